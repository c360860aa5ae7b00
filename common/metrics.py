"""Error metric and tolerance policy (DESIGN.md section 6).

rel_err(x, ref) = ||x - ref||_2 / ||ref||_2 in float64. It never reports a
pass it cannot vouch for:

- NaN or inf anywhere in ``x`` gives inf (an unwritten, poisoned output);
- NaN or inf anywhere in ``ref`` gives inf too (a broken reference checks
  nothing);
- a reference of norm 0 (or an empty one) gives inf: a relative error is not
  defined there, and a check case whose reference is zero checks nothing, so
  it is flagged for the case to be fixed instead of passing.

So the result is a finite float only when both sides are finite and the
reference is not zero, and ``worst()`` keeps inf (``max(0.0, nan)`` would
silently give 0.0).
"""

from __future__ import annotations

import math

import torch

# Per compute precision: the bound of the regime. Each stage declares its own, tighter, tolerance per
# output (StageSpec.tolerance, at the level its check cases reach); these bound what is not a stage of
# the ladder: FLA's and FlashKDA's own errors, and stand-ins a test builds.
TOLERANCE = {
    "fp32": 1e-5,
    "bf16": 5e-3,  # FlashKDA vs FLA measured 5.6e-3 on bf16 o
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    if x is None or ref is None:
        raise ValueError("rel_err needs two tensors")
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: {list(x.shape)} vs reference {list(ref.shape)}")
    x64 = x.detach().to("cpu", torch.float64)
    r64 = ref.detach().to("cpu", torch.float64)
    if not torch.isfinite(x64).all() or not torch.isfinite(r64).all():
        return math.inf
    num = torch.linalg.vector_norm(x64 - r64).item()
    den = torch.linalg.vector_norm(r64).item()
    if den == 0.0:
        return math.inf
    return num / den


def worst(values) -> float | None:
    """The largest of some errors, None if there are none; NaN counts as inf."""
    vals = [math.inf if (v is not None and math.isnan(v)) else v for v in values if v is not None]
    return max(vals) if vals else None


def tolerance(precision: str) -> float:
    return TOLERANCE[precision]


def moving_mean(xs, w: int = 10) -> list:
    """Each value's mean with the w - 1 before it (fewer at the start): a loss curve smoothed."""
    return [sum(xs[max(0, i - w + 1):i + 1]) / len(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


def curve_gap(a, b, start: int = 0, w: int = 10) -> float:
    """The largest difference of two curves, each smoothed by moving_mean, from index ``start`` on."""
    return max(abs(x - y) for x, y in list(zip(moving_mean(a, w), moving_mean(b, w)))[start:])
