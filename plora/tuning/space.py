"""The sweep's search space as Optuna distributions, and trials' params as plora configs."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState

from plora.spec.adapter import INTEGER_HYPERPARAMETERS, TRAINING_DIMS, AdapterConfig, _norm_float
from plora.spec.schema import SweepSpec
from plora.spec.space import Range, RelativeAlpha
from plora.tuning.base import TuneError, _quiet_optuna


#: dimensions whose values are choices, not numbers (categorical in every sampler)
_CHOICES = ("scheduler", "rslora", "targets")


def _dist(name: str, values: Any) -> BaseDistribution:
    """A list is categorical; a range is an int or float distribution (log when the range is).
    A scheduler, rsLoRA switch or target set (`plora.spec.adapter.target_key`) is a choice."""
    integer = name in INTEGER_HYPERPARAMETERS
    if isinstance(values, Range):
        if integer:
            return IntDistribution(int(values.low), int(values.high), log=values.log)
        return FloatDistribution(float(values.low), float(values.high), log=values.log)
    if name in _CHOICES:
        return CategoricalDistribution(list(dict.fromkeys(bool(v) if name == "rslora" else str(v) for v in values)))
    vals = list(dict.fromkeys(int(v) if integer else float(v) for v in values))
    return CategoricalDistribution(vals)


def search_space(spec: SweepSpec, *, include_seed: bool = False) -> dict[str, BaseDistribution]:
    """Optuna distributions of the space file's hyperparameters.

    ``rank``/``batch_size`` are ints, ``learning_rate`` a float, ``alpha`` absolute or, for
    ``alpha: {relative: [...]}``, the factor ``alpha_factor`` (alpha = factor × rank). Value
    lists are categorical; ranges are sampled continuously (their ``num`` only matters to the
    grid sampler). A ``list`` space offers, per hyperparameter, the values its configs use.
    ``include_seed`` adds ``seed`` (categorical) when ``seeds_per_config > 1``. Each
    dimension the space searches per adapter (`plora.spec.adapter.TRAINING_DIMS`) is one more param
    of its name; in a ``list`` space its values are the entries' (the sweep's where an entry
    gives none).
    """
    sp = spec.space
    out: dict[str, BaseDistribution] = {}
    if sp.strategy == "list":
        for name in ("rank", "alpha", "learning_rate", "batch_size"):
            vals = sorted({getattr(c, name) for c in sp.configs or []})
            out[name] = _dist(name, vals)
        sweep = spec.sweep_values()
        for name in sp.searched():
            vals = [getattr(c, name) if getattr(c, name) is not None else sweep[name] for c in sp.configs or []]
            out[name] = _dist(name, sorted(set(vals), key=str))
    else:
        out["rank"] = _dist("rank", sp.rank)
        if isinstance(sp.alpha, RelativeAlpha):
            out["alpha_factor"] = _dist("alpha_factor", sp.alpha.relative)
        else:
            out["alpha"] = _dist("alpha", sp.alpha)
        out["learning_rate"] = _dist("learning_rate", sp.learning_rate)
        out["batch_size"] = _dist("batch_size", sp.batch_size)
        for name in sp.searched():
            out[name] = _dist(name, getattr(sp, name))
    if include_seed and sp.seeds_per_config > 1:
        out["seed"] = CategoricalDistribution([sp.seed + i for i in range(sp.seeds_per_config)])
    return out


def grid_values(spec: SweepSpec) -> dict[str, list]:
    """The grid sampler's points: each hyperparameter's grid values (range points with ``num``)."""
    sp = spec.space
    if sp.strategy == "list":
        return {n: list(d.choices) for n, d in search_space(spec).items()}  # type: ignore[attr-defined]
    out: dict[str, list] = {}
    for name in ("rank", "alpha", "learning_rate", "batch_size", *sp.searched()):
        v = getattr(sp, name)
        if isinstance(v, Range) and v.num is None:
            raise TuneError(f"the grid sampler needs space.{name} as a list or a range with num")
        key = "alpha_factor" if name == "alpha" and isinstance(sp.alpha, RelativeAlpha) else name
        out[key] = list(sp.values(name))
    return out


def _dims(params: Mapping[str, Any]) -> dict[str, Any]:
    return {n: params[n] for n in TRAINING_DIMS if n in params}


def config_from_params(spec: SweepSpec, params: Mapping[str, Any]) -> AdapterConfig:
    """The adapter a trial's params describe (seed: ``params['seed']`` or ``space.seed``)."""
    rank = int(params["rank"])
    alpha = float(params["alpha_factor"]) * rank if "alpha_factor" in params else float(params["alpha"])
    seed = int(params.get("seed", spec.space.seed))
    return spec.make_config(rank, alpha, float(params["learning_rate"]), int(params["batch_size"]), seed,
                            **_dims(params))


def params_of(
    spec: SweepSpec, cfg: AdapterConfig, space: Mapping[str, BaseDistribution] | None = None
) -> tuple[dict[str, Any], dict[str, BaseDistribution]]:
    """The trial params (and their distributions) of an adapter: the inverse of
    :func:`config_from_params`. A value outside the space (an adapter of an earlier version
    of the space file) is left out of the params rather than breaking the study."""
    space = dict(space if space is not None else search_space(spec, include_seed=True))
    values: dict[str, Any] = {"rank": cfg.rank, "learning_rate": cfg.learning_rate, "batch_size": cfg.batch_size,
                              "alpha": cfg.alpha, "seed": cfg.seed, **spec.settings(cfg)}
    if "alpha_factor" in space:
        choices = space["alpha_factor"].choices  # type: ignore[attr-defined]
        match = [f for f in choices if _norm_float(float(f) * cfg.rank) == cfg.alpha]
        values["alpha_factor"] = match[0] if match else cfg.alpha / cfg.rank
    params, dists = {}, {}
    for name, dist in space.items():
        v = values[name]
        if isinstance(dist, CategoricalDistribution):
            if isinstance(v, (str, bool)) or v is None:
                hit = [c for c in dist.choices if type(c) is type(v) and c == v]
            else:
                hit = [c for c in dist.choices if isinstance(c, (int, float)) and not isinstance(c, bool)
                       and math.isclose(float(c), float(v), rel_tol=1e-9)]
            if not hit:
                continue
            v = hit[0]
        elif isinstance(dist, IntDistribution):
            v = int(v)
        if not dist._contains(dist.to_internal_repr(v)):
            continue
        params[name], dists[name] = v, dist
    return params, dists


def enqueue_configs(study: optuna.Study, spec: SweepSpec, configs: Iterable[Mapping[str, Any] | AdapterConfig]) -> int:
    """Queue user-given configurations (dicts with rank, alpha, learning_rate, batch_size, or
    AdapterConfigs) as the next trials, whatever the sampler; already queued or tried ones are
    skipped. Returns how many were queued."""
    space = search_space(spec)
    n = 0
    for c in configs:
        if not isinstance(c, AdapterConfig):
            c = spec.make_config(c["rank"], c["alpha"], c["learning_rate"], c["batch_size"],
                                 c.get("seed", spec.space.seed), **_dims(c))
        params, _ = params_of(spec, c, space)
        missing = sorted(set(space) - set(params))
        if missing:
            raise TuneError(f"configuration {c.to_dict()} is outside the search space ({', '.join(missing)})")
        before = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
        with _quiet_optuna():
            study.enqueue_trial(params, skip_if_exists=True)
        n += len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,))) - before
    return n
