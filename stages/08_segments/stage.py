"""Stage 08: stage 07 in segments of the sequence, forward only.

Stage 07's workspace holds every chunk of the sequence (about 1.3 KB per token
and head), so its memory grows with T. This stage runs K1 + K2 once per
segment of SEGMENT_CHUNKS chunks, the workspace one segment deep (two
buffers), the state carried through ht; K1 of the next segment runs on a side
stream beside K2 of this one. K2's width rule asks for two compute warps per
block once those blocks cover the SMs. The outputs are bitwise stage 07's.
``path`` pins K2's width (and the segment length) for the benchmark and the
tests; ``frag_check`` is stage 07's fragment identity.
"""

from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import torch

from common import extrun
from common.build import load_extension
from common.contract import Ablation, StageSpec, ablation_build_args, prepare

HERE = Path(__file__).resolve().parent
SOURCES = ["kda.cu", "binding.cpp"]

# Checked, not assumed: a check fails on any difference from the previous stage (common.checks.judge);
# the same kernels and roundings in another launch order: stage 07's bits.
SAME_BITS_AS_PREVIOUS = True

# The relative error o and the final state may reach against the fp64 reference and the previous
# stage: the bf16 bound, which the check cases come within 1.2x of (o 4.1e-3, S 3.0e-3 at worst;
# results/h200/checks.json).
TOLERANCE = dict(o=5e-3, S=5e-3)

SPEC = StageSpec(
    name="08_segments",
    title="stage 07 in segments of the sequence: a workspace of one segment, K1 of the next beside K2",
    devices=("cuda",),
    gates=("bounded",),
    chunk_sizes=(16,),
    default_chunk=16,
    head_dims=(64, 128),
    equal_kv=True,
    compute_dtype=torch.bfloat16,
    backward=False,
    regions=(
        # ids 0-14, in the order of the KdaRegion enum in kda.h
        "K1: load+pre-stage", "K1: L/Aqk products", "K1: inverse", "K1: w/u + store",
        "K2: wait for operands", "K2: w@S", "K2: qd@S", "K2: vcorr", "K2: Aqk@vcorr", "K2: o store",
        "K2: S decay", "K2: kr^T@vcorr", "K2: S to bf16",
        "K2 load warp: wait for a free slot", "K2 load warp: issue cp.async",
    ),
    region_unit="cycles",
    tolerance=TOLERANCE,
    extra={"cutlass": True, "min_sm": 80},
)

# The ideas of this stage that can be turned off one at a time (common/ablation.py).
ABLATIONS = (
    Ablation(name="no_segments", define="KDA_NO_SEGMENTS",
             idea="the sequence in segments of 64 chunks: a workspace of one segment",
             instead="one segment, the whole sequence: stage 07's workspace of every chunk",
             region="K2: wait for operands", shape=dict(B=1, T=32768, H=16, K=128, V=128)),
    Ablation(name="one_stream", define="KDA_ONE_STREAM",
             idea="K1 of the next segment on a side stream, beside K2 of this one",
             instead="K1 and K2 of each segment in turn on the call's stream",
             region="K2: wait for operands", shape=dict(B=1, T=32768, H=16, K=128, V=128)),
    Ablation(name="k2_width_stage07", define="KDA_K2_WIDTH_STAGE07",
             idea="two compute warps per K2 block once those blocks cover the SMs",
             instead="stage 07's rule: two only from twice the SMs",
             region="K2: w@S"),
)


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
                          extra_cuda_cflags=CUDA_FLAGS, verbose=verbose,
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


# The segment length in chunks (binding.cpp kSegmentChunks; a GPU test counts the launches).
SEGMENT_CHUNKS = 64

# The paths a call can be pinned to: name -> (fused, compute warps per K2 block). This stage
# has the split path only (K1 + K2); the width is the rule's choice unless pinned.
PATHS = {"split1": (0, 1), "split2": (0, 2)}

# The records of this stage's own measurements (common.stages.declared_records): its paths, and the
# timeline its notebook shows (the split path at a shape long enough for several segments).
RECORDS = dict(paths=dict(table="stage08/paths_04c36d6", profile="stage08/paths_04c36d6", profile_path="split1",
                          profile_shape=dict(B=1, T=32768, H=16, K=128, V=128)))

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
    """Pin the calls inside the block: "split1"/"split2" (1 or 2 compute warps
    per K2 block); None keeps the stage's rule. ``segment_chunks`` sets how many
    chunks run per K1 + K2 pair (None: SEGMENT_CHUNKS), so that the tests see
    many segments in a short sequence. The pin is passed to each call as an
    argument (nothing is stored in the extension)."""
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
    return dict(ncw=PATHS[name][1] if name is not None else 0, segment_chunks=segment_chunks or 0)


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
