// binding.cpp -- torch binding of the CUDA stage: checks every tensor, allocates
// the workspace on the input's device, launches on the current stream.
//
// fwd(q, k, v, g, beta, A_log, dt_bias, h0?, scale, gate_id, lower_bound,
//     chunk_size, o, ht, prof?)
// bwd(q, k, v, g, beta, A_log, dt_bias, h0?, scale, gate_id, lower_bound,
//     chunk_size, do, dht?, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0?, prof?)
// Outputs are preallocated by the caller and completely overwritten.
#define KDA_WITH_TORCH
#include "kda_cuda_check.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>  // (ATen/cuda/CUDAContext.h would need the cuSPARSE headers)
#include <torch/extension.h>

#include <climits>
#include <cmath>

#include "kda.h"
#include "kda_binding.h"  // check_tensor, check_shape, present, launches, KDA_STAGE
#include "kda_profile.cuh"  // KDA_MAX_REGIONS

namespace {

using kda_binding::check_shape;
using kda_binding::check_tensor;
using kda_binding::OptTensor;
using kda_binding::present;

struct Sizes {
  int64_t B, T, H, K, V, BT, NT, Tp;
};

// Checks shared by fwd and bwd: the inputs, the scalars and the sizes.
Sizes check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                   const torch::Tensor& g, const torch::Tensor& beta, const torch::Tensor& A_log,
                   const torch::Tensor& dt_bias, const OptTensor& h0, double scale, int64_t gate_id,
                   double lower_bound, int64_t chunk_size) {
  TORCH_CHECK(q.defined() && q.dim() == 4, "q must be [B, T, H, K]");
  TORCH_CHECK(v.defined() && v.dim() == 4, "v must be [B, T, H, V]");
  Sizes s{};
  s.B = q.size(0);
  s.T = q.size(1);
  s.H = q.size(2);
  s.K = q.size(3);
  s.V = v.size(3);
  TORCH_CHECK(s.B >= 1 && s.T >= 1 && s.H >= 1, "B, T, H must be >= 1, got q shape ", q.sizes());
  TORCH_CHECK(s.K >= 1 && s.K <= 256, "K must be in [1, 256], got ", s.K);
  TORCH_CHECK(s.V >= 1 && s.V <= 256, "V must be in [1, 256], got ", s.V);
  TORCH_CHECK(chunk_size == 16 || chunk_size == 32 || chunk_size == 64,
              "chunk_size must be 16, 32 or 64, got ", chunk_size);
  TORCH_CHECK(gate_id == 0 || gate_id == 1, "gate_id must be 0 (softplus) or 1 (bounded), got ", gate_id);
  if (gate_id == 1)
    TORCH_CHECK(std::isfinite(lower_bound) && lower_bound >= -5.0 && lower_bound < 0.0,
                "lower_bound must be in [-5, 0), got ", lower_bound);
  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  // every size the kernels index with int must fit one (with room for rounding
  // the thread count up to whole blocks)
  TORCH_CHECK(s.B * s.H < (int64_t(1) << 30), "B * H too large: ", s.B * s.H);
  TORCH_CHECK(s.T <= INT_MAX - 64, "T too large: ", s.T);
  s.BT = chunk_size;
  s.NT = (s.T + s.BT - 1) / s.BT;
  s.Tp = s.NT * s.BT;

  check_tensor(q, "q", q);
  check_tensor(k, "k", q);
  check_tensor(v, "v", q);
  check_tensor(g, "g", q);
  check_tensor(beta, "beta", q);
  check_tensor(A_log, "A_log", q);
  check_tensor(dt_bias, "dt_bias", q);
  check_shape(k, "k", {s.B, s.T, s.H, s.K});
  check_shape(v, "v", {s.B, s.T, s.H, s.V});
  check_shape(g, "g", {s.B, s.T, s.H, s.K});
  check_shape(beta, "beta", {s.B, s.T, s.H});
  check_shape(A_log, "A_log", {s.H});
  check_shape(dt_bias, "dt_bias", {s.H, s.K});
  if (present(h0)) {
    check_tensor(*h0, "h0", q);
    check_shape(*h0, "h0", {s.B, s.H, s.K, s.V});
  }
  return s;
}

// The profile buffer: int64 [slots >= B*H, KDA_MAX_REGIONS]; nullptr when absent or
// when this is not the profile build (the timers are compiled out).
long long* prof_ptr(const OptTensor& prof, const torch::Tensor& q, const Sizes& s) {
#ifdef KDA_PROFILE
  if (!present(prof)) return nullptr;
  check_tensor(*prof, "prof", q, torch::kInt64);
  TORCH_CHECK(prof->dim() == 2 && prof->size(1) == KDA_MAX_REGIONS && prof->size(0) >= s.B * s.H,
              "prof must be int64 [slots >= B*H, ", KDA_MAX_REGIONS, "], got ", prof->sizes());
  return reinterpret_cast<long long*>(prof->data_ptr<int64_t>());
#else
  (void)prof;
  (void)q;
  (void)s;
  return nullptr;
#endif
}

float* fptr(torch::Tensor& t) { return t.data_ptr<float>(); }
const float* cptr(const torch::Tensor& t) { return t.data_ptr<float>(); }
double* dptr(torch::Tensor& t) { return t.data_ptr<double>(); }  // gc, dgc: fp64 (kda.h)

// The forward workspace ([BH, Tp, *] and [BH, NT, BT, BT], see kda.h).
struct FwdWork {
  torch::Tensor qn, kn, gc, rq, rk, beta_s, X, Af, Aqk, w, u, vcorr;
  explicit FwdWork(const Sizes& s, const torch::TensorOptions& o) {
    const int64_t BH = s.B * s.H;
    qn = torch::empty({BH, s.Tp, s.K}, o);
    kn = torch::empty({BH, s.Tp, s.K}, o);
    gc = torch::empty({BH, s.Tp, s.K}, o.dtype(torch::kFloat64));
    rq = torch::empty({BH, s.Tp}, o);
    rk = torch::empty({BH, s.Tp}, o);
    beta_s = torch::empty({BH, s.Tp}, o);
    X = torch::empty({BH, s.NT, s.BT, s.BT}, o);
    Af = torch::empty({BH, s.NT, s.BT, s.BT}, o);
    Aqk = torch::empty({BH, s.NT, s.BT, s.BT}, o);
    w = torch::empty({BH, s.Tp, s.K}, o);
    u = torch::empty({BH, s.Tp, s.V}, o);
    vcorr = torch::empty({BH, s.Tp, s.V}, o);
  }
};

KdaFwdParams fwd_params(const Sizes& s, const torch::Tensor& q, const torch::Tensor& k,
                        const torch::Tensor& v, const torch::Tensor& g, const torch::Tensor& beta,
                        const torch::Tensor& A_log, const torch::Tensor& dt_bias, const OptTensor& h0,
                        double scale, int64_t gate_id, double lower_bound, FwdWork& ws) {
  KdaFwdParams p{};
  p.B = (int)s.B;
  p.T = (int)s.T;
  p.H = (int)s.H;
  p.K = (int)s.K;
  p.V = (int)s.V;
  p.BT = (int)s.BT;
  p.NT = (int)s.NT;
  p.Tp = (int)s.Tp;
  p.q = cptr(q);
  p.k = cptr(k);
  p.v = cptr(v);
  p.g = cptr(g);
  p.beta = cptr(beta);
  p.A_log = cptr(A_log);
  p.dt_bias = cptr(dt_bias);
  p.h0 = present(h0) ? cptr(*h0) : nullptr;
  p.scale = (float)scale;
  p.gate_id = (int)gate_id;
  p.lower_bound = (float)lower_bound;
  p.qn = fptr(ws.qn);
  p.kn = fptr(ws.kn);
  p.gc = dptr(ws.gc);
  p.rq = fptr(ws.rq);
  p.rk = fptr(ws.rk);
  p.beta_s = fptr(ws.beta_s);
  p.X = fptr(ws.X);
  p.Af = fptr(ws.Af);
  p.Aqk = fptr(ws.Aqk);
  p.w = fptr(ws.w);
  p.u = fptr(ws.u);
  p.vcorr = fptr(ws.vcorr);
  p.states = nullptr;  // set by the caller
  p.o = nullptr;
  p.prof = nullptr;
  return p;
}

void kda_fwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
             torch::Tensor A_log, torch::Tensor dt_bias, OptTensor h0, double scale, int64_t gate_id,
             double lower_bound, int64_t chunk_size, torch::Tensor o, torch::Tensor ht, OptTensor prof) {
  const Sizes s = check_inputs(q, k, v, g, beta, A_log, dt_bias, h0, scale, gate_id, lower_bound, chunk_size);
  check_tensor(o, "o", q);
  check_shape(o, "o", {s.B, s.T, s.H, s.V});
  check_tensor(ht, "ht", q);
  check_shape(ht, "ht", {s.B, s.H, s.K, s.V});

  const c10::cuda::CUDAGuard device_guard(q.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  FwdWork ws(s, q.options());
  KdaFwdParams p = fwd_params(s, q, k, v, g, beta, A_log, dt_bias, h0, scale, gate_id, lower_bound, ws);
  p.states = fptr(ht);  // S lives in ht, updated in place chunk after chunk
  p.state_bh_stride = s.K * s.V;
  p.state_chunk_stride = 0;
  p.o = fptr(o);
  p.prof = prof_ptr(prof, q, s);
  kda_launch_log().clear();
  kda_check(kda_fwd_launch(p, stream), "kda forward");
}

void kda_bwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta,
             torch::Tensor A_log, torch::Tensor dt_bias, OptTensor h0, double scale, int64_t gate_id,
             double lower_bound, int64_t chunk_size, torch::Tensor dout, OptTensor dht, torch::Tensor dq,
             torch::Tensor dk, torch::Tensor dv, torch::Tensor dg, torch::Tensor dbeta, torch::Tensor dA_log,
             torch::Tensor ddt_bias, OptTensor dh0, OptTensor prof) {
  const Sizes s = check_inputs(q, k, v, g, beta, A_log, dt_bias, h0, scale, gate_id, lower_bound, chunk_size);
  check_tensor(dout, "do", q);
  check_shape(dout, "do", {s.B, s.T, s.H, s.V});
  if (present(dht)) {
    check_tensor(*dht, "dht", q);
    check_shape(*dht, "dht", {s.B, s.H, s.K, s.V});
  }
  check_tensor(dq, "dq", q);
  check_shape(dq, "dq", {s.B, s.T, s.H, s.K});
  check_tensor(dk, "dk", q);
  check_shape(dk, "dk", {s.B, s.T, s.H, s.K});
  check_tensor(dv, "dv", q);
  check_shape(dv, "dv", {s.B, s.T, s.H, s.V});
  check_tensor(dg, "dg", q);
  check_shape(dg, "dg", {s.B, s.T, s.H, s.K});
  check_tensor(dbeta, "dbeta", q);
  check_shape(dbeta, "dbeta", {s.B, s.T, s.H});
  check_tensor(dA_log, "dA_log", q);
  check_shape(dA_log, "dA_log", {s.H});
  check_tensor(ddt_bias, "ddt_bias", q);
  check_shape(ddt_bias, "ddt_bias", {s.H, s.K});
  if (present(dh0)) {
    check_tensor(*dh0, "dh0", q);
    check_shape(*dh0, "dh0", {s.B, s.H, s.K, s.V});
  }

  const c10::cuda::CUDAGuard device_guard(q.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto opts = q.options();
  const int64_t BH = s.B * s.H;

  // forward recompute: same workspace, every chunk-entry state kept, no o
  FwdWork ws(s, opts);
  torch::Tensor states = torch::empty({BH, s.NT + 1, s.K, s.V}, opts);
  KdaBwdParams p{};
  p.f = fwd_params(s, q, k, v, g, beta, A_log, dt_bias, h0, scale, gate_id, lower_bound, ws);
  p.f.states = fptr(states);
  p.f.state_bh_stride = (s.NT + 1) * s.K * s.V;
  p.f.state_chunk_stride = s.K * s.V;
  p.f.o = nullptr;
  p.f.prof = nullptr;  // the recompute is not profiled

  // backward workspace
  torch::Tensor dS = torch::empty({BH, s.K, s.V}, opts);
  torch::Tensor du = torch::empty({BH, s.Tp, s.V}, opts);
  torch::Tensor dw = torch::empty({BH, s.Tp, s.K}, opts);
  torch::Tensor dqd = torch::empty({BH, s.Tp, s.K}, opts);
  torch::Tensor dkr = torch::empty({BH, s.Tp, s.K}, opts);
  torch::Tensor dEL = torch::empty({BH, s.NT, s.K}, opts);
  torch::Tensor dAqk = torch::empty({BH, s.NT, s.BT, s.BT}, opts);
  torch::Tensor dA = torch::empty({BH, s.NT, s.BT, s.BT}, opts);
  torch::Tensor tmp = torch::empty({BH, s.NT, s.BT, s.BT}, opts);
  torch::Tensor dqs = torch::empty({BH, s.Tp, s.K}, opts);
  torch::Tensor dkn = torch::empty({BH, s.Tp, s.K}, opts);
  torch::Tensor dgc = torch::empty({BH, s.Tp, s.K}, opts.dtype(torch::kFloat64));
  torch::Tensor dbeta_s = torch::empty({BH, s.Tp}, opts);
  torch::Tensor dAlog_part = torch::empty({s.B, s.T, s.H}, opts);

  p.dout = cptr(dout);
  p.dht = present(dht) ? cptr(*dht) : nullptr;
  p.dS = fptr(dS);
  p.du = fptr(du);
  p.dw = fptr(dw);
  p.dqd = fptr(dqd);
  p.dkr = fptr(dkr);
  p.dEL = fptr(dEL);
  p.dAqk = fptr(dAqk);
  p.dA = fptr(dA);
  p.tmp = fptr(tmp);
  p.dqs = fptr(dqs);
  p.dkn = fptr(dkn);
  p.dgc = dptr(dgc);
  p.dbeta_s = fptr(dbeta_s);
  p.dq = fptr(dq);
  p.dk = fptr(dk);
  p.dv = fptr(dv);
  p.dg = fptr(dg);
  p.dbeta = fptr(dbeta);
  p.dAlog_part = fptr(dAlog_part);
  p.dh0 = present(dh0) ? fptr(*dh0) : nullptr;
  p.prof = prof_ptr(prof, q, s);
  kda_launch_log().clear();
  kda_check(kda_bwd_launch(p, stream), "kda backward");

  // sums over batch and time, deterministic (torch reductions, no atomics)
  ddt_bias.copy_(dg.sum(at::IntArrayRef{0, 1}));          // dg is d/dx, x = g + dt_bias
  dA_log.copy_(dAlog_part.sum(at::IntArrayRef{0, 1}));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("launches", &kda_binding::launches,
        "grid, block and dynamic shared memory of each kernel the last call launched");
  m.def("fwd", &kda_fwd, "KDA chunked forward of stage " KDA_STAGE, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("g"), py::arg("beta"), py::arg("A_log"), py::arg("dt_bias"), py::arg("h0"), py::arg("scale"),
        py::arg("gate_id"), py::arg("lower_bound"), py::arg("chunk_size"), py::arg("o"), py::arg("ht"),
        py::arg("prof"));
  m.def("bwd", &kda_bwd, "KDA chunked backward of stage " KDA_STAGE, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("g"), py::arg("beta"), py::arg("A_log"), py::arg("dt_bias"), py::arg("h0"), py::arg("scale"),
        py::arg("gate_id"), py::arg("lower_bound"), py::arg("chunk_size"), py::arg("do"), py::arg("dht"),
        py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("dg"), py::arg("dbeta"), py::arg("dA_log"),
        py::arg("ddt_bias"), py::arg("dh0"), py::arg("prof"));
}
