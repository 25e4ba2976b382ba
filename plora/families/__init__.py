"""Model families: per-family config readers and builders (`plora.families.table`).

This package's top level imports no torch, so that the space file's validation can read
the families' LoRA targets (`plora.families.targets`) cheaply.
"""

from plora.families.base import ModelError
from plora.families.targets import FAMILY_TARGETS, family_targets

__all__ = ["FAMILY_TARGETS", "ModelError", "family_targets"]
