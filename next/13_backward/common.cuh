// common.cuh -- what the stage's kernels share (kda.cu includes it, through the
// kernel files): the constants, the MMA types and helpers (operands by
// ldmatrix, c_to_b's fragment moves), vector accesses and the fast
// approximations, mbarriers and asynchronous copies, and the shared-memory
// layouts that two kernels each use -- the prepare's scratch (K1Smem: K1 and the
// fused kernel's prepare teams) and the ring of prepared chunks (K2Slot, K2Smem:
// K2 and the fused kernel).
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

#include "kda.h"
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
constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = 2^(x log2 e)
// The factored products need exp(+-gc) in fp32's normal range: a chunk whose decay
// glast (every key dimension) is >= -kFactoredRange may take them (the bounded gate's
// guarantee: 16 tokens of a > -5); a wider chunk of an unbounded gate goes pair by pair.
constexpr float kFactoredRange = 80.f;
constexpr unsigned kFullMask = 0xffffffffu;

// The prepare's variant (K1 and the fused kernel), a template parameter picked once per
// call by the launcher (kda.cu, with_prep): the bounded gate's instantiation compiles no
// pairwise code, and no kernel reads a variant flag at run time.
//   kProducts (KdaProducts): factored, pairwise in every chunk, or as needed (each chunk
//     by its own decay);  kUHalves: u = Af @ v with Af in two bf16 halves.
template <int kProducts, bool kUHalves>
struct Prep {
  static constexpr int products = kProducts;
  static constexpr bool factored = kProducts != KDA_PRODUCTS_PAIRWISE;  // ki = kn / e is formed
  static constexpr bool pairwise = kProducts != KDA_PRODUCTS_FACTORED;  // gc kept for products_pairwise
  static constexpr bool as_needed = kProducts == KDA_PRODUCTS_AS_NEEDED;  // the chunk's decay decides
  // may run a gate without a bound (the softplus gate's pre-stage compiled in): every variant but the
  // factored one, which needs a bounded gate (the launcher refuses it any other)
  static constexpr bool unbounded = pairwise;
  static constexpr bool u_halves = kUHalves;
};

// What a warp of a warp-specialised block does (the fused kernel: prepare teams, then
// compute warps; K2: compute warps, then one load warp).
enum class WarpRole { kPrepare, kLoad, kCompute };

// ---------------------------------------------------------------------------
// MMA types, shared-memory views, vector accesses, fast approximations
// ---------------------------------------------------------------------------

// One warp-wide MMA instruction: D[16x8] = A[16x16] B[16x8] + C, bf16 in, fp32 accumulate.
using MmaAtom = MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>;
// 4 warps side by side along N: one step of the tiled MMA covers a 16 x 32 x 16
// tile; larger M or N repeat it (MMA_M, MMA_N modes). 128 threads. (K1's w and u.)
using TiledMma4 = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<_1, _4, _1>>{}));
// One warp on its own (K2's compute warps): a 16 x 8 x 16 step, repeated over M, N, K.
using WarpMma = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<_1, _1, _1>>{}));

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

// The fast approximations of the fused prepare (stage_row_slices, decay_columns<kFast>;
// K1 keeps the IEEE forms, so that the split path stays bitwise stage 07's). ex2.approx,
// lg2.approx and rcp.approx are single MUFU instructions (relative error about 2^-22); rsqrtf
// is MUFU.RSQ. The IEEE division and sqrt compile to a fast path, a check and a
// CALL to a slow path: four rows of them in stage_rows were about 1100
// instructions per warp, every row in turn behind a branch.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float lg2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// 1 / (1 + 2^(-x log2 e)): x -> -inf gives 1 / inf = 0, x -> +inf gives 1.
__device__ __forceinline__ float sigmoid_approx(float x) {
  return rcp_approx(1.0f + ex2_approx(-kLog2e * x));
}

// ---------------------------------------------------------------------------
// the sequences
// ---------------------------------------------------------------------------

// Sequence i of the call: its first token bos and its length len, in tokens of the
// [B, T] (or packed [1, T]) inputs. Without cu_seqlens sequence i is batch row i,
// (i T, T); with them (cu[i], cu[i + 1] - cu[i]), a length that may be 0 or shorter
// than a chunk. Token t of sequence i, head h is row (bos + t) * H + h of q, k, v, g,
// beta and o; its state is slot bh = i * H + h of h0 and ht.
struct SeqSpan {
  int bos, len;
};
__device__ __forceinline__ SeqSpan seq_span(const KdaFwdParams& p, int i) {
  if (p.cu_seqlens == nullptr) return SeqSpan{i * p.T, p.T};
  const int bos = __ldg(p.cu_seqlens + i);
  return SeqSpan{bos, __ldg(p.cu_seqlens + i + 1) - bos};
}
// The sequence's chunks: ceil(len / BT) (0 for an empty sequence).
__device__ __forceinline__ int chunks_of(const SeqSpan& s) { return (s.len + BT - 1) / BT; }
// Row (bos + t) * H + h of the token inputs: token t of the sequence, head h.
__device__ __forceinline__ size_t token_row(const KdaFwdParams& p, const SeqSpan& s, int t, int h) {
  return ((size_t)s.bos + t) * p.H + h;
}

}  // namespace kda_stage

// The ablation builds' switches and, for each, the previous stage's code that it runs instead.
#include "ablations.cuh"

namespace kda_stage {

// ---------------------------------------------------------------------------
// tensor-core MMAs: operands from shared memory, fragment moves
// ---------------------------------------------------------------------------

// acc(M, N) += sA(M, Kd) * sB(N, Kd)^T, with sA, sB in shared memory and acc this
// thread's accumulator fragment (from thr_mma.partition_fragment_C). `idx` is the
// thread's index inside the tiled MMA (0 .. size(mma) - 1). K-block by K-block
// (16 wide): copy this thread's share of A and B into registers, then issue the
// MMAs of the block.
//
// The A operand (16 x 16 per warp and k-block, rows 16-byte aligned and K-contiguous
// in every tile of this file) comes by ldmatrix: one LDSM.x4 per k-block gives the
// warp's four 8x8 quadrants straight in fragment order, where a per-element copy is
// four 32-bit shared loads plus their address arithmetic. The rows' 16-byte padding
// (kPad) keeps the eight row addresses of each quadrant on different banks.
template <class TiledMma>
__device__ __forceinline__ auto a_loader(TiledMma const& mma) {
  return make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, bf16>{}, mma);
}

template <class BAtom, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void mma_smem(TiledMma const& mma, int idx, TensorA const& sA,
                                         TensorB const& sB, TensorC& acc) {
  auto thr_mma = mma.get_slice(idx);
  auto ldsm = a_loader(mma);
  auto thr_ldsm = ldsm.get_slice(idx);
  auto ldsm_b = make_tiled_copy_B(Copy_Atom<BAtom, bf16>{}, mma);
  auto thr_ldsm_b = ldsm_b.get_slice(idx);
  Tensor tXsA = thr_ldsm.partition_S(sA);          // (CPY, CPY_M, CPY_K) this thread's ldmatrix rows
  Tensor tXsB = thr_ldsm_b.partition_S(sB);
  Tensor tCrA = thr_mma.partition_fragment_A(sA);  // (MMA, MMA_M, MMA_K) bf16 registers
  Tensor tXrA = thr_ldsm.retile_D(tCrA);           // the same registers, as the copy's destination
  Tensor tCrB = thr_mma.partition_fragment_B(sB);  // (MMA, MMA_N, MMA_K) bf16 registers
  Tensor tXrB = thr_ldsm_b.retile_D(tCrB);
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tCrA); ++kb) {
    copy(ldsm, tXsA(_, _, kb), tXrA(_, _, kb));
    copy(ldsm_b, tXsB(_, _, kb), tXrB(_, _, kb));
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
  auto ldsm = a_loader(mma);
  auto thr_ldsm = ldsm.get_slice(idx);
  Tensor tXsA = thr_ldsm.partition_S(sA);          // (CPY, CPY_M, CPY_K)
  Tensor tCrA = thr_mma.partition_fragment_A(sA);  // (MMA, MMA_M, MMA_K) bf16 registers
  Tensor tXrA = thr_ldsm.retile_D(tCrA);
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(tCrA); ++kb) {
    copy(ldsm, tXsA(_, _, kb), tXrA(_, _, kb));
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
  // The movmatrix result is already the B register (elements 2h, 2h + 1 of the tile,
  // low half first): written as one 32-bit word. (Written as two bf16 halves, the
  // compiler split and re-packed every word: two PRMT and a SHF per MOVM, about a
  // quarter of the chain's instructions.)
  Tensor bw = recast<uint32_t>(b);  // (2, N/8, M/16): word h = elements 2h, 2h + 1
  static_assert(size(decltype(bw.layout()){}) * 2 == size(FragB{}.layout()), "two bf16 per word");
  CUTE_UNROLL
  for (int mt = 0; mt < size<1>(c); ++mt) {
    CUTE_UNROLL
    for (int nt = 0; nt < size<2>(c); ++nt) {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        const __nv_bfloat162 x = __floats2bfloat162_rn(c(2 * h, mt, nt), c(2 * h + 1, mt, nt));
        SM75_U32x1_MOVM_T::copy(reinterpret_cast<const uint32_t&>(x), bw(h, nt, mt));
      }
    }
  }
}

// ---------------------------------------------------------------------------
// mbarriers and asynchronous copies
// ---------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------
// shared-memory layouts
// ---------------------------------------------------------------------------

// Shared memory of K1, and each prepare team's scratch in the fused kernel (K, V <= 128:
// about 43 KB).
template <int K, int V>
struct K1Smem {
  alignas(16) float qn[BT][K];         // l2-normalised q (0 for padded tokens)
  alignas(16) float kn[BT][K];         // l2-normalised k
  alignas(16) float a[BT][K];          // gate a (the cumsum runs in registers); pairwise: gc, written back
  alignas(16) float L[BT][BT];         // L = strict_lower(beta[:, None] * kd @ ki^T)
  alignas(16) float beta[BT];          // sigmoid(beta)
  alignas(16) bf16 kd[BT][K + kPad];   // kn * exp(gc)           A of kd @ ki^T; B (transposed view) of Af @ kd
  alignas(16) bf16 ki[BT][K + kPad];   // kn * exp(-gc)          B of kd @ ki^T and qd @ ki^T (factored only)
  alignas(16) bf16 qd[BT][K + kPad];   // scale * qn * exp(gc)   A of qd @ ki^T
  alignas(16) bf16 v[BT][V + kPad];    // v                      B (transposed view) of Af @ v
  alignas(16) bf16 Af[BT][BT + kPad];  // X * beta[None, :]      A of Af @ kd and Af @ v
  alignas(16) bf16 Afl[BT][BT + kPad]; // X * beta - Af          A of Afl @ v (u_halves: u's second half)
};

// Pipeline depth: shared-memory slots in the ring (the load warp runs up to
// kStages - 1 chunks ahead of the compute warps).
template <int K>
constexpr int kStagesFor = K <= 64 ? 4 : 3;
// K2's ring at K = 64 where each block has an SM to itself (blocks <= SMs: few heads, the
// serial chain binds): twice deeper, 7 chunks ahead (NCW = 2: 86,144 bytes), so that the
// workspace's loads hide behind a K = 64 chunk's short step of the chain (measured at B2 T2048
// H4 K64: 60.4-60.8 us against 63.2-70.9 with 4 slots; 12 slots were 3-4% faster still, but
// compute-sanitizer racecheck reported hazards between the ring's copies and its reads there
// that it did not report at 4, 6, 7 or 8 slots; 8 slots at K = 128 were slower, so K = 128
// keeps its 3). results/h200/stage12/ring_d802487.json, ring_race_25a6d0c.json.
constexpr int kLoneStages64 = 8;

// One slot of the ring: a chunk's state-independent operands (K = 128: 18 KB).
template <int K, int NCW>
struct K2Slot {
  alignas(16) bf16 w[BT][K + kPad];     // A (c, d) of w @ S
  alignas(16) bf16 qd[BT][K + kPad];    // A (c, d) of qd @ S
  alignas(16) bf16 krT[K][BT + kPad];   // A (d, c) of kr^T @ vcorr
  alignas(16) bf16 Aqk[BT][BT + kPad];  // A (c, j) of Aqk @ vcorr
  alignas(16) float u[BT][VW * NCW];    // u[c, col0 + vd] of the chunk (the block's columns)
  alignas(16) float el[K];              // exp(glast) of the chunk, at el_index(d)
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

}  // namespace kda_stage
