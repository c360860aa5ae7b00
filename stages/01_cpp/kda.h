// kda.h -- KDA (Kimi Delta Attention), chunked algorithm, CPU, fp32.
//
// Plain C++ (no torch): every function below is ONE phase of the chunked
// algorithm applied to ONE (batch, head) pair. binding.cpp runs each phase over
// all (batch, head) pairs, one phase after the other.
//
// Forward, per (batch, head), chunks of BT tokens, chunk n = tokens [n*BT, n*BT + nc):
//   prestage          qn, kn = l2norm(q), l2norm(k); beta = sigmoid(beta_raw)
//                     a = gate(g + dt_bias); gc = cumsum of a inside each chunk
//                     qd = scale*qn*exp(gc), kd = kn*exp(gc), kr = kn*exp(glast - gc)
//   wy_transform      L  = strict_lower(beta_c * kn_c . kn_i * exp(gc_c - gc_i))
//                     X  = (I + L)^-1 (forward substitution), Af = X * diag(beta)
//                     w  = Af @ kd,  u = Af @ v
//   intra_chunk_qk    Aqk = lower_incl_diag(scale * qn_c . kn_j * exp(gc_c - gc_j))
//   recurrence        per chunk, in order, S [K, V] carried across chunks:
//                       vcorr = u - w @ S
//                       o     = qd @ S + Aqk @ vcorr
//                       S     = diag(exp(glast)) S + kr^T @ vcorr
// Backward (the adjoint of each step, walked in reverse):
//   (recompute: the four forward phases again, keeping each chunk's entry state)
//   reverse_recurrence  chunks last to first, carrying dS = dLoss/dS:
//                       dvcorr = kr @ dS + Aqk^T @ do
//                       dS     = diag(exp(glast)) dS + qd^T @ do - w^T @ dvcorr
//   chunk_adjoint       per chunk (independent once dvcorr and dS are known):
//                       the adjoints of qd, kd, kr, glast, Aqk, w, u, Af, the inverse
//                       (dL = -X^T dX X^T, strict lower part) and L
//                       ending with the reverse in-chunk cumsum (dgc -> da)
//   prestage_adjoint    per token: the gate, sigmoid, l2norm
//
// The tail: when T is not a multiple of BT the last chunk simply has nc < BT
// rows. That is exactly the same as padding it with tokens of k = 0, v = 0,
// beta = 0 and gate a = 0 (their rows and columns of L, Aqk, w, u, vcorr are
// zero and glast stays the last valid token's), and nothing reads or writes a
// token t >= T.
//
// Precision: everything is float except two running sums of the gate, kept in
// double because float loses exactly what the algorithm needs:
//   gc (forward): L, Aqk and kr use exp(gc[c] - gc[i]). A float gc carries an
//     absolute error ~1e-7 * |gc|, so a difference of two nearby tokens late in
//     a chunk (|gc| ~ 10-100) is off by far more than the difference's own
//     rounding. In double the difference is accurate far below float precision; the
//     exponential itself is taken in float.
//   dgc (backward): each exp(gc[c] - gc[i]) term adds +t to dgc[c] and -t to
//     dgc[i]; the reverse cumsum cancels these pairs for the tokens before i.
//     Summed in float, their rounding survives the cancellation.
// Measured against the fp64 token loop, float gc / dgc give dg errors of a few
// 1e-6 and dA_log errors up to ~5e-4 (dA_log is a sum over tokens with heavy
// cancellation); with them in double dg sits near 2e-7, like the fp32 loop.
//
// Memory layouts (row-major):
//   inputs / outputs: in place in the [B, T, H, *] tensors; a HeadInputs /
//     HeadGrads points at (b, t = 0, h), token t lies at +t*ld (ld = H*K, H*V or H).
//   workspaces: contiguous per (batch, head): token arrays [T, K] / [T, V] / [T],
//     chunk matrices [NT, BT, BT], states [NT, K, V].
#pragma once

#include <cstddef>
#include <cstdint>

namespace kda {

using idx = std::int64_t;  // every offset into a tensor is computed in 64 bits

constexpr int kMaxChunk = 64;     // largest chunk size BT
constexpr int kMaxHeadDim = 256;  // largest K and V
constexpr float kL2Eps = 1e-6f;   // q / sqrt(sum q^2 + eps)

enum Gate : int { kGateSoftplus = 0, kGateBounded = 1 };

// Sizes and scalar arguments shared by every phase.
struct Params {
  int T = 0, K = 0, V = 0;  // tokens, key dim, value dim
  int BT = 0, NT = 0;       // chunk size, number of chunks = ceil(T / BT)
  float scale = 1.0f;       // multiplies q
  int gate = kGateSoftplus;
  float lower_bound = 0.0f;  // bounded gate only, in [-5, 0)

  // rows of chunk n (BT, or fewer for the tail chunk)
  int chunk_len(int n) const {
    const int rest = T - n * BT;
    return rest < BT ? rest : BT;
  }
};

// One (batch, head) of the inputs, read in place.
struct HeadInputs {
  const float* q;     // [T, K] rows at stride ldk
  const float* k;     // [T, K] rows at stride ldk
  const float* g;     // [T, K] rows at stride ldk (raw gate input)
  const float* v;     // [T, V] rows at stride ldv
  const float* beta;  // [T] at stride ldb (raw logits)
  idx ldk, ldv, ldb;  // H*K, H*V, H
  float A_log;            // this head's A_log
  const float* dt_bias;   // [K] this head's row of dt_bias
  const float* h0;        // [K, V] initial state, or nullptr for zeros
};

// One (batch, head) of the upstream gradients and of the outputs of the backward.
struct HeadGrads {
  const float* dout;  // [T, V] at stride ldv: dLoss/do
  const float* dht;   // [K, V] dLoss/d(final state), or nullptr for zeros
  float* dq;          // [T, K] at stride ldk
  float* dk;          // [T, K] at stride ldk
  float* dg;          // [T, K] at stride ldk (= dLoss/dx, x = g + dt_bias)
  float* dv;          // [T, V] at stride ldv
  float* dbeta;       // [T] at stride ldb (w.r.t. the raw logits)
  float* dA_log_tok;  // [T] at stride ldb: token t's share of dA_log (binding sums over b, t)
  float* dh0;         // [K, V], or nullptr when nobody wants it
  idx ldk, ldv, ldb;  // H*K, H*V, H (as in HeadInputs)
};

// Forward intermediates of one (batch, head). The backward recomputes them.
struct FwdWork {
  // per token (prestage)
  float* qn;    // [T, K] l2-normalised q
  float* kn;    // [T, K] l2-normalised k
  float* rq;    // [T]    1 / sqrt(sum q^2 + eps), kept for the l2norm adjoint
  float* rk;    // [T]
  float* beta;  // [T]    sigmoid(beta_raw)
  double* gc;   // [T, K] in-chunk cumulative sum of the gate a, in double (see below)
  float* qd;    // [T, K] scale * qn * exp(gc)
  float* kd;    // [T, K] kn * exp(gc)
  float* kr;    // [T, K] kn * exp(glast - gc)
  // per chunk (wy_transform, intra_chunk_qk); only the top-left nc x nc block is used
  float* X;    // [NT, BT, BT] (I + L)^-1, unit lower triangular
  float* Af;   // [NT, BT, BT] X * diag(beta)
  float* Aqk;  // [NT, BT, BT] lower triangular incl. diagonal
  float* w;    // [T, K] Af @ kd
  float* u;    // [T, V] Af @ v
  // recurrence
  float* vcorr;    // [T, V] u - w @ S
  float* S_entry;  // [NT, K, V] state entering each chunk, or nullptr (not kept)
};

// Backward scratch of one (batch, head).
struct BwdWork {
  float* S;        // [K, V] running state of the recompute (final value unused)
  float* dS;       // [K, V] running dLoss/dS of the reverse recurrence
  float* dS_exit;  // [NT, K, V] dLoss/d(state leaving chunk n)
  float* dvcorr;   // [T, V]
  float* dqn;      // [T, K]
  float* dkn;      // [T, K]
  float* da;       // [T, K] dLoss/da (a = the gate, before the cumsum)
  float* dbeta;    // [T]    dLoss/d sigmoid(beta)
  // one chunk's scratch in chunk_adjoint
  float* dqd;     // [BT, K]
  float* dkd;     // [BT, K]
  float* dkr;     // [BT, K]
  float* dw;      // [BT, K]
  float* dAqk;    // [BT, BT]
  float* dAf;     // [BT, BT]
  float* dX;      // [BT, BT]
  float* Y;       // [BT, BT] X^T @ dX
  // in double, see "Precision" at the top
  double* dgc;     // [BT, K] dLoss/dgc of the chunk
  double* dglast;  // [K]     dLoss/dglast of the chunk
};

// Workspace sizes in bytes and the layout of the arrays inside one block of
// that size (base 64-byte aligned; every array starts 64-byte aligned).
std::size_t fwd_work_bytes(const Params& p, bool keep_states);
FwdWork fwd_work_at(void* base, const Params& p, bool keep_states);
std::size_t bwd_work_bytes(const Params& p);
BwdWork bwd_work_at(void* base, const Params& p);

// ---- forward phases (one (batch, head) each) ----
void prestage(const Params& p, const HeadInputs& in, FwdWork& w);
void wy_transform(const Params& p, const HeadInputs& in, FwdWork& w);
void intra_chunk_qk(const Params& p, FwdWork& w);
// S [K, V]: the running state, set to h0 (or 0) on entry, the final state on
// return. o: [T, V] rows at stride ldo, or nullptr to skip the output. When
// w.S_entry is set, each chunk's entry state is stored there.
void recurrence(const Params& p, const HeadInputs& in, FwdWork& w, float* S, float* o, idx ldo);

// ---- backward phases ----
void reverse_recurrence(const Params& p, const FwdWork& w, const HeadGrads& gr, BwdWork& bw);
void chunk_adjoint(const Params& p, const HeadInputs& in, const FwdWork& w, const HeadGrads& gr,
                   BwdWork& bw);
void prestage_adjoint(const Params& p, const HeadInputs& in, const FwdWork& w, const BwdWork& bw,
                      const HeadGrads& gr);

}  // namespace kda
