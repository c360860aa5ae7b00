"""Stage 12's pairwise products, the scheme on the CPU (no GPU needed).

`products_pairwise` (stages/12_softplus/prepare.cuh) cuts the chunk's 16 x 16 lower
triangle into ten 4 x 4 tiles listed by two packed constants, sends each off-diagonal
tile through a reference row, and leaves value l of a tile on lane l after a warp
reduce-scatter. These tests read the tile table from the source and replay the
scheme in float64 -- the tiles, the reference rows, the lane that ends with each
value -- against the direct sum at the gate's extremes, so that a wrong tile, a
reference row outside a pair's span or a wrong lane mapping fails here before any
GPU runs it (the GPU checks then hold the kernel itself to fp64).
"""

import re

import torch

from common.paths import STAGES_DIR

SRC = (STAGES_DIR / "12_softplus" / "prepare.cuh").read_text()
BT = 16


def tile_table():
    n = int(re.search(r"constexpr int kTiles = (\d+);", SRC).group(1))
    ti, tj = (int(x, 16) for x in re.search(r"kTileI = 0x([0-9a-fA-F]+)ull, kTileJ = 0x([0-9a-fA-F]+)ull", SRC).groups())
    return [((ti >> (4 * t)) & 15, (tj >> (4 * t)) & 15) for t in range(n)]


def test_the_tiles_cover_the_lower_triangle_once():
    tiles = tile_table()
    assert sorted(tiles) == sorted((i, j) for i in range(4) for j in range(i + 1)), tiles
    # warp w takes tiles w, w + 4, w + 8: at most three per warp
    assert max(len(range(w, len(tiles), 4)) for w in range(4)) == 3


def reduce_scatter(acc):
    """acc [32 lanes, 32 values] -> the value each lane holds after the levels 16 .. 1."""
    acc = acc.clone()
    off = 16
    while off:
        new = acc.clone()
        for lane in range(32):
            up, p = bool(lane & off), lane ^ off
            for x in range(off):
                keep = acc[lane, x + off] if up else acc[lane, x]
                send = acc[p, x] if (p & off) else acc[p, x + off]  # what the partner does not keep
                new[lane, x] = keep + send
        acc, off = new, off // 2
    return acc[:, 0]


def pairwise(gc, kn, qn, K):
    """The kernel's scheme in float64: L[i, j] (i > j, no beta) and Aqk[i, j] (i >= j, no scale)."""
    L = torch.zeros(BT, BT, dtype=torch.float64)
    A = torch.zeros(BT, BT, dtype=torch.float64)
    for I, J in tile_table():
        acc = torch.zeros(32, 32, dtype=torch.float64)
        for lane in range(32):
            for d in range(lane, K, 32):
                gj, kj = gc[4 * J:4 * J + 4, d], kn[4 * J:4 * J + 4, d].clone()
                if I != J:
                    gr = gc[4 * I, d]
                    fj = torch.exp(gr - gj)
                    assert (fj <= 1).all()  # the reference row is at or after every column of the tile
                    kj = kj * fj
                    for ii in range(4):
                        fi = torch.exp(gc[4 * I + ii, d] - gr)
                        assert fi <= 1
                        acc[lane, ii * 4:ii * 4 + 4] += kn[4 * I + ii, d] * fi * kj
                        acc[lane, 16 + ii * 4:16 + ii * 4 + 4] += qn[4 * I + ii, d] * fi * kj
                else:
                    for ii in range(4):
                        for jj in range(ii + 1):
                            f = torch.exp(gj[ii] - gj[jj])
                            assert f <= 1
                            acc[lane, ii * 4 + jj] += kj[ii] * kj[jj] * f
                            acc[lane, 16 + ii * 4 + jj] += qn[4 * I + ii, d] * kj[jj] * f
        val = reduce_scatter(acc)
        for lane in range(32):  # the kernel's store: lane l holds value l = (which, ii, jj)
            i, j = 4 * I + ((lane >> 2) & 3), 4 * J + (lane & 3)
            if lane < 16 and i > j:
                L[i, j] = val[lane]
            elif lane >= 16 and i >= j:
                A[i, j] = val[lane]
    return L, A


def test_the_scheme_is_the_direct_sum_at_the_gates_extremes():
    gen = torch.Generator().manual_seed(0)
    K = 64
    a = -400.0 * torch.rand(BT, K, generator=gen, dtype=torch.float64)  # the softplus gate at A_log = 3
    a[3:6] = -1e-3  # and tokens that hardly decay
    gc = a.cumsum(0)
    kn, qn = (torch.randn(BT, K, generator=gen, dtype=torch.float64) for _ in range(2))
    assert torch.isinf(torch.exp(-gc.float())).any()  # the factored form's exp(-gc) overflows here
    L, A = pairwise(gc, kn, qn, K)
    decay = torch.exp((gc[:, None, :] - gc[None, :, :]).clamp(max=0))  # exp(gc_i - gc_j), i >= j
    direct = torch.einsum("id,jd,ijd->ij", kn, kn, decay)
    directA = torch.einsum("id,jd,ijd->ij", qn, kn, decay)
    assert torch.allclose(L, torch.tril(direct, -1), rtol=1e-12, atol=1e-12)
    assert torch.allclose(A, torch.tril(directA), rtol=1e-12, atol=1e-12)
    assert torch.isfinite(L).all() and torch.isfinite(A).all()


def test_wide_chunks_counts_the_chunks_past_the_factored_range():
    """stage.wide_chunks: a chunk is wide when one key dimension decays by more than
    FACTORED_RANGE (the value kernel's kFactoredRange holds) over its 16 tokens; the tail
    chunk counts, and packed sequences are cut at their own boundaries."""
    from common.stages import load_stage

    stage = load_stage("12")
    src = (STAGES_DIR / "12_softplus" / "common.cuh").read_text()
    assert float(re.search(r"constexpr float kFactoredRange = ([0-9.]+)f;", src).group(1)) == stage.FACTORED_RANGE
    a = torch.full((2, 40, 3, 8), -0.1, dtype=torch.float64)  # 16 x 0.1: far inside the range
    a[1, 33, 2, 5] = -79.5                                      # tail chunk (8 tokens) of row 1, head 2: 80.2
    assert stage.wide_chunks(a) == (1, 2 * 3 * 3)
    a[1, 33, 2, 5] = -79.0                                      # 79.7: inside
    assert stage.wide_chunks(a) == (0, 18)
    a[0, 15, 0, 0] = -80.0                                      # chunk 0 of row 0, head 0: 81.5
    assert stage.wide_chunks(a) == (1, 18)
    # packed: one sequence of 10 and one of 30 tokens -> 1 + 2 chunks per head; the
    # decay at token 15 now lies in the second sequence's first chunk (tokens 10-25)
    packed = a[:1].clone()
    assert stage.wide_chunks(packed, cu_seqlens=torch.tensor([0, 10, 40])) == (1, 3 * 3)
    packed[0, 15, 0, 0] = -0.1
    packed[0, 5, 1, 7] = -80.0                                  # first sequence, head 1: 80.9
    assert stage.wide_chunks(packed, cu_seqlens=torch.tensor([0, 10, 40])) == (1, 9)


def test_the_one_wide_chunk_inputs_have_one_wide_chunk():
    """The GPU test of the choice per chunk (test_pairwise_only_where_a_chunk_needs_it) runs
    on checks.one_wide_chunk_inputs: exactly one chunk past the factored range, decaying by
    more than fp32's exp reaches (so the factored products would overflow there), every
    other chunk well inside the range (so the choice has narrow chunks to factor)."""
    from common import checks
    from common.reference import log_decay
    from common.stages import load_stage

    stage = load_stage("12")
    inp = checks.one_wide_chunk_inputs()
    a = log_decay(*(inp[n].double() for n in ("g", "A_log", "dt_bias")))
    wide, total = stage.wide_chunks(a)
    assert (wide, total) == (1, 2 * 3 * 17), (wide, total)
    decay = -a[1, 32:48, 0].sum(0)  # [K]: that chunk's decay per key dimension
    assert decay.min() > 88.7  # exp(88.7) > fp32's largest
    a_rest = a.clone()
    a_rest[1, 32:48, 0] = 0
    assert stage.wide_chunks(a_rest) == (0, total)
