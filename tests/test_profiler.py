"""The profiler: the fit recovers a known model, profiles round-trip, the cache saves probing,
and a real probe on the tiny model measures something."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from plora.cli import app
from plora.cost.model import AdapterLoad, CostModel, MemoryCoeffs, TimeCoeffs
from plora.models.shape import ModelShape
from plora.cost.profiling import profile as profiler
from plora.cost.profiling.errors import ProfileError
from plora.cost.profiling.fit import _nnls_relative, _time_row, fit_cost_model
from plora.cost.profiling.measure import run_probe
from plora.cost.profiling.probes import Measurement, Probe, calibration_probes, fit_probes, holdout_probes, limit_probes
from plora.cost.profiling.profile import profile_sweep
from plora.cost.profiling.record import Profile
from plora.cost.profiling.validate import prediction_errors
from plora.spec.loading import parse_spec

SHAPE = ModelShape.preset("qwen2.5-7b")
SEQ = 1024
GPU = 80 * 2**30
#: a 7B-like truth: 15 GiB base, ~7 MiB per token, AdamW state per rank, LoRA activations
TRUE = CostModel(
    GPU, SEQ,
    time={1: TimeCoeffs(c0=0.030, c_tok=7.5e-5, c_rtok=2.0e-8, c_ad=1.5e-3)},
    memory_coeffs={1: MemoryCoeffs(base=15.5 * 2**30, adapter=24 * 2**20, rank=15 * 2**20, tok=7.3 * 2**20,
                                   rank_tok=800.0)},
)


def synthetic(probes, truth: CostModel = TRUE, noise: float = 0.0, seed: int = 0) -> list[Measurement]:
    """What probes of a machine that follows ``truth`` exactly (times relative noise) would measure."""
    rng = random.Random(seed)
    out = []
    for p in probes:
        t = truth.step_time(p.loads(), 1)
        m = truth.memory(p.loads(), 1)
        times = [t * (1 + rng.gauss(0, noise)) for _ in range(10)]
        out.append(Measurement(p, truth.seq_len, times, peak_bytes=m * (1 + rng.gauss(0, noise / 4))))
    return out


def all_fit_probes(rows: int = 8) -> list[Probe]:
    return calibration_probes() + fit_probes(rows)


# ------------------------------------------------------------------------------- fit


def test_fit_recovers_known_model_exactly_without_noise():
    cm = fit_cost_model(synthetic(all_fit_probes()), SHAPE, SEQ, GPU, targets="all-linear")
    got_t, want_t = cm.time[1], TRUE.time[1]
    for k in ("c0", "c_tok", "c_rtok", "c_ad"):
        assert getattr(got_t, k) == pytest.approx(getattr(want_t, k), rel=1e-4), k
    got_m, want_m = cm.memory_coeffs[1], TRUE.memory_coeffs[1]
    for k in ("base", "adapter", "rank", "tok", "rank_tok"):
        assert getattr(got_m, k) == pytest.approx(getattr(want_m, k), rel=1e-4), k
    assert cm.meta["source"] == "profile" and cm.meta["measured_degrees"] == [1]


def test_fit_with_noise_predicts_held_out_packs():
    cm = fit_cost_model(synthetic(all_fit_probes(), noise=0.02, seed=1), SHAPE, SEQ, GPU, targets="all-linear")
    assert cm.time[1].c_tok == pytest.approx(TRUE.time[1].c_tok, rel=0.05)
    assert cm.memory_coeffs[1].base == pytest.approx(TRUE.memory_coeffs[1].base, rel=0.02)
    assert cm.memory_coeffs[1].tok == pytest.approx(TRUE.memory_coeffs[1].tok, rel=0.02)
    held = synthetic(holdout_probes(8, n=6, seed=3))
    for row in prediction_errors(cm, held):
        assert abs(row["time_err"]) < 0.05, row
        assert abs(row["memory_err"]) < 0.02, row


#: a launch-bound small model: the host takes 150 ms per step (plus per adapter and bucket)
#: whatever the tokens, the GPU catches up only on the large probes
HOST_BOUND = CostModel(
    GPU, SEQ,
    time={1: TimeCoeffs(c0=0.020, c_tok=1.2e-5, c_rtok=2.0e-9, c_ad=2e-4, c_bkt=0.004)},
    memory_coeffs=TRUE.memory_coeffs,
    host_time={1: TimeCoeffs(c0=0.150, c_tok=0.0, c_rtok=0.0, c_ad=1e-3, c_bkt=0.020)},
)


def test_fit_recovers_a_host_bound_step_and_predicts_held_out_packs():
    probes = calibration_probes() + fit_probes(24)
    truth_share = [HOST_BOUND.time[1].c0 + 1.2e-5 * p.tokens(SEQ) > 0.15 for p in probes]
    assert any(truth_share) and not all(truth_share)  # both regimes are probed
    cm = fit_cost_model(synthetic(probes, HOST_BOUND, noise=0.02, seed=2), SHAPE, SEQ, GPU, targets="all-linear")
    assert cm.meta["step_time_pieces"] == 2 and 1 in cm.host_time
    assert cm.host_time[1].c0 == pytest.approx(0.150, rel=0.1)
    assert cm.time[1].c_tok == pytest.approx(1.2e-5, rel=0.15)
    for row in prediction_errors(cm, synthetic(holdout_probes(24, n=8, seed=5), HOST_BOUND)):
        assert abs(row["time_err"]) < 0.06, row
    # one linear form cannot follow both regimes
    one = CostModel(GPU, SEQ, {1: TimeCoeffs(*_nnls_relative(
        np.array([_time_row(p, SEQ) for p in probes]), np.array([HOST_BOUND.step_time(p.loads(), 1) for p in probes])))},
        TRUE.memory_coeffs)
    assert max(abs(r["time_err"]) for r in prediction_errors(one, synthetic(probes, HOST_BOUND))) > 0.1


def test_fit_keeps_one_piece_when_the_step_is_linear():
    cm = fit_cost_model(synthetic(all_fit_probes(), noise=0.01, seed=4), SHAPE, SEQ, GPU)
    assert cm.meta["step_time_pieces"] == 1 and not cm.host_time


def test_host_piece_round_trips_and_scales(tmp_path):
    path = tmp_path / "cm.json"
    HOST_BOUND.save(path)
    back = CostModel.load(path)
    assert back.host_time == HOST_BOUND.host_time
    loads = [AdapterLoad("a", 8, 1, 10), AdapterLoad("b", 64, 2, 5)]
    assert back.step_time(loads, 1) == pytest.approx(HOST_BOUND.step_time(loads, 1))
    assert HOST_BOUND.scaled(2.0).step_time(loads, 1) == pytest.approx(2 * HOST_BOUND.step_time(loads, 1))
    # a step is the longer piece; the job runs 5 steps with both adapters, 5 with one
    two = HOST_BOUND.step_time(loads, 1)
    assert two == pytest.approx(0.150 + 2e-3 + 2 * 0.020)
    assert HOST_BOUND.job_time(loads, 1) == pytest.approx(5 * two + 5 * HOST_BOUND.step_time(loads[:1], 1))


def test_fit_skips_oom_probes_and_needs_enough_of_them():
    ms = synthetic(all_fit_probes())
    ms[3].oom, ms[3].step_times = True, []
    cm = fit_cost_model(ms, SHAPE, SEQ, GPU)
    assert cm.meta["probes_used"] == len(ms) - 1
    with pytest.raises(ProfileError, match="at least 5"):
        fit_cost_model(ms[:4], SHAPE, SEQ, GPU)


def test_probe_design_varies_features_independently():
    probes = all_fit_probes(8)
    rows = [[1, p.adapters, p.rank_sum, p.tokens(SEQ), p.rank_tokens(SEQ)] for p in probes]
    import numpy as np

    assert np.linalg.matrix_rank(np.array(rows, dtype=float)) == 5
    names = {(p.ranks, p.batch_sizes) for p in probes}
    assert not names & {(p.ranks, p.batch_sizes) for p in holdout_probes(8, n=8)}
    assert all(p.adapters <= 8 for p in fit_probes(3, kmax=16)) and max(p.adapters for p in fit_probes(40)) == 16


def test_tp_degrees_are_extrapolated_from_the_measured_one():
    cm = fit_cost_model(synthetic(all_fit_probes()), SHAPE, SEQ, GPU, targets="all-linear", tp_degrees=(1, 2, 4))
    assert cm.degrees == (1, 2, 4)
    assert cm.meta["extrapolated_degrees"] == [2, 4]
    weights = SHAPE.n_params * SHAPE.dtype_bytes
    assert cm.memory_coeffs[2].base == pytest.approx(TRUE.memory_coeffs[1].base - weights / 2, rel=1e-3)
    assert cm.memory_coeffs[4].tok < cm.memory_coeffs[2].tok < cm.memory_coeffs[1].tok
    assert cm.time[4].c_tok < cm.time[2].c_tok < cm.time[1].c_tok
    assert cm.time[2].c_ad == cm.time[1].c_ad  # per-adapter overhead is not sharded


def test_limit_packs_just_fit():
    for lf in (0.9, 0.5):
        packs = limit_probes(TRUE, lf)
        assert packs
        for p in packs:
            assert TRUE.fits(p.loads(), 1, lf)
            bigger = Probe("b", p.ranks, (p.batch_sizes[0] + 1, *p.batch_sizes[1:]))
            assert not TRUE.fits(bigger.loads(), 1, lf) or p.batch_sizes[0] < max(p.batch_sizes)
            # within one row of the limit
            assert TRUE.memory(p.loads(), 1) > lf * GPU - TRUE.memory_per_adapter(bigger.loads()[0], 1)


# ------------------------------------------------------------------------- profile.json


def make_profile() -> Profile:
    fit = synthetic(all_fit_probes(), noise=0.01)
    held = synthetic(holdout_probes(8, n=3), noise=0.01)
    held.append(Measurement(Probe("limit-x", (64, 128), (6, 5), role="limit"), SEQ, oom=True, error="out of memory"))
    cm = fit_cost_model(fit, SHAPE, SEQ, GPU, targets="all-linear", tp_degrees=(1, 2))
    key = {"model": "abc", "model_name": SHAPE.name, "seq_len": SEQ, "dtype": "bfloat16", "device": "X",
           "backend": "triton", "tp": 1}
    return Profile(cm, fit, held, key, 0.9, {"profiling_s": 12.5, "validation_s": 3.0})


def test_profile_json_round_trips(tmp_path):
    prof = make_profile()
    path = prof.save(tmp_path / "profile.json")
    again = Profile.load(path)
    assert again.to_dict() == prof.to_dict()
    assert again.cost_model.to_dict() == prof.cost_model.to_dict()
    # The planner reads the cost model straight from the file.
    cm = CostModel.load(path)
    loads = holdout_probes(8)[1].loads()
    assert cm.step_time(loads, 2) == prof.cost_model.step_time(loads, 2)
    data = json.loads(path.read_text())
    assert data["summary"]["oom"] == 1 and data["summary"]["packs"] == 4
    with pytest.raises(ProfileError):
        Profile.load(tmp_path / "missing.json")


# --------------------------------------------------------------------------------- cache


def space(tmp_path: Path, model_dir: Path, **over) -> Path:
    data = {
        "name": "prof",
        "model": {"path": str(model_dir), "max_seq_len": 32},
        "lora": {"targets": ["q_proj", "v_proj"]},
        "hardware": {"device": "cpu", "gpu_memory_gb": 4},
        "output": {"dir": str(tmp_path / "runs")},
        **over,
    }
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def fake_probes(monkeypatch, tmp_path):
    """Probes answered from a known model, counted."""
    monkeypatch.setenv("PLORA_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def fake(model_dir, probe, *, seq_len, **kw):
        calls.append(probe.name)
        truth = CostModel(4 * 2**30, seq_len, {1: TimeCoeffs(0.01, 2e-5, 1e-8, 1e-3)},
                          {1: MemoryCoeffs(3e8, 1e5, 2e4, 3e4, 50.0)})
        return synthetic([probe], truth)[0]

    monkeypatch.setattr(profiler, "run_probe", fake)
    monkeypatch.setattr(profiler, "run_job_probe", lambda *a, **kw: None)  # no real job: test_jobcost has one
    return calls


def test_cached_profile_is_reused_without_probing(tmp_path, tiny_model, fake_probes):
    spec = parse_spec(yaml.safe_load(space(tmp_path, tiny_model).read_text()))
    cm1 = profile_sweep(spec, tmp_path / "run1")
    n = len(fake_probes)
    assert n >= 9 + 3  # fit probes and held-out packs
    first = Profile.load(tmp_path / "run1" / "profile.json")
    assert not first.reused and Path(first.cache_path).is_file()
    assert Path(first.cache_path).parent == tmp_path / "cache"

    cm2 = profile_sweep(spec, tmp_path / "run2")
    assert len(fake_probes) == n  # no probe ran
    second = Profile.load(tmp_path / "run2" / "profile.json")
    assert second.reused and second.cache_path == first.cache_path
    assert cm2.to_dict() == cm1.to_dict()

    # Another sequence length is another profile; --force probes again.
    other = parse_spec(yaml.safe_load(space(tmp_path, tiny_model, model={"path": str(tiny_model),
                                                                       "max_seq_len": 16}).read_text()))
    profile_sweep(other, tmp_path / "run3")
    assert len(fake_probes) == 2 * n
    profile_sweep(spec, tmp_path / "run4", force=True)
    assert len(fake_probes) == 3 * n


def test_cached_profile_gets_the_sweeps_tp_degrees(tmp_path, tiny_model, fake_probes):
    spec = parse_spec(yaml.safe_load(space(tmp_path, tiny_model).read_text()))
    assert profile_sweep(spec, tmp_path / "r1").degrees == (1,)
    spec2 = parse_spec(yaml.safe_load(space(tmp_path, tiny_model, hardware={"device": "cpu", "gpus": 2,
                                                                           "gpu_memory_gb": 4}).read_text()))
    n = len(fake_probes)
    cm = profile_sweep(spec2, tmp_path / "r2")
    assert len(fake_probes) == n and cm.degrees == (1, 2) and cm.meta["extrapolated_degrees"] == [2]


def test_cli_profile_prints_model_and_held_out_error(tmp_path, tiny_model, fake_probes):
    result = CliRunner().invoke(app, ["profile", str(space(tmp_path, tiny_model))])
    assert result.exit_code == 0, result.output
    assert "cost model of" in result.output and "held-out error" in result.output
    assert (tmp_path / "runs" / "prof" / "profile.json").is_file()
    again = CliRunner().invoke(app, ["profile", str(space(tmp_path, tiny_model))])
    assert again.exit_code == 0 and "reused the cached profile" in again.output


def test_cli_profile_bad_model_is_one_line(tmp_path):
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    result = CliRunner().invoke(app, ["profile", str(space(tmp_path, bad))])
    assert result.exit_code == 2
    assert "error:" in result.output and "Traceback" not in result.output


# ------------------------------------------------------------------------- real probes


def test_real_probe_on_the_tiny_model(tiny_model):
    p = Probe("t", (4, 8), (2, 1))
    m = run_probe(tiny_model, p, seq_len=16, dtype="float32", device="cpu", targets=["q_proj", "v_proj"],
                  warmup=1, iters=2, num_threads=1)
    assert m.ok and len(m.step_times) == 2 and all(t > 0 for t in m.step_times)
    assert m.peak_bytes > 0 and m.allocated_peak is None


def test_out_of_memory_is_a_result(tiny_model, monkeypatch):
    import torch

    from plora.train.packed_lora import PackedLoRARecipe

    def boom(self, active, step):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(PackedLoRARecipe, "train_step", boom)
    m = run_probe(tiny_model, Probe("t", (4,), (1,)), seq_len=16, dtype="float32", device="cpu",
                  targets=["q_proj"], warmup=1, iters=1, num_threads=1)
    assert m.oom and not m.ok and m.step_times == []


def test_deadline_skips_validation_after_min_checks(tmp_path, tiny_model, fake_probes):
    from plora.cost.profiling.cache import shape_from_model
    from plora.cost.profiling.profile import profile_model

    shape = shape_from_model(tiny_model, dtype="float32")
    prof = profile_model(tiny_model, shape, seq_len=32, dtype="float32", device="cpu", gpu_memory_bytes=4 * 2**30,
                         holdout=4, deadline=0.0, min_checks=2)
    assert len(prof.measurements) == 2 + len(fit_probes(8)) and [m.probe.name for m in prof.holdout] == ["ho-1", "ho-2"]
    assert prof.cost_model.meta["holdout"]["packs"] == 2


def test_job_overhead_a_sweep_measured_is_kept_for_the_next(tmp_path, tiny_model, fake_probes):
    """Probes cannot see a job's start-up and evaluation; once a sweep has measured them,
    the cached profile carries them to the next sweep's first plan, without probing."""
    from plora.cost.profiling.cache import remember_job_overhead

    spec = parse_spec(yaml.safe_load(space(tmp_path, tiny_model).read_text()))
    assert remember_job_overhead(spec, 12.5, 3) is None  # nothing cached yet: nothing written
    assert profile_sweep(spec, tmp_path / "run1").job_overhead_s == 0.0
    n = len(fake_probes)
    path = remember_job_overhead(spec, 12.5, 3)
    assert path is not None and path.is_file()
    cm = profile_sweep(spec, tmp_path / "run2")
    assert len(fake_probes) == n
    assert cm.job_overhead_s == 12.5 and cm.meta["job_overhead"]["jobs"] == 3


def test_fill_probes_join_the_fit_at_the_memory_limit(tiny_model, fake_probes):
    """The largest fit probes are placed by the first fit's memory model just under the
    load factor (the planner's packs are that large), and the final fit includes them."""
    from plora.cost.profiling.cache import shape_from_model
    from plora.cost.profiling.probes import FILL_SHARE
    from plora.cost.profiling.profile import profile_model

    shape = shape_from_model(tiny_model, dtype="float32")
    gpu = 4 * 2**30
    prof = profile_model(tiny_model, shape, seq_len=32, dtype="float32", device="cpu", gpu_memory_bytes=gpu,
                         holdout=2, fill=True, max_rows=100_000)
    fills = [m for m in prof.measurements if m.probe.name.startswith("fill-")]
    assert [m.probe.name for m in fills] == ["fill-r32", "fill-k4"] and all(m.probe.role == "fit" for m in fills)
    assert fake_probes.index("fill-r32") > fake_probes.index(fit_probes(8)[-1].name)  # after the first fit
    cm = prof.cost_model
    for m in fills:
        used = cm.memory(m.probe.loads(), 1)
        assert 0.95 * FILL_SHARE * 0.9 * gpu < used <= FILL_SHARE * 0.9 * gpu
        assert m.probe.rows > 100  # far beyond the calibrated probes

    capped = profile_model(tiny_model, shape, seq_len=32, dtype="float32", device="cpu", gpu_memory_bytes=gpu,
                           holdout=1, fill=True)  # CPU: max_rows defaults to a few rows
    assert all(m.probe.rows <= 8 for m in capped.measurements if m.probe.name.startswith("fill-"))


def test_acceptance_script_refits_from_raw_measurements(tmp_path):
    """scripts/profile_models.py run as a program: ``--refit`` fits again from a run's raw
    measurements and tabulates them, ``--extract`` writes the profiles out."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "profile_models.py"
    raw = tmp_path / "work" / "raw"
    raw.mkdir(parents=True)
    truth = CostModel(GPU, 1024, TRUE.time, TRUE.memory_coeffs)
    ms = synthetic(all_fit_probes(), truth) + synthetic(holdout_probes(8, n=2), truth)
    meta = {"device": "X", "backend": "triton", "gpu_memory_bytes": GPU, "targets": "all-linear", "max_tp": 8}
    (raw / "qwen2.5-7b-seq1024.jsonl").write_text(
        "\n".join(json.dumps(x) for x in [{"meta": meta}, *(m.to_dict() for m in ms)]) + "\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parents[1]), os.environ.get("PYTHONPATH", "")])}
    refit = subprocess.run([sys.executable, str(script), "--refit", str(tmp_path)], env=env, capture_output=True,
                           text=True, timeout=300)
    assert refit.returncode == 0, refit.stdout[-2000:] + refit.stderr[-2000:]
    table = (tmp_path / "table.md").read_text()
    assert f"| qwen2.5-7b:1024 | {len(all_fit_probes())} |" in table
    prof = Profile.load(tmp_path / "work" / "profiles" / "qwen2.5-7b-seq1024.json")
    assert prof.cost_model.degrees == (1, 2, 4) and prof.summary()["memory_max_abs_err"] < 1e-6
    extract = subprocess.run([sys.executable, str(script), "--extract", str(tmp_path), "--to", str(tmp_path / "exported")],
                             env=env, capture_output=True, text=True, timeout=300)
    assert extract.returncode == 0, extract.stdout[-2000:] + extract.stderr[-2000:]
    assert CostModel.load(tmp_path / "exported" / "qwen2.5-7b-seq1024.json").degrees == (1, 2, 4)


def test_shipped_gpu_profiles_load():
    """The profiles measured on the GPU that the planner benchmark reads."""
    folder = Path(__file__).parents[1] / "scripts" / "profiles"
    for name in ("qwen2.5-0.5b-seq1024", "qwen2.5-3b-seq1024-ac", "qwen2.5-7b-seq1024",
                 "qwen2.5-0.5b-seq256", "qwen2.5-7b-seq256"):
        path = folder / f"{name}.json"
        cm = CostModel.load(path)
        prof = Profile.load(path)
        assert cm.seq_len == int(name.split("seq")[1].split("-")[0]) and 1 in cm.degrees and cm.meta["measured_degrees"] == [1]
        assert prof.measurements and prof.key["device"].startswith("NVIDIA")
        loads = Probe("p", (16, 32), (1, 2)).loads()
        assert 0 < cm.memory(loads, 1) < cm.gpu_memory_bytes and cm.step_time(loads, 1) > 0


def test_trace_script_reports_a_step(tmp_path):
    """scripts/trace_packed_step.py runs on CPU (the deep-tiny shape) and writes its summary."""
    import subprocess
    import sys

    out = tmp_path / "trace"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parents[1] / "scripts" / "trace_packed_step.py"),
         "--shape", "deep-tiny", "--seq", "16", "--adapters", "2", "--ranks", "8,64", "--dtype", "float32",
         "--warmup", "1", "--steps", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "trace_summary.json").read_text())
    assert summary["step_ms"] > 0 and summary["ranks"] == [8, 64] and summary["device"] == "cpu"
    assert (out / "host_ops.txt").read_text().strip() and (out / "trace.json.gz").is_file()


def test_gpu_probes_are_sized_to_the_sweeps_largest_pack(tmp_path, tiny_model):
    from plora.cost.profiling.probes import far_from_limit, sweep_pack_rows

    spec = parse_spec(yaml.safe_load(space(tmp_path, tiny_model).read_text()))
    sizes = sorted((c.batch_size for c in spec.expand()), reverse=True)
    assert sweep_pack_rows(spec) == sum(sizes[: spec.planner.max_adapters_per_job])

    def cal(peak_a: float, peak_b: float) -> list[Measurement]:
        a, b = calibration_probes()
        return [Measurement(a, 64, [0.1], peak_bytes=peak_a, reserved_peak=peak_a),
                Measurement(b, 64, [0.1], peak_bytes=peak_b, reserved_peak=peak_b)]

    # 1 GiB of base and 1 GiB per row (the calibration probes hold 1 and 4 rows)
    probes = cal(2**30, 4 * 2**30)
    assert far_from_limit(probes, rows=10, usable_bytes=40 * 2**30)  # 11 GiB of 40: no near-limit probes
    assert not far_from_limit(probes, rows=30, usable_bytes=40 * 2**30)
    assert not far_from_limit([Measurement(p, 64, [0.1], peak_bytes=1.0) for p in calibration_probes()], 1, 1e12)
