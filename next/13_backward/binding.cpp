// binding.cpp -- torch binding of stage 12 (stage 11's, with the softplus gate, the
// unbounded log decay and the pairwise products): checks every
// tensor, plans the path (kda_fwd_plan), allocates the per-chunk workspace on the
// input's device only for the split path (two segments of the longest sequence),
// launches on the current stream (the split path's K1 on a side stream joined before
// the call returns; the hybrid's runs of long sequences on side streams). No loop over
// sequences: one launch (or one K1 + K2 pair per segment) covers all of them.
//
// fwd(q, k, v, g, beta, A_log, dt_bias, h0?, scale, gate_id, lower_bound,
//     chunk_size, o, ht, prof?, fused=-1, ncw=0, segment_chunks=0,
//     cu_seqlens=None, max_seqlen=0, state_v_first=False, l2norm=True, beta_mode=1,
//     pairwise=-1, seq_lens=[], long_from=-1, u_halves=-1, deep_ring=-1)
// q, k, v, beta bf16 [B, T, H, *]; g bf16 (gate_id 0 or 1, the raw gate of the softplus
// or the bounded gate) or fp32 (gate_id 3, the log decay a itself, which the caller
// promises <= 0, and >= lower_bound unless lower_bound is 0: no bound);
// A_log, dt_bias, h0 fp32; o bf16 [B, T, H, V] and ht fp32
// [N, H, K, V] ([N, H, V, K] with state_v_first) preallocated by the caller and
// completely overwritten.
// cu_seqlens: int32 [N + 1] on q's device, the token offsets of N packed sequences
// (B = 1; sequence i is tokens cu[i] .. cu[i + 1] - 1); the binding cannot read them
// without a sync, so the caller validates them (0 first, non-decreasing, T last: stage.py
// does). max_seqlen: the longest sequence's length, or any bound in [1, T] of it (0: T);
// a bound below the longest length would drop chunks on the split path. Without
// cu_seqlens N = B and max_seqlen is ignored.
// l2norm: q, k L2-normalised here (true) or taken as they are; beta_mode: 0 beta as it
// is, 1 sigmoid(beta), 2 2 sigmoid(beta).
// lower_bound: in [-5, 0) with gate_id 1; ignored with gate_id 0; with gate_id 3 in [-5, 0)
// or 0 (no bound). pairwise (KdaProducts): -1 the gate's (a bounded gate factored, one
// without a bound pairwise in the chunks that decay by more than 80, factored elsewhere),
// 0 factored in every chunk (refused for a gate without a bound), 1 pairwise in every
// chunk, 2 as needed (any gate). u_halves: u = Af @ v with Af in two bf16 halves (1: u to
// fp32 accuracy) or rounded to bf16 once (0: stages 05-11's u, bitwise); -1 the gate's (a
// bounded gate once, so that it runs stage 11's instantiation; one without a bound in halves).
// Both pick the prepare's instantiation (kda.cu with_prep), never a flag inside a kernel.
// deep_ring: K2's ring on the split path at K = 64, -1 the rule (8 slots where every K2 block
// has an SM, else 4), 0 4 slots, 1 8 slots (K = 64 only); it picks K2's instantiation too.
// Supported: gate_id 0, 1 or 3, chunk_size 16, K = V in {64, 128}.
// bwd(...): the backward (kda_bwd below, common/extrun.py's signature).
// fused, ncw and segment_chunks pin the path (fused -1: the stage's rule, kda_fwd_plan; 0
// split, 1 fused, with ncw compute warps per block) and the split path's segment length (0:
// kSegmentChunks): the benchmark that chose the rule and the tests of both paths pass them.
// seq_lens: the N lengths of cu_seqlens as the host knows them (the caller's CPU copy), or
// empty (not known: no hybrid). long_from: the hybrid's threshold in tokens where the plan
// is fused and seq_lens are given (else there is no hybrid, whatever long_from says; -1:
// kda_hybrid_long_from's rule, unless a path is pinned; 0: no hybrid): each run
// of consecutive sequences at least that long (at most KDA_MAX_SKIP runs, else no hybrid)
// runs on the split path beside the fused kernel over the others.
#define KDA_WITH_TORCH
#include "kda_cuda_check.h"

#include <c10/cuda/CUDAException.h>  // C10_CUDA_CHECK
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // (ATen/cuda/CUDAContext.h would need the cuSPARSE headers)
#include <torch/extension.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "kda.h"
#include "kda_binding.h"  // check_tensor, check_shape, present, launches, KDA_STAGE
#include "kda_profile.cuh"  // KDA_MAX_REGIONS

namespace {

using kda_binding::check_shape;
using kda_binding::check_tensor;
using kda_binding::OptTensor;
using kda_binding::present;

constexpr int64_t kChunk = 16;  // BT of this stage
constexpr int64_t kVCols = 16;  // value columns per recurrence block, at the least
// The split path runs the sequence in segments of at most this many chunks (1024 tokens), its
// workspace two segments' worth (about 2.7 MB per head at K = V = 128) where the whole sequence's
// needs 1.3 KB per token and head. Each further segment costs one more K1 and K2 launch; K1 of
// the next segment runs beside K2 of this one.
constexpr int64_t kSegmentChunks = 64;

// The events that order the split path's two streams (timing off: they only order), made once
// per device and kept (no event is created while a CUDA graph is being captured). A wait takes
// the event's last record at the time of the wait, so calls one after the other may reuse them.
struct Events {
  cudaEvent_t fork{}, k1_done[2]{}, k2_done[2]{};
  cudaEvent_t run_k1[KDA_MAX_SKIP][2]{}, run_k2[KDA_MAX_SKIP][2]{}, run_done[KDA_MAX_SKIP]{};  // the hybrid's runs
};
const Events& events_of(int device) {
  static std::mutex mu;
  static std::map<int, Events> all;
  std::lock_guard<std::mutex> lock(mu);
  auto it = all.find(device);
  if (it == all.end()) {
    Events ev;
    for (cudaEvent_t* e : {&ev.fork, &ev.k1_done[0], &ev.k1_done[1], &ev.k2_done[0], &ev.k2_done[1]})
      C10_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    for (int r = 0; r < KDA_MAX_SKIP; ++r)
      for (cudaEvent_t* e : {&ev.run_k1[r][0], &ev.run_k1[r][1], &ev.run_k2[r][0], &ev.run_k2[r][1], &ev.run_done[r]})
        C10_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    it = all.emplace(device, ev).first;
  }
  return it->second;
}

// The kernels read rows of q, k, v, g, h0 and write o, ht in 4- to 16-byte vectors:
// an input whose data does not start on a 16-byte boundary (a view at an odd
// offset) is copied once; the outputs come from the caller and must be aligned.
torch::Tensor aligned(const torch::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
}
void check_aligned(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must start on a 16-byte boundary");
}

const __nv_bfloat16* bptr(const torch::Tensor& t) {
  return reinterpret_cast<const __nv_bfloat16*>(t.data_ptr<at::BFloat16>());
}
__nv_bfloat16* bptr_mut(torch::Tensor& t) { return reinterpret_cast<__nv_bfloat16*>(t.data_ptr<at::BFloat16>()); }

void kda_fwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
             torch::Tensor A_log, torch::Tensor dt_bias, OptTensor h0, double scale, int64_t gate_id,
             double lower_bound, int64_t chunk_size, torch::Tensor o, torch::Tensor ht, OptTensor prof,
             int64_t fused, int64_t ncw, int64_t segment_chunks, OptTensor cu_seqlens, int64_t max_seqlen,
             bool state_v_first, bool l2norm, int64_t beta_mode, int64_t pairwise,
             std::vector<int64_t> seq_lens, int64_t long_from, int64_t u_halves, int64_t deep_ring) {
  // ---- sizes and scalars ----
  TORCH_CHECK(q.defined() && q.dim() == 4, "q must be [B, T, H, K]");
  TORCH_CHECK(v.defined() && v.dim() == 4, "v must be [B, T, H, V]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3);
  TORCH_CHECK(B >= 1 && T >= 1 && H >= 1, "B, T, H must be >= 1, got q shape ", q.sizes());
  TORCH_CHECK(K == V, "stage " KDA_STAGE " needs K == V, got K = ", K, ", V = ", V);
  TORCH_CHECK(K == 64 || K == 128, "stage " KDA_STAGE " supports K = V in {64, 128}, got ", K);
  TORCH_CHECK(gate_id == KDA_GATE_SOFTPLUS || gate_id == KDA_GATE_BOUNDED || gate_id == KDA_GATE_LOG,
              "stage " KDA_STAGE " supports gate_id 0 (the softplus gate of a raw bf16 g), 1 (the bounded gate of a "
              "raw bf16 g) and 3 (g is the fp32 log decay), got gate_id ", gate_id);
  TORCH_CHECK(beta_mode >= 0 && beta_mode <= 2,
              "beta_mode must be 0 (beta as it is), 1 (sigmoid) or 2 (2 sigmoid), got ", beta_mode);
  const bool lb_in_range = std::isfinite(lower_bound) && lower_bound >= -5.0 && lower_bound < 0.0;
  TORCH_CHECK(gate_id == KDA_GATE_SOFTPLUS || lb_in_range || (gate_id == KDA_GATE_LOG && lower_bound == 0.0),
              gate_id == KDA_GATE_LOG ? "lower_bound must be in [-5, 0), or 0 (no bound), got "
                                      : "lower_bound must be in [-5, 0), got ", lower_bound);
  const bool bounded = gate_id != KDA_GATE_SOFTPLUS && lb_in_range;  // the factored products may run
  TORCH_CHECK(pairwise >= -1 && pairwise <= 2,
              "pairwise must be -1 (the gate's), 0 (factored), 1 (pairwise) or 2 (as needed), got ", pairwise);
  TORCH_CHECK(pairwise != 0 || bounded, "pairwise=0 (the factored products) needs a bounded gate (gate_id 1, or "
              "gate_id 3 with lower_bound in [-5, 0)): exp(-gc) overflows without a bound; got gate_id ", gate_id,
              ", lower_bound ", lower_bound);
  TORCH_CHECK(u_halves >= -1 && u_halves <= 1,
              "u_halves must be -1 (the gate's), 0 (Af rounded once) or 1 (Af in two halves), got ", u_halves);
  TORCH_CHECK(deep_ring >= -1 && deep_ring <= 1,
              "deep_ring must be -1 (the rule's), 0 (4 slots) or 1 (8 slots, K = 64), got ", deep_ring);
  TORCH_CHECK(deep_ring != 1 || K == 64, "deep_ring=1 (the 8-slot ring) is K = 64's, got K = ", K);
  TORCH_CHECK(chunk_size == kChunk, "stage " KDA_STAGE " supports only chunk_size 16, got ", chunk_size);
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  TORCH_CHECK(B * T <= INT_MAX - kChunk, "B * T too large: ", B * T);  // token indices (bos + t) are int
  // ---- the sequences: N of them, the longest max_len tokens ----
  const bool packed = present(cu_seqlens);
  int64_t N = B, max_len = T;
  if (packed) {
    TORCH_CHECK(cu_seqlens->defined() && cu_seqlens->dim() == 1 && cu_seqlens->size(0) >= 2,
                "cu_seqlens must be 1-D [N + 1] with N >= 1, got shape ", cu_seqlens->sizes());
    check_tensor(*cu_seqlens, "cu_seqlens", q, torch::kInt32);
    TORCH_CHECK(B == 1, "with cu_seqlens the sequences are packed into q's one batch row: B must be 1, got B = ", B);
    TORCH_CHECK(max_seqlen >= 0 && max_seqlen <= T, "max_seqlen must be in [0, T = ", T, "] (0: T), got ",
                max_seqlen);
    N = cu_seqlens->size(0) - 1;
    max_len = max_seqlen > 0 ? max_seqlen : T;
  }
  const int64_t NT = (max_len + kChunk - 1) / kChunk;  // chunks of the longest sequence
  // 1-D grids: N*H*NC <= N*H*NT blocks (K1) and up to N*H*V/16 blocks (K2, fused)
  TORCH_CHECK(N * H * NT <= INT_MAX, "N * H * ceil(max_seqlen / 16) too large: ", N * H * NT);
  TORCH_CHECK(N * H * (V / kVCols) <= INT_MAX, "N * H * V / 16 too large: ", N * H * (V / kVCols));

  // the pinned path must exist for these sizes (stage.py's path_error says so first)
  TORCH_CHECK(fused >= -1 && fused <= 1, "fused must be -1 (the rule), 0 (split) or 1 (fused), got ", fused);
  TORCH_CHECK(fused == -1 || ncw == 1 || ncw == 2 || ncw == 4 || ncw == 8,
              "ncw (compute warps per block) must be 1, 2, 4 or 8, got ", ncw);
  TORCH_CHECK(fused != 1 || ncw * kVCols <= V, "the pinned path has ", ncw,
              " compute warps of 16 value columns: it needs V >= ", ncw * kVCols, ", got V = ", V);
  TORCH_CHECK(fused != 0 || ncw <= 2, "the pinned split path has 1 or 2 compute warps, got ", ncw);
  TORCH_CHECK(segment_chunks >= 0 && segment_chunks <= INT_MAX, "segment_chunks must be >= 0 (0: the default of ",
              kSegmentChunks, "), got ", segment_chunks);
  TORCH_CHECK(long_from >= -1 && long_from <= INT_MAX, "long_from must be -1 (the rule), 0 (no hybrid) or a "
              "length in tokens, got ", long_from);
  int64_t host_max = 0;  // the longest of seq_lens
  if (!seq_lens.empty()) {
    TORCH_CHECK(packed && (int64_t)seq_lens.size() == N, "seq_lens must be empty or the N = ", N,
                " lengths of cu_seqlens, got ", seq_lens.size(), packed ? "" : " (no cu_seqlens)");
    int64_t total = 0;
    for (int64_t len : seq_lens) {
      TORCH_CHECK(len >= 0, "seq_lens must be >= 0, got ", len);
      total += len;
      host_max = std::max(host_max, len);
    }
    TORCH_CHECK(total == T, "seq_lens must add up to T = ", T, ", got ", total);
    TORCH_CHECK(host_max <= max_len, "seq_lens has a sequence of ", host_max, " tokens, longer than max_seqlen = ",
                max_len);
  }

  // ---- tensors ----
  check_tensor(q, "q", q, torch::kBFloat16);
  check_tensor(k, "k", q, torch::kBFloat16);
  check_tensor(v, "v", q, torch::kBFloat16);
  check_tensor(g, "g", q, gate_id == KDA_GATE_LOG ? torch::kFloat32 : torch::kBFloat16);
  check_tensor(beta, "beta", q, torch::kBFloat16);
  check_tensor(A_log, "A_log", q, torch::kFloat32);
  check_tensor(dt_bias, "dt_bias", q, torch::kFloat32);
  check_shape(k, "k", {B, T, H, K});
  check_shape(v, "v", {B, T, H, V});
  check_shape(g, "g", {B, T, H, K});
  check_shape(beta, "beta", {B, T, H});
  check_shape(A_log, "A_log", {H});
  check_shape(dt_bias, "dt_bias", {H, K});
  // the state: [N, H, K, V], or [N, H, V, K] with state_v_first (read and written in place)
  const std::vector<int64_t> state_shape =
      state_v_first ? std::vector<int64_t>{N, H, V, K} : std::vector<int64_t>{N, H, K, V};
  if (present(h0)) {
    check_tensor(*h0, "h0", q, torch::kFloat32);
    check_shape(*h0, state_v_first ? "h0 (state_v_first: [N, H, V, K])" : "h0 ([N, H, K, V])", state_shape);
  }
  check_tensor(o, "o", q, torch::kBFloat16);
  check_shape(o, "o", {B, T, H, V});
  check_tensor(ht, "ht", q, torch::kFloat32);
  check_shape(ht, state_v_first ? "ht (state_v_first: [N, H, V, K])" : "ht ([N, H, K, V])", state_shape);

  q = aligned(q);
  k = aligned(k);
  v = aligned(v);
  g = aligned(g);
  if (present(h0)) h0 = aligned(*h0);
  check_aligned(o, "o");
  check_aligned(ht, "ht");

  const c10::cuda::CUDAGuard device_guard(q.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  KdaFwdParams p{};
  p.B = (int)B;
  p.T = (int)T;
  p.H = (int)H;
  p.K = (int)K;
  p.V = (int)V;
  p.NT = (int)NT;
  p.cu_seqlens = packed ? cu_seqlens->data_ptr<int32_t>() : nullptr;
  p.N = (int)N;
  p.q = bptr(q);
  p.k = bptr(k);
  p.v = bptr(v);
  p.g = gate_id != KDA_GATE_LOG ? bptr(g) : nullptr;
  p.g_log = gate_id == KDA_GATE_LOG ? g.data_ptr<float>() : nullptr;
  p.beta = bptr(beta);
  p.A_log = A_log.data_ptr<float>();
  p.dt_bias = dt_bias.data_ptr<float>();
  p.h0 = present(h0) ? h0->data_ptr<float>() : nullptr;
  p.scale = (float)scale;
  p.lower_bound = (float)lower_bound;
  p.gate_id = (int)gate_id;
  p.products = pairwise == -1 ? (bounded ? KDA_PRODUCTS_FACTORED : KDA_PRODUCTS_AS_NEEDED) : (int)pairwise;
  p.u_halves = u_halves == -1 ? (bounded ? 0 : 1) : (int)u_halves;
  p.deep_ring = (int)deep_ring;
  p.l2norm = l2norm ? 1 : 0;
  p.beta_mode = (int)beta_mode;
  p.state_v_first = state_v_first ? 1 : 0;
  KdaPlan plan{};
  kda_check(kda_fwd_plan(p, (int)fused, (int)ncw, &plan), "kda forward plan");

  // ---- the hybrid's runs of long sequences [lo, hi), each with its longest length ----
  struct Run {
    int64_t lo, hi, max_len;
  };
  std::vector<Run> runs;
  const int64_t from = long_from >= 0 ? long_from
                       : fused == -1 && !seq_lens.empty() ? kda_hybrid_long_from(p, plan, T, (int)host_max)
                                                          : 0;
  if (plan.fused && from > 0 && !seq_lens.empty()) {
    for (int64_t i = 0; i < N; ++i) {
      if (seq_lens[i] < from) continue;
      if (!runs.empty() && runs.back().hi == i) {
        runs.back().hi = i + 1;
        runs.back().max_len = std::max(runs.back().max_len, seq_lens[i]);
      } else {
        runs.push_back(Run{i, i + 1, seq_lens[i]});
      }
    }
    if ((int64_t)runs.size() > KDA_MAX_SKIP) runs.clear();  // too scattered: the fused kernel over all
  }

  // ---- workspace of the split path: one slot per chunk of a segment of the longest sequence (at
  //      most kSegmentChunks chunks) and (sequence, head), written by K1, read by K2 (see kda.h), in
  //      two buffers when there are several segments (K1 of segment i + 1 fills one while K2 of
  //      segment i reads the other); the fused path needs none ----
  //      (the hybrid: two buffers for each run of long sequences, sized for the largest)
  const int64_t seg_chunks = segment_chunks > 0 ? segment_chunks : kSegmentChunks;
  const int64_t NC = plan.fused ? NT : std::min<int64_t>(NT, seg_chunks);
  const int64_t n_seg = (NT + NC - 1) / NC;
  int64_t n_buf = plan.fused ? 0 : std::min<int64_t>(n_seg, 2), ws_pairs = N * H, ws_chunks = NC;
  if (!runs.empty()) {
    ws_pairs = ws_chunks = 0;
    for (const Run& r : runs) {
      ws_pairs = std::max(ws_pairs, (r.hi - r.lo) * H);
      ws_chunks = std::max(ws_chunks, std::min((r.max_len + kChunk - 1) / kChunk, seg_chunks));
    }
    n_buf = 2 * (int64_t)runs.size();  // run r's buffers are 2r and 2r + 1
  }
  torch::Tensor ws_qd, ws_w, ws_krT, ws_Aqk, ws_u, ws_el;
  if (n_buf > 0) {
    const int64_t BH = ws_pairs, NC = ws_chunks;  // (sequence, head) pairs and chunks of a segment
    const auto bf = q.options().dtype(torch::kBFloat16);
    const auto f32 = q.options().dtype(torch::kFloat32);
    ws_qd = torch::empty({n_buf, BH, NC, kChunk, K}, bf);
    ws_w = torch::empty({n_buf, BH, NC, kChunk, K}, bf);
    ws_krT = torch::empty({n_buf, BH, NC, K, kChunk}, bf);
    ws_Aqk = torch::empty({n_buf, BH, NC, kChunk, kChunk}, bf);
    ws_u = torch::empty({n_buf, BH, NC, kChunk, V}, f32);
    ws_el = torch::empty({n_buf, BH, NC, K}, f32);
  }
  // the workspace pointers of buffer i
  auto use_buffer = [&](int64_t i, KdaFwdParams& to) {
    torch::Tensor qd = ws_qd[i], w = ws_w[i], krT = ws_krT[i], Aqk = ws_Aqk[i];
    to.qd = bptr_mut(qd);
    to.w = bptr_mut(w);
    to.krT = bptr_mut(krT);
    to.Aqk = bptr_mut(Aqk);
    to.u = ws_u[i].data_ptr<float>();
    to.el = ws_el[i].data_ptr<float>();
  };
  p.o = bptr_mut(o);
  p.ht = ht.data_ptr<float>();
  p.prof = nullptr;
#ifdef KDA_PROFILE
  // int64 [slots, KDA_MAX_REGIONS]; K1 records one slot per chunk of the longest sequence and
  // (sequence, head) (N*H*NT), K2 and the fused kernel one per (sequence, head, column slice) (at
  // most N*H*V/16 blocks)
  if (present(prof)) {
    check_tensor(*prof, "prof", q, torch::kInt64);
    const int64_t need = std::max(N * H * NT, N * H * (V / kVCols));
    TORCH_CHECK(prof->dim() == 2 && prof->size(1) == KDA_MAX_REGIONS && prof->size(0) >= need,
                "prof must be int64 [slots >= ", need, ", ", KDA_MAX_REGIONS, "], got ", prof->sizes());
    p.prof = reinterpret_cast<long long*>(prof->data_ptr<int64_t>());
  }
#else
  (void)prof;
#endif
  kda_launch_log().clear();
  if (plan.fused && runs.empty()) {  // one launch over every sequence, each block its own sequence's chunks
    p.n0 = 0;
    p.NC = (int)NT;
    kda_check(kda_fwd_launch(p, plan, stream), "kda forward");
    return;
  }
  if (plan.fused) {
    // The hybrid. Each run of long sequences, a view of cu_seqlens and of the states, on the split
    // path segment by segment, on a stream pair of its own so that the runs' chains overlap: K1 on
    // s1, K2 on s2, K1 one segment ahead (as below), at high priority (their chains set the call's
    // time); the fused kernel over the other sequences on the caller's stream beside them, which
    // then waits for every run's last K2.
    const int dev = q.device().index();
    const Events& ev = events_of(dev);
    C10_CUDA_CHECK(cudaEventRecord(ev.fork, stream));
    const int64_t state_elems = H * K * V;
    for (size_t ri = 0; ri < runs.size(); ++ri) {
      const Run& r = runs[ri];
      const c10::cuda::CUDAStream s1 = c10::cuda::getStreamFromPool(true, dev);
      const c10::cuda::CUDAStream s2 = c10::cuda::getStreamFromPool(true, dev);
      TORCH_CHECK(s1 != s2, "the hybrid needs two side streams per run, the pool gave one");
      C10_CUDA_CHECK(cudaStreamWaitEvent(s1.stream(), ev.fork, 0));
      C10_CUDA_CHECK(cudaStreamWaitEvent(s2.stream(), ev.fork, 0));
      KdaFwdParams pr = p;
      pr.cu_seqlens = p.cu_seqlens + r.lo;
      pr.N = (int)(r.hi - r.lo);
      pr.NT = (int)((r.max_len + kChunk - 1) / kChunk);
      pr.ht = p.ht + r.lo * state_elems;
      const float* h0_run = p.h0 == nullptr ? nullptr : p.h0 + r.lo * state_elems;
      KdaPlan split{};
      kda_check(kda_fwd_plan(pr, 0, 0, &split), "kda forward plan (hybrid)");  // the split path at the rule's width
      const int64_t nc = std::min<int64_t>(pr.NT, seg_chunks);
      for (int64_t seg = 0, n0 = 0; n0 < pr.NT; n0 += nc, ++seg) {
        const int64_t buf = seg % 2;
        use_buffer(2 * (int64_t)ri + buf, pr);
        pr.n0 = (int)n0;
        pr.NC = (int)std::min<int64_t>(nc, pr.NT - n0);
        pr.h0 = n0 == 0 ? h0_run : pr.ht;
        if (seg >= 2) C10_CUDA_CHECK(cudaStreamWaitEvent(s1.stream(), ev.run_k2[ri][buf], 0));
        kda_check(kda_fwd_launch(pr, split, s1.stream(), KDA_LAUNCH_K1), "kda forward (hybrid K1)");
        C10_CUDA_CHECK(cudaEventRecord(ev.run_k1[ri][buf], s1.stream()));
        C10_CUDA_CHECK(cudaStreamWaitEvent(s2.stream(), ev.run_k1[ri][buf], 0));
        kda_check(kda_fwd_launch(pr, split, s2.stream(), KDA_LAUNCH_K2), "kda forward (hybrid K2)");
        C10_CUDA_CHECK(cudaEventRecord(ev.run_k2[ri][buf], s2.stream()));
      }
      C10_CUDA_CHECK(cudaEventRecord(ev.run_done[ri], s2.stream()));  // its last K2 follows every K1 of s1
    }
    p.n0 = 0;
    p.NC = (int)NT;
    p.n_skip = (int)runs.size();
    for (size_t i = 0; i < runs.size(); ++i) {
      p.skip_lo[i] = (int)runs[i].lo;
      p.skip_hi[i] = (int)runs[i].hi;
    }
    kda_check(kda_fwd_launch(p, plan, stream), "kda forward (hybrid, fused)");
    for (size_t ri = 0; ri < runs.size(); ++ri) C10_CUDA_CHECK(cudaStreamWaitEvent(stream, ev.run_done[ri], 0));
    return;
  }
  // The split path segment by segment: K1 and K2 over chunks n0 .. n0 + NC - 1 of every sequence
  // (those a sequence has), each K2 block starting from the state the previous segment left in ht
  // (its own columns: it reads them before it writes them; a sequence that has ended leaves them). With several segments K1 runs on a side stream, one segment ahead:
  // K1 of segment i + 1 beside K2 of segment i, on the SMs K2's few blocks leave idle.
  //   side: K1(i) into buffer i % 2, after K2(i - 2) has read that buffer
  //   main: K2(i) after K1(i); main waits for side's last K1, so nothing outlives the call
  const float* h0_user = p.h0;
  if (n_seg == 1) {
    use_buffer(0, p);
    p.n0 = 0;
    p.NC = (int)NT;
    kda_check(kda_fwd_launch(p, plan, stream), "kda forward");
    return;
  }
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, q.device().index());
  const Events& ev = events_of(q.device().index());  // fork, k1_done[2], k2_done[2]
  C10_CUDA_CHECK(cudaEventRecord(ev.fork, stream));
  C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), ev.fork, 0));
  for (int64_t i = 0; i < n_seg; ++i) {
    const int64_t buf = i % 2;
    use_buffer(buf, p);
    p.n0 = (int)(i * NC);
    p.NC = (int)std::min<int64_t>(NC, NT - i * NC);
    p.h0 = i == 0 ? h0_user : p.ht;
    if (i >= 2) C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), ev.k2_done[buf], 0));
    kda_check(kda_fwd_launch(p, plan, side.stream(), KDA_LAUNCH_K1), "kda forward (K1)");
    C10_CUDA_CHECK(cudaEventRecord(ev.k1_done[buf], side.stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream, ev.k1_done[buf], 0));
    kda_check(kda_fwd_launch(p, plan, stream, KDA_LAUNCH_K2), "kda forward (K2)");
    C10_CUDA_CHECK(cudaEventRecord(ev.k2_done[buf], stream));
  }
}

// The backward (kda.h KdaBwdParams, backward.cuh): the forward's sequences (batch rows, or packed by
// cu_seqlens with B = 1: the caller validated them, as for fwd) and the state [N, H, K, V], or
// [N, H, V, K] with state_v_first (turned around here, on the way in and out). Recomputes what it
// needs from the inputs (no forward tensors are kept); every gradient is fp32 in its input's shape,
// written completely; dA_log and ddt_bias are sums over batch and time taken here by torch
// (deterministic: no atomics). Returns the kernels' workspace (bwd_workspace); u is then vcorr's buffer, overwritten
// by B2, but with keep_u.
std::vector<torch::Tensor> bwd_impl(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                                    torch::Tensor beta, torch::Tensor A_log, torch::Tensor dt_bias, OptTensor h0,
                                    double scale, int64_t gate_id, double lower_bound, int64_t chunk_size,
                                    torch::Tensor dout, OptTensor dht, torch::Tensor dq, torch::Tensor dk,
                                    torch::Tensor dv, torch::Tensor dg, torch::Tensor dbeta, torch::Tensor dA_log,
                                    torch::Tensor ddt_bias, OptTensor dh0, OptTensor cu_seqlens, int64_t max_seqlen,
                                    bool state_v_first, OptTensor prof = c10::nullopt, bool keep_u = false) {
  TORCH_CHECK(q.defined() && q.dim() == 4, "q must be [B, T, H, K]");
  TORCH_CHECK(v.defined() && v.dim() == 4, "v must be [B, T, H, V]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3);
  TORCH_CHECK(B >= 1 && T >= 1 && H >= 1, "B, T, H must be >= 1, got q shape ", q.sizes());
  TORCH_CHECK(K == V && (K == 64 || K == 128), "the backward of stage " KDA_STAGE " needs K = V in {64, 128}, got K = ",
              K, ", V = ", V);
  TORCH_CHECK(gate_id == KDA_GATE_SOFTPLUS || gate_id == KDA_GATE_BOUNDED,
              "the backward of stage " KDA_STAGE " takes gate_id 0 (softplus) or 1 (bounded), got ", gate_id);
  TORCH_CHECK(gate_id == KDA_GATE_SOFTPLUS || (std::isfinite(lower_bound) && lower_bound >= -5.0 && lower_bound < 0.0),
              "lower_bound must be in [-5, 0), got ", lower_bound);
  TORCH_CHECK(chunk_size == kChunk, "stage " KDA_STAGE " supports only chunk_size 16, got ", chunk_size);
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  TORCH_CHECK(B * T <= INT_MAX - kChunk, "B * T too large: ", B * T);
  const bool packed = present(cu_seqlens);
  int64_t N = B, max_len = T;
  if (packed) {
    TORCH_CHECK(cu_seqlens->defined() && cu_seqlens->dim() == 1 && cu_seqlens->size(0) >= 2,
                "cu_seqlens must be 1-D [N + 1] with N >= 1, got shape ", cu_seqlens->sizes());
    check_tensor(*cu_seqlens, "cu_seqlens", q, torch::kInt32);
    TORCH_CHECK(B == 1, "with cu_seqlens the sequences are packed into q's one batch row: B must be 1, got B = ", B);
    TORCH_CHECK(max_seqlen >= 0 && max_seqlen <= T, "max_seqlen must be in [0, T = ", T, "] (0: T), got ", max_seqlen);
    N = cu_seqlens->size(0) - 1;
    max_len = max_seqlen > 0 ? max_seqlen : T;
  }
  const int64_t NT = (max_len + kChunk - 1) / kChunk;
  TORCH_CHECK(N * H * NT <= INT_MAX, "N * H * ceil(max_seqlen / 16) too large: ", N * H * NT);
  const auto f32 = torch::kFloat32;
  check_tensor(q, "q", q, torch::kBFloat16);
  check_tensor(k, "k", q, torch::kBFloat16);
  check_tensor(v, "v", q, torch::kBFloat16);
  check_tensor(g, "g", q, torch::kBFloat16);
  check_tensor(beta, "beta", q, torch::kBFloat16);
  check_tensor(A_log, "A_log", q, f32);
  check_tensor(dt_bias, "dt_bias", q, f32);
  check_shape(k, "k", {B, T, H, K});
  check_shape(v, "v", {B, T, H, V});
  check_shape(g, "g", {B, T, H, K});
  check_shape(beta, "beta", {B, T, H});
  check_shape(A_log, "A_log", {H});
  check_shape(dt_bias, "dt_bias", {H, K});
  // the states in the caller's layout; the kernels take them K-first
  const std::vector<int64_t> state_shape =
      state_v_first ? std::vector<int64_t>{N, H, V, K} : std::vector<int64_t>{N, H, K, V};
  auto k_first = [&](const torch::Tensor& t) { return state_v_first ? t.transpose(-1, -2).contiguous() : t; };
  if (present(h0)) {
    check_tensor(*h0, "h0", q, f32);
    check_shape(*h0, "h0", state_shape);
  }
  TORCH_CHECK(dout.defined() && (dout.scalar_type() == f32 || dout.scalar_type() == torch::kBFloat16),
              "do must be float32 or bfloat16 (o's dtype), got ", dout.defined() ? dout.scalar_type() : f32);
  check_tensor(dout, "do", q, dout.scalar_type());
  check_shape(dout, "do", {B, T, H, V});
#ifdef KDA_BWD_FP32_CHAINS
  if (dout.scalar_type() == torch::kBFloat16) dout = dout.to(f32);  // the CUDA-core chains read do in fp32
#endif
  if (present(dht)) {
    check_tensor(*dht, "dht", q, f32);
    check_shape(*dht, "dht", state_shape);
  }
  // the five per-token gradients all fp32 or all bf16 (the op's: the dtype it returns them in)
  const auto gdt = dq.defined() ? dq.scalar_type() : f32;
  TORCH_CHECK(gdt == f32 || gdt == torch::kBFloat16, "dq, dk, dv, dg, dbeta must be float32 or bfloat16, got ", gdt);
  const bool grads_bf16 = gdt == torch::kBFloat16;
  check_tensor(dq, "dq", q, gdt);
  check_shape(dq, "dq", {B, T, H, K});
  check_tensor(dk, "dk", q, gdt);
  check_shape(dk, "dk", {B, T, H, K});
  check_tensor(dv, "dv", q, gdt);
  check_shape(dv, "dv", {B, T, H, V});
  check_tensor(dg, "dg", q, gdt);
  check_shape(dg, "dg", {B, T, H, K});
  check_tensor(dbeta, "dbeta", q, gdt);
  check_shape(dbeta, "dbeta", {B, T, H});
  check_tensor(dA_log, "dA_log", q, f32);
  check_shape(dA_log, "dA_log", {H});
  check_tensor(ddt_bias, "ddt_bias", q, f32);
  check_shape(ddt_bias, "ddt_bias", {H, K});
  TORCH_CHECK(present(dh0) == present(h0), "dh0 is given exactly when h0 is");
  if (present(dh0)) {
    check_tensor(*dh0, "dh0", q, f32);
    check_shape(*dh0, "dh0", state_shape);
  }

  const c10::cuda::CUDAGuard device_guard(q.device());
  // B1 and B4 read rows of q, k, v, g and do 16 bytes a load
  q = aligned(q);
  k = aligned(k);
  v = aligned(v);
  g = aligned(g);
  dout = aligned(dout);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto opts = q.options().dtype(f32);
  const int64_t slots = N * H * NT;
#ifdef KDA_BWD_OPS_FP32
  const auto op_opts = opts;
#else
  const auto op_opts = q.options().dtype(torch::kBFloat16);
#endif
  torch::Tensor qd = torch::empty({slots, kChunk, K}, op_opts), kr = torch::empty({slots, kChunk, K}, op_opts);
  torch::Tensor w = torch::empty({slots, kChunk, K}, op_opts), u = torch::empty({slots, kChunk, V}, opts);
  torch::Tensor Aqk = torch::empty({slots, kChunk, kChunk}, opts), el = torch::empty({slots, K}, opts);
#ifdef KDA_BWD_KEEP_XKK
  torch::Tensor Xkk = torch::empty({slots, 2, kChunk, kChunk}, opts);  // B1's X and kk, for B4
#else
  torch::Tensor Xkk = torch::empty({0}, opts);
#endif
#ifdef KDA_BWD_STATES_FP32
  const auto state_opts = opts;
#else
  const auto state_opts = q.options().dtype(torch::kBFloat16);
#endif
  torch::Tensor states = torch::empty({slots, K, V}, state_opts), dstates = torch::empty({slots, K, V}, state_opts);
  // B2 writes each chunk's vcorr = u - w S over its u (the tile it has read; nothing reads u after): one buffer for
  // the two, but where the checks of each kernel ask for u (keep_u, bwd_workspace)
  torch::Tensor vcorr = keep_u ? torch::empty({slots, kChunk, V}, opts) : u;
  torch::Tensor dvcorr = torch::empty({slots, kChunk, V}, opts);
  torch::Tensor dAlog_part = torch::empty({B, T, H}, opts);
  torch::Tensor ddt_part = torch::zeros({slots, K}, opts);  // chunks that do not run stay 0
  torch::Tensor h0_k, dht_k, dh0_k;  // the states K-first
  if (present(h0)) h0_k = k_first(*h0);
  if (present(dht)) dht_k = k_first(*dht);
  if (present(dh0)) dh0_k = state_v_first ? torch::empty({N, H, K, V}, opts) : *dh0;

  KdaBwdParams p{};
  p.B = (int)B;
  p.T = (int)T;
  p.H = (int)H;
  p.D = (int)K;
  p.N = (int)N;
  p.cu_seqlens = packed ? cu_seqlens->data_ptr<int32_t>() : nullptr;
  p.NT = (int)NT;
  p.q = bptr(q);
  p.k = bptr(k);
  p.v = bptr(v);
  p.g = bptr(g);
  p.beta = bptr(beta);
  p.A_log = A_log.data_ptr<float>();
  p.dt_bias = dt_bias.data_ptr<float>();
  p.h0 = present(h0) ? h0_k.data_ptr<float>() : nullptr;
  p.scale = (float)scale;
  p.lower_bound = (float)lower_bound;
  p.gate_id = (int)gate_id;
  p.dout = dout.scalar_type() == f32 ? dout.data_ptr<float>() : nullptr;
  p.dout_bf = dout.scalar_type() == f32 ? nullptr : bptr(dout);
  p.dht = present(dht) ? dht_k.data_ptr<float>() : nullptr;
  p.qd = reinterpret_cast<kda_op_t*>(qd.data_ptr());
  p.kr = reinterpret_cast<kda_op_t*>(kr.data_ptr());
  p.w = reinterpret_cast<kda_op_t*>(w.data_ptr());
  p.u = u.data_ptr<float>();
  p.Aqk = Aqk.data_ptr<float>();
  p.el = el.data_ptr<float>();
  p.Xkk = Xkk.numel() > 0 ? Xkk.data_ptr<float>() : nullptr;
  p.states = reinterpret_cast<kda_state_t*>(states.data_ptr());
  p.dstates = reinterpret_cast<kda_state_t*>(dstates.data_ptr());
  p.vcorr = vcorr.data_ptr<float>();
  p.dvcorr = dvcorr.data_ptr<float>();
  kda_bwd_set_grads(p, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dg.data_ptr(), dbeta.data_ptr(), grads_bf16);
  p.ddt_part = ddt_part.data_ptr<float>();
  p.dAlog_part = dAlog_part.data_ptr<float>();
  p.dh0 = present(dh0) ? dh0_k.data_ptr<float>() : nullptr;
  p.prof = nullptr;
#ifdef KDA_PROFILE
  if (present(prof)) {  // the backward's regions (kda.h KDA_REG_B*), one slot per chunk
    check_tensor(*prof, "prof", q, torch::kInt64);
    TORCH_CHECK(prof->dim() == 2 && prof->size(1) == KDA_MAX_REGIONS && prof->size(0) >= slots,
                "prof must be int64 [slots >= ", slots, ", ", KDA_MAX_REGIONS, "], got ", prof->sizes());
    p.prof = reinterpret_cast<long long*>(prof->data_ptr<int64_t>());
  }
#else
  (void)prof;
#endif
  kda_launch_log().clear();
  kda_check(kda_bwd_launch(p, stream), "kda backward");
  if (present(dh0) && state_v_first) dh0->copy_(dh0_k.transpose(-1, -2));
  // the parameters' gradients: sums over batch and time (dg is also d/d(g + dt_bias)), in fp32 whatever dg's dtype:
  // each chunk's sum of its tokens' dg (B4), then over sequences and chunks
  ddt_bias.copy_(ddt_part.view({N, H, NT, K}).sum(at::IntArrayRef{0, 2}));
  dA_log.copy_(dAlog_part.sum(at::IntArrayRef{0, 1}));
  return {qd, kr, w, u, Aqk, el, states, dstates, vcorr, dvcorr, dAlog_part};
}

// bwd(...): common/extrun.py's signature, and for a varlen call the forward's cu_seqlens, max_seqlen,
// seq_lens (ignored: the backward has no hybrid) and state_v_first by name.
void kda_bwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
             torch::Tensor A_log, torch::Tensor dt_bias, OptTensor h0, double scale, int64_t gate_id,
             double lower_bound, int64_t chunk_size, torch::Tensor dout, OptTensor dht, torch::Tensor dq,
             torch::Tensor dk, torch::Tensor dv, torch::Tensor dg, torch::Tensor dbeta, torch::Tensor dA_log,
             torch::Tensor ddt_bias, OptTensor dh0, OptTensor prof, OptTensor cu_seqlens, int64_t max_seqlen,
             std::vector<int64_t> seq_lens, bool state_v_first) {
  (void)seq_lens;
  bwd_impl(q, k, v, g, beta, A_log, dt_bias, h0, scale, gate_id, lower_bound, chunk_size, dout, dht, dq, dk, dv,
           dg, dbeta, dA_log, ddt_bias, dh0, cu_seqlens, max_seqlen, state_v_first, prof);
}

// The backward's workspace after a call, for the checks of each kernel against
// common/backward_model.py: qd, kr, w [N H NT, 16, K], u [.., 16, V] (kept apart from vcorr), Aqk [.., 16, 16], el [.., K],
// states, dstates [.., K, V], vcorr, dvcorr [.., 16, V], dAlog_part [B, T, H] (plain sequences).
std::vector<torch::Tensor> kda_bwd_workspace(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                                             torch::Tensor beta, torch::Tensor A_log, torch::Tensor dt_bias,
                                             OptTensor h0, double scale, int64_t gate_id, double lower_bound,
                                             torch::Tensor dout, OptTensor dht) {
  const auto f = q.options().dtype(torch::kFloat32);
  torch::Tensor dq = torch::empty(q.sizes(), f), dk = torch::empty(k.sizes(), f), dv = torch::empty(v.sizes(), f);
  torch::Tensor dg = torch::empty(g.sizes(), f), dbeta = torch::empty(beta.sizes(), f);
  torch::Tensor dA_log = torch::empty(A_log.sizes(), f), ddt_bias = torch::empty(dt_bias.sizes(), f);
  OptTensor dh0;
  if (present(h0)) dh0 = torch::empty(h0->sizes(), f);
  return bwd_impl(q, k, v, g, beta, A_log, dt_bias, h0, scale, gate_id, lower_bound, kChunk, dout, dht, dq, dk, dv,
                  dg, dbeta, dA_log, ddt_bias, dh0, c10::nullopt, 0, false, c10::nullopt, /*keep_u=*/true);
}

// out = A @ bf16(X) through the accumulator -> B-fragment transpose (kda.h).
torch::Tensor kda_frag_check(torch::Tensor A, torch::Tensor X) {
  TORCH_CHECK(A.defined() && A.dim() == 2 && A.size(0) == 16, "A must be [16, kd], got ", A.sizes());
  const int64_t kd = A.size(1);
  TORCH_CHECK(kd == 16 || kd == 64 || kd == 128, "kd must be 16, 64 or 128, got ", kd);
  check_tensor(A, "A", A, torch::kBFloat16);
  check_tensor(X, "X", A, torch::kFloat32);
  check_shape(X, "X", {kd, 16});
  const c10::cuda::CUDAGuard device_guard(A.device());
  torch::Tensor out = torch::full({16, 16}, std::nanf(""), X.options());
  kda_check(kda_frag_check_launch(bptr(A), X.data_ptr<float>(), out.data_ptr<float>(), (int)kd,
                                  c10::cuda::getCurrentCUDAStream()),
            "fragment check (stage " KDA_STAGE ")");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("launches", &kda_binding::launches,
        "grid, block and dynamic shared memory of each kernel the last call launched");
  m.def("fwd", &kda_fwd, "KDA chunked forward of stage " KDA_STAGE,
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("A_log"),
        py::arg("dt_bias"), py::arg("h0"), py::arg("scale"), py::arg("gate_id"), py::arg("lower_bound"),
        py::arg("chunk_size"), py::arg("o"), py::arg("ht"), py::arg("prof"), py::arg("fused") = -1,
        py::arg("ncw") = 0, py::arg("segment_chunks") = 0, py::arg("cu_seqlens") = py::none(),
        py::arg("max_seqlen") = 0, py::arg("state_v_first") = false, py::arg("l2norm") = true,
        py::arg("beta_mode") = 1, py::arg("pairwise") = -1, py::arg("seq_lens") = std::vector<int64_t>{},
        py::arg("long_from") = -1, py::arg("u_halves") = -1, py::arg("deep_ring") = -1);
  m.def("bwd", &kda_bwd, "KDA chunked backward of stage " KDA_STAGE, py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("A_log"), py::arg("dt_bias"), py::arg("h0"),
        py::arg("scale"), py::arg("gate_id"), py::arg("lower_bound"), py::arg("chunk_size"), py::arg("do"),
        py::arg("dht"), py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("dg"), py::arg("dbeta"),
        py::arg("dA_log"), py::arg("ddt_bias"), py::arg("dh0"), py::arg("prof"), py::arg("cu_seqlens") = py::none(),
        py::arg("max_seqlen") = 0, py::arg("seq_lens") = std::vector<int64_t>{}, py::arg("state_v_first") = false);
  m.def("bwd_workspace", &kda_bwd_workspace, "the backward's workspace after a call (tests)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("A_log"), py::arg("dt_bias"),
        py::arg("h0"), py::arg("scale"), py::arg("gate_id"), py::arg("lower_bound"), py::arg("do"), py::arg("dht"));
  m.def("frag_check", &kda_frag_check, "A @ bf16(X) with X turned from an MMA accumulator into a B fragment by movmatrix",
        py::arg("A"), py::arg("X"));
}
