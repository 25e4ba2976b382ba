"""plora's environment variables: read in one place (`plora.settings`), typed, with defaults."""

from __future__ import annotations

import re
from pathlib import Path

from plora.settings import Settings

ROOT = Path(__file__).resolve().parents[1]


def test_defaults():
    s = Settings.from_env({})
    assert s.cache_dir == Path.home() / ".cache" / "plora"
    assert s.profile_dir == Path.home() / ".cache" / "plora" / "profiles"
    assert s.kernels == "auto" and s.cuda_graphs is None and s.attempt is None and s.job_attempt == 1
    assert not s.launched_by_engine and s.handed_at is None and s.test_hooks == ()
    assert s.spare_jobs and s.cpu_share and s.cpus is None and s.log_progress_s == 30.0
    assert s.fused_loss and not Settings.from_env({"PLORA_FUSED_LOSS": "off"}).fused_loss


def test_values_are_typed(tmp_path):
    s = Settings.from_env({
        "PLORA_CACHE_DIR": str(tmp_path), "PLORA_KERNELS": "Torch", "PLORA_CUDA_GRAPHS": "off",
        "PLORA_ATTEMPT": "3", "PLORA_HANDED_AT": "12.5", "PLORA_TEST_HOOKS": "a, b.py,", "PLORA_SPARE_JOBS": "off",
        "PLORA_CPU_SHARE": "0", "PLORA_CPUS": "0-3", "PLORA_LOG_PROGRESS_S": "-2"})
    assert s.cache_dir == tmp_path and s.profile_dir == tmp_path  # profiles: the folder itself, where it is set
    assert s.kernels == "torch" and s.cuda_graphs == "off" and s.attempt == 3 and s.launched_by_engine
    assert s.handed_at == 12.5 and s.test_hooks == ("a", "b.py") and not s.spare_jobs and not s.cpu_share
    assert s.cpus == "0-3" and s.log_progress_s == 0.0
    assert Settings.from_env({"PLORA_LOG_PROGRESS_S": "soon", "PLORA_HANDED_AT": "x"}).log_progress_s == 30.0


def test_no_other_module_reads_a_plora_variable():
    """Every ``PLORA_*`` variable is read in plora/settings.py: elsewhere a variable of that
    name appears only as what a process is given (the engine sets some for its jobs)."""
    reads = re.compile(r"(environ\.get|environ\[|getenv)\(?\s*[\"']PLORA_")
    found = [f"{p.relative_to(ROOT)}:{i}" for folder in ("plora", "kernels") for p in sorted((ROOT / folder).rglob("*.py"))
             if p.name != "settings.py" and "plora/kernels" not in str(p.relative_to(ROOT))
             for i, line in enumerate(p.read_text().splitlines(), 1) if reads.search(line)]
    assert not found, found
