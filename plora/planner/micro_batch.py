"""The micro-batch of an adapter whose effective batch does not fit one pass.

A space's ``batch_size`` is an adapter's effective batch. Where no ``training.micro_batch_size``
is set and an adapter's one-pass load exceeds a GPU's share of memory even alone, at the
lowest TP degree at which it can run at all, the sweep would otherwise plan a job that runs
out of memory (and is split by the engine, or fails). Instead the planner trains that
adapter over the fewest power-of-two parts that fit (`plora.data.accumulation` cuts its
batch into near-equal parts: ceil(B / 2**j) rows each); adapters that fit keep one pass,
so a space that fits is planned exactly as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from plora.cost.model import AdapterLoad, CostModel, packed_load
from plora.data.accumulation import accumulation_steps


def lowest_degree(model: CostModel, load: AdapterLoad, load_factor: float) -> int | None:
    """The smallest TP degree of ``model`` at which ``load`` alone runs with one row per
    step (None: at none, so no micro-batch makes it fit)."""
    row = packed_load(load.id, load.rank, load.batch_size, load.steps, 1)
    return next((d for d in sorted(model.degrees) if model.fits([row], d, load_factor)), None)


def micro_batch_for(load: AdapterLoad, model: CostModel, load_factor: float) -> int | None:
    """The largest micro-batch (of power-of-two parts) at which ``load`` (one pass of its
    effective batch) fits alone at its lowest TP degree; None where one pass fits (or nothing does)."""
    d = lowest_degree(model, load, load_factor)
    if d is None or model.fits([load], d, load_factor):
        return None
    parts = 2
    while True:
        micro = -(-load.batch_size // parts)
        if model.fits([packed_load(load.id, load.rank, load.batch_size, load.steps, micro)], d, load_factor):
            return micro
        if micro == 1:
            return None
        parts *= 2


def micro_batches_for(loads: Sequence[AdapterLoad], model: CostModel, load_factor: float) -> dict[str, int]:
    """Adapter id -> the micro-batch the planner chose, for the ``loads`` (one pass each)
    that need one; the others are absent."""
    out = {}
    for a in loads:
        micro = micro_batch_for(a, model, load_factor)
        if micro is not None:
            out[a.id] = micro
    return out


#: how `accumulation_note`'s line starts (a plan's notes are searched for it)
ACCUMULATION_NOTE = "gradient accumulation chosen for memory"


def accumulation_note(batch_sizes: Mapping[str, int], micro_batches: Mapping[str, int]) -> str:
    """One line for the user: which adapters the planner made accumulate, and in how many parts."""
    by_parts: dict[tuple[int, int], list[str]] = {}
    for aid, micro in sorted(micro_batches.items()):
        parts = accumulation_steps(batch_sizes[aid], micro)
        by_parts.setdefault((parts, micro), []).append(aid)
    groups = [f"{', '.join(ids)} in {parts} parts of at most {micro} rows"
              for (parts, micro), ids in sorted(by_parts.items())]
    return (f"{ACCUMULATION_NOTE} ({len(micro_batches)} adapter"
            f"{'s' if len(micro_batches) != 1 else ''} whose batch does not fit one pass): " + "; ".join(groups))
