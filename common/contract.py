"""The stage contract (DESIGN.md section 5): one call for every stage.

    o, final_state = stage.forward(q, k, v, g, beta, A_log=..., dt_bias=...,
        scale=None, initial_state=None, output_final_state=True,
        gate="softplus" | "bounded", lower_bound=None, chunk_size=None)

A stage whose spec says ``varlen`` also takes ``cu_seqlens`` (packed sequences,
FLA's convention) and ``state_v_first`` (the state as [N, H, V, K]).

Each stage declares what it supports in a :class:`StageSpec`; :func:`prepare`
checks a call against it and raises a ``TypeError`` / ``ValueError`` naming the
argument before any kernel runs, then returns the converted, contiguous
tensors in a :class:`Call`. Validation runs in a fixed order, one message per
fact.

Outputs are allocated through :func:`alloc`, which fills them with NaN while
:func:`poisoned` is active, so a check sees every element a kernel forgot to
write.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

import torch

from .metrics import TOLERANCE

GATES = ("softplus", "bounded")
OUTPUTS = ("o", "S")  # what a forward returns, as the checks name it
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "dinitial_state")  # and a backward
# The kernels' gate ids (stages/11_varlen/kda.h KdaGate), the one gate table: the stage contract's two gates, and
# the log decay itself (g is a, FLA's use_gate_in_kernel=False), which only the op passes to the last stage.
GATE_ID = {"softplus": 0, "bounded": 1, "log_decay": 3}
DEFAULT_LOWER_BOUND = -5.0
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class StageSpec:
    """What a stage supports. Anything outside it is refused in Python."""

    name: str  # directory name, e.g. "01_cpp"
    title: str  # one line: what the stage adds
    devices: tuple = ("cpu",)  # torch device types the kernels run on
    gates: tuple = GATES
    chunk_sizes: tuple | None = (16, 32, 64)  # None: any power of two >= 16
    default_chunk: int = 64
    head_dims: tuple | None = None  # allowed K (= V); None: 1..max_head_dim
    max_head_dim: int = 256
    equal_kv: bool = False  # K must equal V
    compute_dtype: torch.dtype = torch.float32  # q, k, v, g, beta converted to this
    backward: bool = True
    varlen: bool = False  # takes cu_seqlens (packed sequences) and state_v_first (the state [N, H, V, K])
    regions: tuple = ()  # profile region names, in kernel order
    # the backward's region names where its kernels number their regions from 0 in a table of their own (stage 13);
    # else a backward's regions are the names in `regions` that start with "bwd:"
    backward_regions: tuple = ()
    region_unit: str = "s"  # "s" (CPU wall time) or "cycles" (clock64)
    # output name ("o", "S", "dq", ... "dinitial_state") -> the relative error a check may reach, set at the
    # level the stage's check cases reach (at most 10x their worst: tests/test_tolerances.py holds it there)
    tolerance: dict = field(default_factory=dict)
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.name[:2]

    @property
    def outputs(self) -> tuple:
        """The outputs a check compares: o and the final state, and with a backward every gradient."""
        return OUTPUTS + (GRADIENTS if self.backward else ())

    def tol(self, output: str) -> float:
        """The relative error a check of ``output`` may reach on this stage. A stage of the ladder declares
        one per output (tests/test_tolerances.py); a stand-in that declares none (a planted stage, a test's
        spec) is held to its precision's bound (common.metrics.TOLERANCE)."""
        if output in self.tolerance:
            return float(self.tolerance[output])
        if self.tolerance:
            raise KeyError(f"stage {self.name} declares no tolerance for {output!r} "
                           f"(it declares {sorted(self.tolerance)})")
        return TOLERANCE["bf16" if self.compute_dtype == torch.bfloat16 else "fp32"]

    def runnable_here(self) -> tuple[bool, str]:
        """(True, "") if this machine can run the stage, else (False, why)."""
        if "cpu" in self.devices:
            return True, ""
        if "cuda" in self.devices:
            if not torch.cuda.is_available():
                return False, "needs an NVIDIA GPU; none is visible on this machine"
            need = self.extra.get("min_sm")
            if need is not None:
                major, minor = torch.cuda.get_device_capability()
                if major * 10 + minor < need:
                    return False, f"needs sm_{need} or newer, this GPU is sm_{major}{minor}"
            return True, ""
        return False, f"runs on {self.devices}, not available here"


@dataclass(frozen=True)
class Ablation:
    """One idea of a multi-idea stage, turned off at compile time.

    The stage's sources keep the idea under ``#ifndef <define>`` and do what the
    previous stage did instead; the variant must still pass the stage's checks.
    common.ablation builds, checks and times each variant beside the stage.
    """

    name: str  # short id, e.g. "no_load_warp" (the build variant's name)
    define: str  # the preprocessor switch, e.g. "KDA_NO_LOAD_WARP"
    idea: str  # the idea it turns off, as the stage's README names it
    instead: str  # what the variant does instead
    region: str  # the profile region where the idea shows (a name in SPEC.regions)
    # the shape the idea shows at, where the stage's regime shape does not run it (None: that shape)
    shape: dict | None = None


def ablation_build_args(ablations, name) -> dict:
    """load_extension's keyword arguments for ``name`` (one of ``ablations``;
    None: the stage itself)."""
    if name is None:
        return {}
    for a in ablations:
        if a.name == name:
            return {"variant": a.name, "defines": (a.define,)}
    known = ", ".join(a.name for a in ablations) or "none"
    raise ValueError(f"ablation must be one of this stage's ablations ({known}), got {name!r}")


@dataclass
class Call:
    """A validated call: contiguous tensors in the stage's dtypes plus sizes."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    initial_state: torch.Tensor | None
    scale: float
    gate: str
    gate_id: int
    lower_bound: float
    chunk_size: int
    output_final_state: bool
    out_dtype: torch.dtype
    B: int
    T: int
    H: int
    K: int
    V: int
    # packed sequences (a varlen stage): cu_seqlens int32 [N + 1] on the device, N sequences, the
    # longest max_seqlen tokens, seq_lens their lengths as the host knows them (from the CPU copy that
    # validated them); without them N = B (sequence i is batch row i), max_seqlen = T, seq_lens None
    cu_seqlens: torch.Tensor | None = None
    N: int | None = None
    max_seqlen: int | None = None
    seq_lens: tuple | None = None
    state_v_first: bool = False  # initial_state and final_state [N, H, V, K] instead of [N, H, K, V]

    def __post_init__(self):
        if self.N is None:
            self.N = self.B
        if self.max_seqlen is None:
            self.max_seqlen = self.T

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def state_shape(self) -> tuple:
        """The shape of initial_state and final_state: [N, H, K, V], or [N, H, V, K] V-first."""
        return (self.N, self.H, self.V, self.K) if self.state_v_first else (self.N, self.H, self.K, self.V)


# --------------------------------------------------------------------------
# poisoned outputs
# --------------------------------------------------------------------------

_POISON = [os.environ.get("KDALAB_POISON", "0") == "1"]


@contextlib.contextmanager
def poisoned(enabled: bool = True):
    """While active, :func:`alloc` fills new outputs with NaN instead of leaving
    them uninitialised, so an element a kernel never writes shows up as NaN."""
    old = _POISON[0]
    _POISON[0] = enabled
    try:
        yield
    finally:
        _POISON[0] = old


def poisoning() -> bool:
    return _POISON[0]


def alloc(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Allocate an output a kernel will overwrite completely."""
    if _POISON[0]:
        return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)
    return torch.empty(tuple(shape), dtype=dtype, device=device)


# --------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------


def _is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def check_is_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def check_float(name: str, x: torch.Tensor) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")


def check_one_device(q: torch.Tensor, named) -> None:
    """Every tensor of ``named`` ((name, tensor or None) pairs) on q's device."""
    dev = q.device
    for name, x in named:
        if x is not None and x.device != dev:
            raise ValueError(f"{name} is on {x.device} but q is on {dev}; all inputs must be on one device")


def _check_tensor(name: str, x, spec: StageSpec) -> None:
    check_is_tensor(name, x)
    check_float(name, x)
    if x.device.type not in spec.devices:
        allowed = " or ".join(spec.devices)
        raise ValueError(f"{name} must be on {allowed} for stage {spec.name}, got {x.device}")


def _check_shape(name: str, x: torch.Tensor, want: tuple, labels: str) -> None:
    if tuple(x.shape) != tuple(want):
        raise ValueError(f"{name} must be {labels} = {list(want)}, got {list(x.shape)}")


def check_gate(gate, lower_bound, spec: StageSpec | None = None) -> tuple[str, int, float]:
    """Validate the gate name and lower_bound; returns (gate, gate_id, lower_bound)."""
    if not isinstance(gate, str) or gate not in GATES:
        raise ValueError(f"gate must be 'softplus' or 'bounded', got {gate!r}")
    if spec is not None and gate not in spec.gates:
        raise ValueError(f"gate={gate!r} is not supported by stage {spec.name} (supports {list(spec.gates)})")
    if gate == "softplus":
        if lower_bound is not None:
            raise ValueError("lower_bound is only used with gate='bounded'; pass lower_bound=None")
        return gate, GATE_ID[gate], 0.0
    if lower_bound is None:
        lower_bound = DEFAULT_LOWER_BOUND
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
        raise TypeError(f"lower_bound must be a float, got {type(lower_bound).__name__}")
    lb = float(lower_bound)
    if not math.isfinite(lb):
        raise ValueError(f"lower_bound must be finite, got {lb}")
    if not (-5.0 <= lb < 0.0):
        raise ValueError(f"lower_bound must be in [-5, 0), got {lb}")
    return gate, GATE_ID[gate], lb


def check_cu_seqlens_tensor(cu_seqlens, B: int, device) -> int:
    """What can be checked of packed sequences without reading them (no device sync): a 1-D int32 or
    int64 tensor [N + 1] on ``device``, and B == 1. Returns N."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor or None, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}; all inputs must be on one device")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1] with N >= 1, got shape {list(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed into one batch row: q must be [1, T, H, K], "
                         f"got B = {B}")
    return cu_seqlens.numel() - 1


def check_cu_seqlens_values(cu, T: int) -> tuple[int, int, tuple]:
    """The contents of packed sequences' offsets (a CPU tensor or a list of N + 1 ints): cu[0] == 0,
    non-decreasing, cu[-1] == T. Returns (N, the longest sequence's length, the N lengths)."""
    cu = torch.as_tensor(cu).detach().to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        i = int(torch.nonzero(lengths < 0)[0])
        raise ValueError(f"cu_seqlens must be non-decreasing, got cu[{i}] = {int(cu[i])} > cu[{i + 1}] = {int(cu[i + 1])}")
    if int(cu[-1]) != T:
        raise ValueError(f"cu_seqlens must end at T = {T} (q.shape[1]), got {int(cu[-1])}")
    return cu.numel() - 1, int(lengths.max()), tuple(lengths.tolist())


def check_cu_seqlens(cu_seqlens, B: int, T: int, device) -> tuple[torch.Tensor, int, int, tuple]:
    """Validate packed sequences (FLA's convention) on a CPU copy: a 1-D int32 or int64
    tensor [N + 1] on ``device`` with cu[0] == 0, non-decreasing, cu[-1] == T, and B == 1.
    Returns (cu_seqlens as int32 on the device, N, the longest sequence's length, the N lengths)."""
    check_cu_seqlens_tensor(cu_seqlens, B, device)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    N, longest, lengths = check_cu_seqlens_values(cu, T)
    return cu_seqlens.to(torch.int32).contiguous(), N, longest, lengths


def check_sizes(q: torch.Tensor, k, v, g, beta) -> tuple[int, int, int, int, int]:
    """q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], with B, T, H >= 1. Returns (B, T, H, K, V)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {list(q.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4:
        raise ValueError(f"v must be [B, T, H, V], got shape {list(v.shape)}")
    V = v.shape[3]
    if min(B, T, H) < 1:
        raise ValueError(f"q must have B, T, H >= 1, got shape {list(q.shape)}")
    _check_shape("k", k, (B, T, H, K), "[B, T, H, K]")
    _check_shape("v", v, (B, T, H, V), "[B, T, H, V] (B, T, H as in q)")
    _check_shape("g", g, (B, T, H, K), "[B, T, H, K]")
    _check_shape("beta", beta, (B, T, H), "[B, T, H]")
    return B, T, H, K, V


def head_dims_error(spec: StageSpec, K: int, V: int) -> str | None:
    """Why a stage cannot take head dimensions K and V (None: it can)."""
    if spec.head_dims is not None:
        if K not in spec.head_dims:
            return f"K (q.shape[3]) must be one of {list(spec.head_dims)} for stage {spec.name}, got {K}"
        if V not in spec.head_dims:
            return f"V (v.shape[3]) must be one of {list(spec.head_dims)} for stage {spec.name}, got {V}"
    else:
        if not 1 <= K <= spec.max_head_dim:
            return f"K (q.shape[3]) must be in [1, {spec.max_head_dim}] for stage {spec.name}, got {K}"
        if not 1 <= V <= spec.max_head_dim:
            return f"V (v.shape[3]) must be in [1, {spec.max_head_dim}] for stage {spec.name}, got {V}"
    if spec.equal_kv and K != V:
        return f"stage {spec.name} needs K == V, got K={K}, V={V}"
    return None


def check_head_dims(spec: StageSpec, K: int, V: int) -> None:
    why = head_dims_error(spec, K, V)
    if why is not None:
        raise ValueError(why)


def check_scale(scale, K: int) -> float:
    """The attention scale: None gives K ** -0.5; any other value is taken as it is (0.0 included)."""
    if scale is None:
        scale = K ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_state_shape(initial_state: torch.Tensor, N: int, H: int, K: int, V: int, *, state_v_first: bool,
                      packed: bool) -> None:
    """initial_state [N, H, K, V], or [N, H, V, K] with state_v_first (N: the sequences, B unless packed)."""
    n = "N" if packed else "B"
    want, labels = ((N, H, V, K), f"[{n}, H, V, K] (state_v_first)") if state_v_first else \
        ((N, H, K, V), f"[{n}, H, K, V]")
    _check_shape("initial_state", initial_state, want, labels)


def prepare(
    spec: StageSpec,
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log,
    dt_bias,
    scale=None,
    initial_state=None,
    output_final_state=True,
    gate="softplus",
    lower_bound=None,
    chunk_size=None,
    cu_seqlens=None,
    state_v_first=False,
) -> Call:
    """Check a call against ``spec`` and return it converted (see module doc).
    ``cu_seqlens`` and ``state_v_first`` only for a stage whose spec says ``varlen``."""
    gate, gate_id, lb = check_gate(gate, lower_bound, spec)
    if not isinstance(state_v_first, bool):
        raise TypeError(f"state_v_first must be a bool, got {type(state_v_first).__name__}")
    if not spec.varlen:
        if cu_seqlens is not None:
            raise ValueError(f"stage {spec.name} does not take packed sequences; pass cu_seqlens=None")
        if state_v_first:
            raise ValueError(f"stage {spec.name} takes the state as [B, H, K, V] only; pass state_v_first=False")

    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_tensor(name, x, spec)
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        _check_tensor(name, x, spec)
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, spec)
    dev = q.device
    check_one_device(q, (("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                         ("dt_bias", dt_bias), ("initial_state", initial_state)))

    B, T, H, K, V = check_sizes(q, k, v, g, beta)
    _check_shape("A_log", A_log, (H,), "[H]")
    _check_shape("dt_bias", dt_bias, (H, K), "[H, K]")
    N, max_seqlen, seq_lens = B, T, None
    if cu_seqlens is not None:
        cu_seqlens, N, max_seqlen, seq_lens = check_cu_seqlens(cu_seqlens, B, T, dev)
    if initial_state is not None:
        check_state_shape(initial_state, N, H, K, V, state_v_first=state_v_first, packed=cu_seqlens is not None)
    check_head_dims(spec, K, V)
    scale = check_scale(scale, K)

    if chunk_size is None:
        chunk_size = spec.default_chunk
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}")
    if spec.chunk_sizes is None:
        if chunk_size < 16 or not _is_pow2(chunk_size):
            raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    elif chunk_size not in spec.chunk_sizes:
        raise ValueError(f"chunk_size must be one of {list(spec.chunk_sizes)} for stage {spec.name}, got {chunk_size}")

    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state must be a bool, got {type(output_final_state).__name__}")

    if not spec.backward and torch.is_grad_enabled():
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                        ("dt_bias", dt_bias), ("initial_state", initial_state)):
            if x is not None and x.requires_grad:
                raise ValueError(
                    f"{name} requires grad but stage {spec.name} has no backward; "
                    "call it under torch.no_grad() or detach the inputs")

    cd = spec.compute_dtype

    def conv(x, dtype):
        return x.to(dtype).contiguous()

    return Call(
        q=conv(q, cd), k=conv(k, cd), v=conv(v, cd), g=conv(g, cd), beta=conv(beta, cd),
        A_log=conv(A_log, torch.float32), dt_bias=conv(dt_bias, torch.float32),
        initial_state=None if initial_state is None else conv(initial_state, torch.float32),
        scale=scale, gate=gate, gate_id=gate_id, lower_bound=lb, chunk_size=chunk_size,
        output_final_state=output_final_state, out_dtype=v.dtype,
        B=B, T=T, H=H, K=K, V=V, cu_seqlens=cu_seqlens, N=N, max_seqlen=max_seqlen, seq_lens=seq_lens,
        state_v_first=state_v_first,
    )
