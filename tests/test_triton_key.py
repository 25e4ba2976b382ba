"""Triton's own version key, kept in plora's cache (`plora.kernels.triton_key`): the same key
Triton computes, computed once per Triton install instead of once per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from plora.kernels.triton_key import fingerprint, well_formed

ROOT = Path(__file__).resolve().parents[1]


def _tree(root: Path) -> None:
    for rel in ("runtime/cache.py", "_C/libtriton.so", "compiler/a.py", "backends/nvidia/b.py", "language/c.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)


def test_the_fingerprint_follows_the_hashed_files(tmp_path):
    _tree(tmp_path)
    first = fingerprint(tmp_path, "3.6.0")
    assert fingerprint(tmp_path, "3.6.0") == first
    assert fingerprint(tmp_path, "3.6.1") != first
    (tmp_path / "compiler" / "__pycache__").mkdir()
    (tmp_path / "compiler" / "__pycache__" / "a.py").write_text("x")  # not Triton's source
    (tmp_path / "README.md").write_text("x")  # not hashed by Triton either
    assert fingerprint(tmp_path, "3.6.0") == first
    st = (tmp_path / "backends" / "nvidia" / "b.py").stat()
    os.utime(tmp_path / "backends" / "nvidia" / "b.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    changed = fingerprint(tmp_path, "3.6.0")
    assert changed != first
    (tmp_path / "language" / "d.py").write_text("new")
    assert fingerprint(tmp_path, "3.6.0") not in (first, changed)


def test_a_linked_backend_is_followed_as_triton_follows_it(tmp_path):
    _tree(tmp_path / "triton")
    (tmp_path / "third_party" / "amd").mkdir(parents=True)
    (tmp_path / "third_party" / "amd" / "driver.py").write_text("one")
    (tmp_path / "triton" / "backends" / "amd").symlink_to(tmp_path / "third_party" / "amd")
    first = fingerprint(tmp_path / "triton", "3.6.0")
    (tmp_path / "third_party" / "amd" / "driver.py").write_text("other, longer")
    assert fingerprint(tmp_path / "triton", "3.6.0") != first


def test_only_a_well_formed_key_is_taken():
    digest = "0123456789abcdef" * 4
    assert well_formed(f"3.6.0{digest}-{digest}", "3.6.0")
    assert not well_formed("", "3.6.0") and not well_formed(f"3.6.0{digest[:-1]}", "3.6.0")
    assert not well_formed(f"3.5.0{digest}", "3.6.0") and not well_formed(f"3.6.0{digest}-", "3.6.0")


KEEP = """
import sys
from pathlib import Path
import triton.runtime.cache as c
from plora.kernels.triton_key import remember_triton_key
if sys.argv[2] == "compute":
    own = c.triton_key()
else:  # Triton's own computation is not called again: the key is read from the cache
    own = None
    def refuse():
        raise AssertionError("computed again")
    c.triton_key = refuse
key = remember_triton_key(Path(sys.argv[1]))
assert own is None or key == own, "not Triton's own key"
assert c.triton_key() == key
print(key)
"""


def test_a_second_process_reads_the_key_the_first_computed(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    first = subprocess.run([sys.executable, "-c", KEEP, str(tmp_path), "compute"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert len(list((tmp_path / "triton-key").iterdir())) == 1
    second = subprocess.run([sys.executable, "-c", KEEP, str(tmp_path), "read"], env=env, capture_output=True,
                            text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout and first.stdout.strip()
    kept = next((tmp_path / "triton-key").iterdir())
    kept.write_text(first.stdout.strip()[:40])  # cut short: computed again, and kept whole
    third = subprocess.run([sys.executable, "-c", KEEP, str(tmp_path), "compute"], env=env, capture_output=True,
                           text=True, timeout=300)
    assert third.returncode == 0, third.stderr
    assert kept.read_text() == first.stdout.strip() and [p.name for p in kept.parent.iterdir()] == [kept.name]
