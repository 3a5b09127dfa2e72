"""The config tree: YAML + dotted overrides, errors that name key and location, cross-section checks."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from megatrain.config.base import dump_yaml, reference
from megatrain.errors import ConfigError, MegatrainError
from megatrain.launch.config.tree import Config, load_config, validate

DEFAULT_YAML = Path(__file__).resolve().parents[1] / "examples" / "default.yaml"


@pytest.fixture
def write_yaml(tmp_path: Path):
    def write(text: str, name: str = "cfg.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


def config_error(path: Path | str | None, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


def leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of a config dataclass tree, dotted (a dict-typed field is a leaf)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


# ---- loading -----------------------------------------------------------------------------------


def test_default_yaml_loads_with_file_values_and_defaults_elsewhere() -> None:
    cfg = load_config(DEFAULT_YAML)
    assert isinstance(cfg, Config)
    assert cfg.model.family == "llama"
    assert cfg.model.hf["hidden_size"] == 128 and cfg.model.hf["tie_word_embeddings"] is True
    assert cfg.data.seq_len == 128 and cfg.data.batch_size == 16
    assert cfg.optim.lr == pytest.approx(3e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.optim.schedule == "cosine" and cfg.optim.warmup_steps == 30
    assert cfg.engine.checkpoint_interval == 2
    assert cfg.data.ops == "+" and cfg.data.loss_on == "answers"
    assert cfg.train.steps == 1500 and cfg.train.eval_every == 500 and cfg.train.output_dir == "runs/{run_id}"
    # Keys the file does not set keep their dataclass defaults.
    assert cfg.optim.eps == Config().optim.eps
    assert cfg.ipc == Config().ipc
    assert cfg.actors == Config().actors


def test_no_file_gives_the_defaults() -> None:
    assert load_config(None) == Config()


@pytest.mark.parametrize("text", ["# nothing here\n", "", "---\n"])
def test_an_empty_file_is_refused(write_yaml, text: str) -> None:
    """An empty file would silently train the built-in default model (7B-sized)."""
    assert "the config file sets nothing" in config_error(write_yaml(text))


def test_checkpoint_interval_above_the_layer_count_is_refused() -> None:
    msg = config_error(None, ["model.hf.num_hidden_layers=3", "engine.checkpoint_interval=4"])
    assert "'engine.checkpoint_interval=4'" in msg and "4 exceeds the model's 3 layers" in msg
    assert load_config(None, ["model.hf.num_hidden_layers=3", "engine.checkpoint_interval=3"])


def test_missing_file_invalid_yaml_and_non_mapping_top_level(write_yaml, tmp_path: Path) -> None:
    assert "does not exist" in config_error(tmp_path / "nope.yaml")
    bad = write_yaml("optim: [1, 2\n", "bad.yaml")
    msg = config_error(bad)
    assert str(bad) in msg and "not valid YAML" in msg
    top = write_yaml("- model\n- data\n", "list.yaml")
    assert "top level must be a mapping" in config_error(top)


# ---- unknown keys ------------------------------------------------------------------------------


def test_unknown_key_names_dotted_key_and_file_line(write_yaml) -> None:
    path = write_yaml("model:\n  family: llama\noptim:\n  lr: 1.0e-3\n  zzqq_unrelated: 3\n")
    msg = config_error(path)
    assert "'optim.zzqq_unrelated'" in msg
    assert f"{path}:5" in msg
    assert "unknown key" in msg
    # No close match: the valid keys of the section are listed instead.
    assert "valid keys" in msg and "weight_decay" in msg


@pytest.mark.parametrize(
    "yaml_text, line, bad, suggestion",
    [
        ("optim:\n  lr: 1.0e-3\n  wieght_decay: 0.1\n", 3, "optim.wieght_decay", "optim.weight_decay"),
        ("data:\n  seqlen: 64\n", 2, "data.seqlen", "data.seq_len"),
        ("train:\n  steps: 3\nipc:\n  weight_slab: 2\n", 4, "ipc.weight_slab", "ipc.weight_slabs"),
        ("model:\n  family: llama\noptimizer:\n  lr: 1.0\n", 3, "optimizer", "optim"),
    ],
)
def test_misspelled_key_suggests_the_right_one(
    write_yaml, yaml_text: str, line: int, bad: str, suggestion: str
) -> None:
    path = write_yaml(yaml_text)
    msg = config_error(path)
    assert f"{path}:{line}" in msg
    assert f"'{bad}'" in msg
    assert f"did you mean '{suggestion}'" in msg


def test_a_misspelled_model_family_suggests_the_family(write_yaml) -> None:
    path = write_yaml("model:\n  family: lama\n")
    msg = config_error(path)
    assert f"{path}:2" in msg and "model.family 'lama' is not one of" in msg and msg.endswith("did you mean llama?")
    assert "did you mean" not in config_error(None, ["model.family=zzzz"])  # nothing close: no guess


# ---- wrong types and values ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "yaml_text, line, key, detail",
    [
        ("optim: {lr: abc}\n", 1, "optim.lr", "expected a number"),
        ("data:\n  batch_size: 2\n  seq_len: 12.5\n", 3, "data.seq_len", "expected an integer"),
        ("data:\n  seq_len: true\n", 2, "data.seq_len", "expected an integer"),
        ("train:\n  save_final: 1\n", 2, "train.save_final", "expected true/false"),
        ("optim:\n  betas: [0.9]\n", 2, "optim.betas", "expected 2 items"),
        ("optim:\n  betas: 0.9\n", 2, "optim.betas", "expected a list"),
        ("optim: 3\n", 1, "optim", "expected a mapping"),
        ("model:\n  hf: 7\n", 2, "model.hf", "expected a mapping"),
    ],
)
def test_wrong_type_names_key_and_line(write_yaml, yaml_text: str, line: int, key: str, detail: str) -> None:
    path = write_yaml(yaml_text)
    msg = config_error(path)
    assert f"'{key}'" in msg
    assert f"{path}:{line}" in msg
    assert detail in msg


@pytest.mark.parametrize(
    "yaml_text, words",
    [
        ("optim:\n  schedule: step\n", ["optim.schedule", "step"]),
        ("optim:\n  lr: -1.0\n", ["lr"]),
        ("data:\n  loss_on: everything\n", ["data.loss_on", "everything"]),
        ("ipc:\n  weight_slabs: 0\n", ["ipc.weight_slabs"]),
        ("model:\n  family: gpt2\n", ["model.family", "gpt2"]),
    ],
)
def test_bad_value_in_a_section_is_reported_with_the_file(write_yaml, yaml_text: str, words: list[str]) -> None:
    path = write_yaml(yaml_text)
    msg = config_error(path)
    assert str(path) in msg
    for w in words:
        assert w in msg


def test_float_written_without_a_dot_is_accepted() -> None:
    # YAML 1.1 reads 3e-4 (no dot) as a string; a float field must still accept it.
    cfg = load_config(DEFAULT_YAML, ["optim.lr=3e-4"])
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)


# ---- command-line overrides ----------------------------------------------------------------------


def test_dotted_overrides_apply_over_the_file() -> None:
    cfg = load_config(
        DEFAULT_YAML,
        [
            "optim.lr=3e-4",
            "model.hf.hidden_size=64",
            "data.batch_size=4",
            "optim.betas=[0.8, 0.9]",
            "train.save_final=true",
            "model.hf.num_hidden_layers=2",
            "ipc.poll_s=0.01",
        ],
    )
    assert cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.model.hf["hidden_size"] == 64 and cfg.model.hf["num_hidden_layers"] == 2
    assert cfg.data.batch_size == 4
    assert cfg.optim.betas == (0.8, 0.9)
    assert cfg.train.save_final is True
    assert cfg.ipc.poll_s == pytest.approx(0.01)
    # Untouched keys keep the file's values.
    assert cfg.model.hf["intermediate_size"] == 384
    assert cfg.data.seq_len == 128
    assert cfg.optim.warmup_steps == 30


def test_overrides_without_a_file() -> None:
    cfg = load_config(None, ["data.seq_len=32", "optim.schedule=linear"])
    assert cfg.data.seq_len == 32 and cfg.optim.schedule == "linear"
    assert cfg.optim.lr == Config().optim.lr


def test_later_override_wins() -> None:
    cfg = load_config(DEFAULT_YAML, ["data.batch_size=4", "data.batch_size=6"])
    assert cfg.data.batch_size == 6


@pytest.mark.parametrize("path", [DEFAULT_YAML, None])
def test_unknown_override_key_is_reported_as_command_line(path: Path | None) -> None:
    msg = config_error(path, ["optim.lrr=1e-3"])
    assert msg.startswith("command line")
    assert "'optim.lrr'" in msg
    assert "did you mean 'optim.lr'" in msg
    assert str(DEFAULT_YAML) not in msg


def test_unknown_override_section_is_reported_as_command_line() -> None:
    msg = config_error(DEFAULT_YAML, ["bogus.x=1"])
    assert msg.startswith("command line") and "'bogus'" in msg


def test_wrong_type_in_an_override_of_a_key_the_file_lacks() -> None:
    msg = config_error(DEFAULT_YAML, ["optim.eps=abc"])  # default.yaml sets no optim.eps
    assert msg.startswith("command line")
    assert "'optim.eps'" in msg and "expected a number" in msg


def test_wrong_type_in_an_override_of_a_key_the_file_sets() -> None:
    msg = config_error(DEFAULT_YAML, ["optim.lr=abc"])  # default.yaml:20 has a valid optim.lr
    assert "'optim.lr'" in msg
    assert msg.startswith("command line")


def test_file_error_stays_with_the_file_when_an_override_is_quoted_in_the_hint(write_yaml) -> None:
    path = write_yaml("optim:\n  lr: 1.0e-3\n  wieght_decay: 0.1\n")
    msg = config_error(path, ["optim.weight_decay=0.2"])
    assert msg.startswith(f"{path}:3")


def test_malformed_overrides() -> None:
    assert "dotted.key=value" in config_error(DEFAULT_YAML, ["optim.lr"])
    msg = config_error(DEFAULT_YAML, ["optim.lr.x=1"])  # optim.lr is a value, not a section
    assert "'lr' is not a section" in msg


# ---- cross-section validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["ipc.weight_slabs=1", "actors.num_packers=2"], ["ipc.weight_slabs", "actors.num_packers"]),
        (["ipc.weight_slabs=3", "actors.num_packers=4"], ["ipc.weight_slabs", "actors.num_packers"]),
        (["ipc.grad_slabs=2", "actors.num_accumulators=3"], ["ipc.grad_slabs", "actors.num_accumulators"]),
        (["data.seq_len=513"], ["data.seq_len", "max_position_embeddings", "512"]),
        (["model.hf.max_position_embeddings=64"], ["data.seq_len", "max_position_embeddings", "64"]),
        (["model.hf.vocab_size=100"], ["model.hf.vocab_size", "100"]),
    ],
)
def test_cross_section_validation_names_the_keys(overrides: list[str], words: list[str]) -> None:
    msg = config_error(DEFAULT_YAML, overrides)
    for w in words:
        assert w in msg


@pytest.mark.parametrize(
    "overrides",
    [
        ["ipc.weight_slabs=2", "actors.num_packers=2", "ipc.grad_slabs=3", "actors.num_accumulators=3"],
        ["data.seq_len=512"],  # equal to max_position_embeddings
        ["model.family=mistral", "model.hf.sliding_window=null"],
        ["model.family=mistral", "model.hf.sliding_window=128"],
        ["model.family=mistral", "model.hf.sliding_window=64"],  # a window under data.seq_len (attention.py)
    ],
)
def test_cross_section_validation_accepts_the_boundary(overrides: list[str]) -> None:
    load_config(DEFAULT_YAML, overrides)


def test_validate_directly_on_a_modified_config() -> None:
    cfg = load_config(DEFAULT_YAML)
    validate(cfg)
    cfg.actors.num_packers = cfg.ipc.weight_slabs + 1
    with pytest.raises(ConfigError, match=r"ipc\.weight_slabs.*actors\.num_packers"):
        validate(cfg)
    cfg = load_config(DEFAULT_YAML)
    cfg.data.seq_len = cfg.model.hf["max_position_embeddings"] * 2
    with pytest.raises(ConfigError, match=r"data\.seq_len'?: .*max_position_embeddings"):
        validate(cfg)


# ---- dump and reference ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [[], ["optim.betas=[0.8, 0.99]", "model.hf.hidden_size=64", "train.run_id=abc123", "model.pretrained=null"]],
)
def test_dump_yaml_reloads_to_an_equal_config(write_yaml, overrides: list[str]) -> None:
    cfg = load_config(DEFAULT_YAML, overrides)
    text = dump_yaml(cfg)
    again = load_config(write_yaml(text, "dumped.yaml"))
    assert again == cfg
    assert dump_yaml(again) == text
    # Every section is written out, not only the ones the source file set.
    for section in ("model", "data", "optim", "engine", "ipc", "actors", "train", "launch"):
        assert re.search(rf"^{section}:$", text, re.M), section


def test_dump_yaml_of_the_defaults_reloads() -> None:
    text = dump_yaml(Config())
    assert load_config(None) == Config()
    assert "weight_slabs: 4" in text


def test_reference_documents_every_key() -> None:
    rows = reference(Config)
    keys = [k for k, _, _ in rows]
    assert keys == leaf_keys(Config)
    assert len(set(keys)) == len(keys)
    for key, default, doc in rows:
        assert isinstance(doc, str) and doc.strip(), f"{key} has no doc"
        assert isinstance(default, str)
    defaults = {k: d for k, d, _ in rows}
    assert defaults["optim.lr"] == repr(Config().optim.lr)
    assert defaults["ipc.weight_slabs"] == "4"
    # Sections carry a doc too.
    for f in dataclasses.fields(Config):
        assert f.metadata.get("doc", "").strip(), f.name


def test_a_stalled_actor_is_named_within_30s_with_the_defaults(tmp_path: Path, rid: str, monkeypatch) -> None:
    """ipc.stall_timeout_s left at auto: a run whose Adam hangs inside its work fails within 30 s of the hang,
    naming Adam (the monitor's verdict after the timeout and a beat, then the driver's wait for the others)."""
    import threading
    import time

    from megatrain.actors.adam_updater import AdamUpdater
    from tests.harness import train_small as run

    assert load_config(None).ipc.stall_timeout_s == "auto"
    release, hung_at = threading.Event(), []
    real = AdamUpdater._update

    def update(self, unit, lo, hi, g, t, lr, scale, spare=False):  # noqa: ANN001
        if t == 2:
            hung_at.append(time.monotonic())
            release.wait(60)  # freed once the run has ended
        real(self, unit, lo, hi, g, t, lr, scale, spare)

    monkeypatch.setattr(AdamUpdater, "_update", update)
    try:
        with pytest.raises(MegatrainError) as info:
            run(tmp_path, rid, "train.overlap_adam=false")
        took = time.monotonic() - hung_at[0]
    finally:
        release.set()
    assert "stalled: actor 'adam-updater'" in str(info.value), info.value
    assert took < 30, f"named {took:.1f} s after the hang"


def test_the_stall_timeout_covers_a_long_layer() -> None:
    """auto: the 15 s floor at 16x4096 tokens of a 7B; at 512K tokens 4x a layer's work at 100 TFLOPS
    (several minutes); an explicit value is kept."""
    from megatrain.config.ipc import IpcConfig
    from megatrain.flops import model_step_flops
    from megatrain.ipc.protocol import resolve_stall
    from megatrain.model.spec import ModelConfig, build_spec
    from tests.harness import QWEN7B

    spec = build_spec(ModelConfig(family="qwen2", hf={**QWEN7B, "num_hidden_layers": 28}))
    assert resolve_stall(IpcConfig(), spec, 16, 4096).stall_timeout_s == 15.0
    long = resolve_stall(IpcConfig(), spec, 1, 524288).stall_timeout_s
    half = resolve_stall(IpcConfig(), spec, 1, 262144).stall_timeout_s
    # above its floor the timeout follows the step's work, its attention quadratic in the sequence
    work = model_step_flops(spec, 1, 524288) / model_step_flops(spec, 1, 262144)
    assert long / half == pytest.approx(work, rel=1e-3) and 2 < work < 4 and 300 < long < 1200
    assert resolve_stall(IpcConfig(stall_timeout_s=7), spec, 1, 524288).stall_timeout_s == 7
    assert IpcConfig().stall_seconds() == 15.0
