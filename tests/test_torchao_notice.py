"""torchao's notice about its C++ extensions (issue 46): never on plora's output, nor in a
job's log, while every other torchao message still gets through."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_space_file
from plora.torchao_notice import NOTICE_PREFIX

REPO = Path(__file__).resolve().parents[1]
PLORA = [sys.executable, "-c", "import sys; from plora.cli import app; sys.argv[0] = 'plora'; app()"]


def plora(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([*PLORA, *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=600)


def space(tmp_path: Path) -> Path:
    return tiny_space_file(
        tmp_path, max_seq_len=32, num_train=8, num_eval=2, lora={"targets": ["q_proj"]},
        space={"strategy": "list", "configs": [{"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 2}]},
        training={"steps": 2}, eval={"metrics": ["loss"]}, output={"dir": "runs"})


def test_only_that_notice_is_dropped(caplog):
    import plora  # noqa: F401 - installs the filter

    logger = logging.getLogger("torchao")
    with caplog.at_level(logging.WARNING, logger="torchao"):
        logger.warning(f"{NOTICE_PREFIX} 2.13.0+cpu for torchao version 0.15.0")
        logger.warning("Skipping import of cpp extensions: some other reason")
        logger.error("a real torchao problem")
    assert [r.getMessage() for r in caplog.records] == ["Skipping import of cpp extensions: some other reason",
                                                       "a real torchao problem"]


def test_version_and_dry_run_print_no_notice(tmp_path):
    for args in (["--version"], ["sweep", str(space(tmp_path)), "--dry-run"]):
        result = plora(*args, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert "Skipping import of cpp extensions" not in result.stdout + result.stderr, args
        assert "torchao" not in result.stderr, result.stderr


@pytest.mark.parametrize("spares", ["1", "0"], ids=["job-started-ahead", "tune-run"])
def test_a_real_job_logs_no_notice(tmp_path, spares):
    result = plora("sweep", str(space(tmp_path)), cwd=tmp_path, PLORA_SPARE_JOBS=spares)
    assert result.returncode == 0, result.stdout + result.stderr
    logs = list((tmp_path / "runs" / "t" / "jobs").glob("*/log.txt"))
    assert logs
    for text in [result.stdout, result.stderr, *(p.read_text() for p in logs)]:
        assert "Skipping import of cpp extensions" not in text, text
