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
from common.contract import Ablation, StageSpec, ablation_build_args, prepare

HERE = Path(__file__).resolve().parent
SOURCES = ["kda.cu", "binding.cpp"]

# The relative error each output and gradient may reach against the fp64 reference and the previous
# stage: about 4x the worst of the GPU check cases (common.checks.gpu_cases; results/h200/checks.json),
# so that a change which loses accuracy fails.
TOLERANCE = dict(o=3e-6, S=3e-6, dq=3e-6, dk=2e-6, dv=3e-6, dg=1.5e-6,
                 dbeta=4e-6, dA_log=1.5e-7, ddt_bias=1.2e-6, dinitial_state=2e-6)

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
    tolerance=TOLERANCE,
)


# The ideas of this stage that can be turned off one at a time (common/ablation.py).
# Each define switches ONE idea of the README off in kda.cu (stage 03's way for that
# part) and keeps the others on.
ABLATIONS = (
    Ablation(name="no_warp_chunk", define="KDA_NO_WARP_CHUNK",
             idea="warp per chunk (lanes split K/V, shuffle reductions, parallel triangular solve)",
             instead="one thread per chunk, one block per (b, h) (stage 03)",
             region="fwd: WY transform"),
    Ablation(name="no_column_threads", define="KDA_NO_COLUMN_THREADS",
             idea="recurrences: one thread per value column",
             instead="one thread per (b, h) carries the whole K x V state (stage 03)",
             region="fwd: recurrence"),
    Ablation(name="no_precompute", define="KDA_NO_PRECOMPUTE",
             idea="precomputed gated operands kd, qd, kr, exp(glast)",
             instead="every use re-evaluates its exp(), in the recurrences on each of the V threads (stage 03)",
             region="fwd: recurrence"),
    Ablation(name="no_bwd_chunk_states", define="KDA_NO_BWD_CHUNK_STATES",
             idea="backward around per-chunk states: the sums over V leave the serial chain",
             instead="one dS carried in place; the sums over V inside the reverse chain, split over the block (stage 03)",
             region="bwd: recurrence"),
)


def build(profile=False, verbose=False, ablation=None):
    """Compile (or load the cached build of) this stage's extension; ``ablation``
    names one of ABLATIONS to build with that idea turned off."""
    return load_extension(HERE, SPEC.name, SOURCES, cuda=True, profile=profile, verbose=verbose,
                          **ablation_build_args(ABLATIONS, ablation))


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
