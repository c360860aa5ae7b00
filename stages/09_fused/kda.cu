// kda.cu -- stage 09: stage 08 plus a fused path that needs no workspace.
//
// Stage 08 runs two kernels per segment: K1 prepares every chunk in parallel
// and writes qd, w, kr^T, Aqk (bf16), u and exp(glast) (fp32) to a workspace in
// global memory -- about 1.3 KB per token and head, twice the size of the
// inputs q, k, v, g together -- and K2's load warps read it back, once per
// column slice. At 8 x 1024 tokens x 64 heads that round trip is about 2 GB of
// traffic for 0.7 GB of inputs and outputs.
//
// What changes here (each idea has a switch, stage.py ABLATIONS):
//
//   * The fused kernel (KDA_NO_FUSED: the split path everywhere). K1's body is
//     cut into five phases (load_rows + stage_rows, decay_columns, products,
//     invert, w_u), device functions that write through a pointer and a row
//     pitch: K1 calls them with the dense workspace, as before (bitwise).
//     kda_fused_kernel runs them in a loop: the block of one (b, h) has 8
//     prepare warps and NCW compute warps. The prepare warps take the place of
//     K2's load warp: instead of copying chunk n from the workspace into a ring
//     slot they COMPUTE it there, synchronised among themselves by a named
//     barrier, and hand the slot over through the same FULL/EMPTY mbarriers
//     (waited on with try_wait, which suspends a waiting thread instead of
//     spinning beside the warps it waits for). The compute warps run the
//     recurrence (now recurrence_warp, shared by K2 and the fused kernel)
//     unchanged. The rule (kda_fwd_plan) takes it at V = 128 where its blocks
//     fill the SMs, the split path elsewhere; the binding allocates the
//     workspace only for the split path.
//
//   * The price: K1 prepared all chunks of all heads at once over every SM; in
//     the fused kernel each block prepares its chunks one after the other, and
//     the recurrence can go no faster than that stream. The prepare is a chain
//     of short dependent steps, so what pays is latency hidden:
//       - a fast prepare (kFastPrepare; KDA_NO_FAST_PREPARE): MUFU
//         approximations without slow-path branches, the gate in log2 units,
//         every shared load of a phase before its stores, each phase's rows
//         written interleaved, beta kept in bf16 until every row is loaded;
//       - two prepare teams of 4 warps on alternate chunks (kPrepTeams;
//         KDA_ONE_PREP_TEAM), with 8 compute warps setmaxnreg moves registers
//         from the prepare warps to the compute warps (sm_90a);
//       - the next chunk's global loads issued before the current chunk's
//         phases (kEarlyLoads; KDA_LATE_LOADS), so only the first chunk waits
//         for memory.
//
// Numerics: the split path has stage 08's roundings (bitwise equal outputs).
// The fused path's prepare uses ex2.approx, rcp.approx and rsqrt (MUFU, about
// 2e-7 relative each before the bf16 rounding) where K1 has expf, IEEE
// divisions and sqrt: its outputs differ from stage 08's by about 3e-4 relative,
// and not measurably against fp64. Both bitwise deterministic.

#include <cuda_runtime.h>

#include <type_traits>

#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

#include "kda.h"
#include "kda_cuda_check.h"
#include "kda_device.cuh"  // sigmoid_f
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
constexpr unsigned kFullMask = 0xffffffffu;

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

// The (empty) B-operand fragment of this thread for an (N, KD) operand: the shape
// of the registers only (the null shared-memory view is never dereferenced).
template <int N, int KD, class ThrMma>
__device__ __forceinline__ auto b_fragment(ThrMma const& thr_mma) {
  return thr_mma.partition_fragment_B(make_tensor(
      make_smem_ptr(static_cast<bf16*>(nullptr)), make_layout(Shape<Int<N>, Int<KD>>{}, LayoutRight{})));
}

// acc(M, N) += sA(M, Kd) * B, with sA in shared memory and the B operand already
// a register fragment (MMA, MMA_N, MMA_K) of this thread (see c_to_b).
template <class TiledMma, class TensorA, class FragB, class TensorC>
__device__ __forceinline__ void mma_smem_reg(TiledMma const& mma, int idx, TensorA const& sA,
                                             FragB const& rB, TensorC& acc) {
  auto thr_mma = mma.get_slice(idx);
  Tensor tCsA = thr_mma.partition_A(sA);           // (MMA, MMA_M, MMA_K)
  Tensor tCrA = thr_mma.partition_fragment_A(sA);  // (MMA, MMA_M, MMA_K) bf16 registers
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tCrA); ++kb) {
    copy(tCsA(_, _, kb), tCrA(_, _, kb));
    gemm(mma, tCrA(_, _, kb), rB(_, _, kb), acc);  // acc += A_kb * B_kb
  }
}

// An accumulator fragment of a single-warp SM80 16x8x16 MMA holding a matrix
// X (M, N) -> the B-operand fragment of the same X seen as (Kd = M, N), rounded
// to bf16, so that gemm(A, b) computes A @ X.
//   c: (4, M/16, N/8) fp32, element v of tile (mt, nt) at (16 mt + g + 8 (v / 2), 8 nt + 2 t + v % 2)
//   b: (4, N/8, M/16) bf16, element v of tile (nt, kt) at (k = 16 kt + 2 t + v % 2 + 8 (v / 2), n = 8 nt + g)
// Lane (g, t) holds one 32-bit word (two bf16) per 8x8 quadrant on each side:
// half h of accumulator tile (mt, nt) -- rows 16 mt + 8 h + g, columns 2t, 2t+1 --
// transposed across the warp by movmatrix, is half h of B tile (nt, kt = mt).
template <class FragC, class FragB>
__device__ __forceinline__ void c_to_b(FragC const& c, FragB& b) {
  static_assert(size<0>(FragC{}.layout()) == 4 && size<0>(FragB{}.layout()) == 4, "SM80 16x8x16 fragments");
  static_assert(size<1>(FragC{}.layout()) == size<2>(FragB{}.layout()) &&
                size<2>(FragC{}.layout()) == size<1>(FragB{}.layout()), "B = X as (M, N) -> (N, M) tiles");
  CUTE_UNROLL
  for (int mt = 0; mt < size<1>(c); ++mt) {
    CUTE_UNROLL
    for (int nt = 0; nt < size<2>(c); ++nt) {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const __nv_bfloat162 x = __floats2bfloat162_rn(c(2 * h, mt, nt), c(2 * h + 1, mt, nt));
        uint32_t y;
        SM75_U32x1_MOVM_T::copy(reinterpret_cast<const uint32_t&>(x), y);
        b(2 * h, nt, mt) = bf16::bitcast(static_cast<uint16_t>(y & 0xffffu));
        b(2 * h + 1, nt, mt) = bf16::bitcast(static_cast<uint16_t>(y >> 16));
      }
    }
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
// On sm_90 the wait is try_wait: a thread whose phase has not completed is
// suspended in hardware until it does (or a time limit passes, then it asks
// again) instead of spinning on test_wait and taking issue slots from the warps
// that do the work -- in the fused kernel, the prepare warps that every waiting
// compute warp depends on.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "WAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "\t@!done bra WAIT;\n\t}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#else
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "WAIT:\n\tmbarrier.test_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "\t@!done bra WAIT;\n\t}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#endif
}

// Asynchronous copy of a [ROWS, COLS] tile from global (rows SRC_LD elements
// apart) into shared memory (rows DST_LD apart) by ONE WARP: 16-byte cp.async
// per lane and step, no registers in between. Completion is signalled through
// an mbarrier (mbar_arrive_on_copies).
template <int ROWS, int COLS, int DST_LD, int SRC_LD, class T>
__device__ __forceinline__ void async_tile(T* dst, const T* src, int lane) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
  constexpr int kPerRow = COLS / kVec;
  static_assert(COLS % kVec == 0 && DST_LD % kVec == 0 && SRC_LD % kVec == 0, "16-byte rows");
  CUTE_UNROLL
  for (int i = lane; i < ROWS * kPerRow; i += 32) {
    const int r = i / kPerRow, cv = i % kPerRow;
    SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>::copy(
        *reinterpret_cast<const uint128_t*>(src + (size_t)r * SRC_LD + cv * kVec),
        *reinterpret_cast<uint128_t*>(dst + r * DST_LD + cv * kVec));
  }
}

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
// The prepare of one chunk, in five phases that 128 threads (4 warps) run with a
// barrier between phases. K1 runs them once per block (one chunk, __syncthreads);
// the fused kernel's prepare warps run them chunk after chunk into a ring slot
// (named barrier 1). The destinations are template parameters only through their
// row pitches: K1 writes the dense global workspace, the fused kernel the padded
// shared slot that the compute warps read.
// ---------------------------------------------------------------------------

// A chunk's raw inputs in registers: warp w holds token rows 4w .. 4w + 3, lane j
// the K/32 contiguous features lane * K/32 .. of q, k, g and V/32 of v.
template <int K, int V>
struct RawRows {
  static constexpr int kRows = BT / (kThreads / 32), QV = K / 32, VV = V / 32;
  bf16 q[kRows][QV], k[kRows][QV], g[kRows][QV], v[kRows][VV];
  bf16 beta[kRows];  // raw bf16, converted in stage_rows (see load_rows)
};

// Phase 0 (issue only): the global loads of chunk n, ALL rows of the warp first
// (one 8- or 4-byte vector per lane and tensor). Padded tokens (t >= T) get
// q = k = v = 0, beta logit 0 and are not read. Nothing waits here: the values
// are first used by stage_rows, so the loads of the next chunk fly while the
// fused kernel's prepare warps finish the current one. Even beta stays bf16 in
// its register: stage 07 converted it to float right after its load, and since
// the compiler gives the four rows' beta the same register, each row's
// conversion waited for that row's load -- four memory latencies in a row, in
// every K1 block (about 8e3 cycles per chunk, measured in the fused kernel).
template <int K, int V>
__device__ __forceinline__ void load_rows(const KdaFwdParams& p, int b, int h, int n, int warp, int lane,
                                          RawRows<K, V>& r) {
  constexpr int kRows = RawRows<K, V>::kRows, QV = RawRows<K, V>::QV, VV = RawRows<K, V>::VV;
  const bf16* q = reinterpret_cast<const bf16*>(p.q);
  const bf16* k = reinterpret_cast<const bf16*>(p.k);
  const bf16* g = reinterpret_cast<const bf16*>(p.g);
  const bf16* v = reinterpret_cast<const bf16*>(p.v);
  const bf16* beta = reinterpret_cast<const bf16*>(p.beta);
  const int t0 = n * BT, len = min(BT, p.T - t0);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int c = warp * kRows + i;
    if (c < len) {
      const size_t row = ((size_t)b * p.T + t0 + c) * p.H + h;  // token row (b, t, h)
      load_vec(q + row * K + lane * QV, r.q[i]);
      load_vec(k + row * K + lane * QV, r.k[i]);
      load_vec(g + row * K + lane * QV, r.g[i]);
      load_vec(v + row * V + lane * VV, r.v[i]);
      r.beta[i] = beta[row];  // no conversion here: a use would wait for the load
    } else {
#pragma unroll
      for (int j = 0; j < QV; ++j) r.q[i][j] = r.k[i][j] = r.g[i][j] = bf16(0.f);
#pragma unroll
      for (int j = 0; j < VV; ++j) r.v[i][j] = bf16(0.f);
      r.beta[i] = bf16(0.f);
    }
  }
}

// Phase 1: normalise the rows -> shared: qn = q / sqrt(sum q^2 + eps), kn likewise;
// a = lb * sigmoid(exp(A_log) (g + dt_bias)); beta = sigmoid(beta); v as bf16.
// Padded tokens: a = 0, beta = 0.
// The head's gate parameters of this lane: exp(A_log[h]) and its K/32 features of dt_bias.
template <int K>
struct GateParams {
  float aexp, dtb[K / 32];
};
template <int K>
__device__ __forceinline__ GateParams<K> gate_params(const KdaFwdParams& p, int h, int lane) {
  GateParams<K> gp;
  gp.aexp = expf(p.A_log[h]);
#pragma unroll
  for (int j = 0; j < K / 32; ++j) gp.dtb[j] = p.dt_bias[(size_t)h * K + lane * (K / 32) + j];
  return gp;
}

// The fast approximations of the fused prepare (kFast below; K1 keeps the IEEE
// forms, so that the split path stays bitwise stage 07's). ex2.approx and
// rcp.approx are single MUFU instructions (relative error about 2^-22); rsqrtf
// is MUFU.RSQ. The IEEE division and sqrt compile to a fast path, a check and a
// CALL to a slow path: four rows of them in stage_rows were about 1100
// instructions per warp, every row in turn behind a branch.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// 1 / (1 + 2^(-x log2 e)): x -> -inf gives 1 / inf = 0, x -> +inf gives 1.
__device__ __forceinline__ float sigmoid_approx(float x) {
  return rcp_approx(1.0f + ex2_approx(-1.4426950408889634f * x));
}

// Phase 1 for P chunks at once (n .. n + P - 1: scratch sm[x], raw rows r[x]).
// The source order interleaves the chunks' and rows' work: first the sums of
// squares of every row, then their warp sums level by level (4P rows x 2: that
// many independent shuffles in flight), then each row's normalisation and gate.
// (Written row after row, the compiler kept each row's chains in turn: a warp
// per scheduler then waits on its own shuffle and MUFU latencies.) K1: P = 1,
// and the same arithmetic in the same order as stage 07 (the butterfly is
// warp_sum's).
// kFast (the fused kernel, where this phase is on the critical path of every
// block): rsqrt and sigmoid by the approximations above (no IEEE slow-path
// branches), the sigmoid's exponent as one FMA, qn with the scale folded in
// (qd = scale qn e needs it nowhere else) and a in log2 units (a log2 e, so
// that decay_columns needs no multiply before ex2).
template <int K, int V, bool kFast = false, int P = 1>
__device__ __forceinline__ void stage_rows(K1Smem<K, V>* sm, const KdaFwdParams& p, const GateParams<K>& gp, int n,
                                           int warp, int lane, const RawRows<K, V>* r) {
  constexpr int kRows = RawRows<K, V>::kRows, QV = RawRows<K, V>::QV, VV = RawRows<K, V>::VV;
  constexpr float kLog2e = 1.4426950408889634f;
  const float aexp = gp.aexp;
  const float* dtb = gp.dtb;
  float c0[QV];  // kFast: 2^(g c1 + c0[j]) = exp(-aexp (g + dt_bias)), c1 = -aexp log2 e
#pragma unroll
  for (int j = 0; j < QV; ++j) c0[j] = -aexp * kLog2e * dtb[j];
  float sq[P][kRows], sk[P][kRows];
#pragma unroll
  for (int x = 0; x < P; ++x) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      sq[x][i] = sk[x][i] = 0.f;
#pragma unroll
      for (int j = 0; j < QV; ++j) {
        const float qf = static_cast<float>(r[x].q[i][j]), kf = static_cast<float>(r[x].k[i][j]);
        sq[x][i] += qf * qf;
        sk[x][i] += kf * kf;
      }
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {  // warp_sum's butterfly, every row side by side
#pragma unroll
    for (int x = 0; x < P; ++x) {
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        sq[x][i] += __shfl_xor_sync(kFullMask, sq[x][i], off);
        sk[x][i] += __shfl_xor_sync(kFullMask, sk[x][i], off);
      }
    }
  }
#pragma unroll
  for (int x = 0; x < P; ++x) {
    const int len = min(BT, p.T - (n + x) * BT);
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int c = warp * kRows + i;
      const bool real = c < len;
      const float rq = kFast ? rsqrtf(sq[x][i] + kL2Eps) * p.scale : 1.0f / sqrtf(sq[x][i] + kL2Eps);
      const float rk = kFast ? rsqrtf(sk[x][i] + kL2Eps) : 1.0f / sqrtf(sk[x][i] + kL2Eps);
      const float lb2 = real ? p.lower_bound * kLog2e : 0.f;  // kFast: padded rows get a = 0
      float qn[QV], kn[QV], av[QV];
#pragma unroll
      for (int j = 0; j < QV; ++j) {
        qn[j] = static_cast<float>(r[x].q[i][j]) * rq;
        kn[j] = static_cast<float>(r[x].k[i][j]) * rk;
        if constexpr (kFast) {
          const float t = ex2_approx(fmaf(static_cast<float>(r[x].g[i][j]), -aexp * kLog2e, c0[j]));
          av[j] = lb2 * rcp_approx(1.0f + t);
        } else {
          const float xg = static_cast<float>(r[x].g[i][j]) + dtb[j];
          av[j] = real ? p.lower_bound * sigmoid_f(aexp * xg) : 0.f;
        }
      }
      store_vec(&sm[x].qn[c][lane * QV], qn);
      store_vec(&sm[x].kn[c][lane * QV], kn);
      store_vec(&sm[x].a[c][lane * QV], av);
      store_vec(&sm[x].v[c][lane * VV], r[x].v[i]);
      const float braw = static_cast<float>(r[x].beta[i]);
      if (lane == 0) sm[x].beta[c] = real ? (kFast ? sigmoid_approx(braw) : sigmoid_f(braw)) : 0.f;
    }
  }
}

// Phase 2: one thread per key dimension d (a column of the chunk).
//   gc[c] = a[0] + ... + a[c]   (registers; glast = gc[BT - 1], flat over padded tokens)
//   e = exp(gc) is the only exponential per element: with the bounded gate
//   -80 <= gc <= 0, so 1/e <= e^80 and e^glast / e lie in fp32's normal range.
//   kd = kn e, ki = kn / e, qd = scale qn e   -> shared (bf16)
//   qd -> out_qd [BT, K] (rows LDQ apart);  kr = kn e^glast / e -> out_krT as kr^T
//   [K, BT] (rows LDKR apart; row d is this thread's 16 values: two 16-byte
//   stores);  exp(glast) -> out_el [K].
//   P chunks at once (scratch sm[x], destinations out_*[x]), interleaved in the
//   source as in stage_rows; K1: P = 1.
//   kFast (the fused kernel, where this phase is on the critical path): a comes
//   in log2 units and qn already scaled (stage_rows<kFast>), e and 1/e are two
//   ex2.approx of +-gc -- about 2e-7 relative error each, far below the bf16
//   rounding (4e-3) that follows; K1 keeps expf so that the split path stays
//   bitwise stage 07's. kQdScratch = false: qd goes to out_qd only (products
//   then reads it there).
template <int K, int V, int LDQ, int LDKR, bool kFast = false, bool kQdScratch = true, int P = 1>
__device__ __forceinline__ void decay_columns(K1Smem<K, V>* sm, const KdaFwdParams& p, int tid,
                                              bf16* const* out_qd, bf16* const* out_krT, float* const* out_el) {
  static_assert(LDKR % 8 == 0, "16-byte aligned rows of kr^T");
#pragma unroll
  for (int d0 = 0; d0 < K; d0 += kThreads) {  // K = 128: once, no loop; K = 64: threads 64-127 idle
    const int d = d0 + tid;
    if (K % kThreads != 0 && d >= K) break;
    if constexpr (kFast) {
      // the fused prepare: chunk after chunk, each in three passes -- every shared load
      // (a, kn, qn of the column), then the arithmetic, then every store. Written as one
      // loop over c, each row's loads waited behind the previous row's stores (the
      // compiler cannot tell the ring slot's pointers from the scratch), one shared-
      // memory latency per row of the chunk.
#pragma unroll
      for (int x = 0; x < P; ++x) {
        float av[BT], kv[BT], qv[BT];
#pragma unroll
        for (int c = 0; c < BT; ++c) {
          av[c] = sm[x].a[c][d];
          kv[c] = sm[x].kn[c][d];
          qv[c] = sm[x].qn[c][d];
        }
        float acc = 0.f;
#pragma unroll
        for (int c = 0; c < BT; ++c) {
          acc += av[c];
          av[c] = acc;  // gc (log2 units)
        }
        const float el = ex2_approx(acc);  // exp(glast)
        bf16 kd[BT], ki[BT], qd[BT];
        uint32_t kr_row[BT / 2];  // row d of kr^T, two bf16 per word (low half = lower c)
#pragma unroll
        for (int c = 0; c < BT; ++c) {
          const float e = ex2_approx(av[c]), ie = ex2_approx(-av[c]);
          kd[c] = bf16(kv[c] * e);
          ki[c] = bf16(kv[c] * ie);
          qd[c] = bf16(qv[c] * e);  // qn carries the scale (stage_rows<kFast>)
          const uint32_t kr_bits = bf16(kv[c] * (el * ie)).raw();
          kr_row[c / 2] = (c % 2 == 0) ? kr_bits : (kr_row[c / 2] | (kr_bits << 16));
        }
#pragma unroll
        for (int c = 0; c < BT; ++c) {
          sm[x].kd[c][d] = kd[c];
          sm[x].ki[c][d] = ki[c];
          if constexpr (kQdScratch) sm[x].qd[c][d] = qd[c];
          out_qd[x][c * LDQ + d] = qd[c];
        }
        out_el[x][d] = el;
        uint4* dst = reinterpret_cast<uint4*>(out_krT[x] + (size_t)d * LDKR);  // 32 bytes, 16-byte aligned row
        dst[0] = make_uint4(kr_row[0], kr_row[1], kr_row[2], kr_row[3]);
        dst[1] = make_uint4(kr_row[4], kr_row[5], kr_row[6], kr_row[7]);
      }
      continue;
    }
    float gc[P][BT], acc[P], el[P];
#pragma unroll
    for (int x = 0; x < P; ++x) acc[x] = 0.f;
#pragma unroll
    for (int c = 0; c < BT; ++c) {
#pragma unroll
      for (int x = 0; x < P; ++x) {
        acc[x] += sm[x].a[c][d];
        gc[x][c] = acc[x];
      }
    }
#pragma unroll
    for (int x = 0; x < P; ++x) {
      el[x] = expf(acc[x]);  // exp(glast)
      out_el[x][d] = el[x];
    }
    uint32_t kr_row[P][BT / 2];  // row d of kr^T, two bf16 per word (low half = lower c)
#pragma unroll
    for (int c = 0; c < BT; ++c) {
#pragma unroll
      for (int x = 0; x < P; ++x) {
        const float e = expf(gc[x][c]);
        const float ie = 1.0f / e;
        const float knv = sm[x].kn[c][d];
        sm[x].kd[c][d] = bf16(knv * e);
        sm[x].ki[c][d] = bf16(knv * ie);
        const bf16 qdv = bf16(p.scale * sm[x].qn[c][d] * e);
        if constexpr (kQdScratch) sm[x].qd[c][d] = qdv;
        out_qd[x][c * LDQ + d] = qdv;
        const uint32_t kr_bits = bf16(knv * (el[x] * ie)).raw();
        kr_row[x][c / 2] = (c % 2 == 0) ? kr_bits : (kr_row[x][c / 2] | (kr_bits << 16));
      }
    }
#pragma unroll
    for (int x = 0; x < P; ++x) {
      uint4* dst = reinterpret_cast<uint4*>(out_krT[x] + (size_t)d * LDKR);  // 32 bytes of a 16-byte aligned row
      dst[0] = make_uint4(kr_row[x][0], kr_row[x][1], kr_row[x][2], kr_row[x][3]);
      dst[1] = make_uint4(kr_row[x][4], kr_row[x][5], kr_row[x][6], kr_row[x][7]);
    }
  }
}

// Phase 3: L/Aqk products, two 64-thread tiled MMAs side by side (both read ki as B):
//   warps 0-1:  L   = strict_lower(beta[:, None] * (kd @ ki^T))  -> shared, fp32
//   warps 2-3:  Aqk = lower_incl_diag(qd @ ki^T)                 -> out_Aqk (rows LDA apart), bf16
template <int K, int V, int LDA>
__device__ __forceinline__ void products(K1Smem<K, V>& sm, int tid, const bf16* qd, bf16* out_Aqk) {
  TiledMma2 mma;
  const int idx = tid % 64;  // thread index inside its 64-thread MMA
  auto thr_mma = mma.get_slice(idx);
  Tensor sKi = smem_rows<BT, K, K + kPad>(&sm.ki[0][0]);          // (BT,K)   (i, d)
  Tensor cC = make_identity_tensor(Shape<Int<BT>, Int<BT>>{});    // (BT,BT)  -> (c, i)
  Tensor tCcC = thr_mma.partition_C(cC);                          // (MMA,MMA_M,MMA_N)
  Tensor acc = thr_mma.partition_fragment_C(cC);                  // (MMA,MMA_M,MMA_N) fp32
  clear(acc);
  if (tid < 64) {
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
    Tensor sQd = smem_rows<BT, K, K + kPad>(qd);                  // (BT,K)   (c, d)
    mma_smem(mma, idx, sQd, sKi, acc);                            // qd @ ki^T
    Tensor gA = make_tensor(make_gmem_ptr(out_Aqk),
                            make_layout(Shape<Int<BT>, Int<BT>>{}, make_stride(Int<LDA>{}, _1{})));  // (BT,BT)
    Tensor tCgA = thr_mma.partition_C(gA);
    CUTE_UNROLL
    for (int e = 0; e < size(acc); ++e) {
      const int c = get<0>(tCcC(e)), j = get<1>(tCcC(e));
      tCgA(e) = bf16((j <= c) ? acc(e) : 0.f);
    }
  }
}

// Phase 4: the inverse X = (I + L)^-1, unit lower triangular, fp32, by warp 0:
//   (I + L) X = I  =>  X[c, i] = [c == i] - sum_{m < c} L[c, m] X[m, i]
//   Lane i (< 16) keeps column i of X in registers (x[0..15]; the loops are fully
//   unrolled, so every index is a compile-time constant) and reads row c of L as
//   a shared-memory broadcast (all lanes, one address). Rows c < i come out 0 and
//   row i comes out 1 by themselves. Af[c, i] = X[c, i] * beta[i] leaves straight
//   from the registers as bf16.
template <int K, int V>
__device__ __forceinline__ void invert(K1Smem<K, V>& sm, int lane) {
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

// Phase 5: w = Af @ kd -> out_w bf16 [BT, K] (rows LDW apart);  u = Af @ v -> fp32,
//   columns u_col0 .. u_col0 + UC - 1 of it to out_u [BT, UC] (UC = V: all of them).
//   C(c, d) = sum_j Af(c, j) kd(j, d): the B operand is kd viewed as (d, j) -- the
//   transposed layout of the same shared array (likewise v). Straight from the
//   accumulators to the destination (rows of padded tokens are zero: Af's rows and
//   columns there are zero since beta = 0).
template <int K, int V, int LDW, int UC>
__device__ __forceinline__ void w_u(K1Smem<K, V>& sm, int tid, bf16* out_w, float* out_u, int u_col0) {
  TiledMma4 mma;
  auto thr_mma = mma.get_slice(tid);
  Tensor sAf = smem_rows<BT, BT, BT + kPad>(&sm.Af[0][0]);     // (BT,BT)  (c, j)
  Tensor sKdT = smem_cols<BT, K, K + kPad>(&sm.kd[0][0]);      // (K,BT)   (d, j)
  Tensor sVT = smem_cols<BT, V, V + kPad>(&sm.v[0][0]);        // (V,BT)   (vd, j)

  Tensor gWt = make_tensor(make_gmem_ptr(out_w),
                           make_layout(Shape<Int<BT>, Int<K>>{}, make_stride(Int<LDW>{}, _1{})));  // (BT,K)
  Tensor accW = thr_mma.partition_fragment_C(gWt);            // (MMA,MMA_M,MMA_N)
  clear(accW);
  mma_smem(mma, tid, sAf, sKdT, accW);
  Tensor tCgW = thr_mma.partition_C(gWt);
  CUTE_UNROLL
  for (int e = 0; e < size(accW); ++e) tCgW(e) = bf16(accW(e));

  Tensor cU = make_identity_tensor(Shape<Int<BT>, Int<V>>{});  // (BT,V) -> (c, vd)
  Tensor tCcU = thr_mma.partition_C(cU);
  Tensor accU = thr_mma.partition_fragment_C(cU);             // (MMA,MMA_M,MMA_N)
  clear(accU);
  mma_smem(mma, tid, sAf, sVT, accU);
  CUTE_UNROLL
  for (int e = 0; e < size(accU); ++e) {
    const int c = get<0>(tCcU(e)), vd = get<1>(tCcU(e)) - u_col0;
    if (UC == V || (vd >= 0 && vd < UC)) out_u[c * UC + vd] = accU(e);
  }
}

// ---------------------------------------------------------------------------
// kda_prepare_kernel -- the five phases for one chunk per block (the split path).
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
  const int bh = (int)(blockIdx.x / p.NC), m = (int)(blockIdx.x % p.NC), n = p.n0 + m;  // chunk n of the segment
  const int b = bh / p.H, h = bh % p.H;
  const size_t slot = (size_t)bh * p.NC + m;       // the chunk's workspace slot (one segment)
  const int prof_slot = bh * p.NT + n;             // profile: one slot per chunk of the sequence
  (void)prof_slot;
  KDA_PROF_START(tp);

  RawRows<K, V> raw;
  load_rows(p, b, h, n, warp, lane, raw);
  stage_rows(&sm, p, gate_params<K>(p, h, lane), n, warp, lane, &raw);
  __syncthreads();
  bf16* const qd_out = reinterpret_cast<bf16*>(p.qd) + slot * BT * K;
  bf16* const krT_out = reinterpret_cast<bf16*>(p.krT) + slot * K * BT;
  float* const el_out = p.el + slot * K;
  decay_columns<K, V, K, BT>(&sm, p, tid, &qd_out, &krT_out, &el_out);
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, prof_slot, KDA_REG_K1_PRE, tp);
  products<K, V, BT>(sm, tid, &sm.qd[0][0], reinterpret_cast<bf16*>(p.Aqk) + slot * BT * BT);
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, prof_slot, KDA_REG_K1_PRODUCTS, tp);
  if (warp == 0) invert(sm, lane);
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, prof_slot, KDA_REG_K1_INVERSE, tp);
  w_u<K, V, K, V>(sm, tid, reinterpret_cast<bf16*>(p.w) + slot * BT * K, p.u + slot * BT * V, 0);
  if (tid == 0) KDA_PROF_LAP(p.prof, prof_slot, KDA_REG_K1_WU, tp);
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

// Shared memory of K2: only the ring (K = 128: about 55 KB). The state and
// vcorr live in registers.
template <int K, int NCW, int S = kStagesFor<K>>
struct K2Smem {
  static constexpr int kStages = S;
  K2Slot<K, NCW> slot[S];
  uint64_t full[S];   // slot s holds its chunk: the producer's threads arrive (K2: 32 load-warp lanes on copy completion)
  uint64_t empty[S];  // slot s is free again: 32 * NCW compute lanes arrive
};

// ---------------------------------------------------------------------------
// recurrence_warp -- the serial chain of one compute warp over the chunks of
// (b, h) for the 16 value columns cw0 .. cw0 + 15, reading each chunk from the
// ring slot that the producer (K2's load warp, or the fused kernel's prepare
// warps) filled:
//   S = h0[:, cols] (or 0)
//   for n in chunks:  vcorr = u - w @ S
//                     o     = qd @ S + Aqk @ vcorr        (rows t < T written, bf16)
//                     S     = diag(exp(glast)) S + kr^T @ vcorr
//   ht[:, cols] = S
// cw is the warp's index among the block's compute warps (its columns of the
// slot's u). Profile: compute warp 0's lane 0 times the K2 regions, slot =
// block index.
// ---------------------------------------------------------------------------
template <int K, int V, int NCW, int S>
__device__ __forceinline__ void recurrence_warp(K2Smem<K, NCW, S>& sm, const KdaFwdParams& p, int bh, int cw0, int cw,
                                                int lane, int n_first, int n_count) {
  constexpr int kStages = S;
  const int b = bh / p.H, h = bh % p.H;
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
      const float2 s2 = h0 ? *reinterpret_cast<const float2*>(h0 + (size_t)d * V + cw0 + vd)
                           : make_float2(0.f, 0.f);
      rS(e) = s2.x;
      rS(e + 1) = s2.y;
    }
    c_to_b(rS, rSb);
  }

  bf16* o = reinterpret_cast<bf16*>(p.o);
  const size_t o_row = (size_t)p.H * V;  // elements between tokens t and t + 1 of o
  bf16* o_base = o + ((size_t)b * p.T * p.H + h) * V + cw0;
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
      if (t0 + c < p.T)
        *reinterpret_cast<__nv_bfloat162*>(o_base + (size_t)(t0 + c) * o_row + vd) =
            __floats2bfloat162_rn(accO(e), accO(e + 1));
    }
    if (timer) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2_OSTORE, tp);

    // ---- S = diag(exp(glast)) S + kr^T @ vcorr: decay in place, then accumulate ----
    CUTE_UNROLL
    for (int e = 0; e < size(rS); ++e) rS(e) *= st.el[get<0>(tCcS(e))];
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
    *reinterpret_cast<float2*>(ht + (size_t)d * V + cw0 + vd) = make_float2(rS(e), rS(e + 1));
  }
}

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
// ---------------------------------------------------------------------------
template <int K, int V, int NCW>
__global__ void __launch_bounds__(32 * (NCW + 1)) kda_recurrence_kernel(const __grid_constant__ KdaFwdParams p) {
  constexpr int VC = VW * NCW;               // value columns per block
  constexpr int NS = V / VC;                 // column slices per head
  constexpr int kStages = kStagesFor<K>;
  static_assert(K % 16 == 0 && V % VC == 0, "K multiple of 16, V multiple of 16 * NCW");
  extern __shared__ __align__(16) unsigned char kda_smem[];
  K2Smem<K, NCW>& sm = *reinterpret_cast<K2Smem<K, NCW>*>(kda_smem);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int bh = (int)(blockIdx.x / NS), col0 = (int)(blockIdx.x % NS) * VC;
  const int NC = p.NC;  // the segment's chunks n0 .. n0 + NC - 1, workspace slots 0 .. NC - 1
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&sm.full[s], 32);
      mbar_init(&sm.empty[s], 32 * NCW);
    }
  }
  __syncthreads();  // the barriers exist before any warp uses them (the only block-wide barrier)
  KDA_PROF_START(tp);

  if (warp == NCW) {
    // =================== the load warp: producer of the ring ===================
    const bf16* gQd = reinterpret_cast<const bf16*>(p.qd);
    const bf16* gW = reinterpret_cast<const bf16*>(p.w);
    const bf16* gKrT = reinterpret_cast<const bf16*>(p.krT);
    const bf16* gAqk = reinterpret_cast<const bf16*>(p.Aqk);
    // Issue chunk m into its slot (one warp, 16-byte cp.async per lane).
    auto issue = [&](int m) {
      K2Slot<K, NCW>& st = sm.slot[m % kStages];
      const size_t chunk = (size_t)bh * NC + m;
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
    for (int m = 0; m < NC; ++m) {
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
  recurrence_warp<K, V, NCW>(sm, p, bh, col0 + warp * VW, warp, lane, p.n0, p.NC);
}

// ===========================================================================
// The fused kernel: prepare and recurrence in one block, no workspace
// ===========================================================================

// The prepare of the fused kernel (see kda_fused_kernel): kPrepTeams teams of
// 4 warps, each team taking kPrepChunks chunks per step, and the ring depth: a
// multiple of both, so that a step's chunks take neighbouring slots and the
// teams' slots never meet.
#ifdef KDA_ONE_PREP_TEAM
constexpr int kPrepTeams = 1;  // ablation: one team of 4 warps prepares every chunk
#else
constexpr int kPrepTeams = 2;
#endif
constexpr int kPrepChunks = 1;
// The fused prepare's arithmetic (stage_rows / decay_columns <kFast>) and where a team issues the
// next chunk's global loads (kEarlyLoads: before the current chunk's phases); the ablations
// KDA_NO_FAST_PREPARE and KDA_LATE_LOADS turn them off.
#ifdef KDA_NO_FAST_PREPARE
constexpr bool kFastPrepare = false;  // ablation: K1's arithmetic (expf, IEEE division, sqrt; one pass)
#else
constexpr bool kFastPrepare = true;
#endif
#ifdef KDA_LATE_LOADS
constexpr bool kEarlyLoads = false;  // ablation: the next chunk's loads issued after this chunk's phases
#else
constexpr bool kEarlyLoads = true;
#endif
constexpr int kFusedStages = 2 * kPrepTeams * kPrepChunks;
constexpr int kPrepThreads = kPrepTeams * kThreads;

// Registers per thread after the block is running, where the fused kernel's warps
// outnumber what 168 registers each allow (8 compute warps: 16 warps, 128 each at
// launch): setmaxnreg hands the prepare warps' spare registers to the compute
// warps, whose register-resident state needs about 150 (sm_90a only; the sum is
// the register file, 8 x 32 x (104 + 152) = 65536).
constexpr int kPrepRegs = 104, kComputeRegs = 152;

// Shared memory of the fused kernel: one prepare scratch per team and chunk of a
// step, and the ring of prepared chunks (K = V = 128, 8 compute warps: about 185 KB).
template <int K, int V, int NCW>
struct FusedSmem {
  K1Smem<K, V> prep[kPrepTeams][kPrepChunks];
  K2Smem<K, NCW, kFusedStages> ring;
};

// The barrier of one prepare team's 4 warps (named barrier 1 + team; the other
// team and the compute warps never take part, and __syncthreads' barrier 0 is
// used once, at the start).
__device__ __forceinline__ void prep_sync(int team) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(1 + team), "n"(kThreads) : "memory");
}

// ---------------------------------------------------------------------------
// kda_fused_kernel -- K1 and K2 in one block per (b, h, 16 * NCW value columns):
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
// interleaved (stage_rows, decay_columns). Each team issues its next chunk's
// global loads before the phases of the current one, so only the first chunk
// waits for memory. With 8 compute warps the block is 16 warps, and setmaxnreg
// moves registers from the prepare warps (kPrepRegs) to the compute warps
// (kComputeRegs).
//
// Nothing is written to global memory but o and ht; the price is that the
// prepare, chunk-parallel in K1, becomes a serial stream per block beside the
// recurrence it feeds.
// grid = B*H*V/(16*NCW) blocks (block = bh * (V / (16*NCW)) + slice), block =
// 32 * (8 + NCW) threads, dynamic smem = sizeof(FusedSmem). With column slices
// (NCW < V/16) every slice prepares the whole chunk and keeps its columns of u.
// Profile: slot = block index; thread 0 of each team times its prepare, summed
// over its chunks: FUSED_BARRIER (the team's barrier before a chunk),
// K2L_ISSUE (stage_rows + the next chunk's loads), K2L_WAIT_SLOT (the wait for
// a free slot and the barrier after it), FUSED_DECAY (decay_columns), then K1's
// products, inverse and w/u regions; compute warp 0's lane 0 the K2 regions.
// ---------------------------------------------------------------------------
template <int K, int V, int NCW>
__global__ void __launch_bounds__(kPrepThreads + 32 * NCW, 1) kda_fused_kernel(const __grid_constant__ KdaFwdParams p) {
  constexpr int VC = VW * NCW;  // value columns per block
  constexpr int NS = V / VC;    // column slices per head
  constexpr int kStages = kFusedStages;
  constexpr int P = kPrepChunks;
  constexpr int kPrepWarps = kPrepThreads / 32;
  constexpr bool kMoveRegs = kPrepWarps + NCW > 12;  // more than 168 registers a thread cannot be had at launch
  static_assert(V % VC == 0, "V multiple of 16 * NCW");
  static_assert(kStages % (kPrepTeams * P) == 0 && P <= kThreads / 32, "a step's chunks in neighbouring slots");
  static_assert(kPrepWarps % 4 == 0, "the compute warps start a warpgroup (setmaxnreg acts per warpgroup)");
  extern __shared__ __align__(16) unsigned char kda_smem[];
  FusedSmem<K, V, NCW>& sm = *reinterpret_cast<FusedSmem<K, V, NCW>*>(kda_smem);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int bh = (int)(blockIdx.x / NS), col0 = (int)(blockIdx.x % NS) * VC;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&sm.ring.full[s], kThreads);    // every thread of the preparing team arrives after its writes
      mbar_init(&sm.ring.empty[s], 32 * NCW);
    }
  }
  __syncthreads();  // the barriers exist before any warp uses them

  if (warp < kPrepWarps) {
    // =================== the prepare teams: producers of the ring ===================
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (kMoveRegs) asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kPrepRegs));
#endif
    const int team = warp / 4, tid = threadIdx.x % kThreads, twarp = warp % 4;
    const int b = bh / p.H, h = bh % p.H;
    K1Smem<K, V>* scratch = sm.prep[team];
    KDA_PROF_START(tp);
    const GateParams<K> gp = gate_params<K>(p, h, lane);  // once per block, not per chunk
    RawRows<K, V> raw[P];
    constexpr int kStride = kPrepTeams * P;  // chunks between two steps of one team
#pragma unroll
    for (int x = 0; x < P; ++x) load_rows(p, b, h, team * P + x, twarp, lane, raw[x]);
    for (int n = team * P; n < p.NT; n += kStride) {  // chunk n + x in slot (n + x) % kStages
      prep_sync(team);  // the team's last step is done with its scratch
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_FUSED_BARRIER, tp);
      stage_rows<K, V, kFastPrepare, P>(scratch, p, gp, n, twarp, lane, raw);
      if constexpr (kEarlyLoads) {
#pragma unroll
        for (int x = 0; x < P; ++x) load_rows(p, b, h, n + kStride + x, twarp, lane, raw[x]);  // past T: zero rows
      }
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2L_ISSUE, tp);
      // slot s is refilled once the compute warps released chunk m - kStages
#pragma unroll
      for (int x = 0; x < P; ++x) {
        const int m = n + x;
        if (m >= kStages) mbar_wait(&sm.ring.empty[m % kStages], (m / kStages - 1) & 1);
      }
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K2L_WAIT_SLOT, tp);
      prep_sync(team);
      {
        bf16* qd_out[P];
        bf16* krT_out[P];
        float* el_out[P];
#pragma unroll
        for (int x = 0; x < P; ++x) {
          K2Slot<K, NCW>& st = sm.ring.slot[(n + x) % kStages];
          qd_out[x] = &st.qd[0][0];
          krT_out[x] = &st.krT[0][0];
          el_out[x] = st.el;
        }
        decay_columns<K, V, K + kPad, BT + kPad, kFastPrepare, false, P>(scratch, p, tid, qd_out, krT_out, el_out);
      }
      prep_sync(team);
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_FUSED_DECAY, tp);
#pragma unroll
      for (int x = 0; x < P; ++x) {
        K2Slot<K, NCW>& st = sm.ring.slot[(n + x) % kStages];
        products<K, V, BT + kPad>(scratch[x], tid, &st.qd[0][0], &st.Aqk[0][0]);
      }
      prep_sync(team);
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_PRODUCTS, tp);
      if (twarp < P) invert(scratch[twarp], lane);  // a step's inverses side by side, one warp each
      prep_sync(team);
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_INVERSE, tp);
#pragma unroll
      for (int x = 0; x < P; ++x) {
        K2Slot<K, NCW>& st = sm.ring.slot[(n + x) % kStages];
        w_u<K, V, K + kPad, VC>(scratch[x], tid, &st.w[0][0], &st.u[0][0], col0);
      }
      // release: this thread's writes to the slots are ordered before the compute
      // warps' reads, which wait for all 128 arrivals of the team
#pragma unroll
      for (int x = 0; x < P; ++x)
        if (n + x < p.NT) mbar_arrive(&sm.ring.full[(n + x) % kStages]);
      if constexpr (!kEarlyLoads) {
#pragma unroll
        for (int x = 0; x < P; ++x) load_rows(p, b, h, n + kStride + x, twarp, lane, raw[x]);
      }
      if (tid == 0) KDA_PROF_LAP(p.prof, blockIdx.x, KDA_REG_K1_WU, tp);
    }
    return;
  }

  // ===================== compute warps 8 .. 8 + NCW - 1 =====================
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kMoveRegs) asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kComputeRegs));
#endif
  const int cw = warp - kPrepWarps;
  recurrence_warp<K, V, NCW>(sm.ring, p, bh, col0 + cw * VW, cw, lane, 0, p.NT);
}

// ---------------------------------------------------------------------------
// kda_frag_check_kernel -- the fragment identity behind this stage, tested on
// its own: one warp loads X (KD x 16, fp32) as an ACCUMULATOR fragment, turns it
// into a B fragment with c_to_b (movmatrix), multiplies A (16 x KD, bf16) by it
// and writes out = A @ bf16(X) (16 x 16, fp32). KD = 16 is vcorr's case (one
// k-tile), KD = K the state's (K/16 k-tiles). grid = 1, block = 32.
// ---------------------------------------------------------------------------
template <int KD>
__global__ void __launch_bounds__(32) kda_frag_check_kernel(const bf16* A, const float* X, float* out) {
  const int lane = threadIdx.x;
  WarpMma mma;
  auto thr_mma = mma.get_slice(lane);
  Tensor cX = make_identity_tensor(Shape<Int<KD>, Int<VW>>{});    // X as an (M = KD, N = 16) C tile
  Tensor tCcX = thr_mma.partition_C(cX);
  Tensor rX = thr_mma.partition_fragment_C(cX);
  CUTE_UNROLL
  for (int e = 0; e < size(rX); ++e) rX(e) = X[get<0>(tCcX(e)) * VW + get<1>(tCcX(e))];
  Tensor rXb = b_fragment<VW, KD>(thr_mma);
  c_to_b(rX, rXb);

  Tensor gA = make_tensor(make_gmem_ptr(A), make_layout(Shape<Int<BT>, Int<KD>>{}, LayoutRight{}));
  Tensor tCgA = thr_mma.partition_A(gA);
  Tensor tCrA = thr_mma.partition_fragment_A(gA);
  copy(tCgA, tCrA);
  Tensor cO = make_identity_tensor(Shape<Int<BT>, Int<VW>>{});
  Tensor tCcO = thr_mma.partition_C(cO);
  Tensor acc = thr_mma.partition_fragment_C(cO);
  clear(acc);
  gemm(mma, tCrA, rXb, acc);
  CUTE_UNROLL
  for (int e = 0; e < size(acc); ++e) out[get<0>(tCcO(e)) * VW + get<1>(tCcO(e))] = acc(e);
}

// ---------------------------------------------------------------------------
// launch helpers
// ---------------------------------------------------------------------------


template <int K, int V, int NCW>
cudaError_t launch_recurrence(const KdaFwdParams& p, cudaStream_t stream) {
  const long long blocks = (long long)p.B * p.H * (V / (VW * NCW));
  const size_t smem = sizeof(K2Smem<K, NCW>);
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_recurrence_kernel<K, V, NCW>, smem));
  kda_note_launch("kda_recurrence_kernel", (const void*)kda_recurrence_kernel<K, V, NCW>, dim3((unsigned)blocks), dim3(32 * (NCW + 1)), smem);
  kda_recurrence_kernel<K, V, NCW><<<(unsigned)blocks, 32 * (NCW + 1), smem, stream>>>(p);
  return cudaGetLastError();
}

template <int K, int V, int NCW>
cudaError_t launch_fused(const KdaFwdParams& p, cudaStream_t stream) {
  const long long blocks = (long long)p.B * p.H * (V / (VW * NCW));
  const size_t smem = sizeof(FusedSmem<K, V, NCW>);
  const int threads = kPrepThreads + 32 * NCW;
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_fused_kernel<K, V, NCW>, smem));
  kda_note_launch("kda_fused_kernel", (const void*)kda_fused_kernel<K, V, NCW>, dim3((unsigned)blocks), dim3(threads), smem);
  kda_fused_kernel<K, V, NCW><<<(unsigned)blocks, threads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <int K, int V>
cudaError_t launch(const KdaFwdParams& p, const KdaPlan& plan, cudaStream_t stream, int kernels) {
  if (plan.fused) {
    switch (plan.ncw) {
      case 1: return launch_fused<K, V, 1>(p, stream);
      case 2: return launch_fused<K, V, 2>(p, stream);
      case 4: return launch_fused<K, V, 4>(p, stream);
      case 8: if constexpr (V >= 128) return launch_fused<K, V, 8>(p, stream);
              return cudaErrorInvalidValue;
      default: return cudaErrorInvalidValue;
    }
  }
  const long long bhs = (long long)p.B * p.H;  // B*H*NT and B*H*V/16 <= INT_MAX (checked by the binding)
  if (kernels & KDA_LAUNCH_K1) {
    const size_t smem1 = sizeof(K1Smem<K, V>);
    KDA_RETURN_IF_ERROR(kda_allow_smem(kda_prepare_kernel<K, V>, smem1));
    kda_note_launch("kda_prepare_kernel", (const void*)kda_prepare_kernel<K, V>, dim3((unsigned)(bhs * p.NC)), dim3(kThreads), smem1);
    kda_prepare_kernel<K, V><<<(unsigned)(bhs * p.NC), kThreads, smem1, stream>>>(p);
    KDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  if (!(kernels & KDA_LAUNCH_K2)) return cudaSuccess;
  if (plan.ncw == 2) return launch_recurrence<K, V, 2>(p, stream);
  if (plan.ncw == 1) return launch_recurrence<K, V, 1>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace kda_stage

// ---------------------------------------------------------------------------
// launcher
// ---------------------------------------------------------------------------

cudaError_t kda_fwd_plan(const KdaFwdParams& p, int want_fused, int want_ncw, KdaPlan* plan) {
  if (p.B < 1 || p.T < 1 || p.H < 1 || p.K != p.V || (p.K != 64 && p.K != 128)) return cudaErrorInvalidValue;
  const int max_ncw = p.V / kda_stage::VW;
  if (want_fused >= 0) {  // a path asked for by name (the benchmark's and the tests' knob)
    const bool ok = want_fused ? (want_ncw == 1 || want_ncw == 2 || want_ncw == 4 || want_ncw == 8) && want_ncw <= max_ncw
                               : (want_ncw == 1 || want_ncw == 2);
    if (!ok) return cudaErrorInvalidValue;
    *plan = KdaPlan{want_fused != 0, want_ncw};
    return cudaSuccess;
  }
  int dev = 0, sms = 0;
  KDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  KDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const long long bhs = (long long)p.B * p.H;
  // At V = 128 the fused kernel where its blocks fill the SMs: eight compute
  // warps (one block per head) once the heads fill about two thirds of the SMs,
  // four (two blocks per head, each preparing every chunk) where that doubling
  // fills one to two thirds without a second wave. Measured (paths table): fused8
  // 0.72 against 1.16 ms for the split path at 512 heads and 1.41 against 1.72 ms
  // at 96 heads; fused4 0.133 against 0.163 ms and 1.01 against 1.18 ms at 64
  // heads (there fused8, with half the SMs idle, is slower than the split path).
  // Below that, and at V = 64 (not measured fused at many heads), the split
  // path: two compute warps per K2 block as soon as those blocks still cover the
  // SMs once (stage 07 asked for twice: measured 1.2-1.3x slower at 64 and 96
  // heads). docs/PERF_NOTES.md, results/h200/stage08/.
#ifndef KDA_NO_FUSED  // (the ablation: the split path everywhere, as stage 08)
  if (p.V == 128 && 3 * bhs >= 2LL * sms) {
    *plan = KdaPlan{true, 8};
    return cudaSuccess;
  }
  if (p.V == 128 && 3 * bhs >= (long long)sms && 2 * bhs <= (long long)sms) {
    *plan = KdaPlan{true, 4};
    return cudaSuccess;
  }
#endif
  *plan = KdaPlan{false, bhs * (p.V / (2 * kda_stage::VW)) >= sms ? 2 : 1};
  return cudaSuccess;
}

cudaError_t kda_fwd_launch(const KdaFwdParams& p, const KdaPlan& plan, cudaStream_t stream, int kernels) {
  if (kernels < KDA_LAUNCH_K1 || kernels > KDA_LAUNCH_ALL) return cudaErrorInvalidValue;
  if (p.B < 1 || p.T < 1 || p.H < 1 || p.NT != (p.T + kda_stage::BT - 1) / kda_stage::BT || p.K != p.V)
    return cudaErrorInvalidValue;
  if (!plan.fused && (p.qd == nullptr || p.w == nullptr || p.krT == nullptr || p.Aqk == nullptr ||
                      p.u == nullptr || p.el == nullptr))
    return cudaErrorInvalidValue;  // the split path needs the workspace
  if (!plan.fused && (p.n0 < 0 || p.NC < 1 || p.n0 + p.NC > p.NT))
    return cudaErrorInvalidValue;  // a segment of the sequence's chunks
  if (p.K == 64) return kda_stage::launch<64, 64>(p, plan, stream, kernels);
  if (p.K == 128) return kda_stage::launch<128, 128>(p, plan, stream, kernels);
  return cudaErrorInvalidValue;
}

cudaError_t kda_frag_check_launch(const __nv_bfloat16* A, const float* X, float* out, int kd, cudaStream_t stream) {
  const auto* a = reinterpret_cast<const kda_stage::bf16*>(A);
  switch (kd) {
    case 16: kda_stage::kda_frag_check_kernel<16><<<1, 32, 0, stream>>>(a, X, out); break;
    case 64: kda_stage::kda_frag_check_kernel<64><<<1, 32, 0, stream>>>(a, X, out); break;
    case 128: kda_stage::kda_frag_check_kernel<128><<<1, 32, 0, stream>>>(a, X, out); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}
