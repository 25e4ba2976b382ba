"""On a GPU: does a packed step's first launch find every LoRA kernel compiled ahead, and what
does compiling ahead on threads save against compiling at each launch?

For a pack like the first-sweep benchmark's (16 adapters, ranks 8-64, 2 or 4 rows of 256
tokens, the seven linears of Qwen2.5-0.5B), in a fresh Triton cache each time:

* ``ahead``: `plora.kernels.compile_ahead` (threads: ``--threads``), then the real forward and
  backward of every layer shape; counts the variants the real launches still compiled
  (entries added to each kernel's in-process cache) and times both halves;
* ``at launch``: the same forward and backward with nothing compiled ahead;
* ``warm``: ``at launch`` again in the cache the first ``ahead`` filled (what a second run pays).

    python scripts/check_compile_ahead.py --out DIR [--threads 16]

Writes DIR/compile_ahead.json; prints one line per mode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, os, sys, time
import torch
from plora.kernels import build_lora_meta
from plora.kernels import compile_ahead as ca
from plora.kernels import triton_ops as T

mode, threads = sys.argv[1], int(sys.argv[2])
ranks = [8, 8, 16, 16, 32, 32, 64, 64] * 2
rows = [4] * 8 + [2] * 8
tokens = [r * 256 for r in rows]
meta = build_lora_meta(tokens, ranks, [2.0] * 16, "cuda")
shapes = [(896, 896), (896, 128), (896, 4864), (4864, 896)]
dev, dt = torch.device("cuda"), torch.bfloat16
torch.zeros(1, device=dev)
k = T.kernels_module()
kernels = [getattr(k, n) for n in dir(k) if hasattr(getattr(k, n), "device_caches")]

def cached():
    return sum(len(c[0]) for f in kernels for c in f.device_caches.values())

t0 = time.perf_counter()
ahead = ca.compile_ahead(meta, shapes, dt, dev, backward=True, threads=threads) if mode == "ahead" else 0
t1 = time.perf_counter()
before = cached()
for d_in, d_out in shapes:
    n, r = meta.num_tokens, meta.total_rank
    x = torch.randn(n, d_in, device=dev, dtype=dt, requires_grad=False)
    y = torch.randn(n, d_out, device=dev, dtype=dt)
    a = torch.randn(r, d_in, device=dev, dtype=dt) * 0.01
    b = torch.randn(r, d_out, device=dev, dtype=dt) * 0.01
    s = T.lora_forward(x, a, b, meta, y)
    T.lora_backward(y, x, s, a, b, meta, torch.zeros_like(x))
torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"mode": mode, "threads": threads, "compiled_ahead": ahead, "ahead_s": t1 - t0,
                  "step_s": t2 - t1, "compiled_at_launch": cached() - before, "total_s": t2 - t0}))
"""


def run(mode: str, threads: int, cache: str) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(threads)], env=env, capture_output=True,
                          text=True, cwd=str(Path(__file__).resolve().parents[1]))
    if proc.returncode:
        return {"mode": mode, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("check-compile-ahead"))
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as root:
        caches = [os.path.join(root, str(i)) for i in range(3)]
        results = [run("ahead", args.threads, caches[0]), run("ahead", 1, caches[1]), run("at-launch", 0, caches[2]),
                   {**run("at-launch", 0, caches[0]), "mode": "warm (the cache ahead filled)"}]
    (args.out / "compile_ahead.json").write_text(json.dumps(results, indent=2))
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
