"""Optuna samplers and pruners by the names ``plora tune`` takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import (
    FloatDistribution,
)
from optuna.trial import TrialState

from plora.spec.schema import SweepSpec
from plora.tuning.base import TuneError, _quiet_optuna
from plora.tuning.fidelity import PatientRungs, Rungs
from plora.tuning.space import grid_values, search_space

#: ``--sampler`` names accepted by :func:`make_sampler`.
SAMPLERS = ("tpe", "random", "grid", "cmaes", "gp", "qmc", "nsgaii", "bruteforce")
#: ``--pruner`` names accepted by :func:`make_pruner`.
PRUNERS = ("none", "median", "percentile", "successive-halving", "hyperband", "wilcoxon")


def make_sampler(
    name: str | optuna.samplers.BaseSampler,
    spec: SweepSpec,
    *,
    seed: int | None = None,
    n_startup_trials: int | None = None,
) -> optuna.samplers.BaseSampler:
    """An Optuna sampler by name (see :data:`SAMPLERS`), or the sampler given.

    ``n_startup_trials`` (TPE, CMA-ES, GP): random trials before the model takes over;
    :func:`run_tune` sets it to the batch size, so the first batch explores and every later
    one is proposed from the results before it. ``seed`` defaults to ``space.seed``.
    """
    if isinstance(name, optuna.samplers.BaseSampler):
        return name
    seed = spec.space.seed if seed is None else seed
    key = str(name).lower().replace("_", "-")
    startup = {} if n_startup_trials is None else {"n_startup_trials": int(n_startup_trials)}
    with _quiet_optuna():
        if key == "tpe":
            return optuna.samplers.TPESampler(seed=seed, constant_liar=True, **startup)
        if key == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if key == "grid":
            return optuna.samplers.GridSampler(grid_values(spec), seed=seed)
        if key in ("cmaes", "cma-es"):
            try:
                import cmaes  # noqa: F401
            except ImportError:
                raise TuneError("sampler cmaes needs the cmaes package (pip install cmaes)") from None
            return optuna.samplers.CmaEsSampler(seed=seed, **startup)
        if key == "gp":
            return optuna.samplers.GPSampler(seed=seed, **startup)
        if key == "qmc":
            return optuna.samplers.QMCSampler(seed=seed)
        if key in ("nsgaii", "nsga2", "nsga-ii"):
            return optuna.samplers.NSGAIISampler(seed=seed)
        if key in ("bruteforce", "brute-force"):
            if any(isinstance(d, FloatDistribution) and d.step is None for d in search_space(spec).values()):
                raise TuneError("the bruteforce sampler needs a finite space: give the float hyperparameters as lists")
            return optuna.samplers.BruteForceSampler(seed=seed)
    raise TuneError(f"unknown sampler {name!r}; expected one of: {', '.join(SAMPLERS)}")


def make_pruner(name: str | optuna.pruners.BasePruner | None, rungs: Rungs | None = None) -> optuna.pruners.BasePruner:
    """An Optuna pruner by name (see :data:`PRUNERS`), or the pruner given; None prunes nothing.

    The resource is the per-mille of its budget an adapter has seen (`plora.tuning.fidelity`):
    successive halving and Hyperband get ``rungs``' minimum, reduction factor and the full
    budget as maximum, and no rung stops a trial before ``rungs.min_peers`` trials were
    scored at it. The median and percentile pruners compare a trial with *completed* ones,
    so in packed batches the first batch is never pruned by them.
    """
    if isinstance(name, optuna.pruners.BasePruner):
        return name
    key = (name or "none").lower().replace("_", "-")
    with _quiet_optuna():
        if rungs is not None and (on_rungs := rungs.pruner(key)) is not None:
            return PatientRungs(on_rungs, rungs.min_peers) if rungs.min_peers > 1 else on_rungs
        if key in ("none", "nop"):
            return optuna.pruners.NopPruner()
        if key == "median":
            return optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)
        if key == "percentile":
            return optuna.pruners.PercentilePruner(25.0, n_startup_trials=1)
        if key in ("successive-halving", "sha", "asha"):
            return optuna.pruners.SuccessiveHalvingPruner()
        if key == "hyperband":
            return optuna.pruners.HyperbandPruner()
        if key == "wilcoxon":
            return optuna.pruners.WilcoxonPruner()
    raise TuneError(f"unknown pruner {name!r}; expected one of: {', '.join(PRUNERS)}")


@dataclass
class Startup:
    """Random trials until ``n`` trials are *told*, then the study's own sampler.

    TPE (and GP, CMA-ES) count running trials toward their start-up when the constant liar
    is on, so a tune that asks each trial as a slot frees (``--async``) would hand the model
    the 17th trial with one result and 15 guesses; the loop asks its second batch with the
    whole first one told. This keeps the two alike: the model proposes only from ``n``
    results."""

    sampler: optuna.samplers.BaseSampler
    n: int

    def ask(self, study: optuna.Study, space: dict[str, Any]) -> optuna.Trial:
        told = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
        if told >= self.n:
            return study.ask(space)
        model, study.sampler = study.sampler, self.sampler
        try:
            return study.ask(space)
        finally:
            study.sampler = model
