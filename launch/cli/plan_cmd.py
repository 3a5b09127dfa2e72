"""`megatrain-launch plan CONFIG [overrides]`: its arguments. The plan itself (launch/cli/plan_view.py) is imported
once they are read, so `plan --help` and a mistyped flag answer at once."""

from __future__ import annotations

import argparse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="megatrain-launch plan",
        description="Host and GPU memory of a run, against this machine, before anything "
        "is allocated. Exit 0 when it fits, 1 when it does not.",
    )
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.add_argument(
        "--gpu-gib",
        type=float,
        help="plan for a GPU with this much free memory (default: this machine's GPU; without one, the CPU device)",
    )
    p.add_argument(
        "--host-gib",
        type=float,
        help="plan for a host with this much RAM, all of it free (default: this machine's available RAM and /dev/shm)",
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=None,
        help="plan one host of a run over this many hosts alike (--host-gib, else this machine): each holds its "
        "slice of the fp32 weights and Adam's moments and the whole bf16 copy; without a fit, the plan names the "
        "fewest hosts that fit (default: actors.num_hosts, or 1 for auto)",
    )
    p.add_argument(
        "--gpu",
        help="the GPU the time estimate assumes: H100, 'A100 80GB', RTX 4090, ... (default: this machine's); "
        "without --gpu-gib, its memory too",
    )
    p.add_argument("--gpu-tflops", type=float, help="the time estimate's GPU by its nominal dense bf16 TFLOPS instead")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_intermixed_args(argv)  # overrides may come after the flags too
    from megatrain.launch.cli.plan_view import report

    return report(args)
