"""A job process leaves through `leave` with its main's exit code, skipping the interpreter's
teardown: torchtune's `config.parse` ends the main it wraps with `sys.exit`, which had kept
every job from ever reaching it."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import atexit, sys
from plora.train.packed_lora import run_then_leave
atexit.register(lambda: print("torn down", flush=True))
def main():
    print("ran", flush=True)
    {body}
run_then_leave(main)
"""


@pytest.mark.parametrize("body, code, err", [("return None", 0, ""), ("sys.exit(3)", 3, ""),
                                              ("sys.exit('no rows left')", 1, "no rows left"),
                                              ("sys.exit(None)", 0, "")])
def test_a_job_leaves_with_its_mains_exit_code_and_no_teardown(body, code, err):
    p = subprocess.run([sys.executable, "-c", CHILD.format(body=body)], capture_output=True, text=True, timeout=120)
    assert p.returncode == code, p.stderr[-2000:]
    assert p.stdout.strip() == "ran"  # atexit never ran: the process left through os._exit
    assert err in p.stderr


def test_an_exception_still_fails_the_job_the_ordinary_way():
    p = subprocess.run([sys.executable, "-c", CHILD.format(body="raise RuntimeError('broken')")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "RuntimeError: broken" in p.stderr
