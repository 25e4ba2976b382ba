"""A job config from a sweep's spec: the spec's settings with the sweep's decisions made for
one job's adapters (step budgets, warm-ups, the LoRA targets resolved for the model's
family, the sweep's row layout and streaming). What `plora.sweep` and `plora.tuning` write
as each job's job.yaml (`plora.job.config.JobConfig`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING


from plora.data.check import data_config, eval_config
from plora.engine.streaming import STREAM_LINGER_S
from plora.hardware import Hardware, sweep_on_gpu
from plora.job.config import JobAdapter, JobConfig, JobLora, JobModel, JobStreaming, JobTraining
from plora.spec.adapter import AdapterConfig
from plora.spec.schema import SweepSpec

if TYPE_CHECKING:
    from plora.planner.plan import Job
    from plora.tuning.fidelity import Rungs


def model_targets(spec: SweepSpec, targets: str | Sequence[str] | None = None) -> list[str]:
    """The layers a job adapts: ``targets`` (default ``lora.targets``) resolved for the
    model's family (Phi-3's ``all-linear`` is its fused qkv_proj/gate_up_proj, not llama's
    seven layers)."""
    from plora.models.folders import read_model_info
    from plora.spec.model import resolve_targets

    family = read_model_info(spec.model.resolved_path(), spec.model.family).family
    return resolve_targets(spec.lora.targets if targets is None else list(targets), family)


def job_adapter(spec: SweepSpec, cfg: AdapterConfig, steps: int, rungs: Rungs | None = None, *,
                micro_batch_size: int | None = None) -> JobAdapter:
    """One adapter as a job trains it: its configuration, step budget, warm-up, its own
    training settings (the sweep's where it sets none), the steps a tune's rungs score
    it at (`plora.tuning.fidelity`) and the micro-batch the planner chose for it (None: the
    job's ``training.micro_batch_size``; a user's setting wins, so it is never given then)."""
    if spec.training.micro_batch_size is not None:
        micro_batch_size = None
    s = spec.settings(cfg)
    return JobAdapter(id=cfg.id, rank=cfg.rank, alpha=cfg.alpha, learning_rate=cfg.learning_rate,
                      batch_size=cfg.batch_size, seed=cfg.seed, steps=steps, warmup_steps=spec.warmup_for(cfg, steps),
                      dropout=s["dropout"], weight_decay=s["weight_decay"], scheduler=s["scheduler"],
                      rslora=s["rslora"], eval_steps=rungs.eval_steps(steps) if rungs is not None else [],
                      micro_batch_size=micro_batch_size)


def adapter_targets(spec: SweepSpec, configs: Sequence[AdapterConfig]) -> list[str]:
    """The layers a job of ``configs`` adapts, resolved for the model's family: their one
    target set (adapters of different sets never share a job: `plan_jobs`)."""
    from plora.spec.adapter import target_names

    sets = spec.target_sets(configs)
    if len(sets) > 1:
        raise ValueError(f"adapters of different target sets in one job: {', '.join(sets)}")
    if not sets or sets[0] == spec.sweep_values()["targets"]:
        return model_targets(spec)
    return model_targets(spec, target_names(sets[0]))


def check_target_sets(spec: SweepSpec, configs: Sequence[AdapterConfig]) -> None:
    """Every target set the space searches names layers the model's family has (a
    `SpecError` naming ``space.targets`` otherwise), before anything runs."""
    from plora.spec.adapter import target_names
    from plora.spec.base import SpecError

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
               hardware: Hardware | None = None, rungs: Rungs | None = None,
               micro_batches: Mapping[str, int] | None = None) -> JobConfig:
    """The recipe config of one job (what `tune run` reads, as job.yaml): the spec's
    settings with the sweep's decisions made for the job's ``adapters`` (its configurations,
    in its order): step budgets, warm-ups, resolved targets. ``streaming``: the job's
    streaming section when whoever runs it sends it joins itself (default: from
    ``planner.streaming`` on the sweep's ``hardware``). ``length_buckets``, ``row_layout``:
    the sweep's resolved ones (default the spec's). ``rungs``: a tune's pruner's, at which
    each adapter is scored (`plora.tuning.fidelity`). ``micro_batches``: the plan's
    micro-batch per adapter id where the planner chose one (`plora.planner.micro_batch`)."""
    t = spec.training
    micro = micro_batches or {}
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
        adapters=[job_adapter(spec, a, steps[a.id], rungs, micro_batch_size=micro.get(a.id)) for a in adapters],
        training=JobTraining(
            scheduler=t.scheduler, grad_clip=t.grad_clip, weight_decay=t.weight_decay,
            divergence_loss=t.divergence_loss, activation_checkpointing=t.checkpointing,
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
