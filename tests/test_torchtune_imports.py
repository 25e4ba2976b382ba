"""A spare's imports without torchtune's package `__init__`s (`plora.models.torchtune_imports`):
every family still builds and loads, to the same logits, and ``datasets`` never comes in,
nor sympy where a random-init model is materialised."""

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
from plora.models.torchtune_imports import defer_compiler_disable, defer_nf4, import_job_modules, skip_package_inits

assert skip_package_inits() and defer_nf4() and defer_compiler_disable()
import plora.train.packed_lora  # the recipe, as a spare imports it
import_job_modules()
from plora.models.check import check_model
from plora.models.loading import load_base_model

out = {}
for name, folder in json.loads(sys.argv[1]).items():
    check_model(folder, max_seq_len=32)  # built on meta, as a spare checks a model
    load_base_model(folder, max_seq_len=32, random_init=True)  # as a spare preloads a benchmark's shape
    model, info = load_base_model(folder, max_seq_len=32)
    with torch.no_grad():
        out[name] = model(torch.arange(1, 9).unsqueeze(0)).flatten().tolist()
skipped = [m for m in ("datasets", "torchtune.datasets", "torchtune.generation", "torchtune.data", "torchao",
                       "torch._dynamo", "sympy") if m in sys.modules]
print(json.dumps({"logits": out, "imported": skipped}))
"""


def test_every_family_loads_to_the_same_logits_without_torchtunes_package_inits(tmp_path):
    folders = {name: str(make_model(name, tmp_path / name)) for name in CASES}
    proc = subprocess.run([sys.executable, "-c", LEAN_CHILD, json.dumps(folders)], capture_output=True, text=True,
                          cwd=str(Path(__file__).resolve().parents[1]), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # nothing of torchtune's datasets, data or generation, nor torchao, dynamo or sympy (a
    # meta model's ``to_empty`` imported it: seconds of a spare's preload), came in
    assert got["imported"] == []
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


NF4_CHILD = r"""
import json, sys
import torch
lean = sys.argv[1] == "lean"
if lean:
    from plora.models.torchtune_imports import defer_nf4, import_job_modules, skip_package_inits

    assert skip_package_inits() and defer_nf4()
    import plora.train.packed_lora  # the recipe, as a spare imports it
    import_job_modules()
    assert "torchao" not in sys.modules  # torchtune's modules are in, torchao is not
from torchtune.modules.common_utils import NF4Tensor
from plora.quantize.nf4 import dense_weight, is_nf4, to_nf4_weight

before = isinstance(torch.zeros(1), NF4Tensor)
w = torch.randn(64, 512, generator=torch.Generator().manual_seed(0), dtype=torch.bfloat16)
q = to_nf4_weight(w)
x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
y = torch.nn.functional.linear(x, q)
print(json.dumps({"before": before, "nf4": is_nf4(q), "tune_sees_it": isinstance(q, NF4Tensor),
                  "clone_nf4": is_nf4(q.clone()), "y": y.float().flatten().tolist(),
                  "w": dense_weight(q).float().flatten().tolist()[:256]}))
"""


def test_torchao_waits_for_a_qlora_job_and_then_quantizes_as_usual():
    repo = str(Path(__file__).resolve().parents[1])
    got = {}
    for mode in ("lean", "usual"):
        proc = subprocess.run([sys.executable, "-c", NF4_CHILD, mode], capture_output=True, text=True, cwd=repo,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    lean, usual = got["lean"], got["usual"]
    assert lean["before"] is False and lean["nf4"] and lean["tune_sees_it"] and lean["clone_nf4"]
    assert lean == usual  # the same NF4 weights, the same products: bit for bit


def test_the_nf4_stand_in_stays_out_where_torchao_is_imported_or_lean_imports_are_off():
    code = ("import os, sys; os.environ['PLORA_LEAN_IMPORTS'] = '{off}'; {pre}"
            "from plora.models.torchtune_imports import defer_nf4, NF4_MODULE; "
            "assert defer_nf4() is False; m = sys.modules.get(NF4_MODULE); "
            "assert m is None or type(m).__name__ == 'module'")
    repo = str(Path(__file__).resolve().parents[1])
    for off, pre in (("0", ""), ("1", "import torchao.dtypes.nf4tensor; ")):
        proc = subprocess.run([sys.executable, "-c", code.format(off=off, pre=pre)], cwd=repo, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_torchtune_imports_without_flex_attention_and_attends_as_before():
    code = r"""
import sys, torch
from plora.models.torchtune_imports import defer_nf4, skip_flex_attention, skip_package_inits
assert skip_package_inits() and defer_nf4() and skip_flex_attention()
import torchtune.modules.attention_utils as attention_utils
from torchtune.modules.attention_utils import _sdpa_or_flex_attention
import torchtune.utils._import_guard as guard
assert guard._SUPPORTS_FLEX_ATTENTION is False and not hasattr(attention_utils, "flex_attention_compiled")
assert skip_flex_attention() is False  # torchtune's attention is imported now: too late to change
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
out = _sdpa_or_flex_attention()(q, k, v, None, 0.0, True)
want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
assert torch.equal(out, want)
"""
    repo = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    off = subprocess.run([sys.executable, "-c", "import os; os.environ['PLORA_LEAN_IMPORTS'] = '0'; "
                          "from plora.models.torchtune_imports import skip_flex_attention; "
                          "assert skip_flex_attention() is False"], cwd=repo, capture_output=True, text=True, timeout=300)
    assert off.returncode == 0, off.stderr[-2000:]


def test_torchaos_own_package_imported_under_the_stand_in_gets_the_real_nf4():
    code = r"""
import torch
from plora.models.torchtune_imports import defer_nf4
assert defer_nf4()
import torchao  # its package imports NF4Tensor and to_nf4 from the stand-in
import torchao.dtypes as dtypes
assert callable(dtypes.NF4Tensor.from_tensor)  # any use of the class loads the real one
from torchao.dtypes.nf4tensor import NF4Tensor as real
assert dtypes.NF4Tensor is real and dtypes.to_nf4.__module__ == "torchao.dtypes.nf4tensor"
w = dtypes.to_nf4(torch.randn(64, 256))
assert isinstance(w, real) and isinstance(w, dtypes.NF4Tensor)
"""
    repo = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_deferred_compiler_disable_runs_the_function_and_hands_over_once_dynamo_loads():
    """`defer_compiler_disable`: a decorated function runs as it is while ``torch._dynamo`` is
    not loaded (nothing can be compiling), and through torch's own disable once it is."""
    code = """
import sys
from plora.models.torchtune_imports import defer_compiler_disable
assert defer_compiler_disable() and defer_compiler_disable()  # twice: still one wrapper
import torch
f = torch.compiler.disable(lambda x: x + 1)
g = torch.compiler.disable(recursive=False)(lambda: 5)
assert f(1) == 2 and g() == 5 and "torch._dynamo" not in sys.modules
import torch._dynamo
assert f(2) == 3 and g() == 5
compiled = torch.compile(lambda x: f(x) * 2, backend="eager")
assert int(compiled(torch.tensor(3))) == 8
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(Path(__file__).resolve().parents[1]), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_spare_on_a_gpu_imports_what_a_job_imports_late_on_a_thread(monkeypatch):
    """torch's varlen attention (which imports ``torch._dynamo``) comes in while the spare
    waits for its job, where a GPU is visible; not at all on a CPU."""
    from plora.models import torchtune_imports as lean_imports

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert lean_imports.import_late_modules({}) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    moments: dict = {}
    thread = lean_imports.import_late_modules(moments)
    assert thread is not None
    thread.join(120)
    assert "late_imports_at" in moments and all(m in sys.modules for m in lean_imports.LATE_GPU_MODULES)
