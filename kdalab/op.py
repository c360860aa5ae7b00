"""``chunk_kda``: fla-core 0.6.0's ``fla.ops.kda.chunk_kda`` (same signature,
argument names and defaults) running the tutorial's last stage, with a backward
(next/13_backward) when an input requires grad.

What runs here (anything else raises one clear error before any kernel; FLA's
``chunk_kda`` runs it):

- CUDA tensors; q, k, v, beta in bf16 (fp16 and fp32 converted, o returned in
  v's dtype); K = V in {64, 128}; as many value heads as query heads (no GVA);
- every gate FLA runs. ``use_gate_in_kernel=True``: g is the raw gate, A_log [H]
  and dt_bias [H * K] or [H, K] (None: 0) passed in ``**kwargs`` as FLA takes them;
  without ``lower_bound`` the softplus gate (Kimi Linear's),
  a = -exp(A_log) * softplus(g + dt_bias) (A_log required, as FLA requires it), with
  ``lower_bound`` in [-5, 0) the bounded gate,
  a = lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (A_log None: exp(A_log) = 1;
  ``safe_gate=True`` needs lower_bound, as in FLA). ``use_gate_in_kernel=False``
  (FLA's default): g is the log decay itself, taken as FLA takes it: in
  [lower_bound, 0] with ``safe_gate=True`` (lower_bound None: [-5, 0]), any value
  <= 0 with ``safe_gate=False``. A gate without a bound runs the pairwise products
  of stage 12 (no exponent overflows); a bounded one the factored products;
- ``use_qk_l2norm_in_kernel``, ``use_beta_sigmoid_in_kernel`` and
  ``allow_neg_eigval`` (2 * sigmoid(beta)) with both values;
- ``initial_state`` fp32 [N, H, K, V] ([N, H, V, K] with ``state_v_first``,
  read and written in place of a transpose), ``output_final_state``;
- ``cu_seqlens`` (int32 or int64, B = 1) in one launch. Its contents are checked
  on the host (0 first, non-decreasing, T last) and give the lengths, which size
  the launch (the longest) and let the kernel run a sequence much longer than
  the others on its own path beside them (the stages' hybrid): from
  ``cu_seqlens_cpu`` when given, else from one ``.cpu()`` copy (a device sync).
  While torch.compile traces, and while a CUDA graph is captured without
  ``cu_seqlens_cpu``, they are not read: unchecked, T bounds the longest sequence
  (a larger launch whose extra blocks exit), and there is no hybrid;
- ``disable_recompute`` is accepted and does nothing: it only changes what FLA
  keeps for its backward, and this op's backward keeps only the inputs (its
  kernels recompute the rest). ``max_num_seqs`` is ignored without ``use_graph``,
  as FLA ignores it.

Training (an input that requires grad, with grad enabled) runs the backward of
next/13_backward, a stage on its way into the ladder (``BACKWARD``), for Kimi
Linear's layer as FLA's KimiDeltaAttention calls it: bf16 q, k, v, g, beta and
the gate, the l2norm of q and k and sigmoid(beta) in the kernel (anything else
raises NotImplementedError naming FLA's flag). Every input gets its gradient:
q, k, v, g, beta in their dtype, A_log, dt_bias and initial_state in theirs,
the final state's gradient taken when it is returned. The backward is the
custom op ``torch.ops.kdalab.chunk_kda_bwd``, registered as chunk_kda_fwd's
autograd, so a training step compiles with ``fullgraph=True`` too.

The kernel call is the custom op ``torch.ops.kdalab.chunk_kda_fwd`` (tensors and
plain scalars, a fake implementation for torch.compile, no host sync inside), so
a model that calls ``chunk_kda`` compiles with ``fullgraph=True`` and can be
captured in a CUDA graph. ``chunk_kda`` checks and converts outside the op.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from common import contract
from common.stages import last_stage

# The stage whose kernels run, for every gate: the last of the ladder. A bounded gate (the bounded gate, or the
# log decay with safe_gate) runs its instantiation of stage 11's arithmetic (stage 11's bits), a gate without a
# bound (the softplus gate, the log decay without safe_gate) the products as needed.
STAGE = last_stage()  # the ladder's last stage (common.stages.last_stage): stages/12_softplus today
_DEVICE_TYPES = ("cuda",)  # where the kernel runs (the CPU tests widen it to reach a fake extension)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_FLA = "fla.ops.kda.chunk_kda"

# The stage whose backward kernels run when an input requires grad: next/13_backward, on its way into the
# ladder (its forward is stage 12's source, so the forward's bits do not depend on which of the two runs it).
BACKWARD = "13_backward"

_exts: dict = {}


def _extension(stage: str = STAGE):
    """The compiled extension of a stage (built once, on first use)."""
    if stage not in _exts:
        from common.stages import load_stage

        _exts[stage] = load_stage(stage).build()
    return _exts[stage]


def _backward_extension():
    """The compiled extension of BACKWARD (built once, on first use)."""
    if BACKWARD not in _exts:
        from common.stages import load_next

        _exts[BACKWARD] = load_next(BACKWARD).build()
    return _exts[BACKWARD]


# --------------------------------------------------------------------------
# The checks: one function, used by chunk_kda (raises) and supported (answers)
# --------------------------------------------------------------------------

def _host_reads(cu_seqlens_cpu, sync) -> bool:
    """Whether the contents of cu_seqlens are read on the host. Not while
    torch.compile traces (no graph break) nor, without cu_seqlens_cpu, while a
    CUDA graph is captured (no sync) or for supported(): then they go unchecked
    and the kernel takes T as the bound of the longest sequence (max_seqlen 0)."""
    if torch.compiler.is_compiling():
        return False
    if cu_seqlens_cpu is not None:
        return True
    return sync and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def _refuse(flag, got, supported, instead=f"use {_FLA}", exc=NotImplementedError):
    return exc(f"kdalab.chunk_kda: {flag}={got} is not supported ({supported}); {instead}")


@contextlib.contextmanager
def _rule():
    """A rule of the stage contract (common.contract) broken by the call: its error, named as the op's."""
    try:
        yield
    except (TypeError, ValueError) as e:
        raise type(e)(f"kdalab.chunk_kda: {e}") from None


def _spec():
    """The last stage's spec (what its kernels take), on the device types the op runs on."""
    from common.stages import load_stage

    return dataclasses.replace(load_stage(STAGE).SPEC, devices=_DEVICE_TYPES)


def _gate(use_gate_in_kernel, safe_gate, lower_bound) -> tuple[str, float]:
    """FLA's gate flags as the contract's gate (a name of contract.GATE_ID) and the kernel's bound:
    the raw gate activated in the kernel, the softplus gate or with lower_bound the bounded one; or g the
    log decay itself, bounded by lower_bound with safe_gate (-5 without one, FLA's default), else not at
    all (0: the kernel forms the products pair by pair where a chunk needs it)."""
    if use_gate_in_kernel:
        if lower_bound is None:
            return "softplus", 0.0
        with _rule():
            return "bounded", contract.check_gate("bounded", lower_bound)[2]
    if not safe_gate:
        return "log_decay", 0.0
    with _rule():
        return "log_decay", contract.check_gate("bounded", lower_bound)[2]  # None: the contract's -5, FLA's default


def _plan(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
          use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
          allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
          return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
          cp_context=None, use_graph=False, max_num_seqs=None, *, sync=True, **kwargs) -> dict:
    """Check a chunk_kda call and return the op's scalar arguments, or raise the
    call's first problem (TypeError / ValueError / NotImplementedError). The rules
    every stage's call obeys are the stage contract's (common.contract, with the
    last stage's spec); what is here is FLA's: its flags, the words of its own
    checks, and what the kernel does not run (NotImplementedError, naming FLA).
    Nothing here touches the extension. ``sync=False`` leaves the contents of
    cu_seqlens unchecked unless cu_seqlens_cpu is given (no device copy)."""
    # ---- keyword arguments FLA takes in **kwargs ----
    if "transpose_state_layout" in kwargs:  # FLA's deprecated name of state_v_first
        if state_v_first:
            raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    chunk_size = kwargs.pop("chunk_size", None)
    if kwargs:
        raise TypeError(f"kdalab.chunk_kda got unexpected keyword argument(s) {sorted(kwargs)}: it takes "
                        f"{_FLA}'s arguments, and A_log, dt_bias, chunk_size, transpose_state_layout in **kwargs")
    spec = _spec()

    # ---- tensors and device ----
    with _rule():
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            contract.check_is_tensor(name, t)
    if q.device.type not in spec.devices:
        raise _refuse("q.device", q.device, "CUDA tensors only", exc=ValueError)
    if not use_gate_in_kernel:
        A_log, dt_bias = None, None  # FLA ignores them too: g is the log decay
    optional = [(n, t) for n, t in (("A_log", A_log), ("dt_bias", dt_bias), ("initial_state", initial_state),
                                    ("cu_seqlens", cu_seqlens)) if t is not None]
    with _rule():
        for name, t in optional:
            contract.check_is_tensor(name, t)
        contract.check_one_device(q, [("k", k), ("v", v), ("g", g), ("beta", beta)] + optional)
    training = torch.is_grad_enabled() and any(
        t.requires_grad for _, t in [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)] + optional)

    # ---- flags FLA has and the kernel does not run ----
    if cp_context is not None:
        raise _refuse("cp_context", type(cp_context).__name__, "context parallelism is not run here")
    if return_intermediate_states:
        raise _refuse("return_intermediate_states", True, "the kernel keeps no per-chunk state")
    if use_graph:
        raise _refuse("use_graph", True, "FLA's padded fixed-shape chunk lists are not built here",
                      f"capture kdalab.chunk_kda in a CUDA graph as it is, or use {_FLA}")
    if chunk_size is not None and chunk_size not in spec.chunk_sizes:
        raise _refuse("chunk_size", chunk_size, f"the kernel's chunk is {spec.default_chunk} tokens (FLA's 64 is "
                      "its Triton tiling; the result does not depend on it)", "leave chunk_size out", exc=ValueError)
    if lower_bound is None and use_gate_in_kernel and safe_gate:
        raise _refuse("lower_bound", None, "safe_gate=True with use_gate_in_kernel=True needs lower_bound "
                      "in [-5, 0), as FLA does", "pass lower_bound (FLA recommends -5)", exc=ValueError)
    if use_gate_in_kernel and lower_bound is None and A_log is None:  # FLA's check and words
        raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
    gate, lb = _gate(use_gate_in_kernel, safe_gate, lower_bound)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")  # FLA's words
    if training:
        _check_training(q, k, v, g, beta, use_gate_in_kernel, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                        allow_neg_eigval)

    # ---- dtypes and shapes: the contract's, after what the kernel does not run ----
    with _rule():
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            contract.check_float(name, t)
        if q.dim() != 4 or v.dim() != 4:
            contract.check_sizes(q, k, v, g, beta)  # its error: q or v is no 4-D tensor
    B, T, H, K = q.shape
    if v.shape[2] != H and tuple(v.shape[:2]) == (B, T):
        raise _refuse("v.shape[2] (HV)", v.shape[2], f"as many value heads as query heads, H = {H}; GVA is not run "
                      "here")
    why = contract.head_dims_error(spec, K, v.shape[3])
    if why is not None:
        raise _refuse("head dims (K, V)", (K, v.shape[3]), f"K = V in {{{', '.join(map(str, spec.head_dims))}}}")
    with _rule():
        B, T, H, K, V = contract.check_sizes(q, k, v, g, beta)
        if use_gate_in_kernel:  # FLA's forms: A_log [H], dt_bias [H * K] or [H, K]
            if A_log is not None and A_log.numel() != H:
                raise ValueError(f"A_log must be [H] = [{H}], got {list(A_log.shape)}")
            if dt_bias is not None and dt_bias.numel() != H * K:
                raise ValueError(f"dt_bias must be [H * K] or [H, K] = [{H * K}] or [{H}, {K}], "
                                 f"got {list(dt_bias.shape)}")
        scale = contract.check_scale(scale, K)

    # ---- packed sequences and states ----
    N, max_seqlen, seq_lens = B, 0, []  # the longest packed sequence (0: T, the kernel's bound when it is not
    # known) and the lengths (empty: not known)
    if cu_seqlens_cpu is not None and cu_seqlens is None:
        raise ValueError("kdalab.chunk_kda: cu_seqlens_cpu is given without cu_seqlens")
    if cu_seqlens is not None:
        if B != 1:  # FLA's check and words
            raise ValueError(f"The batch size is expected to be 1 rather than {B} when using `cu_seqlens`."
                             f"Please flatten variable-length inputs before processing.")
        with _rule():
            N = contract.check_cu_seqlens_tensor(cu_seqlens, B, q.device)
        if cu_seqlens_cpu is not None and (not isinstance(cu_seqlens_cpu, torch.Tensor)
                                           or cu_seqlens_cpu.device.type != "cpu"
                                           or tuple(cu_seqlens_cpu.shape) != tuple(cu_seqlens.shape)):
            raise ValueError(f"kdalab.chunk_kda: cu_seqlens_cpu must be the CPU copy of cu_seqlens "
                             f"(shape {list(cu_seqlens.shape)})")
        if _host_reads(cu_seqlens_cpu, sync):
            with _rule():
                _, max_seqlen, seq_lens = contract.check_cu_seqlens_values(
                    cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu(), T)
    if initial_state is not None:
        if initial_state.dtype != torch.float32:
            raise TypeError(f"kdalab.chunk_kda: initial_state must be float32 (as FLA requires), "
                            f"got {initial_state.dtype}")
        if cu_seqlens is not None and initial_state.dim() > 0 and initial_state.shape[0] != N:  # FLA's words
            raise ValueError(f"The number of initial states is expected to be equal to the number of input "
                             f"sequences, i.e., {N} rather than {initial_state.shape[0]}.")
        with _rule():
            contract.check_state_shape(initial_state, N, H, K, V, state_v_first=state_v_first,
                                       packed=cu_seqlens is not None)

    return dict(scale=scale, gate_id=contract.GATE_ID[gate], lower_bound=lb,
                l2norm=bool(use_qk_l2norm_in_kernel),
                beta_mode=(2 if allow_neg_eigval else 1) if use_beta_sigmoid_in_kernel else 0,
                state_v_first=bool(state_v_first), output_final_state=bool(output_final_state),
                max_seqlen=int(max_seqlen), seq_lens=[int(n) for n in seq_lens], A_log=A_log, dt_bias=dt_bias)


def _check_training(q, k, v, g, beta, use_gate_in_kernel, use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel,
                    allow_neg_eigval):
    """What the backward (BACKWARD's bwd) runs, asked of a call with an input that requires grad: Kimi Linear's
    layer as FLA's KimiDeltaAttention calls it, in bf16 (the NotImplementedError names FLA's flag)."""
    train = "in training (an input requires grad)"
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype != torch.bfloat16:
            raise _refuse(f"{name}.dtype", t.dtype, f"{train} q, k, v, g and beta are bf16, as the backward's kernels "
                          "read them (other dtypes are converted for inference only)",
                          f"cast them to torch.bfloat16, or train with {_FLA}")
    for flag, value, want in (("use_gate_in_kernel", use_gate_in_kernel, True),
                              ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel, True),
                              ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel, True),
                              ("allow_neg_eigval", allow_neg_eigval, False)):
        if bool(value) != want:
            raise _refuse(flag, bool(value), f"{train} the backward runs {flag}={want} only: the gate, the "
                          "l2norm of q and k and sigmoid(beta) in the kernel, as FLA's KimiDeltaAttention calls it",
                          f"train with {_FLA}")


def supported(*args, **kwargs) -> tuple[bool, str | None]:
    """(True, None) if ``chunk_kda(*args, **kwargs)`` runs the kernel, else
    (False, the error it would raise). Never syncs the device: without
    cu_seqlens_cpu the contents of cu_seqlens are checked by the call itself."""
    try:
        _plan(*args, sync=False, **kwargs)
    except (TypeError, ValueError, NotImplementedError) as e:
        return False, str(e)
    return True, None


# --------------------------------------------------------------------------
# The custom op: tensors and plain scalars, checked already
# --------------------------------------------------------------------------

def _outputs(q, v, cu_seqlens, state_v_first):
    """Empty o [B, T, H, V] bf16 and final state [N, H, K, V] ([N, H, V, K]) fp32."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    ht = q.new_empty((N, H, V, K) if state_v_first else (N, H, K, V), dtype=torch.float32)
    return q.new_empty(B, T, H, V, dtype=torch.bfloat16), ht


@torch.library.custom_op("kdalab::chunk_kda_fwd", mutates_args=())
def chunk_kda_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, initial_state: torch.Tensor | None,
                  cu_seqlens: torch.Tensor | None, scale: float, gate_id: int, lower_bound: float, l2norm: bool,
                  beta_mode: int, state_v_first: bool, output_final_state: bool,
                  max_seqlen: int, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel: q, k, v, beta bf16 [B, T, H, *]; g bf16 raw (gate_id 0 softplus,
    1 bounded) or fp32 log decay (gate_id 3; lower_bound 0: no bound);
    A_log fp32 [H] and dt_bias fp32 [H, K] or None (0);
    initial_state fp32 or None; cu_seqlens int32 [N + 1] or None; max_seqlen the
    longest of its sequences or a bound of it in [1, T] (a host int; 0: T); seq_lens the
    lengths of its sequences as the host knows them, or [] (not known).
    Returns o bf16 [B, T, H, V] and the final state
    (an empty [0] tensor unless output_final_state)."""
    o, ht = _outputs(q, v, cu_seqlens, state_v_first)  # the kernel writes every element of both
    H, K = q.shape[2], q.shape[3]
    if A_log is None:
        A_log = q.new_zeros(H, dtype=torch.float32)
    if dt_bias is None:
        dt_bias = q.new_zeros(H, K, dtype=torch.float32)
    _extension().fwd(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, h0=initial_state, scale=scale,
                     gate_id=gate_id, lower_bound=lower_bound, chunk_size=_spec().default_chunk, o=o, ht=ht, prof=None,
                     cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, state_v_first=state_v_first, l2norm=l2norm,
                     beta_mode=beta_mode, seq_lens=seq_lens)  # the path, products and u: the stage's rule
    return o, ht if output_final_state else ht.new_empty(0)


@chunk_kda_fwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, gate_id, lower_bound, l2norm,
      beta_mode, state_v_first, output_final_state, max_seqlen, seq_lens):
    o, ht = _outputs(q, v, cu_seqlens, state_v_first)
    return o, ht if output_final_state else ht.new_empty(0)


@torch.library.custom_op("kdalab::chunk_kda_bwd", mutates_args=())
def chunk_kda_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  A_log: torch.Tensor, dt_bias: torch.Tensor, initial_state: torch.Tensor | None,
                  cu_seqlens: torch.Tensor | None, do: torch.Tensor, dht: torch.Tensor | None, scale: float,
                  gate_id: int, lower_bound: float, state_v_first: bool,
                  max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's kernels (BACKWARD): from the forward's inputs (nothing of the forward is kept: the
    kernels recompute it) and the gradients of o (do, bf16 or fp32) and of the final state (dht or None), the
    gradients of q, k, v, g [B, T, H, K] and beta [B, T, H] in their inputs' dtype (bf16: the kernels write
    them so), of A_log [H], dt_bias [H, K] and initial_state (an empty [0] tensor without one) in fp32."""
    f32 = torch.float32
    dq, dk, dv, dg, dbeta = (torch.empty_like(t) for t in (q, k, v, g, beta))
    dA_log, ddt_bias = torch.empty_like(A_log), torch.empty_like(dt_bias)
    dh0 = None if initial_state is None else torch.empty_like(initial_state)
    # common/extrun.py's order (the binding names do "do"), the packed sequences' arguments by name
    _backward_extension().bwd(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, gate_id, lower_bound,
                              _spec().default_chunk, do, dht, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0, None,
                              cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, seq_lens=[], state_v_first=state_v_first)
    return dq, dk, dv, dg, dbeta, dA_log, ddt_bias, q.new_empty(0, dtype=f32) if dh0 is None else dh0


@chunk_kda_bwd.register_fake
def _(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, do, dht, scale, gate_id, lower_bound,
      state_v_first, max_seqlen):
    f32 = torch.float32
    grads = [torch.empty_like(t) for t in (q, k, v, g, beta)] + [torch.empty_like(t) for t in (A_log, dt_bias)]
    dh0 = q.new_empty(0, dtype=f32) if initial_state is None else torch.empty_like(initial_state)
    return (*grads, dh0)


_TRAINABLE = dict(gate_ids=(contract.GATE_ID["softplus"], contract.GATE_ID["bounded"]), l2norm=True, beta_mode=1)


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, gate_id, lower_bound, l2norm, beta_mode,
     state_v_first, output_final_state, max_seqlen, seq_lens) = inputs
    ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens)
    ctx.scalars = (scale, gate_id, lower_bound, state_v_first, max_seqlen)
    ctx.trainable = (gate_id in _TRAINABLE["gate_ids"] and l2norm == _TRAINABLE["l2norm"]
                     and beta_mode == _TRAINABLE["beta_mode"])
    ctx.output_final_state = output_final_state


def _backward(ctx, do, dht):
    """chunk_kda_fwd's gradients through chunk_kda_bwd. chunk_kda refuses what it cannot train before any
    kernel (_check_training); a direct call of the op with such flags is refused here."""
    if not ctx.trainable:
        raise NotImplementedError("kdalab::chunk_kda_fwd: the backward runs the softplus or bounded gate with "
                                  "l2norm and sigmoid(beta) in the kernel only (gate_id 0 or 1, l2norm True, "
                                  "beta_mode 1)")
    q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens = ctx.saved_tensors
    scale, gate_id, lower_bound, state_v_first, max_seqlen = ctx.scalars
    H, K = q.shape[2], q.shape[3]
    A = A_log if A_log is not None else q.new_zeros(H, dtype=torch.float32)
    dtb = dt_bias if dt_bias is not None else q.new_zeros(H, K, dtype=torch.float32)
    if do is None:
        do = q.new_zeros(v.shape, dtype=torch.float32)
    dht = dht if ctx.output_final_state and dht is not None else None
    dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0 = torch.ops.kdalab.chunk_kda_bwd(
        q, k, v, g, beta, A, dtb, initial_state, cu_seqlens,
        (do if do.dtype == torch.bfloat16 else do.to(torch.float32)).contiguous(),  # o's dtype, as it came
        None if dht is None else dht.contiguous(), scale, gate_id, lower_bound, state_v_first, max_seqlen)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
            None if A_log is None else dA_log, None if dt_bias is None else ddt_bias,
            None if initial_state is None else dh0, None, None, None, None, None, None, None, None, None, None)


torch.library.register_autograd("kdalab::chunk_kda_fwd", _backward, setup_context=_setup_context)


# --------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------

def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    r"""KDA (Kimi Delta Attention), chunked forward on bf16 tensor cores: a drop-in for fla-core 0.6.0's
    ``fla.ops.kda.chunk_kda`` (same arguments, names and defaults) running the tutorial's last stage.

    Needs a CUDA GPU (sm_80 or newer; tuned on the H200). Forward only on the ladder's kernels; with an input
    that requires grad (grad enabled) it trains through the backward of next/13_backward, for Kimi Linear's
    flags in bf16 (``use_gate_in_kernel``, ``use_qk_l2norm_in_kernel`` and ``use_beta_sigmoid_in_kernel``
    True, ``allow_neg_eigval`` False). Anything it does not run raises one error naming the argument, before
    any kernel; ``kdalab.supported(...)`` answers without running.

    Args:
        q (torch.Tensor):
            queries of shape ``[B, T, H, K]``, on a CUDA device; bf16 (fp16 and fp32 are converted).
        k (torch.Tensor):
            keys of shape ``[B, T, H, K]``.
        v (torch.Tensor):
            values of shape ``[B, T, H, V]``; ``K = V``, 64 or 128. No GVA: as many value heads as query heads.
        g (torch.Tensor):
            the gate, ``[B, T, H, K]``. With ``use_gate_in_kernel=False`` (the default) the log decay
            itself (``<= 0``); with ``use_gate_in_kernel=True`` the raw gate input, activated in the kernel
            as ``-exp(A_log) * softplus(g + dt_bias)`` (Kimi Linear's gate), or with ``lower_bound`` as
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``.
        beta (torch.Tensor):
            betas of shape ``[B, T, H]`` (post-sigmoid, or logits with ``use_beta_sigmoid_in_kernel``).
        scale (float, Optional):
            scale of the attention scores. Default: ``None``, i.e. ``1 / sqrt(K)`` (``0.0`` is a scale of 0).
        initial_state (torch.Tensor, Optional):
            fp32 initial state ``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first``) for ``N``
            sequences (``N = B``, or ``len(cu_seqlens) - 1``). Default: ``None`` (zeros).
        output_final_state (bool, Optional):
            return the fp32 final state, shaped as ``initial_state``. Default: ``False``.
        use_qk_l2norm_in_kernel (bool, Optional):
            L2-normalise q and k per token and head in the kernel. Default: ``False``.
        use_gate_in_kernel (bool, Optional):
            activate ``g`` in the kernel (see ``g``); ``A_log`` ``[H]`` and ``dt_bias`` ``[H * K]`` or
            ``[H, K]`` (``None``: 0) are passed as keyword arguments, as to FLA. Default: ``False``.
        use_beta_sigmoid_in_kernel (bool, Optional):
            apply ``sigmoid(beta)`` in the kernel. Default: ``False``.
        allow_neg_eigval (bool, Optional):
            ``2 * sigmoid(beta)`` instead of ``sigmoid(beta)``; needs ``use_beta_sigmoid_in_kernel``.
            Default: ``False``.
        safe_gate (bool, Optional):
            the gate is bounded below by ``lower_bound`` (with ``use_gate_in_kernel``, ``lower_bound`` is
            required). A bounded gate runs the factored chunk products, a gate without a bound forms them
            pair by pair where a chunk's decay would overflow. Default: ``False``.
        lower_bound (float, Optional):
            the bound, in ``[-5, 0)``. Default: ``None``.
        disable_recompute (bool, Optional):
            accepted, no effect (it changes what FLA keeps for its backward; this one keeps the inputs).
            Default: ``False``.
        return_intermediate_states (bool, Optional):
            not supported (the kernel keeps no per-chunk state): ``True`` raises. Default: ``False``.
        state_v_first (bool, Optional):
            states as ``[N, H, V, K]``, read and written in place. Default: ``False``.
        cu_seqlens (torch.LongTensor, Optional):
            ``[N + 1]`` offsets of ``N`` sequences packed into one batch row (``B = 1``), int32 or int64, as
            in FlashAttention; one launch for all of them. Default: ``None``.
        cu_seqlens_cpu (torch.LongTensor, Optional):
            the CPU copy of ``cu_seqlens``: its lengths are then read without a device sync (and while a
            CUDA graph is captured). Default: ``None``.
        cp_context, use_graph:
            not supported (context parallelism, FLA's padded chunk lists): anything but ``None`` / ``False``
            raises. A CUDA graph captures ``chunk_kda`` as it is.
        max_num_seqs (int, Optional):
            ignored, as FLA ignores it without ``use_graph``.

    Returns:
        o (torch.Tensor): ``[B, T, H, V]`` in ``v``'s dtype.
        final_state (torch.Tensor or None): fp32, shaped as ``initial_state``, if ``output_final_state``.

    Examples::

        >>> import torch, kdalab
        >>> B, T, H, K = 1, 4096, 32, 128
        >>> q, k, v = (torch.randn(B, T, H, K, dtype=torch.bfloat16, device="cuda") for _ in range(3))
        >>> g = torch.randn(B, T, H, K, dtype=torch.bfloat16, device="cuda")
        >>> beta = torch.randn(B, T, H, dtype=torch.bfloat16, device="cuda")
        >>> A_log = torch.zeros(H, device="cuda"); dt_bias = torch.zeros(H * K, device="cuda")
        >>> with torch.inference_mode():
        ...     o, ht = kdalab.chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias,
        ...                              use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
        ...                              use_beta_sigmoid_in_kernel=True, output_final_state=True)
    """
    p = _plan(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
              use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
              disable_recompute, return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu,
              cp_context, use_graph, max_num_seqs, **kwargs)
    H, K = q.shape[2], q.shape[3]

    def bf16(t):
        return t.to(torch.bfloat16).contiguous()  # no copy when it is bf16 and contiguous already

    A_log, dt_bias = p["A_log"], p["dt_bias"]
    o, ht = torch.ops.kdalab.chunk_kda_fwd(
        bf16(q), bf16(k), bf16(v),
        bf16(g) if p["gate_id"] != contract.GATE_ID["log_decay"] else g.to(torch.float32).contiguous(),
        bf16(beta),
        None if A_log is None else A_log.to(torch.float32).reshape(H).contiguous(),
        None if dt_bias is None else dt_bias.to(torch.float32).reshape(H, K).contiguous(),
        None if initial_state is None else initial_state.contiguous(),
        None if cu_seqlens is None else cu_seqlens.to(torch.int32),
        p["scale"], p["gate_id"], p["lower_bound"], p["l2norm"], p["beta_mode"], p["state_v_first"],
        p["output_final_state"], p["max_seqlen"], p["seq_lens"])
    return o.to(v.dtype), (ht if p["output_final_state"] else None)
