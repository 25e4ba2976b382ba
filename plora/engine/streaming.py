"""Streaming: adapters waiting in the queue join running jobs instead of waiting for a new one.

With ``planner.streaming`` the engine looks, at each tick, at every running job (one
process, TP 1) whose adapters have left room: the adapters of queued jobs not started yet
join it, in queue order, while the job's adapters still training and the newcomers fit
(`StreamPolicy.fits`: the cost model's memory within the planner's load factor, and
``planner.max_adapters_per_job``). They go through the job's control.json
(`plora.jobcontrol`); the journal records them under that job. Such jobs linger a while
when their adapters have all left (``streaming.linger_s`` in their job config); the
engine closes one as soon as nothing is left to send it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from plora.jobconfig import JobAdapter

#: how long a streaming job waits for a join once its adapters have all left; the engine
#: closes it sooner as soon as it has nothing to send it
STREAM_LINGER_S = 60.0


@dataclass
class StreamPolicy:
    """What the engine needs from the sweep to send adapters into running jobs."""

    #: the job adapter entry of an adapter id (its configuration, step budget and warm-up)
    entry: Callable[[str], JobAdapter]
    #: whether a job of these adapters, training at once, fits at TP ``d``
    fits: Callable[[Sequence[str], int], bool]


def pick_joins(training: Sequence[str], waiting: Sequence[str], fits: Callable[[Sequence[str], int], bool],
               tp: int = 1) -> list[str]:
    """The waiting adapters, in order, that join a job whose adapters ``training`` still
    train: each while the whole pack still fits (no overtaking: the next one that does not
    fit stops the list, as the planner's order says who goes first)."""
    taken: list[str] = []
    for a in waiting:
        if not fits([*training, *taken, a], tp):
            break
        taken.append(a)
    return taken
