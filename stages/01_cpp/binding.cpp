// binding.cpp -- the torch side of stage 01: checks, workspaces, phases, outputs.
//
// Each phase of kda.h runs over all (batch, head) pairs with at::parallel_for
// (pairs are independent: each writes only its own rows of the outputs and its
// own workspace, so there are no races and the result does not depend on the
// thread count). Phases run one after the other, so the profile build
// (-DKDA_PROFILE) can time each with a wall clock. The only sums over batch
// (dA_log, ddt_bias) are done at the end with torch reductions.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <chrono>
#include <cmath>
#include <optional>

#include "kda.h"

namespace {

// Profile region ids: indices into SPEC.regions in stage.py (keep them in sync).
enum Region : int {
  kFwdPrestage = 0,           // "fwd: pre-stage"
  kFwdWY = 1,                 // "fwd: WY transform"
  kFwdAqk = 2,                // "fwd: Aqk"
  kFwdRecurrence = 3,         // "fwd: recurrence"
  kBwdRecompute = 4,          // "bwd: recompute"        (the four forward phases again)
  kBwdReverseRecurrence = 5,  // "bwd: reverse recurrence"
  kBwdChunkAdjoint = 6,       // "bwd: WY adjoint"       (chunk_adjoint: WY, inverse, Aqk, gate cumsum)
  kBwdPrestageAdjoint = 7,    // "bwd: pre-stage adjoint" (plus the dA_log / ddt_bias sums)
};

using Tensor = torch::Tensor;
using OptTensor = std::optional<Tensor>;

void check_tensor(const Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
}

// Validates the inputs shared by fwd and bwd and returns the sizes.
kda::Params check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                         const Tensor& beta, const Tensor& A_log, const Tensor& dt_bias,
                         const OptTensor& h0, double scale, int64_t gate_id, double lower_bound,
                         int64_t chunk_size, int64_t* B, int64_t* H) {
  TORCH_CHECK(q.dim() == 4, "q must be [B, T, H, K], got ", q.sizes());
  TORCH_CHECK(v.dim() == 4, "v must be [B, T, H, V], got ", v.sizes());
  const int64_t b = q.size(0), T = q.size(1), h = q.size(2), K = q.size(3), V = v.size(3);
  TORCH_CHECK(b >= 1 && T >= 1 && h >= 1, "B, T, H must be >= 1, got q ", q.sizes());
  TORCH_CHECK(K >= 1 && K <= kda::kMaxHeadDim, "K must be in [1, ", kda::kMaxHeadDim, "], got ", K);
  TORCH_CHECK(V >= 1 && V <= kda::kMaxHeadDim, "V must be in [1, ", kda::kMaxHeadDim, "], got ", V);
  TORCH_CHECK(T <= (int64_t)1 << 30, "T too large: ", T);
  check_tensor(q, "q", {b, T, h, K});
  check_tensor(k, "k", {b, T, h, K});
  check_tensor(v, "v", {b, T, h, V});
  check_tensor(g, "g", {b, T, h, K});
  check_tensor(beta, "beta", {b, T, h});
  check_tensor(A_log, "A_log", {h});
  check_tensor(dt_bias, "dt_bias", {h, K});
  if (h0) check_tensor(*h0, "h0", {b, h, K, V});
  TORCH_CHECK(chunk_size == 16 || chunk_size == 32 || chunk_size == 64,
              "chunk_size must be 16, 32 or 64, got ", chunk_size);
  TORCH_CHECK(gate_id == kda::kGateSoftplus || gate_id == kda::kGateBounded,
              "gate_id must be 0 (softplus) or 1 (bounded), got ", gate_id);
  if (gate_id == kda::kGateBounded)
    TORCH_CHECK(lower_bound >= -5.0 && lower_bound < 0.0, "lower_bound must be in [-5, 0), got ",
                lower_bound);
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);

  kda::Params p;
  p.T = (int)T;
  p.K = (int)K;
  p.V = (int)V;
  p.BT = (int)chunk_size;
  p.NT = (int)((T + chunk_size - 1) / chunk_size);
  p.scale = (float)scale;
  p.gate = (int)gate_id;
  p.lower_bound = (float)lower_bound;
  *B = b;
  *H = h;
  return p;
}

// Workspace bytes per (batch, head), rounded up so every block starts 64-byte aligned.
int64_t round64(std::size_t bytes) { return (int64_t)((bytes + 63) / 64 * 64); }

// The profile buffer: float64 [1, 16] seconds per region (profile build only).
double* prof_slots(const OptTensor& prof) {
  if (!prof) return nullptr;
  TORCH_CHECK(prof->device().is_cpu() && prof->scalar_type() == at::kDouble && prof->is_contiguous() &&
                  prof->numel() >= 16,
              "prof must be a contiguous float64 CPU tensor of at least 16 elements");
  return prof->data_ptr<double>();
}

// Runs body(bh) for every (batch, head) pair bh in [0, BH) in parallel; in the
// profile build adds the phase's wall time to prof[region].
template <class Body>
void run_phase(int64_t BH, double* prof, int region, const Body& body) {
#ifdef KDA_PROFILE
  const auto t0 = std::chrono::steady_clock::now();
#endif
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) body(bh);
  });
#ifdef KDA_PROFILE
  if (prof) prof[region] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#else
  (void)prof;
  (void)region;
#endif
}

// Pointers of one (batch, head) into the [B, T, H, *] inputs.
kda::HeadInputs head_inputs(const kda::Params& p, int64_t H, int64_t bh, const Tensor& q, const Tensor& k,
                            const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& A_log,
                            const Tensor& dt_bias, const OptTensor& h0) {
  const int64_t b = bh / H, h = bh % H, T = p.T, K = p.K, V = p.V;
  kda::HeadInputs in;
  in.q = q.data_ptr<float>() + (b * T * H + h) * K;
  in.k = k.data_ptr<float>() + (b * T * H + h) * K;
  in.g = g.data_ptr<float>() + (b * T * H + h) * K;
  in.v = v.data_ptr<float>() + (b * T * H + h) * V;
  in.beta = beta.data_ptr<float>() + b * T * H + h;
  in.ldk = H * K;
  in.ldv = H * V;
  in.ldb = H;
  in.A_log = A_log.data_ptr<float>()[h];
  in.dt_bias = dt_bias.data_ptr<float>() + h * K;
  in.h0 = h0 ? h0->data_ptr<float>() + bh * K * V : nullptr;
  return in;
}

// fwd: o [B, T, H, V] and ht [B, H, K, V] are written completely.
void fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
         const Tensor& A_log, const Tensor& dt_bias, const OptTensor& h0, double scale, int64_t gate_id,
         double lower_bound, int64_t chunk_size, Tensor o, Tensor ht, const OptTensor& prof) {
  int64_t B, H;
  const kda::Params p =
      check_inputs(q, k, v, g, beta, A_log, dt_bias, h0, scale, gate_id, lower_bound, chunk_size, &B, &H);
  check_tensor(o, "o", {B, p.T, H, p.V});
  check_tensor(ht, "ht", {B, H, p.K, p.V});
  double* pr = prof_slots(prof);
  const int64_t BH = B * H;

  // one workspace block per (batch, head): [BH, fwd_work_bytes] bytes
  const int64_t wsize = round64(kda::fwd_work_bytes(p, /*keep_states=*/false));
  Tensor ws = torch::empty({BH, wsize}, q.options().dtype(at::kByte));
  uint8_t* ws0 = ws.data_ptr<uint8_t>();
  auto work = [&](int64_t bh) { return kda::fwd_work_at(ws0 + bh * wsize, p, false); };
  auto inputs = [&](int64_t bh) { return head_inputs(p, H, bh, q, k, v, g, beta, A_log, dt_bias, h0); };

  run_phase(BH, pr, kFwdPrestage, [&](int64_t bh) {
    kda::FwdWork w = work(bh);
    kda::prestage(p, inputs(bh), w);
  });
  run_phase(BH, pr, kFwdWY, [&](int64_t bh) {
    kda::FwdWork w = work(bh);
    kda::wy_transform(p, inputs(bh), w);
  });
  run_phase(BH, pr, kFwdAqk, [&](int64_t bh) {
    kda::FwdWork w = work(bh);
    kda::intra_chunk_qk(p, w);
  });
  run_phase(BH, pr, kFwdRecurrence, [&](int64_t bh) {
    kda::FwdWork w = work(bh);
    const int64_t b = bh / H, h = bh % H;
    float* o_bh = o.data_ptr<float>() + (b * p.T * H + h) * p.V;  // token t at + t * H * V
    float* S = ht.data_ptr<float>() + bh * p.K * p.V;            // the running state lives in ht
    kda::recurrence(p, inputs(bh), w, S, o_bh, H * p.V);
  });
}

// bwd: every gradient is written completely (dh0 when given).
void bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
         const Tensor& A_log, const Tensor& dt_bias, const OptTensor& h0, double scale, int64_t gate_id,
         double lower_bound, int64_t chunk_size, const Tensor& dout, const OptTensor& dht, Tensor dq,
         Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, Tensor dA_log, Tensor ddt_bias,
         const OptTensor& dh0, const OptTensor& prof) {
  int64_t B, H;
  const kda::Params p =
      check_inputs(q, k, v, g, beta, A_log, dt_bias, h0, scale, gate_id, lower_bound, chunk_size, &B, &H);
  const int64_t T = p.T, K = p.K, V = p.V;
  check_tensor(dout, "do", {B, T, H, V});
  if (dht) check_tensor(*dht, "dht", {B, H, K, V});
  check_tensor(dq, "dq", {B, T, H, K});
  check_tensor(dk, "dk", {B, T, H, K});
  check_tensor(dv, "dv", {B, T, H, V});
  check_tensor(dg, "dg", {B, T, H, K});
  check_tensor(dbeta, "dbeta", {B, T, H});
  check_tensor(dA_log, "dA_log", {H});
  check_tensor(ddt_bias, "ddt_bias", {H, K});
  if (dh0) check_tensor(*dh0, "dh0", {B, H, K, V});
  double* pr = prof_slots(prof);
  const int64_t BH = B * H;

  // workspaces: the forward's intermediates (with each chunk's entry state) and the backward's
  const int64_t fsize = round64(kda::fwd_work_bytes(p, /*keep_states=*/true));
  const int64_t bsize = round64(kda::bwd_work_bytes(p));
  Tensor fws = torch::empty({BH, fsize}, q.options().dtype(at::kByte));
  Tensor bws = torch::empty({BH, bsize}, q.options().dtype(at::kByte));
  Tensor dA_tok = torch::empty({B, T, H}, q.options());  // per-token shares of dA_log
  uint8_t* f0 = fws.data_ptr<uint8_t>();
  uint8_t* b0 = bws.data_ptr<uint8_t>();
  auto fwork = [&](int64_t bh) { return kda::fwd_work_at(f0 + bh * fsize, p, true); };
  auto bwork = [&](int64_t bh) { return kda::bwd_work_at(b0 + bh * bsize, p); };
  auto inputs = [&](int64_t bh) { return head_inputs(p, H, bh, q, k, v, g, beta, A_log, dt_bias, h0); };
  auto grads = [&](int64_t bh) {
    const int64_t b = bh / H, h = bh % H;
    kda::HeadGrads gr;
    gr.dout = dout.data_ptr<float>() + (b * T * H + h) * V;
    gr.dht = dht ? dht->data_ptr<float>() + bh * K * V : nullptr;
    gr.dq = dq.data_ptr<float>() + (b * T * H + h) * K;
    gr.dk = dk.data_ptr<float>() + (b * T * H + h) * K;
    gr.dg = dg.data_ptr<float>() + (b * T * H + h) * K;
    gr.dv = dv.data_ptr<float>() + (b * T * H + h) * V;
    gr.dbeta = dbeta.data_ptr<float>() + b * T * H + h;
    gr.dA_log_tok = dA_tok.data_ptr<float>() + b * T * H + h;
    gr.dh0 = dh0 ? dh0->data_ptr<float>() + bh * K * V : nullptr;
    gr.ldk = H * K;
    gr.ldv = H * V;
    gr.ldb = H;
    return gr;
  };

  // recompute the forward intermediates (no output), keeping every chunk's entry state
  run_phase(BH, pr, kBwdRecompute, [&](int64_t bh) {
    kda::FwdWork w = fwork(bh);
    kda::BwdWork bw = bwork(bh);
    const kda::HeadInputs in = inputs(bh);
    kda::prestage(p, in, w);
    kda::wy_transform(p, in, w);
    kda::intra_chunk_qk(p, w);
    kda::recurrence(p, in, w, bw.S, /*o=*/nullptr, 0);
  });
  run_phase(BH, pr, kBwdReverseRecurrence, [&](int64_t bh) {
    kda::BwdWork bw = bwork(bh);
    kda::reverse_recurrence(p, fwork(bh), grads(bh), bw);
  });
  run_phase(BH, pr, kBwdChunkAdjoint, [&](int64_t bh) {
    kda::BwdWork bw = bwork(bh);
    kda::chunk_adjoint(p, inputs(bh), fwork(bh), grads(bh), bw);
  });
  run_phase(BH, pr, kBwdPrestageAdjoint, [&](int64_t bh) {
    kda::BwdWork bw = bwork(bh);
    kda::prestage_adjoint(p, inputs(bh), fwork(bh), bw, grads(bh));
  });

  // dA_log[h] and ddt_bias[h, :] sum over batch and time: fixed-order torch reductions
  // (dg is dLoss/dx with x = g + dt_bias, so it is also dt_bias's per-token gradient)
#ifdef KDA_PROFILE
  const auto t0 = std::chrono::steady_clock::now();
#endif
  dA_log.copy_(dA_tok.sum(at::IntArrayRef{0, 1}));
  ddt_bias.copy_(dg.sum(at::IntArrayRef{0, 1}));
#ifdef KDA_PROFILE
  if (pr) pr[kBwdPrestageAdjoint] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fwd", &fwd, "KDA chunked forward (CPU, fp32)");
  m.def("bwd", &bwd, "KDA chunked backward (CPU, fp32)");
}
