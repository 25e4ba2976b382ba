"""The torch reference of the packed LoRA ops: a loop over adapters, fp32 accumulation.

This is the CPU path and the oracle the Triton kernels are tested against. It computes the
same quantities, in the same layouts, as the kernels (see `triton_ops`), so the autograd
function can call either one:

- forward:  S'_k = s_k x_k A_kᵀ (kept for backward), y_k += S'_k B_k
- backward: dS_k = s_k dy_k B_kᵀ, dB_k = S'_kᵀ dy_k (= s_k S_kᵀ dy_k), dA_k = dS_kᵀ x_k,
  dx_k += dS_k A_k

where B_k is stored transposed (r_k × out). S' and dS live in one packed buffer: adapter k's
n_k rows start at ``meta.s_offsets_host[k]``, with row stride ``meta.bucket_of_host[k]`` (the first
r_k columns are used). Arithmetic is in float32, or float64
when the inputs are float64 (the test oracle).
"""

from __future__ import annotations

import torch

from .meta import LoRAMeta


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64 on ``got``'s device (inf when ``got`` is not finite):
    how the kernels are judged against this reference, in tests and benchmarks alike."""
    got, want = got.double(), want.to(got.device, torch.float64)
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _blocks(meta: LoRAMeta):
    """(k, token slice, rank slice, packed-buffer slice, scale) of each adapter with tokens."""
    for k, n in enumerate(meta.tokens_host):
        if n == 0:
            continue
        t0, t1 = meta.token_starts_host[k], meta.token_starts_host[k + 1]
        r0, r1 = meta.rank_starts_host[k], meta.rank_starts_host[k + 1]
        s0, s1 = meta.s_offsets_host[k], meta.s_offsets_host[k + 1]
        yield k, slice(t0, t1), slice(r0, r1), slice(s0, s1), meta.scales_host[k]


def _rows(buf: torch.Tensor, ts: slice, rs: slice, ss: slice) -> torch.Tensor:
    """Adapter k's n_k × r_k view of a packed low-rank buffer (rows as wide as its bucket)."""
    n = ts.stop - ts.start
    return buf[ss].view(n, (ss.stop - ss.start) // n)[:, : rs.stop - rs.start]


def lora_forward_ref(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, meta: LoRAMeta, y: torch.Tensor
) -> torch.Tensor:
    """Accumulate the LoRA term into ``y`` in place; return the packed S' (acc dtype)."""
    acc = _acc_dtype(x)
    S = torch.zeros(meta.s_numel, dtype=acc, device=x.device)
    for _, ts, rs, ss, scale in _blocks(meta):
        sk = (x[ts].to(acc) @ A[rs].to(acc).t()) * scale
        _rows(S, ts, rs, ss).copy_(sk)
        y[ts] = (y[ts].to(acc) + sk @ B[rs].to(acc)).to(y.dtype)
    return S


def lora_backward_ref(
    dy: torch.Tensor,
    x: torch.Tensor,
    S: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    meta: LoRAMeta,
    dx: torch.Tensor | None,
    need_dx: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of A and B, and the LoRA part of dx.

    ``dx`` given: the LoRA part is added into it in place and it is returned. ``dx`` None
    and ``need_dx``: a fresh tensor (zeros outside the segments) holds the LoRA part alone.
    """
    acc = _acc_dtype(dy)
    dA = torch.zeros_like(A)
    dB = torch.zeros_like(B)
    if need_dx and dx is None:
        dx = torch.zeros_like(x)
    for _, ts, rs, ss, scale in _blocks(meta):
        dyk = dy[ts].to(acc)
        sk = _rows(S, ts, rs, ss).to(acc)
        dsk = (dyk @ B[rs].to(acc).t()) * scale
        dB[rs] = (sk.t() @ dyk).to(dB.dtype)
        xk = x[ts].to(acc)
        dA[rs] = (dsk.t() @ xk).to(dA.dtype)
        if need_dx:
            dx[ts] = (dx[ts].to(acc) + dsk @ A[rs].to(acc)).to(dx.dtype)
    return dA, dB, (dx if need_dx else None)
