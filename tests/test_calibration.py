"""A sweep calibrates its cost model from its own training instead of waiting for a profile:
jobs report each pack's steps, tokens and footprint; the model is corrected from them; the
jobs not started yet are planned again; a plan made before any measurement stays inside
memory."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import tiny_space_file
from plora.cost.model import AdapterLoad, CostModel, MemoryCoeffs, TimeCoeffs

from plora.models.shape import ModelShape
from plora.job.phases import PhaseClock
from plora.cost.profiling.calibrate import (
    MEMORY_MARGIN,
    Calibration,
    PackFootprint,
    PackTiming,
    SweepCalibrator,
    conservative,
    samples_from_phases,
)

GIB = 2**30
SEQ = 512
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def prior(memory_gb: float = 80.0) -> CostModel:
    shape = ModelShape.preset("qwen2.5-0.5b")
    return CostModel.analytic(shape, SEQ, memory_gb * GIB, TARGETS, activation_checkpointing=False, tp_degrees=[1])


def truth(model: CostModel, a: float = 1.6, b: float = 0.8, mem: float = 2.4) -> CostModel:
    """A 'real' GPU the prior is wrong about: per-step part a x, per-token part b x, memory per
    adapter mem x."""
    c, m = model.time[1], model.memory_coeffs[1]
    return replace(model, time={1: TimeCoeffs(c.c0 * a, c.c_tok * b, c.c_rtok * b, c.c_ad * a, c.c_bkt * a)},
                   memory_coeffs={1: MemoryCoeffs(m.base, m.adapter * mem, m.rank * mem, m.tok * mem, m.rank_tok * mem)})


def packs() -> list[list[AdapterLoad]]:
    return [[AdapterLoad("a", 16, 1, 1)],
            [AdapterLoad(f"k{i}", r, b, 1) for i, (r, b) in enumerate([(8, 2), (16, 4), (32, 2), (64, 4)] * 4)],
            [AdapterLoad(f"k{i}", r, 2, 1) for i, r in enumerate([8, 16, 32, 64])]]


def test_a_job_clock_records_each_pack_its_tokens_and_steady_steps():
    clock = PhaseClock()
    for tokens in (600, 512, 512, 640):
        clock.step([0, 1], 0.5 if tokens == 600 else 0.1, ranks=[8, 16], rows=[2, 3], tokens=tokens)
    clock.step([1], 0.3, ranks=[16], rows=[3], tokens=300)
    first, second = clock.phases
    assert first["ranks"] == [8, 16] and first["rows"] == [2, 3] and first["steps"] == 4
    assert first["rest_tokens"] == 512 + 512 + 640 and first["max_row_tokens"] == pytest.approx(640 / 5)
    timings, footprints = samples_from_phases(clock.phases, SEQ)
    assert footprints == []  # no GPU: no footprint
    assert len(timings) == 1  # the one-step pack has no steady step
    t = timings[0]
    assert t.step_s == pytest.approx(0.1) and t.steps == 3
    assert t.row_tokens == pytest.approx((512 + 512 + 640) / 3 / 5)


def test_a_footprint_counts_only_for_the_largest_pack_so_far():
    """Reserved memory only grows: the footprint read after a smaller pack still holds the
    larger one's blocks, and would make the smaller one look expensive."""
    phases = [{"steps": 5, "first_s": 1, "rest_s": 1, "ranks": [8] * 4, "rows": [4] * 4, "rest_tokens": 4 * 16 * 256,
               "max_row_tokens": 256.0, "device_bytes": 20e9},
              {"steps": 5, "first_s": 1, "rest_s": 1, "ranks": [8] * 2, "rows": [4] * 2, "rest_tokens": 4 * 8 * 256,
               "max_row_tokens": 256.0, "device_bytes": 26e9},
              {"steps": 5, "first_s": 1, "rest_s": 1, "ranks": [8] * 6, "rows": [4] * 6, "rest_tokens": 4 * 24 * 256,
               "max_row_tokens": 256.0, "device_bytes": 30e9}]
    _, footprints = samples_from_phases(phases, SEQ)
    assert [f.device_bytes for f in footprints] == [20e9, 30e9]
    assert all(f.row_tokens == 256.0 for f in footprints)


def test_phases_without_packs_or_garbage_give_no_samples():
    assert samples_from_phases([{"adapters": 2, "steps": 9, "first_s": 1, "rest_s": 2}, "x", {}], SEQ) == ([], [])


def test_the_calibration_recovers_the_gpus_time_and_memory_from_its_packs():
    p = prior()
    real = truth(p)
    timings = [PackTiming(tuple(a.rank for a in pk), tuple(a.batch_size for a in pk), 250.0,
                          real.for_rows(250.0).step_time(pk, 1), 50) for pk in packs()]
    footprints = [PackFootprint(tuple(a.rank for a in pk), tuple(a.batch_size for a in pk), 300.0,
                                replace(real, seq_len=300).memory(pk, 1)) for pk in packs()[1:]]
    model = Calibration(timings, footprints).apply(p)
    info = model.meta["calibration"]
    assert info["time_scales"] == [pytest.approx(1.6, rel=1e-3), pytest.approx(0.8, rel=1e-3)]
    assert info["memory_scale"] == pytest.approx(2.4, rel=1e-6)
    for pk in packs():
        assert model.for_rows(250.0).step_time(pk, 1) == pytest.approx(real.for_rows(250.0).step_time(pk, 1), rel=1e-3)
        assert model.memory(pk, 1) == pytest.approx(real.memory(pk, 1), rel=1e-6)


def test_a_small_packs_footprint_does_not_shrink_the_memory_per_adapter():
    """Weights and context under the prior's 3 GiB overhead: a pack of four small adapters
    measured there says nothing of the adapters, and must not plan packs that do not fit."""
    p = prior()
    small = [AdapterLoad(f"s{i}", 8, 1, 1) for i in range(4)]
    weights = p.memory_coeffs[1].base - 3 * GIB
    tiny = PackFootprint((8,) * 4, (1,) * 4, float(SEQ), weights + 1.5e9)
    assert Calibration(footprints=[tiny]).apply(p).memory(small, 1) == pytest.approx(conservative(p).memory(small, 1))
    low = PackFootprint((64,) * 16, (8,) * 16, float(SEQ), p.memory_coeffs[1].base)  # at the prior's base
    assert "memory_scale" not in Calibration(footprints=[low]).apply(p).meta["calibration"]
    big = [AdapterLoad(f"b{i}", 64, 8, 1) for i in range(16)]
    half = PackFootprint((64,) * 16, (8,) * 16, float(SEQ), 3 * p.memory_coeffs[1].base)  # far under the prior
    model = Calibration(footprints=[half]).apply(p)
    assert model.meta["calibration"]["memory_scale"] == 0.75  # the floor, not what it measured
    assert model.memory(big, 1) > 3 * p.memory_coeffs[1].base


def test_one_kind_of_pack_gives_one_time_scale_and_no_footprint_keeps_the_margin():
    p = prior()
    pk = packs()[1]
    t = PackTiming(tuple(a.rank for a in pk), tuple(a.batch_size for a in pk), float(SEQ),
                   1.3 * p.step_time(pk, 1), 20)
    model = Calibration([t]).apply(p)
    assert model.meta["calibration"]["time_scales"] == [pytest.approx(1.3), pytest.approx(1.3)]
    assert model.memory(pk, 1) == pytest.approx(conservative(p).memory(pk, 1))


def test_finished_jobs_give_the_job_terms():
    run = {"start_s": 2.0, "load_s": 1.0, "setup_s": 0.5, "phases": [
        {"steps": 10, "first_s": 0.9, "rest_s": 0.9, "ranks": [8], "rows": [2], "rest_tokens": 9 * 512}],
        "evals": [], "saves": [{"adapters": 1, "seconds": 0.2}]}
    model = Calibration(job_runs=[run]).apply(prior())
    assert model.overheads is not None and model.overheads.save_s == pytest.approx(0.2)
    assert model.job_overhead_s == pytest.approx(2.0 + 1.0 + 0.5 + 0.8)


def test_a_first_sweeps_kernel_compilation_is_not_a_job_term_of_the_next():
    from plora.cost.profiling.calibrate import job_terms_runs

    def run(first_s, eval_s, cold):
        return {"start_s": 9.0, "load_s": 0.0, "setup_s": 1.5, "cold": cold,
                "phases": [{"steps": 129, "first_s": first_s, "rest_s": 128 * 0.15, "ranks": [8], "rows": [4]},
                           {"steps": 128, "first_s": 0.6, "rest_s": 127 * 0.05, "ranks": [8], "rows": [2]}],
                "evals": [{"adapters": 8, "samples": 32, "seconds": eval_s},
                          {"adapters": 8, "samples": 32, "seconds": 0.35}], "saves": []}

    cold = Calibration(job_runs=[run(13.8, 3.2, True)]).apply(prior())
    assert cold.overheads.warm_s == pytest.approx(0.55, abs=1e-6)  # a later pack's capture, not the compile
    warm = Calibration(job_runs=[run(13.8, 3.2, True), run(1.5, 0.36, False)]).apply(prior())
    assert warm.overheads.warm_s == pytest.approx(1.35, abs=1e-6)  # the warm run alone
    assert job_terms_runs([run(13.8, 3.2, True)])[0]["evals"] == [{"adapters": 8, "samples": 32, "seconds": 0.35}]


def test_a_calibration_round_trips_and_refuses_other_files():
    cal = Calibration([PackTiming((8,), (2,), 200.0, 0.1, 5)], [PackFootprint((8,), (2,), 256.0, 3e9)], [{"x": 1}])
    again = Calibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert again == cal
    with pytest.raises(ValueError):
        Calibration.from_dict({"kind": "something else"})


def test_a_plan_made_before_any_measurement_stays_inside_memory():
    """Simulated device: 40 GB, memory per adapter 2.7x what the prior says (the worst seen
    on an H200). The prior's own plan would run out of memory; the conservative one does not."""
    from plora.planner import plan_sweep

    p = prior(memory_gb=40.0)
    real = truth(p, mem=2.7)
    assert 2.7 < MEMORY_MARGIN
    loads = [AdapterLoad(f"a{i}", r, b, 64 * 4 // b) for i, (r, b) in
             enumerate([(r, b) for r in (8, 16, 32, 64) for b in (1, 2, 4, 8)] * 2)]
    limit = 0.9 * p.gpu_memory_bytes

    def worst(model: CostModel) -> float:
        plan = plan_sweep(loads, model, 1, load_factor=0.9, max_adapters_per_job=16, time_limit_s=10)
        by_id = {a.id: a for a in loads}
        return max(real.memory([by_id[a] for a in job.adapters], job.tp) for job in plan.jobs)

    assert worst(p) > limit  # planned on the prior alone: out of memory
    assert worst(conservative(p)) <= limit


def test_the_margin_never_leaves_an_adapter_without_a_gpu():
    p = prior(memory_gb=24.0)
    big = AdapterLoad("big", 64, 8, 10)
    assert not conservative(p).fits([big], 1)
    safe = conservative(p, loads=[big, AdapterLoad("small", 8, 1, 10)])
    assert safe.fits([big], 1) and 1.0 <= safe.meta["memory_margin"] < MEMORY_MARGIN


def test_calibrator_says_when_the_waiting_jobs_should_be_planned_again():
    p = prior()
    loads = {f"a{i}": AdapterLoad(f"a{i}", r, 2, 100) for i, r in enumerate([8, 16, 32, 64])}
    cal = SweepCalibrator(p, planned=conservative(p), load=loads.__getitem__, seq_len=SEQ)
    waiting = [(["a0", "a1"], 1), (["a2", "a3"], 1)]
    assert cal.drift(waiting) is None and cal.describe() == ""  # nothing measured yet
    slow = truth(p, a=3.0, b=3.0, mem=1.0)
    phases = [{"steps": 11, "first_s": 1.0, "rest_s": 10 * slow.for_rows(300.0).step_time(list(loads.values()), 1),
               "ranks": [8, 16, 32, 64], "rows": [2, 2, 2, 2], "rest_tokens": 10 * 8 * 300,
               "max_row_tokens": 300.0, "device_bytes": slow.memory(list(loads.values()), 1)}]
    assert cal.observe("job-000", phases) is True
    assert cal.observe("job-000", phases) is False  # nothing new
    assert "3.00x" in cal.drift(waiting)
    assert "steps 3.0x/3.0x" in cal.describe()
    cal.planned_with(cal.model())
    assert cal.drift(waiting) is None


def test_calibrator_sees_room_for_larger_packs():
    p = prior()
    loads = {f"a{i}": AdapterLoad(f"a{i}", 16, 4, 100) for i in range(8)}
    cal = SweepCalibrator(p, planned=conservative(p), load=loads.__getitem__, seq_len=SEQ)
    pk = list(loads.values())
    phases = [{"steps": 6, "first_s": 1.0, "rest_s": 5 * p.step_time(pk, 1), "ranks": [16] * 8, "rows": [4] * 8,
               "rest_tokens": 5 * 32 * SEQ, "max_row_tokens": float(SEQ), "device_bytes": p.memory(pk, 1)}]
    cal.observe("job-000", phases)
    assert cal.drift([(list(loads), 1)]) == "the measured memory holds larger packs than planned"


def test_a_quick_calibration_probe_is_the_sweeps_pack_cut_to_a_safe_size():
    from plora.cost.profiling.profile import QUICK_PROBE_SHARE, quick_probe

    p = prior(memory_gb=40.0)
    pack = [AdapterLoad(f"a{i}", r, 4, 10) for i, r in enumerate([8, 16, 32, 64] * 4)]
    probe = quick_probe(p, pack, 0.9)
    loads = probe.loads()
    assert replace(p, eval_load=None).memory(loads, 1) <= QUICK_PROBE_SHARE * 0.9 * p.gpu_memory_bytes
    assert set(probe.ranks) <= {8, 16, 32, 64} and max(probe.ranks) == 64  # the sweep's own ranks, largest first


def test_the_first_plan_measures_only_where_memory_decides_it(monkeypatch):
    from plora import sweep
    from plora.cost.profiling import profile
    from plora.cost.sweep_model import CALIBRATED_SOURCE_NOW
    from plora.hardware import Hardware

    calls = []

    def fake_quick(spec, prior_model, loads, log=None):
        calls.append(len(loads))
        pk = list(loads)[:4]
        return Calibration([PackTiming(tuple(a.rank for a in pk), tuple(a.batch_size for a in pk), float(SEQ),
                                       prior_model.step_time(pk, 1), 4)],
                           [PackFootprint(tuple(a.rank for a in pk), tuple(a.batch_size for a in pk), float(SEQ),
                                          prior_model.memory(pk, 1))])

    monkeypatch.setattr(profile, "quick_calibration", fake_quick)
    monkeypatch.setattr("plora.cost.profiling.cache.remember_calibration", lambda spec, cal: None)

    class Spec:
        class planner:
            max_adapters_per_job = 16
            memory_load_factor = 0.9

    class Config:
        def __init__(self, i, r, b):
            self.id, self.rank, self.batch_size = f"c{i}", r, b

    small = [Config(i, 8, 1) for i in range(2)]
    large = [Config(i, 64, 8) for i in range(16)]
    hw = Hardware(True, 1, 80 * GIB)
    p = prior()
    checked = []  # the model check is waited for only where a calibration measures
    model, cal = sweep.calibrate_first(Spec, small, {c.id: 10 for c in small}, p, conservative(p), hw, None,
                                       before_measuring=lambda: checked.append(len(calls)))
    assert calls == [] and cal.empty and model.meta.get("memory_margin") == MEMORY_MARGIN
    assert checked == []
    model, cal = sweep.calibrate_first(Spec, large, {c.id: 10 for c in large}, p, conservative(p), hw, None,
                                       before_measuring=lambda: checked.append(len(calls)))
    assert calls == [16] and not cal.empty and model.meta["calibration"]["memory_scale"] == pytest.approx(1.0)
    assert checked == [0]  # before the probes
    assert model.meta["plan_source"] == CALIBRATED_SOURCE_NOW


def test_running_jobs_recalibrate_and_replan_only_the_jobs_not_started(tmp_path):
    """Two CPU slots, four one-adapter jobs, a cost model 100x too fast: once the first jobs
    report their steps, the two waiting jobs are planned again while the running ones go on;
    every adapter trains exactly once."""

    from plora.engine.journal import Journal
    from plora.spec.loading import load_spec
    from plora.hardware import Hardware
    from plora.sweep import prepare, run_prepared, write_run_files

    configs = [{"rank": r, "alpha": 2 * r, "learning_rate": 1e-3, "batch_size": 2} for r in (2, 4, 8, 16)]
    spec = load_spec(tiny_space_file(
        tmp_path, name="cal", num_train=64, space={"strategy": "list", "configs": configs},
        training={"epochs": 2}, eval={"metrics": ["loss"]}, planner={"max_adapters_per_job": 1, "streaming": False}))
    base = prepare(spec)
    wrong = base.cost_model.scaled(0.01)
    wrong = wrong.with_meta(source="analytic")
    # a GPU sweep as the engine sees it (its jobs run on the CPU slots given below)
    prep = prepare(spec, cost_model=wrong, hardware=Hardware(True, 2, 80 * GIB, local=False))
    prep.prior = wrong
    from plora.cost.profiling.calibrate import Calibration as Cal

    prep.calibration = Cal()
    write_run_files(prep)
    assert len(prep.plan.jobs) == 4
    frame = run_prepared(prep, slots=["cpu:0", "cpu:1"])
    assert set(frame.status) == {"done"} and len(frame) == 4
    j = Journal(prep.run_dir / "journal.sqlite")
    events = j.events()
    jobs = {r.id: r for r in j.jobs()}
    adapters = {a["id"]: a for a in j.adapters()}
    j.close()
    replans = [json.loads(d) for _, kind, _, d in events if kind == "replan"]
    assert replans and "reason" in replans[0] and "plan's" in replans[0]["reason"]
    first = replans[0]
    assert set(first["old"]) <= {"job-002", "job-003"}  # never a job that had started
    assert jobs["job-000"].status == "finished" and jobs["job-001"].status == "finished"
    launched = [a for _, kind, _, d in events if kind == "launch" for a in json.loads(d)["adapters"]]
    assert sorted(launched) == sorted(adapters)  # every adapter launched exactly once
    assert all(a["attempts"] == 1 for a in adapters.values())


def test_a_cpu_sweep_keeps_its_plan_and_model():
    """The calibration is a GPU sweep's: a CPU sweep (the demo) plans as before."""
    from plora.spec.loading import load_spec
    from plora.cost.sweep_model import ANALYTIC_SOURCE
    from plora.sweep import prepare, sweep_calibrator

    spec = load_spec(Path(__file__).resolve().parent.parent / "sweeps" / "demo.yaml")
    prep = prepare(spec)
    assert prep.cost_model.meta.get("plan_source") == ANALYTIC_SOURCE
    assert "memory_margin" not in prep.cost_model.meta
    assert sweep_calibrator(prep) is None


def test_a_resumed_sweep_keeps_the_row_layout_its_jobs_were_given(tmp_path):
    from plora.sweep import resolved_layout

    assert resolved_layout(tmp_path) is None
    job = tmp_path / "jobs" / "job-000"
    job.mkdir(parents=True)
    (job / "job.yaml").write_text("training:\n  row_layout: balanced\n  length_buckets: 1\n")
    assert resolved_layout(tmp_path) == ("balanced", 1)


def test_a_retried_job_is_not_taken_for_done_by_its_last_attempts_files(tmp_path):
    from types import SimpleNamespace

    from plora.engine import local as local_jobs
    from plora.engine.runner import Engine, RunningJob
    from plora.planner.plan import Job

    engine = Engine.__new__(Engine)
    engine.queue, engine.launch, engine.history = [], local_jobs.launch, {}
    engine._history("job-000").attempt = 2
    (tmp_path / "summary.json").write_text("{}")
    progress = {"final": True, "attempt": 1}
    proc = SimpleNamespace(job_dir=tmp_path, progress=lambda: progress)
    rj = RunningJob(Job("job-000", ["a"]), proc, ["cuda:0"])
    assert not engine._done_by_its_files(rj)
    progress["attempt"] = 2
    assert engine._done_by_its_files(rj)
