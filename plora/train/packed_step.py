"""One packed optimizer step of the active adapters, with one host sync (`PackedStep`).

The step's decisions per adapter (a non-finite or too-large loss, a non-finite gradient
norm, the clipping coefficient) are made on the device (`PackedStep.device_step`); the host
reads the losses and norms back once and keeps the books (`PackedStep.account`): so the same
step runs eagerly or replayed from a CUDA graph (`plora.train.step_graph.StepGraph`), its own
or that of a held composition covering it (the rows this step lacks fed padding).

**The next step's rows, ahead** (`PackedStep.step_ahead`; ``PLORA_STEP_AHEAD``, on a GPU). The
host's part of a step (each adapter's rows drawn from its stream, the batch laid out) is the
GPU's idle time between two replays when it follows the wait for the step before: on an
H200, 7.7 ms of a 130 ms step of the first-sweep benchmark's full pack, 3.6 ms of the
47 ms step it drains to (`scripts/step_gap.py`). So once a step is on the device, the next
one's rows are drawn and laid out while it runs, where nothing can change the pack before it
(no adapter ends with this step, no join can come, no adapter accumulates its batch). They are
used as they are when the next step's adapters and held shapes are those they were laid out
for; otherwise (an adapter diverged or was pruned, a checkpoint is due: `discard_ahead`) each
adapter's stream is put back where it was, and the next step draws its rows itself. Either
way every adapter trains on the rows, in the order, it would have trained on without.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from plora.data.dataset import IGNORE_INDEX, Sample
from plora.job.config import JobTraining
from plora.train.adapter_pack import AdapterPack
from plora.train.adapter_run import AdapterRun
from plora.train.packed.inject import PackedModel
from plora.train.packed.head_loss import (adapter_loss_sums, adapter_mean_losses, final_hidden, head_chunk_rows,
                                          head_dtype)
from plora.train.packed.rows import LabelParts
from plora.train.packed.step_batch import StepBatch
from plora.train.packed.tp import TensorParallel
from plora.train.row_stream import TrainRows
from plora.train.step_graph import Composition, StepBuffers, StepGraph, step_inputs


@dataclass
class RowsAhead:
    """The next step's rows, drawn and laid out while the step before ran (module docstring):
    for the adapters ``runs`` in ``slots``, each one's stream before they were drawn, and the
    batch as laid out against the shapes ``held`` then."""

    runs: list[AdapterRun]
    slots: list[int]
    streams: list[dict[str, Any]]
    parts: list[list[Sample]]
    held: tuple
    batch: StepBatch


@dataclass
class StepBooks:
    """What the host's books made of a step: adapters that diverged (with why), and the
    metrics.jsonl rows of those that stepped."""

    diverged: list[tuple[AdapterRun, str]] = field(default_factory=list)
    logged: list[dict[str, Any]] = field(default_factory=list)


class PackedStep:
    """Runs packed steps on a pack (`AdapterPack`) over its rows (`TrainRows`)."""

    def __init__(self, pm: PackedModel, pack: AdapterPack, rows: TrainRows, training: JobTraining, *,
                 device: torch.device, vocab_size: int, row_attention=None, graphs: StepGraph | None = None,
                 tp: TensorParallel | None = None, scales_in_key: bool = False):
        self.pm = pm
        self.pack = pack
        self.rows = rows
        #: the model's per-row attention (`install_row_attention`; None: rows are padded)
        self.row_attention = row_attention
        self.graphs = graphs
        self.tp = tp
        self.device = device
        self.grad_clip = training.grad_clip
        self.divergence_loss = training.divergence_loss
        self.micro_batch_size = training.micro_batch_size
        self.vocab_size = int(vocab_size)
        self.head_chunk = head_chunk_rows(self.vocab_size, pm.model, device)
        #: where a capture would bake the adapters' scales in, a graph is only for the scales it saw
        self.scales_in_key = scales_in_key
        self.real_tokens = 0  # non-padding tokens trained on (throughput)
        self.stepped_tokens = 0  # tokens the steps ran, padding included (a covering graph's too)
        #: the job's side lane (`plora.train.side_lane`; None: none): while it works, the model's
        #: state is the lane's, and a replayed step leaves it as it is
        self.lane = None
        #: each slot's rows in the last step (what a composition captured ahead is shaped by)
        self.last_parts: dict[int, list] = {}
        #: whether the next step's rows are laid out while a step runs (module docstring)
        self.step_ahead = False
        self._ahead: RowsAhead | None = None
        #: steps whose rows were laid out ahead: ``used``, or ``given_back`` (the job's summary)
        self.ahead_counts = {"used": 0, "given_back": 0}

    def run(self, active: list[AdapterRun], steps_left: int | None) -> list[list[float]]:
        """One optimizer step of ``active``; what the device reported (`device_step`'s ``out``).
        ``steps_left``: how many more steps this pack runs as it is (None: a join may change
        it first)."""
        ahead = self._take_ahead(active)
        parts = ahead.parts if ahead is not None else self.rows.next_parts(active)
        rows = [len(p) for p in parts]
        for r, n in zip(active, rows):
            r.last_rows = n
        ids = [r.index for r in active]
        self.last_parts = dict(zip(ids, parts))
        graphed = self.graphs is not None and self.graphs.enabled
        self.pack.set_learning_rates(active)
        planned = self.pack.planned(ids)  # a vacant slot's row says "leave alone"
        own = self.composition(ids, rows)
        use, batch = own, None
        if graphed:
            use = self.graphs.plan(own, lasts=steps_left)
            if use != own:
                batch = self.rows.covered_batch(parts, own, use, self.graphs.held_shapes(use, captured=True))
                if batch is None:
                    self.graphs.decline(own)
                    use = own
        if batch is None:
            held = tuple(self.graphs.held_shapes(own)) if graphed else ()
            if ahead is not None and use == own and ahead.held == held:
                batch = ahead.batch
            else:
                batch = self.rows.step_batch([x for part in parts for x in part], rows, graphed, held,
                                             self.rows.floors(active) if graphed else None)
        slots = list(use.slots)
        key = (use, batch.shape)
        inputs = step_inputs(batch)
        if self.rows.accumulates:  # the job's micro-batch, or an adapter's own (the planner's)
            inputs["accum"] = self.accumulation_inputs(active, slots)
        state = self.pm.state
        make, body = self._step_fns(key, slots, batch, inputs, planned)
        if graphed:
            buffers = self.graphs.run(use, batch.shape, make, (inputs, planned), body, own=own)
            if self.lane is None or not self.lane.busy:  # else the state is the lane's
                state.clear()
        else:
            buffers = make()
            try:
                self.device_step(buffers, batch)
            finally:
                state.clear()
        self.real_tokens += sum(len(x.tokens) for part in parts for x in part)
        self.stepped_tokens += batch.num_tokens
        if self.step_ahead and steps_left is not None and steps_left > 1 and not self.rows.accumulates:
            self._lay_out_ahead(active, graphed)  # while the device runs this step
        return _read_back(buffers.out)

    def _lay_out_ahead(self, active: list[AdapterRun], graphed: bool) -> None:
        """The next step's rows for ``active`` (none of which ends with this step), drawn and
        laid out now (module docstring)."""
        if graphed and self.rows.row_layout == "balanced" and any(r.floor is None for r in active):
            return  # a balanced step's sizes are an adapter's from where its stream is at its own step
        floors = self.rows.floors(active) if graphed else None
        streams = [r.stream.state_dict() for r in active]
        parts = self.rows.next_parts(active)
        rows = [len(p) for p in parts]
        own = self.composition([r.index for r in active], rows)
        held = tuple(self.graphs.held_shapes(own)) if graphed else ()
        batch = self.rows.step_batch([x for part in parts for x in part], rows, graphed, held, floors)
        self._ahead = RowsAhead(list(active), [r.index for r in active], streams, parts, held, batch)

    def _take_ahead(self, active: list[AdapterRun]) -> RowsAhead | None:
        """The rows laid out ahead, where they were laid out for ``active`` (the same adapters
        in the same slots); otherwise they are given back (`discard_ahead`) and None."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if (len(ahead.runs) == len(active) and all(a is b for a, b in zip(ahead.runs, active))
                and ahead.slots == [r.index for r in active]):
            self.ahead_counts["used"] += 1
            return ahead
        self._give_back(ahead)
        return None

    def discard_ahead(self) -> None:
        """Give back the rows laid out ahead, if any: each adapter's stream where it was before
        they were drawn. Before anything reads where a stream is (a checkpoint)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._give_back(ahead)

    def _give_back(self, ahead: RowsAhead) -> None:
        for r, state in zip(ahead.runs, ahead.streams):
            r.stream.load_state_dict(state)
        self.ahead_counts["given_back"] += 1

    def _launches_beside_layers(self) -> None:
        """What a step launches besides its layers' kernels, for `compile_kernels_ahead` to
        collect: the optimizer's norms and AdamW, and the loss's (in training and in evals)."""
        self.pack.optimizer_launches()
        if self.tp is None:
            from plora.kernels.cross_entropy import loss_launches

            loss_launches(head_dtype(self.pm.model), self.device, self.vocab_size, IGNORE_INDEX)

    def _step_fns(self, key: tuple, slots: list[int], batch: StepBatch, inputs: dict[str, torch.Tensor],
                  planned: torch.Tensor):
        """``make()``: a key's buffers, with the pack state its body reads (the kernels'
        schedules made ahead); ``body(buffers)``: the step on them."""
        state = self.pm.state

        def make() -> StepBuffers:
            buffers = StepBuffers.allocate(key, inputs, planned, slots, self.pack.num_slots, self.device)
            state.set_batch(slots, batch.segment_tokens, self.device)
            self.pm.compile_kernels_ahead(training=True, also=self._launches_beside_layers)
            buffers.meta = state.meta
            return buffers

        def body(b: StepBuffers) -> None:
            state.use(slots, b.meta)  # an eval since the last step may have cleared it
            self.device_step(b, batch)

        return make, body

    def ahead(self, runs: list[AdapterRun]) -> tuple[tuple, Any] | None:
        """The key of the composition ``runs`` will train in once the others have left, and
        the side lane's task that captures its graph (`StepGraph.capture_ahead`); None where
        it is not wanted (its graphs are held, or its step would not fit beside them).

        Its batch is laid out from each adapter's rows of the last step: with fixed-length
        rows, or balanced ones (whose shape holds every step of the composition), that is the
        shape its steps take; where a step's rows need another, that step captures its own."""
        graphs = self.graphs
        if graphs is None or self.rows.accumulates or any(r.index not in self.last_parts for r in runs):
            return None
        ids = [r.index for r in runs]
        parts = [self.last_parts[k] for k in ids]
        rows = [len(p) for p in parts]
        own = self.composition(ids, rows)
        batch = self.rows.step_batch([x for part in parts for x in part], rows, True, (), self.rows.floors(runs))
        if not graphs.ahead_wanted(own, batch.num_tokens):
            return None
        # the optimizer table's values are each replay's (`StepBuffers.fill`); the capture reads its place
        key = (own, batch.shape)
        make, body = self._step_fns(key, ids, batch, step_inputs(batch), self.pack.planned(ids))
        state = self.pm.state

        def capture_body(b: StepBuffers) -> None:
            try:
                body(b)
            finally:
                state.clear()

        return key, graphs.capture_ahead(make, capture_body)

    @staticmethod
    def accumulation_inputs(active: Sequence[AdapterRun], slots: list[int]) -> torch.Tensor:
        """What the step needs of each slot's accumulation (float32 [4, slots], the batch's
        slot order): the label tokens its loss is over (0: this step's own), whether its
        gradient starts from zero, whether its optimizer may step, and its loss so far. A
        one-pass adapter (and a vacant slot): 0, 1, 1, 0 (what a step without accumulation does)."""
        by_slot = {r.index: r for r in active}
        cols = []
        for k in slots:
            r = by_slot.get(k)
            if r is None or r.parts == 1:
                cols.append((0.0, 1.0, 1.0, 0.0))
            else:
                cols.append((float(r.cycle_labels), float(r.micro == 0), float(r.micro == r.parts - 1), r.partial))
        return torch.tensor(cols, dtype=torch.float32).t().contiguous()

    def composition(self, ids: list[int], rows: list[int]) -> Composition:
        """What this step's graph is keyed on besides its batch shape (`Composition`): the
        slots, their rows, and their scales only where a capture would bake them in."""
        scales = tuple(self.pack.scale(k) for k in ids) if self.scales_in_key else ()
        return Composition(tuple(ids), tuple(rows), scales)

    def device_step(self, b: StepBuffers, spec: StepBatch) -> None:
        """Forward, per-adapter losses, backward, norms, clipping and AdamW, all on the
        device; results go to ``b.out``. An adapter whose loss is non-finite (or over
        ``divergence_loss``) or whose gradient norm is non-finite does not step: its rows
        of the batch are its own (attention, norms and the loss are per row; its LoRA
        gradients are its own segment), so whatever it computes cannot reach another.

        The LM head and the loss run only where labels are, in chunks (`adapter_mean_losses`);
        flattened rows attend only within themselves while the step runs (forward and the
        recomputations of backward). ``spec``: this step's batch on the host (a replayed
        graph keeps the sizes of the one it was captured with, which ``spec`` shares)."""
        pm, row_attn, slots = self.pm, self.row_attention, self.pack.num_slots
        acc = b.inputs.get("accum")  # `accumulation_inputs`; None: every adapter in one pass
        if acc is None:
            self.pack.zero_grad()
        else:  # an adapter mid-batch keeps its gradient; every other one (in the batch or not) starts at 0
            zero = torch.ones(slots, dtype=torch.bool, device=acc.device)
            self.pack.zero_grad(zero.index_copy_(0, b.active, acc[1] > 0))
        # under TP, the parts summed so far stay out of this step's all-reduce
        held = self.tp.take_reduced_grads() if self.tp is not None and acc is not None else None
        if pm.state.has_dropout:  # each adapter's masks follow its own step (`plora.train.packed.dropout`)
            pm.state.set_dropout(b.planned[:, 0], None if spec.flat else int(b.tokens.shape[-1]))
        try:
            if spec.flat:
                row_attn.set(spec.row_lengths, b.inputs.get("cu_seqlens"), spec.max_len)
            hidden = final_hidden(pm.model, b.tokens, b.inputs.get("positions"))
            labels = LabelParts(b.inputs["label_index"], b.inputs["label_targets"], spec.labels.sizes,
                                spec.labels.counts)
            flat_hidden = hidden.reshape(-1, hidden.shape[-1])
            if acc is None:
                losses = torch.stack(adapter_mean_losses(pm.model.output, flat_hidden, labels, self.head_chunk))
            else:  # a part's loss is over the label tokens of its whole effective batch
                sums, counts = adapter_loss_sums(pm.model.output, flat_hidden, labels, self.head_chunk)
                over = torch.where(acc[0] > 0, acc[0], torch.stack(counts).clamp(min=1).to(acc.dtype))
                losses = torch.stack(sums) / over
            del hidden, flat_hidden
            values = losses.detach().float()
            if self.tp is not None:  # rank 0's losses: one divergence decision on every rank
                self.tp.broadcast_(values)
            ok = torch.isfinite(values)
            total, last = values, None  # the effective batch's loss so far; whether the optimizer may step
            if acc is not None:
                total, last = values + acc[3], acc[2] > 0
            if self.divergence_loss is not None:  # on the whole batch's loss, at its last part
                within = total <= self.divergence_loss
                ok &= within if last is None else (within | ~last)
            torch.where(ok, losses, torch.zeros_like(losses)).sum().backward()
        finally:
            if row_attn is not None:
                row_attn.clear()
        if self.tp is not None:  # partial gradients of replicated LoRA tensors
            self.tp.reduce_grads()
            if held is not None:
                self.tp.give_back_grads(held)
        k = slots
        loss_k = torch.full((k,), float("nan"), dtype=torch.float32, device=values.device)
        loss_k.index_copy_(0, b.active, total)
        go = torch.zeros(k, dtype=torch.bool, device=values.device)
        go.index_copy_(0, b.active, ok if last is None else ok & last)
        norms = self.pack.sq_norms().sqrt()
        go &= torch.isfinite(norms)
        if self.grad_clip is not None:  # as torch's clip_grad_norm_, per adapter
            coef = (self.grad_clip / (norms + 1e-6)).clamp(max=1.0)
        else:
            coef = torch.ones_like(norms)
        self.pack.step_where(b.planned, go, coef)
        b.out[0].copy_(loss_k)
        b.out[1].copy_(norms)
        b.out[2].copy_(self.pack.sq_norms(of_weights=True).sqrt())
        b.out[3].zero_().index_copy_(0, b.active, ok.float())
        b.out[4].copy_(go)

    def account(self, active: list[AdapterRun], step: int, out: list[list[float]]) -> StepBooks:
        """The host's books after a step, from what `device_step` decided and reported: its
        decisions are read back, not made again, so the steps counted here are the steps the
        device took. Adapters that diverged are returned, not removed: leaving the pack is
        the recipe's."""
        losses, norms, weight_norms, loss_ok, went = out
        books = StepBooks()
        stepped = []
        for r in active:
            k = r.index
            value = losses[k]
            if not loss_ok[k]:
                books.diverged.append((r, f"loss {value} at step {r.step}"))
                continue
            if r.micro < r.parts - 1:  # a part of its batch: its optimizer steps after the last
                r.micro += 1
                r.partial = value  # the batch's loss so far (the device added this part's)
                continue
            r.micro, r.cycle, r.cycle_stream, r.partial = 0, [], None, 0.0
            r.losses.append(value)
            if not went[k]:
                books.diverged.append((r, f"gradient norm {norms[k]} at step {r.step}"))
                continue
            books.logged.append({"step": step, "adapter": r.id, "adapter_step": r.step, "loss": value,
                                 "lr": self.pack.learning_rate(k), "grad_norm": norms[k]})
            stepped.append(r)
        self.pack.count_steps([r.index for r in stepped])
        for r in stepped:
            r.step += 1
            if not math.isfinite(weight_norms[r.index]):
                books.diverged.append((r, f"non-finite weights after step {r.step}"))
        return books


def _read_back(out: torch.Tensor) -> list[list[float]]:
    """A step's report on the host. On a GPU the wait for the step is a stream
    synchronisation, which lets go of the interpreter (``tolist`` on a device tensor holds
    it while it waits): the side lane's work goes on meanwhile."""
    if out.device.type != "cuda":
        return out.tolist()
    host = out.to("cpu", non_blocking=True)
    torch.cuda.current_stream(out.device).synchronize()
    return host.tolist()
