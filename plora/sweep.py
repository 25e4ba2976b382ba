"""A sweep from a validated spec: expand, group into packed jobs, run them, collect results.

Every stage leaves a file in the run directory (spec.yaml, configs.parquet, plan.json,
jobs/<id>/job.yaml, adapters/<id>/…, results.parquet), so a person can open each one and
each stage can be re-run on its own. This module is the library behind `plora sweep`; the
CLI only renders what it returns.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from plora.data.accumulation import micro_rows
from plora.data.check import DataReport, check_data
from plora.engine.streaming import StreamPolicy
from plora.job.config import JobAdapter, JobStreaming
from plora.cost.profiling.calibrate import CALIBRATED_SOURCE
from plora.cost.sweep_model import (
    ANALYTIC_SOURCE,
    CALIBRATED_SOURCE_NOW,
    cost_model_for,
    graphed_steps,
    priced_for_sweep,
    recalibrated,
    sweep_models,
    targets_cost_model,
    within_node,
)
from plora.hardware import Hardware, hardware_for, sweep_on_gpu
from plora.job.from_spec import check_target_sets, job_adapter, job_config
from plora.results.collect import has_eval_data, write_results, write_unmeasured_base_metrics
from plora.spec.adapter import AdapterConfig
from plora.spec.schema import SweepSpec

if TYPE_CHECKING:  # the planner (and its solvers) is imported where a sweep plans
    from plora.cost.model import AdapterLoad, CostModel
    from plora.cost.profiling.calibrate import Calibration, SweepCalibrator
    from plora.planner.plan import Job, Plan
    from plora.tuning.fidelity import Rungs  # Optuna is imported where a tune runs


def dataset_size(spec: SweepSpec) -> int:
    """Training examples the adapters' epoch budgets are counted in (rows checked first)."""
    return check_data(spec).num_train


def plan_jobs(
    spec: SweepSpec,
    configs: Sequence[AdapterConfig],
    steps: dict[str, int],
    cost_model: CostModel | None = None,
    hardware: Hardware | None = None,
) -> Plan:
    """Group adapters into jobs with the DTM planner on the sweep's cost model; the jobs
    are named ``job-000``, ``job-001``, … in launch order.

    `hardware` defaults to this machine's; `cost_model` to what `cost_model_for` finds
    without probing (a profile from the cache, else the analytic prior). Adapters of
    different target sets never share a job (a job adapts one set of layers): each set is
    planned on its own, priced for its layers (`targets_cost_model`), and the plans run one
    after the other. Without ``training.micro_batch_size``, an adapter whose batch does not
    fit one pass on a GPU trains over the micro-batch the planner chooses
    (`plora.planner.micro_batch`; the plan's ``micro_batches`` and a note say which).
    """
    from plora.planner import PLANNING_BUDGET_S
    from plora.planner.micro_batch import accumulation_note

    hw = hardware or hardware_for(spec)
    if cost_model is None:
        cost_model, source = cost_model_for(spec, None, probe=False, hardware=hw)
    else:
        source = cost_model.meta.get("plan_source", cost_model.name or "a given cost model")
    plan, chosen = plan_target_sets(spec, configs, steps, cost_model, hw, hw.max_tp, hw.slots, PLANNING_BUDGET_S)
    grouping = (f"planned ({plan.strategy}, {plan.objective} objective, solver {plan.solver}) for "
                f"{hw.describe()} with {source}")
    notes = plan.notes
    if chosen:
        notes = [*notes, accumulation_note({c.id: c.batch_size for c in configs}, chosen)]
    return replace(plan, jobs=[replace(j, id=f"job-{i:03d}") for i, j in enumerate(plan.jobs)], grouping=grouping,
                   hardware=hw.describe(), cost_model_source=source, micro_batches=chosen, notes=notes)


def plan_target_sets(spec: SweepSpec, configs: Sequence[AdapterConfig], steps: Mapping[str, int],
                     cost_model: CostModel, hw: Hardware, max_tp: int | None, gpus: int,
                     time_limit_s: float) -> tuple[Plan, dict[str, int]]:
    """The plan of ``configs`` and the micro-batches the planner chose for them. Each target
    set is planned on its own (a job adapts one set of layers), on ``cost_model`` for the
    sweep's set and priced for its own layers otherwise (`targets_cost_model`), within
    ``max_tp``; the plans run one after the other, sharing ``time_limit_s``. Without
    ``training.micro_batch_size``, an adapter whose batch does not fit one pass trains over
    the micro-batch `plora.planner.micro_batch` chooses on that model."""
    from plora.planner.micro_batch import micro_batches_for

    sets = spec.target_sets(configs)
    sweep_set = spec.sweep_values()["targets"]
    plans = []
    chosen: dict[str, int] = {}
    for targets in sets:
        group = [c for c in configs if (c.targets or sweep_set) == targets]
        model = cost_model if targets == sweep_set else targets_cost_model(spec, targets, hw)
        model = within_node(model, max_tp)
        micro: int | None | dict[str, int] = micro_batch_size_of(spec)
        if micro is None:  # the planner's micro-batch where a batch does not fit one pass
            micro = micro_batches_for(sweep_loads(group, steps), model, spec.planner.memory_load_factor)
            chosen.update(micro)
            if micro:  # a job that accumulates captures nothing ahead: it scores in line
                model = model.scored_in_line()
        plans.append(planned(spec, sweep_loads(group, steps, micro), model, gpus, time_limit_s / len(sets)))
    return (plans[0] if len(plans) == 1 else one_after_another(plans, sets)), chosen


def planned(spec: SweepSpec, loads: Sequence[AdapterLoad], cost_model: CostModel, gpus: int, time_limit_s: float) -> Plan:
    """The sweep's plan for ``loads``: the packed planner's, or the baseline the space asks
    for (``planner.baseline``), on ``cost_model`` and ``gpus``."""
    from plora.planner import baseline_plan, plan_sweep

    p = spec.planner
    if p.baseline is not None:
        return baseline_plan(list(loads), cost_model, gpus, p.baseline, load_factor=p.memory_load_factor)
    return plan_sweep(list(loads), cost_model, gpus, solver=p.solver, load_factor=p.memory_load_factor,
                      max_adapters_per_job=p.max_adapters_per_job, objective=p.objective, time_limit_s=time_limit_s)


def one_after_another(plans: Sequence[Plan], names: Sequence[str]) -> Plan:
    """Plans of disjoint adapter groups as one queue: each starts where the one before ends
    (the engine starts a job as soon as a slot is free, so groups overlap at their seams;
    the predicted makespan is an upper bound)."""
    jobs, offset = [], 0.0
    for p in plans:
        for j in p.jobs:
            jobs.append(replace(j, start=None if j.start is None else j.start + offset,
                                end=None if j.end is None else j.end + offset))
        offset += p.makespan
    first = plans[0]
    baselines = {k: sum(p.baselines.get(k, 0.0) for p in plans) for k in first.baselines}
    notes = [f"{len(plans)} target sets ({'; '.join(names)}) planned apart: adapters of different sets never "
             "share a job", *(n for p in plans for n in p.notes)]
    return replace(first, jobs=jobs, adapters=[a for p in plans for a in p.adapters], makespan=offset,
                   lower_bound=max(p.lower_bound for p in plans), baselines=baselines,
                   packed_makespan=sum(p.packed_makespan for p in plans),
                   planning_seconds=sum(p.planning_seconds for p in plans), notes=notes,
                   optimal=False, strategy="+".join(dict.fromkeys(p.strategy for p in plans)))


@dataclass
class PreparedSweep:
    spec: SweepSpec
    run_dir: Path
    configs: list[AdapterConfig]
    steps: dict[str, int]
    plan: Plan
    cost_model: CostModel | None = None
    hardware: Hardware | None = None
    data: DataReport | None = None  # rows checked, cut or dropped (notes for the user)
    #: every job's streaming section, for a caller that sends joins itself (None: job_config's default)
    streaming: JobStreaming | None = None
    #: ``training.length_buckets`` as every job of the sweep gets it (`plora.cost.sweep_rows.sweep_length_buckets`)
    length_buckets: int | str = "auto"
    #: ``training.row_layout`` as every job of the sweep gets it (`plora.cost.sweep_rows.sweep_row_layout`)
    row_layout: str = "auto"
    #: what measurements correct while the sweep runs (the priced analytic prior, or a profile)
    #: and the measurements so far (`plora.cost.profiling.calibrate`); None: the cost model as it is
    prior: CostModel | None = None
    calibration: Calibration | None = None
    #: a tune's pruner's rungs: every adapter is scored at them (`plora.tuning.fidelity`)
    rungs: Rungs | None = None
    #: when each stage of `prepare` ended (``time.time()``): where a sweep's start went
    moments: dict[str, float] = field(default_factory=dict)


def stream_policy(prep: PreparedSweep) -> StreamPolicy:
    """How the engine sends adapters into running jobs (``planner.streaming``): each as its
    job config would list it, while the pack stays within ``max_adapters_per_job`` and,
    with a cost model, within the planner's share of GPU memory; the cost model also times
    the packs for the choice (`plora.engine.join_choice`)."""
    from plora.engine.join_choice import pack_fits

    spec, by_id = prep.spec, {c.id: c for c in prep.configs}

    def entry(adapter_id: str) -> JobAdapter:
        return job_adapter(spec, by_id[adapter_id], prep.steps[adapter_id], prep.rungs,
                           micro_batch_size=prep.plan.micro_batches.get(adapter_id))

    def fits(loads: Sequence[AdapterLoad], tp: int) -> bool:
        return pack_fits(loads, tp, prep.cost_model, max_adapters=spec.planner.max_adapters_per_job,
                         load_factor=spec.planner.memory_load_factor)

    sweep_set = spec.sweep_values()["targets"]

    def targets(adapter_id: str) -> str:
        return by_id[adapter_id].targets or sweep_set

    several = len(spec.target_sets(prep.configs)) > 1
    return StreamPolicy(entry, fits, prep.cost_model, targets if several else None,
                        micro_batch_size=micro_batch_size_of(spec))


def prepare(spec: SweepSpec, run_dir: Path | None = None, *, probe: bool = False,
            hardware: Hardware | None = None, cost_model: CostModel | None = None,
            log: Callable[[str], None] | None = None, fresh: bool = False,
            check_model: bool | Callable[[], None] = True,
            on_rows: Callable[[SweepSpec, Sequence[AdapterConfig], SweepRows, Hardware], None] | None = None,
            on_cost_model: Callable[[], None] | None = None,
            ) -> PreparedSweep:
    """Everything a sweep decides before training: configurations, step budgets, the plan.

    Writes nothing to the run directory (a quick calibration goes to plora's cache). On a GPU
    of this machine with nothing measured of the model yet, the plan counts the analytic
    prior's memory per adapter `MEMORY_MARGIN` times; where that margin alone would keep the
    largest pack the sweep may form off the GPU, `probe` lets it first measure two short packs
    (`plora.cost.profiling.profile.quick_calibration`, a few seconds, reported through ``log``) and
    plan on them. The sweep's own jobs calibrate the model further while they run. ``fresh``:
    the run directory is started over, its profile.json is not this sweep's. ``on_rows``: told
    the rows once they are decided, before the cost model and the plan (what a first job
    will step: `plora.engine.kernel_warmer`). ``on_cost_model``: called once the cost model is
    decided, when nothing more is measured on the GPU before the plan (the first job's model
    may be loaded there from then on). ``check_model``:
    True, the model is checked first; a callable, the caller checks it meanwhile
    (`plora.models.check.start_spec_model_check`) and this waits for it before a quick
    calibration measures anything; False, the caller checks it.
    """
    from plora.models.check import check_spec_model

    if check_model is True:
        check_spec_model(spec)  # a broken model folder is refused before any planning
    moments: dict[str, float] = {"prepare_began_at": time.time()}
    configs = spec.expand()
    check_target_sets(spec, configs)
    moments["configs_expanded_at"] = time.time()
    data = check_data(spec)  # bad data is refused here, before anything is written
    n_train = data.num_train
    moments["data_checked_at"] = time.time()
    steps = {c.id: spec.steps_for(c, n_train) for c in configs}
    run = spec.run_dir(run_dir)
    hw = hardware or hardware_for(spec)
    rows = replace(decide_rows(spec, configs, steps, hw, None if fresh else run), data=data)
    spec, layout, buckets, lengths = rows.spec, rows.layout, rows.length_buckets, rows.lengths
    moments["rows_decided_at"] = time.time()
    if on_rows is not None:
        on_rows(spec, configs, rows, hw)
    prior = calibration = None
    if cost_model is None:
        models = sweep_models(spec, None if fresh else run, hardware=hw, length_buckets=buckets, row_lengths=lengths,
                              row_layout=layout, loads=sweep_loads(configs, steps, micro_batch_size_of(spec)))
        cost_model, prior, calibration = models.model, models.prior, models.calibration
        if probe and hw.gpu and hw.local and models.source == ANALYTIC_SOURCE:
            # no probe of a model that the check refuses; where nothing is probed, planning
            # goes on while the check runs (the caller waits for it before any job starts)
            cost_model, calibration = calibrate_first(spec, configs, steps, prior, cost_model, hw, log,
                                                      before_measuring=check_model if callable(check_model) else None)
    else:
        cost_model = priced_for_sweep(spec, cost_model, hw, buckets, lengths, layout)
    moments["cost_model_at"] = time.time()
    if on_cost_model is not None:
        on_cost_model()
    plan = plan_jobs(spec, configs, steps, cost_model, hw)
    if plan.micro_batches:  # its accumulating jobs score in line (as `plan_target_sets` priced them)
        cost_model = cost_model.scored_in_line()
    moments["jobs_planned_at"] = time.time()
    prep = PreparedSweep(spec, run, configs, steps, plan, cost_model, hw, data, length_buckets=buckets,
                         row_layout=layout, prior=prior, calibration=calibration, moments=moments)
    prep.plan = replace(plan, streamed_makespan=streamed_forecast(prep) or 0.0)
    return prep


def streamed_forecast(prep: PreparedSweep) -> float | None:
    """The plan's makespan as the engine will run it, streaming queued adapters into running
    jobs (`plora.engine.stream_forecast`); None where the sweep does not stream or the plan
    made no prediction. Never raises: a forecast that fails leaves the plan's own."""
    spec, plan = prep.spec, prep.plan
    if prep.cost_model is None or plan.makespan <= 0 or not spec.planner.streams(sweep_on_gpu(spec, prep.hardware)):
        return None
    from plora.engine.join_choice import JOIN_TP
    from plora.engine.stream_forecast import streamed_makespan

    try:
        policy = stream_policy(prep)
        return streamed_makespan(plan, prep.cost_model, [policy.load(c.id) for c in prep.configs],
                                 lambda loads: policy.fits(loads, JOIN_TP), targets=policy.targets)
    except Exception:  # noqa: BLE001 - the plan's own makespan stands
        return None


@dataclass(frozen=True)
class SweepRows:
    """What a sweep decides once for every job it runs, from its space: whether activation
    checkpointing is on (``auto`` resolved, `resolve_checkpointing`), and how rows are laid
    out and ordered (``training.row_layout`` and ``training.length_buckets`` resolved,
    `plora.cost.sweep_rows`). An adapter's row order follows from these, its own seed and
    batch size, and the data: never from which adapters share its job, nor from whether a
    sweep or a tune trains it (a tune decides from its space as a sweep of it would)."""

    spec: SweepSpec  # activation_checkpointing decided: the jobs, the cost model and spec.yaml see on/off
    layout: str
    length_buckets: int | str
    #: the training rows' token counts, where a decision needed them (None: not tokenized)
    lengths: list[int] | None = None
    #: what the data check found: among it the eval rows each adapter is scored on (what the
    #: first job's evals will launch, `plora.engine.kernel_warmer`); None where not told
    data: DataReport | None = None


def decide_rows(spec: SweepSpec, configs: Sequence[AdapterConfig], steps: Mapping[str, int], hw: Hardware,
                run_dir: Path | None = None) -> SweepRows:
    """`SweepRows` of a sweep of ``configs`` on ``hw``. ``run_dir``: where a sweep or tune
    of these adapters ran before; its jobs' layout is kept (their checkpoints hold the row
    order), None: decided anew."""
    from plora.cost.sweep_rows import sweep_length_buckets, sweep_row_layout, train_row_lengths

    spec = resolve_checkpointing(spec, configs, steps, hw)
    graphed = graphed_steps(spec, hw)
    # tokenized once here for all three: the layout, the bucket count and the rows' price
    wanted = graphed and (spec.training.length_buckets == "auto" or spec.training.row_layout == "auto")
    lengths = train_row_lengths(spec) if wanted else None
    before = resolved_layout(run_dir) if run_dir is not None else None
    if before is not None:
        layout, buckets = before
    else:
        micro = micro_batch_size_of(spec)
        layout = sweep_row_layout(spec, graphed=graphed, lengths=lengths,
                                  batch_sizes=[micro_rows(c.batch_size, micro) for c in configs])
        buckets = sweep_length_buckets(spec, steps, graphed=graphed, lengths=lengths, row_layout=layout)
    return SweepRows(spec, layout, buckets, lengths)


def resolve_checkpointing(spec: SweepSpec, configs: Sequence[AdapterConfig], steps: Mapping[str, int],
                          hw: Hardware) -> SweepSpec:
    """The spec with ``training.activation_checkpointing: auto`` decided for this sweep:
    on where some adapter fits no GPU without it, even alone in a job at its smallest
    micro-batch (the user's ``training.micro_batch_size``, else one row: the planner may
    split any batch, `plora.planner.micro_batch`), and fits with it, on the analytic memory
    model at ``model.max_seq_len`` rows; off otherwise (a slower step buys nothing, and on
    the CPU memory is not what limits). A spec of true or false is returned as it is."""
    t = spec.training
    if t.activation_checkpointing != "auto":
        return spec

    def with_(on: bool) -> SweepSpec:
        return spec.model_copy(update={"training": t.model_copy(update={"activation_checkpointing": on})})

    if not hw.gpu:
        return with_(False)
    from plora.cost.model import packed_load
    from plora.cost.sweep_model import analytic_prior

    lf = spec.planner.memory_load_factor
    smallest = t.micro_batch_size or 1

    def placeable(on: bool) -> list[bool]:
        model = within_node(analytic_prior(with_(on), hw), hw.max_tp)
        loads = [packed_load(c.id, c.rank, c.batch_size, steps[c.id], smallest) for c in configs]
        return [any(model.fits([a], d, lf) for d in model.degrees) for a in loads]

    off, on = placeable(False), placeable(True)
    return with_(any(b and not a for a, b in zip(off, on)))


def memory_notes(spec: SweepSpec, prep: PreparedSweep) -> list[str]:
    """What the sweep decided for memory that the user did not set, one line each: the
    adapters the planner made accumulate (and in how many parts), and activation
    checkpointing turned on by ``auto``. ``spec``: the space as the user gave it."""
    from plora.planner.micro_batch import ACCUMULATION_NOTE

    notes = [n for n in prep.plan.notes if n.startswith(ACCUMULATION_NOTE)]
    if spec.training.activation_checkpointing == "auto" and prep.spec.training.checkpointing:
        notes.append("activation checkpointing on (training.activation_checkpointing: auto): an adapter fits a GPU "
                     "only with it")
    return notes


def resolved_layout(run_dir: Path) -> tuple[str, int | str] | None:
    """The row layout and length-bucket count a sweep in ``run_dir`` resolved before (its jobs'
    job.yaml), or None where no job was written yet."""
    import yaml

    for path in sorted((run_dir / "jobs").glob("*/job.yaml")) if (run_dir / "jobs").is_dir() else []:
        try:
            training = yaml.safe_load(path.read_text()).get("training", {})
            return str(training["row_layout"]), training["length_buckets"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError, yaml.YAMLError):
            continue
    return None


def sweep_loads(configs: Sequence[AdapterConfig], steps: Mapping[str, int],
                micro_batch_size: int | Mapping[str, int] | None = None) -> list[AdapterLoad]:
    """What the planner knows of each of the sweep's adapters: its rows per packed step and
    its packed steps (an adapter accumulating over micro-batches: `plora.cost.model.packed_load`).
    ``micro_batch_size``: the sweep's, or each adapter's by id (absent: one pass)."""
    from plora.cost.model import packed_load

    def micro(adapter_id: str) -> int | None:
        if isinstance(micro_batch_size, Mapping):
            return micro_batch_size.get(adapter_id)
        return micro_batch_size

    return [packed_load(c.id, c.rank, c.batch_size, steps[c.id], micro(c.id)) for c in configs]


def micro_batch_size_of(spec: SweepSpec) -> int | None:
    """The sweep's ``training.micro_batch_size`` (None where a spec-like object has none)."""
    return getattr(getattr(spec, "training", None), "micro_batch_size", None)


def sweep_micro_batches(prep: PreparedSweep) -> int | dict[str, int] | None:
    """The micro-batches a prepared sweep's adapters train at: the user's
    ``training.micro_batch_size`` where set (it wins), else the planner's choice per adapter."""
    user = micro_batch_size_of(prep.spec)
    return user if user is not None else dict(prep.plan.micro_batches)


def adapter_micro_batch(prep: PreparedSweep, adapter_id: str) -> int | None:
    """One adapter's micro-batch in a prepared sweep (`sweep_micro_batches`; None: one pass)."""
    micro = sweep_micro_batches(prep)
    return micro.get(adapter_id) if isinstance(micro, dict) else micro


def largest_pack(spec: SweepSpec, configs: Sequence[AdapterConfig], steps: Mapping[str, int]) -> list[AdapterLoad]:
    """The heaviest pack the sweep may form: its `max_adapters_per_job` adapters of most rows
    and rank."""
    loads = sweep_loads(configs, steps, micro_batch_size_of(spec))
    loads.sort(key=lambda a: (a.batch_size, a.rank), reverse=True)
    return loads[: max(1, int(spec.planner.max_adapters_per_job))]


def may_measure_before_planning(spec: SweepSpec, run_dir: Path | None, hw: Hardware, *, probe: bool) -> bool:
    """Whether `prepare` (with ``probe``) may measure on this machine's GPU before it plans:
    a quick calibration (`calibrate_first`), where nothing measured of the model is at hand
    (no profile of it, in ``run_dir`` or cached, and no cached calibration). A sweep sure not
    to may load its first job's model on that GPU at once (`plora.engine.spare.preload`)."""
    from plora.cost.sweep_model import cached_calibration, profiled_model

    if not (probe and hw.gpu and hw.local):
        return False
    return (profiled_model(spec, run_dir, hw) is None and cached_calibration(spec, hw).empty
            and not fits_before_measuring(spec, hw))


def fits_before_measuring(spec: SweepSpec, hw: Hardware) -> bool:
    """Whether `calibrate_first` is sure to measure nothing, known before the data is checked:
    the sweep's largest pack fits one GPU on the conservative prior with every training row
    at ``max_seq_len``, padded (the most memory a row can take), its margin not cut. The
    conservative prior of the rows the data check finds counts each adapter no more (the
    same or a cut margin, on rows no longer), so it fits that pack too. On a machine's first
    use the sweep's imports alone take seconds before the data check (5.7 s on an H200), in
    which the first job's process loads its model instead of waiting for the cost model."""
    from plora.cost.profiling.calibrate import MEMORY_MARGIN, conservative
    from plora.cost.sweep_model import analytic_prior

    configs = spec.expand()
    steps = {c.id: 1 for c in configs}  # a pack's memory does not depend on its steps
    longest = [int(spec.model.max_seq_len)]
    prior = priced_for_sweep(spec, analytic_prior(spec, hw), hw, 1, longest, "padded")
    load_factor = spec.planner.memory_load_factor
    model = conservative(prior, loads=sweep_loads(configs, steps, micro_batch_size_of(spec)), load_factor=load_factor)
    return (float(model.meta.get("memory_margin", 0.0)) >= MEMORY_MARGIN
            and model.fits(largest_pack(spec, configs, steps), 1, load_factor))


def calibrate_first(spec: SweepSpec, configs: Sequence[AdapterConfig], steps: Mapping[str, int], prior: CostModel,
                    conservative_model: CostModel, hw: Hardware, log: Callable[[str], None] | None, *,
                    before_measuring: Callable[[], None] | None = None) -> tuple[CostModel, Calibration]:
    """The model to plan on before any job runs: the conservative prior where even then the
    sweep's largest pack fits one GPU (memory cannot decide the plan), else the prior
    corrected by a quick calibration (kept in plora's cache for the next sweep).
    ``before_measuring`` runs only where the calibration measures (the model check it must
    wait for: on a first use it waits for the first job's process to import, 10 s on an H200,
    which planning on the conservative prior need not)."""
    from plora.cost.profiling.cache import remember_calibration
    from plora.cost.profiling.calibrate import Calibration
    from plora.cost.profiling.profile import quick_calibration

    pack = largest_pack(spec, configs, steps)
    if conservative_model.fits(pack, 1, spec.planner.memory_load_factor):
        return conservative_model, Calibration()
    if before_measuring is not None:
        before_measuring()
    calibration = quick_calibration(spec, prior, pack, log=log)
    if calibration.empty:
        return conservative_model, calibration
    try:
        remember_calibration(spec, calibration)
    except OSError:
        pass
    model = calibration.apply(prior, loads=sweep_loads(configs, steps, micro_batch_size_of(spec)))
    return model.with_meta(plan_source=CALIBRATED_SOURCE_NOW), calibration


def write_plan(prep: PreparedSweep) -> Path:
    """plan.json: the plan (jobs with TP, GPUs, predicted start and end; baselines; lower
    bound; solver), as `plora.planner.plan.Plan` writes and reads it."""
    from plora.planner.plan import PLAN_FILE

    prep.run_dir.mkdir(parents=True, exist_ok=True)
    return prep.plan.save(prep.run_dir / PLAN_FILE)


def write_run_files(prep: PreparedSweep, *, restart: bool = False) -> None:
    """spec.yaml, configs.parquet, plan.json (and profile.json when one was measured).

    Each job's job.yaml is written by the engine when the job starts, with the adapters it
    still has to train (a resumed, retried or split job trains fewer than planned). A run
    directory that holds a sweep of another space is left as it is (`RunDirError`) unless
    ``restart`` starts it over."""
    from plora.engine.preflight import check_resumable

    run_dir = prep.run_dir
    if restart and run_dir.exists():
        shutil.rmtree(run_dir)
    check_resumable(run_dir, prep.spec, (c.id for c in prep.configs))
    (run_dir / "jobs").mkdir(parents=True, exist_ok=True)
    (run_dir / "adapters").mkdir(exist_ok=True)
    (run_dir / "spec.yaml").write_text(prep.spec.to_yaml())
    configs_frame(prep).to_parquet(run_dir / "configs.parquet", index=False)
    write_plan(prep)
    # a profile (not the analytic prior or a calibration of it: a resumed sweep finds those
    # in plora's cache with their samples, and goes on calibrating)
    measured = prep.cost_model is not None and prep.cost_model.meta.get("plan_source") not in (
        ANALYTIC_SOURCE, CALIBRATED_SOURCE, CALIBRATED_SOURCE_NOW)
    if measured and not (run_dir / "profile.json").is_file():
        prep.cost_model.save(run_dir / "profile.json")


def configs_frame(prep: PreparedSweep) -> pd.DataFrame:
    return pd.DataFrame([{**c.to_dict(), "steps": prep.steps[c.id]} for c in prep.configs])


def run_prepared(
    prep: PreparedSweep,
    *,
    on_tick: Callable[[list, list], None] | None = None,
    on_snapshot: Callable[[Any], None] | None = None,
    slots: list[str] | None = None,
    max_retries: int = 2,
    replan: bool = True,
    feed: Callable[[Any], None] | None = None,
    stop: Callable[[], str | None] | None = None,
) -> pd.DataFrame:
    """Run every adapter that has no result yet through the engine, then collect the table.

    On an existing run directory this resumes: finished adapters are kept, the rest are
    re-queued in their planned jobs. `on_tick(running, finished)` gets the job processes
    (e.g. to watch their files); `on_snapshot` gets the engine's state for a live view.
    With `replan` (and a cost model), jobs not started yet are planned again when finished
    jobs' times drift from the plan's predictions (jobs without predictions never drift).
    `feed(engine)` is called at each tick by a caller that adds adapters and jobs while
    the engine runs (appending to ``prep.configs`` and ``prep.steps`` first); the engine
    then streams nothing itself. ``stop()``, asked at each tick, winds the run down once it
    says ``finish`` (no job starts any more; running ones end as planned) or ``stop`` (their
    adapters are pruned too).
    """
    from plora.engine.backends import backend_for
    from plora.engine.journal import Journal
    from plora.engine.local import default_slots
    from plora.engine.runner import Drift, Engine
    from plora.tracking.forward import Tracker

    if slots is None:
        slots = prep.hardware.slot_names() if prep.hardware else default_slots(prep.spec.hardware.device)
    backend = backend_for(prep.spec, prep.run_dir, slots)  # Ray: checks the run directory from every node
    slots = backend.slots
    by_id = {c.id: c for c in prep.configs}
    if not has_eval_data(prep.spec) and not (prep.run_dir / "base_metrics.json").is_file():
        write_unmeasured_base_metrics(prep.spec, prep.run_dir)  # no job evaluates the base model on nothing
    journal = Journal(prep.run_dir / "journal.sqlite")
    journal.add_adapters(by_id)
    tracker = Tracker.for_spec(prep.spec, prep.run_dir)  # TensorBoard, W&B: each adapter as it finishes
    first_job = prep.plan.jobs[0].id if prep.plan.jobs else None

    def write_job(job: Job) -> Path:
        by_id.update((c.id, c) for c in prep.configs if c.id not in by_id)  # a feed's adapters
        job_dir = prep.run_dir / "jobs" / job.id
        job_dir.mkdir(parents=True, exist_ok=True)
        eval_base = job.id == first_job and not (prep.run_dir / "base_metrics.json").is_file()
        job_config(prep.spec, job, [by_id[a] for a in job.adapters], prep.steps, prep.run_dir,
                   eval_base=eval_base, streaming=prep.streaming,
                   length_buckets=prep.length_buckets, row_layout=prep.row_layout,
                   hardware=prep.hardware, rungs=prep.rungs,
                   micro_batches=prep.plan.micro_batches).write(job_dir / "job.yaml")
        return job_dir

    wound_down: list[bool] = []

    def tick(snapshot) -> None:
        if stop is not None and not wound_down and (how := stop()) is not None:
            engine.wind_down(prune=how == "stop")
            wound_down.append(True)
        tracker.poll(by_id)
        if on_snapshot is not None:
            on_snapshot(snapshot)
        if on_tick is not None:
            on_tick([rj.proc for rj in snapshot.running], list(engine.finished))

    def replan_waiting(adapters: list[str], drift: Drift, now: float, free: int) -> list[Job]:
        spec = prep.spec
        if calibrator is not None and calibrator.measured:  # measured steps, memory and job terms
            corrected = calibrator.model()
        else:
            corrected = recalibrated(prep.cost_model, drift)
        # a waiting adapter's micro-batch is chosen again on what was measured
        plan, chosen = plan_target_sets(spec, [by_id[a] for a in adapters], prep.steps, corrected,
                                        prep.hardware or hardware_for(spec),
                                        prep.hardware and prep.hardware.max_tp, len(slots), 30)
        if micro_batch_size_of(spec) is None:  # the jobs written from now on (`write_job`) train at these
            started = {a: m for a, m in prep.plan.micro_batches.items() if a not in adapters}  # kept
            prep.plan = replace(prep.plan, micro_batches={**started, **chosen})
        prefix = f"r{engine.replans + 1}-"
        return [replace(j, id=f"{prefix}job-{i:03d}", start=now + j.start, end=now + j.end)
                for i, j in enumerate(plan.jobs)]

    calibrator = sweep_calibrator(prep)

    def use_model(model: CostModel) -> None:  # joins fit, and re-plans plan, by the corrected model
        prep.cost_model = model

    study_ready = open_study_meanwhile(prep)
    engine = Engine(
        prep.run_dir, journal, slots, write_job,
        max_retries=max_retries, predicted_makespan_s=prep.plan.expected_makespan or None, on_tick=tick,
        replan=replan_waiting if replan and prep.cost_model is not None else None,
        launcher=backend.launcher,
        streaming=(stream_policy(prep) if prep.spec.planner.streams(sweep_on_gpu(prep.spec, prep.hardware))
                   and feed is None else None),
        feed=feed, calibrator=calibrator, on_model=use_model,
    )
    try:
        engine.reconcile()
        engine.submit(prep.plan.jobs)
        engine.run()
    finally:
        journal.close()
        backend.close()
        tracker.close(by_id)
    from plora.cost.profiling.calibrate import is_analytic

    if calibrator is not None and prep.hardware is not None and prep.hardware.local and is_analytic(prep.prior):
        from plora.cost.profiling.cache import remember_calibration

        try:  # the next sweep of this model here starts calibrated; losing it costs nothing else
            remember_calibration(prep.spec, calibrator.calibration())
        except OSError:
            pass
    if engine.drift.overhead_s is not None and (prep.hardware is None or prep.hardware.local):
        from plora.cost.profiling.cache import remember_job_overhead
        from plora.cost.profiling.errors import ProfileError

        try:  # the next sweep of this model here plans with it; losing it costs nothing else
            if getattr(prep.cost_model, "overheads", None) is None:
                remember_job_overhead(prep.spec, engine.drift.overhead_s, engine.drift.jobs)
        except (OSError, ValueError, ProfileError):
            pass
    if getattr(prep.cost_model, "overheads", None) is not None and (prep.hardware is None or prep.hardware.local):
        from plora.job.phases import read_phases
        from plora.cost.profiling.cache import remember_job_phases
        from plora.cost.profiling.errors import ProfileError

        try:  # the job terms refitted with this sweep's jobs, for the next sweep's first plan
            remember_job_phases(prep.spec, [read_phases(p.job_dir, p.ended) for p in engine.finished
                                             if p.returncode == 0])
        except (OSError, ValueError, ProfileError):
            pass
    frame = collect_results(prep)
    study_ready.join(timeout=60)
    from plora.tuning.study import record_sweep  # the sweep as an Optuna study; warns, never raises

    record_sweep(prep.spec, prep.run_dir, prep.configs, prep.plan, frame)
    return frame


def open_study_meanwhile(prep: PreparedSweep) -> threading.Thread:
    """Import Optuna and create the sweep's study on a thread of its own while the jobs train
    (seconds on a GPU machine), so that recording the results at the end only adds trials.
    Only a new study of the run directory's own file is created here (one that exists, or
    another storage, may be in use: `plora tune` tells its trials into it); a failure is left
    to `record_sweep`, which warns."""
    def open_it() -> None:
        try:
            from plora.tuning.study import open_study, storage_url

            url = storage_url(prep.spec, prep.run_dir)
            if not prep.spec.optuna.storage and not Path(url.removeprefix("sqlite:///")).exists():
                open_study(prep.spec, prep.run_dir)
        except Exception:  # noqa: BLE001 - record_sweep opens it again and says what went wrong
            pass

    thread = threading.Thread(target=open_it, name="plora-study", daemon=True)
    thread.start()
    return thread


def sweep_calibrator(prep: PreparedSweep) -> SweepCalibrator | None:
    """The calibration a GPU sweep keeps while it runs (`plora.cost.profiling.calibrate`), or None
    (a CPU sweep, or a prepared sweep without a prior)."""
    if prep.prior is None or prep.hardware is None or not prep.hardware.gpu:
        return None
    from plora.cost.model import AdapterLoad, packed_load
    from plora.engine.runner import DRIFT_THRESHOLD
    from plora.cost.profiling.calibrate import Calibration, SweepCalibrator

    def load(adapter_id: str) -> AdapterLoad:
        c = next(c for c in prep.configs if c.id == adapter_id)
        return packed_load(c.id, c.rank, c.batch_size, prep.steps[c.id], adapter_micro_batch(prep, c.id))

    return SweepCalibrator(prep.prior, prep.calibration or Calibration(), planned=prep.cost_model, load=load,
                           loads=sweep_loads(prep.configs, prep.steps, sweep_micro_batches(prep)),
                           seq_len=int(prep.spec.model.max_seq_len), threshold=DRIFT_THRESHOLD,
                           load_factor=prep.spec.planner.memory_load_factor)


def collect_results(prep: PreparedSweep, crashed_jobs: dict[str, str] | None = None) -> pd.DataFrame:
    """The sweep's results table (`plora.results.collect.write_results`): one row per adapter
    of the sweep, in the job it was planned in."""
    return write_results(prep.spec, prep.run_dir, prep.configs, prep.plan.job_of(), crashed_jobs)
