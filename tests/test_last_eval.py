"""A job's last eval keeps the memory its batches left cached (`Evaluator.final(last=True)`):
nothing trains after it, and giving gigabytes back to the device only delays the job's end.
Every other eval gives it back, so that the next pack's footprint starts from training's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from plora.job.phases import PhaseClock
from plora.train.evaluator import Evaluator


@pytest.mark.parametrize("last", [False, True])
def test_only_the_last_eval_keeps_its_cached_memory(monkeypatch, last):
    released: list[bool] = []
    clock = PhaseClock()

    class Event:
        def done(self, release: bool = True) -> None:
            released.append(release)

    monkeypatch.setattr(clock, "eval_event", lambda *a, **k: Event())
    cfg = SimpleNamespace(metrics=["loss"], max_new_tokens=0, batch_rows=None)
    ev = Evaluator(None, None, [], [], cfg, max_seq_len=16, device=SimpleNamespace(type="cpu"), clock=clock)
    monkeypatch.setattr(ev, "evaluate", lambda adapters, **k: [{} for _ in adapters])
    assert ev.final([0, 1], last=last) == [{}, {}]
    assert released == [not last]


def test_an_eval_event_says_when_it_ended_and_a_composition_when_its_last_step_did():
    clock = PhaseClock()
    event = clock.eval_event(2, 0, "cpu", samples=4)
    event.done(release=False)
    assert clock.evals[0]["at"] >= clock.t0
    clock.step([0, 1], 0.5)
    clock.step([0, 1], 0.1)
    assert clock.phases[0]["last_at"] >= clock.t0 and clock.phases[0]["steps"] == 2
