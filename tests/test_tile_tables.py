"""Tuned tiles are data per GPU model: the default file, a GPU's own file, and the kernels'
tables filled from whichever applies."""

from __future__ import annotations

import json

import pytest

from plora.kernels import tile_tables, triton_ops


def test_default_tables_fill_the_kernels_tables():
    raw = json.loads((tile_tables.TILES_DIR / "default.json").read_text())
    assert triton_ops._LOADED[0].name == "default.json"
    assert len(triton_ops.TILES) == len(raw["tiles"]) > 0
    assert triton_ops.DY_MODE == {int(k): v for k, v in raw["dy_mode"].items()}
    shrink = triton_ops.tiles_for("shrink", 16)
    assert (shrink.bt, shrink.bh, shrink.warps) == tuple(raw["tiles"]["shrink:16"][k] for k in ("bt", "bh", "warps"))


def test_a_gpu_with_its_own_file_takes_it(tmp_path, monkeypatch):
    (tmp_path / "default.json").write_text(json.dumps({"tiles": {"shrink:16": {"bt": 64, "bh": 128, "warps": 4, "stages": 3, "waves": 1}}}))
    own = tmp_path / tile_tables.device_file_name("NVIDIA H100 80GB HBM3")
    assert own.name == "NVIDIA_H100_80GB_HBM3.json"
    own.write_text(json.dumps({"tiles": {"shrink:16": {"bt": 32, "bh": 64, "warps": 8, "stages": 4, "waves": 2}},
                               "dy_mode": {"128": "split"}}))
    monkeypatch.setattr(tile_tables, "TILES_DIR", tmp_path)
    assert tile_tables.tables_path("NVIDIA H200") == tmp_path / "default.json"
    t = tile_tables.load_tables(triton_ops.TileConfig, "NVIDIA H100 80GB HBM3")
    assert t.source == own
    assert t.tiles[("shrink", 16)] == triton_ops.TileConfig(bt=32, bh=64, warps=8, stages=4, waves=2)
    assert t.dy_mode == {128: "split"}
    try:
        triton_ops.use_tables("NVIDIA H100 80GB HBM3")
        assert triton_ops.tiles_for("shrink", 16).bt == 32
        assert triton_ops.dy_mode_for(128) == "split"
    finally:
        monkeypatch.undo()
        triton_ops.use_tables()
    assert triton_ops._LOADED[0].name == "default.json"


def test_a_table_naming_a_dy_mode_the_kernels_lack_is_refused(tmp_path, monkeypatch):
    """("fused", an atomic dS mode that no sweep chose, is gone): an old table that names
    it fails when loaded, not in the middle of a backward."""
    (tmp_path / "default.json").write_text(json.dumps({"dy_mode": {"16": "fused"}}))
    monkeypatch.setattr(tile_tables, "TILES_DIR", tmp_path)
    with pytest.raises(ValueError, match="dy mode 'fused' is not one of pair, split, band, block"):
        triton_ops.use_tables()
    monkeypatch.undo()
    assert triton_ops.use_tables().name == "default.json"
    with pytest.raises(ValueError, match="tile_overrides: dy mode 'fused'"), triton_ops.tile_overrides(dy_mode="fused"):
        pass
