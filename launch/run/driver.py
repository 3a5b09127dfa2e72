"""The driver: plans the run, places the actors, runs the step loop (one call per actor per step),
logs, and shuts everything down on every path.

It owns no host memory of the run: the store lives in the store owner's actor on the GPU's node, so
the driver can run anywhere (a laptop attached to a cluster, a `ray job submit` entrypoint).
The work is split by responsibility: launch/control/crew.py (the actors, calls and failures), launch/run/startup.py
(the actors' start-up), launch/run/steploop.py (the step loop and the run's summary), launch/run/checkpoints.py
(the checkpoints). This module is the order of a run.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import secrets
from pathlib import Path

from megatrain import log
from megatrain.actors.base import Role
from megatrain.actors.store_owner import StoreOwner
from megatrain.config.base import Where, differences, dump_yaml, to_dict
from megatrain.ipc.messages import FillReport, HostMemory
from megatrain.ipc.protocol import StoreSpec, resolve_stall
from megatrain.ipc.shared.segments import check_run_id_free
from megatrain.ipc.shared.shm import check_run_id
from megatrain.launch.config import memplan, timeplan
from megatrain.launch.config.tree import Config
from megatrain.launch.control.crew import Crew
from megatrain.launch.control.placement import check_hosts_run_id
from megatrain.launch.control.runners import make_runner
from megatrain.launch.prepare.inputs import Inputs, check_first, read_inputs
from megatrain.launch.prepare.outdir import OutputLock, prepare_output, resolve_output
from megatrain.launch.prepare.resume import may_resume
from megatrain.launch.report.describe import describe_memory, short
from megatrain.launch.report.reporting import RunSummary, clipping_line
from megatrain.launch.report.tensorboard import summary_writer
from megatrain.launch.run import startup
from megatrain.launch.run.checkpoints import Checkpointer, clear_torn, save_final
from megatrain.launch.run.evaluation import Evaluator
from megatrain.launch.run.steploop import PreparedRun, StepLoop
from megatrain.launch.run.stopping import Background, StopRequest, sigint_deferred
from megatrain.memory.plan import MemoryPlan
from megatrain.step.engine import EngineConfig


class Trainer:
    def __init__(
        self, cfg: Config, stop: StopRequest | None = None, launched: float | None = None, where: Where | None = None
    ):
        """`launched`: when the launcher's process started (time.time()), where the start-up clock begins;
        None for now (a Trainer run inside a process that was doing other things before). `where`: the config's
        key locations, for the model checks' messages (the launcher runs those checks here,
        launch/prepare/inputs.py)."""
        self.cfg, self.where = cfg, where  # as given; the run's, resolved, is its PreparedRun's
        self.launched = launched
        self.stop = stop  # a graceful-stop request (signal), checked between steps
        if stop is not None:
            stop.saves = cfg.train.save_on_signal  # what its first signal's line promises
        self.run_id = check_run_id(cfg.train.run_id or secrets.token_hex(5))
        if isinstance(cfg.actors.num_hosts, int):  # auto: once the cluster's nodes are counted (startup.py)
            check_hosts_run_id(self.run_id, cfg.actors, cfg.actors.num_hosts)
        self.out = resolve_output(cfg.train.output_dir, self.run_id)  # absolute; printed at start
        self.log_dir: Path | None = None  # where error.log may go: set once the output directory is ours
        self.crew = Crew(make_runner(cfg.launch), cfg.train.setup_timeout_s)
        self.phases = startup.Phases()
        self.lock: OutputLock | None = None  # the output directory's, for the run's life
        self.loop: StepLoop | None = None  # once set up: the steps recorded so far
        self._closed = False

    # ---- public -----------------------------------------------------------------------------
    def run(self) -> RunSummary:
        self.phases.restart(self.launched)
        atexit.register(self.shutdown)
        try:
            prepared = self.setup()
            if isinstance(prepared, Inputs):  # complete: nothing to do, and nothing was started
                begin = prepared.begin
                return RunSummary(
                    run_id=self.run_id,
                    output_dir=self.out,
                    steps=prepared.steps,
                    last_step=begin.step,
                    checkpoint=begin.directory,
                    complete=True,
                )
            self.loop = StepLoop(prepared)
            self.loop()
            # after the last step: every page is in use; each host's own
            memory = [self.crew.call_one(owner, StoreOwner.host_memory) for owner in self.crew.owners]
            observed = self.crew.gather(
                {n: self.crew.call(n, Role.thread_counts) for n in self.crew.actors},
                self.cfg.train.setup_timeout_s,
                "thread counts",
            )
            if self.loop.stopped_after is None:
                self._finish(prepared, memory[0])
            return self.loop.summary(memory, observed, dict(self.phases.seconds))
        finally:
            self.shutdown()
            atexit.unregister(self.shutdown)

    def _finish(self, run: PreparedRun, mem: HostMemory) -> None:
        """After the last step (not after a graceful stop)."""
        describe_memory(mem, run.spec.layout.num_params)
        said = clipping_line(self.loop.metrics, run.cfg.optim.max_grad_norm)
        if said:
            log(said)
        if run.evaluator.examples and run.cfg.train.final_eval:
            log(
                "held-out problems answered by greedy decoding after the last step:\n  "
                + "\n  ".join(run.evaluator.solved_examples())
            )
        if run.cfg.train.save_final:
            record = {"step": run.steps, "checkpoint": None, "run_id": self.run_id}
            final, config = str(self.out / "final"), to_dict(run.cfg)
            path = save_final(self.crew, run.spec.model, final, config, record, run.cfg.train.setup_timeout_s)
            log(f"saved final fp32 weights (step {run.steps}) to {path}")

    # ---- setup ------------------------------------------------------------------------------
    def setup(self) -> PreparedRun | Inputs:
        """Check and read the run's inputs, spawn, plan and start its actors: the prepared run; or, where the
        run is complete already, its inputs (nothing was started)."""
        cfg = self.cfg
        if cfg.train.run_id and not _remote(cfg):
            check_run_id_free(cfg.train.run_id, cfg.ipc.shm_dir)  # the store is on this machine: say it now
        if cfg.train.tensorboard:
            summary_writer()  # a missing package is a usage error before anything starts
        self.lock = OutputLock(self.out, self.run_id)  # before anything in the directory is read or changed
        machine = memplan.this_host(cfg)  # as `megatrain-launch plan` sees it: before Ray and the actors
        resumable = may_resume(cfg.train.resume, self.out)
        check_first(cfg, self.where, self.out, fresh=not resumable)  # what takes no time: before Ray starts
        # The inputs (launch/prepare/inputs.py) are read on a thread while Ray starts and the actors spawn; a refused
        # one ends them again and leaves the directory as it was. Not beside in-process actors: there is no process
        # start to hide, and their threads would import transformers side by side (its lazy module fails so).
        # Nor where a checkpoint may be resumed: a complete run or a corrupt checkpoint starts nothing.
        beside = cfg.launch.runner == "ray" and not resumable
        reading = Background(read_inputs, cfg, self.where, self.out, name="inputs", here=not beside)
        if not beside:
            self.phases.close("inputs read (config checks, data, checkpoint)")
            if reading.result().begin.complete:  # read first: a refusal raises here, and a complete run starts nothing
                return reading.result()
        spawned = startup.spawn_actors(self.crew, cfg, reading, self.phases)
        inputs = reading.result()
        if inputs.begin.complete:
            return inputs
        if beside:
            self.phases.close("inputs read (config checks, data, checkpoint), beyond the actors' spawn")
        # The one resolved config of the run: the staging mode the actors were spawned for, the monitor's timeout
        # for this model's layers; the store, the plan and config.yaml take it.
        ipc = dataclasses.replace(cfg.ipc, staging=spawned.roster.staging)
        cfg = dataclasses.replace(cfg, ipc=resolve_stall(ipc, inputs.model, cfg.data.batch_size, cfg.data.seq_len))
        checkpointer = self._own_output(cfg, inputs)
        memory = memplan.run_plan(cfg, inputs.model, spawned.cuda, spawned.executors, machine, spawned.hosts)
        self._write_config(cfg, spawned.engine)
        changed = differences(self._resolved(cfg, spawned.engine), Config())
        log(f"run {self.run_id}; output directory {self.out}")
        log(
            f"config (what differs from the defaults; all of it, resolved, in "
            f"{self.out / 'config.yaml'}):\n  " + "\n  ".join(f"{k}: {short(v)}" for k, v in changed)
        )
        engine, specs, fills = self._start_actors(cfg, spawned, inputs, memory)
        timeplan.warn_if_long(
            self.crew, cfg, inputs.model, spawned.executors, inputs.steps - inputs.begin.step, spawned.hosts
        )
        return PreparedRun(
            run_id=self.run_id,
            cfg=cfg,
            engine=engine,
            crew=self.crew,
            data=inputs.data,
            spec=specs[0],
            specs=specs,
            fills=fills,
            executors=spawned.executors,
            hosts=spawned.hosts,
            out=self.out,
            start=inputs.begin.step,
            steps=inputs.steps,
            evaluator=Evaluator(inputs.data, cfg.train.eval_batches, self.crew, cfg.train.step_timeout_s),
            checkpointer=checkpointer,
            config_yaml=dump_yaml(self._resolved(cfg, engine, specs[0])),
            stop=self.stop,
            launched=self.phases.launched,
        )

    def _own_output(self, cfg: Config, inputs: Inputs) -> Checkpointer:
        """The output directory made the run's (emptied, or trimmed to the checkpoint it resumes in place), its
        checkpoints' writer."""
        begin = inputs.begin
        prepare_output(self.out, cfg.train.overwrite, begin.step if begin.in_place else None)
        self.log_dir = self.out
        checkpointer = Checkpointer(cfg.train, self.out / "checkpoints", inputs.steps)
        clear_torn(checkpointer.root, "an earlier run's")  # a killed run's (the directory is ours now)
        if begin.directory:
            log(f"resuming from {begin.directory} (after step {begin.step} of {inputs.steps})")
        if inputs.steps != cfg.train.steps:
            log(
                f"data.epochs {cfg.data.epochs} x {inputs.data.batches_per_epoch} batches per epoch = {inputs.steps} "
                f"steps (train.steps {cfg.train.steps} is not used)"
            )
        return checkpointer

    def _start_actors(
        self, cfg: Config, spawned: startup.Spawned, inputs: Inputs, memory: MemoryPlan
    ) -> tuple[EngineConfig, list[StoreSpec], list[FillReport]]:
        """The workers (spawned beside the inputs' reading) finish their start while the store owner makes and
        fills the store; they attach to it once it exists. The engine's sizes wait for the executor's free GPU
        memory; the store does not wait for them (the owner settles them after). The engine, resolved; each host's
        store and how it was filled."""
        crew, phases, begin = self.crew, self.phases, inputs.begin
        about = {"output_dir": str(self.out), "steps": inputs.steps, "first": begin.step}
        creating = startup.create_stores(crew, cfg, self.run_id, spawned, inputs.model, memory, begin.directory, about)
        # Where the store will be on this machine: the RAM its pinned checkpoints may take, measured before it.
        host_room = memory.pinned_room if spawned.cuda and not _remote(cfg) else None
        engine = startup.choose_sizes(crew, cfg, inputs.model, spawned.engine, host_room, spawned.roster.staging)
        if engine.device == "cuda":
            phases.close("executor started (imports, CUDA context; the store is made meanwhile)")
        specs, fills = startup.settle_store(crew, creating, engine, cfg.train.setup_timeout_s)
        phases.close("store made and filled (beyond the executor's start)" if len(specs) == 1 else "stores made")
        self._write_config(cfg, engine, specs[0])  # now with ipc.staging as the store owner resolved it
        startup.attach_workers(crew, cfg, specs, spawned.roster, engine, begin.step)
        phases.close("actors attached (pinning, CUDA IPC events)")
        startup.form_groups(crew, cfg.train.setup_timeout_s, phases)
        startup.describe(crew, specs[0], engine, cfg.launch.runner == "inprocess", phases)
        return engine, specs, fills

    def _resolved(self, cfg: Config, engine: EngineConfig, spec: StoreSpec | None = None) -> Config:
        """The run's config as config.yaml holds it: the engine and, once a store exists, its staging mode."""
        ipc = dataclasses.replace(cfg.ipc, staging=spec.staging_mode) if spec else cfg.ipc
        return dataclasses.replace(
            cfg, engine=engine, ipc=ipc, train=dataclasses.replace(cfg.train, run_id=self.run_id)
        )

    def _write_config(self, cfg: Config, engine: EngineConfig, spec: StoreSpec | None = None) -> None:
        (self.out / "config.yaml").write_text(dump_yaml(self._resolved(cfg, engine, spec)))

    # ---- shutdown ---------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Idempotent: unlink the store, end every actor, release Ray. Runs on every exit path."""
        if self._closed:
            return
        self._closed = True
        with sigint_deferred():
            self.crew.shutdown()
            if self.log_dir is not None:  # the output directory is this run's: a write its end cut short goes
                clear_torn(self.out / "checkpoints", "this run's")
            if self.lock is not None:
                self.lock.release()


def _remote(cfg: Config) -> bool:
    """The run joins a Ray cluster: its store is on the GPU's node, not necessarily this machine."""
    return bool(cfg.launch.address or os.environ.get("RAY_ADDRESS"))
