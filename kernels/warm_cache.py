"""Fill Triton's cache with a sweep's likely kernels in a process of its own, while it plans.

On a machine's first sweep the first job compiles its kernels ahead of its first step
(`plora.kernels.compile_ahead`): 3.2 s on 16 threads for the 16-adapter benchmark on an
H200, 5.3 s for SmolLM2's 24 adapters, with the GPU idle. Which variants a step launches
follows from its layer shapes, ranks and tokens per adapter, which the sweep knows once it
has decided its rows, seconds before the first job's process has imported torchtune. So a
sweep on a GPU starts this process with its spare (`plora.engine.kernel_warmer`): it imports
torch and the kernels only, says ``ready``, reads one `WarmOrder` line (the packs the sweep
expects: their steps, and the forwards of the evals that score them), compiles every variant
of those, and of the optimizer's norms and AdamW and the loss's, on threads into Triton's cache (the same
``TRITON_CACHE_DIR`` as the jobs'), prints one `WarmAnswer` line and exits. (Without the
evals' and the optimizer's, the first job compiled 11 variants of its own on an H200: 1.4 s.)
The first job's spare then loads them before its job comes, once this process has answered
(`plora.train.spare.KernelsAhead`, which calls `warm` in that process: every variant is then a
load from Triton's cache), and the job's own compile-ahead finds them loaded (where the spare
had no time, on disk); a variant this missed, or has not finished, compiles there as before. Nothing here changes what any step
computes.

    python -m plora.kernels.warm_cache < order.json
"""

from __future__ import annotations

import sys
import time

from plora.job.warm_order import READY, WarmAnswer, WarmOrder, WarmPack

__all__ = ["READY", "WarmAnswer", "WarmOrder", "WarmPack", "main", "warm"]


def warm(order: WarmOrder) -> int:
    """Compile the kernels of each of ``order``'s packs (a training step's forward and
    backward, or an eval's forward), and with the first training step the optimizer's
    and loss's (`launches_beside_layers`); how many variants were compiled."""
    import torch

    from .compile_ahead import compile_ahead, compiles_here
    from .meta import build_lora_meta

    device = torch.device(order.device)
    if not compiles_here(device) or not torch.cuda.is_available():
        return 0
    dtype = getattr(torch, order.dtype)
    done = 0
    optimizer = order.optimizer
    for pack in order.packs:
        if not pack.tokens or len(pack.tokens) != len(pack.ranks):
            continue
        if not _fits(pack, order.shapes, dtype, device):
            continue  # an eval's forward larger than this process may hold beside the first job
        meta = build_lora_meta(pack.tokens, pack.ranks, [1.0] * len(pack.ranks), device)
        also = None
        if optimizer and pack.backward:
            also, optimizer = (lambda: launches_beside_layers(dtype, device, order.vocab)), False
        done += compile_ahead(meta, order.shapes, dtype, device, backward=pack.backward,
                              accumulate_dx=order.accumulate_dx, also=also)
    return done


#: most bytes a pack's dry run may hold (its one scratch buffer), and most of the free memory
SCRATCH_MOST = 4 << 30
SCRATCH_SHARE = 0.1


def _fits(pack: WarmPack, shapes, dtype, device) -> bool:
    """Whether ``pack``'s dry run (`compile_ahead.launches_of`: a buffer of its tokens × the
    widest layer per view) stays small beside the first job on the same GPU: at most
    `SCRATCH_MOST`, and `SCRATCH_SHARE` of the free memory. An eval's forward over every eval
    row of several adapters can be far larger; the job compiles its variants itself."""
    import torch

    from .compile_ahead import scratch_bytes

    need = scratch_bytes(sum(pack.tokens), shapes, dtype, backward=pack.backward)
    free, _total = torch.cuda.mem_get_info(device)
    return need <= min(SCRATCH_MOST, SCRATCH_SHARE * free)


def launches_beside_layers(dtype, device, vocab: int | None) -> None:
    """What a training step launches besides its layers' kernels: its optimizer's, and with
    ``vocab`` its loss's and its evals' (`cross_entropy.loss_launches`), as a job's
    `PackedStep` collects them."""
    from .cross_entropy import loss_launches

    optimizer_launches(dtype, device)
    if vocab:
        loss_launches(dtype, device, vocab)


def optimizer_launches(dtype, device) -> None:
    """What a training step's norms and AdamW launch (`plora.train.packed.bank`) for adapters of
    ``dtype``: the kernels take pointers only (and constants), so two adapters' worth of tiles
    give the variants every pack of that dtype launches."""
    import torch

    from .segments import HP_COLUMNS, TILE, build_segments, segment_sq_norms, segmented_adamw_

    n = 2 * TILE
    seg = build_segments([(0, TILE, 0, 1.0), (TILE, TILE, 1, 1.0)], 2, n, device)
    weights = torch.zeros(n, dtype=dtype, device=device)
    grads = torch.zeros_like(weights)
    moment = torch.float64 if dtype == torch.float64 else torch.float32
    exp_avg = torch.zeros(n, dtype=moment, device=device)
    exp_avg_sq = torch.zeros_like(exp_avg)
    segment_sq_norms(grads, seg)
    segmented_adamw_(weights, grads, exp_avg, exp_avg_sq, seg,
                     torch.zeros(2, len(HP_COLUMNS), dtype=torch.float32, device=device))


def main() -> None:
    import torch  # noqa: F401 - the imports a compile needs, done before saying ready

    from . import compile_ahead, triton_ops  # noqa: F401

    print(READY, flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return  # the sweep needed nothing (or went away)
    t0 = time.perf_counter()
    try:
        kernels = warm(WarmOrder.model_validate_json(line))
        answer = WarmAnswer(kernels=kernels, seconds=round(time.perf_counter() - t0, 3), finished_at=time.time())
    except Exception as e:  # noqa: BLE001 - a job compiles what this could not
        answer = WarmAnswer(seconds=round(time.perf_counter() - t0, 3), finished_at=time.time(),
                            error=f"{type(e).__name__}: {e}"[:500])
    print(answer.model_dump_json(), flush=True)


if __name__ == "__main__":
    main()
