"""Error metric and tolerance policy (DESIGN.md section 6).

rel_err(x, ref) = ||x - ref||_2 / ||ref||_2 in float64. NaN or inf anywhere in
``x`` gives inf, so it never passes. A reference that is exactly zero is
compared by the absolute norm instead.
"""

from __future__ import annotations

import math

import torch

# Per compute precision: the relative error a stage must stay under, against
# the fp64 reference and against the previous stage.
TOLERANCE = {
    "fp32": 1e-5,  # stages 00-04
    "bf16": 5e-3,  # stages 05-07 (FlashKDA vs FLA measured 5.6e-3 on bf16 o)
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if x is None or ref is None:
        raise ValueError("rel_err needs two tensors")
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: {list(x.shape)} vs reference {list(ref.shape)}")
    x64 = x.detach().to("cpu", torch.float64)
    r64 = ref.detach().to("cpu", torch.float64)
    if not torch.isfinite(x64).all():
        return math.inf
    num = torch.linalg.vector_norm(x64 - r64).item()
    den = torch.linalg.vector_norm(r64).item()
    if den == 0.0:
        return num
    return num / den


def tolerance(precision: str) -> float:
    return TOLERANCE[precision]
