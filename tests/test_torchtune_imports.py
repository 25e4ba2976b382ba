"""A spare's imports without torchtune's package `__init__`s (`plora.models.torchtune_imports`):
every family still builds and loads, to the same logits, and ``datasets`` never comes in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from family_models import CASES, make_model

LEAN_CHILD = r"""
import json, sys
import torch
from plora.models.torchtune_imports import import_job_modules, skip_package_inits

assert skip_package_inits()
import plora.train.packed_lora  # the recipe, as a spare imports it
import_job_modules()
from plora.models.loading import load_base_model

out = {}
for name, folder in json.loads(sys.argv[1]).items():
    model, info = load_base_model(folder, max_seq_len=32)
    with torch.no_grad():
        out[name] = model(torch.arange(1, 9).unsqueeze(0)).flatten().tolist()
skipped = [m for m in ("datasets", "torchtune.datasets", "torchtune.generation", "torchtune.data") if m in sys.modules]
print(json.dumps({"logits": out, "imported": skipped}))
"""


def test_every_family_loads_to_the_same_logits_without_torchtunes_package_inits(tmp_path):
    folders = {name: str(make_model(name, tmp_path / name)) for name in CASES}
    proc = subprocess.run([sys.executable, "-c", LEAN_CHILD, json.dumps(folders)], capture_output=True, text=True,
                          cwd=str(Path(__file__).resolve().parents[1]), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["imported"] == []  # nothing of torchtune's datasets, data or generation came in
    from plora.models.loading import load_base_model

    for name, folder in folders.items():
        model, _ = load_base_model(folder, max_seq_len=32)
        with torch.no_grad():
            want = model(torch.arange(1, 9).unsqueeze(0)).flatten()
        assert torch.equal(torch.tensor(got["logits"][name], dtype=want.dtype), want), name


def test_lean_imports_stand_aside_where_torchtune_is_imported_or_switched_off(monkeypatch):
    import torchtune  # noqa: F401 - as in any process that imported it the usual way

    from plora.models import torchtune_imports as lean_imports

    assert lean_imports.skip_package_inits() is False  # torchtune is imported: nothing to skip
    code = ("import os; os.environ['PLORA_LEAN_IMPORTS'] = '0'; from plora.models import torchtune_imports as lean_imports; "
            "import sys; assert lean_imports.skip_package_inits() is False and 'torchtune' not in sys.modules")
    assert subprocess.run([sys.executable, "-c", code], cwd=str(Path(__file__).resolve().parents[1])).returncode == 0
