"""Packed LoRA kernels: many adapters of their own ranks over one batch of token segments.

Installed as ``plora.kernels``. The public surface:

- `build_lora_meta` / `LoRAMeta`: segment and rank metadata, built once per step and
  shared by every layer;
- `packed_lora_linear`: ``x Wᵀ + b`` plus every adapter's LoRA term on its own segment,
  as one autograd function (Triton on CUDA, the torch reference on CPU);
- `packed_lora_delta`: the LoRA term alone;
- `build_segments`, `segment_sq_norms`, `segmented_adamw_`: per-adapter norms and AdamW
  over one flat buffer that holds every adapter, one launch for the whole pack.
- `fused_linear.linear_lora`: the base product with the LoRA expand fused into its GEMM
  (measured against cuBLAS plus the expand by `scripts/bench_fused_linear.py`; the packed
  layer does not use it, see NOTES.md).

`reference` holds the torch loop that is the CPU path and the test oracle; `triton_ops`
the kernel launchers; both expose ``lora_forward``/``lora_backward`` style ops that work
in place on the base output and on dx.
"""

from .function import backend_for, packed_lora_delta, packed_lora_linear
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
    "segment_sq_norms",
    "segmented_adamw_",
]
