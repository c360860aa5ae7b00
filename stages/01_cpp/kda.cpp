// kda.cpp -- the phases declared in kda.h, each for ONE (batch, head).
//
// Every loop is written out. Matrix products are spelled as loops over rows
// with an explicit inner sum, and comments give the formula and the shapes.
// Exponentials of the gate always take a difference gc[c] - gc[i] with c >= i
// (or glast - gc), so the exponent is <= 0 and never overflows.
#include "kda.h"

#include <algorithm>
#include <cmath>

namespace kda {
namespace {

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// log(1 + exp(x)) without overflow
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// The gate a(x), x = g + dt_bias, A = exp(A_log):
//   softplus: a = -A * softplus(x)
//   bounded:  a = lower_bound * sigmoid(A * x)
inline float gate_value(const Params& p, float x, float A) {
  if (p.gate == kGateSoftplus) return -A * softplus(x);
  return p.lower_bound * sigmoid(A * x);
}

// The two partial derivatives of the gate, from the raw x (not from a, which
// would lose precision when recovering sigmoid(x) from softplus(x)).
//   softplus: da/dx = -A * sigmoid(x)              da/dA_log = a
//   bounded:  da/dx = lb * s * (1 - s) * A          da/dA_log = da/dx * x   (s = sigmoid(A x))
inline void gate_partials(const Params& p, float x, float A, float* da_dx, float* da_dAlog) {
  if (p.gate == kGateSoftplus) {
    *da_dx = -A * sigmoid(x);
    *da_dAlog = -A * softplus(x);
  } else {
    const float s = sigmoid(A * x);
    *da_dx = p.lower_bound * s * (1.0f - s) * A;
    *da_dAlog = *da_dx * x;
  }
}

// exp(g1 - g0) for two values of the gate cumsum gc (kept in double, see kda.h):
// the difference is taken in double, the exponential in float.
inline float decay(double g1, double g0 = 0.0) { return std::exp(static_cast<float>(g1 - g0)); }

// Carves consecutive arrays out of one block of bytes (each 64-byte aligned);
// with base == nullptr it only counts.
struct Carver {
  unsigned char* base;
  std::size_t used = 0;
  template <class T>
  T* take(std::size_t n) {
    T* r = base ? reinterpret_cast<T*>(base + used) : nullptr;
    used += (n * sizeof(T) + 63) / 64 * 64;
    return r;
  }
};

std::size_t layout_fwd(const Params& p, bool keep_states, void* base, FwdWork* w) {
  const std::size_t T = p.T, K = p.K, V = p.V, BT = p.BT, NT = p.NT;
  Carver c{static_cast<unsigned char*>(base)};
  w->qn = c.take<float>(T * K);
  w->kn = c.take<float>(T * K);
  w->rq = c.take<float>(T);
  w->rk = c.take<float>(T);
  w->beta = c.take<float>(T);
  w->gc = c.take<double>(T * K);
  w->qd = c.take<float>(T * K);
  w->kd = c.take<float>(T * K);
  w->kr = c.take<float>(T * K);
  w->X = c.take<float>(NT * BT * BT);
  w->Af = c.take<float>(NT * BT * BT);
  w->Aqk = c.take<float>(NT * BT * BT);
  w->w = c.take<float>(T * K);
  w->u = c.take<float>(T * V);
  w->vcorr = c.take<float>(T * V);
  w->S_entry = keep_states ? c.take<float>(NT * K * V) : nullptr;
  return c.used;
}

std::size_t layout_bwd(const Params& p, void* base, BwdWork* b) {
  const std::size_t T = p.T, K = p.K, V = p.V, BT = p.BT, NT = p.NT;
  Carver c{static_cast<unsigned char*>(base)};
  b->S = c.take<float>(K * V);
  b->dS = c.take<float>(K * V);
  b->dS_exit = c.take<float>(NT * K * V);
  b->dvcorr = c.take<float>(T * V);
  b->dqn = c.take<float>(T * K);
  b->dkn = c.take<float>(T * K);
  b->da = c.take<float>(T * K);
  b->dbeta = c.take<float>(T);
  b->dqd = c.take<float>(BT * K);
  b->dkd = c.take<float>(BT * K);
  b->dkr = c.take<float>(BT * K);
  b->dw = c.take<float>(BT * K);
  b->dAqk = c.take<float>(BT * BT);
  b->dAf = c.take<float>(BT * BT);
  b->dX = c.take<float>(BT * BT);
  b->Y = c.take<float>(BT * BT);
  b->dgc = c.take<double>(BT * K);
  b->dglast = c.take<double>(K);
  return c.used;
}

}  // namespace

std::size_t fwd_work_bytes(const Params& p, bool keep_states) {
  FwdWork w;
  return layout_fwd(p, keep_states, nullptr, &w);
}

FwdWork fwd_work_at(void* base, const Params& p, bool keep_states) {
  FwdWork w;
  layout_fwd(p, keep_states, base, &w);
  return w;
}

std::size_t bwd_work_bytes(const Params& p) {
  BwdWork b;
  return layout_bwd(p, nullptr, &b);
}

BwdWork bwd_work_at(void* base, const Params& p) {
  BwdWork b;
  layout_bwd(p, base, &b);
  return b;
}

// ===========================================================================
// Forward
// ===========================================================================

// Pre-stage: per token l2norm and sigmoid, per chunk the gate cumsum and the
// decayed operands qd, kd, kr.
void prestage(const Params& p, const HeadInputs& in, FwdWork& w) {
  const int K = p.K, BT = p.BT;
  const float A = std::exp(in.A_log);

  // qn = q / sqrt(sum q^2 + eps), the same for k; beta = sigmoid(beta_raw)
  for (idx t = 0; t < p.T; ++t) {
    const float* qt = in.q + t * in.ldk;  // [K]
    const float* kt = in.k + t * in.ldk;  // [K]
    float sq = 0.0f, sk = 0.0f;
    for (int d = 0; d < K; ++d) {
      sq += qt[d] * qt[d];
      sk += kt[d] * kt[d];
    }
    const float rq = 1.0f / std::sqrt(sq + kL2Eps);
    const float rk = 1.0f / std::sqrt(sk + kL2Eps);
    w.rq[t] = rq;
    w.rk[t] = rk;
    for (int d = 0; d < K; ++d) {
      w.qn[t * K + d] = qt[d] * rq;
      w.kn[t * K + d] = kt[d] * rk;
    }
    w.beta[t] = sigmoid(in.beta[t * in.ldb]);
  }

  for (int n = 0; n < p.NT; ++n) {
    const int base = n * BT, nc = p.chunk_len(n);
    // gc[c] = a[0] + ... + a[c]: the log-decay from the chunk start through token c
    for (int c = 0; c < nc; ++c) {
      const idx t = base + c;
      const float* gt = in.g + t * in.ldk;  // [K] raw gate
      for (int d = 0; d < K; ++d) {
        const float a = gate_value(p, gt[d] + in.dt_bias[d], A);
        w.gc[t * K + d] = (c == 0 ? 0.0 : w.gc[(t - 1) * K + d]) + a;
      }
    }
    // glast = gc of the chunk's last valid token (the decay across the whole chunk)
    const double* glast = w.gc + (idx)(base + nc - 1) * K;  // [K]
    for (int c = 0; c < nc; ++c) {
      const idx t = base + c;
      for (int d = 0; d < K; ++d) {
        const double gcd = w.gc[t * K + d];
        const float e = decay(gcd);  // decay chunk start -> token c (<= 1)
        w.qd[t * K + d] = p.scale * w.qn[t * K + d] * e;
        w.kd[t * K + d] = w.kn[t * K + d] * e;
        w.kr[t * K + d] = w.kn[t * K + d] * decay(glast[d], gcd);  // token c -> chunk end
      }
    }
  }
}

// WY transform: L, X = (I + L)^-1, Af = X diag(beta), w = Af kd, u = Af v.
void wy_transform(const Params& p, const HeadInputs& in, FwdWork& w) {
  const int K = p.K, V = p.V, BT = p.BT;
  float Lrow[kMaxChunk];  // row c of L (BT <= kMaxChunk: the binding checks chunk_size)
  for (int n = 0; n < p.NT; ++n) {
    const int base = n * BT, nc = p.chunk_len(n);
    float* X = w.X + (idx)n * BT * BT;    // [BT, BT]
    float* Af = w.Af + (idx)n * BT * BT;  // [BT, BT]
    std::fill(X, X + BT * BT, 0.0f);
    std::fill(Af, Af + BT * BT, 0.0f);

    for (int c = 0; c < nc; ++c) {
      const idx tc = base + c;
      // L[c, i] = beta_c * sum_d kn[c, d] kn[i, d] exp(gc[c, d] - gc[i, d]),   i < c
      for (int i = 0; i < c; ++i) {
        const idx ti = base + i;
        float inner = 0.0f;
        for (int d = 0; d < K; ++d)
          inner += w.kn[tc * K + d] * w.kn[ti * K + d] * decay(w.gc[tc * K + d], w.gc[ti * K + d]);
        Lrow[i] = w.beta[tc] * inner;
      }
      // Row c of (I + L) X = I reads  X[c, j] + sum_{m<c} L[c, m] X[m, j] = delta(c, j).
      // Rows m < c of X are known, and X[m, j] = 0 for m < j, so
      //   X[c, j] = -sum_{m=j}^{c-1} L[c, m] X[m, j]   (j < c),   X[c, c] = 1.
      for (int j = 0; j < c; ++j) {
        float acc = 0.0f;
        for (int m = j; m < c; ++m) acc += Lrow[m] * X[m * BT + j];
        X[c * BT + j] = -acc;
      }
      X[c * BT + c] = 1.0f;
      // Af[c, i] = X[c, i] * beta_i   (i <= c)
      for (int i = 0; i <= c; ++i) Af[c * BT + i] = X[c * BT + i] * w.beta[base + i];
    }

    // w[c, :] = sum_{i<=c} Af[c, i] kd[i, :]     [nc, K]
    // u[c, :] = sum_{i<=c} Af[c, i] v[i, :]      [nc, V]
    for (int c = 0; c < nc; ++c) {
      const idx tc = base + c;
      float* wc = w.w + tc * K;
      float* uc = w.u + tc * V;
      for (int d = 0; d < K; ++d) wc[d] = 0.0f;
      for (int e = 0; e < V; ++e) uc[e] = 0.0f;
      for (int i = 0; i <= c; ++i) {
        const idx ti = base + i;
        const float a = Af[c * BT + i];
        const float* kdi = w.kd + ti * K;
        const float* vi = in.v + ti * in.ldv;
        for (int d = 0; d < K; ++d) wc[d] += a * kdi[d];
        for (int e = 0; e < V; ++e) uc[e] += a * vi[e];
      }
    }
  }
}

// Aqk[c, j] = scale * sum_d qn[c, d] kn[j, d] exp(gc[c, d] - gc[j, d]),   j <= c
void intra_chunk_qk(const Params& p, FwdWork& w) {
  const int K = p.K, BT = p.BT;
  for (int n = 0; n < p.NT; ++n) {
    const int base = n * BT, nc = p.chunk_len(n);
    float* Aqk = w.Aqk + (idx)n * BT * BT;  // [BT, BT]
    std::fill(Aqk, Aqk + BT * BT, 0.0f);
    for (int c = 0; c < nc; ++c) {
      const idx tc = base + c;
      for (int j = 0; j <= c; ++j) {
        const idx tj = base + j;
        float acc = 0.0f;
        for (int d = 0; d < K; ++d)
          acc += w.qn[tc * K + d] * w.kn[tj * K + d] * decay(w.gc[tc * K + d], w.gc[tj * K + d]);
        Aqk[c * BT + j] = p.scale * acc;
      }
    }
  }
}

// The serial chain over chunks: vcorr, o, then the state update.
void recurrence(const Params& p, const HeadInputs& in, FwdWork& w, float* S, float* o, idx ldo) {
  const int K = p.K, V = p.V, BT = p.BT;
  for (int i = 0; i < K * V; ++i) S[i] = in.h0 ? in.h0[i] : 0.0f;

  for (int n = 0; n < p.NT; ++n) {
    const int base = n * BT, nc = p.chunk_len(n);
    const float* Aqk = w.Aqk + (idx)n * BT * BT;
    const double* glast = w.gc + (idx)(base + nc - 1) * K;  // [K]
    if (w.S_entry)  // the backward needs the state each chunk started from
      std::copy(S, S + K * V, w.S_entry + (idx)n * K * V);

    // vcorr[c, :] = u[c, :] - sum_d w[c, d] S[d, :]      [nc, V]
    // (the new values of the chunk's tokens, minus what the state already predicts)
    for (int c = 0; c < nc; ++c) {
      const idx tc = base + c;
      float* vc = w.vcorr + tc * V;
      for (int e = 0; e < V; ++e) vc[e] = w.u[tc * V + e];
      for (int d = 0; d < K; ++d) {
        const float wcd = w.w[tc * K + d];
        for (int e = 0; e < V; ++e) vc[e] -= wcd * S[d * V + e];
      }
    }

    // o[c, :] = sum_d qd[c, d] S[d, :] + sum_{j<=c} Aqk[c, j] vcorr[j, :]      [nc, V]
    // (the part of the state from earlier chunks, plus this chunk's own tokens)
    if (o) {
      for (int c = 0; c < nc; ++c) {
        const idx tc = base + c;
        float* oc = o + tc * ldo;
        for (int e = 0; e < V; ++e) oc[e] = 0.0f;
        for (int d = 0; d < K; ++d) {
          const float qcd = w.qd[tc * K + d];
          for (int e = 0; e < V; ++e) oc[e] += qcd * S[d * V + e];
        }
        for (int j = 0; j <= c; ++j) {
          const float a = Aqk[c * BT + j];
          const float* vj = w.vcorr + (idx)(base + j) * V;
          for (int e = 0; e < V; ++e) oc[e] += a * vj[e];
        }
      }
    }

    // S[d, :] = exp(glast[d]) S[d, :] + sum_c kr[c, d] vcorr[c, :]      [K, V]
    // (in place: element (d, e) of the new state reads only element (d, e) of the old)
    for (int d = 0; d < K; ++d) {
      float* Sd = S + d * V;
      const float dl = decay(glast[d]);  // exp(glast)
      for (int e = 0; e < V; ++e) Sd[e] *= dl;
      for (int c = 0; c < nc; ++c) {
        const idx tc = base + c;
        const float kcd = w.kr[tc * K + d];
        const float* vc = w.vcorr + tc * V;
        for (int e = 0; e < V; ++e) Sd[e] += kcd * vc[e];
      }
    }
  }
}

// ===========================================================================
// Backward
// ===========================================================================

// The serial chain walked backwards. dS enters chunk n as dLoss/d(state after
// chunk n) and leaves it as dLoss/d(state before chunk n). Per chunk:
//   S_out = diag(exp(glast)) S + kr^T vcorr   ->  dvcorr  = kr dS_out,  dS  = diag(exp(glast)) dS_out
//   o     = qd S + Aqk vcorr                  ->  dvcorr += Aqk^T do,   dS += qd^T do
//   vcorr = u - w S                           ->  (du = dvcorr),        dS -= w^T dvcorr
// Everything else of the chunk's adjoint waits for chunk_adjoint, which needs
// only dvcorr and dS_out (stored here) and can run for all chunks at once.
void reverse_recurrence(const Params& p, const FwdWork& w, const HeadGrads& gr, BwdWork& bw) {
  const int K = p.K, V = p.V, BT = p.BT;
  float* dS = bw.dS;  // [K, V]
  for (int i = 0; i < K * V; ++i) dS[i] = gr.dht ? gr.dht[i] : 0.0f;

  for (int n = p.NT - 1; n >= 0; --n) {
    const int base = n * BT, nc = p.chunk_len(n);
    const float* Aqk = w.Aqk + (idx)n * BT * BT;
    const double* glast = w.gc + (idx)(base + nc - 1) * K;
    std::copy(dS, dS + K * V, bw.dS_exit + (idx)n * K * V);


    // dvcorr[c, :] = sum_d kr[c, d] dS[d, :] + sum_{j>=c} Aqk[j, c] do[j, :]      [nc, V]
    for (int c = 0; c < nc; ++c) {
      const idx tc = base + c;
      float* dvc = bw.dvcorr + tc * V;
      for (int e = 0; e < V; ++e) dvc[e] = 0.0f;
      for (int d = 0; d < K; ++d) {
        const float kcd = w.kr[tc * K + d];
        for (int e = 0; e < V; ++e) dvc[e] += kcd * dS[d * V + e];
      }
      for (int j = c; j < nc; ++j) {
        const float a = Aqk[j * BT + c];
        const float* doj = gr.dout + (base + j) * gr.ldv;
        for (int e = 0; e < V; ++e) dvc[e] += a * doj[e];
      }
    }

    // dS[d, :] = exp(glast[d]) dS[d, :] + sum_c (qd[c, d] do[c, :] - w[c, d] dvcorr[c, :])   [K, V]
    for (int d = 0; d < K; ++d) {
      float* dSd = dS + d * V;
      const float dl = decay(glast[d]);  // exp(glast)
      for (int e = 0; e < V; ++e) dSd[e] *= dl;
      for (int c = 0; c < nc; ++c) {
        const idx tc = base + c;
        const float qcd = w.qd[tc * K + d];
        const float wcd = w.w[tc * K + d];
        const float* doc = gr.dout + tc * gr.ldv;
        const float* dvc = bw.dvcorr + tc * V;
        for (int e = 0; e < V; ++e) dSd[e] += qcd * doc[e] - wcd * dvc[e];
      }
    }
  }
  if (gr.dh0) std::copy(dS, dS + K * V, gr.dh0);  // dLoss/d(state before chunk 0)
}

// The rest of each chunk's adjoint. Inputs: the chunk's entry state S, dS_out,
// vcorr, dvcorr, do. Outputs: this chunk's rows of dqn, dkn, da, dbeta (w.r.t.
// sigmoid(beta)) and of dv (final: v enters only through u). Chunks do not
// interact here: a token's q, k, v, g, beta appear only in its own chunk.
void chunk_adjoint(const Params& p, const HeadInputs& in, const FwdWork& w, const HeadGrads& gr,
                   BwdWork& bw) {
  const int K = p.K, V = p.V, BT = p.BT;
  const double* gc = w.gc;  // [T, K]
  const float* qn = w.qn;  // [T, K]
  const float* kn = w.kn;  // [T, K]
  float* dqn = bw.dqn;     // [T, K]
  float* dkn = bw.dkn;     // [T, K]
  // the chunk's scratch
  float* dqd = bw.dqd;        // [BT, K]
  float* dkd = bw.dkd;        // [BT, K]
  float* dkr = bw.dkr;        // [BT, K]
  float* dw = bw.dw;          // [BT, K]
  float* dAqk = bw.dAqk;      // [BT, BT]
  float* dAf = bw.dAf;        // [BT, BT]
  float* dX = bw.dX;          // [BT, BT]
  float* Y = bw.Y;            // [BT, BT]
  double* dgc = bw.dgc;       // [BT, K]  (row c = token base + c)
  double* dglast = bw.dglast; // [K]

  for (int n = 0; n < p.NT; ++n) {
    const int base = n * BT, nc = p.chunk_len(n);
    const idx last = base + nc - 1;
    const float* X = w.X + (idx)n * BT * BT;         // [BT, BT]
    const float* Af = w.Af + (idx)n * BT * BT;       // [BT, BT]
    const float* S = w.S_entry + (idx)n * K * V;     // [K, V] state entering the chunk
    const float* dSo = bw.dS_exit + (idx)n * K * V;  // [K, V] dLoss/d(state leaving it)
    const double* glast = gc + last * K;              // [K]

    // this chunk's rows of the token gradients start at zero
    for (int c = 0; c < nc; ++c) {
      const idx tc = base + c;
      for (int d = 0; d < K; ++d) {
        dqn[tc * K + d] = 0.0f;
        dkn[tc * K + d] = 0.0f;
        dgc[c * K + d] = 0.0;
      }
      bw.dbeta[tc] = 0.0f;
    }

    // --- 1. the recurrence's products, now that S, dS_out, vcorr and dvcorr are known ---
    //   o     = qd S + Aqk vcorr                 ->  dqd = do S^T,          dAqk = lower(do vcorr^T)
    //   S_out = diag(exp(glast)) S + kr^T vcorr  ->  dkr = vcorr dS_out^T,  dglast = exp(glast) rowsum(S * dS_out)
    //   vcorr = u - w S                          ->  dw  = -dvcorr S^T,     du = dvcorr
    for (int c = 0; c < nc; ++c) {
      const idx tc = base + c;
      const float* doc = gr.dout + tc * gr.ldv;  // [V]
      const float* vc = w.vcorr + tc * V;        // [V]
      const float* dvc = bw.dvcorr + tc * V;     // [V]
      for (int d = 0; d < K; ++d) {
        const float* Sd = S + d * V;
        const float* dSod = dSo + d * V;
        float sq = 0.0f, sr = 0.0f, sw = 0.0f;
        for (int e = 0; e < V; ++e) {
          sq += doc[e] * Sd[e];
          sr += vc[e] * dSod[e];
          sw += dvc[e] * Sd[e];
        }
        dqd[c * K + d] = sq;
        dkr[c * K + d] = sr;
        dw[c * K + d] = -sw;
      }
      for (int j = 0; j <= c; ++j) {
        const float* vj = w.vcorr + (idx)(base + j) * V;
        float sa = 0.0f;
        for (int e = 0; e < V; ++e) sa += doc[e] * vj[e];
        dAqk[c * BT + j] = sa;
      }
    }
    for (int d = 0; d < K; ++d) {
      float sg = 0.0f;
      for (int e = 0; e < V; ++e) sg += S[d * V + e] * dSo[d * V + e];
      dglast[d] = decay(glast[d]) * sg;
    }

    // --- 2. qd and kr back to qn, kn, gc (kd's gradient comes from w, in step 4) ---
    //   qd = scale qn exp(gc)       ->  dqn += scale exp(gc) dqd,    dgc += qd dqd
    //   kr = kn exp(glast - gc)     ->  dkn += exp(glast - gc) dkr,  dgc -= kr dkr,  dglast += sum_c kr dkr
    for (int c = 0; c < nc; ++c) {
      const idx tc = base + c;
      for (int d = 0; d < K; ++d) {
        const idx td = tc * K + d;
        const float gqd = dqd[c * K + d], gkr = dkr[c * K + d];
        dqn[td] += p.scale * decay(gc[td]) * gqd;
        dkn[td] += decay(glast[d], gc[td]) * gkr;
        const float tq = w.qd[td] * gqd, tr = w.kr[td] * gkr;
        dgc[c * K + d] += tq;
        dgc[c * K + d] -= tr;
        dglast[d] += tr;
      }
    }

    // --- 3. Aqk[c, j] = scale sum_d qn[c, d] kn[j, d] exp(gc[c, d] - gc[j, d])   (j <= c) ---
    //   with g = dAqk[c, j] scale and t = g qn[c, d] kn[j, d] exp(.):
    //   dqn[c] += g kn[j] exp(.),  dkn[j] += g qn[c] exp(.),  dgc[c] += t,  dgc[j] -= t
    //   (on the diagonal exp(0) = 1 does not depend on the gate)
    for (int c = 0; c < nc; ++c) {
      const idx tc = base + c;
      for (int j = 0; j <= c; ++j) {
        const idx tj = base + j;
        const float g = dAqk[c * BT + j] * p.scale;
        for (int d = 0; d < K; ++d) {
          const float e = decay(gc[tc * K + d], gc[tj * K + d]);
          dqn[tc * K + d] += g * kn[tj * K + d] * e;
          dkn[tj * K + d] += g * qn[tc * K + d] * e;
          if (j < c) {
            const float t = g * qn[tc * K + d] * kn[tj * K + d] * e;
            dgc[c * K + d] += t;
            dgc[j * K + d] -= t;
          }
        }
      }
    }

    // --- 4. w = Af kd,  u = Af v   (du = dvcorr) ---
    //   dAf[c, i] = dw[c] . kd[i] + dvcorr[c] . v[i]      (i <= c)
    //   dkd[i, :] = sum_{c>=i} Af[c, i] dw[c, :]
    //   dv[i, :]  = sum_{c>=i} Af[c, i] dvcorr[c, :]
    for (int c = 0; c < nc; ++c) {
      const idx tc = base + c;
      for (int i = 0; i <= c; ++i) {
        const idx ti = base + i;
        const float* vi = in.v + ti * in.ldv;
        float sa = 0.0f;
        for (int d = 0; d < K; ++d) sa += dw[c * K + d] * w.kd[ti * K + d];
        for (int e = 0; e < V; ++e) sa += bw.dvcorr[tc * V + e] * vi[e];
        dAf[c * BT + i] = sa;
      }
    }
    for (int i = 0; i < nc; ++i) {
      const idx ti = base + i;
      float* dkdi = dkd + i * K;
      float* dvi = gr.dv + ti * gr.ldv;
      for (int d = 0; d < K; ++d) dkdi[d] = 0.0f;
      for (int e = 0; e < V; ++e) dvi[e] = 0.0f;
      for (int c = i; c < nc; ++c) {
        const float a = Af[c * BT + i];
        const float* dvc = bw.dvcorr + (idx)(base + c) * V;
        for (int d = 0; d < K; ++d) dkdi[d] += a * dw[c * K + d];
        for (int e = 0; e < V; ++e) dvi[e] += a * dvc[e];
      }
    }
    //   kd = kn exp(gc)  ->  dkn += exp(gc) dkd,  dgc += kd dkd
    for (int c = 0; c < nc; ++c) {
      const idx tc = base + c;
      for (int d = 0; d < K; ++d) {
        const idx td = tc * K + d;
        dkn[td] += decay(gc[td]) * dkd[c * K + d];
        dgc[c * K + d] += w.kd[td] * dkd[c * K + d];
      }
    }

    // --- 5. Af[c, i] = X[c, i] beta_i   (i <= c) ---
    //   dbeta[i] += sum_{c>=i} dAf[c, i] X[c, i];   dX[c, i] = dAf[c, i] beta_i
    // (X's diagonal is the constant 1 and its upper part 0: only the strictly
    //  lower part of dX matters for L)
    for (int c = 0; c < nc; ++c) {
      for (int i = 0; i <= c; ++i) {
        bw.dbeta[base + i] += dAf[c * BT + i] * X[c * BT + i];
        if (i < c) dX[c * BT + i] = dAf[c * BT + i] * w.beta[base + i];
      }
    }

    // --- 6. X = (I + L)^-1 ---
    // A change dL moves X by -X dL X, so dLoss/dL = -X^T dX X^T, of which we
    // need the strictly lower part (L is strictly lower). X is lower triangular:
    //   Y = X^T dX:     Y[c, r] = sum_{m>=c} X[m, c] dX[m, r]     (r < c, so m > r)
    //   dL = -Y X^T:    dL[c, i] = -sum_{r<=i} Y[c, r] X[i, r]    (i < c, computed in step 7)
    for (int c = 0; c < nc; ++c) {
      for (int r = 0; r < c; ++r) {
        float sy = 0.0f;
        for (int m = c; m < nc; ++m) sy += X[m * BT + c] * dX[m * BT + r];
        Y[c * BT + r] = sy;
      }
    }

    // --- 7. L[c, i] = beta_c inner[c, i],  inner = sum_d kn[c, d] kn[i, d] exp(gc[c, d] - gc[i, d]) ---
    //   dbeta[c] += dL inner;  with gi = dL beta_c and t = gi kn[c, d] kn[i, d] exp(.):
    //   dkn[c] += gi kn[i] exp(.),  dkn[i] += gi kn[c] exp(.),  dgc[c] += t,  dgc[i] -= t
    for (int c = 0; c < nc; ++c) {
      const idx tc = base + c;
      for (int i = 0; i < c; ++i) {
        const idx ti = base + i;
        float dL = 0.0f;
        for (int r = 0; r <= i; ++r) dL -= Y[c * BT + r] * X[i * BT + r];
        float inner = 0.0f;
        for (int d = 0; d < K; ++d)
          inner += kn[tc * K + d] * kn[ti * K + d] * decay(gc[tc * K + d], gc[ti * K + d]);
        bw.dbeta[tc] += dL * inner;
        const float gi = dL * w.beta[tc];
        for (int d = 0; d < K; ++d) {
          const float e = decay(gc[tc * K + d], gc[ti * K + d]);
          const float t = gi * kn[tc * K + d] * kn[ti * K + d] * e;
          dkn[tc * K + d] += gi * kn[ti * K + d] * e;
          dkn[ti * K + d] += gi * kn[tc * K + d] * e;
          dgc[c * K + d] += t;
          dgc[i * K + d] -= t;
        }
      }
    }

    // --- 8. glast is gc of the chunk's last token; gc is the in-chunk cumsum of a ---
    //   gc[c] = a[0] + ... + a[c]  ->  da[c] = dgc[c] + ... + dgc[nc-1]   (reverse cumsum)
    for (int d = 0; d < K; ++d) dgc[(nc - 1) * K + d] += dglast[d];
    for (int d = 0; d < K; ++d) {
      double acc = 0.0;
      for (int c = nc - 1; c >= 0; --c) {
        acc += dgc[c * K + d];
        bw.da[(idx)(base + c) * K + d] = (float)acc;
      }
    }
  }
}

// Per token: the adjoints of the gate, the sigmoid and the l2norms. Writes dq,
// dk, dg, dbeta and each token's share of dA_log.
void prestage_adjoint(const Params& p, const HeadInputs& in, const FwdWork& w, const BwdWork& bw,
                      const HeadGrads& gr) {
  const int K = p.K;
  const float A = std::exp(in.A_log);

  for (idx t = 0; t < p.T; ++t) {
    // a = gate(x), x = g + dt_bias:  dg = da da/dx  (also dt_bias's per-token gradient:
    // the binding sums it), and this token's share of dA_log = sum_d da da/dA_log
    const float* gt = in.g + t * in.ldk;
    const float* dat = bw.da + t * K;
    float* dgt = gr.dg + t * gr.ldk;
    float dA = 0.0f;
    for (int d = 0; d < K; ++d) {
      float da_dx, da_dAlog;
      gate_partials(p, gt[d] + in.dt_bias[d], A, &da_dx, &da_dAlog);
      dgt[d] = dat[d] * da_dx;
      dA += dat[d] * da_dAlog;
    }
    gr.dA_log_tok[t * gr.ldb] = dA;

    // beta = sigmoid(beta_raw)  ->  dbeta_raw = dbeta beta (1 - beta)
    const float b = w.beta[t];
    gr.dbeta[t * gr.ldb] = bw.dbeta[t] * b * (1.0f - b);

    // qn = q rq, rq = (sum q^2 + eps)^(-1/2)  ->  dq = rq (dqn - (qn . dqn) qn); the same for k
    const float* qnt = w.qn + t * K;
    const float* knt = w.kn + t * K;
    const float* dqnt = bw.dqn + t * K;
    const float* dknt = bw.dkn + t * K;
    float sq = 0.0f, sk = 0.0f;
    for (int d = 0; d < K; ++d) {
      sq += qnt[d] * dqnt[d];
      sk += knt[d] * dknt[d];
    }
    float* dqt = gr.dq + t * gr.ldk;
    float* dkt = gr.dk + t * gr.ldk;
    for (int d = 0; d < K; ++d) {
      dqt[d] = w.rq[t] * (dqnt[d] - sq * qnt[d]);
      dkt[d] = w.rk[t] * (dknt[d] - sk * knt[d]);
    }
  }
}

}  // namespace kda
