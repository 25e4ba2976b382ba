"""The makespan a plan will take once streaming sends its queued adapters into running jobs.

A plan's own makespan (`plora.planner.plan.Plan.makespan`) replays its jobs one after
another on their GPUs (`plora.planner.simulate`). With ``planner.streaming`` the engine does
better than that: whenever a running pack has room, adapters of jobs not started yet join
it (`plora.engine.join_choice`), so a job planned to wait for the GPU may never start at all.
On the effective-batch sweep of `scripts/bench_long_rows.py` (batches 16 and 64 at 1k-token
rows, one H200) the plan said 31.4 s and the sweep took 23.8 s: its second job's adapters had
joined the first, and the second job never started. A
prediction the user is shown is only worth reading if it is what the engine will do, so
this replays the engine's own rule on the cost model:

* queued jobs start in the plan's launch order on free GPUs, each paying the job's fixed
  start (``job_overhead_s``);
* at every moment something changes (an adapter leaves, a job starts) and at least every
  `tick` seconds (a held-back adapter's turn comes as its pack drains), `choose_joins`
  picks the joins from the running one-GPU packs (their adapters about to leave counted
  as gone, as the engine does: `staying`) and the adapters still queued; a join sent while
  the adapters it makes room for are leaving waits in the job until they have left;
* a pack steps at the cost model's step time of its adapters; each composition after its
  first pays a capture, and adapters that leave together pay their eval and saves
  (`CostModel.exit_pause`), exactly as `CostModel.job_time` prices a job that takes no joins
  (with no joins this replay gives the plan's own times);
* a pack that is empty and is sent nothing ends, and its GPU takes the next queued job.

Pure: a plan, a cost model and the engine's ``fits`` in, seconds out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from plora.cost.model import AdapterLoad, CostModel
from plora.engine.join_choice import JOIN_TP, RunningPack, choose_joins, staying
from plora.planner.plan import Plan

__all__ = ["streamed_makespan"]

#: an adapter with this few (fractional) steps left has finished
_DONE = 1e-6
#: most replay events before it gives up (a forecast, never a hang)
_MAX_EVENTS = 200_000


@dataclass
class _Pack:
    """A running job in the replay."""

    job_id: str
    tp: int
    loads: dict[str, AdapterLoad]  #: its adapters, with their whole step budgets
    left: dict[str, float] = field(default_factory=dict)  #: steps each has left
    ready_at: float = 0.0  #: when it steps again (after its start, a capture, an exit's eval and saves)
    #: joins waiting in the job for the adapters they were sent after to leave
    #: (``streaming.max_active``: the engine sends a join while those are about to leave)
    pending: dict[str, set[str]] = field(default_factory=dict)

    def training(self) -> list[AdapterLoad]:
        """Its adapters as the engine reads them: each with the steps it has left, a join
        still waiting with all of its own."""
        return ([replace(self.loads[a], steps=max(1, math.ceil(s))) for a, s in self.left.items()]
                + [self.loads[a] for a in self.pending])

    def admit(self) -> bool:
        """Let in the waiting joins whose adapters have left; whether any came in."""
        ready = [a for a, after in self.pending.items() if not after & self.left.keys()]
        for a in ready:
            del self.pending[a]
            self.left[a] = float(self.loads[a].steps)
        return bool(ready)


def streamed_makespan(plan: Plan, cost: CostModel, loads: Sequence[AdapterLoad],
                      fits: Callable[[Sequence[AdapterLoad]], bool], *,
                      targets: Callable[[str], str] | None = None, tick: float | None = None) -> float | None:
    """Seconds from the first job's start to the last job's end when the engine streams
    ``plan``'s queued adapters into its running packs (module docstring); None where the
    cost model cannot time a one-GPU pack or the plan has no jobs. ``loads``: every
    adapter as `StreamPolicy.load` gives it; ``fits``: whether a grown pack fits one GPU
    (the engine's); ``targets``: an adapter's target set where a sweep has several;
    ``tick``: how often waiting adapters are offered again (default: 1/200 of the plan's
    makespan, at least 0.25 s, the engine's tick)."""
    if not plan.jobs or JOIN_TP not in cost.time:
        return None
    by_id = {a.id: a for a in loads}
    queue: list[tuple[str, int, list[str]]] = [
        (j.id, j.tp, [a for a in j.adapters if a in by_id])
        for j in sorted(plan.jobs, key=lambda j: (j.start, j.id))]
    tick = tick if tick is not None else max(0.25, plan.makespan / 200.0)
    free = [0.0] * max(1, int(plan.gpus or 1))  #: when each free GPU is free (a job's exit eval may run on)
    capture = cost.overheads.capture_s if cost.overheads is not None else 0.0
    running: list[_Pack] = []
    now, end = 0.0, 0.0

    def offer() -> None:
        packs = [p for p in running if p.tp == JOIN_TP]
        waiting = [by_id[a] for _, _, ids in queue for a in ids]
        if not packs or not waiting:
            return
        views = [RunningPack(p.job_id, tuple(staying(p.training(), cost)),
                             targets(next(iter(p.loads))) if targets is not None and p.loads else None)
                 for p in packs]
        chosen = choose_joins(views, waiting, fits, cost, targets=targets)
        for p, view in zip(packs, views):
            taken = chosen.get(p.job_id, [])
            if not taken:
                continue
            leaving = set(p.left) - {a.id for a in view.training}
            for a in taken:
                p.loads[a] = by_id[a]
                p.pending[a] = set(leaving)
            if p.admit():
                p.ready_at = max(p.ready_at, now) + capture  # a new composition: its graphs are captured
            gone = set(taken)
            queue[:] = [(jid, tp, [a for a in ids if a not in gone]) for jid, tp, ids in queue]
            queue[:] = [q for q in queue if q[2]]  # a job whose adapters all streamed never starts

    def launch() -> None:
        while queue and queue[0][1] <= len(free):
            jid, tp, ids = queue.pop(0)
            free.sort()
            taken, free[:] = free[:tp], free[tp:]
            running.append(_Pack(jid, tp, {a: by_id[a] for a in ids}, {a: float(by_id[a].steps) for a in ids},
                                 ready_at=max(now, *taken) + cost.job_overhead_s))

    def close() -> bool:
        nonlocal end
        empty = [p for p in running if not p.left and not p.pending]  # empty, and sent nothing: it ends
        for p in empty:
            running.remove(p)
            free.extend([p.ready_at] * p.tp)
            end = max(end, p.ready_at)
        return bool(empty)

    for _ in range(_MAX_EVENTS):
        # as the engine's tick: the jobs that have GPUs start, then joins go to the running ones
        launch()
        offer()
        while close():
            launch()
            offer()
        if not running:
            return end if not queue else None  # a job wider than the GPUs: the plan's own makespan stands
        # the next moment something changes: an adapter leaves, or a waiting adapter is offered again
        nxt = now + tick
        steps = {id(p): cost.step_time(list(p.loads[a] for a in p.left), p.tp) for p in running if p.left}
        for p in running:
            if p.left:
                nxt = min(nxt, max(now, p.ready_at) + min(p.left.values()) * steps[id(p)])
        nxt = max(nxt, now + 1e-9)
        for p in running:
            start = max(now, p.ready_at)
            if start >= nxt or not p.left:
                continue
            done = (nxt - start) / steps[id(p)]
            for a in p.left:
                p.left[a] -= done
            leaving = [a for a, s in p.left.items() if s <= _DONE * max(1.0, p.loads[a].steps)]
            if leaving:
                for a in leaving:
                    del p.left[a]
                # scored in line where nothing stays or a join may still change the pack (the job's
                # rule: a join waiting for these adapters is still pending when they are scored)
                inline = not p.left or bool(queue) or bool(p.pending)
                p.admit()
                p.ready_at = nxt + cost.exit_pause(len(leaving), p.tp, inline=inline) + (capture if p.left else 0.0)
        now = nxt
    return None
