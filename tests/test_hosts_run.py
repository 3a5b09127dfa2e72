"""A run over several hosts (actors.num_hosts), each host its own store, Adam updater and executors, simulated
in one process by the in-process runner: host h holds slice h of the fp32 master weights and Adam moments and
the whole resident copy; the gradients are summed over every executor and split among the hosts, each host
updates its slice, and the updated slices are gathered into every host's copy. Ten steps equal the plain HF
model + torch.optim.AdamW on the whole batch, clipping by the global norm included, and the final weights are
exported whole though no host holds them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatrain.errors import ConfigError
from megatrain.formats import checkpoint as ckpt
from megatrain.ipc.shared.shm import host_run_id
from megatrain.launch.cli.fidelity import compare
from megatrain.launch.config.tree import load_config
from megatrain.launch.run.driver import Trainer
from tests.harness import ROOT, check, final_weights, run_leftovers, tiny_config

CASES = [
    # family, tied, K, hosts, executors per host, extra
    ("llama", False, 2, 2, 1, []),
    ("qwen2", True, 1, 3, 1, ["engine.chunk_sequences=1"]),  # rows 2/1/1 over three hosts
    ("mistral", False, 3, 2, 1, ["optim.max_grad_norm=0", "engine.last_block_layers=3"]),  # no clipping
    ("llama", False, 2, 2, 2, []),  # two hosts of two executors: every executor one row
]
MOE_CASES = [("qwen3_moe", False, 1, 2, 1, []), ("mixtral", True, 2, 3, 1, [])]


def _run(tmp_path, family: str, tied: bool, k: int, hosts: int, gpus: int, extra: list[str]) -> dict:
    cfg = tiny_config(family, tied, k, tmp_path, extra=[f"actors.num_hosts={hosts}", f"actors.num_gpus={gpus}", *extra])
    rep = compare(cfg, tmp_path)
    check(rep, tied)
    s = rep["summary"]
    assert s.hosts == hosts and s.staging == "resident"
    assert {f"store-owner@host{h}" for h in range(1, hosts)} <= set(s.pids)
    assert {f"adam-updater@host{h}" for h in range(1, hosts)} <= set(s.pids)
    # every host's store fill and memory, host 0's first (each holds its store's processes)
    assert len(s.fills) == hosts and len({f.source for f in s.fills}) == 1
    assert len(s.memory) == hosts and all(m.processes >= 2 for m in s.memory)
    row = s.metrics[-1]
    assert len(row["executor_compute_s"]) == hosts * gpus and row["tokens"] == 4 * 31
    for h in range(1, hosts):
        assert run_leftovers(host_run_id(s.run_id, h)) == []
    return rep


@pytest.mark.parametrize("family,tied,k,hosts,gpus,extra", CASES, ids=[f"{c[0]}-{c[3]}x{c[4]}" for c in CASES])
def test_hosts_match_one_model_on_the_whole_batch(tmp_path, family, tied, k, hosts, gpus, extra) -> None:
    _run(tmp_path, family, tied, k, hosts, gpus, extra)


@pytest.mark.parametrize("family,tied,k,hosts,gpus,extra", MOE_CASES, ids=[f"{c[0]}-{c[3]}x{c[4]}" for c in MOE_CASES])
def test_hosts_match_one_moe_model_with_the_whole_batch_s_routing(
    tmp_path, family, tied, k, hosts, gpus, extra
) -> None:
    """The router statistics (the load-balancing loss) are summed over every executor of every host."""
    _run(tmp_path, family, tied, k, hosts, gpus, extra)


def test_what_several_hosts_cannot_run_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"actors\.num_hosts must be auto or >= 1"):
        load_config(None, ["actors.num_hosts=0"])
    with pytest.raises(ConfigError, match=r"data\.batch_size.: 4 is split by rows over .*actors\.num_hosts 3 hosts"):
        load_config(None, ["actors.num_hosts=3", "actors.num_gpus=2", "data.batch_size=4"])
    with pytest.raises(ConfigError, match=r"ipc\.staging.*no host of actors\.num_hosts 2 holds"):
        load_config(None, ["actors.num_hosts=2", "ipc.staging=slabs"])


@pytest.mark.parametrize("then", [1, 3])
def test_a_two_host_checkpoint_resumes_on_another_host_count(tmp_path, capsys, then: int) -> None:
    """Each host writes its part of the checkpoint (its slices); a resume on one host or on three re-slices it
    exactly: 6 steps on 2 hosts, or 3 on 2 and then 3 more on `then` hosts, end with the same weights."""

    def run(out: str, hosts: int, *extra: str) -> Path:
        over = [f"actors.num_hosts={hosts}", f"train.output_dir={tmp_path}/{out}", "train.save_final=true", *extra]
        Trainer(tiny_config("llama", False, 2, tmp_path, steps=6, extra=over)).run()
        return tmp_path / out

    whole = final_weights(run("whole", 2))
    part = run("part", 2, "train.save_every=3", "train.steps=3")
    assert sorted(p.name for p in (ckpt.step_dir(part / "checkpoints", 3)).iterdir() if p.is_dir()) == [
        "host-0",
        "host-1",
    ]
    resumed = final_weights(run("part", then, "train.resume=auto", "train.overwrite=true"))
    rows = [json.loads(x) for x in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for name, w in whole.items():
        assert torch.allclose(resumed[name], w, rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("hosts", [1, 2])
def test_the_final_save_gathers_each_unit_in_chunks(tmp_path, capsys, monkeypatch, hosts: int) -> None:
    """The final save moves each host's slice of a unit in chunks (through Ray, each an object of its store):
    chunks of a few hundred values, one ending exactly at a slice's end or not, give the same weights."""
    from megatrain.launch.run import checkpoints

    def run(out: str) -> dict:
        over = [f"actors.num_hosts={hosts}", f"train.output_dir={tmp_path}/{out}", "train.save_final=true"]
        Trainer(tiny_config("llama", False, 2, tmp_path, steps=2, extra=over)).run()
        return final_weights(tmp_path / out)

    whole = run("whole")
    monkeypatch.setattr(checkpoints, "CHUNK_ELEMS", 777)
    chunked = run("chunked")
    assert whole.keys() == chunked.keys()
    for name, w in whole.items():
        assert torch.equal(chunked[name], w), name


def test_a_two_host_checkpoint_exports_whole_and_a_corrupt_part_is_refused(tmp_path, capsys) -> None:
    """`megatrain-launch export` puts each unit together from every host's part: the weights equal the run's own
    final export; a byte changed in host 1's file is refused by name before anything is written."""
    from megatrain.launch.cli.main import main

    over = ["actors.num_hosts=2", "train.save_every=3", "train.save_final=true"]
    run_dir = Path(Trainer(tiny_config("llama", False, 2, tmp_path, steps=3, extra=over)).run().output_dir)
    step = ckpt.step_dir(run_dir / "checkpoints", 3)
    assert main(["export", str(step), str(tmp_path / "hf" / "final")]) == 0
    final = final_weights(run_dir)
    exported = final_weights(tmp_path / "hf")
    assert exported.keys() == final.keys()
    for name, w in final.items():
        assert torch.equal(exported[name], w), name
    data = bytearray((step / "host-1" / "params.bin").read_bytes())
    data[100] ^= 0xFF
    (step / "host-1" / "params.bin").write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["export", str(step), str(tmp_path / "hf2")]) == 2
    assert "host-1/params.bin" in capsys.readouterr().err
    assert not (tmp_path / "hf2").exists() or not any((tmp_path / "hf2").iterdir())


def test_a_run_id_too_long_for_the_last_host_is_refused_by_name(tmp_path, capsys) -> None:
    """Host h's store is named after the run id with `h<h>`: a run id with no room for it is refused before
    anything starts, naming the key."""
    from megatrain.launch.cli.main import main

    args = ["actors.num_hosts=2", f"train.run_id={'a' * 32}", f"train.output_dir={tmp_path}/out"]
    assert main([str(ROOT / "examples" / "default.yaml"), *args]) == 2
    err = capsys.readouterr().err
    assert "train.run_id" in err and "actors.num_hosts 2" in err and not (tmp_path / "out").exists()
