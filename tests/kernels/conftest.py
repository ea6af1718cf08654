"""Kernel tests: Triton runs on CPU tensors through its interpreter when there is no GPU.

tests/conftest.py sets the same default before any package is imported; repeating it here keeps
`pytest tests/kernels` correct on its own. It is harmless when kernels were imported earlier:
kernels/ops.py imports the Triton modules (where `@triton.jit` reads the variable) on first use.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
