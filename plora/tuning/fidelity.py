"""The resource a pruner sees in ``plora tune``: the share of its own budget an adapter has seen.

Adapter steps do not compare across configurations: over the same rows, batch size 4 takes
half the steps of batch size 2, so a rung at step 100 would judge one adapter at a quarter
of its training against another at half of it. The resource is the fraction of an
adapter's training budget it has seen (its rows seen over its rows to see, i.e. its own
steps over its total), in per-mille (:data:`UNITS`), an integer as Optuna wants it; the
full budget is known before any trial runs, so ``max_resource`` never waits for a trial to
finish. Rungs sit at fixed fractions, ``min_fraction × reduction_factor^k``
(``optuna.pruner`` in the space file), and each adapter's job scores it at the first of its
own steps that reaches each rung (:meth:`Rungs.eval_steps`, carried by the job config), so
every adapter is judged at the same fractions whatever its batch size.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from plora.spec.schema import SweepSpec

#: The whole training budget of an adapter, in the pruner's resource units (per-mille).
UNITS = 1000


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Rungs:
    """Fixed fractions of the budget at which adapters are scored and judged."""

    min_units: int
    reduction_factor: int
    #: trials that must have been scored at a rung before it stops any (`PatientRungs`)
    min_peers: int = 1

    @classmethod
    def of(cls, spec: SweepSpec) -> Rungs:
        p = spec.optuna.pruner
        return cls(max(1, round(p.min_fraction * UNITS)), p.reduction_factor, p.min_peers)

    @property
    def units(self) -> list[int]:
        """The rungs, in resource units, below the full budget."""
        out, r = [], self.min_units
        while r < UNITS:
            out.append(r)
            r *= self.reduction_factor
        return out

    def eval_steps(self, total: int) -> list[int]:
        """An adapter's steps at which it is scored: for each rung, the first of its ``total``
        steps by which it has seen that share of its budget (its last step is scored anyway)."""
        return sorted({s for u in self.units if (s := max(1, _ceil_div(u * total, UNITS))) < total})

    def resource(self, step: int, total: int) -> int:
        """What an eval at an adapter's ``step`` of ``total`` reports to its trial: the
        largest rung that step stands for (so adapters of every batch size report at the same
        rungs), else the per-mille of its budget seen (an ``eval.every_steps`` point)."""
        if total <= 0 or step >= total:
            return UNITS
        at = [u for u in self.units if max(1, _ceil_div(u * total, UNITS)) == step]
        return max(at) if at else step * UNITS // total

    def pruner(self, name: str) -> optuna.pruners.BasePruner | None:
        """Successive halving and Hyperband on these rungs (None: a pruner that has no rungs)."""
        if name in ("successive-halving", "sha", "asha"):
            return optuna.pruners.SuccessiveHalvingPruner(min_resource=self.min_units,
                                                          reduction_factor=self.reduction_factor)
        if name == "hyperband":
            return optuna.pruners.HyperbandPruner(min_resource=self.min_units, max_resource=UNITS,
                                                  reduction_factor=self.reduction_factor)
        return None


class PatientRungs(optuna.pruners.BasePruner):
    """A pruner that stops no trial at a resource until ``min_peers`` trials have reported
    at it (or past it): asynchronous successive halving otherwise judges the second trial
    to reach a rung against the first alone, and prunes on that one comparison."""

    def __init__(self, wrapped: optuna.pruners.BasePruner, min_peers: int) -> None:
        self.wrapped = wrapped
        self.min_peers = int(min_peers)

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        verdict = self.wrapped.prune(study, trial)  # always asked: it records the rung's value
        if not verdict or self.min_peers <= 1:
            return verdict
        step = trial.last_step
        if step is None:
            return False
        return _peers(study.get_trials(deepcopy=False), step) >= self.min_peers


def _peers(trials: Iterable[FrozenTrial], step: int) -> int:
    return sum(1 for t in trials
               if t.state == TrialState.COMPLETE or any(k >= step for k in t.intermediate_values))
