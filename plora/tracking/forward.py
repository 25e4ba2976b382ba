"""Forwarding finished adapters to the space file's trackers, from the sweep's process.

Why here and not in the job that trains them: a job already writes everything a tracker
shows (per-step ``metrics.jsonl``, ``evals.jsonl``, each adapter's ``metrics.json``), so the
sweep can forward it without a job importing TensorBoard or W&B (a job's start stays as
fast as it was, and a TP job needs no rule for which rank logs); a tracker that fails or
hangs cannot cost a job its training; one W&B run per adapter is one run open at a time in
the sweep's process, never K live runs in a packed job. An adapter is forwarded once it has
left its job (its metrics.json is written), as the sweep goes, on a thread of its own so
that a slow tracker never holds up the engine; the curve is then complete and final, so a
job's resumed or retried attempts are already sorted out (`plora.tracking.records`).

``<run>/tracked.jsonl`` lists what each tracker received, so a resumed sweep, or each batch
of ``plora tune``, forwards only what is new.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from plora.results.adapter_spans import read_jsonl
from plora.tracking.records import AdapterRecord, CurveReader, finished_adapters

if TYPE_CHECKING:
    from plora.spec.schema import SweepSpec

__all__ = ["Tracker", "trackers_for"]

#: what each tracker received (one line per adapter and tracker)
TRACKED_FILE = "tracked.jsonl"
#: seconds between two looks for adapters that finished (the engine ticks far more often)
POLL_EVERY_S = 2.0


class AdapterLogger(Protocol):
    name: str

    def log_adapter(self, record: AdapterRecord) -> None: ...


def trackers_for(spec: SweepSpec, run_dir: Path) -> list[AdapterLogger]:
    """The loggers the space file's ``logging`` section turns on."""
    out: list[AdapterLogger] = []
    if spec.logging.tensorboard:
        from plora.tracking.tensorboard_logger import TensorBoardLogger

        out.append(TensorBoardLogger(run_dir))
    if spec.logging.wandb is not None:
        from plora.tracking.wandb_logger import WandbLogger

        out.append(WandbLogger(run_dir, spec.logging.wandb.model_dump(), spec.name))
    return out


class Tracker:
    """Sends each adapter that finished to every logger, once. `poll` is cheap and never
    blocks (the engine calls it at each tick); `close` forwards what is left and waits."""

    def __init__(self, run_dir: Path, loggers: list[AdapterLogger]) -> None:
        self.run_dir = Path(run_dir)
        self.loggers = loggers
        self._reader = CurveReader(self.run_dir)
        self._sent: dict[str, set[str]] = {lg.name: set() for lg in loggers}
        for row in read_jsonl(self.run_dir / TRACKED_FILE):
            self._sent.setdefault(str(row.get("tracker")), set()).add(str(row.get("adapter")))
        self._queued: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plora-tracking") if loggers else None
        self._pending: list[Future] = []
        self._last_poll = 0.0
        self._warned: set[str] = set()

    @classmethod
    def for_spec(cls, spec: SweepSpec, run_dir: Path) -> Tracker:
        return cls(run_dir, trackers_for(spec, run_dir))

    def poll(self, adapter_ids: Iterable[str], *, now: bool = False) -> None:
        """Queue the adapters among ``adapter_ids`` that finished since the last look (at most
        every `POLL_EVERY_S` unless ``now``)."""
        if self._pool is None or (not now and time.monotonic() - self._last_poll < POLL_EVERY_S):
            return
        self._last_poll = time.monotonic()
        todo = [a for a in adapter_ids if a not in self._queued and any(a not in s for s in self._sent.values())]
        new = finished_adapters(self.run_dir, todo)
        if new:
            self._queued.update(new)
            self._pending.append(self._pool.submit(self._forward, new))

    def close(self, adapter_ids: Iterable[str] = ()) -> None:
        """Forward the adapters of ``adapter_ids`` that finished and are not sent yet, and wait
        for every forward."""
        if self._pool is None:
            return
        self.poll(adapter_ids, now=True)
        self._pool.shutdown(wait=True)
        self._pool = None

    def _forward(self, adapter_ids: list[str]) -> None:
        try:
            records = self._reader.records(adapter_ids)
        except Exception as e:  # noqa: BLE001 - a run directory being written; the sweep goes on
            for logger in self.loggers:
                self._warn(logger.name, f"{type(e).__name__}: {e}")
            return
        for logger in self.loggers:
            for record in records:
                if record.adapter_id in self._sent[logger.name]:
                    continue
                try:
                    logger.log_adapter(record)
                except Exception as e:  # noqa: BLE001 - a tracker never costs the sweep
                    self._warn(logger.name, f"{type(e).__name__}: {e}")
                    continue
                self._sent[logger.name].add(record.adapter_id)
                with open(self.run_dir / TRACKED_FILE, "a") as f:
                    f.write(json.dumps({"tracker": logger.name, "adapter": record.adapter_id}) + "\n")

    def _warn(self, tracker: str, problem: str) -> None:
        if tracker not in self._warned:  # once per tracker: the same cause fails every adapter
            self._warned.add(tracker)
            warnings.warn(f"{tracker}: an adapter was not logged ({problem}); the sweep goes on",
                          RuntimeWarning, stacklevel=2)
