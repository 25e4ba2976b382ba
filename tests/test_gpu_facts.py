"""The GPUs a sweep plans for, read from the CUDA driver without torch (`plora.gpu_facts`):
the driver's answers as torch gives them, its failures left to torch, and a GPU sweep
planned without torch imported."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import tiny_space_file
from plora import gpu_facts


class _FakeDriver:
    """libcuda's five entry points that `plora.gpu_facts` calls, answering for ``gpus``."""

    def __init__(self, gpus: list[tuple[str, int]], init: int = 0, fail: str | None = None):
        self.gpus, self.init, self.fail = gpus, init, fail

    def cuInit(self, flags):
        return self.init

    def cuDeviceGetCount(self, count):
        count._obj.value = len(self.gpus)
        return 1 if self.fail == "count" else 0

    def cuDeviceGet(self, device, ordinal):
        device._obj.value = ordinal
        return 0

    def cuDeviceGetName(self, buffer, size, device):
        buffer.value = self.gpus[device.value][0].encode()
        return 1 if self.fail == "name" else 0

    def cuDeviceTotalMem_v2(self, memory, device):
        memory._obj.value = self.gpus[device.value][1]
        return 0


@pytest.fixture
def driver(monkeypatch):
    def install(fake: _FakeDriver | None):
        gpu_facts._driver_answer.clear()

        def cdll(name):
            assert name == "libcuda.so.1"
            if fake is None:
                raise OSError("libcuda.so.1: cannot open shared object file")
            return fake

        monkeypatch.setattr(ctypes, "CDLL", cdll)

    yield install
    gpu_facts._driver_answer.clear()


def test_the_drivers_devices_are_listed_as_torch_names_them(driver):
    driver(_FakeDriver([("NVIDIA H100 80GB HBM3", 85_045_395_456), ("NVIDIA H100 80GB HBM3", 85_045_395_456)]))
    assert gpu_facts._from_driver() == (gpu_facts.GpuFacts("NVIDIA H100 80GB HBM3", 85_045_395_456),) * 2


def test_no_device_is_none_and_a_failing_driver_leaves_it_to_torch(driver):
    driver(_FakeDriver([], init=100))  # CUDA_ERROR_NO_DEVICE: CUDA_VISIBLE_DEVICES empty, say
    assert gpu_facts._from_driver() == ()
    driver(_FakeDriver([], init=999))  # a driver that does not start
    assert gpu_facts._from_driver() is None
    driver(_FakeDriver([("GPU", 1)], fail="name"))
    assert gpu_facts._from_driver() is None
    driver(None)  # no driver library at all
    assert gpu_facts._from_driver() is None


def test_the_driver_is_asked_once_whoever_asks_and_ahead_on_a_thread(driver, monkeypatch):
    fake = _FakeDriver([("NVIDIA H200", 150_000_000_000)])
    calls = []
    init = fake.cuInit

    def slow_init(flags):
        calls.append(flags)
        time.sleep(0.2)  # starting the driver takes a while: a second caller waits for it
        return init(flags)

    fake.cuInit = slow_init
    driver(fake)
    monkeypatch.setattr(gpu_facts, "cuda_torch_build", lambda: True)
    monkeypatch.setattr(gpu_facts, "_torch_imported", lambda: False)
    gpu_facts.look_ahead()
    time.sleep(0.05)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(gpu_facts._from_driver())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert answers == [(gpu_facts.GpuFacts("NVIDIA H200", 150_000_000_000),)] * 3
    assert len(calls) == 1
    gpu_facts.look_ahead()  # answered already: nothing more
    time.sleep(0.05)
    assert len(calls) == 1


def test_nothing_is_asked_ahead_with_a_cpu_torch(driver, monkeypatch):
    driver(None)
    monkeypatch.setattr(gpu_facts, "cuda_torch_build", lambda: False)
    started = []
    monkeypatch.setattr(gpu_facts.threading, "Thread", lambda *a, **k: started.append(k))
    gpu_facts.look_ahead()
    assert started == []


def test_once_torch_is_imported_torch_answers(driver):
    import torch  # noqa: F401 - (the test process has it anyway)

    driver(_FakeDriver([("NVIDIA H200", 150_000_000_000)]))
    assert gpu_facts.visible_gpus() == gpu_facts._from_torch()  # here: no CUDA, no GPUs


_PLAN_WITHOUT_TORCH = """
import json, sys
from pathlib import Path
import plora.gpu_facts as gpu_facts
gpu_facts.cuda_torch_build = lambda: True
gpu_facts._from_driver = lambda: (gpu_facts.GpuFacts("NVIDIA H100 80GB HBM3", 85_045_395_456),)
from plora.spec.loading import load_spec
from plora.sweep import prepare
from plora.cost.sweep_model import graphed_steps
from plora.engine import kernel_warmer
from plora.cli import _warm_kernels


ORDERS = []


class _Warmer:  # the kernel-warming process, as the sweep sees it: it reads one order
    class stdin:
        write = staticmethod(ORDERS.append)
        close = staticmethod(lambda: None)

    poll = staticmethod(lambda: None)


kernel_warmer._proc = _Warmer()
spec = load_spec(Path(sys.argv[1]))
prep = prepare(spec, probe=False, check_model=False,  # (a sweep has the first job's process build it)
               on_rows=_warm_kernels)
print(json.dumps({"torch": "torch" in sys.modules, "ordered": len(ORDERS),
                  "gpu": prep.hardware.gpu, "slots": prep.hardware.slots,
                  "memory": prep.hardware.gpu_memory_bytes, "graphed": graphed_steps(prep.spec, prep.hardware),
                  "jobs": len(prep.plan.jobs), "makespan": prep.plan.makespan}))
"""


def test_a_gpu_sweep_is_planned_without_importing_torch(tmp_path):
    """Its GPUs, their name (which finds what was measured of the model there), whether
    steps are graphed and the kernels its first job will want (ordered of the process that
    compiles them): all without torch, whose import took 3.7-5 s of a sweep's planning (and
    again 4 s on an H200 while the kernels were ordered through torch's modules)."""
    space = tiny_space_file(tmp_path, name="gpu-plan", num_train=16,
                            space={"strategy": "grid", "rank": [2, 4], "alpha": {"relative": [2]},
                                   "learning_rate": [1e-3], "batch_size": [2]},
                            hardware={"device": "cuda", "gpus": 1})
    script = tmp_path / "plan.py"
    script.write_text(textwrap.dedent(_PLAN_WITHOUT_TORCH))
    out = subprocess.run([sys.executable, str(script), str(space)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-6000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts == {"torch": False, "ordered": 1, "gpu": True, "slots": 1, "memory": 85_045_395_456.0, "graphed": True,
                     "jobs": facts["jobs"], "makespan": facts["makespan"]} and facts["jobs"] >= 1
    # nothing measured yet: each job's set-up, first steps, evals and saves are priced all the same
    from plora.cost.sweep_model import GPU_JOB_TERMS

    assert facts["makespan"] >= GPU_JOB_TERMS.fixed_s


def test_without_torch_the_driver_answers_unless_torch_is_a_cpu_build(monkeypatch, driver):
    """A CPU wheel of torch on a GPU host: the driver lists GPUs that no job could use."""
    driver(_FakeDriver([("NVIDIA H100 80GB HBM3", 85_045_395_456)]))
    monkeypatch.setattr(gpu_facts, "_torch_imported", lambda: False)
    monkeypatch.setattr(gpu_facts, "cuda_torch_build", lambda: True)
    assert gpu_facts.visible_gpus() == (gpu_facts.GpuFacts("NVIDIA H100 80GB HBM3", 85_045_395_456),)
    monkeypatch.setattr(gpu_facts, "cuda_torch_build", lambda: False)
    assert gpu_facts.visible_gpus() == ()


def test_hardware_takes_its_gpus_from_these_facts(monkeypatch, tmp_path):
    from plora.hardware import hardware_for
    from plora.spec.loading import load_spec

    spec = load_spec(tiny_space_file(tmp_path, name="hw", num_train=8, hardware={"device": "cuda", "gpus": 4}))
    monkeypatch.setattr(gpu_facts, "visible_gpus", lambda: (gpu_facts.GpuFacts("NVIDIA H200", 150_000_000_000),) * 2)
    hw = hardware_for(spec)
    assert (hw.gpu, hw.slots, hw.gpu_memory_bytes) == (True, 2, 150e9)
    monkeypatch.setattr(gpu_facts, "visible_gpus", lambda: ())
    with pytest.raises(ValueError, match="no CUDA device"):
        hardware_for(spec)
