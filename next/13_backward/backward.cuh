// backward.cuh -- the chunked backward of stage 13 (kda.h, KdaBwdParams), in four kernels.
//
// The forward's chunk algebra (DESIGN.md section 3) walked back, as common/backward_model.py
// takes it in fp64 (every equation below is one line of that file):
//
//   B1 prepare (parallel, one block per chunk): each chunk's chain operands again, in fp32:
//        qd, kr, w [16, K], u [16, V], Aqk [16, 16], el = exp(glast) [K]
//   B2 states (serial, one block per (sequence, head, 32 value columns)): the forward chain
//        from h0 again, keeping each chunk's entry state S and vcorr = u - w S;
//   B3 reverse (serial, as many blocks, from the last chunk to the first): the state's gradient
//        dS (from dht) carried back, keeping each chunk's exit gradient and
//        dvcorr = kr dS + Aqk^T do;      dS <- el * dS + qd^T do - w^T dvcorr;   dh0 = dS
//   B4 adjoint (parallel, one block per chunk): from S, dS, vcorr, dvcorr and do, the chunk's
//        gradients through o, the state update, the WY transform, the two 16 x 16 products and
//        the decays, then through the pre-stage (l2norm, sigmoid, the gate) to the raw inputs.
//
// No decay exceeds 1 (exp(gc_c - gc_i) for i <= c, factored only where a chunk's range allows), so no
// gate overflows. The chains run on tensor cores (chains_mma.cuh); their first version, every product
// fp32 on the CUDA cores, is here too: the "exact" build (stage.py BACKWARD_VARIANTS) runs it, the
// reference the tensor-core kernels are checked against.
// B2 and B3 need only B1's operands: one launch runs both, side by side on different SMs.
#pragma once

#ifndef KDA_DYNAMIC_SMEM  // kda_emu.h, which runs these kernels on the CPU, has its own
#define KDA_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace kda_stage {
namespace bwd {

constexpr int kVTile = 32;  // value columns per chain block (one per lane)
constexpr int kChainWarps = 4;  // a chain block's warps split the key dimension in four
constexpr int kPrepThreads = 128;
constexpr int kAdjThreads = 256;

// The chunk as both B1 and B4 rebuild it, in shared memory: q, k normalised, gc the cumulative
// log decay (natural log), the pair sums kk[c][i] = sum_d k_c k_i e^{gc_c - gc_i} and
// qk[c][i] = the same with q_c (i <= c), X = (I + L)^-1 with L = strict_lower(beta_c kk).
// Rows of D + 1 floats: the pair loops give each of 16 lanes its own row i at the same column d, which
// rows of D floats (D a multiple of 32) would put in one bank, 16 lanes queued on it; a row one float
// longer moves each row to the next bank.
#ifdef KDA_BWD_NO_PAD  // the variant build without the padding (stage.py build(variant="no_pad")), timed beside it
constexpr int kPad = 0;
#else
constexpr int kPad = 1;
#endif
template <int D>
struct ChunkSmem {
  float q[BT][D + kPad], k[BT][D + kPad], v[BT][D + kPad], gc[BT][D + kPad];
  float beta[BT], rq[BT], rk[BT];
  float kk[BT][BT + 1], qk[BT][BT + 1], X[BT][BT + 1];
  float wide[8];  // per warp: 1 where a key dimension decays by more than kFactoredRange in the chunk
};
// The factored pair sums' operands (load_chunk): q e^gc, k e^gc and k e^-gc, only while the pair sums are taken.
template <int D>
struct PairScratch {
  float qf[BT][D + kPad], kf[BT][D + kPad], kb[BT][D + kPad];
};

__device__ __forceinline__ float bf2f(__nv_bfloat16 x) { return __bfloat162float(x); }

// A gradient element into its output: bf16 where the bf16 buffer is given, else fp32.
__device__ __forceinline__ void put_grad(float* f32, __nv_bfloat16* bf, size_t i, float x) {
  if (bf != nullptr)
    bf[i] = __float2bfloat16_rn(x);
  else
    f32[i] = x;
}

// A state element as stored for B4 (kda_state_t: bf16, or fp32 in the variant build), and back.
__device__ __forceinline__ kda_state_t to_state(float x) {
#ifdef KDA_BWD_STATES_FP32
  return x;
#else
  return __float2bfloat16_rn(x);
#endif
}
// A chain operand as B1 stores it (kda_op_t).
__device__ __forceinline__ kda_op_t to_op(float x) {
#ifdef KDA_BWD_OPS_FP32
  return x;
#else
  return __float2bfloat16_rn(x);
#endif
}
__device__ __forceinline__ float from_state(kda_state_t x) {
#ifdef KDA_BWD_STATES_FP32
  return x;
#else
  return __bfloat162float(x);
#endif
}

// Sequence i: its first token and length (common.cuh's seq_span for KdaBwdParams). Without cu_seqlens
// batch row i, (i T, T); with them tokens cu[i] .. cu[i + 1] - 1 of the packed [1, T] inputs.
struct Span {
  int bos, len;
};
__device__ __forceinline__ Span span_of(const KdaBwdParams& p, int i) {
  if (p.cu_seqlens == nullptr) return Span{i * p.T, p.T};
  return Span{p.cu_seqlens[i], p.cu_seqlens[i + 1] - p.cu_seqlens[i]};
}

// The log decay of one gate argument x = g + dt_bias (A = exp(A_log)).
__device__ __forceinline__ float gate_of(const KdaBwdParams& p, float A, float x) {
  if (p.gate_id == KDA_GATE_SOFTPLUS) {
    const float sp = x > 20.f ? x : log1pf(expf(x));
    return -A * sp;
  }
  return p.lower_bound / (1.f + expf(-A * x));
}

// Workspace offsets of chunk n of pair bh.
__device__ __forceinline__ size_t chunk_slot(const KdaBwdParams& p, int bh, int n) {
  return (size_t)bh * p.NT + n;
}

// Load and rebuild chunk n of pair bh (sequence bh / H, head bh % H) into s, with NTHR threads; its three parts
// are timed into the profile's regions reg0, reg0 + 1, reg0 + 2 (load, pair sums, inverse).
// Tokens past the sequence's end are zero (k = q = v = 0, beta = 0, a = 0). With kPairs false (B4 where B1 keeps
// them, kda.h KDA_BWD_KEEP_XKK) the pair sums kk and the inverse X are B1's, read from p.Xkk with the inputs; qk
// is then not formed.
template <int D, int NTHR, bool kPairs = true>
__device__ void load_chunk(const KdaBwdParams& p, int bh, int n, ChunkSmem<D>& s, PairScratch<D>& sc, int reg0) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int h = bh % p.H;
  const Span sq = span_of(p, bh / p.H);
  const int t0 = n * BT, len = min(BT, sq.len - t0);
  const size_t slot = chunk_slot(p, bh, n);
  (void)slot;
  (void)reg0;
  KDA_PROF_START(tp);
  const float A = expf(p.A_log[h]);
  // 8 elements (16 bytes) of a row of q, k, v and g a load, every load of the thread issued before the first is used
  constexpr int V8 = D / 8;
#pragma unroll
  for (int it = 0; it < (BT * V8 + NTHR - 1) / NTHR; ++it) {
    const int vi = tid + it * NTHR, c = vi / V8, d0 = 8 * (vi % V8);
    if (vi >= BT * V8) break;  // K = 64 in B4: half the threads
    uint4 xq = {0, 0, 0, 0}, xk = xq, xv = xq, xg = xq;
    if (c < len) {
      const size_t at = (((size_t)sq.bos + t0 + c) * p.H + h) * D + d0;
      xq = *reinterpret_cast<const uint4*>(p.q + at);
      xk = *reinterpret_cast<const uint4*>(p.k + at);
      xv = *reinterpret_cast<const uint4*>(p.v + at);
      xg = *reinterpret_cast<const uint4*>(p.g + at);
    }
    const __nv_bfloat16 *eq = reinterpret_cast<const __nv_bfloat16*>(&xq), *ek = reinterpret_cast<const __nv_bfloat16*>(&xk),
                        *ev = reinterpret_cast<const __nv_bfloat16*>(&xv), *eg = reinterpret_cast<const __nv_bfloat16*>(&xg);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      s.q[c][d0 + j] = bf2f(eq[j]);
      s.k[c][d0 + j] = bf2f(ek[j]);
      s.v[c][d0 + j] = bf2f(ev[j]);
      s.gc[c][d0 + j] = c < len ? gate_of(p, A, bf2f(eg[j]) + p.dt_bias[h * D + d0 + j]) : 0.f;
    }
  }
  if (tid < BT) {
    const int c = tid;
    s.beta[c] = c < len ? 1.f / (1.f + expf(-bf2f(p.beta[((size_t)sq.bos + t0 + c) * p.H + h]))) : 0.f;
  }
#ifdef KDA_BWD_KEEP_XKK
  if (!kPairs) {  // B1's X and kk of this chunk, loaded with the inputs
    for (int pr = tid; pr < BT * BT; pr += NTHR) {
      const int c = pr / BT, i = pr % BT;
      s.X[c][i] = p.Xkk[slot * 2 * BT * BT + pr];
      s.kk[c][i] = p.Xkk[slot * 2 * BT * BT + BT * BT + pr];
    }
  }
#endif
  __syncthreads();
  // the norms, one warp per row
  for (int c = warp; c < BT; c += NTHR / 32) {
    float sq = 0.f, sk = 0.f;
    for (int d = lane; d < D; d += 32) {
      sq += s.q[c][d] * s.q[c][d];
      sk += s.k[c][d] * s.k[c][d];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      sq += __shfl_xor_sync(0xffffffffu, sq, o);
      sk += __shfl_xor_sync(0xffffffffu, sk, o);
    }
    if (lane == 0) {
      s.rq[c] = sqrtf(sq + kL2Eps);
      s.rk[c] = sqrtf(sk + kL2Eps);
    }
  }
  __syncthreads();
  for (int idx = tid; idx < BT * D; idx += NTHR) {
    const int c = idx / D, d = idx % D;
    s.q[c][d] /= s.rq[c];
    s.k[c][d] /= s.rk[c];
  }
  float wide = 0.f;  // 1 where one of this thread's key dimensions decays by more than kFactoredRange
  for (int d = tid; d < D; d += NTHR) {  // gc = cumsum(a) over the chunk
    float acc = 0.f;
    for (int c = 0; c < BT; ++c) {
      acc += s.gc[c][d];
      s.gc[c][d] = acc;
    }
    if (acc < -kFactoredRange) wide = 1.f;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) wide = fmaxf(wide, __shfl_xor_sync(0xffffffffu, wide, o));
  if (lane == 0) s.wide[warp] = wide;
  __syncthreads();
  for (int w = 0; w < NTHR / 32; ++w) wide = fmaxf(wide, s.wide[w]);
  if (tid == 0) KDA_PROF_LAP(p.prof, slot, reg0, tp);
  if (!kPairs) return;  // kk and X are in (read above)
#ifndef KDA_BWD_PAIRWISE_SUMS
  if (wide == 0.f) {  // the whole block: every thread read the same flags
    // the pair sums factored, as the forward's K1 takes them where a chunk allows:
    // e^{gc_c - gc_i} = e^{gc_c} e^{-gc_i}, both in fp32's normal range (gc >= -kFactoredRange)
    for (int idx = tid; idx < BT * D; idx += NTHR) {
      const int c = idx / D, d = idx % D;
      const float e = expf(s.gc[c][d]);
      sc.qf[c][d] = s.q[c][d] * e;
      sc.kf[c][d] = s.k[c][d] * e;
      sc.kb[c][d] = s.k[c][d] * expf(-s.gc[c][d]);
    }
    __syncthreads();
    for (int pr = tid; pr < BT * BT; pr += NTHR) {
      const int c = pr / BT, i = pr % BT;
      float kk = 0.f, qk = 0.f;
      if (i <= c) {
        for (int d = 0; d < D; ++d) {
          kk += sc.kf[c][d] * sc.kb[i][d];
          qk += sc.qf[c][d] * sc.kb[i][d];
        }
      }
      s.kk[c][i] = kk;
      s.qk[c][i] = qk;
    }
  } else
#endif
  {
    // the pair sums, one pair per thread (i <= c), every decay <= 1
    for (int pr = tid; pr < BT * BT; pr += NTHR) {
      const int c = pr / BT, i = pr % BT;
      float kk = 0.f, qk = 0.f;
      if (i <= c) {
        for (int d = 0; d < D; ++d) {
          const float dec = expf(s.gc[c][d] - s.gc[i][d]) * s.k[i][d];
          kk += s.k[c][d] * dec;
          qk += s.q[c][d] * dec;
        }
      }
      s.kk[c][i] = kk;
      s.qk[c][i] = qk;
    }
  }
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, slot, reg0 + 1, tp);
  // X = (I + L)^-1, one column per thread: X[r][j] = -sum_{j <= m < r} L[r][m] X[m][j], the column kept in
  // registers (xc[m] = 0 for m < j, so the sum may start at m = 0: the same value, with no loop bound that
  // depends on j and no shared-memory round trip between one row's result and the next row's sum)
  if (tid < BT) {
    const int j = tid;
    float xc[BT];
#pragma unroll
    for (int r = 0; r < BT; ++r) {
      float x = r == j ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < r; ++m) x -= s.beta[r] * s.kk[r][m] * xc[m];
      xc[r] = x;
      s.X[r][j] = x;
    }
  }
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, slot, reg0 + 2, tp);
}

// ---------------------------------------------------------------------------
// B1: the chain operands of every chunk
// ---------------------------------------------------------------------------
// Blocks of B1 per SM that ptxas must leave registers for: 214 registers allow 2 (12.5% occupancy, Nsight Compute at
// cc1f336); the variant builds "prep_3blocks" and "prep_4blocks" ask for 3 (168 registers, 88 bytes of spill) and 4
// (128 registers, 416 bytes of spill), to be timed beside this one.
#ifdef KDA_BWD_PREP_MIN_BLOCKS
constexpr int kPrepMinBlocks = KDA_BWD_PREP_MIN_BLOCKS;
#else
constexpr int kPrepMinBlocks = 1;
#endif
template <int D>
struct PrepSmem {
  ChunkSmem<D> ch;
  PairScratch<D> sc;
};
template <int D>
__global__ void __launch_bounds__(kPrepThreads, kPrepMinBlocks) kda_bwd_prepare_kernel(const KdaBwdParams p) {
  KDA_DYNAMIC_SMEM(smem_raw);
  PrepSmem<D>& sm = *reinterpret_cast<PrepSmem<D>*>(smem_raw);
  ChunkSmem<D>& s = sm.ch;
  const int bh = blockIdx.x / p.NT, n = blockIdx.x % p.NT;
  if (n * BT >= span_of(p, bh / p.H).len) return;  // past the sequence's end: the whole block
  load_chunk<D, kPrepThreads>(p, bh, n, s, sm.sc, KDA_REG_B1_LOAD);
  const size_t slot = chunk_slot(p, bh, n);
  const int tid = threadIdx.x;
  KDA_PROF_START(tp);
  for (int d = tid; d < D; d += kPrepThreads) {
    const float glast = s.gc[BT - 1][d];
    float kd[BT];
#pragma unroll
    for (int c = 0; c < BT; ++c) {
      const float ed = expf(s.gc[c][d]);
      kd[c] = s.k[c][d] * ed;
      p.qd[(slot * BT + c) * D + d] = to_op(p.scale * s.q[c][d] * ed);
      p.kr[(slot * BT + c) * D + d] = to_op(s.k[c][d] * expf(glast - s.gc[c][d]));
    }
#pragma unroll
    for (int c = 0; c < BT; ++c) {
      float w = 0.f, u = 0.f;
#pragma unroll
      for (int i = 0; i <= c; ++i) {
        const float af = s.X[c][i] * s.beta[i];
        w += af * kd[i];
        u += af * s.v[i][d];
      }
      p.w[(slot * BT + c) * D + d] = to_op(w);
      p.u[(slot * BT + c) * D + d] = u;
    }
    p.el[slot * D + d] = expf(glast);
  }
  for (int pr = tid; pr < BT * BT; pr += kPrepThreads) {
    const int c = pr / BT, i = pr % BT;
    p.Aqk[slot * BT * BT + pr] = i <= c ? p.scale * s.qk[c][i] : 0.f;
#ifdef KDA_BWD_KEEP_XKK
    p.Xkk[slot * 2 * BT * BT + pr] = s.X[c][i];  // for B4, which then forms neither
    p.Xkk[slot * 2 * BT * BT + BT * BT + pr] = s.kk[c][i];
#endif
  }
#ifdef KDA_PROFILE
  __syncthreads();  // the block's stores issued (the profile build only)
  if (tid == 0) KDA_PROF_LAP(p.prof, slot, KDA_REG_B1_STORE, tp);
#endif
}

// ---------------------------------------------------------------------------
// B2, B3: the two chains. Chain block (bh, tile): lane j holds value column tile * 32 + j, warp w the
// key rows [w D / 4, (w + 1) D / 4) of it, in registers.
// ---------------------------------------------------------------------------
// One chunk's operands of a chain in shared memory; the chains keep two, the next chunk's copied in with
// cp.async while the current one is worked on.
template <int D>
struct ChainOps {
  float a[BT][D], b[BT][D], c[BT][D];  // the chunk's three [16, K] operands
  float el[D];
  float aqk[BT][BT];
  float e[BT][kVTile];  // u (B2) or do (B3), this block's columns
};

template <int D>
struct ChainSmem {
  ChainOps<D> ops[2];
  float part[kChainWarps][BT][kVTile];  // partial sums over each warp's key rows
  float x[BT][kVTile];                  // vcorr (B2) or dvcorr (B3)
};

// 16 bytes from global to shared memory without the registers (cp.async; the emulator copies at once), zeros
// where `valid` is false (src is then not read).
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid = true) {
#ifdef KDA_EMULATED
  if (valid)
    memcpy(dst, src, 16);
  else
    memset(dst, 0, 16);
#else
  const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
#endif
}
__device__ __forceinline__ void copies_issued() {
#ifndef KDA_EMULATED
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
__device__ __forceinline__ void copies_arrived() {
#ifndef KDA_EMULATED
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#endif
}
// Until at most `pending` (0, 1 or 2) of this thread's latest groups are still in flight.
__device__ __forceinline__ void copies_arrived_but(int pending) {
#ifndef KDA_EMULATED
  if (pending >= 2)
    asm volatile("cp.async.wait_group 2;\n" ::: "memory");
  else if (pending == 1)
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
  else
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
#else
  (void)pending;
#endif
}

constexpr int kChainThreads = kVTile * kChainWarps;

// Rows 0 .. BT - 1 of a block W elements wide at src (rows src_ld elements apart) into dst (rows LD >= W elements
// long), by NTHR threads, 16 bytes a copy. Both chain kernels' operand copies (the tensor-core one's rows are
// longer, and its qd, kr, w bf16).
template <int NTHR, int W, int LD, class T>
__device__ __forceinline__ void copy_rows(const T* src, T (&dst)[BT][LD], int src_ld = W) {
  constexpr int E = 16 / sizeof(T);  // elements a copy
  for (int v = threadIdx.x; v < BT * W / E; v += NTHR) {
    const int c = v / (W / E), j = E * (v % (W / E));
    copy16(&dst[c][j], src + (size_t)c * src_ld + j);
  }
}

// This thread's slice of a [K, V] state of pair bh (fp32, row-major), rows r0 .. r0 + D / 4 - 1, column col.
template <int D>
__device__ __forceinline__ size_t state_at(int bh, int row, int col) {
  return ((size_t)bh * D + row) * D + col;
}

// B2's operands of chunk `slot` (w, kr, el, u's 32 columns from col0) into `o` (ChainOps or MmaChainOps), by NTHR
// threads.
template <int NTHR, int D, class Ops>
__device__ void issue_states(const KdaBwdParams& p, Ops& o, size_t slot, int col0) {
  copy_rows<NTHR, D>(p.w + slot * BT * D, o.a);
  copy_rows<NTHR, D>(p.kr + slot * BT * D, o.b);
  for (int v = threadIdx.x; v < D / 4; v += NTHR) copy16(o.el + 4 * v, p.el + slot * D + 4 * v);
  copy_rows<NTHR, kVTile>(p.u + slot * BT * D + col0, o.e, D);
  copies_issued();
}

// B3's operands of chunk n of the sequence (kr, qd, w, el, Aqk, do's 32 columns from col0, zero past its end).
template <int NTHR, int D, class Ops>
__device__ void issue_reverse(const KdaBwdParams& p, Ops& o, size_t slot, const Span& sq, int h, int n, int col0) {
  copy_rows<NTHR, D>(p.kr + slot * BT * D, o.a);
  copy_rows<NTHR, D>(p.qd + slot * BT * D, o.b);
  copy_rows<NTHR, D>(p.w + slot * BT * D, o.c);
  for (int v = threadIdx.x; v < D / 4; v += NTHR) copy16(o.el + 4 * v, p.el + slot * D + 4 * v);
  copy_rows<NTHR, BT>(p.Aqk + slot * BT * BT, o.aqk);
  const int t0 = n * BT, len = min(BT, sq.len - t0);
  if (p.dout_bf != nullptr) {  // do in bf16 (only the tensor-core chain takes it: the binding gives the fp32 chains fp32)
    for (int v = threadIdx.x; v < BT * kVTile / 8; v += NTHR) {
      const int c = v / (kVTile / 8), j = 8 * (v % (kVTile / 8));
      const bool real = c < len;
      copy16(reinterpret_cast<__nv_bfloat16*>(&o.e[c][0]) + j,
             real ? p.dout_bf + (((size_t)sq.bos + t0 + c) * p.H + h) * D + col0 + j : p.dout_bf, real);
    }
  } else {
    for (int v = threadIdx.x; v < BT * kVTile / 4; v += NTHR) {
      const int c = v / (kVTile / 4), j = 4 * (v % (kVTile / 4));
      const bool real = c < len;
      copy16(&o.e[c][j], real ? p.dout + (((size_t)sq.bos + t0 + c) * p.H + h) * D + col0 + j : p.dout, real);
    }
  }
  copies_issued();
}

template <int D>
__device__ void states_chain(const KdaBwdParams& p, ChainSmem<D>& s, int block) {
  constexpr int R = D / kChainWarps;
  const int tiles = D / kVTile;
  const int bh = block / tiles, col0 = (block % tiles) * kVTile, j = threadIdx.x & 31, col = col0 + j;
  const int warp = threadIdx.x >> 5, r0 = warp * R, tid = threadIdx.x;
  float S[R];
#pragma unroll
  for (int r = 0; r < R; ++r) S[r] = p.h0 != nullptr ? p.h0[state_at<D>(bh, r0 + r, col)] : 0.f;
  const int nt = (span_of(p, bh / p.H).len + BT - 1) / BT;  // this sequence's chunks
  if (nt > 0) issue_states<kChainThreads, D>(p, s.ops[0], chunk_slot(p, bh, 0), col0);
  for (int n = 0; n < nt; ++n) {
    const size_t slot = chunk_slot(p, bh, n);
    ChainOps<D>& o = s.ops[n & 1];
    copies_arrived();
    __syncthreads();  // chunk n's operands are in; the other buffer's last reader (chunk n - 1) is done
    if (n + 1 < nt) issue_states<kChainThreads, D>(p, s.ops[(n + 1) & 1], chunk_slot(p, bh, n + 1), col0);
    kda_state_t* st = p.states + slot * D * D;
#pragma unroll
    for (int r = 0; r < R; ++r) st[(size_t)(r0 + r) * D + col] = to_state(S[r]);
#pragma unroll
    for (int c = 0; c < BT; ++c) {
      float acc = 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) acc += o.a[c][r0 + r] * S[r];
      s.part[warp][c][j] = acc;
    }
    __syncthreads();
    for (int idx = tid; idx < BT * kVTile; idx += kChainThreads) {
      const int c = idx / kVTile, jj = idx % kVTile;
      float ws = 0.f;
#pragma unroll
      for (int w = 0; w < kChainWarps; ++w) ws += s.part[w][c][jj];
      const float vc = o.e[c][jj] - ws;
      s.x[c][jj] = vc;
      p.vcorr[(slot * BT + c) * D + col0 + jj] = vc;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float acc = o.el[r0 + r] * S[r];
#pragma unroll
      for (int c = 0; c < BT; ++c) acc += o.b[c][r0 + r] * s.x[c][j];
      S[r] = acc;
    }
  }
}

template <int D>
__device__ void reverse_chain(const KdaBwdParams& p, ChainSmem<D>& s, int block) {
  constexpr int R = D / kChainWarps;
  const int tiles = D / kVTile;
  const int bh = block / tiles, col0 = (block % tiles) * kVTile, j = threadIdx.x & 31, col = col0 + j;
  const int warp = threadIdx.x >> 5, r0 = warp * R, tid = threadIdx.x;
  const int h = bh % p.H;
  const Span sq = span_of(p, bh / p.H);
  const int nt = (sq.len + BT - 1) / BT;
  float dS[R];
#pragma unroll
  for (int r = 0; r < R; ++r) dS[r] = p.dht != nullptr ? p.dht[state_at<D>(bh, r0 + r, col)] : 0.f;
  if (nt > 0) issue_reverse<kChainThreads, D>(p, s.ops[(nt - 1) & 1], chunk_slot(p, bh, nt - 1), sq, h, nt - 1, col0);
  for (int n = nt - 1; n >= 0; --n) {
    const size_t slot = chunk_slot(p, bh, n);
    ChainOps<D>& o = s.ops[n & 1];
    copies_arrived();
    __syncthreads();  // chunk n's operands are in; the other buffer's last reader (chunk n + 1) is done
    if (n > 0) issue_reverse<kChainThreads, D>(p, s.ops[(n - 1) & 1], chunk_slot(p, bh, n - 1), sq, h, n - 1, col0);
    kda_state_t* st = p.dstates + slot * D * D;
#pragma unroll
    for (int r = 0; r < R; ++r) st[(size_t)(r0 + r) * D + col] = to_state(dS[r]);
#pragma unroll
    for (int c = 0; c < BT; ++c) {
      float acc = 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) acc += o.a[c][r0 + r] * dS[r];
      s.part[warp][c][j] = acc;
    }
    __syncthreads();
    for (int idx = tid; idx < BT * kVTile; idx += kChainThreads) {
      const int c = idx / kVTile, jj = idx % kVTile;
      float acc = 0.f;
#pragma unroll
      for (int w = 0; w < kChainWarps; ++w) acc += s.part[w][c][jj];
      for (int i = c; i < BT; ++i) acc += o.aqk[i][c] * o.e[i][jj];  // (Aqk^T do)[c]
      s.x[c][jj] = acc;
      p.dvcorr[(slot * BT + c) * D + col0 + jj] = acc;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float acc = o.el[r0 + r] * dS[r];
#pragma unroll
      for (int c = 0; c < BT; ++c) acc += o.b[c][r0 + r] * o.e[c][j] - o.c[c][r0 + r] * s.x[c][j];
      dS[r] = acc;
    }
  }
  if (p.dh0 != nullptr) {
#pragma unroll
    for (int r = 0; r < R; ++r) p.dh0[state_at<D>(bh, r0 + r, col)] = dS[r];
  }
}

// B2 and B3 need only B1's operands, not each other: one launch runs both chains side by side, its first
// B H D / 32 blocks the forward chain, the rest the reverse chain, so that the two serial walks overlap.
template <int D>
__global__ void __launch_bounds__(kChainThreads) kda_bwd_chains_kernel(const KdaBwdParams p) {
  KDA_DYNAMIC_SMEM(smem_raw);
  ChainSmem<D>& s = *reinterpret_cast<ChainSmem<D>*>(smem_raw);
  const int chains = p.N * p.H * (D / kVTile);
  if ((int)blockIdx.x < chains)
    states_chain<D>(p, s, blockIdx.x);
  else
    reverse_chain<D>(p, s, blockIdx.x - chains);
}

}  // namespace bwd
}  // namespace kda_stage

// The same two chains on tensor cores: the stage's (the build with KDA_BWD_FP32_CHAINS runs the ones above)
#include "chains_mma.cuh"

namespace kda_stage {
namespace bwd {

// ---------------------------------------------------------------------------
// B4: the chunk adjoint
// ---------------------------------------------------------------------------
constexpr int kSTile = 16;  // columns of S and dS per tile in B4

// A 16-column tile of S and of dS as stored (bf16), for B4's tensor-core products.
template <int D>
struct alignas(16) StateTile {
  __nv_bfloat16 S[D][kSTile + 8], dS[D][kSTile + 8];
};
// B4's shared memory, about 112 KB at K = V = 128 so that two blocks share an SM: three phases reuse one
// area (`ph`): the tiles of S and dS for the products with them, then kd for dAf, then the pair phase's results.
template <int D>
struct AdjSmem {
  ChunkSmem<D> ch;
  float dout[BT][D + kPad], vc[BT][D + kPad], dvc[BT][D + kPad];  // do, vcorr, dvcorr (V = D columns, rows read by lane)
  // the gradients of the chain operands; until the products with S and dS write them, two of their tiles
  alignas(16) float dqd[BT][D];
  float dkr[BT][D], dw[BT][D];
  union {
    struct {
      float S[D][kSTile + 1], dS[D][kSTile + 1];  // a 16-column tile of S and of dS
    } tile;
    StateTile<D> mtile[2];  // the tensor-core products' first two tiles
    PairScratch<D> pairs;    // load_chunk's
    float kd[BT][D + kPad];  // k e^gc, w's right operand (read row by lane)
    struct {
      float dq[BT][D], dk[BT][D];  // of the normalised q, k
      float dal[BT][D];            // da * da/dA_log, summed over d per token
    } g;
    struct {  // pair_grads_mma's sums over each block of 16 key dimensions
      float aqk[D / 16][BT][BT + 1], af[D / 16][BT][BT + 1];
    } part;
  } ph;
  float dgl[D];  // the gradient of glast through the state's decay
  float dAqk[BT][BT + 1], dAf[BT][BT + 1], dL[BT][BT + 1];
  union {
    float T1[BT][BT + 1];  // X^T dX, until dL is taken
    float dgl_part[D];     // then the second key group's share of dglast
  };
  float db[BT];
};

// Two blocks per SM on sm_90 (228 KB of shared memory per SM, 1 KB of it reserved per block).
static_assert(2 * (sizeof(AdjSmem<128>) + 1024) <= 228 * 1024, "B4 no longer fits two blocks per SM at K = 128");

// Columns j0 .. j0 + kSTile - 1 of S and dS into the shared tiles, between two barriers: the first waits for do,
// vcorr and dvcorr (first tile) or for the last tile's readers, the second for the tiles.
template <int D>
__device__ __forceinline__ void stage_tiles(AdjSmem<D>& s, const kda_state_t* S, const kda_state_t* dS, int j0) {
  __syncthreads();
  for (int idx = threadIdx.x; idx < D * kSTile; idx += kAdjThreads) {
    const int r = idx / kSTile, jj = idx % kSTile;
    s.ph.tile.S[r][jj] = from_state(S[(size_t)r * D + j0 + jj]);
    s.ph.tile.dS[r][jj] = from_state(dS[(size_t)r * D + j0 + jj]);
  }
  __syncthreads();
}

// dqd = do S^T, dw = -dvcorr S^T, dkr = vcorr dS^T, dgl = e^glast rowsum(S * dS) on the CUDA cores, in fp32, over
// 16-column tiles of S and dS staged in shared memory.
template <int D>
__device__ void state_products_fp32(AdjSmem<D>& s, const ChunkSmem<D>& ch, const kda_state_t* S,
                                   const kda_state_t* dS) {
  const int tid = threadIdx.x;
  // thread (grp, d) takes the rows c = grp, grp + G, ... of its key row d, over 16-column tiles of S and dS
  constexpr int G = kAdjThreads / D;
  const int d = tid % D, grp = tid / D;
  float aq[BT / G], aw[BT / G], ar[BT / G], agl = 0.f;
#pragma unroll
  for (int m = 0; m < BT / G; ++m) aq[m] = aw[m] = ar[m] = 0.f;
  for (int j0 = 0; j0 < D; j0 += kSTile) {
    stage_tiles<D>(s, S, dS, j0);
    for (int jj = 0; jj < kSTile; ++jj) {
      const float sv = s.ph.tile.S[d][jj], dsv = s.ph.tile.dS[d][jj];
      agl += sv * dsv;
#pragma unroll
      for (int m = 0; m < BT / G; ++m) {
        const int c = grp + m * G;
        aq[m] += s.dout[c][j0 + jj] * sv;
        aw[m] -= s.dvc[c][j0 + jj] * sv;
        ar[m] += s.vc[c][j0 + jj] * dsv;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < BT / G; ++m) {
    const int c = grp + m * G;
    s.dqd[c][d] = aq[m];
    s.dw[c][d] = aw[m];
    s.dkr[c][d] = ar[m];
  }
  if (grp == 0) s.dgl[d] = expf(ch.gc[BT - 1][d]) * agl;
}

// The same on tensor cores, the stage's (fp32_adjoint, and every build with fp32 states, runs the products above;
// the build mma_adjoint of 560f07e, its tiles staged in fp32 by plain loads, took the step from 7.84 to 7.31 ms at
// B1 T8192 H32 K128, an H100: results/h100/stage13/train_560f07e.json). Each product is [16, V] x
// [V, K] with the state as stored, [K, V] with V contiguous: row d of S is column d of the B operand, so 16 columns
// of S and dS are one k-block, and a B fragment's two words are two bf16 pairs of row d as stored
// (b[0] = S[d][2t..2t+1], b[1] = S[d][2t+8..2t+9] of the tile). The tiles come in by cp.async as stored, bf16, the
// next while the current one is multiplied; their rows are 24 halves long, so that a fragment read (row g, word t)
// lands on bank 12 g + t mod 32, every lane on its own. Warp w takes the key rows d of its D / 8 columns; do,
// dvcorr and vcorr are the A operands, rounded to bf16 as they are read. (Its first version read the fragments
// straight from global memory and made B4 5.07 ms against 4.39 on the CUDA cores: train_1465c4f.json.)
#if defined(KDA_BWD_STATES_FP32) && !defined(KDA_BWD_FP32_ADJOINT)
#error "B4's tensor-core products take the states as stored in bf16: a build with KDA_BWD_STATES_FP32 needs KDA_BWD_FP32_ADJOINT"
#endif
// The tiles in flight: kStateTileBufs buffers, kStateTileBufs - 1 tiles loading while one is multiplied. Buffers 0
// and 1 are the union's; 2 and 3 lie over dqd, dkr and dw, which the products write only after their last tile.
// The variant two_state_tiles (KDA_BWD_TWO_STATE_TILES) keeps two buffers, one tile in flight, its first issued
// after the chunk's load.
#ifdef KDA_BWD_TWO_STATE_TILES
constexpr int kStateTileBufs = 2;
#else
constexpr int kStateTileBufs = 4;
#endif
constexpr int kTilesAhead = kStateTileBufs - 1;  // tiles in flight while one is multiplied
// The first tiles go out before the chunk's inputs are loaded where that load leaves the union alone (it reads
// B1's X and kk, forming no pair sums in it) and the products run on tensor cores.
#if defined(KDA_BWD_KEEP_XKK) && !defined(KDA_BWD_FP32_ADJOINT) && !defined(KDA_BWD_TWO_STATE_TILES)
#define KDA_BWD_TILES_BEFORE_LOAD 1
#endif
template <int D>
__device__ __forceinline__ StateTile<D>& state_tile(AdjSmem<D>& s, int buf) {
  constexpr size_t kRow = sizeof(float) * BT * D;  // each of dqd, dkr, dw
  static_assert(2 * sizeof(StateTile<D>) <= 3 * kRow, "two tiles must fit over dqd, dkr and dw");
  static_assert(offsetof(AdjSmem<D>, dkr) == offsetof(AdjSmem<D>, dqd) + kRow &&
                offsetof(AdjSmem<D>, dw) == offsetof(AdjSmem<D>, dkr) + kRow, "dqd, dkr, dw in a row");
  return buf < 2 ? s.ph.mtile[buf] : reinterpret_cast<StateTile<D>*>(&s.dqd[0][0])[buf - 2];
}
// Columns j0 .. j0 + 15 of S and dS (D rows of 16 bf16, two 16-byte pieces each) into buffer buf: one group.
template <int D>
__device__ __forceinline__ void issue_state_tiles(AdjSmem<D>& s, int buf, const kda_state_t* S, const kda_state_t* dS,
                                                  int j0) {
  StateTile<D>& tl = state_tile<D>(s, buf);
  for (int idx = threadIdx.x; idx < 4 * D; idx += kAdjThreads) {
    const int r = (idx >> 1) % D, half = idx & 1;
    const bool of_dS = idx >= 2 * D;
    copy16((of_dS ? tl.dS[r] : tl.S[r]) + 8 * half, (of_dS ? dS : S) + (size_t)r * D + j0 + 8 * half);
  }
  copies_issued();
}
template <int D>
__device__ void state_products_mma(AdjSmem<D>& s, const ChunkSmem<D>& ch, const kda_state_t* S,
                                   const kda_state_t* dS) {
  constexpr int NTW = D / 64;  // 8-column tiles per warp (8 warps)
  constexpr int NTILES = D / kSTile, AHEAD = kTilesAhead;
  static_assert(kAdjThreads == 256 && kSTile == 16, "eight warps split the key rows; a tile is one k-block");
  static_assert(AHEAD - 1 <= 2 && AHEAD < NTILES, "copies_arrived_but leaves at most two groups in flight");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
  float aq[NTW][4] = {}, aw[NTW][4] = {}, ar[NTW][4] = {}, agl = 0.f;
#ifndef KDA_BWD_TILES_BEFORE_LOAD
  for (int i = 0; i < AHEAD; ++i) issue_state_tiles<D>(s, i, S, dS, i * kSTile);
#endif
  for (int i = 0; i < NTILES; ++i) {
    const int buf = i % kStateTileBufs;
    copies_arrived_but(min(AHEAD - 1, NTILES - 1 - i));  // tile i is in: the groups after it may still fly
    __syncthreads();  // tile i seen by all (and do, vcorr, dvcorr, first time); tile i - 1's readers are done
    if (i + AHEAD < NTILES) issue_state_tiles<D>(s, (i + AHEAD) % kStateTileBufs, S, dS, (i + AHEAD) * kSTile);
    const StateTile<D>& tl = state_tile<D>(s, buf);
    const int j0 = i * kSTile;
    if (tid < D)
      for (int jj = 0; jj < kSTile; ++jj) agl += bf2f(tl.S[tid][jj]) * bf2f(tl.dS[tid][jj]);
    uint32_t a_do[4], a_dv[4], a_vc[4];
    a_frag<D + kPad, 1>(&s.dout[0][0], 0, j0, 1.f, a_do);
    a_frag<D + kPad, 1>(&s.dvc[0][0], 0, j0, -1.f, a_dv);
    a_frag<D + kPad, 1>(&s.vc[0][0], 0, j0, 1.f, a_vc);
#pragma unroll
    for (int j = 0; j < NTW; ++j) {
      const int d = 8 * (NTW * warp + j) + g;
      const uint32_t* sr = reinterpret_cast<const uint32_t*>(tl.S[d]);
      const uint32_t* dr = reinterpret_cast<const uint32_t*>(tl.dS[d]);
      const uint32_t bS[2] = {sr[t], sr[t + 4]}, bdS[2] = {dr[t], dr[t + 4]};
      mma_bf16(aq[j], a_do, bS);
      mma_bf16(aw[j], a_dv, bS);
      mma_bf16(ar[j], a_vc, bdS);
    }
  }
  if (kStateTileBufs > 2) __syncthreads();  // the last tiles' readers done: dqd, dkr, dw are theirs no longer
#pragma unroll
  for (int j = 0; j < NTW; ++j)
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int c = acc_row(0, v), d = 8 * (NTW * warp + j) + acc_col(0, v);
      s.dqd[c][d] = aq[j][v];
      s.dw[c][d] = aw[j][v];
      s.dkr[c][d] = ar[j][v];
    }
  if (tid < D) s.dgl[tid] = expf(ch.gc[BT - 1][tid]) * agl;
}

// B4's per-key-dimension terms of key dimension e, added into this thread's sums: the pair terms of rows c in
// [C0, C1) (dkk = dL beta_c and dqk = dAqk scale, times the decays e^{gc_c - gc_i}, i <= c), and those of the key
// rows i in [I0, I1) of w = Af kd (dkd = Af^T dw), qd = scale q e^gc and kr = k e^{glast - gc}.
#ifdef KDA_BWD_ONE_KEY_GROUP  // the variant build one_key_group: the first group takes every term, as before
constexpr int kSplitRow = BT, kSplitKey = BT;
#else
constexpr int kSplitRow = 11, kSplitKey = 5;  // rows 0-10: 66 pairs, keys 0-4: 70 terms; the rest 70 and 66
#endif
template <int D, int C0, int C1, int I0, int I1>
__device__ __forceinline__ void key_terms(const KdaBwdParams& p, const AdjSmem<D>& s, int e, float (&dq)[BT],
                                          float (&dk)[BT], float (&dgc)[BT], float& dglast) {
  const ChunkSmem<D>& ch = s.ch;
#ifndef KDA_BWD_PAIRWISE_SUMS
  // row c of the pair decays e^{gc_c - gc_i} (i <= c), carried from row c - 1: each entry times e^{a_c} (<= 1, so
  // nothing overflows), one exponential per token where each pair took its own; row C0 - 1 from its own
  float dec_row[BT];
#pragma unroll
  for (int i = 0; i < C0; ++i) dec_row[i] = expf(ch.gc[C0 - 1][e] - ch.gc[i][e]);
#endif
#pragma unroll
  for (int c = C0; c < C1; ++c) {
    const float qc = ch.q[c][e], kc = ch.k[c][e], gcc = ch.gc[c][e];
#ifndef KDA_BWD_PAIRWISE_SUMS
    const float ea = c == 0 ? 1.f : expf(gcc - ch.gc[c - 1][e]);
#pragma unroll
    for (int i = 0; i < c; ++i) dec_row[i] *= ea;
    dec_row[c] = 1.f;
#endif
#pragma unroll
    for (int i = 0; i <= c; ++i) {
#ifndef KDA_BWD_PAIRWISE_SUMS
      const float dec = dec_row[i], ki = ch.k[i][e];
#else
      const float dec = expf(gcc - ch.gc[i][e]), ki = ch.k[i][e];
#endif
      const float tk = s.dL[c][i] * ch.beta[c] * dec;  // dkk = dL beta_c
      const float tq = s.dAqk[c][i] * p.scale * dec;
      dk[c] += tk * ki;
      dk[i] += tk * kc + tq * qc;
      dq[c] += tq * ki;
      const float pair = (tk * kc + tq * qc) * ki;
      dgc[c] += pair;
      dgc[i] -= pair;
    }
  }
  const float glast = ch.gc[BT - 1][e];
#pragma unroll
  for (int i = I0; i < I1; ++i) {
    float dkd = 0.f;
    for (int c = i; c < BT; ++c) dkd += ch.X[c][i] * ch.beta[i] * s.dw[c][e];
    const float ed = expf(ch.gc[i][e]), er = expf(glast - ch.gc[i][e]);
    const float kr = ch.k[i][e] * er;
    dk[i] += dkd * ed + s.dkr[i][e] * er;
    dq[i] += s.dqd[i][e] * p.scale * ed;
    dgc[i] += dkd * ch.k[i][e] * ed + s.dqd[i][e] * p.scale * ch.q[i][e] * ed - s.dkr[i][e] * kr;
    dglast += s.dkr[i][e] * kr;
  }
}

// bf16 MMAs that keep fp32's products: each operand split into high and low bf16 halves (B4's products but
// those with the states, which are stored in bf16).
// x0, x1 (adjacent in k) as the bf16 pair hi and the pair lo of what hi leaves: x = hi + lo to about 2^-16
__device__ __forceinline__ void split_pack(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack_bf16(x0, x1);
  const uint32_t b0 = hi << 16, b1 = hi & 0xffff0000u;
  float h0, h1;
  memcpy(&h0, &b0, sizeof h0);
  memcpy(&h1, &b1, sizeof h1);
  lo = pack_bf16(x0 - h0, x1 - h1);
}
// The A fragment (a_frag's layout) of the 16 x 16 block at(r, k), in two halves.
template <class F>
__device__ __forceinline__ void a_frag_split(F at, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i & 1), k = 2 * t + 8 * (i >> 1);
    split_pack(at(r, k), at(r, k + 1), hi[i], lo[i]);
  }
}
// The B fragment of lane (g, t): rows k = 2t, 2t + 1 and 2t + 8, 2t + 9 of column g, at(k), in two halves.
template <class F>
__device__ __forceinline__ void b_frag_split(F at, uint32_t (&hi)[2], uint32_t (&lo)[2]) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) split_pack(at(2 * t + 8 * h), at(2 * t + 8 * h + 1), hi[h], lo[h]);
}
__device__ __forceinline__ void mma_split(float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                          const uint32_t (&bh)[2], const uint32_t (&bl)[2]) {
  mma_bf16(c, al, bh);  // the small terms first
  mma_bf16(c, ah, bl);
  mma_bf16(c, ah, bh);
}

// dAqk = do vcorr^T and dAf = dw kd^T + dvcorr v^T ([16, D] x [D, 16] each, kept on i <= c) on tensor cores, split
// into bf16 halves as key_terms_mma's products (the build fp32_pair_grads takes them on the CUDA cores in fp32, a
// pair (c, i) a thread). Warp w takes the key dimensions 16 kb .. 16 kb + 15, kb = w mod D / 16, of the 8-column
// tiles (tokens i) its share; each block's sums go to s.ph.part, then a pair a thread adds them.
template <int D>
__device__ void pair_grads_mma(AdjSmem<D>& s) {
  constexpr int KB = D / 16, NTW = 2 * KB / 8;  // key blocks; 8-column tiles a warp (2 at D = 128, 1 at D = 64)
  static_assert(kAdjThreads == 256 && 8 * NTW == 2 * KB, "eight warps take the key blocks and the two column tiles");
  const ChunkSmem<D>& ch = s.ch;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  const int kb = warp % KB, k0 = 16 * kb;
  uint32_t doh[4], dol[4], dwh[4], dwl[4], dvh[4], dvl[4];
  a_frag_split([&](int r, int k) { return s.dout[r][k0 + k]; }, doh, dol);
  a_frag_split([&](int r, int k) { return s.dw[r][k0 + k]; }, dwh, dwl);
  a_frag_split([&](int r, int k) { return s.dvc[r][k0 + k]; }, dvh, dvl);
#pragma unroll
  for (int j = 0; j < NTW; ++j) {
    const int nt = warp / KB * NTW + j, i = 8 * nt + g;  // this lane's B column: token i
    uint32_t vch[2], vcl[2], kdh[2], kdl[2], vh[2], vl[2];
    b_frag_split([&](int k) { return s.vc[i][k0 + k]; }, vch, vcl);
    b_frag_split([&](int k) { return ch.k[i][k0 + k] * expf(ch.gc[i][k0 + k]); }, kdh, kdl);  // kd = k e^gc
    b_frag_split([&](int k) { return ch.v[i][k0 + k]; }, vh, vl);
    float qa[4] = {}, fa[4] = {};
    mma_split(qa, doh, dol, vch, vcl);
    mma_split(fa, dwh, dwl, kdh, kdl);
    mma_split(fa, dvh, dvl, vh, vl);
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      s.ph.part.aqk[kb][acc_row(0, v)][acc_col(nt, v)] = qa[v];
      s.ph.part.af[kb][acc_row(0, v)][acc_col(nt, v)] = fa[v];
    }
  }
  __syncthreads();
  for (int pr = threadIdx.x; pr < BT * BT; pr += kAdjThreads) {
    const int c = pr / BT, i = pr % BT;
    float qa = 0.f, fa = 0.f;
    if (i <= c) {
#pragma unroll
      for (int b = 0; b < KB; ++b) {
        qa += s.ph.part.aqk[b][c][i];
        fa += s.ph.part.af[b][c][i];
      }
    }
    s.dAqk[c][i] = qa;
    s.dAf[c][i] = fa;
  }
}

// dv = Af^T du (du = dvcorr, Af = X diag(beta)) on tensor cores, split into bf16 halves (the build fp32_dv: on the
// CUDA cores in fp32, an element a thread), written from the accumulators: warp w the columns of
// state_products_mma, the chunk's real tokens (tok0, its first) only.
template <int D>
__device__ void dv_mma(const KdaBwdParams& p, const AdjSmem<D>& s, size_t tok0, int h, int len) {
  constexpr int NTW = D / 64;  // 8-column tiles per warp (8 warps)
  const ChunkSmem<D>& ch = s.ch;
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2;
  uint32_t fth[4], ftl[4];
  a_frag_split([&](int r, int k) { return ch.X[k][r] * ch.beta[r]; }, fth, ftl);  // Af^T
#pragma unroll
  for (int j = 0; j < NTW; ++j) {
    const int n0 = 8 * (NTW * warp + j), e = n0 + g;
    uint32_t bh[2], bl[2];
    b_frag_split([&](int c) { return s.dvc[c][e]; }, bh, bl);
    float acc[4] = {};
    mma_split(acc, fth, ftl, bh, bl);
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int i = acc_row(0, v);
      if (i < len) put_grad(p.dv, p.dv_bf, ((tok0 + i) * p.H + h) * D + n0 + acc_col(0, v), acc[v]);
    }
  }
}

// The same terms on tensor cores, the stage's where a chunk's decays factor (no key dimension decays by more than
// kFactoredRange in it; the build fp32_key_terms, and chunks that decay more, take key_terms above). With
// P = beta_c dL (c > i) and Q = scale dAqk (i <= c), the pair sums over i of key dimension e are [16, 16] x [16, D]
// products once each decay e^{gc_c - gc_i} = e^{gc_c - m} e^{m - gc_i} is split about the chunk's middle
// m = glast / 2 (each factor within e^{+-kFactoredRange / 2}, so no sum comes near fp32's range):
//   M1 = P kb,  M2 = Q kb,  M3 = P^T kf + Q^T qf,  dkd = Af^T dw,    kb = k e^{m - gc}, kf = k e^{gc - m}, qf = q e^{gc - m}
//   dq  = e^{gc - m} M2 + scale e^gc dqd
//   dk  = e^{gc - m} M1 + e^{m - gc} M3 + e^gc dkd + e^{glast - gc} dkr
//   dgc = k e^{gc - m} M1 + q e^{gc - m} M2 - k e^{m - gc} M3 + k e^gc dkd + scale q e^gc dqd - kr dkr
//   dglast += sum over the rows of kr dkr
// Each product is three bf16 MMAs of its operands' high and low halves (hi hi + hi lo + lo hi: fp32's products to
// about 2^-16), fp32 accumulation. Warp w takes the D / 8 columns of state_products_mma; the results go to
// s.ph.g (dq, dk, and dgc in dal's place) and dglast's share into s.dgl.
#if !defined(KDA_BWD_FP32_KEY_TERMS) && !defined(KDA_BWD_PAIRWISE_SUMS)
#define KDA_BWD_KEY_TERMS_MMA 1
template <int D>
__device__ void key_terms_mma(const KdaBwdParams& p, AdjSmem<D>& s) {
  constexpr int NTW = D / 64;  // 8-column tiles per warp (8 warps)
  const ChunkSmem<D>& ch = s.ch;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const float sc = p.scale;
  uint32_t Ph[4], Pl[4], Qh[4], Ql[4], PTh[4], PTl[4], QTh[4], QTl[4], FTh[4], FTl[4];
  a_frag_split([&](int r, int k) { return s.dL[r][k] * ch.beta[r]; }, Ph, Pl);
  a_frag_split([&](int r, int k) { return s.dAqk[r][k] * sc; }, Qh, Ql);
  a_frag_split([&](int r, int k) { return s.dL[k][r] * ch.beta[k]; }, PTh, PTl);  // P^T
  a_frag_split([&](int r, int k) { return s.dAqk[k][r] * sc; }, QTh, QTl);        // Q^T
  a_frag_split([&](int r, int k) { return ch.X[k][r] * ch.beta[r]; }, FTh, FTl);  // Af^T (Af = X diag(beta))
#pragma unroll
  for (int j = 0; j < NTW; ++j) {
    const int n0 = 8 * (NTW * warp + j), e = n0 + g;  // the B operands' column of this lane
    const float m = 0.5f * ch.gc[BT - 1][e];
    uint32_t kbh[2], kbl[2], kfh[2], kfl[2], qfh[2], qfl[2], dwh[2], dwl[2];
    b_frag_split([&](int i) { return ch.k[i][e] * expf(m - ch.gc[i][e]); }, kbh, kbl);
    b_frag_split([&](int c) { return ch.k[c][e] * expf(ch.gc[c][e] - m); }, kfh, kfl);
    b_frag_split([&](int c) { return ch.q[c][e] * expf(ch.gc[c][e] - m); }, qfh, qfl);
    b_frag_split([&](int c) { return s.dw[c][e]; }, dwh, dwl);
    float m1[4] = {}, m2[4] = {}, m3[4] = {}, mk[4] = {};
    mma_split(m1, Ph, Pl, kbh, kbl);
    mma_split(m2, Qh, Ql, kbh, kbl);
    mma_split(m3, PTh, PTl, kfh, kfl);
    mma_split(m3, QTh, QTl, qfh, qfl);
    mma_split(mk, FTh, FTl, dwh, dwl);
    float gl[2] = {0.f, 0.f};  // this lane's two columns' share of dglast
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const int r = acc_row(0, v), col = n0 + acc_col(0, v);
      const float gc = ch.gc[r][col], mc = 0.5f * ch.gc[BT - 1][col];
      const float ef = expf(gc - mc), eb = expf(mc - gc), ed = expf(gc), er = expf(ch.gc[BT - 1][col] - gc);
      const float kv = ch.k[r][col], qv = ch.q[r][col], dqd = sc * s.dqd[r][col], dkr = s.dkr[r][col];
      const float kr = kv * er;
      const float a1 = ef * m1[v] + ed * mk[v], a2 = ef * m2[v] + ed * dqd, a3 = eb * m3[v];
      s.ph.g.dq[r][col] = a2;
      s.ph.g.dk[r][col] = a1 + a3 + er * dkr;
      s.ph.g.dal[r][col] = kv * a1 + qv * a2 - kv * a3 - kr * dkr;
      gl[v & 1] += kr * dkr;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // over the rows: the eight lanes g of this t
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) gl[h] += __shfl_xor_sync(0xffffffffu, gl[h], o);
    }
    if (g == 0) {  // one lane a column pair, one warp a column: no other writer
      s.dgl[n0 + 2 * t] += gl[0];
      s.dgl[n0 + 2 * t + 1] += gl[1];
    }
  }
}
#endif

template <int D>
__global__ void __launch_bounds__(kAdjThreads, 2) kda_bwd_adjoint_kernel(const KdaBwdParams p) {
  KDA_DYNAMIC_SMEM(smem_raw);
  AdjSmem<D>& s = *reinterpret_cast<AdjSmem<D>*>(smem_raw);
  const int bh = blockIdx.x / p.NT, n = blockIdx.x % p.NT;
  const Span sq = span_of(p, bh / p.H);
  const int h = bh % p.H, t0 = n * BT, len = min(BT, sq.len - t0);
  if (len <= 0) return;  // past the sequence's end: the whole block
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#ifdef KDA_BWD_TILES_BEFORE_LOAD
  {  // the first tiles of S and dS, in flight while the chunk loads (state_products_mma waits for them)
    const size_t at = chunk_slot(p, bh, n) * D * D;
    for (int i = 0; i < kTilesAhead; ++i) issue_state_tiles<D>(s, i, p.states + at, p.dstates + at, i * kSTile);
  }
#endif
#ifdef KDA_BWD_KEEP_XKK
  load_chunk<D, kAdjThreads, false>(p, bh, n, s.ch, s.ph.pairs, KDA_REG_B4_LOAD);  // B1's X and kk
#else
  load_chunk<D, kAdjThreads>(p, bh, n, s.ch, s.ph.pairs, KDA_REG_B4_LOAD);
#endif
  KDA_PROF_START(tp);
  ChunkSmem<D>& ch = s.ch;
  const size_t slot = chunk_slot(p, bh, n);
  // 4 floats a load, every load of the thread issued before the first is used
#pragma unroll
  for (int it = 0; it < BT * D / 4 / kAdjThreads; ++it) {
    const int vi = tid + it * kAdjThreads, c = vi / (D / 4), d0 = 4 * (vi % (D / 4));
    const size_t at = (((size_t)sq.bos + t0 + c) * p.H + h) * D + d0;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c < len && p.dout_bf != nullptr) {  // do in bf16: four halves
      const uint2 x = *reinterpret_cast<const uint2*>(p.dout_bf + at);
      const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&x);
      o = make_float4(bf2f(e[0]), bf2f(e[1]), bf2f(e[2]), bf2f(e[3]));
    } else if (c < len) {
      o = *reinterpret_cast<const float4*>(p.dout + at);
    }
    const float4 x = *reinterpret_cast<const float4*>(p.vcorr + slot * BT * D + 4 * vi);
    const float4 y = *reinterpret_cast<const float4*>(p.dvcorr + slot * BT * D + 4 * vi);
    const float os[4] = {o.x, o.y, o.z, o.w}, xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      s.dout[c][d0 + j] = os[j];
      s.vc[c][d0 + j] = xs[j];
      s.dvc[c][d0 + j] = ys[j];
    }
  }
  const kda_state_t* S = p.states + slot * D * D;
  const kda_state_t* dS = p.dstates + slot * D * D;
#ifdef KDA_PROFILE
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, slot, KDA_REG_B4_LOAD, tp);
#endif
#ifdef KDA_BWD_FP32_ADJOINT
  state_products_fp32<D>(s, ch, S, dS);
#else
  state_products_mma<D>(s, ch, S, dS);
#endif
  __syncthreads();  // the tiles are done with: kd takes their place
  if (tid == 0) KDA_PROF_LAP(p.prof, slot, KDA_REG_B4_STATES, tp);
  // dAqk = lower_incl(do vcorr^T); dAf = dw kd^T + du v^T (du = dvcorr), on i <= c
#ifdef KDA_BWD_FP32_PAIR_GRADS
  for (int idx = tid; idx < BT * D; idx += kAdjThreads) {
    const int c = idx / D, e = idx % D;
    s.ph.kd[c][e] = ch.k[c][e] * expf(ch.gc[c][e]);
  }
  __syncthreads();
  for (int pr = tid; pr < BT * BT; pr += kAdjThreads) {
    const int c = pr / BT, i = pr % BT;
    float qa = 0.f, fa = 0.f;
    if (i <= c) {
      for (int e = 0; e < D; ++e) {
        qa += s.dout[c][e] * s.vc[i][e];
        fa += s.dw[c][e] * s.ph.kd[i][e] + s.dvc[c][e] * ch.v[i][e];
      }
    }
    s.dAqk[c][i] = qa;
    s.dAf[c][i] = fa;
  }
#else
  pair_grads_mma<D>(s);
#endif
  __syncthreads();
  // dbeta through Af = X diag(beta); T1 = X^T dX with dX = dAf diag(beta)
  if (tid < BT) {
    const int i = tid;
    float acc = 0.f;
    for (int c = i; c < BT; ++c) acc += s.dAf[c][i] * ch.X[c][i];
    s.db[i] = acc;
  }
  for (int pr = tid; pr < BT * BT; pr += kAdjThreads) {
    const int a = pr / BT, nn = pr % BT;
    float acc = 0.f;
    for (int m = 0; m < BT; ++m) acc += ch.X[m][a] * s.dAf[m][nn] * ch.beta[nn];
    s.T1[a][nn] = acc;
  }
  __syncthreads();
  // dL = -(X^T dX X^T) on the strictly lower entries
  for (int pr = tid; pr < BT * BT; pr += kAdjThreads) {
    const int a = pr / BT, c = pr % BT;
    float acc = 0.f;
    if (c < a) {
      for (int m = 0; m < BT; ++m) acc += s.T1[a][m] * ch.X[c][m];
    }
    s.dL[a][c] = -acc;
  }
  __syncthreads();
  if (tid < BT) {  // dbeta through L = strict_lower(beta_c kk)
    const int c = tid;
    float acc = 0.f;
    for (int i = 0; i < c; ++i) acc += s.dL[c][i] * ch.kk[c][i];
    s.db[c] += acc;
  }
#ifdef KDA_PROFILE
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, slot, KDA_REG_B4_SMALL, tp);
#endif
  // the per-key-dimension terms: on tensor cores where the chunk's decays factor (key_terms_mma, into s.ph.g and
  // s.dgl), else one key dimension per thread on the CUDA cores, two groups of D threads sharing the pair rows and
  // the key rows of w (136 terms each), the second adding its sums into the first's through shared memory
  const int e = tid % D, grp = tid / D;
  float dq[BT], dk[BT], dgc[BT], dglast = 0.f;
#pragma unroll
  for (int c = 0; c < BT; ++c) dq[c] = dk[c] = dgc[c] = 0.f;
#ifdef KDA_BWD_KEY_TERMS_MMA
  bool wide = false;  // the same flags for every thread: the whole block takes one path
#pragma unroll
  for (int w = 0; w < kAdjThreads / 32; ++w) wide = wide || ch.wide[w] != 0.f;
  if (!wide) {
    key_terms_mma<D>(p, s);
    __syncthreads();
    if (grp == 0) {
#pragma unroll
      for (int c = 0; c < BT; ++c) {
        dq[c] = s.ph.g.dq[c][e];
        dk[c] = s.ph.g.dk[c][e];
        dgc[c] = s.ph.g.dal[c][e];
      }
      dglast = s.dgl[e];
    }
  } else
#endif
  {
    if (grp == 0) {
      dglast = s.dgl[e];
      key_terms<D, 0, kSplitRow, 0, kSplitKey>(p, s, e, dq, dk, dgc, dglast);
    } else if (grp == 1 && kSplitRow < BT) {
      key_terms<D, kSplitRow, BT, kSplitKey, BT>(p, s, e, dq, dk, dgc, dglast);
#pragma unroll
      for (int c = 0; c < BT; ++c) {
        s.ph.g.dq[c][e] = dq[c];
        s.ph.g.dk[c][e] = dk[c];
        s.ph.g.dal[c][e] = dgc[c];
      }
      s.dgl_part[e] = dglast;
    }
    __syncthreads();
    if (grp == 0 && kSplitRow < BT) {  // the second group's sums: the same thread reads each and, below, writes its place
#pragma unroll
      for (int c = 0; c < BT; ++c) {
        dq[c] += s.ph.g.dq[c][e];
        dk[c] += s.ph.g.dk[c][e];
        dgc[c] += s.ph.g.dal[c][e];
      }
      dglast += s.dgl_part[e];
    }
  }
  if (grp == 0) {
    // gc = cumsum(a), glast = gc[last]: da[c] = sum_{c' >= c} dgc[c'] + dglast; then the gate
    const float A = expf(p.A_log[h]);
    float acc = dglast, dsum = 0.f;  // dsum: the chunk's share of ddt_bias[h][e]
#ifndef KDA_BWD_GATE_LOADS_IN_LOOP
    // the gate's inputs, every row's load issued before the loop: inside it, each would wait for the store of dg
    // before it (the compiler cannot tell g from dg), one round trip to memory a row
    float gx[BT];
    const float bias = p.dt_bias[h * D + e];
#pragma unroll
    for (int c = 0; c < BT; ++c)
      gx[c] = c < len ? bf2f(p.g[(((size_t)sq.bos + t0 + c) * p.H + h) * D + e]) + bias : 0.f;
#endif
#pragma unroll
    for (int c = BT - 1; c >= 0; --c) {
      acc += dgc[c];
      float dgx = 0.f, dal = 0.f;
      if (c < len) {
        const size_t row = ((size_t)sq.bos + t0 + c) * p.H + h;
#ifdef KDA_BWD_GATE_LOADS_IN_LOOP
        const float x = bf2f(p.g[row * D + e]) + p.dt_bias[h * D + e];
#else
        const float x = gx[c];
#endif
        float dadx, dadlog;
        if (p.gate_id == KDA_GATE_SOFTPLUS) {
          const float sg = 1.f / (1.f + expf(-x));
          dadx = -A * sg;
          dadlog = -A * (x > 20.f ? x : log1pf(expf(x)));
        } else {
          const float sg = 1.f / (1.f + expf(-A * x));
          dadx = p.lower_bound * sg * (1.f - sg) * A;
          dadlog = dadx * x;
        }
        dgx = acc * dadx;
        dal = acc * dadlog;
        put_grad(p.dg, p.dg_bf, row * D + e, dgx);
        dsum += dgx;
      }
      s.ph.g.dal[c][e] = dal;
      s.ph.g.dq[c][e] = dq[c];
      s.ph.g.dk[c][e] = dk[c];
    }
    p.ddt_part[slot * D + e] = dsum;
  }
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, slot, KDA_REG_B4_KEYS, tp);
  // dv = Af^T du
#ifdef KDA_BWD_FP32_DV
  for (int idx = tid; idx < BT * D; idx += kAdjThreads) {
    const int i = idx / D, e = idx % D;
    if (i < len) {
      float acc = 0.f;
      for (int c = i; c < BT; ++c) acc += ch.X[c][i] * ch.beta[i] * s.dvc[c][e];
      put_grad(p.dv, p.dv_bf, (((size_t)sq.bos + t0 + i) * p.H + h) * D + e, acc);
    }
  }
#else
  dv_mma<D>(p, s, (size_t)sq.bos + t0, h, len);
#endif
  // per token: the l2norm's adjoint, dbeta through the sigmoid, dA_log's share; one warp per row
  for (int c = warp; c < len; c += kAdjThreads / 32) {
    float xq = 0.f, xk = 0.f, al = 0.f;
    for (int e = lane; e < D; e += 32) {
      xq += ch.q[c][e] * s.ph.g.dq[c][e];
      xk += ch.k[c][e] * s.ph.g.dk[c][e];
      al += s.ph.g.dal[c][e];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      xq += __shfl_xor_sync(0xffffffffu, xq, o);
      xk += __shfl_xor_sync(0xffffffffu, xk, o);
      al += __shfl_xor_sync(0xffffffffu, al, o);
    }
    const size_t row = ((size_t)sq.bos + t0 + c) * p.H + h;
    for (int e = lane; e < D; e += 32) {
      put_grad(p.dq, p.dq_bf, row * D + e, (s.ph.g.dq[c][e] - ch.q[c][e] * xq) / ch.rq[c]);
      put_grad(p.dk, p.dk_bf, row * D + e, (s.ph.g.dk[c][e] - ch.k[c][e] * xk) / ch.rk[c]);
    }
    if (lane == 0) {
      const float sb = ch.beta[c];
      put_grad(p.dbeta, p.dbeta_bf, row, s.db[c] * sb * (1.f - sb));
      p.dAlog_part[row] = al;
    }
  }
#ifdef KDA_PROFILE
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, slot, KDA_REG_B4_OUT, tp);
#endif
}

}  // namespace bwd
}  // namespace kda_stage
