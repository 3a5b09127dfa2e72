"""Checkpoint speed at scale, in one run: the disk's own sequential write speed (dd, O_DIRECT), a training
run with checkpoints (each write's GB/s and what it cost the steps around it), the export of the last
checkpoint as an HF bf16 directory and its import (`model.pretrained`), and on a small model how far a
resumed run ends from an uninterrupted one (and from a second uninterrupted one: the GPU's own noise).

  python bench/checkpoint.py --dir /big/disk/ckpt --out OUT --layers 28 --batch 16 --seq 4096 --steps 14 \
      --save-every 7 --drop-mid --parts all

`--dir` must be on the disk to measure (it holds the checkpoints; OUT gets only logs and results.json).
`--drop-mid` deletes each mid-run checkpoint once it is complete, for a disk that holds one checkpoint
(91 GB at 7.6B) but not two. Writes OUT/results.json and OUT/results.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.run import overrides  # noqa: E402
from megatrain.formats import checkpoint as ckpt  # noqa: E402
from megatrain.launch.config.tree import load_config  # noqa: E402
from megatrain.launch.run.driver import Trainer  # noqa: E402

SMALL = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "num_hidden_layers": 4,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
}


def disk_speed(directory: Path, gib: int, streams: int) -> dict:
    """dd from /dev/zero with oflag=direct (conv=fsync): `streams` files written at once, gib GiB in all."""
    count = max(gib * 16 // streams, 1)  # 64 MiB blocks
    files = [directory / f"dd-{i}.bin" for i in range(streams)]
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            ["dd", "if=/dev/zero", f"of={f}", "bs=64M", f"count={count}", "oflag=direct", "conv=fsync", "status=none"]
        )
        for f in files
    ]
    rcs = [p.wait() for p in procs]
    seconds = time.perf_counter() - t0
    nbytes = sum(f.stat().st_size for f in files if f.exists())
    for f in files:
        f.unlink(missing_ok=True)
    return {
        "streams": streams,
        "bytes": nbytes,
        "seconds": seconds,
        "GBps": nbytes / seconds / 1e9,
        "ok": all(rc == 0 for rc in rcs),
    }


def dropper(root: Path, last: int, stop: threading.Event) -> threading.Thread:
    """Delete every complete checkpoint but the last step's as soon as it is complete."""

    def run() -> None:
        while not stop.wait(0.5):
            for step, path in ckpt.complete(root):
                if step != last:
                    shutil.rmtree(path, ignore_errors=True)
                    print(f"[bench] dropped {path.name} (--drop-mid)", flush=True)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def train_with_checkpoints(args: argparse.Namespace, run_dir: Path) -> dict:
    extra = [f"train.save_every={args.save_every}", *args.extra]
    cfg = load_config(None, overrides(args, run_dir, extra))
    stop = threading.Event()
    if args.drop_mid:
        dropper(run_dir / "checkpoints", args.steps, stop)
    t0 = time.perf_counter()
    try:
        summary = Trainer(cfg).run()
    finally:
        stop.set()
    wall = time.perf_counter() - t0
    times = [r["step_time_s"] for r in summary.metrics]
    saved = [c["step"] for c in summary.checkpoints]
    touched = {s + 1 for s in saved} | {s + 2 for s in saved}  # a write overlaps the next step or two
    steady = [t for i, t in enumerate(times, 1) if i > args.warmup and i not in touched]
    med = statistics.median(steady)
    cost = {s: sum(times[i - 1] - med for i in (s + 1, s + 2) if i <= len(times)) for s in saved if s < len(times)}
    return {
        "wall_s": wall,
        "step_times_s": times,
        "steady_median_s": med,
        "steady_min_s": min(steady),
        "steady_max_s": max(steady),
        "steady_steps": len(steady),
        "first_step_s": times[0],
        "checkpoints": summary.checkpoints,
        "step_cost_s": cost,
        "num_params": summary.num_params,
        "checkpoint_dir": str(run_dir / "checkpoints" / f"step-{args.steps:07d}"),
    }


def export_and_import(args: argparse.Namespace, src: Path, dst: Path) -> dict:
    shutil.rmtree(dst, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "megatrain.launch.cli.main", "export", str(src), str(dst), "--dtype", "bf16"], check=True
    )
    export_s = time.perf_counter() - t0
    nbytes = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    run_dir = Path(args.dir) / "import-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    one = argparse.Namespace(**{**vars(args), "steps": 1})
    cfg = load_config(None, [*overrides(one, run_dir, args.extra), f"model.pretrained={dst}"])
    t0 = time.perf_counter()
    summary = Trainer(cfg).run()
    return {
        "export_s": export_s,
        "export_bytes": nbytes,
        "export_GBps": nbytes / export_s / 1e9,
        "import": dataclasses.asdict(summary.fills[0]),
        "import_run_wall_s": time.perf_counter() - t0,
        "import_GBps": summary.fills[0].bytes / max(summary.fills[0].seconds, 1e-9) / 1e9,
    }


def resume_difference(args: argparse.Namespace, base: Path) -> dict:
    """A small model, 10 steps, three ways: uninterrupted twice, and 5 + resume for 5."""
    shutil.rmtree(base, ignore_errors=True)

    def go(name: str, *extra: str) -> Path:
        small = argparse.Namespace(
            **{
                **vars(args),
                "layers": SMALL["num_hidden_layers"],
                "batch": 4,
                "seq": 1024,
                "steps": 10,
                "k": 1,
                "last": 0,
            }
        )
        over = overrides(small, base / name, ["train.save_every=5", *extra])
        over = [o for o in over if not o.startswith("model.hf=")] + [f"model.hf={json.dumps(SMALL)}"]
        Trainer(load_config(None, over)).run()
        return base / name

    a, b = go("a"), go("b")
    r = go("r", f"train.resume={ckpt.step_dir(a / 'checkpoints', 5)}")

    def diff(x: Path, y: Path) -> dict:
        out = {}
        for part in ckpt.PLANES:
            fx, fy = (
                np.fromfile(ckpt.step_dir(run / "checkpoints", 10) / "host-0" / f"{part}.bin", np.float32)
                for run in (x, y)
            )
            d = np.abs(fx - fy)
            out[part] = {
                "max_abs": float(d.max()),
                "max_rel": float((d / np.maximum(np.abs(fx), 1e-12)).max()),
                "equal": bool(np.array_equal(fx.view(np.uint32), fy.view(np.uint32))),
            }
        la, lb = (loss_by_step(x), loss_by_step(y))
        out["loss_max_abs"] = max(abs(la[s] - lb[s]) for s in lb if s in la)
        return out

    return {"resumed_vs_uninterrupted": diff(a, r), "uninterrupted_vs_uninterrupted": diff(a, b)}


def loss_by_step(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="where checkpoints go (on the disk being measured)")
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="all", help="comma list of: disk, train, import, resume (or all)")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--save-every", type=int, default=7)
    p.add_argument("--drop-mid", action="store_true")
    p.add_argument("--dd-gib", type=int, default=16)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--last", type=int, default=0)
    p.add_argument("--chunk", type=int, default=0)
    p.add_argument("--slab-params", type=int, default=0)
    p.add_argument("--loss-chunk", type=int, default=8192)
    p.add_argument("--packers", type=int, default=4)
    p.add_argument("--packer-threads", type=int, default=2)
    p.add_argument("--accumulators", type=int, default=2)
    p.add_argument("--accumulator-threads", type=int, default=0)
    p.add_argument("--adam-threads", type=int, default=0)
    p.add_argument("--extra", nargs="*", default=[], help="config overrides")
    args = p.parse_args()
    parts = {"disk", "train", "import", "resume"} if args.parts == "all" else set(args.parts.split(","))
    out, base = Path(args.out), Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    base.mkdir(parents=True, exist_ok=True)
    res: dict = {"argv": sys.argv[1:], "disk_free_bytes": shutil.disk_usage(base).free}

    def save() -> None:
        (out / "results.json").write_text(json.dumps(res, indent=1, default=str))

    if "disk" in parts:
        res["dd"] = [disk_speed(base, args.dd_gib, n) for n in (1, 4)]
        print("[bench] dd:", json.dumps(res["dd"]), flush=True)
        save()
    if "train" in parts:
        res["train"] = train_with_checkpoints(args, base / "run")
        print("[bench] train:", json.dumps({k: v for k, v in res["train"].items() if k != "step_times_s"}), flush=True)
        save()
    if "import" in parts:
        src = base / "run" / "checkpoints" / f"step-{args.steps:07d}"
        res["export_import"] = export_and_import(args, src, base / "hf-bf16")
        print("[bench] export/import:", json.dumps(res["export_import"]), flush=True)
        save()
    if "resume" in parts:
        res["resume"] = resume_difference(args, base / "resume")
        print("[bench] resume:", json.dumps(res["resume"]), flush=True)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
