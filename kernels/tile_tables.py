"""Tuned tiles as data: one JSON file per GPU model in ``tiles/`` (``default.json`` elsewhere).

Like vLLM's per-device kernel configs, the tables are measurements, not code: a sweep on a new
GPU (``scripts/bench_kernels.py --sweep``) writes a file named after that GPU, and the kernels
take it there without a code change.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

TILES_DIR = Path(__file__).with_name("tiles")


def device_file_name(device_name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``NVIDIA_H100_80GB_HBM3.json``."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", device_name.strip()) + ".json"


@dataclass
class TileTables:
    """Tiles per ``(kind, rank bucket)`` (``large``: launches past ``LARGE_ELEMS``) and the
    dy mode per bucket (``dy_mode_large``/``dy_mode_small``: past / within the size limits)."""

    source: Path
    tiles: dict[tuple[str, int], Any] = field(default_factory=dict)
    large: dict[tuple[str, int], Any] = field(default_factory=dict)
    dy_mode: dict[int, str] = field(default_factory=dict)
    dy_mode_large: dict[int, str] = field(default_factory=dict)
    dy_mode_small: dict[int, str] = field(default_factory=dict)


def tables_path(device_name: str | None = None) -> Path:
    """The table file of a GPU model, or ``default.json`` when it has none."""
    if device_name:
        own = TILES_DIR / device_file_name(device_name)
        if own.is_file():
            return own
    return TILES_DIR / "default.json"


def load_tables(make_tile: Callable[..., Any], device_name: str | None = None) -> TileTables:
    """Read the tables for ``device_name``; ``make_tile(**fields)`` builds one tile entry."""
    path = tables_path(device_name)
    raw = json.loads(path.read_text())

    def keyed(section: dict) -> dict[tuple[str, int], Any]:
        out = {}
        for key, fields in section.items():
            kind, bucket = key.split(":")
            out[(kind, int(bucket))] = make_tile(**fields)
        return out

    def modes(section: dict) -> dict[int, str]:
        return {int(k): str(v) for k, v in section.items()}

    return TileTables(
        source=path,
        tiles=keyed(raw.get("tiles", {})),
        large=keyed(raw.get("large", {})),
        dy_mode=modes(raw.get("dy_mode", {})),
        dy_mode_large=modes(raw.get("dy_mode_large", {})),
        dy_mode_small=modes(raw.get("dy_mode_small", {})),
    )
