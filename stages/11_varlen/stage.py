"""Stage 11: stage 10's kernels over what a model passes, in one launch, forward only.

Packed sequences: ``cu_seqlens`` (FLA's convention, int32 or int64 token offsets
[N + 1] on q's device) with q, k, v, g, beta [1, T_total, H, *]; every kernel
works per (sequence, head) and the sequences run in one launch (the fused path)
or in the split path's segments, never in a loop over sequences. The state in
either layout: ``state_v_first`` takes initial_state and returns final_state as
[N, H, V, K] instead of [N, H, K, V]. The binding also takes the caller's
activations (l2norm, beta_mode, gate_id 3: the log decay itself) for the op
(kdalab); ``forward`` keeps the stage contract's. Without cu_seqlens a call is
stage 10's. Where one sequence is much longer than the rest, the long ones run on
the split path beside the fused kernel over the others (the hybrid: the lengths are
known from the CPU copy that validates cu_seqlens). ``path`` pins one path (and the
hybrid's threshold) for the benchmark and the tests;
``frag_check`` is stage 07's fragment identity.
"""

from pathlib import Path

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from common import extrun
from common.build import load_extension
from common.contract import StageSpec, ablation_build_args, prepare

HERE = Path(__file__).resolve().parent
SOURCES = ["kda.cu", "binding.cpp"]

# Checked, not assumed: a check fails on any difference from the previous stage (common.checks.judge);
# one launch over packed sequences runs stage 10's arithmetic: its bits on the equal-length calls.
SAME_BITS_AS_PREVIOUS = True

# The relative error o and the final state may reach against the fp64 reference and the previous
# stage: the bf16 bound, which the check cases come within 1.2x of (o 4.1e-3, S 3.0e-3 at worst;
# results/h200/checks.json).
TOLERANCE = dict(o=5e-3, S=5e-3)

SPEC = StageSpec(
    name="11_varlen",
    title="what a model passes, in one launch: packed sequences (cu_seqlens), the state V-first or K-first, "
          "the caller's activations",
    devices=("cuda",),
    gates=("bounded",),
    chunk_sizes=(16,),
    default_chunk=16,
    head_dims=(64, 128),
    equal_kv=True,
    compute_dtype=torch.bfloat16,
    backward=False,
    varlen=True,
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

# No switches: the stage's idea (sequences and layouts a model passes) has no previous-stage
# code to switch back to; stage 10's switches are stage 10's (ablations.cuh says so).
ABLATIONS = ()


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
                          extra_cuda_cflags=CUDA_FLAGS, verbose=verbose, **ablation_build_args(ABLATIONS, ablation))


def forward(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None,
            output_final_state=True, gate="softplus", lower_bound=None, chunk_size=None,
            cu_seqlens=None, state_v_first=False):
    """The stage contract (DESIGN.md section 5), plus packed sequences and the state's layout.
    Returns (o, final_state).

    cu_seqlens: None, or int32 / int64 [N + 1] token offsets on q's device (cu[0] = 0,
    non-decreasing, cu[-1] = T; B must be 1): sequence i is tokens cu[i] .. cu[i + 1] - 1
    of the [1, T, H, *] inputs, any length (0 included). initial_state and final_state are
    then [N, H, K, V]. state_v_first: both are [N, H, V, K] ([B, H, V, K] without
    cu_seqlens). Everything is checked (a CPU copy of cu_seqlens) before any kernel runs."""
    # the pin is checked first (prepare refuses a v that is no [B, T, H, V] tensor, so pin is set past it)
    pin = _path_args(v.shape[-1]) if isinstance(v, torch.Tensor) and v.dim() >= 1 else None
    c = prepare(SPEC, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, gate=gate,
                lower_bound=lower_bound, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                state_v_first=state_v_first)
    return extrun.run(build(), SPEC, c, path=pin)


def profile(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None,
            output_final_state=True, gate="softplus", lower_bound=None, chunk_size=None,
            backward=False, cu_seqlens=None, state_v_first=False):
    """clock64 cycles per region from the profile build (-DKDA_PROFILE)."""
    # the pin is checked first (prepare refuses a v that is no [B, T, H, V] tensor, so pin is set past it)
    pin = _path_args(v.shape[-1]) if isinstance(v, torch.Tensor) and v.dim() >= 1 else None
    c = prepare(SPEC, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, gate=gate,
                lower_bound=lower_bound, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                state_v_first=state_v_first)
    return extrun.profile(build(profile=True), SPEC, c, backward=backward, path=pin)


# The split path's segment length in chunks (binding.cpp kSegmentChunks; a GPU test counts the launches).
SEGMENT_CHUNKS = 64

# The fused kernel's prepare teams of 4 warps on alternate chunks (fused.cuh kPrepTeams; a test
# compares): thread 0 of each team adds its timeline to the block's prepare regions of a profile.
PREP_TEAMS = 2

PATHS = {"split1": (0, 1), "split2": (0, 2), "fused1": (1, 1), "fused2": (1, 2), "fused4": (1, 4),
         "fused8": (1, 8)}

# The records of this stage's own measurements (common.stages.declared_records): its paths (stage 10's
# kernels over sequences: no fused profile of its own), the packed mixes, and its time at the tensor-core
# shapes (bounded gate, measured beside stage 12 and FlashKDA).
RECORDS = dict(paths=dict(table="stage11/paths_e242ae3"), varlen="stage11/varlen_hybrid_dacff50",
               latency=dict(file="stage12/summit_c8a9662", part="bounded"),
               # the region profile beside stage 10's, both from one call (an H100, the profiles phase)
               region_profile="../h100/stage12/profiles_c9f36c0")


_PIN: ContextVar = ContextVar("path_pin", default=(None, None, None))  # (name, segment_chunks, long_from) of ``path``


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
def path(name=None, segment_chunks=None, long_from=None):
    """Pin the kernels of the calls inside the block: "split1"/"split2" (K1 + K2
    with 1 or 2 compute warps per K2 block) or "fused1"/"fused2"/"fused4"/"fused8"
    (the fused kernel with that many compute warps per block; fused8 needs
    K = V = 128); None keeps the stage's rule. A path that does not exist for
    the sizes of a call raises at that call (path_error). ``segment_chunks`` sets
    how many chunks the split path runs per K1 + K2 pair (None: SEGMENT_CHUNKS),
    so that the tests see many segments in a short sequence. ``long_from`` sets
    the hybrid's threshold in tokens where the path is fused (None: the rule's,
    binding.cpp; 0: no hybrid): every sequence at least that long runs on the
    split path beside the fused kernel. The pin is passed to each call as an
    argument (nothing is stored in the extension)."""
    if name is not None and name not in PATHS:
        raise ValueError(path_error(name, 0))
    if segment_chunks is not None and (isinstance(segment_chunks, bool) or not isinstance(segment_chunks, int)
                                       or segment_chunks < 1):
        raise ValueError(f"segment_chunks must be a positive int or None, got {segment_chunks!r}")
    if long_from is not None and (isinstance(long_from, bool) or not isinstance(long_from, int) or long_from < 0):
        raise ValueError(f"long_from must be an int >= 0 (0: no hybrid) or None (the rule), got {long_from!r}")
    if long_from and name is not None and not PATHS[name][0]:
        raise ValueError(f"long_from (the hybrid) needs a fused path, got the split path {name!r}")
    token = _PIN.set((name, segment_chunks, long_from))
    try:
        yield
    finally:
        _PIN.reset(token)


def _path_args(V) -> dict:
    """The extension's path arguments for a call at value dimension V (refused here,
    before the extension is called, when the pinned path cannot run)."""
    name, segment_chunks, long_from = _PIN.get()
    why = path_error(name, V)
    if why is not None:
        raise ValueError(why)
    fused, ncw = PATHS[name] if name is not None else (-1, 0)
    return dict(fused=fused, ncw=ncw, segment_chunks=segment_chunks or 0,
                long_from=-1 if long_from is None else long_from)


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
