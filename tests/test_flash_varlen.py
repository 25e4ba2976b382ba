"""Flattened rows attended through ATen's flash ops directly (`plora.train.packed.flash_varlen`):
the same results as torch's ``varlen_attn``, and no ``torch._dynamo`` imported for them."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from plora.models.torchtune_imports import import_late_modules
from plora.train.packed.flash_varlen import flash_varlen

_NO_DYNAMO = """
import sys, torch
from plora.job.phases import DYNAMO_IMPORTED_BY, watch_dynamo_import
watch_dynamo_import()
from plora.train.packed.varlen_attention import RowAttention
assert RowAttention.graph_safe(torch.device("cuda"), torch.bfloat16)  # one flash launch for all rows
print(sorted(m for m in ("torch._dynamo", "torch.nn.attention.varlen") if m in sys.modules), DYNAMO_IMPORTED_BY)
"""


def test_this_torchs_flash_ops_take_what_varlen_attn_gives_them():
    assert flash_varlen() is not None


def test_rows_on_a_gpu_need_no_dynamo():
    out = subprocess.run([sys.executable, "-c", _NO_DYNAMO], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[] []"


def test_nothing_is_imported_late_where_nothing_needs_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert import_late_modules({}, ()) is None


def test_the_first_import_of_dynamo_is_traced_to_its_importer():
    code = ("from plora.job.phases import DYNAMO_IMPORTED_BY, watch_dynamo_import\n"
            "watch_dynamo_import()\n"
            "from plora.train.packed.varlen_attention import _varlen_fn\n"
            "_varlen_fn()\n"
            "print(DYNAMO_IMPORTED_BY[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert "torch/nn/attention/varlen.py" in line and "varlen_attention.py:" in line and line.endswith("(_varlen_fn)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_same_outputs_and_gradients_as_varlen_attn(dtype):
    from torch.nn.attention.varlen import varlen_attn

    from plora.train.packed import varlen_attention

    assert flash_varlen() is not None, f"torch {torch.__version__}: its flash ops lack the window arguments"

    torch.manual_seed(0)
    lengths = [7, 130, 64, 1, 259]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    heads, dim = 6, 64
    base = [torch.randn(sum(lengths), heads, dim, device="cuda", dtype=dtype) for _ in range(3)]
    grad = torch.randn(sum(lengths), heads, dim, device="cuda", dtype=dtype)

    def run(fn):
        q, k, v = (t.clone().requires_grad_(True) for t in base)
        out = fn(q, k, v)
        out.backward(grad)
        return [out.detach(), q.grad, k.grad, v.grad]

    kwargs = {}
    params = set(varlen_attention.inspect.signature(varlen_attn).parameters)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "num_splits" in params:
        kwargs["num_splits"] = 1
    theirs = run(lambda q, k, v: varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), **kwargs))
    ours = run(lambda q, k, v: flash_varlen()(q, k, v, cu, max(lengths)))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
