"""Stage 09: stage 08 plus a fused path, forward only.

The fused path is one kernel: in each block eight prepare warps run K1's
phases chunk after chunk into a shared-memory ring and the compute warps run
the register-resident recurrence on it. The per-chunk workspace (about 1.3 KB
per token and head, written once and read back by every column slice)
disappears, and with it most of the peak memory. Its ideas, each with a switch
(ABLATIONS): the fused kernel and the rule that picks it (at V = 128, where its
blocks fill the SMs; elsewhere stage 08's split path in segments), a fast
prepare (MUFU approximations, loads before stores), two prepare teams on
alternate chunks (with eight compute warps setmaxnreg moves registers to the
compute warps, so the stage builds for sm_90a on the H200), and the next
chunk's loads issued early. ``path`` pins one path for the benchmark and the
tests; ``frag_check`` is stage 07's fragment identity.
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
    name="09_fused",
    title="stage 08 + a fused path: the prepare streams into the recurrence's block, no workspace, "
          "taken where the heads fill the SMs",
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
    # sm90a: on the H200 (or with no GPU) built for sm_90a, whose setmaxnreg the fused kernel uses
    extra={"cutlass": True, "min_sm": 80, "sm90a": True},
)

# The ideas of this stage that can be turned off one at a time (common/ablation.py).
ABLATIONS = (
    Ablation(name="no_fused", define="KDA_NO_FUSED",
             idea="the fused kernel: the prepare computed into the recurrence's ring, no workspace",
             instead="the split path at every shape (K1 + K2 in segments, stage 08)",
             region="K2: wait for operands"),
    Ablation(name="no_fast_prepare", define="KDA_NO_FAST_PREPARE",
             idea="a fast prepare: MUFU approximations, the gate in log2 units, loads before stores",
             instead="K1's arithmetic (expf, IEEE divisions, sqrt) and its one-pass loops",
             region="K1: load+pre-stage"),
    Ablation(name="one_prep_team", define="KDA_ONE_PREP_TEAM",
             idea="two prepare teams of four warps on alternate chunks",
             instead="one team of four warps prepares every chunk",
             region="K2 producer: wait (free slot, barrier)"),
    Ablation(name="late_loads", define="KDA_LATE_LOADS",
             idea="the next chunk's global loads issued before this chunk's phases",
             instead="issued after this chunk's phases",
             region="K2 producer: issue loads (+ stage rows, fused)"),
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
                          extra_cuda_cflags=CUDA_FLAGS, verbose=verbose, sm90a=SPEC.extra["sm90a"],
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

# The fused kernel's prepare teams of 4 warps on alternate chunks (kda.cu kPrepTeams; a test
# compares): thread 0 of each team adds its timeline to the block's prepare regions of a profile.
PREP_TEAMS = 2

PATHS = {"split1": (0, 1), "split2": (0, 2), "fused1": (1, 1), "fused2": (1, 2), "fused4": (1, 4),
         "fused8": (1, 8)}

# The records of this stage's own measurements (common.stages.declared_records): its paths, and the
# fused kernel's timeline its notebook shows.
RECORDS = dict(paths=dict(table="stage09/paths_04c36d6", profile="stage09/profile_2bcc81f", profile_path="fused8",
                          profile_shape=dict(B=8, T=1024, H=64, K=128, V=128)))


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
