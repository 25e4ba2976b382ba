"""Every adapter weight of a packed model in one flat buffer, and the optimizer over it.

After injection (and tensor-parallel sharding, which changes the local shapes), `LoRABank`
moves each layer's stacked ``a_all``/``bt_all`` into one flat weight buffer and points
their ``.grad`` at views of one flat gradient buffer: autograd then accumulates every
layer's gradient in place there, zeroing is one fill, and the per-adapter norms and AdamW
step are one launch each over the whole pack (`plora.kernels.segments`), not one per
adapter, layer and tensor. Adapter k owns rows ``row_starts[k]:row_starts[k+1]`` of every
stacked tensor: 2 × layers contiguous ranges of the buffer.

`PackedAdamW` is AdamW with one learning rate, step count, clipping coefficient and
"steps now or not" per adapter; its moments are float32 (float64 for float64 weights)
whatever the weight dtype.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Sequence

import torch
from torch import nn

from plora.kernels import adamw_hyperparams, build_segments, segment_sq_norms, segmented_adamw_
from plora.kernels.segments import HP_COLUMNS
from plora.train.cuda_capture import CAPTURE_LOCK
from plora.train.packed.inject import PackedModel

#: the stacked trainable tensors of a packed layer, in bank order
STACKED = ("a_all", "bt_all")


#: bytes of the pinned buffer a snapshot's host copy goes through, in pieces
STAGING_BYTES = 32 << 20
_staging: torch.Tensor | None = None
_staging_lock = threading.Lock()


def host_staging() -> torch.Tensor:
    """The process's pinned staging buffer (made at the first call: a spare makes it while
    it waits for its job, `plora.train.spare`, else a job's bank at set-up).

    Pinned host memory is what a device-to-host copy wants (a copy to pageable memory is
    staged by the driver and holds the copy engine several times as long), but pinning
    takes the driver's lock for as long as it runs: on an H200 a leaving group's 256 MB
    buffer pinned on the writer's thread held it 136 ms, and the main loop's next copy, and
    so the GPU, waited all that time. So one small buffer is pinned once, ahead, and every
    snapshot goes through it into ordinary memory."""
    global _staging
    with _staging_lock:
        if _staging is None:
            _staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
        return _staging


Entry = tuple[str, int, tuple[int, ...], bool]  # (key, offset in the snapshot, shape, transposed)


def _host_states(flat: torch.Tensor, layout: list[list[Entry]], stream) -> list[dict[str, torch.Tensor]]:
    """``flat`` (a snapshot on the device) as each adapter's state dict on the host: views of
    one host copy, each contiguous in the orientation it is read in (a ``transposed`` entry
    is turned on the device, in place of the same size), so that the adapter writer copies
    nothing more (safetensors writes views of one buffer that do not overlap as they are).
    The entries go, a scratch buffer at a time, through the pinned staging buffer on
    ``stream`` (None: the current one, synchronously: how a CPU test drives it) into the
    host copy, one piece of up to the staging buffer's size at a time."""
    staging = host_staging()
    dtype, item = flat.dtype, flat.element_size()
    per = max(1, staging.numel() // item)
    entries = sorted((off, shape[0] * shape[1], shape, transposed) for adapter in layout
                     for _, off, shape, transposed in adapter)
    host = torch.empty(flat.numel(), dtype=dtype)
    with _on(stream):  # freed, it stays cached for that stream: the next snapshot's (`copy_stream`)
        scratch = torch.empty(max([per, *(e[1] for e in entries)]), dtype=dtype, device=flat.device)
    g0 = 0
    while g0 < len(entries):  # a group: the entries whose span fills the scratch buffer at most
        base, g1, total = entries[g0][0], g0 + 1, entries[g0][1]
        while g1 < len(entries) and entries[g1][0] + entries[g1][1] - base <= scratch.numel():
            total = entries[g1][0] + entries[g1][1] - base
            g1 += 1
        with _on(stream):
            _lay_out(flat, scratch, entries[g0:g1], base)
        for a in range(0, total, per):
            b = min(total, a + per)
            piece = staging[: (b - a) * item].view(dtype)
            with _on(stream):
                piece.copy_(scratch[a:b], non_blocking=stream is not None)
            if stream is not None:
                stream.synchronize()
            host[base + a : base + b].copy_(piece)
        g0 = g1
    return [{key: host[off : off + shape[0] * shape[1]].view((shape[1], shape[0]) if transposed else shape)
             for key, off, shape, transposed in adapter} for adapter in layout]


_copy_streams: dict[str, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream snapshots come to the host on, per device: what a snapshot's scratch
    buffer is allocated on stays cached for the next one, not for a stream never used again."""
    with _staging_lock:
        key = str(device)
        if key not in _copy_streams:
            _copy_streams[key] = torch.cuda.Stream(device)
        return _copy_streams[key]


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _lay_out(flat: torch.Tensor, scratch: torch.Tensor, group: list, base: int) -> None:
    """The ``group``'s entries of ``flat`` (side by side from offset ``base``) at the same
    places of ``scratch`` (from 0), each transposed one turned; plain entries in a row in
    one copy."""
    run: list[int] | None = None  # [offset, length] of plain entries in a row
    for off, n, shape, transposed in group:
        if transposed:
            scratch[off - base : off - base + n].view(shape[1], shape[0]).copy_(flat[off : off + n].view(shape).t())
            continue
        if run is not None and run[0] + run[1] == off:
            run[1] += n
            continue
        if run is not None:
            scratch[run[0] - base : run[0] - base + run[1]].copy_(flat[run[0] : run[0] + run[1]])
        run = [off, n]
    if run is not None:
        scratch[run[0] - base : run[0] - base + run[1]].copy_(flat[run[0] : run[0] + run[1]])


class BankSnapshot:
    """Leaving adapters' weights, copied on the device at once (`LoRABank.snapshot`) and
    brought to the host once, by whoever needs them first (`states`).

    On a GPU the host copy is what a leaving group used to wait for: a whole-bank transfer
    to pageable memory, 0.3-0.4 s of every group on the 16-adapter benchmark (an H200), the
    GPU idle. Now only the group's rows are gathered, in one device copy that takes
    milliseconds, and the adapter writer's thread brings them over on a stream of its own
    while the pack trains on and the group is evaluated, through a pinned buffer made ahead
    (`host_staging`). It holds `CAPTURE_LOCK` meanwhile: a capture in global mode forbids
    any thread's synchronising copy."""

    def __init__(self, flat: torch.Tensor, layout: list[list[Entry]]):
        self._flat: torch.Tensor | None = flat
        self._layout = layout
        self._states: list[dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self._ready = None
        if flat.is_cuda:  # what the copy waits for: the gather, queued on this stream
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(flat.device))

    def states(self) -> list[dict[str, torch.Tensor]]:
        """Each adapter's state dict, made by the first call: views of one host copy of a CPU
        snapshot; from a GPU, contiguous views in the orientation they are read in (`_host_states`)."""
        with self._lock:
            if self._states is None:
                self._states = self._to_host()
            return self._states

    def state(self, i: int) -> dict[str, torch.Tensor]:
        """The ``i``-th adapter's state dict (`states`)."""
        return self.states()[i]

    def _to_host(self) -> list[dict[str, torch.Tensor]]:
        flat, self._flat = self._flat, None  # the device copy goes once copied: nothing else reads it
        assert flat is not None
        if self._ready is None:
            return self._split(flat if flat.device.type == "cpu" else flat.to("cpu"))
        with CAPTURE_LOCK:  # (one snapshot at a time on the copy stream too)
            stream = copy_stream(flat.device)
            stream.wait_event(self._ready)
            states = _host_states(flat, self._layout, stream)
            del flat
        return states

    def _split(self, host: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        out: list[dict[str, torch.Tensor]] = []
        for entries in self._layout:
            state: dict[str, torch.Tensor] = {}
            for key, off, shape, transposed in entries:
                part = host[off : off + math.prod(shape)].view(shape)
                state[key] = part.t() if transposed else part
            out.append(state)
        return out


def _consecutive_runs(ks: Sequence[int]) -> list[tuple[int, int]]:
    """``ks`` in order as runs of consecutive slots, ``[(first, last + 1), ...]``."""
    runs: list[tuple[int, int]] = []
    for k in ks:
        if runs and runs[-1][1] == k:
            runs[-1] = (runs[-1][0], k + 1)
        else:
            runs.append((k, k + 1))
    return runs


class LoRABank:
    """One flat buffer for the weights of every adapter of `pm`, one for their gradients."""

    def __init__(self, pm: PackedModel, share: Callable[[nn.Parameter], float] | None = None):
        """``share(p)``: the weight of tensor p's squared norm (1 / the number of
        tensor-parallel ranks that hold the same values); 1 by default."""
        self.pm = pm
        self.num_adapters = len(pm.adapters)
        params = [getattr(layer, which) for layer in pm.layers.values() for which in STACKED]
        if not params:
            raise ValueError("the packed model has no LoRA layers")
        device, dtype = params[0].device, params[0].dtype
        numel = sum(p.numel() for p in params)
        self.weights = torch.empty(numel, dtype=dtype, device=device)
        self.grads = torch.zeros(numel, dtype=dtype, device=device)
        rows = pm.state.row_starts
        ranges: list[tuple[int, int, int, float]] = []
        self._views: list[tuple[nn.Parameter, int]] = []
        off = 0
        with torch.no_grad():
            for p in params:
                n, width = p.numel(), p.shape[1]
                w = self.weights[off : off + n].view_as(p)
                w.copy_(p)
                p.data = w  # the parameter object stays (optimizer-free bookkeeping keys on it)
                p.grad = self.grads[off : off + n].view_as(p)
                weight = share(p) if share is not None else 1.0
                for k in range(self.num_adapters):
                    ranges.append((off + rows[k] * width, (rows[k + 1] - rows[k]) * width, k, weight))
                self._views.append((p, off))
                off += n
        self.segments = build_segments(ranges, self.num_adapters, numel, device)
        if device.type == "cuda":
            host_staging()  # pinned now, before any step runs, where no spare pinned it already
        self._run_owner: torch.Tensor | None = None  # `zero_grad_where`'s runs, built on first use
        self._run_lengths: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.weights.device

    def host_states(self, ks: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Adapters ``ks`` in torchtune's LoRA naming (`PackedModel.adapter_state_dict`), as
        views of one private host copy of their rows (`snapshot`, brought over now)."""
        return self.snapshot(ks).states()

    def snapshot(self, ks: Sequence[int]) -> "BankSnapshot":
        """Adapters ``ks``'s rows of every stacked tensor, gathered on the device into one
        buffer of their own now (a slot refilled at the next step does not change it); the
        host copy is made where it is needed (`BankSnapshot.states`, on the writer's thread
        while the pack trains on)."""
        rows = self.pm.state.row_starts
        names = [(name, which) for name in self.pm.layers for which in STACKED]
        runs = _consecutive_runs(ks)
        pieces: list[torch.Tensor] = []
        layout: list[list[Entry]] = [[] for _ in ks]
        off = 0
        for (p, start), (name, which) in zip(self._views, names):
            width = p.shape[1]
            # adapters of consecutive slots own one contiguous range of the buffer: one piece
            # each, not one per adapter (a leaving group of 8 over 336 tensors: 336 pieces,
            # not 2,688 slices on the main loop while the GPU waits)
            for k0, k1 in runs:
                pieces.append(self.weights.narrow(0, start + rows[k0] * width, (rows[k1] - rows[k0]) * width))
            a = which == "a_all"
            for entries, k in zip(layout, ks):
                shape = (rows[k + 1] - rows[k], width)
                entries.append((f"{name}.lora_{'a' if a else 'b'}.weight", off, shape, not a))
                off += shape[0] * shape[1]
        flat = torch.cat(pieces) if pieces else self.weights.new_empty(0)
        return BankSnapshot(flat, layout)

    def zero_grad(self) -> None:
        """One fill for the whole pack; the ``.grad`` views stay in place (autograd adds into them)."""
        self.grads.zero_()

    def zero_grad_where(self, zero: torch.Tensor) -> None:
        """Zero the gradients of the adapters whose flag is set (bool [K], on the device)
        and keep the others' (an adapter accumulating over several steps): no host sync, so
        a CUDA graph can hold it. A fill, not a product: a non-finite gradient is cleared too."""
        if self._run_owner is None:
            self._run_owner, self._run_lengths = self._element_runs()
        flags = torch.cat([zero.to(torch.bool), zero.new_ones(1, dtype=torch.bool)])  # the last: nobody's
        mask = torch.repeat_interleave(flags[self._run_owner], self._run_lengths, output_size=self.grads.numel())
        self.grads.masked_fill_(mask, 0)

    def _element_runs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat buffers as consecutive runs of one owner each (index K: no adapter's)."""
        owners, lengths, at = [], [], 0
        for start, n, k, _ in sorted(self.segments.ranges):
            if start > at:
                owners.append(self.num_adapters)
                lengths.append(start - at)
            owners.append(k)
            lengths.append(n)
            at = start + n
        if at < self.grads.numel():
            owners.append(self.num_adapters)
            lengths.append(self.grads.numel() - at)
        device = self.grads.device
        return (torch.tensor(owners, dtype=torch.int64, device=device),
                torch.tensor(lengths, dtype=torch.int64, device=device))

    def check_views(self) -> None:
        """Raise if a layer's ``.grad`` no longer views the bank (e.g. someone called the
        model's ``zero_grad(set_to_none=True)``): its gradients would be lost silently."""
        for p, off in self._views:
            if p.grad is None or p.grad.data_ptr() != self.grads[off:].data_ptr():
                raise RuntimeError("a LoRA gradient was detached from the bank's buffer")

    def sq_norms(self, of_weights: bool = False) -> torch.Tensor:
        """Each adapter's squared L2 norm of its gradient (or weights): a device tensor [K]."""
        return segment_sq_norms(self.weights if of_weights else self.grads, self.segments)

    def adapter_views(self, buf: torch.Tensor, k: int) -> list[torch.Tensor]:
        """Adapter k's pieces of a buffer laid out like the bank (tests look in)."""
        return [buf[s : s + n] for s, n, g, _ in self.segments.ranges if g == k]


class PackedAdamW:
    """AdamW per adapter over a `LoRABank`: one launch per step for the whole pack."""

    def __init__(
        self,
        bank: LoRABank,
        lrs: Sequence[float],
        weight_decay: float | Sequence[float] = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        if len(lrs) != bank.num_adapters:
            raise ValueError(f"one learning rate per adapter: {len(lrs)} for {bank.num_adapters}")
        self.bank = bank
        self.lrs = [float(x) for x in lrs]
        #: each adapter's decoupled weight decay (one number: the same for every adapter)
        if isinstance(weight_decay, (int, float)):
            weight_decay = [float(weight_decay)] * bank.num_adapters
        if len(weight_decay) != bank.num_adapters:
            raise ValueError(f"one weight decay per adapter: {len(weight_decay)} for {bank.num_adapters}")
        self.weight_decays = [float(x) for x in weight_decay]
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        acc = torch.float64 if bank.weights.dtype == torch.float64 else torch.float32
        self.exp_avg = torch.zeros(bank.weights.numel(), dtype=acc, device=bank.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.steps = [0] * bank.num_adapters

    def planned_hyperparams(self, adapters: Sequence[int]) -> torch.Tensor:
        """The `segmented_adamw_` table (host, float32) as if every adapter in ``adapters``
        stepped now at its ``self.lrs`` with coefficient 1; `step_where` then keeps the rows
        that may step and puts in their clipping coefficients, on the device, so a step needs
        no host sync between the backward and the update (and can run in a CUDA graph)."""
        b1, b2 = self.betas
        table = {k: (self.steps[k] + 1, self.lrs[k], self.weight_decays[k], b1, b2, self.eps, 1.0) for k in adapters}
        return adamw_hyperparams(table, self.bank.num_adapters, "cpu")

    def step_where(self, planned: torch.Tensor, go: torch.Tensor, coef: torch.Tensor) -> None:
        """Step the adapters whose ``go`` (bool [K], on the device) is set, with gradient
        coefficients ``coef`` (float [K]); ``planned`` is `planned_hyperparams` on the device.
        The caller counts the steps taken (`count_steps`) once it has read ``go`` back."""
        hp = planned.clone()
        hp[:, 0] *= go.to(hp.dtype)
        hp[:, HP_COLUMNS.index("grad_coef")] = torch.where(go, coef.to(hp.dtype), 0.0)
        bank = self.bank
        segmented_adamw_(bank.weights, bank.grads, self.exp_avg, self.exp_avg_sq, bank.segments, hp)

    def count_steps(self, adapters: Sequence[int]) -> None:
        for k in adapters:
            self.steps[k] += 1

    def step(self, coefs: dict[int, float]) -> None:
        """Step the adapters in ``coefs`` (adapter -> gradient coefficient, 1 without
        clipping) at their learning rate in ``self.lrs``; every other adapter is left alone."""
        if not coefs:
            return
        ids = list(coefs)
        device = self.bank.device
        go = torch.zeros(self.bank.num_adapters, dtype=torch.bool)
        coef = torch.zeros(self.bank.num_adapters, dtype=torch.float32)
        go[ids] = True
        coef[ids] = torch.tensor([float(c) for c in coefs.values()], dtype=torch.float32)
        self.step_where(self.planned_hyperparams(ids).to(device), go.to(device), coef.to(device))
        self.count_steps(ids)

    def state_views(self, k: int) -> list[torch.Tensor]:
        """Adapter k's pieces of both moments."""
        return self.bank.adapter_views(self.exp_avg, k) + self.bank.adapter_views(self.exp_avg_sq, k)
