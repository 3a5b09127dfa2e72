"""The driver: plans the run, places the actors, runs the step loop (one call per actor per step),
logs, and shuts everything down on every path.

It owns no host memory of the run: the store lives in the store owner's actor on the GPU's node, so
the driver can run anywhere (a laptop attached to a cluster, a `ray job submit` entrypoint).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from megatrain.actors.adam_updater import AdamUpdater
from megatrain.actors.checkpoint_writer import CheckpointWriter
from megatrain.actors.gpu_executor import GpuExecutor
from megatrain.actors.grad_accumulator import GradAccumulator
from megatrain.actors.packer import Packer
from megatrain.actors.store_owner import StoreOwner
from megatrain.ipc.protocol import StoreSpec, checkpoint_host_bytes
from megatrain.ipc.shm import check_run_id, check_run_id_free
from megatrain.launch.actor_profile import ActorProfile
from megatrain.launch.checkpointing import Checkpointer
from megatrain.launch.config import Config
from megatrain.launch.evaluation import Evaluator
from megatrain.launch.metrics import executor_row
from megatrain.launch.output import (
    OutputLock,
    describe_memory,
    describe_run,
    prepare_output,
    resolve_output,
    short,
)
from megatrain.launch.placement import Demand, bundle, demands, describe_need, expect_packers, thread_request
from megatrain.launch.reporting import Reporter
from megatrain.launch.resume import check_fits, find_checkpoint
from megatrain.launch.runners import Handle, Pending, make_runner
from megatrain.launch.stopping import StopRequest, sigint_deferred
from megatrain.launch.tensorboard import summary_writer

from megatrain import autosize, log
from megatrain.adamw import lr_at
from megatrain.checkpoint import step_dir as ckpt_step_dir
from megatrain.configbase import differences, dump_yaml
from megatrain.data import Data, open_data
from megatrain.data.loader import Prefetcher
from megatrain.engine import resolve_engine
from megatrain.errors import AbortError, ActorFailure, MegatrainError
from megatrain.flops import model_step_flops
from megatrain.model import build_spec, resolve_hf_config

SHUTDOWN_S = 15.0


class Trainer:
    def __init__(self, cfg: Config, stop: StopRequest | None = None):
        self.cfg = cfg
        self.stop = stop  # a graceful-stop request (signal), checked between steps
        self.stopped_after: int | None = None
        self.run_id = check_run_id(cfg.train.run_id or secrets.token_hex(5))
        self.out = resolve_output(cfg.train.output_dir, self.run_id)  # absolute; printed at start
        self.log_dir: Path | None = None  # where error.log may go: set once the output directory is ours
        self.runner = make_runner(cfg.launch)
        self.actors: dict[str, Handle] = {}
        self.pids: dict[str, int] = {}
        self.spec: StoreSpec | None = None
        self.sentinel: Pending | None = None
        self.metrics: list[dict] = []
        self.data: Data | None = None
        self.steps = cfg.train.steps
        self.start = 0  # the first step to run (a resumed run's checkpoint step)
        self.resume_dir: Path | None = None
        self.loader: Prefetcher | None = None
        self.evaluator: Evaluator | None = None
        self.pending_write: Pending | None = None  # the checkpoint being written
        self.staged: dict | None = None  # the checkpoint written but not yet published (CheckpointWriter.publish)
        self.reporter: Reporter | None = None  # while the step loop runs
        self.store_fill: dict = {}  # how the store was filled (StoreOwner.fill_report)
        self._closed = False
        self.lock: OutputLock | None = None  # the output directory's, for the run's life
        self.launched, self.first_step_s = time.monotonic(), None  # launch -> the first step's end (s)
        self.launched_wall, self.marks = time.time(), {}  # each actor's start-up timeline (Role.mark)
        self.startup: dict[str, float] = {}  # seconds per start-up phase, in order (logged before step 1)

    # ---- public -----------------------------------------------------------------------------
    def run(self) -> dict:
        self.launched, self.launched_wall = time.monotonic(), time.time()
        atexit.register(self.shutdown)
        try:
            self.setup()
            self.train()
            mem = self._call_one("store-owner", "host_memory")  # after the last step: every page is in use
            observed = self._gather({n: self.runner.call(h, "thread_counts") for n, h in self.actors.items()},
                                    self.cfg.train.setup_timeout_s, "thread counts")
            if self.stopped_after is None:
                self._finish(mem)
            written = self.checkpointer.written
            return {"run_id": self.run_id, "output_dir": str(self.out), "metrics": self.metrics,
                    "stopped_by": self.stop.name if self.stopped_after is not None else "",
                    "last_step": self.stopped_after if self.stopped_after is not None else self.steps,
                    "checkpoint": str(ckpt_step_dir(self.checkpointer.root, written)) if written else "",
                    "checkpoints": self.checkpointer.history, "store_fill": self.store_fill,
                    "time_to_first_step_s": self.first_step_s, "startup_s": dict(self.startup),
                    "cpu_plan": {n: dataclasses.asdict(t) for n, t in self.spec.threads.items() if n in self.actors},
                    "threads_observed": observed, "pids": dict(self.pids), "num_params": self.spec.layout.num_params,
                    "store_bytes": sum(self.spec.part_bytes().values()), "staging": self.spec.staging_mode,
                    "executor_host_bytes": checkpoint_host_bytes(self.spec.model, self.engine_cfg,
                                                                 self.cfg.data.batch_size, self.cfg.data.seq_len),
                    "process_pss_bytes": mem["pss_bytes"], "pss_own_by_role": mem["pss_own_by_role"],
                    "processes": mem["processes"]}
        finally:
            self.shutdown()
            atexit.unregister(self.shutdown)

    def _finish(self, mem: dict) -> None:
        """After the last step (not after a graceful stop)."""
        describe_memory(mem, self.spec.layout.num_params)
        if self.evaluator is not None and self.evaluator.examples and self.cfg.train.final_eval:
            log("held-out problems answered by greedy decoding after the last step:\n  "
                + "\n  ".join(self.evaluator.solved_examples()))
        if self.cfg.train.save_final:
            tok = None if self.cfg.data.kind in ("arithmetic", "tokens") else (self.cfg.data.tokenizer
                                                                               or self.cfg.model.pretrained)
            path = self._call_one("store-owner", "save", str(self.out / "final"), tok)
            log(f"saved final fp32 weights to {path}")

    # ---- setup ------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        if cfg.train.run_id and not (cfg.launch.address or os.environ.get("RAY_ADDRESS")):
            check_run_id_free(cfg.train.run_id, cfg.ipc.shm_dir)  # the store is on this machine: say it now
        if cfg.train.tensorboard:
            summary_writer()  # a missing package is a usage error before anything starts
        self.lock = OutputLock(self.out, self.run_id)  # before anything in the directory is read or changed
        self.resume_dir = find_checkpoint(cfg.train.resume, self.out)
        manifest = check_fits(self.resume_dir, cfg) if self.resume_dir else None
        self.start = int(manifest["step"]) if manifest else 0
        in_place = self.resume_dir is not None and self.resume_dir.parent.parent.resolve() == self.out.resolve()
        prepare_output(self.out, cfg.train.overwrite, self.start if in_place else None)
        self.log_dir = self.out
        # The data first: a bad file is reported (and tokenizing is done) before any process starts.
        self.data = open_data(cfg.data, resolve_hf_config(cfg.model)[1], cfg.model.pretrained)
        self.steps = self.data.steps(cfg.train.steps)
        self.checkpointer = Checkpointer(cfg.train, self.out / "checkpoints", self.steps)
        if self.resume_dir:
            log(f"resuming from {self.resume_dir} (after step {self.start} of {self.steps})")
        if self.steps != cfg.train.steps:
            log(f"data.epochs {cfg.data.epochs} x {self.data.batches_per_epoch} batches per epoch = {self.steps} "
                f"steps (train.steps {cfg.train.steps} is not used)")
        self._phase("config and data")
        dem = demands(cfg.actors, cuda=False)
        self.runner.connect(bundle(dem)["CPU"])
        self._phase("Ray")
        cuda = cfg.engine.device == "cuda" or (cfg.engine.device == "auto" and self.runner.has_gpu())
        self.engine_cfg = resolve_engine(cfg.engine, cuda)
        self._write_config()
        changed = differences(self._resolved(), Config())
        log(f"run {self.run_id}; output directory {self.out}")
        log(f"config (what differs from the defaults; all of it, resolved, in "
            f"{self.out / 'config.yaml'}):\n  " + "\n  ".join(f"{k}: {short(v)}" for k, v in changed))
        dem = demands(cfg.actors, cuda, clip=cfg.optim.clips, writer=self.checkpointer.enabled,
                      staging=cfg.ipc.staging)
        self.runner.place(bundle(dem), describe_need(dem))
        self._phase("placement")
        # Worker processes start (and import torch, compile Numba, make a CUDA context) while the store
        # owner makes and fills the store; they attach to it once it exists. The engine's sizes wait for
        # the executor's free GPU memory; the store does not wait for them (the owner settles them after).
        self.actors["store-owner"] = self.runner.spawn("store-owner", StoreOwner, (), dem["store-owner"])
        self._spawn_workers(dem, packers=expect_packers(cfg.ipc.staging, cuda))
        creating = self._create_store()
        self._autosize()
        if self.engine_cfg.device == "cuda":
            self._phase("executor started (imports, CUDA context; the store is made meanwhile)")
        self._settle_store(creating)
        self._phase("store made and filled (beyond the executor's start)")
        self._write_config()  # now with ipc.staging as the store owner resolved it
        self._attach_workers(dem)
        self._phase("actors attached (pinning, CUDA IPC events)")
        self._describe()
        self.evaluator = Evaluator(self.data, cfg.train.eval_batches, list(self.actors),
                                   lambda name, method, *a: self.runner.call(self.actors[name], method, *a),
                                   lambda calls, what: self._gather(calls, cfg.train.step_timeout_s, what))

    def _phase(self, name: str) -> None:
        """Close a start-up phase: the time since launch not yet given to an earlier one."""
        self.startup[name] = time.monotonic() - self.launched - sum(self.startup.values())

    def _resolved(self) -> Config:
        cfg = self.cfg
        ipc = dataclasses.replace(cfg.ipc, staging=self.spec.staging_mode) if self.spec else cfg.ipc
        return dataclasses.replace(cfg, engine=self.engine_cfg, ipc=ipc,
                                   train=dataclasses.replace(cfg.train, run_id=self.run_id))

    def _write_config(self) -> None:
        (self.out / "config.yaml").write_text(dump_yaml(self._resolved()))

    def _create_store(self) -> Pending:
        """The owner's create call, not waited for: it plans with the engine's sizes still `auto`."""
        cfg = self.cfg
        self.sentinel = self.runner.call(self.actors["store-owner"], "serve")
        return self.runner.call(self.actors["store-owner"], "create", self.run_id, cfg.model, cfg.optim.no_decay_1d,
                                cfg.optim.clips, self.engine_cfg, cfg.actors.num_packers,
                                cfg.actors.num_accumulators, cfg.ipc, (cfg.data.batch_size, cfg.data.seq_len),
                                str(self.resume_dir) if self.resume_dir else None, thread_request(cfg.actors),
                                {"output_dir": str(self.out), "steps": self.steps, "first": self.start})

    def _settle_store(self, creating: Pending) -> None:
        self._gather({"store-owner": creating}, self.cfg.train.setup_timeout_s, "store-owner.create")
        self.spec = self._call_one("store-owner", "settle", self.engine_cfg)
        log(f"weight staging: {self.spec.staging_mode}; gradients: "
            + ("into the resident copy, until the global norm is known (clipping)" if self.spec.grads_in_resident
               and self.spec.clip else "into the resident copy, updated as they come (no clipping)"
               if self.spec.grads_in_resident else "fp32 plane, global-norm clipping" if self.spec.clip
               else "straight to Adam (no clipping)"))
        fill = self.store_fill = self._call_one("store-owner", "fill_report")
        log(f"store filled from {fill['source']} in {fill['seconds']:.1f} s" + (
            f" ({fill['bytes'] / 1e9:.2f} GB read, {fill['bytes'] / 1e9 / max(fill['seconds'], 1e-9):.2f} GB/s)"
            if fill["bytes"] else ""))

    def _autosize(self) -> None:
        """Resolve the engine's `auto` sizes from the GPU memory the executor finds free (autosize.py)."""
        cfg = self.cfg
        free = self._call_one("gpu-executor", "gpu_free_bytes") if self.engine_cfg.device == "cuda" else None
        sizes, why = autosize.choose(build_spec(cfg.model, cfg.optim.no_decay_1d), self.engine_cfg,
                                     cfg.data.batch_size, cfg.data.seq_len, free, cfg.optim.clips)
        self.engine_cfg = autosize.apply(self.engine_cfg, sizes)
        log(f"engine sizes: {sizes} ({why}; the rule for 'auto': megatrain/autosize.py)")

    def _spawn_workers(self, dem: dict, packers: bool) -> None:
        family = resolve_hf_config(self.cfg.model)[0]
        plan: list[tuple[str, type, tuple]] = [("gpu-executor", GpuExecutor, (self.engine_cfg, family))]
        accumulators = [n for n in dem if n.startswith("grad-accumulator-")]  # as demands() expects them
        plan += [(name, GradAccumulator, (i,)) for i, name in enumerate(accumulators)]
        plan += [("adam-updater", AdamUpdater, (self.cfg.optim,))]
        if self.checkpointer.enabled:
            plan += [("checkpoint-writer", CheckpointWriter, (self.cfg.actors.writer_threads,))]
        if packers:
            plan += self._packer_plan()
        for name, cls, args in plan:
            self.actors[name] = self.runner.spawn(name, cls, args, dem[name])

    def _packer_plan(self) -> list[tuple[str, type, tuple]]:
        a = self.cfg.actors
        return [(f"packer-{i}", Packer, (i,)) for i in range(a.num_packers)]

    def _attach_workers(self, dem: dict) -> None:
        spec = self.spec
        packers = [n for n in self.actors if n.startswith("packer-")]
        if spec.resident:  # nothing to pack per step: Adam writes the resident copy
            for name in packers:
                self.runner.kill(self.actors.pop(name))
        if not spec.running_accumulators:  # gradients go straight to Adam, or into the resident copy
            for name in [n for n in self.actors if n.startswith("grad-accumulator-")]:
                self.runner.kill(self.actors.pop(name))
        elif not packers:
            for name, cls, args in self._packer_plan():
                self.actors[name] = self.runner.spawn(name, cls, args, dem[name])
        workers = {n: h for n, h in self.actors.items() if n != "store-owner"}
        extra = {"adam-updater": (self.start,),  # Adam's step count (bias correction) continues
                 "gpu-executor": (self.engine_cfg,)}  # with the sizes chosen since it started
        self._gather({n: self.runner.call(h, "attach", spec, *extra.get(n, ())) for n, h in workers.items()},
                     self.cfg.train.setup_timeout_s, "starting the actors")
        infos = self._gather({n: self.runner.call(h, "info") for n, h in self.actors.items()},
                             self.cfg.train.setup_timeout_s, "starting the actors")
        self.pids = {n: i["pid"] for n, i in infos.items()}
        self.marks = {n: i["marks"] for n, i in infos.items()}
        self.runner.pids = self.pids
        handles = self._call_one("gpu-executor", "event_handles")
        if handles is not None:
            drainers = [n for n in self.actors if n.startswith("grad-accumulator")] if spec.clip else ["adam-updater"]
            self._gather({n: self.runner.call(self.actors[n], "open_events", handles) for n in drainers}, 120,
                         "opening CUDA IPC events")

    def _describe(self) -> None:
        device = self._call_one("gpu-executor", "device_name")
        describe_run(self.spec, device, self.engine_cfg.compute_dtype, self.pids, list(self.actors),
                     self.cfg.launch.runner == "inprocess")
        log(f"start-up {sum(self.startup.values()):.1f} s: "
            + ", ".join(f"{k} {v:.1f}" for k, v in self.startup.items()))
        log("start-up by process (s after launch): " + "; ".join(
            f"{name}: " + ", ".join(f"{k} {t - self.launched_wall:.1f}" for k, t in marks.items() if t)
            for name, marks in self.marks.items()))

    # ---- the loop ---------------------------------------------------------------------------
    def train(self) -> None:
        """The step loop. With train.overlap_adam, step t+1 is launched while Adam still updates step
        t's units: packers wait per unit for its update (version counters), so the next forward
        starts as soon as the embedding is updated instead of after the whole model. An evaluation
        after step t runs before step t+1 is launched, on the same version counters. A checkpoint after
        step t is launched with step t+1 and written while it runs (actors/checkpoint_writer.py)."""
        cfg = self.cfg
        prev: tuple[dict, Pending] | None = None
        self.loader = Prefetcher(self.data.batch, self.start, self.steps, cfg.data.prefetch)
        flops = model_step_flops(self.spec.model, cfg.data.batch_size, cfg.data.seq_len)
        self.reporter = Reporter(self.out, cfg.train, self.engine_cfg.device == "cuda", flops,
                                 self.start, self.steps, lambda step, row: self.evaluator.describe(step, row))
        sampled = ActorProfile(cfg.train, self.out, list(self.actors), self._call_one)
        try:
            for t in range(self.start, self.steps):
                if self.stop is not None and self.stop.signum is not None:
                    if prev is not None:  # the last launched step's update, then the checkpoint
                        self._record(prev[0], self._gather({"adam-previous": prev[1]}, cfg.train.step_timeout_s,
                                                           "Adam")["adam-previous"])
                        prev = None
                    self._stop_gracefully(t)
                    break
                sampled.before(t)
                calls, row = self._launch(t, saving=self.checkpointer.writing == t)
                adam = calls.pop("adam-updater")
                if prev is not None:
                    calls["adam-previous"] = prev[1]
                if not cfg.train.overlap_adam:
                    calls["adam-updater"] = adam
                res = self._gather(calls, cfg.train.step_timeout_s, f"step {t}", self._writing())
                self._first_step_done()
                sampled.after(t)
                self._maybe_written(res)
                row = executor_row(row, res["gpu-executor"])
                row.update(self._maybe_evaluate(t + 1))
                if prev is not None:
                    self._record(prev[0], res["adam-previous"])
                if cfg.train.overlap_adam:
                    prev = (row, adam)
                else:
                    self._record(row, res["adam-updater"])
                    prev = None
                if self.checkpointer.due(t + 1):
                    self._start_checkpoint(t + 1, row["epoch"])
            if prev is not None:
                self._record(prev[0], self._gather({"adam-previous": prev[1]}, cfg.train.step_timeout_s,
                                                   "the last Adam update", self._writing())["adam-previous"])
            self._wait_written()
        finally:
            self.reporter.close()
            self.reporter = None
            self.loader.close()

    def _stop_gracefully(self, step: int) -> None:
        """A signal asked to stop: `step` steps are done and applied; checkpoint them unless that is off,
        nothing is new since the start, or it was just written."""
        self.stopped_after = step
        self._wait_written()
        if not self.cfg.train.save_on_signal or step == self.start or step == self.checkpointer.written:
            return
        if "checkpoint-writer" not in self.actors:  # started on demand when no periodic saves were asked for
            self.actors["checkpoint-writer"] = self.runner.spawn("checkpoint-writer", CheckpointWriter,
                                                                 (self.cfg.actors.writer_threads,), Demand(0.0, 0.0))
            self._call_one("checkpoint-writer", "attach", self.spec)
        self._start_checkpoint(step, self.metrics[-1]["epoch"])
        self._wait_written()

    def _start_checkpoint(self, step: int, epoch: int) -> None:
        """Launch the write of the state after `step`. The writer takes each piece once Adam's update of
        `step` is in; the next step's call tells Adam to hold each piece's next update until it is taken."""
        self._wait_written()  # one write at a time
        meta = {"config": dump_yaml(self._resolved()), "steps_total": self.steps,
                "data": {"position": step, "seed": self.cfg.data.seed, "epoch": epoch},
                "lr_schedule_position": step,
                "rng": "none: a step draws nothing at random; batch t is a function of (data, data.seed, t)"}
        self.checkpointer.started(step)
        self.pending_write = self.runner.call(self.actors["checkpoint-writer"], "write", step,
                                              str(self.checkpointer.root.resolve()), meta)

    def _writing(self) -> dict[str, Pending]:
        return {"checkpoint-writer": self.pending_write} if self.pending_write is not None else {}

    def _maybe_written(self, res: dict) -> None:
        if "checkpoint-writer" in res:
            self.pending_write, self.staged = None, res["checkpoint-writer"]
            self._publish_ready()

    def _publish_ready(self) -> None:
        """Publish the written checkpoint once metrics.jsonl holds its step's row, on disk: a run resumed
        from it keeps the rows up to its step, so none may be missing."""
        step = self.checkpointer.writing
        if self.staged is None or (self.metrics[-1]["step"] if self.metrics else self.start) < step:
            return
        if self.reporter is not None:
            self.reporter.sync()
        res, self.staged = self.staged, None
        self._call_one("checkpoint-writer", "publish", step)
        self.checkpointer.finished(res)

    def _wait_written(self) -> None:
        """Wait for the checkpoint being written, if any, and publish it (every caller has recorded the
        metrics of its step)."""
        if self.pending_write is not None:
            step = self.checkpointer.writing
            self._maybe_written(self._gather(self._writing(), self.cfg.train.step_timeout_s,
                                             f"the checkpoint after step {step}"))

    def _maybe_evaluate(self, step: int) -> dict:
        every = self.cfg.train.eval_every
        last = step == self.steps and self.cfg.train.final_eval
        if not self.evaluator.enabled or not (last or (every and step % every == 0)):
            return {}
        return self.evaluator(step)

    def _launch(self, t: int, saving: bool = False) -> tuple[dict[str, Pending], dict]:
        cfg = self.cfg
        b = self.loader.get(t)
        ids, labels = b.ids, b.labels
        lr = lr_at(cfg.optim, t, self.steps)
        row = {"step": t + 1, "epoch": b.epoch, "lr": lr, "t0": time.perf_counter(), "batch_tokens": ids.numel()}
        timeline = t + 1 == cfg.train.timeline_step
        # Absolute: the executor writes it, from its own working directory (on the GPU's node).
        profile = (str((self.out / f"profile-step-{t + 1}.json").resolve()) if t + 1 == cfg.train.profile.step
                   and cfg.train.profile.actor == "gpu-executor" else "")
        calls = {"gpu-executor": self.runner.call(self.actors["gpu-executor"], "step", t, ids, labels, timeline,
                                                  profile),
                 "adam-updater": self.runner.call(self.actors["adam-updater"], "step", t, lr, saving)}
        for name, h in self.actors.items():
            if name.startswith(("packer", "grad-accumulator")):
                calls[name] = self.runner.call(h, "step", t)
        return calls, row

    def _first_step_done(self) -> None:
        """Launch to the end of the first step's forward and backward (its loss is known; its Adam update
        overlaps the next step, so its metrics row is written after that one)."""
        if self.first_step_s is None:
            self.first_step_s = time.monotonic() - self.launched
            log(f"first step done {self.first_step_s:.1f} s after launch")

    def _record(self, row: dict, adam: dict) -> None:
        self.metrics.append(self.reporter.record(row, adam))
        self._publish_ready()

    # ---- calls and failures -----------------------------------------------------------------
    def _call_one(self, name: str, method: str, *args: Any) -> Any:
        return self._gather({name: self.runner.call(self.actors[name], method, *args)},
                            self.cfg.train.setup_timeout_s, f"{name}.{method}")[name]

    def _gather(self, calls: dict[str, Pending], timeout: float, what: str,
                optional: dict[str, Pending] | None = None) -> dict[str, Any]:
        """Wait for every call in `calls`; a call in `optional` (the checkpoint being written) is watched
        for failure and its result taken if it ends meanwhile, but not waited for."""
        results: dict[str, Any] = {}
        pending = dict(calls)
        extra = {k: v for k, v in (optional or {}).items() if k not in pending}
        deadline = time.monotonic() + timeout
        while pending:
            watch = list(pending.values()) + list(extra.values()) + ([self.sentinel] if self.sentinel else [])
            done = self.runner.wait_any(watch, max(deadline - time.monotonic(), 0.0))
            if not done:
                self._abort(f"{what} timed out")
                raise MegatrainError(f"{what} did not finish within {timeout:.0f}s; still waiting on: "
                                     f"{', '.join(pending)}")
            for p in done:
                if p is self.sentinel:
                    self.sentinel = None
                    self._owner_died(p, {**pending, **extra})
                key = next(k for k, v in {**pending, **extra}.items() if v is p)
                pending.pop(key, None)
                extra.pop(key, None)
                try:
                    results[key] = self.runner.result(p)
                except (ActorFailure, AbortError) as exc:
                    raise self._root_cause(exc, p.actor, {**pending, **extra}) from None
        return results

    def _owner_died(self, serve: Pending, pending: dict[str, Pending]) -> None:
        """The owner's serve() call ended before shutdown: its process is gone, or the run was aborted."""
        try:
            self.runner.result(serve)
            exc: Exception = ActorFailure("store-owner", "stopped serving the store", self.pids.get("store-owner"))
        except (ActorFailure, AbortError) as failure:
            exc = failure
        raise self._root_cause(exc, "store-owner", pending)

    def _root_cause(self, first: Exception, actor: str, pending: dict[str, Pending]) -> MegatrainError:
        """Abort the run, let the others fail fast, and report the failure that started it all."""
        self._abort(f"{actor} failed")
        failures: list[Exception] = [first]
        deadline = time.monotonic() + 5  # a stopped actor never answers: the verdict must not wait long
        for p in pending.values():
            try:
                self.runner.result(p, timeout=max(deadline - time.monotonic(), 0.1))
            except (ActorFailure, AbortError) as exc:
                failures.append(exc)
            except MegatrainError:
                pass
        real = [f for f in failures if isinstance(f, ActorFailure)]
        deaths = [f for f in real if f.died]
        root = (deaths or real or failures)[0]
        return root if isinstance(root, MegatrainError) else MegatrainError(str(root))

    def _abort(self, reason: str) -> None:
        """Raise the shared abort flag through any actor that still answers."""
        for name, h in self.actors.items():
            if name == "store-owner" or name not in self.pids:
                continue
            try:
                self.runner.result(self.runner.call(h, "abort", reason), timeout=2)
                return
            except Exception:
                continue

    # ---- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Idempotent: unlink the store, end every actor, release Ray. Runs on every exit path."""
        if self._closed:
            return
        self._closed = True
        with sigint_deferred():
            owner = self.actors.get("store-owner")
            for h in self.actors.values():
                if h is not owner:
                    self.runner.kill(h)
            if owner is not None:
                try:  # waits for the workers to be gone, then unlinks everything of the run
                    self.runner.result(self.runner.call(owner, "shutdown"), timeout=SHUTDOWN_S)
                except Exception as exc:  # the reaper unlinks if the owner is gone
                    print(f"[megatrain] store owner did not shut down cleanly: {exc}", file=sys.stderr)
                self.runner.kill(owner)
            self.runner.close()
            if self.lock is not None:
                self.lock.release()
