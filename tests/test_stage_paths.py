"""Stages 08 and 09 have two paths (K1 + K2 in segments of the sequence, or the
fused kernel) and pick one per call. Every path is checked on its own, whatever
the rule would pick for the shape: against the fp64 reference and the previous
stage (tolerance); the split path bitwise against stage 07 (same roundings),
the fused path (MUFU approximations in its prepare) within nb.FUSED_VS_PREVIOUS
(1e-3) of the previous stage; the segments (many of them at short T, bitwise);
the rule's choice by size; a path that does not exist for the sizes is refused
with a named error. The GPU tests are marked gpu; the argument checks run
anywhere."""

import inspect
from contextlib import nullcontext

import pytest
import torch

from common import checks
from common import notebook as nb  # the notebook's paths check holds every path to the same promises
from common.metrics import rel_err
from common.stages import load_stage, path_stages, previous, selected_ids
from common.stages import stage as ladder_stage

PATH_STAGES = selected_ids(path_stages())  # 08-12: every stage with PATHS (KDALAB_STAGES=12: one of them)
FUSED_STAGES = [s for s in PATH_STAGES if "fused8" in load_stage(s).PATHS]
PATH_CASES = [
    checks.Case(2, 257, 3, 128, 128, chunk=16, gate="bounded", lower_bound=-5.0, seed=81),          # tail chunk, h0
    checks.Case(1, 100, 5, 64, 64, chunk=16, gate="bounded", lower_bound=-2.0, h0=False, seed=82),  # T < 7 chunks
    # the split path in five segments of the sequence (SEGMENT_CHUNKS = 64 each, the last a tail), h0
    checks.Case(1, 2 * 2048 + 40, 2, 64, 64, chunk=16, gate="bounded", lower_bound=-5.0, seed=83),
]


@pytest.fixture(params=PATH_STAGES)
def sid(request):
    return request.param


def test_path_names_are_checked_before_anything_runs(sid):
    S = load_stage(sid)
    with pytest.raises(ValueError, match="path must be one of"):
        with S.path("fused3"):
            pass
    with pytest.raises(ValueError, match="segment_chunks must be a positive int"):
        with S.path("split1", segment_chunks=0):
            pass
    if "long_from" in inspect.signature(S.path).parameters:  # the packed-sequence stages' hybrid
        with pytest.raises(ValueError, match="long_from must be an int >= 0"):
            with S.path(long_from=-1):
                pass
        with pytest.raises(ValueError, match="long_from .the hybrid. needs a fused path, got the split path 'split2'"):
            with S.path("split2", long_from=100):
                pass
        with S.path("fused2", long_from=100):
            assert S._path_args(128)["long_from"] == 100
        assert S._path_args(128)["long_from"] == -1  # the rule's, outside the block


@pytest.mark.parametrize("pin_sid", [s for s in PATH_STAGES if hasattr(load_stage(s), "u_halves")])
def test_the_products_and_u_pins_are_checked_and_reach_the_extension(pin_sid):
    """Stage 12's pins of its variants (which instantiation the launcher runs): a wrong value is
    refused by name; a right one is what the extension is called with inside the block, and the
    gate's own choice (-1) outside it."""
    S = load_stage(pin_sid)
    with pytest.raises(TypeError, match="pairwise must be True, False or None, got 1"):
        with S.pairwise(1):
            pass
    with pytest.raises(TypeError, match="u_halves must be True, False or None, got 1"):
        with S.u_halves(1):
            pass
    assert S._path_args(128)["pairwise"] == -1 and S._path_args(128)["u_halves"] == -1
    with S.pairwise(True), S.u_halves(False):
        assert S._path_args(128)["pairwise"] == 1 and S._path_args(128)["u_halves"] == 0
    with S.u_halves(True):
        assert S._path_args(128)["u_halves"] == 1
    assert S._path_args(128)["pairwise"] == -1 and S._path_args(128)["u_halves"] == -1
    with pytest.raises(TypeError, match="deep_ring must be True, False or None, got 1"):
        with S.deep_ring(1):
            pass
    assert S._path_args(64)["deep_ring"] == -1
    with S.deep_ring(True):
        assert S._path_args(64)["deep_ring"] == 1
        with S.deep_ring(False):
            assert S._path_args(64)["deep_ring"] == 0
    assert S._path_args(64)["deep_ring"] == -1


def test_a_pinned_path_too_wide_for_v_is_refused_before_the_extension(monkeypatch, sid):
    from common.inputs import make_inputs

    S = load_stage(sid)
    wide = max(S.PATHS, key=lambda n: S.PATHS[n][1])  # fused8, or split2 where there is no fused path
    V = 16 * S.PATHS[wide][1] // 2
    kw = make_inputs(1, 20, 1, V, V, dtype=torch.bfloat16, gate="bounded", lower_bound=-5.0, chunk_size=16)
    with S.path(wide), pytest.raises(ValueError, match=f"path '{wide}'.*needs V >= {2 * V}, got V = {V}"):
        S.forward(**kw)  # on the CPU: it must fail before any build or device check


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name", list(load_stage("09").PATHS))
def test_every_path_is_correct_and_equal_to_the_previous_stage(sid, name, case):
    if name == "fused8" and case.V < 128:
        pytest.skip("fused8 needs V = 128 (test_fused8_refuses_v64)")
    S, pid = load_stage(sid), previous(sid)
    if name not in S.PATHS:
        pytest.skip(f"stage {sid} has no path {name}")
    P = load_stage(pid)
    inp = checks.case_inputs(case, "cpu", torch.bfloat16)
    with S.path(name):
        got = checks.run(S.forward, inp, "cuda", backward=False)
        # read right after the call: the check below runs the previous stage too, whose launches may replace the log
        kernels = {x["kernel"] for x in S.build().launches()}
    with S.path(name):
        rows = checks.check_case(S, case, device="cuda", prev=None)  # against fp64; the previous stage below
    assert kernels == (nb.FUSED_KERNELS if name.startswith("fused") else nb.SPLIT_KERNELS), kernels
    bad = [r for r in rows if not r["ok"]]
    assert not bad, checks.format_rows(bad)
    # the previous stage's same path where it has one (09 against 08), else its rule (08 against 07)
    with (P.path(name) if name in getattr(P, "PATHS", {}) else nullcontext()):
        ref = checks.run(P.forward, inp, "cuda", backward=False)
    if checks.same_bits(S):  # a stage that declares the previous stage's bits has them on every path
        assert torch.equal(got["o"], ref["o"]) and torch.equal(got["S"], ref["S"]), f"not bitwise stage {pid}"
    if name.startswith("split"):
        s07 = ref if pid == "07" else checks.run(load_stage("07").forward, inp, "cuda", backward=False)
        for r, who in ((ref, pid), (s07, "07")):
            assert torch.equal(got["o"], r["o"]) and torch.equal(got["S"], r["S"]), f"not bitwise equal to stage {who}"
    else:  # only the prepare's MUFU approximations (08) and its sums' order (09) differ: bf16 outputs round apart
        for n in ("o", "S"):
            err = rel_err(got[n], ref[n])
            assert err <= nb.FUSED_VS_PREVIOUS, f"{n}: fused path {err:.1e} from stage {pid}"


@gpu
@pytest.mark.parametrize("seg", [1, 3])
@pytest.mark.parametrize("case", PATH_CASES[:2], ids=lambda c: c.id)
def test_split_path_in_short_segments_is_bitwise_stage07(sid, case, seg):
    """The split path runs K1 + K2 once per segment of ``seg`` chunks, each K2 block
    starting from the state the last segment left in ht: one launch pair per segment
    and the same bits as stage 07's single pass, outputs poisoned before the call."""
    S = load_stage(sid)
    inp = checks.case_inputs(case, "cuda", torch.bfloat16)
    nt = -(-case.T // 16)
    with S.path("split1", segment_chunks=seg):
        got = checks.run(S.forward, inp, "cuda", backward=False)
        kernels = [x["kernel"] for x in S.build().launches()]
    assert kernels == ["kda_prepare_kernel", "kda_recurrence_kernel"] * -(-nt // seg), kernels
    ref = checks.run(load_stage("07").forward, inp, "cuda", backward=False)
    assert torch.equal(got["o"], ref["o"]) and torch.equal(got["S"], ref["S"]), "not bitwise equal to stage 07"


@gpu
def test_the_default_segment_bounds_the_split_workspace(sid):
    """At 259 chunks the split path launches five K1 + K2 pairs (segments of
    SEGMENT_CHUNKS = 64, two workspace buffers) and needs much less memory than
    in one segment of the whole sequence."""
    S = load_stage(sid)
    case = PATH_CASES[2]
    inp = checks.case_inputs(case, "cuda", torch.bfloat16)
    nt = -(-case.T // 16)
    peaks = {}
    for seg in (None, nt):
        with S.path("split1", segment_chunks=seg):
            S.forward(**inp)  # built and warm
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            S.forward(**inp)
            torch.cuda.synchronize()
            peaks[seg] = torch.cuda.max_memory_allocated() - base
            launches = len(S.build().launches())
        assert launches == 2 * -(-nt // (seg or S.SEGMENT_CHUNKS)), (seg, launches)
    assert peaks[None] < 0.75 * peaks[nt], peaks  # workspace 2 x 64 vs 259 chunks, plus o


@gpu
@pytest.mark.parametrize("sid", FUSED_STAGES)
def test_fused8_refuses_v64(sid):
    S = load_stage(sid)
    case = PATH_CASES[1]
    inp = checks.case_inputs(case, "cuda", torch.bfloat16)
    with S.path("fused8"), pytest.raises(ValueError, match="path 'fused8'.*needs V >= 128"):
        S.forward(**inp)


@gpu
def test_rule_picks_the_split_width_by_the_sm_count(sid):
    """The rule (kda_fwd_plan): the split path, two compute warps per K2 block once
    B*H*V/32 blocks cover the SMs (K2's grid tells the width: B*H*V/(16*ncw))."""
    S = load_stage(sid)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for H, ncw in ((sms // 2, 2), (sms // 2 - 1, 1), (2, 1)):  # K = V = 64: B*H*2 blocks of two warps
        inp = checks.case_inputs(checks.Case(1, 40, H, 64, 64, chunk=16, gate="bounded", lower_bound=-5.0),
                                 "cuda", torch.bfloat16)
        S.forward(**inp)
        k2 = [x for x in S.build().launches() if x["kernel"] == "kda_recurrence_kernel"]
        assert len(k2) == 1 and k2[0]["grid"] == H * 64 // (16 * ncw), (H, ncw, S.build().launches())


@gpu
@pytest.mark.parametrize("sid", [s for s in FUSED_STAGES if hasattr(load_stage(s), "SPLIT_NCW_V128")])
def test_rule_split_width_at_v128(sid):
    """A stage that widens the split path at V = 128 (SPLIT_NCW_V128, stage 12: where the
    serial chain binds) launches K2 with that many compute warps per block from the heads
    whose one-warp blocks would cover half the SMs (H * 8 >= SMs / 2) to the most heads below
    fused4's range, where the SM count alone gives one; with fewer heads, one."""
    S = load_stage(sid)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    first = -(-sms // 16)  # the fewest heads with 2 * H * 128 / 16 >= SMs
    for H, ncw in ((2, 1), (first - 1, 1), (first, S.SPLIT_NCW_V128), (-(-sms // 3) - 1, S.SPLIT_NCW_V128)):
        inp = checks.case_inputs(checks.Case(1, 40, H, 128, 128, chunk=16, gate="bounded", lower_bound=-5.0),
                                 "cuda", torch.bfloat16)
        S.forward(**inp)
        k2 = [x for x in S.build().launches() if x["kernel"] == "kda_recurrence_kernel"]
        assert len(k2) == 1 and k2[0]["grid"] == H * 128 // (16 * ncw), (H, ncw, S.build().launches())


@gpu
@pytest.mark.parametrize("sid", [s for s in PATH_STAGES if hasattr(load_stage(s), "LONE_RING64")])
def test_k64_ring_is_deeper_where_each_k2_block_has_an_sm(sid):
    """At K = 64, K2's ring has LONE_RING64 slots where its blocks fit on the SMs one each
    (3 heads) and that ring fits a block's shared memory, 4 where the blocks do not fit (as
    many heads as SMs): read from the launch log's dynamic shared memory (S slots and two
    barriers each), and the depth changes no bit (the 3 heads' outputs bitwise those of the
    same heads inside the larger call)."""
    from common.inputs import make_inputs

    S = load_stage(sid)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    big = make_inputs(2, 100, sms, 64, 64, seed=3, dtype=torch.bfloat16, device="cuda", gate="softplus", chunk_size=16)
    small = dict(big)
    for name in ("q", "k", "v", "g"):
        small[name] = big[name][:, :, :3].contiguous()
    small.update(beta=big["beta"][:, :, :3].contiguous(), A_log=big["A_log"][:3].contiguous(),
                 dt_bias=big["dt_bias"][:3].contiguous(), initial_state=big["initial_state"][:, :3].contiguous())
    got = {}
    for name, kw in (("small", small), ("big", big)):
        with torch.no_grad(), S.path("split2"):
            o, ht = S.forward(**kw)
        k2 = [x for x in S.build().launches() if x["kernel"] == "kda_recurrence_kernel"]
        assert len(k2) == 1, S.build().launches()
        got[name] = (o[:, :, :3], ht[:, :3], k2[0])
    assert got["small"][2]["grid"] <= sms < got["big"][2]["grid"], (got["small"][2], got["big"][2])
    per_slot = got["big"][2]["dynamic_smem"] / 4  # common.cuh kStagesFor<64> = 4
    optin = getattr(torch.cuda.get_device_properties(0), "shared_memory_per_block_optin", None)
    deep_fits = optin is None or per_slot * S.LONE_RING64 <= optin  # a part with less per block keeps 4 slots
    want = S.LONE_RING64 if deep_fits else 4
    assert got["small"][2]["dynamic_smem"] == per_slot * want, (got["small"][2], got["big"][2])
    assert torch.equal(got["small"][0], got["big"][0]) and torch.equal(got["small"][1], got["big"][1])
    if not hasattr(S, "deep_ring"):
        return
    # the switch: each depth pinned where the rule takes the other, the launch's shared memory says which ran,
    # and no bit changes
    for name, kw, pin, slots in (("small", small, False, 4), ("big", big, True, S.LONE_RING64 if deep_fits else 0)):
        if not slots:
            continue
        with torch.no_grad(), S.path("split2"), S.deep_ring(pin):
            o, ht = S.forward(**kw)
        k2 = [x for x in S.build().launches() if x["kernel"] == "kda_recurrence_kernel"]
        assert k2[0]["dynamic_smem"] == per_slot * slots, (name, pin, k2)
        assert torch.equal(o[:, :, :3], got[name][0]) and torch.equal(ht[:, :3], got[name][1]), name
    k128 = make_inputs(1, 40, 2, 128, 128, seed=4, dtype=torch.bfloat16, device="cuda", gate="softplus", chunk_size=16)
    with pytest.raises(ValueError, match="deep_ring.True. pins the 8-slot ring, which is K = 64's"):
        with torch.no_grad(), S.deep_ring(True):
            S.forward(**k128)


@gpu
@pytest.mark.parametrize("sid", FUSED_STAGES)
def test_rule_takes_the_fused_kernel_where_its_blocks_fill_the_sms(sid):
    """The rule at V = 128: the fused kernel with 8 compute warps (grid B*H) once
    3 B*H >= 2 SMs, with 4 (grid 2 B*H) where SMs <= 3 B*H and 2 B*H <= SMs, the
    split path elsewhere; V = 64 stays split at any B*H."""
    S = load_stage(sid)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    h8 = -(-2 * sms // 3)  # the fewest heads that take fused8
    h4 = -(-sms // 3)      # the fewest heads that take fused4
    cases = ((h8, 128, 8), (h8 - 1, 128, None), (sms // 2, 128, 4), (h4, 128, 4), (h4 - 1, 128, None),
             (2 * sms, 64, None))
    for H, KV, ncw in cases:
        inp = checks.case_inputs(checks.Case(1, 40, H, KV, KV, chunk=16, gate="bounded", lower_bound=-5.0),
                                 "cuda", torch.bfloat16)
        S.forward(**inp)
        launched = S.build().launches()
        kernels = {x["kernel"] for x in launched}
        if ncw:
            assert kernels == nb.FUSED_KERNELS and launched[0]["grid"] == H * KV // (16 * ncw), (H, KV, launched)
        else:
            assert kernels == nb.SPLIT_KERNELS, (H, KV, launched)


@gpu
def test_path_rows_time_every_path_and_pass_the_notebook_checks(sid):
    """common.bench.path_rows (scripts/bench_paths.py and the notebook's live
    table): the previous stage, the rule and every path that exists for V, each
    checked as the notebook checks it (common.notebook.path_problems)."""
    from common import bench
    from common.notebook import path_problems

    S, pid = load_stage(sid), previous(sid)
    rows = bench.path_rows(sid, dict(B=1, T=100, H=3, K=64, V=64), budget_s=0.05, flashkda=False)
    assert [(r["stage"], r["path"]) for r in rows] == [(pid, "rule"), (sid, "rule")] + [
        (sid, p) for p in S.PATHS if p != "fused8"]  # 8 compute warps need V = 128
    problems = {(r["stage"], r["path"]): path_problems(r, pid) for r in rows}
    assert not any(problems.values()), problems
    assert all(r[f"equal_to_{pid}"] for r in rows if r["path"] in ("rule", "split1", "split2"))
    prev_paths = getattr(load_stage(pid), "PATHS", {})
    if prev_paths:  # held to the previous stage's same path where it has it (08: split only), else to its rule
        assert [r.get("vs_path") for r in rows[1:]] == ["rule"] + [
            p if p in prev_paths else "rule" for p in S.PATHS if p != "fused8"]
    assert all(r["peak_mb"] > 0 and r["fwd_ms"] > 0 for r in rows)
