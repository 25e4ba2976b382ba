"""The online choice of joins (`plora.engine.join_choice`): longest first, into the pack
that ends soonest with it, only within memory and without lowering a pack's tokens per
second, nothing overtaking a long adapter that waits for room; and a tensor-parallel job
that the engine sends nothing, saying why."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import cost_model_holding
from plora.cost.model import AdapterLoad, CostModel
from plora.engine import join_choice as jc
from plora.engine.journal import Journal
from plora.engine.local import JobProcess
from plora.engine.runner import Engine
from plora.engine.streaming import StreamPolicy
from plora.job.config import JobAdapter
from plora.job.control import read_control
from plora.planner.plan import Job

LOAD_FACTOR = 0.9


def cost(admits: int = 100, **time_terms) -> CostModel:
    return cost_model_holding(admits, load_factor=LOAD_FACTOR, **time_terms)


def fits_for(model: CostModel | None, max_adapters: int = 100):
    return lambda loads: jc.pack_fits(loads, 1, model, max_adapters=max_adapters, load_factor=LOAD_FACTOR)


def load(name: str, steps: int, rank: int = 4, bs: int = 2) -> AdapterLoad:
    return AdapterLoad(name, rank, bs, steps)


def pack(job_id: str, *loads: AdapterLoad) -> jc.RunningPack:
    return jc.RunningPack(job_id, tuple(loads))


# --------------------------------------------------------------------------- the pieces


def test_longest_first_by_solo_span_first_in_line_before_and_ties_in_queue_order():
    m = cost(c0=1.0, c_tok=0.1)  # step alone: 1 + 0.1 * bs * 10
    a, b, c, d = load("a", 10, bs=1), load("b", 4, bs=8), load("c", 10, bs=1), load("d", 3, bs=1)
    # spans: a 20, b 36, c 20, d 6
    assert [x.id for x in jc.longest_first([a, b, c, d], m)] == ["b", "a", "c", "d"]
    assert [x.id for x in jc.longest_first([a, b, c, d], m, first={"d"})] == ["d", "b", "a", "c"]
    assert [x.id for x in jc.longest_first([a, b, c, d], None)] == ["a", "c", "b", "d"]  # steps alone


def test_remaining_time_counts_the_steps_left_and_not_the_jobs_start():
    m = cost(c0=1.0, c_tok=0.1, overhead_s=30.0)
    loads = jc.steps_left([load("a", 10, bs=1), load("b", 6, bs=1)], {"a": 4, "x": 9})
    assert [x.steps for x in loads] == [6, 6]
    assert jc.remaining_seconds(loads, m) == pytest.approx(6 * (1.0 + 2 * 0.1 * 10))
    assert jc.remaining_seconds([], m) == 0.0
    assert jc.remaining_seconds(loads, None) == 6.0
    assert jc.steps_left([load("a", 3)], {"a": 5})[0].steps == 0


def test_pack_fits_holds_memory_and_the_adapter_cap():
    m = cost(admits=2)
    two, three = [load("a", 1), load("b", 1)], [load("a", 1), load("b", 1), load("c", 1)]
    assert jc.pack_fits(two, 1, m, max_adapters=8, load_factor=LOAD_FACTOR)
    assert not jc.pack_fits(three, 1, m, max_adapters=8, load_factor=LOAD_FACTOR)
    assert not jc.pack_fits(two, 1, None, max_adapters=1, load_factor=LOAD_FACTOR)
    assert not jc.pack_fits(two, 2, m, max_adapters=8, load_factor=LOAD_FACTOR)  # no TP 2 in the model


def test_throughput_rule_refuses_an_adapter_that_slows_the_pack_until_the_pack_has_drained():
    """Rank-heavy newcomer: its tokens cost more than the pack's average, so the pack's
    tokens per second would fall; an emptier pack (lower average) takes it."""
    m = cost(c0=0.1, c_tok=0.01, c_rtok=0.01)
    big = load("big", 10, rank=64, bs=1)
    full = [load(f"s{i}", 10, rank=1, bs=4) for i in range(4)]
    assert jc.throughput([*full, big], m) < jc.throughput(full, m)
    assert not jc.keeps_throughput(full, big, m)
    assert jc.keeps_throughput([], big, m)  # an empty pack takes anything that fits
    assert jc.keeps_throughput(full, big, None)  # nothing to say otherwise
    small = load("small", 10, rank=1, bs=4)
    assert jc.keeps_throughput(full, small, m)
    lone = [load("s0", 10, rank=64, bs=1)]
    assert jc.keeps_throughput(lone, big, m)  # the same cost per token: c0 shared


def test_tensor_parallel_jobs_take_no_joins():
    assert jc.join_refusal(1) is None
    assert jc.join_refusal(2) == jc.TP_JOIN_REFUSAL == jc.join_refusal(8)


# --------------------------------------------------------------------------- the choice


def test_two_packs_take_the_longest_waiting_adapters_within_memory():
    """Each pack holds 2 adapters and runs 1: the two longest of four waiting join, one in
    each pack; the two shorter ones wait (each holds a pack for itself: no overtaking)."""
    m = cost(admits=2)
    packs = [pack("job-000", load("r0", 3)), pack("job-001", load("r1", 3))]
    waiting = [load("w4", 4), load("w12", 12), load("w6", 6), load("w8", 8)]
    chosen = jc.choose_joins(packs, waiting, fits_for(m), m)
    assert chosen == {"job-000": ["w12"], "job-001": ["w8"]}
    for job_id, taken in chosen.items():
        own = next(p for p in packs if p.job_id == job_id).training
        assert len(own) + len(taken) <= 2


def test_an_adapter_goes_where_the_grown_pack_ends_soonest():
    m = cost(admits=8, c0=1.0, c_tok=0.1)
    long_pack = pack("job-000", load("r0", 50))
    short_pack = pack("job-001", load("r1", 5))
    assert jc.choose_joins([long_pack, short_pack], [load("w", 10)], fits_for(m), m) == {"job-001": ["w"]}
    # equal remaining time: the pack with fewer tokens per step
    many_rows, few_rows = pack("job-000", load("r0", 10, bs=8)), pack("job-001", load("r1", 10, bs=1))
    m0 = cost(admits=8, c0=1.0)  # step time flat: the remaining times tie
    assert jc.choose_joins([many_rows, few_rows], [load("w", 4)], fits_for(m0), m0) == {"job-001": ["w"]}
    # without a cost model: fewest steps left
    assert jc.choose_joins([long_pack, short_pack], [load("w", 3)], fits_for(None), None) == {"job-001": ["w"]}


def test_one_pack_takes_several_in_order_until_it_is_full():
    m = cost(admits=3)
    chosen = jc.choose_joins([pack("job-000")], [load("a", 2), load("b", 9), load("c", 5), load("d", 7)],
                             fits_for(m), m)
    assert chosen == {"job-000": ["b", "d", "c"]}


def test_a_long_adapter_that_does_not_fit_yet_holds_the_pack_that_drains_first():
    """w_long needs the whole GPU (it fits alone only); it reserves job-001 (fewer steps
    left), which takes nothing else; job-000 still takes the short ones."""
    m = cost(admits=3)
    heavy = AdapterLoad("w_long", 2, 2, 100)

    def fits(loads):
        return jc.pack_fits(loads, 1, m, max_adapters=8, load_factor=LOAD_FACTOR) and (
            heavy not in loads or len(loads) == 1)

    packs = [pack("job-000", load("r0", 50)), pack("job-001", load("r1", 5))]
    chosen = jc.choose_joins(packs, [load("s1", 3), heavy, load("s2", 4)], fits, m)
    assert chosen == {"job-000": ["s2", "s1"]}
    # once job-001 has drained, w_long joins it
    drained = [packs[0], pack("job-001")]
    assert jc.choose_joins(drained, [load("s1", 3), heavy], fits, m) == {"job-001": ["w_long"], "job-000": ["s1"]}


def test_an_adapter_too_big_for_any_pack_holds_nothing():
    m = cost(admits=2)

    def fits(loads):
        return not any(a.id == "huge" for a in loads) and jc.pack_fits(loads, 1, m, max_adapters=8,
                                                                       load_factor=LOAD_FACTOR)

    chosen = jc.choose_joins([pack("job-000", load("r0", 5))], [load("huge", 99), load("s", 2)], fits, m)
    assert chosen == {"job-000": ["s"]}


def test_a_rank_heavy_adapter_that_can_wait_is_held_back_and_others_pass_it():
    """busy: 4 light adapters, 10 steps (33 s) left. A 2-step rank-64 adapter (13 s alone)
    would lower the pack's tokens per second and can wait: held back, holding nothing; the
    light one behind it joins. Into an empty pack, it joins at once."""
    m = cost(admits=10, c0=0.1, c_tok=0.01, c_rtok=0.01)
    busy = pack("job-000", *[load(f"s{i}", 10, rank=1, bs=4) for i in range(4)])
    heavy, small = load("heavy", 2, rank=64, bs=1), load("small", 1, rank=1, bs=4)
    assert jc.solo_span(heavy, m) < jc.remaining_seconds(busy.training, m)
    assert jc.held_back(busy.training, heavy, m) and not jc.held_back(busy.training, small, m)
    assert jc.choose_joins([busy], [heavy, small], fits_for(m), m) == {"job-000": ["small"]}
    # beside an empty pack, heavy takes it, and small ends soonest next to heavy
    assert jc.choose_joins([busy, pack("job-001")], [heavy, small], fits_for(m), m) == {"job-001": ["heavy", "small"]}
    # once the pack has less left than the adapter's own span, the hold ends
    drained = jc.steps_left(busy.training, {f"s{i}": 9 for i in range(4)})
    assert jc.remaining_seconds(drained, m) < jc.solo_span(heavy, m)
    assert not jc.held_back(drained, heavy, m)


def test_a_long_adapter_is_never_held_back_for_throughput():
    """A 30-step rank-64 adapter lowers the pack's rate too, but it is the longest work
    left: held back, it would be the sweep's tail. It joins now."""
    m = cost(admits=10, c0=0.1, c_tok=0.01, c_rtok=0.01)
    busy = pack("job-000", *[load(f"s{i}", 10, rank=1, bs=4) for i in range(4)])
    long_heavy = load("long", 30, rank=64, bs=1)
    assert not jc.keeps_throughput(busy.training, long_heavy, m)
    assert not jc.held_back(busy.training, long_heavy, m)
    assert jc.choose_joins([busy], [long_heavy], fits_for(m), m) == {"job-000": ["long"]}


# --------------------------------------------------------------------------- the engine


class _Forever:
    """A job process that runs until the test ends."""

    pid = None
    returncode = None

    def poll(self):
        return None

    def wait(self, timeout=None):
        return None

    def send_signal(self, sig):
        pass


def _streaming_engine(tmp_path: Path, slots: list[str], fits, model: CostModel,
                      steps: int) -> tuple[Engine, Journal, Path]:
    """An engine whose jobs run forever (`_Forever`) and whose adapters are all rank 4,
    batch 2, ``steps`` steps: (engine, its journal, the run directory)."""
    run = tmp_path / "run"
    (run / "jobs").mkdir(parents=True)
    journal = Journal(run / "journal.sqlite")

    def write_job(job: Job) -> Path:
        d = run / "jobs" / job.id
        d.mkdir(exist_ok=True)
        return d

    def launcher(job_id, job_dir, slot, *, gpus=(), nproc=1, extra_env=None):
        return JobProcess(job_id, job_dir, slot, _Forever(), time.time())

    def entry(adapter_id: str) -> JobAdapter:
        return JobAdapter(id=adapter_id, rank=4, alpha=8.0, learning_rate=1e-3, batch_size=2, seed=0, steps=steps)

    policy = StreamPolicy(entry, fits, model)
    return Engine(run, journal, slots, write_job, launcher=launcher, streaming=policy), journal, run


def test_the_engine_sends_a_tensor_parallel_job_nothing_and_says_so_once(tmp_path: Path):
    engine, journal, run = _streaming_engine(tmp_path, ["cpu:0", "cpu:1"], lambda loads, tp: True, cost(), 10)
    try:
        engine.submit([Job("job-000", ["a"], tp=2), Job("job-001", ["b"])])
        engine._launch_ready()
        assert list(engine.running) == ["job-000"] and [j.id for j in engine.queue] == ["job-001"]
        for _ in range(3):
            engine._stream()
        assert [j.adapters for j in engine.queue] == [["b"]]  # b still waits for a slot of its own
        assert read_control(run / "jobs" / "job-000").join == []
        refusals = [(s, d) for _, kind, s, d in journal.events() if kind == "no_joins"]
        assert refusals == [("job-000", jc.TP_JOIN_REFUSAL)]
        assert "job-000" not in engine.closed
    finally:
        journal.close()


def test_adapters_about_to_leave_count_as_gone_when_joins_are_chosen():
    """An adapter whose steps left take at most LEAVING_SOON_S at the pack's step time
    (without a cost model: at most LEAVING_SOON_STEPS steps) counts as gone."""
    cm = cost(admits=2, c0=jc.LEAVING_SOON_S / 4)  # a step of a quarter of the lookahead
    soon, later = load("soon", 4), load("later", 5)
    assert jc.staying([soon, later], cm) == [later]
    n = jc.LEAVING_SOON_STEPS
    assert [a.id for a in jc.staying([load("x", n), load("y", n + 1)], None)] == ["y"]


def test_the_engine_sends_a_join_ahead_for_the_room_an_adapter_about_to_leave_frees(tmp_path: Path):
    """A full running pack (two of two) whose adapter ``a`` has one step left: the queued
    adapter ``c`` is sent now, waiting in control.json for ``a`` to leave (``after``), so
    that it enters at the step boundary where ``a`` leaves; ``b`` (many steps left) stays,
    and the job is not closed."""
    model = cost(admits=2, c0=0.1)
    fits = lambda loads, tp: jc.pack_fits(loads, tp, model, max_adapters=2, load_factor=LOAD_FACTOR)  # noqa: E731
    engine, journal, run = _streaming_engine(tmp_path, ["cpu:0"], fits, model, 100)
    try:
        engine.submit([Job("job-000", ["a", "b"]), Job("job-001", ["c"])])
        engine._launch_ready()
        progress = run / "jobs" / "job-000" / "progress.json"
        progress.write_text(json.dumps({"adapter_steps": {"a": 50, "b": 50}}))
        engine._stream()
        assert read_control(run / "jobs" / "job-000").join == []  # no room, none about to be made
        progress.write_text(json.dumps({"adapter_steps": {"a": 99, "b": 50}}))
        engine._stream()
        control = read_control(run / "jobs" / "job-000")
        assert [a.id for a in control.join] == ["c"] and control.after == {"c": ["a"]}
        assert not control.close and "job-000" not in engine.closed
        assert journal.job("job-001").status == "streamed"
    finally:
        journal.close()
