"""The makespan forecast of a streaming sweep (`plora.engine.stream_forecast`): a plan whose
jobs take no joins is predicted as the plan itself predicts it; a queued job whose adapters
fit a running pack is forecast as the engine runs it, with them joined; and the sweep
writes and shows that forecast."""

from __future__ import annotations

import pytest

from conftest import cost_model_holding
from plora.cost.job import JobOverheads
from plora.cost.model import AdapterLoad
from plora.engine import join_choice as jc
from plora.engine.stream_forecast import streamed_makespan
from plora.planner.plan import Job, Plan
from plora.planner.simulate import simulate


def fits_for(model, max_adapters: int = 100):
    return lambda loads: jc.pack_fits(loads, 1, model, max_adapters=max_adapters, load_factor=0.9)


def plan_of(jobs: list[list[str]], loads: list[AdapterLoad], model, gpus: int = 1) -> Plan:
    """Jobs one after another on GPU 0 (or spread over ``gpus``), timed by ``model``."""
    by_id = {a.id: a for a in loads}
    plan = Plan([Job(f"job-{i:03d}", ids, 1, [i % gpus], 0.0, 0.0) for i, ids in enumerate(jobs)], adapters=loads, gpus=gpus)
    sim = simulate(plan, model, loads)
    for j in plan.jobs:
        j.start, j.end = sim.starts[j.id], sim.ends[j.id]
    plan.makespan = sim.makespan
    assert all(by_id[a] for ids in jobs for a in ids)
    return plan


def test_without_joins_the_forecast_is_the_plans_own_makespan():
    """A pack that drains (adapters of 4, 8 and 12 steps), its start, its captures and its
    exits' evals and saves: the same seconds `CostModel.job_time` gives."""
    model = cost_model_holding(3, c0=1.0, c_tok=0.05, overhead_s=7.0)
    model = model.with_overheads(JobOverheads(start_s=7.0, capture_s=0.5, save_s=0.1))
    loads = [AdapterLoad("a", 4, 2, 4), AdapterLoad("b", 8, 4, 8), AdapterLoad("c", 16, 2, 12)]
    plan = plan_of([["a", "b", "c"]], loads, model)
    got = streamed_makespan(plan, model, loads, fits_for(model))
    assert got == pytest.approx(plan.makespan, rel=1e-9)
    assert got == pytest.approx(model.job_time(loads, 1), rel=1e-9)


def test_without_joins_adapters_scored_beside_training_are_forecast_as_the_job_prices_them():
    """With nothing queued, a one-GPU pack scores leaving adapters beside its training: the
    forecast holds the pack up for their saves only, as `CostModel.job_time` does."""
    from plora.cost.job import EvalLoad

    model = cost_model_holding(3, c0=1.0, c_tok=0.05, overhead_s=7.0)
    load = EvalLoad(samples=64, row_tokens=40.0, prompt_tokens=38.0, max_new_tokens=6, beside_training=True)
    model = model.with_overheads(JobOverheads(start_s=7.0, capture_s=0.5, save_s=0.1, eval_call_s=3.0)).for_eval(load)
    loads = [AdapterLoad("a", 4, 2, 4), AdapterLoad("b", 8, 4, 8), AdapterLoad("c", 16, 2, 12)]
    plan = plan_of([["a", "b", "c"]], loads, model)
    got = streamed_makespan(plan, model, loads, fits_for(model))
    assert got == pytest.approx(model.job_time(loads, 1), rel=1e-9)
    inline = model.for_eval(EvalLoad(samples=64, row_tokens=40.0, prompt_tokens=38.0, max_new_tokens=6))
    assert got == pytest.approx(inline.job_time(loads, 1) - 2 * 3.0, rel=1e-9)  # two evals of three beside


def test_adapters_leaving_while_a_join_waits_for_them_are_forecast_in_line():
    """A join sent for the room of adapters about to leave waits in the job until they have
    left: the job then scores them in line (a join may still change its pack), and so does
    the forecast, although nothing is queued any more once the join was sent."""
    from plora.cost.job import EvalLoad

    base = cost_model_holding(2, c0=1.0, c_tok=0.01, overhead_s=5.0)
    base = base.with_overheads(JobOverheads(start_s=5.0, save_s=0.1, eval_call_s=3.0))
    beside = base.for_eval(EvalLoad(samples=8, row_tokens=40.0, beside_training=True))
    inline = base.for_eval(EvalLoad(samples=8, row_tokens=40.0))
    loads = [AdapterLoad("a", 8, 2, 10), AdapterLoad("b", 8, 2, 40), AdapterLoad("c", 8, 2, 10)]
    plan = plan_of([["a", "b"], ["c"]], loads, beside)
    got = streamed_makespan(plan, beside, loads, fits_for(beside, max_adapters=2))
    assert got == pytest.approx(streamed_makespan(plan, inline, loads, fits_for(inline, max_adapters=2)) - 3.0,
                                rel=1e-9)  # c's leaving (nothing queued, no join waiting) is the only one beside


def test_two_jobs_in_a_row_that_fit_one_pack_are_forecast_as_one():
    """The planner put two adapters after two others (its packs run one after another); the
    GPU holds all four, so the engine sends the second job's adapters into the first at
    once and the second job never starts: the forecast is the one pack's time, shorter
    than the plan's."""
    model = cost_model_holding(4, c0=1.0, c_tok=0.01, overhead_s=5.0)
    loads = [AdapterLoad(x, 8, 2, 10) for x in "abcd"]
    plan = plan_of([["a", "b"], ["c", "d"]], loads, model)
    got = streamed_makespan(plan, model, loads, fits_for(model))
    assert got == pytest.approx(model.job_time(loads, 1), rel=1e-6)
    assert got < plan.makespan


def test_joins_wait_for_room_and_a_job_whose_adapters_all_joined_never_starts():
    """The GPU holds two adapters: the queued ones join as the running ones leave (a short
    one first), so the forecast is longer than one pack and shorter than the plan's two jobs,
    each with its start."""
    model = cost_model_holding(2, c0=1.0, overhead_s=5.0)
    loads = [AdapterLoad("short", 8, 2, 4), AdapterLoad("long", 8, 2, 20),
             AdapterLoad("c", 8, 2, 10), AdapterLoad("d", 8, 2, 10)]
    plan = plan_of([["short", "long"], ["c", "d"]], loads, model)
    got = streamed_makespan(plan, model, loads, fits_for(model), tick=0.25)
    # sent 2 s before the adapter it waits for leaves (the engine's look-ahead), c trains
    # once short has left (t = 9), d once c has (t = 19): 29 s, against the plan's two jobs
    # one after another (25 s + 15 s)
    assert plan.makespan == pytest.approx(40.0)
    assert got == pytest.approx(29.0)
    assert got > model.job_time(loads[:2], 1)


def test_a_job_wider_than_the_gpus_gets_no_forecast_and_nothing_without_a_one_gpu_time():
    model = cost_model_holding(2, c0=1.0)
    loads = [AdapterLoad("a", 8, 2, 4)]
    wide = Plan([Job("job-000", ["a"], 2, [0, 1])], adapters=loads, gpus=1, makespan=4.0)
    assert streamed_makespan(wide, model, loads, fits_for(model)) is None
    assert streamed_makespan(Plan([], adapters=loads, gpus=1), model, loads, fits_for(model)) is None


def test_the_plan_file_keeps_the_forecast_and_the_expected_makespan_prefers_it(tmp_path):
    plan = Plan([Job("job-000", ["a"], 1, [0], 0.0, 10.0)], gpus=1, makespan=10.0)
    assert plan.expected_makespan == 10.0
    plan.streamed_makespan = 7.5
    back = Plan.load(plan.save(tmp_path / "plan.json"))
    assert back.streamed_makespan == 7.5 and back.expected_makespan == 7.5
    plan.streamed_makespan = 0.0
    assert Plan.load(plan.save(tmp_path / "plan.json")).expected_makespan == 10.0


def test_a_streaming_sweep_is_planned_with_its_forecast_and_a_plain_one_without(tmp_path):
    """`prepare` forecasts a sweep that streams (``planner.streaming: true``) as the engine
    will run it, and the plan file and the plan table carry it; a sweep that does not
    stream keeps the plan's own makespan."""
    from conftest import STREAM_CONFIGS, tiny_space_file
    from plora.spec.loading import load_spec
    from plora.sweep import prepare
    from plora.views import plan_summary

    def prepared(streaming: bool, name: str):
        path = tiny_space_file(tmp_path / name, name=name, space={"strategy": "list", "configs": STREAM_CONFIGS},
                               training={"epochs": 1}, eval={"max_new_tokens": 2, "metrics": ["loss"]},
                               planner={"max_adapters_per_job": 2, "streaming": streaming})
        return prepare(load_spec(path))

    streamed, plain = prepared(True, "s"), prepared(False, "p")
    assert plain.plan.streamed_makespan == 0.0 and plain.plan.expected_makespan == plain.plan.makespan
    assert 0 < streamed.plan.streamed_makespan <= streamed.plan.makespan * (1 + 1e-9)
    assert streamed.plan.expected_makespan == streamed.plan.streamed_makespan
    table = plan_summary(streamed)
    assert table is not None and "plan, streamed" in [str(c) for c in table.columns[0]._cells]
