// ablations.cuh -- stage 05's ablations: the code that the switches of stage.py
// ABLATIONS compile in place of parts of kda.cu. The stage itself is kda.cu, and
// the default build (no switch) compiles nothing of this file but the declarations
// just below. kda.cu includes it inside namespace kda_stage, after its constants
// and helpers, and reads each switch once, as a flag (kTcPrepare, kTcRecurrence,
// kColumnSplit, kSmemState).
//
// Each switch turns ONE idea of the stage off and keeps the others:
//   KDA_NO_TC_PREPARE     K1's four products (L, Aqk, w, u) as fp32 SIMT FMAs on
//                         the same bf16 tiles, instead of mma.sync (NoTcPrepare)
//   KDA_NO_TC_RECURRENCE  K2's four products (w@S, qd@S, Aqk@vcorr, kr^T@vcorr) as
//                         fp32 SIMT FMAs on the same bf16 tiles, instead of mma.sync
//                         (NoTcRecurrence)
//   KDA_NO_FUSED_PREPARE  K1 split into three kernels as in stage 04 (pre-stage,
//                         WY transform, Aqk); kd, ki, sigmoid(beta) and qd
//                         round-trip through global memory (bf16 / fp32 as rounded
//                         where produced: the results are bitwise the default's)
//                         (kda_pre_kernel, kda_wy_kernel, kda_aqk_kernel, launched
//                         by launch_prepare_split; the workspace in kda.h, binding.cpp)
//   KDA_NO_COLUMN_SPLIT   K2 runs one block per (b, h) over all V columns: V/32
//                         groups of 4 warps in one block (same per-column work),
//                         grid B*H instead of B*H*V/32 (no code here: kda.cu's K2
//                         is written for G column groups, k2_groups)
//   KDA_NO_SMEM_STATE     K2 keeps the fp32 state in global memory (in ht): the bf16
//                         operand copy is rebuilt from it at every chunk's loads and
//                         the update is a read-modify-write of global memory
//                         (NoSmemState)
// KDA_NO_TC_PREPARE and KDA_NO_FUSED_PREPARE do not combine; the others do.
//
// What kda.cu calls from an `if constexpr` branch is a static member of a struct
// named after its switch, declared here in every build and defined only in that
// switch's builds: the default build discards those branches, and a name that
// depends on the kernel's template parameters is not looked up in a discarded one.
// What replaces a whole step (the split K1) is called from the switch's #else.

template <int K, int V> struct NoTcPrepare;            // products, wu
template <int K, int V, int G> struct NoTcRecurrence;  // vcorr, o, update
template <int K, int V, int G> struct NoSmemState;     // init, tile, to_sb

#if defined(KDA_NO_TC_PREPARE) || defined(KDA_NO_TC_RECURRENCE)
// ===========================================================================
// KDA_NO_TC_PREPARE, KDA_NO_TC_RECURRENCE: the products as fp32 FMAs on the bf16
// tiles the MMAs would read (same operands, same roundings; only the summation
// order differs from the tensor cores').
// ===========================================================================

// 8 consecutive bf16 of shared memory (16-byte aligned) -> fp32 (one 16-byte load).
__device__ __forceinline__ void load8(const bf16* src, float (&f)[8]) {
  const uint4 x = *reinterpret_cast<const uint4*>(src);
  const uint32_t wd[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f[2 * j] = __uint_as_float(wd[j] << 16);              // low half: the lower address
    f[2 * j + 1] = __uint_as_float(wd[j] & 0xffff0000u);
  }
}

// sum_d x[d] y[d] over N bf16 values (N a multiple of 8, both 16-byte aligned), fp32.
template <int N>
__device__ __forceinline__ float dot_bf16(const bf16* x, const bf16* y) {
  float acc = 0.f;
#pragma unroll 4
  for (int d = 0; d < N; d += 8) {
    float a[8], b[8];
    load8(x + d, a);
    load8(y + d, b);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = fmaf(a[j], b[j], acc);
  }
  return acc;
}

// sum_j row[j] col[j] over one 16-wide bf16 row of shared memory (16-byte aligned)
// and 16 fp32 values in registers.
__device__ __forceinline__ float dot_col(const bf16* row, const float (&col)[BT]) {
  float r0[8], r1[8];
  load8(row, r0);
  load8(row + 8, r1);
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) acc = fmaf(r0[j], col[j], acc);
#pragma unroll
  for (int j = 0; j < 8; ++j) acc = fmaf(r1[j], col[8 + j], acc);
  return acc;
}

#endif

#ifdef KDA_NO_TC_PREPARE
// ---- K1's products ----
template <int K, int V>
struct NoTcPrepare {
  // L/Aqk products: a thread per (c, i) element (two per thread), dot products
  // over K; masked elements are not computed.
  template <class Smem>
  static __device__ __forceinline__ void products(Smem& sm, int tid, bf16* gAqk) {
    for (int e = tid; e < BT * BT; e += kThreads) {
      const int c = e / BT, i = e % BT;
      sm.L[c][i] = (c > i) ? sm.beta[c] * dot_bf16<K>(&sm.kd[c][0], &sm.ki[i][0]) : 0.f;
      gAqk[c * BT + i] = bf16((i <= c) ? dot_bf16<K>(&sm.qd[c][0], &sm.ki[i][0]) : 0.f);
    }
  }

  // w/u + store: a thread per column d of w (then vd of u) keeps the 16 values of
  // that column in registers and walks the 16 rows of Af (broadcast reads).
  template <class Smem>
  static __device__ __forceinline__ void wu(Smem& sm, int tid, bf16* gW, float* gU) {
    for (int d = tid; d < K; d += kThreads) {
      float col[BT];
#pragma unroll
      for (int j = 0; j < BT; ++j) col[j] = static_cast<float>(sm.kd[j][d]);
#pragma unroll 4
      for (int c = 0; c < BT; ++c) gW[c * K + d] = bf16(dot_col(&sm.Af[c][0], col));
    }
    for (int vd = tid; vd < V; vd += kThreads) {
      float col[BT];
#pragma unroll
      for (int j = 0; j < BT; ++j) col[j] = static_cast<float>(sm.v[j][vd]);
#pragma unroll 4
      for (int c = 0; c < BT; ++c) gU[c * V + vd] = dot_col(&sm.Af[c][0], col);
    }
  }
};
#endif  // KDA_NO_TC_PREPARE

#ifdef KDA_NO_SMEM_STATE
// ===========================================================================
// KDA_NO_SMEM_STATE: K2's fp32 state in global memory, in ht (the final state's
// place), for the whole chunk loop; G column groups of 32 per block, `cb` the
// block's first column.
// ===========================================================================
template <int K, int V, int G>
struct NoSmemState {
  static constexpr int NTHR = kThreads * G;  // threads per K2 block

  // The head's state [K, V].
  static __device__ __forceinline__ float* state(const KdaFwdParams& p, int bh) {
    return p.ht + (size_t)bh * K * V;
  }

  // S = h0[:, cb : cb + 32 G] or 0, into ht (the same thread rebuilds Sb from each
  // element at chunk 0).
  static __device__ __forceinline__ void init(const KdaFwdParams& p, int bh, int cb, int tid) {
    float* const gS = state(p, bh);
    const float* h0 = p.h0 ? p.h0 + (size_t)bh * K * V : nullptr;
    for (int e = tid; e < K * G * VC; e += NTHR) {
      const int d = e / (G * VC), vd = e % (G * VC);
      const float s = h0 ? h0[d * V + cb + vd] : 0.f;
      gS[d * V + cb + vd] = s;
    }
  }

  // The (K, 32) state tile of the group at column col0, (d, vd), in global memory.
  static __device__ __forceinline__ auto tile(const KdaFwdParams& p, int bh, int col0) {
    return make_tensor(make_gmem_ptr(state(p, bh) + col0),
                       make_layout(Shape<Int<K>, Int<VC>>{}, make_stride(Int<V>{}, _1{})));
  }

  // At each chunk's loads: the bf16 operand copy Sb rebuilt from the state in global.
  template <class Smem>
  static __device__ __forceinline__ void to_sb(Smem& sm, const KdaFwdParams& p, int bh, int cb, int tid) {
    const float* gS = state(p, bh);
    for (int e = tid; e < K * G * VC; e += NTHR) {
      const int d = e / (G * VC), vd = e % (G * VC);
      sm.Sb[vd][d] = bf16(gS[d * V + cb + vd]);
    }
  }
};
#endif  // KDA_NO_SMEM_STATE

#ifdef KDA_NO_TC_RECURRENCE
// ===========================================================================
// KDA_NO_TC_RECURRENCE: K2's products. SIMT thread maps, `idx` the thread's index
// in its group of 128 (`gv` the group's first column). w@S and o: thread = column
// svd = idx % 32 of the group, rows r0, r0 + 4, r0 + 8, r0 + 12 (r0 = idx / 32;
// 16-byte row reads of Sb / vc; w, qd, Aqk rows broadcast). S update: thread = key
// dimension ud = idx % K, kCols consecutive columns (16-byte reads of its kr^T
// row; vc rows broadcast).
// ===========================================================================
template <int K, int V, int G>
struct NoTcRecurrence {
  static constexpr int kRowStep = kThreads / VC, kRows = BT / kRowStep;  // 4, 4
  static constexpr int kCols = VC * K / kThreads;                        // 32 (K = 128) or 16 (K = 64)
  static_assert(kThreads % K == 0 && (VC * K) % kThreads == 0, "K in {64, 128}");

  // vcorr = u - w @ S -> vc (bf16 vcorr^T).
  template <class Smem>
  static __device__ __forceinline__ void vcorr(Smem& sm, int gv, int idx) {
    const int svd = idx % VC, r0 = idx / VC;
    float acc[kRows] = {};
#pragma unroll 2
    for (int d = 0; d < K; d += 8) {
      float s8[8];
      load8(&sm.Sb[gv + svd][d], s8);
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        float w8[8];
        load8(&sm.w[r0 + kRowStep * j][d], w8);
#pragma unroll
        for (int m = 0; m < 8; ++m) acc[j] = fmaf(w8[m], s8[m], acc[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int c = r0 + kRowStep * j;
      sm.vc[gv + svd][c] = bf16(sm.u[c][gv + svd] - acc[j]);
    }
  }

  // o = qd @ S + Aqk @ vcorr -> global (rows of real tokens, bf16).
  template <class Smem>
  static __device__ __forceinline__ void o(Smem& sm, int gv, int idx, const KdaFwdParams& p, int b, int h, int t0,
                                           int col0) {
    bf16* gO = reinterpret_cast<bf16*>(p.o);
    const int svd = idx % VC, r0 = idx / VC;
    float acc[kRows] = {};
#pragma unroll 2
    for (int d = 0; d < K; d += 8) {
      float s8[8];
      load8(&sm.Sb[gv + svd][d], s8);
#pragma unroll
      for (int j = 0; j < kRows; ++j) {
        float q8[8];
        load8(&sm.qd[r0 + kRowStep * j][d], q8);
#pragma unroll
        for (int m = 0; m < 8; ++m) acc[j] = fmaf(q8[m], s8[m], acc[j]);
      }
    }
    float vcol[BT];  // vcorr[:, vd] of the chunk
    {
      float v0[8], v1[8];
      load8(&sm.vc[gv + svd][0], v0);
      load8(&sm.vc[gv + svd][8], v1);
#pragma unroll
      for (int m = 0; m < 8; ++m) vcol[m] = v0[m], vcol[8 + m] = v1[m];
    }
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      const int c = r0 + kRowStep * j;
      acc[j] += dot_col(&sm.Aqk[c][0], vcol);  // (Aqk's upper triangle is stored as 0)
      if (t0 + c < p.T) gO[(((size_t)b * p.T + t0 + c) * p.H + h) * V + col0 + svd] = bf16(acc[j]);
    }
  }

  // S = diag(exp(glast)) S + kr^T @ vcorr: fp32 state and its bf16 copy in shared
  // memory (KDA_NO_SMEM_STATE as well: the state in global memory, updated in place).
  template <class Smem>
  static __device__ __forceinline__ void update(Smem& sm, int gv, int idx, const KdaFwdParams& p, int bh,
                                                int cb) {
    const int ud = idx % K, uvd0 = (idx / K) * kCols;
    float kr[BT];  // row ud of kr^T
    {
      float k0[8], k1[8];
      load8(&sm.krT[ud][0], k0);
      load8(&sm.krT[ud][8], k1);
#pragma unroll
      for (int m = 0; m < 8; ++m) kr[m] = k0[m], kr[8 + m] = k1[m];
    }
    const float eg = sm.el[ud];
#pragma unroll 4
    for (int j = 0; j < kCols; ++j) {
      const int vd = gv + uvd0 + j;  // column inside the block
      const float acc = dot_col(&sm.vc[vd][0], kr);
      if constexpr (kSmemState) {
        const float s = eg * sm.S[vd][ud] + acc;
        sm.S[vd][ud] = s;
        sm.Sb[vd][ud] = bf16(s);
      } else {
        float& gs = NoSmemState<K, V, G>::state(p, bh)[(size_t)ud * V + cb + vd];
        gs = eg * gs + acc;
      }
    }
  }
};
#endif  // KDA_NO_TC_RECURRENCE

#ifdef KDA_NO_FUSED_PREPARE
// ===========================================================================
// (ablation KDA_NO_FUSED_PREPARE) K1 as three kernels, as in stage 04: pre-stage,
// WY transform, Aqk. Each is one block per chunk (grid B*H*NT, block = bh*NT + n)
// and records into the same profile slot (the chunk) as the fused kernel, so a
// region is the sum over the three kernels. What the fused kernel keeps on chip
// goes through global memory instead: kd, ki (bf16, as rounded where they are
// produced: the results are bitwise the fused kernel's), sigmoid(beta) (fp32),
// and qd (already a workspace array) is read back by the Aqk kernel.
// ===========================================================================

static_assert(kTcPrepare, "KDA_NO_TC_PREPARE and KDA_NO_FUSED_PREPARE are separate ablations; build one at a time");

template <int K>
struct K1PreSmem {
  alignas(16) float qn[BT][K];  // l2-normalised q (0 for padded tokens)
  alignas(16) float kn[BT][K];  // l2-normalised k
  alignas(16) float a[BT][K];   // gate a
};

// Pre-stage: l2norm, gate, sigmoid(beta), cumsum, exponentials. Writes qd, kr^T,
// exp(glast) (as the fused kernel) and kd, ki, sigmoid(beta) (workspace of the
// ablation). Region K1: load+pre-stage. 128 threads, dynamic smem sizeof(K1PreSmem).
template <int K, int V>
__global__ void __launch_bounds__(kThreads) kda_pre_kernel(const __grid_constant__ KdaFwdParams p) {
  static_assert(K % 32 == 0 && V % 32 == 0, "K, V multiples of 32");
  extern __shared__ __align__(16) unsigned char kda_smem[];
  K1PreSmem<K>& sm = *reinterpret_cast<K1PreSmem<K>*>(kda_smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int bh = (int)(blockIdx.x / p.NT), n = (int)(blockIdx.x % p.NT);
  const int b = bh / p.H, h = bh % p.H;
  const int t0 = n * BT;                           // first token of the chunk
  const int len = min(BT, p.T - t0);               // real tokens in it (1..16)
  const size_t slot = (size_t)bh * p.NT + n;       // the chunk's workspace slot
  KDA_PROF_START(tp);

  const bf16* q = reinterpret_cast<const bf16*>(p.q);
  const bf16* k = reinterpret_cast<const bf16*>(p.k);
  const bf16* g = reinterpret_cast<const bf16*>(p.g);
  const bf16* beta = reinterpret_cast<const bf16*>(p.beta);
  bf16* gQd = reinterpret_cast<bf16*>(p.qd) + slot * BT * K;    // [BT, K]
  bf16* gKd = reinterpret_cast<bf16*>(p.kd) + slot * BT * K;    // [BT, K]
  bf16* gKi = reinterpret_cast<bf16*>(p.ki) + slot * BT * K;    // [BT, K]
  bf16* gKrT = reinterpret_cast<bf16*>(p.krT) + slot * K * BT;  // [K, BT]
  float* gEl = p.el + slot * K;                                 // [K]
  float* gBs = p.bs + slot * BT;                                // [BT]

  // one warp per token row (as the fused kernel; v is loaded by the WY kernel)
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
      if (lane == 0) gBs[c] = real ? sigmoid_f(static_cast<float>(beta[row])) : 0.f;
    }
  }
  __syncthreads();

  // one thread per key dimension d (as the fused kernel; kd, ki to global instead of shared)
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
      gKd[c * K + d] = bf16(knv * e);
      gKi[c * K + d] = bf16(knv * expf(-gc[c]));
      gQd[c * K + d] = bf16(p.scale * sm.qn[c][d] * e);
      const uint32_t kr_bits = bf16(knv * expf(glast - gc[c])).raw();
      kr_row[c / 2] = (c % 2 == 0) ? kr_bits : (kr_row[c / 2] | (kr_bits << 16));
    }
    uint4* dst = reinterpret_cast<uint4*>(gKrT + (size_t)d * BT);  // 32-byte row, 16-byte aligned
    dst[0] = make_uint4(kr_row[0], kr_row[1], kr_row[2], kr_row[3]);
    dst[1] = make_uint4(kr_row[4], kr_row[5], kr_row[6], kr_row[7]);
  }
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_PRE, tp);
}

template <int K, int V>
struct K1WySmem {
  alignas(16) float L[BT][BT];         // L, then X in place
  alignas(16) float beta[BT];          // sigmoid(beta)
  alignas(16) bf16 kd[BT][K + kPad];   // A of kd @ ki^T; B (transposed view) of Af @ kd
  alignas(16) bf16 ki[BT][K + kPad];   // B of kd @ ki^T
  alignas(16) bf16 v[BT][V + kPad];    // B (transposed view) of Af @ v
  alignas(16) bf16 Af[BT][BT + kPad];  // A of Af @ kd and Af @ v
};

// ---------------------------------------------------------------------------
// The fused kernel's inverse and w/u phases, as functions for the WY kernel
// (the same code as in kda_prepare_kernel above).
// ---------------------------------------------------------------------------

// inverse: X = (I + L)^-1, unit lower triangular, by forward substitution (fp32).
//   (I + L) X = I  =>  X[c, i] = -L[c, i] - sum_{i < m < c} L[c, m] X[m, i]   (i < c)
//   Row c needs only rows m < c of X: one warp walks the rows, lane i owns column i;
//   X overwrites L row by row (all lanes read row c of L before any lane writes it).
// Then Af = X * beta[None, :] -> shared bf16. Ends at a barrier.
template <int K, int V>
__device__ __forceinline__ void k1_inverse(K1WySmem<K, V>& sm, int tid, int lane, int warp) {
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
  __syncthreads();
}

// w/u + store: w = Af @ kd -> global bf16 [BT, K];  u = Af @ v -> global fp32 [BT, V].
//   C(c, d) = sum_j Af(c, j) kd(j, d): the B operand is kd viewed as (d, j) -- the
//   transposed layout of the same shared array (likewise v). Straight from the
//   accumulators to global memory (rows of padded tokens are zero: Af's rows and
//   columns there are zero since beta = 0). No barrier at the end.
template <int K, int V>
__device__ __forceinline__ void k1_wu(K1WySmem<K, V>& sm, int tid, bf16* gW, float* gU) {
  TiledMma4 mma;
  auto thr_mma = mma.get_slice(tid);
  Tensor sAf = smem_rows<BT, BT, BT + kPad>(&sm.Af[0][0]);     // (BT,BT)  (c, j)
  Tensor sKdT = smem_cols<BT, K, K + kPad>(&sm.kd[0][0]);      // (K,BT)   (d, j)
  Tensor sVT = smem_cols<BT, V, V + kPad>(&sm.v[0][0]);        // (V,BT)   (vd, j)

  Tensor gWt = make_tensor(make_gmem_ptr(gW), make_layout(Shape<Int<BT>, Int<K>>{}, LayoutRight{}));  // (BT,K)
  Tensor accW = thr_mma.partition_fragment_C(gWt);            // (MMA,MMA_M,MMA_N)
  clear(accW);
  mma_smem(mma, tid, sAf, sKdT, accW);
  Tensor tCgW = thr_mma.partition_C(gWt);
  CUTE_UNROLL
  for (int e = 0; e < size(accW); ++e) tCgW(e) = bf16(accW(e));

  Tensor gUt = make_tensor(make_gmem_ptr(gU), make_layout(Shape<Int<BT>, Int<V>>{}, LayoutRight{}));  // (BT,V)
  Tensor accU = thr_mma.partition_fragment_C(gUt);            // (MMA,MMA_M,MMA_N)
  clear(accU);
  mma_smem(mma, tid, sAf, sVT, accU);
  Tensor tCgU = thr_mma.partition_C(gUt);
  CUTE_UNROLL
  for (int e = 0; e < size(accU); ++e) tCgU(e) = accU(e);
}

// WY transform: loads kd, ki, sigmoid(beta) (workspace) and v (input); L on warps
// 0-1 (tensor cores), inverse, w and u (k1_inverse, k1_wu: as the fused kernel).
// Regions: loads -> K1: load+pre-stage, then L/Aqk products, inverse, w/u + store.
// 128 threads, dynamic smem sizeof(K1WySmem).
template <int K, int V>
__global__ void __launch_bounds__(kThreads) kda_wy_kernel(const __grid_constant__ KdaFwdParams p) {
  extern __shared__ __align__(16) unsigned char kda_smem[];
  K1WySmem<K, V>& sm = *reinterpret_cast<K1WySmem<K, V>*>(kda_smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int bh = (int)(blockIdx.x / p.NT), n = (int)(blockIdx.x % p.NT);
  const int b = bh / p.H, h = bh % p.H;
  const int t0 = n * BT;
  const int len = min(BT, p.T - t0);
  const size_t slot = (size_t)bh * p.NT + n;
  KDA_PROF_START(tp);

  const bf16* v = reinterpret_cast<const bf16*>(p.v);
  bf16* gW = reinterpret_cast<bf16*>(p.w) + slot * BT * K;  // [BT, K]
  float* gU = p.u + slot * BT * V;                          // [BT, V]

  load_tile<BT, K, K + kPad, K>(&sm.kd[0][0], reinterpret_cast<const bf16*>(p.kd) + slot * BT * K);
  load_tile<BT, K, K + kPad, K>(&sm.ki[0][0], reinterpret_cast<const bf16*>(p.ki) + slot * BT * K);
  if (tid < BT) sm.beta[tid] = p.bs[slot * BT + tid];
  for (int c = warp; c < BT; c += kThreads / 32) {
    const bool real = c < len;
    const size_t row = real ? ((size_t)b * p.T + t0 + c) * p.H + h : 0;
    for (int vd = lane; vd < V; vd += 32) sm.v[c][vd] = real ? v[row * V + vd] : bf16(0.f);
  }
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_PRE, tp);

  // L = strict_lower(beta[:, None] * (kd @ ki^T)) -> shared fp32 (warps 0-1, as the fused kernel)
  if (warp < 2) {
    TiledMma2 mma;
    auto thr_mma = mma.get_slice(tid);
    Tensor sKi = smem_rows<BT, K, K + kPad>(&sm.ki[0][0]);          // (BT,K)   (i, d)
    Tensor sKd = smem_rows<BT, K, K + kPad>(&sm.kd[0][0]);          // (BT,K)   (c, d)
    Tensor cC = make_identity_tensor(Shape<Int<BT>, Int<BT>>{});    // (BT,BT)  -> (c, i)
    Tensor tCcC = thr_mma.partition_C(cC);
    Tensor acc = thr_mma.partition_fragment_C(cC);
    clear(acc);
    mma_smem(mma, tid, sKd, sKi, acc);
    Tensor sL = smem_rows<BT, BT, BT>(&sm.L[0][0]);                 // (BT,BT)  (c, i)
    Tensor tCsL = thr_mma.partition_C(sL);
    CUTE_UNROLL
    for (int e = 0; e < size(acc); ++e) {
      const int c = get<0>(tCcC(e)), i = get<1>(tCcC(e));
      tCsL(e) = (c > i) ? sm.beta[c] * acc(e) : 0.f;
    }
  }
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_PRODUCTS, tp);

  k1_inverse<K, V>(sm, tid, lane, warp);
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_INVERSE, tp);

  k1_wu<K, V>(sm, tid, gW, gU);
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_WU, tp);
}

constexpr int kAqkThreads = 64;  // the Aqk kernel: one 16 x 16 x 16 tiled MMA (2 warps)

template <int K>
struct K1AqkSmem {
  alignas(16) bf16 qd[BT][K + kPad];  // A of qd @ ki^T
  alignas(16) bf16 ki[BT][K + kPad];  // B of qd @ ki^T
};

// Aqk = lower_incl_diag(qd @ ki^T) -> global bf16, from the workspace's qd and ki.
// Regions: loads -> K1: load+pre-stage, product -> K1: L/Aqk products.
// 64 threads, dynamic smem sizeof(K1AqkSmem).
template <int K>
__global__ void __launch_bounds__(kAqkThreads) kda_aqk_kernel(const __grid_constant__ KdaFwdParams p) {
  extern __shared__ __align__(16) unsigned char kda_smem[];
  K1AqkSmem<K>& sm = *reinterpret_cast<K1AqkSmem<K>*>(kda_smem);
  const int tid = threadIdx.x;
  const size_t slot = blockIdx.x;  // = bh * NT + n
  KDA_PROF_START(tp);

  load_tile<BT, K, K + kPad, K, kAqkThreads>(&sm.qd[0][0], reinterpret_cast<const bf16*>(p.qd) + slot * BT * K);
  load_tile<BT, K, K + kPad, K, kAqkThreads>(&sm.ki[0][0], reinterpret_cast<const bf16*>(p.ki) + slot * BT * K);
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_PRE, tp);

  TiledMma2 mma;
  auto thr_mma = mma.get_slice(tid);
  Tensor sQd = smem_rows<BT, K, K + kPad>(&sm.qd[0][0]);          // (BT,K)   (c, d)
  Tensor sKi = smem_rows<BT, K, K + kPad>(&sm.ki[0][0]);          // (BT,K)   (j, d)
  Tensor cC = make_identity_tensor(Shape<Int<BT>, Int<BT>>{});    // (BT,BT)  -> (c, j)
  Tensor tCcC = thr_mma.partition_C(cC);
  Tensor acc = thr_mma.partition_fragment_C(cC);
  clear(acc);
  mma_smem(mma, tid, sQd, sKi, acc);
  Tensor gA = make_tensor(make_gmem_ptr(reinterpret_cast<bf16*>(p.Aqk) + slot * BT * BT),
                          make_layout(Shape<Int<BT>, Int<BT>>{}, LayoutRight{}));  // (BT,BT)
  Tensor tCgA = thr_mma.partition_C(gA);
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) {
    const int c = get<0>(tCcC(e)), j = get<1>(tCcC(e));
    tCgA(e) = bf16((j <= c) ? acc(e) : 0.f);
  }
  __syncthreads();  // (profile: the whole block)
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_PRODUCTS, tp);
}

// K1 as the three kernels above; the WY and Aqk kernels both read the pre-stage's output.
template <int K, int V>
cudaError_t launch_prepare_split(const KdaFwdParams& p, cudaStream_t stream) {
  const unsigned grid1 = (unsigned)((long long)p.B * p.H * p.NT);
  const size_t smem_pre = sizeof(K1PreSmem<K>), smem_wy = sizeof(K1WySmem<K, V>), smem_aqk = sizeof(K1AqkSmem<K>);
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_pre_kernel<K, V>, smem_pre));
  kda_note_launch("kda_pre_kernel", (const void*)kda_pre_kernel<K, V>, dim3(grid1), dim3(kThreads), smem_pre);
  kda_pre_kernel<K, V><<<grid1, kThreads, smem_pre, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_wy_kernel<K, V>, smem_wy));
  kda_note_launch("kda_wy_kernel", (const void*)kda_wy_kernel<K, V>, dim3(grid1), dim3(kThreads), smem_wy);
  kda_wy_kernel<K, V><<<grid1, kThreads, smem_wy, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_aqk_kernel<K>, smem_aqk));
  kda_note_launch("kda_aqk_kernel", (const void*)kda_aqk_kernel<K>, dim3(grid1), dim3(kAqkThreads), smem_aqk);
  kda_aqk_kernel<K><<<grid1, kAqkThreads, smem_aqk, stream>>>(p);
  return cudaGetLastError();
}
#endif  // KDA_NO_FUSED_PREPARE
