"""Tensor parallelism: a packed step on two ranks (gloo, CPU) equals the step on one.

Two checks. (1) Model level, in two forked workers: a packed model sharded over two ranks
trains a few AdamW steps next to an unsharded copy in the same process; per-adapter losses,
gradient norms and the gathered adapter weights agree. It covers both attention layouts
(KV heads split, and one KV head copied on both ranks), biases (Qwen2), LoRA dropout (the
ranks draw the same masks), and base linears that no adapter targets. (2) The real recipe
through `tune run --nproc_per_node 2`, against the same job on one process: the same
per-step losses and the same PEFT checkpoints, and a diverging adapter leaves the pack on
both ranks at the same step.

Tolerance: the sharded and unsharded runs differ only in float32 summation order (split
contractions in the row-parallel layers, all-reduced partial sums), a few ulp per op
through a few steps; 1e-5 is far below what a wrong shard or a missing reduction gives
(order 1e-3 and more after the first AdamW step).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import job_config

pytestmark = pytest.mark.dist

ATOL = 1e-5  # float32, the real recipe
ATOL64 = 1e-10  # float64, the model-level check
STEPS = 3
ADAPTERS = [  # (rank, alpha, batch rows, seed)
    (2, 4.0, 2, 11),
    (4, 4.0, 1, 12),
    (3, 6.0, 3, 13),
]
SEQ = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":  # 4 heads, 2 KV heads: both split over 2 ranks
        from torchtune.models.llama3._component_builders import llama3

        return llama3(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                      max_seq_len=32, intermediate_dim=128)
    from torchtune.models.qwen2._component_builders import qwen2

    # 1 KV head: copied on both ranks; q/k/v have biases
    return qwen2(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=1, embed_dim=64,
                 intermediate_dim=128, max_seq_len=32)


CASES = {
    "llama": dict(targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], dropout=0.1),
    "qwen2": dict(targets=["q_proj", "v_proj", "down_proj"], dropout=0.0),
}


def _losses(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """Per-adapter mean next-token loss, in the logits' dtype (float64 here)."""
    token_loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none"
    ).view(tokens.shape[0], -1)
    return [seg.mean() for seg in token_loss.split(rows)]


def _train(pm, tp, tokens: torch.Tensor, steps: int):
    """A few packed AdamW steps (per-adapter loss, clipping to 1.0); losses and norms per step."""
    from plora.train.packed.bank import LoRABank, PackedAdamW

    bank = LoRABank(pm, share=tp.share if tp is not None else None)
    opt = PackedAdamW(bank, [1e-2] * len(ADAPTERS), weight_decay=0.01)
    rows = [a[2] for a in ADAPTERS]
    history = []
    for step in range(steps):
        torch.manual_seed(100 + step)  # the dropout masks of this step
        bank.zero_grad()
        pm.state.set_batch(list(range(len(ADAPTERS))), [n * SEQ for n in rows], "cpu")
        losses = _losses(pm.model(tokens), tokens, rows)
        sum(losses).backward()
        pm.state.clear()
        if tp is not None:
            tp.reduce_grads()
        sq = bank.sq_norms()
        if tp is not None:
            tp.reduce_sq_norms(sq)
        norms = sq.sqrt().tolist()
        opt.step({k: min(1.0, 1.0 / (n + 1e-6)) for k, n in enumerate(norms)})
        bank.check_views()
        history.append(([float(x) for x in losses], norms))
    return history


def _model_worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from plora.train.packed.inject import inject_packed_lora
    from plora.train.packed.layer import AdapterSpec
    from plora.train.packed.tp import TensorParallel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        specs = [AdapterSpec(f"a{k}", r, alpha, seed) for k, (r, alpha, _, seed) in enumerate(ADAPTERS)]
        tokens = torch.randint(4, 64, (sum(a[2] for a in ADAPTERS), SEQ), generator=torch.Generator().manual_seed(5))
        for kind, case in CASES.items():
            base = _build(kind).to(torch.float64)
            for p in base.parameters():
                p.requires_grad_(False)
            ref = inject_packed_lora(copy.deepcopy(base), specs, case["targets"], case["dropout"])
            pm = inject_packed_lora(base, specs, case["targets"], case["dropout"])
            gen = torch.Generator().manual_seed(3)  # nonzero B from the start: every path has gradients
            with torch.no_grad():
                for name in ref.layers:
                    for k in range(len(specs)):
                        b = torch.randn(ref.layers[name].lora_bt[k].shape, generator=gen, dtype=torch.float64) * 0.05
                        ref.layers[name].lora_bt[k].copy_(b)
                        pm.layers[name].lora_bt[k].copy_(b)
            tp = TensorParallel()
            tp.shard(pm)
            ref.model.train()
            pm.model.train()
            want = _train(ref, None, tokens, STEPS)
            got = _train(pm, tp, tokens, STEPS)
            for step, ((wl, wn), (gl, gn)) in enumerate(zip(want, got)):
                assert max(abs(a - b) for a, b in zip(wl, gl)) <= ATOL64, (kind, step, wl, gl)
                assert max(abs(a - b) for a, b in zip(wn, gn)) <= ATOL64, (kind, step, wn, gn)
            for k in range(len(specs)):
                full, single = tp.adapter_state_dict(k), ref.adapter_state_dict(k)
                assert full.keys() == single.keys()
                for key in full:
                    assert full[key].shape == single[key].shape, key
                    assert float((full[key] - single[key]).abs().max()) <= ATOL64, (kind, key)
                # it trained: B moved away from its start
                assert any(float(v.abs().max()) > 1e-3 for v in full.values())
            if kind == "qwen2":  # one KV head, on both ranks: its shards must stay equal
                from torch.distributed import all_gather

                bt = pm.layers["layers.0.attn.v_proj"].lora_bt[1].detach().contiguous()
                both = [torch.empty_like(bt) for _ in range(world)]
                all_gather(both, bt)
                assert torch.equal(both[0], both[1])
    finally:
        dist.destroy_process_group()


def test_sharded_model_matches_one_process():
    import torch.multiprocessing as mp
    from torchtune.models.llama3._component_builders import llama3  # noqa: F401  (imported once,
    from torchtune.models.qwen2._component_builders import qwen2  # noqa: F401  before the fork)

    import plora.train.packed.tp  # noqa: F401

    mp.start_processes(_model_worker, args=(2, _free_port()), nprocs=2, start_method="fork", join=True)


# ------------------------------------------------------------------------ the recipe
RECIPE_ADAPTERS = [
    dict(id="r2", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=11, steps=4),
    dict(id="r4", rank=4, alpha=2.0, learning_rate=3e-3, batch_size=3, seed=12, steps=3),
    dict(id="absurd", rank=4, alpha=8.0, learning_rate=1e38, batch_size=2, seed=99, steps=4),
]


def _metrics(out: Path) -> dict[tuple[int, str], dict]:
    rows = [json.loads(line) for line in (out / "jobs" / "job-test" / "metrics.jsonl").read_text().splitlines()]
    return {(r["step"], r["adapter"]): r for r in rows}


def test_tune_run_tp2_equals_one_process(tiny_model, reverse_data, tmp_path):
    import yaml
    from safetensors.torch import load_file

    from plora.train.packed_lora import PackedLoRARecipe

    cfg = job_config(tiny_model, reverse_data, tmp_path / "one", RECIPE_ADAPTERS)
    cfg["eval"]["max_eval_samples"] = 4
    one = PackedLoRARecipe(cfg).run()

    cfg2 = dict(cfg, output_dir=str(tmp_path / "two"), tp=2)
    job_yaml = tmp_path / "job.yaml"
    job_yaml.write_text(yaml.safe_dump(cfg2))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torchtune._cli.tune", "run", "--nproc_per_node", "2",
         "plora/train/packed_lora.py", "--config", str(job_yaml)],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "jobs" / "job-test" / "summary.json").read_text())
    assert one["adapters"] == two["adapters"] == {"r2": "done", "r4": "done", "absurd": "diverged"}
    assert one["steps"] == two["steps"]

    m1, m2 = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert m1.keys() == m2.keys()
    for key in m1:
        assert abs(m1[key]["loss"] - m2[key]["loss"]) <= ATOL, key
        assert abs(m1[key]["grad_norm"] - m2[key]["grad_norm"]) <= ATOL * 10, key
    for a in ("r2", "r4"):
        w1 = load_file(str(tmp_path / "one" / "adapters" / a / "adapter_model.safetensors"))
        w2 = load_file(str(tmp_path / "two" / "adapters" / a / "adapter_model.safetensors"))
        assert w1.keys() == w2.keys()
        assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) <= ATOL, a
        r1 = json.loads((tmp_path / "one" / "adapters" / a / "metrics.json").read_text())
        r2 = json.loads((tmp_path / "two" / "adapters" / a / "metrics.json").read_text())
        assert abs(r1["eval_loss"] - r2["eval_loss"]) <= ATOL
    bad = json.loads((tmp_path / "two" / "adapters" / "absurd" / "metrics.json").read_text())
    assert bad["status"] == "diverged" and bad["checkpoint_path"] is None
