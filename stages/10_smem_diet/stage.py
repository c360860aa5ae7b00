"""Stage 10: stage 09 with less work around each MMA, forward only.

Stage 09's fused kernel is bound by shared memory and by the instructions that
move MMA operands (its SASS and Nsight Compute's counters). This stage keeps
stage 09's paths, rule and segments and cuts that work: the chain's B fragments
written as 32-bit words and its A fragments loaded by ldmatrix, the fused
prepare's rows in eight lanes per token (6 shuffles per lane and chunk instead
of 40), exp(glast) laid out for 16-byte loads and one warp per 16 x 16 product
of the prepare. The compute warps then fit in 128 registers: no setmaxnreg, no
sm_90a build. The split path keeps stage 07's bits. ``path`` pins one path for
the benchmark and the tests; ``frag_check`` is stage 07's fragment identity.
"""

from pathlib import Path

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from common import extrun
from common.build import load_extension
from common.contract import Ablation, StageSpec, ablation_build_args, prepare

HERE = Path(__file__).resolve().parent
SOURCES = ["kda.cu", "binding.cpp"]

# The relative error o and the final state may reach against the fp64 reference and the previous
# stage: the bf16 bound, which the check cases come within 1.2x of (o 4.1e-3, S 3.0e-3 at worst;
# results/h200/checks.json).
TOLERANCE = dict(o=5e-3, S=5e-3)

SPEC = StageSpec(
    name="10_smem_diet",
    title="stage 09 with less work around each MMA: fragments by ldmatrix and as words, eight lanes per "
          "token in the prepare, 16-byte decay loads; no setmaxnreg",
    devices=("cuda",),
    gates=("bounded",),
    chunk_sizes=(16,),
    default_chunk=16,
    head_dims=(64, 128),
    equal_kv=True,
    compute_dtype=torch.bfloat16,
    backward=False,
    regions=(
        # ids 0-16, in the order of the KdaRegion enum in kda.h
        "K1: load+pre-stage", "K1: L/Aqk products", "K1: inverse", "K1: w/u + store",
        "K2: wait for operands", "K2: w@S", "K2: qd@S", "K2: vcorr", "K2: Aqk@vcorr", "K2: o store",
        "K2: S decay", "K2: kr^T@vcorr", "K2: S to bf16",
        "K2 producer: wait (free slot, barrier)", "K2 producer: issue loads (+ stage rows, fused)",
        "fused prepare: team barrier", "fused prepare: decay columns",
    ),
    region_unit="cycles",
    tolerance=TOLERANCE,
    extra={"cutlass": True, "min_sm": 80},
)

# The ideas of this stage that can be turned off one at a time (common/ablation.py).
# Each define turns ONE idea of the README off and does there what stage 09 did
# (ablations.cuh holds that code); the other ideas stay on.
ABLATIONS = (
    Ablation(name="frag_stage09", define="KDA_FRAG_STAGE09",
             idea="B fragments written as 32-bit words, A fragments by ldmatrix",
             instead="B written as two bf16 halves (re-packed), operands by 32-bit shared loads",
             region="K2: S to bf16"),
    Ablation(name="smem_stage09", define="KDA_SMEM_STAGE09",
             idea="exp(glast) at el_index (16-byte loads), one warp per prepare product",
             instead="exp(glast) at d (single loads), two warps per 16 x 16 product",
             region="K2: S decay"),
    Ablation(name="rows_stage09", define="KDA_ROWS_STAGE09",
             idea="eight lanes per token in the fused prepare (6 shuffles)",
             instead="K1's rows, a lane across 4 rows (40 shuffles per lane and chunk)",
             region="K2 producer: issue loads (+ stage rows, fused)"),
    Ablation(name="regs_stage09", define="KDA_REGS_STAGE09",
             idea="128 registers for all warps (no setmaxnreg, sm_90 build)",
             instead="setmaxnreg 104 (prepare) / 152 (compute warps), sm_90a build",
             region="K2: wait for operands"),
)

# The ablation whose code needs the sm_90a build (setmaxnreg); the stage itself is built for sm_90.
_SM90A_ABLATIONS = ("regs_stage09",)


# CuTe's bf16 type needs the half/bf16 operators that torch's extension flags
# switch off; CuTe's constexpr helpers are called from device code.
CUDA_FLAGS = [
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]


def build(profile=False, verbose=False, ablation=None):
    """Compile (or load the cached build of) this stage's extension; ``ablation``
    names one of ABLATIONS to build with that idea turned off."""
    return load_extension(HERE, SPEC.name, SOURCES, cuda=True, cutlass=True, profile=profile,
                          extra_cuda_cflags=CUDA_FLAGS, verbose=verbose, sm90a=ablation in _SM90A_ABLATIONS,
                          **ablation_build_args(ABLATIONS, ablation))


def forward(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None,
            output_final_state=True, gate="softplus", lower_bound=None, chunk_size=None):
    """The stage contract (DESIGN.md section 5). Returns (o, final_state)."""
    # the pin is checked first (prepare refuses a v that is no [B, T, H, V] tensor, so pin is set past it)
    pin = _path_args(v.shape[-1]) if isinstance(v, torch.Tensor) and v.dim() >= 1 else None
    c = prepare(SPEC, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, gate=gate,
                lower_bound=lower_bound, chunk_size=chunk_size)
    return extrun.run(build(), SPEC, c, path=pin)


def profile(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None,
            output_final_state=True, gate="softplus", lower_bound=None, chunk_size=None,
            backward=False):
    """clock64 cycles per region from the profile build (-DKDA_PROFILE)."""
    # the pin is checked first (prepare refuses a v that is no [B, T, H, V] tensor, so pin is set past it)
    pin = _path_args(v.shape[-1]) if isinstance(v, torch.Tensor) and v.dim() >= 1 else None
    c = prepare(SPEC, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, gate=gate,
                lower_bound=lower_bound, chunk_size=chunk_size)
    return extrun.profile(build(profile=True), SPEC, c, backward=backward, path=pin)


# The split path's segment length in chunks (binding.cpp kSegmentChunks; a GPU test counts the launches).
SEGMENT_CHUNKS = 64

# The fused kernel's prepare teams of 4 warps on alternate chunks (fused.cuh kPrepTeams; a test
# compares): thread 0 of each team adds its timeline to the block's prepare regions of a profile.
PREP_TEAMS = 2

PATHS = {"split1": (0, 1), "split2": (0, 2), "fused1": (1, 1), "fused2": (1, 2), "fused4": (1, 4),
         "fused8": (1, 8)}

# The records of this stage's own measurements (common.stages.declared_records): its paths, and the
# fused kernel's timeline its notebook shows.
RECORDS = dict(paths=dict(table="stage10/paths_04c36d6", profile="stage10/profile_2bcc81f", profile_path="fused8",
                          profile_shape=dict(B=8, T=1024, H=64, K=128, V=128)))
# Three of the switches (and the three together) built beside the stage and timed at B = 8 (fused8) and at the
# seed's shape (fused4) in one call (scripts/try_variants.py, an H100): what each idea buys where the step is large.
RECORDS["ideas_at"] = dict(file="../h100/stage10/ideas_b8_2671fbe",
                           ideas={"frag": "frag_stage09", "smem": "smem_stage09", "rows": "rows_stage09",
                                  "three": "all three"})


_PIN: ContextVar = ContextVar("path_pin", default=(None, None))  # (path name, segment_chunks) of ``path``


def path_error(name, V):
    """Why path ``name`` cannot run at value dimension V (None: it can)."""
    if name is None:
        return None
    if name not in PATHS:
        return f"path must be one of {', '.join(PATHS)} or None, got {name!r}"
    ncw = PATHS[name][1]
    if 16 * ncw > V:
        return f"path {name!r} has {ncw} compute warps of 16 value columns: it needs V >= {16 * ncw}, got V = {V}"
    return None


@contextmanager
def path(name=None, segment_chunks=None):
    """Pin the kernels of the calls inside the block: "split1"/"split2" (K1 + K2
    with 1 or 2 compute warps per K2 block) or "fused1"/"fused2"/"fused4"/"fused8"
    (the fused kernel with that many compute warps per block; fused8 needs
    K = V = 128); None keeps the stage's rule. A path that does not exist for
    the sizes of a call raises at that call (path_error). ``segment_chunks`` sets
    how many chunks the split path runs per K1 + K2 pair (None: SEGMENT_CHUNKS),
    so that the tests see many segments in a short sequence. The pin is passed
    to each call as an argument (nothing is stored in the extension)."""
    if name is not None and name not in PATHS:
        raise ValueError(path_error(name, 0))
    if segment_chunks is not None and (isinstance(segment_chunks, bool) or not isinstance(segment_chunks, int)
                                       or segment_chunks < 1):
        raise ValueError(f"segment_chunks must be a positive int or None, got {segment_chunks!r}")
    token = _PIN.set((name, segment_chunks))
    try:
        yield
    finally:
        _PIN.reset(token)


def _path_args(V) -> dict:
    """The extension's path arguments for a call at value dimension V (refused here,
    before the extension is called, when the pinned path cannot run)."""
    name, segment_chunks = _PIN.get()
    why = path_error(name, V)
    if why is not None:
        raise ValueError(why)
    fused, ncw = PATHS[name] if name is not None else (-1, 0)
    return dict(fused=fused, ncw=ncw, segment_chunks=segment_chunks or 0)


def frag_check(A, X):
    """out = A @ bf16(X) computed by one warp whose X starts as an MMA accumulator
    and becomes the B operand through movmatrix (the identity stage 07 relies on).
    A: bf16 [16, kd] and X: fp32 [kd, 16] on a CUDA device, kd in {16, 64, 128}."""
    if not (isinstance(A, torch.Tensor) and isinstance(X, torch.Tensor)):
        raise TypeError("A and X must be torch tensors")
    if A.device.type != "cuda" or X.device != A.device:
        raise ValueError(f"A and X must be on the same CUDA device, got {A.device} and {X.device}")
    if A.dtype != torch.bfloat16 or X.dtype != torch.float32:
        raise TypeError(f"A must be bfloat16 and X float32, got {A.dtype} and {X.dtype}")
    if A.dim() != 2 or A.shape[0] != 16 or A.shape[1] not in (16, 64, 128) or tuple(X.shape) != (A.shape[1], 16):
        raise ValueError(f"A must be [16, kd] with kd in (16, 64, 128) and X [kd, 16], got {tuple(A.shape)} "
                         f"and {tuple(X.shape)}")
    return build().frag_check(A.contiguous(), X.contiguous())
