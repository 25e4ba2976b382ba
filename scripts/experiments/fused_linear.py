"""The base linear layer and the LoRA expand as one kernel (the "fused" path): an experiment
measured by `scripts/bench_fused_linear.py`, kept out of the runtime package because the packed
layer does not use it (kernels/NOTES.md says why).

Unfused, a packed layer's forward is ``y = x Wᵀ + b`` (cuBLAS), then ``y += S' B`` per
segment (`triton_ops.expand_stage`), which reads and writes all of y once more; its dx is
``dy W``, then ``dx += dS A``. Here the LoRA factor becomes extra steps of the base GEMM's
reduction: each output tile adds ``S'_k B_k`` for the segments crossing its rows before it
is stored, so y and dx are written once and never re-read. The price is that the base
product runs in Triton instead of cuBLAS; `scripts/bench_fused_linear.py` measures both.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from pathlib import Path

from plora.kernels import triton_ops
from plora.kernels.meta import LoRAMeta

_KERNELS = Path(__file__).with_name("_fused_linear_kernels.py")


@dataclass(frozen=True)
class GemmTiles:
    """BM × BN output tile, BK reduction step, warps, pipeline stages, row tiles per group."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    warps: int = 8
    stages: int = 3
    group_m: int = 8
    tma: bool = False  # read X and W by TMA (host tensor descriptors), where their rows are 16-byte aligned


TILES = GemmTiles()


def _tables(meta: LoRAMeta, rows: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row tile, its first segment ending past the tile's first row (K: none); per
    adapter, its bucket (the row stride of its low-rank rows). Once per step and shape."""
    def build() -> tuple[torch.Tensor, torch.Tensor]:
        ends = meta.token_starts_host[1:]
        seg0 = [bisect.bisect_right(ends, m0) for m0 in range(0, rows, bm)]
        buckets = list(meta.bucket_of_host) or [0]
        return tuple(torch.tensor(v, dtype=torch.int32).to(meta.device, non_blocking=True) for v in (seg0 or [0], buckets))

    return triton_ops._cached(meta, ("linear_lora", rows, bm), build)


def linear_lora(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    P: torch.Tensor | None,
    L: torch.Tensor,
    meta: LoRAMeta,
    *,
    weight_is_out_in: bool = True,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """``x Wᵀ + b + concat_k(P_k L_k)`` (``weight_is_out_in``: W is out × in, the forward
    with P = S', L = B) or ``x W + concat_k(P_k L_k)`` (W is in × out as stored, so for dx:
    x = dy, P = dS, L = A). ``P`` None: the base product alone. A new tensor."""
    cfg = tiles or TILES
    x = x if x.stride(-1) == 1 else x.contiguous()
    M, KD = x.shape
    N = weight.shape[0] if weight_is_out_in else weight.shape[1]
    if (weight.shape[1] if weight_is_out_in else weight.shape[0]) != KD:
        raise ValueError(f"linear_lora: x has {KD} columns, the weight is {tuple(weight.shape)}")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    lora = P is not None and meta.num_tokens > 0 and meta.total_rank > 0
    if lora and L.shape[1] != N:
        raise ValueError(f"linear_lora: the LoRA factor has {L.shape[1]} columns, the output {N}")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    L = L if L.stride(-1) == 1 else L.contiguous()
    seg0, buckets = _tables(meta, M, cfg.bm)
    br = min(max(meta.bucket_of_host, default=16), cfg.bk, 64)
    stride_wk, stride_wn = (weight.stride(1), weight.stride(0)) if weight_is_out_in else (weight.stride(0), 1)
    k = triton_ops.kernels_module(_KERNELS)
    grid = (triton_ops._cdiv(M, cfg.bm) * triton_ops._cdiv(N, cfg.bn),)
    tables = (seg0, meta.token_starts, meta.rank_starts, meta.ranks, meta.s_offsets, buckets)
    common = dict(BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, BR=br, HAS_BIAS=bias is not None,
                  LORA=lora, IEEE=x.dtype == torch.float32, num_warps=cfg.warps)
    bias_p, p_p = (bias if bias is not None else out), (P if lora else out)
    if cfg.tma and all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (x, weight)):
        from triton.tools.tensor_descriptor import TensorDescriptor

        xd = TensorDescriptor.from_tensor(x, [cfg.bm, cfg.bk])
        wd = TensorDescriptor.from_tensor(weight, [cfg.bn, cfg.bk] if weight_is_out_in else [cfg.bk, cfg.bn])
        kernel = k.linear_lora_tma_kernel
        args = (xd, wd, bias_p, p_p, L, out, *tables, M, N, KD, meta.num_adapters, L.stride(0), out.stride(0))
        kw = dict(common, W_NK=weight_is_out_in, STAGES=cfg.stages)
    else:
        kernel = k.linear_lora_kernel
        args = (x, weight, bias_p, p_p, L, out, *tables, M, N, KD, meta.num_adapters,
                x.stride(0), stride_wk, stride_wn, L.stride(0), out.stride(0))
        kw = dict(common, EVEN_K=KD % cfg.bk == 0, num_stages=cfg.stages)
    triton_ops._launch(kernel, grid, *args, **kw)
    return out
