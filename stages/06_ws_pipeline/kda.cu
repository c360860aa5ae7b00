// kda.cu -- stage 06: stage 05 with a warp-specialised, pipelined recurrence.
//
// What changes from stage 05 (same algorithm, same workspace, same numerics):
//
//   * K2 = kda_recurrence_kernel is WARP-SPECIALISED. Stage 05's block loaded a
//     chunk's operands, waited at __syncthreads, computed, waited again: the
//     serial chain stood still for every global load (64% of its cycles). Now a
//     block of 32 * NCW value columns has NCW COMPUTE WARPS (16 columns each) and
//     ONE LOAD WARP. The load warp copies chunk n + 1, n + 2, ... into a ring of
//     kStages shared-memory slots with 16-byte cp.async while the compute warps
//     work on chunk n:
//
//        load warp     | wait EMPTY[m-S] | issue chunk m (cp.async) | wait EMPTY | issue m+1 ...
//        compute warps | wait FULL[n] | w@S, qd@S, vcorr, Aqk@vcorr, S update | arrive EMPTY[n] | ...
//
//     FULL[s] and EMPTY[s] are MBARRIERS (shared-memory barrier objects that
//     count arrivals and flip a phase bit). Each load-warp lane hands its copies
//     to the hardware with cp.async.mbarrier.arrive, which arrives on FULL[s]
//     when they have landed, so the load warp itself never waits for data; it
//     only waits on EMPTY[s] before it refills a slot. The compute warps wait on
//     FULL[s] and arrive on EMPTY[s] when they are done with it. Block-wide
//     __syncthreads is gone from the loop: nobody waits on anybody's internal
//     steps, only on the slot they need.
//
//   * Each compute warp OWNS 16 value columns for the whole kernel. Column vd of
//     the state only meets column vd of u, vcorr and o, so the four products of
//     a chunk need no data from the other compute warp: between them only
//     __syncwarp (for the warp's own shared tiles), never a block barrier.
//
//   * The fp32 state lives in REGISTERS, as the accumulator fragment of the S
//     update (64 floats per thread at K = 128): S = el * S (decay, in place) and
//     then S += kr^T @ vcorr accumulates straight into it. exp(glast) is read
//     once per element per chunk, outside the product. Only the bf16 copy of S,
//     the B operand of w @ S and qd @ S, is written to (warp-private) shared
//     memory. Element-wise traffic is vectorised: u read as float2, o written as
//     bf16x2, the operand tiles copied in 16-byte vectors.
//
//   * K1 stops waiting too: each warp issues the global loads of its four token
//     rows before using any (8- or 4-byte vectors per lane), the chunk needs one
//     exp per element instead of three (ki = kn / e^gc, kr = kn * e^glast / e^gc),
//     and the 16x16 inverse keeps column i of X in lane i's registers: no
//     __syncwarp between its rows and no separate pass for Af.
//
// Everything else -- the fused prepare kernel K1 (one block per chunk), the
// workspace (bf16 qd, w, kr^T, Aqk; fp32 u, exp(glast)), the bounded gate at
// BT = 16, the SM80 bf16 MMA through CuTe -- is stage 05's. See stage 05's
// kda.cu for the CuTe vocabulary (sX, rX, tCsX, partition_A/B/C).
//
// Numerics: as stage 05 (fp32 except the bf16 MMA operands and o). The state
// is now rounded to bf16 for the MMAs from the register copy, bitwise the same
// values as before. Bitwise deterministic: no atomics outside the profile timers.
//
// Ablations (stage.py ABLATIONS; common/ablation.py builds each with -D<switch>):
// five compile-time switches, each turning ONE of the ideas above off. This file
// is the stage itself, as the default build (no switch) compiles it; what a switch
// puts in place of its idea is in ablations.cuh (with what each switch does).

#include <cuda_runtime.h>

#include <type_traits>

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
constexpr int VW = 16;        // value columns per compute warp of K2
constexpr int kPad = 8;       // bf16 row padding of the MMA operand tiles (16 bytes):
                              // rows stay 16-byte aligned and the fragment loads
                              // of a warp hit 32 different banks
constexpr int kThreads = 128; // K1: 4 warps
constexpr float kL2Eps = 1e-6f;

// The ideas of K2 that an ablation switch turns off, as the default build has them.
#ifndef KDA_NO_LOAD_WARP
constexpr int kLoadWarps = 1;      // K2: one load warp (the last warp of the block)
#else
constexpr int kLoadWarps = 0;
#endif
#ifndef KDA_NO_MBARRIER
constexpr bool kMbarrier = true;   // K2: FULL/EMPTY mbarriers per slot
#else
constexpr bool kMbarrier = false;
#endif
#ifndef KDA_NO_REG_STATE
constexpr bool kRegState = true;   // K2: the fp32 state in registers
#else
constexpr bool kRegState = false;
#endif

// ---------------------------------------------------------------------------
// tensor-core MMAs
// ---------------------------------------------------------------------------

// One warp-wide MMA instruction: D[16x8] = A[16x16] B[16x8] + C, bf16 in, fp32 accumulate.
using MmaAtom = MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>;
// 4 warps side by side along N: one step of the tiled MMA covers a 16 x 32 x 16
// tile; larger M or N repeat it (MMA_M, MMA_N modes). 128 threads. (K1's w and u.)
using TiledMma4 = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<_1, _4, _1>>{}));
// 2 warps along N: a 16 x 16 x 16 tile, 64 threads (the two 16 x 16 products of K1).
using TiledMma2 = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<_1, _2, _1>>{}));
// One warp on its own (K2's compute warps): a 16 x 8 x 16 step, repeated over M, N, K.
using WarpMma = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<_1, _1, _1>>{}));

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

// N contiguous elements between global/shared memory and registers as ONE vector
// access (N * sizeof(T) must be 4, 8 or 16 bytes; the address aligned to it).
template <int N, class T>
struct VecBytes {
  static constexpr int kBytes = N * (int)sizeof(T);
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "4-, 8- or 16-byte vectors");
  using type = std::conditional_t<kBytes == 4, uint32_t, std::conditional_t<kBytes == 8, uint2, uint4>>;
};
template <int N, class T>
__device__ __forceinline__ void load_vec(const T* src, T (&dst)[N]) {
  using Vec = typename VecBytes<N, T>::type;
  const Vec x = *reinterpret_cast<const Vec*>(src);
  memcpy(dst, &x, sizeof(Vec));  // a register move, not a memory copy
}
template <int N, class T>
__device__ __forceinline__ void store_vec(T* dst, const T (&src)[N]) {
  using Vec = typename VecBytes<N, T>::type;
  Vec x;
  memcpy(&x, src, sizeof(Vec));
  *reinterpret_cast<Vec*>(dst) = x;
}

// mbarriers: 64-bit objects in shared memory that count arrivals and flip a
// phase bit each time the expected count is reached. A thread waits for a phase
// with its parity (0, 1, 0, ... for the 1st, 2nd, 3rd completion). Arrivals have
// release and the wait has acquire semantics, so what a thread wrote (or read)
// before arriving is ordered before what the waiter does next. SM80 instructions.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n\t.reg .b64 state;\n\tmbarrier.arrive.shared::cta.b64 state, [%0];\n\t}\n" ::"r"(smem_addr(bar))
               : "memory");
}
// The arrival of this thread, made by the hardware once all of its earlier
// cp.async copies have landed (.noinc: it counts toward the init count).
__device__ __forceinline__ void mbar_arrive_on_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "WAIT:\n\tmbarrier.test_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "\t@!done bra WAIT;\n\t}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// Asynchronous copy of a [ROWS, COLS] tile from global (rows SRC_LD elements
// apart) into shared memory (rows DST_LD apart) by ONE WARP (NTHR = 32 threads,
// `lane` their index; KDA_NO_LOAD_WARP: all compute warps): 16-byte cp.async per
// lane and step, no registers in between. Completion is signalled through an
// mbarrier (mbar_arrive_on_copies).
template <int ROWS, int COLS, int DST_LD, int SRC_LD, int NTHR = 32, class T>
__device__ __forceinline__ void async_tile(T* dst, const T* src, int lane) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
  constexpr int kPerRow = COLS / kVec;
  static_assert(COLS % kVec == 0 && DST_LD % kVec == 0 && SRC_LD % kVec == 0, "16-byte rows");
  CUTE_UNROLL
  for (int i = lane; i < ROWS * kPerRow; i += NTHR) {
    const int r = i / kPerRow, cv = i % kPerRow;
    SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>::copy(
        *reinterpret_cast<const uint128_t*>(src + (size_t)r * SRC_LD + cv * kVec),
        *reinterpret_cast<uint128_t*>(dst + r * DST_LD + cv * kVec));
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
  alignas(16) float L[BT][BT];         // L = strict_lower(beta[:, None] * kd @ ki^T)
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

#ifndef KDA_K1_STAGE05
  // ---- load + pre-stage (1/2): each warp owns BT/4 = 4 token rows and ISSUES ALL
  //   THEIR GLOBAL LOADS FIRST (lane j holds K/32 contiguous features of q, k, g and V/32
  //   of v, as one 8- or 4-byte vector each), then normalises:
  //   qn = q / sqrt(sum q^2 + eps), kn likewise; a = lb * sigmoid(exp(A_log) (g + dt_bias));
  //   beta = sigmoid(beta). Padded tokens (t >= T): q = k = v = 0, a = 0, beta = 0,
  //   and global memory is not touched for them. (Stage 05 loaded one row at a time,
  //   so each warp waited for four global round trips in a row.)
  {
    constexpr int kRows = BT / (kThreads / 32);  // token rows per warp
    constexpr int QV = K / 32, VV = V / 32;      // contiguous features per lane
    const float aexp = expf(p.A_log[h]);
    float dtb[QV];
#pragma unroll
    for (int j = 0; j < QV; ++j) dtb[j] = p.dt_bias[(size_t)h * K + lane * QV + j];
    bf16 qr[kRows][QV], kr[kRows][QV], gr[kRows][QV], vr[kRows][VV];
    float br[kRows];
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int c = warp * kRows + i;
      if (c < len) {
        const size_t row = ((size_t)b * p.T + t0 + c) * p.H + h;  // token row (b, t, h)
        load_vec(q + row * K + lane * QV, qr[i]);
        load_vec(k + row * K + lane * QV, kr[i]);
        load_vec(g + row * K + lane * QV, gr[i]);
        load_vec(v + row * V + lane * VV, vr[i]);
        br[i] = static_cast<float>(beta[row]);
      } else {
#pragma unroll
        for (int j = 0; j < QV; ++j) qr[i][j] = kr[i][j] = gr[i][j] = bf16(0.f);
#pragma unroll
        for (int j = 0; j < VV; ++j) vr[i][j] = bf16(0.f);
        br[i] = 0.f;
      }
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int c = warp * kRows + i;
      const bool real = c < len;
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int j = 0; j < QV; ++j) {
        const float qf = static_cast<float>(qr[i][j]), kf = static_cast<float>(kr[i][j]);
        sq += qf * qf;
        sk += kf * kf;
      }
      sq = warp_sum(sq);
      sk = warp_sum(sk);
      const float rq = 1.0f / sqrtf(sq + kL2Eps), rk = 1.0f / sqrtf(sk + kL2Eps);
      float qn[QV], kn[QV], av[QV];
#pragma unroll
      for (int j = 0; j < QV; ++j) {
        qn[j] = static_cast<float>(qr[i][j]) * rq;
        kn[j] = static_cast<float>(kr[i][j]) * rk;
        const float x = static_cast<float>(gr[i][j]) + dtb[j];
        av[j] = real ? p.lower_bound * sigmoid_f(aexp * x) : 0.f;
      }
      store_vec(&sm.qn[c][lane * QV], qn);
      store_vec(&sm.kn[c][lane * QV], kn);
      store_vec(&sm.a[c][lane * QV], av);
      store_vec(&sm.v[c][lane * VV], vr[i]);
      if (lane == 0) sm.beta[c] = real ? sigmoid_f(br[i]) : 0.f;
    }
  }
  __syncthreads();

  // ---- load + pre-stage (2/2): one thread per key dimension d (a column of the chunk).
  //   gc[c] = a[0] + ... + a[c]   (registers; glast = gc[BT - 1], flat over padded tokens)
  //   e = exp(gc) is the only exponential per element: with the bounded gate
  //   -80 <= gc <= 0, so 1/e <= e^80 and e^glast / e lie in fp32's normal range.
  //   kd = kn e, ki = kn / e, qd = scale qn e   -> shared (bf16)
  //   qd -> global [BT, K];  kr = kn e^glast / e -> global as kr^T [K, BT] (row d
  //   of kr^T is this thread's 16 values: two 16-byte stores);  exp(glast) -> global.
  for (int d = tid; d < K; d += kThreads) {
    float gc[BT];
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < BT; ++c) {
      acc += sm.a[c][d];
      gc[c] = acc;
    }
    const float el = expf(acc);  // exp(glast)
    gEl[d] = el;
    uint32_t kr_row[BT / 2];  // row d of kr^T, two bf16 per word (low half = lower c)
#pragma unroll
    for (int c = 0; c < BT; ++c) {
      const float e = expf(gc[c]), ie = 1.0f / e;
      const float knv = sm.kn[c][d];
      sm.kd[c][d] = bf16(knv * e);
      sm.ki[c][d] = bf16(knv * ie);
      const bf16 qdv = bf16(p.scale * sm.qn[c][d] * e);
      sm.qd[c][d] = qdv;
      gQd[c * K + d] = qdv;
      const uint32_t kr_bits = bf16(knv * (el * ie)).raw();
      kr_row[c / 2] = (c % 2 == 0) ? kr_bits : (kr_row[c / 2] | (kr_bits << 16));
    }
    uint4* dst = reinterpret_cast<uint4*>(gKrT + (size_t)d * BT);  // 32-byte row, 16-byte aligned
    dst[0] = make_uint4(kr_row[0], kr_row[1], kr_row[2], kr_row[3]);
    dst[1] = make_uint4(kr_row[4], kr_row[5], kr_row[6], kr_row[7]);
  }
#else
  k1_pre_stage05<K, V>(sm, p, tid, lane, warp, b, h, t0, len, q, k, g, v, beta, gQd, gKrT, gEl);  // (ablations.cuh)
#endif
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_PRE, tp);

  // ---- L/Aqk products, two 64-thread tiled MMAs side by side (both read ki as B):
  //   warps 0-1:  L   = strict_lower(beta[:, None] * (kd @ ki^T))  -> shared, fp32
  //   warps 2-3:  Aqk = lower_incl_diag(qd @ ki^T)                 -> global, bf16
  {
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
  }
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_PRODUCTS, tp);

#ifndef KDA_K1_STAGE05
  // ---- inverse: X = (I + L)^-1, unit lower triangular, fp32, by one warp:
  //   (I + L) X = I  =>  X[c, i] = [c == i] - sum_{m < c} L[c, m] X[m, i]
  //   Lane i (< 16) keeps column i of X in registers (x[0..15]; the loops are fully
  //   unrolled, so every index is a compile-time constant) and reads row c of L as
  //   a shared-memory broadcast (all lanes, one address). Rows c < i come out 0 and
  //   row i comes out 1 by themselves. No __syncwarp between rows (stage 05 wrote X
  //   back into L row by row), and Af[c, i] = X[c, i] * beta[i] leaves straight
  //   from the registers as bf16.
  if (warp == 0) {
    const int i = lane & (BT - 1);  // lanes 16-31 repeat lanes 0-15 and store nothing
    float x[BT];
#pragma unroll
    for (int c = 0; c < BT; ++c) {
      float s = (c == i) ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < c; ++m) s -= sm.L[c][m] * x[m];
      x[c] = s;
    }
    if (lane < BT) {
      const float bi = sm.beta[i];
#pragma unroll
      for (int c = 0; c < BT; ++c) sm.Af[c][i] = bf16(x[c] * bi);
    }
  }
#else
  k1_inverse_stage05(sm, tid, lane, warp);  // stage 05's inverse (ablations.cuh)
#endif
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_INVERSE, tp);

  // ---- w/u + store: w = Af @ kd -> global bf16 [BT, K];  u = Af @ v -> global fp32 [BT, V].
  //   C(c, d) = sum_j Af(c, j) kd(j, d): the B operand is kd viewed as (d, j) -- the
  //   transposed layout of the same shared array (likewise v). Straight from the
  //   accumulators to global memory (rows of padded tokens are zero: Af's rows and
  //   columns there are zero since beta = 0).
  {
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
  if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_WU, tp);
}

// ===========================================================================
// K2: the recurrence, warp-specialised, one block per (b, h, 16 * NCW value columns)
// ===========================================================================

// Pipeline depth: shared-memory slots in the ring (the load warp runs up to
// kStages - 1 chunks ahead of the compute warps).
template <int K>
constexpr int kStagesFor = K <= 64 ? 4 : 3;

// One slot of the ring: a chunk's state-independent operands (K = 128: 18 KB).
template <int K, int NCW>
struct K2Slot {
  alignas(16) bf16 w[BT][K + kPad];     // A (c, d) of w @ S
  alignas(16) bf16 qd[BT][K + kPad];    // A (c, d) of qd @ S
  alignas(16) bf16 krT[K][BT + kPad];   // A (d, c) of kr^T @ vcorr
  alignas(16) bf16 Aqk[BT][BT + kPad];  // A (c, j) of Aqk @ vcorr
  alignas(16) float u[BT][VW * NCW];    // u[c, col0 + vd] of the chunk (the block's columns)
  alignas(16) float el[K];              // exp(glast) of the chunk
};

// Shared memory of K2 (K = 128, NCW = 2: about 65 KB; KDA_NO_REG_STATE: 17 KB more).
template <int K, int NCW>
struct K2Smem {
  K2Slot<K, NCW> slot[kStagesFor<K>];
  alignas(16) bf16 Sb[NCW][VW][K + kPad];  // per compute warp: bf16 copy of its S columns,
                                           //   B operand (vd, d) of w @ S and qd @ S
  alignas(16) bf16 vc[NCW][VW][BT + kPad]; // per compute warp: vcorr^T, vc[vd][c];
                                           //   B (vd, c) of Aqk @ vcorr and kr^T @ vcorr
#ifdef KDA_NO_REG_STATE
  alignas(16) float S[NCW][VW][K + kSPad]; // per compute warp: its fp32 state columns, S[vd][d]
                                           //   (stage 05's layout, ablations.cuh: conflict-free C-fragment access)
#endif
#ifndef KDA_NO_MBARRIER
  uint64_t full[kStagesFor<K>];   // slot s holds its chunk: 32 load-warp lanes arrive (on copy completion)
                                  //   (KDA_NO_LOAD_WARP: the 32 * NCW compute lanes, on theirs)
  uint64_t empty[kStagesFor<K>];  // slot s is free again: 32 * NCW compute lanes arrive
#endif
};

// ---------------------------------------------------------------------------
// kda_recurrence_kernel -- the serial chain over chunks for one (b, h) and the
// 16 * NCW value columns col0 ..:
//   S = h0[:, cols] (or 0)
//   for n in chunks:  vcorr = u - w @ S
//                     o     = qd @ S + Aqk @ vcorr        (rows t < T written, bf16)
//                     S     = diag(exp(glast)) S + kr^T @ vcorr
//   ht[:, cols] = S
// grid = B*H*V/(16*NCW) blocks (block = bh * (V / (16*NCW)) + slice),
// block = 32 * (NCW + 1) threads: warps 0 .. NCW-1 compute (warp w owns columns
// col0 + 16w .. col0 + 16w + 15), warp NCW loads. dynamic smem = sizeof(K2Smem).
// Profile: slot = block index; compute warp 0's lane 0 times the compute
// regions, the load warp's lane 0 the load-warp regions.
// Ablations (ablations.cuh): KDA_NO_LOAD_WARP drops warp NCW (block = 32 * NCW
// threads); KDA_NO_MBARRIER runs the chunk loop on every warp, the load warp
// included, with one __syncthreads per chunk; KDA_NO_REG_STATE keeps S in sm.S.
// ---------------------------------------------------------------------------
template <int K, int V, int NCW>
__global__ void __launch_bounds__(32 * (NCW + kLoadWarps)) kda_recurrence_kernel(const __grid_constant__ KdaFwdParams p) {
  constexpr int VC = VW * NCW;               // value columns per block
  constexpr int NS = V / VC;                 // column slices per head
  constexpr int kStages = kStagesFor<K>;
  static_assert(K % 16 == 0 && V % VC == 0, "K multiple of 16, V multiple of 16 * NCW");
  extern __shared__ __align__(16) unsigned char kda_smem[];
  K2Smem<K, NCW>& sm = *reinterpret_cast<K2Smem<K, NCW>*>(kda_smem);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int bh = (int)(blockIdx.x / NS), col0 = (int)(blockIdx.x % NS) * VC;
  const int b = bh / p.H, h = bh % p.H;
  const int NT = p.NT;
  // Threads that issue a chunk's copies: the load warp's 32 lanes (KDA_NO_LOAD_WARP:
  // all 32 * NCW compute lanes). Each arrives once on FULL per chunk.
  constexpr int kIssuers = kLoadWarps ? 32 : 32 * NCW;
#ifndef KDA_NO_MBARRIER
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&sm.full[s], kIssuers);
      mbar_init(&sm.empty[s], 32 * NCW);
    }
  }
  __syncthreads();  // the barriers exist before any warp uses them (the only block-wide barrier)
#endif
  KDA_PROF_START(tp);

  const bf16* gQd = reinterpret_cast<const bf16*>(p.qd);
  const bf16* gW = reinterpret_cast<const bf16*>(p.w);
  const bf16* gKrT = reinterpret_cast<const bf16*>(p.krT);
  const bf16* gAqk = reinterpret_cast<const bf16*>(p.Aqk);
  // Issue chunk m into its slot (16-byte cp.async; `idx` = 0 .. kIssuers - 1).
  auto issue = [&](int m, int idx) {
    K2Slot<K, NCW>& st = sm.slot[m % kStages];
    const size_t chunk = (size_t)bh * NT + m;
    async_tile<BT, K, K + kPad, K, kIssuers>(&st.w[0][0], gW + chunk * BT * K, idx);
    async_tile<BT, K, K + kPad, K, kIssuers>(&st.qd[0][0], gQd + chunk * BT * K, idx);
    async_tile<K, BT, BT + kPad, BT, kIssuers>(&st.krT[0][0], gKrT + chunk * K * BT, idx);
    async_tile<BT, BT, BT + kPad, BT, kIssuers>(&st.Aqk[0][0], gAqk + chunk * BT * BT, idx);
    async_tile<BT, VC, VC, V, kIssuers>(&st.u[0][0], p.u + chunk * BT * V + col0, idx);
    async_tile<1, K, K, K, kIssuers>(&st.el[0], p.el + chunk * K, idx);
  };

#ifndef KDA_NO_LOAD_WARP
  if (warp == NCW) {
    // =================== the load warp: producer of the ring ===================
#ifndef KDA_NO_MBARRIER
    // Chunk m goes to slot m % kStages; that slot's (m / kStages)-th use. Before
    // refilling it, wait until the compute warps released chunk m - kStages (the
    // (m / kStages - 1)-th completion of EMPTY). The load warp never waits for its
    // own copies: each lane's arrival on FULL is made by the hardware once that
    // lane's copies have landed, so the warp runs ahead until the ring is full.
    for (int m = 0; m < NT; ++m) {
      const int s = m % kStages;
      if (m >= kStages) mbar_wait(&sm.empty[s], (m / kStages - 1) & 1);
      if (lane == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2L_WAIT_SLOT, tp);
      issue(m, lane);
      mbar_arrive_on_copies(&sm.full[s]);
      if (lane == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2L_ISSUE, tp);
    }
    cp_async_wait<0>();  // do not leave the kernel with copies in flight
    return;
#else
    NoMbarrier<kStages>::prologue(NT, lane, issue);  // the first chunks, then the chunk loop
    if (lane == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2L_ISSUE, tp);
#endif
  }
#endif

  // ===================== compute warp `warp`: 16 columns =====================
  // (The load warp has returned. KDA_NO_MBARRIER: it runs the chunk loop too, for
  // its barriers, with warp 0's views, which it never touches.)
  const bool computes = kMbarrier || warp < NCW;
  const int cwarp = computes ? warp : 0;
  const int cw0 = col0 + cwarp * VW;  // first global value column of this warp
  WarpMma mma;
  auto thr_mma = mma.get_slice(lane);
  bf16* Sb = &sm.Sb[cwarp][0][0];
  bf16* vc = &sm.vc[cwarp][0][0];
  Tensor sSb = smem_rows<VW, K, K + kPad>(Sb);        // (VW,K)   (vd, d)   B of w @ S, qd @ S
  Tensor sSbC = smem_cols<VW, K, K + kPad>(Sb);       // (K,VW)   (d, vd)   the same array as a C tile
  Tensor sVcB = smem_rows<VW, BT, BT + kPad>(vc);     // (VW,BT)  (vd, c)   B of both vcorr products
  Tensor sVcC = smem_cols<VW, BT, BT + kPad>(vc);     // (BT,VW)  (c, vd)   the same array as a C tile
  Tensor cO = make_identity_tensor(Shape<Int<BT>, Int<VW>>{});  // (BT,VW) -> (c, vd)
  Tensor cS = make_identity_tensor(Shape<Int<K>, Int<VW>>{});   // (K,VW)  -> (d, vd)
  Tensor tCcO = thr_mma.partition_C(cO);    // (MMA,1,2)    this lane's (c, vd) elements
  Tensor tCcS = thr_mma.partition_C(cS);    // (MMA,K/16,2) this lane's (d, vd) elements
  Tensor tCsVc = thr_mma.partition_C(sVcC);
  Tensor tCsSb = thr_mma.partition_C(sSbC);
  // The fp32 state of the warp's columns, resident in registers for the whole
  // loop as the accumulator fragment of the S update (K/16 x 2 MMA tiles).
  // (KDA_NO_REG_STATE: the state lives in shared memory, sm.S; rS only holds it
  // during each chunk's update, loaded and decayed, accumulated, stored back.)
  Tensor rS = thr_mma.partition_fragment_C(cS);
  // C-fragment elements come in pairs of adjacent columns (e, e + 1): (c, vd), (c, vd + 1).
  static_assert(size<0>(decltype(tCcO.layout()){}) == 4, "SM80 16x8 accumulator: 4 values per lane");

  if (computes) {  // S = h0[:, cols] (or 0); its bf16 copy -> shared
    const float* h0 = p.h0 ? p.h0 + (size_t)bh * K * V : nullptr;
    CUTE_UNROLL
    for (int e = 0; e < size(rS); e += 2) {
      const int d = get<0>(tCcS(e)), vd = get<1>(tCcS(e));
      const float2 s2 = h0 ? *reinterpret_cast<const float2*>(h0 + (size_t)d * V + cw0 + vd)
                           : make_float2(0.f, 0.f);
      rS(e) = s2.x;
      rS(e + 1) = s2.y;
      tCsSb(e) = bf16(s2.x);
      tCsSb(e + 1) = bf16(s2.y);
    }
    if constexpr (!kRegState) NoRegState<K>::store(sm, cwarp, thr_mma, rS);
    __syncwarp();
  }

  bf16* o = reinterpret_cast<bf16*>(p.o);
  const size_t o_row = (size_t)p.H * V;  // elements between tokens t and t + 1 of o
  bf16* o_base = o + ((size_t)b * p.T * p.H + h) * V + cw0;
  KDA_PROF_RESET(tp);

  for (int n = 0; n < NT; ++n) {
    const int s = n % kStages;
    K2Slot<K, NCW>& st = sm.slot[s];
    const int t0 = n * BT;
    if constexpr (kLoadWarps && kMbarrier) {
      mbar_wait(&sm.full[s], (n / kStages) & 1);  // chunk n is in slot s
    } else if constexpr (!kLoadWarps) {
      NoLoadWarp<kStages>::wait_chunk(sm, s, n, issue);
    } else {
      auto lap = [&](int region) { if (lane == 0) KDA_PROF_LAP(p.prof, blockIdx.x, region, tp); };
      if (!NoMbarrier<kStages>::wait_chunk(computes, n, NT, lane, issue, lap)) continue;  // (the load warp)
    }
    if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_WAIT, tp);

    // ---- w @ S and qd @ S   (two C tiles (BT, VW); both read only S, so their MMAs
    //      are issued back to back and overlap in the tensor-core pipeline) ----
    Tensor accV = thr_mma.partition_fragment_C(cO);
    clear(accV);
    mma_smem(mma, lane, smem_rows<BT, K, K + kPad>(&st.w[0][0]), sSb, accV);
    if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_WS, tp);
    Tensor accO = thr_mma.partition_fragment_C(cO);
    clear(accO);
    mma_smem(mma, lane, smem_rows<BT, K, K + kPad>(&st.qd[0][0]), sSb, accO);
    if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_QS, tp);

    // ---- vcorr = u - w @ S  -> the warp's vcorr^T tile (bf16); u read as float2 ----
    CUTE_UNROLL
    for (int e = 0; e < size(accV); e += 2) {
      const int c = get<0>(tCcO(e)), vd = get<1>(tCcO(e));
      const float2 u2 = *reinterpret_cast<const float2*>(&st.u[c][cwarp * VW + vd]);
      tCsVc(e) = bf16(u2.x - accV(e));
      tCsVc(e + 1) = bf16(u2.y - accV(e + 1));
    }
    __syncwarp();  // vcorr^T complete before any lane reads it as an MMA operand
    if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_VCORR, tp);

    // ---- o = qd @ S + Aqk @ vcorr ----
    mma_smem(mma, lane, smem_rows<BT, BT, BT + kPad>(&st.Aqk[0][0]), sVcB, accO);
    if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_AV, tp);
    CUTE_UNROLL
    for (int e = 0; e < size(accO); e += 2) {  // rows of real tokens -> global, bf16x2
      const int c = get<0>(tCcO(e)), vd = get<1>(tCcO(e));
      if (t0 + c < p.T)
        *reinterpret_cast<__nv_bfloat162*>(o_base + (size_t)(t0 + c) * o_row + vd) =
            __floats2bfloat162_rn(accO(e), accO(e + 1));
    }
    if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_OSTORE, tp);

    // ---- S = diag(exp(glast)) S + kr^T @ vcorr: decay in place, then accumulate ----
    if constexpr (!kRegState) NoRegState<K>::load(sm, cwarp, thr_mma, rS);
    CUTE_UNROLL
    for (int e = 0; e < size(rS); ++e) rS(e) *= st.el[get<0>(tCcS(e))];
    if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_DECAY, tp);
    mma_smem(mma, lane, smem_rows<K, BT, BT + kPad>(&st.krT[0][0]), sVcB, rS);
    if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_KV, tp);

    // every read of slot s is done: hand it back to the load warp (for chunk n + kStages;
    // after the last chunks nobody waits, and the arrival is harmless)
    if constexpr (kMbarrier) mbar_arrive(&sm.empty[s]);
    __syncwarp();  // all lanes' reads of Sb and vc for this chunk are done
    CUTE_UNROLL
    for (int e = 0; e < size(rS); ++e) tCsSb(e) = bf16(rS(e));
    if constexpr (!kRegState) NoRegState<K>::store(sm, cwarp, thr_mma, rS);
    __syncwarp();  // the new bf16 state is complete before the next chunk's w @ S
    if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_SCOPY, tp);
  }

  if (!computes) {  // KDA_NO_MBARRIER: the load warp is done (only empty copy groups can be left)
    cp_async_wait<0>();
    return;
  }

  // ---- final state: ht[:, cols] = S (float2 stores) ----
  float* ht = p.ht + (size_t)bh * K * V;
  if constexpr (!kRegState) NoRegState<K>::load(sm, cwarp, thr_mma, rS);
  CUTE_UNROLL
  for (int e = 0; e < size(rS); e += 2) {
    const int d = get<0>(tCcS(e)), vd = get<1>(tCcS(e));
    *reinterpret_cast<float2*>(ht + (size_t)d * V + cw0 + vd) = make_float2(rS(e), rS(e + 1));
  }
}

// ---------------------------------------------------------------------------
// launch helpers
// ---------------------------------------------------------------------------

// (Dynamic shared memory above the default 48 KB needs an opt-in per kernel:
// kda_allow_smem, common/include/kda_cuda_check.h.)

template <int K, int V, int NCW>
cudaError_t launch_recurrence(const KdaFwdParams& p, cudaStream_t stream) {
  const long long blocks = (long long)p.B * p.H * (V / (VW * NCW));
  const size_t smem = sizeof(K2Smem<K, NCW>);
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_recurrence_kernel<K, V, NCW>, smem));
  constexpr int threads = 32 * (NCW + kLoadWarps);
  kda_note_launch("kda_recurrence_kernel", (const void*)kda_recurrence_kernel<K, V, NCW>, dim3((unsigned)blocks),
                  dim3(threads), smem);
  kda_recurrence_kernel<K, V, NCW><<<(unsigned)blocks, threads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int K, int V>
cudaError_t launch(const KdaFwdParams& p, cudaStream_t stream) {
  const long long bhs = (long long)p.B * p.H;  // B*H*NT and B*H*V/16 <= INT_MAX (checked by the binding)

  const size_t smem1 = sizeof(K1Smem<K, V>);
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_prepare_kernel<K, V>, smem1));
  kda_note_launch("kda_prepare_kernel", (const void*)kda_prepare_kernel<K, V>, dim3((unsigned)(bhs * p.NT)), dim3(kThreads), smem1);
  kda_prepare_kernel<K, V><<<(unsigned)(bhs * p.NT), kThreads, smem1, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());

#ifndef KDA_FIXED_WIDTH
  // K2 block width: two compute warps (32 columns) share one load warp and one copy
  // of w, qd, kr^T per chunk; when that leaves SMs idle (few heads), one compute
  // warp per block (16 columns) doubles the number of independent chains.
  int dev = 0, sms = 0;
  KDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  KDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (bhs * (V / (2 * VW)) >= 2LL * sms) return launch_recurrence<K, V, 2>(p, stream);
  return launch_recurrence<K, V, 1>(p, stream);
#else
  // KDA_FIXED_WIDTH: always two compute warps (32 columns, stage 05's block width).
  return launch_recurrence<K, V, 2>(p, stream);
#endif
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
