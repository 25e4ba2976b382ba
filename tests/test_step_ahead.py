"""The next step's rows laid out while a step runs (`plora.train.packed_step`, ``PLORA_STEP_AHEAD``).

On a GPU a job draws and lays out the next step's rows while the device runs the step
before. Here, on a CPU (where a job does not, as nothing overlaps) it is switched on by
hand, and a job with it must train every adapter exactly as the same job without it:
the same rows in the same order, the same losses, the same weights bit for bit, the same
checkpoints (a checkpoint saves where each adapter's stream is: rows laid out ahead are
given back first), whatever leaves the pack (an adapter diverging, one pruned).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import adapter_weights, job_config
from fake_graphs import install as install_fake_graphs
from plora.job.control import request
from plora.train import hooks, packed_lora
from plora.train.checkpoint import JobCheckpointer
from plora.train.packed_lora import PackedLoRARecipe

A = dict(id="a", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=21, steps=6, warmup_steps=2)
C = dict(id="c", rank=4, alpha=8.0, learning_rate=3e-3, batch_size=3, seed=22, steps=12, warmup_steps=2)
D = dict(id="d", rank=2, alpha=2.0, learning_rate=5e-3, batch_size=2, seed=23, steps=10, warmup_steps=1)
ABSURD = dict(id="absurd", rank=4, alpha=8.0, learning_rate=1e38, batch_size=2, seed=99, steps=10)


def _run(tiny_model, reverse_data, out: Path, monkeypatch, *, ahead: bool, adapters: list[dict],
         graphed: bool, prune_d_at: int | None = None, **training) -> tuple[dict, list, PackedLoRARecipe]:
    """The job, with rows laid out ahead or not; its summary, the stream states each checkpoint
    saved, and the recipe."""
    with monkeypatch.context() as mp:
        if graphed:
            install_fake_graphs(mp, [])
        mp.setattr(packed_lora, "step_ahead_wanted", lambda device: ahead)
        saved: list = []
        real_save = JobCheckpointer.save

        def save(self, step, runs):
            saved.append((step, {r.id: r.stream_state() for r in runs if r.active}))
            return real_save(self, step, runs)

        mp.setattr(JobCheckpointer, "save", save)
        cfg = job_config(tiny_model, reverse_data, out, adapters)
        cfg["training"] = dict(cfg["training"], length_buckets=1, **training)
        recipe = PackedLoRARecipe(cfg)

        def prune(recipe, step):
            if step == prune_d_at:
                request(recipe.job_dir, prune=["d"])

        with hooks.installed("after_step", prune):
            summary = recipe.run()
    return summary, saved, recipe


def _losses(out: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (out / "jobs" / "job-test" / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["adapter"], r["adapter_step"], r["loss"]) for r in rows if "loss" in r]


@pytest.mark.parametrize("layout,graphed", [("auto", True), ("balanced", True), ("auto", False)])
def test_rows_laid_out_ahead_train_every_adapter_exactly_as_without(tiny_model, reverse_data, tmp_path, monkeypatch,
                                                                    layout, graphed):
    """A job of adapters of different lengths, one diverging at once and one pruned mid-way,
    with checkpoints every 3 steps: the same results, logs and checkpoints with rows laid
    out ahead as without, and most steps' rows were laid out ahead."""
    adapters = [A, C, D, ABSURD]
    runs = {}
    for ahead in (False, True):
        out = tmp_path / f"ahead-{ahead}"
        runs[ahead] = (out, *_run(tiny_model, reverse_data, out, monkeypatch, ahead=ahead, adapters=adapters,
                                  graphed=graphed, prune_d_at=4, row_layout=layout, checkpoint_every_steps=3,
                                  checkpoint_every_minutes=None))
    (out0, summary0, saved0, _), (out1, summary1, saved1, recipe1) = runs[False], runs[True]
    assert summary1["adapters"] == summary0["adapters"] == {"a": "done", "c": "done", "d": "pruned",
                                                            "absurd": "diverged"}
    assert _losses(out1) == _losses(out0)
    assert saved1 == saved0 and len(saved0) >= 3
    for a in ("a", "c"):
        w0, w1 = adapter_weights(out0, a), adapter_weights(out1, a)
        assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0), a
    counts = recipe1.stepper.ahead_counts
    phases = json.loads((out1 / "jobs" / "job-test" / "summary.json").read_text())["phases"]
    assert phases["rows_ahead"] == counts
    # given back where the pack changed (the diverged adapter, the pruned one) and before each
    # checkpoint; used at most other steps
    assert counts["given_back"] >= 2 and counts["used"] >= 4
    assert json.loads((out0 / "jobs" / "job-test" / "summary.json").read_text())["phases"]["rows_ahead"] is None


def test_rows_are_not_laid_out_ahead_on_a_cpu_or_when_switched_off(monkeypatch):
    """Only a GPU's steps run while the host goes on; ``PLORA_STEP_AHEAD=0`` turns it off there."""
    monkeypatch.delenv("PLORA_STEP_AHEAD", raising=False)
    assert not packed_lora.step_ahead_wanted(torch.device("cpu"))
    assert packed_lora.step_ahead_wanted(torch.device("cuda", 0))
    monkeypatch.setenv("PLORA_STEP_AHEAD", "0")
    assert not packed_lora.step_ahead_wanted(torch.device("cuda", 0))
