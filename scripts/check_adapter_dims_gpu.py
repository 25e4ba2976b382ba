"""Per-adapter LoRA dropout on a GPU: the Triton mask kernel draws the torch path's bits, and
what it costs beside torch's own dropout. (That packed training with differing dropout,
weight decay, schedules, warm-ups and step budgets equals training each adapter alone on
the GPU is a test: ``python -m pytest -m gpu tests/test_adapter_dims.py``.)

    python scripts/check_adapter_dims_gpu.py
"""
import time

import torch

from plora.train.packed.dropout import _apply, _mask, adapter_key, token_keys

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
