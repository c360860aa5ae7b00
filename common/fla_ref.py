"""Optional comparison kernels: FLA's Triton chunk_kda (pip package fla-core)
and FlashKDA (MoonshotAI, not on PyPI), imported only when present and only on
a GPU. Both get the same raw inputs as the stages (gate, l2norm and beta
sigmoid fused in the kernel)."""

from __future__ import annotations

import importlib.util

import torch


def fla_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "FLA's chunk_kda is Triton: it needs a GPU"
    if importlib.util.find_spec("fla") is None:
        return False, "fla-core is not installed (pip install -e '.[fla]')"
    return True, ""


def fla_forward(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None, output_final_state=True,
                gate="softplus", lower_bound=None, chunk_size=None):
    """FLA chunk_kda with the stage contract's arguments (chunk_size is FLA's own: 64)."""
    from fla.ops.kda import chunk_kda

    bounded = gate == "bounded"
    return chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        safe_gate=bounded, lower_bound=(-5.0 if lower_bound is None else lower_bound) if bounded else None,
        A_log=A_log, dt_bias=dt_bias.reshape(-1),
    )


def flashkda_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "FlashKDA needs a GPU"
    if importlib.util.find_spec("flash_kda") is None:
        return False, "FlashKDA is not installed (it is not on PyPI; build it from its repository)"
    return True, ""
