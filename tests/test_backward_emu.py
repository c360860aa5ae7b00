"""Stage 13's backward (next/13_backward, on its way into the ladder), checked on a machine without a GPU.

The CUDA source of its four kernels runs on the CPU under kda_emu.h (a std::thread per CUDA
thread, barriers for __syncthreads, the shuffles and the warp's MMAs), with the GPU build's grids, threads and
shared memory. On the "exact" build (every product and state in fp32) every gradient must match autograd
through the fp64 token loop at fp32 round-off, and each kernel's output the fp64 model of
common/backward_model.py; the shipped build's tensor-core chains must match a model with their bf16 roundings. A kernel that reads the wrong row, skips a barrier's partner or drops
a term fails here by orders of magnitude (the reverse chain without the diagonal of Aqk^T do: 1.6e-3 to 3e-2
on every gradient but dq, against 2e-7). The GPU build is compiled too.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from common import backward_model as bm
from common import checks
from common.inputs import make_cotangents, make_inputs
from common.metrics import rel_err
from common.paths import REPO_ROOT
from common.reference import activate, kda_reference
from common.stages import load_next

STAGE_DIR = REPO_ROOT / "next" / "13_backward"
NAMES = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")
TOL = 1e-5  # fp32 arithmetic against fp64 on the same bf16 inputs: 2e-7 to 2.3e-6 measured (dA_log the largest)

# (B, T, H, K = V, gate, lower_bound, h0, seed): B > 1 with h0 and a tail, one chunk and less, both head sizes
CASES = [
    (2, 37, 2, 64, "softplus", None, True, 1),
    (1, 20, 1, 128, "bounded", -5.0, True, 2),
    (3, 5, 1, 64, "bounded", -2.0, False, 3),
    (1, 48, 2, 64, "softplus", None, False, 4),
]


@pytest.fixture(scope="module")
def stage():
    return load_next(STAGE_DIR.name)


def _case(B, T, H, K, gate, lb, h0, seed):
    kw = make_inputs(B, T, H, K, K, seed=seed, dtype=torch.bfloat16, gate=gate, lower_bound=lb, h0=h0,
                     chunk_size=16)
    do, dht = make_cotangents((B, T, H, K), (B, H, K, K), seed=seed)
    return kw, do, dht


def _reference(kw, do, dht, gate, lb):
    """Autograd through the fp64 token loop on the same (bf16) inputs."""
    leaves = {n: (None if kw[n] is None else kw[n].detach().double().requires_grad_()) for n in NAMES}
    o, S = kda_reference(**leaves, gate=gate, lower_bound=lb, scale=kw["q"].shape[-1] ** -0.5)
    torch.autograd.backward((o, S), (do.double(), dht.double()))
    return {n: (None if t is None else t.grad) for n, t in leaves.items()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-{c[4]}-h0{int(c[6])}")
def test_every_gradient_is_autograd_at_fp32_roundoff(stage, case):
    B, T, H, K, gate, lb, h0, seed = case
    kw, do, dht = _case(*case)
    got = stage.emulate_backward(**{n: kw[n] for n in NAMES}, gate=gate, lower_bound=lb, do=do, dht=dht, variant="exact")
    ref = _reference(kw, do, dht, gate, lb)
    for n in NAMES:
        if ref[n] is None:
            assert got[n] is None
            continue
        assert torch.isfinite(got[n]).all(), f"d{n} has a NaN: an element never written"
        assert rel_err(got[n], ref[n]) <= TOL, f"d{n}: {rel_err(got[n], ref[n]):.2e}"


def test_chunks_too_wide_to_factor_go_pair_by_pair(stage):
    """B1 and B4 take the pair sums factored (e^{gc_c} e^{-gc_i}) where every key dimension of a chunk decays by at
    most kFactoredRange = 80, and pair by pair where one decays by more: a case with both kinds of chunk (the softplus
    gate, head 1's A = exp(A_log) 20 times the drawn one) is autograd at fp32 round-off on the exact build."""
    B, T, H, K, gate, lb = 1, 48, 2, 64, "softplus", None
    kw, do, dht = _wide_case()
    x = {n: kw[n].double() for n in NAMES}
    _, _, _, a = activate(x["q"], x["k"], x["g"], x["beta"], x["A_log"], x["dt_bias"], gate=gate, lower_bound=lb)
    glast = a.reshape(B, T // 16, 16, H, K).sum(2)  # each chunk's decay, per key dimension
    wide = (glast < -80).any(-1)  # [B, chunks, H]
    assert wide.any() and not wide.all(), "the case must have chunks of both kinds"
    got = stage.emulate_backward(**{n: kw[n] for n in NAMES}, gate=gate, lower_bound=lb, do=do, dht=dht,
                                 variant="exact")
    ref = _reference(kw, do, dht, gate, lb)
    for n in NAMES:
        assert torch.isfinite(got[n]).all(), f"d{n} has a NaN"
        assert rel_err(got[n], ref[n]) <= TOL, f"d{n}: {rel_err(got[n], ref[n]):.2e}"


# B4's products on tensor cores, each three bf16 MMAs of its operands' high and low halves, against the same on the
# CUDA cores in fp32, every other product the same. The per-key-dimension terms (key_terms_mma against the build
# fp32_key_terms): 2e-7 to 8.3e-6 measured (dA_log the largest); with Q^T read as Q (a planted slip) dk is 52 to
# 6e15 off (the upper triangle's decays are not below 1). dAqk and dAf (pair_grads_mma against fp32_pair_grads):
# 3e-7 to 6.5e-6 (dq the largest); with kd = k, its decay left out (planted), dk is 2.8e-3 to 1.1e-2 off. dv (dv_mma
# against fp32_dv): 3.4e-6 to 4.7e-6; with Af's beta taken by row, not by column (planted), 1.4e-2 to 7.9e-2 off.
SPLIT_TOL = 2e-5


def _wide_case():
    """B1 T48 H2 K64, softplus, h0: head 1's A = exp(A_log) 20 times the drawn one, so that some of its chunks decay
    by more than kFactoredRange = 80 in a key dimension and the others do not."""
    kw, do, dht = _case(1, 48, 2, 64, "softplus", None, True, 7)
    kw["A_log"] = kw["A_log"] + torch.tensor([0.0, math.log(20)])
    return kw, do, dht


@pytest.mark.parametrize("which,variant", [(w, v) for v in ("fp32_key_terms", "fp32_pair_grads", "fp32_dv")
                                           for w in ("B2-T37-K64", "B1-T20-K128-bounded")]
                         + [("both-kinds-of-chunk", "fp32_key_terms")])  # the one whose path depends on the chunk
def test_the_split_products_are_the_fp32_ones(stage, which, variant):
    """B4's products but those with the states run on tensor cores, each operand split into bf16 halves: the
    per-key-dimension terms where a chunk's decays factor (key_terms_mma: elsewhere on the CUDA cores), dAqk and
    dAf (pair_grads_mma), dv (dv_mma). Every gradient against the build that takes one of them on the CUDA cores in fp32, on
    cases with a tail, h0, both head sizes, and chunks of both kinds."""
    if which == "both-kinds-of-chunk":
        (kw, do, dht), gate, lb = _wide_case(), "softplus", None
    else:
        case = CASES[0] if which.startswith("B2") else CASES[1]
        (kw, do, dht), gate, lb = _case(*case), case[4], case[5]
    args = dict(**{n: kw[n] for n in NAMES}, gate=gate, lower_bound=lb, do=do, dht=dht)
    got = stage.emulate_backward(**args)
    want = stage.emulate_backward(**args, variant=variant)
    for n in NAMES:
        assert torch.isfinite(got[n]).all(), f"d{n} has a NaN: an element never written"
        assert rel_err(got[n], want[n]) <= SPLIT_TOL, f"d{n}: {rel_err(got[n], want[n]):.2e}"


def _packed_case(gate, lb, seed):
    """Packed sequences (B = 1) of lengths 7, 0, 20 and 33 (one empty, one shorter than a chunk, one of a chunk and
    a tail), H = 2, K = V = 64, each with its own h0: (inputs, do, dht, cu_seqlens)."""
    lens = (7, 0, 20, 33)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    N, T, H, K = len(lens), sum(lens), 2, 64
    kw = make_inputs(1, T, H, K, K, seed=seed, dtype=torch.bfloat16, gate=gate, lower_bound=lb, h0=False,
                     chunk_size=16)
    gen = torch.Generator().manual_seed(seed + 1)
    kw["initial_state"] = torch.randn(N, H, K, K, generator=gen) / 8
    do, dht = make_cotangents((1, T, H, K), (N, H, K, K), seed=seed + 2)
    return kw, do, dht, cu


@pytest.mark.parametrize("gate,lb", [("softplus", None), ("bounded", -3.0)])
def test_packed_sequences_are_each_sequence_alone(stage, gate, lb):
    """Packed sequences (cu_seqlens, B = 1): one empty, one shorter than a chunk, one of a chunk and a tail, each
    with its own h0, against autograd through the fp64 token loop run on each sequence alone."""
    kw, do, dht, cu = _packed_case(gate, lb, seed=5)
    N, K = len(cu) - 1, kw["q"].shape[-1]
    got = stage.emulate_backward(**{n: kw[n] for n in NAMES}, gate=gate, lower_bound=lb, do=do, dht=dht,
                                 cu_seqlens=cu, variant="exact")
    leaves = {n: kw[n].detach().double().requires_grad_() for n in NAMES}
    loss = 0.0
    for i in range(N):
        s0, s1 = int(cu[i]), int(cu[i + 1])
        h0 = leaves["initial_state"][i:i + 1]
        if s1 == s0:  # nothing runs: the final state is h0
            loss = loss + (h0 * dht[i:i + 1].double()).sum()
            continue
        part = {n: leaves[n][:, s0:s1] for n in ("q", "k", "v", "g", "beta")}
        o, S = kda_reference(**part, A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], initial_state=h0, gate=gate,
                             lower_bound=lb, scale=K ** -0.5)
        loss = loss + (o * do[:, s0:s1].double()).sum() + (S * dht[i:i + 1].double()).sum()
    loss.backward()
    for n in NAMES:
        assert torch.isfinite(got[n]).all(), f"d{n} has a NaN: an element never written"
        assert rel_err(got[n], leaves[n].grad) <= TOL, f"d{n}: {rel_err(got[n], leaves[n].grad):.2e}"


def test_the_shipped_build_packs_sequences_as_it_runs_them_alone(stage):
    """The shipped build (tensor-core chains) on packed sequences, one empty, one shorter than a chunk, each with its
    own h0: every per-token gradient and dh0 is, bit for bit, what the same build gives each sequence alone;
    dA_log and ddt_bias (sums over the sequences, taken in another order) within fp32 round-off."""
    kw, do, dht, cu = _packed_case("softplus", None, seed=8)
    N = len(cu) - 1
    got = stage.emulate_backward(**{n: kw[n] for n in NAMES}, gate="softplus", do=do, dht=dht, cu_seqlens=cu)
    sums = {"A_log": 0.0, "dt_bias": 0.0}
    for i in range(N):
        s0, s1 = int(cu[i]), int(cu[i + 1])
        if s1 == s0:  # nothing runs: dh0 is dht
            assert torch.equal(got["initial_state"][i], dht[i]), "the empty sequence's dh0"
            continue
        part = {n: kw[n][:, s0:s1] for n in ("q", "k", "v", "g", "beta")}
        alone = stage.emulate_backward(**part, A_log=kw["A_log"], dt_bias=kw["dt_bias"],
                                       initial_state=kw["initial_state"][i:i + 1], gate="softplus",
                                       do=do[:, s0:s1], dht=dht[i:i + 1])
        for n in ("q", "k", "v", "g", "beta"):
            assert torch.equal(got[n][:, s0:s1], alone[n]), f"sequence {i}: d{n}"
        assert torch.equal(got["initial_state"][i:i + 1], alone["initial_state"]), f"sequence {i}: dh0"
        for n in sums:
            sums[n] = sums[n] + alone[n]
    for n, want in sums.items():
        assert rel_err(got[n], want) <= 1e-6, f"d{n}: {rel_err(got[n], want):.2e}"


def test_each_kernel_is_the_model(stage):
    """B1's operands, B2's entry states and vcorr, B3's exit gradients and dvcorr, chunk by chunk, against
    common/backward_model.py in fp64 (a tail chunk compared on its real tokens)."""
    B, T, H, K, gate, lb, h0, seed = CASES[0]
    kw, do, dht = _case(*CASES[0])
    got = stage.emulate_backward(**{n: kw[n] for n in NAMES}, gate=gate, lower_bound=lb, do=do, dht=dht, variant="exact",
                                 keep_u=True)
    x = {n: kw[n].double() for n in NAMES}
    qn, kn, b, a = activate(x["q"], x["k"], x["g"], x["beta"], x["A_log"], x["dt_bias"], gate=gate, lower_bound=lb)
    NT = math.ceil(T / 16)
    ops = [bm.chunk_operands(qn, kn, x["v"], b, a, scale=K ** -0.5, t0=t0, t1=min(t0 + 16, T))
           for t0 in range(0, T, 16)]
    S, entry, vcorr = x["initial_state"], [], []
    for c in ops:
        vc, _, S_next = bm.step(c, S)
        entry.append(S)
        vcorr.append(vc)
        S = S_next
    dS, exits, dvcorr = dht.double(), [None] * NT, [None] * NT
    for n in range(NT - 1, -1, -1):
        exits[n] = dS
        dvcorr[n], dS = bm.reverse_step(ops[n], dS, do.double()[:, 16 * n:16 * n + 16].transpose(1, 2))
    for n, c in enumerate(ops):
        m = c["q"].shape[2]
        want = dict(qd=c["qd"], kr=c["kr"], w=c["w"], u=c["u"], Aqk=c["Aqk"], el=torch.exp(c["glast"]),
                    states=entry[n], dstates=exits[n], vcorr=vcorr[n], dvcorr=dvcorr[n])
        for name, ref in want.items():
            t = got[name].reshape(B, H, NT, *got[name].shape[1:])[:, :, n]
            t = t[:, :, :m, :m] if name == "Aqk" else t[:, :, :m] if t.dim() == 4 and name not in ("states", "dstates") \
                else t
            assert rel_err(t, ref) <= TOL, f"chunk {n} {name}: {rel_err(t, ref):.2e}"


# The shipped build takes the chains' products on bf16 tensor-core MMAs (chains_mma.cuh) and stores the states for
# B4 in bf16 (kda.h kda_state_t): each gradient within this of fp64 autograd on the CASES, dA_log and ddt_bias
# relative to the size of the terms they sum (common.checks reduction_scales, as the GPU checks judge them).
# Measured with B4's products with S and dS on tensor cores too (55063fe's default): 3.0e-3 at most (dg; dk 2.5e-3,
# dv 2.4e-3: 1.8e-7 with the fp32 chains), dA_log 3.9e-4, ddt_bias 2.1e-3; with those products on the CUDA cores
# (fp32_adjoint) 2.75e-3 (dg), dA_log 3.2e-4, ddt_bias 1.7e-3. Where B4 read dS's second eight columns for the first
# (a planted slip) dk is 1.4 off.
SHIPPED_TOL = 3.5e-3
# The tensor-core chains against common.backward_model.mma_chains (the same bf16 roundings in fp64), from the
# same B1 operands: 7e-9 to 2.3e-6 measured (the largest where the fp32 and fp64 sums put a state on either side
# of a bf16 rounding). With Aqk read untransposed in the reverse chain (a planted slip): dvcorr off by 3e-2 to
# 8e-2, dh0 by 3e-2.
MMA_CHAINS_TOL = 1e-5


def _shipped_case(stage, case, variant=None, keep_u=False):
    B, T, H, K, gate, lb, h0, seed = case
    kw, do, dht = _case(*case)
    args = dict(**{n: kw[n] for n in NAMES}, gate=gate, lower_bound=lb, do=do, dht=dht)
    return kw, do, dht, stage.emulate_backward(**args, variant=variant, keep_u=keep_u)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-{c[4]}-h0{int(c[6])}")
def test_the_mma_chains_are_their_model(stage, case):
    """B2 and B3 on tensor cores (the fp32_states build: the states as the chains carry them) against
    common.backward_model.mma_chains, which rounds to bf16 exactly what the MMAs take, from the kernels' own B1
    operands: entry states, exit gradients, vcorr, dvcorr and dh0 at fp32 round-off."""
    B, T, H, K, gate, lb, h0, seed = case
    kw, do, dht, got = _shipped_case(stage, case, "fp32_states", keep_u=True)
    want = bm.mma_chains(got, do, H=H, h0=kw["initial_state"], dht=dht)
    want["initial_state"] = want.pop("dh0")
    for name in ("states", "dstates", "vcorr", "dvcorr", "initial_state"):
        if got[name] is None:
            continue
        assert torch.isfinite(got[name]).all(), f"{name} has a NaN: an element never written"
        if not want[name].any():  # the entry states of a single chunk without h0
            assert not got[name].any(), name
            continue
        assert rel_err(got[name], want[name]) <= MMA_CHAINS_TOL, f"{name}: {rel_err(got[name], want[name]):.2e}"


@pytest.mark.parametrize("case,variant", [(c, None) for c in CASES] + [(CASES[0], "fp32_adjoint")],
                         ids=lambda c: c if isinstance(c, str) or c is None else
                         f"B{c[0]}-T{c[1]}-H{c[2]}-K{c[3]}-{c[4]}-h0{int(c[6])}")
def test_the_shipped_build_is_within_its_tolerance(stage, case, variant):
    """The shipped build (the chains and B4's state products on tensor cores, states stored in bf16), and with B4's
    products on the CUDA cores (fp32_adjoint): the
    stored states are the fp32_states build's rounded to bf16 bit for bit (the chains carry them in fp32 either way),
    and every gradient stays within SHIPPED_TOL of fp64 autograd."""
    B, T, H, K, gate, lb, h0, seed = case
    kw, do, dht, got = _shipped_case(stage, case, variant)
    _, _, _, fp32 = _shipped_case(stage, case, "fp32_states")
    for name in ("states", "dstates"):
        assert got[name].dtype == torch.bfloat16
        real = torch.isfinite(fp32[name])  # slots past a sequence's end are never written
        assert torch.equal(got[name][real], fp32[name][real].to(torch.bfloat16)), name
    ref = _reference(kw, do, dht, gate, lb)
    scales = checks.reduction_scales(dict({n: kw[n] for n in NAMES}, gate=gate, lower_bound=lb, scale=None), (do, dht))
    for n in NAMES:
        if ref[n] is None:
            continue
        assert torch.isfinite(got[n]).all(), f"d{n} has a NaN: an element never written"
        err = checks._err(got[n], ref[n], scales.get("d" + n))
        assert err <= SHIPPED_TOL, f"d{n}: {err:.2e}"


def test_the_chain_operands_are_stored_in_bf16_as_the_mmas_round_them(stage):
    """B1 stores qd, kr and w in bf16 for the tensor-core chains (kda.h kda_op_t): each is the exact build's fp32
    operand rounded to bf16, bit for bit (the rounding the chains' fragments took of fp32 operands before)."""
    case = CASES[0]
    _, _, _, got = _shipped_case(stage, case)
    _, _, _, ref = _shipped_case(stage, case, "exact")
    for name in ("qd", "kr", "w"):
        assert got[name].dtype == torch.bfloat16 and ref[name].dtype == torch.float32, name
        real = torch.isfinite(ref[name])  # slots past a sequence's end are never written
        assert real.any() and torch.equal(got[name][real], ref[name][real].to(torch.bfloat16)), name
    # the same chains reading fp32 operands and rounding them as they read (the variant fp32_operands): the same bits
    _, _, _, f32ops = _shipped_case(stage, case, "fp32_operands")
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "states", "dstates", "vcorr", "dvcorr"):
        assert torch.equal(got[name].nan_to_num(7.0), f32ops[name].nan_to_num(7.0)), name


def test_do_in_bf16_is_do_in_fp32_of_the_same_values(stage):
    """The op gives the kernels o's gradient as it comes, bf16 (B3 and B4 read it so): the same bits as an fp32 do
    holding the same values, on a case with a tail and on packed sequences."""
    for (kw, do, dht, cu), gate, lb in ((_case(*CASES[0]) + (None,), *CASES[0][4:6]),
                                        (_packed_case("bounded", -3.0, seed=5), "bounded", -3.0)):
        args = dict(**{n: kw[n] for n in NAMES}, gate=gate, lower_bound=lb, dht=dht, cu_seqlens=cu)
        do = do.to(torch.bfloat16).float()
        a = stage.emulate_backward(**args, do=do)
        b = stage.emulate_backward(**args, do=do, do_bf16=True)
        for n in NAMES + ("states", "dstates", "vcorr", "dvcorr"):
            if a[n] is not None:
                assert torch.equal(a[n].nan_to_num(7.0), b[n].nan_to_num(7.0)), n


def test_vcorr_over_u_changes_nothing(stage):
    """B2 writes each chunk's vcorr over the u it has read (one buffer for the two, as the binding allocates them):
    every gradient, state and vcorr the same bits as with u kept in a buffer of its own, on a case with a tail and h0
    and on packed sequences, for the shipped build and the fp32 chains'. A chain that read a chunk's u after
    writing its vcorr, or a later reader of u, would differ here."""
    for (kw, do, dht, cu), gate, lb in ((_case(*CASES[0]) + (None,), *CASES[0][4:6]),
                                        (_packed_case("bounded", -3.0, seed=5), "bounded", -3.0)):
        args = dict(**{n: kw[n] for n in NAMES}, gate=gate, lower_bound=lb, do=do, dht=dht, cu_seqlens=cu)
        for variant in (None, "fp32_chains"):
            shared = stage.emulate_backward(**args, variant=variant)
            apart = stage.emulate_backward(**args, variant=variant, keep_u=True)
            assert shared["u"].data_ptr() == shared["vcorr"].data_ptr()
            assert apart["u"].data_ptr() != apart["vcorr"].data_ptr()
            assert not torch.equal(apart["u"].nan_to_num(7.0), apart["vcorr"].nan_to_num(7.0))
            for n in NAMES + ("states", "dstates", "vcorr", "dvcorr"):
                if shared[n] is not None:
                    assert torch.equal(shared[n].nan_to_num(7.0), apart[n].nan_to_num(7.0)), (variant, n)


def test_b4_reading_b1s_inverse_is_b4_forming_it(stage):
    """B1 keeps each chunk's X = (I + L)^-1 and pair sums kk for B4, which no longer forms them: every gradient the
    same bits as the build where B4 forms them again (b4_rebuilds), on a case with a tail and h0, on packed
    sequences, and on chunks too wide to factor; what B1 keeps is written on every real chunk."""
    for (kw, do, dht, cu), gate, lb in ((_case(*CASES[1]) + (None,), *CASES[1][4:6]),
                                        (_packed_case("softplus", None, seed=6), "softplus", None),
                                        (_wide_case() + (None,), "softplus", None)):
        args = dict(**{n: kw[n] for n in NAMES}, gate=gate, lower_bound=lb, do=do, dht=dht, cu_seqlens=cu)
        kept = stage.emulate_backward(**args)
        formed = stage.emulate_backward(**args, variant="b4_rebuilds")
        assert formed["Xkk"].numel() == 0
        real = torch.isfinite(kept["Aqk"]).all(-1).all(-1)  # the chunks B1 ran
        assert real.any() and torch.isfinite(kept["Xkk"][real]).all()
        for n in NAMES:
            if kept[n] is not None:
                assert torch.equal(kept[n], formed[n]), n


def test_b4s_reorderings_change_no_bit(stage):
    """Changes to B4 that only move its work: every gradient the same bits as the build without them (b4_waits: both
    off, one build for CI's time; each has its own build for the GPU's timing), with a tail and h0 at K = 64 and
    K = 128, and on packed sequences.
    - two_state_tiles: the stage keeps its tiles of S and dS four buffers deep, the first three issued before the
      chunk's load (two buffers over dqd, dkr and dw until the products write them; at K = 64, three of its four
      tiles before the load). A tile issued into the buffer being read (planted) fails. A buffer reused before its
      readers are done would show here only by chance: the GPU's training tests run the same kernel.
    - gate_loads_in_loop: the stage loads the gate's inputs of every row before its loop over the rows."""
    for (kw, do, dht, cu), gate, lb in ((_case(*CASES[0]) + (None,), *CASES[0][4:6]),
                                        (_case(*CASES[1]) + (None,), *CASES[1][4:6]),
                                        (_packed_case("bounded", -5.0, seed=7), "bounded", -5.0)):
        args = dict(**{n: kw[n] for n in NAMES}, gate=gate, lower_bound=lb, do=do, dht=dht, cu_seqlens=cu)
        stage_bits = stage.emulate_backward(**args)
        without = stage.emulate_backward(**args, variant="b4_waits")
        for n in NAMES:
            if stage_bits[n] is not None:
                assert torch.equal(stage_bits[n], without[n]), n


def test_the_profile_regions_are_the_kernels_table(stage):
    """SPEC.backward_regions names kda.h's KdaBwdRegion ids in order, and the table fits the profile buffer."""
    import re

    from common.extrun import MAX_REGIONS

    text = (Path(stage.__file__).parent / "kda.h").read_text()
    enum = re.search(r"enum KdaBwdRegion \{(.*?)\};", text, re.S).group(1)
    ids = [int(x) for x in re.findall(r"KDA_REG_B\w+ = (\d+),", enum)]
    assert ids == list(range(len(stage.SPEC.backward_regions))) and len(ids) <= MAX_REGIONS
    assert all(r.startswith("bwd: ") for r in stage.SPEC.backward_regions)


def test_the_check_fails_on_wrong_gradients(stage):
    """The comparison itself: the same inputs with the gate taken as the other one give gradients far off."""
    B, T, H, K, gate, lb, h0, seed = CASES[1]
    kw, do, dht = _case(*CASES[1])
    ref = _reference(kw, do, dht, gate, lb)
    wrong = stage.emulate_backward(**{n: kw[n] for n in NAMES}, gate="softplus", do=do, dht=dht, variant="exact")
    assert max(rel_err(wrong[n], ref[n]) for n in ("k", "g", "beta")) > 100 * TOL


def test_the_cpu_check_of_the_algorithm_holds():
    """The notebook's check of the algorithm on the CPU (common.notebook.backward_model_check) and its picture."""
    import matplotlib.pyplot as plt

    from common import notebook

    table = notebook.backward_model_check()
    assert table.shape == (8, 2) and float(table.max().max()) < 1e-9
    notebook.backward_picture()
    plt.close("all")


def test_the_gpu_build_compiles(stage):
    """The CUDA build of the stage (stage 12's forward and the backward kernels) compiles with nvcc here."""
    assert hasattr(stage.build(), "bwd")


def test_the_op_calls_the_binding_by_its_own_names(stage):
    """kdalab.chunk_kda's backward calls the GPU build's bwd with 23 arguments in order and the packed sequences'
    by name; the binding's signature (pybind's, read from the build compiled here) must take exactly that. (The CPU
    models of the binding take any name, so only this test sees a keyword the binding does not have.)"""
    import inspect
    import re

    from kdalab import op

    doc = stage.build().bwd.__doc__
    params = re.findall(r"(\w+): ", doc.splitlines()[0])
    src = inspect.getsource(op)  # the module: chunk_kda_bwd is a CustomOpDef
    call = src[src.index("_backward_extension().bwd("):]
    call = call[:call.index(")\n")]
    keywords = re.findall(r"(\w+)=", call)
    positional = call.split("(", 1)[1].split("cu_seqlens=")[0].count(",")
    assert positional == 23 and params[:23][-1] == "prof", (positional, params)
    assert keywords and all(k in params[23:] for k in keywords), (keywords, params)


def test_the_op_trains_on_these_kernels(stage, monkeypatch):
    """kdalab.chunk_kda in training with this backward's source (the emulator in place of the GPU build, the
    forward an fp64 model): its gradients are the kernels' own, rounded to the inputs' dtypes, bit for bit;
    packed sequences with their states V-first, as FLA's KimiDeltaAttention calls it."""
    import kdalab
    from common.kernel_model import ReferenceExtension
    from kdalab import op

    monkeypatch.setattr(op, "_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(op, "_extension", lambda *a: ReferenceExtension(op.STAGE))
    monkeypatch.setattr(op, "_backward_extension", lambda: stage.EmulatedExtension())
    lens, H, K = (9, 0, 23), 2, 64
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    kw = make_inputs(1, sum(lens), H, K, K, seed=11, dtype=torch.bfloat16, gate="softplus", h0=False, chunk_size=16)
    gen = torch.Generator().manual_seed(12)
    h0 = torch.randn(len(lens), H, K, K, generator=gen) / 8  # V-first
    leaves = {n: kw[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
    leaves["initial_state"] = h0.clone().requires_grad_()
    o, ht = kdalab.chunk_kda(**{n: leaves[n] for n in ("q", "k", "v", "g", "beta")}, A_log=leaves["A_log"],
                             dt_bias=leaves["dt_bias"].reshape(-1), initial_state=leaves["initial_state"],
                             output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, state_v_first=True, cu_seqlens=cu)
    do, dht = torch.randn(o.shape, generator=gen).to(o.dtype), torch.randn(ht.shape, generator=gen)
    torch.autograd.backward((o, ht), (do, dht))
    want = stage.emulate_backward(**{n: kw[n] for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")},
                                  initial_state=h0.transpose(-1, -2), gate="softplus", do=do.float(),
                                  dht=dht.transpose(-1, -2), cu_seqlens=cu)
    want["initial_state"] = want["initial_state"].transpose(-1, -2)
    for n, t in leaves.items():
        assert torch.equal(t.grad, want[n].to(t.dtype)), f"d{n}: {rel_err(t.grad, want[n]):.2e}"


@pytest.mark.parametrize("variant", [None, "exact"])
def test_the_declared_bytes_are_the_workspace(stage, variant):
    """stage.backward_bytes (the chapter's table of what is kept, and bench_train's prediction of the peak) against
    the tensors the kernels are given (the emulator allocates them as the binding does), at a case with a tail, for
    the stage and for a build whose states and chain operands are fp32."""
    B, T, H, K, gate, lb, h0, seed = CASES[0]
    kw, do, dht = _case(*CASES[0])
    got = stage.emulate_backward(**{n: kw[n] for n in NAMES}, gate=gate, lower_bound=lb, do=do, dht=dht,
                                 variant=variant)
    want = stage.backward_bytes(B, T, H, K, variant=variant)["workspace"]
    nbytes = {n: got[n].numel() * got[n].element_size() for n in ("qd", "kr", "w", "u", "Aqk", "el", "states",
                                                                    "dstates", "vcorr", "dvcorr")}
    assert want["qd, kr, w"] == nbytes["qd"] + nbytes["kr"] + nbytes["w"]
    assert got["u"].data_ptr() == got["vcorr"].data_ptr(), "vcorr is written over u: one buffer"
    assert want["u, then vcorr over it (fp32)"] == nbytes["vcorr"]
    assert want["Aqk, exp(glast) (fp32)"] == nbytes["Aqk"] + nbytes["el"]
    assert want["entry states, exit gradients"] == nbytes["states"] + nbytes["dstates"]
    assert want["dvcorr (fp32)"] == nbytes["dvcorr"]
    assert want["X, kk: B1's, for B4 (fp32)"] == got["Xkk"].numel() * got["Xkk"].element_size()
    each = stage._buffer_bytes(B, T, H, K, variant)  # what backward_traffic counts, buffer by buffer
    nbytes["Xkk"] = got["Xkk"].numel() * got["Xkk"].element_size()
    assert {n: each[n] for n in nbytes} == nbytes


def test_each_kernels_traffic_is_declared(stage):
    """stage.BACKWARD_IO, from which nb.backward_floors takes each kernel's bytes: every field it names is one of
    KdaBwdParams' buffers, every buffer is named (but the gradients' bf16 twins, counted under their fp32 names, and
    what is too small to count), and what a kernel writes and is not a gradient a kernel at or after it reads (a
    buffer that no kernel were declared to read, or one read before it is written, fails)."""
    import re

    src = (STAGE_DIR / "kda.h").read_text()
    struct = re.sub(r"//.*", "", src[src.index("struct KdaBwdParams"):])
    struct = struct[:struct.index("};")]
    pointers = set(re.findall(r"\*\s*(\w+)", struct))
    small = {"cu_seqlens", "A_log", "dt_bias", "prof"}
    io = list(stage.BACKWARD_IO.values())
    named = {f for reads, writes in io for f in reads + writes}
    assert named == {f for f in pointers - small if not f.endswith("_bf")}, named ^ pointers
    assert {f for f in pointers if f.endswith("_bf")} <= {f + "_bf" for f in named}
    outputs = {"dq", "dk", "dv", "dg", "dbeta", "dh0", "ddt_part", "dAlog_part"}
    for i, (_, writes) in enumerate(io):
        for f in set(writes) - outputs:
            assert any(f in reads for reads, _ in io[i:]), f"{f}: written, never read after"
    for i, (reads, _) in enumerate(io):
        for f in reads:
            made = [j for j, (_, writes) in enumerate(io) if f in writes]
            assert not made or min(made) <= i, f"{f}: read before any kernel writes it"
    t = stage.backward_traffic(1, 8192, 32, 128)
    work = stage.backward_bytes(1, 8192, 32, 128)
    written = sum(w for _, w in t.values())
    # the workspace and gradients, each written once, but u's buffer twice (u, then vcorr over it)
    assert written == work["total"] + stage._buffer_bytes(1, 8192, 32, 128)["vcorr"]


def test_the_floors_and_loss_curves_come_from_their_records(monkeypatch):
    """nb.backward_floors at the recorded shape: each kernel's time over a floor of at least its bytes; the chains'
    floor is their chain's. nb.loss_curves recomputes the gaps from the curves and fails where the record's differ
    (a record whose kernel gap was edited, planted)."""
    import copy

    import matplotlib

    matplotlib.use("Agg")
    from common import notebook as nb
    from common import results

    df = nb.backward_floors()
    assert list(df.index) == ["B1 prepare", "B2, B3 chains", "B4 adjoint"]
    assert (df["x its floor"] >= 1).all() and (df["ms"] > df["bytes floor ms"]).all()
    assert df.loc["B2, B3 chains", "bound by"] == "the chain"
    _, gaps = nb.loss_curves()
    assert gaps["gap"].max() > 0
    real = results.recorded

    def edited(record, device_dir):
        data = copy.deepcopy(real(record, device_dir))
        data["kernel_gap"]["0"] /= 2
        return data

    monkeypatch.setattr(results, "recorded", edited)
    with pytest.raises(nb.CheckFailed):
        nb.loss_curves()
