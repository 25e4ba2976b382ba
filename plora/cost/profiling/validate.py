"""The fitted model against measured packs: what `plora profile` prints and profile.json
keeps. Packs left out of the fit (`plora.cost.profiling.probes.holdout_probes`, `limit_probes`)
say how far the planner can trust it; a pack predicted to fit that ran out of memory is
counted apart, because that is the error that costs a sweep."""

from __future__ import annotations

from typing import Any, Sequence

from plora.cost.model import CostModel
from plora.cost.profiling.probes import Measurement


def prediction_errors(cm: CostModel, measurements: Sequence[Measurement], load_factor: float = 0.9,
                      d: int = 1) -> list[dict[str, Any]]:
    """Per measured pack: predicted vs measured step time and peak memory, and whether
    the model said it fits (at ``load_factor``) and whether it ran out of memory."""
    rows = []
    for m in measurements:
        loads = m.probe.loads()
        pt, pm = cm.step_time(loads, d), cm.memory(loads, d)
        rows.append({
            "probe": m.probe.name,
            "role": m.probe.role,
            "label": m.probe.label(),
            "tokens": m.probe.tokens(m.seq_len),
            "measured_s": m.step_time if m.ok else None,
            "predicted_s": pt,
            "time_err": (pt / m.step_time - 1.0) if m.ok else None,
            "measured_bytes": m.peak_bytes if m.ok else None,
            "allocated_bytes": m.allocated_bytes if m.ok else None,
            "predicted_bytes": pm,
            "memory_err": (pm / m.peak_bytes - 1.0) if m.ok else None,
            "predicted_share": pm / cm.gpu_memory_bytes,
            "fits": cm.fits(loads, d, load_factor),
            "oom": m.oom,
        })
    return rows


def summarize_errors(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Max and mean absolute relative errors, and predicted fits that ran out of memory."""
    te = [abs(r["time_err"]) for r in rows if r["time_err"] is not None]
    me = [abs(r["memory_err"]) for r in rows if r["memory_err"] is not None]
    return {
        "packs": len(rows),
        "time_max_abs_err": max(te) if te else None,
        "time_mean_abs_err": sum(te) / len(te) if te else None,
        "memory_max_abs_err": max(me) if me else None,
        "memory_mean_abs_err": sum(me) / len(me) if me else None,
        "predicted_fit_oom": sum(1 for r in rows if r["fits"] and r["oom"]),
        "oom": sum(1 for r in rows if r["oom"]),
    }
