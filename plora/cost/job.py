"""A job's time outside its steady training steps: fitted terms and the sweep's eval load.

On a GPU a packed job of a 0.5B model spends about as long starting, loading, capturing
graphs, evaluating and saving as it spends in its steps; a plan that prices only the steps
predicts half the makespan. These terms are measured from the phases a job records
(`plora.job.phases.PhaseClock`, summary.json ``phases``), fitted here, cached with the
profile (`plora.cost.profiling`), and used by `plora.cost.model.CostModel.job_time`:

    job = fixed + Σ_phases steps·step_time + capture·(phases - 1) + Σ_groups (eval(G) + save·|G|)

``fixed`` is the process start, model load, set-up, the first step's one-time costs and the
process exit; each change of the pack (an adapter leaving) costs a capture; adapters that
leave together are evaluated packed and saved then, inside the job:

    eval(G) = call + tok·rows·L + gen_fwd·m·⌈rows/batch⌉ + gen_tok·rows·m·(P + m/2),  rows = |G|·n

(once per epoch end where each epoch is scored: `EvalLoad.evals`) with n eval samples of
L tokens (P of them prompt), m new tokens generated per row (0 when
no metric generates). Every coefficient is non-negative and fitted on relative error, like
the step time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

from plora.spec.defaults import EVAL_BATCH_ROWS  # rows an eval forward takes at once

__all__ = ["EvalLoad", "JobOverheads", "eval_features", "fit_overheads"]


@dataclass(frozen=True)
class EvalLoad:
    """What evaluating one adapter costs a sweep: its eval rows, their size, generation."""

    samples: int
    row_tokens: float
    prompt_tokens: float = 0.0
    max_new_tokens: int = 0  # 0: no metric generates
    batch_rows: int = EVAL_BATCH_ROWS
    #: bytes an eval batch may use beyond the job's weights and adapter state (None: unbounded,
    #: the batch is `batch_rows` rows whatever they need)
    budget_bytes: float | None = None
    #: evals each adapter gets on these rows: one at each epoch end with per-epoch scoring
    #: (`plora.train.epochs`), else 1 (its final eval). Adapters that leave together end
    #: their epochs together too (same batch size, same steps), so each eval is of the same group
    evals: int = 1
    #: whether a one-GPU job scores adapters that leave while others stay beside its training
    #: (its side lane, `plora.train.side_lane`): their final eval then holds the pack up for
    #: nothing but their saves. On an H200, SmolLM2's first eval of 12 adapters (2.0-2.4 s)
    #: left its job's wall where setup, steps and the last eval put it; priced in line, warm
    #: sweeps' predictions had run 11-28 % long. As a rule, not always: a pack too tight for
    #: the eval beside its graphs, or rows of a shape not captured ahead, wait for the lane.
    beside_training: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EvalLoad":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def eval_features(adapters: int, samples: int, row_tokens: float, prompt_tokens: float, max_new_tokens: int,
                  batch_rows: int = EVAL_BATCH_ROWS) -> list[float]:
    """The eval-time features of one packed eval (see the module docstring)."""
    rows = adapters * samples
    if rows <= 0:
        return [0.0, 0.0, 0.0, 0.0]
    m = max(0, int(max_new_tokens))
    return [1.0, float(rows * row_tokens), float(m * math.ceil(rows / max(1, batch_rows))),
            float(rows * m * (prompt_tokens + m / 2.0))]


@dataclass(frozen=True)
class JobOverheads:
    """Seconds a job spends outside its steady steps (see the module docstring)."""

    start_s: float = 0.0  # process creation to the recipe (interpreter, imports, CLI)
    load_s: float = 0.0  # the base model built and loaded
    setup_s: float = 0.0  # LoRA injection, data, optimizer
    warm_s: float = 0.0  # the first step over a steady one (kernel compilation, first capture)
    tail_s: float = 0.0  # after the summary is written until the process has exited
    capture_s: float = 0.0  # each later pack composition's first step over a steady one
    eval_call_s: float = 0.0
    eval_tok_s: float = 0.0
    eval_gen_fwd_s: float = 0.0
    eval_gen_tok_s: float = 0.0
    save_s: float = 0.0  # per adapter saved (PEFT files, metrics)
    jobs: int = 0  # job runs behind the fit

    @property
    def fixed_s(self) -> float:
        """Paid once by every job, whatever its adapters."""
        return self.start_s + self.load_s + self.setup_s + self.warm_s + self.tail_s

    def eval_time(self, adapters: int, load: EvalLoad | None) -> float:
        if load is None or adapters <= 0 or load.samples <= 0:
            return 0.0
        x = eval_features(adapters, load.samples, load.row_tokens, load.prompt_tokens, load.max_new_tokens,
                          load.batch_rows)
        c = (self.eval_call_s, self.eval_tok_s, self.eval_gen_fwd_s, self.eval_gen_tok_s)
        return float(sum(a * b for a, b in zip(x, c)))

    def exit_time(self, adapters: int, load: EvalLoad | None) -> float:
        """Seconds ``adapters`` adapters leaving the pack together add: their packed evals (one
        per epoch end with per-epoch scoring, `EvalLoad.evals`), saves."""
        if adapters <= 0:
            return 0.0
        evals = max(1, load.evals) if load is not None else 1
        return self.eval_time(adapters, load) * evals + self.save_s * adapters

    def scaled(self, factor: float) -> "JobOverheads":
        return JobOverheads(**{f.name: (getattr(self, f.name) * factor if f.name != "jobs" else self.jobs)
                               for f in fields(self)})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "JobOverheads":
        known = {f.name for f in fields(cls)}
        return cls(**{k: (int(v) if k == "jobs" else float(v)) for k, v in d.items() if k in known})


def _steady(phase: dict[str, Any]) -> float | None:
    n = int(phase.get("steps", 0))
    return float(phase["rest_s"]) / (n - 1) if n >= 2 else None


def fit_overheads(runs: Sequence[dict[str, Any]], batch_rows: int = EVAL_BATCH_ROWS) -> JobOverheads:
    """The job terms from finished jobs' phases.

    ``runs``: one dict per job run, the ``phases`` of its summary.json, optionally with
    ``exited_at`` (when whoever started the process saw it end: gives the tail). Medians
    for the per-job terms (one slow start does not move them), a non-negative least-squares
    fit on relative error for the eval; the save time per adapter is the total over all saves.
    """
    runs = [r for r in runs if r]
    if not runs:
        raise ValueError("no job phases to fit")

    def median(values) -> float:
        values = [float(v) for v in values if v is not None]
        return statistics.median(values) if values else 0.0

    warm, capture = [], []
    for r in runs:
        phases = r.get("phases", [])
        for i, p in enumerate(phases):
            if i > 0 and p.get("reused"):  # replayed a held graph: no capture to measure
                continue
            steady = _steady(p)
            if steady is None and i + 1 < len(phases):  # a one-step phase: the next one's rate
                steady = _steady(phases[i + 1])
            if steady is None:
                continue
            (warm if i == 0 else capture).append(max(0.0, float(p["first_s"]) - steady))
    tails = [max(0.0, float(r["exited_at"]) - float(r["finished_at"])) for r in runs
             if r.get("exited_at") is not None and r.get("finished_at") is not None]
    saved = sum(int(s["adapters"]) for r in runs for s in r.get("saves", []))
    save_s = sum(float(s["seconds"]) for r in runs for s in r.get("saves", [])) / saved if saved else 0.0

    X, y = [], []
    for r in runs:
        for e in r.get("evals", []):
            if float(e.get("seconds", 0)) <= 0 or int(e.get("samples", 0)) <= 0:
                continue
            X.append(eval_features(int(e["adapters"]), int(e["samples"]), float(r.get("eval_row_tokens", 0.0)),
                                   float(r.get("eval_prompt_tokens", 0.0)), int(e.get("max_new_tokens", 0)),
                                   int(e.get("batch_rows") or batch_rows)))
            y.append(float(e["seconds"]))
    coef = _fit_eval(X, y)
    return JobOverheads(
        start_s=median(r.get("start_s") for r in runs),
        load_s=median(r.get("load_s") for r in runs),
        setup_s=median(r.get("setup_s") for r in runs),
        warm_s=median(warm),
        tail_s=median(tails),
        capture_s=median(capture),
        eval_call_s=coef[0], eval_tok_s=coef[1], eval_gen_fwd_s=coef[2], eval_gen_tok_s=coef[3],
        save_s=save_s,
        jobs=len(runs),
    )


def _fit_eval(X: list[list[float]], y: list[float]) -> list[float]:
    if not y:
        return [0.0] * 4
    import numpy as np
    from scipy.optimize import nnls

    A, b = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    used = np.abs(A).sum(axis=0) > 0  # a feature no event had (no generation) stays 0
    w = 1.0 / b
    Aw = A[:, used] * w[:, None]
    scale = np.linalg.norm(Aw, axis=0)
    scale[scale == 0] = 1.0
    c, _ = nnls(Aw / scale, b * w)
    out = np.zeros(A.shape[1])
    out[used] = c / scale
    return [float(v) for v in out]
