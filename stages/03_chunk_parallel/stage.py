"""Stage 03: chunk-parallel CUDA, fp32, one block per (batch, head).

The kernels of stage 02 with a new thread mapping: every kernel runs one block
per (batch, head); the phases whose chunks are independent (pre-stage, WY
transform, Aqk and their adjoints) give each chunk its own thread, while the
serial recurrences keep one thread per (batch, head), now alone in its block.
The profile build times each kernel with clock64 (cycles per block).
"""

from pathlib import Path

import torch

from common import extrun
from common.build import load_extension
from common.contract import StageSpec, ablation_build_args, prepare

HERE = Path(__file__).resolve().parent
SOURCES = ["kda.cu", "binding.cpp"]

# Checked, not assumed: a check fails on any difference from the previous stage (common.checks.judge);
# only the mapping of threads to chunks changed: the outputs are stage 02's, bit for bit.
SAME_BITS_AS_PREVIOUS = True

# The relative error each output and gradient may reach against the fp64 reference and the previous
# stage: about 4x the worst of the GPU check cases (common.checks.gpu_cases; results/h200/checks.json),
# so that a change which loses accuracy fails.
TOLERANCE = dict(o=3e-6, S=3e-6, dq=3e-6, dk=3e-6, dv=3e-6, dg=4e-6,
                 dbeta=4e-6, dA_log=2e-7, ddt_bias=1.5e-6, dinitial_state=2e-6)

SPEC = StageSpec(
    name="03_chunk_parallel",
    title="CUDA fp32, block per (batch, head), thread per chunk for the chunk-independent steps",
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
ABLATIONS = ()


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
