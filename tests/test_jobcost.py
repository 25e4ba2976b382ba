"""Job terms of the cost model: fitted from the phases jobs record, priced in job_time and
memory, cached with the profile, and a CPU sweep's makespan predicted from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import tiny_space_file
from plora.cost.model import EVAL_HEAD_BYTES, AdapterLoad, CostModel, MemoryCoeffs, TimeCoeffs

from plora.models.shape import ModelShape
from plora.cost.job import EvalLoad, JobOverheads, eval_features, fit_overheads
from plora.job.phases import PhaseClock, read_phases
from plora.cost.profiling.probes import Measurement, Probe
from plora.cost.profiling.record import Profile

TRUTH = JobOverheads(start_s=4.0, load_s=2.0, setup_s=0.5, warm_s=1.5, tail_s=0.8, capture_s=0.3,
                     eval_call_s=0.05, eval_tok_s=2e-6, eval_gen_fwd_s=0.02, eval_gen_tok_s=1e-6, save_s=0.2)


def phases_of(truth: JobOverheads, groups, samples=32, new=8, row=200.0, prompt=180.0, step=0.1, exited=True):
    """The phases a job with these adapters-leaving groups would record under ``truth``."""
    evals, saves, phases = [], [], []
    left = sum(groups)
    for i, g in enumerate(groups):
        first = step + (truth.warm_s if i == 0 else truth.capture_s)
        phases.append({"adapters": left, "steps": 10, "first_s": first, "rest_s": 9 * step})
        for adapters, m in ((left, 0), (g, new)):  # an intermediate loss eval, then the leaving group's
            x = eval_features(adapters, samples, row, prompt, m)
            c = (truth.eval_call_s, truth.eval_tok_s, truth.eval_gen_fwd_s, truth.eval_gen_tok_s)
            evals.append({"adapters": adapters, "samples": samples, "max_new_tokens": m,
                          "seconds": sum(a * b for a, b in zip(x, c))})
        saves.append({"adapters": g, "seconds": truth.save_s * g})
        left -= g
    return {"start_s": truth.start_s, "load_s": truth.load_s, "setup_s": truth.setup_s, "eval_rows": samples,
            "eval_row_tokens": row, "eval_prompt_tokens": prompt, "phases": phases, "evals": evals, "saves": saves,
            "finished_at": 100.0, **({"exited_at": 100.0 + truth.tail_s} if exited else {})}


def test_terms_are_fitted_from_measured_phases():
    runs = [phases_of(TRUTH, (1, 2, 4)), phases_of(TRUTH, (3, 1), samples=16, new=4), phases_of(TRUTH, (8,))]
    fit = fit_overheads(runs)
    for name in ("start_s", "load_s", "setup_s", "warm_s", "tail_s", "capture_s", "save_s"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6), name
    load = EvalLoad(samples=32, row_tokens=250.0, prompt_tokens=200.0, max_new_tokens=16)
    for g in (1, 4, 8, 16):  # the eval, also past the measured group sizes and new tokens
        assert fit.eval_time(g, load) == pytest.approx(TRUTH.eval_time(g, load), rel=1e-3)
    assert fit.jobs == 3 and fit.fixed_s == pytest.approx(4.0 + 2.0 + 0.5 + 1.5 + 0.8)
    with pytest.raises(ValueError, match="no job phases"):
        fit_overheads([])


def test_a_phase_that_replayed_a_held_graph_is_not_a_capture_sample():
    """A streaming job's pack returning to a composition it holds graphs for replays at once
    (`PhaseClock.step(reused=True)`): its first step is no capture, and the fit ignores it."""
    runs = [phases_of(TRUTH, (1, 2, 4))]
    reused = dict(runs[0]["phases"][1], first_s=0.1, reused=True)
    runs[0]["phases"].insert(2, reused)
    assert fit_overheads(runs).capture_s == pytest.approx(TRUTH.capture_s, rel=1e-6)
    clock = PhaseClock()
    for pack, replayed in (([0, 1], False), ([0, 1], True), ([1], True), ([0, 1], True)):
        clock.step(pack, 0.01, reused=replayed)
    assert ["reused" in p for p in clock.to_dict()["phases"]] == [False, True, True]
    assert clock.to_dict()["graphs"] is None  # a job without graphs


def test_phase_clock_records_what_the_fit_reads():
    from plora.data.dataset import Sample

    clock = PhaseClock()
    clock.loaded(0.01)
    clock.set_up([Sample([1, 2, 3, 4], [-100, -100, 3, 4]), Sample([1, 2], [-100, 2])])
    for pack in ([0, 1], [0, 1], [0, 1], [1], [1]):
        clock.step(pack, 0.01)
    ev = clock.eval_event(1, 4, "cpu")
    ev.done()
    clock.saved(1, 0.001)
    d = json.loads(json.dumps(clock.to_dict()))
    assert [p["adapters"] for p in d["phases"]] == [2, 1] and [p["steps"] for p in d["phases"]] == [3, 2]
    assert d["eval_rows"] == 2 and d["eval_row_tokens"] == 3.0 and d["eval_prompt_tokens"] == 1.5
    assert d["evals"][0]["adapters"] == 1 and d["evals"][0]["max_new_tokens"] == 4
    assert d["start_s"] is None or d["start_s"] >= 0
    fit = fit_overheads([d])
    assert fit.save_s == pytest.approx(0.001) and fit.load_s == pytest.approx(0.01)


def model(overheads=None, eval_load=None) -> CostModel:
    return CostModel(80 * 2**30, 256, {1: TimeCoeffs(0.01, 1e-6, 1e-9, 1e-3)},
                     {1: MemoryCoeffs(2e9, 1e6, 1e5, 1e5, 10.0)}).with_overheads(overheads).for_eval(eval_load)


def test_job_time_prices_start_captures_evals_and_saves():
    base = model()
    load = EvalLoad(samples=32, row_tokens=250.0, prompt_tokens=200.0, max_new_tokens=16)
    cm = model(TRUTH, load)
    a, b, c = AdapterLoad("a", 8, 2, 100), AdapterLoad("b", 16, 4, 100), AdapterLoad("c", 64, 2, 200)
    steps_only = base.job_time([a, b, c], 1)
    # two pack compositions (one capture); a and b leave together, then c alone
    expected = steps_only + TRUTH.fixed_s + TRUTH.capture_s + TRUTH.exit_time(2, load) + TRUTH.exit_time(1, load)
    assert cm.job_time([a, b, c], 1) == pytest.approx(expected)
    assert cm.job_overhead_s == pytest.approx(TRUTH.fixed_s)  # what the planner adds once per job
    assert cm.exit_time(2) > cm.exit_time(1) > 0 and base.exit_time(3) == 0.0
    # without an eval load, leaving adapters cost their saves only
    assert model(TRUTH).job_time([a], 1) == pytest.approx(base.job_time([a], 1) + TRUTH.fixed_s + TRUTH.save_s)
    # a re-plan scales every term
    assert cm.scaled(2.0).job_time([a, b, c], 1) == pytest.approx(2 * cm.job_time([a, b, c], 1))
    assert cm.step_time([a, b], 1) == base.step_time([a, b], 1)  # the planner's step is untouched


def test_adapters_scored_beside_training_hold_their_job_up_for_their_saves_only():
    """On one GPU a job scores leaving adapters on its side lane while the others train on:
    only the last group's eval (nothing stays) is paid in line, and a TP job pays all."""
    from dataclasses import replace

    load = EvalLoad(samples=200, row_tokens=40.0, prompt_tokens=38.0, max_new_tokens=6)
    inline, beside = model(TRUTH, load), model(TRUTH, replace(load, beside_training=True))
    a, b, c = AdapterLoad("a", 8, 2, 100), AdapterLoad("b", 16, 4, 100), AdapterLoad("c", 64, 2, 200)
    hidden = TRUTH.exit_time(2, load) - 2 * TRUTH.save_s  # a and b scored while c trains
    assert beside.job_time([a, b, c], 1) == pytest.approx(inline.job_time([a, b, c], 1) - hidden)
    assert beside.job_time([a, b], 1) == pytest.approx(inline.job_time([a, b], 1))  # they leave last
    assert beside.exit_pause(2, 1, inline=True) == TRUTH.exit_time(2, load)
    assert beside.exit_pause(2, 1, inline=False) == pytest.approx(2 * TRUTH.save_s)
    assert beside.exit_pause(2, 2, inline=False) == TRUTH.exit_time(2, load)  # no lane in a TP job
    assert EvalLoad.from_dict(replace(load, beside_training=True).to_dict()).beside_training
    assert not EvalLoad.from_dict({"samples": 4, "row_tokens": 9.0}).beside_training  # older caches
    # per-epoch scoring: the epoch-end evals before the final one run in line
    epochs = model(TRUTH, replace(load, beside_training=True, evals=3))
    assert epochs.exit_pause(2, 1, inline=False) == pytest.approx(2 * TRUTH.eval_time(2, load) + 2 * TRUTH.save_s)
    # jobs that never score beside training (joins, accumulation): every eval in line
    assert beside.scored_in_line().job_time([a, b, c], 1) == pytest.approx(inline.job_time([a, b, c], 1))
    assert inline.scored_in_line() is inline


def test_a_gpu_sweep_scores_beside_training_unless_the_lane_is_off(tmp_path, monkeypatch):
    from plora.cost.sweep_rows import eval_load_for
    from plora.spec.loading import load_spec

    def spec(name: str, **training):
        path = tiny_space_file(tmp_path / name, name=name, data={"task": "builtin:shift", "num_train": 16, "num_eval": 4},
                               space={"rank": [2], "batch_size": [2]}, training={"steps": 2, **training})
        return load_spec(path)

    plain = spec("plain")
    assert eval_load_for(plain, gpu=True).beside_training
    assert not eval_load_for(plain, gpu=False).beside_training  # a CPU job has no lane
    assert not eval_load_for(spec("micro", micro_batch_size=1), gpu=True).beside_training
    assert not eval_load_for(spec("eager", cuda_graphs=False), gpu=True).beside_training
    monkeypatch.setenv("PLORA_OVERLAP", "0")
    assert not eval_load_for(plain, gpu=True).beside_training


def test_steps_are_timed_by_the_sweeps_real_tokens_and_memory_by_the_longest_row():
    cm = model()
    a = AdapterLoad("a", 8, 4, 10)
    half = cm.for_rows(128.0)
    c = cm.time[1]
    assert half.step_time([a], 1) == pytest.approx(c.c0 + 4 * 128 * (c.c_tok + 8 * c.c_rtok) + c.c_ad)
    assert half.memory([a], 1) == cm.memory([a], 1)
    assert cm.for_rows(10_000.0).row_tokens == 256  # never past max_seq_len
    assert CostModel.from_dict(half.to_dict()).row_tokens == 128.0 and cm.for_rows(None).row_tokens is None


def test_eval_memory_is_bounded_by_the_eval_batch_and_its_budget():
    loads = [AdapterLoad(f"x{i}", 16, 2, 128) for i in range(16)]
    train = model().memory(loads, 1)
    big = EvalLoad(samples=32, row_tokens=250.0, prompt_tokens=200.0, max_new_tokens=16)
    cm = model(TRUTH, big)
    m = cm.memory_coeffs[1]
    state = cm.memory_base(1) + 16 * (m.adapter + m.rank * 16)
    # 16 adapters leave together: 512 rows, the batch is 256 rows of 250 tokens
    assert cm.eval_memory(loads, 1) == pytest.approx(state + m.tok * 256 * 250)  # no shape: training's bytes
    shaped = CostModel.from_dict({**cm.to_dict(), "meta": {"shape": ModelShape.preset("qwen2.5-0.5b").to_dict()}})
    per_token = 16 * 896 * 2  # a few hidden-size bf16 activations: the head's logits come a chunk at a time
    assert shaped.eval_bytes_per_token(1) == per_token
    assert shaped.eval_memory(loads, 1) == pytest.approx(state + per_token * 256 * 250 + EVAL_HEAD_BYTES)
    # 16 adapters x 32 samples of 250 tokens: a few GiB, not the full logits' hundreds
    assert shaped.eval_memory(loads, 1) < 8 * 2**30
    assert cm.memory(loads, 1) == max(train, cm.eval_memory(loads, 1))
    budgeted = model(TRUTH, EvalLoad(32, 250.0, 200.0, 16, budget_bytes=1e8))
    assert budgeted.eval_memory(loads, 1) == pytest.approx(state + 1e8)
    assert model(TRUTH).eval_memory(loads, 1) == 0.0 and model(TRUTH).memory(loads, 1) == train


def test_cost_model_and_profile_round_trip_with_job_terms(tmp_path):
    load = EvalLoad(samples=8, row_tokens=30.0, prompt_tokens=20.0, max_new_tokens=4)
    cm = model(TRUTH, load)
    again = CostModel.from_dict(json.loads(json.dumps(cm.to_dict())))
    assert again.overheads == TRUTH and again.eval_load == load and again.to_dict() == cm.to_dict()
    runs = [phases_of(TRUTH, (1, 2))]
    meas = [Measurement(Probe("p", (8,), (2,)), 256, step_times=[0.1, 0.1], peak_bytes=3e9)]
    prof = Profile(model(fit_overheads(runs)), meas, [], {"model": "m"}, job_runs=runs)
    path = prof.save(tmp_path / "profile.json")
    loaded = Profile.load(path)
    assert loaded.job_runs == runs and loaded.cost_model.overheads == prof.cost_model.overheads
    assert CostModel.load(path).job_time([AdapterLoad("a", 8, 2, 10)], 1) == \
        prof.cost_model.job_time([AdapterLoad("a", 8, 2, 10)], 1)


def test_old_cached_profiles_without_job_terms_still_load(tmp_path):
    meas = [Measurement(Probe("p", (8,), (2,)), 256, step_times=[0.1, 0.1], peak_bytes=3e9)]
    data = Profile(model(), meas, [], {"model": "m"}).to_dict()
    assert "job_runs" not in data and "overheads" not in data["cost_model"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = Profile.load(tmp_path / "old.json")
    assert old.job_runs == [] and old.cost_model.overheads is None and old.cost_model.eval_load is None
    a = AdapterLoad("a", 8, 2, 10)
    assert old.cost_model.job_time([a], 1) == pytest.approx(10 * old.cost_model.step_time([a], 1))
    # the shipped GPU profiles (written before job terms) load as before
    shipped = sorted((Path(__file__).parent.parent / "scripts" / "profiles").glob("*.json"))
    assert shipped and all(Profile.load(p).cost_model.overheads is None for p in shipped)


def test_read_phases_of_a_job_dir(tmp_path):
    assert read_phases(tmp_path) is None
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 3, "phases": {"load_s": 1.0}}))
    assert read_phases(tmp_path, 5.0) == {"load_s": 1.0, "exited_at": 5.0}
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 3}))
    assert read_phases(tmp_path) is None


def test_real_job_probe_on_the_tiny_model(tiny_model):
    """One real job process (tune run): every phase is measured and the terms fit."""
    from plora.cost.profiling.job_probe import run_job_probe

    run = run_job_probe(tiny_model, seq_len=32, dtype="float32", device="cpu", targets=["q_proj", "v_proj"])
    assert run is not None
    assert run["start_s"] > 0 and run["load_s"] > 0 and run["exited_at"] >= run["finished_at"]
    assert [p["adapters"] for p in run["phases"]] == [4, 3, 1]
    finals = [e["adapters"] for e in run["evals"] if e["max_new_tokens"] > 0]
    assert finals == [1, 2, 1] and any(e["max_new_tokens"] == 0 for e in run["evals"])
    terms = fit_overheads([run])
    assert terms.start_s > 0 and terms.save_s > 0
    assert terms.eval_time(2, EvalLoad(4, 32.0, 26.0, 4)) > 0


def sweep_space(tmp_path: Path, num_train: int) -> Path:
    return tiny_space_file(
        tmp_path, name="cm", max_seq_len=32, num_train=num_train, num_eval=32,
        lora={"targets": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        space={"strategy": "grid", "rank": [2, 8], "alpha": {"relative": [2]},
               "learning_rate": [1e-3, 1e-2], "batch_size": [4, 16]},
        training={"epochs": 1, "scheduler": "constant", "grad_clip": 1.0},
        eval={"metrics": ["loss", "exact_match"], "max_new_tokens": 8}, planner={"max_adapters_per_job": 4})


@pytest.mark.slow
def test_cpu_sweep_makespan_is_predicted(tmp_path, capsys):
    """Profile (probes and the job probe), plan, run: the engine's makespan against the plan's.
    CPU timing on a shared machine is noisy, so the bound is loose; the ratio is printed."""
    from plora.engine.journal import measured_makespan
    from plora.cost.profiling.profile import profile_sweep
    from plora.spec.loading import load_spec
    from plora.sweep import prepare, run_prepared, write_run_files

    spec = load_spec(sweep_space(tmp_path, 512))
    cm = profile_sweep(spec, None)
    assert cm.overheads is not None and cm.overheads.start_s > 0
    prep = prepare(spec)
    assert prep.cost_model.eval_load is not None and prep.cost_model.eval_load.max_new_tokens == 8
    write_run_files(prep)
    predicted = prep.plan.makespan
    frame = run_prepared(prep)
    assert set(frame.status) == {"done"}
    measured = measured_makespan(prep.run_dir)
    ratio = measured / predicted
    with capsys.disabled():
        print(f"\nCPU sweep: predicted {predicted:.1f} s, measured {measured:.1f} s, measured/predicted {ratio:.2f}")
    assert 1 / 1.5 <= ratio <= 1.5
    # the sweep's jobs refitted the cached job terms
    from plora.cost.profiling.cache import sweep_cache_path

    assert Profile.load(sweep_cache_path(spec)).cost_model.overheads.jobs == 1 + len(prep.plan.jobs)


def test_the_eval_load_counts_the_rows_a_job_scores(tmp_path):
    """The eval a sweep's cost model prices is the job's: the rows left after tokenizing,
    at most ``data.max_eval_samples`` of them."""
    from plora.cost.sweep_rows import eval_load_for
    from plora.spec.loading import load_spec

    def load(**data):
        path = tiny_space_file(tmp_path, data={"task": "builtin:shift", "num_train": 24, "num_eval": 8, **data},
                               space={"rank": [2], "batch_size": [2]}, training={"steps": 2},
                               eval={"metrics": ["loss", "exact_match"], "max_new_tokens": 4})
        return eval_load_for(load_spec(path))

    assert load().samples == 8
    capped = load(max_eval_samples=3)
    assert capped.samples == 3 and capped.max_new_tokens == 4 and 0 < capped.prompt_tokens < capped.row_tokens


def test_an_eval_forward_takes_more_rows_on_a_gpu_and_the_cost_model_counts_them(tmp_path):
    """On a GPU an eval forward's cost is mostly fixed, so it takes up to 2048 rows (256 on a
    CPU) unless ``eval.batch_rows`` says; the priced eval counts its forwards by the rows the
    job will use, the fit by the rows each measured eval used, and the eval's memory is priced
    at the CPU's rows (a GPU eval only takes what is free when it runs)."""
    from plora.data.check import eval_config
    from plora.cost.sweep_rows import eval_load_for
    from plora.spec.defaults import EVAL_BATCH_ROWS, EVAL_BATCH_ROWS_GPU, eval_batch_rows
    from plora.spec.loading import load_spec

    assert (eval_batch_rows(None, "cpu"), eval_batch_rows(None, "cuda")) == (256, 2048)
    assert eval_batch_rows(64, "cuda") == 64 == eval_batch_rows(64, "cpu")

    def spec(**eval_section):
        root = tmp_path / str(len(eval_section))
        root.mkdir(exist_ok=True)
        path = tiny_space_file(root, data={"task": "builtin:shift", "num_train": 24, "num_eval": 8},
                               space={"rank": [2], "batch_size": [2]}, training={"steps": 2},
                               eval={"metrics": ["loss", "exact_match"], "max_new_tokens": 4, **eval_section})
        return load_spec(path)

    plain, set_ = spec(), spec(batch_rows=96)
    assert eval_load_for(plain, gpu=True).batch_rows == EVAL_BATCH_ROWS_GPU
    assert eval_load_for(plain, gpu=False).batch_rows == EVAL_BATCH_ROWS
    assert eval_load_for(set_, gpu=True).batch_rows == 96
    assert eval_config(plain).batch_rows is None and eval_config(set_).batch_rows == 96  # the job decides by its device

    # a fit on GPU evals (2048 rows a forward) prices the same evals back
    gpu_evals = []
    for adapters, m in ((8, 0), (8, 8), (24, 8), (3, 8)):
        x = eval_features(adapters, 200, 80.0, 70.0, m, EVAL_BATCH_ROWS_GPU)
        c = (TRUTH.eval_call_s, TRUTH.eval_tok_s, TRUTH.eval_gen_fwd_s, TRUTH.eval_gen_tok_s)
        gpu_evals.append({"adapters": adapters, "samples": 200, "max_new_tokens": m, "batch_rows": EVAL_BATCH_ROWS_GPU,
                          "seconds": sum(a * b for a, b in zip(x, c))})
    run = dict(phases_of(TRUTH, (8,)), evals=gpu_evals, eval_row_tokens=80.0, eval_prompt_tokens=70.0)
    fit = fit_overheads([run])
    load = EvalLoad(samples=200, row_tokens=80.0, prompt_tokens=70.0, max_new_tokens=8, batch_rows=EVAL_BATCH_ROWS_GPU)
    for g in (2, 12, 24):
        assert fit.eval_time(g, load) == pytest.approx(TRUTH.eval_time(g, load), rel=1e-3)

    loads = [AdapterLoad(f"x{i}", 16, 2, 128) for i in range(16)]
    wide = model(TRUTH, EvalLoad(32, 250.0, 200.0, 16, batch_rows=EVAL_BATCH_ROWS_GPU))
    narrow = model(TRUTH, EvalLoad(32, 250.0, 200.0, 16))
    assert wide.eval_memory(loads, 1) == narrow.eval_memory(loads, 1)


def test_a_job_evaluates_with_its_devices_rows_and_records_them(tmp_path):
    from plora.job.phases import PhaseClock
    from plora.job.config import JobEval
    from plora.train.evaluator import Evaluator

    import torch

    clock = PhaseClock()
    ev = Evaluator(None, None, [], [], JobEval(), max_seq_len=32, device=torch.device("cpu"), clock=clock)
    assert ev.batch_rows == 256
    assert Evaluator(None, None, [], [], JobEval(batch_rows=7), max_seq_len=32, device=torch.device("cpu"),
                     clock=clock).batch_rows == 7
    assert Evaluator(None, None, [], [], JobEval(), max_seq_len=32, device=torch.device("cuda"),
                     clock=clock).batch_rows == 2048
    event = clock.eval_event(2, 4, "cpu", batch_rows=ev.batch_rows)
    event.done()
    assert clock.to_dict()["evals"][-1]["batch_rows"] == 256


def test_a_gpu_sweeps_first_plan_prices_its_evals_generation_included(tmp_path, monkeypatch):
    """Before anything is measured on a GPU, the prior's job terms price each group of
    adapters leaving together: its eval's tokens and, where a metric generates, a forward per
    new token of each eval batch. A flat per-job overhead had priced no generation."""
    from plora import gpu_facts
    from plora.cost.sweep_model import GPU_JOB_TERMS
    from plora.spec.defaults import EVAL_BATCH_ROWS_GPU
    from plora.spec.loading import load_spec
    from plora.sweep import prepare

    monkeypatch.setattr(gpu_facts, "visible_gpus", lambda: (gpu_facts.GpuFacts("NVIDIA H200", 150_000_000_000),))
    monkeypatch.setenv("PLORA_CACHE_DIR", str(tmp_path / "cache"))  # nothing measured here yet

    def first_model(name: str, **eval_section):
        path = tiny_space_file(tmp_path / name, name=name, data={"task": "builtin:shift", "num_train": 24, "num_eval": 8},
                               space={"rank": [2], "batch_size": [2]}, training={"steps": 2},
                               hardware={"device": "cuda", "gpus": 1}, eval=eval_section)
        prep = prepare(load_spec(path), probe=False, check_model=False)
        assert "analytic" in prep.plan.cost_model_source
        return prep.cost_model

    loss = first_model("loss", metrics=["loss"], max_new_tokens=6)
    generated = first_model("gen", metrics=["loss", "exact_match"], max_new_tokens=6)
    assert loss.overheads == generated.overheads == GPU_JOB_TERMS
    assert loss.job_overhead_s == GPU_JOB_TERMS.fixed_s
    assert generated.eval_load.max_new_tokens == 6 and loss.eval_load.max_new_tokens == 0
    assert generated.eval_load.batch_rows == EVAL_BATCH_ROWS_GPU
    adapters = [AdapterLoad(f"a{i}", 2, 2, 2) for i in range(4)]
    extra = generated.job_time(adapters, 1) - loss.job_time(adapters, 1)
    # 4 adapters x 8 rows: one batch, a forward for each of the 6 new tokens (and their tokens)
    assert extra >= 6 * GPU_JOB_TERMS.eval_gen_fwd_s
