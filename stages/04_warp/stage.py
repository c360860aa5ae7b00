"""Stage 04: CUDA fp32, warp-level parallelism.

The chunk-independent phases run one warp per (batch, head, chunk): the 32
lanes split the feature dimension (coalesced rows), reduce dot products with
warp shuffles and solve the triangular inverse row by row in parallel over
columns. The two recurrences run one block per (batch, head) with one thread
per value column, so the serial chain over chunks is V threads wide.
The profile build times each kernel with clock64 (cycles per warp or block).
"""

from pathlib import Path

import torch

from common import extrun
from common.build import load_extension
from common.contract import StageSpec, prepare

HERE = Path(__file__).resolve().parent
SOURCES = ["binding.cpp", "kda.cu"]

SPEC = StageSpec(
    name="04_warp",
    title="CUDA fp32, warp per chunk (shuffle reductions, parallel triangular solve); "
          "recurrence: block per (b, h), thread per value column",
    devices=("cuda",),
    chunk_sizes=(16, 32, 64),
    default_chunk=64,
    max_head_dim=256,
    compute_dtype=torch.float32,
    backward=True,
    regions=(
        # ids 0-6, in the order of the KdaRegion enum in kda.h
        "fwd: pre-stage", "fwd: WY transform", "fwd: Aqk", "fwd: recurrence",
        "bwd: recurrence", "bwd: WY/Aqk adjoint", "bwd: pre-stage adjoint",
    ),
    region_unit="cycles",
)


def build(profile=False, verbose=False):
    """Compile (or load the cached build of) this stage's extension."""
    return load_extension(HERE, SPEC.name, SOURCES, cuda=True, profile=profile, verbose=verbose)


def forward(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None,
            output_final_state=True, gate="softplus", lower_bound=None, chunk_size=None):
    """The stage contract (DESIGN.md section 5). Returns (o, final_state)."""
    c = prepare(SPEC, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, gate=gate,
                lower_bound=lower_bound, chunk_size=chunk_size)
    return extrun.run(build(), SPEC, c)


def profile(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None,
            output_final_state=True, gate="softplus", lower_bound=None, chunk_size=None,
            backward=False):
    """clock64 cycles per region from the profile build (-DKDA_PROFILE)."""
    c = prepare(SPEC, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, gate=gate,
                lower_bound=lower_bound, chunk_size=chunk_size)
    return extrun.profile(build(profile=True), SPEC, c, backward=backward)
