"""The step loop: one call per actor per step, Adam's update overlapping the next step, evaluations and
checkpoints between steps, a graceful stop on a signal; each step's row to launch/report/reporting.py."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain import log
from megatrain.actors.adam_updater import AdamUpdater
from megatrain.actors.executor.gpu_executor import GpuExecutor
from megatrain.collective import split_rows
from megatrain.data import Data
from megatrain.data.loader import Prefetcher
from megatrain.errors import ProtocolError
from megatrain.flops import active_params, model_step_flops
from megatrain.formats.checkpoint import step_dir
from megatrain.host.adamw import lr_at
from megatrain.ipc.messages import AdamRequest, Applied, FillReport, HostMemory, StepReport, StepRequest
from megatrain.ipc.protocol import StoreSpec, checkpoint_host_bytes
from megatrain.launch.config.tree import Config
from megatrain.launch.control.crew import Crew
from megatrain.launch.control.runners import Pending
from megatrain.launch.report.actor_profile import ActorProfile
from megatrain.launch.report.metrics import executor_row
from megatrain.launch.report.reporting import Reporter, RunSummary
from megatrain.launch.run.checkpoints import Checkpointer, Saves
from megatrain.launch.run.evaluation import Evaluator
from megatrain.launch.run.stopping import StopRequest
from megatrain.roster import EXECUTOR, Kind, Verb
from megatrain.step.engine import EngineConfig


@dataclass(frozen=True, kw_only=True)
class PreparedRun:
    """What the start-up settled and the loop runs with (Trainer.setup's answer)."""

    run_id: str
    cfg: Config  # resolved: ipc.staging as the actors were spawned for, the stall monitor's timeout
    engine: EngineConfig  # resolved: the device, the `auto` sizes chosen
    crew: Crew
    data: Data
    spec: StoreSpec
    specs: list[StoreSpec]  # every host's store (host 0's is `spec`)
    fills: list[FillReport]  # how each host's store was filled
    executors: int  # actors.num_gpus, resolved: each host's
    hosts: int  # actors.num_hosts, resolved
    out: Path
    start: int  # the first step to run (a resumed run's checkpoint step)
    steps: int
    evaluator: Evaluator
    checkpointer: Checkpointer
    config_yaml: str  # the resolved config, into each checkpoint's manifest
    stop: StopRequest | None
    launched: float  # time.monotonic() at launch

    @property
    def cuda(self) -> bool:
        """The executor's device."""
        return self.engine.device == "cuda"


class StepLoop:
    def __init__(self, run: PreparedRun):
        self.run, self.cfg, self.crew = run, run.cfg, run.crew
        self.metrics: list[dict] = []
        self.stopped_after: int | None = None
        self.first_step_s: float | None = None  # launch -> the first step's end (s)
        self.reporter: Reporter | None = None  # while the loop runs
        self.executors = run.crew.of(Kind.EXECUTOR)  # executor 0 first, host by host; each runs its rows of a batch
        self.adams = run.crew.of(Kind.ADAM)  # one per host, each updating its host's slice
        if run.crew.roster is None:
            raise ProtocolError("the step loop calls the spawned actors of the run's roster, and there is none")
        self.streaming = run.crew.roster.stepping(Verb.STREAM)  # called with step(t) each step
        self.loader: Prefetcher | None = None
        self.saves = Saves(
            run.crew,
            run.checkpointer,
            # the HF config as the driver holds it: the writer would import transformers to read its own
            {"config": run.config_yaml, "steps_total": run.steps, "hf_config": run.spec.model.hf_config.to_dict()},
            run.cfg.train.step_timeout_s,
            self._recorded,
            self._sync,
        )

    def __call__(self) -> None:
        """With train.overlap_adam, step t+1 is launched while Adam still updates step t's units: packers
        wait per unit for its update (version counters), so the next forward starts as soon as the
        embedding is updated instead of after the whole model. An evaluation after step t runs before step
        t+1 is launched, on the same version counters. A checkpoint after step t is launched with step t+1
        and written while it runs (actors/checkpoint_writer.py)."""
        run, cfg = self.run, self.cfg
        timeout = cfg.train.step_timeout_s
        prev: tuple[dict, dict[str, Pending]] | None = None
        self.loader = loader = Prefetcher(run.data.batch, run.start, run.steps, cfg.data.prefetch)
        flops = model_step_flops(run.spec.model, cfg.data.batch_size, cfg.data.seq_len)
        self.reporter = Reporter(
            run.out,
            cfg.train,
            run.cuda,
            flops,
            run.start,
            run.steps,
            lambda step, row: run.evaluator.describe(step, row),
        )
        sampled = ActorProfile(cfg.train, run.out, self.crew)
        try:
            for t in range(run.start, run.steps):
                if run.stop is not None and run.stop.signum is not None:
                    if prev is not None:  # the last launched step's update, then the checkpoint
                        self._record(
                            prev[0], self._applied(self.crew.gather(_previous(prev[1]), timeout, "Adam"), previous=True)
                        )
                        prev = None
                    self._stop_gracefully(t)
                    break
                sampled.before(t)
                calls, row = self._launch(t, loader, saving=run.checkpointer.writing == t)
                adam = {n: calls.pop(n) for n in self.adams}
                if prev is not None:
                    calls.update(_previous(prev[1]))
                if not cfg.train.overlap_adam:
                    calls.update(adam)
                res = self.crew.gather(calls, timeout, f"step {t}", self.saves.writing())
                self._first_step_done()
                sampled.after(t)
                self.saves.taken(res)
                row = executor_row(row, StepReport.merge([res.pop(n) for n in self.executors]))
                row.update(self._maybe_evaluate(t + 1))
                if prev is not None:
                    self._record(prev[0], self._applied(res, previous=True))
                if cfg.train.overlap_adam:
                    prev = (row, adam)
                else:
                    self._record(row, self._applied(res))
                    prev = None
                if run.checkpointer.due(t + 1):
                    self.saves.start(t + 1, row["epoch"], cfg.data.seed)
            if prev is not None:
                last = self.crew.gather(_previous(prev[1]), timeout, "the last Adam update", self.saves.writing())
                self._record(prev[0], self._applied(last, previous=True))
            self.saves.wait()
        finally:
            self.reporter.close()
            self.reporter = None
            self.loader.close()

    def summary(self, memory: list[HostMemory], observed: dict[str, dict], startup_s: dict[str, float]) -> RunSummary:
        """The run's summary once the loop ended: `memory`, each host's after it; `observed`, each actor's threads;
        `startup_s`, the start-up's phases."""
        run, spec, written = self.run, self.run.spec, self.run.checkpointer.written
        stopped = self.stopped_after is not None
        return RunSummary(
            run_id=run.run_id,
            output_dir=run.out,
            steps=run.steps,
            last_step=self.stopped_after if self.stopped_after is not None else run.steps,
            stopped_by=run.stop.name if stopped and run.stop is not None else "",
            checkpoint=step_dir(run.checkpointer.root, written) if written else None,
            checkpoints=run.checkpointer.history,
            metrics=self.metrics,
            time_to_first_step_s=self.first_step_s,
            startup_s=startup_s,
            fills=run.fills,
            memory=memory,
            cpu_plan={n: dataclasses.asdict(t) for n, t in spec.threads.items() if n in self.crew.actors},
            threads_observed=observed,
            pids=dict(self.crew.pids),
            num_params=spec.layout.num_params,
            active_params=active_params(spec.model),
            store_bytes=sum(spec.part_bytes().values()),
            executor_host_bytes=checkpoint_host_bytes(
                spec.model, run.engine, self.cfg.data.batch_size, self.cfg.data.seq_len
            ),
            staging=spec.staging_mode,
            executors=run.executors,
            hosts=run.hosts,
        )

    def _stop_gracefully(self, step: int) -> None:
        """A signal asked to stop: `step` steps are done and applied; checkpoint them unless that is off,
        nothing is new since the start, or it was just written."""
        self.stopped_after = step
        self.saves.wait()
        if not self.cfg.train.save_on_signal or step == self.run.start or step == self.run.checkpointer.written:
            return
        self.saves.ensure_writer(self.cfg.actors.writer_threads, self.run.specs)
        self.saves.start(step, self.metrics[-1]["epoch"], self.cfg.data.seed)
        self.saves.wait()

    def _launch(self, t: int, loader: Prefetcher, saving: bool = False) -> tuple[dict[str, Pending], dict]:
        cfg, crew = self.cfg, self.crew
        b = loader.get(t)
        ids, labels, positions = b.ids, b.labels, b.positions
        lr = lr_at(cfg.optim, t, self.run.steps)
        row = {"step": t + 1, "epoch": b.epoch, "lr": lr, "t0": time.perf_counter(), "batch_tokens": ids.numel()}
        timeline = t + 1 == cfg.train.timeline_step
        # Absolute: the executor writes it, from its own working directory (on the GPU's node).
        profile = (
            str((self.run.out / f"profile-step-{t + 1}.json").resolve())
            if t + 1 == cfg.train.profile.step and cfg.train.profile.actor == EXECUTOR
            else ""
        )
        calls: dict[str, Pending] = {}
        parts = split_rows(ids.shape[0], len(self.executors))
        for name, (rid, rlab, rpos) in zip(self.executors, _rows(parts, ids, labels, positions)):
            request = StepRequest(
                step=t, ids=rid, labels=rlab, timeline=timeline, profile=profile, positions=rpos, lr=lr
            )
            calls[name] = crew.call(name, GpuExecutor.step, request)
            timeline, profile = False, ""  # executor 0's only
        for name in self.adams:
            calls[name] = crew.call(name, AdamUpdater.step, AdamRequest(step=t, lr=lr, saving=saving))
        for name in self.streaming:  # packers and accumulators: step(t), their share of the slabs
            calls[name] = crew.call(name, crew.actors[name].cls.step, t)
        return calls, row

    def _maybe_evaluate(self, step: int) -> dict:
        every, evaluator = self.cfg.train.eval_every, self.run.evaluator
        last = step == self.run.steps and self.cfg.train.final_eval
        if not evaluator.enabled or not (last or (every and step % every == 0)):
            return {}
        return evaluator(step)

    def _first_step_done(self) -> None:
        """Launch to the end of the first step's forward and backward (its loss is known; its Adam update
        overlaps the next step, so its metrics row is written after that one)."""
        if self.first_step_s is None:
            self.first_step_s = time.monotonic() - self.run.launched
            log(f"first step done {self.first_step_s:.1f} s after launch")

    def _applied(self, res: dict, previous: bool = False) -> Applied:
        """The step's update as one: each host's updater's answer, which agree on the global norm (host 0's
        timeline; the slowest host's time)."""
        return Applied.merge([res[_PREVIOUS + n if previous else n] for n in self.adams])

    def _record(self, row: dict, adam: Applied) -> None:
        if self.reporter is None:
            raise ProtocolError(f"step {row['step']} recorded outside the step loop")
        self.metrics.append(self.reporter.record(row, adam))
        self.saves.publish_ready()

    def _recorded(self) -> int:
        return self.metrics[-1]["step"] if self.metrics else self.run.start

    def _sync(self) -> None:
        if self.reporter is not None:
            self.reporter.sync()


_PREVIOUS = "previous step: "  # an update launched with the step before, gathered with this one


def _previous(adam: dict[str, Pending]) -> dict[str, Pending]:
    return {_PREVIOUS + n: p for n, p in adam.items()}


def _rows(parts: list[slice], *batch: torch.Tensor | None) -> list[tuple[torch.Tensor | None, ...]]:
    """Each executor's rows of the batch's tensors; copies, where there are several (a view would carry its
    whole batch's storage through Ray)."""
    if len(parts) == 1:
        return [batch]
    return [tuple(None if x is None else x[rows].clone() for x in batch) for rows in parts]
