"""The bench's results table (bench/run.py): one row per system, its columns computed from the row's result."""

from __future__ import annotations

import argparse
import statistics

from megatrain.flops import step_flops


def tflops(n_params: int, tokens: int, layers: int, hidden: int, seq: int, seconds: float) -> float:
    return step_flops(n_params, layers, hidden, seq, tokens) / seconds / 1e12


def copy_rates(tl: dict, last: dict) -> dict:
    """GB/s while copying (bytes over the summed intervals of the timed step)."""
    busy = lambda lane: sum(b - a for _, a, b in tl.get(lane, [])) or float("nan")  # noqa: E731
    return {
        "h2d_GBps_busy": last["h2d_bytes"] / busy("h2d") / 1e9,
        "d2h_GBps_busy": last["d2h_bytes"] / busy("d2h") / 1e9,
    }


def steady(r: dict, warmup: int) -> tuple[float, float, float]:
    """Median, min and max of the steps after the warm-up."""
    rows = r["step_times_s"][warmup:] or r["step_times_s"]
    return statistics.median(rows), min(rows), max(rows)


def table(results: list[dict], args: argparse.Namespace, hf) -> str:
    """One row per system: time to the first step (MegaTrain: from launch, store and workers included;
    a peer: its first step), the warm-up steps, the steady median with min and max, TFLOPS, and the
    ratio of MegaTrain's TFLOPS to the row's."""
    lines = [
        "| system | GPUs | status | first step s | warm-up steps s | steady median s (min–max) | tokens/s | TFLOPS "
        "| MegaTrain × | GPU peak GiB | host B/param (planned / PSS) | fwd / head / bwd s "
        "| weight wait s | Adam s (updating; Gparam/s) | GPU optimizer units (update s); clipped steps "
        "| H2D GB/s (busy) | D2H GB/s (busy) | load max/mean (worst; median layer) |",
        "|" + "---|" * 18,
    ]
    n = next((r["active_params"] for r in results if "active_params" in r), None)
    total = next((r["num_params"] for r in results if "num_params" in r), None)
    ours = None
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | {r.get('gpus', args.gpus)} | {r['status']} |" + " |" * 15)
            continue
        med, lo, hi = steady(r, args.warmup)
        tokens = r.get("batch", args.batch * args.gpus) * args.seq
        r.update(step_time_s=med, step_min_s=lo, step_max_s=hi)
        tf = tflops(n, tokens, args.layers, hf.hidden_size, args.seq, med) if n else float("nan")
        r["tflops"], r["tokens_per_s"] = tf, tokens / med
        ours = ours or tf  # the first row is MegaTrain's default
        first = r.get("time_to_first_step_s") or r["step_times_s"][0]
        warm = ", ".join(f"{t:.2f}" for t in r["step_times_s"][: args.warmup])
        split = f"{r['forward_s']:.2f} / {r['head_s']:.2f} / {r['backward_s']:.2f}" if "forward_s" in r else ""
        lines.append(
            f"| {r['name']} | {r.get('gpus', args.gpus)} | ok | {first:.1f} | {warm} | {med:.3f} ({lo:.3f}–{hi:.3f}) "
            f"| {tokens / med:,.0f} | {tf:.1f} "
            f"| {ours / tf:.2f} | {r['gpu_peak_bytes'] / 2**30:.1f} "
            f"| {r.get('host_bytes_per_param', float('nan')):.2f} / "
            f"{r.get('process_pss_bytes_per_param', float('nan')):.2f} | {split} "
            f"| {r.get('weight_wait_s', 0):.3f} "
            f"| {adam_cell(r, total)} | {gpu_optimizer_cell(r)} | {r.get('h2d_GBps_busy', float('nan')):.1f} "
            f"| {r.get('d2h_GBps_busy', float('nan')):.1f} | {load_cell(r)} |"
        )
    return "\n".join(lines)


def routing(load: list[list[float]]) -> str:
    """The routing of one step in a line: per MoE layer, the busiest and the idlest expert's tokens against an
    even share (1.00 = even; a collapsed router shows a large max and a min of 0)."""
    hi, lo = [], []
    for layer in load:
        even = sum(layer) / len(layer)
        hi.append(max(layer) / even)
        lo.append(min(layer) / even)
    return (
        f"tokens per expert against an even share over {len(load)} MoE layers: busiest expert "
        f"{statistics.median(hi):.2f}× (median; {min(hi):.2f}–{max(hi):.2f}), idlest {statistics.median(lo):.2f}× "
        f"(median; {min(lo):.2f}–{max(lo):.2f})"
    )


def adam_cell(r: dict, n: int | None) -> str:
    """Adam's time in the step, and, where measured, its time updating and its rate over all n parameters."""
    if "adam_update_s" not in r or not n:
        return f"{r.get('adam_s', 0):.3f}"
    upd = r["adam_update_s"]
    if not upd:  # every unit's update on the GPU (engine.gpu_optimizer)
        return f"{r['adam_s']:.3f} (none on the host)"
    return f"{r['adam_s']:.3f} ({upd:.3f}; {n / upd / 1e9:.2f})"


def gpu_optimizer_cell(r: dict) -> str:
    """MegaTrain: the units whose optimizer the GPU held, its update's time (the wait for Adam's norm
    included), and the steps that clipped; a peer: empty."""
    if "gpu_units" not in r:
        return ""
    cell = f"{r['gpu_units']} ({r['gpu_update_s']:.3f}); {r['clipped_steps']} of {len(r['step_times_s'])}"
    speculated = r.get("speculated") or []
    if any(speculated):  # ipc.spare_slots: units speculated / kept, the steady steps' median
        mid = len(speculated) // 2
        cell += f"; speculated {sorted(speculated)[mid]}, kept {sorted(r['committed'])[mid]}"
    return cell


def load_stats(rows: list[dict]) -> dict | None:
    """Expert load of a MegaTrain run from its steady metrics rows (each with expert_load: tokens per expert per
    MoE layer, RouterStats.load()): per layer, over those steps together, the busiest expert's routed rows
    against the mean (1.00 = even; up to experts / top-k when every token takes the same k);
    the worst layer's and the median layer's. None for a dense run."""
    loads = [r["expert_load"] for r in rows if r.get("expert_load")]
    if not loads:
        return None
    ratios = []
    for layer in zip(*loads):
        per_expert = [sum(col) for col in zip(*layer)]
        mean = sum(per_expert) / len(per_expert)
        ratios.append(max(per_expert) / mean if mean else float("nan"))
    return {"load_max_mean_worst": max(ratios), "load_max_mean_median": statistics.median(ratios)}


def load_cell(r: dict) -> str:
    """The load column: empty for a dense model and for a peer, which cannot report its routing."""
    if "load_max_mean_worst" not in r:
        return ""
    return f"{r['load_max_mean_worst']:.2f}; {r['load_max_mean_median']:.2f}"
