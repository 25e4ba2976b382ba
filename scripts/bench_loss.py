#!/usr/bin/env python
"""The LM head's loss on one GPU: torch's path against the fused kernel (`plora.kernels.cross_entropy`).

What a packed step's head runs over its label tokens, chunk by chunk as `plora.train.packed.head_loss`
cuts them: the head's product, the loss and its gradient with respect to the logits, and the
product back to the hidden states. torch's path casts the logits to float32 and runs
log-softmax and the NLL forward and backward; the fused one reads the logits twice and writes
their gradient once. Per vocabulary (the families' own: SmolLM2 49,152, Llama 3 128,256, Qwen2.5
151,936, Gemma 256,000) it checks the fused path against torch's (loss, and the gradient with
respect to the hidden states, bf16) and times both from CUDA graph replays (GPU time, as a
step replays them), for the 0.5B benchmark's full pack (12,000 label tokens) and its drain
(4,000). With ``--blocks`` it also times the kernel alone at other block sizes and warps, and
with ``--chunks`` the fused path at torch's chunks and at twice its own.

    python scripts/bench_loss.py --out DIR [--blocks] [--chunks]
    python scripts/bench_loss.py --smoke --out DIR   # CPU, Triton's interpreter: the check only

Files in ``--out``: loss.json (every row), loss.md (the table).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

VOCABS = {"smollm2": (49152, 576), "llama3": (128256, 2048), "qwen2.5-0.5b": (151936, 896), "gemma": (256000, 2304)}
LABELS = {"full pack": 12000, "drain": 4000}


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes: the check only")
    ap.add_argument("--blocks", action="store_true", help="also time the kernel at other block sizes and warps")
    ap.add_argument("--chunks", action="store_true", help="also time the fused path at larger chunks")
    ap.add_argument("--reps", type=int, default=20)
    return ap.parse_args()


def main() -> None:
    args = _args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("PLORA_KERNELS", "triton")
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    rows: list[dict] = []
    if args.smoke:
        vocabs, labels, dtype = {"tiny": (1000, 32)}, {"tiny": 300}, torch.float32
    else:
        vocabs, labels, dtype = VOCABS, LABELS, torch.bfloat16
    for name, (vocab, hidden) in vocabs.items():
        for where, n in labels.items():
            rows.append(_row(name, vocab, hidden, where, n, dtype, device, args))
            print(json.dumps(rows[-1]), flush=True)
    if args.blocks and device.type == "cuda":
        rows += _blocks(dtype, device, args)
    (args.out / "loss.json").write_text(json.dumps({"device": _device_name(device), "rows": rows}, indent=1))
    lines = ["| vocab | labels | chunk rows (torch/fused) | torch ms | fused ms | saved ms | loss rel err | grad max err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "torch_ms" in r:
            lines.append(f"| {r['model']} {r['vocab']} | {r['labels']} | {r['chunk']} | {r['torch_ms']:.2f} | "
                         f"{r['fused_ms']:.2f} | {r['torch_ms'] - r['fused_ms']:.2f} | {r['loss_rel_err']:.1e} | "
                         f"{r['grad_max_err']:.1e} |")
    for r in rows:
        if "kernel_ms" in r:
            lines.append(f"kernel alone, vocab {r['vocab']}, {r['rows']} rows, block {r['block']} warps {r['warps']}: "
                         f"{r['kernel_ms']:.3f} ms ({r['gb_s']:.0f} GB/s at 6 bytes a logit)")
    (args.out / "loss.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _paths(vocab: int, hidden: int, n: int, dtype, device):
    """The head's weight, the label tokens' hidden states and targets, and each path's whole
    head (all chunks, loss and gradient with respect to the hidden states)."""
    import torch
    import torch.nn.functional as F

    from plora.data.dataset import IGNORE_INDEX
    from plora.kernels.cross_entropy import cross_entropy_rows

    gen = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=gen) / hidden**0.5).to(dtype).to(device)
    h = torch.randn(n, hidden, generator=gen).to(dtype).to(device)
    targets = torch.randint(0, vocab, (n,), generator=gen).to(device)
    targets[::17] = IGNORE_INDEX

    def torch_path(chunk: int):
        total, grads = torch.zeros((), device=device), []
        for c0 in range(0, n, chunk):
            leaf = h[c0:c0 + chunk].detach().requires_grad_(True)
            loss = F.cross_entropy(F.linear(leaf, weight).float(), targets[c0:c0 + chunk], ignore_index=IGNORE_INDEX,
                                   reduction="sum")
            (g,) = torch.autograd.grad(loss, leaf)
            total, _ = total + loss.detach(), grads.append(g)
        return total, torch.cat(grads)

    def fused_path(chunk: int):
        total, grads = torch.zeros((), device=device), []
        for c0 in range(0, n, chunk):
            leaf = h[c0:c0 + chunk].detach().requires_grad_(True)
            logits = F.linear(leaf, weight)
            per_row, dlogits = cross_entropy_rows(logits.detach(), targets[c0:c0 + chunk], IGNORE_INDEX, grad=True)
            (g,) = torch.autograd.grad(logits, leaf, dlogits)
            total, _ = total + per_row.sum(), grads.append(g)
        return total, torch.cat(grads)

    return torch_path, fused_path


def _time_ms(fn, device, reps: int) -> float:
    """GPU time of ``fn()`` replayed from a CUDA graph (as a packed step replays its head)."""
    import torch

    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _row(model: str, vocab: int, hidden: int, where: str, n: int, dtype, device, args) -> dict:
    from plora.train.packed.head_loss import chunk_rows

    torch_path, fused_path = _paths(vocab, hidden, n, dtype, device)
    chunk = chunk_rows(vocab)  # torch's path: float32 logits and their gradient
    fused_chunk = chunk_rows(vocab, bytes_per_logit=2 * dtype.itemsize)  # the fused loss's (`head_chunk_rows`)
    want_loss, want_grad = torch_path(chunk)
    got_loss, got_grad = fused_path(fused_chunk)
    row = {"model": model, "vocab": vocab, "hidden": hidden, "labels": n, "where": where,
           "chunk": f"{chunk}/{fused_chunk}",
           "loss_rel_err": abs(float(got_loss) - float(want_loss)) / max(1e-9, abs(float(want_loss))),
           "grad_max_err": float((got_grad.float() - want_grad.float()).abs().max()),
           "grad_max": float(want_grad.float().abs().max())}
    row["torch_ms"] = _time_ms(lambda: torch_path(chunk), device, args.reps)
    row["fused_ms"] = _time_ms(lambda: fused_path(fused_chunk), device, args.reps)
    if args.chunks and device.type == "cuda":
        row["fused_other_chunks_ms"] = {str(c): _time_ms(lambda c=c: fused_path(c), device, args.reps)
                                        for c in (chunk, 2 * fused_chunk)}
    return row


def _blocks(dtype, device, args) -> list[dict]:
    """The kernel alone over one chunk of the 0.5B shape's vocabulary, at other blocks and warps."""
    import torch

    from plora.data.dataset import IGNORE_INDEX
    from plora.kernels import cross_entropy as ce
    from plora.train.packed.head_loss import chunk_rows

    out = []
    vocab = VOCABS["qwen2.5-0.5b"][0]
    n = chunk_rows(vocab)
    logits = torch.randn(n, vocab, device=device).to(dtype)
    targets = torch.randint(0, vocab, (n,), device=device)
    kept = ce.WARPS
    try:
        for block, warps in ((4096, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 16), (32768, 32), (65536, 32)):
            ce.WARPS = ((0, warps),)
            ms = _time_ms(lambda b=block: ce.cross_entropy_rows(logits, targets, IGNORE_INDEX, grad=True, block=b),
                          device, args.reps)
            out.append({"vocab": vocab, "rows": n, "block": block, "warps": warps, "kernel_ms": ms,
                        "gb_s": 6 * n * vocab / (ms * 1e-3) / 1e9})
            print(json.dumps(out[-1]), flush=True)
    finally:
        ce.WARPS = kept
    return out


if __name__ == "__main__":
    main()
