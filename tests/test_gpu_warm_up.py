"""A spare runs its held model once before its job (`plora.train.gpu_warm_up`): only on a GPU,
and without changing the model (weights, gradients, which weights train)."""

from __future__ import annotations

import pytest
import torch

from plora.train.gpu_warm_up import warm_up


def test_nothing_is_warmed_off_the_gpu_or_in_what_is_not_a_decoder(tiny_model):
    from plora.models.loading import load_base_model

    model, _ = load_base_model(str(tiny_model), max_seq_len=64, dtype="float32", device="cpu")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert warm_up(model, "cpu") is None
    assert warm_up(torch.nn.Linear(2, 2), "cuda") is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.gpu
def test_a_warm_up_on_the_gpu_leaves_the_model_as_it_was(tiny_model):
    from plora.models.loading import load_base_model

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model, _ = load_base_model(str(tiny_model), max_seq_len=64, dtype="bfloat16", device="cuda")
    wanted = {n: p.requires_grad for n, p in model.named_parameters()}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seconds = warm_up(model, "cuda")
    assert seconds is not None and seconds >= 0
    assert {n: p.requires_grad for n, p in model.named_parameters()} == wanted
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_job_waits_for_its_spares_warm_up_a_bounded_time_then_loads_its_own_model(monkeypatch):
    """A warm-up thread that never ends does not hold the job: past the handover's wait the
    job goes on, and the model the thread may still be running is not handed to it."""
    import threading

    from plora.train import preload, spare

    monkeypatch.setattr(spare, "HANDOVER_WAIT_S", 0.2)
    key = preload.ModelKey.of("m", "llama", 8, "float32", "cpu", True)
    monkeypatch.setattr(preload, "_held", (key, object(), object()))
    stop = threading.Event()
    stuck = threading.Thread(target=stop.wait, name="plora-warm-up", daemon=True)
    done = threading.Thread(target=lambda: None, name="plora-prewarm", daemon=True)
    stuck.start()
    done.start()
    moments: dict = {}
    try:
        spare._join_warming([done, None, stuck], moments)
        assert moments["warming_abandoned"] == "plora-warm-up"
        assert preload.held_model(key) is None
    finally:
        stop.set()
    moments = {}
    monkeypatch.setattr(preload, "_held", (key, "model", "info"))
    spare._join_warming([done], moments)
    assert moments == {} and preload.held_model(key) == "model"
