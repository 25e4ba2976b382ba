"""A job's evals: adapters scored packed on the eval rows (`Evaluator`).

Four occasions, each packed (the adapters due together in one eval) and timed for the cost
model (`plora.job.phases.PhaseClock.eval_event`): an adapter leaving the pack (every metric,
on the whole eval set: its final scores), an epoch end (the same, with ``eval.each_epoch``),
an intermediate eval (the loss every ``eval.every_steps`` of its own steps and at its tune's
rungs, and the objective on a fixed slice of the eval rows: what a pruner decides on), and
the base model (``eval_base``). Batches are sized from the device's memory
(`plora.results.evaluate.evaluate_adapters`); ``before`` makes room for them first (the
held step graphs').
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from plora.data.dataset import Sample, TextTokenizer
from plora.job.config import JobEval
from plora.job.phases import PhaseClock
from plora.results.evaluate import evaluate_adapters
from plora.results.metrics import generated_metrics, metric_name
from plora.spec.defaults import eval_batch_rows
from plora.train.adapter_run import AdapterRun
from plora.train.packed.inject import PackedModel


class Evaluator:
    """Scores the pack's adapters (by slot; None: the base model) on the job's eval rows."""

    def __init__(self, pm: PackedModel, tok: TextTokenizer, samples: list[Sample], examples: list[dict],
                 cfg: JobEval, *, max_seq_len: int, device: torch.device, clock: PhaseClock,
                 before: Callable[[], None] = lambda: None):
        self.pm = pm
        self.tok = tok
        self.samples = samples
        self.examples = examples
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.device = device
        self.clock = clock
        self.before = before

    def evaluate(self, adapters: list[int | None], *, metrics: list[str], max_new_tokens: int,
                 samples: list[Sample] | None = None, examples: list[dict] | None = None) -> list[dict[str, float]]:
        """Packed eval of these adapters (None: the base model) on the eval set (or on
        ``samples`` / ``examples``), batches sized from the device's memory."""
        return evaluate_adapters(
            self.pm, adapters, self.samples if samples is None else samples,
            self.examples if examples is None else examples, self.tok,
            metrics=metrics, max_new_tokens=max_new_tokens, max_seq_len=self.max_seq_len,
            device=self.device, batch_rows=self.batch_rows, token_budget=self.cfg.token_budget,
        )

    @property
    def batch_rows(self) -> int:
        """Rows one eval forward takes (the job's ``eval.batch_rows``, else by device)."""
        return eval_batch_rows(self.cfg.batch_rows, self.device.type)

    def _timed(self, adapters: int, max_new_tokens: int, samples: int | None = None):
        """An eval event on the job's clock, with the rows its forwards take (what the cost
        model's fit counts the forwards by)."""
        return self.clock.eval_event(adapters, max_new_tokens, self.device, samples, batch_rows=self.batch_rows)

    def full(self, adapters: list[int], metrics: list[str], *, last: bool = False) -> list[dict[str, float]]:
        """Every metric of ``metrics`` on the whole eval set (an adapter's final or epoch-end
        scores), timed as one eval event. The room is the caller's to make. ``last``: nothing
        trains after it (its batches' memory is not given back: `PhaseClock.eval_event`)."""
        max_new = self.cfg.max_new_tokens
        clock = self._timed(len(adapters), max_new if generated_metrics(metrics) else 0)
        out = self.evaluate(adapters, metrics=metrics, max_new_tokens=max_new)
        clock.done(release=not last)
        return out

    def final(self, adapters: list[int], *, last: bool = False) -> list[dict[str, float]]:
        """Leaving adapters' scores: every metric where the job has eval rows (none without);
        ``last``: the job's last adapters, nothing trains after them."""
        return self.full(adapters, list(self.cfg.metrics) if self.examples else [], last=last)

    def epoch_end(self, adapters: list[int]) -> list[dict[str, float]]:
        """Adapters at an epoch end: every metric on the whole eval set."""
        self.before()
        return self.full(adapters, list(self.cfg.metrics))

    @property
    def scores_epochs(self) -> bool:
        return bool(self.cfg.each_epoch and self.examples)

    def intermediate_due(self, stepped: Sequence[AdapterRun]) -> list[AdapterRun]:
        """Adapters due an intermediate eval: every ``eval.every_steps`` of their own steps,
        and at the steps their config lists (a tune's rungs)."""
        every = self.cfg.every_steps
        if not self.samples:
            return []
        return [r for r in stepped if r.active and r.at_boundary and r.step < r.total_steps
                and ((every and r.step % every == 0) or r.step in r.cfg.eval_steps)]

    def intermediate(self, due: Sequence[AdapterRun]) -> list[dict[str, Any]]:
        """The intermediate eval of ``due`` (packed): each one's evals.jsonl record (without
        its time and attempt): its eval loss and, where the objective is not the loss, the
        objective scored on the intermediate slice (`intermediate_slice`)."""
        self.before()
        ids = [r.index for r in due]
        objective = self.objective_metric()
        loss_metrics = ["loss"] + (["perplexity"] if objective == "perplexity" else [])
        clock = self._timed(len(due), 0)
        metrics = self.evaluate(ids, metrics=loss_metrics, max_new_tokens=1)
        clock.done()
        scored: dict[str, Any] = {"objective": self.cfg.objective} if self.cfg.objective else {}
        if objective is not None and objective not in loss_metrics:
            samples, examples = self.intermediate_slice()
            max_new = self.cfg.max_new_tokens
            clock = self._timed(len(due), max_new if generated_metrics([objective]) else 0, samples=len(samples))
            for m, o in zip(metrics, self.evaluate(ids, metrics=[objective], max_new_tokens=max_new,
                                                   samples=samples, examples=examples)):
                m.update(o)
            clock.done()
            scored["objective_samples"] = len(samples)
        key = f"eval_{self.cfg.objective}"
        records = []
        for r, m in zip(due, metrics):
            rec = {"adapter": r.id, "adapter_step": r.step, "eval_loss": m["eval_loss"],
                   "budget_fraction": round(r.step / r.total_steps, 6)}
            if scored:
                rec.update(scored)
                rec[key] = m.get(key)
            records.append(rec)
        return records

    def objective_metric(self) -> str | None:
        """The objective as ``eval.metrics`` names it (a user metric: ``module:function``);
        None where the job has no objective or it is the loss."""
        name = self.cfg.objective
        if name is None or name == "loss":
            return None
        return next((m for m in self.cfg.metrics if metric_name(m) == name), None)

    def intermediate_slice(self) -> tuple[list[Sample], list[dict]]:
        """The eval rows intermediate evals score the objective on: ``intermediate_samples``
        of them spread evenly over the eval set (all of it when it is smaller), the same rows
        at every eval and for every adapter."""
        n, want = len(self.samples), self.cfg.intermediate_samples
        rows = list(range(n)) if want >= n else [i * n // want for i in range(want)]
        examples = [self.examples[i] for i in rows] if len(self.examples) == n else []
        return [self.samples[i] for i in rows], examples

    def base(self) -> dict[str, float]:
        """The base model's scores (every metric)."""
        self.before()
        return self.evaluate([None], metrics=list(self.cfg.metrics), max_new_tokens=self.cfg.max_new_tokens)[0]
