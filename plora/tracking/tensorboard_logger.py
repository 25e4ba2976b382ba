"""An adapter as a TensorBoard run: ``<run>/tensorboard/<adapter-id>/``.

``tensorboard --logdir <run>/tensorboard`` then shows every adapter's curves side by side,
and its HParams tab each adapter's hyperparameters against its final metrics. Written with
torch's own `SummaryWriter` (the ``tensorboard`` package is its only need).
"""

from __future__ import annotations

from pathlib import Path

from plora.tracking.records import AdapterRecord

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger:
    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        self.root = Path(run_dir) / "tensorboard"

    def log_adapter(self, record: AdapterRecord) -> None:
        """One event file: the curve by adapter step, the final metrics at the last step, and
        an hparams summary tying the hyperparameters to those metrics."""
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        writer = SummaryWriter(log_dir=str(self.root / record.adapter_id))
        try:
            for step, values in record.curve.items():
                for tag, value in values.items():
                    writer.add_scalar(tag, value, step)
            for tag, value in record.final.items():
                writer.add_scalar(tag, value, record.last_step)
            params = {**record.hyperparameters, "status": record.status}
            for summary in hparams(params, dict(record.final)):
                writer.file_writer.add_summary(summary)
        finally:
            writer.close()
