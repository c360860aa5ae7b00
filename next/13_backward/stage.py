"""Stage 13: the backward, stage 12's forward with the chunked backward written for the GPU.

The forward is stage 12's source, so its bits. The backward (backward.cuh) walks the forward's chunk
algebra back in four kernels: each chunk's chain operands again (parallel), the forward chain
again keeping each chunk's entry state, the reverse chain of the state's gradient from the last
chunk to the first (serial), and each chunk's gradients from those (parallel), through the
pre-stage to the raw inputs. This first version is fp32 on the CUDA cores, every decay taken pair
by pair (exp(gc_c - gc_i) <= 1), so no gate overflows; it is the reference the tensor-core
backward is checked against. It takes what the forward takes: packed sequences (cu_seqlens) and
the state in either layout.
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

# The relative error each output and gradient may reach against the fp64 reference: o and S the bf16 bound of
# stages 05-12; the gradients about 2x the worst of the first H100 checks (results/h100/stage13/
# bwd_checks_2e8b3f6.json: dq 2.5e-3, dk 1.8e-3, dv 1.8e-3, dg 1.9e-3, dbeta 2.0e-3, dh0 1.7e-3; dA_log 4.8e-5 and
# ddt_bias 2.3e-4 of their terms), to be set at the measured level of the H200 checks when it joins the ladder.
TOLERANCE = dict(o=5e-3, S=5e-3, dq=5e-3, dk=5e-3, dv=5e-3, dg=6e-3, dbeta=7e-3, dA_log=5e-3,
                 ddt_bias=5e-3, dinitial_state=5e-3)

# The forward is stage 12's source, so its bits: o and S 0 off stage 12's on the 14 of the first H100 checks' 16
# cases that stage 12 is compared on (bwd_checks_2e8b3f6.json, err_prev; the two at the gate's extremes only fp64
# judges). With it declared, every check of o and S against stage 12 must come out 0
# (common.checks.judge).
SAME_BITS_AS_PREVIOUS = True

SPEC = StageSpec(
    name="13_backward",
    title="the backward: the state's gradient carried back through the chunks, each chunk's gradients "
          "from its entry state and exit gradient",
    devices=("cuda",),
    gates=("softplus", "bounded"),
    chunk_sizes=(16,),
    default_chunk=16,
    head_dims=(64, 128),
    equal_kv=True,
    compute_dtype=torch.bfloat16,
    backward=True,
    varlen=True,
    regions=(
        # ids 0-16, in the order of the KdaRegion enum in kda.h
        "K1: load+pre-stage", "K1: L/Aqk products", "K1: inverse", "K1: w/u + store",
        "K2: wait for operands", "K2: w@S", "K2: qd@S", "K2: vcorr", "K2: Aqk@vcorr", "K2: o store",
        "K2: S decay", "K2: kr^T@vcorr", "K2: S to bf16",
        "K2 producer: wait (free slot, barrier)", "K2 producer: issue loads (+ stage rows, fused)",
        "fused prepare: team barrier", "fused prepare: decay columns",
    ),
    # the backward's, per chunk (a chain's: one step of it), ids 0-14 of its own table (kda.h KdaBwdRegion)
    backward_regions=(
        "bwd: B1 load", "bwd: B1 pair sums", "bwd: B1 inverse", "bwd: B1 operands out",
        "bwd: B2 wait for operands", "bwd: B2 step", "bwd: B3 wait for operands", "bwd: B3 step",
        "bwd: B4 load", "bwd: B4 pair sums", "bwd: B4 inverse", "bwd: B4 state products",
        "bwd: B4 16 x 16 adjoints", "bwd: B4 per key dimension", "bwd: B4 dv, l2norm, out",
    ),
    region_unit="cycles",
    tolerance=TOLERANCE,
    extra={"cutlass": True, "min_sm": 80},
)

# No build switches: each variant of the stage's ideas (``pairwise``, ``u_halves``, ``deep_ring``) is an
# instantiation of one build, picked per call, so that each runs either way on the same inputs;
# stage 10's switches are stage 10's.
ABLATIONS = ()


# CuTe's bf16 type needs the half/bf16 operators that torch's extension flags
# switch off; CuTe's constexpr helpers are called from device code.
CUDA_FLAGS = [
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]


def build_emulator(verbose=False, variant=None):
    """The backward's kernels compiled for the CPU (emu.cpp through kda_emu.h: a std::thread per
    CUDA thread), so that a machine without a GPU runs their source; a C++ compiler and the CUDA headers only.
    ``variant``: one of BACKWARD_VARIANTS, built as the GPU's variant is; "exact" (fp32 chains, fp32 states) makes
    every gradient exact to fp32 round-off, so that a wrong index cannot hide in bf16's rounding."""
    from common.build import setup_cuda_home

    defines = _variant_defines(variant)
    home = setup_cuda_home()
    if home is None:
        raise RuntimeError("the CUDA headers (cuda_bf16.h) were not found: set CUDA_HOME to the CUDA toolkit")
    flags = ["-std=c++20", "-pthread", "-Wno-unknown-pragmas", f"-I{home}/include"]
    return load_extension(HERE, "emu_13_backward" + (f"_{variant}" if variant else ""), ["emu.cpp"], cuda=False,
                          verbose=verbose, extra_cflags=flags + [f"-D{d}" for d in defines])


def emulate_backward(q, k, v, g, beta, *, A_log, dt_bias, initial_state=None, scale=None, gate="softplus",
                     lower_bound=None, do, dht=None, cu_seqlens=None, variant=None, grads_bf16=False,
                     do_bf16=False, keep_u=False) -> dict:
    """The backward of backward.cuh run on the CPU (build_emulator), on the stage's bf16 inputs: the eight
    gradients by the name of their input (None for an absent h0) and the kernels' workspace (qd, kr, w, u, Aqk,
    el, states, dstates, vcorr, dvcorr), every output poisoned (NaN) before the call. ``cu_seqlens``: packed
    sequences (B = 1), the states then [N, H, K, V]. ``variant``: build_emulator's. ``grads_bf16``: the per-token
    gradients written in bf16 by the kernels, as the op has them written. ``do_bf16``: do given to the kernels in
    bf16 (rounded), as the op gives them o's gradient. ``u`` is ``vcorr``'s buffer, as the binding has it (B2
    writes each chunk's vcorr over its u), but with ``keep_u``, which gives u a buffer of its own (the checks of
    each kernel, as binding.cpp's bwd_workspace)."""
    from common.contract import check_gate

    gate, gate_id, lb = check_gate(gate, lower_bound)
    K = q.shape[-1]
    bf, f32 = (lambda t: t.to(torch.bfloat16).contiguous()), (lambda t: t.float().contiguous())
    out = build_emulator(variant=variant).bwd(
        bf(q), bf(k), bf(v), bf(g), bf(beta), f32(A_log), f32(dt_bias), None if initial_state is None else f32(initial_state),
        float(K ** -0.5 if scale is None else scale), gate_id, float(lb or 0.0), bf(do) if do_bf16 else f32(do),
        None if dht is None else f32(dht),
        None if cu_seqlens is None else cu_seqlens.to(torch.int32).contiguous(), grads_bf16, keep_u)
    dq, dk, dv, dg, dbeta, dal, dh0 = out[:7]
    grads = dict(q=dq, k=dk, v=dv, g=dg, beta=dbeta, A_log=dal.sum((0, 1)), dt_bias=out[17],
                 initial_state=dh0 if initial_state is not None else None)
    names = ("qd", "kr", "w", "u", "Aqk", "el", "states", "dstates", "vcorr", "dvcorr")
    return dict(grads, **dict(zip(names, out[7:17])), Xkk=out[18])


class EmulatedExtension:
    """The GPU build's ``bwd`` (binding.cpp's arguments) on the CPU through the emulator, so that a caller of the
    binding (kdalab.chunk_kda's autograd) runs the backward's own source on a machine without a GPU."""

    def bwd(self, q, k, v, g, beta, A_log, dt_bias, h0, scale, gate_id, lower_bound, chunk_size, dout, dht, dq, dk,
            dv, dg, dbeta, dA_log, ddt_bias, dh0, prof=None, cu_seqlens=None, max_seqlen=0, seq_lens=(),
            state_v_first=False):
        if chunk_size != SPEC.default_chunk:
            raise ValueError(f"chunk_size must be {SPEC.default_chunk}, got {chunk_size}")
        k_first = (lambda t: t.transpose(-1, -2).contiguous()) if state_v_first else (lambda t: t)
        out = build_emulator().bwd(q, k, v, g, beta, A_log, dt_bias, None if h0 is None else k_first(h0),
                                   float(scale), int(gate_id), float(lower_bound), dout,
                                   None if dht is None else k_first(dht), cu_seqlens, dq.dtype == torch.bfloat16,
                                   False)
        for buf, got in zip((dq, dk, dv, dg, dbeta), out[:5]):
            if got.dtype != buf.dtype:
                raise TypeError(f"the emulator wrote {got.dtype} where the binding writes {buf.dtype}")
            buf.copy_(got)
        ddt_bias.copy_(out[17])
        dA_log.copy_(out[5].sum((0, 1)))
        if dh0 is not None:
            dh0.copy_(k_first(out[6]))


def _buffer_bytes(B, T, H, K, variant=None, grads_bytes=2, h0=False) -> dict:
    """The bytes of every buffer the backward's kernels read or write at a shape (N = B sequences of T tokens,
    K = V), by KdaBwdParams' field: the op's bf16 inputs and do, the workspace (one slot per chunk of 16 tokens and
    head), the gradients (bf16 for the op, ``grads_bytes`` 4 for the stage's own fp32 calls). u and vcorr are one
    buffer. The states and the chains' operands are bf16, fp32 in the ``variant`` builds whose defines say so."""
    defines = set(_variant_defines(variant))
    states_bytes = 4 if "KDA_BWD_STATES_FP32" in defines else 2
    ops_bytes = 4 if defines & {"KDA_BWD_FP32_CHAINS", "KDA_BWD_FP32_OPERANDS"} else 2
    slots, rows, f32 = B * H * (-(-T // 16)), B * T * H, 4
    state = B * H * K * K * f32 if h0 else 0
    return dict(
        q=rows * K * 2, k=rows * K * 2, v=rows * K * 2, g=rows * K * 2, beta=rows * 2, dout=rows * K * 2,
        h0=state, dht=state, dh0=state,
        qd=slots * 16 * K * ops_bytes, kr=slots * 16 * K * ops_bytes, w=slots * 16 * K * ops_bytes,
        u=slots * 16 * K * f32, vcorr=slots * 16 * K * f32, Aqk=slots * 16 * 16 * f32, el=slots * K * f32,
        Xkk=0 if "KDA_BWD_B4_REBUILDS" in defines else slots * 2 * 16 * 16 * f32,
        states=slots * K * K * states_bytes, dstates=slots * K * K * states_bytes, dvcorr=slots * 16 * K * f32,
        dq=rows * K * grads_bytes, dk=rows * K * grads_bytes, dv=rows * K * grads_bytes, dg=rows * K * grads_bytes,
        dbeta=rows * grads_bytes, ddt_part=slots * K * f32, dAlog_part=rows * f32)


def backward_bytes(B, T, H, K, *, variant=None, grads_bytes=2) -> dict:
    """What the backward allocates at a shape, by tensor, in bytes: the workspace that lives between its kernels
    (binding.cpp bwd_impl) and the gradients it writes (_buffer_bytes). B2 writes each chunk's vcorr over its u,
    one buffer for the two. Nothing of the forward is kept but its inputs."""
    b = _buffer_bytes(B, T, H, K, variant, grads_bytes)
    work = {
        "qd, kr, w": b["qd"] + b["kr"] + b["w"],
        "u, then vcorr over it (fp32)": b["u"],
        "Aqk, exp(glast) (fp32)": b["Aqk"] + b["el"],
        "X, kk: B1's, for B4 (fp32)": b["Xkk"],
        "entry states, exit gradients": b["states"] + b["dstates"],
        "dvcorr (fp32)": b["dvcorr"],
        "dA_log's and ddt_bias's parts (fp32)": b["dAlog_part"] + b["ddt_part"],
    }
    grads = {"dq, dk, dv, dg": b["dq"] + b["dk"] + b["dv"] + b["dg"], "dbeta": b["dbeta"]}
    return dict(workspace=work, gradients=grads, total=sum(work.values()) + sum(grads.values()))


# What each of the backward's kernels reads and writes in global memory, by KdaBwdParams' field: (reads, writes).
# The profiler's kernel names are the keys' second parts. B2 and B3 are one launch.
BACKWARD_IO = {
    ("B1 prepare", "kda_bwd_prepare_kernel"): (
        ("q", "k", "v", "g", "beta"),
        ("qd", "kr", "w", "u", "Aqk", "el", "Xkk")),
    ("B2, B3 chains", "kda_bwd_chains_mma_kernel"): (
        ("w", "kr", "qd", "el", "u", "Aqk", "dout", "h0", "dht"),
        ("states", "vcorr", "dstates", "dvcorr", "dh0")),
    ("B4 adjoint", "kda_bwd_adjoint_kernel"): (
        ("q", "k", "v", "g", "beta", "dout", "vcorr", "dvcorr", "states", "dstates", "Xkk"),
        ("dq", "dk", "dv", "dg", "dbeta", "ddt_part", "dAlog_part")),
}


def backward_traffic(B, T, H, K, *, variant=None, h0=False) -> dict:
    """The bytes each backward kernel must move at least once at a shape (the op's call: bf16 inputs, do and
    gradients), {kernel: (read, written)}: its floor is these over the memory's bandwidth. A chain block's re-reads
    of its chunk's operands (four blocks of 32 value columns read the same rows) come from L2 and are not counted."""
    b = _buffer_bytes(B, T, H, K, variant, 2, h0)
    return {name: (sum(b[f] for f in reads), sum(b[f] for f in writes))
            for (name, _), (reads, writes) in BACKWARD_IO.items()}


# The backward's variants, each a build of its own timed beside the stage's (scripts/bench_train.py --variant):
# name -> the preprocessor defines that turn one change off.
BACKWARD_VARIANTS = {
    "no_pad": ("KDA_BWD_NO_PAD",),  # rows of K floats in shared memory (16-way bank conflicts)
    # the chains' states stored for B4 in fp32 (twice the bytes), B4's products with them then on the CUDA cores
    "fp32_states": ("KDA_BWD_STATES_FP32", "KDA_BWD_FP32_ADJOINT"),
    "fp32_chains": ("KDA_BWD_FP32_CHAINS",),  # the two chains on the CUDA cores, in fp32 (backward.cuh)
    "pairwise_sums": ("KDA_BWD_PAIRWISE_SUMS",),  # every pair decay its own exponential (B1's and B4's pair sums, B4's pair terms)
    "fp32_operands": ("KDA_BWD_FP32_OPERANDS",),  # B1's qd, kr, w in fp32, the tensor-core chains rounding them as they read
    # B4's per-key-dimension terms on the CUDA cores (chunks too wide to factor, fp32_key_terms) on D threads, not
    # two groups of D
    "one_key_group": ("KDA_BWD_ONE_KEY_GROUP",),
    "fp32_adjoint": ("KDA_BWD_FP32_ADJOINT",),  # B4's products with S and dS on the CUDA cores, in fp32
    # B4's per-key-dimension terms (the pair terms, dkd) on the CUDA cores in fp32, every chunk as the ones too wide
    # to factor take them, not as tensor-core products of the factored decays (backward.cuh key_terms_mma)
    "fp32_key_terms": ("KDA_BWD_FP32_KEY_TERMS",),
    # B4's dAqk = do vcorr^T and dAf = dw kd^T + dvcorr v^T on the CUDA cores in fp32, a pair a thread, not as
    # tensor-core products (backward.cuh pair_grads_mma)
    "fp32_pair_grads": ("KDA_BWD_FP32_PAIR_GRADS",),
    "fp32_dv": ("KDA_BWD_FP32_DV",),  # B4's dv = Af^T dvcorr on the CUDA cores in fp32, not on tensor cores (dv_mma)
    # B4's tiles of S and dS two buffers deep (one in flight while one is multiplied), the first issued after the
    # chunk's load, not four deep with the first three issued before it (backward.cuh kStateTileBufs)
    "two_state_tiles": ("KDA_BWD_TWO_STATE_TILES",),
    # B4's gate loop loading each row's g inside the loop, after the previous row's store of dg, not all rows before it
    "gate_loads_in_loop": ("KDA_BWD_GATE_LOADS_IN_LOOP",),
    # both of the two above at once: one build for the emulator's check that neither changes a bit
    "b4_waits": ("KDA_BWD_TWO_STATE_TILES", "KDA_BWD_GATE_LOADS_IN_LOOP"),
    "b4_rebuilds": ("KDA_BWD_B4_REBUILDS",),  # B4 forms each chunk's pair sums kk and inverse X again, as B1 does
    # candidates, not on: B1 held to 168 / 128 registers, 3 / 4 blocks per SM (with 214 it has 2)
    "prep_3blocks": ("KDA_BWD_PREP_MIN_BLOCKS=3",),
    "prep_4blocks": ("KDA_BWD_PREP_MIN_BLOCKS=4",),
    # not a change but the reference build: every product and stored state in fp32, so that each kernel's output
    # is the fp64 model's to fp32 round-off (scripts/check_backward.py --kernels, tests/test_backward_emu.py)
    "exact": ("KDA_BWD_STATES_FP32", "KDA_BWD_FP32_CHAINS", "KDA_BWD_FP32_ADJOINT", "KDA_BWD_FP32_KEY_TERMS",
              "KDA_BWD_FP32_PAIR_GRADS", "KDA_BWD_FP32_DV"),
}


def _variant_defines(variant) -> tuple:
    if variant is None:
        return ()
    if variant not in BACKWARD_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(BACKWARD_VARIANTS)}, got {variant!r}")
    return BACKWARD_VARIANTS[variant]


def build(profile=False, verbose=False, ablation=None, variant=None):
    """Compile (or load the cached build of) this stage's extension; ``ablation``
    names one of ABLATIONS to build with that idea turned off, ``variant`` one of BACKWARD_VARIANTS."""
    if variant is not None:
        return load_extension(HERE, SPEC.name, SOURCES, cuda=True, cutlass=True, profile=profile,
                              extra_cuda_cflags=CUDA_FLAGS, verbose=verbose, variant=variant,
                              defines=_variant_defines(variant))
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
    _check_pairwise(pin, c)
    return extrun.run(build(), SPEC, c, path=pin)


def profile(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None,
            output_final_state=True, gate="softplus", lower_bound=None, chunk_size=None,
            backward=False, cu_seqlens=None, state_v_first=False, variant=None):
    """clock64 cycles per region from the profile build (-DKDA_PROFILE); with ``backward`` the backward's regions
    too (per chunk: B1 and B4 a block each, a chain one step), of the ``variant`` build if one is named."""
    # the pin is checked first (prepare refuses a v that is no [B, T, H, V] tensor, so pin is set past it)
    pin = _path_args(v.shape[-1]) if isinstance(v, torch.Tensor) and v.dim() >= 1 else None
    c = prepare(SPEC, q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale,
                initial_state=initial_state, output_final_state=output_final_state, gate=gate,
                lower_bound=lower_bound, chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                state_v_first=state_v_first)
    _check_pairwise(pin, c)
    return extrun.profile(build(profile=True, variant=variant), SPEC, c, backward=backward, path=pin)


# The aim the stage was built to (issue 21): with the softplus gate, GPU time at most this fraction of FLA's
# chunk_kda (safe_gate=False) at every benchmark shape and Kimi Linear's; notebook 12 asserts it against the records.
FLA_TIME_TARGET = 0.7

# A chunk whose decay -glast (any key dimension, natural log) exceeds this goes pair by pair
# (common.cuh kFactoredRange: the bounded gate's guarantee, 16 tokens of a >= -5).
FACTORED_RANGE = 80.0


def wide_chunks(a, cu_seqlens=None):
    """How many chunks go pair by pair, and how many there are, for the log decay a
    ([B, T, H, K], natural log, a <= 0: what common.reference.log_decay gives): a
    chunk (16 tokens of one sequence and head) is wide when some key dimension's decay
    summed over it is below -FACTORED_RANGE. Computed in float64 here: a chunk within
    fp32 round-off of the range may be counted the other way by the kernel."""
    B, T, H, K = a.shape
    bounds = [(b, 0, T) for b in range(B)] if cu_seqlens is None else \
        [(0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    wide = total = 0
    for b, s, e in bounds:
        x = a[b, s:e].double()
        n = -(-(e - s) // 16)
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 16 * n - (e - s)))
        glast = x.reshape(n, 16, H, K).sum(1)  # [n, H, K]
        wide += int((glast < -FACTORED_RANGE).any(-1).sum())
        total += n * H
    return wide, total


# The split path's segment length in chunks (binding.cpp kSegmentChunks; a GPU test counts the launches).
SEGMENT_CHUNKS = 64

# The fused kernel's prepare teams of 4 warps on alternate chunks (fused.cuh kPrepTeams; a test
# compares): thread 0 of each team adds its timeline to the block's prepare regions of a profile.
PREP_TEAMS = 2

# The rule's split width at V = 128 (kda_fwd_plan): two compute warps per K2 block once one-warp
# blocks (B*H*V/16) would cover half the SMs, fewer heads one (re-measured here where the serial
# chain binds; a GPU test counts K2's grid).
SPLIT_NCW_V128 = 2

# K2's ring at K = 64 where each K2 block has an SM to itself (blocks <= SMs): this many
# slots instead of 4 (common.cuh kLoneStages64; a test compares, a GPU test reads K2's
# shared memory in the launch log).
LONE_RING64 = 8

PATHS = {"split1": (0, 1), "split2": (0, 2), "fused1": (1, 1), "fused2": (1, 2), "fused4": (1, 4),
         "fused8": (1, 8)}

# The records of this stage's own measurements (common.stages.declared_records): its time at the
# tensor-core shapes on the bounded gate, measured beside stage 11 and FlashKDA (scripts/bench_summit.py).
RECORDS = {}  # none in the ladder's form yet; the first H100 checks and times are in results/h100/stage13/


_PIN: ContextVar = ContextVar("path_pin", default=(None, None, None))  # (name, segment_chunks, long_from) of ``path``
_PAIRWISE: ContextVar = ContextVar("pairwise_pin", default=None)  # None: the gate's; True / False: pinned
_U_HALVES: ContextVar = ContextVar("u_halves_pin", default=None)  # None: the gate's; True / False: pinned
_DEEP_RING: ContextVar = ContextVar("deep_ring_pin", default=None)  # None: the rule's; True / False: pinned


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
    pw = _PAIRWISE.get()
    return dict(fused=fused, ncw=ncw, segment_chunks=segment_chunks or 0, pairwise=-1 if pw is None else int(pw),
                long_from=-1 if long_from is None else long_from,
                u_halves=-1 if _U_HALVES.get() is None else int(_U_HALVES.get()),
                deep_ring=-1 if _DEEP_RING.get() is None else int(_DEEP_RING.get()))


def _check_pairwise(pin, c):
    """The factored products pinned on the softplus gate, and the 8-slot ring at K = 128: refused here,
    before the extension."""
    if pin["deep_ring"] == 1 and c.K != 64:
        raise ValueError(f"deep_ring(True) pins the 8-slot ring, which is K = 64's; got K = {c.K}")
    if pin["pairwise"] == 0 and c.gate == "softplus":
        raise ValueError("pairwise(False) pins the factored products, which need a bounded gate: with "
                         "gate='softplus' exp(-gc) overflows; use pairwise(None) or pairwise(True)")


@contextmanager
def _pinned(var: ContextVar, name: str, on):
    """Set one variant pin (True, False or None: the rule's) for the calls inside the block."""
    if on is not None and not isinstance(on, bool):
        raise TypeError(f"{name} must be True, False or None, got {on!r}")
    token = var.set(on)
    try:
        yield
    finally:
        var.reset(token)


@contextmanager
def pairwise(on=True):
    """Pin how the calls inside the block form L and Aqk: True pair by pair in every chunk
    (any gate), False factored through exp(-gc) in every chunk (stage 11's; only a bounded
    gate: the softplus gate raises at its call), None the gate's own choice (a bounded gate
    factored; a gate without a bound pair by pair in its wide chunks, factored elsewhere)."""
    with _pinned(_PAIRWISE, "pairwise", on):
        yield


@contextmanager
def u_halves(on=True):
    """Pin how the calls inside the block form u = Af @ v: True with Af in two bf16 halves,
    Af_hi + Af_lo, so that u, from which every state update is built, carries no bf16
    rounding of Af (a gate without a bound does so by default); False with Af rounded to
    bf16 once, as stages 05-11 (a bounded gate's default: stage 11's bits); None the gate's."""
    with _pinned(_U_HALVES, "u_halves", on):
        yield


@contextmanager
def deep_ring(on=True):
    """Pin K2's ring on the split path at K = 64 for the calls inside the block: True 8 slots
    (kLoneStages64) wherever they fit a block's shared memory, False 4 (kStagesFor, stage 11's),
    None the rule's (8 where every K2 block has an SM, else 4). True with K = 128 raises at the
    call. The fused path has no ring of K2's and ignores it."""
    with _pinned(_DEEP_RING, "deep_ring", on):
        yield


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
