"""Streaming: adapters waiting in the queue join running jobs instead of waiting for a new one.

With ``planner.streaming`` the engine looks, at each tick, at every running one-GPU job
whose adapters have left room: the adapters of queued jobs not started yet join them as
`plora.engine.join_choice` decides from the cost model (longest first, into the pack that
ends soonest with them, only while the grown pack fits the GPU's memory and
``planner.max_adapters_per_job`` and moves no fewer tokens per second). A running job's
adapters count with the steps they have left (its progress.json's ``adapter_steps``). A
tensor-parallel job takes no joins; the journal says so once for each. Joins go through
the job's control.json (`plora.job.control`); the journal records them under that job.
Such jobs linger a while when their adapters have all left (``streaming.linger_s`` in
their job config); the engine closes one as soon as nothing is left to send it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from plora.cost.model import AdapterLoad, CostModel, packed_load
from plora.job.config import JobAdapter

#: how long a streaming job waits for a join once its adapters have all left; the engine
#: closes it sooner as soon as it has nothing to send it
STREAM_LINGER_S = 60.0


@dataclass
class StreamPolicy:
    """What the engine needs from the sweep to send adapters into running jobs."""

    #: the job adapter entry of an adapter id (its configuration, step budget and warm-up)
    entry: Callable[[str], JobAdapter]
    #: whether a job of these adapters, training at once, fits at TP ``d``
    fits: Callable[[Sequence[AdapterLoad], int], bool]
    #: the sweep's cost model, which times packs for the choice (None: step counts decide)
    cost: CostModel | None = None
    #: an adapter's target set (`plora.spec.adapter.target_key`): a job adapts one, so only adapters
    #: of its set join it (None: every adapter has the same)
    targets: Callable[[str], str] | None = None
    #: the sweep's ``training.micro_batch_size`` (`plora.data.accumulation`)
    micro_batch_size: int | None = None

    def load(self, adapter_id: str) -> AdapterLoad:
        """What the choice needs of an adapter: its rank, rows per packed step and packed
        steps (as a job's progress.json counts them)."""
        a = self.entry(adapter_id)
        micro = a.micro_batch_size if a.micro_batch_size is not None else self.micro_batch_size
        return packed_load(a.id, a.rank, a.batch_size, a.steps, micro)
