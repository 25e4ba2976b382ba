"""Gradient accumulation per adapter (``training.micro_batch_size``): an adapter whose
effective batch is trained over several packed steps ends where one pass of that batch
ends, next to adapters that do not accumulate, through a kill and resume, and in steps
replayed from (fake) CUDA graphs; the planner sees its micro-batch."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from conftest import adapter_weights, assert_training_value_refused, job_config, tiny_space
from plora.train import hooks
from plora.data.accumulation import accumulation_steps, micro_rows, split_batch
from plora.cost.model import AdapterLoad, packed_load
from plora.train.packed_lora import PackedLoRARecipe

#: batch 8: four parts of 2 under micro 2
BIG = dict(id="big", rank=4, alpha=8.0, learning_rate=3e-3, batch_size=8, seed=11, steps=4)
#: batch 2: one pass under micro 2
SMALL = dict(id="small", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=12, steps=6)
#: batch 5: parts of 3 and 2 under micro 3 (not a multiple)
ODD = dict(id="odd", rank=2, alpha=4.0, learning_rate=5e-3, batch_size=5, seed=13, steps=3)

#: one pass against the sum of parts: float rounding, amplified a little by AdamW's first steps
RTOL, ATOL = 1e-4, 1e-5


def _run(tiny_model, reverse_data, out, adapters, micro=None, **training):
    cfg = job_config(tiny_model, reverse_data, out, adapters)
    cfg["training"] = dict(cfg["training"], micro_batch_size=micro, checkpoint_every_steps=None,
                           checkpoint_every_minutes=None, **training)
    recipe = PackedLoRARecipe(cfg)
    return recipe, recipe.run()


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    assert max(float(v.abs().max()) for v in got.values()) > 1e-3  # it trained
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL)


def _losses(out, adapter_id: str) -> list[float]:
    rows = [json.loads(line) for line in (out / "jobs" / "job-test" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("adapter") == adapter_id and "loss" in r]


def test_parts_of_an_effective_batch():
    assert accumulation_steps(8, None) == 1 and accumulation_steps(8, 8) == 1 and accumulation_steps(8, 16) == 1
    assert accumulation_steps(8, 2) == 4 and accumulation_steps(5, 3) == 2 and accumulation_steps(7, 2) == 4
    assert micro_rows(8, 2) == 2 and micro_rows(5, 3) == 3 and micro_rows(7, 2) == 2 and micro_rows(8, None) == 8
    assert split_batch([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert split_batch(list(range(7)), 4) == [[0, 1], [2, 3], [4, 5], [6]]
    assert split_batch([1, 2], 1) == [[1, 2]]


def test_the_planner_sees_micro_batches_and_packed_steps():
    assert packed_load("a", 8, 64, 10, 16) == AdapterLoad("a", 8, 16, 40)
    assert packed_load("a", 8, 64, 10, None) == AdapterLoad("a", 8, 64, 10)
    assert packed_load("a", 8, 5, 10, 3) == AdapterLoad("a", 8, 3, 20)


def test_the_engine_prices_a_joining_adapter_by_its_micro_batch():
    from plora.engine.streaming import StreamPolicy
    from plora.job.config import JobAdapter

    entry = JobAdapter(**BIG)
    policy = StreamPolicy(entry=lambda _: entry, fits=lambda loads, tp: True, micro_batch_size=2)
    assert policy.load("big") == AdapterLoad("big", 4, 2, 4 * BIG["steps"])
    assert StreamPolicy(entry=lambda _: entry, fits=lambda loads, tp: True).load("big") == AdapterLoad(
        "big", 4, 8, BIG["steps"])


def test_accumulated_batch_equals_one_pass_and_packs_with_one_pass_adapters(tiny_model, reverse_data, tmp_path):
    """big (batch 8) in 4 parts of 2 equals big in one pass; packed next to small (one
    pass) and odd (5 rows in parts of 3 and 2), each equals itself alone without a
    micro-batch size; the logged losses are the effective batch's; steps count optimizer
    steps."""
    one_pass = {}
    for a in (BIG, SMALL, ODD):
        _, summary = _run(tiny_model, reverse_data, tmp_path / f"alone-{a['id']}", [a])
        assert summary["adapters"] == {a["id"]: "done"}
        one_pass[a["id"]] = adapter_weights(tmp_path / f"alone-{a['id']}", a["id"])

    solo, summary = _run(tiny_model, reverse_data, tmp_path / "big-micro", [BIG], micro=2)
    assert summary["steps"] == 4 * BIG["steps"]  # packed steps
    progress = json.loads((solo.job_dir / "progress.json").read_text())
    assert progress["adapter_steps"] == {"big": 4 * BIG["steps"]}  # what the engine counts time left from
    assert progress["adapter_steps_done"] == progress["adapter_steps_total"] == BIG["steps"]
    _assert_same(adapter_weights(tmp_path / "big-micro", "big"), one_pass["big"])

    _, summary = _run(tiny_model, reverse_data, tmp_path / "pack", [BIG, SMALL], micro=2)
    assert summary["adapters"] == {"big": "done", "small": "done"}
    for a in (BIG, SMALL):
        _assert_same(adapter_weights(tmp_path / "pack", a["id"]), one_pass[a["id"]])
        m = json.loads((tmp_path / "pack" / "adapters" / a["id"] / "metrics.json").read_text())
        assert m["steps"] == m["total_steps"] == a["steps"]  # optimizer steps
        assert m["config"]["batch_size"] == a["batch_size"]
    assert _losses(tmp_path / "pack", "big") == pytest.approx(_losses(tmp_path / "alone-big", "big"), rel=1e-5)
    assert len(_losses(tmp_path / "pack", "big")) == BIG["steps"]

    _, summary = _run(tiny_model, reverse_data, tmp_path / "odd", [ODD, SMALL], micro=3)
    assert summary["adapters"] == {"odd": "done", "small": "done"}
    _assert_same(adapter_weights(tmp_path / "odd", "odd"), one_pass["odd"])
    _assert_same(adapter_weights(tmp_path / "odd", "small"), one_pass["small"])


def test_divergence_is_decided_on_the_whole_batch(tiny_model, reverse_data, tmp_path):
    """``divergence_loss`` compares the effective batch's loss, at its last part: the
    adapter diverges at the same optimizer step as in one pass, with the same loss."""
    wild = dict(BIG, id="wild", learning_rate=1.0, steps=6)  # its loss: 4.16, then 4.21
    reasons = {}
    for micro in (None, 2):
        recipe, summary = _run(tiny_model, reverse_data, tmp_path / f"m{micro}", [wild], micro=micro,
                               divergence_loss=4.19)
        assert summary["adapters"] == {"wild": "diverged"}
        [run] = recipe.runs
        assert run.step == 1 and len(run.losses) == 1
        reasons[micro] = run.reason
    step_of = {m: reason.rsplit(" ", 1)[-1] for m, reason in reasons.items()}
    assert step_of[None] == step_of[2], reasons
    assert float(reasons[2].split()[1]) == pytest.approx(float(reasons[None].split()[1]), rel=1e-4)


def test_a_job_killed_mid_batch_resumes_to_the_uninterrupted_result(tiny_model, reverse_data, tmp_path):
    """Checkpoint after packed step 3 (big is on its batch's 4th part, odd on its 2nd),
    the job dies after step 5; the relaunched job trains big's batch again from its
    first part and ends where an uninterrupted job ends."""
    adapters = [BIG, dict(ODD, batch_size=6)]
    cfg = job_config(tiny_model, reverse_data, tmp_path / "killed", adapters)
    cfg["training"] = dict(cfg["training"], micro_batch_size=2, checkpoint_every_steps=3,
                           checkpoint_every_minutes=None)

    class Killed(Exception):
        pass

    def kill(recipe, step):
        if step == 4:  # the 5th packed step (0-based)
            raise Killed

    with hooks.installed("after_step", kill), pytest.raises(Killed):
        PackedLoRARecipe(cfg).run()
    saved = torch.load(tmp_path / "killed" / "jobs" / "job-test" / "checkpoint" / "state.rank0.pt", weights_only=True)
    assert saved["job_step"] == 3 and saved["adapters"]["big"]["step"] == 0  # mid-batch: as at its last step
    summary = PackedLoRARecipe(cfg).run()
    assert summary["resumed_from"] == {"big": 0, "odd": 1}
    _run(tiny_model, reverse_data, tmp_path / "straight", adapters, micro=2)
    for a in adapters:
        got = adapter_weights(tmp_path / "killed", a["id"])
        want = adapter_weights(tmp_path / "straight", a["id"])
        _assert_same(got, want)


def test_graphed_steps_with_accumulation_equal_eager_ones(tiny_model, reverse_data, tmp_path, monkeypatch):
    """Steps replayed from (fake) CUDA graphs read the accumulation flags from their held
    buffers: the job equals the eager one; the graphs are keyed on the rows per packed step."""
    from fake_graphs import install as install_fake_graphs

    eager, _ = _run(tiny_model, reverse_data, tmp_path / "eager", [BIG, SMALL], micro=2, length_buckets=1)
    made: list = []
    install_fake_graphs(monkeypatch, made)
    graphed, summary = _run(tiny_model, reverse_data, tmp_path / "graphed", [BIG, SMALL], micro=2, length_buckets=1)
    assert summary["adapters"] == {"big": "done", "small": "done"}
    [sg] = made
    assert sg.replays > 0 and {key[0].rows for key in sg.backend.captured} <= {(2, 2), (2,)}
    for a in (BIG, SMALL):
        _assert_same(adapter_weights(tmp_path / "graphed", a["id"]), adapter_weights(tmp_path / "eager", a["id"]))


@pytest.mark.parametrize("value", [0, -2, "two"])
def test_a_bad_micro_batch_size_is_one_line_naming_the_field(tmp_path, value):
    assert_training_value_refused(tmp_path, "micro_batch_size", value)


def test_micro_batch_size_keeps_ids_and_reaches_the_jobs(tmp_path):
    """The micro-batch size changes how adapters train, not what they learn: the adapter
    ids are the same with and without it, and every job gets it."""
    from plora.spec.loading import parse_spec
    from plora.sweep import prepare

    base = tiny_space(tmp_path, name="x", lora=None, space={"batch_size": [2, 8]})
    plain = prepare(parse_spec(base))
    micro = prepare(parse_spec({**base, "training": {"micro_batch_size": 2}}))
    assert [c.id for c in plain.configs] == [c.id for c in micro.configs]
    by_batch = {c.batch_size: c for c in micro.configs}
    assert micro.plan.adapters is not None
    loads = {a.id: a for a in micro.plan.adapters}
    assert loads[by_batch[8].id].batch_size == 2 and loads[by_batch[8].id].steps == 4 * micro.steps[by_batch[8].id]
    assert loads[by_batch[2].id].batch_size == 2 and loads[by_batch[2].id].steps == micro.steps[by_batch[2].id]


def test_balanced_rows_accumulate_as_one_pass(tiny_model, reverse_data, tmp_path):
    """Balanced batches (`plora.data.balanced_stream`) are dealt for the effective batch, then
    cut in parts: the adapter equals its one-pass self of the same layout."""
    _run(tiny_model, reverse_data, tmp_path / "one", [BIG], row_layout="balanced")
    _run(tiny_model, reverse_data, tmp_path / "parts", [BIG, SMALL], micro=2, row_layout="balanced")
    _assert_same(adapter_weights(tmp_path / "parts", "big"), adapter_weights(tmp_path / "one", "big"))


def test_the_bank_zeroes_the_gradients_of_the_adapters_it_is_told(tiny_model):
    """Per-adapter zeroing keeps an accumulating adapter's gradient and clears the others',
    a non-finite one too (a fill, not a product)."""
    from plora.models.loading import load_base_model
    from plora.train.packed.bank import LoRABank
    from plora.train.packed.inject import inject_packed_lora
    from plora.train.packed.layer import AdapterSpec

    model, _ = load_base_model(tiny_model, max_seq_len=32, random_init=True)
    specs = [AdapterSpec("a", 2, 4.0, 1), AdapterSpec("b", 4, 8.0, 2), AdapterSpec("c", 2, 2.0, 3)]
    bank = LoRABank(inject_packed_lora(model, specs, ["q_proj", "v_proj"]))
    bank.grads.copy_(torch.randn_like(bank.grads))
    for v in bank.adapter_views(bank.grads, 2):
        v.fill_(float("nan"))
    kept = torch.cat(bank.adapter_views(bank.grads, 1)).clone()
    bank.zero_grad_where(torch.tensor([True, False, True]))
    assert torch.equal(torch.cat(bank.adapter_views(bank.grads, 1)), kept)
    for k in (0, 2):
        assert float(torch.cat(bank.adapter_views(bank.grads, k)).abs().max()) == 0.0
    bank.check_views()


@pytest.mark.dist
def test_tp2_accumulation_equals_one_pass_in_one_process(tiny_model, reverse_data, tmp_path):
    """A tensor-parallel job (2 processes) whose adapter accumulates 4 parts ends where the
    one-process job of one pass ends: each step's all-reduce sums only that part's partial
    gradients of the replicated tensors."""
    import os
    import subprocess
    import sys

    _run(tiny_model, reverse_data, tmp_path / "one", [BIG, SMALL])
    cfg = job_config(tiny_model, reverse_data, tmp_path / "two", [BIG, SMALL], tp=2)
    cfg["training"] = dict(cfg["training"], micro_batch_size=2, checkpoint_every_steps=None,
                           checkpoint_every_minutes=None)
    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, "-m", "torchtune._cli.tune", "run", "--nproc_per_node", "2",
                           "plora/train/packed_lora.py",
                           "--config", str(job_yaml)], cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for a in (BIG, SMALL):
        _assert_same(adapter_weights(tmp_path / "two", a["id"]), adapter_weights(tmp_path / "one", a["id"]))
