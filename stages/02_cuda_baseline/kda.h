// kda.h -- parameters and launchers of the KDA chunked kernel (fp32, CUDA).
//
// Plain C++/CUDA (no torch): binding.cpp fills these structs with device
// pointers and calls the launchers, which return the first CUDA error.
//
// Conventions (every array is contiguous, row-major, fp32 unless noted):
//   BH = B * H, bh = b * H + h                 one (batch, head) pair
//   NT = ceil(T / BT)                           chunks per (b, h)
//   Tp = NT * BT                                time padded to whole chunks
// Inputs and outputs use the operator's layout ([B, T, H, *]); the workspace
// uses a per-(b, h) layout ([BH, Tp, *] or [BH, NT, BT, BT]) so the tokens of
// one head are contiguous. The padded tokens t in [T, Tp) of the last chunk
// exist only in the workspace: they act as k = q = v = 0, beta = 0 and gate
// a = 0, which leaves every real token's result unchanged. Inputs and outputs
// are never read or written at t >= T.
//
// Precision (stage 01's choice): everything is fp32 except the gate's in-chunk
// cumsum gc and its adjoint dgc (then da), kept in fp64. A float gc loses the low
// bits of the differences gc[c] - gc[i] the decays need, and dgc's +t / -t pairs
// cancel only up to float rounding. Differences in double, exp() in float.
#pragma once

#include <cuda_runtime.h>

// Profile region ids (indices of SPEC.regions in stage.py).
enum KdaRegion {
  KDA_REG_FWD_PRE = 0,    // fwd: pre-stage
  KDA_REG_FWD_WY = 1,     // fwd: WY transform
  KDA_REG_FWD_AQK = 2,    // fwd: Aqk
  KDA_REG_FWD_RECUR = 3,  // fwd: recurrence
  KDA_REG_BWD_RECUR = 4,  // bwd: recurrence
  KDA_REG_BWD_WY = 5,     // bwd: WY/Aqk adjoint
  KDA_REG_BWD_PRE = 6,    // bwd: pre-stage adjoint
};

struct KdaFwdParams {
  // ---- sizes ----
  int B, T, H, K, V;
  int BT, NT, Tp;  // chunk size, number of chunks, NT * BT
  // ---- operator inputs ----
  const float* q;        // [B, T, H, K] raw queries
  const float* k;        // [B, T, H, K] raw keys
  const float* v;        // [B, T, H, V]
  const float* g;        // [B, T, H, K] raw gate input
  const float* beta;     // [B, T, H]    raw beta logits
  const float* A_log;    // [H]
  const float* dt_bias;  // [H, K]
  const float* h0;       // [B, H, K, V] initial state, or nullptr (zero state)
  float scale;
  int gate_id;        // 0: softplus gate, 1: bounded gate
  float lower_bound;  // bounded gate only
  // ---- workspace (written by the forward kernels) ----
  float* qn;      // [BH, Tp, K] l2-normalised q
  float* kn;      // [BH, Tp, K] l2-normalised k
  double* gc;     // [BH, Tp, K] gate a, cumulative sum inside each chunk (fp64)
  float* rq;      // [BH, Tp]    1 / ||q|| (l2norm factor)
  float* rk;      // [BH, Tp]    1 / ||k||
  float* beta_s;  // [BH, Tp]    sigmoid(beta)
  float* X;       // [BH, NT, BT, BT] (I + L)^-1 (unit lower triangular)
  float* Af;      // [BH, NT, BT, BT] X * beta[None, :]
  float* Aqk;     // [BH, NT, BT, BT] lower_incl_diag(qd @ ki^T)
  float* w;       // [BH, Tp, K] Af @ kd
  float* u;       // [BH, Tp, V] Af @ v
  float* vcorr;   // [BH, Tp, V] u - w @ S
  // Chunk-entry states: S_n of (b, h) is states + bh * state_bh_stride +
  // n * state_chunk_stride ([K, V]). The forward passes ht itself with
  // state_chunk_stride = 0 (S updated in place, ends as the final state); the
  // backward's recompute passes a [BH, NT + 1, K, V] buffer (all S_n kept).
  float* states;
  long long state_bh_stride;
  long long state_chunk_stride;
  // ---- output ----
  float* o;         // [B, T, H, V], or nullptr (backward recompute: o not needed)
  long long* prof;  // [slots, KDA_MAX_REGIONS] int64 cycles (profile build), or nullptr
};

struct KdaBwdParams {
  KdaFwdParams f;  // the forward recompute: inputs + workspace (f.prof = nullptr)
  // ---- upstream gradients ----
  const float* dout;  // [B, T, H, V] gradient of o
  const float* dht;   // [B, H, K, V] gradient of the final state, or nullptr (zero)
  // ---- backward workspace ----
  float* dS;    // [BH, K, V]        gradient of the state, carried backward
  float* du;    // [BH, Tp, V]       = dvcorr (gradient of u)
  float* dw;    // [BH, Tp, K]       gradient of w
  float* dqd;   // [BH, Tp, K]       gradient of qd = scale * qn * exp(gc)
  float* dkr;   // [BH, Tp, K]       gradient of kr = kn * exp(glast - gc)
  float* dEL;   // [BH, NT, K]       gradient of EL = exp(glast)
  float* dAqk;  // [BH, NT, BT, BT]  gradient of Aqk
  float* dA;    // [BH, NT, BT, BT]  gradient of Af, then of X (in place)
  float* tmp;   // [BH, NT, BT, BT]  X^T @ dX (inverse VJP)
  float* dqs;   // [BH, Tp, K]       gradient of qs = scale * qn
  float* dkn;   // [BH, Tp, K]       gradient of kn
  double* dgc;  // [BH, Tp, K]       gradient of gc, then da (in place) (fp64)
  float* dbeta_s;  // [BH, Tp]       gradient of sigmoid(beta)
  // ---- outputs ----
  float* dq;      // [B, T, H, K]
  float* dk;      // [B, T, H, K]
  float* dv;      // [B, T, H, V]
  float* dg;      // [B, T, H, K]  (= d/dx, x = g + dt_bias; ddt_bias = dg.sum((0, 1)))
  float* dbeta;   // [B, T, H]
  float* dAlog_part;  // [B, T, H]  per-token dA_log terms (summed in the binding)
  float* dh0;     // [B, H, K, V], or nullptr (no initial state)
  long long* prof;
};

// Forward: pre-stage, WY transform, Aqk, recurrence (o and the final state).
cudaError_t kda_fwd_launch(const KdaFwdParams& p, cudaStream_t stream);
// Backward: recomputes the forward (p.f, states kept), then walks it in reverse.
cudaError_t kda_bwd_launch(const KdaBwdParams& p, cudaStream_t stream);
