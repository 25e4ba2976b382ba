"""plora: packed LoRA hyperparameter sweeps.

``plora.kernels`` is the repository's top-level ``kernels/`` folder, reached through the
``plora/kernels`` link: one mapping for an install, an editable install and a source tree on
``PYTHONPATH`` alike.

Importing plora drops torchao's notice about its C++ extensions (`plora.torchao_notice`):
it has to happen before torchao is imported, and every plora process imports this first.
"""

from __future__ import annotations

from plora.torchao_notice import silence_torchao_version_notice

__version__ = "0.1.0"

silence_torchao_version_notice()
