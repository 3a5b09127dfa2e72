"""The driver's own section of the config tree."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatrain.config.base import opt, section
from megatrain.ipc.shared.shm import check_run_id
from megatrain.roster import EXECUTOR, parse_role


@dataclass
class ProfileConfig:
    step: int = opt(0, "The step to profile; 0 = none.")
    actor: str = opt(
        EXECUTOR,
        "Which actor: 'gpu-executor' runs that step under torch.profiler (a Chrome "
        "trace in OUTPUT_DIR/profile-step-N.json, and a count of host-blocking CUDA "
        "calls the compute thread made inside the layer loop: logged, should be 0); a "
        "CPU actor (adam-updater, store-owner, packer-N, grad-accumulator-N, "
        "checkpoint-writer), or another executor of several (gpu-executor-N), is sampled with py-spy "
        "during that step into "
        "OUTPUT_DIR/profiles/ACTOR-step-N.speedscope.json (needs py-spy and ptrace "
        "rights: root, or kernel.yama.ptrace_scope 0).",
    )

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError("train.profile.step must be >= 0 (0 = none)")
        try:
            parse_role(self.actor)
        except ValueError as exc:
            raise ValueError(f"train.profile.actor: {exc}") from None


@dataclass
class TrainConfig:
    RENAMED: ClassVar[dict[str, str]] = {"profile_step": "profile.step", "profile_actor": "profile.actor"}

    steps: int = opt(100, "Optimizer steps to run.")
    output_dir: str = opt(
        "runs/{run_id}", "Where metrics.jsonl, config.yaml and saved weights go; {run_id} is replaced."
    )
    run_id: str = opt("", "Names the run's shared memory (1-32 lowercase letters and digits); empty = random.")
    overwrite: bool = opt(
        False,
        "Start in a train.output_dir that holds another run's metrics.jsonl, replacing "
        "its metrics, config, error.log, timeline, profiles and final weights; false "
        "refuses to start there.",
    )
    log_every: int | str = opt(
        "auto",
        "Print a plain progress line (train.progress: lines) every this many steps; auto: "
        "about every 10 s of wall time, at an interval of 1, 2, 5, 10, 20, 50... steps "
        "from the recent steps' pace, and the first and last step. metrics.jsonl gets every step.",
    )
    progress: str = opt(
        "auto",
        "How progress is shown: 'bar' (a tqdm bar with step, loss, tokens/s, TFLOPS and "
        "ETA), 'lines' (a plain line every log_every steps, with the same and the ETA), "
        "or 'auto' (bar on a terminal; lines under ray job submit, CI or redirected "
        "output).",
    )
    tensorboard: bool = opt(
        False,
        "Write loss, lr, grad_norm, tokens/s, TFLOPS, step time, GPU memory and "
        "eval_loss as TensorBoard scalars to OUTPUT_DIR/tb (needs the tensorboard "
        "package: pip install 'megatrain[tensorboard]').",
    )
    save_final: bool = opt(False, "Write the final fp32 weights to OUTPUT_DIR/final as an HF model directory.")
    save_every: int = opt(
        0,
        "Write a checkpoint (fp32 weights, Adam moments, the step) to "
        "OUTPUT_DIR/checkpoints/step-N every this many steps, and one after the last step; "
        "0 = off (unless save_every_minutes).",
    )
    save_every_minutes: float = opt(
        0.0,
        "Also write a checkpoint once this many minutes have passed since the "
        "last one (checked after each step); 0 = off.",
    )
    keep_last: int = opt(
        0,
        "Keep only the newest this many complete checkpoints (older ones are removed after "
        "a new one is complete); 0 = keep all.",
    )
    save_on_signal: bool = opt(
        True,
        "On the first SIGINT, SIGTERM or SIGHUP finish the current step and write a "
        "checkpoint before exiting (a second signal exits at once).",
    )
    resume: str = opt(
        "auto",
        "Where to start from: 'auto' (the newest complete checkpoint in OUTPUT_DIR, if "
        "any, else from scratch), 'none', or a checkpoint directory or run directory. "
        "metrics.jsonl is then appended and step numbers continue.",
    )
    overlap_adam: bool = opt(
        True,
        "Launch step t+1 while Adam still updates step t (per-piece version "
        "counters keep it exact); false waits for Adam between steps.",
    )
    timeline_step: int = opt(
        0,
        "Record a per-unit timeline (H2D, compute, D2H, CPU Adam) of this step "
        "into OUTPUT_DIR/timeline.json; 0 = none.",
    )
    profile: ProfileConfig = section(ProfileConfig, "Profile one actor over one step.")
    eval_every: int = opt(
        0,
        "Evaluate every this many steps (and after the last one, see train.final_eval), when "
        "there is evaluation data: data.eval_path, data.eval_fraction, or the arithmetic's "
        "held-out problems; 0: only after the last step.",
    )
    final_eval: bool = opt(
        True,
        "Evaluate after the last step (when there is evaluation data); false skips it, "
        "as a benchmark does (bench/run.py). train.eval_every still applies.",
    )
    eval_batches: int = opt(
        0,
        "Batches per evaluation, from the start of the evaluation set in file order; "
        "0: the whole set (generated arithmetic: 8).",
    )
    step_timeout_s: float = opt(1800.0, "A step that takes longer than this fails the run.")
    setup_timeout_s: float = opt(600.0, "Starting and attaching all actors must finish within this.")

    @property
    def saves_checkpoints(self) -> bool:
        """Periodic checkpoints are on (the checkpoint writer runs from the start)."""
        return self.save_every > 0 or self.save_every_minutes > 0

    def __post_init__(self) -> None:
        if self.run_id:
            try:
                check_run_id(self.run_id)  # the one rule, where shared-memory names are made
            except ValueError as exc:
                raise ValueError(f"train.run_id: {exc} (it names shared memory)") from None
        if not self.output_dir.strip():
            raise ValueError("train.output_dir must not be empty")
        if self.steps < 0:
            raise ValueError("train.steps must be >= 0")
        if self.log_every != "auto" and not (isinstance(self.log_every, int) and self.log_every >= 1):
            raise ValueError(f"train.log_every must be a number of steps >= 1 or 'auto', not {self.log_every!r}")
        if self.eval_every < 0 or self.eval_batches < 0:
            raise ValueError("train.eval_every and train.eval_batches must be >= 0")
        if self.save_every < 0 or self.save_every_minutes < 0 or self.keep_last < 0:
            raise ValueError("train.save_every, train.save_every_minutes and train.keep_last must be >= 0")
        if not self.resume.strip():
            raise ValueError("train.resume must be 'auto', 'none' or a path")
        if self.timeline_step < 0:
            raise ValueError("train.timeline_step must be >= 0 (0 = none)")
        if self.progress not in ("auto", "bar", "lines"):
            raise ValueError(f"train.progress must be 'auto', 'bar' or 'lines', not '{self.progress}'")
        if self.step_timeout_s <= 0 or self.setup_timeout_s <= 0:
            raise ValueError("train.step_timeout_s and train.setup_timeout_s must be > 0")
