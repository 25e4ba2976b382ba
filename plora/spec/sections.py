"""The sections of a space file other than ``model`` and ``space``: ``data``, ``lora``,
``training``, ``eval``, ``hardware``, ``planner``, ``optuna``, ``logging`` and ``output``.

Each is a strict pydantic model (`_Model`): unknown keys and bad values are one-line errors
naming the field. The defaults a job also has come from `plora.spec.defaults`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import Field, ValidationInfo, field_validator, model_validator

from plora.models.families.targets import ALL_LINEAR, DEFAULT_TARGETS
from plora.spec import defaults as D
from plora.spec.base import _base_dir, _fmt, _Issue, _Model, _resolve, _where_relative
from plora.spec.model import _check_targets, resolve_targets


DATA_SUFFIXES: tuple[str, ...] = (".json", ".jsonl", ".csv", ".parquet")


class DataConfig(_Model):
    task: Optional[str] = None  # defaults to builtin:shift when no train file is given
    train: Optional[Path] = None  # a file, or a folder written by datasets' save_to_disk
    eval: Optional[Path] = None
    train_split: Optional[str] = Field(None, min_length=1)  # a folder of splits: the one to read
    eval_split: Optional[str] = Field(None, min_length=1)
    format: Literal["auto", "plain", "instruction", "chat", "sharegpt"] = D.DATA_FORMAT  # auto: from the columns
    input_column: str = Field(D.INPUT_COLUMN, min_length=1)
    output_column: str = Field(D.OUTPUT_COLUMN, min_length=1)
    instruction_column: str = Field(D.INSTRUCTION_COLUMN, min_length=1)
    messages_column: str = Field(D.MESSAGES_COLUMN, min_length=1)
    conversations_column: str = Field(D.CONVERSATIONS_COLUMN, min_length=1)  # ShareGPT rows
    prompt_template: Optional[str] = None  # e.g. "Question: {input}\nAnswer:" (plain and instruction rows)
    on_bad_rows: Literal["error", "drop"] = D.ON_BAD_ROWS  # rows without an answer (or cut away by max_seq_len)
    num_train: Optional[int] = Field(None, ge=1)
    num_eval: Optional[int] = Field(None, ge=1)
    max_eval_samples: int = Field(D.MAX_EVAL_SAMPLES, ge=1)

    @field_validator("task")
    @classmethod
    def _check_task(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        if not v.startswith("builtin:") or not v.removeprefix("builtin:"):
            raise _Issue(f"must be builtin:<name> (give data.train for your own files), got {v!r}")
        name = v.removeprefix("builtin:")
        try:  # imported here: the tasks module is heavier and optional for validation
            from plora.data.tasks import BUILTIN_TASKS
        except ImportError:
            return v
        if name not in BUILTIN_TASKS:
            raise _Issue(f"unknown built-in task {name!r}; available: {', '.join(sorted(BUILTIN_TASKS))}")
        return v

    @field_validator("train", "eval")
    @classmethod
    def _check_file(cls, v: Optional[Path], info: ValidationInfo) -> Optional[Path]:
        if v is None:
            return v
        p = _resolve(v, info)
        if p.is_dir():
            from plora.data.folders import DatasetFolderError, splits_of

            try:
                splits_of(p)
            except DatasetFolderError as e:
                raise _Issue(str(e)) from None
            return p
        if p.suffix.lower() not in DATA_SUFFIXES:
            kind = p.suffix or "(none)"
            raise _Issue(f"unsupported file type {kind!r} in {p}; use one of {', '.join(DATA_SUFFIXES)}")
        if not p.is_file():
            raise _Issue(f"file not found: {p}{_where_relative(v, info)}")
        return p

    @field_validator("prompt_template")
    @classmethod
    def _check_template(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        from plora.data.formats import template_fields

        try:
            template_fields(v)
        except ValueError as e:
            raise _Issue(str(e)) from None
        return v

    @model_validator(mode="after")
    def _check_source(self) -> "DataConfig":
        if self.format in ("chat", "sharegpt") and self.prompt_template is not None:
            raise _Issue(f"not used with format {self.format} (the model's chat template renders its rows)",
                         "prompt_template")
        if self.task is not None and self.format not in ("auto", "plain"):
            raise _Issue(f"a built-in task has plain rows, not {self.format}", "format")
        if self.task is not None and self.train is not None:
            raise _Issue("give either task or train (+ eval) files, not both")
        if self.train is None:
            if self.eval is not None:
                raise _Issue("needs data.train (a built-in task makes its own eval set)", "eval")
            if self.task is None:
                self.task = "builtin:shift"
        else:
            for name in ("num_train", "num_eval"):
                if getattr(self, name) is not None:
                    raise _Issue("only used with a built-in task, not with train files", name)
        self._pick_splits()
        return self

    def _pick_splits(self) -> None:
        """The split each saved-dataset folder is read from (`plora.data.folders`)."""
        from plora.data.folders import DatasetFolderError, pick_split

        for role in ("train", "eval"):
            path, field = getattr(self, role), f"{role}_split"
            wanted = getattr(self, field)
            if path is None or not path.is_dir():
                if wanted is not None:
                    raise _Issue(f"only for a folder of splits written by datasets' save_to_disk "
                                 f"(data.{role} is {path or 'not given'})", field)
                continue
            try:
                setattr(self, field, pick_split(path, role, wanted))
            except DatasetFolderError as e:
                raise _Issue(str(e), field) from None

    @property
    def task_name(self) -> Optional[str]:
        """The built-in task's name without ``builtin:``, or None for files."""
        return self.task.removeprefix("builtin:") if self.task else None


class LoraConfig(_Model):
    targets: Union[str, list[str]] = Field(default_factory=lambda: list(DEFAULT_TARGETS))
    dropout: float = D.LORA_DROPOUT
    rslora: bool = False  # scale alpha/sqrt(rank) instead of alpha/rank (PEFT's use_rslora)

    @field_validator("targets")
    @classmethod
    def _check(cls, v: Union[str, list[str]]) -> Union[str, list[str]]:
        _check_targets(v)
        if isinstance(v, str) and v != ALL_LINEAR:  # a single name is a one-item list
            return [v]
        return v

    @field_validator("dropout")
    @classmethod
    def _check_dropout(cls, v: float) -> float:
        if not 0 <= v < 1:
            raise _Issue(f"must be in [0, 1), got {_fmt(v)}")
        return v

    def resolved_targets(self) -> list[str]:
        return resolve_targets(self.targets)


def cuda_graphs_setting(value: Any) -> Union[str, bool]:
    """``training.cuda_graphs`` (or ``PLORA_CUDA_GRAPHS``) as "auto", True or False; YAML's
    on/off arrive as booleans, the environment's as text."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text in ("on", "true", "yes", "1"):
        return True
    if text in ("off", "false", "no", "0"):
        return False
    raise ValueError(f"expected auto, on or off, got {value!r}")


def warmup_steps_for(total_steps: int, warmup_steps: Optional[int], warmup_ratio: Optional[float]) -> int:
    """An adapter's warm-up in its own steps: ``warmup_steps``, or ``warmup_ratio`` of its
    ``total_steps`` rounded up (as transformers does). The one place it is computed: the
    space file's validation and the job both call it."""
    if warmup_ratio:
        return int(math.ceil(float(warmup_ratio) * int(total_steps)))
    return int(warmup_steps or 0)


class TrainingConfig(_Model):
    epochs: Optional[float] = Field(None, gt=0)  # defaults to 1 when steps is not given
    steps: Optional[int] = Field(None, ge=1)
    warmup_steps: Optional[int] = Field(None, ge=0)  # defaults to 0 when warmup_ratio is not given
    warmup_ratio: Optional[float] = Field(None, ge=0, le=1)
    scheduler: Literal["constant", "linear", "cosine"] = D.SCHEDULER
    grad_clip: Optional[float] = Field(D.GRAD_CLIP, gt=0)
    weight_decay: float = Field(D.WEIGHT_DECAY, ge=0)
    divergence_loss: Optional[float] = Field(None, gt=0)
    # recompute each decoder layer in backward: far less activation memory, a slower step;
    # "auto": on only where some adapter of the sweep fits a GPU with it and not without it,
    # even alone at its smallest micro-batch (`plora.sweep.resolve_checkpointing`)
    activation_checkpointing: Union[Literal["auto"], bool] = D.ACTIVATION_CHECKPOINTING
    # steps replayed from CUDA graphs: "auto" = on one GPU without activation checkpointing
    cuda_graphs: Any = D.CUDA_GRAPHS
    # rows of a packed step: "flat" (no padding: one token stream, attention confined to each
    # row), "padded" (each row padded to the pack's widest), "balanced" (flat, each adapter's
    # rows dealt into batches of nearly equal tokens, so one segment size holds every step of
    # a CUDA graph: `plora.data.balanced_stream`), or "auto": flat, except in steps replayed from
    # CUDA graphs, where it is padded, or balanced where rows vary so much in length that
    # padding them would cost 8% or more (H100, 16 adapters of varied rows: 57 ms padded
    # against 427 ms plain flat, whose per-adapter sizes keep growing and recapturing)
    row_layout: Literal["auto", "flat", "padded", "balanced"] = D.ROW_LAYOUT
    # padded rows: each adapter draws its rows from this many length buckets in turn (the
    # same bucket at the same step for every batch size), so a step pads to the longest row
    # of one bucket, not of the whole data; "auto": where rows are padded in CUDA-graph
    # steps (one GPU), the count (1-8) that costs the sweep's jobs least for its rows and step
    # budgets (`plora.data.row_layout.auto_length_buckets`; more buckets pad less, each is one more
    # graph to capture), else 1 (a plain shuffle)
    length_buckets: Union[Literal["auto"], int] = D.LENGTH_BUCKETS
    # mid-job checkpoints (weights, AdamW state, schedule and data position of every adapter
    # in the pack), whichever comes first; null turns that trigger off
    checkpoint_every_steps: Optional[int] = Field(D.CHECKPOINT_EVERY_STEPS, ge=1)
    checkpoint_every_minutes: Optional[float] = Field(D.CHECKPOINT_EVERY_MINUTES, gt=0)
    # the most rows an adapter puts in one packed step: a larger batch_size (still the
    # effective batch, an optimizer step's rows) accumulates its gradient over
    # ceil(batch_size / micro_batch_size) packed steps in near-equal parts, and trains as
    # it would in one pass (`plora.data.accumulation`); null: every batch in one pass
    micro_batch_size: Optional[int] = Field(None, ge=1)

    @field_validator("cuda_graphs", mode="before")
    @classmethod
    def _graphs(cls, v: Any) -> Union[str, bool]:
        return cuda_graphs_setting(v)

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing(cls, v: Any) -> Union[str, bool]:
        if v == "auto" or isinstance(v, bool):
            return v
        raise ValueError("must be true, false or auto")

    @property
    def checkpointing(self) -> bool:
        """Whether jobs recompute activations: ``auto`` counts as off until a sweep resolves
        it (`plora.sweep.resolve_checkpointing`), as a profile of the model measures it."""
        return self.activation_checkpointing is True

    @field_validator("length_buckets")
    @classmethod
    def _buckets(cls, v: Union[str, int]) -> Union[str, int]:
        if v != "auto" and (isinstance(v, bool) or int(v) < 1):
            raise ValueError("must be auto or a whole number of at least 1")
        return v

    @model_validator(mode="after")
    def _check(self) -> "TrainingConfig":
        if self.epochs is not None and self.steps is not None:
            raise _Issue("give exactly one of epochs or steps")
        if self.epochs is None and self.steps is None:
            self.epochs = 1.0
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise _Issue("give at most one of warmup_steps or warmup_ratio")
        if self.warmup_steps is None and self.warmup_ratio is None:
            self.warmup_steps = 0
        return self

    def warmup_for(self, total_steps: int) -> int:
        """Warm-up steps of an adapter that trains ``total_steps`` steps."""
        return warmup_steps_for(total_steps, self.warmup_steps, self.warmup_ratio)


class EvalConfig(_Model):
    # plora.results.metrics.BUILTIN_METRICS, or a user metric "module:function"
    metrics: list[str] = Field(default_factory=lambda: list(D.EVAL_METRICS))
    max_new_tokens: int = Field(D.MAX_NEW_TOKENS, ge=1)
    objective: Optional[str] = None  # exact_match if measured, else the first metric
    greater_is_better: Optional[bool] = None  # default: false for loss and perplexity, true for every other metric
    every_steps: Optional[int] = Field(None, ge=1)  # intermediate eval loss every N adapter steps (pruning, curves)
    # eval rows on which intermediate evals also score the objective where it is not the loss
    # (generation is costly): the same rows each time, for every adapter; clipped to the eval set
    intermediate_samples: int = Field(D.INTERMEDIATE_SAMPLES, ge=1)
    choices: Optional[list[str]] = None  # choice_accuracy: the label choices of every row
    choices_column: Optional[str] = Field(None, min_length=1)  # or: a column with each row's own choices
    # rows one eval forward takes at once (every adapter's rows counted); default: 256 on a
    # CPU, 2048 on a GPU (`plora.spec.defaults.eval_batch_rows`); the device's free memory
    # still caps each forward's tokens
    batch_rows: Optional[int] = Field(None, ge=1)

    @field_validator("metrics")
    @classmethod
    def _check_metrics(cls, v: list[str], info: ValidationInfo) -> list[str]:
        from plora.results.metrics import MetricError, check_metric

        for i, name in enumerate(v):
            try:
                check_metric(name, _base_dir(info))
            except MetricError as e:
                raise _Issue(str(e), i) from None
        return v

    @field_validator("choices")
    @classmethod
    def _check_choices(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is None:
            return v
        if len(v) < 2:
            raise _Issue(f"needs at least two choices, got {_fmt(v)}")
        if any(not c.strip() for c in v):
            raise _Issue("a choice is empty")
        if len(set(v)) != len(v):
            raise _Issue(f"duplicate choice in {_fmt(v)}")
        return v

    @model_validator(mode="after")
    def _check(self) -> "EvalConfig":
        from plora.results.metrics import metric_name

        if not self.metrics:
            raise _Issue("must name at least one metric", "metrics")
        names = [metric_name(m) for m in self.metrics]
        if len(set(names)) != len(names):
            raise _Issue(f"duplicate metric in {_fmt(self.metrics)}", "metrics")
        if "choice_accuracy" in names:
            if (self.choices is None) == (self.choices_column is None):
                raise _Issue("choice_accuracy needs exactly one of eval.choices or eval.choices_column", "metrics")
        else:
            for name in ("choices", "choices_column"):
                if getattr(self, name) is not None:
                    raise _Issue("only used with the choice_accuracy metric", name)
        if self.objective is None:
            self.objective = "exact_match" if "exact_match" in names else names[0]
        elif self.objective in self.metrics:
            self.objective = metric_name(self.objective)
        elif self.objective not in names:
            raise _Issue(f"{self.objective!r} is not in eval.metrics {_fmt(self.metrics)}", "objective")
        return self

    @property
    def metric_names(self) -> list[str]:
        """What each metric is called in results (``eval_<name>``)."""
        from plora.results.metrics import metric_name

        return [metric_name(m) for m in self.metrics]

    @property
    def minimize(self) -> bool:
        """Whether a lower objective is better (loss, perplexity, or ``greater_is_better: false``)."""
        from plora.results.metrics import minimize

        return minimize(self.objective, self.greater_is_better)


class RayConfig(_Model):
    address: Optional[str] = None  # a running cluster ("auto", "ray://host:10001", "host:6379"); default: start one here
    cpus_per_gpu: float = Field(1.0, ge=0)  # CPUs reserved beside each GPU of a job


class HardwareConfig(_Model):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    gpus: int = Field(1, ge=1)
    gpu_memory_gb: float = Field(80, gt=0)
    backend: Literal["local", "ray"] = "local"  # ray: jobs run as Ray tasks on a cluster (pip install "plora[ray]")
    nodes: int = Field(1, ge=1)  # ray: the planner plans for nodes x gpus_per_node
    gpus_per_node: Optional[int] = Field(None, ge=1)  # default: gpus; CPU slots per node on a CPU cluster
    ray: RayConfig = Field(default_factory=dict)

    @property
    def per_node(self) -> int:
        """GPUs (or CPU slots) of one node: the largest TP degree a job may have."""
        return self.gpus_per_node or self.gpus


class PlannerConfig(_Model):
    max_adapters_per_job: int = Field(8, ge=1)
    solver: Literal["auto", "gurobi", "highs"] = "auto"
    memory_load_factor: float = Field(0.9, gt=0, le=1)
    objective: Literal["makespan", "paper"] = "makespan"
    #: adapters of jobs not started yet join running one-GPU jobs that have room for them (by
    #: the cost model's memory and max_adapters_per_job) instead of waiting for a job of their
    #: own: the longest first, each where the cost model predicts the pack ends soonest
    #: (`plora.engine.join_choice`). "auto": on a GPU (a job process, its imports and its
    #: model are then paid once per GPU, and packs never drain while adapters wait), off on
    #: a CPU (the demo's one-core jobs gain nothing from it)
    streaming: Union[bool, Literal["auto"]] = "auto"
    #: run a baseline instead of the packed plan, on the same engine, to measure what packing
    #: saves: ``min_gpu`` (one adapter per job on the fewest GPUs that hold it, jobs side by
    #: side), ``max_gpu`` (one adapter per job on as many GPUs as it can use) or
    #: ``sequential`` (one adapter at a time); nothing is streamed into their jobs
    baseline: Optional[Literal["min_gpu", "max_gpu", "sequential"]] = None

    def streams(self, gpu: bool) -> bool:
        """Whether a sweep on a GPU (``gpu``) or CPU slots streams adapters into running jobs."""
        if self.baseline is not None:
            return False
        return self.streaming is True or (self.streaming == "auto" and gpu)


class PrunerConfig(_Model):
    """Where ``plora tune``'s pruner looks: rungs at fixed fractions of each adapter's own
    training budget, ``min_fraction × reduction_factor^k`` (`plora.tuning.fidelity`)."""

    min_fraction: float = Field(1 / 9, gt=0, lt=1)  # the first rung: the share of its budget an adapter has seen
    reduction_factor: int = Field(3, ge=2)  # rungs' spacing, and the share (1/η) a rung keeps
    #: a rung stops no trial until this many trials have been scored at it (default: the
    #: reduction factor): the first ones to reach it are not judged against one another alone
    min_trials_per_rung: Optional[int] = Field(None, ge=1)

    @property
    def min_peers(self) -> int:
        return self.min_trials_per_rung or self.reduction_factor


class OptunaConfig(_Model):
    storage: Optional[str] = None  # any Optuna storage URL; default: sqlite in the run directory
    study_name: Optional[str] = None  # default: the sweep's name
    pruner: PrunerConfig = Field(default_factory=dict)
    #: ``plora tune`` stops asking trials once its jobs have spent this many GPU-seconds
    #: (``--budget``); running trials then finish (``finish``) or are pruned (``stop``)
    budget_gpu_seconds: Optional[float] = Field(None, gt=0)
    on_budget: Literal["finish", "stop"] = "finish"


class WandbConfig(_Model):
    """A Weights & Biases run per adapter (`plora.tracking`)."""

    project: str = Field("plora", min_length=1)
    entity: Optional[str] = None  # default: the account's own
    mode: Optional[Literal["online", "offline", "disabled"]] = None  # default: WANDB_MODE, else online
    group: Optional[str] = None  # default: the sweep's name
    tags: list[str] = Field(default_factory=list)


class LoggingConfig(_Model):
    """Experiment trackers each adapter's curves, eval metrics and hyperparameters go to
    (`plora.tracking`); each needs its optional extra, checked here."""

    tensorboard: bool = False  # event files under <run>/tensorboard/<adapter-id>/
    wandb: Optional[WandbConfig] = None  # true: every default; a mapping: its settings

    @field_validator("wandb", mode="before")
    @classmethod
    def _switch(cls, v: Any) -> Any:
        if v is True:
            return {}
        return None if v is False else v

    @field_validator("tensorboard", "wandb")
    @classmethod
    def _package(cls, v: Any, info: ValidationInfo) -> Any:
        from plora.tracking.packages import missing_package

        if v:
            problem = missing_package(info.field_name)
            if problem:
                raise _Issue(problem)
        return v


class OutputConfig(_Model):
    dir: Path = Path("runs")

    @field_validator("dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        # An output, unlike the inputs: runs land where the user runs plora (`plora sweep
        # sweeps/demo.yaml` writes runs/demo here), not next to the space file.
        return Path(v).expanduser().resolve()
