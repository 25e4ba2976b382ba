"""On a GPU: where a warm job's kernel loads go, and what paying Triton's per-process costs
ahead (`plora.kernels.prewarm`, as a spare does while it waits) leaves of them.

For the first-sweep benchmark's pack (16 adapters, ranks 8-64, 2 or 4 rows of 256 tokens, the
seven linears of Qwen2.5-0.5B), each line a fresh process over one Triton cache filled first:

* ``fill``: `compile_ahead` in an empty cache (first use);
* ``warm``: `compile_ahead` with every variant cached (what a warm job's first step pays);
* ``prewarmed``: `prewarm`, then `compile_ahead` (what is left for the job);
* ``profile`` / ``profile-prewarmed``: the same on one thread under cProfile (top entries);
* ``draw``: a 16-adapter pack's initial A for every layer, drawn as a job does.

    python scripts/profile_kernel_loads.py --out DIR

Writes DIR/kernel_loads.json and DIR/profile-*.txt; prints one line per run.
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
import cProfile, io, json, pstats, sys, time
t0 = time.perf_counter()
import torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t_cuda = time.perf_counter() - t0
from plora.kernels import build_lora_meta
from plora.kernels import compile_ahead as ca
from plora.kernels.prewarm import prewarm

mode, threads, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ranks = [8, 8, 16, 16, 32, 32, 64, 64] * 2
rows = [4] * 8 + [2] * 8
meta = build_lora_meta([r * 256 for r in rows], ranks, [2.0] * 16, "cuda")
shapes = [(896, 896), (896, 128), (896, 4864), (4864, 896)]
dev, dt = torch.device("cuda"), torch.bfloat16
res = {"mode": mode, "threads": threads, "cuda_s": t_cuda}
if mode == "draw":
    from plora.train.packed.layer import AdapterSpec, _stable_seed
    from plora.train.packed.inject import _initial_as
    import torch.nn as nn
    specs = [AdapterSpec(name=f"a{i}", rank=r, alpha=2.0 * r, seed=1000 + i) for i, r in enumerate(ranks)]
    layer_shapes = [(896, 896), (896, 128), (896, 128), (896, 896), (896, 4864), (896, 4864), (4864, 896)] * 24
    layers = [(f"layers.{i // 7}.m{i % 7}", nn.Linear(a, b, bias=False, device="meta")) for i, (a, b) in enumerate(layer_shapes)]
    class L:  # a stand-in with a cuda weight's device and dtype
        def __init__(self, lin):
            self.in_features = lin.in_features
            self.weight = torch.empty(0, device=dev, dtype=dt)
    ls = [(n, L(l)) for n, l in layers]
    t = time.perf_counter(); a = _initial_as(specs, ls); torch.cuda.synchronize(); res["cpu_draw_s"] = time.perf_counter() - t
    def gpu(name, d_in):
        o = torch.empty(sum(ranks), d_in, device=dev, dtype=torch.float32)
        r0 = 0
        for s in specs:
            g = torch.Generator(device=dev).manual_seed(_stable_seed(s.seed, name))
            o[r0:r0 + s.rank].uniform_(-1 / d_in ** 0.5, 1 / d_in ** 0.5, generator=g)
            r0 += s.rank
        return o.to(dt)
    for rep in range(2):
        t = time.perf_counter(); b = [gpu(n, l.in_features) for n, l in ls]; torch.cuda.synchronize()
        res[f"gpu_draw_s_{rep}"] = time.perf_counter() - t
    res["numbers"] = sum(x.numel() for x in a)
else:
    if mode.endswith("prewarmed"):
        t = time.perf_counter(); res["prewarm"] = prewarm(dev); res["prewarm_s"] = time.perf_counter() - t
    prof = cProfile.Profile() if mode.startswith("profile") else None
    if prof: prof.enable()
    t = time.perf_counter()
    res["kernels"] = ca.compile_ahead(meta, shapes, dt, dev, backward=True, threads=threads)
    res["ahead_s"] = time.perf_counter() - t
    if prof:
        prof.disable()
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(35)
        st.sort_stats("cumulative").print_stats(45)
        open(out, "w").write(s.getvalue())
    # the real launches find them ready
    t = time.perf_counter()
    from plora.kernels import triton_ops as T
    for d_in, d_out in shapes:
        n, r = meta.num_tokens, meta.total_rank
        x = torch.randn(n, d_in, device=dev, dtype=dt); y = torch.randn(n, d_out, device=dev, dtype=dt)
        a = torch.randn(r, d_in, device=dev, dtype=dt) * 0.01; b = torch.randn(r, d_out, device=dev, dtype=dt) * 0.01
        s_ = T.lora_forward(x, a, b, meta, y)
        T.lora_backward(y, x, s_, a, b, meta, torch.zeros_like(x))
    torch.cuda.synchronize()
    res["launches_s"] = time.perf_counter() - t
print(json.dumps(res))
"""


def run(mode: str, threads: int, cache: str, out: Path) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": cache}
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(threads), str(out / f"profile-{mode}.txt")],
                          env=env, capture_output=True, text=True, cwd=str(Path(__file__).resolve().parents[1]))
    if proc.returncode:
        return {"mode": mode, "error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("kernel-loads"))
    ap.add_argument("--threads", type=int, default=16)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as cache:
        for mode, threads in [("fill", args.threads), ("warm", args.threads), ("prewarmed", args.threads),
                              ("warm", args.threads), ("prewarmed", args.threads), ("profile", 1),
                              ("profile-prewarmed", 1), ("draw", 0)]:
            results.append(run(mode, threads, cache, args.out))
            print(json.dumps(results[-1]), flush=True)
    (args.out / "kernel_loads.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
