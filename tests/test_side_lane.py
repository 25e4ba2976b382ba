"""The side lane a GPU job does its eager model work on while its steps replay
(`plora.train.side_lane`): one thread, tasks in order, errors carried to where their result
is taken, and the main loop's wait for it."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from plora.train.side_lane import SWITCH_INTERVAL_S, SideLane

CPU = torch.device("cpu")


def test_tasks_run_in_order_on_one_thread_of_their_own():
    lane = SideLane(CPU)
    try:
        seen: list[tuple[int, str]] = []
        futures = [lane.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i) for i in range(5)]
        lane.wait()
        assert [f.result() for f in futures] == list(range(5))
        assert [i for i, _ in seen] == list(range(5))
        names = {name for _, name in seen}
        assert len(names) == 1 and names != {threading.current_thread().name}
    finally:
        lane.close()


def test_busy_while_a_task_runs_and_wait_waits_for_it():
    lane = SideLane(CPU)
    try:
        go = threading.Event()
        f = lane.submit(go.wait)
        assert lane.busy
        go.set()
        lane.wait()
        assert not lane.busy and f.done()
    finally:
        lane.close()


def test_an_error_is_raised_where_the_result_is_taken_not_by_wait():
    lane = SideLane(CPU)
    try:
        f = lane.submit(lambda: 1 / 0)
        lane.wait()  # the main loop's wait goes on
        with pytest.raises(ZeroDivisionError):
            f.result()
        assert lane.submit(lambda: 7).result() == 7  # the lane still works
    finally:
        lane.close()


def test_the_switch_interval_is_short_while_the_lane_is_open_and_restored_after():
    before = sys.getswitchinterval()
    lane = SideLane(CPU)
    assert sys.getswitchinterval() <= SWITCH_INTERVAL_S
    lane.close()
    assert sys.getswitchinterval() == before
    lane.close()  # twice is fine


def test_an_inline_lane_runs_each_task_at_once():
    lane = SideLane(CPU, inline=True)
    here = threading.current_thread().name
    f = lane.submit(lambda: threading.current_thread().name)
    assert f.done() and f.result() == here and not lane.busy
    bad = lane.submit(lambda: [][1])
    with pytest.raises(IndexError):
        bad.result()
    lane.close()


def test_what_runs_before_the_first_task_waits_for_it():
    lane = SideLane(CPU)
    try:
        seen: list[str] = []
        lane.before_first(lambda: seen.append("warm"))
        assert seen == []  # not at once
        lane.submit(lambda: seen.append("a"))
        lane.submit(lambda: seen.append("b"))
        lane.wait()
        assert seen == ["warm", "a", "b"]
    finally:
        lane.close()


def test_a_task_that_waits_for_the_lane_fails_instead_of_hanging():
    """A task on the lane that waits for the lane would wait for itself for ever (and the job's
    main loop for it): it raises, in its own future, and the lane goes on."""
    lane = SideLane(CPU)
    try:
        waiting = lane.submit(lane.wait)
        with pytest.raises(RuntimeError, match="waited for the lane"):
            waiting.result(timeout=10)
        after = lane.submit(lambda: 7)
        lane.wait()
        assert after.result(timeout=10) == 7
    finally:
        lane.close()
