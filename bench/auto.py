"""The plan's answers for the bench's `auto` flags: --batch auto (the most sequences per GPU) and --layers auto (the
most layers of the --model preset's shape) whose MegaTrain plan (launch/config/memplan.py) fits this machine's
host and its GPU's free memory, capped at --gpu-gib."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

from bench.workload import Failed, bench_model, overrides
from megatrain.launch.config.tree import load_config


def plan_fits(args: argparse.Namespace, extra: list[str]) -> bool:
    """Whether the MegaTrain row of `args` (its model args.hf, the default variant's `extra`) fits this machine by
    its plan. Loaded without the budget, which the config's check would refuse a batch for: the plan says so."""
    from megatrain.launch.config.memplan import make_plan

    budget, args.gpu_gib = args.gpu_gib, None
    try:
        cfg = load_config(None, overrides(args, Path(args.out), extra))
    finally:
        args.gpu_gib = budget
    cfg.engine = dataclasses.replace(cfg.engine, gpu_memory_gib=budget)
    return make_plan(cfg, gpu_free(), True).fits()


def most(fits: Callable[[int], bool], what: str, most: int) -> int:
    """The largest n in [1, most] with fits(n), fits being monotone (n fits: every smaller one does)."""
    if not fits(1):
        raise Failed(f"{what}: not even 1 fits (megatrain-launch plan shows why)", 1)
    lo, hi = 1, 2
    while hi <= most and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, most + 1)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _need_gpu(args: argparse.Namespace, flag: str) -> None:
    if args.gpu_gib is None and gpu_free() is None:
        raise Failed(f"{flag} auto: no GPU here to plan for; give --gpu-gib N", 2)


def _budget(args: argparse.Namespace) -> str:
    return f"--gpu-gib {args.gpu_gib:g}" if args.gpu_gib is not None else "the GPU's free memory"


def most_batch(args: argparse.Namespace, limit: int = 4096) -> int:
    """--batch auto: the most sequences per GPU (up to `limit`) whose plan fits; the plan's answer, printed.
    args.hf is the model (bench_model())."""
    _need_gpu(args, "--batch")

    def fits(b: int) -> bool:
        args.batch = b
        return plan_fits(args, args.extra)

    n = most(fits, f"--batch auto ({args.seq} tokens a sequence)", limit)
    print(
        f"[bench] --batch auto: {n} sequences of {args.seq} tokens per GPU, the most the plan fits in {_budget(args)}"
    )
    return n


def most_layers(args: argparse.Namespace, limit: int = 1024) -> int:
    """--layers auto: the most layers of the --model preset's shape (up to `limit`) whose plan fits this machine at
    --batch: the deepest model it holds. args.extra as given (its model.hf items change the shape)."""
    _need_gpu(args, "--layers")

    def fits(layers: int) -> bool:
        args.hf, extra = bench_model(args.model, layers, args.extra)
        return plan_fits(args, extra)

    n = most(fits, f"--layers auto (--model {args.model}, {args.batch}x{args.seq} tokens)", limit)
    print(
        f"[bench] --layers auto: {n} layers of --model {args.model}, the most the plan fits on this host and in "
        f"{_budget(args)}"
    )
    return n


def gpu_free() -> int | None:
    """The GPU's free memory now (the plan's figure without --gpu-gib); None without a GPU."""
    import torch

    return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else None
