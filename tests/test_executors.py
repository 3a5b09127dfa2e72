"""Several executors over one host store (actors.num_gpus): on the CPU device each is an executor with its
rows of the batch, the gradients summed through torch.distributed's gloo, one Adam. 10 steps equal the
plain HF model + torch.optim.AdamW on the whole batch (clipping by the global norm over the summed
gradient included); an executor killed mid-run stops the run with it named; a checkpoint resumes on
another count; what cannot run is refused by name."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from megatrain.collective import split_rows
from megatrain.errors import ConfigError, MegatrainError
from megatrain.ipc.messages import StepReport
from megatrain.launch.cli.fidelity import compare
from megatrain.launch.config.tree import load_config
from megatrain.launch.control.placement import ActorsConfig, demands, resolve_executors, roster_for
from megatrain.launch.run.driver import Trainer
from tests.harness import Cli, check, final_weights, tiny_config

CASES = [
    # family, tied, K, executors, extra
    ("llama", False, 2, 2, []),
    ("qwen2", True, 1, 3, ["engine.chunk_sequences=1"]),  # rows 2/1/1; each executor's rows in chunks
    ("mistral", False, 3, 2, ["optim.max_grad_norm=0", "engine.last_block_layers=3", "engine.lean_layers=2"]),
]
MOE_CASES = [
    ("mixtral", True, 2, 2, ["engine.chunk_sequences=1"]),  # routing counted over every chunk, then summed
    ("qwen3_moe", False, 1, 3, []),
]


@pytest.mark.parametrize("family,tied,k,n,extra", CASES, ids=[f"{c[0]}-x{c[3]}" for c in CASES])
def test_executors_match_one_model_on_the_whole_batch(
    tmp_path, family: str, tied: bool, k: int, n: int, extra: list[str]
) -> None:
    rep = compare(tiny_config(family, tied, k, tmp_path, extra=[f"actors.num_gpus={n}", *extra]), tmp_path)
    check(rep, tied)
    s = rep["summary"]
    assert s.staging == "resident" and s.executors == n
    assert {f"gpu-executor-{r}" for r in range(1, n)} <= set(s.pids)
    assert not any(name.startswith(("packer", "grad-accumulator")) for name in s.pids)
    row = s.metrics[-1]
    assert len(row["executor_compute_s"]) == n and row["tokens"] == 4 * 31  # every row's labels, once


@pytest.mark.parametrize("family,tied,k,n,extra", MOE_CASES, ids=[f"{c[0]}-x{c[3]}" for c in MOE_CASES])
def test_executors_match_one_moe_model_with_the_whole_batch_s_routing(
    tmp_path, family: str, tied: bool, k: int, n: int, extra: list[str]
) -> None:
    """The load-balancing loss is HF's over the whole batch: each executor's router counts are summed over
    the executors before any aux gradient is taken (megatrain/layers/moe.py)."""
    rep = compare(tiny_config(family, tied, k, tmp_path, extra=[f"actors.num_gpus={n}", *extra]), tmp_path)
    check(rep, tied)
    for step, (ours, ref) in enumerate(zip(rep["aux_losses"], rep["ref_aux_losses"])):
        assert abs(ours - ref) <= 1e-5 * abs(ref), f"step {step + 1}: aux {ours} vs {ref}"
    load = rep["summary"].metrics[-1]["expert_load"]
    assert all(sum(row) == 4 * 32 * 2 for row in load)  # the whole batch's top-2 assignments per layer


def test_a_checkpoint_resumes_on_another_executor_count(tmp_path, capsys) -> None:
    """The store, the data order and the step do not depend on the count: 6 steps on 2 executors, or 3 and
    then 3 more on 1 executor from the step-3 checkpoint, end with the same weights (the summed gradients
    differ only in the order of one fp32 addition)."""

    def run(out: str, n: int, *extra: str) -> Path:
        cfg = tiny_config(
            "llama",
            False,
            2,
            tmp_path,
            steps=6,
            extra=[f"actors.num_gpus={n}", f"train.output_dir={tmp_path}/{out}", "train.save_final=true", *extra],
        )
        Trainer(cfg).run()
        return tmp_path / out

    whole = final_weights(run("whole", 2))
    part = run("part", 2, "train.save_every=3", "train.steps=3")
    assert "2 executors: gradients summed through torch.distributed (gloo) into executor 0" in capsys.readouterr().out
    resumed = final_weights(run("part", 1, "train.resume=auto", "train.overwrite=true"))
    out = capsys.readouterr().out
    assert "resuming a run of actors.num_gpus 2 with 1" in out
    assert "gradients summed" not in out  # one executor forms no process group: nothing to sum
    rows = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for name, w in whole.items():
        assert torch.allclose(resumed[name], w, rtol=1e-5, atol=1e-7), name


def test_what_several_executors_cannot_run_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"actors\.num_gpus must be auto or >= 1"):
        load_config(None, ["actors.num_gpus=0"])
    with pytest.raises(ConfigError, match=r"data\.batch_size.: 2 is split .*actors\.num_gpus 3"):
        load_config(None, ["actors.num_gpus=3", "data.batch_size=2"])
    with pytest.raises(ConfigError, match=r"ipc\.staging.*slabs .*actors\.num_gpus 2 needs the resident copy"):
        load_config(None, ["actors.num_gpus=2", "ipc.staging=slabs"])
    assert load_config(None, ["train.profile.actor=gpu-executor-1"]).train.profile.actor == "gpu-executor-1"
    with pytest.raises(ConfigError, match=r"'gpu-executor-x' is not an actor"):
        load_config(None, ["train.profile.actor=gpu-executor-x"])
    with pytest.raises(ConfigError, match=r"actors\.num_gpus 4: the node with the most GPUs has 2"):
        resolve_executors(ActorsConfig(num_gpus=4), cuda=True, gpus=2)
    assert resolve_executors(ActorsConfig(num_gpus="auto"), cuda=True, gpus=8) == 8
    assert resolve_executors(ActorsConfig(num_gpus="auto"), cuda=False, gpus=0) == 1
    roster = roster_for(ActorsConfig(num_gpus=2), cuda=True, clip=True, writer=False, staging="resident", executors=2)
    d = demands(roster)
    assert d["gpu-executor"].gpus + d["gpu-executor-1"].gpus == 2.0 and "packer-0" not in d


def test_rows_and_results_are_split_and_merged() -> None:
    assert split_rows(5, 2) == [slice(0, 3), slice(3, 5)]
    assert split_rows(4, 3) == [slice(0, 2), slice(2, 3), slice(3, 4)]
    with pytest.raises(MegatrainError, match="4 executors"):
        split_rows(3, 4)
    zero = dict.fromkeys(("weight_wait_s", "grad_wait_s", "d2h_bytes", "forward_s", "head_s", "backward_s"), 0)
    parts = [
        StepReport(loss=1.5, tokens=10, compute_s=2.0, gpu_peak_bytes=5, h2d_bytes=7, aux_loss=0.3, **zero),
        StepReport(loss=0.5, tokens=6, compute_s=3.0, gpu_peak_bytes=4, h2d_bytes=7, aux_loss=0.3, **zero),
    ]
    got = StepReport.merge(parts).row()
    assert (got["loss"], got["tokens"], got["compute_s"], got["gpu_peak_bytes"], got["h2d_bytes"]) == (2, 16, 3, 5, 14)
    assert got["aux_loss"] == 0.3 and got["executor_compute_s"] == [2.0, 3.0]


@pytest.mark.slow
def test_a_killed_executor_stops_the_run_with_it_named(tmp_path: Path) -> None:
    """Through Ray, one process per executor: executor 1 SIGKILLed mid-run; executor 0, waiting in a
    reduction it can never finish, is released by the abort and the run ends naming the dead one."""
    cli = Cli(tmp_path, "actors.num_gpus=2", "engine.device=cpu", "train.save_every=0", steps=10_000)
    pids = cli.actor_pids()
    cli.wait_for(r"first step done")
    os.kill(pids["gpu-executor-1"], signal.SIGKILL)
    assert cli.finish() == 1, cli.text()
    assert "gpu-executor-1" in "".join(cli.stderr), cli.text()
    cli.assert_clean()


def test_the_plan_sizes_each_gpu_for_its_share_and_counts_every_executor() -> None:
    from megatrain.launch.config.memplan import GIB, Host, make_plan

    hf = json.dumps({"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "vocab_size": 32000})
    base = ["model.family=qwen2", f"model.hf={hf}", "data.seq_len=512", "data.kind=tokens", "data.path=x.bin"]
    host = Host(ram=64 * GIB, total=64 * GIB, shm=64 * GIB, threshold=None)
    one = make_plan(load_config(None, [*base, "data.batch_size=8"]), 20 * GIB, True, host)
    two = make_plan(load_config(None, [*base, "data.batch_size=16", "actors.num_gpus=2"]), 20 * GIB, True, host)
    assert "over 2 executors (at most 8 sequences each)" in two.title
    assert two.host["process: gpu-executor-1"] == two.host["process: gpu-executor"]
    assert "shm: resident" in two.host and two.host["shm: params"] == one.host["shm: params"]
    extra = {k: v for k, v in two.gpu.items() if k not in one.gpu}
    assert list(extra) == ["fp32 gradients awaiting the executors' sum"]
    layer = next(k for k in one.gpu if k.startswith("activations of"))
    assert "(4096 tokens each)" in layer and two.gpu[layer] == one.gpu[layer]  # 8 sequences of 512 on each GPU
