"""The plan's time estimate (megatrain/steptime.py, launch/config/timeplan.py), its
warning for a run of more than a day, the plan's word when no setting makes a run fit, and a plan of a
pretrained directory without its weights. No timing is asserted: the rates are given, or only their presence
is checked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megatrain import steptime
from megatrain.errors import ConfigError
from megatrain.launch.cli.main import main
from megatrain.launch.config import timeplan
from megatrain.launch.config.tree import load_config, load_tree, validate_model
from megatrain.memory.hosts import network_bytes
from megatrain.model.arch import arch_from_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
}


def small_cfg(*more: str):
    return load_config(None, [f"model.hf={json.dumps(SMALL)}", "data.seq_len=256", "data.batch_size=8", *more])


def gpu_basis(tflops: float = 100.0, host_gb_s: float = 100.0) -> timeplan.Basis:
    return timeplan.Basis(steptime.Rate(tflops * 1e12, f"a {tflops:g} TFLOPS GPU"), host_gb_s * 1e9, "given")


def test_a_step_takes_its_flops_at_the_rate() -> None:
    """Twice the tokens per step, twice the compute; the run is its steps times the step."""
    cfg, spec = small_cfg(), arch_from_config(small_cfg().model)
    one = timeplan.estimate(cfg, spec, gpu_basis(), 1, 1000)
    two = timeplan.estimate(small_cfg("data.batch_size=16"), spec, gpu_basis(), 1, 1000)
    assert one is not None and two is not None
    assert two.compute_s == pytest.approx(2 * one.compute_s) and two.adam_s == one.adam_s
    flops = 6 * spec.layout.num_params * 8 * 256 + 12 * 4 * 256 * 256 * 8 * 256  # 6·N·D + 12·L·H·S·D
    assert one.compute_s == pytest.approx(flops / 100e12)
    assert one.total_s == pytest.approx(1000 * one.step_s + (one.eval_s or 0))
    halves = timeplan.estimate(cfg, spec, gpu_basis(), 2, 1000)  # two executors: each does half
    assert halves is not None and halves.compute_s == pytest.approx(one.compute_s / 2)


def test_over_several_hosts_each_takes_its_share_and_the_network_is_said() -> None:
    """The batch splits over every executor of every host, each host's Adam updates its slice, and the plan
    says the bytes each host sends a step (6 (H-1)/H per parameter on GPUs, 10 (H-1)/H on the CPU device:
    an all-reduce of the gradients) and the speed at which they hide behind the estimated step."""
    cfg, spec = small_cfg(), arch_from_config(small_cfg().model)
    one = timeplan.estimate(cfg, spec, gpu_basis(host_gb_s=1.0), 1, 10)
    two = timeplan.estimate(cfg, spec, gpu_basis(host_gb_s=1.0), 1, 10, hosts=2)
    assert one is not None and two is not None
    assert two.compute_s == pytest.approx(one.compute_s / 2) and two.adam_s == pytest.approx(one.adam_s / 2, rel=1e-6)
    n = spec.layout.num_params
    assert network_bytes(spec.layout, 1) == 0
    for hosts in (2, 3, 4):  # padded to the hosts' slices: a little over the parameters' own bytes
        assert 6 * (hosts - 1) / hosts * n <= network_bytes(spec.layout, hosts) <= 1.05 * 6 * (hosts - 1) / hosts * n
        gpu, cpu = network_bytes(spec.layout, hosts), network_bytes(spec.layout, hosts, cuda=False)
        assert cpu * 6 == gpu * 10
    said = timeplan.lines(cfg, spec, gpu_basis(), 1, hosts=4)
    est = timeplan.estimate(cfg, spec, gpu_basis(), 1, cfg.train.steps, hosts=4)
    assert est is not None
    (net,) = [line for line in said if "between the hosts" in line]
    sent = network_bytes(spec.layout, 4)
    assert f"each sends {sent / 1e9:,.1f} GB a step" in net and f"{sent / est.step_s / 1e9:,.1f} GB/s" in net
    assert "on each of 4 executors (1 on each of 4 hosts)" in said[1] and "slice (1/4)" in said[3]
    assert not any("between the hosts" in line for line in timeplan.lines(cfg, spec, gpu_basis(), 2))


def test_the_adam_pass_is_a_floor_on_a_gpu_and_adds_on_the_cpu() -> None:
    params = 10**9
    fast = steptime.step_estimate(1e15, params, 10, steptime.Rate(1e15, "gpu"), 1e12, 1, 0.0)
    assert fast.step_s == pytest.approx(1.0)  # Adam (0.028 s) hides under the forward
    slow = steptime.step_estimate(1e15, params, 10, steptime.Rate(1e15, "gpu"), 1e10, 1, 0.0)
    assert slow.adam_s == pytest.approx(2.8) and slow.step_s == pytest.approx(2 / 3 + 2.8)
    cpu = steptime.step_estimate(1e12, params, 10, steptime.Rate(1e12, "cpu", cpu=True), 1e10, 1, 0.0)
    assert cpu.step_s == pytest.approx(1.0 + 10 * steptime.CPU_UNIT_S + 2.8)


@pytest.mark.parametrize(
    "name,label",
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA GH200 480GB", "GH200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A10G", "A10G"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA RTX A6000", "RTX A6000"),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("rtx 3090", "RTX 3090"),
        ("h100", "H100"),
    ],
)
def test_gpus_are_known_by_name(name: str, label: str) -> None:
    assert steptime.gpu_by_name(name)[0] == label


def test_an_unknown_gpu_falls_back_to_its_properties() -> None:
    assert steptime.gpu_by_name("Tesla V100-SXM2-16GB") is None
    rate = steptime.gpu_rate("Some Ampere", sms=108, capability=(8, 0), clock_hz=1.41e9)
    assert rate is not None and rate.flops_per_s == pytest.approx(108 * 2048 * 1.41e9 * steptime.GPU_EFFICIENCY)
    assert "108 SMs of compute capability 8.0" in rate.how
    assert steptime.gpu_rate("Tesla V100-SXM2-16GB", sms=80, capability=(7, 0)) is None  # no bf16 tensor cores


def test_a_run_of_more_than_a_day_is_warned_of() -> None:
    cfg = small_cfg("train.steps=1000")
    spec = arch_from_config(cfg.model)
    slow = timeplan.lines(cfg, spec, gpu_basis(tflops=1e-4), 1)
    assert slow[0].startswith("time (an estimate):") and "train.steps 1,000" in slow[0]
    warning = [line for line in slow if "WARNING" in line]
    assert len(warning) == 1 and "more than a day" in warning[0] and "1,000 steps" in warning[0]
    assert not any("WARNING" in line for line in timeplan.lines(cfg, spec, gpu_basis(), 1))
    assert timeplan.lines(cfg, spec, timeplan.Basis(None, why="no rate"), 1) == ["time: no estimate: no rate"]


def test_evaluation_is_counted_when_its_size_is_known() -> None:
    spec = arch_from_config(small_cfg().model)
    fwd = 8 * 256 * (6 * spec.layout.num_params + 12 * 4 * 256 * 256) / 3
    cfg = small_cfg("data.kind=arithmetic", "train.steps=100", "train.eval_every=30", "train.eval_batches=2")
    assert timeplan.evaluation_flops(cfg, spec, 100) == pytest.approx(4 * 2 * fwd)  # 30, 60, 90 and the last
    cfg = small_cfg("data.kind=arithmetic", "train.steps=90", "train.eval_every=30", "train.final_eval=false")
    assert timeplan.evaluation_flops(cfg, spec, 90) == pytest.approx(3 * 8 * fwd)  # 8: the arithmetic's own
    held_out = load_config(
        None, [f"model.hf={json.dumps(SMALL)}", "data.kind=text", "data.path=x.jsonl", "data.eval_fraction=0.01"]
    )
    assert timeplan.evaluation_flops(held_out, spec, 100) is None  # the whole held-out set: not read by the plan
    assert timeplan.evaluation_flops(small_cfg("data.kind=tokens", "data.path=x.bin"), spec, 100) == 0.0


def test_the_cpu_rate_is_the_fastest_rounds_whatever_else_ran() -> None:
    """The rounds of a busy machine (the field's: 16 to 251 GFLOPS between two plans) give the CPU's rate as long
    as a few rounds ran alone: their median, robust to one round sped up by timer noise; their spread is said."""
    alone = [250e9, 251e9, 249e9]
    busy = [16e9, 20e9, 31e9, 18e9, 60e9, 24e9, 17e9]
    for rounds in (alone + busy, busy[:3] + alone + busy[3:], [*busy, *alone, 900e9]):  # in any order, any noise
        assert steptime.best_rate(rounds) == pytest.approx(250.5e9, rel=0.01), rounds
    assert steptime.best_rate(busy[:2]) == 18e9  # fewer rounds than counted: their median
    assert steptime.settled(alone + busy) and not steptime.settled([*busy, 250e9])  # one fast round: go on
    timing = steptime.Timing(steptime.best_rate(alone + busy), tuple(alone + busy))
    assert timing.busy and timing.spread() == "16-251"
    assert not steptime.Timing(250e9, tuple(alone)).busy
    with pytest.raises(ValueError):
        steptime.best_rate([])


def test_timed_rounds_stop_when_the_fastest_agree_or_at_the_limit() -> None:
    """A steady piece of work stops once its fastest rounds agree (well before a limit of minutes); at the limit
    it stops whatever the rounds say: one round where the limit is 0."""
    timing = steptime.timed_rounds(lambda: sum(range(100)), min_s=0.0, max_s=300.0)
    assert steptime.settled(list(timing.rounds)) and timing.rate == steptime.best_rate(list(timing.rounds))
    assert len(steptime.timed_rounds(lambda: None, min_s=0.0, max_s=0.0).rounds) == 1


def own_model(tmp_path: Path) -> Path:
    """The README's own-model config."""
    body = (ROOT / "README.md").read_text().split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "my-model.yaml").write_text(body)
    return tmp_path / "my-model.yaml"


def test_plan_prints_the_estimate_and_keeps_its_exit_code_for_memory(tmp_path, capsys) -> None:
    cfg = str(own_model(tmp_path))
    # a GPU of 0.0001 TFLOPS: the run takes years, and still fits
    assert main(["plan", cfg, "--gpu-gib", "40", "--host-gib", "64", "--gpu-tflops", "0.0001"]) == 0
    out = capsys.readouterr().out
    assert "--gpu-tflops 0.0001 (nominal dense bf16)" in out and "WARNING: the whole run" in out
    assert "BENCHMARKS.md's 16-core GPU hosts (--host-gib)" in out  # another host: not this one's bandwidth
    assert out.index("time (an estimate)") < out.index("verdict: fits")
    assert main(["plan", cfg, "--gpu-gib", "40", "--host-gib", "64", "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    assert "H100: 989 TFLOPS nominal dense bf16 x 45%" in out and "WARNING" not in out
    # the same run that does not fit: exit 1, the estimate still said
    assert main(["plan", cfg, "--gpu-gib", "40", "--host-gib", "2", "--gpu", "H100"]) == 1
    assert "time (an estimate)" in capsys.readouterr().out


def test_plan_on_the_cpu_measures_this_cpu(capsys) -> None:
    assert main(["plan", str(ROOT / "examples" / "default.yaml"), "engine.device=cpu", "train.steps=10"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "a float32 matmul of the model's shape" in line)
    assert re.search(r"\(2048x128 @ 128x384\) timed at \d+ GFLOPS with \d+ thread", line), line
    assert "this host's memory bandwidth (a copy timed with" in out


def test_plan_says_when_it_cannot_estimate_and_refuses_what_it_cannot_read(tmp_path, capsys) -> None:
    cfg = str(own_model(tmp_path))
    if not torch.cuda.is_available():
        assert main(["plan", cfg, "--gpu-gib", "40"]) == 0
        assert "time: no estimate: the plan knows the GPU's memory, not its speed" in capsys.readouterr().out
    assert main(["plan", cfg, "--gpu-gib", "40", "--gpu", "Voodoo 5"]) == 2
    assert "--gpu 'Voodoo 5': not a GPU the plan knows" in capsys.readouterr().err
    assert main(["plan", cfg, "engine.device=cpu", "--gpu", "H100"]) == 2
    assert "the plan is for the CPU device: engine.device is cpu" in capsys.readouterr().err
    assert main(["plan", cfg, "--gpu-gib", "40", "--gpu-tflops", "0"]) == 2
    assert main(["plan", cfg, "--gpu-gib", "40", "engine.compute_dtype=fp32", "--gpu", "H100"]) == 0
    assert "time: no estimate: the GPU rates are bf16's" in capsys.readouterr().out


def test_plan_says_when_no_setting_makes_it_fit_and_what_would(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)  # a private Ray's 98 %
    cfg = str(own_model(tmp_path))
    assert main(["plan", cfg, "engine.device=cpu", "--host-gib", "4"]) == 1
    out = capsys.readouterr().out
    found = re.search(
        r"none of these makes it fit that host: the least of them needs ([\d.]+) GiB .* it fits a host "
        r"with (\d+) GiB of RAM",
        out,
    )
    assert found, out
    least = next(line.split(":")[0].strip() for line in out.splitlines() if "slabs of a quarter layer" in line)
    need = found.group(2)  # the setting that needs least, on the host the sentence names: it fits
    assert main(["plan", cfg, "engine.device=cpu", *least.split(), "--host-gib", need]) == 0
    # where a setting does make it fit (a host between what it needs and what the defaults need), it is not said
    default = float(re.search(r"host: ([\d.]+) GiB needed", out).group(1))
    between = (float(found.group(1)) + default) / 2 / 0.98
    capsys.readouterr()
    assert main(["plan", cfg, "engine.device=cpu", "--host-gib", f"{between:.2f}"]) == 1
    out = capsys.readouterr().out
    assert "settings that need less" in out and "none of these" not in out


def test_plan_says_when_no_engine_setting_fits_the_gpu(tmp_path, capsys) -> None:
    cfg = str(own_model(tmp_path))
    assert main(["plan", cfg, "--gpu-gib", "0.5", "--host-gib", "64", "--gpu", "H100"]) == 1
    out = capsys.readouterr().out
    assert "none of the engine settings makes it fit this GPU" in out and "a shorter data.seq_len" in out
    # every layer's activations kept for the whole batch: the settings listed would make it fit, and it is not said
    keep = ["engine.last_block_layers=16", "engine.chunk_sequences=16", "engine.lean_layers=0"]
    assert main(["plan", cfg, "--gpu-gib", "8", "--host-gib", "64", *keep]) == 1
    out = capsys.readouterr().out
    assert "engine.chunk_sequences=1 (the batch" in out and "none of the engine settings" not in out


def test_plan_says_each_way_out_of_a_gpu_too_small_once(tmp_path, capsys) -> None:
    """A GPU too small for one sequence: its line says why, the suggestions what would fit, each once (the
    engine settings that cannot help are not listed, and the plan does not point to itself)."""
    cfg = str(own_model(tmp_path))
    assert main(["plan", cfg, "--gpu-gib", "0.5", "--host-gib", "64", "--gpu", "H100", "data.seq_len=2048"]) == 1
    out = capsys.readouterr().out
    assert out.count("a shorter data.seq_len") == 1 and "shows the whole plan" not in out, out
    assert "engine.chunk_sequences=1" not in out
    tips = out.split("settings that need less:\n", 1)[1].splitlines()
    assert len(tips) == len(set(tips)), tips


def test_plan_takes_a_named_gpus_memory_without_gpu_gib(tmp_path, capsys) -> None:
    """--gpu NAME alone plans that GPU: its data sheet's memory as CUDA reports it, less the CUDA context; a part
    sold in several sizes is named with its size; --gpu-gib still sets the memory where given."""
    cfg = str(own_model(tmp_path))
    assert main(["plan", cfg, "--host-gib", "64", "--gpu", "H100"]) == 0
    out = capsys.readouterr().out
    assert "78.70 GiB free on the GPU (--gpu H100: 80 GB, 78.7 GiB free after the CUDA context" in out, out
    assert "H100: 989 TFLOPS nominal dense bf16" in out
    assert main(["plan", cfg, "--host-gib", "64", "--gpu", "A100"]) == 2
    err = capsys.readouterr().err
    assert "--gpu 'A100' comes with 40 or 80 GB: name it as 'A100 40GB' or 'A100 80GB', or add --gpu-gib N" in err
    assert main(["plan", cfg, "--host-gib", "64", "--gpu", "A100 40GB"]) == 0
    assert "39.10 GiB free on the GPU (--gpu A100 40GB: 40 GB" in capsys.readouterr().out
    assert main(["plan", cfg, "--host-gib", "64", "--gpu", "H100", "--gpu-gib", "40"]) == 0
    assert "40.00 GiB free on the GPU (--gpu-gib)" in capsys.readouterr().out
    assert steptime.gpu_memory_gb("rtx 4090") == (24,) and steptime.gpu_memory_gb("Voodoo 5") == ()
    assert {label for label, _, _ in steptime.GPUS} == set(steptime.GPU_MEMORY_GB)  # every GPU the plan knows


def test_plan_of_a_pretrained_directory_before_its_weights(tmp_path, capsys) -> None:
    """config.json alone: the plan is made from it and says the weights are missing; a run refuses it."""
    from transformers import LlamaConfig

    model = tmp_path / "model"
    LlamaConfig(**SMALL).save_pretrained(model)
    assert sorted(p.name for p in model.iterdir()) == ["config.json"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"model: {{pretrained: {model}}}\ndata: {{kind: tokens, path: x.bin, seq_len: 128, batch_size: 4}}\n"
    )
    assert main(["plan", str(cfg), "engine.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "llama, 4 layers" in out and "verdict: fits" in out
    assert f"model.pretrained: '{model}' holds config.json but no weights yet" in out
    tree, where = load_tree(cfg, [])
    with pytest.raises(ConfigError, match="holds no model.safetensors"):
        validate_model(tree, where)  # what a run checks


def test_a_run_estimated_at_more_than_a_day_says_so_at_its_start(tmp_path, capsys, rid: str) -> None:
    """A real run (in-process, on the CPU) of a billion steps: the warning comes before its first step, with how
    it was estimated; the first Ctrl-C then stops it."""
    import os
    import signal
    import threading

    out = tmp_path / "run"
    args = [
        str(ROOT / "examples" / "default.yaml"),
        "engine.device=cpu",
        "train.steps=1000000000",
        "train.eval_every=0",
        "train.final_eval=false",
        f"train.output_dir={out}",
        f"train.run_id={rid}",
        "launch.runner=inprocess",
    ]
    metrics = out / "metrics.jsonl"

    def stop_after_the_first_step() -> None:
        while not (metrics.is_file() and metrics.read_text().strip()):
            threading.Event().wait(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=stop_after_the_first_step, daemon=True).start()
    assert main(args) == 128 + signal.SIGINT
    said = capsys.readouterr().out
    line = next(x for x in said.splitlines() if "warning: the whole run" in x)
    assert "1,000,000,000 steps" in line and "more than a day" in line
    assert "a float32 matmul of the model's shape" in line and "FLOPs a step" in line and "GB/s" in line
    assert said.index("warning: the whole run") < said.index("step 1/")
