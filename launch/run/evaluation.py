"""Evaluation between steps: forward-only weight walks through the same streaming engine and actors.

The executor runs one forward walk (embedding, layers, head; no recompute, no gradients, no Adam) per
evaluation batch, and for the generated arithmetic one more per generated token; in slabs mode each
packer packs exactly as many walks. All of them read the weights after the step's Adam update (the
packers and the resident source wait on the same version counters as the next step does), so an
evaluation may start while Adam still updates the last units.
"""

from __future__ import annotations

import math
from typing import TypeVar

from megatrain.actors.executor.gpu_executor import GpuExecutor
from megatrain.actors.packer import Packer
from megatrain.data import Data, arithmetic
from megatrain.ipc.messages import EvalRequest, GenerateRequest
from megatrain.launch.control.crew import Crew
from megatrain.launch.control.handles import Pending
from megatrain.roster import EXECUTOR, Kind

R = TypeVar("R")

GROUP = 8  # evaluation batches per executor call: a large set is never built or shipped at once


class Evaluator:
    """Runs evaluations for a Trainer through its actors (`crew`); each waits at most `timeout_s`."""

    def __init__(self, data: Data, eval_batches: int, crew: Crew, timeout_s: float):
        self.data, self.crew, self.timeout_s = data, crew, timeout_s
        self.packers = crew.of(Kind.PACKER)
        self.count = data.eval_count(eval_batches)
        self.examples: list[tuple[str, str, str]] = []

    @property
    def enabled(self) -> bool:
        return self.count > 0 or bool(self.data.problems)

    def __call__(self, step: int) -> dict:
        """Evaluate the weights after `step` optimizer steps; the metrics to add to that step's row."""
        out: dict = {}
        if self.count:
            loss_sum, tokens, seconds = 0.0, 0, 0.0
            for lo in range(0, self.count, GROUP):
                batches = [self.data.eval_batch(i) for i in range(lo, min(lo + GROUP, self.count))]
                request = EvalRequest(step=step, batches=batches)
                res = self._walks(step, len(batches), self.crew.call(EXECUTOR, GpuExecutor.evaluate, request))
                loss_sum, tokens, seconds = loss_sum + res.loss_sum, tokens + res.tokens, seconds + res.eval_s
            out.update(eval_tokens=tokens, eval_s=seconds)
            if tokens:  # an evaluation set without a labelled token has no loss (it is said so, not 0)
                loss = loss_sum / tokens
                out.update(eval_loss=loss, eval_ppl=math.exp(min(loss, 700.0)))
        if self.data.problems:
            ids, pos, new = arithmetic.prompts(self.data.cfg, self.data.problems)
            prompt = GenerateRequest(step=step, ids=ids, pos=pos, new_tokens=new)
            got = arithmetic.answers(self._walks(step, new, self.crew.call(EXECUTOR, GpuExecutor.generate, prompt)))
            out["eval_accuracy"] = arithmetic.accuracy(self.data.problems, got)
            self.examples = [(q, a, g) for (q, a), g in zip(self.data.problems, got)]
        return out

    def _walks(self, step: int, walks: int, executor: Pending[R]) -> R:
        """The executor's call (issued) and, in slabs mode, the packers' for as many forward walks."""
        calls: dict[str, Pending] = {EXECUTOR: executor}
        calls.update({p: self.crew.call(p, Packer.step, step, walk="forward", repeat=walks) for p in self.packers})
        return self.crew.gather(calls, self.timeout_s, f"evaluation after step {step}")[EXECUTOR]

    def describe(self, step: int, row: dict) -> str:
        parts = []
        if "eval_loss" in row:
            parts.append(
                f"eval_loss {row['eval_loss']:.4f} eval_ppl {row['eval_ppl']:.2f} "
                f"({self.count} batches, {row['eval_tokens']} tokens)"
            )
        elif "eval_tokens" in row:
            parts.append(f"no eval_loss: the {self.count} evaluation batches hold no labelled token")
        if "eval_accuracy" in row:
            parts.append(
                f"exact-match accuracy {row['eval_accuracy']:.1%} on {len(self.data.problems)} held-out problems"
            )
        return f"eval after step {step}: " + ", ".join(parts)

    def solved_examples(self, count: int = 5) -> list[str]:
        """A few held-out problems with the model's answers (right ones first)."""
        ranked = sorted(self.examples, key=lambda e: e[1] != e[2])[:count]
        return [f"{q}{g}  {'ok' if g == a else f'wrong, expected {a}'}" for q, a, g in ranked]
