"""Packed LoRA kernels: many adapters of their own ranks over one batch of token segments.

Imported as ``plora.kernels`` (``plora/kernels`` links here). The public surface:

- `build_lora_meta` / `LoRAMeta`: segment and rank metadata, built once per step and
  shared by every layer;
- `packed_lora_linear`: ``x Wᵀ + b`` plus every adapter's LoRA term on its own segment,
  as one autograd function (Triton on CUDA, the torch reference on CPU);
- `packed_lora_delta`: the LoRA term alone;
- `build_segments`, `segment_sq_norms`, `segmented_adamw_`: per-adapter norms and AdamW
  over one flat buffer that holds every adapter, one launch for the whole pack;
- `cross_entropy.cross_entropy_rows`: the LM head's loss and the gradient of its logits in
  one pass over them (imported where the loss runs, not here).

Tuned tiles are data, one file per GPU model in ``tiles/`` (`tile_tables`). Experiments that
the packed layer does not use (the expand fused into the base GEMM) live with the benchmarks
in ``scripts/experiments/``.

`compile_ahead` compiles, on threads, every kernel variant a step will launch before its
first launch (the ops run once with their launches collected, `triton_ops.collecting`).

`reference` holds the torch loop that is the CPU path and the test oracle; `triton_ops`
the kernel launchers; both expose ``lora_forward``/``lora_backward`` style ops that work
in place on the base output and on dx.
"""

from .function import backend_for, packed_lora_delta, packed_lora_linear, scales_on_device
from .meta import MAX_RANK, LoRAMeta, build_lora_meta, rank_bucket
from .segments import Segments, adamw_hyperparams, build_segments, segment_sq_norms, segmented_adamw_

__all__ = [
    "MAX_RANK",
    "LoRAMeta",
    "Segments",
    "adamw_hyperparams",
    "build_segments",
    "backend_for",
    "build_lora_meta",
    "packed_lora_delta",
    "packed_lora_linear",
    "rank_bucket",
    "scales_on_device",
    "segment_sq_norms",
    "segmented_adamw_",
]
