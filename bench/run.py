"""MegaTrain throughput benchmark on a model shape (--model: Qwen2.5-7B's by default, OLMoE-1B-7B's,
GPT-OSS-20B's) with --layers layers, with peers in the same run.

  python bench/run.py --layers 8 --batch 16 --seq 4096 --steps 5 --peers plain --out OUT
  python bench/run.py --model olmoe-1b-7b --layers 16 --batch 16 --seq 4096 --peers deepspeed --out OUT
  python bench/run.py --gpus 2 --layers 28 --batch 16 --seq 4096 --peers deepspeed --out OUT

--batch is per GPU: with --gpus N the first row runs N executors on N x --batch sequences a step, the
second one executor on --batch, and the peers run on N GPUs.

--gpu-gib N is a GPU memory budget per GPU (the CUDA context included): engine.gpu_memory_gib for MegaTrain,
and the same cap on each peer's process (torch.cuda.set_per_process_memory_fraction; bench/peers.py); the
tables name it. --batch auto is the most sequences per GPU whose MegaTrain plan fits that budget (or the
GPU's free memory) and the host: every row then runs that batch. --layers auto is the most layers of the --model
shape whose plan fits this host and GPU at --batch (bench/auto.py): the deepest model the machine holds.

--tokens random (the default for a mixture of experts) trains every system on one seeded file of token ids drawn
uniformly over the model's vocabulary, written under OUT, that MegaTrain reads as data.kind tokens and every peer
through the same data path (bench/tokens.py); arithmetic (the dense presets' default) is megatrain's generated
problems, whose 15 or so distinct byte tokens no router can spread evenly over its experts. The heading names them.

--routing uniform (a mixture of experts) starts MegaTrain and every peer from one saved init whose routers
are balanced on the run's tokens, every layer on what the balanced layers before it give, in bf16 (the dtype a
GPU run computes in) and fp32 alike (bench/routing.py); random, the default, is each system's own random init.
MegaTrain's MoE rows carry the expert load of the steady steps (bench/table.py, load_stats()).

Writes OUT/results.json, OUT/results.md (the table, with the command and commit) and OUT/timeline-VARIANT.png.
TFLOPS use the paper's formula: (6*N*D + 12*L*H*S*D) / step time, N parameters, D tokens per step,
L layers, H hidden size, S sequence length (recompute is not counted as useful work); N counts a mixture
of experts' active parameters (the routed experts' top-k share).

A failure is one line on stderr, as megatrain-launch reports it: exit 2 for the input (a config key or
override, --peers official without the official code), 1 for a run that failed (the traceback in the failed
variant's error.log).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.auto import most_batch, most_layers  # noqa: E402
from bench.hosts import host_overrides, simulated_hosts  # noqa: E402
from bench.official.checkout import MissingCheckout, official_src  # noqa: E402
from bench.peers import PEERS  # noqa: E402
from bench.presets import ABLATIONS, MODELS  # noqa: E402
from bench.presets import QWEN7B as QWEN7B  # noqa: E402  (bench/lean.py imports it from here)
from bench.routing import ROUTINGS  # noqa: E402
from bench.table import copy_rates, load_stats, routing, table  # noqa: E402
from bench.tokens import TOKENS, default_tokens, random_tokens  # noqa: E402
from bench.workload import KNOBS, Failed, bench_model, overrides  # noqa: E402
from megatrain.config.data import DataConfig  # noqa: E402
from megatrain.errors import MegatrainError  # noqa: E402
from megatrain.ipc.procs import started_at  # noqa: E402
from megatrain.launch.config.tree import load_config  # noqa: E402
from megatrain.launch.plot.plots import plot_timeline  # noqa: E402
from megatrain.launch.run.driver import Trainer  # noqa: E402
from megatrain.model.spec import resolve_hf_config  # noqa: E402


def megatrain_variant(
    args: argparse.Namespace, name: str, extra: list[str], gpus: int | None = None, hosts: int = 1
) -> dict:
    """One MegaTrain row on `gpus` GPUs in all (default --gpus); over `hosts` simulated hosts of --gpus each."""
    out, gpus = Path(args.out) / name, gpus or args.gpus
    trainer = None
    try:
        # The first row's start-up counts from this process's start, as the launcher's does from its own: the
        # imports of the product (and of this bench, a little more) come first.
        launched = (started_at(os.getpid()) or None) if name == "default" else None
        with simulated_hosts(hosts, args.gpus) if hosts > 1 else contextlib.nullcontext() as address:
            where = host_overrides(hosts, args.gpus, address) if hosts > 1 else []
            trainer = Trainer(load_config(None, overrides(args, out, [*extra, *where], gpus)), launched=launched)
            summary = trainer.run()
    except Exception as exc:  # the run has released its processes and shared memory
        raise Failed.of(exc, f"MegaTrain ({name})", getattr(trainer, "log_dir", None)) from exc
    rows = summary.metrics[args.warmup :]
    med = statistics.median(r["step_time_s"] for r in rows)
    pick = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    h2d_busy = pick("h2d_bytes")
    res = {
        "name": f"MegaTrain ({name}, {summary.staging})",
        "status": "ok",
        "gpus": gpus,
        "batch": args.batch * gpus,
        "step_time_s": med,
        "step_times_s": [r["step_time_s"] for r in summary.metrics],
        "time_to_first_step_s": summary.time_to_first_step_s,
        "cpu_plan": summary.cpu_plan,
        "store_fill_s": summary.fills[0].seconds,
        "num_params": summary.num_params,
        "active_params": summary.active_params,
        "host_bytes_per_param": (summary.store_bytes + summary.executor_host_bytes) / summary.num_params,
        "process_pss_bytes_per_param": summary.memory[0].pss_bytes / summary.num_params,
        # over several hosts, each host's store and processes (host 0's is the column's)
        "host_pss_bytes_per_param": [m.pss_bytes / summary.num_params for m in summary.memory]
        if summary.hosts > 1
        else [],
        "hosts": summary.hosts,
        "pss_own_by_role": summary.memory[0].pss_own_by_role,
        "store_bytes": summary.store_bytes,
        "gpu_peak_bytes": max(r.get("gpu_peak_bytes", 0) for r in rows),
        **{
            k: pick(k)
            for k in ("forward_s", "head_s", "backward_s", "weight_wait_s", "grad_wait_s", "adam_s", "adam_update_s")
        },
        # engine.gpu_optimizer's choice and its update; the steps that clipped (clip scale below 1)
        "gpu_units": rows[-1].get("gpu_units", 0),
        "gpu_update_s": pick("gpu_update_s") if "gpu_update_s" in rows[-1] else 0.0,
        "clipped_steps": sum(r.get("clip_scale", 1.0) < 1.0 for r in summary.metrics),
        # ipc.spare_slots: the steady steps' units speculated during the backward, and kept
        "speculated": [r.get("speculated", 0) for r in rows],
        "committed": [r.get("committed", 0) for r in rows],
        "h2d_GBps_avg": h2d_busy / med / 1e9,
        "d2h_GBps_avg": pick("d2h_bytes") / med / 1e9,
        "losses": [r["loss"] for r in summary.metrics],
    }
    if "expert_load" in summary.metrics[-1]:  # a mixture of experts: the last step's routing, the steady load
        res.update(expert_load=summary.metrics[-1]["expert_load"], aux_losses=[r["aux_loss"] for r in rows])
        res.update(load_stats(rows) or {})
    timeline = out / "timeline.json"
    if timeline.is_file():
        plot_timeline(
            json.loads(timeline.read_text()),
            Path(args.out) / f"timeline-{name}.png",
            f"MegaTrain, {args.layers} layers, {args.batch}x{args.seq} tokens: one step",
        )
        res.update(copy_rates(json.loads(timeline.read_text()), summary.metrics[-1]))
    return res


# The headline suite: the targets of BENCHMARKS.md, each in its own process (a peer's pinned memory is
# not the next entry's problem), product defaults, the peers each target names in the same run, same model
# and batch (the official code at 16x4096 too with --peers official: 5 s/step, and FSDP2 at 4x4096 with
# --peers fsdp2: 6 s/step and 2.5 minutes, are outside the suite's budget).
# Two calls under a device's 10-minute limit (README, Benchmark; BENCHMARKS.md has the minutes):
# --only 8L-158x1024,8L-4x4096, then --only 8L-16x4096,28L-16x4096.
SUITE = {
    "8L-16x4096": ["--layers", "8", "--batch", "16", "--seq", "4096", "--peers", "deepspeed"],
    "8L-4x4096": ["--layers", "8", "--batch", "4", "--seq", "4096", "--peers", "plain"],
    "8L-158x1024": ["--layers", "8", "--batch", "158", "--seq", "1024", "--peers", "official"],
    "28L-16x4096": ["--layers", "28", "--batch", "16", "--seq", "4096", "--peers", ""],
}


def run_suite(args: argparse.Namespace) -> int:
    names = args.only.split(",") if args.only else list(SUITE)
    unknown = [n for n in names if n not in SUITE]
    if unknown:
        print(f"bench/run.py: --only: unknown suite entries {unknown}; known: {', '.join(SUITE)}", file=sys.stderr)
        return 2
    rc, t0 = 0, time.monotonic()
    for name in names:
        cmd = [
            sys.executable,
            __file__,
            *SUITE[name],
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--machine",
            args.machine,
            "--out",
            str(Path(args.out) / name),
        ]
        print(f"[suite] {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.monotonic()
        rc = max(rc, subprocess.run(cmd, cwd=ROOT).returncode)
        print(
            f"[suite] {name}: {time.monotonic() - start:.0f} s (suite so far {time.monotonic() - t0:.0f} s)", flush=True
        )
    return rc


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="MegaTrain throughput on a model's layer shape, peers in the same "
        "run. Model knobs left out keep the product's defaults."
    )
    p.add_argument("--suite", choices=["headline"], help="run the headline suite (each entry in its own process)")
    p.add_argument("--only", default="", help="with --suite: a comma list of entries: " + ", ".join(SUITE))
    p.add_argument("--model", choices=list(MODELS), default="qwen2.5-7b", help="the layer shape measured")
    p.add_argument(
        "--layers",
        type=lambda v: v if v == "auto" else int(v),
        default=8,
        help="layers of --model's shape; auto: the most whose MegaTrain plan fits this host and GPU (--gpu-gib) "
        "at --batch",
    )
    p.add_argument(
        "--batch",
        type=lambda v: v if v == "auto" else int(v),
        default=16,
        help="sequences per step per GPU; auto: the most whose MegaTrain plan fits the GPU (--gpu-gib) and host",
    )
    p.add_argument(
        "--gpu-gib",
        type=float,
        default=None,
        help="GPU memory budget per GPU in GiB, CUDA context included: engine.gpu_memory_gib for MegaTrain, "
        "the same cap on every peer",
    )
    p.add_argument("--gpus", type=int, default=1, help="GPUs (actors.num_gpus; the peers' world size)")
    p.add_argument(
        "--hosts",
        type=int,
        default=1,
        help="a run over this many hosts of --gpus GPUs each, simulated on this machine (bench/hosts.py), beside "
        "one host of all their GPUs",
    )
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=12, help="steps per system (at least 10 steady ones)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the steady statistics")
    p.add_argument(
        "--peer-steps",
        type=int,
        default=None,
        help="steps per peer (default: --steps); fewer for a peer whose steps take minutes, the table says so",
    )
    for flag, key in KNOBS.items():
        p.add_argument("--" + flag.replace("_", "-"), dest=flag, type=int, default=None, help=f"sets {key}")
    p.add_argument(
        "--routing",
        choices=ROUTINGS,
        default="random",
        help="a mixture of experts' routing at the start: random (each system's random init) or uniform (one "
        "init, routers balanced on the run's tokens, for MegaTrain and every peer)",
    )
    p.add_argument(
        "--tokens",
        choices=TOKENS,
        default=None,
        help="what every system trains on: random (token ids uniform over the vocabulary, seeded, one file for "
        "all; the default with experts) or arithmetic (megatrain's generated problems; the dense default)",
    )
    p.add_argument("--peers", default="plain", help="comma list of: " + ",".join(PEERS))
    p.add_argument(
        "--official-src",
        default=None,
        help="the official MegaTrain checkout for --peers official (default: $MEGATRAIN_OFFICIAL_SRC, "
        "else ../shared/peers/official/src beside the repository root)",
    )
    p.add_argument("--ablations", default="", help="comma list of: " + ",".join(ABLATIONS))
    p.add_argument("--out", required=True)
    p.add_argument(
        "--extra",
        nargs="*",
        default=[],
        help="config overrides for the default variant; model.hf.KEY=VALUE ones change the model of "
        "every row (variants and peers)",
    )
    p.add_argument("--machine", default="")
    args = p.parse_args(argv)
    if args.gpus < 1:
        p.error("--gpus: at least 1")
    if args.gpu_gib is not None and args.gpu_gib <= 0:
        p.error("--gpu-gib: a number of GiB > 0")
    if args.peer_steps is not None and args.peer_steps <= args.warmup:
        p.error("--peer-steps: more than --warmup, or no steady step is left")
    if args.batch != "auto" and args.batch < 1:
        p.error("--batch: at least 1, or auto")
    if args.layers != "auto" and args.layers < 1:
        p.error("--layers: at least 1, or auto")
    if args.layers == "auto" and args.batch == "auto":
        p.error("--layers auto and --batch auto: one at a time (the deepest model at a batch, or a model's most batch)")
    if args.hosts < 1:
        p.error("--hosts: at least 1")
    if args.hosts > 1 and (args.peers or args.suite):
        p.error("--hosts: the row over hosts is measured beside one host of as many GPUs: --peers '' and no --suite")
    if args.gpus > 1 and {"plain", "fsdp2", "official"} & set(args.peers.split(",")):
        p.error("--gpus > 1: only --peers deepspeed runs on several GPUs")
    for flag, names, known in (("--peers", args.peers, PEERS), ("--ablations", args.ablations, ABLATIONS)):
        unknown = [n for n in names.split(",") if n and n not in known]
        if unknown:
            p.error(f"{flag}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("bench/run.py: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        ours = isinstance(exc, (MegatrainError, MissingCheckout))  # a bug's traceback goes to OUT/error.log
        failed = exc if isinstance(exc, Failed) else Failed.of(exc, log_dir=None if ours else Path(args.out))
        print(f"bench/run.py: error: {failed}", file=sys.stderr)
        return failed.code


def run(args: argparse.Namespace) -> int:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.suite:
        return run_suite(args)
    if args.layers == "auto":
        args.layers = most_layers(args)
    args.hf, args.extra = bench_model(args.model, args.layers, args.extra)
    if args.batch == "auto":
        args.batch = most_batch(args)
    args.tokens = args.tokens or default_tokens(args.hf)
    if args.tokens == "random":  # every batch a run reads, MegaTrain's (g x --batch a step) and the peers'
        steps = max(args.steps, args.peer_steps or 0)
        whole = DataConfig(seq_len=args.seq, batch_size=args.batch * args.gpus * args.hosts)
        args.data = random_tokens(int(args.hf["vocab_size"]), whole, steps, Path(args.out))
    if args.routing == "uniform" and not any(k in args.hf for k in ("num_experts", "num_local_experts")):
        raise Failed(f"--routing uniform: --model {args.model} has no routers", 2)
    peers = [p for p in args.peers.split(",") if p]
    if "official" in peers and MODELS[args.model][0] != "qwen2":
        raise Failed(f"--peers official: the official code trains the qwen2 family only, not --model {args.model}", 2)
    # before anything is measured: a missing checkout is the user's to fix, not a row's error 20 minutes in
    src = official_src(args.official_src) if "official" in peers else None
    _, hf = resolve_hf_config(load_config(None, overrides(args, Path(args.out), args.extra)).model)
    whole = getattr(args, "data", None) or DataConfig(seq_len=args.seq, batch_size=args.batch * args.gpus * args.hosts)
    data = dataclasses.replace(whole, batch_size=args.batch)  # per GPU
    if args.routing == "uniform":
        from bench.routing import uniform_model

        args.init = uniform_model(hf, whole, args.steps)
    try:
        return measure(args, hf, data, peers, src)
    finally:
        if getattr(args, "init", None):
            shutil.rmtree(args.init, ignore_errors=True)


def measure(args: argparse.Namespace, hf, data, peers: list[str], src: Path | None) -> int:
    variants = [("default", args.extra, None, 1)]
    if args.hosts > 1:  # the baseline: one host of every GPU the hosts have, the same batch in all
        variants = [("default", args.extra, args.gpus * args.hosts, args.hosts)]
        variants.append(("one host", args.extra, args.gpus * args.hosts, 1))
    elif args.gpus > 1:  # the scaling's baseline: one executor, one GPU's share of the batch
        variants.append(("one GPU", args.extra, 1, 1))
    variants += [(a, ABLATIONS[a], None, 1) for a in filter(None, args.ablations.split(","))]
    results: list[dict] = []
    for name, extra, gpus, hosts in variants:  # each row saved as it ends: a later row's failure keeps the others
        results.append(megatrain_variant(args, name, extra, gpus, hosts))
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    for peer in [None, *peers]:
        if peer is not None:
            kw = {"src": src} if peer == "official" else {"gpus": args.gpus} if args.gpus > 1 else {}
            if getattr(args, "init", None):
                kw["init"] = args.init
            results.append(PEERS[peer](hf, data, args.peer_steps or args.steps, gpu_gib=args.gpu_gib, **kw))
            results[-1].setdefault("gpus", args.gpus if "gpus" in kw else 1)
            results[-1].setdefault("batch", args.batch * results[-1]["gpus"])
        # row by row: a peer the kernel's OOM killer ends takes the bench's process, not the rows measured
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("losses", "expert_load")}), flush=True)
    md = table(results, args, hf)
    when = datetime.date.today().isoformat()
    given = ", ".join(f"{KNOBS[f]}={getattr(args, f)}" for f in KNOBS if getattr(args, f) is not None)
    head = (
        f"\n### {args.layers} layers ({MODELS[args.model][2]}), {args.batch}x{args.seq} tokens/step"
        + (f" per GPU, {args.gpus} GPUs" if args.gpus > 1 and args.hosts == 1 else "")
        + (f" per GPU, {args.hosts} hosts of {args.gpus} GPU(s)" if args.hosts > 1 else "")
        + f"{f' ({given})' if given else ', product defaults'}"
        + (f", GPU memory budget {args.gpu_gib:g} GiB per GPU (every row)" if args.gpu_gib is not None else "")
        + (f", routing {args.routing}" if MODELS[args.model][1].get("num_experts_per_tok") else "")
        + f", {args.tokens} tokens"
        + f" — {args.machine}, {when}, commit {commit()}\n\n"
        f"`python bench/run.py {shlex.join(sys.argv[1:])}`\n\n"
        f"Steps {args.steps}{f' (peers {args.peer_steps})' if args.peer_steps else ''}, warm-up {args.warmup}; "
        f"CPU plan: {results[0].get('cpu_plan', '?')}\n\n"
    )
    if "expert_load" in results[0]:
        head += f"Last step's routing (MegaTrain): {routing(results[0]['expert_load'])}\n\n"
    if results[0].get("host_pss_bytes_per_param"):  # each host's store and processes, against its plan
        each = ", ".join(f"host {h} {b:.2f}" for h, b in enumerate(results[0]["host_pss_bytes_per_param"]))
        head += f"Host PSS per parameter over {results[0]['hosts']} hosts: {each} (planned per host: "
        head += f"{results[0]['host_bytes_per_param']:.2f})\n\n"
    (Path(args.out) / "results.md").write_text(head + md + "\n")
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))
    print(head + md)
    return 0


def commit() -> str:
    """The commit measured (with '+dirty' when the tree has changes): a number holds only for it.
    MEGATRAIN_COMMIT wins: a copied working tree (the device tool's) may carry a stale .git."""
    if os.environ.get("MEGATRAIN_COMMIT"):
        return os.environ["MEGATRAIN_COMMIT"]
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"


if __name__ == "__main__":
    sys.exit(main())
