"""Job processes started ahead of their jobs (`plora.engine.spare`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from conftest import tiny_space_file
from plora.cli import app
from plora.engine import spare


def _space(root: Path) -> Path:
    return tiny_space_file(
        root, name="spare", num_train=16,
        space={"strategy": "list", "configs": [
            {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
            {"rank": 4, "alpha": 8, "learning_rate": 3e-3, "batch_size": 2},
            {"rank": 2, "alpha": 2, "learning_rate": 5e-3, "batch_size": 8}]},
        training={"epochs": 1, "scheduler": "cosine", "warmup_steps": 1},
        eval={"max_new_tokens": 2, "metrics": ["loss"]}, planner={"max_adapters_per_job": 1})


def _sweep(root: Path, monkeypatch, on: bool) -> tuple[pd.DataFrame, list[bool]]:
    monkeypatch.setenv(spare.ENV_SWITCH, "1" if on else "0")
    result = CliRunner().invoke(app, ["sweep", str(_space(root)), "--no-profile"])
    assert result.exit_code == 0, result.output
    run = root / "runs" / "spare"
    spares = [json.loads(p.read_text())["phases"]["spare"] for p in sorted(run.glob("jobs/*/summary.json"))]
    return pd.read_parquet(run / "results.parquet").sort_values("adapter_id"), spares


def test_a_job_handed_to_a_spare_trains_as_a_fresh_process(tmp_path, monkeypatch):
    cold, cold_spares = _sweep(tmp_path / "cold", monkeypatch, on=False)
    warm, warm_spares = _sweep(tmp_path / "warm", monkeypatch, on=True)
    assert cold_spares == [False, False, False]
    assert len(warm_spares) == 3 and any(warm_spares)
    assert warm_spares[0]  # the sweep's first job was waiting for it, started before planning
    assert (warm["status"] == "done").all()
    for col in ("train_loss", "eval_loss", "steps"):
        assert warm[col].tolist() == cold[col].tolist()
    assert not spare._spares  # let go at the end of the sweep: no process left behind
    # where the wait went: the sweep's moments in order, and when its first job's spare was ready
    run = tmp_path / "warm" / "runs" / "spare"
    t = json.loads((run / "timings.json").read_text())
    order = ["spec_loaded_s", "model_checked_s", "prepare_began_s", "configs_expanded_s", "data_checked_s",
             "rows_decided_s", "cost_model_s",
             "jobs_planned_s", "planned_s", "started_s", "ended_s"]
    assert [t[k] for k in order] == sorted(t[k] for k in order)
    assert t["model_checked_s"] <= t["weights_checked_s"] <= t["planned_s"]
    first = json.loads(sorted(run.glob("jobs/*/summary.json"))[0].read_text())["phases"]
    moments = first["spare_moments"]
    assert moments["created_at"] <= moments["ready_at"] <= first["clock_at"]
    assert moments["created_at"] <= t["process_started_at"] + t["model_checked_s"]  # started before the model check


def test_a_spare_is_not_used_where_the_environment_differs(tmp_path, monkeypatch):
    monkeypatch.setenv(spare.ENV_SWITCH, "1")
    spare.prime()
    proc = next(iter(spare._spares.values())).proc
    env = {**spare.spare_env(), "PYTHONPATH": "/elsewhere"}  # read at import: the spare cannot adopt it
    assert spare.take(tmp_path / "job.yaml", tmp_path, tmp_path / "log.txt", env, 0.0) is None
    assert proc.poll() is not None and not spare._spares


def test_an_unused_spare_is_killed(monkeypatch):
    monkeypatch.setenv(spare.ENV_SWITCH, "1")
    spare.prime()
    proc = next(iter(spare._spares.values())).proc
    spare.keep(False)
    assert proc.poll() is not None and not spare._spares


def test_spares_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(spare.ENV_SWITCH, "0")
    spare.prime()
    assert not spare._spares


def test_the_order_a_spare_reads_has_a_schema():
    order = {"config": "job.yaml", "cwd": ".", "log": "log.txt", "env": {"A": "1"}}
    assert spare.SpareOrder.model_validate_json(json.dumps(order)).env == {"A": "1"}
    with pytest.raises(ValidationError):
        spare.SpareOrder.model_validate_json(json.dumps({**order, "device": "cuda"}))


def test_a_job_clock_counts_from_its_launch_when_handed_to_a_spare(monkeypatch):
    from plora.job.phases import PhaseClock, process_started_at

    monkeypatch.setenv("PLORA_HANDED_AT", "1000.5")
    assert process_started_at() == 1000.5
    assert PhaseClock().spare is True
    monkeypatch.delenv("PLORA_HANDED_AT")
    assert PhaseClock().spare is False and (process_started_at() or 0) <= __import__("time").time()
    assert os.environ.get("PLORA_HANDED_AT") is None


def test_a_spare_takes_only_a_job_for_its_gpus(monkeypatch):
    for name in ("TORCHINDUCTOR_CACHE_DIR", "CUDA_MODULE_LOADING"):
        monkeypatch.delenv(name, raising=False)
    s = spare.Spare.__new__(spare.Spare)  # no process: only the environment rule
    s.env, s.gpus = {"CUDA_VISIBLE_DEVICES": "0", "A": "1"}, (0,)
    s.started_from = dict(os.environ)
    assert s.compatible({"CUDA_VISIBLE_DEVICES": "0", "A": "1", "PLORA_ATTEMPT": "2"})
    # torchao's and torchtune's imports ask CUDA about the GPU: the GPUs a spare sees are fixed
    assert not s.compatible({"CUDA_VISIBLE_DEVICES": "1", "A": "1"})
    assert not s.compatible({"CUDA_VISIBLE_DEVICES": "0", "A": "2"})
    # what the sweep's own imports set after the spare started (a first model check) is no difference
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/x")
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    assert s.compatible({"CUDA_VISIBLE_DEVICES": "0", "A": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x",
                         "CUDA_MODULE_LOADING": "LAZY"})
    # a spare started with another value than the sweep's, which the sweep did not change since
    s.env = {**s.env, "TORCHINDUCTOR_CACHE_DIR": "/tmp/y"}
    s.started_from = dict(os.environ)
    assert not s.compatible({"CUDA_VISIBLE_DEVICES": "0", "A": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"})


def test_what_the_sweep_set_itself_after_its_spare_started_is_no_difference(monkeypatch):
    """A first model check or a quick calibration imports libraries that set variables in the
    sweep's process (on an H100, the first job of a first sweep then started cold, 11-20 s);
    the spare's own imports set theirs. Its GPUs stay pinned."""
    monkeypatch.delenv("SOME_LIBRARY_CACHE", raising=False)
    s = spare.Spare.__new__(spare.Spare)
    s.env, s.gpus = {"CUDA_VISIBLE_DEVICES": "0", "A": "1"}, (0,)
    s.started_from = dict(os.environ)
    monkeypatch.setenv("SOME_LIBRARY_CACHE", "/tmp/lib")
    assert s.compatible({"CUDA_VISIBLE_DEVICES": "0", "A": "1", "SOME_LIBRARY_CACHE": "/tmp/lib"})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert not s.compatible({"CUDA_VISIBLE_DEVICES": "3", "A": "1", "SOME_LIBRARY_CACHE": "/tmp/lib"})
    assert not s.compatible({"CUDA_VISIBLE_DEVICES": "0", "A": "2", "SOME_LIBRARY_CACHE": "/tmp/lib"})


def test_a_spare_that_dies_before_it_is_ready_turns_spares_off(tmp_path, monkeypatch):
    monkeypatch.setenv(spare.ENV_SWITCH, "1")
    monkeypatch.setattr(spare, "CHILD", "import sys; sys.exit(1)")
    monkeypatch.setattr(spare, "_broken", False)
    spare.prime()
    proc = next(iter(spare._spares.values())).proc
    proc.wait(timeout=30)
    assert spare.take(tmp_path / "job.yaml", tmp_path, tmp_path / "log.txt", spare.spare_env(), 0.0) is None
    assert not spare.enabled()
    spare.prime()  # no respawning on every tick
    assert not spare._spares


def test_each_gpu_of_the_first_wave_finds_its_own_spare(tmp_path, monkeypatch):
    """On a host of several GPUs the jobs that start side by side each take the spare made for
    their GPU; one for another GPU is neither used nor killed by the first job's hand-over."""
    monkeypatch.setenv(spare.ENV_SWITCH, "1")
    made: list[tuple[int, ...]] = []

    idle: list[bool] = []

    class FakeSpare:
        def __init__(self, env, gpus=(), *, gpu_idle=False):
            self.env, self.gpus, self.killed, self.handed = env, tuple(gpus), False, None
            self.proc = type("P", (), {"poll": lambda self: None})()
            made.append(self.gpus)
            idle.append(gpu_idle)

        def compatible(self, env):
            return env.get("CUDA_VISIBLE_DEVICES") == self.env.get("CUDA_VISIBLE_DEVICES")

        def wait_ready(self, timeout_s):
            return True

        def hand(self, order):
            self.handed = order
            return True

        def tell(self, order):
            return True

        def kill(self):
            self.killed = True

    monkeypatch.setattr(spare, "Spare", FakeSpare)
    monkeypatch.setattr(spare, "spare_env", lambda gpus=(): {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))})
    try:
        for g in (0, 1, 0):
            spare.prime([g], gpu_idle=True)
        assert made == [(0,), (1,)] and set(spare._spares) == {(0,), (1,)}
        assert idle == [True, True]  # the first wave's GPUs are idle: their spares start CUDA early
        assert spare.preload(spare.PreloadOrder(path="m", family="llama", max_seq_len=8, dtype="float32",
                                                device="cuda", random_init=True))
        second = spare._spares[(1,)]
        first = spare.take(tmp_path / "a.yaml", tmp_path, tmp_path / "a.log", {"CUDA_VISIBLE_DEVICES": "0"}, 0.0)
        assert first is not None and set(spare._spares) == {(1,)} and not second.killed
        assert spare.take(tmp_path / "b.yaml", tmp_path, tmp_path / "b.log", {"CUDA_VISIBLE_DEVICES": "1"}, 0.0) \
            is second.proc and second.handed is not None
        assert spare.take(tmp_path / "c.yaml", tmp_path, tmp_path / "c.log", {"CUDA_VISIBLE_DEVICES": "1"}, 0.0) is None
        # after planning: spares for the GPUs the first jobs start on, the others let go
        spare.prime([0])
        zero = spare._spares[(0,)]
        spare.keep_only([[1], [2]])
        assert zero.killed and set(spare._spares) == {(1,), (2,)}
    finally:
        spare._spares.clear()


def test_the_first_wave_is_one_gpu_each_of_those_seen(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert spare.first_wave("cuda", 4) == [[0], [1]]  # two seen: never a spare for a GPU not there
    assert spare.first_wave("cuda", 1) == [[0]]
    assert spare.first_wave("cpu", 4) == [[]]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(spare, "host_gpu_count", lambda: 8)
    assert spare.first_wave("cuda", 4) == [[0], [1], [2], [3]]


def test_auto_finds_the_first_gpu_from_the_drivers_list_without_torch(monkeypatch):
    """The spare starts before the sweep imports torch (seconds on a GPU host): where the
    driver lists GPUs, ``auto`` needs no torch to know the first job's GPU."""
    calls = []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(spare, "host_gpu_count", lambda torch_fallback=True: calls.append(torch_fallback) or 2)
    monkeypatch.setattr(spare, "_gpu_torch", lambda: True)
    assert spare.first_gpus("auto") == [0]
    assert calls == [False]
    for hidden in ("", "-1", "-1,0"):  # CUDA stops at the first invalid entry
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
        assert spare.first_gpus("auto") == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(spare, "_gpu_torch", lambda: False)  # a CPU build of torch on a GPU host: torch decides
    import torch

    assert spare.first_gpus("auto") == ([0] if torch.cuda.is_available() else [])


def _not_in_this_process(monkeypatch):
    import plora.models.check as mc

    def refuse(*_a, **_k):
        raise AssertionError("the model was built on meta in the sweep's own process")

    monkeypatch.setattr("plora.models.loading.build_on_meta", refuse)
    mc._check_folder.cache_clear()


def test_the_spare_checks_the_model_for_the_sweep(tmp_path, monkeypatch):
    """The model check's slow part (torchtune's import, the model built on meta) is asked of
    the first job's process started ahead, which imports torchtune anyway."""
    monkeypatch.setenv(spare.ENV_SWITCH, "1")
    _not_in_this_process(monkeypatch)
    result = CliRunner().invoke(app, ["sweep", str(_space(tmp_path)), "--no-profile"])
    assert result.exit_code == 0, result.output
    assert not spare._spares


def test_a_broken_model_found_by_the_spare_is_the_usual_one_line_error(tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import load_file, save_file

    from plora.models.loading import ASSETS

    folder = tmp_path / "model"
    shutil.copytree(ASSETS / "tiny-llama", folder)
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.0.mlp.upproj.weight"] = state.pop("model.layers.0.mlp.up_proj.weight")
    save_file(state, str(folder / "model.safetensors"))
    monkeypatch.setenv(spare.ENV_SWITCH, "1")
    _not_in_this_process(monkeypatch)
    space = tiny_space_file(tmp_path, model_path=str(folder), space={"strategy": "list", "configs": [
        {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4}]})
    result = CliRunner().invoke(app, ["sweep", str(space)])
    assert result.exit_code == 2, result.output
    assert "model.path" in result.output and "upproj" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "runs").exists() and not spare._spares


def test_a_spare_answers_a_check_between_its_preload_and_its_job(tmp_path, monkeypatch):
    from plora.models.loading import ASSETS

    one = spare.Spare(spare.spare_env(()))
    try:
        folder = str(ASSETS / "tiny-llama")
        assert one.wait_ready(180) and one.tell(spare.PreloadOrder(
            path=folder, family="llama", max_seq_len=48, dtype="float32", device="cpu", random_init=False))
        good = spare.CheckOrder(check=folder, family="auto", random_init=False, max_seq_len=48)
        assert one.check(good, 180) == spare.CheckAnswer(ok=True)
        missing = spare.CheckOrder(check=str(tmp_path / "nothing"), family="auto", random_init=False, max_seq_len=48)
        answer = one.check(missing, 180)
        assert answer is not None and not answer.ok and str(tmp_path / "nothing") in (answer.error or "")
        assert one.wait_ready(0)  # its ready line was read once, and stays read
    finally:
        one.kill()


def test_a_spare_that_took_a_check_and_gave_no_answer_is_let_go(monkeypatch):
    """Its answer, written once the sweep stopped reading, would kill it as its job began."""
    class Silent:
        def __init__(self):
            self.killed = False
            self.proc = type("P", (), {"poll": lambda _self: None})()

        def wait_ready(self, timeout_s):
            return True

        def check(self, order, timeout_s):
            return None

        def kill(self):
            self.killed = True

    silent = Silent()
    monkeypatch.setattr(spare, "_spares", {(): silent})
    order = spare.CheckOrder(check="x", family="auto", random_init=False, max_seq_len=8)
    assert spare.check_model(order) is None
    assert silent.killed and not spare._spares


class _Planned(Exception):
    """Stops a sweep once it has planned (what these tests look at happened by then)."""


@pytest.mark.parametrize("may_measure", [False, True])
def test_the_first_jobs_model_is_loaded_before_planning_unless_planning_may_measure(tmp_path, monkeypatch, may_measure):
    """A sweep whose plan measures nothing on the GPU (a profile or calibration of the model is
    at hand) has the first spare load the model at once; one whose quick calibration may
    measure sends it once the cost model is decided, so that the probes never share the GPU
    with it; either way once."""
    import threading

    import plora.sweep as sweep_module

    events: list[str] = []
    monkeypatch.setenv(spare.ENV_SWITCH, "1")
    monkeypatch.setattr(sweep_module, "may_measure_before_planning", lambda *a, **k: may_measure)
    monkeypatch.setattr(spare, "preload", lambda order: events.append(f"preload on {threading.current_thread().name}"))
    real_prepare = sweep_module.prepare

    def prepare(*a, **k):
        events.append("plan")
        real_prepare(*a, **k)
        events.append("planned")
        raise _Planned

    monkeypatch.setattr(sweep_module, "prepare", prepare)
    result = CliRunner().invoke(app, ["sweep", str(_space(tmp_path))])
    assert isinstance(result.exception, _Planned), result.output
    if may_measure:  # once the cost model is decided, in planning
        assert events == ["plan", "preload on MainThread", "planned"]
    else:  # at once, from the thread that found the model measured
        import time

        deadline = time.monotonic() + 30
        while len(events) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(events) == ["plan", "planned", "preload on plora-first-model"]
    assert not spare._spares


def test_planning_may_measure_only_on_this_machines_gpu_with_nothing_measured(tmp_path, monkeypatch):
    from plora.cost import sweep_model
    from plora.cost.profiling.calibrate import Calibration
    from plora.hardware import Hardware
    from plora.spec.loading import load_spec
    from plora.sweep import may_measure_before_planning

    spec = load_spec(_space(tmp_path))
    gpu = Hardware(True, 1, 2 * 2**30)  # the sweep's largest pack may not fit it unmeasured
    monkeypatch.setattr(sweep_model, "profiled_model", lambda *a: None)
    monkeypatch.setattr(sweep_model, "cached_calibration", lambda *a: Calibration())
    assert may_measure_before_planning(spec, None, gpu, probe=True)
    # where it fits even with every row at its longest, nothing is measured: the model goes at once
    assert not may_measure_before_planning(spec, None, Hardware(True, 1, 80 * 2**30), probe=True)
    assert not may_measure_before_planning(spec, None, gpu, probe=False)  # --no-profile
    assert not may_measure_before_planning(spec, None, Hardware(False, 2), probe=True)
    assert not may_measure_before_planning(spec, None, Hardware(True, 1, 80 * 2**30, local=False), probe=True)
    monkeypatch.setattr(sweep_model, "profiled_model", lambda *a: (object(), "a profile"))
    assert not may_measure_before_planning(spec, None, gpu, probe=True)


@pytest.mark.parametrize("gib", [2, 3.4, 3.7, 4, 8, 80])
def test_a_sweep_found_to_fit_before_its_data_is_checked_measures_nothing_before_planning(tmp_path, monkeypatch, gib):
    """`fits_before_measuring` (every row at its longest, before the data check) is never
    wrong the unsafe way: where it says the largest pack fits, planning with the rows the data
    check finds runs no quick calibration either, whatever the GPU's size."""
    from plora.cost import sweep_model
    from plora.cost.profiling import profile
    from plora.cost.profiling.calibrate import Calibration
    from plora.hardware import Hardware
    from plora.spec.loading import load_spec
    from plora.sweep import fits_before_measuring, prepare

    spec = load_spec(_space(tmp_path))
    hw = Hardware(True, 1, int(gib * 2**30))
    monkeypatch.setattr(sweep_model, "profiled_model", lambda *a: None)
    monkeypatch.setattr(sweep_model, "cached_calibration", lambda *a: Calibration())
    measured: list = []
    monkeypatch.setattr(profile, "quick_calibration", lambda *a, **k: measured.append(a) or Calibration())
    sure = fits_before_measuring(spec, hw)
    try:
        prepare(spec, probe=True, hardware=hw, check_model=False, fresh=True)
    except Exception:  # noqa: BLE001 - a GPU too small to plan on: what matters is what was measured first
        pass
    assert not (sure and measured)
    assert sure == (gib >= 3.7)  # 3.3 GiB a pack at its longest rows, counted 3 times, within 0.9 of the GPU
    if gib == 2:  # (and a pack that may not fit is measured: the probe above is the one planning calls)
        assert measured


def test_only_a_spare_of_an_idle_gpu_is_told_to_start_cuda_early(monkeypatch):
    """A spare started beside a running job takes no GPU memory before its job: only the
    first wave's spares (``gpu_idle``) get the argument that starts CUDA beside the imports."""
    argvs: list[list[str]] = []

    class FakePopen:
        def __init__(self, args, **kwargs):
            argvs.append(list(args))

    monkeypatch.setattr(spare.subprocess, "Popen", FakePopen)
    spare.Spare({"A": "1"}, (0,), gpu_idle=True)
    spare.Spare({"A": "1"}, (0,))
    assert argvs[0][-1] == spare.GPU_IDLE and spare.GPU_IDLE not in argvs[1]
    from plora.train import spare as child

    assert child.GPU_IDLE == spare.GPU_IDLE
