"""torchtune recipe: train K LoRA adapters packed on one frozen base model.

Run as ``tune run plora/recipes/packed_lora.py --config job.yaml`` (what `plora sweep`
does for each job), or in-process with ``PackedLoRARecipe(cfg).run()``.

One step: every active adapter draws its own micro-batch from its own seeded data order;
the rows are concatenated adapter by adapter, flattened without padding (each row with its
own positions and attention, `plora.packed.step_batch`); the base model runs once; the LM
head and the loss run only where labels are (`plora.packed.head_loss`); the loss is the sum
of per-adapter mean losses, so each adapter's gradient is exactly its own. Clipping,
learning rate, warm-up and schedule are per adapter (`PackedAdamW` over one flat buffer of
every adapter's weights: one launch per step for the whole pack). With
``training.micro_batch_size``, an adapter whose batch is larger trains it over several
packed steps and steps its optimizer after the last (`plora.accumulation`); others in the
same pack step every packed step. An adapter
whose loss or gradient turns NaN/inf is marked ``diverged`` and leaves the batch; one whose
budget is done is evaluated, saved in the PEFT format and leaves the batch.

Adapters may also join a running job (`plora.jobcontrol`: control.json's ``join`` list):
at a step boundary each takes the slot of an adapter that has left, or the pack is laid
out again (`plora.packed.slots`), and it trains as it would alone. A job with
``streaming.linger_s`` waits that long for joins once its adapters have all left.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException
from pydantic import ValidationError
from torchtune.config._errors import ConfigError

from plora import hooks
from plora.accumulation import accumulation_steps, split_batch
from plora.data import (
    IGNORE_INDEX,
    AdapterStream,
    DataError,
    Sample,
    TextTokenizer,
    prepare_data,
    synthetic_samples,
)
from plora.balanced_stream import BalancedStream
from plora.evaluate import evaluate_adapters
from plora.heap import frozen_heap
from plora.jobconfig import JobAdapter, JobConfig
from plora.jobcontrol import (
    JobControl,
    JoinRecord,
    append_join,
    read_joins,
)
from plora.jobphases import PhaseClock
from plora.kernels import scales_on_device
from plora.metrics import generated_metrics, metric_name, use_metric_paths
from plora.models import ModelError
from plora.packed.bank import LoRABank, PackedAdamW
from plora.packed.head_loss import adapter_loss_sums, adapter_mean_losses, chunk_rows, final_hidden
from plora.packed.inject import inject_packed_lora
from plora.packed.layer import AdapterSpec
from plora.packed.rows import LabelParts
from plora.packed.slots import NewAdapter, refill_slot, relayout
from plora.packed.step_batch import StepBatch, build_step_batch, row_labels
from plora.packed.tp import TensorParallel, close_tp, init_tp, tp_degree
from plora.packed.varlen_attention import install_row_attention
from plora.quantize.cost import check_tp
from plora.recipes import preload
from plora.recipes.adapter_writer import AdapterWriter
from plora.recipes.checkpoint import JobCheckpointer
from plora.recipes.epochs import better_epoch, epoch_ends, epoch_record, flat_weights, load_flat_weights
from plora.recipes.step_graph import Composition, StepBuffers, StepGraph, step_inputs
from plora.row_layout import length_buckets_for, rows_flattened
from plora.step_settings import graphs_wanted

#: exit code of a job that ran out of memory: the engine splits it and re-queues the halves
EXIT_OOM = 3
#: exit code of a job whose model, data or config cannot be used (retrying cannot fix it);
#: the message is in UNFIXABLE_FILE in the job's folder (torchrun reports any failure as 1)
EXIT_UNFIXABLE = 4
UNFIXABLE_FILE = "error.json"
UNFIXABLE_ERRORS: tuple[type[BaseException], ...] = (ModelError, DataError, ConfigError, OmegaConfBaseException,
                                                      ValidationError)
#: learning rates are capped here; see train_step
MAX_LR = 1e37  # lr / (1 - beta1) must stay under float32 max (3.4e38)
#: how often a job lingering for joins looks at its control.json
LINGER_POLL_S = 0.05
#: what identifies every adapter's configuration (metrics.json's ``config`` has them all)
BASE_HYPERPARAMETERS = ("rank", "alpha", "learning_rate", "batch_size", "seed")
#: what an adapter that left the pack has as its status
FINAL_STATUSES = ("done", "diverged", "pruned")


def lr_factor(step: int, total: int, warmup: int, scheduler: str) -> float:
    """Multiplier of an adapter's base LR at its own step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    if scheduler == "constant":
        return 1.0
    if scheduler == "linear":
        return max(0.0, 1.0 - progress)
    if scheduler == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    raise ValueError(f"unknown scheduler {scheduler!r}")


@dataclass
class AdapterRun:
    """One adapter's progress inside the job. ``index``: its slot in the pack (None once
    the slot was given back); ``joined_at``: the job step it joined at (None: in the job
    from its start)."""

    index: int | None
    cfg: JobAdapter
    stream: AdapterStream
    step: int = 0
    status: str = "running"  # running | done | diverged | pruned
    losses: list[float] = field(default_factory=list)
    reason: str = ""
    finished_at: float | None = None
    joined_at: int | None = None
    #: the largest batch its stream draws from here on (tokens, labels), for a balanced step's shape
    floor: tuple[int, int] | None = None
    #: seconds it trained in earlier attempts of its job (from its checkpoint): its wall
    #: time counts them, so that a resumed adapter's time is not only the last attempt's
    earlier_s: float = 0.0
    #: the adapter steps its epochs end at, the last with its budget (`plora.recipes.epochs`);
    #: None until the job has worked them out
    epoch_ends: list[int] | None = None
    #: each finished epoch's scores (`epoch_record`), with ``eval.each_epoch``
    epochs: list[dict[str, Any]] = field(default_factory=list)
    #: the best finished epoch so far (its number), and its weights as a flat host copy
    best_epoch: int | None = None
    best_weights: torch.Tensor | None = None
    #: packed steps one optimizer step spans (`plora.accumulation`; 1: its batch in one pass)
    parts: int = 1
    #: the part of its effective batch the next packed step trains (0: a new batch is drawn)
    micro: int = 0
    #: the current effective batch, in parts; its label tokens (every part's loss is over
    #: them); the loss of its parts so far; the stream's position before it was drawn (what
    #: a checkpoint saves: an adapter mid-batch resumes from the start of that batch, its
    #: weights and moments being those of its last optimizer step)
    cycle: list[list[int]] = field(default_factory=list)
    cycle_labels: int = 0
    partial: float = 0.0
    cycle_stream: dict[str, Any] | None = None
    #: rows it put in the last packed step
    last_rows: int = 0

    @property
    def id(self) -> str:
        return self.cfg.id

    @property
    def total_steps(self) -> int:
        return self.cfg.steps

    @property
    def warmup(self) -> int:
        return self.cfg.warmup_steps

    @property
    def scheduler(self) -> str:
        return self.cfg.scheduler or "constant"

    @property
    def active(self) -> bool:
        return self.status == "running"

    @property
    def at_boundary(self) -> bool:
        """Whether its next packed step starts a new effective batch (and its last, if any,
        ended with an optimizer step)."""
        return self.micro == 0

    @property
    def packed_steps_taken(self) -> int:
        return self.step * self.parts + self.micro

    def next_rows(self, label_counts: list[int]) -> list[int]:
        """The rows of its next packed step: its whole batch in one pass, or the next part
        of the effective batch it draws whole (one pass's rows, in one pass's order)."""
        b = self.cfg.batch_size
        if self.parts == 1:
            return self.stream.next(b)
        if self.micro == 0:
            self.cycle_stream = self.stream.state_dict()
            rows = self.stream.next(b)
            self.cycle = split_batch(rows, self.parts)
            self.cycle_labels = sum(label_counts[i] for i in rows)
            self.partial = 0.0
        return self.cycle[self.micro]

    def stream_state(self) -> dict[str, Any]:
        """Where a checkpoint resumes its data from: the start of its current effective batch."""
        return self.cycle_stream if self.cycle_stream is not None else self.stream.state_dict()


class PackedLoRARecipe:
    """One packed job, shaped as torchtune's recipes are: `__init__` reads the (typed) job
    config, `setup` builds the model, data, optimizer and graphs, `train` runs the loop
    (evaluating and saving adapters as they leave), `cleanup` releases what the job holds.
    `run` does all three, as `recipe_main` does."""

    def __init__(self, cfg: JobConfig | DictConfig | Mapping[str, Any]):
        self.cfg = JobConfig.parse(cfg)  # a typo or a bad value in the job file fails here
        c = self.cfg
        self.job_id = c.job_id
        self.output_dir = c.output_dir
        self.job_dir: Path = c.job_dir
        self.attempt = int(os.environ.get("PLORA_ATTEMPT", "1"))
        self.targets = list(c.lora.targets)
        self.max_seq_len = c.model.max_seq_len
        self.grad_clip = c.training.grad_clip
        self.divergence_loss = c.training.divergence_loss
        self.micro_batch_size = c.training.micro_batch_size
        self._metrics_file = None  # what cleanup() closes, whether or not setup() got that far
        self.writer: AdapterWriter | None = None  # likewise

    def setup(self) -> None:
        """Build the job: process group (TP), base model with the packed adapters, data,
        optimizer, step graphs, checkpointer."""
        c = self.cfg
        if c.num_threads:
            torch.set_num_threads(c.num_threads)
        self.device = _pick_device(c.device)
        # TP > 1: one process per GPU under torchrun (WORLD_SIZE); rank 0 writes every file.
        self.tp: TensorParallel | None = None
        if tp_degree(c.tp) > 1:
            check_tp(c.model.quantize, tp_degree(c.tp))  # a quantized base: one process a job
            self.tp, self.device = init_tp(self.device)
        self.is_main = self.tp is None or self.tp.is_main
        self.clock = PhaseClock()  # what the job spends outside its steps, for the cost model
        torch.manual_seed(c.seed)
        self.job_dir.mkdir(parents=True, exist_ok=True)

        t_load = time.perf_counter()
        # a model this process loaded before the job was handed to it (`plora.recipes.preload`)
        model, self.info = preload.load(preload.ModelKey.of(c.model.path, c.model.family, c.model.max_seq_len,
                                                            c.model.dtype, self.device, c.model.random_init))
        self.clock.loaded(time.perf_counter() - t_load)
        rejoined = self._rejoined()  # adapters that joined an earlier attempt and did not finish
        adapters = list(c.adapters) + [a for a, _ in rejoined]
        adapters = [self._own(a) for a in adapters]
        specs = [self._spec(a) for a in adapters]
        self.pm = inject_packed_lora(model, specs, self.targets)
        # rows flattened without padding, attention confined to each (None: padded rows)
        self.row_attn = install_row_attention(self.pm.model)
        if self.tp is not None:  # before the optimizer: it must see the local shards
            self.tp.shard(self.pm)
        if c.model.quantize:  # the block linears to NF4, the adapters stay in the dtype (`plora.quantize.nf4`)
            from plora.quantize.nf4 import quantize_base

            self.quantized = quantize_base(self.pm.model, c.model.quantize)
        t = c.training
        if t.activation_checkpointing:
            # Each decoder layer is recomputed in backward; the pack's state stays set until
            # after backward (train_step), so the recomputed LoRA rows are the same rows.
            from torchtune.modules import TransformerSelfAttentionLayer
            from torchtune.training import set_activation_checkpointing

            set_activation_checkpointing(self.pm.model, auto_wrap_policy={TransformerSelfAttentionLayer})
        self.pm.model.train()
        self.dtype = self.pm.model.tok_embeddings.weight.dtype
        self.head_chunk = chunk_rows(int(self.info.vocab_size))
        self.real_tokens = 0  # non-padding tokens trained on (throughput)
        self.stepped_tokens = 0  # tokens the steps ran, padding included (a covering graph's too)

        self.tok = TextTokenizer(self.info.path, self.info.eos_token_id, self.info.pad_token_id)
        synthetic = c.data.synthetic
        if synthetic is not None:  # profiling and benchmarks: fixed-length random rows, no eval
            self.train_samples = synthetic_samples(synthetic.num_samples, synthetic.seq_len, self.info.vocab_size)
            self.eval_samples, self.eval_examples = [], []
        else:
            use_metric_paths(c.eval.python_path)
            data = prepare_data(c.data, c.eval, self.tok, self.max_seq_len)
            self.train_samples, self.eval_samples, self.eval_examples = data.train, data.eval, data.eval_examples

        self.graphs: StepGraph | None = None
        if graphs_wanted(t.cuda_graphs, self.device, tp=self.tp is not None,
                         activation_checkpointing=t.activation_checkpointing):
            self.graphs = StepGraph(self.device)
            self.graphs.cover = t.cover_vacant_slots
        graphed = self.graphs is not None
        # where a capture would bake the adapters' scales in, a graph is only for the scales it saw
        self._scales_in_key = graphed and not scales_on_device(self.device)
        buckets = length_buckets_for(t.length_buckets, flattened=self._rows_flat(graphed), graphed=graphed)
        self._stream_lengths = [len(s.tokens) for s in self.train_samples]
        self._label_counts = [row_labels(s) for s in self.train_samples]
        self._stream_buckets = buckets
        joined_at = {a.id: s for a, s in rejoined}
        self.runs = [self._run(i, a, joined_at.get(a.id)) for i, a in enumerate(adapters)]
        # after TP sharding: the bank lays out the local shards
        self.bank = LoRABank(self.pm, share=self.tp.share if self.tp else None)
        self.optimizer = PackedAdamW(self.bank, [a.learning_rate for a in adapters],
                                     weight_decay=[a.weight_decay for a in adapters])
        self._metrics_file = open(self.job_dir / "metrics.jsonl", "a") if self.is_main else None
        # leaving adapters' files are written while the pack trains on (one process: no collectives)
        self.writer = AdapterWriter(background=self.tp is None)
        self._last_progress = 0.0
        self._control_seen: tuple[int, int, int] | None = None  # control.json's (inode, mtime, size) last read
        self._pending_joins: list[JobAdapter] = []  # asked for, not taken yet (no room)
        self._join_after: dict[str, set[str]] = {}  # join id -> adapters it waits for to leave
        self._closed = False  # control.json said no more joins will come
        self.checkpointer = JobCheckpointer(self, t.checkpoint_every_steps, t.checkpoint_every_minutes)
        self.resumed: dict[str, int] = {}  # adapter id -> the adapter step it resumed from
        self.start_time = time.time()
        self.clock.set_up(self.eval_samples)

    def run(self) -> dict[str, Any]:
        """The whole job in this process: setup, train, cleanup (what `recipe_main` runs);
        the job's summary."""
        self.setup()
        try:
            return self.train()
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        """Release what the job holds open: its metrics log (flushed and closed). Safe after
        a setup that failed part way, and twice."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None

    # ------------------------------------------------------------------ training
    def train(self) -> dict[str, Any]:
        """Train until every adapter has left the pack (and, with ``streaming.linger_s``, no
        join came in that time); the job's summary (also summary.json). The ``after_step``
        hook (`plora.hooks`) fires after each optimizer step, before finished adapters
        leave: tests look in there."""
        if self.cfg.eval_base:
            with self.clock.timed("eval_base_s"):
                self._eval_base()
        self.resumed = self.checkpointer.restore()
        step = self.checkpointer.job_step
        # Time in optimizer steps after the first (which pays kernel compilation): what the
        # cost model predicts. The rest of the job's wall time is its fixed overhead; the
        # engine re-plans with the two measured apart.
        first_step_s = steps_s = 0.0
        with frozen_heap():  # no full garbage collections of the model's objects mid-step
            while True:
                self._check_control(step)  # prunes, then joins: a freed slot is refilled at once
                active = self._active()
                if not active:
                    if self._linger(step):
                        continue
                    break
                t_step = time.perf_counter()
                stepped_before = self.stepped_tokens
                self.train_step(active, step)
                dt = time.perf_counter() - t_step
                self.clock.step([r.index for r in active], dt,
                                reused=self.graphs is not None and self.graphs.last_run in ("replay", "cover"),
                                ranks=[r.cfg.rank for r in active], rows=[r.last_rows for r in active],
                                tokens=self.stepped_tokens - stepped_before, device=self.device)
                if step == self.checkpointer.job_step:
                    first_step_s = dt
                else:
                    steps_s += dt
                hooks.fire("after_step", recipe=self, step=step)
                step += 1
                self._intermediate_eval(active)
                self._epoch_evals(active, step)
                finished = [r for r in active if r.active and r.step >= r.total_steps]
                if finished:
                    self._finish(finished, "done")
                if self.checkpointer.maybe_save(step) and self._metrics_file is not None:
                    self._metrics_file.flush()  # the log holds at least what the checkpoint does
                self._write_progress(step)
        self.writer.drain()  # every leaving adapter's files are on disk before the job says it is done
        self.checkpointer.discard()
        self._write_progress(step, final=True)
        self.clock.graphs = self.graphs.counts.to_dict() if self.graphs is not None else None
        summary = {
            "job_id": self.job_id,
            "steps": step,
            "resumed_from": self.resumed,
            "wall_time_s": time.time() - self.start_time,
            "first_step_s": first_step_s,
            "step_time_s": steps_s,  # steps 2..n
            "adapters": {r.id: r.status for r in self.runs},
            "joined": {r.id: r.joined_at for r in self.runs if r.joined_at is not None},
            "tokens": {"real": self.real_tokens, "stepped": self.stepped_tokens},
            "phases": self.clock.to_dict(),
        }
        if self.is_main:
            (self.job_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def train_step(self, active: list[AdapterRun], step: int) -> None:
        """One optimizer step of the active adapters, with one host sync.

        The step's decisions per adapter (a non-finite or too-large loss, a non-finite
        gradient norm, the clipping coefficient) are made on the device (`_device_step`);
        the host reads the losses and norms back once and keeps the books: so the same step
        runs eagerly or replayed from a CUDA graph (`StepGraph`), its own or that of a held
        composition covering it (the rows this step lacks fed padding, `_covered_batch`).
        """
        parts, rows = [], []
        for r in active:
            idx = r.next_rows(self._label_counts)
            parts.append([self.train_samples[i] for i in idx])
            rows.append(len(idx))
            r.last_rows = len(idx)
        ids = [r.index for r in active]
        graphed = self.graphs is not None and self.graphs.enabled
        for r in active:
            lr = r.cfg.learning_rate * lr_factor(r.step, r.total_steps, r.warmup, r.scheduler)
            # lr / (1 - beta1) goes to the device as float32: a larger value would turn one
            # absurd adapter's step into inf before its weights could show it.
            self.optimizer.lrs[r.index] = min(lr, MAX_LR)
        planned = self.optimizer.planned_hyperparams(ids)  # a vacant slot's row says "leave alone"
        own = self._composition(ids, rows)
        use, batch = own, None
        if graphed:
            use = self.graphs.plan(own, lasts=self._steps_left(active))
            if use != own:
                batch = self._covered_batch(parts, own, use)
                if batch is None:
                    self.graphs.decline(own)
                    use = own
        if batch is None:
            batch = self._step_batch([x for part in parts for x in part], rows, own, graphed,
                                     self._floors(active) if graphed else None)
        slots = list(use.slots)
        key = (use, batch.shape)
        inputs = step_inputs(batch)
        if self.micro_batch_size is not None:
            inputs["accum"] = self._accumulation_inputs(active, slots)

        def make() -> StepBuffers:
            buffers = StepBuffers.allocate(key, inputs, planned, slots, self.bank.num_adapters, self.device)
            self.pm.state.set_batch(slots, batch.segment_tokens, self.device)
            buffers.meta = self.pm.state.meta
            return buffers

        if graphed:
            def body(b: StepBuffers) -> None:
                self.pm.state.use(slots, b.meta)  # an eval since the last step may have cleared it
                self._device_step(b, batch)

            buffers = self.graphs.run(use, batch.shape, make, (inputs, planned), body, own=own)
            self.pm.state.clear()
        else:
            buffers = make()
            try:
                self._device_step(buffers, batch)
            finally:
                self.pm.state.clear()
        self.real_tokens += sum(len(x.tokens) for part in parts for x in part)
        self.stepped_tokens += batch.num_tokens
        self._account(active, step, buffers.out.tolist())

    @staticmethod
    def _accumulation_inputs(active: list[AdapterRun], slots: list[int]) -> torch.Tensor:
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

    def _composition(self, ids: list[int], rows: list[int]) -> Composition:
        """What this step's graph is keyed on besides its batch shape (`Composition`): the
        slots, their rows, and their scales only where a capture would bake them in."""
        scales = tuple(self.pm.state.adapters[k].scale for k in ids) if self._scales_in_key else ()
        return Composition(tuple(ids), tuple(rows), scales)

    def _steps_left(self, active: list[AdapterRun]) -> int | None:
        """How many more steps this pack runs as it is, where no join can change it first
        (the next adapter to finish ends it); None where one may (a streaming job)."""
        if self._pending_joins or (self.cfg.streaming.linger_s > 0 and not self._closed):
            return None
        return min((r.total_steps - r.step) * r.parts - r.micro for r in active)

    def _covered_batch(self, parts: list[list], own: Composition, cover: Composition) -> StepBatch | None:
        """This step's rows laid out as ``cover``'s: each active slot its own rows, then
        one-token padding rows up to its rows in ``cover`` (a vacant slot: only those), in a
        shape ``cover`` has a graph of; None when the rows fit none of its shapes. Padding
        rows have no labels (a vacant slot's loss is 0, and its optimizer row says "leave
        alone"); every row is alone in its attention, a vacant slot's through its old
        adapter's weights."""
        mine = dict(zip(own.slots, parts))
        pad = Sample([self.tok.pad_id], [IGNORE_INDEX])
        samples: list = []
        for k, n in zip(cover.slots, cover.rows):
            part = mine.get(k, [])
            samples.extend(part + [pad] * (n - len(part)))
        held = self.graphs.held_shapes(cover, captured=True)
        batch = build_step_batch(samples, list(cover.rows), self.tok.pad_id, flat=self._rows_flat(True), fixed=True,
                                 held=held, max_width=self.max_seq_len)
        return batch if batch.shape in held else None

    def _step_batch(self, samples: list, rows: list[int], own: Composition, graphed: bool,
                    floors: tuple[list[int], list[int]] | None = None) -> StepBatch:
        """Flattened rows when attention can be confined to rows (and, for a CUDA graph,
        read its row boundaries from the device) and ``training.row_layout`` allows it
        ("auto": not in graph-replayed steps, see the spec); padded rows otherwise.
        ``floors``: a balanced step's sizes (`_floors`)."""
        flat = self._rows_flat(graphed)
        held = self.graphs.held_shapes(own) if graphed else ()
        return build_step_batch(samples, rows, self.tok.pad_id, flat=flat, fixed=graphed, held=held,
                                max_width=self.max_seq_len, floors=floors if flat else None)

    def _rows_flat(self, graphed: bool) -> bool:
        return (self.row_attn is not None and rows_flattened(self.cfg.training.row_layout, graphed=graphed)
                and (not graphed or self.row_attn.graph_safe(self.device, self.dtype)))

    def _device_step(self, b: StepBuffers, spec: StepBatch) -> None:
        """Forward, per-adapter losses, backward, norms, clipping and AdamW, all on the
        device; results go to ``b.out``. An adapter whose loss is non-finite (or over
        ``divergence_loss``) or whose gradient norm is non-finite does not step: its rows
        of the batch are its own (attention, norms and the loss are per row; its LoRA
        gradients are its own segment), so whatever it computes cannot reach another.

        The LM head and the loss run only where labels are, in chunks (`adapter_mean_losses`);
        flattened rows attend only within themselves while the step runs (forward and the
        recomputations of backward). ``spec``: this step's batch on the host (a replayed
        graph keeps the sizes of the one it was captured with, which ``spec`` shares)."""
        acc = b.inputs.get("accum")  # `_accumulation_inputs`; None: every adapter in one pass
        if acc is None:
            self.bank.zero_grad()
        else:  # an adapter mid-batch keeps its gradient; every other one (in the batch or not) starts at 0
            zero = torch.ones(self.bank.num_adapters, dtype=torch.bool, device=acc.device)
            self.bank.zero_grad_where(zero.index_copy_(0, b.active, acc[1] > 0))
        # under TP, the parts summed so far stay out of this step's all-reduce
        held = self.tp.take_reduced_grads() if self.tp is not None and acc is not None else None
        if self.pm.state.has_dropout:  # each adapter's masks follow its own step (`plora.packed.dropout`)
            self.pm.state.set_dropout(b.planned[:, 0], None if spec.flat else int(b.tokens.shape[-1]))
        try:
            if spec.flat:
                self.row_attn.set(spec.row_lengths, b.inputs.get("cu_seqlens"), spec.max_len)
            hidden = final_hidden(self.pm.model, b.tokens, b.inputs.get("positions"))
            labels = LabelParts(b.inputs["label_index"], b.inputs["label_targets"], spec.labels.sizes,
                                spec.labels.counts)
            flat_hidden = hidden.reshape(-1, hidden.shape[-1])
            if acc is None:
                losses = torch.stack(adapter_mean_losses(self.pm.model.output, flat_hidden, labels, self.head_chunk))
            else:  # a part's loss is over the label tokens of its whole effective batch
                sums, counts = adapter_loss_sums(self.pm.model.output, flat_hidden, labels, self.head_chunk)
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
            if self.row_attn is not None:
                self.row_attn.clear()
        if self.tp is not None:  # partial gradients of replicated LoRA tensors
            self.tp.reduce_grads()
            if held is not None:
                self.tp.give_back_grads(held)
        k = self.bank.num_adapters
        loss_k = torch.full((k,), float("nan"), dtype=torch.float32, device=values.device)
        loss_k.index_copy_(0, b.active, total)
        go = torch.zeros(k, dtype=torch.bool, device=values.device)
        go.index_copy_(0, b.active, ok if last is None else ok & last)
        norms = self._sq_norms().sqrt()
        go &= torch.isfinite(norms)
        if self.grad_clip is not None:  # as torch's clip_grad_norm_, per adapter
            coef = (self.grad_clip / (norms + 1e-6)).clamp(max=1.0)
        else:
            coef = torch.ones_like(norms)
        self.optimizer.step_where(b.planned, go, coef)
        b.out[0].copy_(loss_k)
        b.out[1].copy_(norms)
        b.out[2].copy_(self._sq_norms(of_weights=True).sqrt())
        b.out[3].zero_().index_copy_(0, b.active, ok.float())
        b.out[4].copy_(go)

    def _account(self, active: list[AdapterRun], step: int, out: list[list[float]]) -> None:
        """The host's books after a step, from what `_device_step` decided and reported:
        its decisions are read back, not made again, so the steps counted here are the
        steps the device took."""
        losses, norms, weight_norms, loss_ok, went = out
        stepped = []
        for r in active:
            k = r.index
            value = losses[k]
            if not loss_ok[k]:
                self._diverge(r, f"loss {value} at step {r.step}")
                continue
            if r.micro < r.parts - 1:  # a part of its batch: its optimizer steps after the last
                r.micro += 1
                r.partial = value  # the batch's loss so far (the device added this part's)
                continue
            r.micro, r.cycle, r.cycle_stream, r.partial = 0, [], None, 0.0
            r.losses.append(value)
            if not went[k]:
                self._diverge(r, f"gradient norm {norms[k]} at step {r.step}")
                continue
            self._log({"step": step, "adapter": r.id, "adapter_step": r.step, "loss": value,
                       "lr": self.optimizer.lrs[k], "grad_norm": norms[k]})
            stepped.append(r)
        self.optimizer.count_steps([r.index for r in stepped])
        for r in stepped:
            r.step += 1
            if not math.isfinite(weight_norms[r.index]):
                self._diverge(r, f"non-finite weights after step {r.step}")

    def _drop_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.drop()

    def _room_for_eval(self) -> None:
        """An eval is next: the held graphs stay where the largest held step could still
        run eagerly beside them (the pack will likely replay them after), else they go
        first. The eval sizes its batches from half the free memory (`eval_token_budget`,
        which also counts the pool's free blocks): with a step's room beside the pool, that
        half is free."""
        if self.graphs is not None:
            self.graphs.make_room()

    def _sq_norms(self, of_weights: bool = False) -> torch.Tensor:
        """Every adapter's squared L2 norm (gradient, or weights) over the whole model: one
        launch, one all-reduce under TP; a device tensor [K]."""
        sq = self.bank.sq_norms(of_weights)
        if self.tp is not None:
            self.tp.reduce_sq_norms(sq)
        return sq

    # ---------------------------------------------------------- leaving the pack
    def _diverge(self, r: AdapterRun, reason: str) -> None:
        r.status, r.reason, r.finished_at = "diverged", reason, time.time()
        self._leave_early(r)

    def _leave_early(self, r: AdapterRun) -> None:
        """A diverged or pruned adapter's result: nothing, or, where it finished an epoch
        (``eval.each_epoch``), its best finished epoch's weights and scores (its status
        stays what it is; the reason says which epoch it keeps)."""
        if r.best_epoch is None or r.best_weights is None:
            self._write_adapter_metrics(r, {}, checkpoint=None)
            return
        r.reason = f"{r.reason}; kept epoch {r.best_epoch}"
        best = next(e for e in r.epochs if e["epoch"] == r.best_epoch)
        checkpoint = self._save_best([r])[0]
        self._write_adapter_metrics(r, self._epoch_metrics(best), checkpoint=checkpoint)

    def _finish(self, runs: list[AdapterRun], status: str) -> None:
        """Save adapters leaving the pack in the PEFT format, then evaluate them (packed),
        then drop their state. The weights are copied to the host before the eval runs and
        written while it runs (`AdapterWriter`), so an eval that fails cannot cost their
        training; one that runs out of memory retries in smaller pieces
        (`evaluate_adapters`). Each adapter's metrics.json follows its weights."""
        self._room_for_eval()
        t_save = time.perf_counter()
        checkpoints = self._save(runs)
        self.clock.saved(len(runs), time.perf_counter() - t_save)
        max_new = self.cfg.eval.max_new_tokens
        eval_metrics = list(self.cfg.eval.metrics) if self.eval_examples else []
        eval_clock = self.clock.eval_event(len(runs), max_new if generated_metrics(eval_metrics) else 0, self.device)
        metrics = self._evaluate([r.index for r in runs], metrics=eval_metrics, max_new_tokens=max_new)
        eval_clock.done()
        if self.cfg.eval.each_epoch and eval_metrics:
            metrics = self._keep_best_epoch(runs, metrics)
        for r, m, ckpt in zip(runs, metrics, checkpoints):
            r.status, r.finished_at = status, time.time()
            self._write_adapter_metrics(r, m, checkpoint=ckpt)

    # ------------------------------------------------------------------ epochs
    def _ends(self, r: AdapterRun) -> list[int]:
        """The adapter steps ``r``'s epochs end at (only its budget's end without
        ``eval.each_epoch``)."""
        if r.epoch_ends is None:
            r.epoch_ends = (epoch_ends(len(self.train_samples), r.cfg.batch_size, r.total_steps)
                            if self.cfg.eval.each_epoch else [r.total_steps])
        return r.epoch_ends

    def _epoch_evals(self, stepped: list[AdapterRun], step: int) -> None:
        """Adapters at the end of an epoch before their last are evaluated (packed, on the
        eval set, every metric, as their final eval is); each one's scores are kept, and its
        weights where the epoch is its best so far. A mid-job checkpoint follows (when the
        job takes them), so that a resumed job need not score the epoch again."""
        if not self.cfg.eval.each_epoch or not self.eval_examples:
            return
        due = [r for r in stepped if r.active and r.at_boundary and r.step < r.total_steps and r.step in self._ends(r)]
        if not due:
            return
        self._room_for_eval()
        max_new = self.cfg.eval.max_new_tokens
        eval_metrics = list(self.cfg.eval.metrics)
        eval_clock = self.clock.eval_event(len(due), max_new if generated_metrics(eval_metrics) else 0, self.device)
        metrics = self._evaluate([r.index for r in due], metrics=eval_metrics, max_new_tokens=max_new)
        eval_clock.done()
        for r, m in zip(due, metrics):
            if self._record_epoch(r, m):
                r.best_weights = flat_weights(self.bank.adapter_views(self.bank.weights, r.index))
        if self.checkpointer.enabled:
            self.checkpointer.save(step)

    def _record_epoch(self, r: AdapterRun, m: dict[str, float]) -> bool:
        """Add the epoch ``r`` has just finished to its scores; True when it is its best so far."""
        ends = self._ends(r)
        record = epoch_record(ends.index(r.step) + 1 if r.step in ends else len(r.epochs) + 1, r.step, m)
        r.epochs.append(record)
        best = next((e for e in r.epochs if e["epoch"] == r.best_epoch), None)
        objective = f"eval_{self.cfg.eval.objective or 'loss'}"
        if not better_epoch(record, best, objective, minimize=not self.cfg.eval.greater_is_better):
            return False
        r.best_epoch = record["epoch"]
        return True

    def _keep_best_epoch(self, runs: list[AdapterRun], metrics: list[dict[str, float]]) -> list[dict[str, float]]:
        """The last epoch's scores join each adapter's; where an earlier epoch is its best,
        that epoch's weights are saved over the last one's (after them: the writer keeps the
        order) and its scores are the adapter's. Returns each adapter's metrics.json scores."""
        out, earlier = [], []
        for r, m in zip(runs, metrics):
            last_best = self._record_epoch(r, m)
            if not last_best and r.best_weights is None:  # its best's weights unknown (an old checkpoint): the last
                r.best_epoch = r.epochs[-1]["epoch"]
            elif not last_best:
                earlier.append(r)
            best = next(e for e in r.epochs if e["epoch"] == r.best_epoch)
            out.append(self._epoch_metrics(best))
        if earlier:
            self._save_best(earlier)
        return out

    def _save_best(self, runs: list[AdapterRun]) -> list[Path | None]:
        """Save each adapter's best epoch's weights as its PEFT folder: the flat copy is put
        back into its (leaving) slot and saved from there, as any leaving adapter is."""
        for r in runs:
            load_flat_weights(self.bank.adapter_views(self.bank.weights, r.index), r.best_weights)
        return self._save(runs)

    def _save(self, runs: list[AdapterRun]) -> list[Path | None]:
        """Save leaving adapters' weights as they are in their slots, in the PEFT format (by
        the writer, in the background); their folders (None on a rank that does not write)."""
        if self.tp is None:  # one host copy of the bank for the whole leaving group
            states = self.bank.host_states([r.index for r in runs])
        else:  # gathered to full tensors (a collective, on every rank), saved by rank 0
            states = [self.tp.adapter_state_dict(r.index) for r in runs]
        items = [(self.output_dir / "adapters" / r.id, state,
                  dict(rank=r.cfg.rank, alpha=r.cfg.alpha, targets=self.targets, dropout=r.cfg.dropout or 0.0,
                       rslora=bool(r.cfg.rslora),
                       **({"base_quantize": self.cfg.model.quantize} if self.cfg.model.quantize else {})))
                 for r, state in zip(runs, states)]
        if not self.is_main:
            return [None] * len(runs)
        return self.writer.save_all(items, self.info, on_host=self.tp is None)

    @staticmethod
    def _epoch_metrics(best: dict[str, Any]) -> dict[str, Any]:
        """An epoch's eval scores, as metrics.json holds an adapter's."""
        return {k: v for k, v in best.items() if k.startswith("eval_")}

    def _evaluate(self, adapters: list[int | None], *, metrics: list[str], max_new_tokens: int,
                  samples: list[Sample] | None = None, examples: list[dict] | None = None) -> list[dict[str, float]]:
        """Packed eval of these adapters (None: the base model) on the eval set (or on
        ``samples`` / ``examples``), batches sized from the device's memory."""
        return evaluate_adapters(
            self.pm, adapters, self.eval_samples if samples is None else samples,
            self.eval_examples if examples is None else examples, self.tok,
            metrics=metrics, max_new_tokens=max_new_tokens, max_seq_len=self.max_seq_len,
            device=self.device, batch_rows=self.cfg.eval.batch_rows, token_budget=self.cfg.eval.token_budget,
        )

    def _intermediate_eval(self, stepped: list[AdapterRun]) -> None:
        """Every `eval.every_steps` of its own steps, and at the steps its config lists (a
        tune's rungs), an adapter's eval loss goes to evals.jsonl (learning curves), and, where
        the objective is not the loss, the objective scored on the intermediate slice
        (`_slice`): what a pruner decides on. Adapters due together are evaluated packed."""
        every = self.cfg.eval.every_steps
        if not self.eval_samples:
            return
        due = [r for r in stepped if r.active and r.at_boundary and r.step < r.total_steps
               and ((every and r.step % every == 0) or r.step in r.cfg.eval_steps)]
        if not due:
            return
        self._room_for_eval()
        ids = [r.index for r in due]
        objective = self._objective_metric()
        loss_metrics = ["loss"] + (["perplexity"] if objective == "perplexity" else [])
        eval_clock = self.clock.eval_event(len(due), 0, self.device)
        metrics = self._evaluate(ids, metrics=loss_metrics, max_new_tokens=1)
        eval_clock.done()
        scored: dict[str, Any] = {"objective": self.cfg.eval.objective} if self.cfg.eval.objective else {}
        if objective is not None and objective not in loss_metrics:
            samples, examples = self._slice()
            max_new = self.cfg.eval.max_new_tokens
            eval_clock = self.clock.eval_event(len(due), max_new if generated_metrics([objective]) else 0, self.device,
                                               samples=len(samples))
            for m, o in zip(metrics, self._evaluate(ids, metrics=[objective], max_new_tokens=max_new,
                                                    samples=samples, examples=examples)):
                m.update(o)
            eval_clock.done()
            scored["objective_samples"] = len(samples)
        if not self.is_main:
            return
        key = f"eval_{self.cfg.eval.objective}"
        with open(self.job_dir / "evals.jsonl", "a") as f:
            for r, m in zip(due, metrics):
                rec = {"adapter": r.id, "adapter_step": r.step, "eval_loss": m["eval_loss"],
                       "budget_fraction": round(r.step / r.total_steps, 6)}
                if scored:
                    rec.update(scored)
                    rec[key] = m.get(key)
                rec.update({"time": round(time.time() - self.start_time, 4), "attempt": self.attempt})
                f.write(json.dumps(rec) + "\n")

    def _objective_metric(self) -> str | None:
        """The objective as ``eval.metrics`` names it (a user metric: ``module:function``);
        None where the job has no objective or it is the loss."""
        name = self.cfg.eval.objective
        if name is None or name == "loss":
            return None
        return next((m for m in self.cfg.eval.metrics if metric_name(m) == name), None)

    def _slice(self) -> tuple[list[Sample], list[dict]]:
        """The eval rows intermediate evals score the objective on: ``intermediate_samples``
        of them spread evenly over the eval set (all of it when it is smaller), the same rows
        at every eval and for every adapter."""
        n, want = len(self.eval_samples), self.cfg.eval.intermediate_samples
        rows = list(range(n)) if want >= n else [i * n // want for i in range(want)]
        examples = [self.eval_examples[i] for i in rows] if len(self.eval_examples) == n else []
        return [self.eval_samples[i] for i in rows], examples

    def _eval_base(self) -> None:
        self._room_for_eval()
        metrics = self._evaluate([None], metrics=list(self.cfg.eval.metrics),
                                 max_new_tokens=self.cfg.eval.max_new_tokens)[0]
        if self.is_main:
            (self.output_dir / "base_metrics.json").write_text(json.dumps(metrics, indent=2))

    # ------------------------------------------------------------------- files
    def _write_adapter_metrics(self, r: AdapterRun, m: dict[str, float], checkpoint: Path | None) -> None:
        if not self.is_main:
            return
        out = self.output_dir / "adapters" / r.id
        tail = r.losses[-10:]
        row = {
            "adapter_id": r.id,
            "job_id": self.job_id,
            "attempt": self.attempt,
            "status": r.status,
            "reason": r.reason,
            "steps": r.step,
            "total_steps": r.total_steps,
            "train_loss": sum(tail) / len(tail) if tail else None,
            **m,
            "wall_time_s": r.earlier_s + (r.finished_at or time.time()) - self.start_time,
            "checkpoint_path": str(checkpoint) if checkpoint else None,
            "config": r.cfg.hyperparameters(),
            "targets": self.targets,  # the layers it adapts (its PEFT target_modules)
            "warmup_steps": r.warmup,
        }
        if self.cfg.eval.each_epoch and r.epochs:
            row["epoch"] = r.best_epoch  # the epoch whose weights and scores these are
            row["epochs"] = r.epochs
        self.writer.metrics(out, row)  # after the adapter's checkpoint, if it has one

    def _log(self, row: dict[str, Any]) -> None:
        if self._metrics_file is None:
            return
        row["time"] = round(time.time() - self.start_time, 4)
        row["attempt"] = self.attempt
        self._metrics_file.write(json.dumps(row) + "\n")

    def _write_progress(self, step: int, final: bool = False, lingering: bool = False) -> None:
        if not self.is_main:
            return
        now = time.time()
        if not (final or lingering) and now - self._last_progress < 0.5:
            return
        self._last_progress = now
        self._metrics_file.flush()
        done_steps = sum(min(r.step, r.total_steps) if r.status in ("running", "done") else r.total_steps for r in self.runs)
        progress = {
            "job_id": self.job_id,
            "step": step,
            "adapter_steps_done": done_steps,
            "adapter_steps_total": sum(r.total_steps for r in self.runs),
            "adapters_finished": sum(not r.active for r in self.runs),
            "adapters_total": len(self.runs),
            # steps each adapter has taken (one that left: its whole budget): what the engine's
            # choice of joins counts a running job's remaining time from
            # (packed steps: an adapter that accumulates takes its parts × optimizer steps)
            "adapter_steps": {r.id: (r.packed_steps_taken if r.active else r.total_steps * r.parts) for r in self.runs},
            # the mean loss of each training adapter's last steps: a log's progress line shows their range
            "train_loss": {r.id: sum(r.losses[-10:]) / len(r.losses[-10:]) for r in self.runs
                           if r.active and r.losses},
            "adapters_joined": sum(r.joined_at is not None for r in self.runs),
            "joins_waiting": len(self._pending_joins),
            "lingering": lingering,
            "elapsed_s": now - self.start_time,
            "final": final,
            "attempt": self.attempt,
            "resumed_step": self.checkpointer.job_step if self.resumed else None,
            "resumed": self.resumed,
            # each pack composition so far (ranks, rows, steady steps, their seconds and tokens,
            # the device footprint): what the sweep calibrates its cost model from meanwhile
            "phases": self.clock.phases,
        }
        tmp = self.job_dir / "progress.json.tmp"
        tmp.write_text(json.dumps(progress))
        tmp.replace(self.job_dir / "progress.json")

    def _check_control(self, step: int) -> None:
        """At a step boundary: adapters named in control.json's "prune" list leave the pack,
        then adapters waiting to join (its "join" list) take the room there is."""
        control = self._read_control() if self.is_main else None
        prune = set(control.prune) if control is not None else set()
        if self.tp is not None:  # rank 0 reads the file; every rank prunes at the same step
            flags = torch.tensor([r.id in prune for r in self.runs], dtype=torch.uint8, device=self.device)
            prune = {r.id for r, f in zip(self.runs, self.tp.broadcast_(flags).tolist()) if f}
        for r in self.runs:
            if r.active and r.id in prune:
                r.status, r.reason, r.finished_at = "pruned", "pruned", time.time()
                self._leave_early(r)
        if control is not None:
            self._closed = self._closed or control.close
            for a, waits in control.after.items():
                self._join_after.setdefault(a, set()).update(waits)
            self._queue_joins(control.join, step)
        if self._pending_joins:
            self._take_joins(step)

    def _read_control(self) -> JobControl | None:
        """control.json (`plora.jobcontrol`), read only when it has changed (None when it has
        not): one stat per step, so a request takes effect at the next step however fast
        the steps are."""
        path = self.job_dir / "control.json"
        try:
            st = path.stat()
        except OSError:
            return None
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen == self._control_seen:
            return None
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):  # half-written by a writer without an atomic rename: next step
            return None
        self._control_seen = seen
        try:
            return JobControl.model_validate(raw)
        except ValidationError as e:  # a whole file that is wrong: said once, until it changes
            print(f"control.json ignored: {' '.join(str(e).split())[:1000]}", file=sys.stderr, flush=True)
            return None

    # ------------------------------------------------------------------ joins
    def _stream(self, a: JobAdapter) -> AdapterStream | BalancedStream:
        """An adapter's own data order from its start (a joined adapter's too, from length
        bucket 0 whatever bucket the pack is on: `AdapterStream` says why); in balanced
        batches where the sweep's rows are laid out so (`plora.balanced_stream`)."""
        if self.cfg.training.row_layout == "balanced":
            return BalancedStream(len(self.train_samples), a.seed, lengths=self._stream_lengths,
                                  batch_size=a.batch_size)
        return AdapterStream(len(self.train_samples), a.seed, lengths=self._stream_lengths,
                             buckets=self._stream_buckets)

    def _run(self, index: int, a: JobAdapter, joined_at: int | None) -> AdapterRun:
        return AdapterRun(index, a, self._stream(a), joined_at=joined_at,
                          parts=accumulation_steps(a.batch_size, self.micro_batch_size))

    def _floors(self, active: list[AdapterRun]) -> tuple[list[int], list[int]] | None:
        """For a replayed step of balanced rows, each adapter's largest batch to come (tokens,
        labels): the step's shape holds every one of its steps (one capture a composition)."""
        if self.cfg.training.row_layout != "balanced":
            return None
        tokens, labels = [], []
        for r in active:
            if r.floor is None:  # every stream is balanced here (`_stream`)
                left = max(1, r.total_steps - r.step)
                tokens_most, labels_most = r.stream.max_batch_sums(left, [self._stream_lengths, self._label_counts],
                                                                   parts=r.parts)
                r.floor = (tokens_most, labels_most)
            tokens.append(r.floor[0])
            labels.append(r.floor[1])
        return tokens, labels

    def _active(self) -> list[AdapterRun]:
        """The adapters training now, in slot order (the order of their rows in a step)."""
        return sorted((r for r in self.runs if r.active), key=lambda r: r.index)

    def _rejoined(self) -> list[tuple[JobAdapter, int]]:
        """Adapters that joined an earlier attempt of this job (joins.jsonl) and have no
        result yet, with the job step they joined at: they train again, from their mid-job
        checkpoint where there is one. Every id in the file is never taken again."""
        records = read_joins(self.job_dir)
        self._joined_before = {rec.adapter.id for rec in records}
        own = {a.id for a in self.cfg.adapters}
        out: dict[str, tuple[JobAdapter, int]] = {}
        for rec in records:
            a = rec.adapter
            if rec.refused is None and a.id not in own and a.id not in out and not self._has_result(a):
                out[a.id] = (a, rec.job_step)
        return list(out.values())

    def _has_result(self, a: JobAdapter) -> bool:
        """Whether this job already wrote ``a``'s final metrics (an earlier attempt)."""
        try:
            m = json.loads((self.output_dir / "adapters" / a.id / "metrics.json").read_text())
        except (OSError, ValueError):
            return False
        saved, want = m.get("config") or {}, self._own(a).hyperparameters()
        # an earlier plora wrote the five alone: the settings it does not show are not compared
        same = all(saved.get(k) == v for k, v in want.items() if k in saved or k in BASE_HYPERPARAMETERS)
        return m.get("status") in FINAL_STATUSES and m.get("job_id") == self.job_id and same

    def _queue_joins(self, asked: list[JobAdapter], step: int) -> None:
        """The joins control.json asks for that are new to this job wait their turn."""
        held = {r.id: r.cfg for r in self.runs}
        waiting = {a.id for a in self._pending_joins}
        for a in map(self._own, asked):
            if a.id in waiting or a.id in self._joined_before:
                continue
            if a.id in held:
                if held[a.id] != a:
                    self._refuse(a, step, "the job already holds another adapter of this id")
                continue
            self._pending_joins.append(a)
            waiting.add(a.id)

    def _refuse(self, a: JobAdapter, step: int, reason: str) -> None:
        self._joined_before.add(a.id)
        if self.is_main:
            append_join(self.job_dir, JoinRecord(adapter=a, job_step=step, attempt=self.attempt, time=time.time(),
                                                 refused=reason))
            print(f"join of {a.id} refused: {reason}", file=sys.stderr, flush=True)

    def _take_joins(self, step: int) -> None:
        """Waiting joins, in the order asked, enter the pack while ``streaming.max_active``
        and ``max_active_rank`` allow (a join whose control.json ``after`` names adapters
        still training waits for them, and lets later ones pass): each into the slot of an
        adapter of its rank that has left (in place), the rest into a pack laid out again
        (the free slots not reused are given back). Each is in joins.jsonl before its first
        step."""
        if self.tp is not None:
            for a in self._pending_joins:
                self._refuse(a, step, "adapters cannot join a tensor-parallel job")
            self._pending_joins = []
            return
        limits = self.cfg.streaming
        active = self._active()
        count, ranks = len(active), sum(r.cfg.rank for r in active)
        training = {r.id for r in active}
        taking: list[JobAdapter] = []
        for a in self._pending_joins:
            if self._join_after.get(a.id, set()) & training:
                continue  # chosen for the room adapters still training leave: it waits for them
            if limits.max_active is not None and count + 1 > limits.max_active:
                break
            if limits.max_active_rank is not None and ranks + a.rank > limits.max_active_rank:
                break
            taking.append(a)
            count, ranks = count + 1, ranks + a.rank
        if not taking:
            return
        taken = {a.id for a in taking}
        self._pending_joins = [a for a in self._pending_joins if a.id not in taken]
        for a in taking:
            self._joined_before.add(a.id)
            if self.is_main:
                append_join(self.job_dir, JoinRecord(adapter=a, job_step=step, attempt=self.attempt, time=time.time()))
        holder = {r.index: r for r in self.runs if r.index is not None}
        had_dropout = self.pm.state.has_dropout
        free: dict[int, list[int]] = {}  # rank -> free slots
        for k, spec in enumerate(self.pm.state.adapters):
            if k not in holder or not holder[k].active:
                free.setdefault(spec.rank, []).append(k)
        grow: list[JobAdapter] = []
        for a in taking:
            slots = free.get(a.rank)
            if not slots:
                grow.append(a)
                continue
            k = slots.pop(0)
            if k in holder:
                holder[k].index = None
            refill_slot(self.pm, self.bank, self.optimizer, k, self._newcomer(a))
            self._refilled(k)
            self.runs.append(self._run(k, a, step))
        if self.pm.state.has_dropout != had_dropout:
            self._drop_graphs()  # the held graphs were captured with(out) the dropout masks
        if grow:
            self._drop_graphs()  # every buffer a graph reads is laid out again
            keep = [r.index for r in self._active()]
            self.bank, self.optimizer = relayout(self.pm, self.bank, self.optimizer,
                                                 keep + [self._newcomer(a) for a in grow])
            new_index = {old: new for new, old in enumerate(keep)}
            for r in self.runs:
                if r.index is not None:
                    r.index = new_index.get(r.index)
            for i, a in enumerate(grow):
                self.runs.append(self._run(len(keep) + i, a, step))

    def _refilled(self, k: int) -> None:
        """Slot ``k`` holds a new adapter of the same rank: the held graphs stay (they read
        its weights, moments, learning rate and step count where the refill wrote them),
        and read its scale from their segment metadata, written here in place."""
        if self.graphs is None:
            return
        scale = self.pm.state.adapters[k].scale
        for b in self.graphs.held_buffers():
            if b.meta is not None:
                b.meta.set_scale(k, scale)

    def _own(self, a: JobAdapter) -> JobAdapter:
        """``a`` with every training setting of its own: the job's where it gives none."""
        c = self.cfg
        fill = {"dropout": c.lora.dropout, "weight_decay": c.training.weight_decay,
                "scheduler": c.training.scheduler, "rslora": False}
        missing = {k: v for k, v in fill.items() if getattr(a, k) is None}
        return a.model_copy(update=missing) if missing else a

    @staticmethod
    def _spec(a: JobAdapter) -> AdapterSpec:
        return AdapterSpec(a.id, a.rank, a.alpha, a.seed, dropout=a.dropout or 0.0, rslora=bool(a.rslora))

    def _newcomer(self, a: JobAdapter) -> NewAdapter:
        return NewAdapter(self._spec(a), a.learning_rate, a.weight_decay or 0.0)

    def _linger(self, step: int) -> bool:
        """Every adapter has left: wait up to ``streaming.linger_s`` for a join (True when
        one was taken). control.json's ``close``, or SIGTERM, ends the wait at once."""
        wait = self.cfg.streaming.linger_s
        if wait <= 0 or self._closed or self.tp is not None:
            return False
        self.checkpointer.drop()  # nothing trains: its states would only be resumed by mistake
        self._write_progress(step, lingering=True)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not self._closed and not self.checkpointer.stop_requested:
            time.sleep(LINGER_POLL_S)
            self._check_control(step)
            if self._active():
                return True
        return False


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("hardware.device is cuda but no CUDA device is visible")
    return torch.device(name)


def recipe_main(cfg: DictConfig) -> None:
    """The job process: `tune run plora/recipes/packed_lora.py --config job.yaml`."""
    hooks.load_env_hooks()  # tests' hooks (PLORA_TEST_HOOKS); none in production
    try:
        recipe = PackedLoRARecipe(cfg)
        recipe.setup()
        try:
            summary = recipe.train()
        except torch.OutOfMemoryError as e:
            # Adapters that finished before this are saved; the engine re-queues the rest.
            (recipe.job_dir / "oom.json").write_text(json.dumps({"error": str(e)[:2000]}))
            print(f"out of memory: {str(e)[:500]}", file=sys.stderr, flush=True)
            sys.exit(EXIT_OOM)
        finally:
            recipe.cleanup()
    except UNFIXABLE_ERRORS as e:
        # The same model, data or config fails the same way on every attempt: say so and
        # let the engine fail the adapters at once instead of retrying.
        message = " ".join(str(e).split())[:2000] or type(e).__name__
        job_dir = _job_dir_of(cfg)
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / UNFIXABLE_FILE).write_text(json.dumps({"error": message}))
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(EXIT_UNFIXABLE)
    if recipe.is_main:
        print(json.dumps(summary), flush=True)
    close_tp()


def _job_dir_of(cfg: DictConfig) -> Path:
    """Where to report a job whose config may itself be what failed validation: its
    ``job_dir``, else the working directory (the engine starts each job in its folder)."""
    try:
        return JobConfig.parse(cfg).job_dir
    except ValidationError:
        return Path(cfg["job_dir"]) if "job_dir" in cfg else Path.cwd()


def leave(code: int | None) -> None:
    """End the job process once `recipe_main` has returned: every file it wrote is closed
    and its summary printed, so a one-process job skips the interpreter's teardown (freeing
    the CUDA context and every module's objects: a second or more on a GPU, during which
    the engine cannot start the next job). A TP job leaves the ordinary way (its process
    group is torchrun's)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


if __name__ == "__main__":
    from torchtune import config as tune_config

    leave(tune_config.parse(recipe_main)())
