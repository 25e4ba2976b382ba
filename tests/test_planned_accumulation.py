"""The planner's micro-batch (`plora.planner.micro_batch`): where an adapter's effective
batch does not fit one pass on the (simulated) GPU, the sweep plans it over the fewest
power-of-two parts that fit, writes the choice into the plan and each job's adapter entry,
and says so; a space that fits is planned exactly as before; a user's
``training.micro_batch_size`` wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import adapter_weights, job_config
from plora.cost.model import AdapterLoad, packed_load
from plora.hardware import Hardware

GIB = 2**30


def _long_rows_space(tmp_path: Path, batch_sizes: list[int], **training) -> Path:
    """The 0.5B shape on rows of about 1k tokens (each near ``max_seq_len`` 1024)."""
    rows = tmp_path / "train.jsonl"
    with rows.open("w") as f:
        for i in range(128):
            f.write(json.dumps({"input": " ".join(f"w{(i + j) % 50}" for j in range(255)), "output": "yes no"}) + "\n")
    data = {"name": "long", "model": {"path": "shape:qwen2.5-0.5b", "max_seq_len": 1024},
            "data": {"train": str(rows)}, "lora": {"targets": "all-linear"},
            "space": {"strategy": "grid", "rank": [16], "alpha": [32], "learning_rate": [1e-4, 2e-4],
                      "batch_size": batch_sizes},
            "training": {"epochs": 1, **training}, "eval": {"metrics": ["loss"]},
            "hardware": {"device": "cuda", "gpus": 2}, "output": {"dir": str(tmp_path / "runs")}}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _prepare(path: Path, gib: float):
    from plora.spec.loading import load_spec
    from plora.sweep import prepare

    return prepare(load_spec(path), hardware=Hardware(True, 2, int(gib * GIB), local=False))


def _fits(prep) -> bool:
    cm, by_id = prep.cost_model, {a.id: a for a in prep.plan.adapters}
    return all(cm.fits([by_id[a] for a in j.adapters], j.tp, prep.plan.load_factor) for j in prep.plan.jobs)


def test_a_batch_that_does_not_fit_one_pass_is_planned_with_accumulation(tmp_path):
    """Effective batch 64 of 1k-token rows on a 40 GiB GPU: those adapters accumulate over
    power-of-two parts, the batch-8 ones keep one pass, every job fits, the jobs and the
    user are told."""
    from plora.job.from_spec import job_config as sweep_job_config

    prep = _prepare(_long_rows_space(tmp_path, [8, 64]), 40)
    by_batch = {}
    for c in prep.configs:
        by_batch.setdefault(c.batch_size, []).append(c)
    chosen = prep.plan.micro_batches
    assert set(chosen) == {c.id for c in by_batch[64]}
    micro = chosen[by_batch[64][0].id]
    assert 64 % micro == 0 and (64 // micro) & (64 // micro - 1) == 0 and 1 <= micro < 64  # 2**j parts
    # the largest such micro-batch: twice it does not fit alone on the lowest degree
    cm, lf = prep.cost_model, prep.plan.load_factor
    c = by_batch[64][0]
    assert cm.fits([packed_load(c.id, c.rank, 64, 1, micro)], 1, lf)
    assert not cm.fits([packed_load(c.id, c.rank, 64, 1, 2 * micro)], 1, lf)
    assert _fits(prep)
    loads = {a.id: a for a in prep.plan.adapters}
    assert loads[c.id] == packed_load(c.id, c.rank, 64, prep.steps[c.id], micro)
    assert sum("gradient accumulation chosen for memory" in n for n in prep.plan.notes) == 1
    note = next(n for n in prep.plan.notes if "gradient accumulation" in n)
    assert f"in {64 // micro} parts of at most {micro} rows" in note and by_batch[8][0].id not in note
    # written into each job's adapter entry (and back from plan.json)
    from plora.planner.plan import Plan

    assert Plan.from_dict(json.loads(json.dumps(prep.plan.to_dict()))).micro_batches == chosen
    for job in prep.plan.jobs:
        cfg = sweep_job_config(prep.spec, job, [next(x for x in prep.configs if x.id == a) for a in job.adapters],
                               prep.steps, tmp_path / "runs", eval_base=False, micro_batches=chosen)
        for a in cfg.adapters:
            assert a.micro_batch_size == chosen.get(a.id)
        assert cfg.training.micro_batch_size is None


def test_a_space_that_fits_is_planned_as_before(tmp_path):
    from plora.sweep import sweep_loads

    prep = _prepare(_long_rows_space(tmp_path, [2, 4]), 80)
    assert prep.plan.micro_batches == {}
    assert not any("gradient accumulation" in n for n in prep.plan.notes)
    one_pass = sweep_loads(prep.configs, prep.steps)
    assert sorted(prep.plan.adapters, key=lambda a: a.id) == sorted(one_pass, key=lambda a: a.id)
    assert _fits(prep)


def test_a_sweep_whose_jobs_accumulate_is_priced_with_its_evals_in_line(tmp_path):
    """A job that accumulates micro-batches captures no graph ahead, so the adapters leaving
    it are scored in line, not beside its training: the plan and the forecast price them so."""
    def with_eval(root: Path, batch_sizes: list[int]) -> Path:
        root.mkdir()
        space = _long_rows_space(root, batch_sizes)
        data = yaml.safe_load(space.read_text())
        data["data"].update(eval=data["data"]["train"], max_eval_samples=4)
        space.write_text(yaml.safe_dump(data))
        return space

    accumulating = _prepare(with_eval(tmp_path / "a", [8, 64]), 40)
    one_pass = _prepare(with_eval(tmp_path / "b", [2, 4]), 80)
    assert accumulating.plan.micro_batches and not one_pass.plan.micro_batches
    assert not accumulating.cost_model.eval_load.beside_training
    assert one_pass.cost_model.eval_load.beside_training  # scored on each job's side lane


def test_the_users_micro_batch_size_wins(tmp_path):
    prep = _prepare(_long_rows_space(tmp_path, [8, 64], micro_batch_size=4), 40)
    assert prep.plan.micro_batches == {}
    loads = {a.id: a for a in prep.plan.adapters}
    for c in prep.configs:
        assert loads[c.id].batch_size == min(c.batch_size, 4)
    from plora.job.from_spec import job_adapter

    c = prep.configs[0]
    assert job_adapter(prep.spec, c, 3, micro_batch_size=4).micro_batch_size is None


@pytest.mark.parametrize("gpu, want", [(1e9, None), (80.0, None), (60.0, 32), (40.0, 16), (20.0, 8), (10.5, None)])
def test_micro_batch_for_a_linear_memory(gpu, want):
    from plora.cost.model import CostModel, MemoryCoeffs, TimeCoeffs
    from plora.planner.micro_batch import micro_batch_for

    """The fewest power-of-two parts that fit (memory here: 10 + 1 a row); None where one
    pass fits, or where not even one row does."""
    cm = CostModel(gpu_memory_bytes=gpu, seq_len=1, time={1: TimeCoeffs(1.0, 0.0, 0.0, 0.0)},
                   memory_coeffs={1: MemoryCoeffs(10.0, 0.0, 0.0, 1.0, 0.0)}, name="toy")
    load = AdapterLoad("a", 4, 64, 10)
    assert micro_batch_for(load, cm, 1.0) == want


def test_the_engine_and_the_job_use_an_adapters_own_micro_batch(tiny_model, reverse_data, tmp_path):
    """An adapter entry's ``micro_batch_size`` (the planner's) splits that adapter only: it
    equals its one-pass self; its pack partner trains in one pass."""
    from plora.engine.streaming import StreamPolicy
    from plora.job.config import JobAdapter
    from plora.train.packed_lora import PackedLoRARecipe

    big = dict(id="big", rank=4, alpha=8.0, learning_rate=3e-3, batch_size=8, seed=11, steps=3)
    small = dict(id="small", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=12, steps=4)
    entry = JobAdapter(**big, micro_batch_size=2)
    assert StreamPolicy(entry=lambda _: entry, fits=lambda loads, tp: True).load("big") == AdapterLoad(
        "big", 4, 2, 4 * big["steps"])

    def run(out, adapters):
        cfg = job_config(tiny_model, reverse_data, out, adapters)
        cfg["training"] = dict(cfg["training"], checkpoint_every_steps=None, checkpoint_every_minutes=None)
        return PackedLoRARecipe(cfg).run()

    run(tmp_path / "one", [big])
    summary = run(tmp_path / "parts", [dict(big, micro_batch_size=2), small])
    assert summary["adapters"] == {"big": "done", "small": "done"}
    assert summary["steps"] == 4 * big["steps"]
    import torch

    got, want = adapter_weights(tmp_path / "parts", "big"), adapter_weights(tmp_path / "one", "big")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)


def test_the_user_is_told_in_one_line(tmp_path):
    from plora.spec.loading import load_spec
    from plora.sweep import memory_notes

    path = _long_rows_space(tmp_path, [8, 64])
    prep = _prepare(path, 40)
    (note,) = memory_notes(load_spec(path), prep)
    assert len(note.splitlines()) == 1 and "gradient accumulation" in note and "8 parts" in note
    assert memory_notes(load_spec(path), _prepare(_long_rows_space(tmp_path, [2, 4]), 80)) == []


def test_a_replan_that_measures_more_memory_makes_the_waiting_adapters_accumulate(tmp_path, monkeypatch):
    """The plan before calibration put batch-8 adapters in one pass; the sweep's first jobs
    measure far more memory a token (on a GPU: 0.5B shape, batch 64 at 1k-token rows, 179
    GiB where one pass was planned). The re-plan chooses a micro-batch for every adapter
    not started yet, its jobs train at it, the started ones keep theirs, and the sweep
    finishes with every adapter trained once."""
    from dataclasses import replace

    from conftest import tiny_space_file
    from plora.cost.model import MemoryCoeffs
    from plora.cost.profiling.calibrate import Calibration, SweepCalibrator
    from plora.engine.journal import Journal
    from plora.planner.micro_batch import micro_batch_for
    from plora.spec.loading import load_spec
    from plora.sweep import prepare, run_prepared, write_run_files

    configs = [{"rank": r, "alpha": 2 * r, "learning_rate": 1e-3, "batch_size": 8} for r in (2, 4, 8, 16)]
    spec = load_spec(tiny_space_file(
        tmp_path, name="mem", num_train=32, space={"strategy": "list", "configs": configs},
        training={"epochs": 1}, eval={"metrics": ["loss"]}, planner={"max_adapters_per_job": 1, "streaming": False}))
    gpu = Hardware(True, 2, 80 * GIB, local=False)
    base = prepare(spec)
    wrong = base.cost_model.scaled(0.01).with_meta(source="analytic")  # 100x too fast: a re-plan comes
    row = 8 * spec.model.max_seq_len
    # measured: a token takes so much that a batch of 8 rows no longer fits, 2 rows do
    measured = replace(base.cost_model, gpu_memory_bytes=80 * GIB, memory_coeffs={
        d: MemoryCoeffs(c.base, c.adapter, c.rank, 80 * GIB / row * 1.2, c.rank_tok)
        for d, c in base.cost_model.memory_coeffs.items()})
    real_model = SweepCalibrator.model
    monkeypatch.setattr(SweepCalibrator, "model", lambda self: measured if self.measured else real_model(self))

    prep = prepare(spec, cost_model=wrong, hardware=gpu)
    prep.prior, prep.calibration = wrong, Calibration()
    assert prep.plan.micro_batches == {}  # planned before anything was measured: one pass
    write_run_files(prep)
    frame = run_prepared(prep, slots=["cpu:0", "cpu:1"])
    assert set(frame.status) == {"done"} and len(frame) == 4

    j = Journal(prep.run_dir / "journal.sqlite")
    events, adapters = j.events(), {a["id"]: a for a in j.adapters()}
    j.close()
    assert all(a["attempts"] == 1 for a in adapters.values())
    replans = [json.loads(d) for _, kind, _, d in events if kind == "replan"]
    assert replans, [kind for _, kind, _, _ in events]
    waiting = set(replans[0]["adapters"])
    want = micro_batch_for(AdapterLoad("x", 2, 8, 4), measured, prep.plan.load_factor)
    assert want is not None and want < 8
    entries = {a["id"]: a for p in sorted((prep.run_dir / "jobs").glob("*/job.yaml"))
               for a in yaml.safe_load(p.read_text())["adapters"]}
    for aid, entry in entries.items():
        assert entry["micro_batch_size"] == (want if aid in waiting else None), aid
    assert {a: prep.plan.micro_batches[a] for a in waiting} == {a: want for a in waiting}
