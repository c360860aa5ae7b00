// kda.cu -- stage 03: chunk-parallel CUDA, fp32.
//
// Same phases, same per-chunk math as stage 02 (diff the two files: only the
// kernels' thread mapping and the launch configurations change). Now every
// kernel runs ONE BLOCK PER (batch, head), and the phases whose chunks are
// independent (pre, wy, aqk; bwd_wy, bwd_pre) run ONE THREAD PER CHUNK:
// thread n of block bh handles chunks n, n + blockDim, ... The two recurrences
// carry a state from chunk to chunk, so they stay serial: a single thread per
// (batch, head), but now alone in its own block (spread over all SMs).
// Intermediates live in global workspace buffers laid out per (b, h) and per
// chunk (see kda.h): a thread only ever touches the rows of its own chunk, so
// there is no shared memory, no atomics and no race.
//
//   forward  : kda_pre -> kda_wy -> kda_aqk -> kda_recur
//   backward : (forward recompute, all chunk-entry states kept)
//              -> kda_bwd_recur -> kda_bwd_wy -> kda_bwd_pre
//
// The work for one chunk is a __device__ function (pre_chunk, wy_chunk, ...);
// the kernels only decide which thread runs which chunk.
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
// kd, qd and kr are not stored: like the CPU loops, each use recomputes its exp.

#include <cuda_runtime.h>

#include "kda.h"
#include "kda_cuda_check.h"
#include "kda_device.cuh"  // sigmoid_f, softplus_f, warp_sum
#include "kda_profile.cuh"

namespace {

constexpr float kL2Eps = 1e-6f;
constexpr int kMaxChunkThreads = 256;  // threads per block of the per-chunk kernels, at most

// Threads per block of the per-chunk kernels: NT rounded up to a whole warp,
// capped at 256 (a thread then loops over chunks n, n + 256, ...).
inline unsigned chunk_threads(int NT) {
  const int t = (NT + 31) / 32 * 32;
  return (unsigned)(t < kMaxChunkThreads ? t : kMaxChunkThreads);
}

// A block-wide profile lap: wait for every thread of the block, then thread 0
// records the block's cycles in slot `slot`.
#ifdef KDA_PROFILE
#define KDA_BLOCK_LAP(prof, slot, region, t)                   \
  do {                                                         \
    __syncthreads();                                           \
    if (threadIdx.x == 0) KDA_PROF_LAP(prof, slot, region, t); \
  } while (0)
#else
#define KDA_BLOCK_LAP(prof, slot, region, t) \
  do {                                       \
  } while (0)
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

// Number of real tokens in chunk n (BT except possibly in the last chunk).
__device__ __forceinline__ int chunk_len(const KdaFwdParams& p, int n) {
  const int rest = p.T - n * p.BT;
  return rest < p.BT ? rest : p.BT;
}

// ===========================================================================
// Forward phases, one chunk n of head bh each
// ===========================================================================

// Pre-stage of chunk n: l2norm of q and k, sigmoid(beta), gate a and its
// within-chunk cumulative sum. Padded tokens get q = k = 0, beta = 0, a = 0.
__device__ __forceinline__ void pre_chunk(const KdaFwdParams& p, int bh, int n) {
  const int K = p.K, b = bh / p.H, h = bh % p.H;
  const float aexp = expf(p.A_log[h]);
  const float* dtb = p.dt_bias + (size_t)h * K;  // [K]
  const int len = chunk_len(p, n);
  for (int c = 0; c < p.BT; ++c) {
    const int t = n * p.BT + c;
    const size_t r = wrow(p, bh, t);
    float* qn = p.qn + r * K;  // [K]
    float* kn = p.kn + r * K;  // [K]
    double* gc = p.gc + r * K;  // [K]
    const double* gprev = c > 0 ? gc - K : nullptr;  // previous token of the chunk
    if (c < len) {
      const size_t x = tok(p, b, t, h);
      const float* qi = p.q + x * K;
      const float* ki = p.k + x * K;
      const float* gi = p.g + x * K;
      float sq = 0.f, sk = 0.f;
      for (int d = 0; d < K; ++d) {
        sq += qi[d] * qi[d];
        sk += ki[d] * ki[d];
      }
      const float rq = 1.0f / sqrtf(sq + kL2Eps);
      const float rk = 1.0f / sqrtf(sk + kL2Eps);
      p.rq[r] = rq;
      p.rk[r] = rk;
      for (int d = 0; d < K; ++d) {
        qn[d] = qi[d] * rq;
        kn[d] = ki[d] * rk;
        const float a = gate_fwd(gi[d] + dtb[d], aexp, p.gate_id, p.lower_bound);
        gc[d] = (c > 0 ? gprev[d] : 0.0) + a;
      }
      p.beta_s[r] = sigmoid_f(p.beta[x]);
    } else {  // padded token: contributes nothing, the gate sum stays flat
      p.rq[r] = 0.f;
      p.rk[r] = 0.f;
      for (int d = 0; d < K; ++d) {
        qn[d] = 0.f;
        kn[d] = 0.f;
        gc[d] = gprev[d];  // c >= 1 here: chunk n always starts with a real token
      }
      p.beta_s[r] = 0.f;
    }
  }
}

// WY transform of chunk n:
//   L[c,i] = beta[c] * sum_d kn[c,d] kn[i,d] exp(gc[c,d] - gc[i,d])   (i < c)
//   X = (I + L)^-1 by forward substitution, Af = X * beta[None, :]
//   w = Af @ kd,  u = Af @ v
__device__ __forceinline__ void wy_chunk(const KdaFwdParams& p, int bh, int n) {
  const int K = p.K, V = p.V, BT = p.BT, b = bh / p.H, h = bh % p.H;
  const int base = n * BT, len = chunk_len(p, n);
  const size_t r0 = wrow(p, bh, base);
  const float* kn = p.kn + r0 * K;      // [BT, K]
  const double* gc = p.gc + r0 * K;     // [BT, K]
  const float* bs = p.beta_s + r0;      // [BT]
  float* X = p.X + wmat(p, bh, n);      // [BT, BT]
  float* Af = p.Af + wmat(p, bh, n);    // [BT, BT]
  float* w = p.w + r0 * K;              // [BT, K]
  float* u = p.u + r0 * V;              // [BT, V]

  // 1. X <- L (strict lower part), 1 on the diagonal, 0 above.
  for (int c = 0; c < BT; ++c) {
    for (int i = 0; i < BT; ++i) {
      float val = 0.f;
      if (i < c) {
        float inner = 0.f;
        for (int d = 0; d < K; ++d)
          inner += kn[c * K + d] * kn[i * K + d] * decay(gc[c * K + d], gc[i * K + d]);
        val = bs[c] * inner;
      } else if (i == c) {
        val = 1.f;
      }
      X[c * BT + i] = val;
    }
  }
  // 2. Forward substitution, row by row: (I + L) X = I gives
  //    X[c,i] = -sum_{m=i}^{c-1} L[c,m] X[m,i]   (i < c; X[i,i] = 1).
  //    Rows m < c are final; in row c, entries m > i still hold L[c,m].
  for (int c = 1; c < BT; ++c) {
    for (int i = 0; i < c; ++i) {
      float acc = X[c * BT + i];  // L[c,i] * X[i,i]
      for (int m = i + 1; m < c; ++m) acc += X[c * BT + m] * X[m * BT + i];
      X[c * BT + i] = -acc;
    }
  }
  // 3. Af = X * beta[None, :] (lower triangle incl. diagonal, 0 above).
  for (int c = 0; c < BT; ++c)
    for (int i = 0; i < BT; ++i) Af[c * BT + i] = (i <= c) ? X[c * BT + i] * bs[i] : 0.f;
  // 4. w = Af @ kd, u = Af @ v (v of padded tokens is 0: not read).
  for (int c = 0; c < BT; ++c) {
    for (int d = 0; d < K; ++d) {
      float acc = 0.f;
      for (int i = 0; i <= c; ++i) acc += Af[c * BT + i] * kn[i * K + d] * decay(gc[i * K + d]);
      w[c * K + d] = acc;
    }
    const int imax = c < len ? c + 1 : len;  // real tokens i <= c
    for (int vd = 0; vd < V; ++vd) {
      float acc = 0.f;
      for (int i = 0; i < imax; ++i) acc += Af[c * BT + i] * p.v[tok(p, b, base + i, h) * V + vd];
      u[c * V + vd] = acc;
    }
  }
}

// Aqk of chunk n: Aqk[c,j] = scale * sum_d qn[c,d] kn[j,d] exp(gc[c,d] - gc[j,d])  (j <= c), 0 above.
__device__ __forceinline__ void aqk_chunk(const KdaFwdParams& p, int bh, int n) {
  const int K = p.K, BT = p.BT;
  const size_t r0 = wrow(p, bh, n * BT);
  const float* qn = p.qn + r0 * K;   // [BT, K]
  const float* kn = p.kn + r0 * K;   // [BT, K]
  const double* gc = p.gc + r0 * K;  // [BT, K]
  float* A = p.Aqk + wmat(p, bh, n); // [BT, BT]
  for (int c = 0; c < BT; ++c) {
    for (int j = 0; j < BT; ++j) {
      float acc = 0.f;
      if (j <= c)
        for (int d = 0; d < K; ++d)
          acc += qn[c * K + d] * kn[j * K + d] * decay(gc[c * K + d], gc[j * K + d]);
      A[c * BT + j] = p.scale * acc;
    }
  }
}

// The serial chain of head bh: for n = 0 .. NT-1, with S = S_n ([K, V]):
//   vcorr = u - w @ S
//   o     = qd @ S + Aqk @ vcorr                    (skipped when p.o == nullptr)
//   S_{n+1} = diag(exp(glast)) S + kr^T @ vcorr
// S_0 = h0 (or 0). Each S_{n+1} element depends only on the same element of S_n,
// so the forward can update one [K, V] buffer in place (state_chunk_stride = 0).
__device__ __forceinline__ void recur_head(const KdaFwdParams& p, int bh) {
  const int K = p.K, V = p.V, BT = p.BT, b = bh / p.H, h = bh % p.H;
  float* S0 = p.states + bh * p.state_bh_stride;  // S_0 of this head, [K, V]
  const float* h0 = p.h0 ? p.h0 + (size_t)bh * K * V : nullptr;
  for (int e = 0; e < K * V; ++e) S0[e] = h0 ? h0[e] : 0.f;

  for (int n = 0; n < p.NT; ++n) {
    const int base = n * BT, len = chunk_len(p, n);
    const size_t r0 = wrow(p, bh, base);
    const float* S = S0 + n * p.state_chunk_stride;   // S_n      [K, V]
    float* Snext = S0 + (n + 1) * p.state_chunk_stride;  // S_{n+1}  [K, V] (may alias S)
    const float* qn = p.qn + r0 * K;   // [BT, K]
    const float* kn = p.kn + r0 * K;   // [BT, K]
    const double* gc = p.gc + r0 * K;  // [BT, K]
    const float* w = p.w + r0 * K;     // [BT, K]
    const float* u = p.u + r0 * V;     // [BT, V]
    float* vcorr = p.vcorr + r0 * V;   // [BT, V]
    const float* A = p.Aqk + wmat(p, bh, n);  // [BT, BT]
    const double* glast = gc + (size_t)(BT - 1) * K;  // [K]

    // 1. vcorr = u - w @ S
    for (int c = 0; c < BT; ++c)
      for (int vd = 0; vd < V; ++vd) {
        float acc = u[c * V + vd];
        for (int d = 0; d < K; ++d) acc -= w[c * K + d] * S[d * V + vd];
        vcorr[c * V + vd] = acc;
      }
    // 2. o = qd @ S + Aqk @ vcorr, real tokens only
    if (p.o != nullptr)
      for (int c = 0; c < len; ++c) {
        float* orow = p.o + tok(p, b, base + c, h) * V;  // [V]
        for (int vd = 0; vd < V; ++vd) {
          float acc = 0.f;
          for (int d = 0; d < K; ++d) acc += p.scale * qn[c * K + d] * decay(gc[c * K + d]) * S[d * V + vd];
          for (int j = 0; j <= c; ++j) acc += A[c * BT + j] * vcorr[j * V + vd];
          orow[vd] = acc;
        }
      }
    // 3. S_{n+1} = diag(exp(glast)) S + kr^T @ vcorr
    for (int d = 0; d < K; ++d) {
      const float el = decay(glast[d]);
      for (int vd = 0; vd < V; ++vd) {
        float acc = el * S[d * V + vd];
        for (int c = 0; c < BT; ++c) acc += kn[c * K + d] * decay(glast[d], gc[c * K + d]) * vcorr[c * V + vd];
        Snext[d * V + vd] = acc;
      }
    }
  }
}

// ===========================================================================
// Backward phases
// ===========================================================================

// The serial reverse chain of head bh: dS = dht (or 0); for n = NT-1 .. 0, with
// S = S_n and dS the gradient of S_{n+1}:
//   dvcorr = kr @ dS + Aqk^T @ do          -> du (u enters only through vcorr)
//   dkr    = vcorr @ dS^T                  dEL[d] = sum_vd dS[d,vd] S[d,vd]
//   dAqk   = lower_incl_diag(do @ vcorr^T) dqd    = do @ S^T
//   dw     = -dvcorr @ S^T
//   dS    <- diag(exp(glast)) dS + qd^T @ do - w^T @ dvcorr   (gradient of S_n)
// Finally dh0 = dS. dS is updated in place: each element needs only itself
// once dvcorr, dkr and dEL (which read the old dS) are done.
__device__ __forceinline__ void bwd_recur_head(const KdaBwdParams& p, int bh) {
  const KdaFwdParams& f = p.f;
  const int K = f.K, V = f.V, BT = f.BT, b = bh / f.H, h = bh % f.H;
  float* dS = p.dS + (size_t)bh * K * V;  // [K, V]
  const float* dht = p.dht ? p.dht + (size_t)bh * K * V : nullptr;
  for (int e = 0; e < K * V; ++e) dS[e] = dht ? dht[e] : 0.f;

  for (int n = f.NT - 1; n >= 0; --n) {
    const int base = n * BT, len = chunk_len(f, n);
    const size_t r0 = wrow(f, bh, base);
    const float* S = f.states + bh * f.state_bh_stride + n * f.state_chunk_stride;  // S_n [K, V]
    const float* qn = f.qn + r0 * K;       // [BT, K]
    const float* kn = f.kn + r0 * K;       // [BT, K]
    const double* gc = f.gc + r0 * K;      // [BT, K]
    const float* w = f.w + r0 * K;         // [BT, K]
    const float* vcorr = f.vcorr + r0 * V; // [BT, V]
    const float* A = f.Aqk + wmat(f, bh, n);   // [BT, BT]
    const double* glast = gc + (size_t)(BT - 1) * K;  // [K]
    const float* dout = p.dout + tok(f, b, base, h) * V;  // row c at dout[c * H * V] (c < len)
    const size_t dstride = (size_t)f.H * V;
    float* du = p.du + r0 * V;             // [BT, V]
    float* dw = p.dw + r0 * K;             // [BT, K]
    float* dqd = p.dqd + r0 * K;           // [BT, K]
    float* dkr = p.dkr + r0 * K;           // [BT, K]
    float* dEL = p.dEL + ((size_t)bh * f.NT + n) * K;  // [K]
    float* dA = p.dAqk + wmat(f, bh, n);   // [BT, BT]

    // 1. dvcorr = kr @ dS + Aqk^T @ do  (do of padded tokens is 0)
    for (int c = 0; c < BT; ++c)
      for (int vd = 0; vd < V; ++vd) {
        float acc = 0.f;
        for (int d = 0; d < K; ++d) acc += kn[c * K + d] * decay(glast[d], gc[c * K + d]) * dS[d * V + vd];
        for (int j = c; j < len; ++j) acc += A[j * BT + c] * dout[j * dstride + vd];
        du[c * V + vd] = acc;
      }
    // 2. dkr = vcorr @ dS^T
    for (int c = 0; c < BT; ++c)
      for (int d = 0; d < K; ++d) {
        float acc = 0.f;
        for (int vd = 0; vd < V; ++vd) acc += vcorr[c * V + vd] * dS[d * V + vd];
        dkr[c * K + d] = acc;
      }
    // 3. dEL = rowsum(dS * S)
    for (int d = 0; d < K; ++d) {
      float acc = 0.f;
      for (int vd = 0; vd < V; ++vd) acc += dS[d * V + vd] * S[d * V + vd];
      dEL[d] = acc;
    }
    // 4. dAqk[c,j] = do[c] . vcorr[j]  (j <= c, real c), 0 elsewhere
    for (int c = 0; c < BT; ++c)
      for (int j = 0; j < BT; ++j) {
        float acc = 0.f;
        if (j <= c && c < len)
          for (int vd = 0; vd < V; ++vd) acc += dout[c * dstride + vd] * vcorr[j * V + vd];
        dA[c * BT + j] = acc;
      }
    // 5. dqd = do @ S^T (real c), 6. dw = -dvcorr @ S^T
    for (int c = 0; c < BT; ++c)
      for (int d = 0; d < K; ++d) {
        float aq = 0.f, aw = 0.f;
        for (int vd = 0; vd < V; ++vd) {
          if (c < len) aq += dout[c * dstride + vd] * S[d * V + vd];
          aw -= du[c * V + vd] * S[d * V + vd];
        }
        dqd[c * K + d] = aq;
        dw[c * K + d] = aw;
      }
    // 7. dS <- diag(exp(glast)) dS + qd^T @ do - w^T @ dvcorr   (in place)
    for (int d = 0; d < K; ++d) {
      const float el = decay(glast[d]);
      for (int vd = 0; vd < V; ++vd) {
        float acc = el * dS[d * V + vd];
        for (int c = 0; c < len; ++c)
          acc += f.scale * qn[c * K + d] * decay(gc[c * K + d]) * dout[c * dstride + vd];
        for (int c = 0; c < BT; ++c) acc -= w[c * K + d] * du[c * V + vd];
        dS[d * V + vd] = acc;
      }
    }
  }
  if (p.dh0 != nullptr) {
    float* dh0 = p.dh0 + (size_t)bh * K * V;
    for (int e = 0; e < K * V; ++e) dh0[e] = dS[e];
  }
}

// Adjoint of everything in chunk n that sits before the recurrence: given du,
// dw, dAqk, dqd, dkr, dEL of the chunk, produce the gradients of its tokens'
// qs = scale * qn, kn, gc and beta (dqs, dkn, dgc, dbeta_s) and dv.
//   w = Af @ kd, u = Af @ v:   dAf = dw @ kd^T + du @ v^T (lower incl. diag)
//                              dkd = Af^T @ dw,  dv = Af^T @ du
//   Af = X * beta[None, :]:    dbeta[i] += sum_c dAf[c,i] X[c,i];  dX = dAf * beta[None, :]
//   X = (I + L)^-1:            dL = -X^T @ dX @ X^T  (strict lower part used)
//   L[c,i] = beta[c] * sum_d kn[c,d] kn[i,d] exp(gc[c,d] - gc[i,d])
//   Aqk[c,j] = sum_d qs[c,d] kn[j,d] exp(gc[c,d] - gc[j,d])
//   qd = qs * exp(gc),  kr = kn * exp(glast - gc),  EL = exp(glast),  kd = kn * exp(gc)
__device__ __forceinline__ void bwd_wy_chunk(const KdaBwdParams& p, int bh, int n) {
  const KdaFwdParams& f = p.f;
  const int K = f.K, V = f.V, BT = f.BT, b = bh / f.H, h = bh % f.H;
  const int base = n * BT, len = chunk_len(f, n);
  const size_t r0 = wrow(f, bh, base);
  const float* qn = f.qn + r0 * K;       // [BT, K]
  const float* kn = f.kn + r0 * K;       // [BT, K]
  const double* gc = f.gc + r0 * K;      // [BT, K]
  const float* bs = f.beta_s + r0;       // [BT]
  const float* X = f.X + wmat(f, bh, n);    // [BT, BT]
  const float* Af = f.Af + wmat(f, bh, n);  // [BT, BT]
  const double* glast = gc + (size_t)(BT - 1) * K;  // [K]
  const float* du = p.du + r0 * V;       // [BT, V]
  const float* dw = p.dw + r0 * K;       // [BT, K]
  const float* dqd = p.dqd + r0 * K;     // [BT, K]
  const float* dkr = p.dkr + r0 * K;     // [BT, K]
  const float* dEL = p.dEL + ((size_t)bh * f.NT + n) * K;  // [K]
  const float* dAqk = p.dAqk + wmat(f, bh, n);  // [BT, BT]
  float* dA = p.dA + wmat(f, bh, n);     // [BT, BT]
  float* tmp = p.tmp + wmat(f, bh, n);   // [BT, BT]
  float* dqs = p.dqs + r0 * K;           // [BT, K]
  float* dkn = p.dkn + r0 * K;           // [BT, K]
  double* dgc = p.dgc + r0 * K;          // [BT, K]
  float* dbs = p.dbeta_s + r0;           // [BT]
  const float* vrow = f.v + tok(f, b, base, h) * V;  // row i at vrow[i * H * V] (i < len)
  float* dvrow = p.dv + tok(f, b, base, h) * V;
  const size_t vstride = (size_t)f.H * V;

  for (int e = 0; e < BT * K; ++e) {
    dqs[e] = 0.f;
    dkn[e] = 0.f;
    dgc[e] = 0.0;
  }
  for (int c = 0; c < BT; ++c) dbs[c] = 0.f;

  // 1. dAf[c,i] = dw[c] . kd[i] + du[c] . v[i]   (i <= c), 0 above
  for (int c = 0; c < BT; ++c)
    for (int i = 0; i < BT; ++i) {
      float acc = 0.f;
      if (i <= c) {
        for (int d = 0; d < K; ++d) acc += dw[c * K + d] * kn[i * K + d] * decay(gc[i * K + d]);
        if (i < len)
          for (int vd = 0; vd < V; ++vd) acc += du[c * V + vd] * vrow[i * vstride + vd];
      }
      dA[c * BT + i] = acc;
    }
  // 2. dkd = Af^T @ dw  ->  kd = kn * exp(gc): dkn += dkd * exp(gc), dgc += dkd * kd
  for (int i = 0; i < BT; ++i)
    for (int d = 0; d < K; ++d) {
      float acc = 0.f;
      for (int c = i; c < BT; ++c) acc += Af[c * BT + i] * dw[c * K + d];
      const float e = decay(gc[i * K + d]);
      dkn[i * K + d] += acc * e;
      dgc[i * K + d] += acc * kn[i * K + d] * e;
    }
  // 3. dv = Af^T @ du  (real tokens; every token belongs to exactly one chunk)
  for (int i = 0; i < len; ++i)
    for (int vd = 0; vd < V; ++vd) {
      float acc = 0.f;
      for (int c = i; c < BT; ++c) acc += Af[c * BT + i] * du[c * V + vd];
      dvrow[i * vstride + vd] = acc;
    }
  // 4. Af = X * beta[None, :]: dbeta[i] += sum_c dAf[c,i] X[c,i]; dA <- dX = dAf * beta[None, :]
  for (int c = 0; c < BT; ++c)
    for (int i = 0; i <= c; ++i) {
      const float gA = dA[c * BT + i];
      dbs[i] += gA * X[c * BT + i];
      dA[c * BT + i] = gA * bs[i];
    }
  // 5. tmp = X^T @ dX: tmp[a,e] = sum_m X[m,a] dX[m,e], nonzero terms m >= max(a, e)
  for (int a = 0; a < BT; ++a)
    for (int e = 0; e < BT; ++e) {
      float acc = 0.f;
      for (int m = (a > e ? a : e); m < BT; ++m) acc += X[m * BT + a] * dA[m * BT + e];
      tmp[a * BT + e] = acc;
    }
  // 6. dL[c,i] = -(tmp @ X^T)[c,i] = -sum_{m<=i} tmp[c,m] X[i,m]   (i < c), then the
  //    adjoint of L[c,i] = beta[c] * inner[c,i]
  for (int c = 1; c < BT; ++c)
    for (int i = 0; i < c; ++i) {
      float dL = 0.f;
      for (int m = 0; m <= i; ++m) dL -= tmp[c * BT + m] * X[i * BT + m];
      float inner = 0.f;
      for (int d = 0; d < K; ++d)
        inner += kn[c * K + d] * kn[i * K + d] * decay(gc[c * K + d], gc[i * K + d]);
      dbs[c] += dL * inner;
      const float dinner = dL * bs[c];
      for (int d = 0; d < K; ++d) {
        const float fcd = decay(gc[c * K + d], gc[i * K + d]);
        const float term = kn[c * K + d] * kn[i * K + d] * fcd;
        dkn[c * K + d] += dinner * kn[i * K + d] * fcd;
        dkn[i * K + d] += dinner * kn[c * K + d] * fcd;
        dgc[c * K + d] += dinner * term;
        dgc[i * K + d] -= dinner * term;
      }
    }
  // 7. Aqk[c,j] = sum_d qs[c,d] kn[j,d] exp(gc[c,d] - gc[j,d])   (j <= c)
  for (int c = 0; c < BT; ++c)
    for (int j = 0; j <= c; ++j) {
      const float gA = dAqk[c * BT + j];
      for (int d = 0; d < K; ++d) {
        const float fcd = decay(gc[c * K + d], gc[j * K + d]);
        const float qs = f.scale * qn[c * K + d];
        const float term = qs * kn[j * K + d] * fcd;
        dqs[c * K + d] += gA * kn[j * K + d] * fcd;
        dkn[j * K + d] += gA * qs * fcd;
        dgc[c * K + d] += gA * term;
        dgc[j * K + d] -= gA * term;
      }
    }
  // 8. qd = qs * exp(gc);  kr = kn * exp(glast - gc)
  for (int c = 0; c < BT; ++c)
    for (int d = 0; d < K; ++d) {
      const float e = decay(gc[c * K + d]);
      dqs[c * K + d] += dqd[c * K + d] * e;
      dgc[c * K + d] += dqd[c * K + d] * f.scale * qn[c * K + d] * e;
      const float fr = decay(glast[d], gc[c * K + d]);
      const float kr = kn[c * K + d] * fr;
      dkn[c * K + d] += dkr[c * K + d] * fr;
      dgc[c * K + d] -= dkr[c * K + d] * kr;
      dgc[(BT - 1) * K + d] += dkr[c * K + d] * kr;
    }
  // 9. EL = exp(glast)
  for (int d = 0; d < K; ++d) dgc[(BT - 1) * K + d] += dEL[d] * decay(glast[d]);
}

// Adjoint of the pre-stage of chunk n, real tokens only:
//   gc = cumsum(a) in the chunk:  da = reverse cumsum of dgc (written over dgc, in double)
//   gate:     dg = da * da/dx (x = g + dt_bias),  dA_log term = sum_d da * da/dA_log
//   beta:     dbeta = dbeta_s * s * (1 - s)
//   l2norm:   dq = rq * (dqn - (dqn . qn) qn),  dqn = scale * dqs;  same for k
__device__ __forceinline__ void bwd_pre_chunk(const KdaBwdParams& p, int bh, int n) {
  const KdaFwdParams& f = p.f;
  const int K = f.K, BT = f.BT, b = bh / f.H, h = bh % f.H;
  const int base = n * BT, len = chunk_len(f, n);
  const size_t r0 = wrow(f, bh, base);
  const float* qn = f.qn + r0 * K;    // [BT, K]
  const float* kn = f.kn + r0 * K;    // [BT, K]
  const float* dqs = p.dqs + r0 * K;  // [BT, K]
  const float* dkn = p.dkn + r0 * K;  // [BT, K]
  double* dgc = p.dgc + r0 * K;       // [BT, K] -> da
  const float aexp = expf(f.A_log[h]);
  const float* dtb = f.dt_bias + (size_t)h * K;  // [K]

  // reverse cumsum over the whole (padded) chunk: glast lives in its last row
  for (int d = 0; d < K; ++d) {
    double acc = 0.0;
    for (int c = BT - 1; c >= 0; --c) {
      acc += dgc[c * K + d];
      dgc[c * K + d] = acc;
    }
  }
  for (int c = 0; c < len; ++c) {
    const size_t x = tok(f, b, base + c, h);
    const size_t r = r0 + c;
    const float* gi = f.g + x * K;
    float* dgi = p.dg + x * K;
    double dalog = 0.0;  // summed over K in double
    for (int d = 0; d < K; ++d) {
      float da_dx, da_dalog;
      gate_bwd(gi[d] + dtb[d], aexp, f.gate_id, f.lower_bound, &da_dx, &da_dalog);
      const float da = (float)dgc[c * K + d];  // da to float at its use
      dgi[d] = da * da_dx;
      dalog += da * da_dalog;
    }
    p.dAlog_part[x] = (float)dalog;
    const float s = f.beta_s[r];
    p.dbeta[x] = p.dbeta_s[r] * s * (1.0f - s);
    float sq = 0.f, sk = 0.f;
    for (int d = 0; d < K; ++d) {
      sq += f.scale * dqs[c * K + d] * qn[c * K + d];
      sk += dkn[c * K + d] * kn[c * K + d];
    }
    const float rq = f.rq[r], rk = f.rk[r];
    float* dqi = p.dq + x * K;
    float* dki = p.dk + x * K;
    for (int d = 0; d < K; ++d) {
      dqi[d] = rq * (f.scale * dqs[c * K + d] - sq * qn[c * K + d]);
      dki[d] = rk * (dkn[c * K + d] - sk * kn[c * K + d]);
    }
  }
}

}  // namespace

// ===========================================================================
// Kernels: one block per (b, h), grid = B*H blocks (1-D, up to 2^31 - 1).
// Per-chunk kernels: block = min(NT rounded up to 32, 256) threads, thread n
// runs chunks n, n + blockDim, ... Profile: thread 0 records the block's
// cycles in slot bh after a __syncthreads.
// Recurrence kernels: block = 1 thread, which runs the serial chain of its
// (b, h); it records its cycles in slot bh.
// (Kernels are static at file scope, outside the anonymous namespace, so
// tools print their plain names.)
// ===========================================================================

// fwd: pre-stage. qn, kn = l2norm(q, k); beta_s = sigmoid(beta); gc = cumsum_chunk(gate(g + dt_bias)).
static __global__ void kda_pre_kernel(const __grid_constant__ KdaFwdParams p) {
  const int bh = blockIdx.x;
  KDA_PROF_START(t0);
  for (int n = threadIdx.x; n < p.NT; n += blockDim.x) pre_chunk(p, bh, n);
  KDA_BLOCK_LAP(p.prof, bh, KDA_REG_FWD_PRE, t0);
}

// fwd: WY transform. X = (I + L)^-1, Af = X * beta, w = Af @ kd, u = Af @ v.
static __global__ void kda_wy_kernel(const __grid_constant__ KdaFwdParams p) {
  const int bh = blockIdx.x;
  KDA_PROF_START(t0);
  for (int n = threadIdx.x; n < p.NT; n += blockDim.x) wy_chunk(p, bh, n);
  KDA_BLOCK_LAP(p.prof, bh, KDA_REG_FWD_WY, t0);
}

// fwd: Aqk = lower_incl_diag(qd @ ki^T).
static __global__ void kda_aqk_kernel(const __grid_constant__ KdaFwdParams p) {
  const int bh = blockIdx.x;
  KDA_PROF_START(t0);
  for (int n = threadIdx.x; n < p.NT; n += blockDim.x) aqk_chunk(p, bh, n);
  KDA_BLOCK_LAP(p.prof, bh, KDA_REG_FWD_AQK, t0);
}

// fwd: recurrence (serial over chunks). vcorr, o, S_{n+1}.
static __global__ void kda_recur_kernel(const __grid_constant__ KdaFwdParams p) {
  const int bh = blockIdx.x;
  if (threadIdx.x != 0) return;  // launched with one thread per block
  KDA_PROF_START(t0);
  recur_head(p, bh);
  KDA_PROF_LAP(p.prof, bh, KDA_REG_FWD_RECUR, t0);
}

// bwd: reverse recurrence (serial over chunks). du, dw, dAqk, dqd, dkr, dEL, dS -> dh0.
static __global__ void kda_bwd_recur_kernel(const __grid_constant__ KdaBwdParams p) {
  const int bh = blockIdx.x;
  if (threadIdx.x != 0) return;  // launched with one thread per block
  KDA_PROF_START(t0);
  bwd_recur_head(p, bh);
  KDA_PROF_LAP(p.prof, bh, KDA_REG_BWD_RECUR, t0);
}

// bwd: WY/Aqk adjoint. dv, and dqs, dkn, dgc, dbeta_s per token.
static __global__ void kda_bwd_wy_kernel(const __grid_constant__ KdaBwdParams p) {
  const int bh = blockIdx.x;
  KDA_PROF_START(t0);
  for (int n = threadIdx.x; n < p.f.NT; n += blockDim.x) bwd_wy_chunk(p, bh, n);
  KDA_BLOCK_LAP(p.prof, bh, KDA_REG_BWD_WY, t0);
}

// bwd: pre-stage adjoint. dq, dk, dg, dbeta, per-token dA_log terms.
static __global__ void kda_bwd_pre_kernel(const __grid_constant__ KdaBwdParams p) {
  const int bh = blockIdx.x;
  KDA_PROF_START(t0);
  for (int n = threadIdx.x; n < p.f.NT; n += blockDim.x) bwd_pre_chunk(p, bh, n);
  KDA_BLOCK_LAP(p.prof, bh, KDA_REG_BWD_PRE, t0);
}

// ---------------------------------------------------------------------------
// launchers
// ---------------------------------------------------------------------------

cudaError_t kda_fwd_launch(const KdaFwdParams& p, cudaStream_t stream) {
  const int BH = p.B * p.H;  // >= 1 (checked by the binding)
  const dim3 grid((unsigned)BH), chunk_block(chunk_threads(p.NT)), one_thread(1);
  kda_note_launch("kda_pre_kernel", (const void*)kda_pre_kernel, dim3(grid), dim3(chunk_block), 0);
  kda_pre_kernel<<<grid, chunk_block, 0, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());
  kda_note_launch("kda_wy_kernel", (const void*)kda_wy_kernel, dim3(grid), dim3(chunk_block), 0);
  kda_wy_kernel<<<grid, chunk_block, 0, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());
  kda_note_launch("kda_aqk_kernel", (const void*)kda_aqk_kernel, dim3(grid), dim3(chunk_block), 0);
  kda_aqk_kernel<<<grid, chunk_block, 0, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());
  kda_note_launch("kda_recur_kernel", (const void*)kda_recur_kernel, dim3(grid), dim3(one_thread), 0);
  kda_recur_kernel<<<grid, one_thread, 0, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());
  return cudaSuccess;
}

cudaError_t kda_bwd_launch(const KdaBwdParams& p, cudaStream_t stream) {
  KDA_RETURN_IF_ERROR(kda_fwd_launch(p.f, stream));  // recompute; keeps every S_n
  const int BH = p.f.B * p.f.H;
  const dim3 grid((unsigned)BH), chunk_block(chunk_threads(p.f.NT)), one_thread(1);
  kda_note_launch("kda_bwd_recur_kernel", (const void*)kda_bwd_recur_kernel, dim3(grid), dim3(one_thread), 0);
  kda_bwd_recur_kernel<<<grid, one_thread, 0, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());
  kda_note_launch("kda_bwd_wy_kernel", (const void*)kda_bwd_wy_kernel, dim3(grid), dim3(chunk_block), 0);
  kda_bwd_wy_kernel<<<grid, chunk_block, 0, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());
  kda_note_launch("kda_bwd_pre_kernel", (const void*)kda_bwd_pre_kernel, dim3(grid), dim3(chunk_block), 0);
  kda_bwd_pre_kernel<<<grid, chunk_block, 0, stream>>>(p);
  KDA_RETURN_IF_ERROR(cudaGetLastError());
  return cudaSuccess;
}
