// prepare.cuh -- the prepare of one chunk: K1's five phases (load_rows +
// stage_rows, decay_columns, products, invert, w_u), the fused prepare's own
// phase 0 and 1 (load_row_slices, stage_row_slices: eight lanes per token), and
// kda_prepare_kernel, K1 of the split path. The fused kernel's prepare teams
// (fused.cuh) run the same phases into a ring slot.
#pragma once

#include "common.cuh"
#include "kda_device.cuh"  // sigmoid_f

namespace kda_stage {

// ---------------------------------------------------------------------------
// The prepare of one chunk, in five phases that 128 threads (4 warps) run with a
// barrier between phases. K1 runs them once per block (one chunk, __syncthreads);
// the fused kernel's prepare warps run them chunk after chunk into a ring slot
// (named barrier 1). The destinations are template parameters only through their
// row pitches: K1 writes the dense global workspace, the fused kernel the padded
// shared slot that the compute warps read.
// ---------------------------------------------------------------------------

// A chunk's raw inputs in registers: warp w holds token rows 4w .. 4w + 3, lane j
// the K/32 contiguous features lane * K/32 .. of q, k, g and V/32 of v.
template <int K, int V>
struct RawRows {
  static constexpr int kRows = BT / (kThreads / 32), QV = K / 32, VV = V / 32;
  bf16 q[kRows][QV], k[kRows][QV], g[kRows][QV], v[kRows][VV];
  bf16 beta[kRows];  // raw bf16, converted in stage_rows (see load_rows)
};

// Phase 0 (issue only): the global loads of chunk n of sequence s, ALL rows of the
// warp first (one 8- or 4-byte vector per lane and tensor). Padded tokens (t >= the
// sequence's length) get q = k = v = 0, beta logit 0 and are not read. The raw gate
// g is loaded with gate_id 0 and 1 only (gate_id 3's log decay is read where it is used,
// in stage_rows: a register tile of its fp32 rows would cost the default call the
// registers). Nothing waits here: the values are first used by stage_rows, so the
// loads of the next chunk fly while the fused kernel's prepare warps finish the
// current one. Even beta stays bf16 in
// its register: stage 07 converted it to float right after its load, and since
// the compiler gives the four rows' beta the same register, each row's
// conversion waited for that row's load -- four memory latencies in a row, in
// every K1 block (about 8e3 cycles per chunk, measured in the fused kernel).
template <int K, int V>
__device__ __forceinline__ void load_rows(const KdaFwdParams& p, const SeqSpan& s, int h, int n, int warp,
                                          int lane, RawRows<K, V>& r) {
  constexpr int kRows = RawRows<K, V>::kRows, QV = RawRows<K, V>::QV, VV = RawRows<K, V>::VV;
  const bf16* q = reinterpret_cast<const bf16*>(p.q);
  const bf16* k = reinterpret_cast<const bf16*>(p.k);
  const bf16* g = reinterpret_cast<const bf16*>(p.g);
  const bf16* v = reinterpret_cast<const bf16*>(p.v);
  const bf16* beta = reinterpret_cast<const bf16*>(p.beta);
  const int t0 = n * BT, len = min(BT, s.len - t0);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int c = warp * kRows + i;
    if (c < len) {
      const size_t row = token_row(p, s, t0 + c, h);  // token row (s, t, h)
      load_vec(q + row * K + lane * QV, r.q[i]);
      load_vec(k + row * K + lane * QV, r.k[i]);
      if (p.gate_id != KDA_GATE_LOG) load_vec(g + row * K + lane * QV, r.g[i]);
      load_vec(v + row * V + lane * VV, r.v[i]);
      r.beta[i] = beta[row];  // no conversion here: a use would wait for the load
    } else {
#pragma unroll
      for (int j = 0; j < QV; ++j) r.q[i][j] = r.k[i][j] = r.g[i][j] = bf16(0.f);
#pragma unroll
      for (int j = 0; j < VV; ++j) r.v[i][j] = bf16(0.f);
      r.beta[i] = bf16(0.f);
    }
  }
}

// beta as the caller asks (beta_mode, read uniformly): 0 as it is, 1 sigmoid(beta), 2 2 sigmoid(beta)
// (FLA's allow_neg_eigval); the sigmoid of each prepare (kFast: the fused prepare's sigmoid_approx,
// else K1's sigmoid_f).
template <bool kFast>
__device__ __forceinline__ float beta_of(const KdaFwdParams& p, float x) {
  if (p.beta_mode == 0) return x;
  const float s = kFast ? sigmoid_approx(x) : sigmoid_f(x);
  return p.beta_mode == 2 ? 2.0f * s : s;
}

// Phase 1: normalise the rows -> shared: qn = q / sqrt(sum q^2 + eps), kn likewise
// (l2norm 0: q, k as they are); a = lb * sigmoid(exp(A_log) (g + dt_bias)) (gate_id 0:
// a = -exp(A_log) softplus(g + dt_bias); gate_id 3: a = g_log as it is); beta = sigmoid(beta) (beta_mode: beta_of); v as bf16.
// Padded tokens: a = 0, beta = 0.
// The head's gate parameters of this lane: exp(A_log[h]) and its K/32 features of dt_bias.
template <int K>
struct GateParams {
  float aexp, dtb[K / 32];
};
template <int K>
__device__ __forceinline__ GateParams<K> gate_params(const KdaFwdParams& p, int h, int lane) {
  GateParams<K> gp;
  gp.aexp = expf(p.A_log[h]);
#pragma unroll
  for (int j = 0; j < K / 32; ++j) gp.dtb[j] = p.dt_bias[(size_t)h * K + lane * (K / 32) + j];
  return gp;
}

// Phase 1 (K1): the rows' sums of squares, their warp sums (warp_sum's butterfly),
// then each row's normalisation and gate, with stage 07's arithmetic in stage 07's
// order (the split path stays bitwise stage 07's). The source order puts the four
// rows' work side by side: first every sum of squares, then the butterfly level by
// level over all rows (8 independent shuffles in flight).
// kSoftplus: the softplus gate's branch compiled in (the variants that take a gate without a bound).
template <int K, int V, bool kSoftplus>
__device__ __forceinline__ void stage_rows(K1Smem<K, V>& sm, const KdaFwdParams& p, const GateParams<K>& gp,
                                           const SeqSpan& s, int h, int n, int warp, int lane, const RawRows<K, V>& r) {
  constexpr int kRows = RawRows<K, V>::kRows, QV = RawRows<K, V>::QV, VV = RawRows<K, V>::VV;
  float sq[kRows], sk[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    sq[i] = sk[i] = 0.f;
#pragma unroll
    for (int j = 0; j < QV; ++j) {
      const float qf = static_cast<float>(r.q[i][j]), kf = static_cast<float>(r.k[i][j]);
      sq[i] += qf * qf;
      sk[i] += kf * kf;
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      sq[i] += __shfl_xor_sync(kFullMask, sq[i], off);
      sk[i] += __shfl_xor_sync(kFullMask, sk[i], off);
    }
  }
  const int len = min(BT, s.len - n * BT);
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int c = warp * kRows + i;
    const bool real = c < len;
    const float rq = p.l2norm ? 1.0f / sqrtf(sq[i] + kL2Eps) : 1.0f;
    const float rk = p.l2norm ? 1.0f / sqrtf(sk[i] + kL2Eps) : 1.0f;
    float qn[QV], kn[QV], av[QV];
#pragma unroll
    for (int j = 0; j < QV; ++j) {
      qn[j] = static_cast<float>(r.q[i][j]) * rq;
      kn[j] = static_cast<float>(r.k[i][j]) * rk;
    }
    if (p.gate_id == KDA_GATE_LOG) {  // a is the caller's log decay (padded rows: 0, not read)
#pragma unroll
      for (int j = 0; j < QV; ++j) av[j] = 0.f;
      if (real) load_vec(p.g_log + token_row(p, s, n * BT + c, h) * K + lane * QV, av);
    } else if (kSoftplus && p.gate_id == KDA_GATE_SOFTPLUS) {  // a = -exp(A_log) softplus(g + dt_bias): no bound
#pragma unroll
      for (int j = 0; j < QV; ++j) {
        const float xg = static_cast<float>(r.g[i][j]) + gp.dtb[j];
        av[j] = real ? -gp.aexp * softplus_f(xg) : 0.f;
      }
    } else {
#pragma unroll
      for (int j = 0; j < QV; ++j) {
        const float xg = static_cast<float>(r.g[i][j]) + gp.dtb[j];
        av[j] = real ? p.lower_bound * sigmoid_f(gp.aexp * xg) : 0.f;
      }
    }
    store_vec(&sm.qn[c][lane * QV], qn);
    store_vec(&sm.kn[c][lane * QV], kn);
    store_vec(&sm.a[c][lane * QV], av);
    store_vec(&sm.v[c][lane * VV], r.v[i]);
    if (lane == 0) sm.beta[c] = real ? beta_of<false>(p, static_cast<float>(r.beta[i])) : 0.f;
  }
}

// The fused prepare's phase 0 and 1 in another layout: one token row per 8 lanes.
// Lane l of warp w holds row 4w + l / 8, and of it the K/32 groups of 4 features
// 32 m + 4 (l % 8) .. + 3 (m = 0 .. K/32 - 1), likewise for v: a row's sums of squares
// are then 3 butterfly levels over its 8 lanes (6 shuffles per lane and chunk), where
// RawRows' layout (a lane across the 4 rows of its warp) needs 5 levels for each of
// the 4 rows and 2 tensors (40 shuffles) -- in the fused kernel the shuffles and
// their latencies were the largest part of the prepare (ncu). The groups of 4 keep
// the loads 8-byte vectors and each quarter-warp's 16-byte shared stores on 32
// different banks. K1 keeps RawRows (its sums in stage 07's order, bitwise).
template <int K, int V>
struct RowSlices {
  static constexpr int G = K / 32, GV = V / 32;  // groups of 4 features per lane
  bf16 q[G][4], k[G][4], g[G][4], v[GV][4];
  bf16 beta;  // raw bf16, converted in stage_row_slices (see load_rows)
};

template <int K, int V>
__device__ __forceinline__ void load_row_slices(const KdaFwdParams& p, const SeqSpan& s, int h, int n, int warp,
                                                int lane, RowSlices<K, V>& r) {
  constexpr int G = RowSlices<K, V>::G, GV = RowSlices<K, V>::GV;
  const bf16* q = reinterpret_cast<const bf16*>(p.q);
  const bf16* k = reinterpret_cast<const bf16*>(p.k);
  const bf16* g = reinterpret_cast<const bf16*>(p.g);
  const bf16* v = reinterpret_cast<const bf16*>(p.v);
  const int t0 = n * BT, c = warp * 4 + lane / 8, f0 = 4 * (lane % 8);
  if (c < min(BT, s.len - t0)) {
    const size_t row = token_row(p, s, t0 + c, h);  // token row (s, t, h)
#pragma unroll
    for (int m = 0; m < G; ++m) {
      load_vec(q + row * K + 32 * m + f0, r.q[m]);
      load_vec(k + row * K + 32 * m + f0, r.k[m]);
      if (p.gate_id != KDA_GATE_LOG) load_vec(g + row * K + 32 * m + f0, r.g[m]);
    }
#pragma unroll
    for (int m = 0; m < GV; ++m) load_vec(v + row * V + 32 * m + f0, r.v[m]);
    r.beta = reinterpret_cast<const bf16*>(p.beta)[row];
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int m = 0; m < G; ++m) r.q[m][j] = r.k[m][j] = r.g[m][j] = bf16(0.f);
#pragma unroll
      for (int m = 0; m < GV; ++m) r.v[m][j] = bf16(0.f);
    }
    r.beta = bf16(0.f);
  }
}

// The head's gate parameters for the row-slice layout: exp(A_log[h]) log2 e and, per
// feature of the lane, c0 = -exp(A_log[h]) log2 e dt_bias, so that the sigmoid's
// exponent 2^(g c1 + c0) = exp(-exp(A_log) (g + dt_bias)) is one FMA (c1 = -aexp log2 e).
// The softplus gate (gate_id 0) uses the same y = g c1 + c0 = -aexp log2 e (g + dt_bias):
// a (log2 units) = -aexp log2 e softplus(x) = min(y, 0) - aexp log2(1 + 2^(-|y| / aexp)),
// since softplus(x) = max(x, 0) + ln(1 + e^-|x|): ex2 and lg2, two MUFU as the bounded gate's
// ex2 and rcp, and no overflow for any x.
template <int K>
struct GateSlices {
  float c1, c0[K / 32][4];
  float aexp, inv_aexp;  // exp(A_log[h]) and its inverse (the softplus gate)
};
template <int K>
__device__ __forceinline__ GateSlices<K> gate_slices(const KdaFwdParams& p, int h, int lane) {
  GateSlices<K> gs;
  const float aexp = expf(p.A_log[h]);
  gs.c1 = -aexp * kLog2e;
  gs.aexp = aexp;
  gs.inv_aexp = 1.0f / aexp;
#pragma unroll
  for (int m = 0; m < K / 32; ++m)
#pragma unroll
    for (int j = 0; j < 4; ++j) gs.c0[m][j] = gs.c1 * p.dt_bias[(size_t)h * K + 32 * m + 4 * (lane % 8) + j];
  return gs;
}

// Phase 1 of the fused prepare (stage_rows' work, row-slice layout, fast math):
// qn = scale q rsqrt(sum q^2 + eps) (the scale folded in: qd = scale qn e needs it
// nowhere else), kn likewise without the scale, a = lb log2 e sigmoid(...) (log2
// units, so that decay_columns needs no multiply before ex2), beta = sigmoid(beta),
// v as bf16. rsqrt, ex2.approx and rcp.approx are single MUFU instructions with no
// slow-path branches. Padded tokens: a = 0, beta = 0 (q = k = v = 0 from the loads).
// The caller's activations, as uniform branches: l2norm 0 (qn = scale q, kn = k),
// gate_id 0 (the softplus gate, GateSlices), gate_id 3 (a = log2 e g_log, read here: see
// load_rows), beta_mode (beta_of).
template <int K, int V, bool kSoftplus>
__device__ __forceinline__ void stage_row_slices(K1Smem<K, V>& sm, const KdaFwdParams& p, const GateSlices<K>& gs,
                                                 const SeqSpan& s, int h, int n, int warp, int lane,
                                                 const RowSlices<K, V>& r) {
  constexpr int G = RowSlices<K, V>::G, GV = RowSlices<K, V>::GV;
  const int c = warp * 4 + lane / 8, f0 = 4 * (lane % 8);
  float sq = 0.f, sk = 0.f;
#pragma unroll
  for (int m = 0; m < G; ++m) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float qf = static_cast<float>(r.q[m][j]), kf = static_cast<float>(r.k[m][j]);
      sq = fmaf(qf, qf, sq);
      sk = fmaf(kf, kf, sk);
    }
  }
#pragma unroll
  for (int off = 1; off < 8; off <<= 1) {  // the row's 8 lanes
    sq += __shfl_xor_sync(kFullMask, sq, off);
    sk += __shfl_xor_sync(kFullMask, sk, off);
  }
  const float rq = (p.l2norm ? rsqrtf(sq + kL2Eps) : 1.0f) * p.scale, rk = p.l2norm ? rsqrtf(sk + kL2Eps) : 1.0f;
  const bool real = c < min(BT, s.len - n * BT);
  const float lb2 = real ? p.lower_bound * kLog2e : 0.f;
#pragma unroll
  for (int m = 0; m < G; ++m) {
    float qn[4], kn[4], av[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      qn[j] = static_cast<float>(r.q[m][j]) * rq;
      kn[j] = static_cast<float>(r.k[m][j]) * rk;
    }
    if (p.gate_id == KDA_GATE_LOG) {  // a (log2 units) = log2 e * the caller's log decay (padded rows: 0)
#pragma unroll
      for (int j = 0; j < 4; ++j) av[j] = 0.f;
      if (real) load_vec(p.g_log + token_row(p, s, n * BT + c, h) * K + 32 * m + f0, av);
#pragma unroll
      for (int j = 0; j < 4; ++j) av[j] *= kLog2e;
    } else if (kSoftplus && p.gate_id == KDA_GATE_SOFTPLUS) {  // a (log2) = min(y, 0) - aexp lg2(1 + 2^(-|y| / aexp))
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float y = fmaf(static_cast<float>(r.g[m][j]), gs.c1, gs.c0[m][j]);
        const float sp = fminf(y, 0.f) - gs.aexp * lg2_approx(1.0f + ex2_approx(-fabsf(y) * gs.inv_aexp));
        av[j] = real ? sp : 0.f;
      }
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
        av[j] = lb2 * rcp_approx(1.0f + ex2_approx(fmaf(static_cast<float>(r.g[m][j]), gs.c1, gs.c0[m][j])));
    }
    store_vec(&sm.qn[c][32 * m + f0], qn);
    store_vec(&sm.kn[c][32 * m + f0], kn);
    store_vec(&sm.a[c][32 * m + f0], av);
  }
#pragma unroll
  for (int m = 0; m < GV; ++m) store_vec(&sm.v[c][32 * m + f0], r.v[m]);
  if (lane % 8 == 0) sm.beta[c] = real ? beta_of<true>(p, static_cast<float>(r.beta)) : 0.f;
}

// exp(glast) of key dimension d is stored at el_index(d): the K/8 values that a
// compute warp's lane multiplies its state rows by (rows d = g + 8 j of the MMA
// fragment, g = lane / 4, j = 0 .. K/8 - 1) lie side by side, so that the lane
// reads them with K/32 16-byte loads (one shared-memory wavefront each: 8 lanes,
// 8 addresses) instead of K/8 single loads.
template <int K>
__device__ __forceinline__ int el_index(int d) {
  return (d % 8) * (K / 8) + d / 8;
}

// Phase 2: one thread per key dimension d (a column of the chunk).
//   gc[c] = a[0] + ... + a[c]   (registers; glast = gc[BT - 1], flat over padded tokens)
//   e = exp(gc) is the only exponential per element: with the bounded gate
//   -80 <= gc <= 0, so 1/e <= e^80 and e^glast / e lie in fp32's normal range.
//   pairwise (any gate a <= 0): 1/e may overflow, so there is no ki, kr takes
//   exp(glast - gc) <= 1 as one exponential of its own, and gc goes back to
//   shared (sm.a, the gate's own rows) for products_pairwise. As needed: both ki
//   and gc (the chunk picks its products after this phase), and the return value
//   says whether this thread's dimensions decay by more than kFactoredRange
//   (glast < -80: then ki may be inf, and the chunk must go pairwise).
//   kd = kn e, ki = kn / e, qd = scale qn e   -> shared (bf16)
//   qd -> out_qd [BT, K] (rows LDQ apart);  kr = kn e^glast / e -> out_krT as kr^T
//   [K, BT] (rows LDKR apart; row d is this thread's 16 values: two 16-byte
//   stores);  exp(glast) -> out_el [K] (at el_index(d)).
//   kFast (the fused kernel, where this phase is on the critical path): a comes
//   in log2 units and qn already scaled (stage_row_slices), e and 1/e are two
//   ex2.approx of +-gc -- about 2e-7 relative error each, far below the bf16
//   rounding (4e-3) that follows -- and the column is done in three passes:
//   every shared load, then the arithmetic, then every store (in one loop over
//   c, each row's loads waited behind the previous row's stores: the compiler
//   cannot tell the ring slot from the scratch). K1 keeps expf and one loop, so
//   that the split path stays bitwise stage 07's. kQdScratch = false: qd goes to
//   out_qd only (products then reads it there).
template <int K, int V, int LDQ, int LDKR, class Pv, bool kFast = false, bool kQdScratch = true>
__device__ __forceinline__ bool decay_columns(K1Smem<K, V>& sm, const KdaFwdParams& p, int tid, bf16* out_qd,
                                              bf16* out_krT, float* out_el) {
  static_assert(LDKR % 8 == 0, "16-byte aligned rows of kr^T");
  constexpr bool pw = Pv::pairwise;  // gc to shared, kr from exp(glast - gc)
  constexpr bool fac = Pv::factored;  // ki = kn / e
  bool wide = false;
#pragma unroll
  for (int d0 = 0; d0 < K; d0 += kThreads) {  // K = 128: once, no loop; K = 64: threads 64-127 idle
    const int d = d0 + tid;
    if (K % kThreads != 0 && d >= K) break;
    uint32_t kr_row[BT / 2];  // row d of kr^T, two bf16 per word (low half = lower c)
    if constexpr (kFast) {
      float av[BT], kv[BT], qv[BT];
#pragma unroll
      for (int c = 0; c < BT; ++c) {
        av[c] = sm.a[c][d];
        kv[c] = sm.kn[c][d];
        qv[c] = sm.qn[c][d];
      }
      float acc = 0.f;
#pragma unroll
      for (int c = 0; c < BT; ++c) {
        acc += av[c];
        av[c] = acc;  // gc (log2 units)
      }
      const float el = ex2_approx(acc);  // exp(glast)
      wide |= acc < -kFactoredRange * kLog2e;
      bf16 kd[BT], ki[BT], qd[BT];
#pragma unroll
      for (int c = 0; c < BT; ++c) {
        const float e = ex2_approx(av[c]);
        float ie = 0.f;
        if constexpr (fac) ie = ex2_approx(-av[c]);
        kd[c] = bf16(kv[c] * e);
        ki[c] = bf16(kv[c] * ie);
        qd[c] = bf16(qv[c] * e);  // qn carries the scale (stage_row_slices)
        float er;  // exp(glast - gc)
        if constexpr (pw) er = ex2_approx(acc - av[c]); else er = el * ie;
        const uint32_t kr_bits = bf16(kv[c] * er).raw();
        kr_row[c / 2] = (c % 2 == 0) ? kr_bits : (kr_row[c / 2] | (kr_bits << 16));
      }
#pragma unroll
      for (int c = 0; c < BT; ++c) {
        sm.kd[c][d] = kd[c];
        if constexpr (pw) sm.a[c][d] = av[c];  // gc (log2 units) for products_pairwise
        if constexpr (fac) sm.ki[c][d] = ki[c];
        if constexpr (kQdScratch) sm.qd[c][d] = qd[c];
        out_qd[c * LDQ + d] = qd[c];
      }
      out_el[el_index<K>(d)] = el;
    } else {
      float gc[BT], acc = 0.f;
#pragma unroll
      for (int c = 0; c < BT; ++c) {
        acc += sm.a[c][d];
        gc[c] = acc;
      }
      const float el = expf(acc);  // exp(glast)
      out_el[el_index<K>(d)] = el;
      wide |= acc < -kFactoredRange;
#pragma unroll
      for (int c = 0; c < BT; ++c) {
        const float e = expf(gc[c]);
        const float knv = sm.kn[c][d];
        sm.kd[c][d] = bf16(knv * e);
        const float ie = 1.0f / e;
        if constexpr (pw) sm.a[c][d] = gc[c];  // for products_pairwise
        if constexpr (fac) sm.ki[c][d] = bf16(knv * ie);
        float er;  // exp(glast - gc)
        if constexpr (pw) er = expf(acc - gc[c]); else er = el * ie;
        const bf16 qdv = bf16(p.scale * sm.qn[c][d] * e);
        if constexpr (kQdScratch) sm.qd[c][d] = qdv;
        out_qd[c * LDQ + d] = qdv;
        const uint32_t kr_bits = bf16(knv * er).raw();
        kr_row[c / 2] = (c % 2 == 0) ? kr_bits : (kr_row[c / 2] | (kr_bits << 16));
      }
    }
    uint4* dst = reinterpret_cast<uint4*>(out_krT + (size_t)d * LDKR);  // 32 bytes of a 16-byte aligned row
    dst[0] = make_uint4(kr_row[0], kr_row[1], kr_row[2], kr_row[3]);
    dst[1] = make_uint4(kr_row[4], kr_row[5], kr_row[6], kr_row[7]);
  }
  return wide;
}

// Whether a chunk forms L and Aqk pair by pair: always (KDA_PRODUCTS_PAIRWISE), never
// (FACTORED), or where one of its key dimensions decays by more than kFactoredRange
// (AS_NEEDED; any_wide is decay_columns' answer ORed over the chunk's threads).
template <class Pv>
__device__ __forceinline__ bool pairwise_here(bool any_wide) {
  if constexpr (Pv::as_needed) return any_wide;
  return Pv::products == KDA_PRODUCTS_PAIRWISE;
}

// Phase 3: L/Aqk products, one warp each (both read ki as B; warps 2-3 wait):
//   warp 0:  L   = strict_lower(beta[:, None] * (kd @ ki^T))  -> shared, fp32
//   warp 1:  Aqk = lower_incl_diag(qd @ ki^T)                 -> out_Aqk (rows LDA apart), bf16
// One warp per 16 x 16 product loads its A operand once (two warps side by side,
// 8 columns each, loaded it twice): shared-memory bandwidth bounds the fused
// kernel, and the warp's two column tiles are independent chains of the same
// length as one.
template <int K, int V, int LDA>
__device__ __forceinline__ void products(K1Smem<K, V>& sm, int tid, const bf16* qd, bf16* out_Aqk) {
  WarpMma mma;
  const int warp = tid / 32, idx = tid % 32;  // warp 0: L, warp 1: Aqk, each loading its A once
  if (warp > 1) return;
  auto thr_mma = mma.get_slice(idx);
  Tensor sKi = smem_rows<BT, K, K + kPad>(&sm.ki[0][0]);          // (BT,K)   (i, d)
  Tensor cC = make_identity_tensor(Shape<Int<BT>, Int<BT>>{});    // (BT,BT)  -> (c, i)
  Tensor tCcC = thr_mma.partition_C(cC);                          // (MMA,MMA_M,MMA_N)
  Tensor acc = thr_mma.partition_fragment_C(cC);                  // (MMA,MMA_M,MMA_N) fp32
  clear(acc);
  if (warp == 0) {
    Tensor sKd = smem_rows<BT, K, K + kPad>(&sm.kd[0][0]);        // (BT,K)   (c, d)
    mma_smem<SM75_U32x2_LDSM_N>(mma, idx, sKd, sKi, acc);         // kd @ ki^T
    Tensor sL = smem_rows<BT, BT, BT>(&sm.L[0][0]);               // (BT,BT)  (c, i)
    Tensor tCsL = thr_mma.partition_C(sL);
    CUTE_UNROLL
    for (int e = 0; e < size(acc); ++e) {
      const int c = get<0>(tCcC(e)), i = get<1>(tCcC(e));
      tCsL(e) = (c > i) ? sm.beta[c] * acc(e) : 0.f;
    }
  } else {
    Tensor sQd = smem_rows<BT, K, K + kPad>(qd);                  // (BT,K)   (c, d)
    mma_smem<SM75_U32x2_LDSM_N>(mma, idx, sQd, sKi, acc);         // qd @ ki^T
    Tensor gA = make_tensor(make_gmem_ptr(out_Aqk),
                            make_layout(Shape<Int<BT>, Int<BT>>{}, make_stride(Int<LDA>{}, _1{})));  // (BT,BT)
    Tensor tCgA = thr_mma.partition_C(gA);
    CUTE_UNROLL
    for (int e = 0; e < size(acc); ++e) {
      const int c = get<0>(tCcC(e)), j = get<1>(tCcC(e));
      tCgA(e) = bf16((j <= c) ? acc(e) : 0.f);
    }
  }
}

// One level of products_pairwise's reduce-scatter over a warp: a lane keeps the half of
// its 2 * OFF values whose index bit OFF matches its own lane bit, sends the other half to
// its partner (lane ^ OFF, which keeps that one) and adds what the partner sends. After the
// levels 16, 8, 4, 2, 1, lane l holds the warp's total of value l in acc[0]. The halves are
// chosen with selp (inline PTX): written as a C++ select between two array elements, the
// compiler turns it into an indexed load, which puts the whole array in local memory.
__device__ __forceinline__ float select_f(bool c, float a, float b) {
  float r;
  asm("{\n .reg .pred p;\n setp.ne.b32 p, %1, 0;\n selp.f32 %0, %2, %3, p;\n}" : "=f"(r) : "r"((int)c), "f"(a), "f"(b));
  return r;
}
template <int OFF>
__device__ __forceinline__ void reduce_scatter_level(float (&acc)[32], int lane) {
  const bool up = (lane & OFF) != 0;
#pragma unroll
  for (int x = 0; x < OFF; ++x) {
    const float lo = acc[x], hi = acc[x + OFF];
    const float send = select_f(up, lo, hi), keep = select_f(up, hi, lo);
    acc[x] = keep + __shfl_xor_sync(kFullMask, send, OFF);
  }
}

// Phase 3, pairwise (p.pairwise: any gate a <= 0, the softplus gate's): L and Aqk pair
// by pair in fp32, each pair's decay taken inside its own span of tokens:
//   L[i, j]   = beta_i sum_d kn_i kn_j exp(gc_i - gc_j)    -> shared, fp32   (i > j)
//   Aqk[i, j] = scale sum_d qn_i kn_j exp(gc_i - gc_j)     -> out_Aqk, bf16  (i >= j)
// exp(gc_i - gc_j) <= 1 for i >= j (a <= 0), whereas the factored form's ki = kn exp(-gc_j)
// overflows fp32 once the chunk has decayed by more than 88 (the softplus gate at A_log = 3
// gives a down to -400 per token). The lower triangle is cut into 4 x 4 tiles. An
// off-diagonal tile (rows 4I.., columns 4J.., I > J) factors through its first row r = 4I:
//   exp(gc_i - gc_j) = exp(gc_i - gc_r) exp(gc_r - gc_j),   both <= 1 since j < r <= i
// (FLA's reference point per sub-chunk, at 4 tokens): 7 exponentials per feature for 16
// pairs. A diagonal tile takes exp(gc_i - gc_j) directly for its 6 pairs below the diagonal.
// Warp w takes tiles w, w + 4, w + 8 of the 10; lane l the features d = l, l + 32, ...
// (scalar loads, conflict-free); each lane sums its features' products for the tile's
// 16 pairs x {L, Aqk} = 32 values, and a reduce-scatter over the warp (reduce_scatter_level:
// 31 shuffles, where a butterfly per value would take 160) leaves value l's total on lane l,
// which stores it.
// kFast (the fused prepare): gc in log2 units and qn already scaled; else (K1) natural
// units, expf, and the scale here.
template <int K, int V, int LDA, bool kFast>
__device__ __forceinline__ void products_pairwise(K1Smem<K, V>& sm, const KdaFwdParams& p, int tid, bf16* out_Aqk) {
  constexpr int kTiles = 10;
  constexpr unsigned long long kTileI = 0x3210332321ull, kTileJ = 0x3210211000ull;  // tile t: nibble t
  const int warp = tid / 32, lane = tid % 32;
  const float qscale = kFast ? 1.0f : p.scale;
  auto ex = [](float x) { return kFast ? ex2_approx(x) : expf(x); };
  for (int e = tid; e < BT * BT; e += kThreads) {  // Aqk's tiles above the diagonal: zero
    const int i = e / BT, j = e % BT;
    if (j / 4 > i / 4) out_Aqk[i * LDA + j] = bf16(0.f);
  }
  for (int t = warp; t < kTiles; t += kThreads / 32) {
    const int I = (int)((kTileI >> (4 * t)) & 15), J = (int)((kTileJ >> (4 * t)) & 15);
    float acc[32];  // [which][ii][jj]: which 0 = L, 1 = Aqk
#pragma unroll
    for (int x = 0; x < 32; ++x) acc[x] = 0.f;
#pragma unroll(kFast ? 1 : K / 32)
    for (int dd = 0; dd < K / 32; ++dd) {  // row by row: few values live beside the 32 sums (the fused
                                           // kernel's loop not unrolled: its 128 registers hold no more)
      const int d = 32 * dd + lane;
      float gj[4], kj[4];
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        gj[x] = sm.a[4 * J + x][d];
        kj[x] = sm.kn[4 * J + x][d];
      }
      if (I != J) {  // through the reference row r = 4I (uniform over the warp)
        const float gr = sm.a[4 * I][d];
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) kj[jj] *= ex(gr - gj[jj]);  // exp(gc_r - gc_j) <= 1
#pragma unroll
        for (int ii = 0; ii < 4; ++ii) {
          const float fi = ii == 0 ? 1.0f : ex(sm.a[4 * I + ii][d] - gr);  // exp(gc_i - gc_r) <= 1
          const float ki = sm.kn[4 * I + ii][d] * fi, qi = sm.qn[4 * I + ii][d] * fi;
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            acc[ii * 4 + jj] = fmaf(ki, kj[jj], acc[ii * 4 + jj]);
            acc[16 + ii * 4 + jj] = fmaf(qi, kj[jj], acc[16 + ii * 4 + jj]);
          }
        }
      } else {  // the diagonal tile (rows = columns): each pair below the diagonal its own exponential
#pragma unroll
        for (int ii = 0; ii < 4; ++ii) {
          const float qi = sm.qn[4 * I + ii][d];
#pragma unroll
          for (int jj = 0; jj <= ii; ++jj) {
            const float kjf = jj == ii ? kj[jj] : kj[jj] * ex(gj[ii] - gj[jj]);
            acc[ii * 4 + jj] = fmaf(kj[ii], kjf, acc[ii * 4 + jj]);
            acc[16 + ii * 4 + jj] = fmaf(qi, kjf, acc[16 + ii * 4 + jj]);
          }
        }
      }
    }
    reduce_scatter_level<16>(acc, lane);
    reduce_scatter_level<8>(acc, lane);
    reduce_scatter_level<4>(acc, lane);
    reduce_scatter_level<2>(acc, lane);
    reduce_scatter_level<1>(acc, lane);
    const int i = 4 * I + ((lane >> 2) & 3), j = 4 * J + (lane & 3);
    if (lane < 16) {
      if (i > j) sm.L[i][j] = sm.beta[i] * acc[0];
    } else {
      out_Aqk[i * LDA + j] = bf16(i >= j ? qscale * acc[0] : 0.f);
    }
  }
}

// Phase 4: the inverse X = (I + L)^-1, unit lower triangular, fp32, by warp 0:
//   (I + L) X = I  =>  X[c, i] = [c == i] - sum_{m < c} L[c, m] X[m, i]
//   Lane i (< 16) keeps column i of X in registers (x[0..15]; the loops are fully
//   unrolled, so every index is a compile-time constant) and reads row c of L as
//   a shared-memory broadcast (all lanes, one address). Rows c < i come out 0 and
//   row i comes out 1 by themselves. Af[c, i] = X[c, i] * beta[i] leaves straight
//   from the registers as bf16; with halves also its rounding error as a second bf16,
//   Afl = X * beta - Af, so that Af + Afl carries X * beta to about 2^-17 (w_u).
template <bool kHalves, int K, int V>
__device__ __forceinline__ void invert(K1Smem<K, V>& sm, int lane) {
  const int i = lane & (BT - 1);  // lanes 16-31 repeat lanes 0-15 and store nothing
  float x[BT];
#pragma unroll
  for (int c = 0; c < BT; ++c) {
    float s = (c == i) ? 1.f : 0.f;
#pragma unroll
    for (int m = 0; m < c; ++m) s -= sm.L[c][m] * x[m];
    x[c] = s;
  }
  if (lane < BT) {
    const float bi = sm.beta[i];
#pragma unroll
    for (int c = 0; c < BT; ++c) {
      const float y = x[c] * bi;
      const bf16 hi = bf16(y);
      sm.Af[c][i] = hi;
      if constexpr (kHalves) sm.Afl[c][i] = bf16(y - float(hi));
    }
  }
}

// Phase 5: w = Af @ kd -> out_w bf16 [BT, K] (rows LDW apart);  u = Af @ v -> fp32,
//   columns u_col0 .. u_col0 + UC - 1 of it to out_u [BT, UC] (UC = V: all of them).
//   With halves u = Af @ v + Afl @ v: one more MMA per tile, and u (which every state
//   update is built from, vcorr = u - w @ S) no longer carries Af's bf16 rounding; w
//   keeps Af alone (its rounding moves the errors little: PERF_NOTES, outcome 19).
//   C(c, d) = sum_j Af(c, j) kd(j, d): the B operand is kd viewed as (d, j) -- the
//   transposed layout of the same shared array (likewise v). Straight from the
//   accumulators to the destination (rows of padded tokens are zero: Af's rows and
//   columns there are zero since beta = 0).
template <int K, int V, int LDW, int UC, bool kHalves>
__device__ __forceinline__ void w_u(K1Smem<K, V>& sm, int tid, bf16* out_w, float* out_u, int u_col0) {
  TiledMma4 mma;
  auto thr_mma = mma.get_slice(tid);
  Tensor sAf = smem_rows<BT, BT, BT + kPad>(&sm.Af[0][0]);     // (BT,BT)  (c, j)
  Tensor sKdT = smem_cols<BT, K, K + kPad>(&sm.kd[0][0]);      // (K,BT)   (d, j)
  Tensor sVT = smem_cols<BT, V, V + kPad>(&sm.v[0][0]);        // (V,BT)   (vd, j)

  Tensor gWt = make_tensor(make_gmem_ptr(out_w),
                           make_layout(Shape<Int<BT>, Int<K>>{}, make_stride(Int<LDW>{}, _1{})));  // (BT,K)
  Tensor accW = thr_mma.partition_fragment_C(gWt);            // (MMA,MMA_M,MMA_N)
  clear(accW);
  mma_smem<SM75_U16x4_LDSM_T>(mma, tid, sAf, sKdT, accW);
  Tensor tCgW = thr_mma.partition_C(gWt);
  CUTE_UNROLL
  for (int e = 0; e < size(accW); ++e) tCgW(e) = bf16(accW(e));

  Tensor cU = make_identity_tensor(Shape<Int<BT>, Int<V>>{});  // (BT,V) -> (c, vd)
  Tensor tCcU = thr_mma.partition_C(cU);
  Tensor accU = thr_mma.partition_fragment_C(cU);             // (MMA,MMA_M,MMA_N)
  clear(accU);
  mma_smem<SM75_U16x4_LDSM_T>(mma, tid, sAf, sVT, accU);
  if constexpr (kHalves) mma_smem<SM75_U16x4_LDSM_T>(mma, tid, smem_rows<BT, BT, BT + kPad>(&sm.Afl[0][0]), sVT, accU);
  CUTE_UNROLL
  for (int e = 0; e < size(accU); ++e) {
    const int c = get<0>(tCcU(e)), vd = get<1>(tCcU(e)) - u_col0;
    if (UC == V || (vd >= 0 && vd < UC)) out_u[c * UC + vd] = accU(e);
  }
}

// ---------------------------------------------------------------------------
// kda_prepare_kernel -- the five phases for one chunk per block (the split path).
// grid = NH*NC blocks (block = bh * NC + m: chunk n0 + m of the segment, of every
// sequence), block = 128 threads, dynamic smem = sizeof(K1Smem). Writes the chunk's
// slot of qd, w, krT, Aqk, u, el; a block whose chunk lies past its sequence's end
// (the segment covers the longest sequence) returns at once and writes nothing.
// Pv (Prep): how L and Aqk are formed and u is rounded, chosen once per call by the launcher.
// Profile: thread 0, slot = bh * NT + n (one per chunk of the longest sequence), regions K1_*.
// ---------------------------------------------------------------------------
template <int K, int V, class Pv>
__global__ void __launch_bounds__(kThreads) kda_prepare_kernel(const __grid_constant__ KdaFwdParams p) {
  static_assert(K % 32 == 0 && V % 32 == 0, "K, V multiples of 32");
  extern __shared__ __align__(16) unsigned char kda_smem[];
  K1Smem<K, V>& sm = *reinterpret_cast<K1Smem<K, V>*>(kda_smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int bh = (int)(blockIdx.x / p.NC), m = (int)(blockIdx.x % p.NC), n = p.n0 + m;  // chunk n of the segment
  const int h = bh % p.H;
  const SeqSpan s = seq_span(p, bh / p.H);         // sequence bh / H
  if (n * BT >= s.len) return;                     // past the sequence's end (the whole block: uniform)
  const size_t slot = (size_t)bh * p.NC + m;       // the chunk's workspace slot (one segment)
  const int prof_slot = bh * p.NT + n;             // profile: one slot per chunk of the longest sequence
  (void)prof_slot;
  KDA_PROF_START(tp);

  RawRows<K, V> raw;
  load_rows(p, s, h, n, warp, lane, raw);
  stage_rows<K, V, Pv::unbounded>(sm, p, gate_params<K>(p, h, lane), s, h, n, warp, lane, raw);
  __syncthreads();
  bf16* const qd_out = reinterpret_cast<bf16*>(p.qd) + slot * BT * K;
  bf16* const krT_out = reinterpret_cast<bf16*>(p.krT) + slot * K * BT;
  float* const el_out = p.el + slot * K;
  const bool wide = decay_columns<K, V, K, BT, Pv>(sm, p, tid, qd_out, krT_out, el_out);
  bool any_wide = false;  // the chunk's decay, over its key dimensions (as needed only)
  if constexpr (Pv::as_needed) any_wide = __syncthreads_or(wide); else __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, prof_slot, KDA_REG_K1_PRE, tp);
  bf16* const aqk_out = reinterpret_cast<bf16*>(p.Aqk) + slot * BT * BT;
  if constexpr (Pv::pairwise) {
    if (pairwise_here<Pv>(any_wide)) products_pairwise<K, V, BT, false>(sm, p, tid, aqk_out);
    else if constexpr (Pv::factored) products<K, V, BT>(sm, tid, &sm.qd[0][0], aqk_out);
  } else {
    products<K, V, BT>(sm, tid, &sm.qd[0][0], aqk_out);
  }
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, prof_slot, KDA_REG_K1_PRODUCTS, tp);
  if (warp == 0) invert<Pv::u_halves>(sm, lane);
  __syncthreads();
  if (tid == 0) KDA_PROF_LAP(p.prof, prof_slot, KDA_REG_K1_INVERSE, tp);
  w_u<K, V, K, V, Pv::u_halves>(sm, tid, reinterpret_cast<bf16*>(p.w) + slot * BT * K, p.u + slot * BT * V, 0);
  if (tid == 0) KDA_PROF_LAP(p.prof, prof_slot, KDA_REG_K1_WU, tp);
}

}  // namespace kda_stage
