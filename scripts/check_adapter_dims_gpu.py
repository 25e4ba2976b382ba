"""Per-adapter LoRA dropout on a GPU: the Triton mask kernel draws the torch path's bits,
what it costs beside torch's own dropout, and packed training with differing dropout,
weight decay, schedules, warm-ups and step budgets equals training each adapter alone,
in the padded rows of CUDA-graph steps (``auto``) and in flattened rows.

    python scripts/check_adapter_dims_gpu.py
"""
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import adapter_weights, job_config, make_tiny_llama, max_weight_diff  # noqa: E402

from plora.train.packed.dropout import _apply, _mask, adapter_key, token_keys  # noqa: E402

dev = "cuda"
# 1. kernel == torch bits
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(5000, 896, device=dev, dtype=dtype)
    keys = torch.tensor([adapter_key(1), adapter_key(2)], device=dev)
    h, p = token_keys(torch.tensor([0, 2000, 5000], device=dev), 5000, 5000, keys, torch.tensor([3, 7], device=dev),
                      torch.tensor([0.1, 0.5], device=dev), None)
    ref = (x.float() * _mask(tuple(x.shape), h, p, 99, 0, torch.float32)).to(dtype)
    got = _apply(x, h, p, 99, 0)
    print(dtype, "kernel vs torch: zeros agree", bool(((got == 0) == (ref == 0)).all()), "max diff", float((got.float() - ref.float()).abs().max()))
# 2. timing of the mask on a big layer input
x = torch.randn(32768, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
keys = torch.tensor([adapter_key(s) for s in range(8)], device=dev)
starts = torch.arange(0, 32769, 4096, device=dev)
h, p = token_keys(starts, 32768, 32768, keys, torch.arange(8, device=dev), torch.full((8,), 0.1, device=dev), None)
def bench(f, n=20):
    for _ in range(3): f()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e3
print("32768x2048 bf16: triton hash dropout %.3f ms, torch hash dropout %.3f ms, nn.functional.dropout %.3f ms, copy %.3f ms" % (
    bench(lambda: _apply(x.detach(), h, p, 5, 0)),
    bench(lambda: x.detach() * _mask(tuple(x.shape), h, p, 5, 0, x.dtype)),
    bench(lambda: torch.nn.functional.dropout(x.detach(), 0.1, True)),
    bench(lambda: x.detach().clone())))
# 3. packed == alone on the GPU, steps from CUDA graphs
root = Path("/tmp/dchk"); root.mkdir(exist_ok=True)
model = make_tiny_llama(root / "model")
rng = random.Random(0); rows = []
for _ in range(300):
    s = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 5)))
    rows.append({"input": s + ">", "output": s[::-1]})
(root / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:250]))
(root / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in rows[250:]))
data = {"train": root / "train.jsonl", "eval": root / "eval.jsonl"}
from plora.train.packed_lora import PackedLoRARecipe
MIXED = [
    dict(id="d1", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=11, steps=9, dropout=0.2, weight_decay=0.1, scheduler="linear", warmup_steps=3),
    dict(id="d2", rank=4, alpha=2.0, learning_rate=3e-3, batch_size=3, seed=12, steps=5, dropout=0.0, weight_decay=0.0, scheduler="cosine", warmup_steps=0, rslora=True),
    dict(id="d3", rank=2, alpha=8.0, learning_rate=5e-3, batch_size=2, seed=13, steps=7, dropout=0.5, weight_decay=0.01, scheduler="constant", warmup_steps=1),
]
for layout in ("auto", "flat"):
    over = dict(device="cuda", num_threads=None, training={"scheduler": "cosine", "grad_clip": 1.0, "weight_decay": 0.01, "row_layout": layout})
    packed = root / f"packed-{layout}"
    s = PackedLoRARecipe(job_config(model, data, packed, MIXED, **over)).run()
    print(layout, "graphs", s["phases"].get("graphs"))
    for a in MIXED:
        alone = root / f"alone-{layout}-{a['id']}"
        PackedLoRARecipe(job_config(model, data, alone, [a], **over)).run()
        d = max_weight_diff(adapter_weights(packed, a["id"]), adapter_weights(alone, a["id"]))
        nodrop = root / f"nodrop-{layout}-{a['id']}"
        PackedLoRARecipe(job_config(model, data, nodrop, [{**a, "dropout": 0.0}], **over)).run()
        d0 = max_weight_diff(adapter_weights(packed, a["id"]), adapter_weights(nodrop, a["id"]))
        print(f"layout {layout} {a['id']} p={a['dropout']}: packed vs alone {d:.2e}; vs alone without dropout {d0:.2e}")
