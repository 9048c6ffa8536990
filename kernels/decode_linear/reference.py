"""Torch reference of the decode projection (op "decode_linear", backend "reference"):
y = x @ W^T, as the model's linear layers compute it (cuBLAS on the GPU)."""
from __future__ import annotations

import torch


def decode_linear_reference(x: torch.Tensor, w: torch.Tensor, tuning=None) -> torch.Tensor:
    """y [B, N] (x's dtype) for x [B, K] and W [N, K]; `tuning` is the kernel's (unused)."""
    return torch.mm(x, w.t())
