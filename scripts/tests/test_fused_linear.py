"""The base linear with the LoRA expand fused in (`fused_linear.linear_lora`) against a
float64 formula: forward ``x Wᵀ + b + S' B`` and dx ``dy W + dS A``, on fresh random
shapes every run (segments that straddle row tiles, empty and one-token segments, rows
outside every segment, ranks 1 to 128 in several buckets). On CPU in Triton's
interpreter; the `gpu` case in bf16 with the measured tiles."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
import torch

from plora.kernels import build_lora_meta
from plora.kernels.reference import rel_err

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import fused_linear as FL  # noqa: E402  (a benchmark experiment, not the runtime package)

TOL = {torch.float32: 2e-5, torch.float16: 6e-3, torch.bfloat16: 2e-2}


def _case(dtype, device, aligned: bool):
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    k = rng.randint(4, 6)
    ranks = [1, 8, 100, 128] + [rng.randint(2, 64) for _ in range(k - 4)]
    rng.shuffle(ranks)
    tokens = [0, 1] + [rng.randint(2, 40) for _ in range(k - 2)]
    rng.shuffle(tokens)
    scales = [rng.uniform(0.25, 4.0) for _ in range(k)]
    d_in, d_out = (rng.randint(2, 6) * 16, rng.randint(2, 6) * 16) if aligned else (rng.randint(17, 90), rng.randint(17, 90))
    meta = build_lora_meta(tokens, ranks, scales, device, merge_tokens=0)
    rows = sum(tokens) + rng.randint(0, 5)
    g = torch.Generator().manual_seed(rng.getrandbits(31))

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    x, W, b = rnd(rows, d_in), rnd(d_out, d_in, scale=d_in ** -0.5), rnd(d_out)
    A, B = rnd(sum(ranks), d_in, scale=d_in ** -0.5), rnd(sum(ranks), d_out, scale=0.3)
    # packed low-rank rows (S' or dS) as the kernels leave them: adapter k's n_k rows of
    # its bucket's width at s_offsets[k], zeros past its rank
    P = torch.zeros(meta.s_numel, dtype=torch.float64)
    lora = torch.zeros(rows, d_out, dtype=torch.float64)
    lora_dx = torch.zeros(rows, d_in, dtype=torch.float64)
    for a in range(k):
        t0, t1 = meta.token_starts_host[a], meta.token_starts_host[a + 1]
        r0, r = meta.rank_starts_host[a], ranks[a]
        rows_k = P[meta.s_offsets_host[a]: meta.s_offsets_host[a + 1]].view(t1 - t0, meta.bucket_of_host[a])
        rows_k[:, :r] = rnd(t1 - t0, r)
        lora[t0:t1] = rows_k[:, :r] @ B[r0: r0 + r]
        lora_dx[t0:t1] = rows_k[:, :r] @ A[r0: r0 + r]
    want_y = x @ W.t() + b + lora
    dy = rnd(rows, d_out)
    to = {"dtype": dtype, "device": device}
    return meta, [t.to(**to) for t in (x, W, b, A, B, P, dy)], want_y, dy @ W + lora_dx, dy @ W


def _check(dtype, device, tiles):
    meta, (x, W, b, A, B, P, dy), want_y, want_dx, want_base = _case(dtype, device, aligned=tiles.tma)
    y = FL.linear_lora(x, W, b, P, B, meta, tiles=tiles)
    dx = FL.linear_lora(dy, W, None, P, A, meta, weight_is_out_in=False, tiles=tiles)
    base = FL.linear_lora(dy, W, None, None, A, meta, weight_is_out_in=False, tiles=tiles)
    what = f"{tiles} {meta.tokens_host} {meta.ranks_host} {tuple(x.shape)}->{W.shape[0]}"
    assert rel_err(y, want_y) < TOL[dtype], what
    assert rel_err(dx, want_dx) < TOL[dtype], what
    assert rel_err(base, want_base) < TOL[dtype], what


SMALL = FL.GemmTiles(bm=16, bn=32, bk=16, warps=4, stages=1, group_m=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU tensors")
@pytest.mark.parametrize("dtype,tiles", [
    (torch.float32, SMALL),
    (torch.float16, SMALL),
    (torch.float32, FL.GemmTiles(bm=32, bn=16, bk=32, warps=4, stages=1, group_m=1, tma=True)),
])
def test_linear_lora_matches_formula(dtype, tiles):
    _check(dtype, "cpu", tiles)


def test_linear_lora_refuses_mismatched_shapes():
    meta = build_lora_meta([3], [4], [1.0], "cpu")
    x, W = torch.zeros(3, 8), torch.zeros(5, 7)
    with pytest.raises(ValueError, match="x has 8 columns"):
        FL.linear_lora(x, W, None, None, torch.zeros(4, 5), meta)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tiles", [FL.TILES, FL.GemmTiles(tma=True), FL.GemmTiles(bm=256, bn=128)])
def test_linear_lora_gpu_bf16(tiles, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _check(torch.bfloat16, "cuda", tiles)
