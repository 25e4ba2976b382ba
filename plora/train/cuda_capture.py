"""One lock between a CUDA graph capture and the device work other threads of a job do.

A capture (`plora.train.step_graph.CudaGraphs.capture`) runs in CUDA's global capture mode:
while it records, a call from *any* thread that could synchronise the device (a copy to
pageable host memory, an allocation) fails the capture and that call. The adapter writer
copies leaving adapters to the host on its own thread while the pack trains on
(`plora.train.packed.bank.BankSnapshot`); the two take this lock, so neither meets the
other. Each holds it for a fraction of a second, once per pack composition or leaving group.
"""

from __future__ import annotations

import threading

__all__ = ["CAPTURE_LOCK"]

#: held by a capture, and by another thread's device copies of a job
CAPTURE_LOCK = threading.Lock()
