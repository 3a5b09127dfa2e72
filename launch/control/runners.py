"""One interface, two transports: Ray actors (each its own process) or threads in this process.

The driver speaks only this interface. The in-process runner lets tests drive the whole pipeline,
shared memory and semaphores included, without process start-up costs; the Ray runner is what
`megatrain-launch` and `ray job submit` use.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

from megatrain import log
from megatrain.config.base import opt
from megatrain.daemons import DaemonExecutor
from megatrain.errors import AbortError, ActorFailure, ConfigError, MegatrainError, ResourceError, raised_at
from megatrain.launch.control import cluster
from megatrain.launch.control.handles import Handle, Pending, Runner, checked, checked_init
from megatrain.launch.control.placement import Demand, placement_wait, resources_text
from megatrain.roster import EXECUTOR, split_host

# A placement not ready within this many seconds waits for the cluster: the run says for what, in one line
# (Ray's autoscaler events, which would say it in its own words, are kept off the terminal: cluster.py).
PLACEMENT_NOTE_S = 5.0  # a placement the cluster has room for is ready long before
NETWORK_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # the launcher's, passed to every actor

A = TypeVar("A")
P = ParamSpec("P")
R = TypeVar("R")
__all__ = ["Handle", "InProcessRunner", "LaunchConfig", "Pending", "RayRunner", "Runner", "make_runner"]


@dataclass
class LaunchConfig:
    runner: str = opt("ray", "'ray' (one OS process per actor) or 'inprocess' (threads; for tests and debugging).")
    address: str | None = opt(None, "Ray cluster to join (else RAY_ADDRESS, else start a local instance).")
    num_cpus: int = opt(0, "Logical CPUs of a locally started Ray instance; 0 = enough for the actors.")
    object_store_mb: int = opt(
        128, "Object store of a locally started Ray (only the final save's chunks of weights pass through it)."
    )
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


# How long the end of an in-process run waits for its actors' threads once their calls were cancelled: a call
# still running then is stuck (Ray would have killed its process) and is named with where it is.
THREADS_SETTLE_S = 5.0


def stuck_threads(pools: list[DaemonExecutor], settle_s: float) -> list[str]:
    """The actor threads still inside a call `settle_s` after shutdown, each with the line it is at."""
    deadline = time.monotonic() + settle_s
    threads = [t for p in pools for t in p.threads if t.ident is not None]  # started (with a first call)
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    frames = sys._current_frames()
    out = []
    for t in threads:
        if t.is_alive() and t.ident in frames:
            where = traceback.extract_stack(frames[t.ident])[-1]
            out.append(f"{t.name} (at {os.path.basename(where.filename)}:{where.lineno} in {where.name})")
    return out


class InProcessRunner:
    prints_untaken = False

    def __init__(self, cfg: LaunchConfig):
        self.cfg = cfg
        self.pools: dict[str, DaemonExecutor] = {}
        self.ended: list[DaemonExecutor] = []
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

    def place(self, bundle: dict[str, float], need: str = "", hosts: int = 1) -> None:
        pass

    def nodes(self) -> int:
        """Hosts this runner can give a run: every simulated host is a set of threads of this process."""
        return 1

    def host_address(self, host: int) -> str:
        """Where host `host`'s actors listen for the other hosts' (a rendezvous): this process."""
        return "127.0.0.1"

    def spawn(self, name: str, cls: type[A], args: tuple, demand: Demand) -> Handle[A]:
        checked_init(cls, args)
        self.pools[name] = DaemonExecutor(name, workers=3)
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
                p.actor,
                f"{type(exc).__name__}: {exc}",
                traceback="".join(traceback.format_exception(exc)),
                at=raised_at(exc),
            ) from exc

    def kill(self, h: Handle[Any]) -> None:
        self._end(h.name)

    def _end(self, name: str) -> None:
        pool = self.pools.pop(name, None)
        if pool is not None:
            pool.shutdown()
            self.ended.append(pool)

    def close(self) -> None:
        for name in list(self.pools):
            self._end(name)
        stuck = stuck_threads(self.ended, THREADS_SETTLE_S)
        self.ended = []
        if stuck:  # never a hang: they are daemon threads; named, as a stuck actor is a bug to see
            log(f"in-process actor calls still running {THREADS_SETTLE_S:.0f} s after the end: {', '.join(stuck)}")


class RayRunner:
    prints_untaken = True  # Ray's "Unhandled error" with the actor's traceback, when the answer is dropped

    def __init__(self, cfg: LaunchConfig):
        import ray

        self.ray, self.cfg = ray, cfg
        self.connection: cluster.Connection | None = None  # launch/control/cluster.py
        self.started_ray = False  # a private local instance: this node is the GPU's (nsys is looked for here)
        self.pg = None
        self.pids: dict[str, int] = {}

    def connect(self, cpus_needed: float) -> None:
        cfg = self.cfg
        self.connection = cluster.connect(
            self.ray,
            address=cfg.address,
            num_cpus=cfg.num_cpus,
            object_store_mb=cfg.object_store_mb,
            cpus_needed=cpus_needed,
        )
        self.started_ray = self.connection.started

    def has_gpu(self) -> bool:
        return any(n.get("Resources", {}).get("GPU", 0) > 0 for n in self.ray.nodes() if n.get("Alive"))

    def gpus(self) -> int:
        """The GPUs of the node with the most (the executors share one host store: one node)."""
        return int(max((n.get("Resources", {}).get("GPU", 0) for n in self.ray.nodes() if n.get("Alive")), default=0))

    def place(self, bundle: dict[str, float], need: str = "", hosts: int = 1) -> None:
        """One bundle per host, each host's actors on one node and every host on a node of its own. `need`: the
        demand per role, for the message when the cluster cannot hold it."""
        from ray.util.placement_group import placement_group

        alive = self.nodes()
        if hosts > alive:  # the value asks for what the cluster lacks: a usage error, named where it was set
            raise ConfigError(
                f"actors.num_hosts: {hosts} hosts, but the Ray cluster has {alive} node{'s' * (alive != 1)} alive; "
                "each host of the run is a node of its own (`ray start --address ...` on each, or fewer hosts)"
            )
        self.pg = placement_group([bundle] * hosts, strategy="STRICT_PACK" if hosts == 1 else "STRICT_SPREAD")
        timeout = self.cfg.placement_timeout_s
        ready, _ = self.ray.wait([self.pg.ready()], timeout=min(PLACEMENT_NOTE_S, timeout))
        if not ready and timeout > PLACEMENT_NOTE_S:  # the cluster cannot hold it now: say what the run waits for
            log(placement_wait(bundle, hosts, timeout, self._node_sizes(), self._free()))
            ready, _ = self.ray.wait([self.pg.ready()], timeout=timeout - PLACEMENT_NOTE_S)
        if not ready:
            where = "one node" if hosts == 1 else f"each of {hosts} nodes"
            raise ResourceError(
                f"cannot place the store's actors on {where}: they need {need or bundle}; the "
                f"cluster has {resources_text(self._free())} free (waited {timeout:.0f}s)"
            )

    def _node_sizes(self) -> list[dict[str, float]]:
        """Each node alive, its CPUs and GPUs in all."""
        return [n.get("Resources", {}) for n in self.ray.nodes() if n.get("Alive")]

    def _free(self) -> dict[str, float]:
        """The CPUs and GPUs free in the whole cluster now."""
        return self.ray.available_resources()

    def nodes(self) -> int:
        """The cluster's nodes alive now."""
        return sum(1 for n in self.ray.nodes() if n.get("Alive"))

    def host_address(self, host: int) -> str:
        """The address of the node that holds host `host`'s bundle (where its actors open a rendezvous)."""
        from ray.util.placement_group import placement_group_table

        node = placement_group_table(self.pg)["bundles_to_node_id"][host]
        return next(n["NodeManagerAddress"] for n in self.ray.nodes() if n["NodeID"] == node)

    def spawn(self, name: str, cls: type[A], args: tuple, demand: Demand) -> Handle[A]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        checked_init(cls, args)

        # The interfaces the user names for gloo and NCCL go with the actors: a worker has its raylet's environment
        forwarded = {k: os.environ[k] for k in NETWORK_ENV if os.environ.get(k)}
        env: dict[str, Any] = {"env_vars": {"PYTHONUNBUFFERED": "1", **forwarded}}
        if name == EXECUTOR and self.cfg.nsight:
            if self.started_ray and shutil.which("nsys") is None:
                raise ConfigError("launch.nsight: nsys (Nsight Systems) is not on PATH on this node")
            env["nsight"] = self.cfg.nsight
        remote = self.ray.remote(cls).options(
            name=None,
            num_cpus=demand.cpus,
            num_gpus=demand.gpus,
            max_concurrency=3,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=split_host(name)[1]
            ),
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
            if isinstance(cause, AbortError):  # its origin and time with it: the driver orders failures by them
                raise AbortError(str(cause), cause.origin, cause.at) from None
            raise ActorFailure(
                p.actor,
                f"{type(cause).__name__}: {cause}",
                self.pids.get(p.actor),
                traceback=getattr(exc, "traceback_str", "") or str(exc),
                at=raised_at(cause),
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
        if self.connection is not None:
            cluster.disconnect(self.ray, self.connection)
            self.connection, self.started_ray = None, False


def make_runner(cfg: LaunchConfig) -> Runner:
    return RayRunner(cfg) if cfg.runner == "ray" else InProcessRunner(cfg)
