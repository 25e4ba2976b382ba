"""The cost model fitted to measured probes.

* **Fit.** Step time: non-negative least squares on ``[1, Σ bs·seq, Σ r·bs·seq, K,
  buckets]``, or the maximum of that (the GPU) and ``[1, K, buckets]`` (the host issuing
  the step's kernels) when two pieces predict left-out probes clearly better
  (`fit_step_time`); memory: the Appendix-B structure of `CostModel` (base; per adapter a constant, its
  parameters, gradients and AdamW state ∝ rank, activations ∝ bs·seq and ∝ r·bs·seq), all
  coefficients non-negative, calibrated on the measured peaks. Both minimize *relative*
  error, because the planner compares small and large jobs alike. Small packs are
  launch-bound (flat in tokens: on an H200, 150-180 ms per step on the 0.5B shape from 256
  to 4,000 tokens), which one linear form cannot follow next to GPU-bound large packs
  (20-30% errors); the host piece does. Packs whose reserved memory nears the device's are slowed by the
  allocator freeing and retrying; the memory model and the load factor keep the planner's
  packs out of the second regime.
* **TP degree.** One GPU measures d = 1 only. Degrees d > 1 are derived from the d = 1 fit
  with `CostModel.analytic`'s TP scaling (sharded compute and memory divided by d, plus
  its communication terms) and marked ``extrapolated`` in the model's ``meta``.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from plora.cost.model import CostModel, MemoryCoeffs, TimeCoeffs, num_buckets

from plora.models.families.targets import resolve_lora_targets

from plora.models.shape import ModelShape
from plora.cost.profiling.errors import ProfileError
from plora.cost.profiling.probes import Measurement, Probe

TIME_FEATURES = ("c0", "c_tok", "c_rtok", "c_ad", "c_bkt")
MEMORY_FEATURES = ("base", "adapter", "rank", "tok", "rank_tok")


def _time_row(p: Probe, seq: int) -> list[float]:
    return [1.0, float(p.tokens(seq)), float(p.rank_tokens(seq)), float(p.adapters), float(num_buckets(p.ranks))]


#: host-piece forms tried, as columns of `_time_row`: the host issues the same kernels
#: whatever the tokens, so it has a constant, maybe a cost per adapter and per rank bucket
HOST_FORMS = ((0, 3, 4), (0, 3), (0,))
#: the fewest fit probes for which a two-piece step time is tried
MIN_PROBES_TWO_PIECES = 6
#: a two-piece fit must predict left-out probes this much better than one piece to be kept
TWO_PIECE_GAIN = 0.7
#: every host/GPU split is tried up to this many probes (2^n fits), beyond only splits by tokens
EXHAUSTIVE_SPLITS_MAX = 10


def fit_step_time(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Step-time coefficients (the `_time_row` columns): a GPU piece, and a host piece (None
    when one linear form predicts as well).

    The step is ``max(gpu, host)`` (see `plora.cost.model`). Which probes are host-bound is
    unknown, so for each host form (`HOST_FORMS`) the fit searches the splits (all of them
    for up to `EXHAUSTIVE_SPLITS_MAX` probes, else the splits by tokens), refines each by
    reassigning probes to the piece that predicts more, and keeps the split whose maximum
    fits best. Two pieces have up to 8 coefficients for a dozen probes, enough to fit
    noise: the form is chosen by leave-one-out error (each probe predicted by the pieces
    refitted without it), not by the fit's own error.
    """
    n = len(y)

    def rel2(pred: np.ndarray) -> float:
        return float(np.sum((pred / y - 1.0) ** 2))

    def loo_one() -> float:
        err = 0.0
        for i in range(n):
            keep = np.arange(n) != i
            err += (X[i] @ _nnls_relative(X[keep], y[keep]) / y[i] - 1.0) ** 2
        return err

    one = _nnls_relative(X, y)
    if n < MIN_PROBES_TWO_PIECES:
        return one, None
    best_loo, best = loo_one(), (one, None)

    for cols in HOST_FORMS:
        H = X[:, cols]

        def fit_split(gpu: np.ndarray):
            g = h = None
            for _ in range(10):
                if gpu.sum() < 2 or (~gpu).sum() < 1:
                    return None
                g = _nnls_relative(X[gpu], y[gpu])
                h = _nnls_relative(H[~gpu], y[~gpu])
                new = X @ g >= H @ h
                if (new == gpu).all():
                    break
                gpu = new
            return rel2(np.maximum(X @ g, H @ h)), g, h, gpu

        if n <= EXHAUSTIVE_SPLITS_MAX:
            splits = (np.array([(m >> i) & 1 for i in range(n)], dtype=bool) for m in range(1, (1 << n) - 1))
        else:
            order = np.argsort(X[:, 1], kind="stable")  # by tokens
            splits = (np.isin(np.arange(n), order[k:]) for k in range(1, n))
        found = None
        for split in splits:
            got = fit_split(split)
            if got is not None and (found is None or got[0] < found[0]):
                found = got
        if found is None:
            continue
        _, g, h, gpu = found
        loo = 0.0  # the split fixed, each probe predicted by both pieces refitted without it
        for i in range(n):
            keep = np.arange(n) != i
            gk, hk = gpu & keep, ~gpu & keep
            if gk.sum() < 1 or hk.sum() < 1:
                loo = np.inf
                break
            pred = max(X[i] @ _nnls_relative(X[gk], y[gk]), H[i] @ _nnls_relative(H[hk], y[hk]))
            loo += (pred / y[i] - 1.0) ** 2
        if loo < TWO_PIECE_GAIN * best_loo:
            host = np.zeros(X.shape[1])
            host[list(cols)] = h
            best_loo, best = loo, (g, host)
    return best


def _memory_row(p: Probe, seq: int) -> list[float]:
    return [1.0, float(p.adapters), float(p.rank_sum), float(p.tokens(seq)), float(p.rank_tokens(seq))]


def _nnls_relative(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative errors: min Σ ((Xc - y) / y)² with c >= 0."""
    from scipy.optimize import nnls

    w = 1.0 / np.maximum(np.abs(y), 1e-30)
    A = X * w[:, None]
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(A / scale, y * w)
    return coef / scale


def fit_cost_model(
    measurements: Sequence[Measurement],
    shape: ModelShape,
    seq_len: int,
    gpu_memory_bytes: float,
    *,
    targets: str | Iterable[str] | None = None,
    tp_degrees: Iterable[int] = (1,),
    name: str | None = None,
    meta: dict[str, Any] | None = None,
) -> CostModel:
    """A `CostModel` fitted on measured probes (d = 1), extended to ``tp_degrees``.

    Only probes that ran (no OOM) count. Time: ``t = c0 + c_tok·Σbs·seq + c_rtok·Σr·bs·seq
    + c_ad·K + c_bkt·buckets``, or the larger of that and a host piece ``h0 + h_ad·K +
    h_bkt·buckets`` where that predicts left-out probes clearly better (`fit_step_time`); memory: ``base + Σ_k (adapter + rank·r_k + tok·bs_k·seq + rank_tok·r_k·bs_k·seq)``;
    every coefficient non-negative, relative errors minimized.
    """
    good = [m for m in measurements if m.ok]
    if len(good) < len(MEMORY_FEATURES):
        failed = [m.error for m in measurements if m.error and not m.oom]
        why = f" (first failure: {failed[0]})" if failed else ""
        raise ProfileError(f"need at least {len(MEMORY_FEATURES)} probes that ran to fit the cost model, "
                           f"got {len(good)}{why}")
    seqs = {m.seq_len for m in good}
    if seqs != {int(seq_len)}:
        raise ProfileError(f"probes were measured at sequence lengths {sorted(seqs)}, not {seq_len}")
    seq = int(seq_len)
    Xt = np.array([_time_row(m.probe, seq) for m in good])
    yt = np.array([m.step_time for m in good])
    Xm = np.array([_memory_row(m.probe, seq) for m in good])
    ym = np.array([m.peak_bytes for m in good])
    ct, host = fit_step_time(Xt, yt)
    cm_ = _nnls_relative(Xm, ym)
    t1 = TimeCoeffs(*(float(v) for v in ct))
    m1 = MemoryCoeffs(*(float(v) for v in cm_))
    names = resolve_lora_targets(targets)
    degrees = sorted(set(int(d) for d in tp_degrees) | {1})
    time_c, mem_c = _extend_tp(t1, m1, shape, seq, gpu_memory_bytes, names, degrees)
    # every TP rank issues the same launches: the host piece is the same at every degree
    host_c = {d: TimeCoeffs(*(float(v) for v in host)) for d in degrees} if host is not None else {}
    pred_t = Xt @ ct if host is None else np.maximum(Xt @ ct, Xt @ host)
    fit_t = pred_t / yt - 1.0
    fit_m = Xm @ cm_ / ym - 1.0
    info = {
        "source": "profile",
        "shape": shape.to_dict(),
        "targets": list(names),
        "measured_degrees": [1],
        "extrapolated_degrees": [d for d in degrees if d != 1],
        "tp_extrapolation": "CostModel.analytic TP scaling of the d=1 fit (activation_checkpointing=False)",
        "probes_used": len(good),
        "fit_max_abs_err": {"time": float(np.max(np.abs(fit_t))), "memory": float(np.max(np.abs(fit_m)))},
        "memory_measure": "cuda reserved peak + context" if any(m.reserved_peak for m in good) else "process rss",
        **(meta or {}),
    }
    info["step_time_pieces"] = 1 if host is None else 2
    return CostModel(float(gpu_memory_bytes), seq, time_c, mem_c, name=name or f"{shape.name}@{seq}", meta=info,
                     host_time=host_c)


def _extend_tp(t1: TimeCoeffs, m1: MemoryCoeffs, shape: ModelShape, seq: int, gpu_memory_bytes: float,
               targets: Sequence[str], degrees: Sequence[int]) -> tuple[dict[int, TimeCoeffs], dict[int, MemoryCoeffs]]:
    """Coefficients at d > 1 from the measured d = 1 ones and the analytic model's ratios.

    Compute that is sharded (base GEMMs, LoRA products, sharded activations and logits,
    sharded LoRA parameters, the weights) scales as the analytic model says; the measured
    fixed overheads (step constant, per-adapter cost, runtime memory) are kept; the
    analytic all-reduce time per token and latency are added.
    """
    time_c, mem_c = {1: t1}, {1: m1}
    extra = [d for d in degrees if d != 1]
    if not extra:
        return time_c, mem_c
    an = CostModel.analytic(shape, seq, gpu_memory_bytes, targets, activation_checkpointing=False,
                            tp_degrees=[1, *extra])
    a1t, a1m = an.time[1], an.memory_coeffs[1]
    weights = float(shape.n_params * shape.dtype_bytes)

    def ratio(num: float, den: float) -> float:
        return num / den if den > 0 else 1.0

    for d in extra:
        at, am = an.time[d], an.memory_coeffs[d]
        comm_tok = max(0.0, at.c_tok - a1t.c_tok / d)
        time_c[d] = TimeCoeffs(
            c0=max(0.25 * t1.c0, t1.c0 + (at.c0 - a1t.c0)),
            c_tok=t1.c_tok / d + comm_tok,
            c_rtok=t1.c_rtok * ratio(at.c_rtok, a1t.c_rtok),
            c_ad=t1.c_ad,
            c_bkt=t1.c_bkt,
        )
        mem_c[d] = MemoryCoeffs(
            base=max(0.0, m1.base - weights) + weights / d,
            adapter=m1.adapter,
            rank=m1.rank * ratio(am.rank, a1m.rank),
            tok=m1.tok * ratio(am.tok, a1m.tok),
            rank_tok=m1.rank_tok,
        )
    return time_c, mem_c
