"""plora's environment variables, read in one place into typed settings.

Every ``PLORA_*`` variable a plora process reads is named here, with its type and default;
the code that needs one asks `settings()` (or `Settings.from_env` for the environment of
another process, such as a job about to start) instead of reading ``os.environ`` itself.
What the engine *sets* for a job (``PLORA_ATTEMPT``, ``PLORA_HANDED_AT``, ``PLORA_CPUS``)
uses the same names. The variables are read on each call, never cached, so that a test or a
job process that changes its environment is seen at once.

``plora.kernels`` (the top-level ``kernels/`` folder) reads ``PLORA_KERNELS`` from here too
(`plora.kernels.backend_for`, which refuses a value other than auto, torch or triton); this
module imports nothing of plora, so the kernels depend on nothing else of it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

#: plora's cache (GGUF folders, model shapes, model checks; profiles where not overridden)
CACHE_DIR = "PLORA_CACHE_DIR"
#: the packed LoRA kernels: "auto" (Triton on CUDA, torch elsewhere), "torch" or "triton"
KERNELS = "PLORA_KERNELS"
#: overrides ``training.cuda_graphs`` (auto, on, off)
CUDA_GRAPHS = "PLORA_CUDA_GRAPHS"
#: which attempt of its job a job process is (set by the engine; 1 first)
ATTEMPT = "PLORA_ATTEMPT"
#: when a job was handed to the process started ahead for it (set by the engine)
HANDED_AT = "PLORA_HANDED_AT"
#: modules or ``.py`` files a job imports to install test hooks (comma-separated)
TEST_HOOKS = "PLORA_TEST_HOOKS"
#: 0 (false, no, off) starts every job the ordinary way, without a process started ahead
SPARE_JOBS = "PLORA_SPARE_JOBS"
#: 0 (false, no, off) has a process started ahead import torchtune with its package ``__init__``s
LEAN_IMPORTS = "PLORA_LEAN_IMPORTS"
#: threads that compile a step's Triton kernels ahead of its first launch (0: compile each
#: kernel at its launch, one after another)
COMPILE_THREADS = "PLORA_COMPILE_THREADS"
#: 0 (false, no, off) runs a new composition's first step eagerly and captures its graph at
#: the second (by default a composition's graph is captured, then replayed, at its first step)
CAPTURE_FIRST = "PLORA_CAPTURE_FIRST"
#: "0" runs a job's evals of leaving adapters and its captures ahead in its own thread, in
#: turn with its steps, instead of beside them on its side lane (`plora.train.side_lane`)
OVERLAP = "PLORA_OVERLAP"
#: 0 leaves each job's threads and cores to the libraries' defaults
CPU_SHARE = "PLORA_CPU_SHARE"
#: the cores a job process is bound to (``0-7,32-39``; set by the engine)
CPUS = "PLORA_CPUS"
#: seconds between two progress lines of a running job in a log
LOG_PROGRESS_S = "PLORA_LOG_PROGRESS_S"
#: how a GGUF file becomes a model folder: "auto" (plora's own reader where it knows the file's
#: layout, else transformers) or "transformers" (always through transformers' model classes)
GGUF_CONVERTER = "PLORA_GGUF_CONVERTER"
#: 0 (false, no, off) leaves ``PYTHONDONTWRITEBYTECODE`` as it is: plora's processes compile
#: their imports afresh each time instead of keeping the bytecode in plora's cache
#: (`plora.bytecode_cache`)
BYTECODE_CACHE = "PLORA_BYTECODE_CACHE"
#: 0 (false, no, off): no pool compiles a first sweep's modules ahead (`plora.bytecode_ahead`)
BYTECODE_AHEAD = "PLORA_BYTECODE_AHEAD"
#: 0 (false, no, off) leaves a job's RoPE and RMSNorm modules as the model's builder made them,
#: instead of in fewer kernels (`plora.train.packed.rope`: one autograd node per call, the same
#: numbers; `plora.train.packed.norms`: torch's fused RMSNorm kernel)
LEAN_STEP = "PLORA_LEAN_STEP"
#: 0 (false, no, off): a sweep's first job process, started ahead, loads no Triton kernels
#: before its job comes (`plora.engine.spare.KernelsOrder`)
SPARE_KERNELS = "PLORA_SPARE_KERNELS"
#: a GPU job lays out its next step's rows while the step before runs on the device
STEP_AHEAD = "PLORA_STEP_AHEAD"
#: 0 (false, no, off): the LM head's loss in torch's ops (float32 log-softmax and NLL) where
#: the Triton kernels run, not in one kernel (`plora.kernels.cross_entropy`)
FUSED_LOSS = "PLORA_FUSED_LOSS"
#: the report notebook's parameters: the run directory, and more runs to compare (os.pathsep-separated)
REPORT_RUN_DIR = "PLORA_RUN_DIR"
REPORT_COMPARE_DIRS = "PLORA_COMPARE_DIRS"

KERNEL_CHOICES = ("auto", "torch", "triton")
GGUF_CONVERTER_CHOICES = ("auto", "transformers")
DEFAULT_LOG_PROGRESS_S = 30.0
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Settings:
    """What plora's environment variables say, typed, with their defaults applied."""

    cache_dir: Path
    #: where profiles are cached: ``$PLORA_CACHE_DIR`` itself where set, else the cache's ``profiles``
    profile_dir: Path
    kernels: str
    cuda_graphs: str | None
    attempt: int | None
    handed_at: float | None
    test_hooks: tuple[str, ...]
    spare_jobs: bool
    lean_imports: bool
    #: threads compiling a step's kernels ahead (None: one per core, at most 32; 0: off)
    compile_threads: int | None
    cpu_share: bool
    cpus: str | None
    log_progress_s: float
    #: "auto" or "transformers" (`GGUF_CONVERTER`); anything else reads as "auto"
    gguf_converter: str = "auto"
    #: a new composition's graph captured at its first step (`CAPTURE_FIRST`)
    capture_first: bool = True
    #: a GPU job's side lane: leaving adapters scored, and the next composition captured,
    #: while the pack replays (`OVERLAP`)
    overlap: bool = True
    #: bytecode kept in plora's cache where ``PYTHONDONTWRITEBYTECODE`` forbids it beside the
    #: sources (`BYTECODE_CACHE`, `plora.bytecode_cache`)
    bytecode_cache: bool = True
    #: a first sweep's modules compiled ahead into that cache (`BYTECODE_AHEAD`, `plora.bytecode_ahead`)
    bytecode_ahead: bool = True
    #: a job's RoPE in one autograd node per call, its tables made once per forward, and its
    #: RMSNorms on torch's fused kernel (`LEAN_STEP`)
    lean_step: bool = True
    #: a GPU job's next step's rows drawn and laid out while its step before runs on the
    #: device, not after it (`STEP_AHEAD`, `plora.train.packed_step`)
    step_ahead: bool = True
    #: the LM head's loss and its gradient in one Triton kernel where the packed LoRA kernels
    #: run on Triton (`FUSED_LOSS`, `fused_loss_on`)
    fused_loss: bool = True
    #: the first job's process, started ahead, loads the kernels the sweep expects it to
    #: launch once Triton's cache holds them (`SPARE_KERNELS`)
    spare_kernels: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if environ is None else environ
        home = Path.home() / ".cache" / "plora"
        cache = env.get(CACHE_DIR)
        kernels = kernels_choice(env)  # checked where kernels run
        attempt = env.get(ATTEMPT)
        return cls(
            cache_dir=Path(cache).expanduser() if cache else home,
            profile_dir=Path(cache).expanduser() if cache else home / "profiles",
            kernels=kernels,
            cuda_graphs=env.get(CUDA_GRAPHS),
            attempt=int(attempt) if attempt is not None else None,
            handed_at=_float(env.get(HANDED_AT)),
            test_hooks=tuple(n.strip() for n in env.get(TEST_HOOKS, "").split(",") if n.strip()),
            spare_jobs=env.get(SPARE_JOBS, "1") not in _OFF,
            lean_imports=env.get(LEAN_IMPORTS, "1") not in _OFF,
            compile_threads=_threads(env.get(COMPILE_THREADS)),
            cpu_share=env.get(CPU_SHARE, "1").strip() != "0",
            cpus=env.get(CPUS) or None,
            log_progress_s=max(0.0, _float(env.get(LOG_PROGRESS_S)) if _float(env.get(LOG_PROGRESS_S)) is not None
                               else DEFAULT_LOG_PROGRESS_S),
            gguf_converter=_choice(env.get(GGUF_CONVERTER), GGUF_CONVERTER_CHOICES),
            capture_first=env.get(CAPTURE_FIRST, "1").strip().lower() not in _OFF,
            overlap=env.get(OVERLAP, "1").strip().lower() not in _OFF,
            bytecode_cache=env.get(BYTECODE_CACHE, "1").strip().lower() not in _OFF,
            bytecode_ahead=env.get(BYTECODE_AHEAD, "1").strip().lower() not in _OFF,
            lean_step=env.get(LEAN_STEP, "1").strip().lower() not in _OFF,
            step_ahead=env.get(STEP_AHEAD, "1").strip().lower() not in _OFF,
            fused_loss=fused_loss_on(env),
            spare_kernels=env.get(SPARE_KERNELS, "1").strip().lower() not in _OFF,
        )

    @property
    def job_attempt(self) -> int:
        """The attempt of a job process (1 where the engine did not launch it)."""
        return self.attempt if self.attempt is not None else 1

    @property
    def launched_by_engine(self) -> bool:
        """Whether this process is a job the engine launched (it sets ``PLORA_ATTEMPT``)."""
        return self.attempt is not None


def _threads(text: str | None) -> int | None:
    """A thread count: None where unset or not a whole number (the default), 0 where off."""
    if text is None or not text.strip():
        return None
    if text.strip().lower() in _OFF:
        return 0
    try:
        return max(0, int(text))
    except ValueError:
        return None


def _choice(text: str | None, choices: tuple[str, ...]) -> str:
    """``text`` where it is one of ``choices`` (any case), else the first (the default)."""
    value = (text or "").strip().lower()
    return value if value in choices else choices[0]


def _float(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def kernels_choice(environ: Mapping[str, str] | None = None) -> str:
    """``PLORA_KERNELS`` alone (`Settings.kernels`), read now: what every packed LoRA layer
    asks at every call, a step's worth of calls (168 on the 0.5B shape) without reading
    every other setting each time."""
    env = os.environ if environ is None else environ
    return env.get(KERNELS, "auto").strip().lower() or "auto"


def fused_loss_on(environ: Mapping[str, str] | None = None) -> bool:
    """``PLORA_FUSED_LOSS`` alone (`Settings.fused_loss`), read now: asked at every chunk of
    the LM head's loss."""
    env = os.environ if environ is None else environ
    return env.get(FUSED_LOSS, "1").strip().lower() not in _OFF


def settings(environ: Mapping[str, str] | None = None) -> Settings:
    """This process's settings (or those of ``environ``), read now."""
    return Settings.from_env(environ)


def triton_interpreted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether Triton builds interpreted kernels (``TRITON_INTERPRET``, read per call): where
    nothing is compiled. Here, without torch or Triton, for the sweep's process to ask before
    it imports either."""
    env = os.environ if environ is None else environ
    return env.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
