"""One interface, two transports: Ray actors (each its own process) or threads in this process.

The driver speaks only this interface. The in-process runner lets tests drive the whole pipeline,
shared memory and semaphores included, without process start-up costs; the Ray runner is what
`megatrain-launch` and `ray job submit` use.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from megatrain.configbase import opt
from megatrain.errors import AbortError, ActorFailure, ConfigError, MegatrainError, ResourceError
from megatrain.ipc.procs import descendants, spawn_detached, start_ticks
from megatrain.ipc.shm import RAY_THRESHOLD_ENV
from megatrain.launch.control.handles import Handle, Pending, Runner, checked, checked_init
from megatrain.launch.control.placement import Demand

A = TypeVar("A")
P = ParamSpec("P")
R = TypeVar("R")
__all__ = ["Handle", "InProcessRunner", "LaunchConfig", "Pending", "RayRunner", "Runner", "make_runner"]
PRIVATE_THRESHOLD = 0.98  # Ray's memory monitor in a private instance (see _memory_monitor_threshold)


@dataclass
class LaunchConfig:
    runner: str = opt("ray", "'ray' (one OS process per actor) or 'inprocess' (threads; for tests and debugging).")
    address: str | None = opt(None, "Ray cluster to join (else RAY_ADDRESS, else start a local instance).")
    num_cpus: int = opt(0, "Logical CPUs of a locally started Ray instance; 0 = enough for the actors.")
    object_store_mb: int = opt(128, "Object store of a locally started Ray (tensors never go through it).")
    placement_timeout_s: float = opt(60.0, "How long to wait for the placement group before failing.")
    nsight: str | dict = opt(
        "",
        "Run the gpu-executor under Nsight Systems through Ray's nsight runtime env "
        "(runner 'ray', nsys on the GPU node): 'default' (-t cuda,cudnn,cublas,nvtx), or "
        "a mapping of nsys options, e.g. {t: 'cuda,nvtx', o: executor}. The report lands "
        "in Ray's session logs (logs/nsight/). '' = off.",
    )

    def __post_init__(self) -> None:
        if self.runner not in ("ray", "inprocess"):
            raise ValueError(f"launch.runner must be 'ray' or 'inprocess', not '{self.runner}'")
        if self.nsight not in ("", "default") and not isinstance(self.nsight, dict):
            raise ValueError(f"launch.nsight must be '', 'default' or a mapping of nsys options, not '{self.nsight}'")
        if self.nsight and self.runner != "ray":
            raise ValueError("launch.nsight needs launch.runner 'ray' (nsys runs the executor's own process)")


class InProcessRunner:
    def __init__(self, cfg: LaunchConfig):
        self.cfg = cfg
        self.pools: dict[str, cf.ThreadPoolExecutor] = {}
        self.pids: dict[str, int] = {}

    def connect(self, cpus_needed: float) -> None:
        pass

    def has_gpu(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def gpus(self) -> int:
        """The GPUs of the node with the most (this process's: every actor is a thread of it)."""
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def place(self, bundle: dict[str, float], need: str = "") -> None:
        pass

    def spawn(self, name: str, cls: type[A], args: tuple, demand: Demand) -> Handle[A]:
        checked_init(cls, args)
        self.pools[name] = cf.ThreadPoolExecutor(max_workers=3, thread_name_prefix=name)
        obj = cls(*args)
        obj.shared_process = True  # type: ignore[attr-defined]  # one process for every role (torch's threads)
        return Handle(name, cls, obj)

    def call(
        self, h: Handle[A], method: Callable[Concatenate[A, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Pending[R]:
        name = checked(h, method, args, kwargs)
        return Pending(h.name, self.pools[h.name].submit(getattr(h.obj, name), *args, **kwargs), name)

    def wait_any(self, pending: list[Pending], timeout: float) -> list[Pending]:
        done, _ = cf.wait([p.ref for p in pending], timeout=timeout, return_when=cf.FIRST_COMPLETED)
        return [p for p in pending if p.ref in done]

    def result(self, p: Pending, timeout: float | None = None) -> Any:
        try:
            return p.ref.result(timeout=timeout)
        except cf.TimeoutError:
            raise MegatrainError(f"actor '{p.actor}' did not answer within {timeout}s") from None
        except AbortError:
            raise
        except Exception as exc:
            raise ActorFailure(
                p.actor, f"{type(exc).__name__}: {exc}", traceback="".join(traceback.format_exception(exc))
            ) from exc

    def kill(self, h: Handle[Any]) -> None:
        self._end(h.name)

    def _end(self, name: str) -> None:
        pool = self.pools.pop(name, None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        for name in list(self.pools):
            self._end(name)


# A local instance starts no idle workers for its first driver: Ray would start one per logical CPU (16 on a
# 16-core node), each importing Ray, at the moment the actors import torch, and no actor takes one (each
# gets a process of its own, with its own environment).
LOCAL_SYSTEM_CONFIG = {"prestart_worker_first_driver": False}


class RayRunner:
    def __init__(self, cfg: LaunchConfig):
        import ray

        self.ray, self.cfg = ray, cfg
        self.started_ray = False
        self.guard = 0  # pid of the watchdog that ends the local instance if this process dies unannounced
        self.pg = None
        self.pids: dict[str, int] = {}

    def connect(self, cpus_needed: float) -> None:
        ray = self.ray
        address = self.cfg.address or os.environ.get("RAY_ADDRESS")
        if ray.is_initialized():  # a caller's own ray.init (a notebook, a test session): its cluster is used
            if self.cfg.address:
                self._check_same_cluster(self.cfg.address)
            return
        with _keep_sigterm_handler():
            if address:
                self._join(address)
            else:
                cpus = self.cfg.num_cpus or max(os.cpu_count() or 1, int(cpus_needed + 0.999))
                # address="local": always a private instance, even where `ray start` left a cluster
                # that ray.init() would otherwise discover and join.
                _local_auth()
                began = time.monotonic()
                with _memory_monitor_threshold():
                    try:
                        ray.init(
                            address="local",
                            num_cpus=cpus,
                            include_dashboard=False,
                            object_store_memory=self.cfg.object_store_mb * 2**20,
                            log_to_driver=True,
                            logging_level=logging.WARNING,  # a refused input (checked meanwhile) is one line
                            _system_config=LOCAL_SYSTEM_CONFIG,
                        )
                    except _auth_error() as exc:  # e.g. RAY_AUTH_TOKEN_PATH naming no file
                        raise ConfigError(f"cannot start a local Ray instance: {_auth_message(exc)}") from None
                    except Exception as exc:  # Ray's own start-up waits ran out, or its processes failed
                        raise start_failure(exc, time.monotonic() - began) from None
                self.started_ray = True
                self.guard = _start_guard()

    def _check_same_cluster(self, address: str) -> None:
        """An explicit address where this process is already connected: the same cluster, or a refusal. Ray joins
        one cluster per process, and a run on another than the one named would be a silent surprise."""
        connected = self.ray.get_runtime_context().gcs_address
        if _host_port(address) is None or _same_endpoint(address, connected):
            return  # 'auto' and ray:// addresses name whatever Ray resolves: the connected one is taken
        raise ConfigError(
            f"--address / launch.address '{address}': cannot join that Ray cluster: this process is already "
            f"connected to the Ray cluster at {connected} (ray.init was called before the run); call ray.shutdown() "
            "first, or leave the address unset to run on the connected cluster"
        )

    def _join(self, address: str) -> None:
        key = "--address / launch.address" if self.cfg.address else "RAY_ADDRESS"
        unreachable = _unreachable(address)
        if unreachable:  # ray.init would retry for minutes
            raise ConfigError(
                f"{key} '{address}': cannot join that Ray cluster ({unreachable}); without an "
                "address a private local instance is started"
            )
        disabled = os.environ.get(AUTH_MODE_ENV, "").lower() == "disabled"  # nothing of Ray's auth is touched
        refused = "" if disabled else _join_auth() or (_auth_refused(address) if _host_port(address) else "")
        if refused:  # ray.init would retry for 20 s and end in a ConnectionError that does not say why
            raise ConfigError(f"{key} '{address}': cannot join that Ray cluster: {refused}")
        try:
            self.ray.init(address=address, log_to_driver=True)
        except (ConnectionError, ValueError, RuntimeError, TimeoutError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"{key} '{address}': cannot join that Ray cluster ({first}); without an address "
                "a private local instance is started"
            ) from None
        except _auth_error():  # RAY_AUTH_MODE=token and no token anywhere
            raise ConfigError(f"{key} '{address}': cannot join that Ray cluster: {_auth_advice()}") from None

    def has_gpu(self) -> bool:
        return any(n.get("Resources", {}).get("GPU", 0) > 0 for n in self.ray.nodes() if n.get("Alive"))

    def gpus(self) -> int:
        """The GPUs of the node with the most (the executors share one host store: one node)."""
        return int(max((n.get("Resources", {}).get("GPU", 0) for n in self.ray.nodes() if n.get("Alive")), default=0))

    def place(self, bundle: dict[str, float], need: str = "") -> None:
        """`need`: the demand per role, for the message when the cluster cannot hold it."""
        from ray.util.placement_group import placement_group

        self.pg = placement_group([bundle], strategy="STRICT_PACK")
        ready, _ = self.ray.wait([self.pg.ready()], timeout=self.cfg.placement_timeout_s)
        if not ready:
            have = {k: v for k, v in self.ray.available_resources().items() if k in ("CPU", "GPU")}
            raise ResourceError(
                f"cannot place the store's actors on one node: they need {need or bundle}; the "
                f"cluster has {have} available (waited {self.cfg.placement_timeout_s:.0f}s)"
            )

    def spawn(self, name: str, cls: type[A], args: tuple, demand: Demand) -> Handle[A]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        checked_init(cls, args)

        env: dict[str, Any] = {"env_vars": {"PYTHONUNBUFFERED": "1"}}
        if name == "gpu-executor" and self.cfg.nsight:
            if self.started_ray and shutil.which("nsys") is None:
                raise ConfigError("launch.nsight: nsys (Nsight Systems) is not on PATH on this node")
            env["nsight"] = self.cfg.nsight
        remote = self.ray.remote(cls).options(
            name=None,
            num_cpus=demand.cpus,
            num_gpus=demand.gpus,
            max_concurrency=3,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0),
            runtime_env=env,
        )
        return Handle(name, cls, remote.remote(*args))

    def call(
        self, h: Handle[A], method: Callable[Concatenate[A, P], R], *args: P.args, **kwargs: P.kwargs
    ) -> Pending[R]:
        name = checked(h, method, args, kwargs)
        return Pending(h.name, getattr(h.obj, name).remote(*args, **kwargs), name)

    def wait_any(self, pending: list[Pending], timeout: float) -> list[Pending]:
        ready, _ = self.ray.wait([p.ref for p in pending], num_returns=1, timeout=timeout)
        return [p for p in pending if p.ref in ready]

    def result(self, p: Pending, timeout: float | None = None) -> Any:
        from ray import exceptions as rex

        try:
            return self.ray.get(p.ref, timeout=timeout)
        except rex.GetTimeoutError:
            raise MegatrainError(f"actor '{p.actor}' did not answer within {timeout}s") from None
        except rex.RayTaskError as exc:
            cause = exc.cause if exc.cause is not None else exc
            if isinstance(cause, AbortError):
                raise AbortError(str(cause)) from None
            raise ActorFailure(
                p.actor,
                f"{type(cause).__name__}: {cause}",
                self.pids.get(p.actor),
                traceback=getattr(exc, "traceback_str", "") or str(exc),
            ) from None
        except rex.OutOfMemoryError:
            raise ActorFailure(
                p.actor, "the process died: killed by Ray's out-of-memory monitor", self.pids.get(p.actor), died=True
            ) from None
        except rex.RayActorError:
            raise ActorFailure(
                p.actor, "the process died (killed or crashed)", self.pids.get(p.actor), died=True
            ) from None

    def kill(self, h: Handle[Any]) -> None:
        try:
            self.ray.kill(h.obj, no_restart=True)
        except Exception:  # already gone
            pass

    def close(self) -> None:
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.pg)
            except Exception:
                pass
            self.pg = None
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False
        if self.guard:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.guard, signal.SIGTERM)  # it ends what of the instance still lingers, then exits
            self.guard = 0


GCS_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"  # Ray's wait for its GCS to start (30 s unless set)


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
    checks the store against it (ipc/shm.py check_space)."""
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


def _join_auth() -> str:
    """Joining a cluster: Ray sends its token only in token mode, which an explicit address never turns on,
    while `ray start` runs the cluster in token mode wherever it finds a token. With RAY_AUTH_MODE unset and a
    token on this machine, send it (a cluster without authentication ignores it). Returns why this process
    cannot authenticate, or '': token mode without a token would abort the process in Ray's client."""
    try:
        from ray._raylet import AuthenticationTokenLoader
    except ImportError:
        return ""
    try:
        has_token = AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True)
    except _auth_error() as exc:  # RAY_AUTH_TOKEN_PATH naming no file, or an empty one
        return _auth_message(exc)
    mode = os.environ.get(AUTH_MODE_ENV)
    if mode is None and has_token:
        _token_mode()
    if (mode or "").lower() == "token" and not has_token:
        return (
            f"authentication failed: {AUTH_MODE_ENV} is token but this machine has no Ray token; put the "
            f"cluster's token in {TOKEN_PLACES} (`ray get-auth-token` on its head prints it)"
        )
    return ""


def _auth_message(exc: Exception) -> str:
    """Ray's AuthenticationError without the paragraph of general advice Ray appends to it."""
    return f"authentication failed: {getattr(exc, 'message', str(exc)).strip().rstrip('.')}"


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
import sys
from ray._raylet import GcsClient
from ray.exceptions import AuthenticationError
try:
    GcsClient(address=sys.argv[1])
except AuthenticationError:
    print("refused")
"""


def _auth_refused(address: str, timeout: float = 30.0) -> str:
    """Why the cluster's GCS at host:port refuses this process's credentials, or '': one request, answered at
    once, where ray.init would retry for 20 s and end in a ConnectionError that does not say why. The request
    runs in a child process with this one's environment: a GCS client made in the driver before ray.init
    left the actors it then created without their owner's references (they died as unreferenced)."""
    try:
        probe = subprocess.run(
            [sys.executable, "-c", _PROBE, address],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=os.environ.copy(),
        )
    except (OSError, subprocess.TimeoutExpired):  # anything else is ray.init's to report
        return ""
    return _auth_advice() if probe.stdout.strip() == "refused" else ""


def make_runner(cfg: LaunchConfig) -> Runner:
    return RayRunner(cfg) if cfg.runner == "ray" else InProcessRunner(cfg)
