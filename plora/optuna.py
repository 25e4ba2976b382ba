"""Optuna integration: every sweep is a study, and any Optuna sampler can drive packed training.

People who tune hyperparameters already have Optuna's samplers, pruners, storages and
dashboard; plora should be the fastest way to run that search on LoRA adapters, not a
second island. Two directions:

* **Record.** A finished ``plora sweep`` is written into an Optuna study (SQLite in the run
  directory unless ``optuna.storage`` names another storage): one trial per adapter, with
  its hyperparameters as params, the eval objective as value, the state (COMPLETE, FAIL for
  diverged or crashed adapters, PRUNED) and user attrs (adapter, job, TP degree, checkpoint,
  metrics). ``optuna-dashboard <storage>`` opens it.
* **Drive.** :func:`run_tune` asks a batch of K trials from any sampler, trains them as
  packed jobs, tells the results, and repeats: the sampler sees each batch's results before
  it proposes the next. Intermediate eval losses are reported while jobs run, and an
  adapter the pruner stops leaves its pack (through the job's ``control.json``).

Intermediate values are eval losses, signed to the study's direction: a study that
maximizes exact match receives ``-eval_loss`` so that any Optuna pruner (which compares
intermediate values in the study's direction) reads "higher is better" for both.

This module is ``plora.optuna``; inside it ``import optuna`` is the Optuna package
(absolute imports), and callers import it as ``from plora import optuna as plora_optuna``
or ``import plora.optuna``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import pandas as pd
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import FrozenTrial, TrialState

from plora.spec import AdapterConfig, RelativeAlpha, Range, SweepSpec, _norm_float
from plora.sweep import (
    PlannedJob,
    PreparedSweep,
    SweepPlan,
    collect_results,
    configs_frame,
    dataset_size,
    plan_jobs,
    run_prepared,
)

__all__ = [
    "SAMPLERS",
    "PRUNERS",
    "BatchReport",
    "TuneError",
    "check_tune_request",
    "config_from_params",
    "enqueue_configs",
    "intermediate_sign",
    "make_pruner",
    "make_sampler",
    "open_study",
    "params_of",
    "record_sweep",
    "run_tune",
    "search_space",
    "storage_url",
    "study_name",
    "tune_trials",
]

#: ``--sampler`` names accepted by :func:`make_sampler`.
SAMPLERS = ("tpe", "random", "grid", "cmaes", "gp", "qmc", "nsgaii", "bruteforce")
#: ``--pruner`` names accepted by :func:`make_pruner`.
PRUNERS = ("none", "median", "percentile", "successive-halving", "hyperband", "wilcoxon")

#: Trial states of the adapter statuses in results.parquet.
STATE_OF_STATUS = {
    "done": TrialState.COMPLETE,
    "diverged": TrialState.FAIL,
    "failed": TrialState.FAIL,
    "pruned": TrialState.PRUNED,
}


class TuneError(ValueError):
    """A tuning request that cannot run (unknown sampler, bad trial count...); one line."""


# --------------------------------------------------------------------------- the study


def storage_url(spec: SweepSpec, run_dir: Path | None = None) -> str:
    """``optuna.storage`` from the space file, else SQLite in the run directory."""
    if spec.optuna.storage:
        return spec.optuna.storage
    return f"sqlite:///{spec.run_dir(run_dir) / 'study.sqlite'}"


def study_name(spec: SweepSpec) -> str:
    """``optuna.study_name``, else the sweep's name."""
    return spec.optuna.study_name or spec.name


def _direction(spec: SweepSpec) -> str:
    return "minimize" if spec.eval.minimize else "maximize"


def intermediate_sign(spec: SweepSpec) -> float:
    """Factor applied to eval losses reported as intermediate values (see the module doc)."""
    return 1.0 if spec.eval.minimize else -1.0


@contextlib.contextmanager
def _quiet_optuna():
    """Optuna logs every study creation and trial at INFO; plora renders its own progress."""
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(level)


def open_study(
    spec: SweepSpec,
    run_dir: Path | None = None,
    *,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
) -> optuna.Study:
    """Create the sweep's study, or re-open it (``load_if_exists``): re-running keeps every trial."""
    url = storage_url(spec, run_dir)
    if url.startswith("sqlite:///") and not spec.optuna.storage:
        spec.run_dir(run_dir).mkdir(parents=True, exist_ok=True)
    with _quiet_optuna():
        study = optuna.create_study(
            storage=url,
            study_name=study_name(spec),
            direction=_direction(spec),
            sampler=sampler,
            pruner=pruner,
            load_if_exists=True,
        )
    if study.direction.name.lower() != _direction(spec):
        raise TuneError(
            f"study {study.study_name!r} in {url} is set to {study.direction.name.lower()} but eval.objective "
            f"{spec.eval.objective!r} needs {_direction(spec)}; set optuna.study_name to start a new study"
        )
    if study.metric_names is None:  # the dashboard's axis label instead of "Objective 0"
        with _quiet_optuna():
            study.set_metric_names([f"eval_{spec.eval.objective}"])
    if "objective" not in study.user_attrs:
        study.set_user_attr("objective", f"eval_{spec.eval.objective}")
        study.set_user_attr("intermediate_value", "eval_loss" if spec.eval.minimize else "-eval_loss")
        study.set_user_attr("run_dir", str(spec.run_dir(run_dir)))
    return study


# --------------------------------------------------------------------------- the search space


def _dist(name: str, values: Any) -> BaseDistribution:
    """A list is categorical; a range is an int or float distribution (log when the range is)."""
    integer = name in ("rank", "batch_size")
    if isinstance(values, Range):
        if integer:
            return IntDistribution(int(values.low), int(values.high), log=values.log)
        return FloatDistribution(float(values.low), float(values.high), log=values.log)
    vals = list(dict.fromkeys(int(v) if integer else float(v) for v in values))
    return CategoricalDistribution(vals)


def search_space(spec: SweepSpec, *, include_seed: bool = False) -> dict[str, BaseDistribution]:
    """Optuna distributions of the space file's hyperparameters.

    ``rank``/``batch_size`` are ints, ``learning_rate`` a float, ``alpha`` absolute or, for
    ``alpha: {relative: [...]}``, the factor ``alpha_factor`` (alpha = factor × rank). Value
    lists are categorical; ranges are sampled continuously (their ``num`` only matters to the
    grid sampler). A ``list`` space offers, per hyperparameter, the values its configs use.
    ``include_seed`` adds ``seed`` (categorical) when ``seeds_per_config > 1``.
    """
    sp = spec.space
    out: dict[str, BaseDistribution] = {}
    if sp.strategy == "list":
        for name in ("rank", "alpha", "learning_rate", "batch_size"):
            vals = sorted({getattr(c, name) for c in sp.configs or []})
            out[name] = _dist(name, vals)
    else:
        out["rank"] = _dist("rank", sp.rank)
        if isinstance(sp.alpha, RelativeAlpha):
            out["alpha_factor"] = _dist("alpha_factor", sp.alpha.relative)
        else:
            out["alpha"] = _dist("alpha", sp.alpha)
        out["learning_rate"] = _dist("learning_rate", sp.learning_rate)
        out["batch_size"] = _dist("batch_size", sp.batch_size)
    if include_seed and sp.seeds_per_config > 1:
        out["seed"] = CategoricalDistribution([sp.seed + i for i in range(sp.seeds_per_config)])
    return out


def grid_values(spec: SweepSpec) -> dict[str, list]:
    """The grid sampler's points: each hyperparameter's grid values (range points with ``num``)."""
    sp = spec.space
    if sp.strategy == "list":
        return {n: list(d.choices) for n, d in search_space(spec).items()}  # type: ignore[attr-defined]
    out: dict[str, list] = {}
    for name in ("rank", "alpha", "learning_rate", "batch_size"):
        v = getattr(sp, name)
        if isinstance(v, Range) and v.num is None:
            raise TuneError(f"the grid sampler needs space.{name} as a list or a range with num")
        key = "alpha_factor" if name == "alpha" and isinstance(sp.alpha, RelativeAlpha) else name
        out[key] = list(sp.values(name))
    return out


def config_from_params(spec: SweepSpec, params: Mapping[str, Any]) -> AdapterConfig:
    """The adapter a trial's params describe (seed: ``params['seed']`` or ``space.seed``)."""
    rank = int(params["rank"])
    alpha = float(params["alpha_factor"]) * rank if "alpha_factor" in params else float(params["alpha"])
    seed = int(params.get("seed", spec.space.seed))
    return AdapterConfig.make(rank, alpha, float(params["learning_rate"]), int(params["batch_size"]), seed)


def params_of(
    spec: SweepSpec, cfg: AdapterConfig, space: Mapping[str, BaseDistribution] | None = None
) -> tuple[dict[str, Any], dict[str, BaseDistribution]]:
    """The trial params (and their distributions) of an adapter: the inverse of
    :func:`config_from_params`. A value outside the space (an adapter of an earlier version
    of the space file) is left out of the params rather than breaking the study."""
    space = dict(space if space is not None else search_space(spec, include_seed=True))
    values: dict[str, Any] = {"rank": cfg.rank, "learning_rate": cfg.learning_rate, "batch_size": cfg.batch_size,
                              "alpha": cfg.alpha, "seed": cfg.seed}
    if "alpha_factor" in space:
        choices = space["alpha_factor"].choices  # type: ignore[attr-defined]
        match = [f for f in choices if _norm_float(float(f) * cfg.rank) == cfg.alpha]
        values["alpha_factor"] = match[0] if match else cfg.alpha / cfg.rank
    params, dists = {}, {}
    for name, dist in space.items():
        v = values[name]
        if isinstance(dist, CategoricalDistribution):
            hit = [c for c in dist.choices if isinstance(c, (int, float)) and math.isclose(float(c), float(v), rel_tol=1e-9)]
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
            c = AdapterConfig.make(c["rank"], c["alpha"], c["learning_rate"], c["batch_size"],
                                   c.get("seed", spec.space.seed))
        params, _ = params_of(spec, c, space)
        missing = sorted(set(space) - set(params))
        if missing:
            raise TuneError(f"configuration {c.to_dict()} is outside the search space ({', '.join(missing)})")
        before = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
        with _quiet_optuna():
            study.enqueue_trial(params, skip_if_exists=True)
        n += len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,))) - before
    return n


# --------------------------------------------------------------------------- samplers and pruners


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


def make_pruner(name: str | optuna.pruners.BasePruner | None) -> optuna.pruners.BasePruner:
    """An Optuna pruner by name (see :data:`PRUNERS`), or the pruner given; None prunes nothing.

    Pruners compare a trial's intermediate values with those of *completed* trials, so in
    packed batches the first batch is never pruned and later batches are judged against it.
    """
    if isinstance(name, optuna.pruners.BasePruner):
        return name
    key = (name or "none").lower().replace("_", "-")
    with _quiet_optuna():
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


# --------------------------------------------------------------------------- results -> trials


def _clean(v: Any) -> Any:
    """JSON-safe user attr values: numpy scalars to Python, NaN to None."""
    if v is None:
        return None
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        with contextlib.suppress(Exception):
            v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _user_attrs(row: Mapping[str, Any], cfg: AdapterConfig, tp: int | None, run_dir: Path) -> dict[str, Any]:
    keys = ("job_id", "status", "checkpoint_path", "eval_loss", "eval_exact_match", "train_loss", "steps",
            "wall_time_s", "reason")
    attrs = {"adapter_id": cfg.id, "alpha": cfg.alpha, "seed": cfg.seed, "tp": tp, "run_dir": str(run_dir)}
    attrs.update({k: _clean(row.get(k)) for k in keys})
    return attrs


def _objective_value(row: Mapping[str, Any], spec: SweepSpec) -> float | None:
    v = _clean(row.get(f"eval_{spec.eval.objective}"))
    return float(v) if isinstance(v, (int, float)) else None


def _state_and_value(row: Mapping[str, Any], spec: SweepSpec) -> tuple[TrialState, float | None]:
    state = STATE_OF_STATUS.get(str(row.get("status")), TrialState.FAIL)
    value = _objective_value(row, spec) if state == TrialState.COMPLETE else None
    if state == TrialState.COMPLETE and value is None:
        state = TrialState.FAIL  # finished without its objective (metric not measured)
    return state, value


def read_evals(run_dir: Path, job_ids: Iterable[str] | None = None) -> dict[str, dict[int, float]]:
    """Intermediate eval losses per adapter: ``{adapter: {adapter_step: eval_loss}}``."""
    jobs = (run_dir / "jobs" / j for j in job_ids) if job_ids is not None else (run_dir / "jobs").glob("*")
    out: dict[str, dict[int, float]] = {}
    for job_dir in jobs:
        path = job_dir / "evals.jsonl"
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                rec = json.loads(line)
                out.setdefault(rec["adapter"], {})[int(rec["adapter_step"])] = float(rec["eval_loss"])
    return out


def record_sweep(prep: PreparedSweep, frame: pd.DataFrame) -> optuna.Study | None:
    """Write a finished sweep into its Optuna study, one trial per adapter.

    An adapter already in the study with the same status is skipped, and so is one whose
    trial is still running (a batch of :func:`run_tune`, which tells its own trials), so
    re-running a sweep adds only what changed. Never raises: the results table matters more
    than the study, so a storage problem becomes a warning.
    """
    try:
        spec = prep.spec
        study = open_study(spec, prep.run_dir)
        seen = set()
        for t in study.get_trials(deepcopy=False):
            a = t.user_attrs.get("adapter_id")
            seen.add((a, t.user_attrs.get("status")))
            if t.state in (TrialState.RUNNING, TrialState.WAITING):
                seen.add((a, "*"))
        space = search_space(spec, include_seed=True)
        tp_of = {a.id: j.tp for j in prep.plan.jobs for a in j.adapters}
        cfg_of = {c.id: c for c in prep.configs}
        curves = read_evals(prep.run_dir)
        sign = intermediate_sign(spec)
        new = []
        for row in frame.to_dict("records"):
            cfg = cfg_of.get(row["adapter_id"])
            if cfg is None or (cfg.id, row.get("status")) in seen or (cfg.id, "*") in seen:
                continue
            state, value = _state_and_value(row, spec)
            params, dists = params_of(spec, cfg, space)
            new.append(optuna.trial.create_trial(
                state=state, value=value, params=params, distributions=dists,
                user_attrs=_user_attrs(row, cfg, tp_of.get(cfg.id), prep.run_dir),
                intermediate_values={s: sign * v for s, v in curves.get(cfg.id, {}).items()},
            ))
        with _quiet_optuna():
            study.add_trials(new)
        return study
    except Exception as e:  # noqa: BLE001 - see the docstring
        warnings.warn(f"Optuna study not updated ({type(e).__name__}: {e}); results.parquet is complete",
                      RuntimeWarning, stacklevel=2)
        return None


# --------------------------------------------------------------------------- packed optimization


@dataclass
class BatchReport:
    """What one batch of :func:`run_tune` did, for progress display (``on_batch``)."""

    index: int
    trials: list[FrozenTrial]
    trained: list[str]  # adapter ids trained in this batch
    reused: list[str]  # adapter ids whose earlier result was told again
    pruned: list[str]
    jobs: list[str]
    wall_time_s: float
    best: FrozenTrial | None


@dataclass
class _RunState:
    """The tune's cumulative view of the run directory: every config and job so far, so that
    results.parquet, configs.parquet and plan.json describe the whole search."""

    spec: SweepSpec
    run_dir: Path
    configs: dict[str, AdapterConfig] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    jobs: list[PlannedJob] = field(default_factory=list)
    batches: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, spec: SweepSpec, run_dir: Path) -> "_RunState":
        st = cls(spec, run_dir)
        with contextlib.suppress(Exception):
            for r in pd.read_parquet(run_dir / "configs.parquet").to_dict("records"):
                cfg = AdapterConfig.make(r["rank"], r["alpha"], r["learning_rate"], r["batch_size"], r["seed"])
                st.configs[cfg.id] = cfg
                st.steps[cfg.id] = int(r.get("steps") or 0)
        with contextlib.suppress(Exception):
            plan = json.loads((run_dir / "plan.json").read_text())
            st.batches = list(plan.get("batches", []))
            for j in plan.get("jobs", []):
                jid = str(j.get("job_id") or j.get("id"))
                members = [st.configs[a] for a in j.get("adapters", []) if a in st.configs]
                if members:
                    steps = {a.id: int((j.get("steps") or {}).get(a.id, st.steps.get(a.id, 0))) for a in members}
                    st.jobs.append(PlannedJob(jid, members, steps, int(j.get("tp", 1)), list(j.get("gpus") or []),
                                              j.get("predicted_start"), j.get("predicted_end")))
        return st

    def next_batch(self) -> int:
        used = [int(m.group(1)) for j in self.jobs if (m := re.match(r"b(\d+)-", j.job_id))]
        used += [int(b.get("batch", 0)) for b in self.batches]
        return max(used, default=0) + 1

    def prep(self) -> PreparedSweep:
        cfgs = list(self.configs.values())
        return PreparedSweep(self.spec, self.run_dir, cfgs, dict(self.steps),
                             SweepPlan(list(self.jobs), "optuna batches"))

    def add(self, configs: Sequence[AdapterConfig], steps: Mapping[str, int], jobs: Sequence[PlannedJob]) -> None:
        for c in configs:
            self.configs[c.id] = c
            self.steps[c.id] = int(steps.get(c.id, self.steps.get(c.id, 0)))
        self.jobs.extend(jobs)

    def write(self) -> None:
        """configs.parquet and plan.json of everything so far (each batch's jobs keep their id)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        configs_frame(self.prep()).to_parquet(self.run_dir / "configs.parquet", index=False)
        batch_of = {jid: b["batch"] for b in self.batches for jid in b.get("jobs", [])}
        plan = {
            "grouping": f"optuna: {len(self.batches)} batches; " + (self.batches[-1].get("grouping", "") if self.batches else ""),
            "jobs": [{**j.to_dict(), "batch": batch_of.get(j.job_id)} for j in self.jobs],
            "batches": self.batches,
        }
        (self.run_dir / "plan.json").write_text(json.dumps(plan, indent=2))


def _finished_status(run_dir: Path, adapter_id: str) -> str | None:
    path = run_dir / "adapters" / adapter_id / "metrics.json"
    with contextlib.suppress(OSError, ValueError):
        status = json.loads(path.read_text()).get("status")
        return status if status in ("done", "diverged", "pruned") else None
    return None


class _PruneWatcher:
    """Reads the intermediate evals of running jobs, reports them to their trials and, when a
    trial's pruner says so, asks the job to drop that adapter (``control.json``)."""

    def __init__(self, trials: Mapping[str, Sequence[optuna.Trial]], sign: float, can_prune: bool) -> None:
        self.trials = trials
        self.sign = sign
        self.can_prune = can_prune
        self.offsets: dict[Path, int] = {}
        self.reported: dict[int, set[int]] = {}
        self.pruned: set[str] = set()

    def __call__(self, running: Sequence[Any], finished: Sequence[Any]) -> None:
        for jp in running:
            self.poll(Path(jp.job_dir), prune=self.can_prune)

    def poll(self, job_dir: Path, *, prune: bool) -> None:
        path = job_dir / "evals.jsonl"
        if not path.is_file():
            return
        with open(path, "rb") as f:
            f.seek(self.offsets.get(path, 0))
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # only whole lines; the rest is read next time
        self.offsets[path] = self.offsets.get(path, 0) + end
        for line in chunk[:end].decode().splitlines():
            try:
                rec = json.loads(line)
                adapter, step, loss = rec["adapter"], int(rec["adapter_step"]), float(rec["eval_loss"])
            except (ValueError, KeyError, TypeError):
                continue
            trials = self.trials.get(adapter, ())
            if not trials or not math.isfinite(loss) or adapter in self.pruned:
                continue
            for t in trials:
                done = self.reported.setdefault(t.number, set())
                if step not in done:
                    t.report(self.sign * loss, step)
                    done.add(step)
            if prune and trials[0].should_prune():
                self.pruned.add(adapter)
                request_prune(job_dir, [adapter])


def request_prune(job_dir: Path, adapter_ids: Iterable[str]) -> None:
    """Ask a running job to drop adapters: they leave the pack at its next step, with status
    ``pruned`` (the job reads control.json whenever it changes)."""
    path = Path(job_dir) / "control.json"
    try:
        control = json.loads(path.read_text())
    except (OSError, ValueError):
        control = {}
    prune = list(dict.fromkeys([*control.get("prune", []), *adapter_ids]))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**control, "prune": prune}))
    tmp.replace(path)


def _tell(study: optuna.Study, spec: SweepSpec, trial: optuna.Trial, row: Mapping[str, Any] | None,
          cfg: AdapterConfig, tp: int | None, run_dir: Path, batch: int) -> None:
    row = row or {"status": "failed", "reason": "no result"}
    for k, v in _user_attrs(row, cfg, tp, run_dir).items():
        trial.set_user_attr(k, v)
    trial.set_user_attr("batch", batch)
    state, value = _state_and_value(row, spec)
    with _quiet_optuna():
        try:
            if state == TrialState.COMPLETE:
                study.tell(trial, value, skip_if_finished=True)
            else:
                study.tell(trial, state=state, skip_if_finished=True)
        except RuntimeError as e:
            # The grid sampler calls study.stop() once its grid is done, which only works
            # inside study.optimize; the trial is told by then.
            if "Study.stop" not in str(e):
                raise


def tune_trials(spec: SweepSpec, trials: int | None) -> int:
    """Trials a tune runs: ``trials``, else the number of configurations the space expands to
    (which a grid with a range that has no ``num`` does not have: then ``trials`` is needed)."""
    if trials is None:
        unspaced = [n for n in ("rank", "alpha", "learning_rate", "batch_size")
                    if isinstance(getattr(spec.space, n), Range) and getattr(spec.space, n).num is None]
        if spec.space.strategy == "grid" and unspaced:
            raise TuneError(f"--trials is required: space.{unspaced[0]} is a range without num, so the space has "
                            "no number of configurations")
        return len({(c.rank, c.alpha, c.learning_rate, c.batch_size) for c in spec.expand()})
    if int(trials) < 1:
        raise TuneError(f"trials must be >= 1, got {trials}")
    return int(trials)


def check_tune_request(spec: SweepSpec, *, sampler: str, trials: int | None, batch: int | None,
                       pruner: str | None) -> None:
    """What can be wrong with a tune request (trials, batch, sampler, pruner), found before
    anything runs or is printed; raises :class:`TuneError`."""
    tune_trials(spec, trials)
    if batch is not None and batch < 1:
        raise TuneError(f"batch must be >= 1, got {batch}")
    make_sampler(sampler, spec)
    if not isinstance(make_pruner(pruner), optuna.pruners.NopPruner) and not spec.eval.every_steps:
        raise TuneError("pruning needs intermediate eval losses: set eval.every_steps in the space file")


def run_tune(
    spec: SweepSpec,
    *,
    sampler: str | optuna.samplers.BaseSampler = "tpe",
    trials: int | None = None,
    batch: int | None = None,
    pruner: str | optuna.pruners.BasePruner | None = None,
    run_dir: Path | None = None,
    seed: int | None = None,
    n_startup_trials: int | None = None,
    enqueue: Iterable[Mapping[str, Any] | AdapterConfig] | None = None,
    on_batch: Callable[[BatchReport], None] | None = None,
    on_tick: Callable[[list, list], None] | None = None,
    on_snapshot: Callable[[Any], None] | None = None,
    slots: list[str] | None = None,
) -> optuna.Study:
    """Packed optimization driven by an Optuna sampler; returns the study.

    Each batch asks ``batch`` trials, turns them into adapters, plans them into packed jobs
    (ids ``b01-job-000``, … in one run directory), trains them through the sweep's engine
    (:func:`plora.sweep.run_prepared`: journal, retries, out-of-memory splits), and tells
    every trial its result: COMPLETE with the eval objective, FAIL for diverged or crashed adapters, PRUNED
    for adapters the pruner stopped. A trial that proposes an adapter already trained in the
    run directory is told that adapter's result again, without training.

    ``trials`` (new trials in this call) defaults to the number of configurations the space
    file expands to; ``batch`` to ``planner.max_adapters_per_job`` × the machine's slots.
    A ``list`` space's configs, and ``enqueue``'s, are tried first whatever the sampler.
    Re-running on the same storage continues the study.
    """
    from plora.engine.local import default_slots

    run_dir = spec.run_dir(run_dir)
    slots = list(slots or default_slots(spec.hardware.device))
    n_trials = tune_trials(spec, trials)
    size = int(batch) if batch is not None else min(n_trials, spec.planner.max_adapters_per_job * len(slots))
    if size < 1:
        raise TuneError(f"batch must be >= 1, got {size}")
    smp = make_sampler(sampler, spec, seed=seed, n_startup_trials=size if n_startup_trials is None else n_startup_trials)
    prn = make_pruner(pruner)
    if not isinstance(prn, optuna.pruners.NopPruner) and not spec.eval.every_steps:
        raise TuneError("pruning needs intermediate eval losses: set eval.every_steps in the space file")
    n_train = dataset_size(spec)  # bad data is refused before the study or the run directory exists
    study = open_study(spec, run_dir, sampler=smp, pruner=prn)
    if spec.space.strategy == "list":
        enqueue_configs(study, spec, [c.model_dump() for c in spec.space.configs or []])
    if enqueue is not None:
        enqueue_configs(study, spec, enqueue)

    space = search_space(spec)
    state = _RunState.load(spec, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.yaml").write_text(spec.to_yaml())
    sign = intermediate_sign(spec)

    asked = 0
    while asked < n_trials:
        t0 = time.time()
        b = state.next_batch()
        k = min(size, n_trials - asked)
        batch_trials: list[optuna.Trial] = []
        asked += k
        try:
            with _quiet_optuna():
                for _ in range(k):
                    batch_trials.append(study.ask(space))
            cfg_of = {t.number: config_from_params(spec, t.params) for t in batch_trials}
            by_adapter: dict[str, list[optuna.Trial]] = {}
            for t in batch_trials:
                t.set_user_attr("adapter_id", cfg_of[t.number].id)  # visible while it trains
                t.set_user_attr("batch", b)
                by_adapter.setdefault(cfg_of[t.number].id, []).append(t)
            unique = {a: cfg_of[ts[0].number] for a, ts in by_adapter.items()}
            reused = [a for a in unique if _finished_status(run_dir, a) is not None]
            new = [c for a, c in unique.items() if a not in reused]
            for a in reused:  # an adapter of an earlier batch, run or sweep: keep it in the tables
                if a not in state.configs:
                    state.add([unique[a]], {a: spec.steps_for(unique[a], n_train)}, [])
            watcher = _PruneWatcher(by_adapter, sign, can_prune=True)
            jobs: list[PlannedJob] = []
            if new:
                steps = {c.id: spec.steps_for(c, n_train) for c in new}
                plan = plan_jobs(spec, new, steps)
                jobs = [dataclasses.replace(j, job_id=f"b{b:02d}-{j.job_id}") for j in plan.jobs]
                state.add(new, steps, jobs)
                state.batches.append({"batch": b, "trials": [t.number for t in batch_trials],
                                      "jobs": [j.job_id for j in jobs], "grouping": plan.grouping, **plan.details})
                state.write()

                def tick(running: list, finished: list) -> None:
                    watcher(running, finished)
                    if on_tick is not None:
                        on_tick(running, finished)

                batch_prep = PreparedSweep(spec, run_dir, new, steps, SweepPlan(jobs, plan.grouping, plan.details))
                run_prepared(batch_prep, on_tick=tick, on_snapshot=on_snapshot, slots=slots)
                for job_dir in sorted((run_dir / "jobs").glob(f"b{b:02d}-*")):
                    watcher.poll(job_dir, prune=False)  # evals written after the last tick: curves only
            else:
                state.write()
            frame = collect_results(state.prep())
            rows = {r["adapter_id"]: r for r in frame.to_dict("records")}
            tp_of = {a.id: j.tp for j in state.jobs for a in j.adapters}
            for t in batch_trials:
                cfg = cfg_of[t.number]
                _tell(study, spec, t, rows.get(cfg.id), cfg, tp_of.get(cfg.id), run_dir, b)
        except BaseException:
            with _quiet_optuna():
                for t in batch_trials:  # interrupted or broken: no trial stays RUNNING forever
                    with contextlib.suppress(Exception):
                        study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
            raise
        if on_batch is not None:
            numbers = {t.number for t in batch_trials}
            frozen = [t for t in study.get_trials(deepcopy=False) if t.number in numbers]
            on_batch(BatchReport(
                index=b, trials=frozen, trained=[c.id for c in new], reused=reused,
                pruned=[a for a in unique if rows.get(a, {}).get("status") == "pruned"], jobs=[j.job_id for j in jobs],
                wall_time_s=time.time() - t0, best=_best(study),
            ))
    return study


def _best(study: optuna.Study) -> FrozenTrial | None:
    try:
        return study.best_trial
    except ValueError:
        return None


