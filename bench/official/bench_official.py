"""Run the OFFICIAL MegaTrain single-GPU trainer, unchanged, on synthetic tokens, and report per-step TFLOPS.

What runs: examples/sft/train.py main() of a checkout of DLYuanGod/MegaTrain outside this repository (--src,
else $MEGATRAIN_OFFICIAL_SRC, else ../shared/peers/official/src beside the repository root: checkout.py),
i.e. their CPUMasterModel (infinity/model/cpu_master.py) + DeepSpeedCPUAdam + their training loop and timing:
step time = forward_and_backward + clip_grad_norm_ + optimizer.step + _sync_params_to_gpu + zero_grad.
Their YAML for the published 7B run (examples/sft/configs/qwen_7b_1gpu.yaml) is the base config; only the
model path, dataset, batch, sequence length, steps and (if flash-attn is absent) attention are changed.

No file of theirs is edited. Glue applied from here, all outside their algorithm:
  G1 AutoTokenizer (in train.py's namespace) -> a stub: the synthetic data needs no tokenizer, and none
     can be downloaded on the GPU machine.
  G2 ChatDataset (in train.py's namespace) -> SyntheticTokens: random ids in [0, vocab), full length
     (no padding), attention_mask all ones, labels = input_ids (every position supervised). Their
     collate_fn, DataLoader and loop are used as they are.
  G3 only with attention 'sdpa' (used when flash-attn is not installed): their single-GPU path hands
     the raw 2-D [B,T] padding mask to each HF decoder layer, which transformers' sdpa kernel cannot
     take (crash). CPUMasterModel._build_layer_kwargs is wrapped so an all-ones 2-D mask becomes None
     (causal SDPA: what transformers' own masking does for an unpadded sdpa batch) and a padded one
     becomes their own CPUMasterModel._prepare_4d_causal_mask(). With flash_attention_2 nothing is wrapped.
  G4 observation only: train.py's module-level `time` is replaced by a proxy whose perf_counter()
     records the stamps their loop takes (2 per step), and a logging filter on their logger prints our
     line after each of their per-step blocks; CPUMasterModel.__init__ is wrapped to keep a reference
     to the model (to count N exactly as their loop does: sum of numel over model.get_parameters()).
  G5 only with --gpu-gib: the process's caching allocator is capped at that budget less its CUDA context
     before their code allocates on the GPU, as MegaTrain's executor caps its own (megatrain/memory/budget.py).

TFLOPS printed per step:  theirs = 6*N*B*S / t      (their train.py formula, S = max_seq_len)
                          ours   = (6*N*D + 12*L*H*S*D) / t,  D = B*S tokens, L layers, H hidden.
"""

import argparse
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import types

import torch
import torch.utils.data
from checkout import MissingCheckout, commit_of, official_src  # beside this script, which Python puts on sys.path


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", required=True, help="HF model directory (make_model.py writes one)")
    p.add_argument(
        "--src",
        default=None,
        help="their checkout (default: $MEGATRAIN_OFFICIAL_SRC, else "
        "../shared/peers/official/src beside the repository root)",
    )
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096, help="max_seq_len; every sample is exactly this long")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of our mean/median")
    p.add_argument(
        "--attn",
        default="auto",
        choices=["auto", "flash_attention_2", "sdpa"],
        help="auto: flash_attention_2 (their default) if flash-attn is importable, else sdpa + G3",
    )
    p.add_argument("--num-workers", type=int, default=None, help="DataLoader workers (default: their YAML's)")
    p.add_argument("--base-config", default=None, help="default: their examples/sft/configs/qwen_7b_1gpu.yaml")
    p.add_argument("--json-out", default=None)
    p.add_argument("--seed", type=int, default=1234, help="seed of the synthetic token stream")
    p.add_argument("--gpu-gib", type=float, default=None, help="G5: GPU memory budget in GiB, the context included")
    p.add_argument(
        "--allow-torch-adamw",
        action="store_true",
        help="run even if DeepSpeedCPUAdam is not importable (their fallback: torch AdamW)",
    )
    return p.parse_args()


class SyntheticTokens(torch.utils.data.Dataset):
    """G2: stands in for their ChatDataset (same constructor call, same sample dict). Random ids in [0, vocab),
    exactly max_seq_len long (no padding), attention_mask all ones, labels = input_ids (their loss shifts the
    labels itself). Deterministic per index. vocab/n_samples/seed are set on the class by main()."""

    vocab, n_samples, seed = None, 0, 0

    def __init__(self, tokenizer, max_seq_len, **kwargs):
        self.S, self.V, self.n, self.s = max_seq_len, type(self).vocab, type(self).n_samples, type(self).seed

    def __len__(self):
        return self.n

    def __getitem__(self, idx):
        g = torch.Generator().manual_seed(self.s * 1_000_003 + idx)
        ids = torch.randint(0, self.V, (self.S,), generator=g, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones(self.S, dtype=torch.long), "labels": ids.clone()}


def install_sdpa_mask_glue(cls):
    """G3: wrap cls._build_layer_kwargs so the 2-D [B,T] padding mask their single-GPU path hands every HF
    decoder layer becomes something transformers' sdpa attention accepts: None when nothing is padded (sdpa
    then runs causal, as transformers' own mask builder does for an unpadded sdpa batch), else their own
    cls._prepare_4d_causal_mask(). Returns the original method."""
    orig = cls._build_layer_kwargs

    def _build_layer_kwargs(self, mask, cache_position, position_ids, position_embeddings):
        kw = orig(self, mask, cache_position, position_ids, position_embeddings)
        m = kw.get("attention_mask")
        if m is not None and m.dim() == 2:
            if bool(m.all()):
                kw["attention_mask"] = None
            else:
                kw["attention_mask"] = cls._prepare_4d_causal_mask(m, self.config.dtype, m.shape[1])
        return kw

    cls._build_layer_kwargs = _build_layer_kwargs
    return orig


def flash_attn_usable():
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        from transformers.utils import is_flash_attn_2_available

        return bool(is_flash_attn_2_available())
    except Exception:
        return False


def write_config(a, attn, vocab):
    import yaml

    with open(a.base_config) as f:
        cfg = yaml.safe_load(f)
    cfg["model"]["name"] = os.path.abspath(a.model_dir)
    cfg["model"]["attn_implementation"] = attn
    ds = cfg.setdefault("dataset", {})
    workers = ds.get("num_workers", 2) if a.num_workers is None else a.num_workers
    cfg["dataset"] = {"name": "synthetic", "max_seq_len": a.seq, "num_workers": workers}
    cfg["training"]["batch_size"] = a.batch_size
    cfg["training"]["num_steps"] = a.steps
    cfg.setdefault("logging", {})["log_interval"] = 1  # their per-step block is what G4 hooks
    fd, path = tempfile.mkstemp(prefix="official_", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)
    return path, cfg


def main():
    a = parse_args()
    try:
        src = official_src(a.src, "--src")
    except MissingCheckout as exc:
        print(f"bench_official.py: error: {exc}", file=sys.stderr)
        sys.exit(2)
    a.base_config = a.base_config or str(src / "examples" / "sft" / "configs" / "qwen_7b_1gpu.yaml")
    sys.path[:0] = [str(src), str(src / "examples" / "sft")]

    from transformers import AutoConfig

    hf_cfg = AutoConfig.from_pretrained(a.model_dir)
    vocab = hf_cfg.vocab_size
    attn = a.attn if a.attn != "auto" else ("flash_attention_2" if flash_attn_usable() else "sdpa")
    cfg_path, cfg = write_config(a, attn, vocab)

    # Import their script as a module (its main() runs only when called). It sets logging.basicConfig,
    # PYTORCH_CUDA_ALLOC_CONF and tries `from deepspeed.ops.adam import DeepSpeedCPUAdam` on import.
    import train as official
    from infinity.model.cpu_master import FLASH_CE_AVAILABLE, CPUMasterModel

    if not official.CPU_ADAM_AVAILABLE and not a.allow_torch_adamw:
        sys.exit(
            "[bench] DeepSpeedCPUAdam is not importable (is deepspeed on PYTHONPATH?); "
            "their trainer would silently fall back to torch AdamW. Pass --allow-torch-adamw to accept that."
        )

    # ---- G5: the GPU budget, before anything of theirs allocates ----------------------------------
    if a.gpu_gib is not None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from megatrain.memory.budget import GIB, cap_device

        print(f"[bench] {cap_device(torch.cuda.current_device(), int(a.gpu_gib * GIB))}", flush=True)

    # ---- G1: tokenizer stub -------------------------------------------------------------------
    class _NoTokenizer:
        @classmethod
        def from_pretrained(cls, *args, **kwargs):
            return types.SimpleNamespace(pad_token="<|endoftext|>", eos_token="<|endoftext|>")

    official.AutoTokenizer = _NoTokenizer

    # ---- G2: synthetic data in their sample format ----------------------------------------------
    SyntheticTokens.vocab, SyntheticTokens.n_samples, SyntheticTokens.seed = vocab, a.steps * a.batch_size, a.seed
    official.ChatDataset = SyntheticTokens

    # ---- G3: 2-D padding mask -> what sdpa can take (only for sdpa) ------------------------------
    if attn == "sdpa":
        install_sdpa_mask_glue(CPUMasterModel)

    # ---- G4: observe their timing and logs --------------------------------------------------------
    state = {"model": None, "N": None, "L": None, "H": None, "steps": [], "cur": {}}
    _orig_init = CPUMasterModel.__init__

    def _init(self, *args, **kwargs):
        _orig_init(self, *args, **kwargs)
        state["model"] = self

    CPUMasterModel.__init__ = _init

    class _Clock(types.ModuleType):
        def __init__(self):
            super().__init__("time")
            self.stamps = []

        def perf_counter(self):
            t = time.perf_counter()
            self.stamps.append(t)
            return t

        def __getattr__(self, name):
            return getattr(time, name)

    clock = _Clock()
    official.time = clock

    B, S = a.batch_size, a.seq
    D = B * S
    pats = {
        "loss": re.compile(r"^Step (\d+)/\d+ \| Loss ([-+0-9.eEnaif]+)"),
        "their_tflops": re.compile(r"^  Time: ([0-9.]+)s \| Tokens/s [0-9.]+ \| TFLOPS ([0-9.]+)"),
        "fwd_bwd": re.compile(r"^  FWD: ([0-9.]+)s \| BWD: ([0-9.]+)s"),
        "gpu": re.compile(r"^  GPU: ([0-9.]+)GB peak"),
        "cpu": re.compile(r"^  CPU: ([0-9.]+)GB"),
    }

    def on_log(record):
        msg = record.getMessage()
        cur = state["cur"]
        m = pats["loss"].match(msg)
        if m:
            cur.update(step=int(m.group(1)), loss=float(m.group(2)))
        m = pats["fwd_bwd"].match(msg)
        if m:
            cur.update(fwd_s=float(m.group(1)), bwd_s=float(m.group(2)))
        m = pats["gpu"].match(msg)
        if m:
            cur.update(gpu_peak_gb=float(m.group(1)))
        m = pats["their_tflops"].match(msg)
        if m:
            cur.update(their_logged_tflops=float(m.group(2)))
        m = pats["cpu"].match(msg)
        if m:
            cur.update(cpu_rss_gb=float(m.group(1)))
            if state["N"] is None:
                mdl = state["model"]
                state["N"] = sum(p.numel() for p in mdl.get_parameters())
                state["L"] = len(mdl.cpu_layers)
                state["H"] = mdl.hidden_size
            N, L, H = state["N"], state["L"], state["H"]
            st = clock.stamps
            t = st[-1] - st[-2]
            cur.update(
                t=t, tflops_theirs=6 * N * B * S / t / 1e12, tflops_ours=(6 * N * D + 12 * L * H * S * D) / t / 1e12
            )
            state["steps"].append(dict(cur))
            print(
                f"[bench] step {cur.get('step')}: wall {t:.4f} s | TFLOPS theirs 6NBS/t {cur['tflops_theirs']:.1f}"
                f" | ours (6ND+12LHSD)/t {cur['tflops_ours']:.1f} | loss {cur.get('loss')}",
                flush=True,
            )
            state["cur"] = {}
        return True

    official.logger.addFilter(on_log)

    print(
        f"[bench] official trainer, attn={attn} (flash-attn CE {'on' if FLASH_CE_AVAILABLE else 'off: torch CE'}), "
        f"DeepSpeedCPUAdam={'yes' if official.CPU_ADAM_AVAILABLE else 'NO (torch AdamW)'}, "
        f"B={B} S={S} steps={a.steps} config={cfg_path}",
        flush=True,
    )
    print("[bench] config: " + json.dumps(cfg), flush=True)

    sys.argv = ["train.py", "--config", cfg_path]
    err = None
    t_start = time.time()
    try:
        official.main()
    except BaseException as e:  # report what ran, then fail
        import traceback

        traceback.print_exc()
        err = f"{type(e).__name__}: {e}"
        print(f"[bench] official main() raised {err}", flush=True)

    steps = state["steps"]
    kept = steps[a.warmup :] if len(steps) > a.warmup else []
    summ = dict(
        system=f"official MegaTrain (DLYuanGod/MegaTrain {commit_of(src)})",
        src=str(src),
        model_dir=os.path.abspath(a.model_dir),
        attn=attn,
        flash_ce=FLASH_CE_AVAILABLE,
        cpu_adam=official.CPU_ADAM_AVAILABLE,
        batch=B,
        seq=S,
        tokens_per_step=D,
        steps_run=len(steps),
        warmup_excluded=a.warmup,
        N=state["N"],
        L=state["L"],
        H=state["H"],
        gpu=(torch.cuda.get_device_name(0) if torch.cuda.is_available() else None),
        checkpoint_interval=cfg.get("memory", {}).get("checkpoint_interval"),
        num_grad_slabs=cfg.get("memory", {}).get("num_grad_slabs"),
        wall_total_s=time.time() - t_start,
        error=err,
        per_step=steps,
    )
    if kept:
        ts = [s["t"] for s in kept]
        summ.update(
            mean_step_s=statistics.mean(ts),
            median_step_s=statistics.median(ts),
            min_step_s=min(ts),
            tflops_theirs_mean=statistics.mean(s["tflops_theirs"] for s in kept),
            tflops_ours_mean=statistics.mean(s["tflops_ours"] for s in kept),
            tflops_theirs_at_median=6 * state["N"] * B * S / statistics.median(ts) / 1e12,
            tflops_ours_at_median=(6 * state["N"] * D + 12 * state["L"] * state["H"] * S * D)
            / statistics.median(ts)
            / 1e12,
            tflops_theirs_mean_all_steps=statistics.mean(s["tflops_theirs"] for s in steps),  # = their "Avg Throughput"
            peak_gpu_gb=max(s.get("gpu_peak_gb", 0) for s in steps),
            peak_cpu_rss_gb=max(s.get("cpu_rss_gb", 0) for s in steps),
        )
        print(
            f"[bench] SUMMARY over steps {a.warmup + 1}..{len(steps)}: median {summ['median_step_s']:.3f} s/step, "
            f"TFLOPS theirs {summ['tflops_theirs_at_median']:.1f}, ours {summ['tflops_ours_at_median']:.1f} "
            f"(N={state['N']:,}, L={state['L']}, H={state['H']}, D={D}); peak GPU {summ['peak_gpu_gb']:.1f} GB, "
            f"CPU RSS {summ['peak_cpu_rss_gb']:.1f} GB; first-step loss {steps[0].get('loss')} "
            f"(random init: expect ~ln(V) = {math.log(vocab):.2f})",
            flush=True,
        )
    print("[bench] JSON " + json.dumps(summ), flush=True)
    if a.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(a.json_out)), exist_ok=True)
        with open(a.json_out, "w") as f:
            json.dump(summ, f, indent=1)
    if err:
        sys.exit(1)


if __name__ == "__main__":
    main()
