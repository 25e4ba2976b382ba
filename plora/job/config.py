"""The job config: everything one packed job reads, typed, with every job default here.

A job (`plora.train.packed_lora`) is a process of its own that reads its ``job.yaml``.
The sweep (`plora.job.from_spec.job_config`), the profiler's probes and the job probe build a
`JobConfig`; ``job.yaml`` is its dump (`JobConfig.to_yaml`); the recipe validates what it
is given back into a `JobConfig` before anything else and then reads typed attributes
only. Unknown keys are errors, so a typo in a job file fails the job at once (as an
unfixable config) instead of silently training with a default.

The space file's sections (`plora.spec.schema`) say what a user asks for; these say what one job
does, with the sweep's decisions already made: the adapters' step budgets and warm-ups,
the LoRA targets resolved for the model's family, the model's folder on disk.

Its defaults are the space file's (`plora.spec.defaults`); nothing else of plora is imported:
the spec's schema, the sweep, the profiler and the recipe all sit above this.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from plora.spec import defaults as D

__all__ = [
    "JobAdapter",
    "JobConfig",
    "JobData",
    "JobEval",
    "JobLora",
    "JobModel",
    "JobStreaming",
    "JobTraining",
    "SyntheticRows",
    "NEUTRAL_EVAL",
    "NEUTRAL_TRAINING",
]

#: training settings that change how a job runs, not what an adapter learns: a checkpoint
#: taken under other values resumes (`plora.train.checkpoint`), and so does a run directory
#: (`plora.engine.preflight.check_resumable`)
#: (a micro-batch size too: accumulated steps equal one pass's, and checkpoints hold adapters
#: at their optimizer-step boundaries)
NEUTRAL_TRAINING = ("checkpoint_every_steps", "checkpoint_every_minutes", "cuda_graphs", "activation_checkpointing",
                    "micro_batch_size")
#: eval settings that change only what a pruner sees, not an adapter's results: a run
#: directory of other values resumes (`plora.engine.preflight.check_resumable`)
NEUTRAL_EVAL = ("intermediate_samples",)


class _Section(BaseModel):
    # A typo must not fall back to a default; NaN/inf are never a setting.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class JobModel(_Section):
    path: str  # the model folder on disk (the spec's ``model.path`` resolved)
    family: str = "auto"
    dtype: Literal["float32", "bfloat16", "float16"] = D.DTYPE
    max_seq_len: int = Field(ge=1)
    random_init: bool = False  # a shape-only folder: weights drawn at random (planning, probes)
    quantize: Literal["nf4"] | None = None  # the block linears held 4-bit (`plora.quantize`)


class SyntheticRows(_Section):
    """Fixed-length random rows and no eval: what probes and benchmarks train on, where
    only shapes matter."""

    seq_len: int = Field(ge=1)
    num_samples: int = Field(1024, ge=1)


class JobData(_Section):
    """Where a job's rows come from and how they are read (the spec's ``data`` section,
    paths as text; the eval-row limit is `JobEval.max_eval_samples`)."""

    task: str | None = None  # builtin:<name>, or None for files
    train: str | None = None  # a file, or a folder written by datasets' save_to_disk
    eval: str | None = None
    train_split: str | None = None  # the split of a folder of splits (a DatasetDict)
    eval_split: str | None = None
    format: Literal["auto", "plain", "instruction", "chat", "sharegpt"] = D.DATA_FORMAT
    input_column: str = D.INPUT_COLUMN
    output_column: str = D.OUTPUT_COLUMN
    instruction_column: str = D.INSTRUCTION_COLUMN
    messages_column: str = D.MESSAGES_COLUMN
    conversations_column: str = D.CONVERSATIONS_COLUMN
    prompt_template: str | None = None
    on_bad_rows: Literal["error", "drop"] = D.ON_BAD_ROWS
    num_train: int | None = Field(None, ge=1)  # a built-in task's rows
    num_eval: int | None = Field(None, ge=1)
    synthetic: SyntheticRows | None = None  # instead of any of the above


class JobLora(_Section):
    targets: list[str] = Field(min_length=1)  # resolved for the model's family
    dropout: float = Field(D.LORA_DROPOUT, ge=0.0, lt=1.0)


class JobAdapter(_Section):
    """One adapter of the pack, with its own budget and warm-up in its own steps."""

    id: str
    rank: int = Field(ge=1)
    alpha: float
    learning_rate: float = Field(gt=0)
    batch_size: int = Field(ge=1)
    seed: int
    steps: int = Field(ge=0)
    #: computed by whoever builds the job (the sweep: `plora.spec.sections.warmup_steps_for`), never by the job
    warmup_steps: int = Field(0, ge=0)
    #: the adapter's own training settings; None: the job's (``lora.dropout``,
    #: ``training.weight_decay``, ``training.scheduler``). The sweep gives every one.
    dropout: float | None = Field(None, ge=0.0, lt=1.0)  # on the LoRA input of its own rows
    weight_decay: float | None = Field(None, ge=0)
    scheduler: Literal["constant", "linear", "cosine"] | None = None
    rslora: bool | None = None  # scale alpha/sqrt(rank) (PEFT's use_rslora); None: off
    #: its own steps at which its eval loss is written besides ``eval.every_steps`` (a tune's
    #: rungs at fixed fractions of its budget: `plora.tuning.fidelity`), computed by whoever builds the job
    eval_steps: list[int] = Field(default_factory=list)
    #: its rows per packed step at most, where its batch does not fit one pass (the planner's
    #: choice: `plora.planner.micro_batch`); None: the job's ``training.micro_batch_size``
    micro_batch_size: int | None = Field(None, ge=1)

    def hyperparameters(self) -> dict[str, Any]:
        """What identifies the configuration (metrics.json's ``config``): the five of every
        adapter, and the training settings it was given."""
        return self.model_dump(include={"rank", "alpha", "learning_rate", "batch_size", "seed", "dropout",
                                        "weight_decay", "scheduler", "rslora"}, exclude_none=True)


class JobTraining(_Section):
    scheduler: Literal["constant", "linear", "cosine"] = D.SCHEDULER
    grad_clip: float | None = Field(D.GRAD_CLIP, gt=0)  # per adapter; None: no clipping
    weight_decay: float = Field(D.WEIGHT_DECAY, ge=0)
    divergence_loss: float | None = Field(None, gt=0)  # a finite loss above this also diverges
    activation_checkpointing: bool = D.ACTIVATION_CHECKPOINTING
    # "auto": on one CUDA device without activation checkpointing (`plora.train.step_graph`);
    # YAML's and the space file's on/off arrive as booleans
    cuda_graphs: Literal["auto"] | bool = D.CUDA_GRAPHS
    row_layout: Literal["auto", "flat", "padded", "balanced"] = D.ROW_LAYOUT
    length_buckets: Literal["auto"] | int = D.LENGTH_BUCKETS  # `plora.data.row_layout.length_buckets_for`
    # a pack with a freed slot (or a slot refilled by a smaller batch) may replay a fuller
    # pack's CUDA graph, padding rows where it has fewer, while that costs less than a capture
    # (`plora.train.step_graph`); the job probe turns it off, so that each pack it runs is
    # captured and the cost model sees what a capture costs
    cover_vacant_slots: bool = True
    checkpoint_every_steps: int | None = Field(D.CHECKPOINT_EVERY_STEPS, ge=1)  # None turns that trigger off
    checkpoint_every_minutes: float | None = Field(D.CHECKPOINT_EVERY_MINUTES, gt=0)
    # an adapter's rows per packed step at most; a larger batch accumulates (`plora.data.accumulation`)
    micro_batch_size: int | None = Field(None, ge=1)


class JobStreaming(_Section):
    """Adapters joining the job while it runs (`plora.job.control`: control.json's ``join``
    list). Without joins these change nothing: the job leaves when its last adapter does."""

    #: seconds a job whose adapters have all left waits for a join before it leaves; a join
    #: restarts the wait, control.json's ``close`` ends it at once. 0: leave at once.
    linger_s: float = Field(0.0, ge=0)
    #: adapters training at once; a join beyond it waits (in control.json) for a slot to free.
    #: None: no limit (whoever sends the join has checked the memory)
    max_active: int | None = Field(None, ge=1)
    #: the sum of the ranks of the adapters training at once, likewise
    max_active_rank: int | None = Field(None, ge=1)


class JobEval(_Section):
    metrics: list[str] = Field(default_factory=lambda: list(D.EVAL_METRICS))
    max_new_tokens: int = Field(D.MAX_NEW_TOKENS, ge=1)
    max_eval_samples: int = Field(D.MAX_EVAL_SAMPLES, ge=1)
    every_steps: int | None = Field(None, ge=1)  # intermediate eval loss every N adapter steps
    #: the metric that ranks adapters, by its results name (``eval_<objective>``); None: the
    #: loss. Intermediate evals also score it (on `intermediate_samples` rows) where it is not
    #: the loss, and it picks an adapter's best epoch (`each_epoch`)
    objective: str | None = None
    greater_is_better: bool = False  # the objective's direction, resolved by the spec
    #: eval rows an intermediate eval scores the objective on: the same rows each time, for every adapter
    intermediate_samples: int = Field(D.INTERMEDIATE_SAMPLES, ge=1)
    #: score every adapter on the eval set at each of its epoch ends and keep its best epoch's
    #: weights (`plora.train.epochs`)
    each_epoch: bool = False
    choices: list[str] | None = None  # choice_accuracy: the labels of every row
    choices_column: str | None = None  # or a column of each row's own choices
    python_path: list[str] = Field(default_factory=list)  # where user metrics are imported from
    #: rows an eval forward takes at once; None: by the job's device (`plora.spec.defaults.eval_batch_rows`)
    batch_rows: int | None = Field(None, ge=1)
    token_budget: int | None = Field(None, ge=1)  # tokens of one eval batch; None: from device memory


class JobConfig(_Section):
    """One packed job: its adapters, where it writes, and how it trains and evaluates."""

    job_id: str
    output_dir: Path  # the run directory: adapters/<id>/ and base_metrics.json land here
    job_dir: Path | None = None  # default: <output_dir>/jobs/<job_id>
    tp: int | None = Field(None, ge=1)  # must agree with the processes launched (WORLD_SIZE)
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda (| cuda:<i>)
    num_threads: int | None = Field(None, ge=1)  # torch's intra-op threads; None: torch's default
    model: JobModel
    data: JobData = Field(default_factory=JobData)
    lora: JobLora
    adapters: list[JobAdapter] = Field(min_length=1)
    training: JobTraining = Field(default_factory=JobTraining)
    eval: JobEval = Field(default_factory=JobEval)
    eval_base: bool = False  # also evaluate the base model (base_metrics.json)
    streaming: JobStreaming = Field(default_factory=JobStreaming)

    @model_validator(mode="after")
    def _defaults(self) -> JobConfig:
        if self.job_dir is None:
            self.job_dir = self.output_dir / "jobs" / self.job_id
        if self.tp is not None:
            from plora.quantize.cost import check_tp

            check_tp(self.model.quantize, self.tp)
        ids = [a.id for a in self.adapters]
        if len(set(ids)) != len(ids):
            raise ValueError(f"adapter ids repeat: {ids}")
        return self

    @classmethod
    def parse(cls, cfg: JobConfig | Mapping[str, Any]) -> JobConfig:
        """A job config from what a job is given: a `JobConfig`, a plain mapping (a loaded
        job.yaml) or the DictConfig `tune run` hands a recipe."""
        if isinstance(cfg, JobConfig):
            return cfg
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
        return cls.model_validate(dict(cfg))

    @classmethod
    def load(cls, path: str | Path) -> JobConfig:
        return cls.parse(yaml.safe_load(Path(path).read_text()))

    def to_dict(self) -> dict[str, Any]:
        """Plain values (paths as text): what job.yaml holds."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def write(self, path: str | Path) -> Path:
        """Write job.yaml (what `tune run ... --config` reads)."""
        path = Path(path)
        path.write_text(self.to_yaml())
        return path
