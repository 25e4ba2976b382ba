"""Leaving adapters' files written while the pack trains on (`AdapterWriter`): in the order
asked, a host copy taken at once, a metrics.json only after its adapter's weights, and a
failed write raised where the job waits for them."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from plora.models.loading import load_base_model
from plora.train import adapter_writer as aw
from plora.train.adapter_writer import AdapterWriter


@pytest.fixture()
def info(tiny_model):
    return load_base_model(tiny_model, max_seq_len=32, random_init=True)[1]


def _state(info, value: float) -> dict[str, torch.Tensor]:
    return {"layers.0.attn.q_proj.lora_a.weight": torch.full((2, info.embed_dim), value),
            "layers.0.attn.q_proj.lora_b.weight": torch.full((info.num_heads * info.head_dim, 2), value)}


PEFT = dict(rank=2, alpha=4.0, targets=["q_proj"], dropout=0.0)


@pytest.mark.parametrize("background", [True, False])
def test_weights_then_metrics_and_a_host_copy_taken_at_once(tmp_path, info, monkeypatch, background):
    gate = threading.Event()
    order = []
    real_save = aw.save_peft_adapter

    def slow_save(out, state, *a, **k):
        if background:
            assert gate.wait(10)
        order.append(("save", Path(out).name))
        return real_save(out, state, *a, **k)

    monkeypatch.setattr(aw, "save_peft_adapter", slow_save)
    writer = AdapterWriter(background=background)
    state = _state(info, 1.0)
    writer.save(tmp_path / "x", state, info, **PEFT)
    writer.metrics(tmp_path / "x", {"status": "done"})
    for t in state.values():
        t.fill_(7.0)  # the slot is refilled by the next adapter: the saved copy is the old one
    if background:
        assert not (tmp_path / "x" / "metrics.json").exists()  # not before its weights
        gate.set()
    writer.drain()
    writer.close()
    assert order == [("save", "x")]
    assert json.loads((tmp_path / "x" / "metrics.json").read_text()) == {"status": "done"}
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "x" / "adapter_model.safetensors"))
    assert saved and all(float(v.min()) == float(v.max()) == 1.0 for v in saved.values())


def test_a_failed_save_is_raised_at_drain_and_its_adapter_gets_no_result(tmp_path, info):
    writer = AdapterWriter(background=True)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the adapter's folder should be")
    writer.save(blocked, _state(info, 1.0), info, **PEFT)
    writer.metrics(blocked, {"status": "done"})
    writer.save(tmp_path / "ok", _state(info, 2.0), info, **PEFT)
    writer.metrics(tmp_path / "ok", {"status": "done"})
    with pytest.raises(OSError):
        writer.drain()
    writer.close()
    assert blocked.is_file() and (tmp_path / "ok" / "metrics.json").is_file()


@pytest.mark.parametrize("ks", [[2, 0], [0, 1, 2], [1, 2], [2, 1, 0], [1]])
def test_the_banks_host_states_are_each_adapters_weights_and_a_copy_of_their_own(tiny_model, ks):
    """Whatever the leaving slots and their order (consecutive ones are gathered as one range)."""
    from plora.train.packed.bank import LoRABank
    from plora.train.packed.inject import inject_packed_lora
    from plora.train.packed.layer import AdapterSpec

    model, _ = load_base_model(tiny_model, max_seq_len=32, random_init=True)
    specs = [AdapterSpec("a", 2, 4.0, 1), AdapterSpec("b", 4, 8.0, 2), AdapterSpec("c", 2, 2.0, 3)]
    pm = inject_packed_lora(model, specs, ["q_proj", "v_proj"])
    bank = LoRABank(pm)
    with torch.no_grad():
        bank.weights.copy_(torch.randn_like(bank.weights))
    states = bank.host_states(ks)
    assert len(states) == len(ks)
    for state, k in zip(states, ks):
        want = pm.adapter_state_dict(k)
        assert list(state) == list(want)
        for name, t in want.items():
            assert torch.equal(state[name], t), name
    with torch.no_grad():
        bank.weights.zero_()  # the slots change at the next step: the copies do not
    assert all(float(t.abs().max()) > 0 for t in states[0].values())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_device_snapshot_is_taken_at_once_and_written_by_the_writer_as_the_adapters_were(tiny_model, info, tmp_path,
                                                                                            device, monkeypatch):
    """`LoRABank.snapshot` copies the leaving adapters' rows when they leave; the writer
    brings them to the host on its thread (a callable state), on a GPU through the pinned
    staging buffer piece by piece (made small here: several pieces), and writes the same
    files as from their state dicts taken at once, whatever the bank holds by then."""
    from safetensors.torch import load_file

    from plora.train.packed import bank as bank_module
    from plora.train.packed.bank import LoRABank

    monkeypatch.setattr(bank_module, "STAGING_BYTES", 96)
    monkeypatch.setattr(bank_module, "_staging", None)  # pinned at 96 bytes here, the process's own after
    from plora.train.packed.inject import inject_packed_lora
    from plora.train.packed.layer import AdapterSpec

    model, _ = load_base_model(tiny_model, max_seq_len=32, random_init=True, device=device)
    specs = [AdapterSpec("a", 2, 4.0, 1), AdapterSpec("b", 4, 8.0, 2), AdapterSpec("c", 2, 2.0, 3)]
    pm = inject_packed_lora(model, specs, ["q_proj", "v_proj"])
    bank = LoRABank(pm)
    with torch.no_grad():
        bank.weights.copy_(torch.randn_like(bank.weights))
    want = [{k: v.cpu().clone() for k, v in pm.adapter_state_dict(k).items()} for k in (1, 2)]
    snap = bank.snapshot([1, 2])
    with torch.no_grad():
        bank.weights.zero_()  # a refilled slot, the next steps: the snapshot keeps what left
    peft = [dict(PEFT, rank=4, alpha=8.0, targets=["q_proj", "v_proj"]), dict(PEFT, rank=2, alpha=2.0, targets=["q_proj", "v_proj"])]
    writer = AdapterWriter(background=True)
    outs = writer.save_all([(tmp_path / "lazy" / n, lambda i=i: snap.state(i), p) for i, (n, p) in enumerate(zip("bc", peft))],
                           info, on_host=True)
    writer.save_all([(tmp_path / "eager" / n, w, p) for n, w, p in zip("bc", want, peft)], info)
    writer.drain()
    writer.close()
    for out in outs:
        lazy = load_file(str(out / "adapter_model.safetensors"))
        eager = load_file(str(tmp_path / "eager" / out.name / "adapter_model.safetensors"))
        assert lazy.keys() == eager.keys() and all(torch.equal(lazy[k], eager[k]) for k in lazy)
        assert all(float(t.abs().max()) > 0 for t in lazy.values())
    assert snap.states() is snap.states()  # brought over once


def test_an_adapters_curve_is_on_disk_before_its_metrics_json(tmp_path, monkeypatch):
    """metrics.json says an adapter is finished, and the sweep then reads its curve once (to
    forward it to TensorBoard or W&B): every metrics.jsonl line logged before it is in the
    file by the time metrics.json is written."""
    from types import SimpleNamespace

    from plora.train.job_files import JobFiles

    job_dir, out = tmp_path / "jobs" / "job-000", tmp_path
    job_dir.mkdir(parents=True)
    writer = AdapterWriter(background=True)
    files = JobFiles(job_dir, out, "job-000", is_main=True, attempt=1, writer=writer, started_at=0.0)
    seen: list[int] = []
    write = aw.write_metrics

    def spy(where, row):
        seen.append(len((job_dir / "metrics.jsonl").read_text().splitlines()))
        write(where, row)

    monkeypatch.setattr(aw, "write_metrics", spy)
    for step in range(5):
        files.log({"adapter": "a", "adapter_step": step, "loss": 1.0})
    run = SimpleNamespace(id="a", losses=[1.0], status="done", reason=None, step=5, total_steps=5, earlier_s=0.0,
                          finished_at=1.0, cfg=SimpleNamespace(hyperparameters=lambda: {}), warmup=0, epochs=[],
                          best_epoch=None)
    files.adapter_result(run, {}, None, targets=["q_proj"], epochs=False)
    writer.drain()
    files.close()
    writer.close()
    assert seen == [5] and (out / "adapters" / "a" / "metrics.json").is_file()


@pytest.mark.parametrize("staging_bytes", [16, 40, 1 << 20])
def test_a_snapshot_comes_over_as_contiguous_views_whatever_the_staging_size(monkeypatch, staging_bytes):
    """A GPU snapshot's host copy (`_host_states`, driven here on the CPU without a stream):
    every tensor a contiguous view of one host copy, a transposed entry turned, through a
    staging buffer smaller than one entry, than two, or larger than all."""
    from plora.train.packed import bank as bank_module

    monkeypatch.setattr(bank_module, "host_staging", lambda: torch.empty(staging_bytes, dtype=torch.uint8))
    flat = torch.randn(65, dtype=torch.float32)
    # two adapters: plain (2, 5) and (3, 5) blocks side by side, then transposed (2, 7) and (3, 7)
    layout = [[("x.lora_a.weight", 0, (2, 5), False), ("x.lora_b.weight", 25, (2, 7), True)],
              [("x.lora_a.weight", 10, (3, 5), False), ("x.lora_b.weight", 39, (3, 7), True)],
              [("y.lora_a.weight", 62, (1, 3), False)]]  # after a gap of 2
    states = bank_module._host_states(flat, layout, None)
    for state, entries in zip(states, layout):
        assert list(state) == [e[0] for e in entries]
        for key, off, shape, transposed in entries:
            want = flat[off : off + shape[0] * shape[1]].view(shape)
            want = want.t() if transposed else want
            assert torch.equal(state[key], want) and state[key].is_contiguous(), key


def test_safetensors_writes_views_of_one_buffer_that_do_not_overlap(tmp_path):
    """What the writer counts on to write a snapshot's views without copying each."""
    from safetensors.torch import load_file, save_file

    buf = torch.randn(100).to(torch.bfloat16)
    views = {"a": buf[:30].view(5, 6), "b": buf[30:].view(7, 10)}
    save_file(views, str(tmp_path / "v.safetensors"))
    back = load_file(str(tmp_path / "v.safetensors"))
    assert all(torch.equal(back[k], views[k]) for k in views)
