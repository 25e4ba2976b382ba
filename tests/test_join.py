"""Adapters that join a running job: each ends as it would have trained alone, the adapters
already there are untouched, a freed slot is refilled at the next step boundary, a job can
wait for joins, and a SIGKILLed job resumes with the adapters that had joined it.

Tolerance: as `test_packed` (packed against alone differs by float32 summation order in
the base model's matmuls only).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import FAULT_HOOKS, adapter_weights, cost_model_holding, job_config, max_weight_diff, run_streamed_sweep
from plora.train import hooks
from plora.job.config import JobAdapter
from plora.job.control import JobControl, read_joins, request_close, request_join, write_control
from plora.train.packed_lora import PackedLoRARecipe

ATOL = 2e-6
JOIN_HOOKS = Path(__file__).with_name("join_hooks.py")

A = dict(id="a", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=21, steps=6, warmup_steps=2)
C = dict(id="c", rank=4, alpha=8.0, learning_rate=3e-3, batch_size=3, seed=22, steps=12, warmup_steps=2)
B = dict(id="b", rank=8, alpha=8.0, learning_rate=5e-3, batch_size=2, seed=23, steps=7, warmup_steps=2)
E = dict(id="e", rank=4, alpha=2.0, learning_rate=2e-3, batch_size=1, seed=24, steps=5, warmup_steps=1)
F = dict(id="f", rank=2, alpha=2.0, learning_rate=4e-3, batch_size=2, seed=25, steps=4, warmup_steps=0)


@pytest.fixture(scope="module")
def alone(tiny_model, reverse_data, tmp_path_factory):
    """Each adapter trained alone, once per module."""
    done: dict[str, Path] = {}

    def get(adapter: dict) -> dict:
        if adapter["id"] not in done:
            out = tmp_path_factory.mktemp(f"alone-{adapter['id']}")
            PackedLoRARecipe(job_config(tiny_model, reverse_data, out, [adapter])).run()
            done[adapter["id"]] = out
        return adapter_weights(done[adapter["id"]], adapter["id"])

    return get


def _join_at(after: int, *adapters: dict):
    """A hook that asks the job, after its step ``after``, to take ``adapters``."""

    def send(recipe, step):
        if step == after:
            request_join(recipe.job_dir, [JobAdapter(**a) for a in adapters])

    return send


def test_a_joined_adapter_equals_it_alone_and_the_pack_is_unchanged(tiny_model, reverse_data, tmp_path, alone):
    """B (rank 8: no slot of its rank) joins A and C after step 3: the pack is laid out
    again; B trains its own 7 steps from its own init, A and C go on as if alone."""
    recipe = PackedLoRARecipe(job_config(tiny_model, reverse_data, tmp_path, [A, C]))
    seen, banks = [], []

    def look(recipe, step):
        seen.append({r.id for r in recipe.runs if r.active})
        banks.append(recipe.bank.num_adapters)

    with hooks.installed("after_step", _join_at(3, B)), hooks.installed("after_step", look):
        summary = recipe.run()
    assert summary["adapters"] == {"a": "done", "c": "done", "b": "done"}
    assert summary["joined"] == {"b": 4}
    assert seen[3] == {"a", "c"} and seen[4] == {"a", "c", "b"}
    assert banks[3] == 2 and banks[4] == 3  # a new layout of three slots
    for adapter in (A, C, B):
        m = json.loads((tmp_path / "adapters" / adapter["id"] / "metrics.json").read_text())
        assert m["steps"] == adapter["steps"] and m["status"] == "done"
        got = adapter_weights(tmp_path, adapter["id"])
        assert max(float(v.abs().max()) for v in got.values()) > 1e-3  # it trained
        assert max_weight_diff(got, alone(adapter)) <= ATOL, adapter["id"]
    records = read_joins(recipe.job_dir)
    assert [(r.adapter.id, r.job_step, r.refused) for r in records] == [("b", 4, None)]
    # B's metrics carry its own steps from 0
    rows = [json.loads(x) for x in (recipe.job_dir / "metrics.jsonl").read_text().splitlines()]
    b_rows = [(r["step"], r["adapter_step"]) for r in rows if r["adapter"] == "b"]
    assert b_rows == [(4 + i, i) for i in range(7)]


def test_a_pruned_adapters_slot_is_filled_by_a_waiting_join_at_the_next_step(tiny_model, reverse_data, tmp_path,
                                                                             alone):
    """A full pack (streaming.max_active 2): E (rank 4) and F (rank 2) wait in control.json.
    C is pruned after step 3: E takes C's slot at step 4; A finishes after step 6: F takes
    A's slot at step 6. Nothing is laid out again; everyone equals itself alone."""
    cfg = job_config(tiny_model, reverse_data, tmp_path, [A, C], streaming={"max_active": 2})
    recipe = PackedLoRARecipe(cfg)
    job_dir = tmp_path / "jobs" / "job-test"
    job_dir.mkdir(parents=True)
    write_control(job_dir, JobControl(join=[JobAdapter(**E), JobAdapter(**F)]))
    slots, waiting, banks = {}, [], set()

    def look(recipe, step):
        if step == 3:
            request = json.loads((recipe.job_dir / "control.json").read_text())
            (recipe.job_dir / "control.json").write_text(json.dumps({**request, "prune": ["c"]}))
        slots[step] = {r.id: r.index for r in recipe.runs if r.active}
        waiting.append(len(recipe.pending_joins))
        banks.add(id(recipe.bank))

    with hooks.installed("after_step", look):
        summary = recipe.run()
    assert summary["adapters"] == {"a": "done", "c": "pruned", "e": "done", "f": "done"}
    assert summary["joined"] == {"e": 4, "f": 6}
    assert slots[3] == {"a": 0, "c": 1} and slots[4] == {"a": 0, "e": 1} and slots[6] == {"f": 0, "e": 1}
    assert waiting[:4] == [2, 2, 2, 2] and waiting[4] == 1 and waiting[6] == 0
    assert len(banks) == 1  # slots refilled in place
    m = json.loads((tmp_path / "adapters" / "c" / "metrics.json").read_text())
    assert m["status"] == "pruned" and m["steps"] == 4
    for adapter in (A, E, F):
        assert max_weight_diff(adapter_weights(tmp_path, adapter["id"]), alone(adapter)) <= ATOL, adapter["id"]


def test_a_join_sent_ahead_waits_for_the_adapter_it_replaces_and_lets_later_joins_pass(tiny_model, reverse_data,
                                                                                       tmp_path, alone):
    """control.json's ``after``: F, sent before A has left (a pack of three allowed), waits
    for A and enters at step 6, the boundary where A leaves; E, sent after F with no wait,
    passes it and enters at once. Everyone equals itself alone, and A's files are on disk
    (written in the background) when the job ends."""
    cfg = job_config(tiny_model, reverse_data, tmp_path, [A, C], streaming={"max_active": 3})
    recipe = PackedLoRARecipe(cfg)
    job_dir = tmp_path / "jobs" / "job-test"
    job_dir.mkdir(parents=True)
    write_control(job_dir, JobControl(join=[JobAdapter(**F), JobAdapter(**E)], after={"f": ["a"]}))
    active = {}

    def look(recipe, step):
        active[step] = {r.id for r in recipe.runs if r.active}

    with hooks.installed("after_step", look):
        summary = recipe.run()
    assert summary["joined"] == {"e": 0, "f": 6}
    assert active[0] == active[4] == {"a", "c", "e"} and active[5] == {"a", "c"} and active[6] == {"c", "f"}
    for adapter in (A, C, E, F):
        assert (tmp_path / "adapters" / adapter["id"] / "adapter_model.safetensors").is_file()
        assert max_weight_diff(adapter_weights(tmp_path, adapter["id"]), alone(adapter)) <= ATOL, adapter["id"]


def test_a_lingering_job_takes_a_join_after_its_pack_drained_and_leaves_on_close(tiny_model, reverse_data, tmp_path,
                                                                                  alone):
    """streaming.linger_s: the job waits after A finishes; F joins then and trains as alone;
    control.json's close ends the wait long before linger_s."""
    cfg = job_config(tiny_model, reverse_data, tmp_path, [F], streaming={"linger_s": 120})
    job_dir = tmp_path / "jobs" / "job-test"
    second = dict(A, id="a2")

    def steer():
        progress = job_dir / "progress.json"
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if json.loads(progress.read_text()).get("lingering"):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        request_join(job_dir, [JobAdapter(**second)])
        while time.time() < deadline and not (tmp_path / "adapters" / "a2" / "metrics.json").exists():
            time.sleep(0.02)
        request_close(job_dir)

    t = threading.Thread(target=steer)
    t.start()
    t0 = time.time()
    summary = PackedLoRARecipe(cfg).run()
    t.join()
    assert time.time() - t0 < 60
    assert summary["adapters"] == {"f": "done", "a2": "done"} and summary["joined"] == {"a2": 4}
    assert max_weight_diff(adapter_weights(tmp_path, "a2"), alone(A)) <= ATOL  # the same adapter under another id


def test_linger_ends_without_a_join_and_a_bad_join_is_refused(tiny_model, reverse_data, tmp_path):
    cfg = job_config(tiny_model, reverse_data, tmp_path, [F], streaming={"linger_s": 0.3})
    job_dir = tmp_path / "jobs" / "job-test"
    job_dir.mkdir(parents=True)
    write_control(job_dir, JobControl(join=[JobAdapter(**dict(F, rank=4))]))  # F's id, another adapter
    t0 = time.time()
    summary = PackedLoRARecipe(cfg).run()
    assert 0.3 <= time.time() - t0 < 30
    assert summary["adapters"] == {"f": "done"} and summary["joined"] == {}
    [record] = read_joins(job_dir)
    assert record.adapter.rank == 4 and "already holds" in record.refused


def test_control_json_schema():
    with pytest.raises(ValueError):
        JobControl.model_validate({"join": [{"id": "x", "rank": 0}]})
    with pytest.raises(ValueError):
        JobControl.model_validate({"prune": [], "closed": True})  # a typo is not a setting
    assert JobControl.model_validate({"prune": ["a"]}).join == []


def test_sigkilled_job_resumes_with_the_adapters_that_joined_it(tiny_model, reverse_data, tmp_path, monkeypatch):
    """B joins at step 4 (into the checkpoint of step 10), E at step 12 (after it); the job
    is SIGKILLed after step 13 and relaunched: it takes B and E back from its joins.jsonl,
    B from its checkpoint at its step 6, E from the start, and every adapter equals the
    uninterrupted run's."""
    from plora.engine.local import launch
    from plora.job.config import JobConfig

    a, c, b = dict(A, steps=20), dict(C, steps=20), dict(B, steps=15)
    joins = [{"after_step": 3, "adapters": [b]}, {"after_step": 11, "adapters": [E]}]
    training = {"scheduler": "cosine", "grad_clip": 1.0, "weight_decay": 0.01,
                "checkpoint_every_steps": 5, "checkpoint_every_minutes": None}
    run = tmp_path / "run"
    job_dir = run / "jobs" / "job-test"
    job_dir.mkdir(parents=True)
    cfg = job_config(tiny_model, reverse_data, run, [a, c], training=training)
    JobConfig.parse(cfg).write(job_dir / "job.yaml")
    monkeypatch.setenv("PLORA_TEST_HOOKS", f"{FAULT_HOOKS},{JOIN_HOOKS}")
    monkeypatch.setenv("PLORA_INJECT_FAULT", "kill@job-test@13@1")
    monkeypatch.setenv("PLORA_TEST_JOIN", json.dumps(joins))
    for attempt, want in ((1, -9), (2, 0)):
        proc = launch("job-test", job_dir, "cpu:0", extra_env={"PLORA_ATTEMPT": str(attempt)})
        rc = proc.proc.wait(timeout=300)
        proc.log.close()
        assert rc == want, (job_dir / "log.txt").read_text()[-3000:]
        if attempt == 1:
            state = torch.load(job_dir / "checkpoint" / "state.rank0.pt", weights_only=True)
            assert state["job_step"] == 10 and state["adapters"]["b"]["joined_at"] == 4
            assert set(state["adapters"]) == {"a", "c", "b"}
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["resumed_from"] == {"a": 10, "c": 10, "b": 6}
    assert summary["adapters"] == {"a": "done", "c": "done", "b": "done", "e": "done"}
    assert [(r.adapter.id, r.job_step, r.attempt) for r in read_joins(job_dir)] == [("b", 4, 1), ("e", 12, 1)]

    # the same job and joins, uninterrupted, in this process
    ref = tmp_path / "ref"
    ref_cfg = yaml.safe_load((job_dir / "job.yaml").read_text())
    ref_cfg.update(output_dir=str(ref), job_dir=str(ref / "jobs" / "job-test"))
    ref_cfg["training"]["checkpoint_every_steps"] = None
    with hooks.installed("after_step", _join_at(3, b)), hooks.installed("after_step", _join_at(11, E)):
        ref_summary = PackedLoRARecipe(ref_cfg).run()
    assert ref_summary["joined"] == {"b": 4, "e": 12}
    for adapter_id in ("a", "c", "b", "e"):
        got, want = adapter_weights(run, adapter_id), adapter_weights(ref, adapter_id)
        for k in got:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
        m = json.loads((run / "adapters" / adapter_id / "metrics.json").read_text())
        assert m["attempt"] == 2


def test_streaming_sweep_sends_a_waiting_adapter_into_the_running_job(tmp_path):
    """planner.streaming, one CPU slot, two planned jobs: once an adapter of job-000 has
    left, job-001's adapter joins job-000 instead of waiting for a process of its own;
    the journal records it under job-000 and job-001 never runs."""
    from plora.engine.journal import Journal

    prep, frame = run_streamed_sweep(tmp_path)
    first, second, third = (c.id for c in prep.configs)
    assert set(frame.status) == {"done"}, frame[["adapter_id", "status", "reason"]]

    journal = Journal(prep.run_dir / "journal.sqlite")
    try:
        assert journal.job("job-001").status == "streamed"
        job = journal.job("job-000")
        assert job.status == "finished" and job.attempt == 1 and job.adapters == [first, second, third]
        assert any(kind == "join" and subject == "job-000" for _, kind, subject, _ in journal.events())
    finally:
        journal.close()
    [record] = read_joins(prep.run_dir / "jobs" / "job-000")
    assert record.adapter.id == third and record.refused is None
    assert record.adapter.steps == prep.steps[third]
    m = json.loads((prep.run_dir / "adapters" / third / "metrics.json").read_text())
    assert m["job_id"] == "job-000" and m["steps"] == prep.steps[third]
    assert not (prep.run_dir / "jobs" / "job-001" / "job.yaml").exists()


def test_streaming_sends_the_longest_waiting_adapters_first_and_holds_memory(tmp_path):
    """Two running jobs (one adapter of 3 steps each) on two CPU slots, a queued job of four
    adapters of 4, 12, 6 and 8 steps, and a cost model whose GPU holds two adapters: at once
    the 12-step adapter joins job-000 and the 8-step one job-001; the 6- and 4-step ones
    join later, in that order, as the first ones leave; no job ever trains more than two
    adapters at a step, and the queued job never runs."""
    from plora.engine.journal import Journal

    configs = [{"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 8},
               {"rank": 2, "alpha": 4, "learning_rate": 2e-2, "batch_size": 8},
               {"rank": 2, "alpha": 2, "learning_rate": 5e-3, "batch_size": 6},
               {"rank": 4, "alpha": 8, "learning_rate": 3e-3, "batch_size": 2},
               {"rank": 2, "alpha": 2, "learning_rate": 4e-3, "batch_size": 4},
               {"rank": 4, "alpha": 4, "learning_rate": 1e-3, "batch_size": 3}]
    prep, frame = run_streamed_sweep(tmp_path, configs=configs, groups=((0,), (1,), (2, 3, 4, 5)),
                                     slots=("cpu:0", "cpu:1"), max_adapters=4, cost_model=cost_model_holding(2))
    ids = [c.id for c in prep.configs]
    steps = [prep.steps[a] for a in ids]
    assert steps == [3, 3, 4, 12, 6, 8]
    assert set(frame.status) == {"done"}, frame[["adapter_id", "status", "reason"]]

    journal = Journal(prep.run_dir / "journal.sqlite")
    try:
        assert journal.job("job-002").status == "streamed"
        joins = [(subject, json.loads(detail)["adapters"]) for _, kind, subject, detail in journal.events()
                 if kind == "join"]
    finally:
        journal.close()
    longest_first = [ids[3], ids[5], ids[4], ids[2]]
    assert [a for _, taken in joins for a in taken] == longest_first
    assert joins[:2] == [("job-000", [ids[3]]), ("job-001", [ids[5]])]
    for job in ("job-000", "job-001"):
        at_step: dict[int, set] = {}
        for row in _rows(prep.run_dir / "jobs" / job):
            at_step.setdefault(row["step"], set()).add(row["adapter"])
        assert max(len(a) for a in at_step.values()) == 2
    assert not (prep.run_dir / "jobs" / "job-002" / "job.yaml").exists()


def _rows(job_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (job_dir / "metrics.jsonl").read_text().splitlines()]
