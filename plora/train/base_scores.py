"""The base model's eval scores, remembered across sweeps on one machine.

Every sweep scores its base model on its eval rows (``base_metrics.json``, the line its
adapters are compared with). The same model on the same rows scores the same: a warm 0.5B
sweep on an H200 spent 0.33 s of its first job on it, with nothing else on the GPU, and a
tune of many sweeps paid it each time. A job that scores a base remembers the scores under
a key of everything they follow from; a later job with that key writes them without
running the eval.

The key: the model's folder (each file's name, size and modification time: changed
weights are another model), family, sequence length, dtype, random init and quantization;
the device's kind (a GPU's numbers differ in their last bits from a CPU's); every eval
row's tokens, labels, prompt, reference and choices and every raw example; the eval's
metrics and generation settings; the versions of torch, torchtune and plora, and the code
that builds the model and scores it. A metric of the user's (``python_path``) is code this
cannot see change: such an eval is never remembered.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from plora.settings import settings

__all__ = ["key_of", "recall", "remember"]

#: the eval's settings that decide its scores
_EVAL_FIELDS = ("metrics", "max_new_tokens", "max_eval_samples", "objective", "choices", "choices_column")


def key_of(model: Any, evaluation: Any, samples: list, examples: list, device: Any) -> str | None:
    """The key of this base model's scores on these rows (``model``: a job's `JobModel`,
    ``evaluation``: its `JobEval`), or None where they are not to be remembered."""
    if evaluation.python_path or not samples:
        return None
    import torch

    from plora import __version__

    folder = Path(model.path)
    try:
        files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()) \
            if folder.is_dir() else [(folder.name, folder.stat().st_size, folder.stat().st_mtime_ns)]
    except OSError:
        return None
    device = torch.device(device)
    kind = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    digest = hashlib.sha256()
    head = {
        "model": [str(folder.resolve()), files, model.family, model.max_seq_len, model.dtype, model.random_init,
                  json.dumps(model.quantize, default=str, sort_keys=True)],
        "device": kind,
        "eval": {f: getattr(evaluation, f, None) for f in _EVAL_FIELDS},
        "versions": [__version__, torch.__version__, _package_version("torchtune"), _code_version()],
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


def _code_version() -> str:
    """The code the scores follow from besides the model's files: how the model is built
    (`plora.models.check`'s own version of it) and how an eval scores."""
    from importlib.util import find_spec

    from plora.models.check import _checker_version

    digest = hashlib.sha1(_checker_version().encode())
    for module in ("plora.results.evaluate", "plora.results.metrics", "plora.data.dataset"):
        origin = find_spec(module).origin
        digest.update(Path(origin).read_bytes())
    return digest.hexdigest()[:16]
