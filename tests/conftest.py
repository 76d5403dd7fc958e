"""Test configuration: on a machine without CUDA, Triton kernels run in the interpreter.

TRITON_INTERPRET must be set before ``triton.jit`` wraps the kernels (at import), so it is set
here, before any test module imports foscar's kernels.
"""

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: device every kernel test runs on: the GPU, or the CPU through the Triton interpreter
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
