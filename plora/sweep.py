"""A sweep from a validated spec: expand, group into packed jobs, run them, collect results.

Every stage leaves a file in the run directory (spec.yaml, configs.parquet, plan.json,
jobs/<id>/job.yaml, adapters/<id>/…, results.parquet), so a person can open each one and
each stage can be re-run on its own. This module is the library behind `plora sweep`; the
CLI only renders what it returns.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from plora.accumulation import micro_rows
from plora.data_check import DataReport, check_data, data_config, eval_config
from plora.engine.streaming import STREAM_LINGER_S, StreamPolicy
from plora.jobconfig import (
    JobAdapter,
    JobConfig,
    JobLora,
    JobModel,
    JobStreaming,
    JobTraining,
)
from plora.profiling.calibrate import CALIBRATED_SOURCE
from plora.spec import AdapterConfig, SweepSpec

if TYPE_CHECKING:  # the planner (and its solvers) is imported where a sweep plans
    from plora.costmodel import AdapterLoad
    from plora.planner.plan import Job, Plan
    from plora.tuning.fidelity import Rungs  # Optuna is imported where a tune runs


def dataset_size(spec: SweepSpec) -> int:
    """Training examples the adapters' epoch budgets are counted in (rows checked first)."""
    return check_data(spec).num_train


def plan_jobs(
    spec: SweepSpec,
    configs: Sequence[AdapterConfig],
    steps: dict[str, int],
    cost_model: Any | None = None,
    hardware: Hardware | None = None,
) -> Plan:
    """Group adapters into jobs with the DTM planner on the sweep's cost model; the jobs
    are named ``job-000``, ``job-001``, … in launch order.

    `hardware` defaults to this machine's; `cost_model` to what `cost_model_for` finds
    without probing (a profile from the cache, else the analytic prior). Adapters of
    different target sets never share a job (a job adapts one set of layers): each set is
    planned on its own, priced for its layers (`targets_cost_model`), and the plans run one
    after the other.
    """
    from plora.costmodel import packed_load
    from plora.planner import PLANNING_BUDGET_S

    hw = hardware or hardware_for(spec)
    if cost_model is None:
        cost_model, source = cost_model_for(spec, None, probe=False, hardware=hw)
    else:
        source = cost_model.meta.get("plan_source", cost_model.name or "a given cost model")
    slots = hw.slots
    sets = spec.target_sets(configs)
    sweep_set = spec.sweep_values()["targets"]
    plans = []
    for targets in sets:
        group = [c for c in configs if (c.targets or sweep_set) == targets]
        model = cost_model if targets == sweep_set else targets_cost_model(spec, targets, hw)
        model = within_node(model, hw.max_tp)
        loads = sweep_loads(group, steps, micro_batch_size_of(spec))
        plans.append(planned(spec, loads, model, slots, PLANNING_BUDGET_S / len(sets)))
    plan = plans[0] if len(plans) == 1 else one_after_another(plans, sets)
    grouping = (f"planned ({plan.strategy}, {plan.objective} objective, solver {plan.solver}) for "
                f"{hw.describe()} with {source}")
    return replace(plan, jobs=[replace(j, id=f"job-{i:03d}") for i, j in enumerate(plan.jobs)], grouping=grouping,
                   hardware=hw.describe(), cost_model_source=source)


def planned(spec: SweepSpec, loads: Sequence[Any], cost_model: Any, gpus: int, time_limit_s: float) -> Plan:
    """The sweep's plan for ``loads``: the packed planner's, or the baseline the space asks
    for (``planner.baseline``), on ``cost_model`` and ``gpus``."""
    from plora.planner import baseline_plan, plan_sweep

    p = spec.planner
    if p.baseline is not None:
        return baseline_plan(list(loads), cost_model, gpus, p.baseline, load_factor=p.memory_load_factor)
    return plan_sweep(list(loads), cost_model, gpus, solver=p.solver, load_factor=p.memory_load_factor,
                      max_adapters_per_job=p.max_adapters_per_job, objective=p.objective, time_limit_s=time_limit_s)


def targets_cost_model(spec: SweepSpec, targets: str, hw: Hardware) -> Any:
    """The sweep's cost model for adapters of another target set (`plora.spec.target_key`):
    the same model, file and hardware, with ``lora.targets`` set to it."""
    from plora.spec import target_names

    lora = spec.lora.model_copy(update={"targets": target_names(targets)})
    return sweep_models(spec.model_copy(update={"lora": lora}), None, hardware=hw).model


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


@dataclass(frozen=True)
class Hardware:
    """What a sweep is planned for: GPUs (how many, how much memory each) or CPU slots."""

    gpu: bool
    slots: int
    gpu_memory_bytes: float | None = None
    local: bool = True  # this machine's (profiles can be measured and looked up here)
    max_tp: int | None = None  # GPUs of one node on a cluster: no job spans nodes

    def describe(self) -> str:
        if self.gpu:
            return f"{self.slots} GPU{'s' if self.slots > 1 else ''} of {self.gpu_memory_bytes / 2**30:.0f} GiB"
        return f"{self.slots} CPU slot{'s' if self.slots > 1 else ''}"

    def slot_names(self) -> list[str]:
        return [f"cuda:{i}" for i in range(self.slots)] if self.gpu else [f"cpu:{i}" for i in range(self.slots)]


def hardware_for(spec: SweepSpec, *, here: bool = True) -> Hardware:
    """This machine's GPUs (at most `hardware.gpus`) or its cores; with `here=False` and no
    GPU visible, the space file's `hardware` itself (planning a GPU sweep from elsewhere)."""
    import os

    if spec.hardware.backend == "ray":
        return cluster_hardware(spec)
    cpu = Hardware(False, max(1, os.cpu_count() or 1))
    if spec.hardware.device == "cpu":
        return cpu
    import torch

    if torch.cuda.is_available():
        n = max(1, min(spec.hardware.gpus, torch.cuda.device_count()))
        return Hardware(True, n, float(torch.cuda.get_device_properties(0).total_memory))
    if not here:
        return Hardware(True, spec.hardware.gpus, spec.hardware.gpu_memory_gb * 2**30, local=False)
    if spec.hardware.device == "cuda":
        raise ValueError("hardware.device: cuda, but no CUDA device is visible on this machine")
    return cpu


def cluster_hardware(spec: SweepSpec) -> Hardware:
    """A Ray cluster as the space file describes it: ``nodes × gpus_per_node`` GPUs of
    ``gpu_memory_gb`` (CPU slots with ``device: cpu``), no job wider than one node. Its GPUs
    are not this machine's: profiles are not measured here."""
    hw = spec.hardware
    slots = hw.nodes * hw.per_node
    if hw.device == "cpu":
        return Hardware(False, slots, max_tp=1)
    return Hardware(True, slots, hw.gpu_memory_gb * 2**30, local=False, max_tp=hw.per_node)


def within_node(cost_model: Any, max_tp: int | None) -> Any:
    """The cost model without the TP degrees wider than a node (the planner then never
    plans a job across nodes)."""
    if max_tp is None or max(cost_model.degrees) <= max_tp:
        return cost_model
    keep = [d for d in cost_model.degrees if d <= max_tp] or [min(cost_model.degrees)]
    return replace(cost_model, time={d: cost_model.time[d] for d in keep},
                   memory_coeffs={d: cost_model.memory_coeffs[d] for d in keep},
                   host_time={d: c for d, c in cost_model.host_time.items() if d in keep})


#: the CPU prior's memory (`plora.cpu_cost`): what a CPU sweep plans its jobs within, and
#: the runtime's own share of it
CPU_PRIOR = dict(memory_bytes=64 * 2**30, overhead_bytes=0.5 * 2**30)
ANALYTIC_SOURCE = "the analytic cost model (no profile yet: `plora profile` fits one)"
#: where the plan's model came from after a sweep's quick calibration
CALIBRATED_SOURCE_NOW = "the analytic cost model calibrated on this GPU just now (two short packs)"


#: the analytic prior's device numbers by GPU name (dense bf16 FLOP/s, HBM bytes/s); others
#: get the H100's. Only a starting point: a sweep calibrates its model from its own jobs.
GPU_PRIORS = {
    "H200": dict(device_flops=989e12, device_bandwidth=4.8e12),
    "H100": dict(device_flops=989e12, device_bandwidth=3.35e12),
    "A100": dict(device_flops=312e12, device_bandwidth=2.0e12),
}


def gpu_prior(device_name: str | None) -> dict[str, float]:
    for key, numbers in GPU_PRIORS.items():
        if device_name and key in device_name:
            return dict(numbers)
    return dict(GPU_PRIORS["H100"])


def analytic_prior(spec: SweepSpec, hw: Hardware) -> Any:
    """The analytic cost model of the sweep's model on ``hw``: FLOPs and bytes from the model's
    shape, the step as the sweep's jobs run it (activation checkpointing or not)."""
    from plora.costmodel import CostModel
    from plora.cpu_cost import cpu_cost_model
    from plora.profiling.cache import shape_from_model

    shape = shape_from_model(spec.model.resolved_path(), spec.model.family, spec.model.dtype, spec.model.quantize)
    targets = list(spec.lora.resolved_targets())
    seq = spec.model.max_seq_len
    if hw.gpu:
        name = None
        if hw.local:
            import torch

            name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        return CostModel.analytic(shape, seq, hw.gpu_memory_bytes, targets, max_tp=hw.max_tp or hw.slots,
                                  activation_checkpointing=bool(spec.training.activation_checkpointing),
                                  **gpu_prior(name))
    return cpu_cost_model(shape, seq, targets, **CPU_PRIOR)


def cost_model_for(spec: SweepSpec, run_dir: Path | None, *, probe: bool = False,
                   hardware: Hardware | None = None) -> tuple[Any, str]:
    """The cost model a sweep plans with, and where it came from.

    In order: the run directory's profile.json; a cached profile of this model on this
    machine (`plora profile`); on a GPU here, the analytic prior corrected by the cached
    calibration of this model here (`plora.profiling.calibrate`, what earlier sweeps
    measured); else the analytic prior from the model's shape (FLOPs and bytes), on a GPU
    with its memory per adapter counted `MEMORY_MARGIN` times until something is measured.
    A sweep never waits for a profile: ``probe`` is accepted for callers of earlier versions
    and means nothing here (`prepare` measures a few seconds where memory decides the plan).
    """
    from plora.profiling.calibrate import conservative

    hw = hardware or hardware_for(spec)
    found = profiled_model(spec, run_dir, hw)
    if found is not None:
        return found
    prior = analytic_prior(spec, hw)
    if not hw.gpu:
        return prior, ANALYTIC_SOURCE
    calibration = cached_calibration(spec, hw)
    if not calibration.empty:
        return calibration.apply(prior), CALIBRATED_SOURCE
    return conservative(prior), ANALYTIC_SOURCE


def profiled_model(spec: SweepSpec, run_dir: Path | None, hw: Hardware) -> tuple[Any, str] | None:
    """A measured model of the sweep's model, and where it came from: the run directory's
    profile.json, else a profile cached on this machine; None where there is neither."""
    from plora.costmodel import CostModel
    from plora.profiling.profile import profile_sweep

    if run_dir is not None and (run_dir / "profile.json").is_file():
        return CostModel.load(run_dir / "profile.json"), "the run's profile.json"
    cm = profile_sweep(spec, None, cached_only=True) if hw.local else None
    return (cm, "a profile measured on this machine") if cm is not None else None


def cached_calibration(spec: SweepSpec, hw: Hardware) -> Any:
    """What earlier sweeps of the model measured on this machine (empty elsewhere)."""
    from plora.profiling.cache import load_calibration
    from plora.profiling.calibrate import Calibration

    return (load_calibration(spec) if hw.local else None) or Calibration()


def priced_for_sweep(spec: SweepSpec, cost_model: Any, hw: Hardware, length_buckets: int | str | None = None,
                     row_lengths: list[int] | None = None, row_layout: str | None = None) -> Any:
    """A cost model priced on this sweep's own rows (their ``row_lengths`` when already
    tokenized, in its jobs' ``length_buckets``) and eval (`CostModel.for_eval`,
    `CostModel.for_rows`), unless it already is: any model of a GPU sweep, and one with
    measured job terms on a CPU (the CPU's analytic prior stays as it is)."""
    if cost_model.eval_load is not None or (getattr(cost_model, "overheads", None) is None and not hw.gpu):
        return cost_model
    from plora.jobcost import eval_load_for, train_row_lengths, train_row_tokens, widest_train_row

    graphed = graphed_steps(spec, hw)
    lengths = row_lengths if row_lengths is not None else train_row_lengths(spec)
    rows = train_row_tokens(spec, graphed=graphed, length_buckets=length_buckets, lengths=lengths,
                            row_layout=row_layout)
    widest = widest_train_row(spec, graphed=graphed, lengths=lengths, row_layout=row_layout) if hw.gpu else None
    return cost_model.for_eval(eval_load_for(spec)).for_rows(rows, widest)


def sweep_cost_model(spec: SweepSpec, run_dir: Path | None, *, probe: bool = False,
                     hardware: Hardware | None = None, length_buckets: int | str | None = None,
                     row_lengths: list[int] | None = None, row_layout: str | None = None) -> Any:
    """The cost model a sweep runs with: `cost_model_for`'s (its source in
    ``meta["plan_source"]``), priced on the sweep's rows (`priced_for_sweep`)."""
    return sweep_models(spec, run_dir, hardware=hardware, length_buckets=length_buckets,
                        row_lengths=row_lengths, row_layout=row_layout).model


@dataclass
class SweepModels:
    """A sweep's cost model and what it was made of: the model measurements correct
    (``prior``: the analytic prior, or a profile, priced on the sweep's rows) and the
    measurements so far (``calibration``; `plora.profiling.calibrate`)."""

    model: Any
    prior: Any
    calibration: Any
    source: str


def sweep_models(spec: SweepSpec, run_dir: Path | None, *, hardware: Hardware | None = None,
                 length_buckets: int | str | None = None, row_lengths: list[int] | None = None,
                 row_layout: str | None = None, loads: Sequence[AdapterLoad] = ()) -> SweepModels:
    """`cost_model_for`'s model priced for the sweep, with its prior and calibration. On a GPU
    without a profile, the analytic prior is priced once and the model made from it: corrected
    by the cached calibration, else with its memory margin, cut where one of the sweep's
    ``loads`` would fit no GPU with it (`plora.profiling.calibrate.conservative`)."""
    from plora.profiling.calibrate import Calibration, conservative

    hw = hardware or hardware_for(spec)

    def priced(model: Any, source: str) -> Any:
        model.meta["plan_source"] = source
        return priced_for_sweep(spec, model, hw, length_buckets, row_lengths, row_layout)

    found = profiled_model(spec, run_dir, hw)
    if found is not None or not hw.gpu:
        model = priced(*(found or (analytic_prior(spec, hw), ANALYTIC_SOURCE)))
        return SweepModels(model, model, Calibration(), model.meta["plan_source"])
    calibration = cached_calibration(spec, hw)
    source = ANALYTIC_SOURCE if calibration.empty else CALIBRATED_SOURCE
    prior = priced(analytic_prior(spec, hw), source)
    if calibration.empty:
        model = conservative(prior, loads=loads, load_factor=spec.planner.memory_load_factor)
    else:
        model = calibration.apply(prior, loads=loads)
    return SweepModels(model, prior, calibration, source)


def graphed_steps(spec: SweepSpec, hw: Hardware) -> bool:
    """Whether this sweep's (one-GPU) jobs will replay their steps from CUDA graphs."""
    import torch

    from plora.step_settings import graphs_wanted

    device = torch.device("cuda" if hw.gpu else "cpu")
    return graphs_wanted(spec.training.cuda_graphs, device, tp=False,
                         activation_checkpointing=bool(spec.training.activation_checkpointing))


def recalibrated(cost_model: Any, drift: Any) -> Any:
    """The cost model corrected by what finished jobs measured (`plora.engine.runner.Drift`).

    With the jobs' step time known, the steps are scaled by their own drift and the fixed
    per-job overhead is replaced by the measured one: on a GPU a profile taken in-process
    says nothing of process start and model load, which dominate a one-adapter job, and one
    factor for both would make the packed jobs' steps look slow too. Without it, every time
    is scaled by the whole jobs' drift.
    """
    overhead = drift.overhead_s
    if getattr(cost_model, "overheads", None) is not None:  # measured job terms: one factor for all
        return cost_model.scaled(drift.factor)
    predicted_steps = drift.predicted_s - drift.jobs * cost_model.job_overhead_s
    if overhead is None or not drift.step_s or predicted_steps <= 0:
        return cost_model.scaled(drift.factor)
    model = cost_model.scaled(drift.step_s / predicted_steps)
    return replace(model, job_overhead_s=overhead, meta={**model.meta, "job_overhead_measured": True})


def model_targets(spec: SweepSpec, targets: str | Sequence[str] | None = None) -> list[str]:
    """The layers a job adapts: ``targets`` (default ``lora.targets``) resolved for the
    model's family (Phi-3's ``all-linear`` is its fused qkv_proj/gate_up_proj, not llama's
    seven layers)."""
    from plora.models import read_model_info
    from plora.spec import resolve_targets

    family = read_model_info(spec.model.resolved_path(), spec.model.family).family
    return resolve_targets(spec.lora.targets if targets is None else list(targets), family)


def sweep_on_gpu(spec: SweepSpec, hw: Hardware | None = None) -> bool:
    """Whether the sweep's jobs run on GPUs (what ``planner.streaming: auto`` turns on for):
    its hardware's, where the sweep has decided it, else as the space file says (``auto``:
    where CUDA is here)."""
    if hw is not None:
        return hw.gpu
    if spec.hardware.device in ("cpu", "cuda"):
        return spec.hardware.device == "cuda"
    import torch

    return torch.cuda.is_available()


def job_adapter(spec: SweepSpec, cfg: AdapterConfig, steps: int, rungs: Rungs | None = None) -> JobAdapter:
    """One adapter as a job trains it: its configuration, step budget, warm-up, its own
    training settings (the sweep's where it sets none) and the steps a tune's rungs score
    it at (`plora.tuning.fidelity`)."""
    s = spec.settings(cfg)
    return JobAdapter(id=cfg.id, rank=cfg.rank, alpha=cfg.alpha, learning_rate=cfg.learning_rate,
                      batch_size=cfg.batch_size, seed=cfg.seed, steps=steps, warmup_steps=spec.warmup_for(cfg, steps),
                      dropout=s["dropout"], weight_decay=s["weight_decay"], scheduler=s["scheduler"],
                      rslora=s["rslora"], eval_steps=rungs.eval_steps(steps) if rungs is not None else [])


def adapter_targets(spec: SweepSpec, configs: Sequence[AdapterConfig]) -> list[str]:
    """The layers a job of ``configs`` adapts, resolved for the model's family: their one
    target set (adapters of different sets never share a job: `plan_jobs`)."""
    from plora.spec import target_names

    sets = spec.target_sets(configs)
    if len(sets) > 1:
        raise ValueError(f"adapters of different target sets in one job: {', '.join(sets)}")
    if not sets or sets[0] == spec.sweep_values()["targets"]:
        return model_targets(spec)
    return model_targets(spec, target_names(sets[0]))


def check_target_sets(spec: SweepSpec, configs: Sequence[AdapterConfig]) -> None:
    """Every target set the space searches names layers the model's family has (a
    `SpecError` naming ``space.targets`` otherwise), before anything runs."""
    from plora.spec import SpecError, target_names

    sweep_set = spec.sweep_values()["targets"]
    for targets in spec.target_sets(configs):
        if targets == sweep_set:
            continue
        try:
            model_targets(spec, target_names(targets))
        except SpecError as e:
            raise SpecError("space.targets", e.message) from None


def job_config(spec: SweepSpec, job: Job, adapters: Sequence[AdapterConfig], steps: Mapping[str, int],
               run_dir: Path, *, eval_base: bool, streaming: JobStreaming | None = None,
               length_buckets: int | str | None = None, row_layout: str | None = None,
               hardware: Hardware | None = None, rungs: Rungs | None = None) -> JobConfig:
    """The recipe config of one job (what `tune run` reads, as job.yaml): the spec's
    settings with the sweep's decisions made for the job's ``adapters`` (its configurations,
    in its order): step budgets, warm-ups, resolved targets. ``streaming``: the job's
    streaming section when whoever runs it sends it joins itself (default: from
    ``planner.streaming`` on the sweep's ``hardware``). ``length_buckets``, ``row_layout``:
    the sweep's resolved ones (default the spec's). ``rungs``: a tune's pruner's, at which
    each adapter is scored (`plora.tuning.fidelity`)."""
    t = spec.training
    return JobConfig(
        job_id=job.id,
        tp=job.tp,
        output_dir=run_dir,
        job_dir=run_dir / "jobs" / job.id,
        seed=spec.space.seed,
        device=spec.hardware.device,
        num_threads=1 if spec.hardware.device == "cpu" else None,
        model=JobModel(path=str(spec.model.resolved_path()), family=spec.model.family, dtype=spec.model.dtype,
                       max_seq_len=spec.model.max_seq_len, random_init=spec.model.random_init,
                       quantize=spec.model.quantize),
        data=data_config(spec),
        lora=JobLora(targets=adapter_targets(spec, adapters), dropout=spec.lora.dropout),
        adapters=[job_adapter(spec, a, steps[a.id], rungs) for a in adapters],
        training=JobTraining(
            scheduler=t.scheduler, grad_clip=t.grad_clip, weight_decay=t.weight_decay,
            divergence_loss=t.divergence_loss, activation_checkpointing=t.activation_checkpointing,
            cuda_graphs=t.cuda_graphs, row_layout=row_layout or t.row_layout,
            # the sweep's count is for one-GPU graphed jobs; a TP job's steps run eagerly
            length_buckets=t.length_buckets if length_buckets is None or job.tp > 1 else length_buckets,
            checkpoint_every_steps=t.checkpoint_every_steps,
            checkpoint_every_minutes=t.checkpoint_every_minutes,
            micro_batch_size=t.micro_batch_size,
        ),
        eval=eval_config(spec),
        eval_base=eval_base,
        streaming=streaming if streaming is not None else (
            JobStreaming(linger_s=STREAM_LINGER_S, max_active=spec.planner.max_adapters_per_job)
            if spec.planner.streams(sweep_on_gpu(spec, hardware)) and job.tp == 1 else JobStreaming()),
    )


@dataclass
class PreparedSweep:
    spec: SweepSpec
    run_dir: Path
    configs: list[AdapterConfig]
    steps: dict[str, int]
    plan: Plan
    cost_model: Any = None
    hardware: Hardware | None = None
    data: DataReport | None = None  # rows checked, cut or dropped (notes for the user)
    #: every job's streaming section, for a caller that sends joins itself (None: job_config's default)
    streaming: JobStreaming | None = None
    #: ``training.length_buckets`` as every job of the sweep gets it (`plora.jobcost.sweep_length_buckets`)
    length_buckets: int | str = "auto"
    #: ``training.row_layout`` as every job of the sweep gets it (`plora.jobcost.sweep_row_layout`)
    row_layout: str = "auto"
    #: what measurements correct while the sweep runs (the priced analytic prior, or a profile)
    #: and the measurements so far (`plora.profiling.calibrate`); None: the cost model as it is
    prior: Any = None
    calibration: Any = None
    #: a tune's pruner's rungs: every adapter is scored at them (`plora.tuning.fidelity`)
    rungs: Rungs | None = None


def stream_policy(prep: PreparedSweep) -> StreamPolicy:
    """How the engine sends adapters into running jobs (``planner.streaming``): each as its
    job config would list it, while the pack stays within ``max_adapters_per_job`` and,
    with a cost model, within the planner's share of GPU memory; the cost model also times
    the packs for the choice (`plora.engine.join_choice`)."""
    from plora.engine.join_choice import pack_fits

    spec, by_id = prep.spec, {c.id: c for c in prep.configs}

    def entry(adapter_id: str) -> JobAdapter:
        return job_adapter(spec, by_id[adapter_id], prep.steps[adapter_id], prep.rungs)

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
            hardware: Hardware | None = None, cost_model: Any | None = None,
            log: Callable[[str], None] | None = None, fresh: bool = False) -> PreparedSweep:
    """Everything a sweep decides before training: configurations, step budgets, the plan.

    Writes nothing to the run directory (a quick calibration goes to plora's cache). On a GPU
    of this machine with nothing measured of the model yet, the plan counts the analytic
    prior's memory per adapter `MEMORY_MARGIN` times; where that margin alone would keep the
    largest pack the sweep may form off the GPU, `probe` lets it first measure two short packs
    (`plora.profiling.profile.quick_calibration`, a few seconds, reported through ``log``) and
    plan on them. The sweep's own jobs calibrate the model further while they run. ``fresh``:
    the run directory is started over, its profile.json is not this sweep's.
    """
    from plora.model_check import check_spec_model

    check_spec_model(spec)  # a broken model folder is refused before any planning
    configs = spec.expand()
    check_target_sets(spec, configs)
    data = check_data(spec)  # bad data is refused here, before anything is written
    n_train = data.num_train
    steps = {c.id: spec.steps_for(c, n_train) for c in configs}
    run = spec.run_dir(run_dir)
    hw = hardware or hardware_for(spec)
    from plora.jobcost import sweep_length_buckets, sweep_row_layout, train_row_lengths

    graphed = graphed_steps(spec, hw)
    # tokenized once here for all three: the layout, the bucket count and the rows' price
    wanted = graphed and (spec.training.length_buckets == "auto" or spec.training.row_layout == "auto")
    lengths = train_row_lengths(spec) if wanted else None
    before = None if fresh else resolved_layout(run)
    if before is not None:  # a resumed sweep keeps its adapters' row order (their checkpoints hold it)
        layout, buckets = before
    else:
        micro = micro_batch_size_of(spec)
        layout = sweep_row_layout(spec, graphed=graphed, lengths=lengths,
                                  batch_sizes=[micro_rows(c.batch_size, micro) for c in configs])
        buckets = sweep_length_buckets(spec, steps, graphed=graphed, lengths=lengths, row_layout=layout)
    prior = calibration = None
    if cost_model is None:
        models = sweep_models(spec, None if fresh else run, hardware=hw, length_buckets=buckets, row_lengths=lengths,
                              row_layout=layout, loads=sweep_loads(configs, steps, micro_batch_size_of(spec)))
        cost_model, prior, calibration = models.model, models.prior, models.calibration
        if probe and hw.gpu and hw.local and models.source == ANALYTIC_SOURCE:
            cost_model, calibration = calibrate_first(spec, configs, steps, prior, cost_model, hw, log)
    else:
        cost_model = priced_for_sweep(spec, cost_model, hw, buckets, lengths, layout)
    plan = plan_jobs(spec, configs, steps, cost_model, hw)
    return PreparedSweep(spec, run, configs, steps, plan, cost_model, hw, data, length_buckets=buckets,
                         row_layout=layout, prior=prior, calibration=calibration)


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
                micro_batch_size: int | None = None) -> list[AdapterLoad]:
    """What the planner knows of each of the sweep's adapters: its rows per packed step and
    its packed steps (an adapter accumulating over micro-batches: `plora.costmodel.packed_load`)."""
    from plora.costmodel import packed_load

    return [packed_load(c.id, c.rank, c.batch_size, steps[c.id], micro_batch_size) for c in configs]


def micro_batch_size_of(spec: Any) -> int | None:
    """The sweep's ``training.micro_batch_size`` (None where a spec-like object has none)."""
    return getattr(getattr(spec, "training", None), "micro_batch_size", None)


def largest_pack(spec: Any, configs: Sequence[AdapterConfig], steps: Mapping[str, int]) -> list[AdapterLoad]:
    """The heaviest pack the sweep may form: its `max_adapters_per_job` adapters of most rows
    and rank."""
    loads = sweep_loads(configs, steps, micro_batch_size_of(spec))
    loads.sort(key=lambda a: (a.batch_size, a.rank), reverse=True)
    return loads[: max(1, int(spec.planner.max_adapters_per_job))]


def calibrate_first(spec: SweepSpec, configs: Sequence[AdapterConfig], steps: Mapping[str, int], prior: Any,
                    conservative_model: Any, hw: Hardware, log: Callable[[str], None] | None) -> tuple[Any, Any]:
    """The model to plan on before any job runs: the conservative prior where even then the
    sweep's largest pack fits one GPU (memory cannot decide the plan), else the prior
    corrected by a quick calibration (kept in plora's cache for the next sweep)."""
    from plora.profiling.cache import remember_calibration
    from plora.profiling.calibrate import Calibration
    from plora.profiling.profile import quick_calibration

    pack = largest_pack(spec, configs, steps)
    if conservative_model.fits(pack, 1, spec.planner.memory_load_factor):
        return conservative_model, Calibration()
    calibration = quick_calibration(spec, prior, pack, log=log)
    if calibration.empty:
        return conservative_model, calibration
    try:
        remember_calibration(spec, calibration)
    except OSError:
        pass
    model = calibration.apply(prior, loads=sweep_loads(configs, steps, micro_batch_size_of(spec)))
    model.meta["plan_source"] = CALIBRATED_SOURCE_NOW
    return model, calibration


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
    from plora.preflight import check_resumable

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
        write_unmeasured_base_metrics(prep)  # no job evaluates the base model on nothing
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
                   hardware=prep.hardware, rungs=prep.rungs).write(job_dir / "job.yaml")
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
        loads = sweep_loads([by_id[a] for a in adapters], prep.steps, micro_batch_size_of(prep.spec))
        spec = prep.spec
        if calibrator is not None and calibrator.measured:  # measured steps, memory and job terms
            corrected = calibrator.model()
        else:
            corrected = recalibrated(prep.cost_model, drift)
        max_tp = prep.hardware and prep.hardware.max_tp
        sweep_set = spec.sweep_values()["targets"]
        sets = spec.target_sets([by_id[a] for a in adapters])
        plans = []
        for targets in sets:  # a job adapts one target set (`plan_jobs`)
            model = (corrected if targets == sweep_set
                     else targets_cost_model(spec, targets, prep.hardware or hardware_for(spec)))
            group = [x for x in loads if (by_id[x.id].targets or sweep_set) == targets]
            plans.append(planned(spec, group, within_node(model, max_tp), len(slots), 30 / len(sets)))
        plan = plans[0] if len(plans) == 1 else one_after_another(plans, sets)
        prefix = f"r{engine.replans + 1}-"
        return [replace(j, id=f"{prefix}job-{i:03d}", start=now + j.start, end=now + j.end)
                for i, j in enumerate(plan.jobs)]

    calibrator = sweep_calibrator(prep)

    def use_model(model: Any) -> None:  # joins fit, and re-plans plan, by the corrected model
        prep.cost_model = model

    study_ready = open_study_meanwhile(prep)
    engine = Engine(
        prep.run_dir, journal, slots, write_job,
        max_retries=max_retries, predicted_makespan_s=prep.plan.makespan or None, on_tick=tick,
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
    from plora.profiling.calibrate import is_analytic

    if calibrator is not None and prep.hardware is not None and prep.hardware.local and is_analytic(prep.prior):
        from plora.profiling.cache import remember_calibration

        try:  # the next sweep of this model here starts calibrated; losing it costs nothing else
            remember_calibration(prep.spec, calibrator.calibration())
        except OSError:
            pass
    if engine.drift.overhead_s is not None and (prep.hardware is None or prep.hardware.local):
        from plora.profiling.cache import remember_job_overhead
        from plora.profiling.errors import ProfileError

        try:  # the next sweep of this model here plans with it; losing it costs nothing else
            if getattr(prep.cost_model, "overheads", None) is None:
                remember_job_overhead(prep.spec, engine.drift.overhead_s, engine.drift.jobs)
        except (OSError, ValueError, ProfileError):
            pass
    if getattr(prep.cost_model, "overheads", None) is not None and (prep.hardware is None or prep.hardware.local):
        from plora.jobphases import read_phases
        from plora.profiling.cache import remember_job_phases
        from plora.profiling.errors import ProfileError

        try:  # the job terms refitted with this sweep's jobs, for the next sweep's first plan
            remember_job_phases(prep.spec, [read_phases(p.job_dir, p.ended) for p in engine.finished
                                             if p.returncode == 0])
        except (OSError, ValueError, ProfileError):
            pass
    frame = collect_results(prep)
    study_ready.join(timeout=60)
    from plora.tuning.study import record_sweep  # the sweep as an Optuna study; warns, never raises

    record_sweep(prep, frame)
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


def sweep_calibrator(prep: PreparedSweep) -> Any:
    """The calibration a GPU sweep keeps while it runs (`plora.profiling.calibrate`), or None
    (a CPU sweep, or a prepared sweep without a prior)."""
    if prep.prior is None or prep.hardware is None or not prep.hardware.gpu:
        return None
    from plora.costmodel import AdapterLoad, packed_load
    from plora.engine.runner import DRIFT_THRESHOLD
    from plora.profiling.calibrate import Calibration, SweepCalibrator

    def load(adapter_id: str) -> AdapterLoad:
        c = next(c for c in prep.configs if c.id == adapter_id)
        return packed_load(c.id, c.rank, c.batch_size, prep.steps[c.id], micro_batch_size_of(prep.spec))

    return SweepCalibrator(prep.prior, prep.calibration or Calibration(), planned=prep.cost_model, load=load,
                           loads=sweep_loads(prep.configs, prep.steps, micro_batch_size_of(prep.spec)),
                           seq_len=int(prep.spec.model.max_seq_len), threshold=DRIFT_THRESHOLD,
                           load_factor=prep.spec.planner.memory_load_factor)


RESULT_COLUMNS = [
    "adapter_id", "rank", "alpha", "learning_rate", "batch_size", "seed", "job_id", "status",
    "steps", "train_loss", "eval_loss", "eval_exact_match", "wall_time_s", "checkpoint_path",
]


def result_columns(spec: SweepSpec) -> list[str]:
    """RESULT_COLUMNS with the dimensions the space searches per adapter after the seed (each
    adapter's effective value), the sweep's other metrics (`eval_<name>`) after exact match,
    and, where each epoch is scored, the epoch kept and each epoch's objective and loss
    (`epoch_columns`) after them."""
    extra = [f"eval_{n}" for n in spec.eval.metric_names if f"eval_{n}" not in RESULT_COLUMNS]
    at = RESULT_COLUMNS.index("eval_exact_match") + 1
    columns = RESULT_COLUMNS[:at] + extra + epoch_columns(spec) + RESULT_COLUMNS[at:]
    seed = columns.index("seed") + 1
    return columns[:seed] + spec.space.searched() + columns[seed:]


def epoch_columns(spec: SweepSpec) -> list[str]:
    """``epoch`` (the epoch whose weights an adapter keeps) and ``<score>_epoch<e>`` for the
    objective and the loss of each epoch; none where only the end is scored."""
    count = spec.scored_epochs
    if count <= 1:
        return []
    scores = list(dict.fromkeys([f"eval_{spec.eval.objective}"]
                                + (["eval_loss"] if "loss" in spec.eval.metric_names else [])))
    return ["epoch"] + [f"{s}_epoch{e}" for e in range(1, count + 1) for s in scores]


def result_row(spec: SweepSpec, run_dir: Path, c: AdapterConfig, job_id: str | None,
               crashed_jobs: Mapping[str, str] | None = None) -> dict[str, Any]:
    """An adapter's row of results.parquet, from its metrics.json (``failed`` without one;
    ``job_id``: the job it was planned in)."""
    crashed_jobs = crashed_jobs or {}
    path = run_dir / "adapters" / c.id / "metrics.json"
    row: dict[str, Any] = {"adapter_id": c.id, **{k: v for k, v in c.to_dict().items() if k != "id"}}
    settings = spec.settings(c)
    row.update({n: settings[n] for n in spec.space.searched()})
    if path.is_file():
        m = json.loads(path.read_text())
        if m.get("status") == "failed" and crashed_jobs.get(m.get("job_id", "")):
            m["reason"] = f"job crashed; see {crashed_jobs[m['job_id']]}"
        row.update({k: m.get(k) for k in result_columns(spec) if k in m and k not in row})
        for e in m.get("epochs") or []:
            row.update({f"{k}_epoch{e['epoch']}": v for k, v in e.items() if k.startswith("eval_")})
        row["reason"] = m.get("reason") or ""
    else:
        row.update({"job_id": job_id, "status": "failed", "steps": 0})
        log = crashed_jobs.get(job_id or "")
        row["reason"] = f"job crashed; see {log}" if log else "no result"
    return row


def collect_results(prep: PreparedSweep, crashed_jobs: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per adapter from adapters/<id>/metrics.json; adapters with none are `failed`."""
    job_of = prep.plan.job_of()
    rows = [result_row(prep.spec, prep.run_dir, c, job_of.get(c.id), crashed_jobs) for c in prep.configs]
    columns = result_columns(prep.spec)
    frame = pd.DataFrame(rows)
    for col in columns + ["reason"]:
        if col not in frame.columns:
            frame[col] = None
    frame = frame[columns + ["reason"]]
    frame.to_parquet(prep.run_dir / "results.parquet", index=False)
    frame.to_csv(prep.run_dir / "results.csv", index=False)
    return frame


def has_eval_data(spec: SweepSpec) -> bool:
    """Whether the sweep has eval examples (a built-in task makes its own; files need data.eval)."""
    return spec.data.task is not None or spec.data.eval is not None


def write_unmeasured_base_metrics(prep: PreparedSweep) -> None:
    """base_metrics.json for a sweep without eval data: every metric null, so that nothing
    reads an eval loss of 0.0 that was never measured."""
    prep.run_dir.mkdir(parents=True, exist_ok=True)
    metrics = {f"eval_{m}": None for m in prep.spec.eval.metric_names}
    (prep.run_dir / "base_metrics.json").write_text(json.dumps(metrics, indent=2))


def base_metrics(run_dir: Path) -> dict[str, float | None]:
    path = run_dir / "base_metrics.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def ranked(frame: pd.DataFrame, objective: str, minimize: bool) -> pd.DataFrame:
    """Finished adapters best first by the objective column (`eval_<metric>`)."""
    column = f"eval_{objective}"
    done = frame[frame["status"] == "done"].copy()
    if column not in done.columns or done[column].isna().all():
        return done
    keys, ascending = [column], [minimize]
    if column != "eval_loss" and "eval_loss" in done.columns:
        keys.append("eval_loss")  # ties (common with exact match) go to the lower loss
        ascending.append(True)
    return done.sort_values(keys, ascending=ascending)
