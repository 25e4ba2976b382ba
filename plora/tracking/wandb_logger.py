"""An adapter as a Weights & Biases run, in the sweep's group.

Runs are opened one at a time and finished before the next (one per adapter, named by its
id, its hyperparameters as the run's config), so nothing depends on W&B's handling of
several live runs in one process. ``mode: offline`` (or ``WANDB_MODE=offline``) writes them
under ``<run>/wandb/`` for a later ``wandb sync``, with no network or account.
"""

from __future__ import annotations

from pathlib import Path

from plora.tracking.records import AdapterRecord

__all__ = ["WandbLogger"]


class WandbLogger:
    name = "wandb"

    def __init__(self, run_dir: Path, settings: dict, group: str) -> None:
        """``settings``: the space file's ``logging.wandb`` (project, entity, mode, group, tags)."""
        self.run_dir = Path(run_dir)
        self.settings = settings
        self.group = settings.get("group") or group

    def log_adapter(self, record: AdapterRecord) -> None:
        """The curve by adapter step (W&B's steps only go forward: one log per step), the
        final metrics in the run's summary."""
        import wandb

        run = wandb.init(
            project=self.settings.get("project"), entity=self.settings.get("entity"), mode=self.settings.get("mode"),
            group=self.group, tags=list(self.settings.get("tags") or []) or None, name=record.adapter_id,
            job_type="adapter", dir=str(self.run_dir),
            config={**record.hyperparameters, "adapter_id": record.adapter_id, "job_id": record.job_id},
            settings=wandb.Settings(silent=True, console="off"),
        )
        try:
            for step, values in record.curve.items():
                run.log(values, step=step)
            run.summary.update({**record.final, "status": record.status})
        finally:
            run.finish()
