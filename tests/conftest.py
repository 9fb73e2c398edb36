"""Test setup: without a CUDA device, Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before triton is imported; torch itself does not import triton.
"""
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
