"""Every sweep is an Optuna study: storage, naming, directions, and recording a finished
sweep as one trial per adapter (params, objective, state, user attrs).

Intermediate values are the objective, scored on the intermediate eval slice where it is
not the loss (`plora.tuning.prune.intermediate_value`); evals that carry only the loss (a run
of an earlier version) report it signed to the study's direction: a study that maximizes
exact match receives ``-eval_loss``, so any Optuna pruner reads its direction for both.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
import pandas as pd
from optuna.trial import TrialState

from plora.spec.adapter import AdapterConfig
from plora.spec.schema import SweepSpec
from plora.tuning.base import TuneError, _quiet_optuna
from plora.tuning.budget import never_trained
from plora.tuning.prune import intermediate_value
from plora.tuning.space import params_of, search_space

if TYPE_CHECKING:
    from plora.planner.plan import Plan

#: Trial states of the adapter statuses in results.parquet.
STATE_OF_STATUS = {
    "done": TrialState.COMPLETE,
    "diverged": TrialState.FAIL,
    "failed": TrialState.FAIL,
    "pruned": TrialState.PRUNED,
}


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


def intermediate_name(spec: SweepSpec) -> str:
    """What a trial's intermediate values are: the objective (``eval_<objective>``)."""
    return f"eval_{spec.eval.objective}"


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
        study.set_user_attr("intermediate_value", intermediate_name(spec))
        study.set_user_attr("run_dir", str(spec.run_dir(run_dir)))
    return study


# --------------------------------------------------------------------------- the search space


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
    if _clean(row.get("epoch")) is not None:  # per-epoch scoring: the epoch whose weights it keeps
        attrs["epoch"] = int(row["epoch"])
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


def tell_trial(study: optuna.Study, spec: SweepSpec, trial: optuna.Trial, row: Mapping[str, Any] | None,
               cfg: AdapterConfig, tp: int | None, run_dir: Path, batch: int) -> None:
    """Tell a trial its adapter's result (a row of results.parquet; None: no result), with
    the user attrs every trial of a study carries and the tune's ``batch``."""
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


def read_evals(run_dir: Path, job_ids: Iterable[str] | None = None, sign: float | None = None
               ) -> dict[str, dict[int, float]]:
    """Intermediate eval losses per adapter: ``{adapter: {adapter_step: eval_loss}}``; with
    ``sign``, the values reported to trials instead (`intermediate_value`)."""
    jobs = (run_dir / "jobs" / j for j in job_ids) if job_ids is not None else (run_dir / "jobs").glob("*")
    out: dict[str, dict[int, float]] = {}
    for job_dir in jobs:
        path = job_dir / "evals.jsonl"
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                rec = json.loads(line)
                value = float(rec["eval_loss"]) if sign is None else intermediate_value(rec, sign)
                if value is not None:
                    out.setdefault(rec["adapter"], {})[int(rec["adapter_step"])] = value
    return out


def record_sweep(spec: SweepSpec, run_dir: Path, configs: Iterable[AdapterConfig], plan: Plan,
                 frame: pd.DataFrame) -> optuna.Study | None:
    """Write a finished sweep into its Optuna study, one trial per adapter.

    An adapter already in the study with the same status is skipped, and so is one whose
    trial is still running (a batch of :func:`run_tune`, which tells its own trials), so
    re-running a sweep adds only what changed. An adapter that never trained (no result) and
    already has a trial is skipped too: a tune told that trial why (its budget was spent
    first). Never raises: the results table matters more than the study, so a storage
    problem becomes a warning.
    """
    try:
        study = open_study(spec, run_dir)
        seen, tried = set(), set()
        for t in study.get_trials(deepcopy=False):
            a = t.user_attrs.get("adapter_id")
            tried.add(a)
            seen.add((a, t.user_attrs.get("status")))
            if t.state in (TrialState.RUNNING, TrialState.WAITING):
                seen.add((a, "*"))
        space = search_space(spec, include_seed=True)
        tp_of = {a: j.tp for j in plan.jobs for a in j.adapters}
        cfg_of = {c.id: c for c in configs}
        curves = read_evals(run_dir, sign=intermediate_sign(spec))
        new = []
        for row in frame.to_dict("records"):
            cfg = cfg_of.get(row["adapter_id"])
            if cfg is None or (cfg.id, row.get("status")) in seen or (cfg.id, "*") in seen:
                continue
            if cfg.id in tried and never_trained(row):
                continue
            state, value = _state_and_value(row, spec)
            params, dists = params_of(spec, cfg, space)
            new.append(optuna.trial.create_trial(
                state=state, value=value, params=params, distributions=dists,
                user_attrs=_user_attrs(row, cfg, tp_of.get(cfg.id), run_dir),
                intermediate_values=dict(curves.get(cfg.id, {})),
            ))
        with _quiet_optuna():
            study.add_trials(new)
        return study
    except Exception as e:  # noqa: BLE001 - see the docstring
        warnings.warn(f"Optuna study not updated ({type(e).__name__}: {e}); results.parquet is complete",
                      RuntimeWarning, stacklevel=2)
        return None
