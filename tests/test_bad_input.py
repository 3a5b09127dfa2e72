"""Every bad input of the README's *Failures* list through `megatrain-launch` (main() in this process,
so the suite stays fast): exit 2, one line naming the key or file and the value, no traceback, and
nothing started or left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from megatrain.launch.cli import main as cli
from megatrain.launch.config.tree import load_config
from tests.harness import ROOT, TINY, run_leftovers, started_since
from tests.model_fixtures import tiny_hf

DEFAULT = str(ROOT / "examples/default.yaml")


def launch(capsys, *argv: str) -> tuple[int, str]:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code = cli.main(list(argv))
    err = capsys.readouterr().err
    left = started_since(before)
    assert not left, f"processes started and left: {left}"
    assert "Traceback" not in err
    return code, err


def usage_error(capsys, *argv: str, ray: bool = False) -> str:
    """The run refused with exit 2 and one line. A refusal of the model's checks or of the data comes after the
    actors were spawned beside them (launch/prepare/inputs.py): with the in-process runner here (the test's own
    overrides come after it, so a bad launch.runner is still the one checked), with Ray where `ray`."""
    if not ray:
        argv = (argv[0], "launch.runner=inprocess", *argv[1:])
    code, err = launch(capsys, *argv)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "overrides, expect",
    [
        (["engine.checkpoint_interval=0"], ["command line 'engine.checkpoint_interval=0'", "0 is not allowed"]),
        (["engine.checkpoint_interval=3"], ["'engine.checkpoint_interval=3'", "3 exceeds the model's 2 layers"]),
        (["model.hf.num_hiden_layers=2"], ["model.hf.num_hiden_layers", "did you mean 'model.hf.num_hidden_layers'"]),
        (["model.hf.attention_dropout=0.1"], ["'model.hf.attention_dropout=0.1'", "dropout is not supported"]),
        (['model.hf={"hiden_size": 64}'], ["model.hf.hiden_size", "did you mean 'model.hf.hidden_size'"]),
        (["optim.lrr=1"], ["optim.lrr", "did you mean 'optim.lr'"]),
        (["train.steps=ten"], ["train.steps", "expected an integer, got 'ten'"]),
        (["train.run_id=Bad_Id"], ["train.run_id", "'Bad_Id'", "lowercase"]),
        (["data.seq_len=100000"], ["data.seq_len", "100000 exceeds", "max_position_embeddings"]),
        (
            ["data.kind=text", "data.path=/nonexistent/corpus.jsonl", "data.tokenizer=/nonexistent/tok"],
            ["/nonexistent"],
        ),
        (
            ["model.pretrained=/nonexistent/model"],
            ["command line 'model.pretrained=/nonexistent/model': model.pretrained: '/nonexistent/model' does not"],
        ),
        (
            ["data.kind=tokens", "data.path=/nonexistent/t.bin"],
            ["command line 'data.path=/nonexistent/t.bin': data.path: file '/nonexistent/t.bin' does not exist"],
        ),
        (["launch.runner=threads"], ["launch.runner", "'threads'"]),
        (["nonsense"], ["'nonsense'", "dotted.key=value"]),
        # A check that speaks of two keys names the one that is wrong, with its value and where it was set.
        (["data.batch_size=0"], ["command line 'data.batch_size=0': config key 'data.batch_size': 0 is not allowed"]),
        (["optim.lr=-1e-3"], ["command line 'optim.lr=-1e-3': config key 'optim.lr': -0.001 is not allowed"]),
        (["optim.eps=0"], ["command line 'optim.eps=0': config key 'optim.eps': 0.0 is not allowed"]),
        (["ipc.poll_s=0"], ["command line 'ipc.poll_s=0': config key 'ipc.poll_s': 0.0 is not allowed"]),
    ],
)
def test_bad_config_values(capsys, overrides: list[str], expect: list[str]) -> None:
    err = usage_error(capsys, DEFAULT, *overrides)
    for text in expect:
        assert text in err, (text, err)


def test_a_missing_file_names_the_line_that_set_its_key(capsys, tmp_path: Path) -> None:
    """Errors raised where the key's origin is unknown (the data, the model's files) say where it was set too."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  family: llama\n  pretrained: /nonexistent/model\n")
    err = usage_error(capsys, str(cfg))
    assert f"{cfg}:3: model.pretrained: '/nonexistent/model' does not exist" in err, err
    cfg.write_text("data:\n  kind: tokens\n  path: /nonexistent/t.bin\n")
    err = usage_error(capsys, str(cfg))
    assert f"{cfg}:3: data.path: file '/nonexistent/t.bin' does not exist" in err, err


def test_a_message_about_a_key_left_at_its_default_is_not_given_a_place(tmp_path: Path) -> None:
    from megatrain.config.base import Where, locate
    from megatrain.launch.config.tree import Config

    where = Where(str(tmp_path / "c.yaml"), "data:\n  path: x.bin\n", {"train.steps": "train.steps=3"})
    assert locate("data.path: gone", where, Config) == f"{tmp_path / 'c.yaml'}:2: data.path: gone"
    assert locate("train.steps: 3", where, Config) == "command line 'train.steps=3': train.steps: 3"
    assert locate("data.tokenizer: gone", where, Config) == "data.tokenizer: gone"  # not set: no place to name
    assert locate("x.bin: not a token file", where, Config) == "x.bin: not a token file"  # a file, not a key


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA device")
def test_cuda_without_a_gpu_blames_engine_device_where_it_was_set(capsys, tmp_path: Path, ray_cluster) -> None:
    """Not actors.num_gpus, which the user never set: in process, and on a Ray cluster with no GPU node."""
    hf = f"model.hf={json.dumps({**TINY, 'num_hidden_layers': 2})}"
    out = f"train.output_dir={tmp_path / 'o'}"
    for ray in (False, True):
        err = usage_error(capsys, DEFAULT, "engine.device=cuda", hf, out, ray=ray)
        assert "command line 'engine.device=cuda': engine.device: cuda, but no CUDA device is visible" in err, err
        assert "actors.num_gpus" not in err, err
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  family: llama\nengine:\n  checkpoint_interval: 1\n  device: cuda\n")
    err = usage_error(capsys, str(cfg), hf, out)
    assert f"{cfg}:5: engine.device: cuda, but no CUDA device" in err, err
    assert not (tmp_path / "o").exists()


def test_a_ray_start_that_times_out_says_so_and_what_to_do(capsys, tmp_path: Path, monkeypatch) -> None:
    """Ray's own start-up wait running out (a machine busy with other work): one line, exit 1, how long it
    waited, that the machine may be overloaded, and to run again."""
    import ray

    def slow_start(**_kw):
        raise Exception("The current node timed out during startup. This could happen because some of the raylet")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # not the session's instance: a start of its own
    monkeypatch.setattr(ray, "init", slow_start)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the launcher would set it for the instance it starts
    hf = f"model.hf={json.dumps({**TINY, 'num_hidden_layers': 2})}"
    code, err = launch(capsys, DEFAULT, hf, f"train.output_dir={tmp_path / 'o'}")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "Ray did not start within 0 s (The current node timed out during startup" in err, err
    assert "this machine may be overloaded (load average " in err and "run the command again" in err, err
    assert not (tmp_path / "o").exists()


def test_bad_yaml_names_file_and_line(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  family: llama\ntrain:\n  steps: 10\n  stepz: 3\n")
    err = usage_error(capsys, str(bad))
    assert f"{bad}:5" in err and "train.stepz" in err and "did you mean 'train.steps'" in err
    (tmp_path / "hf.yaml").write_text("model:\n  hf:\n    hidden_size: 64\n    num_hiden_layers: 2\n")
    err = usage_error(capsys, str(tmp_path / "hf.yaml"))
    assert f"{tmp_path / 'hf.yaml'}:4" in err and "model.hf.num_hiden_layers" in err


def test_a_range_check_names_the_file_line_of_its_key(capsys, tmp_path: Path) -> None:
    """Not the section's header line, nor another key the same check speaks of."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "model:\n  family: llama\ndata:\n  seq_len: 64\n  batch_size: 0\noptim:\n  weight_decay: 0.1\n  lr: -1.0e-3\n"
    )
    err = usage_error(capsys, str(bad))
    assert f"{bad}:5: config key 'data.batch_size': 0 is not allowed" in err, err
    err = usage_error(capsys, str(bad), "data.batch_size=2")
    assert f"{bad}:8: config key 'optim.lr': -0.001 is not allowed" in err, err


def test_a_token_file_of_part_tokens_says_so_and_creates_nothing(capsys, tmp_path: Path) -> None:
    """A raw token file whose size is not a whole number of data.token_dtype tokens: named in those terms (the
    dtype, the size, the remainder); the refused run leaves no output directory, not even an error.log."""
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(bytes(range(7)) * 3)  # 21 bytes: 5 uint32 tokens and 1 byte
    out = tmp_path / "runs" / "r1"
    err = usage_error(
        capsys, DEFAULT, "data.kind=tokens", f"data.path={tokens}", "data.token_dtype=uint32", f"train.output_dir={out}"
    )
    assert f"{tokens}: 21 bytes is not a whole number of data.token_dtype uint32 tokens (4 bytes each)" in err, err
    assert "5 tokens and 1 byte(s) left over" in err, err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("text", ["", "# only a comment\n", "[1, 2]\n", "model: [\n"])
def test_empty_or_malformed_config_file(capsys, tmp_path: Path, text: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(text)
    assert str(f) in usage_error(capsys, str(f))


def test_missing_config_file(capsys, tmp_path: Path) -> None:
    assert str(tmp_path / "nope.yaml") in usage_error(capsys, str(tmp_path / "nope.yaml"))


def test_output_dir_of_another_run_is_refused_and_left_alone(capsys, tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    err = usage_error(capsys, DEFAULT, f"train.output_dir={out}")
    assert "train.output_dir" in err and str(out) in err and "2 steps" in err and "train.overwrite=true" in err
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]  # no error.log written into it


def test_output_dir_that_is_a_file(capsys, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert "train.output_dir" in usage_error(capsys, DEFAULT, f"train.output_dir={tmp_path / 'f'}")


def test_run_id_of_a_live_run(capsys, tmp_path: Path, rid: str, model_spec) -> None:
    from megatrain.ipc.protocol import Store
    from tests.shm_fixtures import make_spec

    store = Store.create(make_spec(rid, model_spec))  # this process owns it: a live run
    try:
        err = usage_error(capsys, DEFAULT, f"train.run_id={rid}", f"train.output_dir={tmp_path / 'o'}")
        assert f"train.run_id '{rid}' is in use by a live run (store owner pid {os.getpid()})" in err
    finally:
        store.unlink()


def test_truncated_safetensors_is_named(capsys, tmp_path: Path) -> None:
    model = tiny_hf("llama", tied=False, layers=2)
    model.save_pretrained(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    capsys.readouterr()  # save_pretrained's progress bar
    hf = json.dumps({"num_hidden_layers": 2})
    err = usage_error(capsys, DEFAULT, f"model.pretrained={tmp_path / 'm'}", f"model.hf={hf}", "data.seq_len=64")
    assert str(weights) in err and "truncated" in err


def test_unreachable_ray_address_names_the_key(tmp_path: Path) -> None:
    # Its own process: in this one the session's Ray instance may be up already (the next test's case).
    hf = json.dumps({**TINY, "num_hidden_layers": 2})
    argv = [DEFAULT, "--address", "127.0.0.1:9", f"train.output_dir={tmp_path / 'o'}", f"model.hf={hf}"]
    proc = subprocess.run(
        [sys.executable, "-m", "megatrain.launch.cli.main", *argv], capture_output=True, text=True, timeout=300
    )
    err = proc.stderr
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "--address / launch.address '127.0.0.1:9'" in err and "no Ray GCS answers at 127.0.0.1:9" in err


def test_an_address_other_than_the_connected_cluster_is_refused(capsys, tmp_path: Path, ray_cluster) -> None:
    """ray.init called before the run (a notebook): an explicit address naming another cluster is refused, not
    silently replaced by the connected one."""
    connected = ray_cluster.get_runtime_context().gcs_address
    err = usage_error(
        capsys,
        DEFAULT,
        "--address",
        "127.0.0.1:9",
        f"train.output_dir={tmp_path / 'o'}",
        f"model.hf={json.dumps({**TINY, 'num_hidden_layers': 2})}",
        ray=True,
    )
    assert (
        "--address / launch.address '127.0.0.1:9'" in err
        and f"already connected to the Ray cluster at {connected}" in err
    )
    assert not (tmp_path / "o").exists()


def test_addresses_naming_one_endpoint() -> None:
    from megatrain.launch.control.cluster import _same_endpoint

    assert _same_endpoint("localhost:6379", "127.0.0.1:6379") and _same_endpoint("10.0.0.5:1", "10.0.0.5:1")
    assert not _same_endpoint("127.0.0.1:6379", "127.0.0.1:6380") and not _same_endpoint("auto", "127.0.0.1:6379")


def test_fidelity_reports_a_bad_key_in_one_line(capsys) -> None:
    from megatrain.launch.cli import fidelity

    assert fidelity.main([DEFAULT, "optim.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert "optim.lrr" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_nothing_of_a_refused_run_is_in_shm(capsys, tmp_path: Path, rid: str) -> None:
    usage_error(capsys, DEFAULT, f"train.run_id={rid}", "model.hf.num_hiden_layers=2", ray=True)
    assert run_leftovers(rid) == []


def test_sizes_refused_while_the_store_is_made_leave_nothing(capsys, tmp_path: Path, rid: str, monkeypatch) -> None:
    """The store is made while the driver chooses the engine's sizes (the executor's free GPU memory):
    a refusal then (here on the CPU device, forced) is one line, exit 1, and the store being made and
    filled is released with everything else."""
    import threading
    import time

    from megatrain.errors import ResourceError
    from megatrain.launch.run import startup
    from megatrain.memory import autosize

    made: list[bool] = []  # for each refusal: whether the store was being made then

    def refuse(*_a, **_k):
        deadline = time.monotonic() + 120  # the owner is inside create() once its first segment exists
        while not run_leftovers(rid) and time.monotonic() < deadline:
            time.sleep(0.01)
        made.append(bool(run_leftovers(rid)))
        raise ResourceError("the GPU cannot hold one sequence (forced by the test)")

    class Refusing:
        """autosize as the run's start-up sees it, refusing; the driver's memory plan before the store is made
        (megatrain/memory) keeps the real one, so the refusal comes while the store is made, not before."""

        choose = staticmethod(refuse)

        def __getattr__(self, name: str):  # noqa: ANN204
            return getattr(autosize, name)

    monkeypatch.setattr(startup, "autosize", Refusing())
    threads = threading.active_count()
    code, err = launch(
        capsys,
        DEFAULT,
        f"train.run_id={rid}",
        f"train.output_dir={tmp_path / 'run'}",
        "launch.runner=inprocess",
        "model.hf.num_hidden_layers=2",
    )
    assert code == 1 and "cannot hold one sequence" in err and len(err.strip().splitlines()) == 1, err
    assert made == [True] and run_leftovers(rid) == []
    deadline = time.monotonic() + 60  # the fill stops at its next unit once the run is shut down
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= threads


@pytest.mark.parametrize(
    "family, key, value, fix",
    [
        ("mixtral", "router_jitter_noise", 0.1, 0),
        ("llama", "attention_dropout", 0.1, 0),
        ("qwen2", "rms_norm_eps", "tiny", 1e-6),  # HF's own check of the value's type
    ],
)
def test_a_value_from_the_pretrained_config_json_is_named_there(
    capsys, tmp_path: Path, family: str, key: str, value, fix
) -> None:
    """A value that model.pretrained's config.json holds is named with that file, the key's line and the key,
    not with the run's config file, which does not hold it; set in the run's config, it is named there, and
    model.hf over the config.json's value is what is read."""
    tiny_hf(family, tied=False, layers=2).save_pretrained(tmp_path / "m")
    capsys.readouterr()  # save_pretrained's progress bar
    config = tmp_path / "m" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), key: value}, indent=2))
    line = next(i for i, text in enumerate(config.read_text().splitlines(), 1) if text.strip().startswith(f'"{key}"'))
    run = tmp_path / "run.yaml"
    run.write_text(f"model:\n  pretrained: {tmp_path / 'm'}\n  hf: {{}}\ndata:\n  seq_len: 32\n")
    err = usage_error(capsys, str(run))
    assert f"{config}:{line}: key '{key}' of model.pretrained's config.json: " in err, err
    assert str(run) not in err
    assert load_config(run, [f"model.hf.{key}={fix}"]).model.pretrained == str(tmp_path / "m")

    run.write_text(run.read_text().replace("hf: {}", f"hf:\n    {key}: {json.dumps(value)}"))
    err = usage_error(capsys, str(run))
    assert f"{run}:4: config key 'model.hf.{key}': " in err and str(config) not in err, err
