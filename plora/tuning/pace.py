"""How fast a tune's jobs really go against its cost model, for ``on_budget: stop``.

Under ``stop`` a trial (``--async``) or a batch (the loop) starts only if it can train to
its end within the budget left; one that cannot is pruned by the budget, and a search whose
trials are all pruned that way has no result. The cost model times packed steps; a tune's
job also scores its adapters at the rungs, captures a graph for each new pack and may run
slower or faster on this machine than the model says. So each prediction is scaled by what
was measured in this run:

* `JobPaces`: for each running job, the wall seconds between engine ticks while its pack
  had trials training (its start, before the first step, left out: a running job has paid
  it) against the model's time for the steps its pack took meanwhile. Stalls for evals at
  rungs count as measured time with no predicted steps, so they raise the pace.
* `Pace` of the loop: a finished batch's GPU-seconds against its plan's.

A pace is 1 until a second of work is measured, and is kept within `PACE_RANGE`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from plora.cost.model import AdapterLoad, CostModel

#: measured seconds below which a pace is not trusted yet (it stays 1)
MIN_MEASURED_S = 1.0
#: the least and most a pace scales a prediction by
PACE_RANGE = (0.5, 4.0)


@dataclass
class Pace:
    """Measured seconds over predicted seconds, summed over what was measured."""

    measured: float = 0.0
    predicted: float = 0.0

    def add(self, measured: float, predicted: float) -> None:
        self.measured += max(0.0, float(measured))
        self.predicted += max(0.0, float(predicted))

    @property
    def factor(self) -> float:
        if self.measured < MIN_MEASURED_S or self.predicted <= 0:
            return 1.0
        lo, hi = PACE_RANGE
        return min(hi, max(lo, self.measured / self.predicted))


@dataclass
class JobPaces:
    """Each running job's pace (see the module docstring), from the steps its progress.json
    says each adapter has taken (``adapter_steps``), read at every engine tick."""

    model: CostModel
    tp: int = 1
    paces: dict[str, Pace] = field(default_factory=dict)
    #: job -> (when it was last read, its adapters' steps then)
    last: dict[str, tuple[float, dict[str, int]]] = field(default_factory=dict)

    def observe(self, job_id: str, done: Mapping[str, int], pack: Sequence[AdapterLoad], now: float) -> None:
        """Note a job read at ``now``: ``done`` (adapter -> packed steps taken) and the
        trials training in it (``pack``, their whole steps)."""
        before = self.last.get(job_id)
        self.last[job_id] = (now, {a: int(n) for a, n in done.items()})
        if before is None or not pack:
            return
        then, done_then = before
        if not any(done_then.get(a.id, 0) for a in pack):  # its pack had not stepped yet: its start
            return
        stepped = max(int(done.get(a.id, 0)) - int(done_then.get(a.id, 0)) for a in pack)
        pace = self.paces.setdefault(job_id, Pace())
        pace.add(now - then, max(0, stepped) * self.model.step_time(list(pack), self.tp))

    def factor(self, job_id: str) -> float:
        pace = self.paces.get(job_id)
        return pace.factor if pace is not None else 1.0

    def done(self, job_id: str) -> dict[str, int]:
        """Packed steps each adapter of the job had taken when it was last read."""
        last = self.last.get(job_id)
        return last[1] if last is not None else {}

    def stepped(self, job_id: str) -> bool:
        """Whether the job's pack has taken a step (its start is paid)."""
        return any(self.done(job_id).values())
