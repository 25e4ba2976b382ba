"""A process that compiles a sweep's likely Triton kernels while the sweep plans.

The first job of a sweep on a machine whose Triton cache is empty compiles its step's
kernels before its first step (`plora.kernels.compile_ahead`), seconds with the GPU idle. A
sweep on a local GPU starts `plora.kernels.warm_cache` next to its first spare: it imports
torch and the kernels while the sweep checks its data, and once the sweep has decided its
rows (`order`) it is told the packs the sweep expects (its adapters, as many as a job takes,
with the tokens each puts in a step) and compiles their steps' kernels into Triton's cache,
where the first job then finds them. A wrong guess costs nothing but the compile: the job
compiles whatever it still misses, as before. The process takes the first job's GPU and
environment, dies with the sweep, and exits once done; ``PLORA_SPARE_JOBS=0`` (no processes
started ahead) or ``PLORA_COMPILE_THREADS=0`` turns it off.
"""

from __future__ import annotations

import atexit
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from plora.engine.job_env import job_env
from plora.engine.spare import module_child
from plora.settings import settings, triton_interpreted

__all__ = ["WARMER_MODULE", "discard", "eval_packs", "expected_packs", "order", "order_for_sweep", "running", "start",
           "told", "wanted"]

#: the child (`plora.kernels.warm_cache`), with the sweep's working folder left off its path
WARMER_MODULE = "plora.kernels.warm_cache"
CHILD = module_child(WARMER_MODULE)

_proc: subprocess.Popen | None = None
#: the size of the log when the process started: its answer is written past it
_log_offset = 0
#: the order the process was given (`order`), for the first job's process to load the same
#: kernels once they are compiled (`told`)
_told: Any = None


def wanted(device: str) -> bool:
    """Whether a sweep on ``device`` would compile Triton kernels in its jobs and may start
    processes ahead of them: a GPU, the Triton backend, not Triton's interpreter."""
    s = settings()
    if device == "cpu" or not s.spare_jobs or s.compile_threads == 0 or s.kernels == "torch" or triton_interpreted():
        return False
    from plora.engine.spare import first_gpus

    return bool(first_gpus(device))


def start(device: str) -> bool:
    """Start the process for a sweep on ``device`` (its imports begin now); whether it started."""
    global _proc
    if _proc is not None or not wanted(device):
        return _proc is not None
    from plora.engine.spare import child_setup, first_gpus

    global _log_offset, _told
    env = job_env(first_gpus(device))
    _told = None
    try:
        log_path().parent.mkdir(parents=True, exist_ok=True)
        _log_offset = log_path().stat().st_size if log_path().is_file() else 0
        with open(log_path(), "ab") as log:
            _proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=log,
                                     stderr=subprocess.DEVNULL, env=env, start_new_session=True,
                                     preexec_fn=child_setup(env))
    except OSError:  # no process to spare: the first job compiles its kernels itself
        _proc = None
    return _proc is not None


def log_path() -> Path:
    """Where the process says it is ready and what it compiled (`WarmAnswer` lines), in
    plora's cache."""
    return settings().cache_dir / "kernel-warmer.log"


def running() -> bool:
    return _proc is not None and _proc.poll() is None


def expected_packs(configs: Sequence[Any], *, row_tokens: float, max_adapters: int,
                   micro_batch: Mapping[str, int] | int | None = None, eval_load: Any = None) -> list[dict]:
    """The packs a sweep of ``configs`` likely steps first: its adapters in plan order (as
    many as a job takes), each with ``row_tokens`` per row of its (micro-)batch, rounded up
    as a graphed step's segments are (`plora.data.row_layout.round_up`); then the pack
    left when the adapters of the largest batch have finished. With ``eval_load``
    (`plora.cost.job.EvalLoad`), also the forwards of their evals (`eval_packs`)."""
    from plora.data.row_layout import round_up

    def rows(c) -> int:
        m = micro_batch.get(c.id) if isinstance(micro_batch, Mapping) else micro_batch
        return min(int(c.batch_size), int(m)) if m else int(c.batch_size)

    first = list(configs)[: max(1, int(max_adapters))]
    if not first:
        return []
    per = {c.id: round_up(int(rows(c) * row_tokens)) for c in first}
    packs = [{"tokens": [per[c.id] for c in first], "ranks": [int(c.rank) for c in first]}]
    biggest = max(int(c.batch_size) for c in first)
    rest = [c for c in first if int(c.batch_size) < biggest]  # steps per epoch: the larger batches finish first
    if rest and len(rest) < len(first):
        packs.append({"tokens": [per[c.id] for c in rest], "ranks": [int(c.rank) for c in rest]})
    if eval_load is not None:
        packs += eval_packs(first, eval_load)
    return packs


def eval_packs(configs: Sequence[Any], load: Any) -> list[dict]:
    """The forwards of the evals of ``configs`` as `plora.results.evaluate` makes them: the
    adapters that finish together (one batch size) are scored together, as many per forward
    as ``load.batch_rows`` rows hold of their ``load.samples`` rows each, every adapter over
    all of them (the rows flattened: its segment is their tokens). Where a metric decodes
    answers, also the prompts' forward and a decoding step's (one token per row)."""
    n = int(load.samples)
    if n <= 0:
        return []
    each = [int(round(n * float(load.row_tokens)))]
    if int(load.max_new_tokens) > 0:
        each += [int(round(n * float(load.prompt_tokens))), n]
    out: list[dict] = []
    for size in sorted({int(c.batch_size) for c in configs}, reverse=True):  # the order they finish in
        group = [int(c.rank) for c in configs if int(c.batch_size) == size]
        per = max(1, min(len(group), int(load.batch_rows) // n))
        for ranks in dict.fromkeys(tuple(group[i:i + per]) for i in range(0, len(group), per)):
            out += [{"tokens": [t] * len(ranks), "ranks": list(ranks), "backward": False} for t in each if t > 0]
    return out


def order(*, dtype: str, shapes: Sequence[tuple[int, int]], packs: Sequence[dict], accumulate_dx: bool = True,
          vocab: int | None = None) -> bool:
    """Tell the started process what to compile (one line; it exits when done), with the
    loss's kernel for ``vocab`` columns where given. Whether it was told."""
    if not running() or not packs or not shapes:
        discard()
        return False
    from plora.job.warm_order import WarmOrder

    global _told
    warm = WarmOrder(dtype=dtype, shapes=[tuple(s) for s in shapes], packs=list(packs),
                     accumulate_dx=accumulate_dx, vocab=vocab)
    try:
        assert _proc is not None and _proc.stdin is not None
        _proc.stdin.write((warm.model_dump_json() + "\n").encode())
        _proc.stdin.close()
    except (OSError, ValueError):
        discard()
        return False
    _told = warm
    return True


def told() -> tuple[Any, Path, int] | None:
    """What the process was told to compile (a `WarmOrder`), the log it answers in and the
    offset its answer comes past; None where it was told nothing."""
    if _told is None:
        return None
    return _told, log_path(), _log_offset


def order_for_sweep(spec: Any, configs: Sequence[Any], *, layout: str, lengths: list[int] | None,
                    length_buckets: int | str, graphed: bool, eval_load: Any = None) -> bool:
    """`order` what a sweep of ``spec`` is expected to step first, once its rows are decided
    (`plora.sweep.SweepRows`): its first `max_adapters_per_job` configurations in plan
    order, each row priced as its steps will lay it out (`plora.data.row_layout`), over the
    model's targeted linears, and their evals' forwards where ``eval_load`` says what they
    score (`eval_packs`). Whether the process was told (never raises: nothing here may stop
    a sweep)."""
    if not running():
        return False
    try:
        from plora.cost.profiling.cache import shape_from_model
        from plora.data.row_layout import priced_row_tokens
        from plora.models.families.targets import resolve_lora_targets

        m = spec.model
        if m.quantize:  # a 4-bit base: its first job's kernels are left to that job
            discard()
            return False
        shape = shape_from_model(m.resolved_path(), m.family, m.dtype, m.quantize)
        dims = shape.linear_dims()
        shapes = sorted({dims[t] for t in resolve_lora_targets(spec.lora.targets) if t in dims})
        row_tokens = (priced_row_tokens(layout, graphed=graphed, lengths=lengths, max_seq_len=m.max_seq_len,
                                        length_buckets=length_buckets) if lengths else float(m.max_seq_len))
        packs = expected_packs(configs, row_tokens=row_tokens, max_adapters=spec.planner.max_adapters_per_job,
                               micro_batch=spec.training.micro_batch_size, eval_load=eval_load)
        no_dropout = all(not spec.settings(c).get("dropout") for c in configs)
        return order(dtype=m.dtype, shapes=shapes, packs=packs, accumulate_dx=no_dropout, vocab=shape.vocab)
    except Exception:  # noqa: BLE001 - a guess that fails costs the first job its compile, as before
        discard()
        return False


def discard() -> None:
    """Stop the process if it is still there (a sweep that ends, or needs it no more)."""
    global _proc, _told
    proc, _proc, _told = _proc, None, None
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.kill()
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        pass


atexit.register(discard)
