"""--hosts H: a run over several hosts measured on one machine. A Ray cluster of H nodes is simulated here
(raylets of their own, ray.cluster_utils.Cluster), each node started with its own --gpus GPUs
(CUDA_VISIBLE_DEVICES as it starts, which is how Ray gives a node its GPUs); the run joins it with
actors.num_hosts H, every host its own store in this machine's shared memory, the hosts talking over NCCL and
gloo on the loopback. What a row measures is the run's own work over hosts (the reduce-scatter, the gather of
the updated slices, each host's store); the network between real nodes is not in it (docs/hosts.md computes the
bandwidth that hides it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from megatrain.memory.machine import PRIVATE_THRESHOLD, RAY_THRESHOLD_ENV

OBJECT_STORE_BYTES = 128 * 2**20  # as launch.object_store_mb's default: tensors never go through it
# The simulated nodes run without Ray's token authentication, and the launcher that joins them in this process
# must not send a token they never asked for.
NODE_ENV = {"RAY_AUTH_MODE": "disabled", RAY_THRESHOLD_ENV: str(PRIVATE_THRESHOLD)}


def host_overrides(hosts: int, gpus: int, address: str) -> list[str]:
    """The config of a MegaTrain row over `hosts` simulated hosts of `gpus` GPUs each."""
    return [f"actors.num_hosts={hosts}", f"actors.num_gpus={gpus}", "launch.runner=ray", f"launch.address={address}"]


@contextlib.contextmanager
def simulated_hosts(hosts: int, gpus: int) -> Iterator[str]:
    """A cluster of `hosts` nodes on this machine, node h with GPUs h*gpus .. (h+1)*gpus-1 and its share of the
    cores; yields its address. Its nodes are ended by pid on every path, this process's connection first."""
    import ray
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", *NODE_ENV)}
    os.environ.update(NODE_ENV)
    cluster = None
    try:
        for h in range(hosts):
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(h * gpus + g) for g in range(gpus))
            node = {
                "num_cpus": max((os.cpu_count() or 2) // hosts, 2),
                "num_gpus": gpus,
                "object_store_memory": OBJECT_STORE_BYTES,
            }
            if cluster is None:
                cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
            else:
                cluster.add_node(**node)
        _restore({"CUDA_VISIBLE_DEVICES": saved["CUDA_VISIBLE_DEVICES"]})  # this process sees every GPU again
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        _restore(saved)


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
