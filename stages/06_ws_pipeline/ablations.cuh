// ablations.cuh -- stage 06's ablations: the code that the switches of stage.py
// ABLATIONS compile in place of parts of kda.cu. The stage itself is kda.cu, and
// the default build (no switch) compiles nothing of this file but the declarations
// just below. kda.cu includes it inside namespace kda_stage, after its constants
// and helpers, and reads the switches of K2 once, as flags (kLoadWarps, kMbarrier,
// kRegState).
//
// Each switch turns ONE idea of the stage off and keeps the others on:
//   KDA_NO_LOAD_WARP   no load warp: the compute warps fill the slot of chunk n
//                      themselves (same cp.async, same FULL/EMPTY mbarriers) and
//                      wait for it right away, so the loads sit on the chain again
//                      (kLoadWarps = 0; NoLoadWarp)
//   KDA_NO_MBARRIER    no mbarriers: the load warp and the compute warps meet at
//                      one __syncthreads per chunk (the load warp waits for its
//                      own copies with cp.async.wait_group before it) (NoMbarrier)
//   KDA_NO_REG_STATE   the fp32 state slice lives in (warp-private) shared memory
//                      as in stage 05: loaded, decayed, updated and stored back
//                      every chunk (bitwise the same values) (NoRegState)
//   KDA_FIXED_WIDTH    always two compute warps (32 columns) per K2 block, stage
//                      05's block width, whatever the occupancy (in kda.cu's launch)
//   KDA_K1_STAGE05     stage 05's K1 pre-stage (row by row loads, three exps per
//                      element) and inverse (through shared memory, __syncwarp
//                      per row, a separate pass for Af) (k1_pre_stage05,
//                      k1_inverse_stage05)
// KDA_NO_LOAD_WARP and KDA_NO_MBARRIER do not combine; the others do.
//
// What kda.cu calls from an `if constexpr` branch is a static member of a struct
// named after its switch, declared here in every build and defined only in that
// switch's builds: the default build discards those branches, and a name that
// depends on the kernel's template parameters is not looked up in a discarded one.
// What replaces a whole step is called from the switch's #else.

template <int kStages> struct NoLoadWarp;  // wait_chunk
template <int kStages> struct NoMbarrier;  // prologue, wait_chunk
template <int K> struct NoRegState;        // load, store

#if defined(KDA_NO_LOAD_WARP) && defined(KDA_NO_MBARRIER)
#error "KDA_NO_LOAD_WARP and KDA_NO_MBARRIER are ablations of one idea each: build one at a time"
#endif

#ifdef KDA_K1_STAGE05
// ===========================================================================
// KDA_K1_STAGE05: stage 05's K1 steps, verbatim
// ===========================================================================

// Load + pre-stage of the chunk into sm: qn, kn, a, v, beta, then kd, ki, qd; qd,
// kr^T and exp(glast) to global. The arguments are kda_prepare_kernel's variables
// of the same names. Ends without a barrier.
template <int K, int V, class Smem>
__device__ __forceinline__ void k1_pre_stage05(Smem& sm, const KdaFwdParams& p, int tid, int lane, int warp,
                                               int b, int h, int t0, int len, const bf16* q, const bf16* k,
                                               const bf16* g, const bf16* v, const bf16* beta, bf16* gQd,
                                               bf16* gKrT, float* gEl) {
  // ---- load + pre-stage (1/2): one warp per token row, lanes split the features.
  //   qn = q / sqrt(sum q^2 + eps), kn likewise; a = lb * sigmoid(exp(A_log) (g + dt_bias));
  //   beta = sigmoid(beta). Padded tokens (t >= T): q = k = v = 0, a = 0, beta = 0,
  //   and global memory is not touched for them.
  {
    const float aexp = expf(p.A_log[h]);
    const float* dtb = p.dt_bias + (size_t)h * K;
    for (int c = warp; c < BT; c += kThreads / 32) {
      const bool real = c < len;
      const size_t row = real ? ((size_t)b * p.T + t0 + c) * p.H + h : 0;  // token row (b, t, h)
      float qv[K / 32], kv[K / 32];
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int j = 0; j < K / 32; ++j) {
        const int d = lane + 32 * j;
        qv[j] = real ? static_cast<float>(q[row * K + d]) : 0.f;
        kv[j] = real ? static_cast<float>(k[row * K + d]) : 0.f;
        sq += qv[j] * qv[j];
        sk += kv[j] * kv[j];
      }
      sq = warp_sum(sq);
      sk = warp_sum(sk);
      const float rq = 1.0f / sqrtf(sq + kL2Eps), rk = 1.0f / sqrtf(sk + kL2Eps);
#pragma unroll
      for (int j = 0; j < K / 32; ++j) {
        const int d = lane + 32 * j;
        sm.qn[c][d] = qv[j] * rq;
        sm.kn[c][d] = kv[j] * rk;
        const float x = real ? static_cast<float>(g[row * K + d]) + dtb[d] : 0.f;
        sm.a[c][d] = real ? p.lower_bound * sigmoid_f(aexp * x) : 0.f;
      }
      for (int vd = lane; vd < V; vd += 32) sm.v[c][vd] = real ? v[row * V + vd] : bf16(0.f);
      if (lane == 0) sm.beta[c] = real ? sigmoid_f(static_cast<float>(beta[row])) : 0.f;
    }
  }
  __syncthreads();

  // ---- load + pre-stage (2/2): one thread per key dimension d (a column of the chunk).
  //   gc[c] = a[0] + ... + a[c]   (registers; glast = gc[BT - 1], flat over padded tokens)
  //   kd = kn e^gc, ki = kn e^-gc, qd = scale qn e^gc   -> shared (bf16)
  //   qd -> global [BT, K];  kr = kn e^(glast - gc) -> global as kr^T [K, BT] (row d
  //   of kr^T is this thread's 16 values: two 16-byte stores);  exp(glast) -> global.
  for (int d = tid; d < K; d += kThreads) {
    float gc[BT];
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < BT; ++c) {
      acc += sm.a[c][d];
      gc[c] = acc;
    }
    const float glast = acc;
    gEl[d] = expf(glast);
    uint32_t kr_row[BT / 2];  // row d of kr^T, two bf16 per word (low half = lower c)
#pragma unroll
    for (int c = 0; c < BT; ++c) {
      const float e = expf(gc[c]);
      const float knv = sm.kn[c][d];
      sm.kd[c][d] = bf16(knv * e);
      sm.ki[c][d] = bf16(knv * expf(-gc[c]));
      const bf16 qdv = bf16(p.scale * sm.qn[c][d] * e);
      sm.qd[c][d] = qdv;
      gQd[c * K + d] = qdv;
      const uint32_t kr_bits = bf16(knv * expf(glast - gc[c])).raw();
      kr_row[c / 2] = (c % 2 == 0) ? kr_bits : (kr_row[c / 2] | (kr_bits << 16));
    }
    uint4* dst = reinterpret_cast<uint4*>(gKrT + (size_t)d * BT);  // 32-byte row, 16-byte aligned
    dst[0] = make_uint4(kr_row[0], kr_row[1], kr_row[2], kr_row[3]);
    dst[1] = make_uint4(kr_row[4], kr_row[5], kr_row[6], kr_row[7]);
  }
}

// Inverse: X = (I + L)^-1 in place of L, then Af. Ends without a barrier.
template <class Smem>
__device__ __forceinline__ void k1_inverse_stage05(Smem& sm, int tid, int lane, int warp) {
  // ---- inverse: X = (I + L)^-1, unit lower triangular, by forward substitution (fp32).
  //   (I + L) X = I  =>  X[c, i] = -L[c, i] - sum_{i < m < c} L[c, m] X[m, i]   (i < c)
  //   Row c needs only rows m < c of X: one warp walks the rows, lane i owns column i;
  //   X overwrites L row by row (all lanes read row c of L before any lane writes it).
  if (warp == 0) {
    const int i = lane;
    for (int c = 1; c < BT; ++c) {
      float x = 0.f;
      if (i < c) {
        x = -sm.L[c][i];
        for (int m = i + 1; m < c; ++m) x -= sm.L[c][m] * sm.L[m][i];
      }
      __syncwarp();
      if (i < c) sm.L[c][i] = x;
      __syncwarp();
    }
  }
  __syncthreads();
  //   Af = X * beta[None, :] (X's unit diagonal and zero upper triangle made explicit) -> bf16
  for (int e = tid; e < BT * BT; e += kThreads) {
    const int c = e / BT, i = e % BT;
    const float x = (i < c) ? sm.L[c][i] : (i == c ? 1.f : 0.f);
    sm.Af[c][i] = bf16(x * sm.beta[i]);
  }
}

#endif  // KDA_K1_STAGE05

#ifdef KDA_NO_LOAD_WARP
// ===========================================================================
// KDA_NO_LOAD_WARP: the compute warps load their operands themselves
// ===========================================================================
template <int kStages>
struct NoLoadWarp {
  // At the top of chunk n (slot s), in place of the wait on FULL[s]: the compute
  // warps fill slot s themselves (once every compute warp has released its
  // previous chunk, n - kStages) and wait for the copies right away.
  template <class Smem, class Issue>
  static __device__ __forceinline__ void wait_chunk(Smem& sm, int s, int n, Issue& issue) {
    if (n >= kStages) mbar_wait(&sm.empty[s], (n / kStages - 1) & 1);
    issue(n, threadIdx.x);
    mbar_arrive_on_copies(&sm.full[s]);
    mbar_wait(&sm.full[s], (n / kStages) & 1);  // chunk n is in slot s
  }
};
#endif  // KDA_NO_LOAD_WARP

#ifdef KDA_NO_MBARRIER
// ===========================================================================
// KDA_NO_MBARRIER: one __syncthreads per chunk instead of FULL/EMPTY mbarriers
// ===========================================================================
template <int kStages>
struct NoMbarrier {
  // On the load warp before the chunk loop: chunks 0 .. kStages - 2 now, one
  // cp.async group each (empty groups past the last chunk keep the count uniform).
  // Then the load warp joins the chunk loop: every warp executes the same
  // __syncthreads once per chunk.
  template <class Issue>
  static __device__ __forceinline__ void prologue(int NT, int lane, Issue& issue) {
    for (int m = 0; m < kStages - 1; ++m) {
      if (m < NT) issue(m, lane);
      cp_async_fence();
    }
  }

  // At the top of chunk n, on every warp, in place of the wait on FULL[s]: the
  // load warp waits for its own copies of chunk n (the group committed kStages - 1
  // groups ago); the block barrier then publishes them to every warp and tells the
  // load warp that chunk n - 1 is done with: its slot is the one chunk
  // n + kStages - 1 refills. Returns false on the load warp (`computes` false),
  // which then goes on to the next chunk; `lap(region)` times its regions.
  template <class Issue, class Lap>
  static __device__ __forceinline__ bool wait_chunk(bool computes, int n, int NT, int lane, Issue& issue,
                                                    Lap&& lap) {
    if (!computes) cp_async_wait<kStages - 2>();
    __syncthreads();
    if (!computes) {
      lap(KDA_REG_K2L_WAIT_SLOT);
      if (n + kStages - 1 < NT) issue(n + kStages - 1, lane);
      cp_async_fence();
      lap(KDA_REG_K2L_ISSUE);
      return false;
    }
    return true;
  }
};
#endif  // KDA_NO_MBARRIER

#ifdef KDA_NO_REG_STATE
// ===========================================================================
// KDA_NO_REG_STATE: the fp32 state columns of each compute warp in shared memory,
// sm.S (stage 05's layout), not in registers; rS holds them only while a chunk
// uses them: loaded before the decay, stored back after the update.
// ===========================================================================
constexpr int kSPad = 4;  // fp32 row padding of the shared state tile (stage 05's)

template <int K>
struct NoRegState {
  // This lane's elements of its warp's state tile in sm.S, (MMA,K/16,2) (d, vd), as rS.
  template <class Smem, class ThrMma>
  static __device__ __forceinline__ auto tile(Smem& sm, int cwarp, ThrMma const& thr_mma) {
    return thr_mma.partition_C(smem_cols<VW, K, K + kSPad>(&sm.S[cwarp][0][0]));
  }

  template <class Smem, class ThrMma, class Frag>
  static __device__ __forceinline__ void load(Smem& sm, int cwarp, ThrMma const& thr_mma, Frag& rS) {
    Tensor tCsS = tile(sm, cwarp, thr_mma);
    CUTE_UNROLL
    for (int e = 0; e < size(rS); ++e) rS(e) = tCsS(e);
  }

  template <class Smem, class ThrMma, class Frag>
  static __device__ __forceinline__ void store(Smem& sm, int cwarp, ThrMma const& thr_mma, Frag const& rS) {
    Tensor tCsS = tile(sm, cwarp, thr_mma);
    CUTE_UNROLL
    for (int e = 0; e < size(rS); ++e) tCsS(e) = rS(e);  // each lane its own elements
  }
};
#endif  // KDA_NO_REG_STATE
