"""A plain (non-editable) install runs: the wheel is built from the tree, installed into a fresh environment
that sees the test environment's dependencies but not its editable finder of this repository, and
`megatrain-launch` from that environment plans and trains a few steps through Ray. A package missing from the
wheel fails here at the first import, in the driver or in an actor."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.slow
# what a working copy holds beside the source: environments, runs, caches, earlier builds
LOCAL = (".git", ".venv", ".devbundle", "runs", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")
FOLDERS = {"megatrain": "megatrain", "actors": "megatrain/actors", "ipc": "megatrain/ipc", "launch": "megatrain/launch"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy of the tree: setuptools leaves build/ and *.egg-info in the source folder, and a build/
    left from an earlier build could carry a module the tree no longer has into the wheel."""
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*LOCAL))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out,
    )
    assert build.returncode == 0, build.stderr
    (found,) = out.glob("megatrain-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh environment with the wheel installed; the test environment's site directories are on its path as
    plain directories (a .pth line), so their own .pth files, the editable finder among them, are never run."""
    env_dir = tmp_path_factory.mktemp("env") / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = Path(
        subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    ours = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (purelib / "outer_site.pth").write_text("".join(f"{d}\n" for d in dict.fromkeys(ours) if Path(d).is_dir()))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return env_dir


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def test_the_wheel_holds_every_package_of_the_tree(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    want = []
    for folder, installed_as in FOLDERS.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.relative_to(ROOT / folder).as_posix()
            want.append(f"{installed_as}/{rel}")
    missing = [w for w in want if w not in names]
    assert not missing, f"packages of the tree missing from the wheel: {missing}"
    assert not any(n.startswith(("tests/", "bench/", "actors/", "ipc/", "launch/")) for n in names)


def test_megatrain_launch_from_the_wheel_plans_and_trains(installed: Path, tmp_path: Path) -> None:
    env = clean_env()
    where = subprocess.run(
        [
            installed / "bin" / "python",
            "-c",
            "import megatrain.launch.run.driver as d, megatrain; print(megatrain.__file__)",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(installed), f"megatrain imported from {where.stdout}"
    launch = installed / "bin" / "megatrain-launch"
    config = str(ROOT / "examples" / "default.yaml")
    plan = subprocess.run([launch, "plan", config], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    out = tmp_path / "run"
    steps = ["train.steps=4", "train.eval_every=0", f"train.output_dir={out}", "engine.device=cpu"]
    run = subprocess.run([launch, config, *steps], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "loss" in m][-1] == 4
