"""Without a GPU, Triton kernels run in its CPU interpreter, which must be chosen before triton is imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
