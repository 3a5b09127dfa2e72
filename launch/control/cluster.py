"""How the launcher reaches Ray: it joins a cluster (launch.address, else RAY_ADDRESS), or starts a private
local instance. Both are checked before ray.init, which would otherwise retry for minutes and end in an
error that does not say why: an address must answer, and Ray's token authentication must be satisfiable
from this machine. A private instance gets its memory monitor's threshold, its token mode chosen
explicitly, and a watchdog (launch/control/guard.py) that ends it if the launcher dies unannounced.

The transports (launch/control/runners.py) call connect() and disconnect(); nothing here knows of actors.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

from megatrain.errors import ConfigError, MegatrainError
from megatrain.ipc.procs import descendants, spawn_detached, start_ticks
from megatrain.memory.machine import PRIVATE_THRESHOLD, RAY_THRESHOLD_ENV  # a node's memory facts live there

# A local instance starts no idle workers for its first driver: Ray would start one per logical CPU (16 on a
# 16-core node), each importing Ray, at the moment the actors import torch, and no actor takes one (each
# gets a process of its own, with its own environment).
LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}
GCS_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"  # Ray's wait for its GCS to start (30 s unless set)
# Ray's own lines on the run's terminal, off unless the user set their variable (they stay in Ray's log files):
# its deduplication of the actors' lines, which holds a line back and prints it later as "[repeated Nx across
# cluster]" with a notice about itself, and the autoscaler's events ("(autoscaler +4s) Error: No available node
# types ...") while a placement waits, which the run says in a line of its own (runners.py). Ray reads both
# variables when it is imported, before a run connects: the values are set where Ray keeps them (variable,
# module, attribute, value when off).
QUIET = (
    ("RAY_DEDUP_LOGS", "ray._private.ray_logging", "RAY_DEDUP_LOGS", False),
    ("RAY_SCHEDULER_EVENTS", "ray._private.ray_constants", "AUTOSCALER_EVENTS", 0),
)


@dataclass(frozen=True, kw_only=True)
class Connection:
    """What connect() did: `started` a private local instance (this process's to shut down, with its
    watchdog `guard`, a pid), or joined a cluster that outlives the run (started False, guard 0)."""

    started: bool
    guard: int = 0


def connect(
    ray: ModuleType, *, address: str | None, num_cpus: int, object_store_mb: int, cpus_needed: float
) -> Connection:
    """Join the cluster at `address` (launch.address; else RAY_ADDRESS), or start a private local instance of
    `num_cpus` logical CPUs (0: enough for `cpus_needed`, at least the machine's count). A caller's own ray.init
    (a notebook, a test session) is kept: its cluster is used."""
    if ray.is_initialized():
        if address:
            _check_same_cluster(ray, address)
        return Connection(started=False)
    _quiet_console()
    with _keep_sigterm_handler():
        target = address or os.environ.get("RAY_ADDRESS")
        if target:
            _join(ray, target, "--address / launch.address" if address else "RAY_ADDRESS")
            return Connection(started=False)
        _start_local(ray, num_cpus or max(os.cpu_count() or 1, int(cpus_needed + 0.999)), object_store_mb)
        return Connection(started=True, guard=_start_guard())


def disconnect(ray: ModuleType, connection: Connection) -> None:
    """Shut down a private instance and stop its watchdog, which ends what of the instance still lingers, then
    exits; a joined cluster is left as it is."""
    if connection.started:
        ray.shutdown()
    if connection.guard:
        with contextlib.suppress(ProcessLookupError):
            os.kill(connection.guard, signal.SIGTERM)


def _quiet_console() -> None:
    """Ray's deduplication and autoscaler events off in this process (QUIET), each unless its variable is set; and
    where the terminal is a file or a pipe (`| tee run.log`), the actors' lines without Ray's colour codes."""
    if not getattr(sys.stdout, "isatty", lambda: False)():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # read by Ray as it prints each line
    for variable, module, name, off in QUIET:
        if variable in os.environ:
            continue
        try:
            where = importlib.import_module(module)
        except ImportError:  # a Ray that keeps them elsewhere prints its lines: nothing else changes
            continue
        if hasattr(where, name):
            setattr(where, name, off)


def _start_local(ray: ModuleType, cpus: int, object_store_mb: int) -> None:
    # address="local": always a private instance, even where `ray start` left a cluster that ray.init() would
    # otherwise discover and join.
    _local_auth()
    began = time.monotonic()
    with _memory_monitor_threshold():
        try:
            ray.init(
                address="local",
                num_cpus=cpus,
                include_dashboard=False,
                object_store_memory=object_store_mb * 2**20,
                log_to_driver=True,
                logging_level=logging.WARNING,  # a refused input (checked meanwhile) is one line
                _system_config=LOCAL_SYSTEM_CONFIG,
            )
        except _auth_error() as exc:  # e.g. RAY_AUTH_TOKEN_PATH naming no file
            raise ConfigError(f"cannot start a local Ray instance: {_auth_message(exc)}") from None
        except Exception as exc:  # Ray's own start-up waits ran out, or its processes failed
            raise start_failure(exc, time.monotonic() - began) from None


def _check_same_cluster(ray: ModuleType, address: str) -> None:
    """An explicit address where this process is already connected: the same cluster, or a refusal. Ray joins
    one cluster per process, and a run on another than the one named would be a silent surprise."""
    connected = ray.get_runtime_context().gcs_address
    if _host_port(address) is None or _same_endpoint(address, connected):
        return  # 'auto' and ray:// addresses name whatever Ray resolves: the connected one is taken
    raise ConfigError(
        f"--address / launch.address '{address}': cannot join that Ray cluster: this process is already "
        f"connected to the Ray cluster at {connected} (ray.init was called before the run); call ray.shutdown() "
        "first, or leave the address unset to run on the connected cluster"
    )


def _join(ray: ModuleType, address: str, key: str) -> None:
    """`key`: where the address came from, as the messages name it."""
    unreachable = _unreachable(address)
    if unreachable:  # ray.init would retry for minutes
        raise ConfigError(
            f"{key} '{address}': cannot join that Ray cluster ({unreachable}); without an "
            "address a private local instance is started"
        )
    disabled = os.environ.get(AUTH_MODE_ENV, "").lower() == "disabled"  # nothing of Ray's auth is touched
    refused = "" if disabled else _join_auth(address)
    if refused:  # ray.init would retry for 20 s and end in a ConnectionError that does not say why
        raise ConfigError(f"{key} '{address}': cannot join that Ray cluster: {refused}")
    try:
        # Ray's INFO lines on joining ("Connecting to existing Ray cluster ...") stay off the terminal
        ray.init(address=address, log_to_driver=True, logging_level=logging.WARNING)
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"{key} '{address}': cannot join that Ray cluster ({first}); without an address "
            "a private local instance is started"
        ) from None
    except _auth_error():  # RAY_AUTH_MODE=token and no token anywhere
        raise ConfigError(f"{key} '{address}': cannot join that Ray cluster: {_auth_advice()}") from None


def start_failure(exc: Exception, took: float) -> MegatrainError:
    """A local Ray instance that did not start, on one line. Ray gives up after fixed waits (30 s for its raylet
    to register, which no setting lengthens; GCS_WAIT_ENV's for its GCS) that a busy machine can outlast: say so,
    and that running again is the remedy. The failed start's processes end with the launcher (Ray ties them to it)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if not (isinstance(exc, TimeoutError) or "timed out" in str(exc).lower()):
        return MegatrainError(f"Ray did not start a local instance: {first}")
    gcs = "gcs" in first.lower() and "current node timed out" not in first.lower()
    return MegatrainError(
        f"Ray did not start within {took:.0f} s ({first}): this machine may be overloaded (load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores); run the command again once it is less busy"
        + (f", or with {GCS_WAIT_ENV}=SECONDS to give Ray's GCS longer (30 by default)" if gcs else "")
    )


@contextlib.contextmanager
def _memory_monitor_threshold() -> Iterator[None]:
    """A private instance's memory monitor at PRIVATE_THRESHOLD of RAM instead of Ray's 95 %, unless the user
    set RAY_memory_usage_threshold: the run's store is shared memory, which the monitor counts as used, and a
    store sized to the host (admitted against MemAvailable by the store owner) would otherwise get its workers
    killed. The raylet takes the setting from its environment and hands it to the workers, whose store owner
    checks the store against it (ipc/shared/shm.py check_space)."""
    if RAY_THRESHOLD_ENV in os.environ:
        yield
        return
    os.environ[RAY_THRESHOLD_ENV] = str(PRIVATE_THRESHOLD)
    try:
        yield
    finally:
        os.environ.pop(RAY_THRESHOLD_ENV, None)


def _start_guard() -> int:
    """The watchdog of the Ray instance just started: the driver's children now are its head processes."""
    me = os.getpid()
    return spawn_detached("megatrain.launch.control.guard", str(me), str(start_ticks(me)), *map(str, descendants([me])))


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """ray.init replaces the driver's SIGTERM handler with one that just exits; the launcher's own
    (SIGTERM gets the same cleanup as Ctrl-C) must survive it."""
    is_main = threading.current_thread() is threading.main_thread()
    old = signal.getsignal(signal.SIGTERM) if is_main else None
    try:
        yield
    finally:
        if is_main and old is not None:
            signal.signal(signal.SIGTERM, old)


def _host_port(address: str) -> tuple[str, int] | None:
    """A GCS address's host and port; None for 'auto' and ray:// addresses, which Ray resolves itself."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return None
    return host, int(port)


def _same_endpoint(a: str, b: str) -> bool:
    """Whether two host:port addresses name the same endpoint (host names resolved: localhost is 127.0.0.1)."""
    pa, pb = _host_port(a), _host_port(b)
    if pa is None or pb is None or pa[1] != pb[1]:
        return False
    try:
        return socket.gethostbyname(pa[0]) == socket.gethostbyname(pb[0])
    except OSError:
        return pa[0] == pb[0]


def _unreachable(address: str, timeout: float = 5.0) -> str:
    """Why a host:port cluster address cannot be reached, or '' (also for 'auto' and ray:// addresses)."""
    where = _host_port(address)
    if where is None:
        return ""
    host, port = where
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return ""
    except OSError as exc:
        return f"no Ray GCS answers at {address}: {exc.strerror or exc}"


# ---- Ray's token authentication (Ray >= 2.52; `ray start` turns it on where it finds a token) -------------
AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_PLACES = "RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token"


class _NoTokenAuthentication(Exception):
    """Never raised: stands for AuthenticationError where the Ray installed has no token authentication."""


def _auth_error() -> type[Exception]:
    """Ray's AuthenticationError (imported here: this module does not import Ray for the in-process runner)."""
    try:
        from ray.exceptions import AuthenticationError
    except ImportError:
        return _NoTokenAuthentication
    return AuthenticationError


def _token_mode() -> bool:
    """Token mode for this process and the Ray processes it starts, as Ray itself turns it on: the variable,
    and Ray's cached config re-read (it was read at import). False where this Ray has no token authentication."""
    try:
        from ray._raylet import Config
    except ImportError:
        return False
    os.environ[AUTH_MODE_ENV] = "token"
    Config.initialize("")
    return True


def _local_auth() -> None:
    """A private instance keeps Ray's default for a local ray.init (token authentication, Ray making the token in
    ~/.ray/auth_token if there is none) but chosen explicitly, so Ray does not warn about it on every run; the
    user's RAY_AUTH_MODE is left as it is."""
    if AUTH_MODE_ENV not in os.environ:
        _token_mode()


def _join_auth(address: str) -> str:
    """Joining a cluster: Ray sends its token only in token mode, which an explicit address never turns on,
    while `ray start` runs the cluster in token mode wherever it finds a token. With RAY_AUTH_MODE unset and a
    token on this machine, send it, unless the cluster at host:port takes a client without one.
    Returns why this process cannot authenticate, or '': token mode without a token would abort the process
    in Ray's client, and a refused join would retry for 20 s and end in a ConnectionError that does not say
    why. What Ray finds is asked of a child process (_probe_auth)."""
    mode = os.environ.get(AUTH_MODE_ENV)
    found = _probe_auth(address, tokenless=mode is None)
    if found is None:  # the probe itself failed: ray.init reports whatever there is
        return ""
    if found.get("error"):  # RAY_AUTH_TOKEN_PATH naming no file, or an empty one
        return _auth_message(found["error"])
    probed = _host_port(address) is not None  # 'auto' and ray:// addresses: the token is sent where there is one
    if mode is None and found.get("token") and (found.get("refused") or not probed):
        _token_mode()
        found = (_probe_auth(address, tokenless=False) or {}) if probed else found
    elif (mode or "").lower() == "token" and not found.get("token"):
        return (
            f"authentication failed: {AUTH_MODE_ENV} is token but this machine has no Ray token; put the "
            f"cluster's token in {TOKEN_PLACES} (`ray get-auth-token` on its head prints it)"
        )
    return _auth_advice() if found.get("refused") else ""


def _auth_message(exc: Exception | str) -> str:
    """Ray's AuthenticationError (or its message, as a probe reported it) without the paragraph of general
    advice Ray appends to it."""
    text = exc if isinstance(exc, str) else getattr(exc, "message", str(exc))
    return f"authentication failed: {text.strip().rstrip('.')}"


def _auth_advice() -> str:
    if os.environ.get(AUTH_MODE_ENV, "").lower() == "token":
        return (
            f"authentication failed: the cluster refused this machine's Ray token ({TOKEN_PLACES}); put the "
            "cluster's token there (`ray get-auth-token` on its head prints it)"
        )
    return (
        f"authentication failed: the cluster requires Ray's token authentication; export {AUTH_MODE_ENV}=token "
        f"and put the cluster's token in {TOKEN_PLACES} (`ray get-auth-token` on its head prints it)"
    )


_PROBE = """
import json, sys
from ray._raylet import AuthenticationTokenLoader, GcsClient
from ray.exceptions import AuthenticationError
try:
    print(json.dumps({"token": AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)}), flush=True)
except AuthenticationError as exc:
    print(json.dumps({"error": getattr(exc, "message", str(exc))}), flush=True)
    sys.exit()
if sys.argv[1]:
    try:
        GcsClient(address=sys.argv[1])
    except AuthenticationError:
        print(json.dumps({"refused": True}), flush=True)
"""


def _probe_auth(address: str, tokenless: bool, timeout: float = 30.0) -> dict | None:
    """What Ray finds here, asked of a child process with this one's environment: whether this machine has a
    Ray token ("token"), why the one named cannot be read ("error"), and whether the cluster's GCS at
    host:port refuses this process's credentials ("refused"; `tokenless`: a client that sends none). One
    request, answered at once. A child, because in the driver before ray.init a GCS client, or even Ray's
    token loader, left the actors it then created without their owner's references (they died as
    unreferenced before they started). None where the child said nothing of the token."""
    env = {**os.environ, AUTH_MODE_ENV: "disabled"} if tokenless else os.environ.copy()
    where = address if _host_port(address) else ""
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, where], capture_output=True, text=True, timeout=timeout, env=env
        )
        out = probe.stdout
    except subprocess.TimeoutExpired as exc:  # what it said before then still counts
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
    except OSError:
        return None
    found: dict = {}
    for line in out.splitlines():
        try:
            found.update(json.loads(line))
        except ValueError:
            continue
    return found if {"token", "error"} & found.keys() else None
