"""The docs are the code's: the generated references match their generators, and every command, config key,
override, YAML example, link and picture that README.md, docs/*.md and BENCHMARKS.md name works or exists.

Commands are read from the fenced code blocks and from inline code that starts with a command. Ours are
checked (the subcommand exists, every documented --flag is in its --help, a documented config file with its
overrides resolves, `plan` and `status` run); other tools' (ray, pip, py-spy, ...) are not ours to check."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from megatrain.config.base import reference
from megatrain.launch.cli.main import main as launch
from megatrain.launch.config.tree import Config, load_config
from megatrain.launch.report.metrics import METRICS, metrics_table
from megatrain.launch.run.driver import Trainer
from tests.harness import ROOT, TINY

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ALL = [*DOCS, ROOT / "BENCHMARKS.md"]
SUBCOMMANDS = ("export", "plan", "status", "plot", "tokenizer")
SECTIONS = "model|data|optim|engine|ipc|actors|train|launch"
# A config key in running text: a section, then lowercase segments; not part of a longer dotted name
# (megatrain.launch.cli.fidelity) or a path (tests/test_data.py).
KEY = re.compile(rf"(?<![\w./-])(?:{SECTIONS})\.[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*(?![\w/])")
FILE_SUFFIXES = (".json", ".jsonl", ".py", ".yaml", ".md", ".png", ".npy", ".bin")
# Documented before its code lands: a command naming one of these (a subcommand, a flag) is skipped while the
# check says it is not built. An entry that is built, or that no documented command names, fails
# test_every_pending_entry_still_skips_something: the list cannot hold dead entries.
PENDING: dict[str, Callable[[], bool]] = {}


def text(path: Path) -> str:
    return path.read_text()


def fenced(path: Path) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text(path), re.S | re.M)


def prose(path: Path) -> str:
    return re.sub(r"^```\w*\n.*?^```", "", text(path), flags=re.S | re.M)


def spans(path: Path) -> list[str]:
    return [s.replace("\\|", "|") for s in re.findall(r"`([^`\n]+)`", prose(path))]


def block(path: Path, name: str) -> str:
    m = re.search(rf"<!-- {name}[^\n]*-->\n(.*?)<!-- /{name} -->", text(path), re.S)
    if not m:
        pytest.fail(f"{path.name} has no {name} block")
    return m.group(1)


# ---- generated references ---------------------------------------------------------------------------


def test_configuration_md_is_what_config_reference_prints(capsys) -> None:
    assert launch(["--config-reference"]) == 0
    assert text(ROOT / "docs" / "configuration.md") == capsys.readouterr().out, (
        "docs/configuration.md is stale: run `megatrain-launch --config-reference > docs/configuration.md`"
    )


def test_metrics_table_is_generated_from_the_code() -> None:
    assert block(ROOT / "docs" / "operations.md", "metrics-table") == metrics_table(), (
        "docs/operations.md's metrics table is stale (launch/report/metrics.py metrics_table())"
    )


def test_every_field_a_run_writes_is_documented(tmp_path, rid: str) -> None:
    hf = json.dumps({**TINY, "num_hidden_layers": 2})
    cfg = load_config(
        None,
        [
            f"model.hf={hf}",
            "data.seq_len=32",
            "data.batch_size=2",
            "train.steps=2",
            "train.eval_every=1",
            "data.ops=+",
            f"train.run_id={rid}",
            "train.profile.step=2",
            f"train.output_dir={tmp_path / 'out'}",
            "launch.runner=inprocess",
        ],
    )
    Trainer(cfg).run()
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    written = set().union(*rows)
    assert written - set(METRICS) == set(), "fields missing from launch/report/metrics.py"
    assert {"eval_loss", "eval_accuracy", "loop_blocking_calls"} <= written  # the optional groups were exercised


# ---- config keys, overrides and YAML examples -------------------------------------------------------


@cache
def leaf_keys() -> frozenset[str]:
    return frozenset(key for key, _, _ in reference(Config))


def is_key(key: str) -> bool:
    if key in leaf_keys() or any(leaf.startswith(key + ".") for leaf in leaf_keys()):
        return True
    if key.startswith("model.hf."):  # a field of the family's HF config
        from transformers import LlamaConfig, MistralConfig, Qwen2Config

        return any(hasattr(c(), key.split(".", 2)[2]) for c in (LlamaConfig, MistralConfig, Qwen2Config))
    return False


def documented_keys() -> list[tuple[str, str]]:
    found = {(p.name, k) for p in ALL for span in spans(p) for k in KEY.findall(span)}
    found |= {(p.name, k) for p in ALL for lang, body in fenced(p) if lang != "yaml" for k in KEY.findall(body)}
    return sorted((name, k) for name, k in found if not k.endswith(FILE_SUFFIXES))


def test_every_documented_config_key_exists() -> None:
    keys = documented_keys()
    assert len(keys) > 50, "the key scan found almost nothing: is the pattern still right?"
    unknown = [f"{name}: `{k}`" for name, k in keys if not is_key(k)]
    assert not unknown, "documented config keys that do not exist:\n" + "\n".join(unknown)


def documented_settings() -> list[tuple[str, str, str]]:
    """(file, key, value) of every inline `key=value` or `key: value`; `a | b | c` gives one per value."""
    out = set()
    for p in ALL:
        for span in spans(p):
            m = re.fullmatch(rf"((?:{SECTIONS})\.[\w.]+)(?:=|: )(.+)", span)
            if m:
                out |= {(p.name, m.group(1), v.strip()) for v in m.group(2).split(" | ")}
    return sorted(out)


def test_every_documented_setting_is_accepted() -> None:
    settings = documented_settings()
    assert len(settings) > 20, "the setting scan found almost nothing"
    bad = []
    for name, key, value in settings:
        if re.fullmatch(r"[A-Z][A-Z_]+", value):
            continue  # a placeholder for a path or a name (train.resume: PATH)
        value = re.sub(r"\b[NKME]\b", "2", value)  # a placeholder number (save_every: N, {step: N})
        context = ["model.hf.num_hidden_layers=8"] + (["data.path=x.jsonl"] if key == "data.kind" else [])
        try:
            load_config(ROOT / "examples" / "default.yaml", [*context, f"{key}={value}"])
        except Exception as exc:  # noqa: BLE001 - the message is the point
            bad.append(f"{name}: `{key}: {value}`: {exc}")
    assert not bad, "documented settings the config refuses:\n" + "\n".join(bad)


def yaml_examples() -> list[tuple[str, str]]:
    return [(p.name, body) for p in ALL for lang, body in fenced(p) if lang == "yaml"]


def test_every_yaml_example_is_a_valid_config(tmp_path: Path) -> None:
    assert yaml_examples(), "no YAML example found (the README's own-model config should be one)"
    for i, (_, body) in enumerate(yaml_examples()):
        path = tmp_path / f"example-{i}.yaml"
        path.write_text(body)
        load_config(path, [])  # raises ConfigError naming the key and line


# ---- commands ---------------------------------------------------------------------------------------


def command_lines(path: Path) -> list[str]:
    lines = []
    for lang, body in fenced(path):
        if lang in ("", "bash", "sh") and not re.search("[│┌└►]", body):  # a picture, not commands
            lines += [line.strip() for line in body.replace("\\\n", " ").splitlines() if line.strip()]
    lines += [s for s in spans(path) if re.match(r"(megatrain-launch|python|\./run-\S+)( |$)", s)]
    return lines


def documented_commands() -> list[tuple[str, list[str]]]:
    out: dict[str, tuple[str, list[str]]] = {}
    for p in ALL:
        for line in command_lines(p):
            try:
                argv = shlex.split(line, comments=True)
            except ValueError:
                continue
            while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # MEGATRAIN_TEST_CUDA=1 ./run-tests.sh
                argv = argv[1:]
            cut = [i for i, a in enumerate(argv) if a in (">", "|", "&&", ";", "2>&1")]
            argv = argv[: cut[0]] if cut else argv
            if argv and argv[0] in ("megatrain-launch", "python", "./run-default.sh", "./run-tests.sh", "ray"):
                out.setdefault(" ".join(argv), (p.name, argv))
    return sorted(out.values(), key=lambda x: " ".join(x[1]))


def quiet(fn, *args):
    """Call fn, capturing its output; SystemExit (argparse's --help) becomes its code."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = fn(*args)
        except SystemExit as exc:
            rc = exc.code or 0
    return rc, buf.getvalue()


@cache
def launch_help(sub: str | None) -> str:
    rc, out = quiet(launch, [sub, "--help"] if sub else ["--help"])
    assert rc == 0, f"megatrain-launch {sub or ''} --help exited {rc}:\n{out}"
    return out


@cache
def script_help(script: str) -> str:
    """`python SCRIPT --help` (or `python -m MODULE --help`), run in this process: the imports are paid once."""
    argv, path = sys.argv[:], sys.path[:]
    sys.argv = [script, "--help"]
    try:
        if script.endswith(".py"):
            rc, out = quiet(runpy.run_path, str(ROOT / script), None, "__main__")
        else:
            rc, out = quiet(runpy.run_module, script, None, "__main__", True)
    finally:
        sys.argv, sys.path[:] = argv, path
    assert rc == 0, f"python {script} --help exited {rc}: {out[-2000:]}"
    return out


def placeholder(arg: str) -> bool:
    """CONFIG.yaml, RUN_DIR, N, [key=value ...]: a synopsis, not a command to run."""
    return bool(re.fullmatch(r"[A-Z][A-Z_]*(\.yaml)?|\[.*|.*\]|\.\.\.|.*[|].*", arg))


def in_help(flag: str, helptext: str) -> bool:
    return re.search(rf"{re.escape(flag)}(?![\w-])", helptext) is not None


def flags(argv: list[str]) -> list[str]:
    return [a.strip("[]").split("=", 1)[0] for a in argv if a.strip("[]").startswith("--") and a != "--"]


def config_file(name: str, cwd: Path, tmp: Path) -> Path | None:
    """A documented config that exists: one of the repository's, or the README's own-model example."""
    if (cwd / name).is_file():
        return cwd / name
    if name == "my-model.yaml":
        path = tmp / name
        path.write_text(next(body for lang, body in fenced(ROOT / "README.md") if lang == "yaml"))
        return path
    return None


def skip_pending(argv: list[str]) -> None:
    for name, built in PENDING.items():
        if name in argv and not built():
            pytest.skip(f"{name} is documented but not built yet")


def test_every_pending_entry_still_skips_something() -> None:
    named = {a for _, argv in documented_commands() for a in argv}
    dead = [name for name, built in PENDING.items() if built() or name not in named]
    assert not dead, f"PENDING entries that skip nothing (built, or no documented command names them): {dead}"


def check_launch(argv: list[str], cwd: Path, tmp: Path, request: pytest.FixtureRequest) -> None:
    sub = argv[1] if len(argv) > 1 and argv[1] in SUBCOMMANDS else None
    skip_pending(argv)
    helptext = launch_help(sub)
    missing = [f for f in flags(argv) if not in_help(f, helptext)]
    assert not missing, f"flags not in `megatrain-launch {sub or ''} --help`: {missing}"
    if any(placeholder(a) for a in argv):
        return  # a synopsis: its flags are checked, there is nothing to run
    args = argv[2 if sub else 1 :]
    cfg = config_file(args[0], cwd, tmp) if args and sub in (None, "plan") else None
    if cfg is not None and cfg.name == "own-data.yaml":  # its model and data come from make_own_data.py
        request.getfixturevalue("monkeypatch").chdir(request.getfixturevalue("own_data"))
    if sub is None and cfg is not None:
        rc, out = quiet(launch, [str(cfg), *args[1:], "--print-config"])
        assert rc == 0, f"{' '.join(argv)} --print-config exited {rc}: {out[-2000:]}"
    elif sub == "plan" and cfg is not None:
        rc, out = quiet(launch, ["plan", str(cfg), *args[1:]])
        assert rc in (0, 1) and "verdict" in out, f"{' '.join(argv)} exited {rc}: {out[-2000:]}"
    elif sub == "status":
        rc, out = quiet(launch, ["status", *args])
        assert rc == 0, f"megatrain-launch status exited {rc}: {out}"


@pytest.fixture(scope="module")
def own_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `python examples/make_own_data.py runs/own-data` writes, in a directory of its own (fewer rows)."""
    where = tmp_path_factory.mktemp("own-data")
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_own_data.py"), "runs/own-data", "--conversations", "200"],
        cwd=where,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return where


def check_python(argv: list[str]) -> None:
    script = argv[2] if argv[1] == "-m" else argv[1]
    if argv[1] == "-m":
        assert importlib.util.find_spec(script), f"no module {script}"
    else:
        assert (ROOT / script).is_file(), f"no file {script}"
    skip_pending(argv)
    helptext = script_help(script)
    missing = [f for f in flags(argv) if not in_help(f, helptext)]
    assert not missing, f"flags not in `python {script} --help`: {missing}"
    if script == "bench/run.py":
        check_bench_values(argv)


def check_bench_values(argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from bench.run import ABLATIONS, PEERS, SUITE
    finally:
        sys.path.remove(str(ROOT))
    known = {"--peers": PEERS, "--only": SUITE, "--ablations": ABLATIONS, "--suite": {"headline"}}
    for i, a in enumerate(argv[:-1]):
        if a in known and not placeholder(argv[i + 1]):
            values = [v for v in argv[i + 1].split(",") if v]
            assert set(values) <= set(known[a]), f"{a} {argv[i + 1]}: not among {sorted(known[a])}"


def check_script(argv: list[str]) -> None:
    script = ROOT / argv[0]
    assert script.is_file() and os.access(script, os.X_OK), f"{argv[0]} is not an executable file"
    if argv[0] == "./run-default.sh":  # its arguments are overrides of examples/default.yaml
        rc, out = quiet(launch, [str(ROOT / "examples" / "default.yaml"), *argv[1:], "--print-config"])
        assert rc == 0, f"{' '.join(argv)}: {out[-2000:]}"
    else:  # pytest arguments: the markers it names exist
        markers = re.findall(r'"(\w+):', (ROOT / "pyproject.toml").read_text().split("markers", 1)[1].split("]")[0])
        for i, a in enumerate(argv[:-1]):
            if a == "-m":
                used = set(re.findall(r"\w+", argv[i + 1])) - {"not", "and", "or"}
                assert used <= set(markers), f"-m {argv[i + 1]}: markers {sorted(used - set(markers))} do not exist"


@pytest.mark.parametrize("where,argv", documented_commands(), ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_documented_command_works(where: str, argv: list[str], tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if argv[0] == "ray":  # `ray job submit ... --working-dir D -- megatrain-launch ...`: ours is after --
        if "--" not in argv:
            pytest.skip("a Ray command, not ours")
        cwd = ROOT / argv[argv.index("--working-dir") + 1] if "--working-dir" in argv else ROOT
        check_launch(argv[argv.index("--") + 1 :], cwd, tmp_path, request)
    elif argv[0] == "megatrain-launch":
        check_launch(argv, ROOT, tmp_path, request)
    elif argv[0] == "python":
        check_python(argv)
    else:
        check_script(argv)


def test_the_command_scan_finds_the_commands() -> None:
    found = {" ".join(argv[:2]) for _, argv in documented_commands()}
    for cmd in (
        "./run-default.sh",
        "./run-tests.sh",
        "megatrain-launch plan",
        "megatrain-launch status",
        "megatrain-launch export",
        "megatrain-launch plot",
        "megatrain-launch tokenizer",
        "python bench/run.py",
    ):
        assert any(f.startswith(cmd) for f in found), f"no documented command starts with {cmd!r}"


def test_the_readme_recipe_trains_and_exports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rid: str) -> None:
    """The README's own-model recipe as written (its YAML, its five commands), on generated text, with the model
    made tiny and two steps in-process so that it runs in seconds: tokenizer, plan, train, export, load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    readme = ROOT / "README.md"
    recipe = next(body for lang, body in fenced(readme) if "megatrain-launch tokenizer" in body and lang == "")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEGATRAIN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "my-model.yaml").write_text(next(body for lang, body in fenced(readme) if lang == "yaml"))
    words = ["the", "of", "river", "stone", "cloud", "tiger", "maple", "ocean", "candle", "silver", "rocket"]
    lines = [" ".join(words[(i * j) % len(words)] for j in range(25)) for i in range(3000)]
    (tmp_path / "my-data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    tiny = [
        "model.hf.hidden_size=64",
        "model.hf.intermediate_size=128",
        "model.hf.num_hidden_layers=2",
        "model.hf.num_attention_heads=4",
        "model.hf.num_key_value_heads=2",
        "data.seq_len=64",
        "data.batch_size=4",
        "train.steps=2",
        "train.save_every=2",
        "train.eval_every=2",
        "launch.runner=inprocess",
        f"train.run_id={rid}",
    ]
    ran = []
    for line in recipe.splitlines():
        argv = shlex.split(line, comments=True)
        if not argv or argv[0] != "megatrain-launch":
            continue  # `source .venv/bin/activate`: this test runs in that environment
        args = argv[1:] + (tiny if argv[1].endswith(".yaml") else [])
        rc, out = quiet(launch, args)
        assert rc == 0, f"{line}: exit {rc}\n{out[-3000:]}"
        ran.append(argv[1])
    assert ran == ["tokenizer", "plan", "my-model.yaml", "export"], f"the recipe's commands changed: {ran}"
    tok = AutoTokenizer.from_pretrained(tmp_path / "my-tokenizer")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "my-model-hf")
    assert model.config.eos_token_id == tok.eos_token_id is not None
    rows = [json.loads(x) for x in (tmp_path / "runs" / "my-model" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "eval_loss" in rows[-1]


# ---- the code map -----------------------------------------------------------------------------------

MAPPED = ("megatrain", "actors", "ipc", "launch", "bench", "examples")  # every module of these is on the map


def code_map() -> list[str]:
    """The paths docs/architecture.md's code map names, one per row, in order."""
    return re.findall(r"^\| `([^`|]+)` \|", block(ROOT / "docs" / "architecture.md", "code-map"), re.M)


def test_the_code_map_names_every_module_and_only_modules() -> None:
    """One row per folder and per module file (an empty __init__.py has nothing to say), each once, and
    every path the map names exists."""
    rows = code_map()
    files = [p for top in MAPPED for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts]
    modules = {p for p in files if p.read_text().strip()}
    want = {str(p.relative_to(ROOT)) for p in modules} | {str(p.parent.relative_to(ROOT)) + "/" for p in modules}
    assert len(rows) > 100, "the code map's scan found almost nothing: is it still a table of `path` rows?"
    assert sorted(r for r in set(rows) if rows.count(r) > 1) == [], "rows named twice"
    assert sorted(want - set(rows)) == [], "modules and folders missing from docs/architecture.md's code map"
    assert [r for r in rows if not (ROOT / r).exists()] == [], "the code map names paths that do not exist"


# ---- links, pictures, and what the docs must not say ------------------------------------------------


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_resolves() -> None:
    bad = []
    for p in ALL:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(p)):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (p.parent / file).resolve() if file else p
            if not dest.exists():
                bad.append(f"{p.name}: {target}: no such file")
            elif anchor and anchor not in {slug(h) for h in re.findall(r"^#+ (.+)$", prose(dest), re.M)}:
                bad.append(f"{p.name}: {target}: no such heading in {dest.name}")
    assert not bad, "\n".join(bad)


def test_docs_keep_only_the_pictures_they_show() -> None:
    shown = {(p.parent / t).resolve() for p in ALL for t in re.findall(r"\]\(([^)\s#]+\.(?:png|svg|jpg))\)", text(p))}
    pictures = {f.resolve() for f in (ROOT / "docs").rglob("*") if f.suffix in (".png", ".svg", ".jpg")}
    assert not pictures - shown, f"pictures no doc shows (git rm them): {sorted(str(f) for f in pictures - shown)}"


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.name)
def test_no_history_or_outside_paths(path: Path) -> None:
    """No issue numbers, rounds, dates or commit hashes (BENCHMARKS.md names the commit and date a result was
    measured on), nothing about the tools the project is developed with, no paths outside the repository."""
    t = text(path)
    bench = path.name == "BENCHMARKS.md"
    rules = {
        "an issue number": r"\bissues? #?\d+",
        "a round": r"\b(round|rounds)\b",
        "a path outside the repository": r"(\.\./|/work/|/home/)",
        "the development tools": r"device tool|make-bundle|lent machine",
    }
    if path.name == "correctness.md":  # the record of GPU runs names the date and commit each ran on
        t = t.replace(block(path, "gpu-runs"), "")
    if not bench:
        rules |= {"a date": r"\b20\d\d-\d\d-\d\d\b", "a commit": r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"}
    found = [f"{what}: {m.group(0)!r}" for what, rx in rules.items() for m in re.finditer(rx, t, re.I)]
    assert not found, f"{path.name} says: " + "; ".join(found)


@pytest.mark.parametrize("name", ["README.md", "BENCHMARKS.md"])
def test_at_most_300_lines(name: str) -> None:
    assert len(text(ROOT / name).splitlines()) <= 300, f"{name} is over 300 lines: the rest belongs in docs/"


def cuda_test_files() -> set[str]:
    """tests/*_cuda.py, and every other test file with a test marked cuda."""
    files = set((ROOT / "tests").glob("test_*_cuda.py"))
    marked = re.compile(r"^pytestmark = .*(NEEDS_CUDA|mark\.cuda\b)|^\s*@pytest\.mark\.cuda\b", re.M)
    files |= {f for f in (ROOT / "tests").glob("test_*.py") if marked.search(f.read_text())}
    return {f"tests/{f.name}" for f in files}


def test_every_cuda_test_file_has_a_row_of_its_last_gpu_run() -> None:
    rows = re.findall(r"^\| `(tests/[\w.]+)`", block(ROOT / "docs" / "correctness.md", "gpu-runs"), re.M)
    files = cuda_test_files()
    assert "tests/test_engine_cuda.py" in files and "tests/test_profiling.py" in files, "the scan finds no CUDA tests"
    missing, stale = sorted(files - set(rows)), sorted(set(rows) - files)
    assert not missing, f"GPU test files without a row in docs/correctness.md's gpu-runs table: {missing}"
    assert not stale, f"rows of docs/correctness.md's gpu-runs table for no GPU test file: {stale}"
    assert len(rows) == len(set(rows)), "a GPU test file with two rows"
