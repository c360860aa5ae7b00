// kda.h -- parameters and launcher of the KDA chunked forward, stage 12:
// stage 11's kernels with the softplus gate (Kimi Linear's, no lower bound) on
// the tensor cores: the chunk's two 16 x 16 products L and Aqk pair by pair,
// each pair's decay exp(gc_i - gc_j) <= 1 taken relative to a reference token
// inside the pair's span, so that no exponent overflows (kda.cu and its kernel files).
//
// Plain C++/CUDA (no torch): binding.cpp fills the struct with device pointers
// and calls the launcher, which returns the first CUDA error.
//
// Conventions (every array is contiguous, row-major):
//   BT = 16                                    tokens per chunk (fixed in this stage)
//   N sequences: without cu_seqlens N = B and sequence i is batch row i (T tokens);
//     with cu_seqlens (B = 1) sequence i is tokens cu[i] .. cu[i + 1] - 1 of the
//     packed [1, T, H, *] inputs (any length, 0 included). seq_span (common.cuh)
//     gives (bos, len): token t of sequence i, head h is row (bos + t) * H + h.
//   NH = N * H, bh = i * H + h                 one (sequence, head) pair
//   NT_i = ceil(len_i / BT)                    chunks of sequence i
//   NT = ceil(max_i len_i / BT)                the longest sequence's (T without cu_seqlens)
//   K = V, K in {64, 128}                      head dimensions (compile-time in the kernels)
// Inputs and o use the operator's layout ([B, T, H, *]) and are never read or
// written past a sequence's end. The workspace has one slot per chunk ([NH, NC, ...]):
// the padded tokens of a sequence's last chunk exist only there, as k = q = v = 0,
// beta = 0 and gate a = 0, which leaves every real token's result unchanged. The
// state h0, ht is [N, H, K, V], or [N, H, V, K] with state_v_first.
//
// Two ways to form L and Aqk (KdaFwdParams::products):
//   factored (stage 11's, bounded gates only): kd @ ki^T and qd @ ki^T on the
//          tensor cores, ki = kn exp(-gc) <= kn e^80 with the bounded gate;
//   pairwise (any gate a <= 0): per pair (i >= j), sum_d kn_i kn_j exp(gc_i - gc_j)
//          in fp32 (products_pairwise), every factor <= 1. The softplus gate and the
//          log decay without a bound (lower_bound 0) need it; the rest of the chunk
//          (w, u, qd, kr, the recurrence) stays on the tensor cores, every operand
//          of it being kn or qn times a decay <= 1.
//   as needed (KDA_PRODUCTS_AS_NEEDED, the unbounded gates' default): each chunk
//          checks its own decay (one barrier with an OR) and goes pairwise only where
//          some key dimension decays by more than kFactoredRange = 80 within it.
//
// Forward only. Two paths (kda_fwd_plan picks one, the binding allocates what it needs):
//   split: K1 prepares every chunk in parallel into the workspace, K2 runs the
//          recurrence from it (stage 07);
//   fused: one kernel, the prepare warps of a block feed the chunks to its
//          compute warps through shared memory; the workspace pointers are unused;
//   hybrid (packed sequences, one much longer than the rest): the fused kernel over the
//          short sequences and the split path over the long ones, side by side.
// No per-chunk state is written.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

// Profile region ids (indices of SPEC.regions in stage.py).
enum KdaRegion {
  KDA_REG_K1_PRE = 0,        // K1: load+pre-stage   (l2norm, gate, cumsum, exp; qd/kr^T/exp(glast) out)
  KDA_REG_K1_PRODUCTS = 1,   // K1: L/Aqk products    (kd @ ki^T, qd @ ki^T on tensor cores)
  KDA_REG_K1_INVERSE = 2,    // K1: inverse           ((I + L)^-1 in registers, Af)
  KDA_REG_K1_WU = 3,         // K1: w/u + store       (Af @ kd, Af @ v on tensor cores)
  KDA_REG_K2_WAIT = 4,       // K2: wait for operands (compute warps at FULL[slot])
  KDA_REG_K2_WS = 5,         // K2: w@S
  KDA_REG_K2_QS = 6,         // K2: qd@S              (issued right after w@S: both read only S)
  KDA_REG_K2_VCORR = 7,      // K2: vcorr             (u - w@S in the accumulator, movmatrix to B)
  KDA_REG_K2_AV = 8,         // K2: Aqk@vcorr
  KDA_REG_K2_OSTORE = 9,     // K2: o store           (bf16x2 to global)
  KDA_REG_K2_DECAY = 10,     // K2: S decay           (S *= exp(glast), registers)
  KDA_REG_K2_KV = 11,        // K2: kr^T@vcorr        (accumulated into S)
  KDA_REG_K2_SCOPY = 12,     // K2: S to bf16         (accumulator -> B fragment, movmatrix)
  KDA_REG_K2L_WAIT_SLOT = 13,// K2 producer: wait (EMPTY[slot] mbarrier; fused: and the team's barrier after it)
  KDA_REG_K2L_ISSUE = 14,    // K2 producer: issue loads (load warp: cp.async; fused: stage_rows + next chunk's loads)
  KDA_REG_FUSED_BARRIER = 15,// fused prepare: the team's barrier before a chunk (its last step done with the scratch)
  KDA_REG_FUSED_DECAY = 16,  // fused prepare: decay_columns (qd, kr^T, exp(glast) into the slot)
};

// The backward's profile regions (backward.cuh, chains_mma.cuh; indices of SPEC.backward_regions in stage.py), a
// table of their own in the backward's call: each kernel's regions per chunk (slot = the chunk's workspace slot; a
// chain's recorded by the block of its first 32 value columns).
enum KdaBwdRegion {
  KDA_REG_B1_LOAD = 0,       // B1: the chunk's inputs, the gate, the norms, the cumulative decay
  KDA_REG_B1_PAIRS = 1,      // B1: the pair sums kk, qk
  KDA_REG_B1_INVERSE = 2,    // B1: X = (I + L)^-1
  KDA_REG_B1_STORE = 3,      // B1: the chain operands out (qd, kr, w, u, Aqk, el)
  KDA_REG_B2_WAIT = 4,       // B2: wait for the chunk's operands (cp.async) and the block's barrier
  KDA_REG_B2_STEP = 5,       // B2: S stored, w S, vcorr, S decayed + kr^T vcorr
  KDA_REG_B3_WAIT = 6,       // B3: as B2's
  KDA_REG_B3_STEP = 7,       // B3: dS stored, dvcorr, dS decayed + qd^T do - w^T dvcorr
  KDA_REG_B4_LOAD = 8,       // B4: as B1's, and do, vcorr, dvcorr
  KDA_REG_B4_PAIRS = 9,      // B4: as B1's
  KDA_REG_B4_INVERSE = 10,   // B4: as B1's
  KDA_REG_B4_STATES = 11,    // B4: the products with S and dS (dqd, dw, dkr, dglast)
  KDA_REG_B4_SMALL = 12,     // B4: the 16 x 16 adjoints (dAqk, dAf over the key / value dimension; dbeta, T1, dL)
  KDA_REG_B4_KEYS = 13,      // B4: the per-key-dimension terms (pair terms, decays, the gate)
  KDA_REG_B4_OUT = 14,       // B4: dv, the l2norm's adjoint, the gradients out
};

// The gate of KdaFwdParams::gate_id (the binding's gate_id).
enum KdaGate {
  KDA_GATE_SOFTPLUS = 0,  // a = -exp(A_log) * softplus(g + dt_bias), g raw bf16 (no lower bound: pairwise)
  KDA_GATE_BOUNDED = 1,   // a = lower_bound * sigmoid(exp(A_log) * (g + dt_bias)), g raw bf16
  KDA_GATE_LOG = 3,       // a = g_log as it is (fp32; a <= 0, and >= lower_bound unless lower_bound = 0)
};

// How a chunk's L and Aqk are formed (KdaFwdParams::products, the binding's pairwise).
enum KdaProducts {
  KDA_PRODUCTS_FACTORED = 0,   // through exp(-gc) (stages 05-11; bounded gates only)
  KDA_PRODUCTS_PAIRWISE = 1,   // pair by pair (products_pairwise) in every chunk, any gate
  KDA_PRODUCTS_AS_NEEDED = 2,  // pair by pair in a chunk whose decay is wider than kFactoredRange, else factored
};

// The most runs of consecutive long sequences the hybrid splits off (one K1 + K2 chain each).
#define KDA_MAX_SKIP 4

struct KdaFwdParams {
  // ---- sizes ----
  int B, T, H, K, V;
  int NT;  // ceil(longest sequence / 16): ceil(T / 16) without cu_seqlens
  // ---- the sequences: cu_seqlens [N + 1] int32 token offsets on the device (B = 1), or
  //      nullptr (N = B, sequence i is batch row i) ----
  const int* cu_seqlens;
  int N;
  // ---- the fused kernel skips sequences skip_lo[r] .. skip_hi[r] - 1, r < n_skip: the hybrid runs
  //      those (the long ones) on the split path beside it (binding.cpp) ----
  int n_skip;
  int skip_lo[KDA_MAX_SKIP], skip_hi[KDA_MAX_SKIP];
  // ---- the split path runs in segments of the sequence: chunks n0 .. n0 + NC - 1 per K1 + K2 pair ----
  int n0;  // the segment's first chunk
  int NC;  // chunks in the segment (the workspace holds one segment: its chunk pitch)
  // ---- operator inputs (bf16 activations, fp32 parameters) ----
  const __nv_bfloat16* q;     // [B, T, H, K] raw queries
  const __nv_bfloat16* k;     // [B, T, H, K] raw keys
  const __nv_bfloat16* v;     // [B, T, H, V]
  const __nv_bfloat16* g;     // [B, T, H, K] raw gate input (gate_id 0, 1; nullptr with gate_id 3)
  const float* g_log;         // [B, T, H, K] the log decay a itself (gate_id 3; nullptr with gate_id 0, 1)
  const __nv_bfloat16* beta;  // [B, T, H]    beta (raw logits with beta_mode 1, 2)
  const float* A_log;         // [H]
  const float* dt_bias;       // [H, K]
  const float* h0;            // [N, H, K, V] ([N, H, V, K] with state_v_first) initial state, or nullptr (zero state)
  float scale;
  float lower_bound;  // bounded gate: a = lower_bound * sigmoid(exp(A_log) * (g + dt_bias))
  // ---- the prepare's variant: which instantiation the launcher runs (read by kda_fwd_launch only) ----
  int products;       // KdaProducts: how L and Aqk are formed
  int u_halves;       // 1: u = Af_hi @ v + Af_lo @ v (Af in two bf16 halves: u to fp32 accuracy); 0: Af in bf16 once
  int deep_ring;      // K2's ring at K = 64: -1 the rule (kLoneStages64 slots where every block has an SM), 0 kStagesFor slots, 1 kLoneStages64
  // ---- the caller's layout and activations (runtime flags, read uniformly by the pre-stage) ----
  int gate_id;        // KDA_GATE_SOFTPLUS, KDA_GATE_BOUNDED or KDA_GATE_LOG
  int l2norm;         // 1: q, k L2-normalised here; 0: taken as they are
  int beta_mode;      // 0: beta as it is; 1: sigmoid(beta); 2: 2 sigmoid(beta) (FLA's allow_neg_eigval)
  int state_v_first;  // 1: h0, ht are [N, H, V, K]
  // ---- workspace of the split path: written by K1, read by K2 (one slot per chunk) ----
  __nv_bfloat16* qd;   // [NH, NC, 16, K] scale * qn * exp(gc)       (A operand of qd @ S)
  __nv_bfloat16* w;    // [NH, NC, 16, K] Af @ kd                    (A operand of w @ S)
  __nv_bfloat16* krT;  // [NH, NC, K, 16] (kn * exp(glast - gc))^T   (A operand of kr^T @ vcorr)
  __nv_bfloat16* Aqk;  // [NH, NC, 16, 16] lower_incl_diag(qd @ ki^T), or pairwise (A operand of Aqk @ vcorr)
  float* u;            // [NH, NC, 16, V] Af @ v  (fp32: only ever subtracted, never an MMA operand; u_halves: Af to fp32 accuracy)
  float* el;           // [NH, NC, K]     exp(glast), at el_index(d)
  // ---- outputs ----
  __nv_bfloat16* o;  // [B, T, H, V]
  float* ht;         // [N, H, K, V] ([N, H, V, K] with state_v_first) final state
  long long* prof;   // [slots >= max(NH * NT, NH * V / 16), KDA_MAX_REGIONS] int64 cycles, or nullptr
};

// Which kernels run: the fused kernel or K1 + K2, and the compute warps per
// block (ncw: 16 value columns each; fused 1, 2, 4 or V/16, split 1 or 2).
struct KdaPlan {
  bool fused;
  int ncw;
};

// The hybrid: with the fused plan and the sequences' lengths known on the host, the
// sequences of at least long_from tokens run on the split path (their chain of chunks
// no longer carries the prepare of each chunk) beside the fused kernel over the others.
// The rule: long_from = max(2048, 4 x the mean length, H x total_tokens / SMs), and only
// where some sequence is that long (0: no hybrid). p.N sequences of total_tokens tokens,
// the longest max_len.
int kda_hybrid_long_from(const KdaFwdParams& p, const KdaPlan& plan, long long total_tokens, int max_len);

// The plan for these sizes on the current device: want_fused < 0 picks by the
// stage's rule (at V = 128: fused with 8 compute warps when 3 N*H >= 2 SMs,
// fused with 4 when SMs <= 3 N*H and 2 N*H <= SMs; otherwise split, ncw = 2
// when N*H*V/32 >= the number of SMs, else 1); want_fused 0/1 with want_ncw asks
// for one path (cudaErrorInvalidValue if it does not exist); want_fused 0 with
// want_ncw 0 the split path at the rule's width (the hybrid's runs). Sizes this stage
// does not support: cudaErrorInvalidValue.
cudaError_t kda_fwd_plan(const KdaFwdParams& p, int want_fused, int want_ncw, KdaPlan* plan);

// Launch the plan on `stream`: split = K1 (grid NH * NC) then K2 (grid NH * V / (16 ncw)),
// over the segment's chunks n0 .. n0 + NC - 1 of every sequence; fused = one kernel
// (grid NH * V / (16 ncw)), each block over its sequence's NT_i chunks. Returns
// cudaErrorInvalidValue for sizes this stage does not support (K != V or K not in
// {64, 128}), inconsistent sequences, gate or flags (the softplus gate factored), or a
// split plan without its workspace.
// `kernels` picks the split path's kernels to launch (the binding runs K1 of one segment
// on a side stream beside K2 of the previous one); the fused path ignores it.
enum KdaKernels { KDA_LAUNCH_K1 = 1, KDA_LAUNCH_K2 = 2, KDA_LAUNCH_ALL = 3 };
cudaError_t kda_fwd_launch(const KdaFwdParams& p, const KdaPlan& plan, cudaStream_t stream,
                           int kernels = KDA_LAUNCH_ALL);

// The fragment identity of this stage, for the tests: out[16, 16] = A[16, kd] @ bf16(X[kd, 16])
// computed by one warp with X loaded as an MMA accumulator and turned into the B
// operand by movmatrix. kd in {16, 64, 128}; row-major device arrays.
cudaError_t kda_frag_check_launch(const __nv_bfloat16* A, const float* X, float* out, int kd, cudaStream_t stream);

// ---------------------------------------------------------------------------
// The backward (backward.cuh): four kernels, every product fp32, every decay pair by pair.
// N sequences as the forward takes them (batch rows, or packed with cu_seqlens and B = 1), the state
// [N, H, K, V] (the binding turns a V-first state around), K = V in {64, 128}, the raw gates 0
// (softplus) and 1 (bounded), q and k L2-normalised and beta = sigmoid(beta) here.
// ---------------------------------------------------------------------------
// What B4 reads of the two chains, each chunk's entry state and exit gradient, is stored in bf16, as FLA stores
// its per-chunk states for its backward: half the bytes of the largest part of the workspace. The chains keep
// their state in fp32 registers; only B4's copy is rounded. KDA_BWD_STATES_FP32 (the variant build
// "fp32_states", and the CPU check's emulator) stores them in fp32.
#ifdef KDA_BWD_STATES_FP32
using kda_state_t = float;
#else
using kda_state_t = __nv_bfloat16;
#endif
// The chains' [16, K] operands qd, kr, w as B1 stores them: bf16, as the tensor-core chains' MMAs take them (the
// rounding they took of fp32 operands before, so the same bits at half the bytes); fp32 for the CUDA-core chains
// (KDA_BWD_FP32_CHAINS: the variant fp32_chains and the exact build), and for the variant fp32_operands
// (KDA_BWD_FP32_OPERANDS: the tensor-core chains reading fp32 operands, rounding them as they read them).
#if defined(KDA_BWD_FP32_CHAINS) || defined(KDA_BWD_FP32_OPERANDS)
#define KDA_BWD_OPS_FP32 1  // the one place that decides: the kernels, the binding and the emulator read this
using kda_op_t = float;
#else
using kda_op_t = __nv_bfloat16;
#endif

// B1 keeps each chunk's X = (I + L)^-1 and pair sums kk for B4 (2 KB a chunk, fp32), which then rebuilds only
// the rest of the chunk; the variant build b4_rebuilds (KDA_BWD_B4_REBUILDS) has B4 form them again, as B1 does.
#ifndef KDA_BWD_B4_REBUILDS
#define KDA_BWD_KEEP_XKK 1
#endif

struct KdaBwdParams {
  int B, T, H, D;  // D = K = V
  int N;           // sequences: B, or cu_seqlens' N
  const int* cu_seqlens;  // [N + 1] token offsets (B = 1), or nullptr
  int NT;          // ceil(longest sequence / 16): the workspace's chunks per (sequence, head)
  const __nv_bfloat16 *q, *k, *v, *g, *beta;  // the forward's inputs ([B, T, H, *], raw)
  const float* A_log;    // [H]
  const float* dt_bias;  // [H, K]
  const float* h0;       // [N, H, K, V] or nullptr
  float scale, lower_bound;
  int gate_id;           // KDA_GATE_SOFTPLUS or KDA_GATE_BOUNDED
  const float* dout;     // [B, T, H, V] fp32, the gradient of o, or nullptr where dout_bf is given
  const __nv_bfloat16* dout_bf;  // the same in bf16 (o's dtype: the op's), or nullptr
  const float* dht;      // [N, H, K, V] fp32, the gradient of the final state, or nullptr
  // ---- workspace, one slot per chunk [N H, NT, ...], fp32 but the states and qd, kr, w ----
  kda_op_t *qd, *kr, *w;  // [.., 16, K]
  float* u;              // [.., 16, V]: B2 writes each chunk's vcorr over it where vcorr == u (the binding's)
  float* Aqk;            // [.., 16, 16]
  float* el;             // [.., K]  exp(glast)
  float* Xkk;            // [.., 2, 16, 16]  X, then kk (KDA_BWD_KEEP_XKK; else nullptr)
  kda_state_t *states, *dstates;  // [.., K, V]: each chunk's entry state, and the gradient of its exit state
  float *vcorr, *dvcorr;    // [.., 16, V]
  // ---- outputs, fp32, or bf16 where the *_bf pointer is given (then the fp32 one is not written) ----
  float *dq, *dk, *dv, *dg;  // [B, T, H, *]; dg is the gradient of g (and, summed, of dt_bias)
  float* dbeta;              // [B, T, H]
  __nv_bfloat16 *dq_bf, *dk_bf, *dv_bf, *dg_bf, *dbeta_bf;  // the same in bf16 (the op's: as it returns them)
  float* ddt_part;           // [N H, NT, K]: each chunk's sum of dg over its tokens (zero where no chunk runs)
  float* dAlog_part;         // [B, T, H]  each token's share of dA_log
  float* dh0;                // [N, H, K, V] or nullptr
  long long* prof;           // [slots >= N H NT, KDA_MAX_REGIONS] clock64 cycles (the profile build), or nullptr
};

// The five per-token gradients' buffers: bf16 (grads_bf16) or fp32, the other set of pointers left null.
inline void kda_bwd_set_grads(KdaBwdParams& p, void* dq, void* dk, void* dv, void* dg, void* dbeta, bool grads_bf16) {
  if (grads_bf16) {
    p.dq_bf = static_cast<__nv_bfloat16*>(dq);
    p.dk_bf = static_cast<__nv_bfloat16*>(dk);
    p.dv_bf = static_cast<__nv_bfloat16*>(dv);
    p.dg_bf = static_cast<__nv_bfloat16*>(dg);
    p.dbeta_bf = static_cast<__nv_bfloat16*>(dbeta);
  } else {
    p.dq = static_cast<float*>(dq);
    p.dk = static_cast<float*>(dk);
    p.dv = static_cast<float*>(dv);
    p.dg = static_cast<float*>(dg);
    p.dbeta = static_cast<float*>(dbeta);
  }
}

// B1 prepare, B2 states, B3 reverse, B4 adjoint on `stream`; cudaErrorInvalidValue for sizes or a
// gate the backward does not support.
cudaError_t kda_bwd_launch(const KdaBwdParams& p, cudaStream_t stream);
