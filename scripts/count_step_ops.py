"""The ATen ops and Triton launches of one packed training step, with ``PLORA_LEAN_STEP`` on and off.

A packed step replayed from a CUDA graph costs about 2.5 µs per kernel whatever its rows
(on an H200: 13.4 ms of a 0.5B step's 5,362 kernels), so its count of kernels is its fixed
cost. This counts a step's work on the CPU, without a GPU: every ATen op that computes
something (views and allocations left out), by name, and every launch of the packed LoRA
kernels (recorded by `plora.kernels.triton_ops.collecting`, not run). The model is the 0.5B
shape's depth at tiny widths (its ops, not its FLOPs), of the family whose RoPE the
benchmark uses: Qwen2 (rotate-half) or Llama (interleaved pairs, as SmolLM2).

What the CPU cannot show: attention runs here one SDPA per row (on a GPU, one flash varlen
launch per layer), and RMSNorm has no fused CPU kernel, so its composite is counted both
ways (on a GPU the lean step's float32 scale runs ``_fused_rms_norm``: `plora.train.packed.norms`).
Run ``scripts/trace_packed_step.py`` on the GPU for its kernels.

    TRITON_INTERPRET=1 python scripts/count_step_ops.py --family qwen2 --out DIR
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PLORA_KERNELS", "triton")  # the Triton path's ops around its launches

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_packed_step import make_recipe  # noqa: E402

from plora.kernels.triton_ops import collecting  # noqa: E402
from plora.models.folders import write_shape_folder  # noqa: E402
from plora.models.shape import ModelShape  # noqa: E402
from plora.settings import LEAN_STEP  # noqa: E402
from plora.train.heap import frozen_heap  # noqa: E402

#: ATen ops that compute nothing on a GPU (views, metadata, allocations)
NOT_KERNELS = {"view", "_unsafe_view", "t", "transpose", "reshape", "expand", "unsqueeze", "squeeze", "permute",
               "slice", "select", "alias", "detach", "split", "split_with_sizes", "as_strided", "unbind",
               "_reshape_alias", "lift_fresh", "empty", "empty_strided", "new_empty", "unflatten", "flatten",
               "set_", "resize_", "promote_types"}


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NOT_KERNELS:
            self.count[name] += 1
        return func(*args, **(kwargs or {}))


def count_step(family: str, ranks: list[int], sizes: list[int], seq: int, dtype: str, lean: bool) -> dict:
    os.environ[LEAN_STEP] = "1" if lean else "0"
    # the 0.5B shape's 24 layers and heads at width 64 (its ops without its FLOPs)
    shape = ModelShape(f"{'qwen' if family == 'qwen2' else 'llama'}-deep-tiny", 0, 64, 128, 24, 4, 2, 16, 512, 2, True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape_folder(shape, Path(tmp) / "model")
        recipe = make_recipe(model_dir, Path(tmp) / "out", ranks, sizes, seq, dtype)
        runs = list(recipe.runs)
        with frozen_heap():
            with collecting():
                recipe.train_step(runs, 0)  # first step: one-time work left out of the count
            ops = OpCount()
            with collecting() as launches, ops:
                recipe.train_step(runs, 1)
    by_kernel = collections.Counter(getattr(getattr(k, "fn", k), "__name__", str(k)) for k, *_ in launches)
    return {"lean_step": lean, "aten_ops": sum(ops.count.values()), "triton_launches": len(launches),
            "aten_by_name": dict(ops.count.most_common()), "triton_by_kernel": dict(by_kernel.most_common())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=["qwen2", "llama"], default="qwen2")
    ap.add_argument("--ranks", default="8,8,16,16,32,32,64,64", help="ranks, cycled over the adapters")
    ap.add_argument("--batch-sizes", default="4,4,4,4,4,4,4,4,2,2,2,2,2,2,2,2",
                    help="batch sizes, one per adapter (the first-sweep benchmark's full pack by default)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype (a GPU job's: its casts are kernels too)")
    ap.add_argument("--out", type=Path, default=Path("count-out"))
    args = ap.parse_args()
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    cycle = [int(r) for r in args.ranks.split(",")]
    ranks = [cycle[i % len(cycle)] for i in range(len(sizes))]
    rows = [count_step(args.family, ranks, sizes, args.seq, args.dtype, lean) for lean in (False, True)]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"step_ops_{args.family}.json").write_text(json.dumps(rows, indent=2))
    before, after = rows
    print(f"{args.family}: {len(sizes)} adapters, ATen ops per step {before['aten_ops']} -> {after['aten_ops']} "
          f"({after['aten_ops'] - before['aten_ops']:+d}); Triton launches {before['triton_launches']} -> "
          f"{after['triton_launches']}")
    names = sorted(set(before["aten_by_name"]) | set(after["aten_by_name"]),
                   key=lambda n: after["aten_by_name"].get(n, 0) - before["aten_by_name"].get(n, 0))
    for name in names:
        a, b = before["aten_by_name"].get(name, 0), after["aten_by_name"].get(name, 0)
        if a != b:
            print(f"  {name:32s} {a:6d} -> {b:6d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
