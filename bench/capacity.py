"""The largest Qwen2.5-shaped dense model per host size, from the memory plan (launch/config/memplan.py).

  python bench/capacity.py [--hosts 64,128,256,512,1536] [--batch 16] [--seq 4096] [--width 7B]

For each host (all of its RAM free, /dev/shm as large, Ray's memory monitor at a private instance's
threshold) and each Qwen2.5 width (7B, 14B, 32B, 72B: hidden, FFN and heads of the released models),
the most layers whose plan fits with the default config (clipping on), on a GPU with the H200's free
memory; the largest of those is the row. For it: parameters, host bytes per parameter, the plan's GPU
peak on the H200, and the least GPU memory with which the whole plan fits at that batch. Then the
released models' host need. With --width, the depth study instead: for each host the deepest model of that
width alone. Prints Markdown tables. The host need is the run's least: no spare slots (ipc.spare_slots, auto,
fill whatever RAM a host has left, so they would make every host look full).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.presets import QWEN7B, QWEN14B, QWEN72B  # noqa: E402
from megatrain.launch.config.memplan import make_plan, this_host  # noqa: E402
from megatrain.launch.config.tree import load_config  # noqa: E402

GIB = 2**30
H200_FREE = 139.3  # GiB free after the CUDA context (measured)
# The released Qwen2.5 models' shapes (the bench's presets; 32B: the 14B's width with a wider FFN); layers are
# what the search varies.
WIDTHS = {"7B": QWEN7B, "14B": QWEN14B, "32B": {**QWEN14B, "intermediate_size": 27648}, "72B": QWEN72B}
RELEASED_LAYERS = {"7B": 28, "14B": 48, "32B": 64, "72B": 80}


def config(width: str, layers: int, batch: int, seq: int):
    hf = {**WIDTHS[width], "num_hidden_layers": layers}
    return load_config(
        None,
        [
            "model.family=qwen2",
            f"model.hf={json.dumps(hf)}",
            f"data.batch_size={batch}",
            f"data.seq_len={seq}",
            "ipc.spare_slots=0",
        ],
    )


def plan(width: str, layers: int, host_gib: float, gpu_gib: float, batch: int, seq: int):
    cfg = config(width, layers, batch, seq)
    return make_plan(cfg, int(gpu_gib * GIB), True, this_host(cfg, host_gib))


def most_layers(width: str, host_gib: float, batch: int, seq: int) -> int:
    """The most layers of this width whose host part fits (the host part grows with the layers; 12 bytes
    per parameter of fp32 planes bound the search)."""
    per_layer = (
        plan(width, 2, host_gib, H200_FREE, batch, seq).num_params
        - plan(width, 1, host_gib, H200_FREE, batch, seq).num_params
    )
    lo, hi = 0, int(host_gib * GIB / (12 * per_layer)) + 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan(width, mid, host_gib, H200_FREE, batch, seq).host_fits():
            lo = mid
        else:
            hi = mid - 1
    return lo


def least_gpu(width: str, layers: int, host_gib: float, batch: int, seq: int) -> float:
    """The least free GPU memory (GiB, to 1) with which the plan's GPU part fits."""
    lo, hi = 1, 1024
    while lo < hi:
        mid = (lo + hi) // 2
        if plan(width, layers, host_gib, mid, batch, seq).fits():
            hi = mid
        else:
            lo = mid + 1
    return float(lo)


def row(host_gib: float, batch: int, seq: int) -> str:
    found = [(w, most_layers(w, host_gib, batch, seq)) for w in WIDTHS]
    found = [(w, n) for w, n in found if n > 0]
    if not found:
        return f"| {host_gib:g} GiB | none | | | | |"
    best = max(found, key=lambda wn: plan(wn[0], wn[1], host_gib, H200_FREE, batch, seq).num_params)
    p = plan(*best, host_gib, H200_FREE, batch, seq)
    width, layers = best
    released = " (the released model)" if layers == RELEASED_LAYERS[width] else ""
    host = sum(p.host.values())
    return (
        f"| {host_gib:g} GiB | Qwen2.5-{width} width, {layers} layers{released} | {p.num_params / 1e9:.1f}B "
        f"| {host / p.num_params:.1f} | {sum(p.gpu.values()) / GIB:.0f} | "
        f"{least_gpu(width, layers, host_gib, batch, seq):.0f} |"
    )


def released(batch: int, seq: int) -> None:
    """The released models: the host RAM each needs (the plan's total; a host needs that much available
    and, under Ray, within its memory monitor's threshold) and the least GPU memory at this batch."""
    print(
        f"\n| released model | parameters | host RAM needed (clipping on) | bytes/param | least GPU GiB at "
        f"{batch}x{seq} |"
    )
    print("|---|---|---|---|---|")
    for width, layers in RELEASED_LAYERS.items():
        p = plan(width, layers, 4096, H200_FREE, batch, seq)
        host = sum(p.host.values())
        print(
            f"| Qwen2.5-{width} | {p.num_params / 1e9:.1f}B | {host / GIB:.0f} GiB | {host / p.num_params:.1f} "
            f"| {least_gpu(width, layers, 4096, batch, seq):.0f} |",
            flush=True,
        )


def depth(width: str, hosts: list[float], batch: int, seq: int) -> None:
    """The depth study: per host, the deepest model of one width (its parameters and host need)."""
    print(
        f"| host RAM | the deepest Qwen2.5-{width} width (clipping on, {batch}x{seq}) | parameters | host RAM needed |"
    )
    print("|---|---|---|---|")
    for host_gib in hosts:
        layers = most_layers(width, host_gib, batch, seq)
        if not layers:
            print(f"| {host_gib:g} GiB | none | | |", flush=True)
            continue
        p = plan(width, layers, host_gib, H200_FREE, batch, seq)
        need = sum(p.host.values())
        print(f"| {host_gib:g} GiB | {layers} layers | {p.num_params / 1e9:.1f}B | {need / GIB:.0f} GiB |", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", default="64,128,256,512,1536", help="host RAM sizes in GiB")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--width", choices=sorted(WIDTHS), help="the depth study of this width alone")
    args = ap.parse_args(argv)
    if args.width:
        depth(args.width, [float(h) for h in args.hosts.split(",")], args.batch, args.seq)
        return
    print(
        f"| host RAM | largest model (clipping on, {args.batch}x{args.seq}) | parameters | host bytes/param "
        f"| GPU peak GiB on an H200 | least GPU GiB |"
    )
    print("|---|---|---|---|---|---|")
    for h in args.hosts.split(","):
        print(row(float(h), args.batch, args.seq), flush=True)
    released(args.batch, args.seq)


if __name__ == "__main__":
    main()
