"""The process that compiles a sweep's likely kernels while it plans (`plora.engine.kernel_warmer`,
`plora.kernels.warm_cache`): what it is told, its protocol, and that it never stops a sweep."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from plora.engine import kernel_warmer
from plora.kernels.warm_cache import READY, WarmAnswer, WarmOrder

from conftest import tiny_space_file


@dataclass(frozen=True)
class Cfg:
    id: str
    rank: int
    batch_size: int


def test_expected_packs_price_each_adapters_rows_as_its_steps_lay_them_out():
    configs = [Cfg("a", 8, 4), Cfg("b", 16, 2), Cfg("c", 64, 4), Cfg("d", 32, 2)]
    packs = kernel_warmer.expected_packs(configs, row_tokens=250.0, max_adapters=3)
    # the first job's adapters in plan order, as many as a job takes; segments in multiples of 64
    assert packs[0] == {"tokens": [1024, 512, 1024], "ranks": [8, 16, 64]}
    # then the pack left once the largest batches (fewest steps an epoch) have finished
    assert packs[1] == {"tokens": [512], "ranks": [16]}
    # a micro-batch caps the rows a step takes
    micro = kernel_warmer.expected_packs(configs, row_tokens=256.0, max_adapters=4, micro_batch=2)
    assert micro == [{"tokens": [512] * 4, "ranks": [8, 16, 64, 32]}, {"tokens": [512] * 2, "ranks": [16, 32]}]
    same = [Cfg("a", 8, 4), Cfg("b", 16, 4)]  # one batch size: all finish together, one pack
    assert len(kernel_warmer.expected_packs(same, row_tokens=64.0, max_adapters=4)) == 1
    assert kernel_warmer.expected_packs([], row_tokens=256.0, max_adapters=4) == []


def test_the_evals_forwards_are_expected_as_the_evaluator_groups_them():
    from plora.cost.job import EvalLoad

    configs = [Cfg("a", 8, 4), Cfg("b", 16, 2), Cfg("c", 64, 4), Cfg("d", 32, 2)]
    load = EvalLoad(samples=32, row_tokens=250.5, prompt_tokens=200.0, batch_rows=64)
    packs = kernel_warmer.expected_packs(configs, row_tokens=250.0, max_adapters=4, eval_load=load)
    evals = [p for p in packs if not p.get("backward", True)]
    assert [p for p in packs if p.get("backward", True)] == kernel_warmer.expected_packs(
        configs, row_tokens=250.0, max_adapters=4)  # the training steps as before
    # the batch-4 adapters finish first and are scored together, then the batch-2 ones: every
    # adapter over all 32 rows (8,016 tokens), two adapters a forward (64 rows of 32 each)
    assert evals == [{"tokens": [8016, 8016], "ranks": [8, 64], "backward": False},
                     {"tokens": [8016, 8016], "ranks": [16, 32], "backward": False}]
    one = kernel_warmer.eval_packs(configs[:1], EvalLoad(samples=4, row_tokens=30.0, prompt_tokens=20.0,
                                                         max_new_tokens=6, batch_rows=2048))
    # an answer decoded: the prompts' forward, then one token per row a step
    assert one == [{"tokens": [t], "ranks": [8], "backward": False} for t in (120, 80, 4)]
    assert kernel_warmer.eval_packs(configs, EvalLoad(samples=0, row_tokens=10.0)) == []
    order = WarmOrder.model_validate_json(WarmOrder(dtype="bfloat16", shapes=[(8, 8)], packs=packs).model_dump_json())
    assert [p.backward for p in order.packs] == [True, True, False, False] and order.optimizer


def test_the_data_check_measures_the_eval_rows(tmp_path):
    from plora.data.check import check_data
    from plora.spec.loading import load_spec

    report = check_data(load_spec(tiny_space_file(tmp_path)))
    assert report.num_eval > 0
    assert report.eval_row_tokens > report.eval_prompt_tokens > 0


def _child(line: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "plora.kernels.warm_cache"], input=line, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_the_child_says_ready_then_answers_one_order_and_never_fails():
    order = WarmOrder(device="cpu", dtype="float32", shapes=[(64, 64)],
                      packs=[{"tokens": [64, 128], "ranks": [8, 16]}]).model_dump_json()
    lines = _child(order + "\n")
    assert lines[0] == READY
    answer = WarmAnswer.model_validate_json(lines[1])
    assert answer.kernels == 0 and answer.error is None  # nothing compiles on a CPU
    assert _child("") == [READY]  # no order: the sweep needed nothing, it exits
    broken = WarmAnswer.model_validate_json(_child("{\"dtype\": 3}\n")[1])
    assert broken.kernels == 0 and "WarmOrder" in broken.error  # a bad order is an answer, not a crash


def test_no_process_for_a_cpu_sweep_or_with_processes_ahead_off(monkeypatch):
    assert not kernel_warmer.wanted("cpu")
    assert not kernel_warmer.start("cpu") and not kernel_warmer.running()
    monkeypatch.setenv("PLORA_SPARE_JOBS", "0")
    assert not kernel_warmer.wanted("cuda")
    monkeypatch.setenv("PLORA_SPARE_JOBS", "1")
    monkeypatch.setenv("PLORA_COMPILE_THREADS", "0")
    assert not kernel_warmer.wanted("cuda")
    monkeypatch.delenv("PLORA_COMPILE_THREADS")
    monkeypatch.setenv("TRITON_INTERPRET", "true")  # read as Triton reads it: nothing would compile
    assert not kernel_warmer.wanted("cuda")


def test_a_sweep_tells_the_process_its_first_jobs_packs_once_its_rows_are_decided(tmp_path, monkeypatch):
    """The order that `prepare` sends (through ``on_rows``): the tiny Llama's targeted
    linears, the space's adapters with their rows' tokens, in the model's dtype."""
    from plora.cost.sweep_model import graphed_steps
    from plora.spec.loading import load_spec
    from plora.sweep import prepare

    got = tmp_path / "order.json"
    reader = subprocess.Popen([sys.executable, "-c", f"import sys; open({str(got)!r}, 'w').write(sys.stdin.read())"],
                              stdin=subprocess.PIPE)
    monkeypatch.setattr(kernel_warmer, "_proc", reader)
    spec = load_spec(tiny_space_file(tmp_path, space={"strategy": "list", "configs": [
        {"rank": 4, "alpha": 8, "learning_rate": 1e-3, "batch_size": 2},
        {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4}]}))
    told = []

    def on_rows(spec, configs, rows, hw):
        told.append(kernel_warmer.order_for_sweep(spec, configs, layout=rows.layout, lengths=rows.lengths,
                                                  length_buckets=rows.length_buckets, graphed=graphed_steps(spec, hw)))

    prepare(spec, on_rows=on_rows)
    reader.wait(timeout=30)
    assert told == [True]
    order = WarmOrder.model_validate_json(got.read_text())
    info = json.loads((spec.model.resolved_path() / "config.json").read_text())
    h, heads, kv = info["hidden_size"], info["num_attention_heads"], info["num_key_value_heads"]
    head_dim = h // heads
    assert sorted(order.shapes) == sorted({(h, heads * head_dim), (h, kv * head_dim)})  # q_proj, v_proj
    assert order.packs[0].ranks == [4, 8]
    assert all(t % 64 == 0 and t > 0 for t in order.packs[0].tokens)
    assert order.packs[0].tokens[1] >= order.packs[0].tokens[0]
    assert order.dtype == spec.model.dtype and order.accumulate_dx
    assert order.vocab == info["vocab_size"]  # the loss's kernel too
    assert kernel_warmer._proc is reader  # told, left to finish on its own
    kernel_warmer.discard()
    assert not kernel_warmer.running()


def test_a_guess_that_fails_discards_the_process_and_never_raises(tmp_path, monkeypatch):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE)
    monkeypatch.setattr(kernel_warmer, "_proc", sleeper)

    class Broken:
        model = None  # every attribute read fails

    assert kernel_warmer.order_for_sweep(Broken(), [], layout="padded", lengths=None, length_buckets=1,
                                         graphed=False) is False
    assert sleeper.wait(timeout=10) != 0 and kernel_warmer._proc is None


@pytest.mark.parametrize("device", ["cpu"])
def test_the_cli_starts_no_process_for_a_cpu_sweep(tmp_path, device):
    from plora import cli

    space = tiny_space_file(tmp_path, hardware={"device": device})
    cli._load(space, warm=True, check_later=True, kernels_ahead=True)
    assert not kernel_warmer.running()
    cli._PENDING_CHECK.clear()


def test_the_optimizers_launches_are_those_of_a_pack_of_that_dtype():
    """`optimizer_launches` drives the norms and AdamW a step launches (on the CPU, their torch
    reference: what is checked here is that the calls are well formed)."""
    import torch

    from plora.kernels.warm_cache import launches_beside_layers, optimizer_launches

    optimizer_launches(torch.float32, torch.device("cpu"))
    optimizer_launches(torch.bfloat16, torch.device("cpu"))
    launches_beside_layers(torch.bfloat16, torch.device("cpu"), 50)  # and the loss's


def test_a_dry_run_too_large_beside_the_first_job_is_left_to_it(monkeypatch):
    import torch

    from plora.kernels import warm_cache

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 << 30, 140 << 30))
    shapes = [(896, 4864)]
    step = warm_cache.WarmPack(tokens=[1024] * 16, ranks=[8] * 16)
    assert warm_cache._fits(step, shapes, torch.bfloat16, "cuda")
    # an eval's forward: 8 adapters over 256 rows of 512 tokens, a forward holds x and y only
    big = warm_cache.WarmPack(tokens=[256 * 512] * 8, ranks=[8] * 8, backward=False)
    assert not warm_cache._fits(big, shapes, torch.bfloat16, "cuda")  # 9.5 GB: over 4 GiB
    small = warm_cache.WarmPack(tokens=[8016] * 8, ranks=[8] * 8, backward=False)
    assert warm_cache._fits(small, shapes, torch.bfloat16, "cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 << 30, 140 << 30))
    assert not warm_cache._fits(small, shapes, torch.bfloat16, "cuda")  # over a tenth of what is free
