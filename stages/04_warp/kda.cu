// kda.cu -- stage 04: the chunked KDA algorithm with warp-level parallelism, fp32.
//
// Same phases and workspace as stages 02/03; what changes is who does the work:
//
//   * chunk-independent phases (kda_pre, kda_wy, kda_aqk, kda_bwd_wy, kda_bwd_pre):
//     ONE WARP PER CHUNK. Warp gw of the grid owns chunk n of head bh,
//     gw = bh * NT + n (blocks of kWarps warps). The 32 lanes split the feature
//     dimension: lane l owns d = l, l + 32, l + 64, ... (at most kSlots = 8
//     per lane since K, V <= 256), so a warp reading one token row is one
//     coalesced load. Dot products over K (or V) are a per-lane partial sum
//     plus a butterfly of __shfl_xor_sync (warp_sum). The triangular inverse
//     runs row by row with the lanes owning the columns j < c of row c.
//
//   * the recurrences (kda_recur, kda_bwd_recur): ONE BLOCK PER (b, h), ONE
//     THREAD PER VALUE COLUMN vd. Column vd of the state S[:, vd] only ever
//     needs column vd of u, vcorr, o (and of dS, du, do in the backward), so a
//     thread walks all chunks of its column alone: no barrier and no reduction
//     inside the serial chain. The operands shared by all columns (w, qd, kr,
//     Aqk, exp(glast)) are read by every thread at the same address (a
//     broadcast); the thread's own column of vcorr (or do, du) for the current
//     chunk is kept in shared memory ([BT, blockDim], one column per thread,
//     conflict-free); S itself stays in global memory (column vd, coalesced
//     across the warp), because K * V * 4 bytes (up to 256 KB) does not fit.
//
//   * everything the backward needs that sums OVER value columns (dEL, dkr,
//     dqd, dw, dAqk, du @ v^T) moved out of the serial reverse chain: the
//     reverse recurrence stores the gradient of every chunk-entry state
//     (dstates, like the forward stores states), and the chunk-parallel
//     kda_bwd_wy computes those sums per chunk with warp shuffles. No atomics
//     anywhere (the profile timers excepted); forward and backward are
//     bitwise deterministic.
//
//   forward  : kda_pre -> kda_wy -> kda_aqk -> kda_recur
//   backward : (forward recompute, all chunk-entry states kept)
//              -> kda_bwd_recur -> kda_bwd_wy -> kda_bwd_pre
//
// Notation inside chunk n (BT tokens, rows c, i, j; key dim d; value dim vd):
//   gc    = within-chunk cumulative sum of the gate a      [BT, K]
//   glast = gc[BT - 1]                                     [K]
//   kd = kn * exp(gc)     qd = scale * qn * exp(gc)     kr = kn * exp(glast - gc)
//   L   = strict_lower(beta[:, None] * (kd @ ki^T)),  ki = kn * exp(-gc)
//   X   = (I + L)^-1       Af = X * beta[None, :]
//   w   = Af @ kd          u  = Af @ v
//   Aqk = lower_incl_diag(qd @ ki^T)
//   vcorr = u - w @ S;   o = qd @ S + Aqk @ vcorr;   S <- diag(exp(glast)) S + kr^T @ vcorr
// Products like kd @ ki^T are evaluated as sum_d kn[c,d] kn[i,d] exp(gc[c,d] - gc[i,d])
// with c >= i: the exponent is <= 0 (the gate is negative), so nothing overflows.
// gc and dgc are fp64 (kda.h, "Precision"): every exp of gc is decay(), the
// difference in double and expf in float; dgc sums float terms in double.
// kd, qd, kr and exp(glast) are computed once by kda_pre (new in this stage) so
// that the V threads of the recurrence do not each re-evaluate the same exp().
//
// As in stage 03, the work for one chunk is a __device__ function (pre_chunk,
// wy_chunk, ...), now run by a whole warp (argument `lane`), and the work of the
// recurrences a function of one value column (recur_column, bwd_recur_column);
// the kernels at the end only decide which warp or thread runs what.
//
// Ablation switches (stage.py ABLATIONS): each build turns ONE idea of this stage
// off and does what stage 03 did for that part instead, every other idea stays on.
// Their code is in ablations.cuh. Here they show only as #if lines around the
// functions and kernels an ablation replaces, and as a few `if constexpr` lines
// on the flags kNoPrecompute and kNoBwdChunkStates below. Without any switch the
// code below is the stage itself.

#include <cuda_runtime.h>

#include "kda.h"
#include "kda_cuda_check.h"
#include "kda_device.cuh"  // sigmoid_f, softplus_f, warp_sum
#include "kda_profile.cuh"

// warp_sum (kda_device.cuh) of a double, for the dA_log term summed in double: the
// same butterfly on a double. Outside the anonymous namespace, so that it overloads
// the float warp_sum instead of hiding it.
__device__ __forceinline__ double warp_sum(double x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

namespace {

constexpr float kL2Eps = 1e-6f;
#ifndef KDA_NO_WARP_CHUNK
constexpr int kWarps = 4;          // warps per block in the warp-per-chunk kernels
constexpr int kSlots = 8;          // feature elements per lane: 256 / 32
#endif
constexpr int kMaxCols = 256;      // largest K or V

// The two ablation switches that change lines inside this file's own functions,
// as flags for `if constexpr` (the code they switch to is in ablations.cuh).
#ifdef KDA_NO_PRECOMPUTE
[[maybe_unused]] constexpr bool kNoPrecompute = true;
#else
[[maybe_unused]] constexpr bool kNoPrecompute = false;
#endif
#ifdef KDA_NO_BWD_CHUNK_STATES
[[maybe_unused]] constexpr bool kNoBwdChunkStates = true;
#else
[[maybe_unused]] constexpr bool kNoBwdChunkStates = false;
#endif

// ---------------------------------------------------------------------------
// small helpers
// ---------------------------------------------------------------------------

// Gate a(x), x = g + dt_bias[h, d], aexp = exp(A_log[h]).
//   softplus (gate_id 0): a = -aexp * softplus(x)
//   bounded  (gate_id 1): a = lower_bound * sigmoid(aexp * x)
__device__ __forceinline__ float gate_fwd(float x, float aexp, int gate_id, float lb) {
  if (gate_id == 0) return -aexp * softplus_f(x);
  return lb * sigmoid_f(aexp * x);
}

// da/dx and da/dA_log of the gate above.
__device__ __forceinline__ void gate_bwd(float x, float aexp, int gate_id, float lb, float* da_dx,
                                         float* da_dalog) {
  if (gate_id == 0) {
    *da_dx = -aexp * sigmoid_f(x);
    *da_dalog = -aexp * softplus_f(x);  // = a
  } else {
    const float s = sigmoid_f(aexp * x);
    const float t = lb * s * (1.0f - s) * aexp;
    *da_dx = t;
    *da_dalog = t * x;
  }
}

// exp(g1 - g0) for two values of the gate cumsum gc (fp64, see kda.h): the
// difference is taken in double, the exponential in float.
__device__ __forceinline__ float decay(double g1, double g0 = 0.0) { return expf((float)(g1 - g0)); }

// Offset of token (b, t, h) in a [B, T, H, *] tensor, in units of rows; multiply by
// the row length (K, V or 1). Only ever called with t < T.
__device__ __forceinline__ size_t tok(const KdaFwdParams& p, int b, int t, int h) {
  return ((size_t)b * p.T + t) * p.H + h;
}

// Row of padded token t (0 <= t < Tp) of head bh in a [BH, Tp, *] workspace buffer.
__device__ __forceinline__ size_t wrow(const KdaFwdParams& p, int bh, int t) {
  return (size_t)bh * p.Tp + t;
}

// Start of chunk n's [BT, BT] matrix in a [BH, NT, BT, BT] workspace buffer.
__device__ __forceinline__ size_t wmat(const KdaFwdParams& p, int bh, int n) {
  return ((size_t)bh * p.NT + n) * p.BT * p.BT;
}

// Start of chunk n's [K] vector in a [BH, NT, K] workspace buffer.
__device__ __forceinline__ size_t wvec(const KdaFwdParams& p, int bh, int n) {
  return ((size_t)bh * p.NT + n) * p.K;
}

// Number of real tokens in chunk n (BT except possibly in the last chunk).
__device__ __forceinline__ int chunk_len(const KdaFwdParams& p, int n) {
  const int rest = p.T - n * p.BT;
  return rest < p.BT ? rest : p.BT;
}

#ifndef KDA_NO_WARP_CHUNK
// The chunk of the calling warp in a warp-per-chunk kernel: global warp id
// gw = blockIdx.x * kWarps + warp = bh * NT + n. Returns false for the idle
// warps of the last block (the whole warp leaves; these kernels have no
// __syncthreads, only __syncwarp).
struct WarpChunk {
  int lane, warp, bh, n;
  long long gw;  // also the profile slot
};
__device__ __forceinline__ bool warp_chunk(const KdaFwdParams& p, WarpChunk* wc) {
  wc->lane = threadIdx.x & 31;
  wc->warp = threadIdx.x >> 5;
  wc->gw = (long long)blockIdx.x * kWarps + wc->warp;
  if (wc->gw >= (long long)p.B * p.H * p.NT) return false;
  wc->bh = (int)(wc->gw / p.NT);
  wc->n = (int)(wc->gw % p.NT);
  return true;
}
#endif

// The ablation switches' kernels and device functions (stage 03's way for one idea).
#include "ablations.cuh"

// ===========================================================================
// Forward phases: one chunk n of head bh (a warp), or one value column vd of
// head bh (a thread) for the recurrence
// ===========================================================================

// Pre-stage of chunk n, one warp. For each token row c (lanes split K):
//   qn, kn = q / sqrt(sum q^2 + eps), k / ...        (norms: warp_sum)
//   beta_s = sigmoid(beta);  gc = running sum of a = gate(g + dt_bias) over the chunk
//   kd = kn * exp(gc);  qd = scale * qn * exp(gc)
// then, with glast = gc of the last row:  kr = kn * exp(glast - gc),  el = exp(glast).
// Padded rows: q = k = 0, beta = 0, a = 0 (gc stays flat).
#ifndef KDA_NO_WARP_CHUNK  // (KDA_NO_WARP_CHUNK: thread per chunk, ablations.cuh)
__device__ __forceinline__ void pre_chunk(const KdaFwdParams& p, int bh, int n, int lane) {
  const int K = p.K, BT = p.BT, b = bh / p.H, h = bh % p.H;
  const int base = n * BT, len = chunk_len(p, n);
  const float aexp = expf(p.A_log[h]);
  const float* dtb = p.dt_bias + (size_t)h * K;  // [K]
  const size_t r0 = wrow(p, bh, base);
  float* qn = p.qn + r0 * K;  // [BT, K]
  float* kn = p.kn + r0 * K;  // [BT, K]
  double* gc = p.gc + r0 * K;  // [BT, K]
  float* kd = p.kd + r0 * K;  // [BT, K]
  float* qd = p.qd + r0 * K;  // [BT, K]
  float* kr = p.kr + r0 * K;  // [BT, K]

  double gsum[kSlots];  // running gate sum of the lane's columns d = lane + 32 s (fp64)
#pragma unroll
  for (int s = 0; s < kSlots; ++s) gsum[s] = 0.0;

  for (int c = 0; c < BT; ++c) {
    const bool real = c < len;  // warp-uniform
    float qv[kSlots], kv[kSlots], av[kSlots];
    float sq = 0.f, sk = 0.f;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      qv[s] = 0.f;
      kv[s] = 0.f;
      av[s] = 0.f;
    }
    size_t x = 0;
    if (real) {
      x = tok(p, b, base + c, h);
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int d = lane + 32 * s;
        if (d < K) {
          qv[s] = p.q[x * K + d];
          kv[s] = p.k[x * K + d];
          av[s] = gate_fwd(p.g[x * K + d] + dtb[d], aexp, p.gate_id, p.lower_bound);
          sq += qv[s] * qv[s];
          sk += kv[s] * kv[s];
        }
      }
    }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    const float rq = real ? 1.0f / sqrtf(sq + kL2Eps) : 0.f;
    const float rk = real ? 1.0f / sqrtf(sk + kL2Eps) : 0.f;
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int d = lane + 32 * s;
      if (d < K) {
        const float qnv = qv[s] * rq, knv = kv[s] * rk;
        gsum[s] += av[s];
        const float e = decay(gsum[s]);
        qn[c * K + d] = qnv;
        kn[c * K + d] = knv;
        gc[c * K + d] = gsum[s];
        if constexpr (!kNoPrecompute) {  // (KDA_NO_PRECOMPUTE writes no kd, qd)
          kd[c * K + d] = knv * e;
          qd[c * K + d] = p.scale * qnv * e;
        }
      }
    }
    if (lane == 0) {
      p.rq[r0 + c] = rq;
      p.rk[r0 + c] = rk;
      p.beta_s[r0 + c] = real ? sigmoid_f(p.beta[x]) : 0.f;
    }
  }
  if constexpr (kNoPrecompute) return;  // (KDA_NO_PRECOMPUTE writes no kr, el)
  // gsum now holds glast. Second pass over the rows this lane just wrote.
  float* el = p.el + wvec(p, bh, n);  // [K]
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int d = lane + 32 * s;
    if (d < K) el[d] = decay(gsum[s]);
  }
  for (int c = 0; c < BT; ++c) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int d = lane + 32 * s;
      if (d < K) kr[c * K + d] = kn[c * K + d] * decay(gsum[s], gc[c * K + d]);
    }
  }
}

// WY transform of chunk n, one warp; the chunk's [BT, BT] matrix M lives in
// this warp's slice of shared memory (dynamic smem = kWarps * BT * BT floats).
//   1. M[c,i] = L[c,i] = beta[c] * sum_d kn[c,d] kn[i,d] exp(gc[c,d] - gc[i,d])  (i < c)
//      one warp_sum per (c, i)
//   2. X = (I + L)^-1 in place, row by row (forward substitution):
//        X[c,j] = -(L[c,j] + sum_{m=j+1}^{c-1} L[c,m] X[m,j])     (j < c)
//      lane l computes columns j = l and l + 32 of row c at once: they read
//      only row c (still L) and rows m < c (already X), so each lane keeps its
//      result in a register until all lanes have read row c (__syncwarp).
//   3. X and Af = X * beta[None, :] to global; M <- Af
//   4. w = Af @ kd (lanes split K), u = Af @ v (lanes split V)
__device__ __forceinline__ void wy_chunk(const KdaFwdParams& p, int bh, int n, int lane, int warp,
                                         float* smem /* [kWarps, BT, BT] */) {
  const int K = p.K, V = p.V, BT = p.BT, b = bh / p.H, h = bh % p.H;
  const int base = n * BT, len = chunk_len(p, n);
  const size_t r0 = wrow(p, bh, base);
  const float* kn = p.kn + r0 * K;    // [BT, K]
  const double* gc = p.gc + r0 * K;   // [BT, K]
  const float* kd = p.kd + r0 * K;    // [BT, K]
  const float* bs = p.beta_s + r0;    // [BT]
  float* X = p.X + wmat(p, bh, n);    // [BT, BT]
  float* Af = p.Af + wmat(p, bh, n);  // [BT, BT]
  float* w = p.w + r0 * K;            // [BT, K]
  float* u = p.u + r0 * p.V;          // [BT, V]
  float* M = smem + (size_t)warp * BT * BT;  // [BT, BT], this warp's

  // 1. M <- L (strict lower part), 0 elsewhere
  for (int e = lane; e < BT * BT; e += 32) M[e] = 0.f;
  __syncwarp();
  for (int c = 1; c < BT; ++c) {
    float knc[kSlots];
    double gcc[kSlots];
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int d = lane + 32 * s;
      knc[s] = d < K ? kn[c * K + d] : 0.f;
      gcc[s] = d < K ? gc[c * K + d] : 0.0;
    }
    const float bc = bs[c];
    for (int i = 0; i < c; ++i) {
      float part = 0.f;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int d = lane + 32 * s;
        if (d < K) part += knc[s] * kn[i * K + d] * decay(gcc[s], gc[i * K + d]);
      }
      part = warp_sum(part);
      if (lane == 0) M[c * BT + i] = bc * part;
    }
  }
  __syncwarp();

  // 2. forward substitution, in place; BT <= 64 so two columns per lane
  for (int c = 1; c < BT; ++c) {
    const int j0 = lane, j1 = lane + 32;
    float x0 = 0.f, x1 = 0.f;
    if (j0 < c) {
      float acc = M[c * BT + j0];
      for (int m = j0 + 1; m < c; ++m) acc += M[c * BT + m] * M[m * BT + j0];
      x0 = -acc;
    }
    if (j1 < c) {
      float acc = M[c * BT + j1];
      for (int m = j1 + 1; m < c; ++m) acc += M[c * BT + m] * M[m * BT + j1];
      x1 = -acc;
    }
    __syncwarp();  // every lane has read row c
    if (j0 < c) M[c * BT + j0] = x0;
    if (j1 < c) M[c * BT + j1] = x1;
    __syncwarp();  // row c final before row c + 1 reads it
  }

  // 3. X (unit diagonal, 0 above) and Af = X * beta[None, :]; M <- Af
  for (int e = lane; e < BT * BT; e += 32) {
    const int c = e / BT, i = e - c * BT;
    const float xv = i < c ? M[e] : (i == c ? 1.f : 0.f);
    const float av = xv * bs[i];
    X[e] = xv;
    Af[e] = av;
    M[e] = av;
  }
  __syncwarp();

  // 4. w = Af @ kd, u = Af @ v (v of padded tokens is 0: not read; Af is lower incl. diag)
  const size_t vstride = (size_t)p.H * V;              // token stride of v
  const float* vrow = p.v + tok(p, b, base, h) * V;    // row i at vrow[i * vstride] (i < len)
  for (int c = 0; c < BT; ++c) {
    const float* Ac = M + c * BT;  // row c of Af (same address on all lanes: broadcast)
    for (int d = lane; d < K; d += 32) {
      float acc = 0.f;
      if constexpr (kNoPrecompute)  // (KDA_NO_PRECOMPUTE: kd re-evaluated in each term)
        for (int i = 0; i <= c; ++i) acc += w_term_recompute(Ac[i], kn, gc, i * K + d);
      else
        for (int i = 0; i <= c; ++i) acc += Ac[i] * kd[i * K + d];
      w[c * K + d] = acc;
    }
    const int imax = c < len ? c + 1 : len;  // real tokens i <= c
    for (int vd = lane; vd < V; vd += 32) {
      float acc = 0.f;
      for (int i = 0; i < imax; ++i) acc += Ac[i] * vrow[i * vstride + vd];
      u[c * V + vd] = acc;
    }
  }
}

// Aqk of chunk n, one warp:
//   Aqk[c,j] = scale * sum_d qn[c,d] kn[j,d] exp(gc[c,d] - gc[j,d])  (j <= c), 0 above
// one warp_sum per (c, j); lanes split K.
__device__ __forceinline__ void aqk_chunk(const KdaFwdParams& p, int bh, int n, int lane) {
  const int K = p.K, BT = p.BT;
  const size_t r0 = wrow(p, bh, n * BT);
  const float* qn = p.qn + r0 * K;     // [BT, K]
  const float* kn = p.kn + r0 * K;     // [BT, K]
  const double* gc = p.gc + r0 * K;    // [BT, K]
  float* A = p.Aqk + wmat(p, bh, n);   // [BT, BT]
  for (int c = 0; c < BT; ++c) {
    float qnc[kSlots];
    double gcc[kSlots];
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int d = lane + 32 * s;
      qnc[s] = d < K ? qn[c * K + d] : 0.f;
      gcc[s] = d < K ? gc[c * K + d] : 0.0;
    }
    for (int j = 0; j <= c; ++j) {
      float part = 0.f;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int d = lane + 32 * s;
        if (d < K) part += qnc[s] * kn[j * K + d] * decay(gcc[s], gc[j * K + d]);
      }
      part = warp_sum(part);
      if (lane == 0) A[c * BT + j] = p.scale * part;
    }
  }
  // upper triangle (j > c): zeros; disjoint from the elements lane 0 wrote
  for (int e = lane; e < BT * BT; e += 32) {
    const int c = e / BT, j = e - c * BT;
    if (j > c) A[e] = 0.f;
  }
}
#endif  // KDA_NO_WARP_CHUNK

// The recurrence of value column vd of head bh, one thread (the kernel runs one
// block per (b, h), one thread per column). It walks the chunks n = 0 .. NT-1
// of column vd (S_n = S[:, vd]):
//   for each row c:  vcorr[c] = u[c] - w[c] . S         (the K-long dot product of
//                    q      = qd[c] . S                   both share one read of S)
//                    o[c]   = q + sum_{j<=c} Aqk[c,j] vcorr[j]     (real tokens)
//   then for each d: S_{n+1}[d] = exp(glast[d]) S_n[d] + sum_c kr[c,d] vcorr[c]
// S_0 = h0 (or 0). vcorr[:, vd] of the chunk is kept in shared memory
// (vcs[c * blockDim.x], the thread's own column) and also written to global for
// the backward. S_{n+1}[d] needs only S_n[d] of the same column, so the forward
// updates ht in place (state_chunk_stride = 0).
#if !defined(KDA_NO_COLUMN_THREADS) && !defined(KDA_NO_PRECOMPUTE)  // (else: ablations.cuh)
__device__ __forceinline__ void recur_column(const KdaFwdParams& p, int bh, int vd, int nthr,
                                             float* smem /* [BT, nthr] */) {
  const int K = p.K, V = p.V, BT = p.BT, b = bh / p.H, h = bh % p.H;
  float* vcs = smem + vd;  // this thread's column: vcorr[c] at vcs[c * nthr]
  float* S0 = p.states + bh * p.state_bh_stride;  // S_0 of this head, [K, V]
  const float* h0 = p.h0 ? p.h0 + (size_t)bh * K * V : nullptr;
  for (int d = 0; d < K; ++d) S0[d * V + vd] = h0 ? h0[d * V + vd] : 0.f;

  for (int n = 0; n < p.NT; ++n) {
    const int base = n * BT, len = chunk_len(p, n);
    const size_t r0 = wrow(p, bh, base);
    const float* S = S0 + n * p.state_chunk_stride;      // S_n      [K, V]
    float* Snext = S0 + (n + 1) * p.state_chunk_stride;  // S_{n+1}  [K, V] (may alias S)
    const float* w = p.w + r0 * K;      // [BT, K]
    const float* qd = p.qd + r0 * K;    // [BT, K]
    const float* kr = p.kr + r0 * K;    // [BT, K]
    const float* u = p.u + r0 * V;      // [BT, V]
    float* vcorr = p.vcorr + r0 * V;    // [BT, V]
    const float* A = p.Aqk + wmat(p, bh, n);   // [BT, BT]
    const float* el = p.el + wvec(p, bh, n);   // [K]

    for (int c = 0; c < BT; ++c) {
      const float* wc = w + c * K;   // [K] (broadcast)
      const float* qc = qd + c * K;  // [K] (broadcast)
      float acc_v = u[c * V + vd], acc_o = 0.f;
      for (int d = 0; d < K; ++d) {
        const float sv = S[d * V + vd];
        acc_v -= wc[d] * sv;
        acc_o += qc[d] * sv;
      }
      vcs[c * nthr] = acc_v;
      vcorr[c * V + vd] = acc_v;
      if (p.o != nullptr && c < len) {
        const float* Ac = A + c * BT;  // [BT] (broadcast)
        for (int j = 0; j <= c; ++j) acc_o += Ac[j] * vcs[j * nthr];
        p.o[tok(p, b, base + c, h) * V + vd] = acc_o;
      }
    }
    for (int d = 0; d < K; ++d) {
      float acc = el[d] * S[d * V + vd];
      for (int c = 0; c < BT; ++c) acc += kr[c * K + d] * vcs[c * nthr];
      Snext[d * V + vd] = acc;
    }
  }
}
#endif

// ===========================================================================
// Backward phases
// ===========================================================================

// The reverse recurrence of value column vd of head bh, one thread (the kernel
// runs one block per (b, h), one thread per column).
// dS_NT = dht (or 0); for n = NT-1 .. 0, with dS' = dS_{n+1} = dL/dS_{n+1}:
//   du[c]   = kr[c] . dS'[:, vd] + sum_{j>=c} Aqk[j,c] do[j]       (= dvcorr)
//   dS_n[d] = exp(glast[d]) dS'[d] + sum_c qd[c,d] do[c] - sum_c w[c,d] du[c]
// Everything here is column-local; the sums over value columns that the
// adjoint also needs (dEL, dkr, dqd, dw, dAqk) are done per chunk by
// kda_bwd_wy from dstates, S_n and du. Finally dh0 = dS_0.
// The thread's columns of do and du for the chunk sit in shared memory.
#if !defined(KDA_NO_COLUMN_THREADS) && !defined(KDA_NO_BWD_CHUNK_STATES) && !defined(KDA_NO_PRECOMPUTE)
__device__ __forceinline__ void bwd_recur_column(const KdaBwdParams& p, int bh, int vd, int nthr,
                                                 float* smem /* [2, BT, nthr] */) {
  const KdaFwdParams& f = p.f;
  const int K = f.K, V = f.V, BT = f.BT, NT = f.NT, b = bh / f.H, h = bh % f.H;
  float* dos = smem + vd;              // do[c] at dos[c * nthr]
  float* dus = smem + BT * nthr + vd;  // du[c] at dus[c * nthr]
  const size_t KV = (size_t)K * V;
  float* dS0 = p.dstates + (size_t)bh * (NT + 1) * KV;  // slot n: dL/dS_n, [K, V]
  const float* dht = p.dht ? p.dht + (size_t)bh * KV : nullptr;
  for (int d = 0; d < K; ++d) dS0[NT * KV + d * V + vd] = dht ? dht[d * V + vd] : 0.f;

  for (int n = NT - 1; n >= 0; --n) {
    const int base = n * BT, len = chunk_len(f, n);
    const size_t r0 = wrow(f, bh, base);
    const float* dSn1 = dS0 + (n + 1) * KV;  // dL/dS_{n+1}
    float* dSn = dS0 + n * KV;               // dL/dS_n
    const float* w = f.w + r0 * K;      // [BT, K]
    const float* qd = f.qd + r0 * K;    // [BT, K]
    const float* kr = f.kr + r0 * K;    // [BT, K]
    const float* A = f.Aqk + wmat(f, bh, n);  // [BT, BT]
    const float* el = f.el + wvec(f, bh, n);  // [K]
    float* du = p.du + r0 * V;          // [BT, V]
    const float* dout = p.dout + tok(f, b, base, h) * V;  // row c at dout[c * H * V] (c < len)
    const size_t dstride = (size_t)f.H * V;

    for (int c = 0; c < BT; ++c) dos[c * nthr] = c < len ? dout[c * dstride + vd] : 0.f;
    for (int c = 0; c < BT; ++c) {
      const float* krc = kr + c * K;  // [K] (broadcast)
      float acc = 0.f;
      for (int d = 0; d < K; ++d) acc += krc[d] * dSn1[d * V + vd];
      for (int j = c; j < BT; ++j) acc += A[j * BT + c] * dos[j * nthr];
      dus[c * nthr] = acc;
      du[c * V + vd] = acc;
    }
    for (int d = 0; d < K; ++d) {
      float acc = el[d] * dSn1[d * V + vd];
      for (int c = 0; c < BT; ++c) acc += qd[c * K + d] * dos[c * nthr] - w[c * K + d] * dus[c * nthr];
      dSn[d * V + vd] = acc;
    }
  }
  if (p.dh0 != nullptr) {
    float* dh0 = p.dh0 + (size_t)bh * KV;
    for (int d = 0; d < K; ++d) dh0[d * V + vd] = dS0[d * V + vd];
  }
}
#endif

// Adjoint of everything in chunk n apart from the carried state, one warp.
// Inputs: S = S_n (states), dS = dL/dS_{n+1} (dstates), vcorr, du, do.
//   A. sums over value columns (lanes split V, one warp_sum each):
//        dEL[d]   = dS[d] . S[d]             dkr[c,d] = vcorr[c] . dS[d]
//        dqd[c,d] = do[c] . S[d]             dw[c,d]  = -du[c] . S[d]
//      (lane d % 32 stores element d: the same lane that owns d in C and E)
//   B. (lanes split V)  dAqk[c,i] = do[c] . vcorr[i],  dAf[c,i] = du[c] . v[i]   (i <= c)
//                       dv[i] = sum_{c>=i} Af[c,i] du[c]
//   C. (lanes split K)  dAf[c,i] += dw[c] . kd[i],  dkd[i] = sum_{c>=i} Af[c,i] dw[c]
//      and the adjoints of kd = kn e^gc, qd = qs e^gc, kr = kn e^(glast-gc),
//      EL = e^glast: first values of dqs, dkn, dgc per row
//   D. (lanes split the BT columns)  Af = X * beta:  dbeta[i] = sum_c dAf[c,i] X[c,i],
//      dX = dAf * beta;  X = (I + L)^-1:  dL = -X^T dX X^T  (strict lower part),
//      via tmp = (X^T dX)^T stored so both products read rows along the lanes
//   E. (lanes split K) for each (c, i <= c) with f = exp(gc[c] - gc[i]):
//        L[c,i]   = beta[c] * sum_d kn[c,d] kn[i,d] f     -> dkn, dgc, dbeta
//        Aqk[c,i] = sum_d qs[c,d] kn[i,d] f               -> dqs, dkn, dgc
// Every element of dqs/dkn/dgc is only touched by the lane owning its column,
// and BT x BT scratch written by one lane is read by others only after a __syncwarp.
#ifndef KDA_NO_WARP_CHUNK  // (KDA_NO_WARP_CHUNK: thread per chunk, ablations.cuh)
__device__ __forceinline__ void bwd_wy_chunk(const KdaBwdParams& p, int bh, int n, int lane) {
  const KdaFwdParams& f = p.f;
  const int K = f.K, V = f.V, BT = f.BT, NT = f.NT, b = bh / f.H, h = bh % f.H;
  const int base = n * BT, len = chunk_len(f, n);
  const size_t r0 = wrow(f, bh, base);
  const size_t KV = (size_t)K * V;
  const float* S = f.states + bh * f.state_bh_stride + n * f.state_chunk_stride;  // S_n [K, V]
  const float* dS = p.dstates + ((size_t)bh * (NT + 1) + n + 1) * KV;           // dL/dS_{n+1} [K, V]
  const float* qn = f.qn + r0 * K;       // [BT, K]
  const float* kn = f.kn + r0 * K;       // [BT, K]
  const double* gc = f.gc + r0 * K;      // [BT, K]
  const float* kd = f.kd + r0 * K;       // [BT, K]
  const float* qd = f.qd + r0 * K;       // [BT, K]
  const float* kr = f.kr + r0 * K;       // [BT, K]
  const float* el = f.el + wvec(f, bh, n);  // [K]
  const float* bs = f.beta_s + r0;       // [BT]
  const float* X = f.X + wmat(f, bh, n);    // [BT, BT]
  const float* Af = f.Af + wmat(f, bh, n);  // [BT, BT]
  const float* vcorr = f.vcorr + r0 * V; // [BT, V]
  const float* du = p.du + r0 * V;       // [BT, V]
  const size_t tstride = (size_t)f.H * V;               // token stride of v, do, dv
  const float* dout = p.dout + tok(f, b, base, h) * V;  // row c at dout[c * tstride] (c < len)
  const float* vin = f.v + tok(f, b, base, h) * V;      // row i at vin[i * tstride] (i < len)
  float* dvo = p.dv + tok(f, b, base, h) * V;           // row i at dvo[i * tstride] (i < len)
  float* dw = p.dw + r0 * K;             // [BT, K]
  float* dqd = p.dqd + r0 * K;           // [BT, K]
  float* dkr = p.dkr + r0 * K;           // [BT, K]
  float* dEL = p.dEL + wvec(f, bh, n);   // [K]
  float* dAqk = p.dAqk + wmat(f, bh, n); // [BT, BT]
  float* dA = p.dA + wmat(f, bh, n);     // [BT, BT]
  float* tmp = p.tmp + wmat(f, bh, n);   // [BT, BT]
  float* dqs = p.dqs + r0 * K;           // [BT, K]
  float* dkn = p.dkn + r0 * K;           // [BT, K]
  double* dgc = p.dgc + r0 * K;          // [BT, K]
  float* dbs = p.dbeta_s + r0;           // [BT]

  if constexpr (!kNoBwdChunkStates) {
    // ---- A. sums over value columns -> dEL, dkr, dqd, dw -----------------------
    for (int d = 0; d < K; ++d) {
      float part = 0.f;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int vd = lane + 32 * s;
        if (vd < V) part += dS[d * V + vd] * S[d * V + vd];
      }
      part = warp_sum(part);
      if (lane == (d & 31)) dEL[d] = part;
    }
    for (int c = 0; c < BT; ++c) {
      const bool real = c < len;
      float vcv[kSlots], dov[kSlots], duv[kSlots];
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int vd = lane + 32 * s;
        vcv[s] = vd < V ? vcorr[c * V + vd] : 0.f;
        dov[s] = (vd < V && real) ? dout[c * tstride + vd] : 0.f;
        duv[s] = vd < V ? du[c * V + vd] : 0.f;
      }
      for (int d = 0; d < K; ++d) {
        float a_kr = 0.f, a_qd = 0.f, a_w = 0.f;
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
          const int vd = lane + 32 * s;
          if (vd < V) {
            const float sv = S[d * V + vd], dsv = dS[d * V + vd];
            a_kr += vcv[s] * dsv;
            a_qd += dov[s] * sv;
            a_w += duv[s] * sv;
          }
        }
        a_kr = warp_sum(a_kr);
        a_qd = warp_sum(a_qd);
        a_w = warp_sum(a_w);
        if (lane == (d & 31)) {
          dkr[c * K + d] = a_kr;
          dqd[c * K + d] = a_qd;
          dw[c * K + d] = -a_w;
        }
      }
    }

    // ---- B. dAqk, dAf (v part), dv ---------------------------------------------
    for (int i = 0; i < BT; ++i) {
      const bool real_i = i < len;
      float vi[kSlots], vci[kSlots], dva[kSlots];
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int vd = lane + 32 * s;
        vi[s] = (vd < V && real_i) ? vin[i * tstride + vd] : 0.f;
        vci[s] = vd < V ? vcorr[i * V + vd] : 0.f;
        dva[s] = 0.f;
      }
      for (int c = i; c < BT; ++c) {
        const bool real_c = c < len;
        const float af = Af[c * BT + i];
        float a_q = 0.f, a_u = 0.f;
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
          const int vd = lane + 32 * s;
          if (vd < V) {
            const float dov = real_c ? dout[c * tstride + vd] : 0.f;
            const float duv = du[c * V + vd];
            a_q += dov * vci[s];
            a_u += duv * vi[s];
            dva[s] += af * duv;
          }
        }
        a_q = warp_sum(a_q);
        a_u = warp_sum(a_u);
        if (lane == 0) {
          dAqk[c * BT + i] = a_q;
          dA[c * BT + i] = a_u;
        }
      }
      if (real_i) {
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
          const int vd = lane + 32 * s;
          if (vd < V) dvo[i * tstride + vd] = dva[s];
        }
      }
    }
  } else {  // KDA_NO_BWD_CHUNK_STATES: A and dAqk were done in the reverse chain (ablations.cuh)
    bwd_wy_dv(lane, V, BT, len, Af, du, tstride, vin, dvo, dA);
  }
  __syncwarp();

  // ---- C. dAf (w part), dkd; adjoints of kd, qd, kr, EL -----------------------
  if constexpr (!kNoPrecompute) {
    double gl[kSlots], dgl[kSlots];  // glast and its gradient, lane's columns (fp64)
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int d = lane + 32 * s;
      gl[s] = d < K ? gc[(BT - 1) * K + d] : 0.0;
      dgl[s] = d < K ? dEL[d] * el[d] : 0.0;  // EL = exp(glast)
    }
    for (int i = 0; i < BT; ++i) {
      float kdi[kSlots], dkd[kSlots];
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int d = lane + 32 * s;
        kdi[s] = d < K ? kd[i * K + d] : 0.f;
        dkd[s] = 0.f;
      }
      for (int c = i; c < BT; ++c) {
        const float af = Af[c * BT + i];
        float part = 0.f;
#pragma unroll
        for (int s = 0; s < kSlots; ++s) {
          const int d = lane + 32 * s;
          if (d < K) {
            const float dwv = dw[c * K + d];
            part += dwv * kdi[s];
            dkd[s] += af * dwv;
          }
        }
        part = warp_sum(part);
        if (lane == 0) dA[c * BT + i] += part;
      }
      // row i: kd = kn e^gc, qd = qs e^gc, kr = kn e^(glast - gc); first write of dqs, dkn, dgc
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int d = lane + 32 * s;
        if (d < K) {
          const int e = i * K + d;
          const float ex = decay(gc[e]), fr = decay(gl[s], gc[e]);
          const float g_qd = dqd[e], g_kr = dkr[e];
          dqs[e] = g_qd * ex;
          dkn[e] = dkd[s] * ex + g_kr * fr;
          dgc[e] = (double)(dkd[s] * kd[e]) + (double)(g_qd * qd[e]) - (double)(g_kr * kr[e]);
          dgl[s] += g_kr * kr[e];
        }
      }
    }
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int d = lane + 32 * s;
      if (d < K) dgc[(BT - 1) * K + d] += dgl[s];  // glast = gc of the last row
    }
  } else {  // KDA_NO_PRECOMPUTE: kd, qd, kr, el re-evaluated (ablations.cuh)
    bwd_wy_gated_recompute(f, lane, K, BT, qn, kn, gc, Af, dw, dqd, dkr, dEL, dA, dqs, dkn, dgc);
  }
  __syncwarp();

  // ---- D. Af = X * beta, inverse VJP ------------------------------------------
  // D1. lane owns columns i: dbeta[i] = sum_{c>=i} dAf[c,i] X[c,i];  dA <- dX = dAf * beta[i]
  for (int i = lane; i < BT; i += 32) {
    const float bi = bs[i];
    float db = 0.f;
    for (int c = i; c < BT; ++c) {
      const float gA = dA[c * BT + i];
      db += gA * X[c * BT + i];
      dA[c * BT + i] = gA * bi;
    }
    dbs[i] = db;
  }
  __syncwarp();
  // D2. lane owns columns a: tmp[e*BT + a] = (X^T dX)[a,e] = sum_{m>=max(a,e)} X[m,a] dX[m,e]
  for (int a = lane; a < BT; a += 32)
    for (int e = 0; e < BT; ++e) {
      float acc = 0.f;
      for (int m = (a > e ? a : e); m < BT; ++m) acc += X[m * BT + a] * dA[m * BT + e];
      tmp[e * BT + a] = acc;
    }
  __syncwarp();
  // D3. lane owns rows c: dL[c,i] = -sum_{m<=i} (X^T dX)[c,m] X[i,m]  (i < c) -> dA[c,i]
  for (int c = lane; c < BT; c += 32)
    for (int i = 0; i < c; ++i) {
      float acc = 0.f;
      for (int m = 0; m <= i; ++m) acc += tmp[m * BT + c] * X[i * BT + m];
      dA[c * BT + i] = -acc;
    }
  __syncwarp();

  // ---- E. L and Aqk adjoints (lanes split K) ----------------------------------
  for (int c = 0; c < BT; ++c) {
    float knc[kSlots], qsc[kSlots], a_kn[kSlots], a_qs[kSlots];
    double gcc[kSlots], a_gc[kSlots];
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int d = lane + 32 * s;
      knc[s] = d < K ? kn[c * K + d] : 0.f;
      qsc[s] = d < K ? f.scale * qn[c * K + d] : 0.f;
      gcc[s] = d < K ? gc[c * K + d] : 0.0;
      a_kn[s] = 0.f;
      a_qs[s] = 0.f;
      a_gc[s] = 0.0;
    }
    const float bc = bs[c];
    float dbc = 0.f;
    for (int i = 0; i <= c; ++i) {
      const float gq = dAqk[c * BT + i];
      const float gL = i < c ? dA[c * BT + i] : 0.f;  // dL (strict lower)
      const float gin = gL * bc;                      // d inner[c,i]
      float part = 0.f;                               // inner[c,i]
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int d = lane + 32 * s;
        if (d < K) {
          const int e = i * K + d;
          const float fcd = decay(gcc[s], gc[e]);
          const float t1 = kn[e] * fcd;
          const float hh = gin * knc[s] + gq * qsc[s];
          part += knc[s] * t1;
          a_kn[s] += gin * t1;
          a_qs[s] += gq * t1;
          a_gc[s] += hh * t1;
          dkn[e] += hh * fcd;
          dgc[e] -= hh * t1;
        }
      }
      if (i < c) {  // warp-uniform
        part = warp_sum(part);
        dbc += gL * part;
      }
    }
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int d = lane + 32 * s;
      if (d < K) {
        const int e = c * K + d;
        dkn[e] += a_kn[s];
        dqs[e] += a_qs[s];
        dgc[e] += a_gc[s];
      }
    }
    if (lane == 0) dbs[c] += dbc;
  }
}

// Adjoint of the pre-stage of chunk n, one warp (lanes split K), rows c = BT-1 .. 0:
//   da = reverse cumsum of dgc over the chunk (padded rows included: glast is
//        the gc of the last padded row), kept in registers, in double
//   gate:   dg = da * da/dx  (x = g + dt_bias),  dA_log term = sum_d da * da/dA_log
//   beta:   dbeta = dbeta_s * s * (1 - s)
//   l2norm: dq = rq * (dqn - (dqn . qn) qn),  dqn = scale * dqs;  same for k
// (three warp_sums per real row).
__device__ __forceinline__ void bwd_pre_chunk(const KdaBwdParams& p, int bh, int n, int lane) {
  const KdaFwdParams& f = p.f;
  const int K = f.K, BT = f.BT, b = bh / f.H, h = bh % f.H;
  const int base = n * BT, len = chunk_len(f, n);
  const size_t r0 = wrow(f, bh, base);
  const float* qn = f.qn + r0 * K;    // [BT, K]
  const float* kn = f.kn + r0 * K;    // [BT, K]
  const float* dqs = p.dqs + r0 * K;  // [BT, K]
  const float* dkn = p.dkn + r0 * K;  // [BT, K]
  const double* dgc = p.dgc + r0 * K;  // [BT, K]
  const float aexp = expf(f.A_log[h]);
  const float* dtb = f.dt_bias + (size_t)h * K;  // [K]

  double da[kSlots];
#pragma unroll
  for (int s = 0; s < kSlots; ++s) da[s] = 0.0;
  for (int c = BT - 1; c >= 0; --c) {
    const bool real = c < len;  // warp-uniform
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int d = lane + 32 * s;
      if (d < K) da[s] += dgc[c * K + d];
    }
    if (real) {  // a padded row only feeds da: its own a is a constant 0
      const size_t x = tok(f, b, base + c, h);
      const float* gi = f.g + x * K;
      float* dgi = p.dg + x * K;
      double dalog = 0.0;  // summed over K in double
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int d = lane + 32 * s;
        if (d < K) {
          float da_dx, da_dalog;
          gate_bwd(gi[d] + dtb[d], aexp, f.gate_id, f.lower_bound, &da_dx, &da_dalog);
          const float das = (float)da[s];  // da to float at its use
          dgi[d] = das * da_dx;
          dalog += das * da_dalog;
          sq += f.scale * dqs[c * K + d] * qn[c * K + d];
          sk += dkn[c * K + d] * kn[c * K + d];
        }
      }
      dalog = warp_sum(dalog);
      sq = warp_sum(sq);
      sk = warp_sum(sk);
      const size_t r = r0 + c;
      if (lane == 0) {
        p.dAlog_part[x] = (float)dalog;
        const float sb = f.beta_s[r];
        p.dbeta[x] = p.dbeta_s[r] * sb * (1.0f - sb);
      }
      const float rq = f.rq[r], rk = f.rk[r];
      float* dqi = p.dq + x * K;
      float* dki = p.dk + x * K;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int d = lane + 32 * s;
        if (d < K) {
          dqi[d] = rq * (f.scale * dqs[c * K + d] - sq * qn[c * K + d]);
          dki[d] = rk * (dkn[c * K + d] - sk * kn[c * K + d]);
        }
      }
    }
  }
}
#endif  // KDA_NO_WARP_CHUNK

// ===========================================================================
// Kernels: which warp or thread runs what (kernels stay in the anonymous
// namespace). The chunk-parallel kernels run one WARP per (b, h, chunk): grid =
// ceil(B*H*NT / kWarps) blocks of kWarps*32 threads, global warp gw = blockIdx.x
// * kWarps + warp = bh*NT + n (the idle warps of the last block leave at once,
// there is no __syncthreads); profile: lane 0 records the warp's cycles in slot
// gw. The recurrences run one block per (b, h) of ceil(V / 32) * 32 threads,
// thread vd < V on value column vd (the others only reach the final barrier);
// profile: thread 0 records the block's cycles in slot bh after a __syncthreads.
// The ablations' kernels (stage 03's mappings) are in ablations.cuh.
// ===========================================================================

// fwd: pre-stage. qn, kn = l2norm(q, k); beta_s; gc = cumsum_chunk(gate(g + dt_bias)); kd, qd, kr, el.
#ifndef KDA_NO_WARP_CHUNK  // (KDA_NO_WARP_CHUNK: ablations.cuh)
__global__ void __launch_bounds__(kWarps * 32) kda_pre_kernel(const __grid_constant__ KdaFwdParams p) {
  WarpChunk wc;
  if (!warp_chunk(p, &wc)) return;
  KDA_PROF_START(t0);
  pre_chunk(p, wc.bh, wc.n, wc.lane);
  if (wc.lane == 0) KDA_PROF_LAP(p.prof, wc.gw, KDA_REG_FWD_PRE, t0);
}

// fwd: WY transform. X = (I + L)^-1, Af = X * beta, w = Af @ kd, u = Af @ v.
// dynamic smem = kWarps * BT * BT floats: one [BT, BT] matrix per warp.
__global__ void __launch_bounds__(kWarps * 32) kda_wy_kernel(const __grid_constant__ KdaFwdParams p) {
  extern __shared__ float smem[];  // [kWarps, BT, BT]
  WarpChunk wc;
  if (!warp_chunk(p, &wc)) return;
  KDA_PROF_START(t0);
  wy_chunk(p, wc.bh, wc.n, wc.lane, wc.warp, smem);
  if (wc.lane == 0) KDA_PROF_LAP(p.prof, wc.gw, KDA_REG_FWD_WY, t0);
}

// fwd: Aqk = lower_incl_diag(qd @ ki^T).
__global__ void __launch_bounds__(kWarps * 32) kda_aqk_kernel(const __grid_constant__ KdaFwdParams p) {
  WarpChunk wc;
  if (!warp_chunk(p, &wc)) return;
  KDA_PROF_START(t0);
  aqk_chunk(p, wc.bh, wc.n, wc.lane);
  if (wc.lane == 0) KDA_PROF_LAP(p.prof, wc.gw, KDA_REG_FWD_AQK, t0);
}
#endif

// fwd: recurrence (serial over chunks). vcorr, o, S_{n+1}.
#if !defined(KDA_NO_COLUMN_THREADS) && !defined(KDA_NO_PRECOMPUTE)  // (else: ablations.cuh)
// dynamic smem = BT * blockDim.x floats.
__global__ void __launch_bounds__(kMaxCols) kda_recur_kernel(const __grid_constant__ KdaFwdParams p) {
  extern __shared__ float smem[];  // [BT, blockDim.x]
  const int bh = blockIdx.x, vd = threadIdx.x, nthr = blockDim.x;
  KDA_PROF_START(t0);
  if (vd < p.V) recur_column(p, bh, vd, nthr, smem);
  __syncthreads();  // (profile: time the whole block)
  if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, bh, KDA_REG_FWD_RECUR, t0);
}
#endif

// bwd: reverse recurrence (serial over chunks). du, dL/dS_n of every chunk (dstates) -> dh0.
#if !defined(KDA_NO_COLUMN_THREADS) && !defined(KDA_NO_BWD_CHUNK_STATES) && !defined(KDA_NO_PRECOMPUTE)
// dynamic smem = 2 * BT * blockDim.x floats.
__global__ void __launch_bounds__(kMaxCols) kda_bwd_recur_kernel(const __grid_constant__ KdaBwdParams p) {
  extern __shared__ float smem[];  // [2, BT, blockDim.x]
  const int bh = blockIdx.x, vd = threadIdx.x, nthr = blockDim.x;
  KDA_PROF_START(t0);
  if (vd < p.f.V) bwd_recur_column(p, bh, vd, nthr, smem);
  __syncthreads();  // (profile: time the whole block)
  if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, bh, KDA_REG_BWD_RECUR, t0);
}
#endif

// bwd: WY/Aqk adjoint. Sums over V (dEL, dkr, dqd, dw, dAqk), dv, and dqs, dkn, dgc, dbeta_s per token.
#ifndef KDA_NO_WARP_CHUNK  // (KDA_NO_WARP_CHUNK: ablations.cuh)
__global__ void __launch_bounds__(kWarps * 32) kda_bwd_wy_kernel(const __grid_constant__ KdaBwdParams p) {
  WarpChunk wc;
  if (!warp_chunk(p.f, &wc)) return;
  KDA_PROF_START(t0);
  bwd_wy_chunk(p, wc.bh, wc.n, wc.lane);
  if (wc.lane == 0) KDA_PROF_LAP(p.prof, wc.gw, KDA_REG_BWD_WY, t0);
}

// bwd: pre-stage adjoint. dq, dk, dg, dbeta, per-token dA_log terms.
__global__ void __launch_bounds__(kWarps * 32) kda_bwd_pre_kernel(const __grid_constant__ KdaBwdParams p) {
  WarpChunk wc;
  if (!warp_chunk(p.f, &wc)) return;
  KDA_PROF_START(t0);
  bwd_pre_chunk(p, wc.bh, wc.n, wc.lane);
  if (wc.lane == 0) KDA_PROF_LAP(p.prof, wc.gw, KDA_REG_BWD_PRE, t0);
}
#endif

// ---------------------------------------------------------------------------
// launch helpers
// ---------------------------------------------------------------------------

#ifndef KDA_NO_WARP_CHUNK  // (KDA_NO_WARP_CHUNK: thread per chunk, ablations.cuh)
// Launch shape of the chunk-parallel kernels: one warp per (b, h, chunk), blocks
// of kWarps warps; kda_wy_kernel's dynamic smem holds one [BT, BT] matrix per warp.
dim3 chunk_grid(int B, int H, int NT) {
  const long long warps = (long long)B * H * NT;  // <= INT_MAX (checked by the binding)
  return dim3((unsigned)((warps + kWarps - 1) / kWarps));
}
dim3 chunk_block(int /*NT*/) { return dim3(kWarps * 32); }
size_t wy_smem_bytes(int BT) { return (size_t)kWarps * BT * BT * sizeof(float); }  // <= 64 KB
#endif

#ifndef KDA_NO_COLUMN_THREADS  // (KDA_NO_COLUMN_THREADS: one thread per (b, h), ablations.cuh)
// Block of the recurrences: one thread per value column, rounded up to a warp;
// their dynamic smem: `rows` [BT] columns per thread (forward vcorr; backward do, du).
int recur_threads(int V) { return (V + 31) / 32 * 32; }
size_t recur_smem_bytes(int rows, int BT, int threads) { return (size_t)rows * BT * threads * sizeof(float); }
#endif

}  // namespace

// ---------------------------------------------------------------------------
// launchers
// ---------------------------------------------------------------------------

cudaError_t kda_fwd_launch(const KdaFwdParams& p, cudaStream_t stream) {
  if (p.BT < 1 || p.BT > 64 || p.K < 1 || p.K > kMaxCols || p.V < 1 || p.V > kMaxCols)
    return cudaErrorInvalidValue;
  const dim3 wgrid = chunk_grid(p.B, p.H, p.NT), wblock = chunk_block(p.NT);
  const dim3 rgrid((unsigned)(p.B * p.H)), rblock(recur_threads(p.V));

  kda_note_launch("kda_pre_kernel", (const void*)kda_pre_kernel, dim3(wgrid), dim3(wblock), 0);
  kda_pre_kernel<<<wgrid, wblock, 0, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());

  const size_t wy_smem = wy_smem_bytes(p.BT);
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_wy_kernel, wy_smem));
  kda_note_launch("kda_wy_kernel", (const void*)kda_wy_kernel, dim3(wgrid), dim3(wblock), wy_smem);
  kda_wy_kernel<<<wgrid, wblock, wy_smem, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());

  kda_note_launch("kda_aqk_kernel", (const void*)kda_aqk_kernel, dim3(wgrid), dim3(wblock), 0);
  kda_aqk_kernel<<<wgrid, wblock, 0, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());

  const size_t rec_smem = recur_smem_bytes(1, p.BT, rblock.x);  // <= 64 KB
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_recur_kernel, rec_smem));
  kda_note_launch("kda_recur_kernel", (const void*)kda_recur_kernel, dim3(rgrid), dim3(rblock), rec_smem);
  kda_recur_kernel<<<rgrid, rblock, rec_smem, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());
  return cudaSuccess;
}

cudaError_t kda_bwd_launch(const KdaBwdParams& p, cudaStream_t stream) {
  KDA_RETURN_IF_ERROR(kda_fwd_launch(p.f, stream));  // recompute; keeps every S_n
  const KdaFwdParams& f = p.f;
  const dim3 wgrid = chunk_grid(f.B, f.H, f.NT), wblock = chunk_block(f.NT);
  const dim3 rgrid((unsigned)(f.B * f.H)), rblock(recur_threads(f.V));

  const size_t rec_smem = recur_smem_bytes(2, f.BT, rblock.x);  // <= 128 KB
  KDA_RETURN_IF_ERROR(kda_allow_smem(kda_bwd_recur_kernel, rec_smem));
  kda_note_launch("kda_bwd_recur_kernel", (const void*)kda_bwd_recur_kernel, dim3(rgrid), dim3(rblock), rec_smem);
  kda_bwd_recur_kernel<<<rgrid, rblock, rec_smem, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());

  kda_note_launch("kda_bwd_wy_kernel", (const void*)kda_bwd_wy_kernel, dim3(wgrid), dim3(wblock), 0);
  kda_bwd_wy_kernel<<<wgrid, wblock, 0, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());

  kda_note_launch("kda_bwd_pre_kernel", (const void*)kda_bwd_pre_kernel, dim3(wgrid), dim3(wblock), 0);
  kda_bwd_pre_kernel<<<wgrid, wblock, 0, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());
  return cudaSuccess;
}
