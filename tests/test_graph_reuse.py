"""Graphs kept across pack compositions (`plora.train.step_graph`), on a CPU with a fake
graph backend (`fake_graphs`): a refilled slot and a composition that comes back replay
what is held, a composition covered by a held one replays it with padding in its vacant
slots while that is cheaper than a capture, what is held is bounded in count and memory,
and a job run from these graphs trains every adapter as it would alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import adapter_weights, job_config, max_weight_diff
from fake_graphs import FakeGraphs
from fake_graphs import install as install_fake_graphs
from plora.train import hooks
from plora.job.config import JobAdapter
from plora.job.control import request, request_join
from plora.train import packed_lora
from plora.train.packed_lora import PackedLoRARecipe
from plora.train.step_graph import Composition, StepBuffers, StepGraph

CPU = torch.device("cpu")
SHAPE = ("padded", 64, (16,))
ATOL = 2e-6  # as test_join: packed against alone differs by float32 summation order only


def _step(sg: StepGraph, comp: Composition, shape: tuple = SHAPE, tokens: int = 64, own: Composition | None = None,
          ran: list | None = None) -> StepBuffers:
    inputs = ({"tokens": torch.zeros(tokens, dtype=torch.long)}, torch.zeros(4, 8))

    def make() -> StepBuffers:
        return StepBuffers.allocate((comp, shape), inputs[0], inputs[1], comp.slots, 4, CPU)

    def body(b: StepBuffers) -> None:
        if ran is not None:
            ran.append(b.key[0])

    return sg.run(comp, shape, make, inputs, body, own=own)


def _graphs(**fake) -> tuple[StepGraph, FakeGraphs]:
    backend = FakeGraphs(**fake)
    return StepGraph(CPU, backend=backend, log=lambda msg: None), backend


X = Composition((0, 1, 2), (2, 2, 1))
Y = Composition((0, 1, 2), (2, 3, 1))  # slot 1 refilled with another batch size: another composition
Z = Composition((0, 2), (2, 1))  # slot 1 vacant


def test_a_key_runs_eagerly_then_captures_then_replays():
    sg, fake = _graphs()
    for _ in range(4):
        _step(sg, X)
    assert [sg.last_run, sg.counts.eager_steps, sg.captures, sg.replays] == ["replay", 1, 1, 3]
    assert len(fake.captured) == 1 and fake.eager_keys == [(X, SHAPE)]


def test_with_capture_first_a_key_is_captured_and_replayed_at_its_first_step():
    sg, fake = _graphs()
    sg.capture_first = True
    ran: list = []
    for comp in (X, X, X, Y, Y, X):
        _step(sg, comp, ran=ran)
    assert fake.eager_keys == [] and [k[0] for k in fake.captured] == [X, Y]
    assert [sg.captures, sg.replays, sg.counts.eager_steps, sg.counts.reuses] == [2, 6, 0, 1]
    assert len(ran) == 6  # every step ran its body once: from the graph captured at its first step
    assert sg._bytes_per_token == fake.per_token  # what the capture added to the pool, per batch token


def test_a_capture_at_the_first_step_that_fails_falls_back_to_eager_then_capture():
    messages = []
    backend = FakeGraphs(fail_capture=True)
    sg = StepGraph(CPU, backend=backend, log=messages.append, capture_first=True)
    ran: list = []
    _step(sg, X, ran=ran)
    assert sg.enabled and not sg.capture_first and sg.last_run == "eager" and len(ran) == 1
    assert "before its first run failed" in messages[0]
    backend.fail_capture = False  # what failed there was the first capture alone
    _step(sg, X, ran=ran)
    assert sg.last_run == "capture" and sg.captures == 1 and len(ran) == 2


def test_a_composition_that_comes_back_replays_its_held_graphs():
    sg, fake = _graphs()
    for comp in (X, X, X, Y, Y, X, X, Y):
        _step(sg, comp)
    assert sg.captures == 2 and sg.counts.eager_steps == 2
    assert sg.counts.reuses == 2  # X after Y, Y after X: no eager step, no capture
    assert [k[0] for k in fake.captured] == [X, Y]
    assert sg.held_shapes(X) == [SHAPE] and sg.held_shapes(Composition((0,), (1,))) == []


def test_least_recently_used_graphs_leave_past_the_count_bound():
    sg, fake = _graphs()
    sg.MAX_GRAPHS = 3
    comps = [Composition((k,), (1,)) for k in range(4)]
    a, b, c, d = comps
    for comp in (a, a, b, b, c, c, a, d, d):  # a was used after b and c: b is the oldest
        _step(sg, comp)
    assert sg.counts.evictions == 1 and sg.held_shapes(b) == [] and sg.held_shapes(a) == [SHAPE]
    _step(sg, b)
    assert sg.last_run == "eager" and sg.held_shapes(c) == []  # c went for b
    assert sg.captures == 4 and fake.released == 0


def test_held_graphs_go_when_an_eager_step_or_an_eval_would_not_fit_beside_them():
    sg, fake = _graphs(room=10_000, bytes_per_token=100)
    _step(sg, X, tokens=64)
    _step(sg, X, tokens=64)  # captured: an eager step of 64 tokens took 6400 bytes
    _step(sg, Y, tokens=64)  # 1.1 x 6400 fits in 10000: X stays
    assert fake.released == 0 and sg.held_shapes(X) == [SHAPE]
    _step(sg, Z, tokens=128)  # 1.1 x 12800 does not: everything goes first
    assert fake.released == 1 and sg.held_shapes(X) == [] and sg.held_shapes(Z) == [SHAPE]
    fake.free = 15_000
    sg.make_room()
    assert fake.released == 1  # Z's own eager step (1.1 x 12800) still fits beside it
    fake.free = 1000
    sg.make_room()
    assert fake.released == 2 and sg.held_shapes(Z) == [] and sg.counts.releases == 2


def test_a_covered_composition_replays_the_covering_graph_until_that_costs_a_capture():
    assert Z.vacant_share(X) == pytest.approx(2 / 5)
    assert Z.vacant_share(Y) == pytest.approx(3 / 6)
    assert Composition((0, 2), (1, 1)).vacant_share(X) == pytest.approx(3 / 5)  # slot 0 padded to its 2 rows
    assert Composition((0, 2), (3, 1)).vacant_share(X) is None  # more rows in slot 0 than X has
    assert Composition((0, 3), (2, 1)).vacant_share(X) is None  # slot 3 is not in X
    assert Composition((0, 2), (2, 1), (1.0, 2.0)).vacant_share(Composition((0, 1, 2), (2, 2, 1), (1.0, 5.0, 3.0))) \
        is None  # a baked scale differs

    sg, _ = _graphs()
    assert sg.plan(Z) == Z  # nothing held
    _step(sg, X)
    assert sg.plan(Z) == Z  # X not captured yet
    _step(sg, X)
    _step(sg, Y)
    _step(sg, Y)
    assert sg.plan(Z) == X  # the fewest vacant rows of the two
    assert sg.plan(Z, lasts=20) == X  # 20 x 2/5 = 8 steps' waste: what a capture costs, not more
    assert sg.plan(Z, lasts=21) == Z and sg.plan(Z, lasts=5) == X
    steps = 0
    while sg.plan(Z) != Z:
        _step(sg, X, own=Z)
        steps += 1
    assert steps == int(StepGraph.CAPTURE_COST_STEPS / (2 / 5))  # 20 steps of 2/5 wasted: 8
    assert sg.counts.covered_steps == steps and sg.counts.reuses == 1 and sg.last_run == "cover"
    _step(sg, Z)
    assert sg.last_run == "eager" and sg.plan(Z) == Z  # its own graphs from now on
    sg2, _ = _graphs()
    _step(sg2, X)
    _step(sg2, X)
    sg2.decline(Z)  # its rows fit none of X's shapes
    assert sg2.plan(Z) == Z
    with pytest.raises(ValueError, match="covering"):
        _step(sg2, X, shape=("padded", 128, (16,)), own=Z)


def test_a_capture_failure_leaves_every_step_eager():
    messages = []
    backend = FakeGraphs(fail_capture=True)
    sg = StepGraph(CPU, backend=backend, log=messages.append)
    ran: list = []
    for _ in range(3):
        _step(sg, X, ran=ran)
    assert not sg.enabled and sg.captures == 0 and len(ran) == 3 and "capture failed" in messages[0]
    assert sg.plan(Z) == Z


def test_held_shapes_come_oldest_first_and_captured_only_on_request():
    sg, _ = _graphs()
    wide = ("padded", 128, (16,))
    _step(sg, X)
    _step(sg, X, shape=wide)
    _step(sg, X, shape=wide)  # captured
    _step(sg, X)  # captured, and now the most recently used
    assert sg.held_shapes(X) == [SHAPE, wide]
    _step(sg, X, shape=("padded", 192, (16,)))
    assert sg.held_shapes(X, captured=True) == [SHAPE, wide]


def test_a_refilled_slots_scale_is_written_into_held_metadata_in_place():
    from plora.kernels import build_lora_meta, packed_lora_delta

    meta = build_lora_meta([3, 2], [2, 4], [2.0, 1.0], CPU)
    scales = meta.scales
    meta.set_scale(1, 0.25)
    assert meta.scales is scales and meta.scales.tolist() == [2.0, 0.25] and meta.scales_host == (2.0, 0.25)
    x, a, b = torch.randn(5, 8), torch.randn(6, 8), torch.randn(6, 3)
    fresh = build_lora_meta([3, 2], [2, 4], [2.0, 0.25], CPU)
    torch.testing.assert_close(packed_lora_delta(x, a, b, meta), packed_lora_delta(x, a, b, fresh))


# ------------------------------------------------------------------ a whole job, fake graphs

A = dict(id="a", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=21, steps=6, warmup_steps=2)
C = dict(id="c", rank=4, alpha=8.0, learning_rate=3e-3, batch_size=2, seed=22, steps=12, warmup_steps=2)
E = dict(id="e", rank=4, alpha=8.0, learning_rate=2e-3, batch_size=2, seed=24, steps=5, warmup_steps=1)  # C's shape
F = dict(id="f", rank=2, alpha=4.0, learning_rate=4e-3, batch_size=2, seed=25, steps=4, warmup_steps=0)  # A's shape


@pytest.fixture
def fake_graphs(monkeypatch):
    """The `StepGraph`s of the jobs built in this test, each on `FakeGraphs`."""
    made: list[StepGraph] = []
    install_fake_graphs(monkeypatch, made)
    return made


@pytest.fixture(scope="module")
def alone(tiny_model, reverse_data, tmp_path_factory):
    """Each adapter trained alone as the packed jobs train (from fake graphs: padded rows of
    the graphs' width, one length bucket), once per module."""
    done: dict[str, Path] = {}

    def get(adapter: dict) -> dict:
        if adapter["id"] not in done:
            out = tmp_path_factory.mktemp(f"alone-{adapter['id']}")
            with pytest.MonkeyPatch.context() as mp:
                install_fake_graphs(mp, [])
                PackedLoRARecipe(_graphed_config(tiny_model, reverse_data, out, [adapter])).run()
            done[adapter["id"]] = out
        return adapter_weights(done[adapter["id"]], adapter["id"])

    return get


def _graphed_config(tiny_model, reverse_data, out: Path, adapters: list[dict], **over) -> dict:
    cfg = job_config(tiny_model, reverse_data, out, adapters, **over)
    cfg["training"] = dict(cfg["training"], length_buckets=1)  # the order the adapters have alone
    return cfg


def _captured_compositions(sg: StepGraph) -> set:
    return {key[0] for key in sg.backend.captured}


def _prune_then_join(step_at: int, pruned: str, joining: dict):
    """A hook: after step ``step_at``, prune one adapter and send another for its slot."""

    def send(recipe, step):
        if step == step_at:
            request(recipe.job_dir, prune=[pruned], join=[JobAdapter(**joining)])

    return send


def test_a_slot_refilled_in_place_replays_the_packs_graphs(tiny_model, reverse_data, tmp_path, alone, fake_graphs):
    """C is pruned after step 3 and E (C's rank, batch size and scale) takes its slot at
    step 4: the pack keeps its key, nothing is captured again, and every adapter equals
    itself alone."""
    recipe = PackedLoRARecipe(_graphed_config(tiny_model, reverse_data, tmp_path, [A, C]))
    with hooks.installed("after_step", _prune_then_join(3, "c", E)):
        summary = recipe.run()
    assert summary["adapters"] == {"a": "done", "c": "pruned", "e": "done"} and summary["joined"] == {"e": 4}
    [sg] = fake_graphs
    one = Composition((0, 1), (2, 2))
    assert _captured_compositions(sg) == {one}
    assert {key[0] for key in sg.backend.eager_keys} <= {one, Composition((1,), (2,))}
    assert sg.replays > 0 and sg.enabled
    graphs = json.loads((recipe.job_dir / "summary.json").read_text())["phases"]["graphs"]
    assert graphs == sg.counts.to_dict() and graphs["captures"] == sg.captures
    for adapter in (A, E):
        assert max_weight_diff(adapter_weights(tmp_path, adapter["id"]), alone(adapter)) <= ATOL, adapter["id"]


def test_a_slot_refilled_with_a_smaller_batch_replays_the_packs_graph_padded(tiny_model, reverse_data, tmp_path,
                                                                             alone, fake_graphs):
    """A streaming job: E1 (C's rank, batch size 1 where C had 2) takes C's slot: the
    pack's graph covers it (E1's second row is padding, a quarter of the step) for all of
    E1's 5 steps, under a capture's cost; E1 equals itself alone."""
    e1 = dict(E, id="e1", batch_size=1)
    cfg = _graphed_config(tiny_model, reverse_data, tmp_path, [A, C], streaming={"linger_s": 0.05})
    recipe = PackedLoRARecipe(cfg)
    runs: list[str] = []
    with hooks.installed("after_step", _prune_then_join(1, "c", e1)), \
            hooks.installed("after_step", lambda recipe, step: runs.append(recipe.graphs.last_run)):
        summary = recipe.run()
    assert summary["adapters"] == {"a": "done", "c": "pruned", "e1": "done"} and summary["joined"] == {"e1": 2}
    [sg] = fake_graphs
    assert runs[:2] == ["capture", "replay"] and runs[2:7] == ["cover"] * 5
    assert _captured_compositions(sg) == {Composition((0, 1), (2, 2))}
    for adapter in (A, e1):
        assert max_weight_diff(adapter_weights(tmp_path, adapter["id"]), alone(adapter)) <= ATOL, adapter["id"]


@pytest.mark.parametrize("on_device", [True, False])
def test_a_refill_of_another_scale_reuses_graphs_where_the_kernels_read_scales_on_the_device(
        tiny_model, reverse_data, tmp_path, alone, fake_graphs, monkeypatch, on_device):
    """E2 has C's rank and batch size but another alpha. Where the kernels read the scales
    from the device, the refilled pack keeps its key and its graphs read E2's scale from the
    metadata written in place; where a capture would bake them in, the scales are in the
    key and the refilled pack is captured anew. Either way E2 equals itself alone."""
    monkeypatch.setattr(packed_lora, "scales_on_device", lambda device: on_device)
    e2 = dict(E, id="e2", alpha=2.0)
    recipe = PackedLoRARecipe(_graphed_config(tiny_model, reverse_data, tmp_path, [A, C]))
    with hooks.installed("after_step", _prune_then_join(3, "c", e2)):
        summary = recipe.run()
    assert summary["adapters"] == {"a": "done", "c": "pruned", "e2": "done"}
    [sg] = fake_graphs
    slots_rows = {(c.slots, c.rows) for c in _captured_compositions(sg)}
    captured = len(_captured_compositions(sg))
    assert slots_rows == {((0, 1), (2, 2))} and captured == (1 if on_device else 2)
    for adapter in (A, e2):
        assert max_weight_diff(adapter_weights(tmp_path, adapter["id"]), alone(adapter)) <= ATOL, adapter["id"]


def test_a_freed_slot_is_covered_until_its_replacement_comes(tiny_model, reverse_data, tmp_path, alone,
                                                             fake_graphs):
    """A streaming job: A finishes after step 5; C trains alone at steps 6 and 7 from the
    pack's graph (A's slot fed padding), F (A's shape) is asked for after step 7 and takes
    A's slot at step 8, where the pack's graph replays again. One composition captured;
    everyone equals itself alone."""
    cfg = _graphed_config(tiny_model, reverse_data, tmp_path, [A, C], streaming={"linger_s": 0.05})

    def join(recipe, step):
        if step == 7:
            request_join(recipe.job_dir, [JobAdapter(**F)])

    recipe = PackedLoRARecipe(cfg)
    runs: list[str] = []
    with hooks.installed("after_step", join), \
            hooks.installed("after_step", lambda recipe, step: runs.append(recipe.graphs.last_run)):
        summary = recipe.run()
    assert summary["adapters"] == {"a": "done", "c": "done", "f": "done"} and summary["joined"] == {"f": 8}
    [sg] = fake_graphs
    assert _captured_compositions(sg) == {Composition((0, 1), (2, 2))}
    assert runs[6:8] == ["cover", "cover"] and runs[8] in ("replay", "capture")
    assert sg.counts.covered_steps >= 2 and sg.counts.reuses >= 2
    phases = json.loads((recipe.job_dir / "summary.json").read_text())["phases"]["phases"]
    assert [p["adapters"] for p in phases][:3] == [2, 1, 2] and phases[1]["reused"] and phases[2]["reused"]
    for adapter in (A, C, F):
        assert max_weight_diff(adapter_weights(tmp_path, adapter["id"]), alone(adapter)) <= ATOL, adapter["id"]


def test_a_draining_pack_is_covered_only_where_a_capture_would_cost_more(tiny_model, reverse_data, tmp_path,
                                                                         alone, fake_graphs):
    """No join can come: after A leaves (step 6), C's 6 steps waste half a step each in the
    pack's graph, 3 steps in all, under a capture's cost: covered to the end. With 40 steps
    left it would cost more, so the drained pack gets its own graph at once; and so it does
    with ``training.cover_vacant_slots`` off."""
    recipe = PackedLoRARecipe(_graphed_config(tiny_model, reverse_data, tmp_path, [A, C]))
    runs: list[str] = []
    with hooks.installed("after_step", lambda recipe, step: runs.append(recipe.graphs.last_run)):
        recipe.run()
    [sg] = fake_graphs
    assert runs[6:] == ["cover"] * 6 and _captured_compositions(sg) == {Composition((0, 1), (2, 2))}
    for adapter in (A, C):
        assert max_weight_diff(adapter_weights(tmp_path, adapter["id"]), alone(adapter)) <= ATOL, adapter["id"]

    long_c = dict(C, steps=6 + 40)
    recipe = PackedLoRARecipe(_graphed_config(tiny_model, reverse_data, tmp_path / "long", [A, long_c]))
    runs.clear()
    with hooks.installed("after_step", lambda recipe, step: runs.append(recipe.graphs.last_run)):
        recipe.run()
    assert runs[6:8] == ["capture", "replay"]
    assert _captured_compositions(fake_graphs[1]) == {Composition((0, 1), (2, 2)), Composition((1,), (2,))}

    cfg = _graphed_config(tiny_model, reverse_data, tmp_path / "probe", [A, C])
    cfg["training"]["cover_vacant_slots"] = False  # as the job probe runs: every pack captured
    recipe = PackedLoRARecipe(cfg)
    runs.clear()
    with hooks.installed("after_step", lambda recipe, step: runs.append(recipe.graphs.last_run)):
        recipe.run()
    assert runs[6:8] == ["capture", "replay"] and fake_graphs[2].counts.covered_steps == 0


# ------------------------------------------------------------------ the side lane, fake graphs

@pytest.fixture
def inline_lane(monkeypatch):
    """Jobs get a side lane that runs its tasks at once in the job's thread (`SideLane`'s
    ``inline``): the books around it, without the threads (a CPU job's fake replays run the
    model eagerly, so nothing may run beside them here)."""
    from plora.train.side_lane import SideLane

    monkeypatch.setattr(packed_lora, "side_lane_for", lambda device: SideLane(device, inline=True))


def test_the_next_composition_is_captured_ahead_and_its_first_step_replays(tiny_model, reverse_data, tmp_path,
                                                                           alone, fake_graphs, inline_lane):
    """A (6 steps) and C (12) train packed: after the first step, C's composition alone is
    captured ahead on the side lane, so when A leaves C's first step alone replays; A is
    scored on the lane and its result written after; both equal themselves alone."""
    recipe = PackedLoRARecipe(_graphed_config(tiny_model, reverse_data, tmp_path, [A, C]))
    runs: list[str] = []
    with hooks.installed("after_step", lambda recipe, step: runs.append(recipe.graphs.last_run)):
        summary = recipe.run()
    assert summary["adapters"] == {"a": "done", "c": "done"}
    [sg] = fake_graphs
    both, alone_c = Composition((0, 1), (2, 2)), Composition((1,), (2,))
    assert [key[0] for key in sg.backend.beside] == [alone_c]  # captured beside the job's thread
    assert _captured_compositions(sg) == {both, alone_c}
    assert runs[0] == "capture" and runs[1:] == ["replay"] * 11  # C's first step alone (the 7th) replays too
    graphs = json.loads((recipe.job_dir / "summary.json").read_text())["phases"]["graphs"]
    assert graphs["captures"] == 2 and graphs["ahead"] == 1 and graphs["eager_steps"] == 0
    assert graphs["reuses"] == 0  # a graph captured ahead is not a capture saved by reuse
    for adapter in (A, C):
        metrics = json.loads((tmp_path / "adapters" / adapter["id"] / "metrics.json").read_text())
        assert metrics["status"] == "done" and "eval_loss" in metrics
        assert max_weight_diff(adapter_weights(tmp_path, adapter["id"]), alone(adapter)) <= ATOL, adapter["id"]


def test_without_overlap_the_job_has_no_side_lane(tiny_model, reverse_data, tmp_path, fake_graphs, inline_lane,
                                                   monkeypatch):
    """``PLORA_OVERLAP=0``: no lane and nothing captured ahead: C's 6 steps alone replay the
    pack's graph, A's slot padded (covering them costs less than a capture of their own)."""
    monkeypatch.setenv("PLORA_OVERLAP", "0")
    recipe = PackedLoRARecipe(_graphed_config(tiny_model, reverse_data, tmp_path, [A, C]))
    summary = recipe.run()
    assert summary["adapters"] == {"a": "done", "c": "done"} and recipe.lane is None
    [sg] = fake_graphs
    assert sg.backend.beside == [] and sg.counts.ahead == 0 and sg.captures == 1 and sg.counts.covered_steps == 6


def test_a_failed_capture_ahead_costs_only_the_capture(tiny_model, reverse_data, tmp_path, alone, fake_graphs,
                                                       inline_lane, monkeypatch, capsys):
    """The capture ahead fails: the job says so once, captures no composition ahead again,
    and C's steps alone go on as without a lane (covered by the pack's graph); both
    adapters still equal themselves alone."""
    real = FakeGraphs.capture

    def fail_beside(self, body, buffers, pool, *, beside=False):
        if beside:
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(self, body, buffers, pool, beside=beside)

    monkeypatch.setattr(FakeGraphs, "capture", fail_beside)
    recipe = PackedLoRARecipe(_graphed_config(tiny_model, reverse_data, tmp_path, [A, C]))
    summary = recipe.run()
    assert summary["adapters"] == {"a": "done", "c": "done"}
    [sg] = fake_graphs
    assert sg.counts.ahead == 0 and sg.captures == 1 and sg.counts.covered_steps == 6 and sg.enabled
    assert capsys.readouterr().err.count("capturing a composition ahead failed") == 1
    for adapter in (A, C):
        assert max_weight_diff(adapter_weights(tmp_path, adapter["id"]), alone(adapter)) <= ATOL, adapter["id"]


def test_a_graph_captured_ahead_into_a_pool_given_up_is_not_adopted():
    """Every graph dropped (memory wanted) while a composition was captured ahead: the graph
    of the old pool is not taken; the composition's first step captures its own."""
    sg, fake = _graphs()
    sg.capture_first = True
    _step(sg, X)  # captured at its first step: the pool
    assert sg.ahead_wanted(Z, 64)
    buffers = StepBuffers.allocate((Z, SHAPE), {"tokens": torch.zeros(64, dtype=torch.long)}, torch.zeros(4, 8),
                                   Z.slots, 4, CPU)
    task = sg.capture_ahead(lambda: buffers, lambda b: None)
    made = task()
    sg.drop()
    assert not sg.adopt((Z, SHAPE), *made)
    _step(sg, Z)
    assert sg.last_run == "capture" and sg.counts.ahead == 0


def test_a_composition_is_not_captured_ahead_without_room_or_when_held():
    sg, fake = _graphs(room=0)
    sg.capture_first = True
    assert not sg.ahead_wanted(Z, 64)  # no pool yet
    _step(sg, X)
    assert not sg.ahead_wanted(X, 64)  # its graphs are held
    assert not sg.ahead_wanted(Z, 64)  # a step of it would not fit beside the held graphs
    sg2, _ = _graphs()
    sg2.capture_first = True
    _step(sg2, X)
    assert sg2.ahead_wanted(Z, 64)
    sg2.capture_first = False
    assert not sg2.ahead_wanted(Z, 64)


def test_a_key_whose_graph_the_lane_brings_at_its_first_step_replays_it():
    """The lane's capture of a composition is taken at that composition's first step (the
    wait for the lane there brings it): the step replays it, captures nothing of its own."""
    sg, fake = _graphs()
    sg.capture_first = True
    _step(sg, X)
    buffers = StepBuffers.allocate((Z, SHAPE), {"tokens": torch.zeros(64, dtype=torch.long)}, torch.zeros(4, 8),
                                   Z.slots, 4, CPU)
    made = sg.capture_ahead(lambda: buffers, lambda b: None)()
    sg.before_work = lambda: sg.adopt((Z, SHAPE), *made)
    _step(sg, Z)
    assert sg.last_run == "replay" and sg.counts.ahead == 1 and sg.captures == 2
    assert fake.beside == [(Z, SHAPE)] and len(fake.captured) == 2
