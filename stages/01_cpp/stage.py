"""Stage 01: C++ CPU extension, fp32, forward and hand-written backward.

The chunked algorithm of stage 00 with every loop written out, and its exact
adjoint walked in reverse (including the VJP of the triangular inverse).
Phases run one after the other over all (batch, head) pairs, so the profile
build can time each region with a wall clock.
"""

from pathlib import Path

import torch

from common import extrun
from common.build import load_extension
from common.contract import StageSpec, prepare

HERE = Path(__file__).resolve().parent
SOURCES = ["binding.cpp", "kda.cpp"]

# The relative error each output and gradient may reach against the fp64 reference and the previous
# stage: about 4x the worst of the CPU check cases (common.checks.cpu_cases),
# so that a change which loses accuracy fails.
TOLERANCE = dict(o=1.5e-6, S=1.5e-6, dq=1.5e-6, dk=1.5e-6, dv=1e-6, dg=1.5e-6,
                 dbeta=1.5e-6, dA_log=2e-7, ddt_bias=1e-6, dinitial_state=1.5e-6)

SPEC = StageSpec(
    name="01_cpp",
    title="C++ CPU extension, fp32, forward + hand-written backward",
    devices=("cpu",),
    chunk_sizes=(16, 32, 64),
    default_chunk=64,
    max_head_dim=256,
    compute_dtype=torch.float32,
    backward=True,
    regions=(
        # ids 0-7, in the order of the Region enum in binding.cpp
        "fwd: pre-stage", "fwd: WY transform", "fwd: Aqk", "fwd: recurrence",
        "bwd: recompute", "bwd: reverse recurrence", "bwd: WY adjoint", "bwd: pre-stage adjoint",
    ),
    region_unit="s",
    tolerance=TOLERANCE,
)


def build(profile=False, verbose=False):
    """Compile (or load the cached build of) this stage's extension."""
    return load_extension(HERE, SPEC.name, SOURCES, cuda=False, profile=profile, verbose=verbose)


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
    """Seconds per region from the profile build (-DKDA_PROFILE)."""
    c = prepare(SPEC, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, gate=gate,
                lower_bound=lower_bound, chunk_size=chunk_size)
    return extrun.profile(build(profile=True), SPEC, c, backward=backward)
