"""A packed training step replayed from a CUDA graph, and the graphs a job keeps.

A packed step launches thousands of small kernels (every adapted layer runs a few Triton
launches per rank bucket, forward and backward), and on a GPU the host cannot issue them as
fast as the GPU runs them: traced on an H200, a 0.5B-shape step of 16 adapters took 247 ms
of which the GPU was busy 64 ms. A pack's shapes do not change from one step to the next
until an adapter leaves or joins it, so the whole step (forward, per-adapter losses,
backward, norms, clipping, AdamW) is captured once and replayed: the host then issues one
launch per step, and step time is what the GPU needs, the same in every process.

What a step must decide per adapter (diverged loss, non-finite gradient, clipping) is
decided on the device inside the step (`PackedLoRARecipe._device_step`); the host reads
one small tensor back after the replay and keeps the books.

**Keys.** A graph is made for one *composition* (`Composition`: the pack's slots in the
batch and each one's rows) and one batch shape (`plora.train.packed.step_batch`: each adapter's
segment and label part padded to a held size when rows are flattened, which only grows; or
the padded width, one of a few when rows come in length buckets). The first step of a key
captures its graph and replays it, the following ones replay it: what a capture must not
make itself (the kernels' schedules, which the graph then reads, and their compilation) is
made ahead (`PackedModel.compile_kernels_ahead`). Where that first capture fails, or with
``PLORA_CAPTURE_FIRST=0``, the first step of a key runs eagerly (on the stream the graph is
captured on: it builds the schedules too) and the second captures. A job with a side lane
(`plora.train.side_lane`) captures the composition its pack changes to next while the one
before still replays (`capture_ahead`, in CUDA's thread-local capture mode, into the same
pool: nothing runs during a capture, and the new graph replays only after the old one's last
replay, on the same stream), and adopts it as if captured at its first step (`adopt`).
Anything but a replay of a held graph (a new key's step, graphs dropped) first calls
`StepGraph.before_work`, where the job waits for its lane.

A composition names slots, not adapters: whatever a slot's adapter is, the graph reads it
from device memory at fixed addresses. The weights, the AdamW moments and the gradients
are the slot's pieces of flat buffers (the same rows of every stacked tensor, for the same
rank) that a refill writes in place (`plora.train.packed.slots`);
the learning rate, the step count and its bias corrections are the optimizer table that is
copied into the step's buffers before every replay (`StepBuffers.fill`); the scale
alpha/rank is the segment metadata's device tensor, written in place on a refill
(`LoRAMeta.set_scale`). So a slot refilled by an adapter of the same rank and batch size
leaves the key as it was, and the pack replays the graphs it had. Where the kernels take
the scales as host numbers (the torch path on CUDA: they would be baked into a capture),
the composition carries them. Only a pack laid out again (new buffers) drops every graph.

**Held graphs.** The graphs of every composition are kept, the least recently used
dropped past `StepGraph.MAX_GRAPHS`: a composition that comes back (a freed slot refilled,
a pack returning to an earlier set) replays its graphs instead of capturing again. A
composition whose slots are a subset of a held one's, each with at most the rows it has
there (a slot just freed, its replacement not yet arrived; a pack draining; a slot refilled
by an adapter of a smaller batch size), replays that one's graph instead, the rows it lacks
fed padding (`StepGraph.plan`). Padding rows carry no label: in a vacant slot the loss is 0
and the optimizer table does not step it, in an adapter's slot its loss is still the mean
over its own labels and the rows add exact zeros to its gradient; every row is attended and
normed alone, and a vacant slot's rows run through its old weights inside their own rows as
a diverging adapter's rows do, so nothing they compute reaches another slot. Covering
wastes the padding rows' share of each step. Where the composition's length is known (no join can come: it lasts until the next
adapter finishes) it is covered only if all that waste is under what a capture of its own
costs (`CAPTURE_COST_STEPS`); where a join may refill the slot any step, it is covered
until the waste adds up to that cost, then captured: at most twice the cheaper of the two
choices, and nothing captured at all when the slot is refilled soon.

**One memory pool for all graphs.** Every graph is captured into one pool. This is safe:
every tensor a capture allocates is freed by the end of the capture (a step writes what it
reports into its `StepBuffers`, allocated outside the pool, and the schedules it reads were
built before it), so between replays no live tensor lives in the pool; and
replays run one at a time on one stream (eager steps on the capture stream, ordered with
it both ways), so the scratch memory two graphs share is never in use by both. (PyTorch
asks graphs sharing a pool to be replayed in capture order for the case where one graph's
output, allocated in the pool, is read after another graph has run: there is no such
output here.) The pool then holds about the largest held step's activations once, however
many graphs share it; what else is held per graph is its buffers (a batch, an optimizer
table, segment metadata) and the graph itself, bounded by `MAX_GRAPHS`.

**Memory.** Before a step that must run eagerly beside held graphs (a new key), or an eval,
`StepGraph` checks that the memory beside the pool holds an eager step of that size (the
bytes per token the job's eager steps took, with a margin); if not, every graph is dropped
and its memory given back first. So a job never holds the graphs' activations and an eager
step's that do not fit together: held graphs cost speed only where memory is to spare.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

from plora.data.row_layout import WIDTH_MULTIPLE, padded_width
from plora.train.cuda_capture import CAPTURE_LOCK

__all__ = [
    "WIDTH_MULTIPLE",
    "Composition",
    "CudaGraphs",
    "GraphBackend",
    "GraphCounts",
    "StepBuffers",
    "StepGraph",
    "padded_width",
    "step_inputs",
]


def step_inputs(batch) -> dict[str, torch.Tensor]:
    """The host tensors of a `plora.train.packed.step_batch.StepBatch` that a step reads: tokens,
    the label parts, and for flattened rows their positions and boundaries."""
    out = {"tokens": batch.tokens, "label_index": batch.labels.index, "label_targets": batch.labels.targets}
    if batch.flat:
        out["positions"] = batch.positions
        out["cu_seqlens"] = batch.cu_seqlens()
    return out


@dataclass(frozen=True)
class Composition:
    """What a step's graph is made for besides its batch shape: the pack's slots in the batch
    (ascending), each one's rows, and each one's scale only where a capture would bake it
    (module docstring; empty otherwise)."""

    slots: tuple[int, ...]
    rows: tuple[int, ...]
    scales: tuple[float, ...] = ()

    def vacant_share(self, cover: Composition) -> float | None:
        """The share of ``cover``'s rows that would be padding if this composition's step
        replayed ``cover``'s graph (its slots not in this one, and a slot's rows past its
        own), or None where it cannot: a slot of this one missing from ``cover``, or with
        fewer rows (or another baked scale) there."""
        rows = dict(zip(cover.slots, cover.rows))
        scales = dict(zip(cover.slots, cover.scales))
        for i, (k, n) in enumerate(zip(self.slots, self.rows)):
            if k not in rows or n > rows[k] or (self.scales and scales.get(k) != self.scales[i]):
                return None
        total = sum(cover.rows)
        return (total - sum(self.rows)) / total if total else None


@dataclass
class StepBuffers:
    """The device tensors one key's step reads and writes, allocated once.

    ``inputs``: the batch (`step_inputs`: tokens, label positions and targets, and for
    flattened rows their positions and boundaries); ``planned``: the optimizer table as if
    every active adapter stepped (`PackedAdamW.planned_hyperparams`); ``active``: the
    slots in the batch (int64, ascending); ``out``: what the step reports, (5, K) float32 —
    each adapter's loss, gradient norm, weight norm after the update, whether its loss was
    kept (finite, under ``divergence_loss``) and whether it stepped (NaN loss and 0, 0 for
    an adapter not in the batch). ``meta``: the segment metadata the captured kernels read,
    kept alive with the graph.
    """

    key: tuple
    inputs: dict[str, torch.Tensor]
    planned: torch.Tensor
    active: torch.Tensor
    out: torch.Tensor
    meta: Any = None

    @property
    def tokens(self) -> torch.Tensor:
        return self.inputs["tokens"]

    @classmethod
    def allocate(cls, key: tuple, inputs: dict[str, torch.Tensor], planned: torch.Tensor,
                 active: Sequence[int], num_adapters: int, device: torch.device) -> "StepBuffers":
        return cls(
            key=key,
            inputs={name: t.to(device) for name, t in inputs.items()},
            planned=planned.to(device),
            active=torch.tensor(list(active), dtype=torch.int64).to(device),
            out=torch.zeros(5, num_adapters, dtype=torch.float32, device=device),
        )

    def fill(self, inputs: dict[str, torch.Tensor], planned: torch.Tensor) -> None:
        """This step's batch and optimizer table, into the same memory (the graph reads it)."""
        for name, t in inputs.items():
            self.inputs[name].copy_(t, non_blocking=True)
        self.planned.copy_(planned, non_blocking=True)


class GraphBackend(Protocol):
    """The device side of `StepGraph`: what it needs to run, capture and fit steps. On a
    GPU, `CudaGraphs`; the tests drive `StepGraph`'s books with a fake one."""

    def eager(self, body: Callable[[StepBuffers], None], buffers: StepBuffers, *, measure: bool = False) -> int:
        """Run ``body(buffers)`` once; with ``measure``, the bytes its activations took."""

    def capture(self, body: Callable[[StepBuffers], None], buffers: StepBuffers, pool: Any, *,
                beside: bool = False) -> tuple[Any, Any]:
        """Record ``body(buffers)`` into a graph (with a ``replay()``) that allocates from
        ``pool`` (None: a new one); the graph and its pool. Raises when it cannot. ``beside``:
        recorded on a side thread while the job's thread replays (`plora.train.side_lane`)."""

    def stream(self) -> Any:
        """The stream eager steps and captures run on (None where there is none)."""

    def captured_bytes(self) -> int:
        """What the last capture added to the pool: a step's activations, where the pool was new."""

    def room(self) -> int:
        """Bytes an eager step could take now, beside what the held graphs keep."""

    def release(self) -> None:
        """No graph is held any more: give the memory they kept back."""


class CudaGraphs:
    """`GraphBackend` on a CUDA device: eager steps and captures on one side stream, every
    capture into one pool (module docstring), and the memory beside that pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self._pool_bytes = 0  # what the captures added to the reserved memory: the pool's size
        self._grew = 0  # what the last capture added

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def eager(self, body: Callable[[StepBuffers], None], buffers: StepBuffers, *, measure: bool = False) -> int:
        # The warm-up runs on the capture stream (per-stream state such as cuBLAS
        # workspaces is then made before the capture, as CUDA graphs require).
        if measure:  # from an empty cache, what the step leaves cached is what it took
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(self.device)
        stream, main = self._side_stream(), torch.cuda.current_stream(self.device)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            body(buffers)
        main.wait_stream(stream)
        return max(0, torch.cuda.memory_reserved(self.device) - before) if measure else 0

    def stream(self) -> torch.cuda.Stream:
        return self._side_stream()

    def capture(self, body: Callable[[StepBuffers], None], buffers: StepBuffers, pool: Any, *,
                beside: bool = False) -> tuple[Any, Any]:
        # Beside the job's thread (`beside`), in CUDA's thread-local mode: that thread reads
        # its replays' results meanwhile, which the global mode forbids any thread to do.
        with CAPTURE_LOCK:  # no other thread of the job syncs a copy while it records
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the eager steps' cached blocks: not held beside the pool
            before = torch.cuda.memory_reserved(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self._side_stream(), pool=pool,
                                  capture_error_mode="thread_local" if beside else "global"):
                body(buffers)
        self._grew = max(0, torch.cuda.memory_reserved(self.device) - before)
        self._pool_bytes += self._grew
        return graph, pool if pool is not None else graph.pool()

    def captured_bytes(self) -> int:
        return self._grew

    def room(self) -> int:
        free, _total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return int(free + max(0, cached - self._pool_bytes))  # the pool's free blocks are its graphs'

    def release(self) -> None:
        self._pool_bytes = 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


@dataclass
class GraphCounts:
    """What a job's steps did with graphs (summary.json, ``phases.graphs``): ``captures``
    made, ``replays`` of a held graph, ``eager_steps`` (a new key's first step, or every step
    once capture failed), ``reuses`` (a step whose composition had changed since the step
    before and that replayed a graph already held, of its own or covering it: a capture
    saved), ``covered_steps`` (steps replayed from a covering composition's graph, vacant
    slots padded), ``evictions`` (graphs dropped past `StepGraph.MAX_GRAPHS`),
    ``releases`` (every graph dropped: a pack laid out again, or memory wanted) and ``ahead``
    (captures made ahead, `StepGraph.capture_ahead`)."""

    captures: int = 0
    replays: int = 0
    eager_steps: int = 0
    reuses: int = 0
    covered_steps: int = 0
    evictions: int = 0
    releases: int = 0
    #: of ``captures``, those made ahead on the side lane while an earlier composition replayed
    ahead: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _Held:
    buffers: StepBuffers
    graph: Any = None  # None: run eagerly once, captured the next time
    order: int = 0  # when it was made: held shapes are offered oldest first
    tokens: int = 0
    ahead: bool = False  # captured ahead and not replayed yet (its first replay saved no capture)


@dataclass
class _Cover:
    """The composition being covered now and the waste its covered steps added up to."""

    own: Composition | None = None
    waste: float = 0.0


class StepGraph:
    """Runs a step body eagerly or from the CUDA graph of its key (module docstring).

    ``body(buffers)`` must do all its work on the device from ``buffers`` and host numbers
    fixed by the key: no host syncs, no host-side effects (it runs once to record).
    """

    #: graphs held, all compositions together (a composition has one per batch shape: padded
    #: rows drawn from length buckets come in a few widths); past it the least recently used goes
    MAX_GRAPHS = 32
    #: what capturing a composition's own graph costs, in replayed steps of the pack: its
    #: eager step and its capture step each run at the host's launch rate (247 ms against
    #: 64 ms replayed, module docstring), about 4 replayed steps each. With the capture at a
    #: key's first step (`capture_first`) there is no eager step, so this is twice what a
    #: capture costs then; the bound is kept as it was measured (covering is chosen a little
    #: more often than it would be)
    CAPTURE_COST_STEPS = 8.0
    #: an eager step is run beside held graphs only with this much more room than it should take
    ROOM_MARGIN = 1.1

    def __init__(self, device: torch.device, log: Callable[[str], None] | None = None,
                 backend: GraphBackend | None = None, cover: bool = True, capture_first: bool = False):
        self.device = device
        self.enabled = True
        #: a new key's graph is captured, then replayed, at its first step (`_first_step`)
        self.capture_first = capture_first
        self.cover = cover  # whether a composition may replay a held one that covers it (`plan`)
        self.backend: GraphBackend = backend if backend is not None else CudaGraphs(device)
        self._log = log or (lambda msg: print(msg, file=sys.stderr))
        self._held: OrderedDict[tuple[Composition, tuple], _Held] = OrderedDict()  # least recently used first
        self._pool: Any = None  # the memory pool every held graph shares
        self._made = 0
        self._bytes_per_token = 0.0  # the most an eager step of this job took, per batch token
        self._previous: Composition | None = None  # the composition of the step before
        self._cover = _Cover()
        self.counts = GraphCounts()
        #: how the last step ran: "eager", "capture" (captured, then replayed), "replay" or
        #: "cover" (replayed from a covering composition's graph)
        self.last_run = ""
        #: called before anything but a replay uses the model or the pool (an eager step, a
        #: capture, graphs dropped): the job waits there for its side lane (`plora.train.side_lane`)
        self.before_work: Callable[[], None] = lambda: None

    @property
    def captures(self) -> int:
        return self.counts.captures

    @property
    def replays(self) -> int:
        return self.counts.replays

    def held_shapes(self, composition: Composition, *, captured: bool = False) -> list[tuple]:
        """The batch shapes (`StepBatch.shape`) of the graphs held for ``composition``, oldest
        first (with ``captured``, only those already captured): a new batch that fits one
        reuses its graph."""
        entries = [(h.order, key[1]) for key, h in self._held.items()
                   if key[0] == composition and (h.graph is not None or not captured)]
        return [shape for _, shape in sorted(entries)]

    def held_buffers(self) -> Iterator[StepBuffers]:
        """The buffers of every held key (to change what their graphs read in place)."""
        for h in self._held.values():
            yield h.buffers

    def plan(self, own: Composition, lasts: int | None = None) -> Composition:
        """The composition whose graph a step of ``own`` should run: ``own`` where it has
        graphs held, or no held composition covers it, or covering it would waste more than
        a capture costs; else the held composition that covers it with the fewest padding
        rows (its batch then takes that composition's rows, padding where ``own`` has
        fewer, and one of its captured shapes; `decline` if the batch does not fit one).

        ``lasts``: how many more steps ``own`` will run, where that is known (no adapter can
        join: the pack only shrinks): covering then wins only if its whole waste is under a
        capture's cost. Unknown (None: a join may fill a vacant slot at any step), the
        waste covered steps have added up to decides, a step at a time."""
        if not (self.enabled and self.cover) or any(key[0] == own for key in self._held):
            return own
        best, best_share = own, math.inf
        for key, h in self._held.items():
            share = own.vacant_share(key[0]) if h.graph is not None else None
            if share is not None and 0 < share < best_share:
                best, best_share = key[0], share
        if best == own:
            return own
        budget = self.CAPTURE_COST_STEPS * (1 + 1e-9)  # a sum of shares may round just past it
        if lasts is not None and best_share * lasts > budget:
            return own
        spent = self._cover.waste if self._cover.own == own else 0.0
        return best if spent + best_share <= budget else own

    def decline(self, own: Composition) -> None:
        """The covering composition `plan` offered does not fit ``own``'s batch: ``own``
        gets its own graphs (for as long as it lasts)."""
        self._cover = _Cover(own, math.inf)

    def drop(self) -> None:
        """Forget every held graph and give their memory back."""
        if not self._held and self._pool is None:
            return
        self.before_work()
        self._held.clear()
        self._pool = None
        self.counts.releases += 1
        self.backend.release()

    def make_room(self) -> None:
        """Something other than a step (an eval) is about to use the device's memory: drop
        every graph unless the largest held step could still run eagerly beside them."""
        self.before_work()
        if self._held and not self._fits(max(h.tokens for h in self._held.values())):
            self.drop()

    # ------------------------------------------------------------ captured ahead
    def ahead_wanted(self, composition: Composition, tokens: int) -> bool:
        """Whether a graph of ``composition`` (a step of ``tokens`` batch tokens) should be
        captured ahead now (`capture_ahead`): captures at a key's first step work here, a
        pool is there to share, none of the composition's graphs is held, and its step would
        fit beside the held ones without dropping them (else its first step decides, as now)."""
        if not (self.enabled and self.capture_first) or self._pool is None:
            return False
        if any(key[0] == composition for key in self._held) or len(self._held) >= self.MAX_GRAPHS:
            return False
        return self._fits(tokens)

    def capture_ahead(self, make: Callable[[], StepBuffers],
                      body: Callable[[StepBuffers], None]) -> Callable[[], tuple[Any, ...]]:
        """The side lane's task for a composition the pack will change to: its buffers made
        and its graph recorded into the shared pool beside the job's thread, which replays
        the graph of the composition before it meanwhile. The task returns what `adopt` takes
        (the pool last: a graph is adopted only into the pool it was captured into)."""
        pool = self._pool

        def task() -> tuple[Any, ...]:
            buffers = make()
            graph, _ = self.backend.capture(body, buffers, pool, beside=True)
            return buffers, graph, self.backend.captured_bytes(), pool

        return task

    def adopt(self, key: tuple[Composition, tuple], buffers: StepBuffers, graph: Any, grew: int,
              pool: Any) -> bool:
        """A graph captured ahead (`capture_ahead`) into ``pool`` joins the held ones, as one
        captured at its key's first step would; not where that pool was given up meanwhile,
        or the key came first (False)."""
        if pool is None or pool is not self._pool or key in self._held:
            return False
        self._evict_past_max()
        tokens = int(buffers.tokens.numel())
        self._held[key] = _Held(buffers, graph, self._made, tokens, ahead=True)
        self._made += 1
        self.counts.captures += 1
        self.counts.ahead += 1
        self._bytes_per_token = max(self._bytes_per_token, grew / max(1, tokens))
        return True

    def run(
        self,
        composition: Composition,
        shape: tuple,
        make: Callable[[], StepBuffers],
        inputs: tuple[dict[str, torch.Tensor], torch.Tensor],
        body: Callable[[StepBuffers], None],
        *,
        own: Composition | None = None,
    ) -> StepBuffers:
        """One step of key (``composition``, ``shape``). ``make()`` allocates its buffers (and
        sets the pack state the body reads) the first time the key comes; ``inputs`` =
        (`step_inputs`, planned). ``own``: the composition of the adapters that train in
        this step, when ``composition`` covers it (`plan`)."""
        own = own if own is not None else composition
        key = (composition, shape)
        changed = own != self._previous
        self._previous = own
        entry = self._held.get(key)
        if entry is None or entry.graph is None:
            self.before_work()  # the job's lane first: it may also bring this key's graph, captured ahead
            entry = self._held.get(key)
        if entry is None:
            if composition != own:
                raise ValueError("a covering composition runs only from a graph it holds")
            return self._first_step(key, make, inputs, body)
        self._held.move_to_end(key)
        buffers = entry.buffers
        buffers.fill(*inputs)
        captured = False
        if entry.graph is None and self.enabled:
            entry.graph = self._capture(body, buffers)
            captured = entry.graph is not None
        if entry.graph is None:
            self.backend.eager(body, buffers)
            self.counts.eager_steps += 1
            self.last_run = "eager"
            return buffers
        entry.graph.replay()
        self.counts.replays += 1
        self.last_run = "capture" if captured else "replay"
        if changed and not captured and not entry.ahead:
            self.counts.reuses += 1
        entry.ahead = False
        if composition != own:
            self.counts.covered_steps += 1
            self.last_run = "cover"
            share = own.vacant_share(composition) or 0.0
            spent = self._cover.waste if self._cover.own == own else 0.0
            self._cover = _Cover(own, spent + share)
        return buffers

    def _first_step(self, key: tuple[Composition, tuple], make: Callable[[], StepBuffers],
                    inputs: tuple[dict[str, torch.Tensor], torch.Tensor],
                    body: Callable[[StepBuffers], None]) -> StepBuffers:
        """A new key: room for its eager step (dropping every graph if needed), a place in
        the held set (the least recently used key leaving past `MAX_GRAPHS`), its eager step."""
        tokens = int(inputs[0]["tokens"].numel())
        if self._held and not self._fits(tokens):
            self.drop()  # the held graphs' pool and this eager step would not fit side by side
        self._evict_past_max()
        if self._pool is not None and not any(h.graph is not None for h in self._held.values()):
            self._pool = None  # every graph of the pool evicted: the next capture starts a new one
            self.backend.release()
        buffers = make()
        entry = self._held[key] = _Held(buffers, None, self._made, tokens)
        self._made += 1
        if self.capture_first and self.enabled:
            entry.graph = self._capture_at_first(body, buffers, tokens)
            if entry.graph is not None:
                entry.graph.replay()
                self.counts.replays += 1
                self.last_run = "capture"
                return buffers
        took = self.backend.eager(body, buffers, measure=True)
        self._bytes_per_token = max(self._bytes_per_token, took / max(1, tokens))
        self.counts.eager_steps += 1
        self.last_run = "eager"
        return buffers

    def _capture_at_first(self, body: Callable[[StepBuffers], None], buffers: StepBuffers, tokens: int) -> Any:
        """A new key's graph captured before any eager step of it: the step then runs at once
        from its graph, not eagerly first at the host's launch rate (0.3-0.5 s of Python a
        composition on an H200, its GPU mostly idle), since what the eager step used to make
        for the capture is made ahead (the kernels' schedules, with their compilation:
        `PackedModel.compile_kernels_ahead`). Its bytes per token are what the capture added
        to the pool. The graph, or None where this capture failed: this job's new keys then
        run eagerly once first (a capture at the second step fails alone)."""
        try:
            graph = self._record(body, buffers)
        except Exception as e:  # noqa: BLE001 - the eager step first, as without capture_first
            self.capture_first = False
            self._log(f"capturing a step's graph before its first run failed ({type(e).__name__}: {e}); "
                      "new compositions run once eagerly first")
            return None
        self._bytes_per_token = max(self._bytes_per_token, self.backend.captured_bytes() / max(1, tokens))
        return graph

    def _evict_past_max(self) -> None:
        """Room for one more key: the least recently used go past `MAX_GRAPHS`."""
        while len(self._held) >= self.MAX_GRAPHS:
            self._held.popitem(last=False)
            self.counts.evictions += 1

    def _fits(self, tokens: int) -> bool:
        """Whether an eager step of ``tokens`` batch tokens fits beside the held graphs."""
        need = self.ROOM_MARGIN * self._bytes_per_token * tokens
        return need <= 0 or self.backend.room() >= need

    def _capture(self, body: Callable[[StepBuffers], None], buffers: StepBuffers) -> Any:
        try:
            return self._record(body, buffers)
        except Exception as e:  # noqa: BLE001 - a capture failure costs speed, not the job
            self.enabled = False
            self._held.clear()
            self._pool = None
            self.backend.release()
            self._log(f"CUDA graph capture failed ({type(e).__name__}: {e}); this job's steps run eagerly")
            return None

    def _record(self, body: Callable[[StepBuffers], None], buffers: StepBuffers) -> Any:
        """A graph of ``body(buffers)`` captured into the shared pool (raises where it cannot;
        the callers decide what a failure means)."""
        graph, self._pool = self.backend.capture(body, buffers, self._pool)
        self.counts.captures += 1
        return graph
