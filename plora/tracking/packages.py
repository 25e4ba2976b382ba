"""The optional packages each tracker needs, and the extra that installs them.

Looked for (not imported) when the space file is validated, so that a missing package is one
line naming the extra before anything runs, and validating stays fast (``wandb`` alone takes
a second to import)."""

from __future__ import annotations

import importlib.util

__all__ = ["TRACKER_PACKAGES", "missing_package"]

#: tracker -> (import name, the extra that installs it)
TRACKER_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "plora[tensorboard]"),
    "wandb": ("wandb", "plora[wandb]"),
}


def missing_package(tracker: str) -> str | None:
    """What to install for ``tracker`` when its package is missing, else None."""
    module, extra = TRACKER_PACKAGES[tracker]
    if importlib.util.find_spec(module) is None:
        return f"needs the {module} package: pip install \"{extra}\""
    return None
