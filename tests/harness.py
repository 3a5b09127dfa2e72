"""The tests' harness: tiny configs and model shapes, runs through the in-process runner and their checks
against plain PyTorch, the launcher driven as users run it (Cli), and the processes a test starts.
Tiny HF models and engine-level helpers are in tests/model_fixtures.py, shared memory in
tests/shm_fixtures.py, local data in tests/data_fixtures.py; tests/conftest.py holds the fixtures."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
import torch

if TYPE_CHECKING:
    from megatrain.launch.report.reporting import RunSummary

ROOT = Path(__file__).resolve().parents[1]

# The GPU tests: marked cuda, skipped without a GPU (tests/conftest.py hides GPUs unless MEGATRAIN_TEST_CUDA=1).
requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (the suite hides it unless MEGATRAIN_TEST_CUDA=1)"
)
NEEDS_CUDA = [pytest.mark.cuda, requires_cuda]  # a module's pytestmark


# ---- model shapes ----------------------------------------------------------------------------------
# The bundled default shrunk to a model that starts and steps in moments: its overrides, and the launcher's
# arguments before a test's own.
SMALL = [
    "model.hf.hidden_size=32",
    "model.hf.intermediate_size=64",
    "model.hf.num_hidden_layers=2",
    "data.seq_len=32",
    "data.batch_size=2",
]
TINY_DEFAULT = [str(ROOT / "examples/default.yaml"), *SMALL]

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

# Mixture-of-experts families at test size: 4 experts, top-2, the load-balancing loss on with a coefficient
# large enough to move the weights; Qwen2-MoE with a shared expert and one dense layer, GPT-OSS with a
# sliding window shorter than the tests' sequences and sinks.
MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"]
_MOE = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.05}
MOE_TINY = {
    "mixtral": {**_MOE, "num_local_experts": 4, "intermediate_size": 24, "sliding_window": None},
    "qwen2_moe": {
        **_MOE,
        "num_experts": 4,
        "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 40,
        "mlp_only_layers": [1],
    },
    "qwen3_moe": {**_MOE, "num_experts": 4, "moe_intermediate_size": 24},
    "olmoe": {**_MOE, "num_experts": 4, "intermediate_size": 24, "pad_token_id": 0},
    "gpt_oss": {**_MOE, "num_local_experts": 4, "intermediate_size": 24, "head_dim": 8, "sliding_window": 8},
}

# Qwen2.5-7B's shape (its layer count set by each test): the sizes the memory plan and timeouts are held to.
QWEN7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
}


def tiny_config_dict(family: str, tied: bool, layers: int = 3) -> dict:
    """model.hf for a tiny model of the family."""
    extra = {"sliding_window": None} if family == "mistral" else MOE_TINY.get(family, {})
    return {**TINY, "num_hidden_layers": layers, "tie_word_embeddings": tied, **extra}


# ---- runs through the in-process runner, and their match with plain PyTorch ------------------------
LAYERS = 3
# q.(k + b) moves every score of a query by the same q.b, which softmax ignores: the exact gradient of
# k_proj.bias (Qwen2) is zero and what Adam does with it is rounding noise, in both runs alike. Such
# tensors are held to 1e-4 instead of 1e-5 (measured: 2.5e-5 on the CPU).
NOISE_ONLY = ("self_attn.k_proj.bias",)


def tiny_config(
    family: str,
    tied: bool,
    k: int,
    tmp_path,
    steps: int = 10,
    extra: list[str] | None = None,
    runner: str = "inprocess",
):
    """The reference tests' config (tests/test_equivalence.py): a tiny model, clipping and weight decay on."""
    from megatrain.launch.config.tree import load_config

    hf = tiny_config_dict(family, tied, LAYERS)
    overrides = [
        f"model.family={family}",
        f"model.hf={json.dumps(hf)}",
        "data.seq_len=32",
        "data.batch_size=4",
        "optim.lr=2e-3",
        "optim.weight_decay=0.1",
        "optim.max_grad_norm=1.0",
        "optim.warmup_steps=2",
        f"engine.checkpoint_interval={k}",
        "engine.loss_chunk_tokens=40",
        f"train.steps={steps}",
        f"train.output_dir={tmp_path}/out",
        f"launch.runner={runner}",
        *(extra or []),
    ]
    return load_config(None, overrides)


def run_leftovers(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if f"megatrain-{run_id}-" in n]


def check(rep: dict, tied: bool) -> None:
    """A compare() report of tiny_config's 10 steps: losses, clipped norms and final weights equal the reference."""
    assert len(rep["losses"]) == 10
    for step, (ours, ref) in enumerate(zip(rep["losses"], rep["ref_losses"])):
        assert abs(ours - ref) <= 1e-5 * abs(ref), f"step {step + 1}: {ours} vs {ref}"
    # Clipping must really have been exercised (norms above max_grad_norm early on).
    assert max(rep["ref_grad_norms"]) > 1.0
    assert all(abs(a - b) <= 1e-4 * b for a, b in zip(rep["grad_norms"], rep["ref_grad_norms"]))
    weights = rep["weights"]
    assert ("lm_head.weight" in weights) != tied and "model.embed_tokens.weight" in weights
    bad = {n: d / r for n, (d, r) in weights.items() if not n.endswith(NOISE_ONLY) and d > 1e-5 * r}
    assert not bad, f"final weights differ (relative): {bad}"
    noise = {n: d / r for n, (d, r) in weights.items() if n.endswith(NOISE_ONLY) and d > 1e-4 * r}
    assert not noise, f"noise-driven tensors drifted apart: {noise}"
    assert run_leftovers(rep["summary"].run_id) == []


def check_match(rep: dict, eval_expected: bool = True) -> None:
    """A compare() report of a run on the user's data: losses, final weights and the eval loss."""
    for step, (ours, ref) in enumerate(zip(rep["losses"], rep["ref_losses"], strict=True)):
        assert abs(ours - ref) <= 1e-5 * abs(ref), f"step {step + 1}: {ours} vs {ref}"
    bad = {n: d / r for n, (d, r) in rep["weights"].items() if not n.endswith(NOISE_ONLY) and d > 1e-5 * r}
    assert not bad, f"final weights differ (relative): {bad}"
    if eval_expected:
        assert rep["eval_loss"] is not None and rep["ref_eval_loss"] is not None
        assert abs(rep["eval_loss"] - rep["ref_eval_loss"]) <= 1e-5 * rep["ref_eval_loss"]
    assert run_leftovers(rep["summary"].run_id) == []


def train_tiny(out: Path, family: str, *extra: str, steps: int = 10) -> RunSummary:
    """A tiny model of the family trained in-process, a checkpoint every 5 steps (the checkpoint tests')."""
    from megatrain.launch.config.tree import load_config
    from megatrain.launch.run.driver import Trainer

    hf = tiny_config_dict(family, tied=family == "qwen2")
    cfg = load_config(
        None,
        [
            f"model.family={family}",
            f"model.hf={json.dumps(hf)}",
            "data.seq_len=32",
            "data.batch_size=4",
            "optim.lr=2e-3",
            "optim.weight_decay=0.1",
            "optim.warmup_steps=2",
            f"train.steps={steps}",
            "train.save_every=5",
            f"train.output_dir={out}",
            "launch.runner=inprocess",
            *extra,
        ],
    )
    return Trainer(cfg).run()


def train_small(tmp_path: Path, rid: str, *extra: str, steps: int = 4) -> RunSummary:
    """A two-layer model trained in-process as run `rid`, polling fast (the fault tests')."""
    from megatrain.launch.config.tree import load_config
    from megatrain.launch.run.driver import Trainer

    hf = json.dumps({**TINY, "num_hidden_layers": 2, "tie_word_embeddings": False})
    cfg = load_config(
        None,
        [
            f"model.hf={hf}",
            "data.seq_len=32",
            "data.batch_size=2",
            f"train.steps={steps}",
            f"train.run_id={rid}",
            f"train.output_dir={tmp_path / 'out'}",
            "launch.runner=inprocess",
            "ipc.poll_s=0.02",
            *extra,
        ],
    )
    return Trainer(cfg).run()


def planes(step_dir: Path) -> dict[str, bytes]:
    from megatrain.formats import checkpoint as ckpt

    parts = ckpt.part_files(ckpt.manifest_of(step_dir))  # every host's part, host 0's first (one host: one)
    return {p: b"".join((step_dir / names[p]).read_bytes() for names, _ in parts) for p in ckpt.PLANES}


def losses(out: Path) -> dict[int, float]:
    """A run's metrics.jsonl: the loss by step."""
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def loss_rows(out: Path) -> list[tuple[int, float]]:
    """A run's metrics.jsonl: (step, loss) in the order written (a resumed run's rows after the first's)."""
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of a run's final/ HF directory."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted((run_dir / "final").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def in_a_process(out: Path, family: str, *extra: str) -> None:
    """train_tiny in a fresh process, as a launch is (a GPU test's runs do not share a CUDA context)."""
    proc = multiprocessing.get_context("spawn").Process(target=train_tiny, args=(out, family, *extra))
    proc.start()
    proc.join(300)
    if proc.exitcode != 0:
        proc.kill()
        raise AssertionError(f"the run in {out} ended with exit code {proc.exitcode}")


def follows(tmp_path: Path, family: str, base: list[str], other: str, tol: float) -> None:
    """A run of `base` in tmp_path/one, and with `other` set in tmp_path/two: ten steps, each loss within tol."""
    in_a_process(tmp_path / "one", family, *base)
    in_a_process(tmp_path / "two", family, *base, other)
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(two) == list(range(1, 11))
    for s in one:
        assert abs(one[s] - two[s]) <= tol * abs(one[s]), f"step {s}: {one[s]} vs {two[s]}"


# ---- megatrain-launch's main() in this process (the rerun and ended-early tests) ---------------------
RERUN_STEPS = 10
RERUN_ARGS = [
    str(ROOT / "examples/default.yaml"),
    f"model.hf={json.dumps({**TINY, 'num_hidden_layers': 2})}",
    "data.seq_len=32",
    "data.batch_size=4",
    "optim.warmup_steps=2",
    f"train.steps={RERUN_STEPS}",
    "train.eval_every=0",
    "train.final_eval=false",
    "train.log_every=1",
    "launch.runner=inprocess",
]


def sigterm_after(metrics: Callable[[], Path | None], rows: int) -> None:
    """SIGTERM to this process (main() is running here) once the run's metrics.jsonl has `rows` rows."""

    def watch() -> None:
        while True:
            path = metrics()
            if path is not None and path.is_file() and len(path.read_text().splitlines()) >= rows:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            threading.Event().wait(0.01)

    threading.Thread(target=watch, daemon=True).start()


def import_args(src: Path, out: Path) -> list[str]:
    """megatrain-launch's arguments for a CPU run, in-process, of the bundled config started from the HF
    directory `src` (its config.json is the model), writing to `out`."""
    return [
        str(ROOT / "examples/default.yaml"),
        f"model.pretrained={src}",
        "model.hf={}",
        "data.seq_len=32",
        "engine.device=cpu",
        f"train.output_dir={out}",
        "launch.runner=inprocess",
    ]


# ---- the launcher in processes of its own -----------------------------------------------------------
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}  # a throwaway cluster on localhost: no token to hand around
NODES = 2  # the simulated cluster's nodes (tests/conftest.py `cluster`)
NODE_CPUS = 3  # a CPU-device host's actors ask for 2 (its executor and Adam updater)


# How long a test waits for a launcher's start (its actors line, its first step): beyond the launcher's own
# train.setup_timeout_s (600 s), which names a start that hangs; on a loaded 2-core machine a run over a
# simulated two-node cluster takes minutes to start (every actor process imports torch), so a tighter bound
# would fail on the machine's speed, not on the code.
START_S = 660


class Cli:
    """megatrain-launch in its own session (so a Ctrl-C can hit its whole process group)."""

    def __init__(self, tmp_path: Path, *args: str, steps: int = 4, env: dict | None = None, wrap: tuple[str, ...] = ()):
        """`wrap`: a command that runs the launcher's (its arguments follow), e.g. a shell's pipeline."""
        self.run_id = "t" + secrets.token_hex(4)
        self.out = tmp_path / "out"
        cmd = [
            *wrap,
            sys.executable,
            "-m",
            "megatrain.launch.cli.main",
            *TINY_DEFAULT,
            f"train.steps={steps}",
            f"train.run_id={self.run_id}",
            f"train.output_dir={self.out}",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.tree: set[int] = set()
        for stream, sink in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr)):
            threading.Thread(target=self._pump, args=(stream, sink), daemon=True).start()

    def _pump(self, stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.stdout):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None and not any(re.search(pattern, ln) for ln in self.stdout):
                raise AssertionError(f"exited {self.proc.returncode} before '{pattern}':\n{self.text()}")
            time.sleep(0.05)
        self._end()  # a test that fails here leaves no launcher holding the cluster for the next one
        raise AssertionError(f"no '{pattern}' within {timeout}s:\n{self.text()}")

    def _end(self) -> None:
        """SIGKILL the launcher's process group and reap it (Ray ends the actors of a driver gone)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)

    def actor_pids(self) -> dict[str, int]:
        line = self.wait_for(r"actors: (.*)", timeout=START_S).group(1)
        pids = {name: int(pid) for name, pid in re.findall(r"([\w-]+) pid (\d+)", line)}
        self.tree |= set(pids.values())
        self.snapshot()
        return pids

    def snapshot(self) -> None:
        """Every process the launcher has started so far (Ray, actors, the reaper)."""
        try:
            self.tree |= {p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
        self.tree |= {
            p.pid for p in psutil.process_iter(["cmdline"]) if self.run_id in " ".join(p.info["cmdline"] or [])
        }

    def finish(self, timeout: float = 120) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._end()
            raise AssertionError(f"launcher hung:\n{self.text()}") from None

    def text(self) -> str:
        return "".join(self.stdout[-40:]) + "\n--- stderr ---\n" + "".join(self.stderr[-40:])

    def assert_clean(self, timeout: float = 60) -> None:
        """Nothing of the run left: waited for (Ray ends its workers, the guard and the reaper poll), with a bound
        that only ends a wait for what never happens."""
        deadline = time.monotonic() + timeout
        alive = set(self.tree)
        while time.monotonic() < deadline:
            alive = {p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"}
            if not alive and not run_leftovers(self.run_id):
                break
            time.sleep(0.2)
        names = {p: " ".join(psutil.Process(p).cmdline()[:3]) for p in alive if psutil.pid_exists(p)}
        left = run_leftovers(self.run_id)
        assert left == [], f"shared memory left: {left}; processes of the run alive: {names}\n{self.text()}"
        assert not names, f"processes left running: {names}"


HEAVY = (
    "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numba') or m.startswith('transformers.models.'))"
)


def heavy_after(code: str, *args: str, env: dict[str, str] | None = None) -> list[str]:
    """The heavy modules a fresh interpreter holds after `code` (run with sys.argv[1:] = args)."""
    wrapped = f"import json, sys\n{code}\nprint(json.dumps({HEAVY}))"
    done = subprocess.run(
        [sys.executable, "-c", wrapped, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# ---- processes a test starts --------------------------------------------------------------------
def started_since(before: set[int]) -> set[int]:
    """Processes this one has started since its descendants were `before` (and theirs), alive: not the workers
    that a Ray instance of the session (tests/conftest.py) starts on its own, whose parent, its raylet, is older."""
    new = {}
    for p in psutil.Process().children(recursive=True):
        if p.pid not in before:
            with contextlib.suppress(psutil.Error):
                new[p.pid] = p.ppid()
    found, parents = set(), {os.getpid()}
    while parents:
        parents = {pid for pid, ppid in new.items() if ppid in parents} - found
        found |= parents
    return found


def wait_until(condition: Callable[[], bool], timeout: float = 120) -> bool:
    """Whether `condition` came true within `timeout` (a bound for what never happens, not a machine's speed)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def sleeps_seen(pid: int, count: int, timeout: float = 120) -> bool:
    """Whether process `pid` was seen asleep in `count` different sleeps (a poll loop's sleep between its
    looks: the first proves its first look is done) within `timeout`; False once it has exited."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < count and time.monotonic() < deadline:
        try:
            asleep = _asleep(pid)
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:  # gone
            return False
        if "State:\tZ" in status:
            return False
        if asleep:  # a sleep's count of voluntary switches: one more for every sleep after it
            seen.add(int(re.search(r"voluntary_ctxt_switches:\s+(\d+)", status).group(1)))
        time.sleep(0.01)
    return len(seen) >= count


# clock_nanosleep and nanosleep by machine, where the kernel hides the wait channel's name
_SLEEP_CALLS = {"x86_64": {230, 35}, "aarch64": {115, 101}}


def _asleep(pid: int) -> bool:
    """Whether the process sleeps in time.sleep now (its wait channel, else its system call)."""
    wchan = Path(f"/proc/{pid}/wchan").read_text()
    if wchan not in ("", "0"):
        return "nanosleep" in wchan
    call = Path(f"/proc/{pid}/syscall").read_text().split()[0]
    return call.isdigit() and int(call) in _SLEEP_CALLS.get(os.uname().machine, set())


def guard_tree(root: int) -> int:
    """The launcher's own watchdog (launch/control/guard.py) over a process tree a test started in a session of
    its own (`ray start --head --block`): if this pytest process dies before its cleanup runs (SIGKILL, a
    timeout's SIGTERM), the watchdog ends the tree, which would otherwise outlive it. Its pid: SIGTERM it once
    the test has ended the tree itself."""
    from megatrain.ipc.procs import spawn_detached, start_ticks

    me = os.getpid()
    return spawn_detached("megatrain.launch.control.guard", str(me), str(start_ticks(me)), str(root))


def stop_guard(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)


def on_threads(calls: list[Callable[[], Any]]) -> list[Any]:
    """Every call at once, one thread each (a group forms only when all its members are there); their
    results in order, or the first error raised."""
    out: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:  # surfaced below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("an executor's call did not return")
    return out
