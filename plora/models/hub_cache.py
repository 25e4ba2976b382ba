"""Hugging Face Hub model ids (``model.path: HuggingFaceTB/SmolLM2-135M-Instruct``), read
from the local Hugging Face cache only.

A sweep never downloads: a job that fetched gigabytes mid-sweep (or failed to, on a machine
without network) would turn planning and timing into guesses. A model someone already has
(``hf download``, or any earlier `transformers` load) is in the Hub cache, so an id is
looked up there, in the folder `huggingface_hub` itself uses (``HF_HUB_CACHE``, else
``HF_HOME``/hub, else ``~/.cache/huggingface/hub``), read when the lookup runs; the model is
the snapshot its ``main`` ref names. An id not there is one line that says what to run.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["HubCacheError", "cached_model", "hub_cache_dir", "looks_like_repo_id"]

#: ``owner/name`` as the Hub spells repository ids
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


class HubCacheError(ValueError):
    """A Hub model id that is not in the local cache; the message says what to run."""


def looks_like_repo_id(text: str) -> bool:
    """Whether ``text`` reads as a Hub id (``owner/name``) rather than a path."""
    return bool(_REPO_ID.fullmatch(text)) and not text.endswith((".gguf", ".json")) and ".." not in text


def hub_cache_dir() -> Path:
    """The Hub cache, by huggingface_hub's own rules (its environment variables as they are now)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def cached_model(repo_id: str) -> Path:
    """The cached snapshot folder of the model ``repo_id`` (its ``main`` ref), never
    downloading; raises HubCacheError naming the cache and the command that fills it."""
    cache = hub_cache_dir()
    missing = (f"{repo_id} is not in the local Hugging Face cache ({cache}); nothing is downloaded at run time: "
               f"run `hf download {repo_id}` first")
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True))
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError is an OSError), or not an id
        raise HubCacheError(missing) from None
    if not (folder / "config.json").is_file():
        raise HubCacheError(f"{repo_id}: the cached snapshot {folder} has no config.json (not a model, or not all of "
                            f"it was downloaded): run `hf download {repo_id}`")
    return folder
