"""Data folders written by `datasets`' ``save_to_disk``, as ``data.train`` or ``data.eval``.

Such a folder holds one dataset (``state.json``, ``dataset_info.json`` and Arrow shards) or
a `DatasetDict`: ``dataset_dict.json`` listing its splits, one dataset folder each. A folder
of splits is read one split at a time: ``data.train_split`` / ``data.eval_split`` name it,
and where they do not, the train split is ``train`` and the eval split the first of
``validation``, ``eval``, ``test`` (or the only split there is), so a folder saved with the
usual names needs no more than its path. The folder's layout is checked (and the split
chosen) when the space file is read; its rows are read, through `datasets`, only as a
file's would be (`plora.data.formats.read_rows`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

__all__ = ["DatasetFolderError", "dataset_rows", "is_dataset_folder", "pick_split", "splits_of"]

#: a DatasetDict folder: its splits
DICT_FILE = "dataset_dict.json"
#: a Dataset folder: its shards
STATE_FILE = "state.json"
#: the split a role reads when none is named, in order of preference
DEFAULT_SPLITS: dict[str, tuple[str, ...]] = {"train": ("train",), "eval": ("validation", "eval", "test")}


class DatasetFolderError(ValueError):
    """A folder that is not a saved dataset, or a split it does not have; one line naming it."""


def is_dataset_folder(folder: Path) -> bool:
    return (folder / DICT_FILE).is_file() or (folder / STATE_FILE).is_file()


def splits_of(folder: Path) -> list[str] | None:
    """The splits of a DatasetDict folder; None for a folder of one dataset."""
    if not is_dataset_folder(folder):
        raise DatasetFolderError(f"{folder} is a folder, but not one written by datasets' save_to_disk "
                                 f"(no {DICT_FILE} or {STATE_FILE} in it)")
    if not (folder / DICT_FILE).is_file():
        return None
    try:
        splits = json.loads((folder / DICT_FILE).read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DatasetFolderError(f"{folder / DICT_FILE}: not a readable list of splits ({e})") from None
    if not isinstance(splits, list) or not splits or not all(isinstance(s, str) for s in splits):
        raise DatasetFolderError(f"{folder / DICT_FILE}: expected a non-empty list of split names")
    return splits


def pick_split(folder: Path, role: Literal["train", "eval"], wanted: str | None) -> str | None:
    """The split of ``folder`` that ``role`` reads: ``wanted``, else the default for the
    role; None for a folder of one dataset. Raises DatasetFolderError with the splits there are."""
    splits = splits_of(folder)
    if splits is None:
        if wanted is not None:
            raise DatasetFolderError(f"{folder} holds one dataset, not splits: leave the split out")
        return None
    shown = ", ".join(splits)
    if wanted is not None:
        if wanted not in splits:
            raise DatasetFolderError(f"no split {wanted!r} in {folder} (its splits: {shown})")
        return wanted
    for name in DEFAULT_SPLITS[role]:
        if name in splits:
            return name
    if len(splits) == 1:
        return splits[0]
    raise DatasetFolderError(f"{folder} has the splits {shown}: name the one to {'train on' if role == 'train' else 'evaluate on'}")


def dataset_rows(folder: Path, split: str | None, where: str) -> tuple[list[dict], list[str]]:
    """The rows (as dicts) and columns of a saved dataset, or of one split of a DatasetDict."""
    part = folder / split if split is not None else folder
    try:
        from datasets import load_from_disk

        dataset = load_from_disk(str(part))
        return dataset.to_list(), list(dataset.column_names)
    except Exception as e:  # noqa: BLE001 - datasets and pyarrow raise many kinds for a broken folder
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DatasetFolderError(f"{where}: cannot read the saved dataset ({first})") from None
