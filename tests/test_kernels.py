"""Packed LoRA kernels against a float64 oracle, on fresh random shapes every run.

On CPU the Triton kernels run in Triton's interpreter (float32 and float16; the interpreter
mishandles bf16 arithmetic); the `gpu` test runs the compiled kernels in bf16. The oracle is
float64 autograd through the plain formula, so it checks the torch reference too.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from plora.kernels import backend_for, build_lora_meta, packed_lora_delta, packed_lora_linear
from plora.kernels import reference

triton_ops = pytest.importorskip("plora.kernels.triton_ops")
pytest.importorskip("triton")

# Small tiles, small chunks: every masking edge, split hidden dims and token chunks summed
# with atomics show up at the tiny sizes the interpreter can afford.
SMALL_TILES = {
    "shrink": {"bt": 16, "bh": 32},
    "expand": {"bt": 16, "bh": 16, "max_chunk": 32},
    "wgrad": {"bt": 16, "bh": 32, "max_chunk": 16},
    "dy_pair": {"bt": 16, "bh": 32, "bt2": 16, "bh2": 16, "max_chunk": 16},
    "dy_band": {"bt": 16, "bh": 16, "max_chunk": 16, "waves": 0},
    "dy_block": {"bt": 16, "bh": 16, "bt2": 16, "bh2": 16, "block": 48, "max_chunk": 16},
}
# The same, with the expand's token loop software-pipelined (its Y loads in flight ahead)
# and the weight gradient's grid ordered by item (hidden tiles first).
PIPELINED_TILES = {**SMALL_TILES, "expand": {"bt": 16, "bh": 16, "max_chunk": 48, "ystages": 3},
                   "wgrad": {**SMALL_TILES["wgrad"], "hfirst": True}}
TOL = {torch.float32: 2e-5, torch.float16: 6e-3, torch.bfloat16: 3e-2}


def _rng() -> random.Random:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")  # shown by pytest when a test fails
    return random.Random(seed)


def _problem(rng: random.Random, k: int | None = None):
    """Segments with empty and one-token ones, ranks 1/8/100/128 mixed, odd hidden sizes."""
    k = k or rng.randint(4, 6)
    ranks = [1, 8, 100, 128] + [rng.choice([1, 8, 100, 128, rng.randint(2, 64)]) for _ in range(k - 4)]
    rng.shuffle(ranks)
    tokens = [0, 1] + [rng.randint(2, 40) for _ in range(k - 2)]
    rng.shuffle(tokens)
    scales = [rng.uniform(0.25, 4.0) for _ in range(k)]
    d_in = rng.randint(17, 90)
    d_out = rng.randint(17, 90)
    while d_in % 16 == 0:
        d_in += 1
    return tokens, ranks, scales, d_in, d_out


def _tensors(rng, tokens, ranks, d_in, d_out, dtype, device="cpu", extra_rows=0):
    t, r = sum(tokens) + extra_rows, sum(ranks)
    g = torch.Generator().manual_seed(rng.getrandbits(31))

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device=device, dtype=dtype)

    return dict(
        x=rnd(t, d_in),
        weight=rnd(d_out, d_in, scale=d_in**-0.5),
        bias=rnd(d_out),
        A=rnd(r, d_in, scale=d_in**-0.5),
        B=rnd(r, d_out, scale=0.3),
        dy=rnd(t, d_out),
        lora_x=rnd(t, d_in),
    )


def _oracle(ts, tokens, ranks, scales, use_lora_x=False):
    """float64 autograd of the formula, one adapter at a time."""
    v = {k: t.detach().double().cpu().requires_grad_(k in ("x", "A", "B", "lora_x")) for k, t in ts.items()}
    xl = v["lora_x"] if use_lora_x else v["x"]
    y = v["x"] @ v["weight"].t() + v["bias"]
    parts, t0, r0 = [], 0, 0
    for n, r, s in zip(tokens, ranks, scales):
        parts.append(s * (xl[t0 : t0 + n] @ v["A"][r0 : r0 + r].t()) @ v["B"][r0 : r0 + r])
        t0, r0 = t0 + n, r0 + r
    parts.append(torch.zeros(y.shape[0] - t0, y.shape[1], dtype=y.dtype))
    y = y + torch.cat(parts)
    y.backward(v["dy"])
    grads = {k: v[k].grad for k in ("x", "A", "B")}
    if use_lora_x:
        grads["lora_x"] = v["lora_x"].grad
    return y.detach(), grads


def _run(ts, meta, backend, use_lora_x=False):
    v = {k: t.detach().clone().requires_grad_(k in ("x", "A", "B", "lora_x")) for k, t in ts.items()}
    y = packed_lora_linear(
        v["x"], v["weight"], v["bias"], v["A"], v["B"], meta,
        lora_x=v["lora_x"] if use_lora_x else None, backend=backend,
    )
    y.backward(v["dy"])
    grads = {k: v[k].grad for k in ("x", "A", "B")}
    if use_lora_x:
        grads["lora_x"] = v["lora_x"].grad
    return y.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all()
    return reference.rel_err(a.cpu(), b)


def _compare(got, want, tol, what):
    y, g = got
    y_ref, g_ref = want
    errs = {"y": _rel(y, y_ref), **{k: _rel(g[k], g_ref[k]) for k in g_ref}}
    bad = {k: e for k, e in errs.items() if not e <= tol}
    assert not bad, f"{what}: relative errors over {tol}: {bad} (all: {errs})"


@pytest.fixture
def triton_cpu(monkeypatch):
    monkeypatch.setenv("PLORA_KERNELS", "triton")
    assert backend_for(torch.zeros(1)) == "triton"


F32, F16 = torch.float32, torch.float16


# merge_tokens of the metas: 0 keeps one bucket per rank class (as large packs have), which
# the tiny token counts here would otherwise all merge into one (`MERGE_BUCKET_TOKENS`).
SEPARATE, MERGED = 0, None


@pytest.mark.parametrize(
    "dtype,tiles,dy_mode,merge",
    [
        (F32, None, "pair", SEPARATE),
        (F16, None, "pair", SEPARATE),
        (F16, None, "split", SEPARATE),
        (F32, SMALL_TILES, "split", SEPARATE),
        (F16, SMALL_TILES, "pair", SEPARATE),
        (F32, PIPELINED_TILES, "pair", SEPARATE),
        (F32, SMALL_TILES, "band", SEPARATE),
        (F16, {"dy_band": {"waves": 0}}, "band", SEPARATE),
        (F32, {**SMALL_TILES, "dy_band": {"bt": 16, "bh": 32, "waves": 0, "tacc": True}}, "band", SEPARATE),
        (F32, SMALL_TILES, "pair", MERGED),
        (F16, SMALL_TILES, "split", MERGED),
        (F32, SMALL_TILES, "block", SEPARATE),
        (F16, SMALL_TILES, "block", MERGED),
        (F32, {"dy_block": {"bt": 16, "bh": 32, "bt2": 32, "bh2": 32, "block": 64}}, "block", SEPARATE),
    ],
)
def test_triton_matches_oracle(triton_cpu, dtype, tiles, dy_mode, merge):
    rng = _rng()
    tokens, ranks, scales, d_in, d_out = _problem(rng)
    meta = build_lora_meta(tokens, ranks, scales, "cpu", merge_tokens=merge)
    ts = _tensors(rng, tokens, ranks, d_in, d_out, dtype)
    with triton_ops.tile_overrides(tiles, dy_mode=dy_mode):
        got = _run(ts, meta, "triton")
    _compare(got, _oracle(ts, tokens, ranks, scales), TOL[dtype], f"{dtype} {tokens} {ranks} {d_in}x{d_out}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_lora_x_and_uncovered_rows(triton_cpu, dtype):
    """Dropout-ed LoRA input, and rows past the last segment (they get the base output)."""
    rng = _rng()
    tokens, ranks, scales, d_in, d_out = _problem(rng, k=4)
    meta = build_lora_meta(tokens, ranks, scales, "cpu", merge_tokens=SEPARATE)
    ts = _tensors(rng, tokens, ranks, d_in, d_out, dtype, extra_rows=3)
    with triton_ops.tile_overrides(SMALL_TILES, dy_mode="pair"):
        got = _run(ts, meta, "triton", use_lora_x=True)
    _compare(got, _oracle(ts, tokens, ranks, scales, use_lora_x=True), TOL[dtype], "lora_x")


@pytest.mark.parametrize("dy_mode", ["pair", "split"])
def test_low_rank_buffers_summed_in_float32_are_kept_in_the_compute_dtype(triton_cpu, dy_mode, monkeypatch):
    """A shrink that splits the hidden dimension sums S' (and, on the dy side, dS) in
    float32; the op casts it once, so S' is kept and dS read in float16, and results hold."""
    monkeypatch.setattr(triton_ops, "SPLIT_MIN_HIDDEN", 0)  # split at these small sizes too
    rng = _rng()
    tokens, ranks = [0, 1, 37, 5], [8, 128, 100, 1]
    scales = [rng.uniform(0.25, 4.0) for _ in ranks]
    d_in, d_out = 200 + rng.randint(0, 40), 200 + rng.randint(0, 40)  # several hidden tiles to split
    meta = build_lora_meta(tokens, ranks, scales, "cpu", merge_tokens=SEPARATE)
    ts = _tensors(rng, tokens, ranks, d_in, d_out, F16)
    with triton_ops.tile_overrides({"shrink": {"bt": 16, "bh": 32}}, dy_mode=dy_mode):
        assert triton_ops._forward_plans(meta, d_in, d_out, triton_ops._num_sms(ts["x"].device))[2]
        S = triton_ops.lora_forward(ts["x"], ts["A"], ts["B"], meta, ts["x"].new_zeros(ts["x"].shape[0], d_out))
        got = _run(ts, meta, "triton")
    assert S.dtype == F16
    _compare(got, _oracle(ts, tokens, ranks, scales), TOL[F16], f"{dy_mode} {d_in}x{d_out}")


def test_reference_matches_oracle():
    rng = _rng()
    tokens, ranks, scales, d_in, d_out = _problem(rng)
    meta = build_lora_meta(tokens, ranks, scales, "cpu", merge_tokens=SEPARATE)
    ts = _tensors(rng, tokens, ranks, d_in, d_out, torch.float32)
    _compare(_run(ts, meta, "torch"), _oracle(ts, tokens, ranks, scales), TOL[torch.float32], "torch")
    _compare(
        _run(ts, meta, "torch", use_lora_x=True),
        _oracle(ts, tokens, ranks, scales, use_lora_x=True),
        TOL[torch.float32],
        "torch lora_x",
    )


def test_ops_against_float64_reference(triton_cpu):
    """The low-level ops (forward into y, backward into dx) and the packed S' buffer."""
    rng = _rng()
    tokens, ranks, scales, d_in, d_out = _problem(rng, k=4)
    meta = build_lora_meta(tokens, ranks, scales, "cpu", merge_tokens=SEPARATE)
    ts = _tensors(rng, tokens, ranks, d_in, d_out, torch.float32)
    x, A, B, dy = ts["x"], ts["A"], ts["B"], ts["dy"]
    y0, dx0 = torch.randn(x.shape[0], d_out), torch.randn_like(x)
    y_ref = y0.double()
    s_ref = reference.lora_forward_ref(x.double(), A.double(), B.double(), meta, y_ref)
    ga = reference.lora_backward_ref(dy.double(), x.double(), s_ref, A.double(), B.double(), meta, dx0.double())
    with triton_ops.tile_overrides(SMALL_TILES):
        y = y0.clone()
        s = triton_ops.lora_forward(x, A, B, meta, y)
        gb = triton_ops.lora_backward(dy, x, s, A, B, meta, dx0.clone())
        da_only = triton_ops.lora_backward(dy, x, s, A, B, meta, None, need_dx=False)
    assert _rel(y, y_ref) < 2e-5 and _rel(s, s_ref) < 2e-5
    for got, want in zip(gb, ga):
        assert _rel(got, want) < 2e-5
    assert da_only[2] is None and _rel(da_only[0], ga[0]) < 2e-5


def test_delta_is_the_lora_term(triton_cpu):
    rng = _rng()
    tokens, ranks, scales, d_in, d_out = _problem(rng, k=4)
    meta = build_lora_meta(tokens, ranks, scales, "cpu", merge_tokens=SEPARATE)
    ts = _tensors(rng, tokens, ranks, d_in, d_out, torch.float32)
    want = torch.zeros(sum(tokens), d_out, dtype=torch.float64)
    ref = reference.lora_forward_ref(ts["x"].double(), ts["A"].double(), ts["B"].double(), meta, want)
    del ref
    for backend in ("torch", "triton"):
        got = packed_lora_delta(ts["x"], ts["A"], ts["B"], meta, backend=backend)
        assert _rel(got, want) < 2e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_adapters_or_no_tokens_gives_the_base(triton_cpu, backend):
    d_in, d_out = 19, 23
    for tokens, ranks in (([], []), ([0, 0], [8, 100])):
        meta = build_lora_meta(tokens, ranks, [1.0] * len(ranks), "cpu")
        x = torch.randn(5, d_in, requires_grad=True)
        w, b = torch.randn(d_out, d_in), torch.randn(d_out)
        A = torch.randn(sum(ranks), d_in, requires_grad=True)
        B = torch.randn(sum(ranks), d_out, requires_grad=True)
        y = packed_lora_linear(x, w, b, A, B, meta, backend=backend)
        assert torch.allclose(y, x @ w.t() + b, atol=1e-5)
        y.sum().backward()
        assert torch.allclose(x.grad, torch.ones(5, d_out) @ w, atol=1e-5)
        assert A.grad is not None and not A.grad.any() and not B.grad.any()


def test_leading_dims_are_kept(triton_cpu):
    meta = build_lora_meta([3, 5], [8, 1], [2.0, 1.0], "cpu")
    x = torch.randn(2, 4, 21)
    w = torch.randn(13, 21)
    A, B = torch.randn(9, 21), torch.randn(9, 13)
    y = packed_lora_linear(x, w, None, A, B, meta)
    y_ref = packed_lora_linear(x.reshape(8, 21), w, None, A, B, meta, backend="torch")
    assert y.shape == (2, 4, 13) and _rel(y.reshape(8, 13), y_ref) < 2e-5


def test_backend_choice(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("PLORA_KERNELS", raising=False)
    assert backend_for(cpu) == "torch"
    monkeypatch.setenv("PLORA_KERNELS", "torch")
    assert backend_for(cpu) == "torch"
    monkeypatch.setenv("PLORA_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backend_for(cpu) == "torch"  # no interpreter: CPU stays on the reference
    monkeypatch.setenv("PLORA_KERNELS", "bogus")
    with pytest.raises(ValueError, match="PLORA_KERNELS"):
        backend_for(cpu)


def test_meta_layout_and_validation():
    meta = build_lora_meta([4, 0, 2], [8, 100, 1], [2.0, 0.5, 1.0], "cpu")
    assert meta.token_starts.tolist() == [0, 4, 4, 6]
    assert meta.rank_starts.tolist() == [0, 8, 108, 109]
    assert meta.ranks.tolist() == [8, 100, 1]
    assert meta.scales.tolist() == [2.0, 0.5, 1.0]
    assert meta.s_numel == 4 * 16 + 2 * 16  # rows padded to the rank bucket
    assert meta.buckets == {16: (0, 2)}  # the empty adapter has no work, whatever its rank
    sched = meta.schedule(16, 3)
    assert sched.seg.tolist() == [0, 0, 2] and sched.lo.tolist() == [0, 3, 4] and sched.hi.tolist() == [3, 4, 6]
    assert sched.split and meta.schedule(16, 3) is sched
    with pytest.raises(ValueError, match="ranks"):
        build_lora_meta([1], [0], [1.0], "cpu")
    with pytest.raises(ValueError, match="one token count"):
        build_lora_meta([1, 2], [8], [1.0], "cpu")


def test_small_rank_buckets_merge_upwards():
    """Buckets with fewer than `merge_tokens` tokens (with what joined them) go up into
    the next bucket of the pack; large ones keep their own launch; the largest never moves."""
    from plora.kernels.meta import merged_buckets

    mixed8 = [8, 25, 42, 59, 77, 94, 111, 128]
    assert merged_buckets([1024] * 8, mixed8, 8192) == [128] * 8
    mixed32 = [round(8 + 120 * i / 31) for i in range(32)]
    got = merged_buckets([1024] * 32, mixed32, 8192)
    assert got == [64 if r <= 64 else 128 for r in mixed32]  # 16 and 32 (7 adapters) join 64
    assert merged_buckets([1024] * 32, [8] * 31 + [128], 8192) == [16] * 31 + [128]
    assert merged_buckets([1024] * 4, [8, 8, 200, 100], 0) == [16, 16, 256, 128]
    assert merged_buckets([0, 5, 5], [300, 8, 100], 8192) == [512, 128, 128]  # no tokens: no launch, kept
    meta = build_lora_meta([3, 5, 2], [8, 100, 1], [1.0] * 3, "cpu")
    assert meta.buckets == {128: (0, 1, 2)} and meta.bucket_of_host == (128, 128, 128)
    assert meta.s_numel == 10 * 128 and meta.s_offsets.tolist() == [0, 384, 1024, 1280]
    assert build_lora_meta([3, 5, 2], [8, 100, 1], [1.0] * 3, "cpu", merge_tokens=0).buckets == {16: (0, 2), 128: (1,)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "dy_mode,streams,merge",
    [("split", True, SEPARATE), ("pair", True, SEPARATE), ("pair", False, SEPARATE),
     ("band", True, SEPARATE), (None, True, SEPARATE), ("split", True, MERGED), (None, True, MERGED),
     ("split", False, MERGED), ("block", True, SEPARATE), ("large", True, SEPARATE)],
)
def test_gpu_bf16(dy_mode, streams, merge, monkeypatch):
    """Compiled kernels in bf16; rank buckets, and a bucket's independent backward
    launches, on their own streams (the default) or on one; buckets one per rank class
    or merged as small packs are. "large": every launch takes the tiles and dy modes of
    large launches (`TILES_LARGE`, `DY_MODE_LARGE`)."""
    if dy_mode == "large":
        monkeypatch.setattr(triton_ops, "LARGE_ELEMS", 0)
        monkeypatch.setattr(triton_ops, "SMALL_ELEMS", -1)
        dy_mode = None
    monkeypatch.setattr(triton_ops, "BUCKET_STREAMS", streams)
    monkeypatch.setattr(triton_ops, "STAGE_STREAMS", streams)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("PLORA_KERNELS", raising=False)
    rng = _rng()
    tokens = [0, 1, 777, 64, 1500, 33]
    ranks = [8, 128, 100, 1, 8, 256]
    scales = [rng.uniform(0.25, 4.0) for _ in ranks]
    d_in, d_out = 1000 + rng.randint(0, 100), 3584
    meta = build_lora_meta(tokens, ranks, scales, "cuda", merge_tokens=merge)
    assert len(meta.buckets) == (1 if merge is MERGED else 3)
    ts = _tensors(rng, tokens, ranks, d_in, d_out, torch.bfloat16, device="cuda")
    # "band" on every bucket it takes, even with too few programs to choose it by itself
    with triton_ops.tile_overrides({"dy_band": {"waves": 0}} if dy_mode == "band" else None, dy_mode=dy_mode):
        got = _run(ts, meta, None)
        got_lx = _run(ts, meta, None, use_lora_x=True)
    _compare(got, _oracle(ts, tokens, ranks, scales), TOL[torch.bfloat16], "bf16")
    _compare(got_lx, _oracle(ts, tokens, ranks, scales, use_lora_x=True), TOL[torch.bfloat16], "bf16 lora_x")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_forks_never_share_a_stream():
    """Nested forks (buckets, then each bucket's side-by-side launches) run on streams
    distinct from each other and from the stream they fork from, even when that stream is
    one of the kernels' own (torch hands streams out round-robin from a small pool)."""
    dev = torch.device("cuda")
    triton_ops._free_streams(dev, 4, set())
    seen: list[tuple[str, int]] = []

    def leaf(tag):
        return lambda: seen.append((tag, torch.cuda.current_stream(dev).cuda_stream))

    def chain(b):
        seen.append((f"chain{b}", torch.cuda.current_stream(dev).cuda_stream))
        triton_ops._fork(dev, [leaf(f"a{b}"), leaf(f"b{b}")], first_here=True)

    outer = triton_ops._POOL[str(dev)][0]
    with torch.cuda.stream(outer):
        triton_ops._fork(dev, [lambda b=b: chain(b) for b in range(3)], first_here=False)
    got = dict(seen)
    assert got["a0"] == got["chain0"] and got["a2"] == got["chain2"]  # first fn stays on its chain
    side = [got[k] for k in ("chain0", "chain1", "chain2", "b0", "b1", "b2")]
    assert len(set(side)) == 6 and outer.cuda_stream not in side
    assert not triton_ops._BUSY


def test_dy_block_plan_splits_columns_into_blocks_of_whole_tiles():
    """"block" cuts the columns into blocks of whole tiles of both kinds of program, one
    float32 plane of dS parts per block; a block that does not hold whole tiles is refused."""
    meta = build_lora_meta([100, 0, 40], [128, 8, 100], [1.0] * 3, "cpu", merge_tokens=SEPARATE)
    with triton_ops.tile_overrides({"dy_block": {"bt": 16, "bh": 32, "bt2": 16, "bh2": 64, "block": 128}}):
        cfg, sched, (cols, planes), _ = triton_ops._plan(meta, "dy_block", 128, 300, 4)
        assert (cols, planes) == (128, 3)
        kind, aux = sched.kind.tolist(), sched.aux.tolist()
        assert sorted({a for k, a in zip(kind, aux) if k == 0}) == [0, 1, 2]  # column blocks
        assert sorted({a for k, a in zip(kind, aux) if k == 1}) == [0, 1, 2, 3, 4]  # column tiles
        # one block whose tiles cover everything: "pair", dS stored directly
        assert triton_ops._plan(meta, "dy_block", 128, 100, 4)[2] == (100, 1)
    with triton_ops.tile_overrides({"dy_block": {"bh": 32, "bh2": 64, "block": 96}}):
        with pytest.raises(ValueError, match="dy block of 96 columns"):
            triton_ops._plan(meta, "dy_block", 128, 300, 4)


def test_dy_mode_depends_on_launch_size(monkeypatch):
    """A bucket's dy mode is `DY_MODE`'s, or `DY_MODE_LARGE`'s past `LARGE_ELEMS` elements,
    or `DY_MODE_SMALL`'s up to `SMALL_ELEMS`; an override beats them all."""
    monkeypatch.setattr(triton_ops, "DY_MODE", {16: "pair"})
    monkeypatch.setattr(triton_ops, "DY_MODE_LARGE", {16: "band"})
    big = triton_ops.LARGE_ELEMS + 1
    assert triton_ops.dy_mode_for(16, 1024) == "pair"
    assert triton_ops.dy_mode_for(16, big) == "band"
    assert triton_ops.dy_mode_for(32, big) == "pair"  # not listed: the default
    monkeypatch.setattr(triton_ops, "DY_MODE_SMALL", {16: "split"})
    assert triton_ops.dy_mode_for(16, triton_ops.SMALL_ELEMS) == "split"
    assert triton_ops.dy_mode_for(16, triton_ops.SMALL_ELEMS + 1) == "pair"
    with triton_ops.tile_overrides(dy_mode="split"):
        assert triton_ops.dy_mode_for(16, big) == "split"


@pytest.mark.parametrize("dx_first_elems,first", [(1 << 40, "dx"), (0, "dA")])
def test_small_backward_launches_dx_before_da(triton_cpu, dx_first_elems, first, monkeypatch):
    """dA and dx both read only dS; side by side, the one enqueued first gets the SMs first,
    so small launches (`DX_FIRST_ELEMS`) enqueue the longer one, dx, first. Results hold
    either way."""
    monkeypatch.setattr(triton_ops, "DX_FIRST_ELEMS", dx_first_elems)
    order: list[str] = []
    wgrad, expand = triton_ops._launch_wgrad, triton_ops._launch_expand

    def rec(name, fn):
        def launch(*args):
            order.append(name)
            return fn(*args)
        return launch

    rng = _rng()
    tokens, ranks, scales, d_in, d_out = _problem(rng)
    meta = build_lora_meta(tokens, ranks, scales, "cpu", merge_tokens=MERGED)
    ts = _tensors(rng, tokens, ranks, d_in, d_out, F32)
    monkeypatch.setattr(triton_ops, "_launch_wgrad", rec("dA", wgrad))
    monkeypatch.setattr(triton_ops, "_launch_expand", rec("dx", expand))
    with triton_ops.tile_overrides(SMALL_TILES, dy_mode="pair"):
        got = _run(ts, meta, "triton")
    assert len(meta.buckets) == 1 and order[0] == "dx"  # the forward's expand, then the backward's x side
    assert order[-2:] == [first, "dA" if first == "dx" else "dx"]
    _compare(got, _oracle(ts, tokens, ranks, scales), TOL[F32], f"{first} first")
