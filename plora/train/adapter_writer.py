"""Writing leaving adapters' files while the pack trains on.

An adapter that leaves a pack is saved (PEFT format) and evaluated; its metrics.json, the
file that says it is finished, comes last. Writing sixteen rank-64 adapters of a 0.5B
model took a second on an H100 machine, a second in which the GPU did nothing. The job copies
the leaving adapters' rows on the device at once (their slots may be refilled at the next
step: `plora.train.packed.bank.BankSnapshot`), and the writer brings them to the host and
writes the files on one background thread, in the order asked: an adapter's
metrics.json is written after its weights, so a job killed mid-write leaves an adapter
without a result (trained again), never a result without its weights.

A tensor-parallel job writes in its own thread of control (gathering a shard is a
collective), and so does a job with ``background=False``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from plora.train.packed.peft_format import save_peft_adapter


def host_copy(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors copied to the host in one transfer per dtype (an adapter has a few
    hundred small tensors: one copy each cost the GPU a synchronisation each), as views of
    that private copy (the writing thread gives each its own storage, `_save`)."""
    out: dict[str, torch.Tensor] = {}
    by_dtype: dict[torch.dtype, list[str]] = {}
    for k, v in state.items():
        by_dtype.setdefault(v.dtype, []).append(k)
    for names in by_dtype.values():
        flat = torch.cat([state[k].detach().reshape(-1) for k in names]).to("cpu")
        start = 0
        for k in names:
            n = state[k].numel()
            out[k] = flat[start:start + n].view(state[k].shape)
            start += n
    return {k: out[k] for k in state}


def write_metrics(out: Path, row: Mapping[str, Any]) -> None:
    """An adapter's metrics.json, whole or not at all (written aside, then renamed)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "metrics.json.tmp"
    tmp.write_text(json.dumps(row, indent=2))
    tmp.replace(out / "metrics.json")


class AdapterWriter:
    """Adapters' checkpoints and metrics, written in the order asked; in the background
    when ``background``. `drain` waits for every write and raises the first that failed."""

    def __init__(self, background: bool):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-writer") if background else None
        self._pending: list[Future] = []
        self._unsaved: set[Path] = set()  # adapters whose save failed: no metrics.json for them
        #: per adapter saved: seconds bringing its weights to the host and writing its files,
        #: and when it was done (a job's summary says where its end went: `PhaseClock.writes`)
        self.times: list[dict[str, float]] = []

    def _do(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if self._pool is None:
            fn(*args, **kwargs)
            return
        self._pending = [f for f in self._pending if not f.done() or f.exception() is not None]
        self._pending.append(self._pool.submit(fn, *args, **kwargs))

    def save(self, out: Path, state: Mapping[str, torch.Tensor], info: Any, **peft: Any) -> Path:
        """Save an adapter's weights in the PEFT format to ``out`` (a host copy is taken now)."""
        return self.save_all([(out, state, peft)], info)[0]

    def save_all(self, items: list[tuple[Path, Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]],
                                         dict[str, Any]]], info: Any, *, on_host: bool = False) -> list[Path]:
        """`save` for several adapters (out, state, PEFT settings): every host copy is taken
        before the first write starts, so the copies do not wait on the writing thread.
        ``on_host``: the states are already a private copy, on the host or to be brought
        there by the writing thread (a callable giving the state: `BankSnapshot.state`)."""
        if self._pool is not None and not on_host:
            items = [(out, host_copy(state), peft) for out, state, peft in items]
        for out, state, peft in items:
            self._do(self._save, Path(out), state, info, peft)
        return [out for out, _, _ in items]

    def _save(self, out: Path, state: Mapping[str, torch.Tensor] | Callable[[], Mapping[str, torch.Tensor]],
              info: Any, peft: dict[str, Any]) -> None:
        try:
            t0 = time.perf_counter()
            if callable(state):  # a device snapshot: brought to the host here, while the pack trains on
                state = state()
            t1 = time.perf_counter()
            # views of one private host copy (`host_copy`, `LoRABank.host_states`) that do not
            # overlap: safetensors writes them as they are; a transposed one is made contiguous
            state = {k: v if v.is_cuda or v.is_contiguous() else v.contiguous() for k, v in state.items()}
            save_peft_adapter(out, state, info, **peft)
            self.times.append({"host_s": round(t1 - t0, 4), "file_s": round(time.perf_counter() - t1, 4),
                               "at": time.time()})
        except BaseException:
            self._unsaved.add(out)
            raise

    def metrics(self, out: Path, row: Mapping[str, Any]) -> None:
        """Write an adapter's metrics.json (after every save asked before it; never for an
        adapter whose save failed)."""
        self._do(self._metrics, Path(out), dict(row))

    def _metrics(self, out: Path, row: dict[str, Any]) -> None:
        if out not in self._unsaved:
            write_metrics(out, row)

    def drain(self) -> None:
        """Wait for every write asked so far; the first error one raised is raised here."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def close(self) -> None:
        """Finish the writes asked (errors are not raised: `drain` is where they are) and stop."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
