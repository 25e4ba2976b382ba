"""Where a job's wall time goes besides its training steps, as the job itself sees it.

A job's optimizer steps are what the profiler's in-process probes measure; a real job also
pays its process start, the model load, its set-up, the first step's one-time costs, a graph
capture whenever the pack changes to a composition it holds no graph for, and the eval and
checkpoint of every adapter that leaves.
The recipe records each of these (`PhaseClock`) into its summary.json under ``phases``; the
cost model's job terms are fitted from them (`plora.cost.job.fit_overheads`).

No torch at import: the clock is created before anything heavy runs, and tests read the
summaries it writes without a model.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from plora.settings import HANDED_AT, settings

__all__ = ["PhaseClock", "device_footprint", "outside_allocator", "process_started_at", "read_phases"]


def process_started_at() -> float | None:
    """When this process became its job (``time.time()`` scale), or None where unknown: its
    creation, or for a process started ahead (`plora.engine.spare`) when the job was launched."""
    handed = settings().handed_at
    if handed is not None:
        return handed
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - no psutil, or no /proc: the start term goes unmeasured
        return None


#: a process started ahead of its job (`plora.train.spare`): when it was created, when its
#: imports were done (it said ready), when it had loaded the model it was told of; its job's
#: summary keeps them, to show whether the job waited for the spare's imports
SPARE_MOMENTS: dict[str, Any] = {}

#: where this process first imported ``torch._dynamo`` (`watch_dynamo_import`): the two
#: frames that imported it and plora's innermost frame then
DYNAMO_IMPORTED_BY: list[str] = []


class _DynamoWatch:
    """A finder first on ``sys.meta_path`` that finds nothing itself: it looks at the name of
    each module not imported yet, and notes who asks for ``torch._dynamo`` first."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch._dynamo" and not DYNAMO_IMPORTED_BY:
            frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename]
            ours = [f for f in frames if "/plora/" in f.filename and "phases.py" not in f.filename]
            where = [f"{f.filename}:{f.lineno} ({f.name})" for f in (frames[-2:][::-1] + ours[-1:])]
            DYNAMO_IMPORTED_BY.append(" via ".join(dict.fromkeys(where)) or "?")
        return None


def watch_dynamo_import() -> None:
    """Note who first imports ``torch._dynamo`` in this process (a job's summary says;
    seconds of a job's start on the GPU machines)."""
    if _DynamoWatch not in sys.meta_path:
        sys.meta_path.insert(0, _DynamoWatch)


class _EvalEvent:
    """One packed eval of adapters leaving together (or due an intermediate eval)."""

    def __init__(self, clock: "PhaseClock", adapters: int, max_new_tokens: int, device: Any,
                 samples: int | None = None, batch_rows: int | None = None):
        self.clock, self.adapters, self.max_new_tokens = clock, adapters, max_new_tokens
        self.batch_rows = batch_rows
        self.samples = clock.eval_rows if samples is None else int(samples)
        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.device = device
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(device)
        self.t0 = time.perf_counter()

    def done(self, release: bool = True) -> None:
        """The eval has finished (on a GPU, once its work is done); ``release``: the memory
        its batches left cached goes back to the device (not after a job's last eval, when
        nothing trains after it: giving gigabytes back costs its end time)."""
        row: dict[str, Any] = {"adapters": self.adapters, "samples": self.samples,
                               "max_new_tokens": self.max_new_tokens,
                               "seconds": time.perf_counter() - self.t0}
        if self.batch_rows is not None:  # what the cost model's fit counts the forwards by
            row["batch_rows"] = int(self.batch_rows)
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.device)
            row["seconds"] = time.perf_counter() - self.t0
            row["peak_reserved"] = float(torch.cuda.max_memory_reserved(self.device))
            if release:
                # the eval's batches (up to 2048 rows on a GPU) are not the next pack's: its
                # footprint, which the memory calibration reads, starts from what training holds
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        row["at"] = time.time()  # when it ended (where a job's end goes: its summary)
        self.clock.evals.append(row)


class PhaseClock:
    """Times a job's phases; `to_dict` is what summary.json keeps under ``phases``."""

    def __init__(self) -> None:
        self.t0 = time.time()
        created = process_started_at()
        self.created_at = created
        self.start_s = max(0.0, self.t0 - created) if created is not None else None
        #: whether this process was started ahead of its job (`plora.engine.spare`)
        self.spare = bool(os.environ.get(HANDED_AT))
        self.load_s = 0.0
        self.setup_s = 0.0
        #: when each part of the set-up was done, seconds from the clock's start (where a first
        #: use of a machine spends its extra set-up time)
        self.setup_parts: dict[str, float] = {}
        self.eval_base_s = 0.0
        #: whether the base model's scores came from an earlier job's (`plora.train.base_scores`)
        self.base_scores_remembered = False
        self.eval_rows = 0
        self.eval_row_tokens = 0.0
        self.eval_prompt_tokens = 0.0
        #: one per pack composition, in order: adapters in it, steps, first step's and the others'
        #: seconds, and ``reused`` where its first step replayed a graph already held (no capture)
        self.phases: list[dict[str, Any]] = []
        #: what the job's steps did with CUDA graphs (`plora.train.step_graph.GraphCounts`), or None
        self.graphs: dict[str, int] | None = None
        #: steps whose rows were laid out ahead and ``used``, or ``given_back`` (`plora.train.packed_step`)
        self.rows_ahead: dict[str, int] | None = None
        self._pack: tuple | None = None
        self.evals: list[dict[str, Any]] = []
        self.saves: list[dict[str, Any]] = []
        #: the adapter writer's, per adapter (`plora.train.adapter_writer.AdapterWriter.times`)
        self.writes: list[dict[str, float]] = []

    def loaded(self, seconds: float) -> None:
        self.load_s = float(seconds)

    def part_done(self, name: str) -> None:
        """One part of the set-up is done (`setup_parts`)."""
        self.setup_parts[name] = round(time.time() - self.t0, 4)

    def set_up(self, eval_samples: Sequence[Any]) -> None:
        """The job is ready to train; its eval rows are known (their size prices each eval)."""
        self.setup_s = max(0.0, time.time() - self.t0 - self.load_s)
        n = len(eval_samples)
        self.eval_rows = n
        if n:
            self.eval_row_tokens = sum(len(s.tokens) for s in eval_samples) / n
            self.eval_prompt_tokens = sum(sum(1 for x in s.labels if x < 0) for s in eval_samples) / n

    def step(self, pack: Sequence[int], seconds: float, reused: bool = False, *,
             ranks: Sequence[int] | None = None, rows: Sequence[int] | None = None, tokens: int | None = None,
             device: Any = None) -> None:
        """One step of the adapters in ``pack``; ``reused``: it replayed a graph already held.

        ``ranks`` and ``rows`` (per adapter of the pack) and ``tokens`` (what the step ran,
        padding included) let a sweep calibrate its cost model from the job while it runs
        (`plora.cost.profiling.calibrate`): each phase keeps its pack, the tokens of its steady
        steps, and, on a GPU, the job's device footprint once it has run a steady step."""
        # a slot refilled by another adapter (another rank or batch size) is another pack
        key = (tuple(pack), tuple(ranks or ()), tuple(rows or ()))
        if key != self._pack:
            self._pack = key
            phase: dict[str, Any] = {"adapters": len(pack), "steps": 1, "first_s": float(seconds), "rest_s": 0.0}
            if reused:  # no eager step, no capture: not a sample of what a new composition costs
                phase["reused"] = True
            if ranks is not None and rows is not None:
                phase["ranks"] = [int(r) for r in ranks]
                phase["rows"] = [int(n) for n in rows]
                phase["rest_tokens"] = 0
                if tokens is not None and sum(rows) > 0:
                    phase["max_row_tokens"] = tokens / sum(rows)
            self.phases.append(phase)
            return
        phase = self.phases[-1]
        phase["steps"] += 1
        phase["rest_s"] += float(seconds)
        phase["last_at"] = time.time()  # its last step's end so far (where a job's end goes)
        wider = False
        if tokens is not None and "rest_tokens" in phase:
            phase["rest_tokens"] += int(tokens)
            row_tokens = tokens / max(1, sum(phase["rows"]))
            wider = row_tokens > phase.get("max_row_tokens", 0.0)
            phase["max_row_tokens"] = max(phase.get("max_row_tokens", 0.0), row_tokens)
        if "ranks" in phase and ("device_bytes" not in phase or wider):
            # after a steady step (the first also holds what a capture or compilation left), and
            # again whenever wider rows came: the footprint at the phase's widest rows
            footprint = device_footprint(device)
            if footprint is not None:
                phase["device_bytes"] = footprint

    def eval_event(self, adapters: int, max_new_tokens: int, device: Any, samples: int | None = None,
                   batch_rows: int | None = None) -> _EvalEvent:
        """Start timing one eval of ``adapters`` adapters (``max_new_tokens`` 0: no generation)
        on ``samples`` eval rows (default: the whole eval set); call ``done()`` on the result
        when it has finished."""
        return _EvalEvent(self, adapters, max_new_tokens, device, samples, batch_rows)

    def saved(self, adapters: int, seconds: float) -> None:
        self.saves.append({"adapters": int(adapters), "seconds": float(seconds)})

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, name, getattr(self, name) + time.perf_counter() - t)

    def to_dict(self) -> dict[str, Any]:
        return {
            "created_at": self.created_at,
            "clock_at": self.t0,
            "start_s": self.start_s,
            "spare": self.spare,
            "load_s": self.load_s,
            "setup_s": self.setup_s,
            "setup_parts": self.setup_parts,
            "eval_base_s": self.eval_base_s,
            "base_scores_remembered": self.base_scores_remembered,
            "eval_rows": self.eval_rows,
            "eval_row_tokens": self.eval_row_tokens,
            "eval_prompt_tokens": self.eval_prompt_tokens,
            "phases": self.phases,
            "evals": self.evals,
            "saves": self.saves,
            "writes": self.writes,
            "graphs": self.graphs,
            "rows_ahead": self.rows_ahead,
            "compiled_ahead": _compiled_ahead(),
            "spare_moments": dict(SPARE_MOMENTS),
            # whether anything in the job imported torch's compiler front end (seconds of a
            # start that a spare's imports avoid: `plora.models.torchtune_imports`)
            "torch_dynamo_imported": "torch._dynamo" in sys.modules,
            "torch_dynamo_imported_by": DYNAMO_IMPORTED_BY[0] if DYNAMO_IMPORTED_BY else None,
            "finished_at": time.time(),
        }


def _compiled_ahead() -> dict[str, Any]:
    """What this process compiled ahead of its launches (`plora.kernels.compile_ahead`)."""
    from plora.kernels.compile_ahead import COMPILED

    return COMPILED.to_dict()


def device_footprint(device: Any) -> float | None:
    """What this process holds on its GPU: the caching allocator's reserved peak plus what
    lies outside it (`outside_allocator`), as the profiler's probes measure a pack
    (`plora.cost.profiling.measure`). None off a GPU."""
    if getattr(device, "type", str(device)) != "cuda":
        return None
    import torch

    return float(torch.cuda.max_memory_reserved(device)) + outside_allocator(device)


def outside_allocator(device: Any) -> float:
    """Bytes in use on the GPU beside the caching allocator's reserved blocks: the CUDA
    context and loaded kernels (and whatever other processes hold there)."""
    import torch

    free, whole = torch.cuda.mem_get_info(device)
    return float(max(0, (whole - free) - torch.cuda.memory_reserved(device)))


def read_phases(job_dir: Any, exited_at: float | None = None) -> dict[str, Any] | None:
    """The ``phases`` a finished job wrote to its summary.json (with ``exited_at`` when given),
    or None when it wrote none."""
    from plora.job.outputs import read_summary

    phases = (read_summary(job_dir) or {}).get("phases")
    if not isinstance(phases, dict):
        return None
    return {**phases, **({"exited_at": float(exited_at)} if exited_at is not None else {})}
