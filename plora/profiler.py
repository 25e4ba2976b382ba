"""The job config of a probe: the recipe config `plora.profiling.measure.run_probe` builds
a probe's packed job from (a random-init model, fixed-length synthetic rows).

The profiler itself is `plora.profiling`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from plora.profiling.probes import Probe


def probe_job_config(model_dir: str | Path, probe: Probe, *, seq_len: int, dtype: str, device: str,
                     targets: Sequence[str], family: str = "auto", dropout: float = 0.0,
                     output_dir: str | Path = ".", num_threads: int | None = None,
                     activation_checkpointing: bool = False, cuda_graphs: Any = "auto") -> dict[str, Any]:
    """The recipe config of a probe: a random-init model, fixed-length synthetic rows."""
    return {
        "job_id": f"probe-{probe.name}",
        "output_dir": str(output_dir),
        "device": device,
        "num_threads": num_threads,
        "seed": 0,
        "model": {"path": str(model_dir), "family": family, "max_seq_len": int(seq_len), "dtype": dtype,
                  "random_init": True},
        "data": {"synthetic": {"seq_len": int(seq_len), "num_samples": max(16, max(probe.batch_sizes))}},
        "lora": {"targets": list(targets), "dropout": float(dropout)},
        "adapters": [
            {"id": f"{probe.name}-{k}", "rank": r, "alpha": 2.0 * r, "learning_rate": 1e-4, "batch_size": b,
             "seed": k, "steps": 10**9}
            for k, (r, b) in enumerate(zip(probe.ranks, probe.batch_sizes))
        ],
        "training": {"scheduler": "constant", "grad_clip": 1.0, "weight_decay": 0.0,
                     "activation_checkpointing": bool(activation_checkpointing), "cuda_graphs": cuda_graphs},
        "eval": {"metrics": []},
    }
