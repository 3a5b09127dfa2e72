"""The driver: plans the run, places the actors, runs the step loop (one call per actor per step),
logs, and shuts everything down on every path.

It owns no host memory of the run: the store lives in the store owner's actor on the GPU's node, so
the driver can run anywhere (a laptop attached to a cluster, a `ray job submit` entrypoint).
The work is split by responsibility: launch/control/crew.py (the actors, calls and failures), launch/control/startup.py
(the actors' start-up), launch/run/steploop.py (the step loop), launch/run/checkpoints.py (the checkpoints).
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
from megatrain.checkpoint import step_dir as ckpt_step_dir
from megatrain.configbase import Where, differences, dump_yaml, to_dict
from megatrain.data import Data
from megatrain.flops import active_params
from megatrain.ipc.protocol import StoreSpec, checkpoint_host_bytes, resolve_stall
from megatrain.ipc.protocol.messages import FillReport, HostMemory, StoreRequest
from megatrain.ipc.segments import check_run_id_free
from megatrain.ipc.shm import check_run_id, host_run_id
from megatrain.launch.config import memplan, timeplan
from megatrain.launch.config.tree import Config
from megatrain.launch.control import startup
from megatrain.launch.control.crew import Crew
from megatrain.launch.control.placement import check_hosts_run_id, per_executor, thread_request
from megatrain.launch.control.runners import Pending, make_runner
from megatrain.launch.report.describe import describe_memory, short
from megatrain.launch.report.tensorboard import summary_writer
from megatrain.launch.run.checkpoints import Checkpointer, clear_torn, save_final
from megatrain.launch.run.evaluation import Evaluator
from megatrain.launch.run.inputs import check_first, read_inputs
from megatrain.launch.run.outdir import OutputLock, prepare_output, resolve_output
from megatrain.launch.run.resume import Start, may_resume
from megatrain.launch.run.steploop import PreparedRun, StepLoop
from megatrain.launch.run.stopping import Background, StopRequest, sigint_deferred
from megatrain.memory.plan import MemoryPlan
from megatrain.model import ModelSpec
from megatrain.roster import Roster


class Trainer:
    def __init__(
        self, cfg: Config, stop: StopRequest | None = None, launched: float | None = None, where: Where | None = None
    ):
        """`launched`: when the launcher's process started (time.time()), where the start-up clock begins;
        None for now (a Trainer run inside a process that was doing other things before). `where`: the config's
        key locations, for the model checks' messages (the launcher runs those checks here, launch/run/inputs.py)."""
        self.cfg, self.where = cfg, where
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
        self.spec: StoreSpec | None = None
        self.data: Data | None = None
        self.steps = cfg.train.steps
        self.start = 0  # the first step to run (a resumed run's checkpoint step)
        self.resume_dir: Path | None = None
        self.begin = Start()  # where the run starts (launch/run/resume.py), verified before anything changes
        self.evaluator: Evaluator | None = None
        self.loop: StepLoop | None = None
        self.store_fill: FillReport | None = None  # how the store was filled
        self._closed = False
        self.lock: OutputLock | None = None  # the output directory's, for the run's life
        self.phases = startup.Phases()
        self.host_room: int | None = None  # host RAM for pinned checkpoints beside the store (a local store)
        self.memory: MemoryPlan | None = None  # the run's memory plan (megatrain/memory/), made once
        self.model: ModelSpec | None = None  # the model's layout and config (build_spec), once
        self.executors = 1  # actors.num_gpus, resolved: each host's
        self.hosts = 1  # actors.num_hosts, resolved
        self.specs: list[StoreSpec] = []  # each host's store (one host: [self.spec])
        self.roster: Roster | None = None  # the run's actors (megatrain/roster.py), as spawned

    # ---- public -----------------------------------------------------------------------------
    def run(self) -> dict:
        self.phases.restart(self.launched)
        atexit.register(self.shutdown)
        try:
            self.setup()
            if self.begin.complete:  # nothing to do, and nothing was started
                return {
                    "run_id": self.run_id,
                    "output_dir": str(self.out),
                    "metrics": [],
                    "stopped_by": "",
                    "last_step": self.start,
                    "checkpoint": str(self.resume_dir),
                    "complete": True,
                }
            self.loop = StepLoop(
                PreparedRun(
                    cfg=self.cfg,
                    crew=self.crew,
                    data=self.data,
                    spec=self.spec,
                    specs=self.specs,
                    cuda=self.engine_cfg.device == "cuda",
                    out=self.out,
                    start=self.start,
                    steps=self.steps,
                    evaluator=self.evaluator,
                    checkpointer=self.checkpointer,
                    config_yaml=dump_yaml(self._resolved()),
                    stop=self.stop,
                    launched=self.phases.launched,
                )
            )
            self.loop()
            # after the last step: every page is in use; each host's own
            mems = [self.crew.call_one(owner, StoreOwner.host_memory) for owner in self.crew.owners]
            mem = mems[0]
            observed = self.crew.gather(
                {n: self.crew.call(n, Role.thread_counts) for n in self.crew.actors},
                self.cfg.train.setup_timeout_s,
                "thread counts",
            )
            if self.loop.stopped_after is None:
                self._finish(mem)
            return self._summary(mem, observed) | (
                {"host_pss_bytes": [m.pss_bytes for m in mems]} if self.hosts > 1 else {}
            )
        finally:
            self.shutdown()
            atexit.unregister(self.shutdown)

    def _summary(self, mem: HostMemory, observed: dict) -> dict:
        loop, spec, written = self.loop, self.spec, self.checkpointer.written
        return {
            "run_id": self.run_id,
            "output_dir": str(self.out),
            "metrics": loop.metrics,
            "stopped_by": self.stop.name if loop.stopped_after is not None else "",
            "last_step": loop.stopped_after if loop.stopped_after is not None else self.steps,
            "checkpoint": str(ckpt_step_dir(self.checkpointer.root, written)) if written else "",
            "checkpoints": self.checkpointer.history,
            "store_fill": dataclasses.asdict(self.store_fill) if self.store_fill else {},
            "time_to_first_step_s": loop.first_step_s,
            "startup_s": dict(self.phases.seconds),
            "cpu_plan": {n: dataclasses.asdict(t) for n, t in spec.threads.items() if n in self.crew.actors},
            "threads_observed": observed,
            "pids": dict(self.crew.pids),
            "num_params": spec.layout.num_params,
            "active_params": active_params(spec.model),
            "store_bytes": sum(spec.part_bytes().values()),
            "staging": spec.staging_mode,
            "executors": self.executors,
            "hosts": self.hosts,
            "executor_host_bytes": checkpoint_host_bytes(
                spec.model, self.engine_cfg, self.cfg.data.batch_size, self.cfg.data.seq_len
            ),
            "process_pss_bytes": mem.pss_bytes,
            "pss_own_by_role": mem.pss_own_by_role,
            "processes": mem.processes,
        }

    def _finish(self, mem: HostMemory) -> None:
        """After the last step (not after a graceful stop)."""
        describe_memory(mem, self.spec.layout.num_params)
        if self.evaluator is not None and self.evaluator.examples and self.cfg.train.final_eval:
            log(
                "held-out problems answered by greedy decoding after the last step:\n  "
                + "\n  ".join(self.evaluator.solved_examples())
            )
        if self.cfg.train.save_final:
            record = {"step": self.steps, "checkpoint": None, "run_id": self.run_id}
            final, run = str(self.out / "final"), to_dict(self.cfg)
            path = save_final(self.crew, self.spec.model, final, run, record, self.cfg.train.setup_timeout_s)
            log(f"saved final fp32 weights (step {self.steps}) to {path}")

    # ---- setup ------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        if cfg.train.run_id and not (cfg.launch.address or os.environ.get("RAY_ADDRESS")):
            check_run_id_free(cfg.train.run_id, cfg.ipc.shm_dir)  # the store is on this machine: say it now
        if cfg.train.tensorboard:
            summary_writer()  # a missing package is a usage error before anything starts
        self.lock = OutputLock(self.out, self.run_id)  # before anything in the directory is read or changed
        machine = memplan.this_host(cfg)  # as `megatrain-launch plan` sees it: before Ray and the actors
        resumable = may_resume(cfg.train.resume, self.out)
        check_first(cfg, self.where, self.out, fresh=not resumable)  # what takes no time: before Ray starts
        # The inputs (launch/run/inputs.py) are read on a thread while Ray starts and the actors spawn; a refused one
        # ends them again and leaves the directory as it was. Not beside in-process actors: there is no process
        # start to hide, and their threads would import transformers side by side (its lazy module fails so).
        # Nor where a checkpoint may be resumed: a complete run or a corrupt checkpoint starts nothing.
        beside = cfg.launch.runner == "ray" and not resumable
        reading = Background(read_inputs, cfg, self.where, self.out, name="inputs", here=not beside)
        if not beside:
            self.phases.close("inputs read (config checks, data, checkpoint)")
        # read first: a refusal raises here, and a complete run starts nothing
        cuda = False
        if beside or not reading.result().begin.complete:
            s = startup.spawn_actors(self.crew, cfg, reading, self.phases)
            cuda, self.executors, self.engine_cfg, self.roster = s.cuda, s.executors, s.engine, s.roster
            self.hosts = s.hosts
            # the staging mode the actors were spawned for: the store, the plan and config.yaml take it
            self.cfg = cfg = dataclasses.replace(cfg, ipc=dataclasses.replace(cfg.ipc, staging=s.roster.staging))
        inputs = reading.result()
        self.data, self.steps, self.begin, spec = inputs.data, inputs.steps, inputs.begin, inputs.model
        self.resume_dir, self.start = self.begin.directory, self.begin.step
        if self.begin.complete:
            return
        if beside:
            self.phases.close("inputs read (config checks, data, checkpoint), beyond the actors' spawn")
        prepare_output(self.out, cfg.train.overwrite, self.start if self.begin.in_place else None)
        self.log_dir = self.out
        self.checkpointer = Checkpointer(cfg.train, self.out / "checkpoints", self.steps)
        clear_torn(self.checkpointer.root, "an earlier run's")  # a killed run's (the directory is ours now)
        if self.resume_dir:
            log(f"resuming from {self.resume_dir} (after step {self.start} of {self.steps})")
        if self.steps != cfg.train.steps:
            log(
                f"data.epochs {cfg.data.epochs} x {self.data.batches_per_epoch} batches per epoch = {self.steps} "
                f"steps (train.steps {cfg.train.steps} is not used)"
            )
        self.model = spec
        self.cfg = cfg = dataclasses.replace(
            cfg, ipc=resolve_stall(cfg.ipc, spec, cfg.data.batch_size, cfg.data.seq_len)
        )  # the monitor's timeout for this model's layers, in the config.yaml written next
        # Where the store will be on this machine: the RAM its pinned checkpoints may take, measured before it.
        local = cuda and not (cfg.launch.address or os.environ.get("RAY_ADDRESS"))
        self.memory = memplan.run_plan(cfg, spec, cuda, self.executors, machine, self.hosts)
        self.host_room = self.memory.pinned_room if local else None
        self._write_config()
        changed = differences(self._resolved(), Config())
        log(f"run {self.run_id}; output directory {self.out}")
        log(
            f"config (what differs from the defaults; all of it, resolved, in "
            f"{self.out / 'config.yaml'}):\n  " + "\n  ".join(f"{k}: {short(v)}" for k, v in changed)
        )
        self._start_actors()
        timeplan.warn_if_long(self.crew, cfg, spec, self.executors, self.steps - self.start, self.hosts)
        self.evaluator = Evaluator(self.data, cfg.train.eval_batches, self.crew, cfg.train.step_timeout_s)

    def _start_actors(self) -> None:
        """The workers (spawned beside the inputs' reading) finish their start while the store owner makes and
        fills the store; they attach to it once it exists. The engine's sizes wait for the executor's free GPU
        memory; the store does not wait for them (the owner settles them after)."""
        cfg, crew, phases = self.cfg, self.crew, self.phases
        creating = self._create_store()
        self.engine_cfg = startup.choose_sizes(crew, cfg, self.model, self.engine_cfg, self.host_room)
        if self.engine_cfg.device == "cuda":
            phases.close("executor started (imports, CUDA context; the store is made meanwhile)")
        self.specs, self.store_fill = startup.settle_store(crew, creating, self.engine_cfg, cfg.train.setup_timeout_s)
        self.spec = self.specs[0]
        phases.close("store made and filled (beyond the executor's start)" if len(self.specs) == 1 else "stores made")
        self._write_config()  # now with ipc.staging as the store owner resolved it
        startup.attach_workers(crew, cfg, self.specs, self.roster, self.engine_cfg, self.start)
        phases.close("actors attached (pinning, CUDA IPC events)")
        startup.form_groups(crew, cfg.train.setup_timeout_s, phases)
        startup.describe(crew, self.spec, self.engine_cfg, cfg.launch.runner == "inprocess", phases)

    def _create_store(self) -> dict[str, Pending[StoreSpec]]:
        """Each host's owner's create call, not waited for: it plans with the engine's sizes still `auto`."""
        self.crew.serve_owner()
        return {owner: self._create_host_store(owner, h) for h, owner in enumerate(self.crew.owners)}

    def _create_host_store(self, owner: str, host: int) -> Pending[StoreSpec]:
        cfg = self.cfg
        request = StoreRequest(
            run_id=host_run_id(self.run_id, host),
            model=cfg.model,
            no_decay_1d=cfg.optim.no_decay_1d,
            clip=cfg.optim.clips,
            engine=self.engine_cfg,
            num_packers=cfg.actors.num_packers,
            num_accumulators=cfg.actors.num_accumulators,
            ipc=cfg.ipc,
            batch_shape=(
                self.executors * per_executor(cfg.data.batch_size, self.executors * self.hosts),
                cfg.data.seq_len,
            ),
            resume=str(self.resume_dir) if self.resume_dir else None,
            threads=thread_request(cfg.actors),
            about={"output_dir": str(self.out), "steps": self.steps, "first": self.start},
            executors=self.executors,
            spec=self.model,
            roster=self.roster,
            memory=self.memory,
            hosts=self.hosts,
            host=host,
        )
        return self.crew.call(owner, StoreOwner.create, request)

    def _resolved(self) -> Config:
        cfg = self.cfg
        ipc = dataclasses.replace(cfg.ipc, staging=self.spec.staging_mode) if self.spec else cfg.ipc
        return dataclasses.replace(
            cfg, engine=self.engine_cfg, ipc=ipc, train=dataclasses.replace(cfg.train, run_id=self.run_id)
        )

    def _write_config(self) -> None:
        (self.out / "config.yaml").write_text(dump_yaml(self._resolved()))

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
