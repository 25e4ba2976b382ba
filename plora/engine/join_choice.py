"""Which waiting adapters join which running job, decided online from the cost model.

The streaming engine (`plora.engine.streaming`) calls `choose_joins` at every tick with the
running one-GPU packs (each adapter with the steps it has left) and the adapters of the
queued jobs not started yet. The goal is the sweep's end, so the rule is list scheduling
with the longest work first (LPT), packs as the machines:

1. **Longest first.** Waiting adapters are taken in decreasing order of their solo span:
   steps x the step time of a pack of that adapter alone (`solo_span`; without a cost
   model, steps). An adapter started late is the sweep's tail; a short one fills in
   anywhere. Ties keep the queue's order. Adapters of jobs the engine put first in line
   (the halves of a job that ran out of memory: their turn had come) go before the rest.
2. **Room.** A pack can take an adapter only when the grown pack fits: the cost model's
   memory within the planner's load factor, and ``planner.max_adapters_per_job`` (the
   engine's ``fits``).
3. **Throughput.** A pack holds back an adapter that would lower its real tokens per
   second (`keeps_throughput`: the newcomer's tokens cost more per token than the pack's
   average, as for a large rank among small ones, or a few rows that open a new rank
   bucket, a fixed cost on every step), but only while the adapter can wait
   (`held_back`): while its solo span is shorter than the pack's predicted remaining
   time. It joins later, once the pack has drained enough: a pack's average falls as its
   adapters leave (an empty pack takes any adapter that fits), and the hold ends at the
   latest when the pack has no more than the adapter's span left, so the adapter still
   ends about when the pack would have. A long adapter is never held back: holding it
   would make it the sweep's tail, which is what (1) avoids. A held-back adapter reserves no pack (5): adapters that keep the
   pack's rate may pass it.
4. **Where.** Among the packs with room, the one whose predicted remaining time once grown
   is shortest (`remaining_seconds`: the cost model's time of the steps each adapter has
   left, with adapters leaving as they finish; without a cost model, the most steps left):
   the adapter's work ends soonest there, and a pack that ends late is not made to end
   later while another can take the adapter. Ties:
   the pack with fewer real tokens per step, then the one started first.
5. **No overtaking.** An adapter that fits a pack alone but that no pack has room for
   now (memory or adapter count) reserves, of the packs without room, the one predicted
   to drain first: that pack takes no shorter adapter in this tick, so it drains to the
   long one instead of being kept full by short ones (backfilling with one reservation
   per blocked adapter, as EASY backfilling does). An adapter that does not fit a pack
   even alone reserves nothing: it waits for its own queued job.

The queue's order is the planner's predicted launch order (`plora.planner.scheduler`
replays the cost model): a prediction, not an order the user asked for, so the rule may
take its adapters in any order. The one order that is a promise, the engine's first-in-line
jobs, is kept (1).

Everything here is pure: loads and a cost model in, a choice out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from plora.cost.model import AdapterLoad, CostModel

#: the TP degree of a job that takes joins: the recipe refuses joins into a tensor-parallel
#: job (`PackedLoRARecipe._take_joins`), so the engine never sends it any
JOIN_TP = 1
#: why a running tensor-parallel job is sent no adapters (the engine's journal says it once)
TP_JOIN_REFUSAL = "a tensor-parallel job takes no joins"

#: an adapter whose steps left take at most this long counts as gone when joins are chosen
#: (`staying`): twice the engine's view of a job can lag (progress every 0.5 s, a tick of
#: 0.25 s, the job's next step boundary)
LEAVING_SOON_S = 2.0
#: the same without a cost model to time steps
LEAVING_SOON_STEPS = 8

#: whether a pack of these adapters fits one GPU (memory and the planner's adapter cap)
Fits = Callable[[Sequence[AdapterLoad]], bool]


@dataclass(frozen=True)
class RunningPack:
    """A running job that may take joins: its adapters still training, each with the
    steps it has left (``steps``), in the engine's order (the order jobs started)."""

    job_id: str
    training: tuple[AdapterLoad, ...]
    #: the layers its adapters adapt (a `plora.spec.adapter.target_key`): only adapters of the same
    #: set may join (None: any)
    targets: str | None = None


def join_refusal(tp: int) -> str | None:
    """Why a running job at TP degree ``tp`` takes no joins (None: it takes them)."""
    return None if tp == JOIN_TP else TP_JOIN_REFUSAL


def pack_fits(loads: Sequence[AdapterLoad], tp: int, cost: CostModel | None, *, max_adapters: int,
              load_factor: float) -> bool:
    """Whether adapters training at once in one job fit it: at most ``max_adapters`` of
    them and, with a cost model, its memory at TP ``tp`` within ``load_factor`` of the GPU."""
    if len(loads) > max_adapters:
        return False
    return cost is None or cost.fits(loads, tp, load_factor)


def steps_left(loads: Sequence[AdapterLoad], done: Mapping[str, int]) -> tuple[AdapterLoad, ...]:
    """The loads with the steps each has left after ``done`` (adapter id -> steps taken; an
    adapter missing from it has taken none)."""
    return tuple(replace(a, steps=max(0, a.steps - int(done.get(a.id, 0)))) for a in loads)


def _timed(cost: CostModel | None) -> CostModel | None:
    """The cost model when it can time a joinable pack, else None (step counts decide)."""
    return cost if cost is not None and JOIN_TP in cost.time else None


def solo_span(a: AdapterLoad, cost: CostModel | None) -> float:
    """How long adapter ``a`` takes at the least: its steps in a pack of its own (in steps
    without a cost model)."""
    cost = _timed(cost)
    return a.steps * (cost.step_time([a], JOIN_TP) if cost is not None else 1.0)


def remaining_seconds(loads: Sequence[AdapterLoad], cost: CostModel | None) -> float:
    """The predicted time a running pack needs for the steps its adapters have left (in
    steps without a cost model): the cost model's job time without the job's start, which
    a running job has paid."""
    if not loads:
        return 0.0
    cost = _timed(cost)
    if cost is None:
        return float(max(a.steps for a in loads))
    return cost.job_time(loads, JOIN_TP) - cost.job_overhead_s


def pack_tokens(loads: Sequence[AdapterLoad], cost: CostModel | None) -> float:
    """Real tokens of one step of the pack (rows without a cost model)."""
    per_row = 1.0 if cost is None else (cost.row_tokens if cost.row_tokens is not None else float(cost.seq_len))
    return per_row * sum(a.batch_size for a in loads)


def throughput(loads: Sequence[AdapterLoad], cost: CostModel) -> float:
    """Real tokens per second of a pack's step (0 for an empty pack)."""
    if not loads:
        return 0.0
    return pack_tokens(loads, cost) / cost.step_time(loads, JOIN_TP)


def keeps_throughput(pack: Sequence[AdapterLoad], a: AdapterLoad, cost: CostModel | None) -> bool:
    """Whether the pack with ``a`` moves at least as many real tokens per second as without
    (always, without a cost model to say otherwise)."""
    cost = _timed(cost)
    if cost is None or not pack:
        return True
    before, after = throughput(pack, cost), throughput([*pack, a], cost)
    return after >= before * (1 - 1e-9)


def held_back(pack: Sequence[AdapterLoad], a: AdapterLoad, cost: CostModel | None) -> bool:
    """Whether a pack holds ``a`` back for now: it would lower the pack's tokens per second,
    and it can wait (its solo span is shorter than the pack's remaining time)."""
    return not keeps_throughput(pack, a, cost) and solo_span(a, cost) < remaining_seconds(pack, cost)


def staying(loads: Sequence[AdapterLoad], cost: CostModel | None) -> list[AdapterLoad]:
    """The adapters of a running pack that are not about to leave: an adapter leaves soon
    when the steps it has left take at most `LEAVING_SOON_S` at the pack's step time
    (without a cost model, at most `LEAVING_SOON_STEPS` steps). The engine reads a pack
    from its progress.json, written every half second, and a join reaches the job at the
    next step after the engine's tick: adapters chosen for the room these leave wait in the
    job until it is there (``streaming.max_active``)."""
    cost = _timed(cost)
    if cost is None:
        return [a for a in loads if a.steps > LEAVING_SOON_STEPS]
    step = cost.step_time(loads, JOIN_TP) if loads else 0.0
    return [a for a in loads if a.steps * step > LEAVING_SOON_S]


def longest_first(waiting: Sequence[AdapterLoad], cost: CostModel | None,
                  first: frozenset[str] | set[str] = frozenset()) -> list[AdapterLoad]:
    """The waiting adapters in the order they are offered to the packs: those in ``first``
    (first in line), then by solo span, longest first; ties in queue order."""
    order = sorted(enumerate(waiting), key=lambda ia: (ia[1].id not in first, -solo_span(ia[1], cost), ia[0]))
    return [a for _, a in order]


def choose_joins(packs: Sequence[RunningPack], waiting: Sequence[AdapterLoad], fits: Fits,
                 cost: CostModel | None = None, first: frozenset[str] | set[str] = frozenset(),
                 targets: Callable[[str], str] | None = None) -> dict[str, list[str]]:
    """Which waiting adapters join which running pack now (see the module docstring): job
    id -> adapter ids, in the order they were chosen; the jobs in the order each was first
    chosen. ``waiting`` carry their whole step budgets, the packs' adapters the steps they
    have left. ``targets``: an adapter's target set; it is offered only the packs of its own
    set (`RunningPack.targets`)."""
    grown = {p.job_id: list(p.training) for p in packs}
    rank = {p.job_id: i for i, p in enumerate(packs)}
    reserved: set[str] = set()
    out: dict[str, list[str]] = {}
    for a in longest_first(waiting, cost, first):
        own = targets(a.id) if targets is not None else None
        open_packs = [p.job_id for p in packs if p.job_id not in reserved
                      and (own is None or p.targets is None or p.targets == own)]
        if not open_packs:
            break
        best: tuple[tuple[float, float, int], str] | None = None
        no_room: list[str] = []
        for job_id in open_packs:
            pack = grown[job_id]
            if not fits([*pack, a]):
                no_room.append(job_id)
                continue
            if held_back(pack, a, cost):
                continue
            key = (remaining_seconds([*pack, a], cost), pack_tokens(pack, cost), rank[job_id])
            if best is None or key < best[0]:
                best = (key, job_id)
        if best is not None:
            grown[best[1]].append(a)
            out.setdefault(best[1], []).append(a.id)
        elif no_room and fits([a]):
            reserved.add(min(no_room, key=lambda j: (remaining_seconds(grown[j], cost), rank[j])))
    return out
