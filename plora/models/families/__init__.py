"""Model families: per-family config readers and builders (`plora.models.families.table`).

This package's top level imports no torch, so that the space file's validation can read
the families' LoRA targets (`plora.models.families.targets`) cheaply.
"""

from plora.models.families.base import ModelError
from plora.models.families.targets import FAMILY_TARGETS, family_targets

__all__ = ["FAMILY_TARGETS", "ModelError", "family_targets"]
