"""The cost model a sweep plans with, and where it came from.

In order: the run directory's profile.json; a profile of the model cached on this machine
(`plora profile`); on a GPU here, the analytic prior corrected by what earlier sweeps of the
model measured here (`plora.cost.profiling.calibrate`); else the analytic prior from the
model's shape (on a GPU with a memory margin until something is measured; on CPU cores the
CPU prior, `plora.cost.cpu`). Whichever it is, it is priced on the sweep's own rows and eval
(`plora.cost.sweep_rows`), and corrected by what the sweep's finished jobs measure
(`recalibrated`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING


from plora.cost.job import JobOverheads
from plora.cost.profiling.calibrate import CALIBRATED_SOURCE
from plora.hardware import Hardware, hardware_for
from plora.spec.schema import SweepSpec

if TYPE_CHECKING:
    from plora.cost.model import AdapterLoad, CostModel
    from plora.cost.profiling.calibrate import Calibration
    from plora.engine.runner import Drift


def targets_cost_model(spec: SweepSpec, targets: str, hw: Hardware) -> CostModel:
    """The sweep's cost model for adapters of another target set (`plora.spec.adapter.target_key`):
    the same model, file and hardware, with ``lora.targets`` set to it."""
    from plora.spec.adapter import target_names

    lora = spec.lora.model_copy(update={"targets": target_names(targets)})
    return sweep_models(spec.model_copy(update={"lora": lora}), None, hardware=hw).model


def within_node(cost_model: CostModel, max_tp: int | None) -> CostModel:
    """The cost model without the TP degrees wider than a node (the planner then never
    plans a job across nodes)."""
    if max_tp is None or max(cost_model.degrees) <= max_tp:
        return cost_model
    keep = [d for d in cost_model.degrees if d <= max_tp] or [min(cost_model.degrees)]
    return replace(cost_model, time={d: cost_model.time[d] for d in keep},
                   memory_coeffs={d: cost_model.memory_coeffs[d] for d in keep},
                   host_time={d: c for d, c in cost_model.host_time.items() if d in keep})


#: the CPU prior's memory (`plora.cost.cpu`): what a CPU sweep plans its jobs within, and
#: the runtime's own share of it
CPU_PRIOR = dict(memory_bytes=64 * 2**30, overhead_bytes=0.5 * 2**30)


ANALYTIC_SOURCE = "the analytic cost model (no profile yet: `plora profile` fits one)"


#: where the plan's model came from after a sweep's quick calibration
CALIBRATED_SOURCE_NOW = "the analytic cost model calibrated on this GPU just now (two short packs)"


#: the analytic prior's device numbers by GPU name (dense bf16 FLOP/s, HBM bytes/s, and the
#: fraction of peak the frozen base's matmuls reach in a packed step); others get the H100's.
#: Only a starting point: a sweep calibrates its model from its own jobs. The Hopper
#: fractions are what those calibrations measured: packed steps of the 0.5B shape and of
#: SmolLM2-135M took 1.5-2.0x the time per token that the default 0.45 gives on an H200,
#: 1.9x on an H100 (a first sweep's prediction had been 37-54 % short). The lean step
#: (`plora.train.packed.lean_step`) made the H200's 0.5B packed steps 15 % shorter (full pack
#: 118.5 -> 100.8 ms), and a first sweep's prediction 18 % long at 0.27; 0.35 priced them.
#: The model sent to the first job's process at once and the fused loss
#: (`plora.kernels.cross_entropy`: full pack 95 -> 89 ms) put it 15-18 % long again at 0.35;
#: 0.45 prices the full pack at 97 ms. (SmolLM2-135M's narrow steps it prices about 20 % short:
#: its later sweeps calibrate.) The H100's is from before the lean step (long, so on the safe side).
GPU_PRIORS = {
    "H200": dict(device_flops=989e12, device_bandwidth=4.8e12, mfu=0.45),
    "H100": dict(device_flops=989e12, device_bandwidth=3.35e12, mfu=0.24),
    "A100": dict(device_flops=312e12, device_bandwidth=2.0e12),
}

#: what a GPU job pays besides its steady steps before anything of it is measured, in the
#: terms a sweep's own jobs are fitted in (`plora.cost.job`): the process's start and the
#: hand-over, set-up, the first step over a steady one (kernels compiled and loaded, the
#: first capture), the exit, and each group of adapters leaving together: its packed eval
#: (per eval token, and per generated token's forward of a batch) and saves. Fitted on the
#: first sweeps of the 0.5B benchmark and of SmolLM2-135M on an H200 (4 jobs; the exit is
#: what the journal's end of a job was past its own, 0.26-0.34 s). A flat 4 s, which had
#: stood for all of it, priced no generation: SmolLM2's evals (12 adapters x 200 rows, 6 new
#: tokens: 2 s each) put its first prediction 24 % short. The job terms measured from a
#: sweep's finished jobs replace these (`Calibration.apply`, the running sweep's calibration
#: and the cached one's job runs).
GPU_JOB_TERMS = JobOverheads(start_s=0.9, setup_s=0.35, warm_s=1.25, tail_s=0.3, eval_tok_s=4.5e-6,
                             eval_gen_fwd_s=0.135, save_s=0.0026)


def gpu_prior(device_name: str | None) -> dict[str, float]:
    for key, numbers in GPU_PRIORS.items():
        if device_name and key in device_name:
            return dict(numbers)
    return dict(GPU_PRIORS["H100"])


def analytic_prior(spec: SweepSpec, hw: Hardware) -> CostModel:
    """The analytic cost model of the sweep's model on ``hw``: FLOPs and bytes from the model's
    shape, the step as the sweep's jobs run it (activation checkpointing or not)."""
    from plora.cost.model import CostModel
    from plora.cost.cpu import cpu_cost_model
    from plora.cost.profiling.cache import shape_from_model

    shape = shape_from_model(spec.model.resolved_path(), spec.model.family, spec.model.dtype, spec.model.quantize)
    targets = list(spec.lora.resolved_targets())
    seq = spec.model.max_seq_len
    if hw.gpu:
        name = None
        if hw.local:
            from plora.gpu_facts import visible_gpus

            gpus = visible_gpus()
            name = gpus[0].name if gpus else None
        prior = CostModel.analytic(shape, seq, hw.gpu_memory_bytes, targets, max_tp=hw.max_tp or hw.slots,
                                   activation_checkpointing=spec.training.checkpointing,
                                   **gpu_prior(name))
        return prior.with_overheads(GPU_JOB_TERMS)
    return cpu_cost_model(shape, seq, targets, **CPU_PRIOR)


def cost_model_for(spec: SweepSpec, run_dir: Path | None, *, probe: bool = False,
                   hardware: Hardware | None = None) -> tuple[CostModel, str]:
    """The cost model a sweep plans with, and where it came from.

    In order: the run directory's profile.json; a cached profile of this model on this
    machine (`plora profile`); on a GPU here, the analytic prior corrected by the cached
    calibration of this model here (`plora.cost.profiling.calibrate`, what earlier sweeps
    measured); else the analytic prior from the model's shape (FLOPs and bytes), on a GPU
    with its memory per adapter counted `MEMORY_MARGIN` times until something is measured.
    A sweep never waits for a profile: ``probe`` is accepted for callers of earlier versions
    and means nothing here (`prepare` measures a few seconds where memory decides the plan).
    """
    from plora.cost.profiling.calibrate import conservative

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


def profiled_model(spec: SweepSpec, run_dir: Path | None, hw: Hardware) -> tuple[CostModel, str] | None:
    """A measured model of the sweep's model, and where it came from: the run directory's
    profile.json, else a profile cached on this machine; None where there is neither."""
    from plora.cost.model import CostModel
    from plora.cost.profiling.profile import profile_sweep

    if run_dir is not None and (run_dir / "profile.json").is_file():
        return CostModel.load(run_dir / "profile.json"), "the run's profile.json"
    cm = profile_sweep(spec, None, cached_only=True) if hw.local else None
    return (cm, "a profile measured on this machine") if cm is not None else None


def cached_calibration(spec: SweepSpec, hw: Hardware) -> Calibration:
    """What earlier sweeps of the model measured on this machine (empty elsewhere)."""
    from plora.cost.profiling.cache import load_calibration
    from plora.cost.profiling.calibrate import Calibration

    return (load_calibration(spec) if hw.local else None) or Calibration()


def priced_for_sweep(spec: SweepSpec, cost_model: CostModel, hw: Hardware, length_buckets: int | str | None = None,
                     row_lengths: list[int] | None = None, row_layout: str | None = None) -> CostModel:
    """A cost model priced on this sweep's own rows (their ``row_lengths`` when already
    tokenized, in its jobs' ``length_buckets``) and eval (`CostModel.for_eval`,
    `CostModel.for_rows`), unless it already is: any model of a GPU sweep, and one with
    measured job terms on a CPU (the CPU's analytic prior stays as it is)."""
    if cost_model.eval_load is not None or (getattr(cost_model, "overheads", None) is None and not hw.gpu):
        return cost_model
    from plora.cost.sweep_rows import eval_load_for, train_row_lengths, train_row_tokens, widest_train_row

    graphed = graphed_steps(spec, hw)
    lengths = row_lengths if row_lengths is not None else train_row_lengths(spec)
    rows = train_row_tokens(spec, graphed=graphed, length_buckets=length_buckets, lengths=lengths,
                            row_layout=row_layout)
    widest = widest_train_row(spec, graphed=graphed, lengths=lengths, row_layout=row_layout) if hw.gpu else None
    return cost_model.for_eval(eval_load_for(spec, hw.gpu)).for_rows(rows, widest)


def sweep_cost_model(spec: SweepSpec, run_dir: Path | None, *, probe: bool = False,
                     hardware: Hardware | None = None, length_buckets: int | str | None = None,
                     row_lengths: list[int] | None = None, row_layout: str | None = None) -> CostModel:
    """The cost model a sweep runs with: `cost_model_for`'s (its source in
    ``meta["plan_source"]``), priced on the sweep's rows (`priced_for_sweep`)."""
    return sweep_models(spec, run_dir, hardware=hardware, length_buckets=length_buckets,
                        row_lengths=row_lengths, row_layout=row_layout).model


@dataclass
class SweepModels:
    """A sweep's cost model and what it was made of: the model measurements correct
    (``prior``: the analytic prior, or a profile, priced on the sweep's rows) and the
    measurements so far (``calibration``; `plora.cost.profiling.calibrate`)."""

    model: CostModel
    prior: CostModel
    calibration: Calibration
    source: str


def sweep_models(spec: SweepSpec, run_dir: Path | None, *, hardware: Hardware | None = None,
                 length_buckets: int | str | None = None, row_lengths: list[int] | None = None,
                 row_layout: str | None = None, loads: Sequence[AdapterLoad] = ()) -> SweepModels:
    """`cost_model_for`'s model priced for the sweep, with its prior and calibration. On a GPU
    without a profile, the analytic prior is priced once and the model made from it: corrected
    by the cached calibration, else with its memory margin, cut where one of the sweep's
    ``loads`` would fit no GPU with it (`plora.cost.profiling.calibrate.conservative`)."""
    from plora.cost.profiling.calibrate import Calibration, conservative

    hw = hardware or hardware_for(spec)

    def priced(model: CostModel, source: str) -> CostModel:
        return priced_for_sweep(spec, model.with_meta(plan_source=source), hw, length_buckets, row_lengths, row_layout)

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
    from plora.job.step_settings import graphs_wanted

    return graphs_wanted(spec.training.cuda_graphs, "cuda" if hw.gpu else "cpu", tp=False,
                         activation_checkpointing=spec.training.checkpointing)


def recalibrated(cost_model: CostModel, drift: Drift) -> CostModel:
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
    return replace(model, job_overhead_s=overhead).with_meta(job_overhead_measured=True)
