"""Which kernel should attend a flattened step's rows: a probe for the GPU machine.

A job attends flattened rows through the flash varlen kernel (`plora.train.packed.flash_varlen`),
with the keys and values torchtune expanded to every query head, turned to ``[T, H, D]`` by
copies. Padded rows attend through SDPA, which picks cuDNN's kernel on an H100/H200 and was
faster per token in `compare_row_layouts.py`. This times forward + backward of one step's
attention (the first-sweep benchmark's varied rows: 66-440 tokens, about 12,600 in all;
Qwen2.5-0.5B's 14 query heads over 2 key-value heads of 64) for:

- ``copies``: what a job did: the expanded keys and values, turned by copies, flash varlen;
- ``flash``: flash varlen on ``[T, H, D]`` queries and the 2 key-value heads as they are;
- ``cudnn``: cuDNN's ragged (varlen) kernel on the same (``aten._cudnn_attention_forward``
  with cumulative lengths), where this torch has it;
- for scale, dense SDPA (cuDNN, then flash) on the same tokens as fixed rows of 256;

checks each against float32 attention row by row (output and the three gradients), and
that ``flash`` and ``cudnn`` replay from a CUDA graph with new inputs as they ran eagerly.

    python scripts/probe_varlen_attention.py --out DIR

Writes DIR/varlen_attention.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from plora.train.packed.flash_varlen import flash_varlen  # noqa: E402


def row_lengths(total: int, lo: int, hi: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < total:
        out.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    return out


def reference(q, k, v, lengths, g):
    """Float32 attention row by row (keys and values repeated per query head); out and grads."""
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    outs, s = [], 0
    for n in lengths:
        sl = slice(s, s + n)
        qq = qf[sl].transpose(0, 1)
        kk = kf[sl].repeat_interleave(rep, dim=1).transpose(0, 1)
        vv = vf[sl].repeat_interleave(rep, dim=1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(qq, kk, vv, is_causal=True).transpose(0, 1))
        s += n
    out = torch.cat(outs)
    out.backward(g.float())
    return out.detach(), qf.grad, kf.grad, vf.grad


class CudnnRows(torch.autograd.Function):
    """cuDNN's ragged attention over rows bounded by ``cu``, causal; ``[T, H, D]`` in and out."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len):
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True)
        ctx.save_for_backward(q, k, v, out, lse, cu, seed, offset)
        ctx.max_len = max_len
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, out, lse, cu, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            g.contiguous(), q, k, v, out, lse, seed, offset, torch.empty(0, device=q.device), cu, cu,
            ctx.max_len, ctx.max_len, 0.0, True)
        return dq, dk, dv, None, None


def variants(flash):
    def copies(q, k, v, cu, max_len):  # torchtune's expand, [1, H, T, D], then the job's turn to [T, H, D]
        rep = q.shape[1] // k.shape[1]
        q4 = q.unsqueeze(0).transpose(1, 2)
        k4 = k.unsqueeze(0).transpose(1, 2).unsqueeze(2).expand(1, k.shape[1], rep, -1, k.shape[2]).flatten(1, 2)
        v4 = v.unsqueeze(0).transpose(1, 2).unsqueeze(2).expand(1, v.shape[1], rep, -1, v.shape[2]).flatten(1, 2)
        qt, kt, vt = (t[0].transpose(0, 1).contiguous() for t in (q4, k4, v4))
        return flash(qt, kt, vt, cu, max_len)

    return {"copies": copies,
            "flash": lambda q, k, v, cu, m: flash(q, k, v, cu, m),
            "cudnn": lambda q, k, v, cu, m: CudnnRows.apply(q, k, v, cu, m)}


def timed(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def errors(got, ref) -> list[float]:
    return [float((a.float() - b).abs().max() / (b.abs().max() + 1e-6)) for a, b in zip(got, ref)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=12600)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--bounds", default="440,1152", help="max_len values to try (a graph's bound may exceed the rows)")
    ap.add_argument("--out", type=Path, default=Path("varlen-probe"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev, dt = torch.device("cuda"), torch.bfloat16
    lengths = row_lengths(args.tokens, 66, 440, 0)
    T, H, Hk, D = sum(lengths), args.heads, args.kv_heads, args.head_dim
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(T, H, D, device=dev, dtype=dt, generator=gen)
    k = torch.randn(T, Hk, D, device=dev, dtype=dt, generator=gen)
    v = torch.randn(T, Hk, D, device=dev, dtype=dt, generator=gen)
    g = torch.randn(T, H, D, device=dev, dtype=dt, generator=gen)
    ref = reference(q, k, v, lengths, g)
    flash = flash_varlen()
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "cudnn": torch.backends.cudnn.version(), "tokens": T, "rows": len(lengths),
                    "heads": [H, Hk, D], "variants": {}}
    for name, fn in variants(flash).items():
        for bound in [int(b) for b in args.bounds.split(",")]:
            key = f"{name}@{bound}"
            try:
                leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                out = fn(*leaves, cu, bound)
                out.backward(g)
                err = errors([out, *(t.grad for t in leaves)], ref)

                def step():
                    for t in leaves:
                        t.grad = None
                    fn(*leaves, cu, bound).backward(g)

                fwd = timed(lambda: fn(*leaves, cu, bound).detach())
                both = timed(step)
                entry = {"fwd_ms": fwd, "fwd_bwd_ms": both, "rel_err": err}
                if name != "copies":
                    entry["graph"] = graph_check(fn, leaves, cu, bound, g, out, [t.grad for t in leaves])
                result["variants"][key] = entry
            except Exception as e:  # a kernel this torch lacks or refuses: say so, go on
                result["variants"][key] = {"error": f"{type(e).__name__}: {str(e)[:400]}",
                                           "trace": traceback.format_exc()[-1500:]}
            print(key, json.dumps(result["variants"][key])[:400], flush=True)
    # dense SDPA on the same tokens as fixed rows of 256 (the padded layout's kernels)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B = T // 256
    qd = torch.randn(B, H, 256, D, device=dev, dtype=dt, requires_grad=True)
    kd = torch.randn(B, H, 256, D, device=dev, dtype=dt, requires_grad=True)
    vd = torch.randn(B, H, 256, D, device=dev, dtype=dt, requires_grad=True)
    gd = torch.randn(B, H, 256, D, device=dev, dtype=dt)
    for name, backend in (("dense-cudnn", SDPBackend.CUDNN_ATTENTION), ("dense-flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                def dstep():
                    F.scaled_dot_product_attention(qd, kd, vd, is_causal=True).backward(gd)
                result["variants"][name] = {"fwd_bwd_ms": timed(dstep), "tokens": B * 256}
        except Exception as e:
            result["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, json.dumps(result["variants"][name]), flush=True)
    (args.out / "varlen_attention.json").write_text(json.dumps(result, indent=1))
    return 0


def graph_check(fn, leaves, cu, bound, g, out_eager, grads_eager) -> dict:
    """Capture forward + backward once, replay it on other inputs, then on the eager inputs:
    the replay must give the eager results bit for bit."""
    try:
        static = [t.detach().clone().requires_grad_() for t in leaves]
        gs = g.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                for t in static:
                    t.grad = None
                fn(*static, cu, bound).backward(gs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        for t in static:
            t.grad = None
        with torch.cuda.graph(graph):
            out = fn(*static, cu, bound)
            out.backward(gs)
        with torch.no_grad():
            for t in static:
                t.mul_(0.5)
        graph.replay()
        with torch.no_grad():
            for t, src in zip(static, leaves):
                t.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        same = [bool(torch.equal(a, b)) for a, b in zip([out, *(t.grad for t in static)],
                                                        [out_eager, *grads_eager])]
        return {"captured": True, "replay_equals_eager": same}
    except Exception as e:
        return {"captured": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}


if __name__ == "__main__":
    raise SystemExit(main())
