"""Rich renderings of a sweep: the live view while it runs, and `plora status` after.

Library code that only builds rich renderables; the CLI decides where they go.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console, ConsoleDimensions, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

#: Width of output that is not a terminal (a log file, CI): wide enough that no table is
#: cut, so adapter ids stay whole and can be found on disk.
LOG_WIDTH = 4096


class PlainWidthConsole(Console):
    """A rich console that, when its output is not a terminal and COLUMNS is not set, does
    not wrap or cut at 80 columns: a log is read with a pager or grep, not a window."""

    @property
    def size(self) -> ConsoleDimensions:
        dims = super().size
        if self._width is None and not self.is_terminal:
            return ConsoleDimensions(LOG_WIDTH, dims.height)
        return dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


def new_events(seen: list[str], events: list[str]) -> list[str]:
    """The events of `events` not yet in `seen`: the engine keeps a sliding window of its
    latest notes, so the new ones are what follows the longest overlap of the two."""
    for k in range(min(len(seen), len(events)), 0, -1):
        if seen[-k:] == events[:k]:
            return events[k:]
    return list(events)


class EventLog:
    """Progress for output that is not a terminal: each engine event (a job started,
    finished, retried...) as its own line, and a line whenever more adapters finish. A
    live view there would print only its last frame, without the events before it."""

    def __init__(self, console: Console, total_adapters: Callable[[Any], int]) -> None:
        self.console = console
        self.total_adapters = total_adapters
        self.seen: list[str] = []
        self.finished = -1

    def __call__(self, snapshot: Any) -> None:
        for event in new_events(self.seen, list(snapshot.events)):
            self.console.print(event, highlight=False, markup=False)
        self.seen = list(snapshot.events)
        counts = snapshot.adapter_status
        finished = sum(counts.get(k, 0) for k in ("done", "diverged", "pruned", "failed"))
        if finished != self.finished and (finished or self.finished >= 0):
            self.console.print(f"adapters {finished}/{self.total_adapters(snapshot)} finished "
                               f"(done {counts.get('done', 0)}, diverged {counts.get('diverged', 0)}, "
                               f"failed {counts.get('failed', 0)})", highlight=False)
        self.finished = finished
        self.console.file.flush()


@contextlib.contextmanager
def progress(console: Console, total_adapters: Callable[[Any], int], *,
             transient: bool = False) -> Iterator[Callable[[Any], None]]:
    """A snapshot callback for the engine: a live view on a terminal, an event log
    otherwise. On exit (also on Ctrl-C) the output ends with a full line."""
    try:
        if console.is_terminal:
            with Live(console=console, refresh_per_second=4, transient=transient) as live:
                yield lambda snap: live.update(live_view(snap, total_adapters(snap)))
        else:
            yield EventLog(console, total_adapters)
    finally:
        console.file.flush()


def _fmt_s(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return "—"
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def live_view(snapshot, total_adapters: int) -> Group:
    """Running jobs with their progress and ETA, adapters done, predicted vs actual makespan."""
    jobs = Table(title="running jobs", title_justify="left", expand=False)
    for col, just in (("job", "left"), ("GPUs / slots", "left"), ("adapters", "right"), ("adapter steps", "right"),
                      ("done", "right"), ("elapsed", "right"), ("ETA", "right")):
        jobs.add_column(col, justify=just)
    for rj in snapshot.running:
        p = rj.proc.progress()
        done, total = p.get("adapter_steps_done", 0), p.get("adapter_steps_total") or 0
        elapsed = p.get("elapsed_s")
        eta = elapsed * (total - done) / done if elapsed and done else None
        jobs.add_row(rj.job.job_id, ",".join(rj.slots), str(len(rj.job.adapters)),
                     f"{done}/{total}" if total else "starting", f"{p.get('adapters_finished', 0)}",
                     _fmt_s(elapsed), _fmt_s(eta))
    counts = snapshot.adapter_status
    finished = sum(counts.get(k, 0) for k in ("done", "diverged", "pruned", "failed"))
    line = Text.assemble(
        ("adapters ", "bold"), f"{finished}/{total_adapters} finished",
        f" (done {counts.get('done', 0)}, diverged {counts.get('diverged', 0)}, failed {counts.get('failed', 0)})",
        "   ", ("jobs ", "bold"), f"{len(snapshot.running)} running, {len(snapshot.queued)} queued",
        "   ", ("makespan ", "bold"), f"{_fmt_s(snapshot.elapsed_s)} so far",
        f" / {_fmt_s(snapshot.predicted_makespan_s)} predicted" if snapshot.predicted_makespan_s else "",
    )
    parts = [line]
    if snapshot.running:
        parts.append(jobs)
    for note in snapshot.events[-3:]:
        parts.append(Text(note, style="dim"))
    return Group(*parts)


def status_tables(run_dir: Path) -> list:
    """Where a sweep stands, from its journal (works while it runs, and after)."""
    from plora.engine.journal import Journal

    journal = Journal(run_dir / "journal.sqlite")
    try:
        jobs, adapters = journal.jobs(), journal.adapters()
    finally:
        journal.close()
    counts: dict[str, int] = {}
    for a in adapters:
        counts[a["status"]] = counts.get(a["status"], 0) + 1
    summary = Text.assemble(("adapters: ", "bold"), ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none")
    t = Table(title=f"jobs of {run_dir.name}", title_justify="left")
    for col in ("job", "status", "adapters", "TP", "GPUs", "attempt", "resumed at", "wall time", "exit"):
        t.add_column(col)
    for j in jobs:
        wall = (j.ended or 0) - j.started if j.started and j.ended else None
        t.add_row(j.id, j.status, str(len(j.adapters)), str(j.tp), ",".join(map(str, j.gpus)) or "—",
                  str(j.attempt), _resumed_at(run_dir / "jobs" / j.id), _fmt_s(wall),
                  "" if j.returncode is None else str(j.returncode))
    return [summary, t]


def _resumed_at(job_dir: Path) -> str:
    """The step a job's latest attempt resumed from its checkpoint ("—": from the start)."""
    import json

    try:
        step = json.loads((job_dir / "progress.json").read_text()).get("resumed_step")
    except (OSError, ValueError):
        return "—"
    return f"step {step}" if step is not None else "—"
