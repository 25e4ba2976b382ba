"""``plora tune``: ask a batch of trials from any sampler, train them packed, tell, repeat."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from plora.cost.model import CostModel
from plora.planner.plan import Job
from plora.spec.adapter import TRAINING_DIMS, AdapterConfig
from plora.spec.schema import SweepSpec
from plora.spec.space import Range
from plora.sweep import PreparedSweep, SweepRows, collect_results, dataset_size, decide_rows, plan_jobs, run_prepared
from plora.tuning.base import TuneError, _quiet_optuna
from plora.tuning.budget import BUDGET_LEFT_SHORT, BUDGET_SPENT, Budget, TuneHistory, never_trained, strategy_name
from plora.tuning.pace import Pace
from plora.tuning.fidelity import Rungs
from plora.tuning.prune import _finished_status, _PruneWatcher
from plora.tuning.run_state import RunState
from plora.tuning.samplers import Startup, make_pruner, make_sampler
from plora.tuning.space import config_from_params, enqueue_configs, search_space
from plora.tuning.study import intermediate_sign, open_study, tell_trial


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
    #: a whole asynchronous run (``plora tune --async``), which has no batches
    asynchronous: bool = False


def tune_trials(spec: SweepSpec, trials: int | None) -> int:
    """Trials a tune runs: ``trials``, else the number of configurations the space expands to
    (which a grid with a range that has no ``num`` does not have: then ``trials`` is needed)."""
    if trials is None:
        unspaced = [n for n in ("rank", "alpha", "learning_rate", "batch_size", *spec.space.searched())
                    if isinstance(getattr(spec.space, n), Range) and getattr(spec.space, n).num is None]
        if spec.space.strategy == "grid" and unspaced:
            raise TuneError(f"--trials is required: space.{unspaced[0]} is a range without num, so the space has "
                            "no number of configurations")
        return len({(c.rank, c.alpha, c.learning_rate, c.batch_size, *(getattr(c, n) for n in TRAINING_DIMS))
                    for c in spec.expand()})
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
    make_pruner(pruner)



def tune_rows(spec: SweepSpec, n_train: int, run_dir: Path) -> SweepRows:
    """What every job of a tune is given of its rows: what a sweep of the same space decides
    (`plora.sweep.decide_rows`), so that a configuration a tune trains sees the rows, in the
    order, a sweep's would. (On a GPU the two differed: a tune's jobs left ``row_layout:
    auto`` to each job, which ordered the rows in length buckets where the sweep's came in
    balanced batches, and scored lower: 65 against 81 % on the verdict task.) Decided from
    the space's configurations (a space that lists none: one per batch size), or kept from
    the jobs of ``run_dir`` when it has some."""
    from plora.hardware import hardware_for

    configs = spec.expand() or [
        spec.make_config(int(spec.space.values("rank")[0]), 1.0, 1e-3, int(bs), 0)
        for bs in spec.space.values("batch_size")]
    steps = {c.id: spec.steps_for(c, n_train) for c in configs}
    return decide_rows(spec, configs, steps, hardware_for(spec), run_dir)


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
    asynchronous: bool = False,
    on_trial: Callable[[FrozenTrial], None] | None = None,
    cost_model: CostModel | None = None,
    budget: Budget | None = None,
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

    ``asynchronous`` (``plora tune --async``): no batches; ``batch`` trials train at once
    in one long-lived job per slot, and each trial is told the moment its adapter finishes
    or is pruned, the next one asked and sent into the slot it freed
    (`plora.tuning.asynchronous`); ``on_trial`` gets each trial as it is told, and
    ``on_batch`` the whole run as one batch at its end.

    ``cost_model``: what the batches are planned with and, with ``asynchronous``, what says
    whether a trial fits a running job's memory (default: the sweep's, `plora.sweep`).

    The pruner's resource is the share of its budget an adapter has seen, scored at rungs
    of fixed fractions (`plora.tuning.fidelity`, ``optuna.pruner`` in the space file).
    ``budget`` (default: ``optuna.budget_gpu_seconds`` and ``optuna.on_budget``): once the
    tune's jobs have spent it (`plora.tuning.budget`), no trial is asked; running ones
    finish, or are pruned with ``on_budget: stop``. Every trial told is appended to the
    run directory's tune_history.csv (GPU-seconds spent, best so far); tune.json says the
    budget and what was spent.
    """
    from plora.engine.local import default_slots

    run_dir = spec.run_dir(run_dir)
    slots = list(slots or default_slots(spec.hardware.device))
    n_trials = tune_trials(spec, trials)
    size = int(batch) if batch is not None else min(n_trials, spec.planner.max_adapters_per_job * len(slots))
    if size < 1:
        raise TuneError(f"batch must be >= 1, got {size}")
    startup = size if n_startup_trials is None else n_startup_trials
    smp = make_sampler(sampler, spec, seed=seed, n_startup_trials=startup)
    rungs = Rungs.of(spec)
    prn = make_pruner(pruner, rungs)
    scored_at = None if isinstance(prn, optuna.pruners.NopPruner) else rungs  # eval points at the rungs
    if budget is None:
        budget = Budget(spec.optuna.budget_gpu_seconds, spec.optuna.on_budget)
    n_train = dataset_size(spec)  # bad data is refused before the study or the run directory exists
    study = open_study(spec, run_dir, sampler=smp, pruner=prn)
    if spec.space.strategy == "list":
        enqueue_configs(study, spec, [c.model_dump() for c in spec.space.configs or []])
    if enqueue is not None:
        enqueue_configs(study, spec, enqueue)

    space = search_space(spec)
    state = RunState.load(spec, run_dir)
    job_rows = tune_rows(spec, n_train, run_dir)
    if cost_model is None:  # priced on the rows as the jobs get them, as a sweep's model is
        from plora.cost.sweep_model import sweep_cost_model

        cost_model = sweep_cost_model(job_rows.spec, run_dir, length_buckets=job_rows.length_buckets,
                                      row_lengths=job_rows.lengths, row_layout=job_rows.layout)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "spec.yaml").write_text(spec.to_yaml())
    sign = intermediate_sign(spec)
    history = TuneHistory(run_dir, strategy_name(sampler, pruner, asynchronous), budget, spec.eval.minimize)
    if asynchronous:
        from plora.tuning.asynchronous import tune_async

        t0 = time.time()
        trials_run, jobs, _ = tune_async(spec, study, space, state, n_trials=n_trials, in_flight=size, slots=slots,
                                         sign=sign, n_train=n_train, on_trial=on_trial, on_tick=on_tick,
                                         on_snapshot=on_snapshot, cost_model=cost_model, rungs=rungs,
                                         scored_at=scored_at, budget=budget, history=history, rows=job_rows,
                                         startup=_startup_of(smp, startup, seed if seed is not None else spec.space.seed))
        history.write_summary(run_dir, len(trials_run))
        if on_batch is not None and trials_run:
            numbers = {t.number for t in trials_run}
            frozen = [t for t in study.get_trials(deepcopy=False) if t.number in numbers]
            trained = sorted({a for j in state.jobs if j.id in jobs for a in j.adapters})
            on_batch(BatchReport(
                index=int(frozen[0].user_attrs.get("batch", 0)), trials=frozen, trained=trained,
                reused=sorted({str(t.user_attrs.get("adapter_id")) for t in frozen} - set(trained)),
                pruned=[a for a in trained if any(t.user_attrs.get("adapter_id") == a and t.state == TrialState.PRUNED
                                                  for t in frozen)],
                jobs=jobs, wall_time_s=time.time() - t0, best=_best(study), asynchronous=True))
        return study

    asked = 0
    told_before = len(study.get_trials(deepcopy=False))
    pace = Pace()  # the batches' GPU-seconds against their plans' (`plora.tuning.pace`)
    started = False
    while asked < n_trials and not budget.exhausted:
        t0 = time.time()
        b = state.next_batch()
        k = min(size, n_trials - asked)
        batch_trials: list[optuna.Trial] = []
        asked += k
        short = False  # a batch that could not end within the budget left (on_budget: stop)
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
            watcher = _PruneWatcher(by_adapter, sign, can_prune=True, rungs=rungs, totals=state.steps)
            jobs: list[Job] = []
            if new:
                steps = {c.id: spec.steps_for(c, n_train) for c in new}
                plan = plan_jobs(job_rows.spec, new, steps, cost_model)
                predicted = plan_gpu_seconds(plan)
                short = started and not batch_fits(budget, predicted, pace.factor)
            if short:  # it could not train to its end within the budget left: it does not start
                state.add(new, steps, [])
                state.write()
            elif new:
                started = True
                jobs = [dataclasses.replace(j, id=f"b{b:02d}-{j.id}") for j in plan.jobs]
                plan = dataclasses.replace(plan, jobs=jobs)
                state.add(new, steps, jobs)
                state.add_batch(b, [t.number for t in batch_trials], plan)
                state.write()

                def tick(running: list, finished: list) -> None:
                    budget.observe(running, finished)
                    watcher(running, finished)
                    if on_tick is not None:
                        on_tick(running, finished)

                spent_before = budget.spent
                # no re-planning: a re-planned job's id (r1-job-000) would be taken again by the next batch's
                run_prepared(PreparedSweep(job_rows.spec, run_dir, new, steps, plan, rungs=scored_at,
                                           row_layout=job_rows.layout, length_buckets=job_rows.length_buckets), on_tick=tick,
                             on_snapshot=on_snapshot, slots=slots, replan=False,
                             stop=(lambda: budget.on_budget if budget.exhausted else None)
                             if budget.gpu_seconds is not None else None)
                for job_dir in sorted((run_dir / "jobs").glob(f"b{b:02d}-*")):
                    watcher.poll(job_dir, prune=False)  # evals written after the last tick: curves only
                if not budget.exhausted:  # a batch the budget cut short says nothing of its pace
                    pace.add(budget.spent - spent_before, predicted)
            else:
                state.write()
            frame = collect_results(state.prep())
            rows = {r["adapter_id"]: r for r in frame.to_dict("records")}
            tp_of = {a: j.tp for j in state.jobs for a in j.adapters}
            for t in batch_trials:
                cfg = cfg_of[t.number]
                row = rows.get(cfg.id)
                if budget.exhausted and never_trained(row):
                    row = BUDGET_SPENT  # its job never started: the budget was spent before
                elif short and never_trained(row):
                    row = BUDGET_LEFT_SHORT
                tell_trial(study, spec, t, row, cfg, tp_of.get(cfg.id), run_dir, b)
                history.record(study.get_trials(deepcopy=False)[t.number])
        except BaseException:
            with _quiet_optuna():
                for t in batch_trials:  # interrupted or broken: no trial stays RUNNING forever
                    with contextlib.suppress(Exception):
                        study.tell(t, state=TrialState.FAIL, skip_if_finished=True)
            raise
        if short:
            break
        if on_batch is not None:
            numbers = {t.number for t in batch_trials}
            frozen = [t for t in study.get_trials(deepcopy=False) if t.number in numbers]
            on_batch(BatchReport(
                index=b, trials=frozen, trained=[c.id for c in new], reused=reused,
                pruned=[a for a in unique if rows.get(a, {}).get("status") == "pruned"], jobs=[j.id for j in jobs],
                wall_time_s=time.time() - t0, best=_best(study),
            ))
    history.write_summary(run_dir, len(study.get_trials(deepcopy=False)) - told_before)
    return study


def plan_gpu_seconds(plan: Any) -> float:
    """GPU-seconds a batch's plan predicts: each job's predicted span times its GPUs."""
    return sum(j.tp * max(0.0, (j.end or 0.0) - (j.start or 0.0)) for j in plan.jobs)


def batch_fits(budget: Budget, predicted: float, pace: float) -> bool:
    """Under ``on_budget: stop``, whether a batch predicted to take ``predicted`` GPU-seconds
    (scaled by the earlier batches' measured ``pace``) ends within the budget left; a batch
    that would not is pruned by the budget, and its GPU-seconds spent for nothing. Always
    true otherwise (``finish`` lets a started batch end)."""
    return predicted <= 0 or budget.ends_within(predicted * pace)


def _startup_of(sampler: optuna.samplers.BaseSampler, n: int, seed: int) -> Startup | None:
    """What keeps a model-based sampler exploring until ``n`` trials are *told* (None: a
    sampler without a model, or no start-up)."""
    model = (optuna.samplers.TPESampler, optuna.samplers.GPSampler, optuna.samplers.CmaEsSampler)
    return Startup(optuna.samplers.RandomSampler(seed=seed), n) if isinstance(sampler, model) and n > 0 else None


def _best(study: optuna.Study) -> FrozenTrial | None:
    try:
        return study.best_trial
    except ValueError:
        return None
