// fused.cuh -- kda_fused_kernel: the prepare and the recurrence in one block,
// no workspace: two prepare teams compute the chunks into the ring that the
// compute warps run recurrence_warp on. Its knob kPrepTeams, its shared memory
// (FusedSmem) and the teams' barrier are here.
#pragma once

#include "common.cuh"
#include "prepare.cuh"
#include "recurrence.cuh"

namespace kda_stage {

// The prepare of the fused kernel (see kda_fused_kernel): kPrepTeams teams of
// 4 warps on alternate chunks, and the ring depth: a multiple of the teams, so
// that each team has its own slots (team t: slots t, t + kPrepTeams).
constexpr int kPrepTeams = 2;
constexpr int kFusedStages = 2 * kPrepTeams;
constexpr int kPrepThreads = kPrepTeams * kThreads;

// Shared memory of the fused kernel: one prepare scratch per team, and the ring of prepared chunks (K = V = 128, 8 compute warps: about 185 KB).
template <int K, int V, int NCW>
struct FusedSmem {
  K1Smem<K, V> prep[kPrepTeams];
  K2Smem<K, NCW, kFusedStages> ring;
};

// The barrier of one prepare team's 4 warps (named barrier 1 + team; the other
// team and the compute warps never take part, and __syncthreads' barrier 0 is
// used once, at the start).
__device__ __forceinline__ void prep_sync(int team) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + team), "n"(kThreads) : "memory");
}

// prep_sync that also ORs a predicate over the team's threads (bar.red.or): every
// thread gets whether any thread of the team passed true.
__device__ __forceinline__ bool prep_sync_or(int team, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"((uint32_t)pred), "r"(1 + team), "n"(kThreads)
      : "memory");
  return any != 0;
}

// ---------------------------------------------------------------------------
// kda_fused_kernel -- K1 and K2 in one block per (sequence, head, 16 * NCW value columns),
// over the NT_i chunks of its own sequence (an empty one: no chunk, ht = h0 or 0):
// warps 0 .. 8 - 1 run the prepare's five phases, straight into the ring slots of
// the chunks (instead of the workspace in global memory), and warps 8 .. 8 + NCW - 1
// run recurrence_warp on the ring exactly as in K2. The prepare warps replace
// K2's load warp: what it copied from the workspace, they compute.
//
// The prepare is a chain of short dependent steps (warp sums, MUFU, shared
// loads): alone on its scheduler, a warp mostly waits on its own latencies.
// So there are two prepare teams of 4 warps (kPrepTeams), each with its own
// scratch and named barrier: team t prepares chunks t, t + 2, t + 4, ... (the
// ring's slots t and t + 2), and while one team waits on a latency the other's
// warp on the same scheduler issues. Inside a team the phases' work is written
// interleaved (stage_row_slices, decay_columns). Each team issues its next chunk's
// global loads before the phases of the current one, so only the first chunk
// waits for memory. With 8 compute warps the block is 16 warps, 128 registers
// each: enough for both since the compute warps' B fragments are written as
// words (c_to_b) and their A fragments come by ldmatrix (measured: 128 for both
// was faster than moving registers to the compute warps with setmaxnreg).
//
// Nothing is written to global memory but o and ht; the price is that the
// prepare, chunk-parallel in K1, becomes a serial stream per block beside the
// recurrence it feeds.
// grid = NH*V/(16*NCW) blocks (block = bh * (V / (16*NCW)) + slice), block =
// 32 * (8 + NCW) threads, dynamic smem = sizeof(FusedSmem). With column slices
// (NCW < V/16) every slice prepares the whole chunk and keeps its columns of u.
// Profile: slot = block index; thread 0 of each team times its prepare, summed
// over its chunks: FUSED_BARRIER (the team's barrier before a chunk), K2L_ISSUE
// (stage_row_slices + the next chunk's loads), K2L_WAIT_SLOT (the wait for a
// free slot and the barrier after it), FUSED_DECAY (decay_columns), then K1's
// products, inverse and w/u regions; compute warp 0's lane 0 the K2 regions.
// ---------------------------------------------------------------------------
template <int K, int V, int NCW, class Pv>
__global__ void __launch_bounds__(kPrepThreads + 32 * NCW, 1) kda_fused_kernel(const __grid_constant__ KdaFwdParams p) {
  constexpr int VC = VW * NCW;  // value columns per block
  constexpr int NS = V / VC;    // column slices per head
  constexpr int kStages = kFusedStages;
  constexpr int kPrepWarps = kPrepThreads / 32;
  static_assert(V % VC == 0, "V multiple of 16 * NCW");
  static_assert(kStages % kPrepTeams == 0, "each team its own slots");
  extern __shared__ __align__(16) unsigned char kda_smem[];
  FusedSmem<K, V, NCW>& sm = *reinterpret_cast<FusedSmem<K, V, NCW>*>(kda_smem);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int bh = (int)(blockIdx.x / NS), col0 = (int)(blockIdx.x % NS) * VC;
  for (int r = 0; r < p.n_skip; ++r)  // a long sequence of the hybrid: the split path runs it
    if (bh / p.H >= p.skip_lo[r] && bh / p.H < p.skip_hi[r]) return;
  const SeqSpan seq = seq_span(p, bh / p.H);  // the block's sequence: its own NT_i chunks
  const int nt = chunks_of(seq);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&sm.ring.full[s], kThreads);    // every thread of the preparing team arrives after its writes
      mbar_init(&sm.ring.empty[s], 32 * NCW);
    }
  }
  __syncthreads();  // the barriers exist before any warp uses them

  const WarpRole role = warp < kPrepWarps ? WarpRole::kPrepare : WarpRole::kCompute;
  if (role == WarpRole::kPrepare) {
    // =================== the prepare teams: producers of the ring ===================
    const int team = warp / 4, tid = threadIdx.x % kThreads, twarp = warp % 4;
    const int h = bh % p.H;
    KDA_PROF_START(tp);
    const GateSlices<K> gs = gate_slices<K>(p, h, lane);  // once per block, not per chunk
    K1Smem<K, V>& scratch = sm.prep[team];
    RowSlices<K, V> raw;
    load_row_slices(p, seq, h, team, twarp, lane, raw);
    for (int n = team; n < nt; n += kPrepTeams) {  // chunk n in slot n % kStages
      prep_sync(team);  // the team's last chunk is done with its scratch
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_FUSED_BARRIER, tp);
      stage_row_slices<K, V, Pv::unbounded>(scratch, p, gs, seq, h, n, twarp, lane, raw);
      load_row_slices(p, seq, h, n + kPrepTeams, twarp, lane, raw);  // the team's next chunk (past the end: zero rows)
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2L_ISSUE, tp);
      // slot s is refilled once the compute warps released chunk n - kStages
      K2Slot<K, NCW>& st = sm.ring.slot[n % kStages];
      if (n >= kStages) mbar_wait(&sm.ring.empty[n % kStages], (n / kStages - 1) & 1);
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2L_WAIT_SLOT, tp);
      prep_sync(team);
      const bool wide = decay_columns<K, V, K + kPad, BT + kPad, Pv, true, false>(scratch, p, tid, &st.qd[0][0],
                                                                                 &st.krT[0][0], st.el);
      bool any_wide = false;  // the chunk's decay, over its key dimensions (as needed only)
      if constexpr (Pv::as_needed) any_wide = prep_sync_or(team, wide); else prep_sync(team);
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_FUSED_DECAY, tp);
      if constexpr (Pv::pairwise) {
        if (pairwise_here<Pv>(any_wide)) products_pairwise<K, V, BT + kPad, true>(scratch, p, tid, &st.Aqk[0][0]);
        else if constexpr (Pv::factored) products<K, V, BT + kPad>(scratch, tid, &st.qd[0][0], &st.Aqk[0][0]);
      } else {
        products<K, V, BT + kPad>(scratch, tid, &st.qd[0][0], &st.Aqk[0][0]);
      }
      prep_sync(team);
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_PRODUCTS, tp);
      if (twarp == 0) invert<Pv::u_halves>(scratch, lane);
      prep_sync(team);
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_INVERSE, tp);
      w_u<K, V, K + kPad, VC, Pv::u_halves>(scratch, tid, &st.w[0][0], &st.u[0][0], col0);
      // release: this thread's writes to the slot are ordered before the compute
      // warps' reads, which wait for all 128 arrivals of the team
      mbar_arrive(&sm.ring.full[n % kStages]);
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_WU, tp);
    }
    return;
  }

  // ===================== compute warps 8 .. 8 + NCW - 1 =====================
  const int cw = warp - kPrepWarps;
  recurrence_warp<K, V, NCW>(sm.ring, p, bh, seq, col0 + cw * VW, cw, lane, 0, nt);
}

}  // namespace kda_stage
