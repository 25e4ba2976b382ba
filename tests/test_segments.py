"""Per-adapter norms and AdamW over one flat buffer: against torch's AdamW and a float64 sum.

The Triton kernels run in the interpreter on CPU (float32 and float16 weights); the `gpu`
test runs them compiled in bf16.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from plora.kernels import adamw_hyperparams, build_segments, segment_sq_norms, segmented_adamw_
from plora.kernels import segments as S

pytest.importorskip("triton")


def _rng() -> random.Random:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return random.Random(seed)


def _layout(rng: random.Random, groups: int, numel_cap: int = 5000):
    """Random ranges per group, interleaved like a bank's rows (every group in every tensor),
    some gaps nobody owns, one empty range."""
    ranges, off = [], 0
    for _tensor in range(rng.randint(2, 4)):
        for g in range(groups):
            n = 0 if (g == 1 and _tensor == 0) else rng.randint(1, numel_cap // (4 * groups))
            ranges.append((off, n, g, 1.0))
            off += n
        off += rng.randint(0, 7)  # a gap
    return ranges, off


def _torch_adamw(p0: torch.Tensor, grads: list[torch.Tensor], lr, wd, coef_per_step):
    """torch's AdamW from ``p0``: the parameters after the last step, and each element's
    largest magnitude on the way (start included), which bounds a rounded copy's error."""
    p = torch.nn.Parameter(p0.clone())
    peak = p0.abs()
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd, foreach=False)
    for g, c in zip(grads, coef_per_step):
        p.grad = g * c
        opt.step()
        peak = torch.maximum(peak, p.detach().abs())
    return p.detach(), peak


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_segmented_adamw_matches_torch_per_group(backend, dtype):
    rng = _rng()
    groups = 4
    ranges, numel = _layout(rng, groups)
    seg = build_segments(ranges, groups, numel, "cpu", tile=64)  # small tiles: many per range
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    w = torch.randn(numel, generator=gen, dtype=torch.float32).to(dtype)
    m = torch.zeros(numel)
    v = torch.zeros(numel)
    lrs = [1e-2, 3e-3, 5e-2, 1e-3]
    wd = 0.01
    steps = 3
    grads = [torch.randn(numel, generator=gen).to(dtype) for _ in range(steps)]
    coefs = [[rng.uniform(0.2, 1.0) for _ in range(groups)] for _ in range(steps)]
    start = w.clone()
    skipped = 2  # group 2 sits out step 1: its elements must not move then
    counts = [0] * groups
    for s in range(steps):
        table = {}
        for k in range(groups):
            if k == skipped and s == 1:
                continue
            counts[k] += 1
            table[k] = (counts[k], lrs[k], wd, 0.9, 0.999, 1e-8, coefs[s][k])
        hp = adamw_hyperparams(table, groups, "cpu")
        before = w.clone()
        segmented_adamw_(w, grads[s], m, v, seg, hp, backend=backend)
        if s == 1:
            for st, n, g, _ in ranges:
                if g == skipped:
                    assert torch.equal(w[st : st + n], before[st : st + n])
    owned = torch.zeros(numel, dtype=torch.bool)
    for st, n, g, _ in ranges:
        owned[st : st + n] = True
        idx = [i for i in range(steps) if not (g == skipped and i == 1)]
        want, peak = _torch_adamw(start[st : st + n].float(), [grads[i][st : st + n].float() for i in idx],
                                  lrs[g], wd, [coefs[i][g] for i in idx])
        # float16 weights are rounded after every step: 3 half-ulps of the largest magnitude
        # they passed through (which can exceed both the first and the last, e.g. 1.5e-4 ->
        # 0.01 -> 9e-5 at lr 1e-2)
        rel = 1e-6 if dtype == torch.float32 else 1.5 * 2**-10
        tol = 2e-6 + rel * peak
        err = (w[st : st + n].float() - want).abs()
        assert (err <= tol).all(), (g, err.max())
    assert torch.equal(w[~owned], start[~owned])  # gaps untouched


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sq_norms_per_group_with_weights_and_nan_isolation(backend):
    rng = _rng()
    groups = 5
    ranges, numel = _layout(rng, groups)
    ranges = [(s, n, g, 0.5 if (i % 3 == 0) else 1.0) for i, (s, n, g, _) in enumerate(ranges)]
    seg = build_segments(ranges, groups, numel, "cpu", tile=50)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rng.getrandbits(31)))
    want = torch.zeros(groups, dtype=torch.float64)
    for s, n, g, wt in ranges:
        want[g] += wt * x[s : s + n].double().square().sum()
    got = segment_sq_norms(x, seg, backend=backend)
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    bad = next(s for s, n, g, _ in ranges if g == 3 and n > 0)
    x[bad] = float("nan")
    got = segment_sq_norms(x, seg, backend=backend)
    assert torch.isnan(got[3])
    others = [g for g in range(groups) if g != 3]
    assert torch.allclose(got[others].double(), want[others], rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_inf_step_stays_in_its_group():
    """An absurd learning rate poisons only its own adapter's weights."""
    ranges = [(0, 10, 0, 1.0), (10, 10, 1, 1.0)]
    seg = build_segments(ranges, 2, 20, "cpu")
    w, g = torch.ones(20), torch.ones(20)
    m, v = torch.zeros(20), torch.zeros(20)
    hp = adamw_hyperparams({0: (1, 1e38, 0.0, 0.9, 0.999, 1e-8, 1.0), 1: (1, 1e-3, 0.0, 0.9, 0.999, 1e-8, 1.0)}, 2, "cpu")
    for backend in ("torch", "triton"):
        w1 = w.clone()
        segmented_adamw_(w1, g, m.clone(), v.clone(), seg, hp, backend=backend)
        assert not torch.isfinite(w1[:10]).all()
        assert torch.allclose(w1[10:], torch.full((10,), 1 - 1e-3), atol=1e-6)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="group 2 out of range"):
        build_segments([(0, 4, 2, 1.0)], 2, 10, "cpu")
    with pytest.raises(ValueError, match="outside the buffer"):
        build_segments([(8, 4, 0, 1.0)], 1, 10, "cpu")
    seg = build_segments([(0, 4, 0, 1.0)], 1, 10, "cpu")
    with pytest.raises(ValueError, match="contiguous 1-D buffer of 10"):
        segment_sq_norms(torch.zeros(9), seg)
    with pytest.raises(ValueError, match="hp: expected shape"):
        segmented_adamw_(torch.zeros(10), torch.zeros(10), torch.zeros(10), torch.zeros(10), seg, torch.zeros(2, 8))


@pytest.mark.gpu
def test_segmented_ops_on_gpu_bf16(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rng = _rng()
    groups = 8
    ranges, numel = _layout(rng, groups, numel_cap=200_000)
    seg = build_segments(ranges, groups, numel, "cuda")
    w = torch.randn(numel, device="cuda").to(torch.bfloat16)
    g = torch.randn(numel, device="cuda").to(torch.bfloat16)
    m = torch.zeros(numel, device="cuda")
    v = torch.zeros(numel, device="cuda")
    table = {k: (1, 1e-3 * (k + 1), 0.01, 0.9, 0.999, 1e-8, 0.5) for k in range(groups)}
    hp = adamw_hyperparams(table, groups, "cuda")
    want = [t.clone() for t in (w, m, v)]
    S.segmented_adamw_ref_(*want[:1], g, *want[1:], seg, hp)
    segmented_adamw_(w, g, m, v, seg, hp)
    # bf16 weights: the two paths may round the same fp32 value to neighbouring bf16 numbers
    assert ((w.float() - want[0].float()).abs() <= 2**-7 * want[0].float().abs() + 1e-6).all()
    assert torch.allclose(m, want[1], atol=1e-6) and torch.allclose(v, want[2], atol=1e-6)
    assert torch.allclose(segment_sq_norms(g, seg), S.segment_sq_norms_ref(g, seg), rtol=1e-4)


def test_kernels_import_from_a_source_checkout(tmp_path):
    """Without an install (PYTHONPATH on a checkout, as on an offline GPU machine),
    `plora.kernels` still resolves to the repository's kernels/ folder."""
    import site
    import subprocess
    import sys
    from pathlib import Path

    import plora

    repo = Path(plora.__file__).resolve().parent.parent
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join([str(repo), *site.getsitepackages()])}
    code = "import plora.kernels.segments as s, plora.kernels as k; print(k.__file__); print(s.__file__)"
    out = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [str(Path(line).resolve()) for line in out.stdout.split()]  # through the plora/kernels link
    assert lines == [str(repo / "kernels" / "__init__.py"), str(repo / "kernels" / "segments.py")]
