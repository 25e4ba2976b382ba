"""Launchers of the Triton packed LoRA kernels: the same two ops as `reference`.

Forward (per rank bucket): ``shrink`` S' = s·x Aᵀ (reads x once), then ``expand``
y += S' B (reads and writes y once). Backward: the dy side gives dS = s·dy Bᵀ and
dB = S'ᵀ dy; the x side gives dA = dSᵀ x (``wgrad``, reads x once) and dx += dS A
(``expand`` again, reads and writes dx once). The dy side runs in one of four ways per
rank bucket (`DY_MODE`, and `DY_MODE_LARGE` for launches past `LARGE_ELEMS` elements):

- "pair": one launch whose programs compute either dS or dB, scheduled so that both
  read each row of dy at about the same time, so the second read mostly hits L2;
- "split": a shrink and a weight-gradient launch, two full reads of dy;
- "band": one read of dy; a program walks a whole segment over a band of output
  columns, so dB is complete in it, and stores the band's partial dS in float32 for a
  small launch to sum (ranks up to 32: the partials cost 2·rank/band of dy's bytes);
- "block": "pair" over column blocks of a few thousand columns, so that the dy both
  kinds share fits in L2; each block's partial dS goes to a float32 plane, summed as in
  "band" (2·rank/block of dy's bytes each way, rank 128 in 4,096 columns: 1/16).

Tile sizes come from `TILES` (chosen on an H100/H200, see NOTES.md) and can be overridden
with `tile_overrides` (benchmarks, tests). How many token rows one program walks (its
*chunk*) is chosen per call so that a launch has enough programs to fill the GPU; when a
segment is cut into several chunks, its weight gradient is summed with float32 atomics.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .tile_tables import load_tables, tables_path
from .meta import MAX_RANK, LoRAMeta

_MODULES: dict[tuple[str, bool], object] = {}


def _interpreting() -> bool:
    """Whether Triton builds interpreted kernels now (``TRITON_INTERPRET``, read per call)."""
    from plora.settings import triton_interpreted

    return triton_interpreted()


def kernels_module(file: str | Path = "_triton_kernels.py"):
    """A module of jitted kernels, loaded for the current mode (compiled or interpreted):
    a file of this package by name, or any kernel file by path (benchmark experiments).

    Triton decides at decoration time whether a kernel is compiled or interpreted, so the
    module is loaded lazily, once per mode: a process can import this package before
    ``TRITON_INTERPRET=1`` is set and still run the interpreter on CPU tensors.
    """
    mode = _interpreting()
    mod = _MODULES.get((file, mode))
    if mod is None:
        if not mode:  # compiled kernels: Triton's own key kept across processes, its launchers loaded apart
            from plora.settings import settings

            from .launcher_modules import load_launchers_apart
            from .triton_key import remember_triton_key

            remember_triton_key(settings().cache_dir)
            load_launchers_apart()  # before any launcher is loaded: threads load them side by side
        name = f"{__package__}.{Path(file).stem}_{'interp' if mode else 'jit'}"
        path = Path(file) if Path(file).is_absolute() else Path(__file__).with_name(str(file))
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        _MODULES[(file, mode)] = mod
    return mod


@dataclass(frozen=True)
class TileConfig:
    """Tiles of one kernel: BT tokens × BH hidden columns per step, warps, pipeline depth.

    ``bt2``/``bh2`` are the tiles of the second kind of program of a "pair" launch.
    """

    bt: int = 64
    bh: int = 128
    warps: int = 4
    stages: int = 3
    waves: float = 2.0  # aim for at least waves × SMs programs per launch
    max_chunk: int = 0  # cap on tokens per program (0: whole segments when they fill the GPU)
    bt2: int = 64
    bh2: int = 128
    ystages: int = 0  # expand: software-pipeline the token loop, Y's loads included (0: off)
    hfirst: bool = False  # expand, wgrad: grid's first axis over hidden tiles (launch order by token range)
    tacc: bool = False  # dy band: accumulate dBᵀ (band × rank) instead of dB
    block: int = 0  # dy block: columns per block (a multiple of bh and bh2)


def _default_tiles(kind: str, rp: int) -> TileConfig:
    big = rp >= 128  # keep the float32 accumulators of large ranks in registers
    if kind == "shrink":
        return TileConfig(bt=64, bh=64 if big else 128, warps=8 if rp >= 64 else 4, stages=3)
    if kind == "expand":
        return TileConfig(bt=64, bh=64 if rp >= 256 else 128, warps=8 if big else 4, stages=3, waves=4.0)
    if kind == "wgrad":
        return TileConfig(bt=32 if rp >= 256 else 64, bh=64 if big else 128, warps=8 if rp >= 64 else 4, stages=3)
    if kind == "dy_band":  # waves: fall back to "pair" below waves × SMs programs
        return TileConfig(bt=32, bh=512 if rp <= 32 else 128, warps=8, stages=3, waves=1.0)
    if kind == "dy_pair":
        return TileConfig(bt=64, bh=64 if big else 128, bt2=32 if rp >= 256 else 64, bh2=64 if big else 128,
                          warps=8 if rp >= 64 else 4, stages=3)
    if kind == "dy_block":  # "pair"'s tiles, in blocks of 2048 columns
        return replace(_default_tiles("dy_pair", rp), block=2048)
    raise KeyError(kind)


#: Tiles per (kind, rank bucket), the tiles of launches past `LARGE_ELEMS` (where they differ)
#: and the dy side's mode per rank bucket — "band" (one pass over dy, float32 partial dS per
#: band), "pair" (one launch, the second read of dy partly from L2), "block" ("pair" in column
#: blocks whose dy stays in L2) or "split" (two launches, two passes) — for all launches,
#: those past `LARGE_ELEMS` and those within `SMALL_ELEMS`.
#: They are measurements, kept as data per GPU model in ``tiles/`` (`tile_tables`); the
#: sweeps behind them are in NOTES.md. Buckets not listed take `_default_tiles` and "pair".
#: The dicts are filled in place, so a benchmark that swaps them sees every later launch.
TILES: dict[tuple[str, int], TileConfig] = {}
TILES_LARGE: dict[tuple[str, int], TileConfig] = {}
DY_MODE: dict[int, str] = {}
DY_MODE_LARGE: dict[int, str] = {}
DY_MODE_SMALL: dict[int, str] = {}
_LOADED: list[Path] = []  # the table file now in the dicts


#: The dy side's modes and the kind whose tiles each launches with.
_DY_KINDS = {"pair": "dy_pair", "split": "wgrad", "band": "dy_band", "block": "dy_block"}


def _check_dy_mode(mode: str, where: object) -> None:
    if mode not in _DY_KINDS:
        raise ValueError(f"{where}: dy mode {mode!r} is not one of {', '.join(_DY_KINDS)}")


def use_tables(device_name: str | None = None) -> Path:
    """Load the tile tables of ``device_name`` (the default tables when it has none)."""
    t = load_tables(TileConfig, device_name)
    for table in (t.dy_mode, t.dy_mode_large, t.dy_mode_small):
        for mode in table.values():
            _check_dy_mode(mode, t.source)
    for table, value in ((TILES, t.tiles), (TILES_LARGE, t.large), (DY_MODE, t.dy_mode),
                         (DY_MODE_LARGE, t.dy_mode_large), (DY_MODE_SMALL, t.dy_mode_small)):
        table.clear()
        table.update(value)
    _LOADED[:] = [t.source]
    return t.source


def _tables_for(device: torch.device) -> None:
    """Take the tables of the GPU a launch runs on, where it has a file of its own."""
    if tables_path(torch.cuda.get_device_name(device)) != _LOADED[0]:
        use_tables(torch.cuda.get_device_name(device))


use_tables()

#: Launches of at most this many elements (bucket tokens × hidden) take `DY_MODE_SMALL`.
SMALL_ELEMS = 1 << 25
_DEFAULT_DY_MODE = "pair"

_OVERRIDES: list[dict] = []


@contextlib.contextmanager
def tile_overrides(tiles: dict | None = None, dy_mode: str | None = None):
    """Temporarily override tile fields for every bucket: ``{"shrink": {"bt": 32}, ...}``.

    Keys may also be ``(kind, bucket)``. ``dy_mode`` forces the backward's dy side.
    """
    if dy_mode is not None:
        _check_dy_mode(dy_mode, "tile_overrides")
    _OVERRIDES.append({"tiles": tiles or {}, "dy_mode": dy_mode})
    try:
        yield
    finally:
        _OVERRIDES.pop()


#: Launches over more than this many elements (bucket tokens × hidden size) take
#: `TILES_LARGE` where it has an entry: the best tile of a big launch (many programs per
#: SM slot, long streams) is not that of a small one (few programs, ramp and tail).
LARGE_ELEMS = 1 << 26


#: Kinds that take another kind's tiles where they have none of their own: the shrink of
#: dy (the dy side's "split" mode) is the forward's shrink on other operands.
_TILE_FALLBACK = {"dy_shrink": "shrink"}


def tiles_for(kind: str, rp: int, elems: int = 0) -> TileConfig:
    """Tiles of one launch of ``kind`` for bucket ``rp`` over ``elems`` elements."""
    kinds = (kind, _TILE_FALLBACK[kind]) if kind in _TILE_FALLBACK else (kind,)
    cfg = None
    for kd in kinds:
        cfg = cfg or (elems > LARGE_ELEMS and TILES_LARGE.get((kd, rp))) or TILES.get((kd, rp))
    cfg = cfg or _default_tiles(kinds[-1], rp)
    for ov in _OVERRIDES:
        for kd in reversed(kinds):
            for key in (kd, (kd, rp)):
                if key in ov["tiles"]:
                    cfg = replace(cfg, **ov["tiles"][key])
    return cfg


def dy_mode_for(rp: int, elems: int = 0) -> str:
    """The dy mode of bucket ``rp`` for a launch over ``elems`` elements (tokens × hidden)."""
    for ov in reversed(_OVERRIDES):
        if ov["dy_mode"]:
            return ov["dy_mode"]
    if elems > LARGE_ELEMS and rp in DY_MODE_LARGE:
        return DY_MODE_LARGE[rp]
    if elems <= SMALL_ELEMS and rp in DY_MODE_SMALL:
        return DY_MODE_SMALL[rp]
    return DY_MODE.get(rp, _DEFAULT_DY_MODE)


class _Collecting(threading.local):
    """Per thread: the lists that launches are collected into instead of running
    (`collecting`), innermost last."""

    def __init__(self) -> None:
        self.lists: list[list] = []


_COLLECTING = _Collecting()


def _launch(kernel, grid, *args, **kwargs) -> None:
    if _COLLECTING.lists:
        _COLLECTING.lists[-1].append((kernel, grid, args, kwargs))
        return
    kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def collecting():
    """In this thread, every kernel launch of the ops inside is recorded as ``(kernel, grid,
    args, kwargs)`` in the list this yields instead of launched, and nothing goes on a side
    stream: what a step would launch, with the same tiles, flags and arguments, for
    compiling its kernels ahead (`compile_ahead`). The torch operations between the
    launches (allocations, casts, sums) still run; the ops' outputs hold whatever their
    buffers held."""
    calls: list = []
    _COLLECTING.lists.append(calls)
    try:
        yield calls
    finally:
        _COLLECTING.lists.pop()


_SMS: dict[str, int] = {}


def _num_sms(device: torch.device) -> int:
    key = str(device)
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        if device.type == "cuda":  # every launch asks this first: once per device and process
            _tables_for(device)
    return _SMS[key]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _whole_segments(lengths: list[int], cfg: TileConfig) -> int:
    """Tokens per program that cover the longest segment (in BT steps), capped by ``max_chunk``."""
    ct = _cdiv(max(lengths, default=1), cfg.bt) * cfg.bt
    if cfg.max_chunk:
        ct = min(ct, max(cfg.bt, cfg.max_chunk // cfg.bt * cfg.bt))
    return ct


#: A launch whose segments are cut only to fill the GPU keeps them whole when it already has
#: this share of the programs it aims at: cutting sums the cuts' weight gradients with float32
#: atomics, a zero-fill and a cast, for a few more programs (K = 8 × 1024 tokens of a
#: 128-column tile at h = 2048 is 128 programs on 132 SMs).
FILL = 0.9


def _chunk_tokens(lengths: list[int], hidden_tiles: int, cfg: TileConfig, sms: int, fill: float = 1.0) -> int:
    """Tokens per program: whole segments if that gives ``fill`` of the programs the tiles aim
    at (``waves`` × SMs), else halve."""
    ct = _whole_segments(lengths, cfg)
    target = cfg.waves * sms * fill
    while ct > cfg.bt and sum(_cdiv(n, ct) for n in lengths) * hidden_tiles < target:
        ct = max(cfg.bt, _cdiv(ct // 2, cfg.bt) * cfg.bt)
    return ct


def _check(x: torch.Tensor, A: torch.Tensor, meta: LoRAMeta) -> None:
    if max(meta.ranks_host, default=0) > MAX_RANK:
        raise ValueError(f"Triton packed LoRA kernels take ranks up to {MAX_RANK}, got {max(meta.ranks_host)}")
    if x.shape[0] < meta.num_tokens:
        raise ValueError(f"x has {x.shape[0]} rows, the segments cover {meta.num_tokens}")
    if A.shape[0] != meta.total_rank:
        raise ValueError(f"stacked A/B have {A.shape[0]} rows, the ranks sum to {meta.total_rank}")


def _rowmajor(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_elems(meta: LoRAMeta, rp: int, d: int) -> int:
    """Elements (bucket tokens × hidden) of one launch: what picks its size class."""
    return sum(meta.bucket_tokens(rp)) * d


#: A shrink splits the hidden dimension (partial sums in a zeroed float32 buffer, cast once)
#: only from this hidden size up: below it each program's loop is short, and the zero-fill,
#: the atomics and the cast cost more than the programs it adds (H100, K = 8, rank 128:
#: h = 2048 134 -> 130 us, h = 3584 229 -> 217 us unsplit; h = 11008 627 split, 637 not).
SPLIT_MIN_HIDDEN = 4096


def _plan(meta: LoRAMeta, kind: str, rp: int, d: int, sms: int):
    """Tiles, schedule and grid of one launch; cached in the meta (once per step and shape)."""
    cfg = tiles_for(kind, rp, _launch_elems(meta, rp, d))
    return _cached(meta, ("plan", kind, rp, d, cfg), lambda: _build_plan(meta, kind, rp, d, sms, cfg))


def _build_plan(meta: LoRAMeta, kind: str, rp: int, d: int, sms: int, cfg: TileConfig):
    blocks = _cdiv(d, cfg.bh)
    if kind in ("shrink", "dy_shrink"):  # one BT-token tile per program; split the hidden dim to fill the GPU
        sched = meta.schedule(rp, cfg.bt)
        split = min(max(1, math.ceil(cfg.waves * sms / max(sched.n, 1))), max(1, blocks // 2))
        split = 1 if d < SPLIT_MIN_HIDDEN else split
        split_len = _cdiv(blocks, split) * cfg.bh
        plan = (cfg, sched, _cdiv(d, split_len), split_len)
    elif kind in ("dy_pair", "dy_block"):
        blocks2 = _cdiv(d, cfg.bh2)
        block_tiles = blocks2
        if kind == "dy_block":
            if cfg.block <= 0 or cfg.block % cfg.bh2 or cfg.block % cfg.bh:
                raise ValueError(f"dy block of {cfg.block} columns: needs a multiple of bh {cfg.bh} and bh2 {cfg.bh2}")
            block_tiles = min(cfg.block // cfg.bh2, max(blocks2, 1))
        planes = _cdiv(max(blocks2, 1), block_tiles)
        lengths = meta.bucket_tokens(rp)
        n_s = sum(_cdiv(n, cfg.bt) for n in lengths) * planes
        ct = _chunk_tokens(lengths, blocks2, replace(cfg, bt=cfg.bt2, waves=max(cfg.waves * sms - n_s, 0) / sms), sms)
        sched = meta.pair_schedule(rp, cfg.bt, ct, blocks2, block_tiles)
        # columns per kind-0 item, and how many blocks (float32 planes of dS parts) there are
        sum_sched = meta.schedule(rp, BAND_SUM_TOKENS) if planes > 1 else None
        plan = (cfg, sched, (block_tiles * cfg.bh2 if planes > 1 else d, planes), sum_sched)
    elif kind == "dy_band":  # whole segments (dB complete in one program), one band each
        sched = meta.schedule(rp, _whole_segments(meta.bucket_tokens(rp), cfg))
        plan = (cfg, sched, blocks, meta.schedule(rp, BAND_SUM_TOKENS))
    else:  # chunks of tokens per program, one hidden tile each (weight gradients: atomics if cut)
        fill = FILL if kind == "wgrad" else 1.0
        sched = meta.schedule(rp, _chunk_tokens(meta.bucket_tokens(rp), blocks, cfg, sms, fill))
        plan = (cfg, sched, blocks, 0)
    return plan


def _low_rank_buffer(meta: LoRAMeta, atomic: bool, dtype: torch.dtype, device) -> torch.Tensor:
    """S' or dS: in the compute dtype, or a zeroed float32 buffer when summed atomically."""
    if atomic:
        return torch.zeros(meta.s_numel, dtype=torch.float32, device=device)
    return torch.empty(meta.s_numel, dtype=dtype, device=device)


_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis


def _item_grid(cfg: TileConfig, sched, tiles: int) -> tuple[tuple[int, int], bool]:
    """Grid of a launch over (work items × hidden tiles) and whether it runs hidden tiles
    first (``cfg.hfirst``: neighbouring programs share one item), where the items fit
    on the grid's second axis."""
    hfirst = cfg.hfirst and sched.n <= _MAX_GRID_Y
    return ((tiles, sched.n) if hfirst else (sched.n, tiles)), hfirst


def _launch_shrink(k, X, W, S, meta, rp, plan, ieee):
    cfg, sched, nsplit, split_len = plan
    _launch(
        k.shrink_kernel, (sched.n, nsplit),
        X, W, S, sched.seg, sched.lo, sched.hi,
        meta.token_starts, meta.rank_starts, meta.ranks, meta.s_offsets, meta.scales,
        X.shape[1], X.stride(0), W.stride(0), split_len,
        BT=cfg.bt, BD=cfg.bh, RP=rp, ATOMIC=nsplit > 1, EVEN_D=X.shape[1] % cfg.bh == 0, IEEE=ieee,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )


def _launch_wgrad(k, P, X, DW, meta, rp, plan, ieee):
    cfg, sched, blocks, _ = plan
    grid, hfirst = _item_grid(cfg, sched, blocks)
    _launch(
        k.wgrad_kernel, grid,
        P, X, DW, sched.seg, sched.lo, sched.hi,
        meta.token_starts, meta.rank_starts, meta.ranks, meta.s_offsets,
        X.shape[1], X.stride(0), DW.stride(0),
        BT=cfg.bt, BD=cfg.bh, RP=rp, ATOMIC=sched.split, IEEE=ieee, HFIRST=hfirst,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )


def shrink_stage(X: torch.Tensor, W: torch.Tensor, meta: LoRAMeta) -> torch.Tensor:
    """scale · X_k W_kᵀ for every bucket, packed (the forward's S', or the backward's dS)."""
    k, sms, ieee = kernels_module(), _num_sms(X.device), X.dtype == torch.float32
    plans = {rp: _plan(meta, "shrink", rp, X.shape[1], sms) for rp in meta.buckets}
    S = _low_rank_buffer(meta, any(p[2] > 1 for p in plans.values()), X.dtype, X.device)
    for rp, plan in plans.items():
        _launch_shrink(k, X, W, S, meta, rp, plan, ieee)
    return S


def _launch_expand(k, S, W, Y, meta, rp, plan, accumulate, ieee):
    cfg, sched, blocks, _ = plan
    grid, hfirst = _item_grid(cfg, sched, blocks)
    _launch(
        k.expand_kernel, grid,
        S, W, Y, sched.seg, sched.lo, sched.hi,
        meta.token_starts, meta.rank_starts, meta.ranks, meta.s_offsets,
        Y.shape[1], Y.stride(0), W.stride(0),
        BT=cfg.bt, BN=cfg.bh, RP=rp, ACCUM=accumulate, IEEE=ieee, YS=cfg.ystages, HFIRST=hfirst,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )


def expand_stage(S: torch.Tensor, W: torch.Tensor, meta: LoRAMeta, Y: torch.Tensor, accumulate: bool = True) -> None:
    """Y_k (+)= S_k W_k for every bucket, in place (y += S' B, or dx += dS A)."""
    k, sms, ieee = kernels_module(), _num_sms(Y.device), Y.dtype == torch.float32
    for rp in meta.buckets:
        _launch_expand(k, S, W, Y, meta, rp, _plan(meta, "expand", rp, Y.shape[1], sms), accumulate, ieee)


#: Run the launches of different rank buckets on their own CUDA streams, so that one
#: bucket's tail overlaps the others' work (a pack of mixed ranks is one launch per bucket
#: and stage, each too small to fill the GPU to its end on its own).
BUCKET_STREAMS = True  # H200: mixed-rank packs 1.11-1.41x faster than on one stream (NOTES.md)
#: Run a bucket's independent backward launches side by side on streams of their own: dA
#: beside dx (both read only dS), and dB beside dS where they are two launches ("split").
#: Small launches are mostly ramp and tail; side by side, one's tail overlaps the other.
STAGE_STREAMS = True
#: "split" buckets: dB beside the bucket's whole dS -> (dA, dx) chain (else beside dS only).
DB_BESIDE_CHAIN = True
#: Launches of up to this many elements enqueue dx (two passes) before dA (one) when they
#: run side by side: what is enqueued first gets the SMs first, and the longer launch then
#: no longer runs alone at the end (H100, K = 8: h = 2048 rank 32 113.5 -> 99.3 us, rank 128
#: 118.7 -> 115.1; h = 3584 rank 32 181.7 -> 176.0). Larger ones keep dA first: their
#: "band" rank-32 launches lose 1% the other way round (h = 11008, K = 8: 525.8 -> 530.3).
DX_FIRST_ELEMS = 1 << 26
_POOL: dict[str, list] = {}
_BUSY: list[int] = []  # streams that the forks in progress run on


def _free_streams(device: torch.device, n: int, busy: set[int]) -> list:
    """``n`` streams of our own, none of them in ``busy``.

    torch hands out streams round-robin from a small pool, so a stream someone else made
    (a benchmark's, a graph capture's) can be one of ours: a fork onto the stream it forks
    from, or two concurrent chains on one stream, would run in series. So every fork takes
    streams that no fork in progress, and not the current stream, is using."""
    pool = _POOL.setdefault(str(device), [])
    free = [st for st in pool if st.cuda_stream not in busy]
    tries = 0
    while len(free) < n:
        st = torch.cuda.Stream(device)
        tries += 1
        if tries > 256:
            raise RuntimeError("no free CUDA stream for the packed LoRA kernels")
        if all(st.cuda_stream != q.cuda_stream for q in pool):
            pool.append(st)
            if st.cuda_stream not in busy:
                free.append(st)
    return free[:n]


def _fork(device: torch.device, fns, first_here: bool) -> None:
    """Run ``fns`` after what the current stream holds, each on a stream of its own (the
    first on the current one when ``first_here``); the current stream then waits for all.

    Everything the functions touch is allocated before and disjoint between them but for
    what they only read (rows of S'/dS, of A/B and their gradients, of y/dx); as the current
    stream waits for every side stream before returning, later work and frees come after."""
    main = torch.cuda.current_stream(device)
    outermost = not _BUSY
    busy = {*_BUSY, main.cuda_stream}
    sides = _free_streams(device, len(fns) - (1 if first_here else 0), busy)
    # a nested fork's streams stay taken until the outermost one returns: the chains of two
    # buckets are enqueued one after the other, but run at once
    _BUSY.extend(st.cuda_stream for st in sides)
    if outermost:
        _BUSY.append(main.cuda_stream)
    try:
        for st in sides:
            st.wait_stream(main)
        if first_here:
            fns[0]()
        for st, fn in zip(sides, fns[1:] if first_here else fns):
            with torch.cuda.stream(st):
                fn()
        for st in sides:
            main.wait_stream(st)
    finally:
        if outermost:
            _BUSY.clear()


def _streams_on(device: torch.device) -> bool:
    """Whether launches go on side streams at all: compiled kernels on a CUDA device, and
    not while launches are only collected (`collecting`)."""
    return device.type == "cuda" and not _COLLECTING.lists


def _each_bucket(meta: LoRAMeta, device: torch.device, chain) -> None:
    """``chain(rp)`` for every bucket: in order, or each on a stream of its own and joined."""
    rps = list(meta.buckets)
    if len(rps) <= 1 or not BUCKET_STREAMS or not _streams_on(device):
        for rp in rps:
            chain(rp)
        return
    _fork(device, [lambda rp=rp: chain(rp) for rp in rps], first_here=False)


def _side_by_side(device: torch.device, *fns) -> None:
    """``fns`` of one bucket's chain: the first on the current stream, the others on side
    streams (`STAGE_STREAMS`), or all in order."""
    if len(fns) <= 1 or not STAGE_STREAMS or not _streams_on(device):
        for fn in fns:
            fn()
        return
    _fork(device, fns, first_here=True)


class _GradBuffer:
    """Where a weight gradient is summed: the gradient itself, or a float32 buffer when
    some launch adds into it atomically and the gradient is not float32."""

    def __init__(self, like: torch.Tensor, atomic: bool, zero: bool):
        self.dtype = like.dtype
        if atomic and like.dtype != torch.float32:
            self.buf = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        else:
            self.buf = (torch.zeros if (atomic or zero) else torch.empty)(
                like.shape, dtype=like.dtype, device=like.device
            )

    def result(self) -> torch.Tensor:
        return self.buf if self.buf.dtype == self.dtype else self.buf.to(self.dtype)


def wgrad_stage(P: torch.Tensor, X: torch.Tensor, meta: LoRAMeta, like: torch.Tensor) -> torch.Tensor:
    """Σ over each segment's tokens of P_kᵀ X_k, stacked like ``like`` (dA = dSᵀ x, dB = S'ᵀ dy)."""
    k, sms, ieee = kernels_module(), _num_sms(X.device), X.dtype == torch.float32
    plans = {rp: _plan(meta, "wgrad", rp, X.shape[1], sms) for rp in meta.buckets}
    g = _GradBuffer(like, any(p[1].split for p in plans.values()), meta.has_empty_adapter)
    for rp, plan in plans.items():
        _launch_wgrad(k, P, X, g.buf, meta, rp, plan, ieee)
    return g.result()


def _write_then_read(
    meta: LoRAMeta, device: torch.device, buf: torch.Tensor, dtype: torch.dtype, write, read, chain=None
):
    """``write(rp)`` fills a packed low-rank buffer (S' or dS) for every bucket, then
    ``read(rp, buf)`` uses it; returns the buffer as read.

    Each bucket writes and reads only its own rows, so a bucket's write and read go in one
    chain (``chain(rp)`` when given, else the write then the read). A buffer summed
    atomically in float32 is instead written for every bucket, cast once to the compute
    dtype, and then read: its readers re-read it once per hidden tile, and in float32 that
    traffic doubles.
    """
    if buf.dtype == dtype:
        _each_bucket(meta, device, chain or (lambda rp: (write(rp), read(rp, buf))))
        return buf
    _each_bucket(meta, device, write)
    buf = buf.to(dtype)
    _each_bucket(meta, device, lambda rp: read(rp, buf))
    return buf


def _cached(meta: LoRAMeta, key: tuple, build):
    """A per-step plan of one op and layer shape, built once and reused by every layer of
    that shape (the host side of ~170 layers a step is what a small pack waits for). Under
    `tile_overrides` it is rebuilt: the key does not say which overrides made it."""
    return build() if _OVERRIDES else meta.cached(key, build)


def _forward_plans(meta: LoRAMeta, d_in: int, d_out: int, sms: int):
    def build():
        shrink = {rp: _plan(meta, "shrink", rp, d_in, sms) for rp in meta.buckets}
        expand = {rp: _plan(meta, "expand", rp, d_out, sms) for rp in meta.buckets}
        return shrink, expand, any(p[2] > 1 for p in shrink.values())

    return _cached(meta, ("forward", d_in, d_out, sms), build)


def lora_forward(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, meta: LoRAMeta, y: torch.Tensor) -> torch.Tensor:
    """Accumulate s_k (x_k A_kᵀ) B_k into ``y`` in place; return the packed S'.

    S' is returned (and kept for the backward) in the compute dtype, even when some shrink
    splits the hidden dimension and sums its parts in float32 (`_write_then_read`).
    """
    _check(x, A, meta)
    x, A, B = _rowmajor(x), _rowmajor(A), _rowmajor(B)
    k, sms, ieee = kernels_module(), _num_sms(x.device), x.dtype == torch.float32
    shrink, expand, atomic = _forward_plans(meta, x.shape[1], y.shape[1], sms)
    S = _low_rank_buffer(meta, atomic, x.dtype, x.device)
    return _write_then_read(
        meta, x.device, S, x.dtype,
        lambda rp: _launch_shrink(k, x, A, S, meta, rp, shrink[rp], ieee),
        lambda rp, S: _launch_expand(k, S, B, y, meta, rp, expand[rp], True, ieee),
    )


#: Tokens per program of the band planes' sum.
BAND_SUM_TOKENS = 64


#: "band" keeps a (band × rank) float32 dB in registers and writes 2·rank/band of dy's bytes
#: of partials: past this rank it loses to "pair" (2.5× slower at rank 128 on an H200).
BAND_MAX_RANK = 32


def _dy_mode(meta: LoRAMeta, rp: int, d_out: int, sms: int) -> str:
    """The bucket's dy mode; "band" only up to `BAND_MAX_RANK` and when its programs (whole
    segments × bands) fill the GPU, since it never splits a segment: few tokens go to "pair"."""
    mode = dy_mode_for(rp, _launch_elems(meta, rp, d_out))
    if mode == "band" and rp > BAND_MAX_RANK:
        return "pair"
    if mode == "band":
        cfg, sched, bands, _ = _plan(meta, "dy_band", rp, d_out, sms)
        if sched.n * bands < cfg.waves * sms:
            return "pair"
    return mode


def _dy_plans(meta: LoRAMeta, d_out: int, sms: int):
    modes = {rp: _dy_mode(meta, rp, d_out, sms) for rp in meta.buckets}
    plans = {rp: _plan(meta, _DY_KINDS[m], rp, d_out, sms) for rp, m in modes.items()}
    shrink = {rp: _plan(meta, "dy_shrink", rp, d_out, sms) for rp, m in modes.items() if m == "split"}
    atomic_ds = any(p[2] > 1 for p in shrink.values())  # a dy shrink split over hidden tiles sums into dS
    return modes, plans, shrink, atomic_ds, any(p[1].split for p in plans.values())


def _ds_planes(meta: LoRAMeta, planes: int, device) -> torch.Tensor:
    """One float32 plane of dS parts per band or column block ("band", "block")."""
    return torch.empty((planes, max(meta.s_numel, 1)), dtype=torch.float32, device=device)


def _launch_band_sum(k, P, dS, meta, rp, red, planes):
    _launch(
        k.band_sum_kernel, (red.n,),
        P, dS, red.seg, red.lo, red.hi, meta.token_starts, meta.rank_starts, meta.ranks, meta.s_offsets,
        planes, P.stride(0), BT=BAND_SUM_TOKENS, RP=rp, num_warps=4,
    )


def _launch_dy(k, dy, S, B, dS, dB, meta, rp, mode, plan, shrink_plan, ieee, then=None):
    """The dy side of one bucket; ``then()`` once dS is complete: in "split" mode beside
    dB (a launch of its own that needs only S' and dy), else after the dy side."""
    cfg, sched, blocks, red = plan
    d_out = dy.shape[1]
    if mode == "split":
        _side_by_side(
            dy.device,
            lambda: (_launch_shrink(k, dy, B, dS, meta, rp, shrink_plan, ieee), then and then()),
            lambda: _launch_wgrad(k, S, dy, dB, meta, rp, plan, ieee),
        )
        return
    if mode in ("pair", "block"):  # "block" of one block is "pair"
        cols, planes = blocks
        P = _ds_planes(meta, planes, dy.device) if planes > 1 else dS
        _launch(
            k.dy_pair_kernel, (sched.n,),
            dy, B, S, P, dB, sched.kind, sched.seg, sched.lo, sched.hi, sched.aux,
            meta.token_starts, meta.rank_starts, meta.ranks, meta.s_offsets, meta.scales,
            d_out, dy.stride(0), B.stride(0), dB.stride(0), cols, P.stride(0) if planes > 1 else 0,
            BT=cfg.bt, BN=cfg.bh, BT2=cfg.bt2, BN2=cfg.bh2, RP=rp,
            ATOMIC=sched.split, EVEN_N=d_out % cfg.bh == 0, IEEE=ieee,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )
        if planes > 1:
            _launch_band_sum(k, P, dS, meta, rp, red, planes)
    else:  # "band": the band kernel's dS parts in float32 planes, summed by a second launch
        P = _ds_planes(meta, blocks, dy.device)
        _launch(
            k.dy_band_kernel, (sched.n, blocks),
            dy, S, B, P, dB, sched.seg, sched.lo, sched.hi,
            meta.token_starts, meta.rank_starts, meta.ranks, meta.s_offsets, meta.scales,
            d_out, dy.stride(0), B.stride(0), dB.stride(0), P.stride(0),
            BT=cfg.bt, BN=cfg.bh, RP=rp, ATOMIC=sched.split, EVEN_N=d_out % cfg.bh == 0, IEEE=ieee, TACC=cfg.tacc,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )
        _launch_band_sum(k, P, dS, meta, rp, red, blocks)
    if then:
        then()


def dy_stage(dy: torch.Tensor, S: torch.Tensor, B: torch.Tensor, meta: LoRAMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """dS = s·dy Bᵀ (packed) and dB = S'ᵀ dy, per bucket as `dy_mode_for` says."""
    k, sms, ieee = kernels_module(), _num_sms(dy.device), dy.dtype == torch.float32
    modes, plans, shrink, atomic_ds, atomic_db = _dy_plans(meta, dy.shape[1], sms)
    dS = _low_rank_buffer(meta, atomic_ds, dy.dtype, dy.device)
    gB = _GradBuffer(B, atomic_db, meta.has_empty_adapter)
    for rp, mode in modes.items():
        _launch_dy(k, dy, S, B, dS, gB.buf, meta, rp, mode, plans[rp], shrink.get(rp), ieee)
    return dS, gB.result()


def x_stage(
    dS: torch.Tensor, x: torch.Tensor, A: torch.Tensor, meta: LoRAMeta, dx: torch.Tensor | None, accumulate: bool = True
) -> torch.Tensor:
    """dA = dSᵀ x (one pass over x) and, when ``dx`` is given, dx (+)= dS A (one over dx).

    The two share no operand but dS, so they are separate launches: a fused program that
    also streams dx needs so many registers that it loses more than the launch it saves.
    """
    dA = wgrad_stage(dS, x, meta, A)
    if dx is not None:
        expand_stage(dS, A, meta, dx, accumulate)
    return dA


def _backward_plans(meta: LoRAMeta, d_in: int, d_out: int, sms: int, need_dx: bool):
    def build():
        dy = _dy_plans(meta, d_out, sms)
        wgrad = {rp: _plan(meta, "wgrad", rp, d_in, sms) for rp in meta.buckets}
        expand = {rp: _plan(meta, "expand", rp, d_in, sms) for rp in meta.buckets} if need_dx else {}
        dx_first = {rp for rp in expand if _launch_elems(meta, rp, d_in) <= DX_FIRST_ELEMS}
        return (*dy, wgrad, expand, dx_first, any(p[1].split for p in wgrad.values()))

    return _cached(meta, ("backward", d_in, d_out, sms, need_dx), build)


def lora_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    S: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    meta: LoRAMeta,
    dx: torch.Tensor | None,
    need_dx: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """dA, dB and the LoRA part of dx (added into ``dx`` in place when given)."""
    _check(x, A, meta)
    dy, x, A, B = _rowmajor(dy), _rowmajor(x), _rowmajor(A), _rowmajor(B)
    k, sms, ieee = kernels_module(), _num_sms(x.device), x.dtype == torch.float32
    accumulate = dx is not None
    if need_dx and dx is None:
        dx = (torch.empty_like if meta.num_tokens == x.shape[0] else torch.zeros_like)(x)
    modes, plans, shrink, atomic_ds, atomic_db, wgrad, expand, dx_first, atomic_da = _backward_plans(
        meta, x.shape[1], dy.shape[1], sms, need_dx)
    dS = _low_rank_buffer(meta, atomic_ds, dy.dtype, dy.device)
    gB = _GradBuffer(B, atomic_db, meta.has_empty_adapter)
    gA = _GradBuffer(A, atomic_da, meta.has_empty_adapter)

    def x_side(rp: int, dS: torch.Tensor) -> None:
        fns = [lambda: _launch_wgrad(k, dS, x, gA.buf, meta, rp, wgrad[rp], ieee)]
        if need_dx:
            fns.append(lambda: _launch_expand(k, dS, A, dx, meta, rp, expand[rp], accumulate, ieee))
            if rp in dx_first:
                fns.reverse()
        _side_by_side(x.device, *fns)

    def dy_side(rp: int, then=None) -> None:
        _launch_dy(k, dy, S, B, dS, gB.buf, meta, rp, modes[rp], plans[rp], shrink.get(rp), ieee, then)

    def chain(rp: int) -> None:
        """One bucket's backward when no cast comes between dS and its readers. Where dB
        is a launch of its own ("split") it runs beside the whole dS -> (dA, dx) chain, not
        just beside dS (`DB_BESIDE_CHAIN`)."""
        if DB_BESIDE_CHAIN:
            dy_side(rp, then=lambda: x_side(rp, dS))
        else:
            dy_side(rp)
            x_side(rp, dS)

    _write_then_read(meta, x.device, dS, dy.dtype, dy_side, x_side, chain)
    return gA.result(), gB.result(), (dx if need_dx else None)
