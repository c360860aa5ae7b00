// emu.cpp -- the backward's kernels (backward.cuh) run on the CPU by kda_emu.h, so that
// a machine without a GPU checks their indexing and synchronisation against common/backward_model.py
// (tests/test_backward_emu.py). The same source as the GPU build, launched in the same order with the
// same grids, threads and shared memory as kda.cu's bwd::launch_all.
//
// emu_bwd(q, k, v, g, beta, A_log, dt_bias, h0?, scale, gate_id, lower_bound, do, dht?, cu_seqlens?, grads_bf16,
// keep_u) -> [dq, dk, dv, dg, dbeta (fp32, or bf16 with grads_bf16), dAlog_part, dh0 (or empty), qd, kr, w, u, Aqk,
// el, states, dstates, vcorr, dvcorr, ddt_bias], CPU tensors, inputs as the GPU binding takes them (bf16 q, k, v,
// g, beta; fp32 the rest). u is vcorr's buffer, as the binding has it (B2 writes vcorr over u), but with keep_u.
// Then Xkk [slots, 2, 16, 16] (B1's X and kk for B4; empty in the build b4_rebuilds).
#include "kda_emu.h"

#include <torch/extension.h>

#include "kda.h"
#include "kda_profile.cuh"  // its timers: empty without KDA_PROFILE

namespace kda_stage {
using std::min;
constexpr int BT = 16;          // common.cuh's
constexpr float kL2Eps = 1e-6f;  // common.cuh's
constexpr float kFactoredRange = 80.f;  // common.cuh's
}  // namespace kda_stage

#include "backward.cuh"

namespace {

using namespace kda_stage::bwd;

template <int D>
void launch_all(const KdaBwdParams& p) {
  const unsigned chunks = p.N * p.H * p.NT, chains = p.N * p.H * (D / kVTile);
  kda_emu::launch(chunks, kPrepThreads, sizeof(PrepSmem<D>), [&] { kda_bwd_prepare_kernel<D>(p); });
#ifdef KDA_BWD_FP32_CHAINS
  kda_emu::launch(2 * chains, kChainThreads, sizeof(ChainSmem<D>), [&] { kda_bwd_chains_kernel<D>(p); });
#else
  kda_emu::launch(2 * chains, kMmaChainThreads, sizeof(MmaChainSmem<D>), [&] { kda_bwd_chains_mma_kernel<D>(p); });
#endif
  kda_emu::launch(chunks, kAdjThreads, sizeof(AdjSmem<D>), [&] { kda_bwd_adjoint_kernel<D>(p); });
}

const __nv_bfloat16* bf(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16 && t.is_contiguous() && t.device().is_cpu(), "bf16 CPU input");
  return reinterpret_cast<const __nv_bfloat16*>(t.data_ptr<at::BFloat16>());
}
const float* f32(const torch::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(), "fp32 CPU input");
  return t.data_ptr<float>();
}

std::vector<torch::Tensor> emu_bwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor g,
                                   torch::Tensor beta, torch::Tensor A_log, torch::Tensor dt_bias,
                                   c10::optional<torch::Tensor> h0, double scale, int64_t gate_id, double lower_bound,
                                   torch::Tensor dout, c10::optional<torch::Tensor> dht,
                                   c10::optional<torch::Tensor> cu_seqlens, bool grads_bf16, bool keep_u) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  int64_t N = B, max_len = T;
  if (cu_seqlens.has_value()) {
    TORCH_CHECK(cu_seqlens->scalar_type() == torch::kInt32 && cu_seqlens->is_contiguous() && B == 1, "int32 cu_seqlens, B = 1");
    N = cu_seqlens->size(0) - 1;
    max_len = 1;
    for (int64_t i = 0; i < N; ++i)
      max_len = std::max<int64_t>(max_len, cu_seqlens->data_ptr<int32_t>()[i + 1] - cu_seqlens->data_ptr<int32_t>()[i]);
  }
  const int64_t NT = (max_len + 15) / 16;
  TORCH_CHECK(D == 64 || D == 128, "D must be 64 or 128");
  const auto o = torch::TensorOptions().dtype(torch::kFloat32);
  auto nan = [&](std::vector<int64_t> shape) { return torch::full(shape, NAN, o); };  // poisoned: all written?
  const int64_t S = N * H * NT;
  auto grad = [&](std::vector<int64_t> shape) {  // an output gradient in the dtype asked for, poisoned
    return grads_bf16 ? torch::full(shape, NAN, o.dtype(torch::kBFloat16)) : nan(shape);
  };
  torch::Tensor dq = grad({B, T, H, D}), dk = grad({B, T, H, D}), dv = grad({B, T, H, D}), dg = grad({B, T, H, D});
  torch::Tensor dbeta = grad({B, T, H}), dal = nan({B, T, H});
  torch::Tensor ddt = torch::zeros({N * H * NT, D}, o);  // as the binding: zero where no chunk runs
  torch::Tensor dh0 = h0.has_value() ? nan({N, H, D, D}) : torch::Tensor();
#ifdef KDA_BWD_OPS_FP32
  torch::Tensor qd = nan({S, 16, D}), kr = nan({S, 16, D}), w = nan({S, 16, D});
#else
  const auto b16 = o.dtype(torch::kBFloat16);
  torch::Tensor qd = torch::full({S, 16, D}, NAN, b16), kr = torch::full({S, 16, D}, NAN, b16), w = torch::full({S, 16, D}, NAN, b16);
#endif
  torch::Tensor u = nan({S, 16, D});
  torch::Tensor Aqk = nan({S, 16, 16}), el = nan({S, D});
#ifdef KDA_BWD_KEEP_XKK
  torch::Tensor Xkk = nan({S, 2, 16, 16});  // as the binding: B1's X and kk, for B4
#else
  torch::Tensor Xkk = torch::empty({0}, o);
#endif
#ifdef KDA_BWD_STATES_FP32
  torch::Tensor st = nan({S, D, D}), dst = nan({S, D, D});
#else
  torch::Tensor st = torch::full({S, D, D}, NAN, o.dtype(torch::kBFloat16)), dst = torch::full({S, D, D}, NAN, o.dtype(torch::kBFloat16));
#endif
  torch::Tensor vc = keep_u ? nan({S, 16, D}) : u, dvc = nan({S, 16, D});  // as the binding: vcorr over u
  KdaBwdParams p{};
  p.B = (int)B;
  p.T = (int)T;
  p.H = (int)H;
  p.D = (int)D;
  p.N = (int)N;
  p.cu_seqlens = cu_seqlens.has_value() ? cu_seqlens->data_ptr<int32_t>() : nullptr;
  p.NT = (int)NT;
  p.q = bf(q);
  p.k = bf(k);
  p.v = bf(v);
  p.g = bf(g);
  p.beta = bf(beta);
  p.A_log = f32(A_log);
  p.dt_bias = f32(dt_bias);
  p.h0 = h0.has_value() ? f32(*h0) : nullptr;
  p.scale = (float)scale;
  p.lower_bound = (float)lower_bound;
  p.gate_id = (int)gate_id;
#ifdef KDA_BWD_FP32_CHAINS
  if (dout.scalar_type() == torch::kBFloat16) dout = dout.to(torch::kFloat32);  // as the binding: fp32 for these chains
#endif
  p.dout = dout.scalar_type() == torch::kFloat32 ? f32(dout) : nullptr;
  p.dout_bf = dout.scalar_type() == torch::kFloat32 ? nullptr : bf(dout);
  p.dht = dht.has_value() ? f32(*dht) : nullptr;
  p.qd = reinterpret_cast<kda_op_t*>(qd.data_ptr());
  p.kr = reinterpret_cast<kda_op_t*>(kr.data_ptr());
  p.w = reinterpret_cast<kda_op_t*>(w.data_ptr());
  p.u = u.data_ptr<float>();
  p.Aqk = Aqk.data_ptr<float>();
  p.el = el.data_ptr<float>();
  p.Xkk = Xkk.numel() > 0 ? Xkk.data_ptr<float>() : nullptr;
  p.states = reinterpret_cast<kda_state_t*>(st.data_ptr());
  p.dstates = reinterpret_cast<kda_state_t*>(dst.data_ptr());
  p.vcorr = vc.data_ptr<float>();
  p.dvcorr = dvc.data_ptr<float>();
  kda_bwd_set_grads(p, dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), dg.data_ptr(), dbeta.data_ptr(), grads_bf16);
  p.ddt_part = ddt.data_ptr<float>();
  p.dAlog_part = dal.data_ptr<float>();
  p.dh0 = h0.has_value() ? dh0.data_ptr<float>() : nullptr;
  if (D == 64)
    launch_all<64>(p);
  else
    launch_all<128>(p);
  return {dq, dk, dv, dg, dbeta, dal, dh0, qd, kr, w, u, Aqk, el, st, dst, vc, dvc, ddt.view({N, H, NT, D}).sum({0, 2}),
          Xkk};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bwd", &emu_bwd, "stage 13's backward kernels on the CPU (kda_emu.h)");
}
