// kda.h -- parameters and launcher of the KDA chunked forward, stage 05:
// BT = 16, bounded gate, bf16 tensor cores through CuTe (SM80 16x8x16 MMA).
//
// Plain C++/CUDA (no torch): binding.cpp fills the struct with device pointers
// and calls the launcher, which returns the first CUDA error.
//
// Conventions (every array is contiguous, row-major):
//   BT = 16                                    tokens per chunk (fixed in this stage)
//   BH = B * H, bh = b * H + h                 one (batch, head) pair
//   NT = ceil(T / BT)                          chunks per (b, h)
//   K = V, K in {64, 128}                      head dimensions (compile-time in kda.cu)
// Inputs and o use the operator's layout ([B, T, H, *]) and are never read or
// written at t >= T. The workspace has one slot per chunk ([BH, NT, ...]): the
// padded tokens of the last chunk exist only there, as k = q = v = 0, beta = 0
// and gate a = 0, which leaves every real token's result unchanged.
//
// Forward only: the workspace holds what the recurrence (K2) needs of each
// chunk, prepared by one fused kernel (K1). No per-chunk state is written.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

// Profile region ids (indices of SPEC.regions in stage.py).
enum KdaRegion {
  KDA_REG_K1_PRE = 0,      // K1: load+pre-stage      (l2norm, gate, cumsum, exp; qd/kr^T/exp(glast) out)
  KDA_REG_K1_PRODUCTS = 1, // K1: L/Aqk products       (kd @ ki^T, qd @ ki^T on tensor cores)
  KDA_REG_K1_INVERSE = 2,  // K1: inverse              ((I + L)^-1, Af)
  KDA_REG_K1_WU = 3,       // K1: w/u + store          (Af @ kd, Af @ v on tensor cores)
  KDA_REG_K2_LOADS = 4,    // K2: loads / barriers     (chunk operands into shared memory)
  KDA_REG_K2_WS = 5,       // K2: w@S                  (vcorr = u - w @ S)
  KDA_REG_K2_O = 6,        // K2: qd@S + Aqk@vcorr     (o)
  KDA_REG_K2_SUPDATE = 7,  // K2: S update             (S = exp(glast) S + kr^T @ vcorr)
};

struct KdaFwdParams {
  // ---- sizes ----
  int B, T, H, K, V;
  int NT;  // ceil(T / 16)
  // ---- operator inputs (bf16 activations, fp32 parameters) ----
  const __nv_bfloat16* q;     // [B, T, H, K] raw queries
  const __nv_bfloat16* k;     // [B, T, H, K] raw keys
  const __nv_bfloat16* v;     // [B, T, H, V]
  const __nv_bfloat16* g;     // [B, T, H, K] raw gate input
  const __nv_bfloat16* beta;  // [B, T, H]    raw beta logits
  const float* A_log;         // [H]
  const float* dt_bias;       // [H, K]
  const float* h0;            // [B, H, K, V] initial state, or nullptr (zero state)
  float scale;
  float lower_bound;  // bounded gate: a = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
  // ---- workspace: written by K1, read by K2 (one slot per chunk) ----
  __nv_bfloat16* qd;   // [BH, NT, 16, K] scale * qn * exp(gc)       (A operand of qd @ S)
  __nv_bfloat16* w;    // [BH, NT, 16, K] Af @ kd                    (A operand of w @ S)
  __nv_bfloat16* krT;  // [BH, NT, K, 16] (kn * exp(glast - gc))^T   (A operand of kr^T @ vcorr)
  __nv_bfloat16* Aqk;  // [BH, NT, 16, 16] lower_incl_diag(qd @ ki^T) (A operand of Aqk @ vcorr)
  float* u;            // [BH, NT, 16, V] Af @ v  (fp32: only ever subtracted, never an MMA operand)
  float* el;           // [BH, NT, K]     exp(glast)
#ifdef KDA_NO_FUSED_PREPARE
  // ---- ablation KDA_NO_FUSED_PREPARE: what the fused K1 keeps on chip, passed from
  //      the pre-stage kernel to the WY and Aqk kernels through global memory ----
  __nv_bfloat16* kd;   // [BH, NT, 16, K] kn * exp(gc)
  __nv_bfloat16* ki;   // [BH, NT, 16, K] kn * exp(-gc)
  float* bs;           // [BH, NT, 16]    sigmoid(beta) (0 for padded tokens)
#endif
  // ---- outputs ----
  __nv_bfloat16* o;  // [B, T, H, V]
  float* ht;         // [B, H, K, V] final state
  long long* prof;   // [slots >= max(BH * NT, BH * V / 32), KDA_MAX_REGIONS] int64 cycles, or nullptr
};

// K1 (prepare, grid BH * NT) then K2 (recurrence, grid BH * V / 32) on `stream`.
// (Ablations, kda.cu: KDA_NO_FUSED_PREPARE runs K1 as three kernels of grid BH * NT;
// KDA_NO_COLUMN_SPLIT runs K2 with grid BH.)
// Returns cudaErrorInvalidValue for sizes this stage does not support
// (K != V or K not in {64, 128}).
cudaError_t kda_fwd_launch(const KdaFwdParams& p, cudaStream_t stream);
