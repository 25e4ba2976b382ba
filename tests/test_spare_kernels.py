"""The first job's process, started ahead, loading the kernels the sweep expects it to launch
(`plora.engine.spare.KernelsOrder`, `plora.train.spare.KernelsAhead`): only once the kernel-
warming process has answered, never compiling, never holding up a job that comes first."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from plora.engine import kernel_warmer, spare
from plora.job.warm_order import WarmAnswer, WarmOrder, WarmPack, answered
from plora.train.spare import KernelsAhead

ORDER = WarmOrder(dtype="bfloat16", shapes=[(64, 64)], packs=[WarmPack(tokens=[64], ranks=[8])])


def _fields(log, offset: int = 0) -> dict:
    return spare.KernelsOrder(order=ORDER.model_dump(), warmer_log=str(log), warmer_offset=offset).model_dump()


def _answer(log, **kw) -> None:
    with open(log, "a") as f:
        f.write(WarmAnswer(kernels=3, seconds=0.5, finished_at=time.time(), **kw).model_dump_json() + "\n")


def test_only_an_answer_past_the_offset_counts(tmp_path):
    log = tmp_path / "kernel-warmer.log"
    assert answered(log) is None  # no log yet
    log.write_text("ready\n")
    _answer(log)  # an earlier sweep's
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write("ready\n{not json\n")
    assert answered(log, offset) is None
    _answer(log, error=None)
    got = answered(log, offset)
    assert got is not None and got.kernels == 3
    assert answered(log, 0) is not None


def test_an_order_waits_for_the_warming_thread_then_loads_once_answered(tmp_path, monkeypatch):
    from plora.kernels import warm_cache

    loaded: list[WarmOrder] = []
    monkeypatch.setattr(warm_cache, "warm", lambda order: loaded.append(order) or 7)
    log = tmp_path / "kernel-warmer.log"
    _answer(log)
    moments: dict = {}
    ahead = KernelsAhead(moments)
    assert ahead.take(_fields(log)) is None  # kept for the warming thread
    ahead.load(ahead.close())
    assert loaded == [ORDER]
    assert moments["kernels_ahead"]["loaded"] == 7 and "kernels_skipped" not in moments
    # one that comes after the warming thread looked gets a thread of its own
    later = ahead.take(_fields(log))
    assert isinstance(later, threading.Thread)
    later.join(10)
    assert loaded == [ORDER, ORDER]


def test_nothing_is_loaded_before_the_warming_process_answers_and_a_job_stops_the_wait(tmp_path, monkeypatch):
    from plora.kernels import warm_cache

    loaded: list = []
    monkeypatch.setattr(warm_cache, "warm", lambda order: loaded.append(order) or 1)
    log = tmp_path / "kernel-warmer.log"
    _answer(log)  # an earlier sweep's answer: not this one's
    moments: dict = {}
    ahead = KernelsAhead(moments)
    ahead.take(_fields(log, offset=log.stat().st_size))
    waiting = threading.Thread(target=ahead.load, args=(ahead.close(),))
    waiting.start()
    time.sleep(0.1)
    assert waiting.is_alive() and not loaded  # compiling is the warming process's, not the spare's
    ahead.job_came.set()
    waiting.join(5)
    assert not waiting.is_alive() and not loaded
    assert moments["kernels_skipped"] == "not compiled yet"


def test_a_malformed_order_or_a_failed_load_only_leaves_the_kernels_to_the_job(tmp_path, monkeypatch):
    from plora.kernels import warm_cache

    moments: dict = {}
    KernelsAhead(moments).load({"order": {"dtype": "bfloat16"}, "warmer_log": str(tmp_path / "x")})
    assert moments["kernels_skipped"] == "order"

    def broken(order):
        raise RuntimeError("no device")

    monkeypatch.setattr(warm_cache, "warm", broken)
    log = tmp_path / "kernel-warmer.log"
    _answer(log)
    moments = {}
    KernelsAhead(moments).load(_fields(log))
    assert "no device" in moments["kernels_skipped"]


def test_the_warming_process_remembers_what_it_was_told_and_where_it_answers(tmp_path, monkeypatch):
    reader = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    monkeypatch.setattr(kernel_warmer, "_proc", reader)
    monkeypatch.setattr(kernel_warmer, "_log_offset", 123)
    assert kernel_warmer.told() is None
    assert kernel_warmer.order(dtype="bfloat16", shapes=[(64, 64)], packs=[{"tokens": [64], "ranks": [8]}])
    order, log, offset = kernel_warmer.told()
    assert order == ORDER and log == kernel_warmer.log_path() and offset == 123
    reader.wait(timeout=10)
    kernel_warmer.discard()
    assert kernel_warmer.told() is None


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_sweep_sends_the_order_to_its_spares_unless_turned_off(tmp_path, monkeypatch, switch):
    from plora import cli

    monkeypatch.setenv("PLORA_SPARE_KERNELS", switch)
    sent: list = []

    class Live:
        class proc:
            @staticmethod
            def poll():
                return None

        def tell(self, order):
            sent.append(order)
            return True

        def kill(self):
            pass

    monkeypatch.setattr(spare, "_spares", {(0,): Live()})
    cli._spare_kernels((ORDER, tmp_path / "kernel-warmer.log", 5))
    cli._spare_kernels(None)  # the warming process was told nothing: nothing to load
    if switch == "0":
        assert sent == []
    else:
        assert len(sent) == 1 and isinstance(sent[0], spare.KernelsOrder)
        assert WarmOrder.model_validate(sent[0].order) == ORDER and sent[0].warmer_offset == 5


def test_a_spare_reads_a_kernels_order_and_still_answers_and_takes_its_job(tmp_path):
    """On the CPU nothing loads (no warming thread); the order is read and set aside."""
    from plora.models.loading import ASSETS

    one = spare.Spare(spare.spare_env(()))
    try:
        folder = str(ASSETS / "tiny-llama")
        assert one.wait_ready(180) and one.tell(spare.KernelsOrder(**_fields(tmp_path / "kernel-warmer.log")))
        good = spare.CheckOrder(check=folder, family="auto", random_init=False, max_seq_len=48)
        assert one.check(good, 180) == spare.CheckAnswer(ok=True)
    finally:
        one.kill()
