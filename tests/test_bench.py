"""bench/run.py's input handling (no run: these stop before anything is measured) and where the official code is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import run as bench_run
from bench.official import checkout
from megatrain.errors import ConfigError, ResourceError

ROOT = Path(__file__).resolve().parents[1]


def test_model_hf_extras_change_the_model_of_every_row(tmp_path: Path) -> None:
    """--extra model.hf.KEY=VALUE reaches the bench's own model (so --seq past its 32768 positions is allowed),
    the ablations and the peers' hf; the other extras stay with the default variant."""
    from megatrain.launch.config.tree import load_config
    from megatrain.model.spec import resolve_hf_config

    args = bench_run.parse(
        [
            "--out",
            str(tmp_path),
            "--seq",
            "40000",
            "--layers",
            "2",
            "--extra",
            "model.hf.max_position_embeddings=65536",
            "model.hf.rope_theta=5e5",
            "train.log_every=2",
        ]
    )
    args.hf, extra = bench_run.bench_model(args.model, args.layers, args.extra)
    assert extra == ["train.log_every=2"]
    default = load_config(None, bench_run.overrides(args, tmp_path, extra))
    ablation = load_config(None, bench_run.overrides(args, tmp_path, bench_run.ABLATIONS["no-clip"]))
    for cfg in (default, ablation):
        hf = resolve_hf_config(cfg.model)[1]
        assert hf.max_position_embeddings == 65536 and hf.num_hidden_layers == 2 and hf.hidden_size == 3584
        assert cfg.model.hf["rope_theta"] == 5e5
    assert default.train.log_every == 2 and ablation.train.log_every == 1
    with pytest.raises(ConfigError, match="the layer count is --layers"):
        bench_run.bench_model("qwen2.5-7b", 2, ["model.hf.num_hidden_layers=4"])
    with pytest.raises(ConfigError, match="model.hf.KEY=VALUE"):
        bench_run.bench_model("qwen2.5-7b", 2, ['model.hf={"vocab_size": 8}'])


@pytest.mark.parametrize(
    ("model", "family", "total", "active"),
    # GPT-OSS-20B's card gives 3.6B active without the input embedding (a lookup, 0.58B); 6·N·D counts it,
    # for a dense model as for this one
    [("olmoe-1b-7b", "olmoe", 6.92e9, 1.28e9), ("gpt-oss-20b", "gpt_oss", 20.9e9, 3.6e9 + 201088 * 2880)],
)
def test_the_moe_presets_are_the_published_models(
    tmp_path: Path, model: str, family: str, total: float, active: float
) -> None:
    """--model's presets build the published models' shapes (the parameter counts their model cards give, to
    1 %) as the family the product trains; their rows' TFLOPS count the active parameters."""
    from megatrain.flops import active_params
    from megatrain.launch.config.tree import load_config
    from megatrain.model.spec import build_spec

    layers = {"olmoe": 16, "gpt_oss": 24}[family]
    args = bench_run.parse(["--out", str(tmp_path), "--model", model, "--layers", str(layers)])
    args.hf, extra = bench_run.bench_model(args.model, args.layers, args.extra)
    cfg = load_config(None, bench_run.overrides(args, tmp_path, extra))
    assert cfg.model.family == family
    spec = build_spec(cfg.model)
    assert spec.layout.num_params == pytest.approx(total, rel=0.01)
    assert active_params(spec) == pytest.approx(active, rel=0.01)


def test_the_official_peer_is_refused_for_a_family_it_cannot_train(tmp_path: Path) -> None:
    proc = _bench(tmp_path, "--model", "olmoe-1b-7b", "--layers", "1", "--peers", "official")
    assert proc.returncode == 2, proc.stderr
    assert "qwen2 family only" in proc.stderr and "Traceback" not in proc.stderr


def _bench(tmp_path: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--out", str(tmp_path / "out"), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "argv, env, named",
    [
        (["--seq", "40000"], {}, "data.seq_len': 40000 exceeds model max_position_embeddings 32768"),
        (["--extra", "model.hf.num_hidden_layers=4"], {}, "the layer count is --layers"),
        (
            ["--peers", "official"],
            {checkout.ENV: "/nonexistent/official"},
            f"{checkout.ENV}=/nonexistent/official: no such directory; set --official-src PATH or {checkout.ENV}",
        ),
    ],
    ids=["seq-past-positions", "layers-in-extra", "no-official-checkout"],
)
def test_bad_input_is_one_line_and_exit_2_before_anything_runs(
    tmp_path: Path, argv: list[str], env: dict, named: str
) -> None:
    proc = _bench(tmp_path, *argv, env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("bench/run.py: error: "), proc.stderr
    assert named in lines[0]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []  # nothing measured, no error.log


def test_a_failure_is_worded_and_coded_as_the_product_does(tmp_path: Path) -> None:
    try:
        raise ResourceError("the host store needs 9.00 GiB")
    except ResourceError as exc:
        failed = bench_run.Failed.of(exc, "MegaTrain (default)", tmp_path)
    assert failed.code == 1
    assert str(failed) == f"MegaTrain (default): the host store needs 9.00 GiB (details in {tmp_path / 'error.log'})"
    assert "Traceback" in (tmp_path / "error.log").read_text()
    try:
        {}["x"]
    except KeyError as exc:
        failed = bench_run.Failed.of(exc)
    assert failed.code == 1 and str(failed) == "internal error: KeyError: 'x'"
    assert bench_run.Failed.of(ConfigError("config key 'a.b': bad")).code == 2


def _fake_checkout(path: Path) -> Path:
    for rel in checkout.NEEDED:
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text("")
    (path / "SOURCE.txt").write_text("DLYuanGod/MegaTrain 919520f07182c0d4d3e9765b2f915702e71c11a4 2026-04-18\n")
    return path


def test_the_official_checkout_comes_from_the_flag_then_the_environment_then_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag, env, default = (_fake_checkout(tmp_path / name) for name in ("flag", "env", "default"))
    monkeypatch.setattr(checkout, "DEFAULT", default)
    monkeypatch.setenv(checkout.ENV, str(env))
    assert checkout.official_src(str(flag)) == flag.resolve()
    assert checkout.official_src() == env.resolve()
    monkeypatch.delenv(checkout.ENV)
    assert checkout.official_src() == default.resolve() and checkout.commit_of(default) == "919520f"
    (default / checkout.NEEDED[0]).unlink()
    with pytest.raises(checkout.MissingCheckout, match=rf"the default .*: not a checkout .*no {checkout.NEEDED[0]}"):
        checkout.official_src()
    monkeypatch.setattr(checkout, "DEFAULT", tmp_path / "absent")
    with pytest.raises(
        checkout.MissingCheckout,
        match=rf"{tmp_path / 'absent'} does not exist: set "
        rf"--official-src PATH or {checkout.ENV} to a checkout",
    ):
        checkout.official_src()
    with pytest.raises(checkout.MissingCheckout, match=rf"--src {tmp_path}: not a checkout"):
        checkout.official_src(str(tmp_path), "--src")


def test_the_repository_holds_no_copy_of_the_official_code() -> None:
    """Only our glue is in bench/official; their code is a checkout elsewhere (checkout.py)."""
    here = sorted(p.name for p in (ROOT / "bench" / "official").iterdir() if p.name != "__pycache__")
    assert here == ["README.md", "bench_official.py", "checkout.py", "make_model.py", "run_official.sh"]


def test_a_peer_rank_the_kernel_kills_is_the_rows_result_not_the_benchs_end() -> None:
    """DeepSpeed runs in spawned ranks (one with one GPU): a SIGKILL, the OOM killer's signal, becomes the
    row's status, naming the signal."""
    from bench.peers import spawn_ranks
    from tests.spawned import killed_rank

    res = spawn_ranks("peer", killed_rank, (), 2)
    assert isinstance(res, dict) and res["status"].startswith("error: rank 1 killed by SIGKILL"), res
    assert "OOM killer" in res["status"]


@pytest.mark.parametrize(("model", "total"), [("qwen2.5-14b", 14.77e9), ("qwen2.5-72b", 72.7e9)])
def test_the_dense_width_presets_are_the_published_models(tmp_path: Path, model: str, total: float) -> None:
    """The width study's presets: Qwen2.5-14B (48 layers) and Qwen2.5-72B (80 layers) at their model cards'
    parameter counts, to 1 %."""
    from megatrain.launch.config.tree import load_config
    from megatrain.model.spec import build_spec

    layers = {"qwen2.5-14b": 48, "qwen2.5-72b": 80}[model]
    args = bench_run.parse(["--out", str(tmp_path), "--model", model, "--layers", str(layers)])
    args.hf, extra = bench_run.bench_model(args.model, args.layers, args.extra)
    spec = build_spec(load_config(None, bench_run.overrides(args, tmp_path, extra)).model)
    assert spec.layout.num_params == pytest.approx(total, rel=0.01)


def test_the_depth_study_is_the_deepest_the_plan_fits_on_each_host(capsys) -> None:
    """bench/capacity.py --width: on each host the deepest model of the width fits by the plan and one layer
    more does not, deeper on a larger host, and the host need it prints is the least (no spare slots, which
    would fill any host). The plan alone: no GPU here."""
    from bench import capacity

    deepest = {h: capacity.most_layers("7B", h, 4, 4096) for h in (64.0, 128.0)}
    assert 0 < deepest[64.0] < deepest[128.0]
    for host, layers in deepest.items():
        assert capacity.plan("7B", layers, host, capacity.H200_FREE, 4, 4096).host_fits()
        assert not capacity.plan("7B", layers + 1, host, capacity.H200_FREE, 4, 4096).host_fits()
    capacity.main(["--width", "7B", "--hosts", "64", "--batch", "4"])
    need = sum(capacity.plan("7B", deepest[64.0], 1024.0, capacity.H200_FREE, 4, 4096).host.values())
    assert f"| 64 GiB | {deepest[64.0]} layers |" in (out := capsys.readouterr().out)
    assert f"| {need / 2**30:.0f} GiB |" in out and need < 64 * 2**30
