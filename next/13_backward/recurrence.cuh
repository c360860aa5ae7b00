// recurrence.cuh -- the recurrence: recurrence_warp, the serial chain of one
// compute warp over the ring of prepared chunks (K2 and the fused kernel run it),
// and kda_recurrence_kernel, K2 of the split path (a load warp fills the ring
// from the workspace).
#pragma once

#include "common.cuh"

namespace kda_stage {

// ---------------------------------------------------------------------------
// recurrence_warp -- the serial chain of one compute warp over the chunks
// n_first .. n_first + n_count - 1 of sequence s, head h (bh = i * H + h) for the
// 16 value columns cw0 .. cw0 + 15, reading each chunk from the ring slot that the
// producer (K2's load warp, or the fused kernel's prepare warps) filled:
//   S = h0[:, cols] (or 0)
//   for n in chunks:  vcorr = u - w @ S
//                     o     = qd @ S + Aqk @ vcorr        (rows t < len written, bf16)
//                     S     = diag(exp(glast)) S + kr^T @ vcorr
//   ht[:, cols] = S
// n_count may be 0 (an empty sequence: ht = h0, or 0). The state is slot bh of h0
// and ht, [K, V] (state_v_first: [V, K], element (d, col) at col * K + d).
// cw is the warp's index among the block's compute warps (its columns of the
// slot's u). Profile: compute warp 0's lane 0 times the K2 regions, slot =
// block index.
// ---------------------------------------------------------------------------
template <int K, int V, int NCW, int S>
__device__ __forceinline__ void recurrence_warp(K2Smem<K, NCW, S>& sm, const KdaFwdParams& p, int bh,
                                                const SeqSpan& seq, int cw0, int cw, int lane, int n_first,
                                                int n_count) {
  constexpr int kStages = S;
  const int h = bh % p.H;
  const bool timer = cw == 0 && lane == 0;
  (void)timer;
  WarpMma mma;
  auto thr_mma = mma.get_slice(lane);
  Tensor cO = make_identity_tensor(Shape<Int<BT>, Int<VW>>{});   // (BT,VW) -> (c, vd)
  Tensor cS = make_identity_tensor(Shape<Int<K>, Int<VW>>{});    // (K,VW)  -> (d, vd)
  Tensor tCcO = thr_mma.partition_C(cO);    // (MMA,1,2)    this lane's (c, vd) elements
  Tensor tCcS = thr_mma.partition_C(cS);    // (MMA,K/16,2) this lane's (d, vd) elements
  // Register-resident operands of the warp (nothing of the chain is in shared memory):
  Tensor rS = thr_mma.partition_fragment_C(cS);  // fp32 state S (d, vd), accumulator of the S update
  Tensor rSb = b_fragment<VW, K>(thr_mma);
                                                 // (MMA,2,K/16) bf16: S as the B operand of w @ S, qd @ S
  Tensor rVc = b_fragment<VW, BT>(thr_mma);
                                                 // (MMA,2,1) bf16: vcorr as the B operand of
                                                 //   Aqk @ vcorr and kr^T @ vcorr
  // C-fragment elements come in pairs of adjacent columns (e, e + 1): (c, vd), (c, vd + 1).
  static_assert(size<0>(decltype(tCcO.layout()){}) == 4, "SM80 16x8 accumulator: 4 values per lane");

  {  // S = h0[:, cols] (or 0), and its bf16 B fragment
    const float* h0 = p.h0 ? p.h0 + (size_t)bh * K * V : nullptr;
    CUTE_UNROLL
    for (int e = 0; e < size(rS); e += 2) {
      const int d = get<0>(tCcS(e)), vd = get<1>(tCcS(e));
      const float2 s2 = !h0 ? make_float2(0.f, 0.f)
                        : p.state_v_first ? make_float2(h0[(size_t)(cw0 + vd) * K + d], h0[(size_t)(cw0 + vd + 1) * K + d])
                                          : *reinterpret_cast<const float2*>(h0 + (size_t)d * V + cw0 + vd);
      rS(e) = s2.x;
      rS(e + 1) = s2.y;
    }
    c_to_b(rS, rSb);
  }

  bf16* o = reinterpret_cast<bf16*>(p.o);
  const size_t o_row = (size_t)p.H * V;  // elements between tokens t and t + 1 of o
  bf16* o_base = o + token_row(p, seq, 0, h) * V + cw0;  // token 0 of the sequence, head h
  KDA_PROF_START(tp);

  for (int m = 0; m < n_count; ++m) {  // chunk n = n_first + m of the sequence, the ring's m-th
    const int s = m % kStages;
    K2Slot<K, NCW>& st = sm.slot[s];
    const int t0 = (n_first + m) * BT;
    mbar_wait(&sm.full[s], (m / kStages) & 1);  // chunk n is in slot s
    if (timer) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_WAIT, tp);

    // ---- w @ S and qd @ S   (two C tiles (BT, VW); both read only S, so their MMAs
    //      are issued back to back and overlap in the tensor-core pipeline) ----
    Tensor accV = thr_mma.partition_fragment_C(cO);
    clear(accV);
    mma_smem_reg(mma, lane, smem_rows<BT, K, K + kPad>(&st.w[0][0]), rSb, accV);
    if (timer) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_WS, tp);
    Tensor accO = thr_mma.partition_fragment_C(cO);
    clear(accO);
    mma_smem_reg(mma, lane, smem_rows<BT, K, K + kPad>(&st.qd[0][0]), rSb, accO);
    if (timer) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_QS, tp);

    // ---- vcorr = u - w @ S in the accumulator (u read as float2), then one
    //      movmatrix per quadrant makes it the B operand of both vcorr products ----
    CUTE_UNROLL
    for (int e = 0; e < size(accV); e += 2) {
      const int c = get<0>(tCcO(e)), vd = get<1>(tCcO(e));
      const float2 u2 = *reinterpret_cast<const float2*>(&st.u[c][cw * VW + vd]);
      accV(e) = u2.x - accV(e);
      accV(e + 1) = u2.y - accV(e + 1);
    }
    c_to_b(accV, rVc);
    if (timer) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_VCORR, tp);

    // ---- o = qd @ S + Aqk @ vcorr ----
    mma_smem_reg(mma, lane, smem_rows<BT, BT, BT + kPad>(&st.Aqk[0][0]), rVc, accO);
    if (timer) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_AV, tp);
    CUTE_UNROLL
    for (int e = 0; e < size(accO); e += 2) {  // rows of real tokens -> global, bf16x2
      const int c = get<0>(tCcO(e)), vd = get<1>(tCcO(e));
      if (t0 + c < seq.len)
        *reinterpret_cast<__nv_bfloat162*>(o_base + (size_t)(t0 + c) * o_row + vd) =
            __floats2bfloat162_rn(accO(e), accO(e + 1));
    }
    if (timer) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_OSTORE, tp);

    // ---- S = diag(exp(glast)) S + kr^T @ vcorr: decay in place, then accumulate ----
    {  // lane (g, t) holds rows d = 16 mt + g + 8 (v / 2) of S: el[g + 8 j] with j = 2 mt + v / 2
      float elv[K / 8];  // stored at el_index (decay_columns): K/32 16-byte loads
      CUTE_UNROLL
      for (int i = 0; i < K / 32; ++i) {
        const float4 x = *reinterpret_cast<const float4*>(&st.el[(lane / 4) * (K / 8) + 4 * i]);
        elv[4 * i] = x.x, elv[4 * i + 1] = x.y, elv[4 * i + 2] = x.z, elv[4 * i + 3] = x.w;
      }
      CUTE_UNROLL
      for (int mt = 0; mt < size<1>(rS); ++mt)
        CUTE_UNROLL
        for (int nt = 0; nt < size<2>(rS); ++nt)
          CUTE_UNROLL
          for (int v = 0; v < 4; ++v) rS(v, mt, nt) *= elv[2 * mt + v / 2];
    }
    if (timer) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_DECAY, tp);
    mma_smem_reg(mma, lane, smem_rows<K, BT, BT + kPad>(&st.krT[0][0]), rVc, rS);
    if (timer) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_KV, tp);

    // every read of slot s is done: hand it back to the producer (for chunk n + kStages;
    // after the last chunks nobody waits, and the arrival is harmless)
    mbar_arrive(&sm.empty[s]);
    c_to_b(rS, rSb);  // the new state as next chunk's B operand (movmatrix, no shared memory)
    if (timer) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_SCOPY, tp);
  }

  // ---- final state: ht[:, cols] = S (float2 stores) ----
  float* ht = p.ht + (size_t)bh * K * V;
  CUTE_UNROLL
  for (int e = 0; e < size(rS); e += 2) {
    const int d = get<0>(tCcS(e)), vd = get<1>(tCcS(e));
    if (p.state_v_first) {
      ht[(size_t)(cw0 + vd) * K + d] = rS(e);
      ht[(size_t)(cw0 + vd + 1) * K + d] = rS(e + 1);
    } else {
      *reinterpret_cast<float2*>(ht + (size_t)d * V + cw0 + vd) = make_float2(rS(e), rS(e + 1));
    }
  }
}

// ---------------------------------------------------------------------------
// kda_recurrence_kernel -- the serial chain over the segment's chunks of one
// (sequence, head) and the 16 * NCW value columns col0 ..:
//   S = h0[:, cols] (or 0)
//   for n in the sequence's chunks of the segment:  vcorr = u - w @ S
//                     o     = qd @ S + Aqk @ vcorr        (rows t < len written, bf16)
//                     S     = diag(exp(glast)) S + kr^T @ vcorr
//   ht[:, cols] = S
// The segment is chunks n0 .. n0 + NC - 1 of the longest sequence; sequence i has
// count = min(NC, NT_i - n0) of them. A block whose sequence ended before the
// segment (count <= 0, n0 > 0) returns at once: ht already holds its final state.
// In the first segment (n0 = 0) an empty sequence (count 0) still writes ht = h0 (or 0).
// grid = NH*V/(16*NCW) blocks (block = bh * (V / (16*NCW)) + slice), S slots in the ring,
// block = 32 * (NCW + 1) threads: warps 0 .. NCW-1 compute (warp w owns columns
// col0 + 16w .. col0 + 16w + 15), warp NCW loads. dynamic smem = sizeof(K2Smem<K, NCW, S>).
// Profile: slot = block index; compute warp 0's lane 0 times the compute
// regions, the load warp's lane 0 the load-warp regions.
// ---------------------------------------------------------------------------
template <int K, int V, int NCW, int S>
__global__ void __launch_bounds__(32 * (NCW + 1)) kda_recurrence_kernel(const __grid_constant__ KdaFwdParams p) {
  constexpr int VC = VW * NCW;               // value columns per block
  constexpr int NS = V / VC;                 // column slices per head
  constexpr int kStages = S;                 // the ring's slots
  static_assert(K % 16 == 0 && V % VC == 0, "K multiple of 16, V multiple of 16 * NCW");
  extern __shared__ __align__(16) unsigned char kda_smem[];
  K2Smem<K, NCW, S>& sm = *reinterpret_cast<K2Smem<K, NCW, S>*>(kda_smem);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int bh = (int)(blockIdx.x / NS), col0 = (int)(blockIdx.x % NS) * VC;
  const SeqSpan seq = seq_span(p, bh / p.H);
  // the sequence's chunks of the segment n0 .. n0 + NC - 1 (workspace slots 0 .. NC - 1)
  const int n_count = min(p.NC, chunks_of(seq) - p.n0);
  if (n_count <= 0 && p.n0 > 0) return;  // ended in an earlier segment (the whole block: uniform)
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&sm.full[s], 32);
      mbar_init(&sm.empty[s], 32 * NCW);
    }
  }
  __syncthreads();  // the barriers exist before any warp uses them (the only block-wide barrier)
  KDA_PROF_START(tp);

  const WarpRole role = warp == NCW ? WarpRole::kLoad : WarpRole::kCompute;
  if (role == WarpRole::kLoad) {
    // =================== the load warp: producer of the ring ===================
    const bf16* gQd = reinterpret_cast<const bf16*>(p.qd);
    const bf16* gW = reinterpret_cast<const bf16*>(p.w);
    const bf16* gKrT = reinterpret_cast<const bf16*>(p.krT);
    const bf16* gAqk = reinterpret_cast<const bf16*>(p.Aqk);
    // Issue chunk m into its slot (one warp, 16-byte cp.async per lane).
    auto issue = [&](int m) {
      K2Slot<K, NCW>& st = sm.slot[m % kStages];
      const size_t chunk = (size_t)bh * p.NC + m;
      async_tile<BT, K, K + kPad, K>(&st.w[0][0], gW + chunk * BT * K, lane);
      async_tile<BT, K, K + kPad, K>(&st.qd[0][0], gQd + chunk * BT * K, lane);
      async_tile<K, BT, BT + kPad, BT>(&st.krT[0][0], gKrT + chunk * K * BT, lane);
      async_tile<BT, BT, BT + kPad, BT>(&st.Aqk[0][0], gAqk + chunk * BT * BT, lane);
      async_tile<BT, VC, VC, V>(&st.u[0][0], p.u + chunk * BT * V + col0, lane);
      async_tile<1, K, K, K>(&st.el[0], p.el + chunk * K, lane);
    };
    // Chunk m goes to slot m % kStages; that slot's (m / kStages)-th use. Before
    // refilling it, wait until the compute warps released chunk m - kStages (the
    // (m / kStages - 1)-th completion of EMPTY). The load warp never waits for its
    // own copies: each lane's arrival on FULL is made by the hardware once that
    // lane's copies have landed, so the warp runs ahead until the ring is full.
    for (int m = 0; m < n_count; ++m) {
      const int s = m % kStages;
      if (m >= kStages) mbar_wait(&sm.empty[s], (m / kStages - 1) & 1);
      if (lane == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2L_WAIT_SLOT, tp);
      issue(m);
      mbar_arrive_on_copies(&sm.full[s]);
      if (lane == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2L_ISSUE, tp);
    }
    cp_async_wait<0>();  // do not leave the kernel with copies in flight
    return;
  }

  // ===================== compute warps 0 .. NCW-1 =====================
  recurrence_warp<K, V, NCW>(sm, p, bh, seq, col0 + warp * VW, warp, lane, p.n0, n_count);
}

}  // namespace kda_stage
