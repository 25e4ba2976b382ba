"""torchtune recipe: train K LoRA adapters packed on one frozen base model.

Run as ``tune run plora/train/packed_lora.py --config job.yaml`` (what `plora sweep`
does for each job), or in-process with ``PackedLoRARecipe(cfg).run()``.

One step: every active adapter draws its own micro-batch from its own seeded data order;
the rows are concatenated adapter by adapter, flattened without padding (each row with its
own positions and attention, `plora.train.packed.step_batch`); the base model runs once; the LM
head and the loss run only where labels are (`plora.train.packed.head_loss`); the loss is the sum
of per-adapter mean losses, so each adapter's gradient is exactly its own. Clipping,
learning rate, warm-up and schedule are per adapter (`PackedAdamW` over one flat buffer of
every adapter's weights: one launch per step for the whole pack). With
``training.micro_batch_size``, an adapter whose batch is larger trains it over several
packed steps and steps its optimizer after the last (`plora.data.accumulation`); others in the
same pack step every packed step. An adapter
whose loss or gradient turns NaN/inf is marked ``diverged`` and leaves the batch; one whose
budget is done is evaluated, saved in the PEFT format and leaves the batch.

Adapters may also join a running job (`plora.job.control`: control.json's ``join`` list):
at a step boundary each takes the slot of an adapter that has left, or the pack is laid
out again (`plora.train.packed.slots`), and it trains as it would alone. A job with
``streaming.linger_s`` waits that long for joins once its adapters have all left.

The recipe is a shell over components, each in its own file, that share no attributes:

* `plora.train.row_stream.TrainRows` -- the training rows, each adapter's stream, a step's batch;
* `plora.train.adapter_pack.AdapterPack` -- the adapters' weights (bank) and optimizer;
* `plora.train.packed_step.PackedStep` -- one packed optimizer step and its books;
* `plora.train.evaluator.Evaluator` -- final, epoch-end, intermediate and base-model evals;
* `plora.train.epochs.EpochBook` -- epoch ends and each adapter's best epoch;
* `plora.train.joins.JoinDesk` -- control.json: prunes, and joins queued, taken or refused;
* `plora.train.checkpoint.JobCheckpointer` -- mid-job checkpoints of the pack;
* `plora.train.job_files.JobFiles` -- metrics.jsonl, evals.jsonl, progress, summary, results.

Here they are built (`setup`), driven step by step (`train`) and closed (`cleanup`); what an
adapter leaving the pack goes through (saved, scored, its result written) is wired here.

On a GPU whose steps replay CUDA graphs, the job has a side lane (`plora.train.side_lane`):
while the pack replays, the lane captures the composition it changes to next
(`_capture_ahead`) and scores adapters that left while the others train on (`_finish`);
whatever else uses the model waits for it first (`_lane_idle`).
"""


from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException
from pydantic import ValidationError
from torchtune.config._errors import ConfigError

from plora.data.dataset import DataError, TextTokenizer, prepare_data, synthetic_samples
from plora.job.config import JobAdapter, JobConfig
from plora.job.outputs import EXIT_OOM, EXIT_UNFIXABLE, JobProgress, JobSummary, write_error, write_oom
from plora.job.phases import PhaseClock
from plora.job.step_settings import graphs_wanted
from plora.kernels import scales_on_device
from plora.models.loading import ModelError
from plora.quantize.cost import check_tp
from plora.results.metrics import use_metric_paths
from plora.settings import settings
from plora.train import base_scores, hooks, preload
from plora.train.adapter_pack import AdapterPack, adapter_spec
from plora.train.adapter_run import AdapterRun
from plora.train.adapter_writer import AdapterWriter
from plora.train.checkpoint import JobCheckpointer
from plora.train.epochs import EpochBook
from plora.train.evaluator import Evaluator
from plora.train.heap import frozen_heap
from plora.train.job_files import JobFiles
from plora.train.joins import JoinDesk
from plora.train.packed.inject import inject_packed_lora
from plora.train.packed.tp import TensorParallel, close_tp, init_tp, tp_degree
from plora.train.packed.varlen_attention import install_row_attention
from plora.train.packed_step import PackedStep
from plora.train.row_stream import TrainRows
from plora.train.side_lane import SideLane
from plora.train.step_graph import StepGraph

#: a job's exit codes and output files are `plora.job.outputs`'; what no retry can fix:
UNFIXABLE_ERRORS: tuple[type[BaseException], ...] = (ModelError, DataError, ConfigError, OmegaConfBaseException,
                                                      ValidationError)
#: how often a job lingering for joins looks at its control.json
LINGER_POLL_S = 0.05
#: a composition is captured ahead only while the pack before it has at least this many
#: steps left (fewer: its capture would not be done by then, and the step waits for it)
AHEAD_MIN_STEPS = 2


class _Leaving:
    """Adapters that left the pack and are being scored on the side lane: their result is
    written when the scores come (`PackedLoRARecipe._complete_leaving`)."""

    def __init__(self, runs: list[AdapterRun], status: str, checkpoints: list[Path | None], scores):
        self.runs, self.status, self.checkpoints, self.scores = runs, status, checkpoints, scores


def step_ahead_wanted(device: torch.device) -> bool:
    """Whether a job lays out its next step's rows while a step runs (`plora.train.packed_step`):
    on a GPU, whose steps run while the host goes on, unless ``PLORA_STEP_AHEAD=0``. (A CPU's
    step is done when it returns: there is nothing to overlap.)"""
    return device.type == "cuda" and settings().step_ahead


class PackedLoRARecipe:
    """One packed job, shaped as torchtune's recipes are: `__init__` reads the (typed) job
    config, `setup` builds the model and the components, `train` runs the loop (evaluating
    and saving adapters as they leave), `cleanup` releases what the job holds. `run` does
    all three, as `recipe_main` does."""

    def __init__(self, cfg: JobConfig | DictConfig | Mapping[str, Any]):
        self.cfg = JobConfig.parse(cfg)  # a typo or a bad value in the job file fails here
        c = self.cfg
        self.job_id = c.job_id
        self.output_dir = c.output_dir
        self.job_dir: Path = c.job_dir
        self.attempt = settings().job_attempt
        self.targets = list(c.lora.targets)
        self.files: JobFiles | None = None  # what cleanup() closes, whether or not setup() got that far
        self.writer: AdapterWriter | None = None  # likewise
        self.lane: SideLane | None = None  # likewise

    # ------------------------------------------------------------------ set-up
    def setup(self) -> None:
        """Build the job: process group (TP), base model with the packed adapters, data,
        the pack and its optimizer, step graphs, evals, joins, checkpoints and files."""
        c, t = self.cfg, self.cfg.training
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
        # a model this process loaded before the job was handed to it (`plora.train.preload`)
        model, self.info = preload.load(preload.ModelKey.of(c.model.path, c.model.family, c.model.max_seq_len,
                                                            c.model.dtype, self.device, c.model.random_init))
        self.clock.loaded(time.perf_counter() - t_load)
        self.clock.part_done("model")
        self.joins = JoinDesk(self.job_dir, self.output_dir, self.job_id, c.adapters, c.streaming,
                              complete=self._complete, is_main=self.is_main, attempt=self.attempt, tp=self.tp,
                              device=self.device)
        rejoined = self.joins.rejoined()  # adapters that joined an earlier attempt and did not finish
        adapters = [self._complete(a) for a in list(c.adapters) + [a for a, _ in rejoined]]
        self.pm = inject_packed_lora(model, [adapter_spec(a) for a in adapters], self.targets)
        # rows flattened without padding, attention confined to each (None: padded rows)
        self.row_attn = install_row_attention(self.pm.model)
        if self.tp is not None:  # before the optimizer: it must see the local shards
            self.tp.shard(self.pm)
        if c.model.quantize:  # the block linears to NF4, the adapters stay in the dtype (`plora.quantize.nf4`)
            from plora.quantize.nf4 import quantize_base

            self.quantized = quantize_base(self.pm.model, c.model.quantize)
        if t.activation_checkpointing:
            # Each decoder layer is recomputed in backward; the pack's state stays set until
            # after backward (the step), so the recomputed LoRA rows are the same rows.
            # torch's own wrapper, as torchtune's ``training.set_activation_checkpointing`` applies
            # it (importing ``torchtune.training`` would import the whole of torchao)
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
            from torch.distributed.fsdp.wrap import ModuleWrapPolicy
            from torchtune.modules import TransformerSelfAttentionLayer

            apply_activation_checkpointing(self.pm.model,
                                           auto_wrap_policy=ModuleWrapPolicy({TransformerSelfAttentionLayer}))
        self.pm.model.train()
        self.clock.part_done("adapters")
        dtype = self.pm.model.tok_embeddings.weight.dtype

        self.tok = TextTokenizer(self.info.path, self.info.eos_token_id, self.info.pad_token_id)
        synthetic = c.data.synthetic
        if synthetic is not None:  # profiling and benchmarks: fixed-length random rows, no eval
            train_samples = synthetic_samples(synthetic.num_samples, synthetic.seq_len, self.info.vocab_size)
            self.eval_samples, self.eval_examples = [], []
        else:
            use_metric_paths(c.eval.python_path)
            data = prepare_data(c.data, c.eval, self.tok, c.model.max_seq_len)
            train_samples, self.eval_samples, self.eval_examples = data.train, data.eval, data.eval_examples

        self.clock.part_done("data")
        self.graphs: StepGraph | None = None
        if graphs_wanted(t.cuda_graphs, self.device, tp=self.tp is not None,
                         activation_checkpointing=t.activation_checkpointing):
            self.graphs = StepGraph(self.device, capture_first=settings().capture_first)
            self.graphs.cover = t.cover_vacant_slots
        graphed = self.graphs is not None
        self.rows = TrainRows(train_samples, t, pad_id=self.tok.pad_id, max_seq_len=c.model.max_seq_len,
                              row_attention=self.row_attn, device=self.device, dtype=dtype, graphed=graphed,
                              micro_batch_size=t.micro_batch_size)
        joined_at = {a.id: s for a, s in rejoined}
        self.runs: list[AdapterRun] = [self.rows.adapter_run(i, a, joined_at.get(a.id)) for i, a in enumerate(adapters)]
        # after TP sharding: the bank lays out the local shards
        self.clock.part_done("rows")
        self.pack = AdapterPack(self.pm, adapters, self.tp)
        self.clock.part_done("pack")
        self.stepper = PackedStep(self.pm, self.pack, self.rows, t, device=self.device,
                                  vocab_size=self.info.vocab_size, row_attention=self.row_attn,
                                  graphs=self.graphs, tp=self.tp,
                                  # where a capture would bake the scales in, a graph is only for those it saw
                                  scales_in_key=graphed and not scales_on_device(self.device))
        self.stepper.step_ahead = step_ahead_wanted(self.device)
        self._ahead = None  # (key, the lane's future) of a composition being captured ahead
        self._ahead_tried: set = set()  # compositions captured ahead already (or found not wanted)
        self._leaving: list[_Leaving] = []
        if self.graphs is not None and self.tp is None and settings().overlap and t.micro_batch_size is None:
            lane = side_lane_for(self.device)
            if lane is not None:
                self._open_lane(lane)
        self.clock.part_done("step")
        self.evaluator = Evaluator(self.pm, self.tok, self.eval_samples, self.eval_examples, c.eval,
                                   max_seq_len=c.model.max_seq_len, device=self.device, clock=self.clock,
                                   before=self._room_for_eval)
        self.epochs = EpochBook(len(train_samples), each_epoch=c.eval.each_epoch, objective=c.eval.objective,
                                minimize=not c.eval.greater_is_better)
        # leaving adapters' files are written while the pack trains on (one process: no collectives)
        self.writer = AdapterWriter(background=self.tp is None)
        self.start_time = time.time()
        self.files = JobFiles(self.job_dir, self.output_dir, self.job_id, is_main=self.is_main, attempt=self.attempt,
                              writer=self.writer, started_at=self.start_time)
        self.checkpointer = JobCheckpointer(c, self.pack, attempt=self.attempt, started_at=self.start_time,
                                            tp=self.tp, device=self.device)
        self.resumed: dict[str, int] = {}  # adapter id -> the adapter step it resumed from
        self.clock.part_done("files")
        self.clock.set_up(self.eval_samples)

    # what tests and hooks look at: the components' state, read through the shell
    @property
    def bank(self):
        return self.pack.bank

    @property
    def optimizer(self):
        return self.pack.optimizer

    @property
    def train_samples(self):
        return self.rows.samples

    @property
    def real_tokens(self) -> int:
        return self.stepper.real_tokens

    @property
    def pending_joins(self) -> list[JobAdapter]:
        return self.joins.pending

    def run(self) -> JobSummary:
        """The whole job in this process: setup, train, cleanup (what `recipe_main` runs);
        the job's summary."""
        self.setup()
        try:
            return self.train()
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        """Release what the job holds open: the side lane, the writer (drained) and its logs
        (flushed and closed). Safe after a setup that failed part way, and twice."""
        if self.lane is not None:
            self.lane.close()
            self.lane = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.files is not None:
            self.files.close()
            self.files = None

    # ------------------------------------------------------------------ training
    def train(self) -> JobSummary:
        """Train until every adapter has left the pack (and, with ``streaming.linger_s``, no
        join came in that time); the job's summary (also summary.json). The ``after_step``
        hook (`plora.train.hooks`) fires after each optimizer step, before finished adapters
        leave: tests look in there."""
        if self.cfg.eval_base:
            with self.clock.timed("eval_base_s"):
                self.files.base_metrics(self._base_scores())
        self.resumed = self.checkpointer.restore(self.runs)
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
                stepped_before = self.stepper.stepped_tokens
                self.train_step(active, step)
                dt = time.perf_counter() - t_step
                self.clock.step([r.index for r in active], dt,
                                reused=self.graphs is not None and self.graphs.last_run in ("replay", "cover"),
                                ranks=[r.cfg.rank for r in active], rows=[r.last_rows for r in active],
                                tokens=self.stepper.stepped_tokens - stepped_before, device=self.device)
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
                self._lane_news()
                # a checkpoint follows the results of every adapter that left before it
                if self.checkpointer.maybe_save(step, self.runs, before=self._before_checkpoint):
                    self.files.flush()  # the log holds at least what the checkpoint does
                self._capture_ahead()
                self._write_progress(step)
        self._lane_idle()
        self.writer.drain()  # every leaving adapter's files are on disk before the job says it is done
        self.clock.writes = list(self.writer.times)
        self.checkpointer.discard(self.runs)
        self._write_progress(step, final=True)
        self.clock.graphs = self.graphs.counts.to_dict() if self.graphs is not None else None
        self.clock.rows_ahead = dict(self.stepper.ahead_counts) if self.stepper.step_ahead else None
        summary = JobSummary(
            job_id=self.job_id,
            steps=step,
            resumed_from=self.resumed,
            wall_time_s=time.time() - self.start_time,
            first_step_s=first_step_s,
            step_time_s=steps_s,  # steps 2..n
            adapters={r.id: r.status for r in self.runs},
            joined={r.id: r.joined_at for r in self.runs if r.joined_at is not None},
            tokens={"real": self.stepper.real_tokens, "stepped": self.stepper.stepped_tokens},
            phases=self.clock.to_dict(),
        )
        self.files.summary(summary)
        return summary

    def _base_scores(self) -> dict[str, float]:
        """The base model's scores: remembered from an earlier job with the same model, rows
        and eval (`plora.train.base_scores`), else scored now and remembered. Under tensor
        parallelism every rank scores (the eval's collectives need them all)."""
        key = None
        if self.tp is None:
            try:
                key = base_scores.key_of(self.cfg.model, self.cfg.eval, self.eval_samples, self.eval_examples,
                                         self.device)
            except Exception:  # noqa: BLE001 - a key it cannot make is only a cache missed
                key = None
            found = base_scores.recall(key)
            if found is not None:
                self.clock.base_scores_remembered = True
                return found
        scores = self.evaluator.base()
        base_scores.remember(key, scores)
        return scores

    def train_step(self, active: list[AdapterRun], step: int) -> None:
        """One optimizer step of the active adapters (`PackedStep`), and its books: each
        stepped adapter's metrics.jsonl line, each diverged one out of the pack."""
        out = self.stepper.run(active, None if self.joins.may_change_pack else self._steps_left(active))
        books = self.stepper.account(active, step, out)
        for row in books.logged:
            self.files.log(row)
        for r, reason in books.diverged:
            self._diverge(r, reason)

    @staticmethod
    def _steps_left(active: list[AdapterRun]) -> int:
        """How many more steps this pack runs as it is (the next adapter to finish ends it)."""
        return min((r.total_steps - r.step) * r.parts - r.micro for r in active)

    def _active(self) -> list[AdapterRun]:
        """The adapters training now, in slot order (the order of their rows in a step)."""
        return sorted((r for r in self.runs if r.active), key=lambda r: r.index)

    def _room_for_eval(self) -> None:
        """An eval is next: the held graphs stay where the largest held step could still
        run eagerly beside them (the pack will likely replay them after), else they go
        first. The eval sizes its batches from half the free memory (`eval_token_budget`,
        which also counts the pool's free blocks): with a step's room beside the pool, that
        half is free."""
        if self.graphs is not None:
            self.graphs.make_room()

    # ---------------------------------------------------------- leaving the pack
    def _diverge(self, r: AdapterRun, reason: str) -> None:
        r.status, r.reason, r.finished_at = "diverged", reason, time.time()
        self._leave_early(r)

    def _leave_early(self, r: AdapterRun) -> None:
        """A diverged or pruned adapter's result: nothing, or, where it finished an epoch
        (``eval.each_epoch``), its best finished epoch's weights and scores (its status
        stays what it is; the reason says which epoch it keeps)."""
        if r.best_epoch is None or r.best_weights is None:
            self._result(r, {}, checkpoint=None)
            return
        r.reason = f"{r.reason}; kept epoch {r.best_epoch}"
        checkpoint = self._save_best([r])[0]
        self._result(r, self.epochs.best_scores(r), checkpoint=checkpoint)

    def _finish(self, runs: list[AdapterRun], status: str) -> None:
        """Save adapters leaving the pack in the PEFT format, then evaluate them (packed),
        then drop their state. The weights are copied to the host before the eval runs and
        written while it runs (`AdapterWriter`), so an eval that fails cannot cost their
        training; one that runs out of memory retries in smaller pieces
        (`evaluate_adapters`). Each adapter's metrics.json follows its weights.

        Where the job has a side lane and adapters stay in the pack, the leaving ones are
        scored there while the others train on (`_leaves_on_lane`): they are out of the pack
        at once, and their result is written when the scores come (`_complete_leaving`)."""
        self._room_for_eval()
        t_save = time.perf_counter()
        checkpoints = self._save(runs)
        self.clock.saved(len(runs), time.perf_counter() - t_save)
        indices = [r.index for r in runs]
        if self._leaves_on_lane(runs):
            for r in runs:
                r.status = status
            self._leaving.append(_Leaving(runs, status, checkpoints,
                                          self.lane.submit_after(lambda: self.evaluator.final(indices))))
            return
        self._finish_scored(runs, status, checkpoints, self.evaluator.final(indices, last=not self._trains_beside(runs)))

    def _leaves_on_lane(self, runs: list[AdapterRun]) -> bool:
        """Whether leaving ``runs`` are scored on the side lane: the job has one, no join can
        take their slots while they are scored, and the pack trains on without them (the
        last adapters' scores are waited for at once)."""
        return self.lane is not None and not self.joins.may_change_pack and self._stays_beside(runs)

    def _stays_beside(self, runs: list[AdapterRun]) -> bool:
        """Whether adapters stay in the pack beside leaving ``runs``."""
        leaving = {id(r) for r in runs}
        return any(r.active and id(r) not in leaving for r in self.runs)

    def _trains_beside(self, runs: list[AdapterRun]) -> bool:
        """Whether the pack may train on beside leaving ``runs``: adapters stay in it, or a
        join may still bring some."""
        return self.joins.may_change_pack or self._stays_beside(runs)

    def _finish_scored(self, runs: list[AdapterRun], status: str, checkpoints: list[Path | None],
                       metrics: list[dict[str, Any]]) -> None:
        """Leaving adapters with their scores: their best epoch kept where the job scores
        epochs, and each one's result written."""
        if self.cfg.eval.each_epoch and self.eval_examples and self.cfg.eval.metrics:
            metrics, earlier = self.epochs.keep_best(runs, metrics)
            if earlier:  # saved over the last epoch's weights (after them: the writer keeps the order)
                self._save_best(earlier)
        for r, m, ckpt in zip(runs, metrics, checkpoints):
            r.status, r.finished_at = status, time.time()
            self._result(r, m, checkpoint=ckpt)

    # ---------------------------------------------------------- the side lane
    def _open_lane(self, lane: SideLane) -> None:
        """The job's side lane (`plora.train.side_lane`): its thread's CUDA handles made on
        the capture stream first; every step that is not a plain replay, and every graph
        dropped, waits for it (`StepGraph.before_work`)."""
        self.lane = lane
        self.stepper.lane = lane
        stream = self.graphs.backend.stream()
        if stream is not None:
            # the lane's handles once this thread has its own (its first capture took them: a
            # handle made inside a capture invalidates it, and the lane's thread, warmed
            # first, took the one this thread would have been given; measured on an H200)
            dtype = self.pm.model.tok_embeddings.weight.dtype
            lane.before_first(lambda: lane.warm(stream, dtype))
        self.graphs.before_work = self._lane_idle

    def _lane_idle(self) -> None:
        """Wait for the side lane, then take what it made: a graph captured ahead, the
        scores of adapters that left (their results written)."""
        if self.lane is None:
            return
        self.lane.wait()
        self._lane_news()

    def _lane_news(self) -> None:
        """What the side lane has finished, taken without waiting: a graph captured ahead
        joins the held ones; leaving adapters whose scores came get their results."""
        if self._ahead is not None and self._ahead[1].done():
            key, future = self._ahead
            self._ahead = None
            try:
                buffers, graph, grew, pool = future.result()
            except Exception as e:  # noqa: BLE001 - costs the capture it saved, not the job
                self._ahead_tried = None  # none again in this job (the lane's task cleared the pack state)
                print(f"capturing a composition ahead failed ({type(e).__name__}: {e}); "
                      "new compositions are captured at their first step", file=sys.stderr)
            else:
                self.graphs.adopt(key, buffers, graph, grew, pool)
        self._complete_leaving()

    def _complete_leaving(self) -> None:
        """Results of adapters scored on the side lane, in the order they left: those whose
        scores came (all of them once the lane is idle, `_lane_idle`). A failed eval raises
        here, as it would have in `_finish`."""
        while self._leaving and self._leaving[0].scores.done():
            lv = self._leaving.pop(0)
            self._finish_scored(lv.runs, lv.status, lv.checkpoints, lv.scores.result())

    def _capture_ahead(self) -> None:
        """Capture, on the side lane, the graph of the composition the pack changes to when
        its next adapters finish (those with the fewest steps left), while this one replays:
        its first step then replays too. Only where no join can change the pack first."""
        if (self.lane is None or self._ahead is not None or self._ahead_tried is None or self.lane.busy
                or self.joins.may_change_pack):
            return
        active = self._active()
        left = {r.index: (r.total_steps - r.step) * r.parts - r.micro for r in active}
        if not left or min(left.values()) < AHEAD_MIN_STEPS:
            return
        staying = [r for r in active if left[r.index] > min(left.values())]
        tried = tuple(r.index for r in staying)
        if not staying or tried in self._ahead_tried:
            return
        self._ahead_tried.add(tried)
        got = self.stepper.ahead(staying)
        if got is not None:
            key, task = got
            self._ahead = (key, self.lane.submit(task))

    def _epoch_evals(self, stepped: list[AdapterRun], step: int) -> None:
        """Adapters at the end of an epoch before their last are evaluated (packed, on the
        eval set, every metric, as their final eval is); each one's scores are kept, and its
        weights where the epoch is its best so far. A mid-job checkpoint follows (when the
        job takes them), so that a resumed job need not score the epoch again."""
        if not self.evaluator.scores_epochs:
            return
        due = self.epochs.due(stepped)
        if not due:
            return
        for r, m in zip(due, self.evaluator.epoch_end([r.index for r in due])):
            if self.epochs.record(r, m):
                r.best_weights = self.pack.keep_weights(r.index)
        if self.checkpointer.enabled:
            self.stepper.discard_ahead()  # the streams where this step left them
            self.checkpointer.save(step, self.runs)

    def _before_checkpoint(self) -> None:
        """A checkpoint is due: the side lane's work done, and the rows laid out ahead given
        back (a checkpoint saves where each adapter's stream is)."""
        self._lane_idle()
        self.stepper.discard_ahead()

    def _intermediate_eval(self, stepped: list[AdapterRun]) -> None:
        """Adapters due an intermediate eval (`Evaluator.intermediate_due`), evaluated packed;
        their records go to evals.jsonl (learning curves, and what a pruner decides on)."""
        due = self.evaluator.intermediate_due(stepped)
        if due:
            self.files.evals(self.evaluator.intermediate(due))

    def _save_best(self, runs: list[AdapterRun]) -> list[Path | None]:
        """Save each adapter's best epoch's weights as its PEFT folder: the flat copy is put
        back into its (leaving) slot and saved from there, as any leaving adapter is."""
        for r in runs:
            self.pack.put_weights(r.index, r.best_weights)
        return self._save(runs)

    def _save(self, runs: list[AdapterRun]) -> list[Path | None]:
        """Save leaving adapters' weights as they are in their slots, in the PEFT format (by
        the writer, in the background, which also brings a GPU's copy of them to the host);
        their folders (None on a rank that does not write)."""
        states = self.pack.leaving_states([r.index for r in runs])
        items = [(self.output_dir / "adapters" / r.id, state,
                  dict(rank=r.cfg.rank, alpha=r.cfg.alpha, targets=self.targets, dropout=r.cfg.dropout or 0.0,
                       rslora=bool(r.cfg.rslora),
                       **({"base_quantize": self.cfg.model.quantize} if self.cfg.model.quantize else {})))
                 for r, state in zip(runs, states)]
        if not self.is_main:
            return [None] * len(runs)
        return self.writer.save_all(items, self.info, on_host=self.tp is None)

    def _result(self, r: AdapterRun, m: dict[str, Any], checkpoint: Path | None) -> None:
        self.files.adapter_result(r, m, checkpoint, targets=self.targets, epochs=self.cfg.eval.each_epoch)

    def _write_progress(self, step: int, final: bool = False, lingering: bool = False) -> None:
        if not self.files.progress_due(urgent=final or lingering):
            return
        done_steps = sum(min(r.step, r.total_steps) if r.status in ("running", "done") else r.total_steps for r in self.runs)
        self.files.progress(JobProgress(
            job_id=self.job_id,
            step=step,
            adapter_steps_done=done_steps,
            adapter_steps_total=sum(r.total_steps for r in self.runs),
            adapters_finished=sum(not r.active for r in self.runs),
            adapters_total=len(self.runs),
            # steps each adapter has taken (one that left: its whole budget): what the engine's
            # choice of joins counts a running job's remaining time from
            # (packed steps: an adapter that accumulates takes its parts × optimizer steps)
            adapter_steps={r.id: (r.packed_steps_taken if r.active else r.total_steps * r.parts) for r in self.runs},
            # the mean loss of each training adapter's last steps: a log's progress line shows their range
            train_loss={r.id: sum(r.losses[-10:]) / len(r.losses[-10:]) for r in self.runs if r.active and r.losses},
            adapters_joined=sum(r.joined_at is not None for r in self.runs),
            joins_waiting=len(self.joins.pending),
            lingering=lingering,
            elapsed_s=self.files.elapsed(),
            final=final,
            attempt=self.attempt,
            resumed_step=self.checkpointer.job_step if self.resumed else None,
            resumed=self.resumed,
            # each pack composition so far (ranks, rows, steady steps, their seconds and tokens,
            # the device footprint): what the sweep calibrates its cost model from meanwhile
            phases=self.clock.phases,
        ))

    # ------------------------------------------------------------- control and joins
    def _check_control(self, step: int) -> None:
        """At a step boundary: adapters named in control.json's "prune" list leave the pack,
        then adapters waiting to join (its "join" list) take the room there is."""
        control = self.joins.poll()
        prune = self.joins.to_prune(control, self.runs)
        if prune or self.joins.pending or control is not None:
            self._lane_idle()  # a slot may change hands: the adapters scored on the lane first
        for r in self.runs:
            if r.active and r.id in prune:
                r.status, r.reason, r.finished_at = "pruned", "pruned", time.time()
                self._leave_early(r)
        if control is not None:
            self.joins.note(control, step, {r.id: r.cfg for r in self.runs})
        if self.joins.pending:
            self._place(self.joins.choose(step, self._active()), step)

    def _place(self, taking: list[JobAdapter], step: int) -> None:
        """Joins enter the pack: each into the slot of an adapter of its rank that has left
        (in place), the rest into a pack laid out again (the free slots not reused are given
        back)."""
        if not taking:
            return
        holder = {r.index: r for r in self.runs if r.index is not None}
        had_dropout = self.pm.state.has_dropout
        had_accumulation = self.rows.accumulates
        free = self.pack.free_slots({k: r.active for k, r in holder.items()})
        grow: list[JobAdapter] = []
        for a in taking:
            slots = free.get(a.rank)
            if not slots:
                grow.append(a)
                continue
            k = slots.pop(0)
            if k in holder:
                holder[k].index = None
            self.pack.refill(k, a)
            self._refilled(k)
            self.runs.append(self.rows.adapter_run(k, a, step))
        if self.pm.state.has_dropout != had_dropout:
            self._drop_graphs()  # the held graphs were captured with(out) the dropout masks
        if self.rows.accumulates != had_accumulation:
            self._drop_graphs()  # their steps' inputs now carry every slot's accumulation
        if grow:
            self._drop_graphs()  # every buffer a graph reads is laid out again
            keep = [r.index for r in self._active()]
            new_index = self.pack.relayout(keep, grow)
            for r in self.runs:
                if r.index is not None:
                    r.index = new_index.get(r.index)
            for i, a in enumerate(grow):
                self.runs.append(self.rows.adapter_run(len(keep) + i, a, step))

    def _drop_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.drop()

    def _refilled(self, k: int) -> None:
        """Slot ``k`` holds a new adapter of the same rank: the held graphs stay (they read
        its weights, moments, learning rate and step count where the refill wrote them),
        and read its scale from their segment metadata, written here in place."""
        if self.graphs is None:
            return
        scale = self.pack.scale(k)
        for b in self.graphs.held_buffers():
            if b.meta is not None:
                b.meta.set_scale(k, scale)

    def _complete(self, a: JobAdapter) -> JobAdapter:
        """``a`` with every training setting of its own: the job's where it gives none."""
        c = self.cfg
        fill = {"dropout": c.lora.dropout, "weight_decay": c.training.weight_decay,
                "scheduler": c.training.scheduler, "rslora": False}
        missing = {k: v for k, v in fill.items() if getattr(a, k) is None}
        return a.model_copy(update=missing) if missing else a

    def _linger(self, step: int) -> bool:
        """Every adapter has left: wait up to ``streaming.linger_s`` for a join (True when
        one was taken). control.json's ``close``, or SIGTERM, ends the wait at once."""
        wait = self.cfg.streaming.linger_s
        if wait <= 0 or self.joins.closed or self.tp is not None:
            return False
        self.checkpointer.drop()  # nothing trains: its states would only be resumed by mistake
        self._write_progress(step, lingering=True)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not self.joins.closed and not self.checkpointer.stop_requested:
            time.sleep(LINGER_POLL_S)
            self._check_control(step)
            if self._active():
                return True
        return False


def side_lane_for(device: torch.device) -> SideLane | None:
    """A job's side lane where its steps replay CUDA graphs: on a GPU (a CPU job's steps
    use the model eagerly, so nothing could go on beside them)."""
    return SideLane(device) if device.type == "cuda" else None


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("hardware.device is cuda but no CUDA device is visible")
    return torch.device(name)


def recipe_main(cfg: DictConfig) -> None:
    """The job process: `tune run plora/train/packed_lora.py --config job.yaml`: `run`, with
    the job's exit codes (`plora.job.outputs`) for what it cannot finish."""
    hooks.load_env_hooks()  # tests' hooks (PLORA_TEST_HOOKS); none in production
    try:
        recipe = PackedLoRARecipe(cfg)
        try:
            summary = recipe.run()
        except torch.OutOfMemoryError as e:
            # Adapters that finished before this are saved; the engine re-queues the rest.
            write_oom(recipe.job_dir, str(e))
            print(f"out of memory: {str(e)[:500]}", file=sys.stderr, flush=True)
            sys.exit(EXIT_OOM)
    except UNFIXABLE_ERRORS as e:
        # The same model, data or config fails the same way on every attempt: say so and
        # let the engine fail the adapters at once instead of retrying.
        message = " ".join(str(e).split())[:2000] or type(e).__name__
        write_error(_job_dir_of(cfg), message)
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


def leave(code: int | str | None) -> None:
    """End the job process once `recipe_main` has returned: every file it wrote is closed
    and its summary printed, so a one-process job skips the interpreter's teardown (freeing
    the CUDA context and every module's objects: a second or more on a GPU, during which
    the engine cannot start the next job). A TP job leaves the ordinary way (its process
    group is torchrun's). ``code`` as `sys.exit` takes it (a message: printed, exit 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.exit(code)
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def run_then_leave(main: Callable[[], object]) -> None:
    """Run the job's parsed main and `leave` with its exit code. torchtune's `config.parse`
    ends the main it wraps with `sys.exit`: a `leave` put after it was never reached, and
    every job process went through the interpreter's teardown."""
    try:
        main()
        code: int | str | None = 0
    except SystemExit as e:
        code = e.code
    leave(code)


if __name__ == "__main__":
    from plora.job.phases import watch_dynamo_import

    watch_dynamo_import()
    from torchtune import config as tune_config

    run_then_leave(tune_config.parse(recipe_main))
