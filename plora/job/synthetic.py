"""A job of fixed-length random rows on a random-init model: what the profiler's probes and
the benchmarks run where only shapes matter (no data files, no eval)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plora.job.config import (
    JobAdapter,
    JobConfig,
    JobData,
    JobEval,
    JobLora,
    JobModel,
    JobTraining,
    SyntheticRows,
)


def synthetic_job_config(job_id: str, model_dir: str | Path, adapters: Sequence[tuple[int, int]], *, seq_len: int,
                         dtype: str, device: str, targets: Sequence[str], output_dir: str | Path = ".",
                         family: str = "auto", dropout: float = 0.0, tp: int | None = None,
                         num_threads: int | None = None, steps: int = 10**9, learning_rate: float = 1e-4,
                         num_samples: int | None = None, adapter_ids: Sequence[str] | None = None,
                         activation_checkpointing: bool = False, cuda_graphs: Any = "auto",
                         quantize: str | None = None) -> JobConfig:
    """One packed job of ``adapters`` ((rank, batch size) each; adapter k has alpha 2·rank and
    seed k) on the model folder ``model_dir`` (random weights), fixed-length random rows of
    ``seq_len`` tokens (``num_samples`` of them: by default enough for the largest batch);
    the base's block linears held as ``quantize`` says (``model.quantize``)."""
    ids = list(adapter_ids) if adapter_ids is not None else [f"{job_id}-{k}" for k in range(len(adapters))]
    rows = num_samples if num_samples is not None else max(16, max(b for _, b in adapters))
    return JobConfig(
        job_id=job_id,
        output_dir=Path(output_dir),
        device=device,
        tp=tp,
        num_threads=num_threads,
        seed=0,
        model=JobModel(path=str(model_dir), family=family, max_seq_len=int(seq_len), dtype=dtype, random_init=True,
                       quantize=quantize),
        data=JobData(synthetic=SyntheticRows(seq_len=int(seq_len), num_samples=int(rows))),
        lora=JobLora(targets=list(targets), dropout=float(dropout)),
        adapters=[JobAdapter(id=ids[k], rank=r, alpha=2.0 * r, learning_rate=learning_rate, batch_size=b, seed=k,
                             steps=steps)
                  for k, (r, b) in enumerate(adapters)],
        training=JobTraining(scheduler="constant", grad_clip=1.0, weight_decay=0.0,
                             activation_checkpointing=bool(activation_checkpointing), cuda_graphs=cuda_graphs),
        eval=JobEval(metrics=[]),
    )
