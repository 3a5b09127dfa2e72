"""train.profile with a CPU actor: that actor's process sampled by py-spy over the
step (from its launch to its results; with the Adam overlap that window holds the Adam update of the
step before), into OUTPUT_DIR/profiles/ACTOR-step-N.speedscope.json on the actor's node."""

from __future__ import annotations

from pathlib import Path

from megatrain import log
from megatrain.actors.base import Role
from megatrain.launch.config.train import TrainConfig
from megatrain.launch.control.crew import Crew
from megatrain.roster import EXECUTOR


class ActorProfile:
    def __init__(self, cfg: TrainConfig, out: Path, crew: Crew):
        self.step = cfg.profile.step if cfg.profile.actor != EXECUTOR else 0
        self.actor, self.actors, self.crew = cfg.profile.actor, list(crew.actors), crew
        self.path = str((out / "profiles" / f"{self.actor}-step-{self.step}.speedscope.json").resolve())

    def before(self, t: int) -> None:
        if t + 1 != self.step:
            return
        if self.actor not in self.actors:
            log(
                f"train.profile.actor: this run has no actor '{self.actor}' (its actors: {', '.join(self.actors)}); "
                "nothing profiled"
            )
            self.step = 0
            return
        why = self.crew.call_one(self.actor, Role.profile_start, self.path)
        if why:
            log(f"train.profile.actor: cannot sample {self.actor} at step {t + 1}: {why}")
            self.step = 0

    def after(self, t: int) -> None:
        if t + 1 != self.step:
            return
        why = self.crew.call_one(self.actor, Role.profile_stop)
        log(
            f"profiled {self.actor} during step {t + 1} with py-spy into {self.path} (on its node)"
            if not why
            else f"train.profile.actor: sampling {self.actor} at step {t + 1} failed: {why}"
        )
