"""The base model's eval scores, remembered across sweeps on one machine.

Every sweep scores its base model on its eval rows (``base_metrics.json``, the line its
adapters are compared with). The same model on the same rows scores the same: a warm 0.5B
sweep on an H200 spent 0.33 s of its first job on it, with nothing else on the GPU, and a
tune of many sweeps paid it each time. A job that scores a base remembers the scores under
a key of everything they follow from; a later job with that key writes them without
running the eval.

The key: the model's folder (each file's name, size, modification time, inode and change
time: changed or copied-over weights are another model), family, sequence length, dtype,
random init and quantization; the device's kind (a GPU's numbers differ in their last bits
from a CPU's), whether eval rows are flattened or padded and whether the lean step is on
(`PLORA_LEAN_STEP`: fused norms round otherwise on a GPU); every eval row's tokens,
labels, prompt, reference and choices and every raw example; the eval's metrics and
generation settings; the versions of torch and the packages the scores follow from, and
every source file of plora. A metric of the user's is code this cannot see change: such an
eval is never remembered.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, is_dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from plora.settings import settings

__all__ = ["key_of", "recall", "remember"]

#: the eval's settings that decide its scores
_EVAL_FIELDS = ("metrics", "max_new_tokens", "max_eval_samples", "choices", "choices_column")
#: packages whose code the scores also follow from
_PACKAGES = ("torchtune", "triton", "tokenizers", "safetensors", "gguf", "transformers", "rouge-score", "sacrebleu")


def key_of(model: Any, evaluation: Any, samples: list, examples: list, device: Any) -> str | None:
    """The key of this base model's scores on these rows (``model``: a job's `JobModel`,
    ``evaluation``: its `JobEval`), or None where they are not to be remembered."""
    from plora.results.metrics import is_user_metric

    if evaluation.python_path or any(is_user_metric(m) for m in evaluation.metrics) or not samples:
        return None
    import torch

    from plora import __version__
    from plora.train.packed.flash_varlen import flash_varlen

    folder = Path(model.path)
    try:
        files = sorted(_stamp(p) for p in folder.iterdir() if p.is_file()) if folder.is_dir() else [_stamp(folder)]
    except OSError:
        return None
    device = torch.device(device)
    kind = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    digest = hashlib.sha256()
    head = {
        "model": [str(folder.resolve()), files, model.family, model.max_seq_len, model.dtype, model.random_init,
                  json.dumps(model.quantize, default=str, sort_keys=True)],
        "device": kind,
        "flat_rows": flash_varlen() is not None,  # an eval's rows flattened, or padded
        "lean_step": settings().lean_step,  # fused norms on a GPU: other float32 roundings
        "eval": {f: getattr(evaluation, f, None) for f in _EVAL_FIELDS},
        "versions": [__version__, torch.__version__, *(_package_version(p) for p in _PACKAGES), _code_version()],
    }
    digest.update(json.dumps(head, default=str, sort_keys=True).encode())
    for sample in samples:
        digest.update(json.dumps(_plain(sample), default=str, sort_keys=True).encode())
    digest.update(json.dumps(examples, default=str, sort_keys=True).encode())
    return digest.hexdigest()[:32]


def recall(key: str | None) -> dict[str, float] | None:
    """The scores remembered under ``key``, or None."""
    if key is None:
        return None
    try:
        found = json.loads(_path(key).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and all(isinstance(v, (int, float)) for v in found.values()) else None


def remember(key: str | None, scores: dict[str, float]) -> None:
    """Keep ``scores`` under ``key`` (written aside and renamed: never half a file)."""
    if key is None:
        return
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(scores))
        os.replace(tmp, path)
    except OSError:  # a cache it cannot write is only a cache missed
        pass


def _path(key: str) -> Path:
    return settings().cache_dir / "base-scores" / f"{key}.json"


def _plain(sample: Any) -> Any:
    return asdict(sample) if is_dataclass(sample) else sample


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return ""


def _stamp(path: Path) -> tuple:
    """A file as its copies cannot pass for it: name, size, modification time, and the
    inode and change time that no copy (``cp -p``, ``rsync -a``) keeps."""
    st = path.stat()
    return (path.name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


@lru_cache(maxsize=1)
def _code_version() -> str:
    """Every source file of plora and its kernels: the code that builds the model, lays out
    its rows and scores them (a few hundred kilobytes, read once a process)."""
    import plora
    import plora.kernels

    digest = hashlib.sha1()
    roots = {Path(plora.__file__).resolve().parent, Path(plora.kernels.__file__).resolve().parent}
    for path in sorted({p.resolve() for root in roots for p in root.rglob("*.py")}):
        digest.update(str(path.name).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
