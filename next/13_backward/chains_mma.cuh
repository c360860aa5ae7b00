// chains_mma.cuh -- B2 and B3, the backward's two chains, on tensor cores (kda_bwd_chains_mma_kernel).
//
// The same two walks as backward.cuh's kda_bwd_chains_kernel, in the same grid (one block per (sequence, head,
// 32 value columns) and chain), with each chunk's products on bf16 mma.sync with fp32 accumulation, the way the
// forward's K2 takes its own chain (recurrence.cuh):
//
//   forward chain (B2)                            reverse chain (B3)
//   vcorr = u - w S                               dvcorr = kr dS + Aqk^T do
//   S     = diag(el) S + kr^T vcorr               dS     = diag(el) dS + qd^T do - w^T dvcorr
//
// Each warp keeps its 16 columns of the state (S or dS, [K, 16]) in registers as mma accumulators, fp32, and
// takes each product's operands as the instruction wants them: the chunk's [16, K] operands from shared memory
// as A fragments (rounded to bf16 as they are read), the state and vcorr / dvcorr as B fragments moved out of
// the accumulators by movmatrix. The reverse chain is the forward's with the operands' roles exchanged:
// kr where w was, do where u was, and two products on the state where the forward has one.
//
// The fragments (one warp, mma.sync.m16n8k16, lane l = 4 g + t; a word holds two bf16, the lower index low):
//   A (16 x 16): a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
//   B (16 x 8):  b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   C (16 x 8):  c[0], c[1] = C[g][2t], C[g][2t+1];  c[2], c[3] = C[g+8][2t], C[g+8][2t+1]
// The kernels' own bf16 rounding is what the emulator's test checks them against
// (tests/test_backward_emu.py, common/backward_model.py mma_chains).
#pragma once

namespace kda_stage {
namespace bwd {

constexpr int kMmaChainWarps = kVTile / 16;  // a chain block's warps: 16 value columns each
constexpr int kMmaChainThreads = 32 * kMmaChainWarps;
constexpr int kOpPad = 4;   // floats added to each fp32 operand row (Aqk, u, do): conflict-free fragment reads
constexpr int kOpPadH = 8;  // halves added to each bf16 operand row (qd, kr, w): 16 bytes, see MmaChainOps
constexpr int kOpRow = sizeof(kda_op_t) == 2 ? kOpPadH : kOpPad;  // fp32 qd, kr, w: the variant fp32_operands

// One chunk's operands of a chain in shared memory. qd, kr, w bf16 as B1 wrote them, their A fragments taken by
// ldmatrix (one instruction a 16 x 16 fragment, transposed or not), rows kOpPadH halves longer: the eight rows of
// one 8 x 8 matrix (16 bytes each, 2 (D + 8) bytes apart: 4 banks on from the last) then cover the 32 banks once.
// Aqk, u and do fp32 as B1 and the caller wrote them, rows kOpPad floats longer: a lane (g, t) reading row 2t at
// column g (Aqk transposed) then lands on bank 8t + g, every lane on its own (rows of D floats: 8 lanes a bank).
template <int D>
struct MmaChainOps {
  kda_op_t a[BT][D + kOpRow], b[BT][D + kOpRow], c[BT][D + kOpRow];  // w, kr (B2); kr, qd, w (B3)
  float el[D];
  float aqk[BT][BT + kOpPad];
  float e[BT][kVTile + kOpPad];  // u (B2) or do (B3), this block's columns
};
template <int D>
struct MmaChainSmem {
  MmaChainOps<D> ops[2];
};

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 x = __floats2bfloat162_rn(lo, hi);
  uint32_t w;
  memcpy(&w, &x, sizeof w);
  return w;
}

// c += A B (the fragments above). The emulator gathers the warp's registers and takes the sum in fp32.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
#ifdef KDA_EMULATED
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  const uint32_t* all = kda_emu::warp_exchange(mine, 6);
  auto half = [](uint32_t w, int hi) {
    const uint32_t bits = (hi ? w >> 16 : w & 0xffffu) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
  };
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int v = 0; v < 4; ++v) {
    const int r = g + 8 * (v >> 1), n = 2 * t + (v & 1);
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) {
      const float x = half(all[((r & 7) * 4 + (k & 7) / 2) * kda_emu::kWords + (r >> 3) + 2 * (k >> 3)], k & 1);
      const float y = half(all[(n * 4 + (k & 7) / 2) * kda_emu::kWords + 4 + (k >> 3)], k & 1);
      acc += x * y;
    }
    c[v] += acc;
  }
  kda_emu::warp_exchange_end();
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// The 8 x 8 bf16 matrix M of which lane 4 g + t holds M[g][2t..2t+1] -> that lane's word of M^T: M[2t][g],
// M[2t+1][g] (movmatrix.trans).
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
#ifdef KDA_EMULATED
  const uint32_t* all = kda_emu::warp_exchange(&x, 1);
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  auto at = [&](int r, int c) { return (all[(r * 4 + c / 2) * kda_emu::kWords] >> (16 * (c & 1))) & 0xffffu; };
  const uint32_t y = at(2 * t, g) | at(2 * t + 1, g) << 16;
  kda_emu::warp_exchange_end();
  return y;
#else
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
#endif
}

// Four 8 x 8 bf16 matrices from shared memory (ldmatrix.x4): lane 8 j + r gives the address of row r of matrix j (16
// bytes); lane (g, t) gets in d[j] M_j[g][2t..2t+1], or with `trans` M_j[2t][g], M_j[2t+1][g]. The emulator reads
// the rows at the warp's addresses.
template <bool kTrans>
__device__ __forceinline__ void ldsm_x4(const __nv_bfloat16* row, uint32_t (&d)[4]) {
#ifdef KDA_EMULATED
  const uint64_t at = reinterpret_cast<uintptr_t>(row);
  const uint32_t mine[2] = {(uint32_t)at, (uint32_t)(at >> 32)};
  const uint32_t* all = kda_emu::warp_exchange(mine, 2);
  auto row_of = [&](int l) {
    return reinterpret_cast<const uint16_t*>(
        (uintptr_t)((uint64_t)all[l * kda_emu::kWords] | (uint64_t)all[l * kda_emu::kWords + 1] << 32));
  };
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int j = 0; j < 4; ++j)
    d[j] = kTrans ? (uint32_t)row_of(8 * j + 2 * t)[g] | (uint32_t)row_of(8 * j + 2 * t + 1)[g] << 16
                  : (uint32_t)row_of(8 * j + g)[2 * t] | (uint32_t)row_of(8 * j + g)[2 * t + 1] << 16;
  kda_emu::warp_exchange_end();
#else
  const unsigned s = (unsigned)__cvta_generic_to_shared(row);
  if (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(s));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(s));
#endif
}

// The A fragment of the 16 x 16 block of X [16, LD] (bf16, row-major) at columns k0, by ldmatrix: a[0] = rows 0-7,
// a[1] = rows 8-15 of columns k0 .. k0 + 7, a[2], a[3] the same of columns k0 + 8 .. k0 + 15.
template <int LD>
__device__ __forceinline__ void op_frag(const __nv_bfloat16 (&x)[BT][LD], int k0, uint32_t (&a)[4]) {
  const int lane = threadIdx.x & 31, j = lane >> 3, r = lane & 7;
  ldsm_x4<false>(&x[r + 8 * (j & 1)][k0 + 8 * (j >> 1)], a);
}
// The A fragment of the 16 x 16 block of X^T at rows m0 (X [16, LD] bf16 row-major: A[m][k] = X[k][m0 + m]), by
// ldmatrix.trans: a[0] = A rows 0-7 (X columns m0 .. m0 + 7) of X rows 0-7, a[1] = A rows 8-15 of them, a[2], a[3]
// the same of X rows 8-15.
template <int LD>
__device__ __forceinline__ void op_frag_t(const __nv_bfloat16 (&x)[BT][LD], int m0, uint32_t (&a)[4]) {
  const int lane = threadIdx.x & 31, j = lane >> 3, r = lane & 7;
  ldsm_x4<true>(&x[r + 8 * (j >> 1)][m0 + 8 * (j & 1)], a);
}

// Accumulators of X [16 MT, 16] (c[mt][nt][v]) -> the B fragments of X as (k = its rows, n = its columns),
// rounded to bf16: half h of accumulator tile (mt, nt), transposed, is word h of B tile (kt = mt, nt).
template <int MT>
__device__ __forceinline__ void acc_to_b(const float (&c)[MT][2][4], uint32_t (&b)[MT][2][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) b[mt][nt][h] = transpose8x8(pack_bf16(c[mt][nt][2 * h], c[mt][nt][2 * h + 1]));
}

// The A fragment of the 16 x 16 block at (r0, k0) of A [r][k] = x[r * rs + k * ks] (fp32 in shared memory:
// rs = row length, ks = 1 for A itself; rs = 1, ks = row length for the transpose of what is stored), times sgn.
template <int RS, int KS>
__device__ __forceinline__ void a_frag(const float* x, int r0, int k0, float sgn, uint32_t (&a)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  auto at = [&](int r, int k) { return sgn * x[(r0 + r) * RS + (k0 + k) * KS]; };
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i & 1), k = 2 * t + 8 * (i >> 1);
    a[i] = pack_bf16(at(r, k), at(r, k + 1));
  }
}

// The same two fragments from fp32 rows, rounded to bf16 as they are read (the variant fp32_operands).
template <int LD>
__device__ __forceinline__ void op_frag(const float (&x)[BT][LD], int k0, uint32_t (&a)[4]) {
  a_frag<LD, 1>(&x[0][0], 0, k0, 1.f, a);
}
template <int LD>
__device__ __forceinline__ void op_frag_t(const float (&x)[BT][LD], int m0, uint32_t (&a)[4]) {
  a_frag<1, LD>(&x[0][0], m0, 0, 1.f, a);
}

// Lane (g, t)'s element v of accumulator tile (mt, nt): row 16 mt + g + 8 (v / 2), column 8 nt + 2 t + v % 2.
__device__ __forceinline__ int acc_row(int mt, int v) { return 16 * mt + ((threadIdx.x & 31) >> 2) + 8 * (v >> 1); }
__device__ __forceinline__ int acc_col(int nt, int v) { return 8 * nt + 2 * (threadIdx.x & 3) + (v & 1); }

// The warp's 16 columns cw .. cw + 15 of a [K, V] state of pair bh (fp32, K-first) into / out of accumulators.
template <int D>
__device__ __forceinline__ void load_state(const float* src, int bh, int cw, float (&x)[D / 16][2][4]) {
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int v = 0; v < 4; ++v)
        x[mt][nt][v] = src != nullptr ? src[state_at<D>(bh, acc_row(mt, v), cw + acc_col(nt, v))] : 0.f;
}
// Elements v and v + 1 of an accumulator tile are adjacent columns of one row: one 4-byte (bf16) or 8-byte (fp32) store.
template <int D>
__device__ __forceinline__ void store_state(kda_state_t* dst, int cw, const float (&x)[D / 16][2][4]) {
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int v = 0; v < 4; v += 2) {
        kda_state_t* at = dst + (size_t)acc_row(mt, v) * D + cw + acc_col(nt, v);
#ifdef KDA_BWD_STATES_FP32
        *reinterpret_cast<float2*>(at) = make_float2(x[mt][nt][v], x[mt][nt][v + 1]);
#else
        *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(x[mt][nt][v], x[mt][nt][v + 1]);
#endif
      }
}

// x = diag(el) x: row d of the state scaled by el[d].
template <int D>
__device__ __forceinline__ void decay_rows(const float* el, float (&x)[D / 16][2][4]) {
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const float e = el[acc_row(mt, v)];
      x[mt][0][v] *= e;
      x[mt][1][v] *= e;
    }
}

// x[mt] += A_mt B for every 16-row block mt of A [K, 16] = m^T (m a stored [16, K] operand): x += m^T B.
template <int D>
__device__ __forceinline__ void add_transposed_product(const kda_op_t (&m)[BT][D + kOpRow],
                                                       const uint32_t (&b)[1][2][2], float (&x)[D / 16][2][4]) {
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt) {
    uint32_t a[4];
    op_frag_t(m, 16 * mt, a);
    mma_bf16(x[mt][0], a, b[0][0]);
    mma_bf16(x[mt][1], a, b[0][1]);
  }
}

// y += A S for A [16, K] stored row-major, S the state's B fragments.
template <int D>
__device__ __forceinline__ void add_row_product(const kda_op_t (&m)[BT][D + kOpRow],
                                                const uint32_t (&sb)[D / 16][2][2], float (&y)[2][4]) {
#pragma unroll
  for (int kt = 0; kt < D / 16; ++kt) {
    uint32_t a[4];
    op_frag(m, 16 * kt, a);
    mma_bf16(y[0], a, sb[kt][0]);
    mma_bf16(y[1], a, sb[kt][1]);
  }
}

template <int D>
__device__ void states_chain_mma(const KdaBwdParams& p, MmaChainSmem<D>& s, int block) {
  const int tiles = D / kVTile, warp = threadIdx.x >> 5;
  const int bh = block / tiles, col0 = (block % tiles) * kVTile, cw = col0 + 16 * warp;
  float S[D / 16][2][4];
  uint32_t Sb[D / 16][2][2];
  load_state<D>(p.h0, bh, cw, S);
  acc_to_b<D / 16>(S, Sb);
  const int nt = (span_of(p, bh / p.H).len + BT - 1) / BT;
  if (nt > 0) issue_states<kMmaChainThreads, D>(p, s.ops[0], chunk_slot(p, bh, 0), col0);
  const bool timer = threadIdx.x == 0 && col0 == 0;  // the profile: one block of the pair's chain
  (void)timer;
  KDA_PROF_START(tp);
  for (int n = 0; n < nt; ++n) {
    const size_t slot = chunk_slot(p, bh, n);
    MmaChainOps<D>& o = s.ops[n & 1];
    copies_arrived();
    __syncthreads();  // chunk n's operands are in; the other buffer's last reader (chunk n - 1) is done
    if (timer) KDA_PROF_LAP(p.prof, slot, KDA_REG_B2_WAIT, tp);
    if (n + 1 < nt) issue_states<kMmaChainThreads, D>(p, s.ops[(n + 1) & 1], chunk_slot(p, bh, n + 1), col0);
    store_state<D>(p.states + slot * D * D, cw, S);
    float vc[2][4] = {};
    add_row_product<D>(o.a, Sb, vc);  // w S
#pragma unroll
    for (int nt2 = 0; nt2 < 2; ++nt2)
#pragma unroll
      for (int v = 0; v < 4; v += 2) {  // elements v, v + 1: adjacent columns
        const int c = acc_row(0, v), j = 16 * warp + acc_col(nt2, v);
        vc[nt2][v] = o.e[c][j] - vc[nt2][v];
        vc[nt2][v + 1] = o.e[c][j + 1] - vc[nt2][v + 1];
        *reinterpret_cast<float2*>(p.vcorr + (slot * BT + c) * D + col0 + j) = make_float2(vc[nt2][v], vc[nt2][v + 1]);
      }
    uint32_t vb[1][2][2];
    acc_to_b<1>(reinterpret_cast<const float(&)[1][2][4]>(vc), vb);
    decay_rows<D>(o.el, S);
    add_transposed_product<D>(o.b, vb, S);  // + kr^T vcorr
    acc_to_b<D / 16>(S, Sb);
    if (timer) KDA_PROF_LAP(p.prof, slot, KDA_REG_B2_STEP, tp);
  }
}

template <int D>
__device__ void reverse_chain_mma(const KdaBwdParams& p, MmaChainSmem<D>& s, int block) {
  const int tiles = D / kVTile, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int bh = block / tiles, col0 = (block % tiles) * kVTile, cw = col0 + 16 * warp;
  const int h = bh % p.H;
  const Span sq = span_of(p, bh / p.H);
  const int nt = (sq.len + BT - 1) / BT;
  float dS[D / 16][2][4];
  uint32_t dSb[D / 16][2][2];
  load_state<D>(p.dht, bh, cw, dS);
  acc_to_b<D / 16>(dS, dSb);
  if (nt > 0) issue_reverse<kMmaChainThreads, D>(p, s.ops[(nt - 1) & 1], chunk_slot(p, bh, nt - 1), sq, h, nt - 1, col0);
  const bool timer = threadIdx.x == 0 && col0 == 0;  // the profile: one block of the pair's chain
  (void)timer;
  KDA_PROF_START(tp);
  for (int n = nt - 1; n >= 0; --n) {
    const size_t slot = chunk_slot(p, bh, n);
    MmaChainOps<D>& o = s.ops[n & 1];
    copies_arrived();
    __syncthreads();  // chunk n's operands are in; the other buffer's last reader (chunk n + 1) is done
    if (timer) KDA_PROF_LAP(p.prof, slot, KDA_REG_B3_WAIT, tp);
    if (n > 0) issue_reverse<kMmaChainThreads, D>(p, s.ops[(n - 1) & 1], chunk_slot(p, bh, n - 1), sq, h, n - 1, col0);
    store_state<D>(p.dstates + slot * D * D, cw, dS);
    // do as a B fragment (k = token, n = column): b[0] = do[2t..2t+1][g], b[1] = do[2t+8..2t+9][g]
    uint32_t dob[1][2][2];
#pragma unroll
    for (int nt2 = 0; nt2 < 2; ++nt2)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int c = 2 * t + 8 * hh, j = 16 * warp + 8 * nt2 + g;
        if (p.dout_bf != nullptr) {  // do as it came, bf16, at the start of each row
          const uint16_t* r0 = reinterpret_cast<const uint16_t*>(&o.e[c][0]);
          const uint16_t* r1 = reinterpret_cast<const uint16_t*>(&o.e[c + 1][0]);
          dob[0][nt2][hh] = (uint32_t)r0[j] | (uint32_t)r1[j] << 16;
        } else {
          dob[0][nt2][hh] = pack_bf16(o.e[c][j], o.e[c + 1][j]);
        }
      }
    float dv[2][4] = {};
    add_row_product<D>(o.a, dSb, dv);  // kr dS
    uint32_t a[4];
    a_frag<1, BT + kOpPad>(&o.aqk[0][0], 0, 0, 1.f, a);  // Aqk^T
    mma_bf16(dv[0], a, dob[0][0]);
    mma_bf16(dv[1], a, dob[0][1]);
#pragma unroll
    for (int nt2 = 0; nt2 < 2; ++nt2)
#pragma unroll
      for (int v = 0; v < 4; v += 2)
        *reinterpret_cast<float2*>(p.dvcorr + (slot * BT + acc_row(0, v)) * D + cw + acc_col(nt2, v)) =
            make_float2(dv[nt2][v], dv[nt2][v + 1]);
    uint32_t dvb[1][2][2];
    acc_to_b<1>(reinterpret_cast<const float(&)[1][2][4]>(dv), dvb);
    decay_rows<D>(o.el, dS);
    add_transposed_product<D>(o.b, dob, dS);  // + qd^T do
    // - w^T dvcorr: dvcorr's B fragments negated (the sign bit of each bf16)
#pragma unroll
    for (int nt2 = 0; nt2 < 2; ++nt2)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) dvb[0][nt2][hh] ^= 0x80008000u;
    add_transposed_product<D>(o.c, dvb, dS);
    acc_to_b<D / 16>(dS, dSb);
    if (timer) KDA_PROF_LAP(p.prof, slot, KDA_REG_B3_STEP, tp);
  }
  if (p.dh0 != nullptr) {
#pragma unroll
    for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
      for (int nt2 = 0; nt2 < 2; ++nt2)
#pragma unroll
        for (int v = 0; v < 4; ++v) p.dh0[state_at<D>(bh, acc_row(mt, v), cw + acc_col(nt2, v))] = dS[mt][nt2][v];
  }
}

// As kda_bwd_chains_kernel: the first N H D / 32 blocks the forward chain, the rest the reverse chain.
template <int D>
__global__ void __launch_bounds__(kMmaChainThreads) kda_bwd_chains_mma_kernel(const KdaBwdParams p) {
  KDA_DYNAMIC_SMEM(smem_raw);
  MmaChainSmem<D>& s = *reinterpret_cast<MmaChainSmem<D>*>(smem_raw);
  const int chains = p.N * p.H * (D / kVTile);
  if ((int)blockIdx.x < chains)
    states_chain_mma<D>(p, s, blockIdx.x);
  else
    reverse_chain_mma<D>(p, s, blockIdx.x - chains);
}

}  // namespace bwd
}  // namespace kda_stage
