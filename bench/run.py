"""MegaTrain throughput benchmark on the Qwen2.5-7B layer shape, with peers in the same run.

  python bench/run.py --layers 8 --batch 16 --seq 4096 --steps 5 --peers plain --out OUT

Writes OUT/results.json, OUT/results.md, OUT/timeline.png, and appends the table to BENCHMARKS.md.
TFLOPS use the paper's formula: (6*N*D + 12*L*H*S*D) / step time, N parameters, D tokens per step,
L layers, H hidden size, S sequence length (recompute is not counted as useful work).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatrain.launch.config import load_config  # noqa: E402
from megatrain.launch.driver import Trainer  # noqa: E402

from bench.peers import PEERS  # noqa: E402
from bench.timeline import plot_timeline  # noqa: E402
from megatrain.model import resolve_hf_config  # noqa: E402

QWEN7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
          "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
          "tie_word_embeddings": False, "use_sliding_window": False}
ABLATIONS = {"no-double-buffering": ["engine.prefetch=0"], "no-adam-overlap": ["train.overlap_adam=false"],
             "slabs": ["ipc.staging=slabs"], "resident": ["ipc.staging=resident"],
             "no-clip": ["optim.max_grad_norm=0"]}


def overrides(args: argparse.Namespace, out: Path, extra: list[str]) -> list[str]:
    hf = {**QWEN7B, "num_hidden_layers": args.layers}
    return ["model.family=qwen2", f"model.hf={json.dumps(hf)}", f"data.seq_len={args.seq}",
            f"data.batch_size={args.batch}", f"train.steps={args.steps}", f"train.timeline_step={args.steps}",
            f"train.output_dir={out}", "train.log_every=1", "engine.device=cuda",
            f"engine.checkpoint_interval={args.k}", f"engine.last_block_layers={args.last}",
            f"engine.chunk_sequences={args.chunk}", f"ipc.slab_params={args.slab_params}",
            f"engine.loss_chunk_tokens={args.loss_chunk}", f"actors.num_packers={args.packers}",
            f"actors.packer_threads={args.packer_threads}", f"actors.num_accumulators={args.accumulators}",
            f"actors.adam_threads={args.adam_threads}", f"actors.accumulator_threads={args.accumulator_threads}",
            "optim.lr=1e-5", "optim.warmup_steps=0", "optim.schedule=constant", f"ipc.weight_slabs={2 * args.packers}",
            f"ipc.grad_slabs={max(2, 2 * args.accumulators)}", *extra]


def tflops(n_params: int, tokens: int, layers: int, hidden: int, seq: int, seconds: float) -> float:
    return (6 * n_params * tokens + 12 * layers * hidden * seq * tokens) / seconds / 1e12


def megatrain_variant(args: argparse.Namespace, name: str, extra: list[str]) -> dict:
    out = Path(args.out) / name
    cfg = load_config(None, overrides(args, out, extra))
    summary = Trainer(cfg).run()
    rows = summary["metrics"][args.warmup:]
    med = statistics.median(r["step_time_s"] for r in rows)
    pick = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    h2d_busy = pick("h2d_bytes")
    res = {"name": f"MegaTrain ({name}, {summary['staging']})", "status": "ok", "step_time_s": med,
           "step_times_s": [r["step_time_s"] for r in summary["metrics"]],
           "num_params": summary["num_params"],
           "host_bytes_per_param": (summary["store_bytes"] + summary["executor_host_bytes"]) / summary["num_params"],
           "process_pss_bytes_per_param": summary["process_pss_bytes"] / summary["num_params"],
           "pss_own_by_role": summary["pss_own_by_role"], "store_bytes": summary["store_bytes"],
           "gpu_peak_bytes": max(r.get("gpu_peak_bytes", 0) for r in rows),
           **{k: pick(k) for k in ("forward_s", "head_s", "backward_s", "weight_wait_s", "grad_wait_s", "adam_s")},
           "h2d_GBps_avg": h2d_busy / med / 1e9, "d2h_GBps_avg": pick("d2h_bytes") / med / 1e9,
           "losses": [r["loss"] for r in summary["metrics"]]}
    timeline = out / "timeline.json"
    if timeline.is_file():
        plot_timeline(json.loads(timeline.read_text()), Path(args.out) / f"timeline-{name}.png",
                      f"MegaTrain, {args.layers} layers, {args.batch}x{args.seq} tokens: one step")
        res.update(copy_rates(json.loads(timeline.read_text()), summary["metrics"][-1]))
    return res


def copy_rates(tl: dict, last: dict) -> dict:
    """GB/s while copying (bytes over the summed intervals of the timed step)."""
    busy = lambda lane: sum(b - a for _, a, b in tl.get(lane, [])) or float("nan")  # noqa: E731
    return {"h2d_GBps_busy": last["h2d_bytes"] / busy("h2d") / 1e9,
            "d2h_GBps_busy": last["d2h_bytes"] / busy("d2h") / 1e9}


def table(results: list[dict], args: argparse.Namespace, hf) -> str:
    tokens = args.batch * args.seq
    lines = ["| system | status | step s | tokens/s | TFLOPS | GPU peak GiB | host B/param (planned / PSS) "
             "| fwd / head / bwd s "
             "| weight wait s | Adam s | H2D GB/s (busy) | D2H GB/s (busy) |", "|" + "---|" * 12]
    n = next((r["num_params"] for r in results if "num_params" in r), None)
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"| {r['name']} | {r['status']} |" + " |" * 10)
            continue
        st = r.get("step_time_s") or statistics.median(r["step_times_s"][args.warmup:])
        r["step_time_s"] = st
        tf = tflops(n, tokens, args.layers, hf.hidden_size, args.seq, st) if n else float("nan")
        r["tflops"] = tf
        split = (f"{r['forward_s']:.2f} / {r['head_s']:.2f} / {r['backward_s']:.2f}" if "forward_s" in r else "")
        lines.append(f"| {r['name']} | ok | {st:.3f} | {tokens / st:,.0f} | {tf:.1f} "
                     f"| {r['gpu_peak_bytes'] / 2**30:.1f} "
                     f"| {r.get('host_bytes_per_param', float('nan')):.2f} / "
                     f"{r.get('process_pss_bytes_per_param', float('nan')):.2f} | {split} "
                     f"| {r.get('weight_wait_s', 0):.3f} "
                     f"| {r.get('adam_s', 0):.3f} | {r.get('h2d_GBps_busy', float('nan')):.1f} "
                     f"| {r.get('d2h_GBps_busy', float('nan')):.1f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--k", type=int, default=1, help="checkpoint interval")
    p.add_argument("--last", type=int, default=0, help="layers of the never-recomputed last block (0 = K)")
    p.add_argument("--chunk", type=int, default=0, help="sequences per compute chunk (0 = whole batch)")
    p.add_argument("--slab-params", type=int, default=0, help="elements per staging slab (0 = the largest layer)")
    p.add_argument("--loss-chunk", type=int, default=8192, help="tokens per LM-head/loss chunk")
    p.add_argument("--packers", type=int, default=4)
    p.add_argument("--packer-threads", type=int, default=2)
    p.add_argument("--accumulators", type=int, default=2)
    p.add_argument("--accumulator-threads", type=int, default=0, help="0 = all cores")
    p.add_argument("--adam-threads", type=int, default=0, help="0 = all cores")
    p.add_argument("--peers", default="plain", help="comma list of: " + ",".join(PEERS))
    p.add_argument("--ablations", default="", help="comma list of: " + ",".join(ABLATIONS))
    p.add_argument("--out", required=True)
    p.add_argument("--extra", nargs="*", default=[], help="config overrides for the default variant")
    p.add_argument("--machine", default="")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    _, hf = resolve_hf_config(load_config(None, overrides(args, Path(args.out), [])).model)
    results = [megatrain_variant(args, "default", args.extra)]
    results += [megatrain_variant(args, a, ABLATIONS[a]) for a in filter(None, args.ablations.split(","))]
    from megatrain.data import DataConfig

    data = DataConfig(seq_len=args.seq, batch_size=args.batch)
    for peer in filter(None, args.peers.split(",")):
        results.append(PEERS[peer](hf, data, args.steps))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "losses"}), flush=True)
    md = table(results, args, hf)
    when = datetime.date.today().isoformat()
    head = (f"\n### {args.layers} layers (Qwen2.5-7B shape), {args.batch}x{args.seq} tokens/step, K={args.k}"
            f"{f', last block {args.last}' if args.last else ''} "
            f"— {args.machine}, {when}\n\n`python bench/run.py {' '.join(sys.argv[1:])}`\n\n")
    (Path(args.out) / "results.md").write_text(head + md + "\n")
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    with open(ROOT / "BENCHMARKS.md", "a") as f:
        f.write(head + md + "\n")
    print(head + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
