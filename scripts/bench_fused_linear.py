#!/usr/bin/env python
"""What fusing the LoRA expand into the base layer's GEMM gives, on one GPU.

Per layer shape (tokens × in → out) and rank, four products, each from CUDA-graph replays:

- base: ``x Wᵀ`` by cuBLAS (``F.linear``) and by the fused kernel with no LoRA term (how
  far the Triton GEMM is from cuBLAS);
- forward: unfused = cuBLAS ``x Wᵀ + b``, then the packed shrink and expand; fused = the
  packed shrink, then one ``x Wᵀ + b + S' B`` kernel;
- dx: unfused = cuBLAS ``dy W``, then the packed expand ``dx += dS A``; fused = one
  ``dy W + dS A`` kernel.

Every fused result is checked against the unfused one (bf16, relative error). The GEMM
tiles are swept (`VARIANTS`) and the best per product is reported with its tile.

    python scripts/bench_fused_linear.py --out DIR
    python scripts/bench_fused_linear.py --smoke --out DIR   # tiny, CPU, Triton interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as BK  # noqa: E402  (timers, kernels import)

K, T = BK.K, BK.T
sys.path.insert(0, str(Path(__file__).resolve().parent / "experiments"))
import fused_linear as FL  # noqa: E402  (an experiment beside the benchmarks, not the runtime)

#: (BM, BN, BK, warps, stages, group_m, TMA loads). A warp-specialized loop was tried too: at 4
#: warps it never finished compiling (Triton 3.6, H100), at 8 it was no faster.
VARIANTS = [
    (256, 128, 64, 8, 3, 8, False),
    (128, 256, 64, 8, 4, 8, False),
    (128, 128, 64, 8, 4, 8, False),
    (128, 256, 64, 8, 3, 8, True),
    (256, 128, 64, 8, 3, 8, True),
    (128, 128, 64, 8, 4, 8, True),
]
#: (name, tokens, d_in, d_out): Qwen2.5-7B's projections at 32 adapters × 1,024 tokens, and
#: Qwen2.5-0.5B's at the packed step's 16 × 256 tokens.
SHAPES = [
    ("7b q/o", 32 * 1024, 3584, 3584),
    ("7b gate/up", 32 * 1024, 3584, 18944),
    ("7b down", 32 * 1024, 18944, 3584),
    ("7b k/v", 32 * 1024, 3584, 512),
    ("0.5b gate/up", 16 * 256, 896, 4864),
    ("0.5b down", 16 * 256, 4864, 896),
]
RANKS = [8, 32, 128]


def _name(v: tuple) -> str:
    return "x".join(map(str, v[:3])) + f"w{v[3]}s{v[4]}" + ("tma" if v[6] else "")


def run_shape(name: str, tokens: int, d_in: int, d_out: int, ranks: list[int], variants: list, dev: str,
              dtype: torch.dtype, log) -> list[dict]:
    k = 32 if tokens >= 32 * 1024 else 16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * scale).to(dtype)

    x, dy = rnd(tokens, d_in), rnd(tokens, d_out)
    W, b = rnd(d_out, d_in, scale=d_in ** -0.5), rnd(d_out, scale=0.1)
    rows = []
    t_cublas_f = BK.t_graph(lambda: F.linear(x, W, b))
    t_cublas_dx = BK.t_graph(lambda: dy @ W)
    base_f, base_dx = {}, {}
    meta0 = K.build_lora_meta([tokens // k] * k, [8] * k, [1.0] * k, dev)
    for v in variants:
        tl_ = FL.GemmTiles(*v)
        try:
            base_f[v] = BK.t_graph(lambda: FL.linear_lora(x, W, b, None, W, meta0, tiles=tl_))
            base_dx[v] = BK.t_graph(lambda: FL.linear_lora(dy, W, None, None, W, meta0, weight_is_out_in=False,
                                                           tiles=tl_))
        except Exception as e:  # a tile that does not fit this GPU's shared memory
            log(f"{name} base {v}: {type(e).__name__} {str(e)[:120]}")
    log(f"{name} {tokens}x{d_in}->{d_out}: cuBLAS fwd {t_cublas_f:.3f} dx {t_cublas_dx:.3f} ms; triton base "
        + " ".join(f"{_name(v)} {base_f[v]:.3f}/{base_dx[v]:.3f}" for v in base_f))
    for r in ranks:
        meta = K.build_lora_meta([tokens // k] * k, [r] * k, [2.0] * k, dev)
        A, B = rnd(r * k, d_in, scale=d_in ** -0.5), rnd(r * k, d_out, scale=0.05)
        T.lora_forward(x, A, B, meta, F.linear(x, W, b))  # builds the plans
        dS = T.shrink_stage(dy, B, meta).to(dtype)  # s·dy Bᵀ, zero padding: what the dy side gives

        def unfused_f():
            y = F.linear(x, W, b)
            T.lora_forward(x, A, B, meta, y)
            return y

        def unfused_dx():
            dx = dy @ W
            T.expand_stage(dS, A, meta, dx)
            return dx

        def shrink():  # S' in the compute dtype (a split shrink sums in float32)
            return T.shrink_stage(x, A, meta).to(dtype)

        want_f, want_dx = unfused_f(), unfused_dx()
        t_unf_f, t_unf_dx, t_shrink = BK.t_graph(unfused_f), BK.t_graph(unfused_dx), BK.t_graph(shrink)
        best = {}
        for v in base_f:
            tl_ = FL.GemmTiles(*v)

            def fused_f():
                return FL.linear_lora(x, W, b, shrink(), B, meta, tiles=tl_)

            def fused_dx():
                return FL.linear_lora(dy, W, None, dS, A, meta, weight_is_out_in=False, tiles=tl_)

            err_f, err_dx = BK.rel_err(fused_f(), want_f), BK.rel_err(fused_dx(), want_dx)
            tf, tdx = BK.t_graph(fused_f), BK.t_graph(fused_dx)
            for key, t_, err in (("fwd", tf, err_f), ("dx", tdx, err_dx)):
                if key not in best or t_ < best[key][0]:
                    best[key] = (t_, v, err)
        row = dict(shape=name, tokens=tokens, d_in=d_in, d_out=d_out, rank=r, adapters=k,
                   cublas_fwd=t_cublas_f, cublas_dx=t_cublas_dx,
                   triton_base_fwd=min(base_f.values()), triton_base_dx=min(base_dx.values()),
                   shrink=t_shrink, unfused_fwd=t_unf_f, unfused_dx=t_unf_dx,
                   fused_fwd=best["fwd"][0], fused_fwd_tile=best["fwd"][1], fused_fwd_err=best["fwd"][2],
                   fused_dx=best["dx"][0], fused_dx_tile=best["dx"][1], fused_dx_err=best["dx"][2])
        rows.append(row)
        log(f"  r{r}: fwd unfused {t_unf_f:.3f} fused {row['fused_fwd']:.3f} ({t_unf_f / row['fused_fwd']:.2f}x, "
            f"err {row['fused_fwd_err']:.1e}, {_name(row['fused_fwd_tile'])}); dx unfused {t_unf_dx:.3f} fused "
            f"{row['fused_dx']:.3f} ({t_unf_dx / row['fused_dx']:.2f}x, err {row['fused_dx_err']:.1e}, "
            f"{_name(row['fused_dx_tile'])}); "
            f"shrink {t_shrink:.3f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_fused_out"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, Triton interpreter")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    logf = (args.out / "log.txt").open("w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        BK.DEVICE = "cpu"
        dev, dtype = "cpu", torch.float32
        shapes, ranks, variants = [("smoke", 64, 48, 80)], [8], [(16, 32, 16, 4, 1, 2, False),
                                                                      (16, 32, 16, 4, 1, 2, True)]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_fused_linear: needs a CUDA GPU (or --smoke)")
        dev, dtype = "cuda", torch.bfloat16
        shapes = [s for s in SHAPES if args.shapes is None or s[0] in args.shapes.split(",")]
        ranks, variants = RANKS, VARIANTS
    log(f"{torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, {dtype}")
    t0, rows = time.time(), []
    for s in shapes:
        rows += run_shape(*s, ranks, variants, dev, dtype, log)
        (args.out / "result.json").write_text(json.dumps(rows, indent=1))
        if dev == "cuda":
            torch.cuda.empty_cache()
    log(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
