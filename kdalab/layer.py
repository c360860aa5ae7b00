"""A small FLA-style KDA layer on kdalab.chunk_kda: projections, the op, an
output RMSNorm gated as FLA's, an out projection. It is the model the
torch.compile and CUDA-graph tests run (FLA's KimiDeltaAttention, with its
short convolutions and the backend registry, is what scripts/bench_op.py times)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .op import chunk_kda


class KDALayer(nn.Module):
    def __init__(self, hidden_size: int = 1024, num_heads: int = 8, head_dim: int = 128,
                 lower_bound: float | None = -5.0, norm_eps: float = 1e-5, kernel=None):
        """lower_bound in [-5, 0): the bounded gate (safe_gate); None: the softplus gate
        (Kimi Linear's, no bound). kernel: the chunk_kda it calls (None: kdalab's; FLA's
        fla.ops.kda.chunk_kda takes the same arguments)."""
        super().__init__()
        self.kernel = chunk_kda if kernel is None else kernel
        self.num_heads, self.head_dim, self.lower_bound = num_heads, head_dim, lower_bound
        d = num_heads * head_dim
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden_size, d, bias=False) for _ in range(3))
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, head_dim, bias=False), nn.Linear(head_dim, d, bias=False))
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, head_dim, bias=False), nn.Linear(head_dim, d, bias=True))
        self.A_log = nn.Parameter(torch.zeros(num_heads))  # [H] (FLA's safe_gate init)
        self.dt_bias = nn.Parameter(torch.zeros(d))  # [H * K]
        self.o_norm = nn.RMSNorm(head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(d, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, initial_state=None, cu_seqlens=None, cu_seqlens_cpu=None):
        """x [B, T, hidden] -> (y [B, T, hidden], final state [N, H, V, K] fp32)."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q, k, v = (F.silu(p(x)).view(B, T, H, D) for p in (self.q_proj, self.k_proj, self.v_proj))
        o, state = self.kernel(q, k, v, self.f_proj(x).view(B, T, H, D), self.b_proj(x), A_log=self.A_log,
                             dt_bias=self.dt_bias, initial_state=initial_state, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, safe_gate=self.lower_bound is not None,
                             lower_bound=self.lower_bound,
                             state_v_first=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        o = self.o_norm(o) * torch.sigmoid(self.g_proj(x).view(B, T, H, D))
        return self.o_proj(o.reshape(B, T, H * D)), state
