"""The heart of it: 10 optimizer steps through the full actor system equal a plain HF model trained
with torch.optim.AdamW, for every family, tied and untied embeddings, checkpoint intervals 1, 2 and N,
and every staging and worker variant. The matrix runs through the in-process runner (every actor a
thread, the real shared memory, semaphores and protocol); a few cases run end to end through Ray, one
process per actor (marked slow)."""

from __future__ import annotations

import itertools

import numba
import pytest

from megatrain.ipc.cpus import node_cores
from megatrain.ipc.procs import running
from megatrain.launch.cli.fidelity import compare
from megatrain.launch.report.reporting import RunSummary
from tests.harness import LAYERS, check, tiny_config

CASES = list(itertools.product(["llama", "qwen2", "mistral"], [True, False], [1, 2, LAYERS]))


VARIANTS = {
    "resident": ["ipc.staging=resident"],
    "2packers-2accumulators-3slabs": [
        "actors.num_packers=2",
        "actors.num_accumulators=2",
        "ipc.weight_slabs=3",
        "ipc.grad_slabs=3",
    ],
    "no-adam-overlap": ["train.overlap_adam=false"],
    "no-clip": ["optim.max_grad_norm=0"],
    "no-clip-resident": ["optim.max_grad_norm=0", "ipc.staging=resident"],
    "chunks": ["engine.chunk_sequences=3"],  # batch 4: chunks of 3 and 1 sequences
    "chunks-no-clip": ["engine.chunk_sequences=1", "optim.max_grad_norm=0"],
    "lean-no-clip": ["engine.last_block_layers=3", "engine.lean_layers=2", "optim.max_grad_norm=0"],
    # Slabs of 3000 elements: every unit streams in 2-3 pieces, and pieces cut across the decay split.
    "pieces": [
        "ipc.slab_params=3000",
        "actors.num_packers=2",
        "actors.num_accumulators=2",
        "ipc.weight_slabs=3",
        "ipc.grad_slabs=3",
    ],
    "pieces-no-clip-resident": ["ipc.slab_params=3000", "optim.max_grad_norm=0", "ipc.staging=resident"],
    # The optimizer of the first units held by the executor (engine.gpu_optimizer): the embedding and a layer;
    # every unit, without clipping, in pieces; with the gradient summed over chunks.
    "resident-gpu-optimizer": ["ipc.staging=resident", "engine.gpu_optimizer=2"],
    "resident-gpu-optimizer-all-no-clip-pieces": [
        "ipc.staging=resident",
        f"engine.gpu_optimizer={LAYERS + 2}",
        "optim.max_grad_norm=0",
        "ipc.slab_params=3000",
    ],
    "resident-gpu-optimizer-chunks": ["ipc.staging=resident", "engine.gpu_optimizer=3", "engine.chunk_sequences=3"],
}
VARIANT_CASES = [
    ("llama", True, 2, "resident"),
    ("qwen2", False, 1, "resident"),
    ("mistral", False, 3, "resident"),
    ("qwen3", True, 2, "resident"),
    ("qwen3", False, 1, "no-clip"),
    ("llama", False, 1, "2packers-2accumulators-3slabs"),
    ("qwen2", True, 2, "no-adam-overlap"),
    ("llama", False, 2, "no-clip"),
    ("mistral", True, 1, "no-clip-resident"),
    ("qwen2", True, 2, "chunks"),
    ("llama", False, 3, "chunks-no-clip"),
    ("qwen2", False, 2, "pieces"),
    ("llama", True, 1, "pieces-no-clip-resident"),
    ("qwen2", True, 2, "resident-gpu-optimizer"),
    ("llama", False, 1, "resident-gpu-optimizer-all-no-clip-pieces"),
    ("mistral", True, 3, "resident-gpu-optimizer-chunks"),
    ("qwen2", False, 1, "lean-no-clip"),
]


@pytest.mark.parametrize("family,tied,k,variant", VARIANT_CASES, ids=[c[3] + "-" + c[0] for c in VARIANT_CASES])
def test_staging_and_worker_variants_match_plain_pytorch(
    tmp_path, family: str, tied: bool, k: int, variant: str
) -> None:
    rep = compare(tiny_config(family, tied, k, tmp_path, extra=VARIANTS[variant]), tmp_path)
    check(rep, tied)
    assert rep["summary"].staging == ("resident" if "resident" in variant else "slabs")
    if variant == "resident":  # clipping: the gradients wait in the resident copy, drained by no accumulator
        assert not any(name.startswith("grad-accumulator") for name in rep["summary"].pids)


@pytest.mark.parametrize("family,tied,k", CASES, ids=[f"{f}-{'tied' if t else 'untied'}-k{k}" for f, t, k in CASES])
def test_actor_system_matches_plain_pytorch(tmp_path, family: str, tied: bool, k: int) -> None:
    check(compare(tiny_config(family, tied, k, tmp_path), tmp_path), tied)


def test_planes_across_many_shards_match_plain_pytorch(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every segment over 64 KiB shards (ipc/shared/mapping.py): units, slabs and the resident copy straddle the
    files' boundaries, with clipping and with the fp32 gradient plane."""
    from megatrain.ipc.shared import mapping

    monkeypatch.setattr(mapping, "SHARD_BYTES", 1 << 16)
    monkeypatch.setattr(mapping, "ALIGN", 1 << 12)
    for variant in ("resident", "2packers-2accumulators-3slabs"):
        check(
            compare(tiny_config("llama", False, 2, tmp_path / variant, extra=VARIANTS[variant]), tmp_path / variant),
            False,
        )


RAY_CASES = [("llama", False, 2, "2packers-2accumulators-3slabs"), ("qwen2", True, 1, "pieces-no-clip-resident")]


@pytest.mark.slow
@pytest.mark.parametrize("family,tied,k,variant", RAY_CASES, ids=[c[3] + "-" + c[0] for c in RAY_CASES])
def test_through_ray_one_process_per_actor(
    ray_cluster, tmp_path, monkeypatch, family: str, tied: bool, k: int, variant: str
) -> None:
    """The actor system through Ray matches plain PyTorch, and its run returns once its processes are gone: the
    store's memory is free when run() returns (the last process that maps it has exited), so the caller's next
    run (a bench's next row, a notebook's next Trainer) plans against what is free."""
    from megatrain.launch.run.driver import Trainer

    real_run, alive_at_return = Trainer.run, []

    def run(self) -> RunSummary:  # noqa: ANN001
        summary = real_run(self)
        alive_at_return.extend(name for name, pid in summary.pids.items() if running(pid))
        return summary

    monkeypatch.setattr(Trainer, "run", run)
    rep = compare(tiny_config(family, tied, k, tmp_path, extra=VARIANTS[variant], runner="ray"), tmp_path)
    check(rep, tied)
    assert alive_at_return == []
    # Every process of the run reported, and their PSS holds at least the fp32 params, m and v.
    s = rep["summary"]
    mem = s.memory[0]
    assert len(s.memory) == 1 and mem.processes >= 4 and mem.pss_bytes >= 12 * s.num_params
    own = mem.pss_own_by_role
    assert {"store-owner", "reaper", "gpu-executor", "adam-updater"} <= set(own)
    assert 0 < sum(own.values()) < mem.pss_bytes - 12 * s.num_params
    # Every actor's work ran with the node's CPU plan, as seen from inside its process (Ray leaves torch
    # at one thread: OMP_NUM_THREADS follows an actor's CPU request).
    cores = node_cores()
    assert s.threads_observed == s.cpu_plan and set(s.cpu_plan) == set(s.pids)
    assert s.cpu_plan["adam-updater"] == {"torch": cores, "numba": min(cores, numba.config.NUMBA_NUM_THREADS)}
    assert s.cpu_plan["store-owner"]["torch"] == cores
