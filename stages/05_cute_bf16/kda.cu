// kda.cu -- stage 05: the chunked KDA forward on bf16 tensor cores (CuTe, SM80 MMA).
//
// What changes from stage 04 (fp32 SIMT, softplus or bounded gate, BT up to 64):
//
//   * BT = 16 and the BOUNDED gate a = lower_bound * sigmoid(exp(A_log) * x),
//     lower_bound >= -5. Inside a 16-token chunk the cumulative gate stays above
//     16 * (-5) = -80, so exp(-gc) <= e^80 ~ 5.5e34 is finite in fp32 AND in
//     bf16 (max ~3.4e38). The products kd @ ki^T (the L matrix) and qd @ ki^T
//     (Aqk) -- stage 04 had to evaluate them in the difference form
//     exp(gc[c] - gc[i]) element by element -- become plain matrix products of
//     two bf16 tiles, and EVERY product of the algorithm runs on tensor cores:
//     bf16 operands, fp32 accumulation (SM80_16x8x16_F32BF16BF16F32_TN through
//     CuTe). The masked upper triangle of kd @ ki^T can reach ~e^75 per term;
//     fp32 accumulates that without overflow and the mask drops it.
//
//   * K1 = kda_prepare_kernel, grid B*H*NT, ONE BLOCK (4 warps) PER CHUNK, fuses
//     all of stage 04's chunk-parallel kernels (pre-stage, WY transform, Aqk):
//       load + pre-stage : l2norm q, k; gate a; sigmoid(beta)
//                          gc = cumsum(a); kd = kn e^gc; ki = kn e^-gc;
//                          qd = scale qn e^gc; kr = kn e^(glast - gc)
//       L/Aqk products   : L   = strict_lower(beta[:, None] * (kd @ ki^T))   (warps 0-1)
//                          Aqk = lower_incl_diag(qd @ ki^T)                 (warps 2-3)
//       inverse          : X = (I + L)^-1 (forward substitution, fp32); Af = X * beta[None, :]
//       w/u + store      : w = Af @ kd;  u = Af @ v                        (4 warps)
//     Only what the recurrence needs leaves the block (bf16 MMA operands
//     qd, w, kr^T, Aqk; fp32 u and exp(glast)); kn, gc, L, X, Af stay on chip.
//
//   * K2 = kda_recurrence_kernel, grid B*H*(V/32), ONE BLOCK (4 warps) PER
//     (b, h, 32-column slice of V). Column vd of the state only ever meets
//     column vd of u, vcorr and o, so the V columns split into independent
//     blocks (4x more blocks than stage 04's one per (b, h) at V = 128).
//     The slice S[K, 32] of the state stays in shared memory for the whole
//     chunk loop (fp32, plus the bf16 copy the MMAs read). Per chunk:
//       vcorr = u - w @ S
//       o     = qd @ S + Aqk @ vcorr
//       S     = diag(exp(glast)) S + kr^T @ vcorr
//     The forward writes no per-chunk state: only o (bf16) and the final state.
//
// CuTe vocabulary used below (the CuTe tutorial's naming):
//   sX  a tensor in shared memory, gX in global memory, rX / tCrX in registers,
//   cX  an identity tensor (its elements are their own coordinates);
//   tCsX = thr_mma.partition_X(sX): the elements of sX this thread touches in
//   the MMA, shaped (MMA, MMA_M, MMA_K) for A, (MMA, MMA_N, MMA_K) for B,
//   (MMA, MMA_M, MMA_N) for C. An MMA computes C(m, n) += sum_k A(m, k) B(n, k):
//   A is an (M, K) tensor, B an (N, K) tensor. Which array in shared memory
//   plays A or B, and whether it is "transposed", is only a matter of the
//   layout (shape : stride) we view it through: kd is the A operand (c, d) of
//   kd @ ki^T and, through a transposed layout of the SAME array, the B operand
//   (d, c) of Af @ kd. No transpose copies.
//
// Numerics: fp32 everywhere except the MMA operands (rounded to bf16 once,
// where they are produced) and o (bf16, the compute dtype). u stays fp32: it is
// only subtracted (vcorr = u - w @ S) and rounding it would add a bf16 error
// for nothing. Bitwise deterministic: no atomics (the profile timers excepted),
// every sum has a fixed order.
//
// Ablations (stage.py ABLATIONS): five compile-time switches, each turning ONE
// idea of this stage off. This file is the stage itself, as the default build (no
// switch) compiles it; what a switch puts in place of its idea is in ablations.cuh
// (with what each switch does), chosen here through the flags kTcPrepare,
// kTcRecurrence, kColumnSplit, kSmemState and `if constexpr`.

#include <cuda_runtime.h>

#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

#include "kda.h"
#include "kda_cuda_check.h"
#include "kda_device.cuh"  // sigmoid_f, softplus_f, warp_sum
#include "kda_profile.cuh"

// (A named namespace, not an anonymous one: nvcc's generated registration code
// cannot name kernels of an anonymous namespace once CuTe's headers, which have
// anonymous namespaces of their own inside namespace cute, are included.)
namespace kda_stage {

using namespace cute;
using bf16 = cute::bfloat16_t;  // same bits as __nv_bfloat16 / torch.bfloat16

constexpr int BT = 16;        // tokens per chunk
constexpr int VC = 32;        // value columns per K2 block
constexpr int kPad = 8;       // bf16 row padding of the MMA operand tiles (16 bytes):
                              // rows stay 16-byte aligned and the fragment loads
                              // of a warp hit 32 different banks
#ifndef KDA_NO_SMEM_STATE
constexpr int kSPad = 4;      // fp32 row padding of the state tile (conflict-free update)
#endif
constexpr int kThreads = 128; // both kernels: 4 warps
constexpr float kL2Eps = 1e-6f;

// The ideas that an ablation switch turns off (all true in the default build).
#ifndef KDA_NO_TC_PREPARE
constexpr bool kTcPrepare = true;     // K1's products on tensor cores
#else
constexpr bool kTcPrepare = false;
#endif
#ifndef KDA_NO_TC_RECURRENCE
constexpr bool kTcRecurrence = true;  // K2's products on tensor cores
#else
constexpr bool kTcRecurrence = false;
#endif
#ifndef KDA_NO_COLUMN_SPLIT
constexpr bool kColumnSplit = true;   // K2 split over value columns
#else
constexpr bool kColumnSplit = false;
#endif
#ifndef KDA_NO_SMEM_STATE
constexpr bool kSmemState = true;     // K2's state resident in shared memory
#else
constexpr bool kSmemState = false;
#endif

// ---------------------------------------------------------------------------
// tensor-core MMAs
// ---------------------------------------------------------------------------

// One warp-wide MMA instruction: D[16x8] = A[16x16] B[16x8] + C, bf16 in, fp32 accumulate.
using MmaAtom = MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>;
// 4 warps side by side along N: one step of the tiled MMA covers a 16 x 32 x 16
// tile; larger M or N repeat it (MMA_M, MMA_N modes). 128 threads.
using TiledMma4 = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<_1, _4, _1>>{}));
// 2 warps along N: a 16 x 16 x 16 tile, 64 threads (the two 16 x 16 products of K1).
using TiledMma2 = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<_1, _2, _1>>{}));

// acc(M, N) += sA(M, Kd) * sB(N, Kd)^T, with sA, sB in shared memory and acc this
// thread's accumulator fragment (from thr_mma.partition_fragment_C). `idx` is the
// thread's index inside the tiled MMA (0 .. size(mma) - 1). K-block by K-block
// (16 wide): copy this thread's share of A and B into registers, then issue the
// MMAs of the block.
template <class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void mma_smem(TiledMma const& mma, int idx, TensorA const& sA,
                                         TensorB const& sB, TensorC& acc) {
  auto thr_mma = mma.get_slice(idx);
  Tensor tCsA = thr_mma.partition_A(sA);           // (MMA, MMA_M, MMA_K)
  Tensor tCsB = thr_mma.partition_B(sB);           // (MMA, MMA_N, MMA_K)
  Tensor tCrA = thr_mma.partition_fragment_A(sA);  // (MMA, MMA_M, MMA_K) bf16 registers
  Tensor tCrB = thr_mma.partition_fragment_B(sB);  // (MMA, MMA_N, MMA_K) bf16 registers
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tCrA); ++kb) {
    copy(tCsA(_, _, kb), tCrA(_, _, kb));
    copy(tCsB(_, _, kb), tCrB(_, _, kb));
    gemm(mma, tCrA(_, _, kb), tCrB(_, _, kb), acc);  // acc += A_kb * B_kb^T
  }
}

// A shared-memory view of a row-major tile: shape (ROWS, COLS), rows LD elements apart.
template <int ROWS, int COLS, int LD, class T>
__device__ __forceinline__ auto smem_rows(T* ptr) {
  return make_tensor(make_smem_ptr(ptr),
                     make_layout(make_shape(Int<ROWS>{}, Int<COLS>{}), make_stride(Int<LD>{}, _1{})));
}

// The transposed view of the same tile: shape (COLS, ROWS), element (j, i) = ptr[i * LD + j].
template <int ROWS, int COLS, int LD, class T>
__device__ __forceinline__ auto smem_cols(T* ptr) {
  return make_tensor(make_smem_ptr(ptr),
                     make_layout(make_shape(Int<COLS>{}, Int<ROWS>{}), make_stride(_1{}, Int<LD>{})));
}

// ---------------------------------------------------------------------------
// small helpers
// ---------------------------------------------------------------------------

// Copy a [ROWS, COLS] tile from global (rows SRC_LD elements apart) into shared
// memory (rows DST_LD apart), 16 bytes per thread and step, all NTHR threads of the block.
template <int ROWS, int COLS, int DST_LD, int SRC_LD, int NTHR = kThreads, class T>
__device__ __forceinline__ void load_tile(T* dst, const T* src) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
  constexpr int kPerRow = COLS / kVec;
  static_assert(COLS % kVec == 0 && DST_LD % kVec == 0 && SRC_LD % kVec == 0, "16-byte rows");
  for (int i = threadIdx.x; i < ROWS * kPerRow; i += NTHR) {
    const int r = i / kPerRow, cv = i % kPerRow;
    *reinterpret_cast<uint4*>(dst + r * DST_LD + cv * kVec) =
        *reinterpret_cast<const uint4*>(src + (size_t)r * SRC_LD + cv * kVec);
  }
}

// The ablations' code: what a switch compiles in place of this file's (none of it
// runs in the default build).
#include "ablations.cuh"

// ===========================================================================
// K1: prepare, one block per chunk
// ===========================================================================

// Shared memory of K1 (K, V <= 128: about 43 KB).
template <int K, int V>
struct K1Smem {
  alignas(16) float qn[BT][K];         // l2-normalised q (0 for padded tokens)
  alignas(16) float kn[BT][K];         // l2-normalised k
  alignas(16) float a[BT][K];          // gate a (the cumsum runs in registers)
  alignas(16) float L[BT][BT];         // L = strict_lower(beta[:, None] * kd @ ki^T), then X in place
  alignas(16) float beta[BT];          // sigmoid(beta)
  alignas(16) bf16 kd[BT][K + kPad];   // kn * exp(gc)           A of kd @ ki^T; B (transposed view) of Af @ kd
  alignas(16) bf16 ki[BT][K + kPad];   // kn * exp(-gc)          B of kd @ ki^T and qd @ ki^T
  alignas(16) bf16 qd[BT][K + kPad];   // scale * qn * exp(gc)   A of qd @ ki^T
  alignas(16) bf16 v[BT][V + kPad];    // v                      B (transposed view) of Af @ v
  alignas(16) bf16 Af[BT][BT + kPad];  // X * beta[None, :]      A of Af @ kd and Af @ v
};

// ---------------------------------------------------------------------------
// kda_prepare_kernel -- everything chunk-parallel, fused (see the file header).
// grid = B*H*NT blocks (block = bh * NT + n), block = 128 threads, dynamic smem
// = sizeof(K1Smem). Writes the chunk's slot of qd, w, krT, Aqk, u, el.
// Profile: thread 0, slot = block index, regions K1_*.
// ---------------------------------------------------------------------------
template <int K, int V>
__global__ void __launch_bounds__(kThreads) kda_prepare_kernel(const __grid_constant__ KdaFwdParams p) {
  static_assert(K % 32 == 0 && V % 32 == 0, "K, V multiples of 32");
  extern __shared__ __align__(16) unsigned char kda_smem[];
  K1Smem<K, V>& sm = *reinterpret_cast<K1Smem<K, V>*>(kda_smem);

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
  const bf16* v = reinterpret_cast<const bf16*>(p.v);
  const bf16* beta = reinterpret_cast<const bf16*>(p.beta);
  bf16* gQd = reinterpret_cast<bf16*>(p.qd) + slot * BT * K;    // [BT, K]
  bf16* gW = reinterpret_cast<bf16*>(p.w) + slot * BT * K;      // [BT, K]
  bf16* gKrT = reinterpret_cast<bf16*>(p.krT) + slot * K * BT;  // [K, BT]
  bf16* gAqk = reinterpret_cast<bf16*>(p.Aqk) + slot * BT * BT; // [BT, BT]
  float* gU = p.u + slot * BT * V;                              // [BT, V]
  float* gEl = p.el + slot * K;                                 // [K]

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
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_PRE, tp);

  // ---- L/Aqk products, two 64-thread tiled MMAs side by side (both read ki as B):
  //   warps 0-1:  L   = strict_lower(beta[:, None] * (kd @ ki^T))  -> shared, fp32
  //   warps 2-3:  Aqk = lower_incl_diag(qd @ ki^T)                 -> global, bf16
  if constexpr (kTcPrepare) {
    TiledMma2 mma;
    const int idx = tid % 64;  // thread index inside its 64-thread MMA
    auto thr_mma = mma.get_slice(idx);
    Tensor sKi = smem_rows<BT, K, K + kPad>(&sm.ki[0][0]);          // (BT,K)   (i, d)
    Tensor cC = make_identity_tensor(Shape<Int<BT>, Int<BT>>{});    // (BT,BT)  -> (c, i)
    Tensor tCcC = thr_mma.partition_C(cC);                          // (MMA,MMA_M,MMA_N)
    Tensor acc = thr_mma.partition_fragment_C(cC);                  // (MMA,MMA_M,MMA_N) fp32
    clear(acc);
    if (warp < 2) {
      Tensor sKd = smem_rows<BT, K, K + kPad>(&sm.kd[0][0]);        // (BT,K)   (c, d)
      mma_smem(mma, idx, sKd, sKi, acc);                            // kd @ ki^T
      Tensor sL = smem_rows<BT, BT, BT>(&sm.L[0][0]);               // (BT,BT)  (c, i)
      Tensor tCsL = thr_mma.partition_C(sL);
      CUTE_UNROLL
      for (int e = 0; e < size(acc); ++e) {
        const int c = get<0>(tCcC(e)), i = get<1>(tCcC(e));
        tCsL(e) = (c > i) ? sm.beta[c] * acc(e) : 0.f;
      }
    } else {
      Tensor sQd = smem_rows<BT, K, K + kPad>(&sm.qd[0][0]);        // (BT,K)   (c, d)
      mma_smem(mma, idx, sQd, sKi, acc);                            // qd @ ki^T
      Tensor gA = make_tensor(make_gmem_ptr(gAqk), make_layout(Shape<Int<BT>, Int<BT>>{}, LayoutRight{}));  // (BT,BT)
      Tensor tCgA = thr_mma.partition_C(gA);
      CUTE_UNROLL
      for (int e = 0; e < size(acc); ++e) {
        const int c = get<0>(tCcC(e)), j = get<1>(tCcC(e));
        tCgA(e) = bf16((j <= c) ? acc(e) : 0.f);
      }
    }
  } else {
    NoTcPrepare<K, V>::products(sm, tid, gAqk);
  }
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_PRODUCTS, tp);

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
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_INVERSE, tp);

  // ---- w/u + store: w = Af @ kd -> global bf16 [BT, K];  u = Af @ v -> global fp32 [BT, V].
  //   C(c, d) = sum_j Af(c, j) kd(j, d): the B operand is kd viewed as (d, j) -- the
  //   transposed layout of the same shared array (likewise v). Straight from the
  //   accumulators to global memory (rows of padded tokens are zero: Af's rows and
  //   columns there are zero since beta = 0).
  if constexpr (kTcPrepare) {
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
  } else {
    NoTcPrepare<K, V>::wu(sm, tid, gW, gU);
  }
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_WU, tp);
}

// ===========================================================================
// K2: the recurrence, one block per (b, h, 32-column slice of V)
// ===========================================================================

// 32-column groups of V per K2 block: 1 (the split: a block per (b, h, 32
// columns)), or with KDA_NO_COLUMN_SPLIT all V / 32 of them (a block per (b, h)).
__host__ __device__ constexpr int k2_groups(int V) { return kColumnSplit ? 1 : V / VC; }

// Shared memory of K2 (K = 128, G = 1: about 45 KB; KDA_NO_COLUMN_SPLIT at V = 128,
// G = 4: about 130 KB). G groups of 32 value columns; vd below is the column
// inside the block (group g owns rows g*32 .. g*32 + 31 of S, Sb, vc).
template <int K, int G = 1>
struct K2Smem {
#ifndef KDA_NO_SMEM_STATE
  alignas(16) float S[G * VC][K + kSPad];  // state slice, fp32: S[vd][d] = state[d, cb + vd]
#endif
  alignas(16) float u[BT][G * VC];         // u[c, cb + vd] of the chunk
  alignas(16) float el[K];                 // exp(glast) of the chunk
  alignas(16) bf16 Sb[G * VC][K + kPad];   // bf16 copy of S: B operand (vd, d) of w @ S and qd @ S
  alignas(16) bf16 w[BT][K + kPad];        // A (c, d) of w @ S
  alignas(16) bf16 qd[BT][K + kPad];       // A (c, d) of qd @ S
  alignas(16) bf16 krT[K][BT + kPad];      // A (d, c) of kr^T @ vcorr
  alignas(16) bf16 Aqk[BT][BT + kPad];     // A (c, j) of Aqk @ vcorr
  alignas(16) bf16 vc[G * VC][BT + kPad];  // vcorr^T: vc[vd][c]; B (vd, c) of Aqk @ vcorr and kr^T @ vcorr
};

// ---------------------------------------------------------------------------
// kda_recurrence_kernel -- the serial chain over chunks for one (b, h) and 32
// value columns col0 .. col0 + 31:
//   S = h0[:, cols] (or 0)
//   for n in chunks:  vcorr = u - w @ S
//                     o     = qd @ S + Aqk @ vcorr        (rows t < T written, bf16)
//                     S     = diag(exp(glast)) S + kr^T @ vcorr
//   ht[:, cols] = S
// grid = B*H*(V/32) blocks (block = bh * (V/32) + slice), block = 128 threads
// (the tiled MMA's 4 warps side by side along the 32 columns), dynamic smem =
// sizeof(K2Smem). Four barriers per chunk. Profile: thread 0, slot = block index.
// (KDA_NO_COLUMN_SPLIT: G = V/32 such groups of 128 threads in one block per
// (b, h), grid B*H; the chunk operands w, qd, kr^T, Aqk, el are loaded once for
// all groups and every barrier spans the whole block.)
// ---------------------------------------------------------------------------
template <int K, int V>
__global__ void __launch_bounds__(kThreads * k2_groups(V))
    kda_recurrence_kernel(const __grid_constant__ KdaFwdParams p) {
  static_assert(K % 16 == 0 && V % VC == 0, "K multiple of 16, V multiple of 32");
  constexpr int G = k2_groups(V);       // 32-column groups per block
  constexpr int NTHR = kThreads * G;    // threads per block
  constexpr int NS = V / (VC * G);      // blocks per head
  extern __shared__ __align__(16) unsigned char kda_smem[];
  K2Smem<K, G>& sm = *reinterpret_cast<K2Smem<K, G>*>(kda_smem);

  const int tid = threadIdx.x;
  const int grp = (G == 1) ? 0 : tid / kThreads;   // this thread's column group
  const int idx = (G == 1) ? tid : tid % kThreads; // its index in the group's 128-thread tiled MMA
  const int gv = grp * VC;                         // the group's first row of S, Sb, vc (first column of u)
  const int bh = (int)(blockIdx.x / NS), cb = (int)(blockIdx.x % NS) * (VC * G);  // block's first column
  const int col0 = cb + gv;                        // the group's first column
  const int b = bh / p.H, h = bh % p.H;
  KDA_PROF_START(tp);

  // ---- the state slice: S = h0[:, cb : cb + 32 G] or 0 (global reads along vd, coalesced)
  if constexpr (kSmemState) {
    const float* h0 = p.h0 ? p.h0 + (size_t)bh * K * V : nullptr;
    for (int e = tid; e < K * G * VC; e += NTHR) {
      const int d = e / (G * VC), vd = e % (G * VC);
      const float s = h0 ? h0[d * V + cb + vd] : 0.f;
      sm.S[vd][d] = s;
      sm.Sb[vd][d] = bf16(s);
    }
  } else {
    NoSmemState<K, V, G>::init(p, bh, cb, tid);  // into ht
  }  // (the barrier after the first chunk's loads publishes it)

  // ---- CuTe views, fixed for the whole loop. (M,N) / (M,K) / (N,K) as noted.
  TiledMma4 mma;
  auto thr_mma = mma.get_slice(idx);
  Tensor sW = smem_rows<BT, K, K + kPad>(&sm.w[0][0]);         // (BT,K)   (c, d)     A of w @ S
  Tensor sQd = smem_rows<BT, K, K + kPad>(&sm.qd[0][0]);       // (BT,K)   (c, d)     A of qd @ S
  Tensor sSb = smem_rows<VC, K, K + kPad>(&sm.Sb[gv][0]);      // (VC,K)   (vd, d)    B of w @ S, qd @ S
  Tensor sAqk = smem_rows<BT, BT, BT + kPad>(&sm.Aqk[0][0]);   // (BT,BT)  (c, j)     A of Aqk @ vcorr
  Tensor sKrT = smem_rows<K, BT, BT + kPad>(&sm.krT[0][0]);    // (K,BT)   (d, c)     A of kr^T @ vcorr
  Tensor sVcB = smem_rows<VC, BT, BT + kPad>(&sm.vc[gv][0]);   // (VC,BT)  (vd, c)    B of both vcorr products
  Tensor sVcC = smem_cols<VC, BT, BT + kPad>(&sm.vc[gv][0]);   // (BT,VC)  (c, vd)    the same array as a C tile
  Tensor sU = smem_rows<BT, VC, G * VC>(&sm.u[0][gv]);         // (BT,VC)  (c, vd)
#ifndef KDA_NO_SMEM_STATE
  Tensor sS = smem_cols<VC, K, K + kSPad>(&sm.S[gv][0]);       // (K,VC)   (d, vd)    fp32 state
#else
  Tensor sS = NoSmemState<K, V, G>::tile(p, bh, col0);         // (K,VC)   (d, vd)    fp32 state, in ht
#endif
  Tensor sSbC = smem_cols<VC, K, K + kPad>(&sm.Sb[gv][0]);     // (K,VC)   (d, vd)    its bf16 copy as a C tile
  Tensor sEl = make_tensor(make_smem_ptr(&sm.el[0]),           // (K,VC)   (d, vd) -> el[d]: stride 0 along vd
                           make_layout(Shape<Int<K>, Int<VC>>{}, make_stride(_1{}, _0{})));
  Tensor cO = make_identity_tensor(Shape<Int<BT>, Int<VC>>{}); // (BT,VC)  -> (c, vd)

  Tensor tCsU = thr_mma.partition_C(sU);     // (MMA,MMA_M,MMA_N) this thread's (c, vd) elements
  Tensor tCsVc = thr_mma.partition_C(sVcC);  // same elements of vcorr
  Tensor tCcO = thr_mma.partition_C(cO);     // their coordinates
  Tensor tCsS = thr_mma.partition_C(sS);     // (MMA,MMA_M,MMA_N) this thread's (d, vd) elements of S
  Tensor tCsSb = thr_mma.partition_C(sSbC);  // same elements of the bf16 copy
  Tensor tCsEl = thr_mma.partition_C(sEl);   // exp(glast[d]) for each of them

  const bf16* gQd = reinterpret_cast<const bf16*>(p.qd);
  const bf16* gW = reinterpret_cast<const bf16*>(p.w);
  const bf16* gKrT = reinterpret_cast<const bf16*>(p.krT);
  const bf16* gAqk = reinterpret_cast<const bf16*>(p.Aqk);
  bf16* o = reinterpret_cast<bf16*>(p.o);

  for (int n = 0; n < p.NT; ++n) {
    const size_t slot = (size_t)bh * p.NT + n;
    const int t0 = n * BT;

    // ---- loads: the chunk's operands into shared memory (16-byte vectors) ----
    load_tile<BT, K, K + kPad, K, NTHR>(&sm.w[0][0], gW + slot * BT * K);
    load_tile<BT, K, K + kPad, K, NTHR>(&sm.qd[0][0], gQd + slot * BT * K);
    load_tile<K, BT, BT + kPad, BT, NTHR>(&sm.krT[0][0], gKrT + slot * K * BT);
    load_tile<BT, BT, BT + kPad, BT, NTHR>(&sm.Aqk[0][0], gAqk + slot * BT * BT);
    load_tile<BT, G * VC, G * VC, V, NTHR>(&sm.u[0][0], p.u + slot * BT * V + cb);
    load_tile<1, K, K, K, NTHR>(&sm.el[0], p.el + slot * K);
    if constexpr (!kSmemState) NoSmemState<K, V, G>::to_sb(sm, p, bh, cb, tid);
    __syncthreads();
    if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_LOADS, tp);

    // ---- vcorr = u - w @ S   (C tile (BT,VC); result to shared as bf16 vcorr^T) ----
    if constexpr (kTcRecurrence) {
      Tensor acc = thr_mma.partition_fragment_C(sU);  // (MMA,MMA_M,MMA_N) fp32
      clear(acc);
      mma_smem(mma, idx, sW, sSb, acc);
      CUTE_UNROLL
      for (int e = 0; e < size(acc); ++e) tCsVc(e) = bf16(tCsU(e) - acc(e));
    } else {
      NoTcRecurrence<K, V, G>::vcorr(sm, gv, idx);
    }
    __syncthreads();
    if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_WS, tp);

    // ---- o = qd @ S + Aqk @ vcorr   (one accumulator; rows of real tokens to global, bf16) ----
    if constexpr (kTcRecurrence) {
      Tensor acc = thr_mma.partition_fragment_C(sU);  // (MMA,MMA_M,MMA_N) fp32
      clear(acc);
      mma_smem(mma, idx, sQd, sSb, acc);
      mma_smem(mma, idx, sAqk, sVcB, acc);
      CUTE_UNROLL
      for (int e = 0; e < size(acc); ++e) {
        const int c = get<0>(tCcO(e)), vd = get<1>(tCcO(e));
        if (t0 + c < p.T) o[(((size_t)b * p.T + t0 + c) * p.H + h) * V + col0 + vd] = bf16(acc(e));
      }
    } else {
      NoTcRecurrence<K, V, G>::o(sm, gv, idx, p, b, h, t0, col0);
    }
    __syncthreads();  // every read of Sb for this chunk is done before the update rewrites it
    if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_O, tp);

    // ---- S = diag(exp(glast)) S + kr^T @ vcorr   (C tile (K,VC); fp32 state + its bf16 copy) ----
    if constexpr (kTcRecurrence) {
      Tensor acc = thr_mma.partition_fragment_C(sS);  // (MMA,MMA_M,MMA_N) fp32
      clear(acc);
      mma_smem(mma, idx, sKrT, sVcB, acc);
      CUTE_UNROLL
      for (int e = 0; e < size(acc); ++e) {
        const float s = tCsEl(e) * tCsS(e) + acc(e);
        tCsS(e) = s;
        if constexpr (kSmemState) tCsSb(e) = bf16(s);  // (KDA_NO_SMEM_STATE: Sb is rebuilt at the loads)
      }
    } else {
      NoTcRecurrence<K, V, G>::update(sm, gv, idx, p, bh, cb);
    }
    __syncthreads();  // S, Sb complete; el, krT, vc free for the next chunk's loads
    if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_SUPDATE, tp);
  }

  // ---- final state: ht[:, cb : cb + 32 G] = S (coalesced along vd) ----
  if constexpr (kSmemState) {  // (KDA_NO_SMEM_STATE: ht already holds it)
    float* ht = p.ht + (size_t)bh * K * V;
    for (int e = tid; e < K * G * VC; e += NTHR) {
      const int d = e / (G * VC), vd = e % (G * VC);
      ht[d * V + cb + vd] = sm.S[vd][d];
    }
  }
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_LOADS, tp);
}

// ---------------------------------------------------------------------------
// launch helpers
// ---------------------------------------------------------------------------

// (Dynamic shared memory above the default 48 KB needs an opt-in per kernel:
// kda_allow_smem, kda_cuda_check.h.)

template <int K, int V>
cudaError_t launch(const KdaFwdParams& p, cudaStream_t stream) {
  const long long bhs = (long long)p.B * p.H;  // B*H*NT and B*H*V/32 <= INT_MAX (checked by the binding)

#ifndef KDA_NO_FUSED_PREPARE
  const size_t smem1 = sizeof(K1Smem<K, V>);
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_prepare_kernel<K, V>, smem1));
  kda_note_launch("kda_prepare_kernel", (const void*)kda_prepare_kernel<K, V>, dim3((unsigned)(bhs * p.NT)), dim3(kThreads), smem1);
  kda_prepare_kernel<K, V><<<(unsigned)(bhs * p.NT), kThreads, smem1, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());
#else
  KDA_RETURN_IF_ERROR((launch_prepare_split<K, V>(p, stream)));  // K1 as three kernels (ablations.cuh)
#endif

  // K2: grid B*H*V/32 blocks of 128 threads (KDA_NO_COLUMN_SPLIT: B*H blocks of V/32 * 128)
  constexpr int G = k2_groups(V);
  const unsigned grid2 = (unsigned)(bhs * (V / (VC * G)));
  const size_t smem2 = sizeof(K2Smem<K, G>);
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_recurrence_kernel<K, V>, smem2));
  kda_note_launch("kda_recurrence_kernel", (const void*)kda_recurrence_kernel<K, V>, dim3(grid2),
                  dim3(kThreads * G), smem2);
  kda_recurrence_kernel<K, V><<<grid2, kThreads * G, smem2, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());
  return cudaSuccess;
}

}  // namespace kda_stage

// ---------------------------------------------------------------------------
// launcher
// ---------------------------------------------------------------------------

cudaError_t kda_fwd_launch(const KdaFwdParams& p, cudaStream_t stream) {
  if (p.B < 1 || p.T < 1 || p.H < 1 || p.NT != (p.T + kda_stage::BT - 1) / kda_stage::BT || p.K != p.V)
    return cudaErrorInvalidValue;
  if (p.K == 64) return kda_stage::launch<64, 64>(p, stream);
  if (p.K == 128) return kda_stage::launch<128, 128>(p, stream);
  return cudaErrorInvalidValue;
}
