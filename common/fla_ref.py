"""Optional comparison kernels: FLA's Triton chunk_kda (pip package fla-core)
and FlashKDA (MoonshotAI, not on PyPI), imported only when present and only on
a GPU. Both get the same raw inputs as the stages (gate, l2norm and beta
sigmoid fused in the kernel).

FlashKDA is built from a checkout by scripts/build_flashkda.py into
build/flashkda (flash_kda_C); the checkout's small ``flash_kda`` package wraps
it. :func:`flashkda_available` finds that build; its code is never copied
here."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from .paths import BUILD_DIR, REPO_ROOT


def fla_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "FLA's chunk_kda is Triton: it needs a GPU"
    if importlib.util.find_spec("fla") is None:
        return False, "fla-core is not installed (pip install -e '.[fla]')"
    return True, ""


# The head counts FLA is timed at (scripts/bench_softplus.py) for K = 128 and K = 64: its
# autotuned kernels are reused where a comparison runs its heads in groups of that many.
FLA_TUNED_HEADS = {128: 32, 64: 4}


def by_heads(fwd, group: int):
    """``fwd`` run on groups of ``group`` heads (the last one padded with zero heads),
    the outputs put back together. Heads are independent, so this is ``fwd`` on all of
    them; FLA autotunes its kernels once per head count (about 100 s each on the H200),
    so accuracy comparisons run at the head counts the timed rows use
    (FLA_TUNED_HEADS: 32 at K = 128, 4 at K = 64) instead of one new count per case."""
    def run(q, k, v, g, beta, *, A_log, dt_bias, initial_state=None, **kw):
        H = q.shape[2]
        os_, Ss = [], []
        for h0 in range(0, H, group):
            hs = slice(h0, min(H, h0 + group))
            n = hs.stop - hs.start

            def pad(x, dim):
                x = x.narrow(dim, h0, n)
                if n == group:
                    return x.contiguous()
                shape = list(x.shape)
                shape[dim] = group - n
                return torch.cat([x, x.new_zeros(shape)], dim=dim).contiguous()

            o, S = fwd(pad(q, 2), pad(k, 2), pad(v, 2), pad(g, 2), pad(beta, 2), A_log=pad(A_log, 0),
                       dt_bias=pad(dt_bias, 0), initial_state=None if initial_state is None else pad(initial_state, 1),
                       **kw)
            os_.append(o[:, :, :n])
            Ss.append(S[:, :n])
        return torch.cat(os_, dim=2), torch.cat(Ss, dim=1)
    return run


def fla_forward(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None, output_final_state=True,
                gate="softplus", lower_bound=None, chunk_size=None):
    """FLA chunk_kda with the stage contract's arguments (chunk_size is FLA's own: 64)."""
    from fla.ops.kda import chunk_kda

    bounded = gate == "bounded"
    return chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        safe_gate=bounded, lower_bound=(-5.0 if lower_bound is None else lower_bound) if bounded else None,
        A_log=A_log, dt_bias=dt_bias.reshape(-1),
    )


# --------------------------------------------------------------------------
# FlashKDA
# --------------------------------------------------------------------------

FLASHKDA_NAME = "FlashKDA"  # the stage name of its benchmark and check rows
FLASHKDA_HEAD_DIM = 128  # FlashKDA takes K = V = 128 only
FLASHKDA_BUILD_DIR = BUILD_DIR / "flashkda"  # where scripts/build_flashkda.py puts flash_kda_C
FLASHKDA_SRC_ENV = "KDALAB_FLASHKDA_SRC"  # a FlashKDA checkout (its flash_kda/ package); default .flashkda


def flashkda_src(path=None) -> Path:
    """The FlashKDA checkout whose ``flash_kda/`` package wraps the build:
    ``path``, else $KDALAB_FLASHKDA_SRC, else .flashkda; relative to the
    repository root."""
    p = Path(path or os.environ.get(FLASHKDA_SRC_ENV) or ".flashkda")
    return p if p.is_absolute() else REPO_ROOT / p


def flashkda_built(build_dir=None) -> Path | None:
    """The flash_kda_C module built by scripts/build_flashkda.py, or None."""
    hits = sorted(Path(build_dir or FLASHKDA_BUILD_DIR).glob("flash_kda_C*.so"))
    return hits[0] if hits else None


def use_flashkda_build(path=None, build_dir=None) -> list[str]:
    """Make a FlashKDA built by scripts/build_flashkda.py importable: put its
    build folder (flash_kda_C, default build/flashkda) and the checkout that
    holds the ``flash_kda`` package (``path``, default $KDALAB_FLASHKDA_SRC or
    .flashkda) at the front of sys.path. Returns the folders added (for a
    subprocess's PYTHONPATH)."""
    dirs = [str(Path(build_dir or FLASHKDA_BUILD_DIR)), str(flashkda_src(path))]
    for d in reversed(dirs):
        if d not in sys.path:
            sys.path.insert(0, d)
    importlib.invalidate_caches()
    return dirs


def flashkda_available() -> tuple[bool, str]:
    """(True, "") if FlashKDA can run here. When ``flash_kda`` is not
    importable but scripts/build_flashkda.py left a build in build/flashkda,
    that build is put on the path (:func:`use_flashkda_build`)."""
    if not torch.cuda.is_available():
        return False, "FlashKDA needs a GPU"
    if importlib.util.find_spec("flash_kda") is None or importlib.util.find_spec("flash_kda_C") is None:
        if flashkda_built() is None:
            return False, ("FlashKDA is not installed (it is not on PyPI): build it with "
                           "scripts/build_flashkda.py --src <a checkout of MoonshotAI/FlashKDA>")
        if not (flashkda_src() / "flash_kda" / "__init__.py").exists():
            return False, (f"FlashKDA is built in {FLASHKDA_BUILD_DIR} but its flash_kda package is not in "
                           f"{flashkda_src()} (set {FLASHKDA_SRC_ENV} to the checkout)")
        use_flashkda_build()
    try:
        importlib.import_module("flash_kda")
    except Exception as e:  # a build for another torch or GPU: say why
        return False, f"FlashKDA does not import: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return True, ""


def flashkda_unsupported(K: int, V: int, gate: str = "bounded") -> str | None:
    """Why FlashKDA cannot take a call of this head size and gate, or None."""
    if gate != "bounded":
        return f"FlashKDA has only the bounded gate (FLA's safe gate), not {gate!r}"
    if K != FLASHKDA_HEAD_DIM or V != FLASHKDA_HEAD_DIM:
        return f"FlashKDA needs K = V = {FLASHKDA_HEAD_DIM}, got K={K} V={V}"
    return None


def _flashkda_args(q, k, v, g, beta, *, A_log, dt_bias, scale, initial_state, output_final_state, gate,
                   lower_bound, cu_seqlens=None, state_v_first=False) -> dict:
    """Validate a contract call for FlashKDA (before anything touches a GPU)
    and convert it to flash_kda.fwd's arguments: contiguous inputs, the output
    buffer, and the states in FlashKDA's [B, H, V, K] layout (fp32). With
    ``cu_seqlens`` (packed sequences, B == 1) the states are [N, H, V, K] and
    cu_seqlens goes in as int64; ``state_v_first``: initial_state is already
    in FlashKDA's layout (no transpose)."""
    from .contract import alloc

    why = flashkda_unsupported(q.shape[-1], v.shape[-1], gate)
    if why is not None:
        raise ValueError(why)
    for n, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.dtype != torch.bfloat16:
            raise ValueError(f"FlashKDA takes bf16 {n}, got {x.dtype}")
    lb = -5.0 if lower_bound is None else float(lower_bound)
    if not -5.0 <= lb <= 0.0:
        raise ValueError(f"FlashKDA takes lower_bound in [-5, 0], got {lb}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    N, cu = B, None
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"FlashKDA takes packed sequences (cu_seqlens) with B == 1, got B = {B}")
        if not torch.is_tensor(cu_seqlens) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D tensor [N + 1]")
        N, cu = cu_seqlens.numel() - 1, cu_seqlens.to(device=q.device, dtype=torch.int64).contiguous()
    h0 = None
    if initial_state is not None:  # ours [N, H, K, V] -> FlashKDA's [N, H, V, K] (unless given V-first)
        h0 = initial_state.detach().to(torch.float32)
        h0 = (h0 if state_v_first else h0.transpose(-1, -2)).contiguous()
    final = alloc((N, H, V, K), torch.float32, q.device) if output_final_state else None
    return dict(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(), beta=beta.contiguous(),
                scale=float(K ** -0.5 if scale is None else scale), out=alloc((B, T, H, V), torch.bfloat16, q.device),
                A_log=A_log.detach().to(torch.float32).contiguous(),
                dt_bias=dt_bias.detach().to(torch.float32).reshape(H, K).contiguous(), lower_bound=lb,
                initial_state=h0, final_state=final, cu_seqlens=cu)


def flashkda_forward(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None, output_final_state=True,
                     gate="bounded", lower_bound=None, chunk_size=None):
    """FlashKDA's forward with the stage contract's arguments and return:
    (o in bf16 [B, T, H, V], final state fp32 in this project's [B, H, K, V]
    layout, or None). FlashKDA keeps its states as [B, H, V, K]: the initial
    state goes in transposed and the final state comes back transposed.
    Takes bf16 q, k, v, g, beta with K = V = 128 and the bounded gate only
    (ValueError otherwise, before any kernel); chunk_size is FlashKDA's own
    and is ignored; no backward."""
    a = _flashkda_args(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, gate=gate, lower_bound=lower_bound)
    import flash_kda

    flash_kda.fwd(a["q"], a["k"], a["v"], a["g"], a["beta"], a["scale"], a["out"], a["A_log"], a["dt_bias"],
                  a["lower_bound"], initial_state=a["initial_state"], final_state=a["final_state"], cu_seqlens=None)
    S = a["final_state"]
    return a["out"], (S.transpose(-1, -2).contiguous() if S is not None else None)


def flashkda_call(q, k, v, g, beta, *, A_log, dt_bias, scale=None, initial_state=None, output_final_state=True,
                  gate="bounded", lower_bound=None, chunk_size=None):
    """A zero-argument function that runs FlashKDA's own call on these inputs,
    converted once (the states stay in its [B, H, V, K] layout, no transpose,
    the output buffers allocated once): what the benchmark times, as FlashKDA
    is called in a model."""
    a = _flashkda_args(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, gate=gate, lower_bound=lower_bound)
    import flash_kda

    def call():
        flash_kda.fwd(a["q"], a["k"], a["v"], a["g"], a["beta"], a["scale"], a["out"], a["A_log"], a["dt_bias"],
                      a["lower_bound"], initial_state=a["initial_state"], final_state=a["final_state"],
                      cu_seqlens=None)

    return call


def flashkda_varlen_call(q, k, v, g, beta, *, A_log, dt_bias, cu_seqlens, scale=None, initial_state=None,
                         output_final_state=True, gate="bounded", lower_bound=None, chunk_size=None,
                         state_v_first=True):
    """FlashKDA's packed-sequence call, converted once, as a zero-argument
    function (what the benchmark times) and the buffers it writes:
    (call, out [1, T, H, V] bf16, final state [N, H, V, K] fp32 or None).
    q, k, v, g, beta are [1, T, H, *]; cu_seqlens [N + 1] (int64 on the
    device: converted once); initial_state [N, H, V, K] with ``state_v_first``
    (the default: FlashKDA's own layout, passed without a copy), else
    [N, H, K, V] (transposed once)."""
    a = _flashkda_args(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, gate=gate, lower_bound=lower_bound,
                       cu_seqlens=cu_seqlens, state_v_first=state_v_first)
    import flash_kda

    def call():
        flash_kda.fwd(a["q"], a["k"], a["v"], a["g"], a["beta"], a["scale"], a["out"], a["A_log"], a["dt_bias"],
                      a["lower_bound"], initial_state=a["initial_state"], final_state=a["final_state"],
                      cu_seqlens=a["cu_seqlens"])

    return call, a["out"], a["final_state"]


def flashkda_varlen_forward(q, k, v, g, beta, *, A_log, dt_bias, cu_seqlens, scale=None, initial_state=None,
                            output_final_state=True, gate="bounded", lower_bound=None, chunk_size=None,
                            state_v_first=False):
    """FlashKDA over packed sequences with a stage's packed call (cu_seqlens,
    state_v_first) and its return: (o bf16 [1, T, H, V], final state fp32
    [N, H, K, V], or [N, H, V, K] with state_v_first, or None)."""
    call, out, final = flashkda_varlen_call(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
                                            scale=scale, initial_state=initial_state,
                                            output_final_state=output_final_state, gate=gate,
                                            lower_bound=lower_bound, state_v_first=state_v_first)
    call()
    if final is not None and not state_v_first:
        final = final.transpose(-1, -2).contiguous()
    return out, final
