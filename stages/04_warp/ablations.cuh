// ablations.cuh -- stage 04's ablation switches: what each build of stage.py's
// ABLATIONS compiles INSTEAD of one idea of this stage. The stage's own code is
// kda.cu; read this file only to see what an ablation measures. Each switch turns
// ONE idea off and does what stage 03 did for that part; the others stay on:
//
//   KDA_NO_WARP_CHUNK        the chunk-parallel kernels run stage 03's mapping and
//                            per-chunk code: one block per (b, h), one THREAD per
//                            chunk (pre_chunk_thread ... bwd_pre_chunk_thread and
//                            their kernels), not one warp per chunk
//   KDA_NO_COLUMN_THREADS    the recurrences run one thread per (b, h) that carries
//                            the whole K x V state (recur_head, bwd_recur_head),
//                            not one thread per value column
//   KDA_NO_PRECOMPUTE        kda_pre writes no kd, qd, kr, exp(glast); every use
//                            re-evaluates its exp() (stage 03), in the recurrences on
//                            each of the V threads (recur_column_recompute,
//                            bwd_recur_column_recompute, w_term_recompute,
//                            bwd_wy_gated_recompute)
//   KDA_NO_BWD_CHUNK_STATES  the reverse recurrence carries ONE dS in place (no
//                            dstates per chunk) and computes the sums over value
//                            columns (dEL, dkr, dqd, dw, dAqk) inside the serial
//                            chain (bwd_recur_block, bwd_sums_chunk), as stage 03
//                            did; kda_bwd_wy only does the rest (bwd_wy_dv)
// The switches also combine (all four together: stage 03's thread mapping and
// per-chunk code on stage 04's workspace); stage.py lists them one at a time.
//
// Not a header of its own: kda.cu includes it inside its anonymous namespace,
// after the small helpers (tok, wrow, wmat, wvec, chunk_len, gate_fwd, gate_bwd,
// kSlots, kNoPrecompute, ...). Most of it compiles only in its switch's builds,
// where its kernels replace kda.cu's kernels of the same name (kda.cu leaves
// those out with #if). The three functions that kda.cu's warp-per-chunk code calls
// from an `if constexpr (kNoPrecompute)` or `(kNoBwdChunkStates)` branch
// (w_term_recompute, bwd_wy_gated_recompute, bwd_wy_dv) compile wherever their
// caller does; the default build discards those branches, so they never run there.
// These take the caller's locals (sizes and row pointers) rather than the params,
// so that they compile to the code that stood inline before.

// ===========================================================================
// Shared by KDA_NO_WARP_CHUNK and KDA_NO_BWD_CHUNK_STATES
// ===========================================================================

#if defined(KDA_NO_BWD_CHUNK_STATES) || defined(KDA_NO_WARP_CHUNK)
// The sums over value columns of chunk n of head bh, stage 03's
// steps 2-6 of its reverse recurrence, with S = S_n and dS = dL/dS_{n+1}:
//   dEL[d]   = dS[d] . S[d]          dkr[c,d] = vcorr[c] . dS[d]
//   dqd[c,d] = do[c] . S[d]  (real c)   dw[c,d]  = -du[c] . S[d]
//   dAqk[c,j] = do[c] . vcorr[j]  (j <= c, real c), 0 elsewhere
// Each output element is one serial sum over vd (stage 03's order); the elements
// are split over `nthr` threads, thread `tid` taking e = tid, tid + nthr, ...
// Called by one thread per chunk (KDA_NO_WARP_CHUNK: from kda_bwd_wy) or, inside
// the serial chain, by the thread (KDA_NO_COLUMN_THREADS) or whole block
// (KDA_NO_BWD_CHUNK_STATES) of the reverse recurrence.
__device__ __forceinline__ void bwd_sums_chunk(const KdaBwdParams& p, int bh, int n, const float* S,
                                               const float* dS, int tid, int nthr) {
  const KdaFwdParams& f = p.f;
  const int K = f.K, V = f.V, BT = f.BT, b = bh / f.H, h = bh % f.H;
  const int base = n * BT, len = chunk_len(f, n);
  const size_t r0 = wrow(f, bh, base);
  const float* vcorr = f.vcorr + r0 * V;  // [BT, V]
  const float* du = p.du + r0 * V;        // [BT, V]
  const float* dout = p.dout + tok(f, b, base, h) * V;  // row c at dout[c * H * V] (c < len)
  const size_t dstride = (size_t)f.H * V;
  float* dw = p.dw + r0 * K;              // [BT, K]
  float* dqd = p.dqd + r0 * K;            // [BT, K]
  float* dkr = p.dkr + r0 * K;            // [BT, K]
  float* dEL = p.dEL + wvec(f, bh, n);    // [K]
  float* dA = p.dAqk + wmat(f, bh, n);    // [BT, BT]

  // dEL = rowsum(dS * S)
  for (int d = tid; d < K; d += nthr) {
    float acc = 0.f;
    for (int vd = 0; vd < V; ++vd) acc += dS[d * V + vd] * S[d * V + vd];
    dEL[d] = acc;
  }
  // dkr = vcorr @ dS^T,  dqd = do @ S^T (real c),  dw = -du @ S^T
  for (int e = tid; e < BT * K; e += nthr) {
    const int c = e / K, d = e - c * K;
    float akr = 0.f, aq = 0.f, aw = 0.f;
    for (int vd = 0; vd < V; ++vd) {
      akr += vcorr[c * V + vd] * dS[d * V + vd];
      if (c < len) aq += dout[c * dstride + vd] * S[d * V + vd];
      aw -= du[c * V + vd] * S[d * V + vd];
    }
    dkr[e] = akr;
    dqd[e] = aq;
    dw[e] = aw;
  }
  // dAqk[c,j] = do[c] . vcorr[j]  (j <= c, real c), 0 elsewhere
  for (int e = tid; e < BT * BT; e += nthr) {
    const int c = e / BT, j = e - c * BT;
    float acc = 0.f;
    if (j <= c && c < len)
      for (int vd = 0; vd < V; ++vd) acc += dout[c * dstride + vd] * vcorr[j * V + vd];
    dA[e] = acc;
  }
}
#endif

// ===========================================================================
// KDA_NO_WARP_CHUNK: stage 03's thread per chunk
// ===========================================================================
#ifdef KDA_NO_WARP_CHUNK

// Pre-stage of chunk n, one thread (stage 03's pre_chunk): l2norm of q and k,
// sigmoid(beta), gate a and its within-chunk cumulative sum, plus (stage 04) kd,
// qd, then kr and el once glast is known. Padded tokens get q = k = 0, beta = 0, a = 0.
__device__ __forceinline__ void pre_chunk_thread(const KdaFwdParams& p, int bh, int n) {
  const int K = p.K, b = bh / p.H, h = bh % p.H;
  const float aexp = expf(p.A_log[h]);
  const float* dtb = p.dt_bias + (size_t)h * K;  // [K]
  const int len = chunk_len(p, n);
  for (int c = 0; c < p.BT; ++c) {
    const int t = n * p.BT + c;
    const size_t r = wrow(p, bh, t);
    float* qn = p.qn + r * K;  // [K]
    float* kn = p.kn + r * K;  // [K]
    double* gc = p.gc + r * K;  // [K]
#ifndef KDA_NO_PRECOMPUTE
    float* kd = p.kd + r * K;  // [K]
    float* qd = p.qd + r * K;  // [K]
#endif
    const double* gprev = c > 0 ? gc - K : nullptr;  // previous token of the chunk
    if (c < len) {
      const size_t x = tok(p, b, t, h);
      const float* qi = p.q + x * K;
      const float* ki = p.k + x * K;
      const float* gi = p.g + x * K;
      float sq = 0.f, sk = 0.f;
      for (int d = 0; d < K; ++d) {
        sq += qi[d] * qi[d];
        sk += ki[d] * ki[d];
      }
      const float rq = 1.0f / sqrtf(sq + kL2Eps);
      const float rk = 1.0f / sqrtf(sk + kL2Eps);
      p.rq[r] = rq;
      p.rk[r] = rk;
      for (int d = 0; d < K; ++d) {
        qn[d] = qi[d] * rq;
        kn[d] = ki[d] * rk;
        const float a = gate_fwd(gi[d] + dtb[d], aexp, p.gate_id, p.lower_bound);
        gc[d] = (c > 0 ? gprev[d] : 0.0) + a;
#ifndef KDA_NO_PRECOMPUTE
        const float e = decay(gc[d]);
        kd[d] = kn[d] * e;
        qd[d] = p.scale * qn[d] * e;
#endif
      }
      p.beta_s[r] = sigmoid_f(p.beta[x]);
    } else {  // padded token: contributes nothing, the gate sum stays flat
      p.rq[r] = 0.f;
      p.rk[r] = 0.f;
      for (int d = 0; d < K; ++d) {
        qn[d] = 0.f;
        kn[d] = 0.f;
        gc[d] = gprev[d];  // c >= 1 here: chunk n always starts with a real token
#ifndef KDA_NO_PRECOMPUTE
        kd[d] = 0.f;
        qd[d] = 0.f;
#endif
      }
      p.beta_s[r] = 0.f;
    }
  }
#ifndef KDA_NO_PRECOMPUTE
  // glast = gc of the chunk's last row:  el = exp(glast),  kr = kn * exp(glast - gc)
  const size_t r0 = wrow(p, bh, n * p.BT);
  const float* kn = p.kn + r0 * K;  // [BT, K]
  const double* gc = p.gc + r0 * K;  // [BT, K]
  const double* glast = gc + (size_t)(p.BT - 1) * K;  // [K]
  float* kr = p.kr + r0 * K;          // [BT, K]
  float* el = p.el + wvec(p, bh, n);  // [K]
  for (int d = 0; d < K; ++d) el[d] = decay(glast[d]);
  for (int c = 0; c < p.BT; ++c)
    for (int d = 0; d < K; ++d) kr[c * K + d] = kn[c * K + d] * decay(glast[d], gc[c * K + d]);
#endif
}

// WY transform of chunk n, one thread (stage 03's wy_chunk; w reads the precomputed kd):
//   L[c,i] = beta[c] * sum_d kn[c,d] kn[i,d] exp(gc[c,d] - gc[i,d])   (i < c)
//   X = (I + L)^-1 by forward substitution, Af = X * beta[None, :]
//   w = Af @ kd,  u = Af @ v
__device__ __forceinline__ void wy_chunk_thread(const KdaFwdParams& p, int bh, int n) {
  const int K = p.K, V = p.V, BT = p.BT, b = bh / p.H, h = bh % p.H;
  const int base = n * BT, len = chunk_len(p, n);
  const size_t r0 = wrow(p, bh, base);
  const float* kn = p.kn + r0 * K;      // [BT, K]
  const double* gc = p.gc + r0 * K;     // [BT, K]
#ifndef KDA_NO_PRECOMPUTE
  const float* kd = p.kd + r0 * K;      // [BT, K]
#endif
  const float* bs = p.beta_s + r0;      // [BT]
  float* X = p.X + wmat(p, bh, n);      // [BT, BT]
  float* Af = p.Af + wmat(p, bh, n);    // [BT, BT]
  float* w = p.w + r0 * K;              // [BT, K]
  float* u = p.u + r0 * V;              // [BT, V]

  // 1. X <- L (strict lower part), 1 on the diagonal, 0 above.
  for (int c = 0; c < BT; ++c) {
    for (int i = 0; i < BT; ++i) {
      float val = 0.f;
      if (i < c) {
        float inner = 0.f;
        for (int d = 0; d < K; ++d)
          inner += kn[c * K + d] * kn[i * K + d] * decay(gc[c * K + d], gc[i * K + d]);
        val = bs[c] * inner;
      } else if (i == c) {
        val = 1.f;
      }
      X[c * BT + i] = val;
    }
  }
  // 2. Forward substitution, row by row: (I + L) X = I gives
  //    X[c,i] = -sum_{m=i}^{c-1} L[c,m] X[m,i]   (i < c; X[i,i] = 1).
  //    Rows m < c are final; in row c, entries m > i still hold L[c,m].
  for (int c = 1; c < BT; ++c) {
    for (int i = 0; i < c; ++i) {
      float acc = X[c * BT + i];  // L[c,i] * X[i,i]
      for (int m = i + 1; m < c; ++m) acc += X[c * BT + m] * X[m * BT + i];
      X[c * BT + i] = -acc;
    }
  }
  // 3. Af = X * beta[None, :] (lower triangle incl. diagonal, 0 above).
  for (int c = 0; c < BT; ++c)
    for (int i = 0; i < BT; ++i) Af[c * BT + i] = (i <= c) ? X[c * BT + i] * bs[i] : 0.f;
  // 4. w = Af @ kd, u = Af @ v (v of padded tokens is 0: not read).
  for (int c = 0; c < BT; ++c) {
    for (int d = 0; d < K; ++d) {
      float acc = 0.f;
#ifndef KDA_NO_PRECOMPUTE
      for (int i = 0; i <= c; ++i) acc += Af[c * BT + i] * kd[i * K + d];
#else
      for (int i = 0; i <= c; ++i) acc += Af[c * BT + i] * kn[i * K + d] * decay(gc[i * K + d]);
#endif
      w[c * K + d] = acc;
    }
    const int imax = c < len ? c + 1 : len;  // real tokens i <= c
    for (int vd = 0; vd < V; ++vd) {
      float acc = 0.f;
      for (int i = 0; i < imax; ++i) acc += Af[c * BT + i] * p.v[tok(p, b, base + i, h) * V + vd];
      u[c * V + vd] = acc;
    }
  }
}

// Aqk of chunk n, one thread (stage 03's aqk_chunk):
//   Aqk[c,j] = scale * sum_d qn[c,d] kn[j,d] exp(gc[c,d] - gc[j,d])  (j <= c), 0 above.
__device__ __forceinline__ void aqk_chunk_thread(const KdaFwdParams& p, int bh, int n) {
  const int K = p.K, BT = p.BT;
  const size_t r0 = wrow(p, bh, n * BT);
  const float* qn = p.qn + r0 * K;   // [BT, K]
  const float* kn = p.kn + r0 * K;   // [BT, K]
  const double* gc = p.gc + r0 * K;  // [BT, K]
  float* A = p.Aqk + wmat(p, bh, n); // [BT, BT]
  for (int c = 0; c < BT; ++c) {
    for (int j = 0; j < BT; ++j) {
      float acc = 0.f;
      if (j <= c)
        for (int d = 0; d < K; ++d)
          acc += qn[c * K + d] * kn[j * K + d] * decay(gc[c * K + d], gc[j * K + d]);
      A[c * BT + j] = p.scale * acc;
    }
  }
}

// Adjoint of everything in chunk n that sits before the recurrence, one thread
// (stage 03's bwd_wy_chunk, unchanged): given du, dw, dAqk, dqd, dkr, dEL of the
// chunk, produce the gradients of its tokens' qs = scale * qn, kn, gc and beta
// (dqs, dkn, dgc, dbeta_s) and dv.
//   w = Af @ kd, u = Af @ v:   dAf = dw @ kd^T + du @ v^T (lower incl. diag)
//                              dkd = Af^T @ dw,  dv = Af^T @ du
//   Af = X * beta[None, :]:    dbeta[i] += sum_c dAf[c,i] X[c,i];  dX = dAf * beta[None, :]
//   X = (I + L)^-1:            dL = -X^T @ dX @ X^T  (strict lower part used)
//   L[c,i] = beta[c] * sum_d kn[c,d] kn[i,d] exp(gc[c,d] - gc[i,d])
//   Aqk[c,j] = sum_d qs[c,d] kn[j,d] exp(gc[c,d] - gc[j,d])
//   qd = qs * exp(gc),  kr = kn * exp(glast - gc),  EL = exp(glast),  kd = kn * exp(gc)
__device__ __forceinline__ void bwd_wy_chunk_thread(const KdaBwdParams& p, int bh, int n) {
  const KdaFwdParams& f = p.f;
  const int K = f.K, V = f.V, BT = f.BT, b = bh / f.H, h = bh % f.H;
  const int base = n * BT, len = chunk_len(f, n);
  const size_t r0 = wrow(f, bh, base);
  const float* qn = f.qn + r0 * K;       // [BT, K]
  const float* kn = f.kn + r0 * K;       // [BT, K]
  const double* gc = f.gc + r0 * K;      // [BT, K]
  const float* bs = f.beta_s + r0;       // [BT]
  const float* X = f.X + wmat(f, bh, n);    // [BT, BT]
  const float* Af = f.Af + wmat(f, bh, n);  // [BT, BT]
  const double* glast = gc + (size_t)(BT - 1) * K;  // [K]
  const float* du = p.du + r0 * V;       // [BT, V]
  const float* dw = p.dw + r0 * K;       // [BT, K]
  const float* dqd = p.dqd + r0 * K;     // [BT, K]
  const float* dkr = p.dkr + r0 * K;     // [BT, K]
  const float* dEL = p.dEL + wvec(f, bh, n);    // [K]
  const float* dAqk = p.dAqk + wmat(f, bh, n);  // [BT, BT]
  float* dA = p.dA + wmat(f, bh, n);     // [BT, BT]
  float* tmp = p.tmp + wmat(f, bh, n);   // [BT, BT]
  float* dqs = p.dqs + r0 * K;           // [BT, K]
  float* dkn = p.dkn + r0 * K;           // [BT, K]
  double* dgc = p.dgc + r0 * K;          // [BT, K]
  float* dbs = p.dbeta_s + r0;           // [BT]
  const float* vrow = f.v + tok(f, b, base, h) * V;  // row i at vrow[i * H * V] (i < len)
  float* dvrow = p.dv + tok(f, b, base, h) * V;
  const size_t vstride = (size_t)f.H * V;

  for (int e = 0; e < BT * K; ++e) {
    dqs[e] = 0.f;
    dkn[e] = 0.f;
    dgc[e] = 0.0;
  }
  for (int c = 0; c < BT; ++c) dbs[c] = 0.f;

  // 1. dAf[c,i] = dw[c] . kd[i] + du[c] . v[i]   (i <= c), 0 above
  for (int c = 0; c < BT; ++c)
    for (int i = 0; i < BT; ++i) {
      float acc = 0.f;
      if (i <= c) {
        for (int d = 0; d < K; ++d) acc += dw[c * K + d] * kn[i * K + d] * decay(gc[i * K + d]);
        if (i < len)
          for (int vd = 0; vd < V; ++vd) acc += du[c * V + vd] * vrow[i * vstride + vd];
      }
      dA[c * BT + i] = acc;
    }
  // 2. dkd = Af^T @ dw  ->  kd = kn * exp(gc): dkn += dkd * exp(gc), dgc += dkd * kd
  for (int i = 0; i < BT; ++i)
    for (int d = 0; d < K; ++d) {
      float acc = 0.f;
      for (int c = i; c < BT; ++c) acc += Af[c * BT + i] * dw[c * K + d];
      const float e = decay(gc[i * K + d]);
      dkn[i * K + d] += acc * e;
      dgc[i * K + d] += acc * kn[i * K + d] * e;
    }
  // 3. dv = Af^T @ du  (real tokens; every token belongs to exactly one chunk)
  for (int i = 0; i < len; ++i)
    for (int vd = 0; vd < V; ++vd) {
      float acc = 0.f;
      for (int c = i; c < BT; ++c) acc += Af[c * BT + i] * du[c * V + vd];
      dvrow[i * vstride + vd] = acc;
    }
  // 4. Af = X * beta[None, :]: dbeta[i] += sum_c dAf[c,i] X[c,i]; dA <- dX = dAf * beta[None, :]
  for (int c = 0; c < BT; ++c)
    for (int i = 0; i <= c; ++i) {
      const float gA = dA[c * BT + i];
      dbs[i] += gA * X[c * BT + i];
      dA[c * BT + i] = gA * bs[i];
    }
  // 5. tmp = X^T @ dX: tmp[a,e] = sum_m X[m,a] dX[m,e], nonzero terms m >= max(a, e)
  for (int a = 0; a < BT; ++a)
    for (int e = 0; e < BT; ++e) {
      float acc = 0.f;
      for (int m = (a > e ? a : e); m < BT; ++m) acc += X[m * BT + a] * dA[m * BT + e];
      tmp[a * BT + e] = acc;
    }
  // 6. dL[c,i] = -(tmp @ X^T)[c,i] = -sum_{m<=i} tmp[c,m] X[i,m]   (i < c), then the
  //    adjoint of L[c,i] = beta[c] * inner[c,i]
  for (int c = 1; c < BT; ++c)
    for (int i = 0; i < c; ++i) {
      float dL = 0.f;
      for (int m = 0; m <= i; ++m) dL -= tmp[c * BT + m] * X[i * BT + m];
      float inner = 0.f;
      for (int d = 0; d < K; ++d)
        inner += kn[c * K + d] * kn[i * K + d] * decay(gc[c * K + d], gc[i * K + d]);
      dbs[c] += dL * inner;
      const float dinner = dL * bs[c];
      for (int d = 0; d < K; ++d) {
        const float fcd = decay(gc[c * K + d], gc[i * K + d]);
        const float term = kn[c * K + d] * kn[i * K + d] * fcd;
        dkn[c * K + d] += dinner * kn[i * K + d] * fcd;
        dkn[i * K + d] += dinner * kn[c * K + d] * fcd;
        dgc[c * K + d] += dinner * term;
        dgc[i * K + d] -= dinner * term;
      }
    }
  // 7. Aqk[c,j] = sum_d qs[c,d] kn[j,d] exp(gc[c,d] - gc[j,d])   (j <= c)
  for (int c = 0; c < BT; ++c)
    for (int j = 0; j <= c; ++j) {
      const float gA = dAqk[c * BT + j];
      for (int d = 0; d < K; ++d) {
        const float fcd = decay(gc[c * K + d], gc[j * K + d]);
        const float qs = f.scale * qn[c * K + d];
        const float term = qs * kn[j * K + d] * fcd;
        dqs[c * K + d] += gA * kn[j * K + d] * fcd;
        dkn[j * K + d] += gA * qs * fcd;
        dgc[c * K + d] += gA * term;
        dgc[j * K + d] -= gA * term;
      }
    }
  // 8. qd = qs * exp(gc);  kr = kn * exp(glast - gc)
  for (int c = 0; c < BT; ++c)
    for (int d = 0; d < K; ++d) {
      const float e = decay(gc[c * K + d]);
      dqs[c * K + d] += dqd[c * K + d] * e;
      dgc[c * K + d] += dqd[c * K + d] * f.scale * qn[c * K + d] * e;
      const float fr = decay(glast[d], gc[c * K + d]);
      const float kr = kn[c * K + d] * fr;
      dkn[c * K + d] += dkr[c * K + d] * fr;
      dgc[c * K + d] -= dkr[c * K + d] * kr;
      dgc[(BT - 1) * K + d] += dkr[c * K + d] * kr;
    }
  // 9. EL = exp(glast)
  for (int d = 0; d < K; ++d) dgc[(BT - 1) * K + d] += dEL[d] * decay(glast[d]);
}

// Adjoint of the pre-stage of chunk n, one thread (stage 03's bwd_pre_chunk), real tokens only:
//   gc = cumsum(a) in the chunk:  da = reverse cumsum of dgc (written over dgc, in double)
//   gate:     dg = da * da/dx (x = g + dt_bias),  dA_log term = sum_d da * da/dA_log
//   beta:     dbeta = dbeta_s * s * (1 - s)
//   l2norm:   dq = rq * (dqn - (dqn . qn) qn),  dqn = scale * dqs;  same for k
__device__ __forceinline__ void bwd_pre_chunk_thread(const KdaBwdParams& p, int bh, int n) {
  const KdaFwdParams& f = p.f;
  const int K = f.K, BT = f.BT, b = bh / f.H, h = bh % f.H;
  const int base = n * BT, len = chunk_len(f, n);
  const size_t r0 = wrow(f, bh, base);
  const float* qn = f.qn + r0 * K;    // [BT, K]
  const float* kn = f.kn + r0 * K;    // [BT, K]
  const float* dqs = p.dqs + r0 * K;  // [BT, K]
  const float* dkn = p.dkn + r0 * K;  // [BT, K]
  double* dgc = p.dgc + r0 * K;       // [BT, K] -> da
  const float aexp = expf(f.A_log[h]);
  const float* dtb = f.dt_bias + (size_t)h * K;  // [K]

  // reverse cumsum over the whole (padded) chunk: glast lives in its last row
  for (int d = 0; d < K; ++d) {
    double acc = 0.0;
    for (int c = BT - 1; c >= 0; --c) {
      acc += dgc[c * K + d];
      dgc[c * K + d] = acc;
    }
  }
  for (int c = 0; c < len; ++c) {
    const size_t x = tok(f, b, base + c, h);
    const size_t r = r0 + c;
    const float* gi = f.g + x * K;
    float* dgi = p.dg + x * K;
    double dalog = 0.0;  // summed over K in double
    for (int d = 0; d < K; ++d) {
      float da_dx, da_dalog;
      gate_bwd(gi[d] + dtb[d], aexp, f.gate_id, f.lower_bound, &da_dx, &da_dalog);
      const float da = (float)dgc[c * K + d];  // da to float at its use
      dgi[d] = da * da_dx;
      dalog += da * da_dalog;
    }
    p.dAlog_part[x] = (float)dalog;
    const float s = f.beta_s[r];
    p.dbeta[x] = p.dbeta_s[r] * s * (1.0f - s);
    float sq = 0.f, sk = 0.f;
    for (int d = 0; d < K; ++d) {
      sq += f.scale * dqs[c * K + d] * qn[c * K + d];
      sk += dkn[c * K + d] * kn[c * K + d];
    }
    const float rq = f.rq[r], rk = f.rk[r];
    float* dqi = p.dq + x * K;
    float* dki = p.dk + x * K;
    for (int d = 0; d < K; ++d) {
      dqi[d] = rq * (f.scale * dqs[c * K + d] - sq * qn[c * K + d]);
      dki[d] = rk * (dkn[c * K + d] - sk * kn[c * K + d]);
    }
  }
}

// fwd: pre-stage. qn, kn = l2norm(q, k); beta_s; gc = cumsum_chunk(gate(g + dt_bias)); kd, qd, kr, el.
// grid = B*H blocks of chunk_threads(NT) threads; thread i runs chunks i, i + blockDim, ...
// Profile: each thread times each of its chunks, slot bh*NT + n (as the warps of kda.cu).
__global__ void kda_pre_kernel(const __grid_constant__ KdaFwdParams p) {
  const int bh = blockIdx.x;
  for (int n = threadIdx.x; n < p.NT; n += blockDim.x) {
    KDA_PROF_START(t0);
    pre_chunk_thread(p, bh, n);
    KDA_PROF_LAP(p.prof, (long long)bh * p.NT + n, KDA_REG_FWD_PRE, t0);
  }
}

// fwd: WY transform. X = (I + L)^-1, Af = X * beta, w = Af @ kd, u = Af @ v.
// grid = B*H blocks of chunk_threads(NT) threads, no shared memory. Profile: slot bh*NT + n.
__global__ void kda_wy_kernel(const __grid_constant__ KdaFwdParams p) {
  const int bh = blockIdx.x;
  for (int n = threadIdx.x; n < p.NT; n += blockDim.x) {
    KDA_PROF_START(t0);
    wy_chunk_thread(p, bh, n);
    KDA_PROF_LAP(p.prof, (long long)bh * p.NT + n, KDA_REG_FWD_WY, t0);
  }
}

// fwd: Aqk = lower_incl_diag(qd @ ki^T).
// grid = B*H blocks of chunk_threads(NT) threads. Profile: slot bh*NT + n.
__global__ void kda_aqk_kernel(const __grid_constant__ KdaFwdParams p) {
  const int bh = blockIdx.x;
  for (int n = threadIdx.x; n < p.NT; n += blockDim.x) {
    KDA_PROF_START(t0);
    aqk_chunk_thread(p, bh, n);
    KDA_PROF_LAP(p.prof, (long long)bh * p.NT + n, KDA_REG_FWD_AQK, t0);
  }
}

// bwd: WY/Aqk adjoint. Sums over V (dEL, dkr, dqd, dw, dAqk), dv, and dqs, dkn, dgc, dbeta_s per token.
// grid = B*H blocks of chunk_threads(NT) threads. The thread first does the sums
// over value columns of its chunk (bwd_sums_chunk: stage 04 moved them out of the
// serial chain; with KDA_NO_BWD_CHUNK_STATES too the reverse recurrence did them),
// then the adjoint. Profile: slot bh*NT + n.
__global__ void kda_bwd_wy_kernel(const __grid_constant__ KdaBwdParams p) {
  const KdaFwdParams& f = p.f;
  const int bh = blockIdx.x;
  for (int n = threadIdx.x; n < f.NT; n += blockDim.x) {
    KDA_PROF_START(t0);
#ifndef KDA_NO_BWD_CHUNK_STATES
    const size_t KV = (size_t)f.K * f.V;
    bwd_sums_chunk(p, bh, n, f.states + bh * f.state_bh_stride + n * f.state_chunk_stride,  // S_n
                   p.dstates + ((size_t)bh * (f.NT + 1) + n + 1) * KV, 0, 1);           // dL/dS_{n+1}
#endif
    bwd_wy_chunk_thread(p, bh, n);
    KDA_PROF_LAP(p.prof, (long long)bh * f.NT + n, KDA_REG_BWD_WY, t0);
  }
}

// bwd: pre-stage adjoint. dq, dk, dg, dbeta, per-token dA_log terms.
// grid = B*H blocks of chunk_threads(NT) threads. Profile: slot bh*NT + n.
__global__ void kda_bwd_pre_kernel(const __grid_constant__ KdaBwdParams p) {
  const int bh = blockIdx.x;
  for (int n = threadIdx.x; n < p.f.NT; n += blockDim.x) {
    KDA_PROF_START(t0);
    bwd_pre_chunk_thread(p, bh, n);
    KDA_PROF_LAP(p.prof, (long long)bh * p.f.NT + n, KDA_REG_BWD_PRE, t0);
  }
}

// Threads per block of stage 03's thread-per-chunk kernels: NT rounded
// up to a whole warp, capped at 256 (a thread then loops over chunks n, n + 256, ...).
unsigned chunk_threads(int NT) {
  const int t = (NT + 31) / 32 * 32;
  return (unsigned)(t < 256 ? t : 256);
}
// Launch shape of the chunk-parallel kernels: one block per (b, h) of
// chunk_threads(NT) threads, no dynamic smem (kda_wy_kernel builds X in place in
// global memory).
dim3 chunk_grid(int B, int H, int /*NT*/) { return dim3((unsigned)(B * H)); }
dim3 chunk_block(int NT) { return dim3(chunk_threads(NT)); }
size_t wy_smem_bytes(int /*BT*/) { return 0; }
#endif  // KDA_NO_WARP_CHUNK

// ===========================================================================
// KDA_NO_COLUMN_THREADS: stage 03's one thread per (b, h)
// ===========================================================================
#ifdef KDA_NO_COLUMN_THREADS

// The serial chain of head bh on ONE thread (stage 03's recur_head; the products
// read the precomputed qd, kr, el), for n = 0 .. NT-1, with S = S_n ([K, V]):
//   vcorr = u - w @ S
//   o     = qd @ S + Aqk @ vcorr                    (skipped when p.o == nullptr)
//   S_{n+1} = diag(exp(glast)) S + kr^T @ vcorr
// Each element is summed in the same order as by the column threads (kda.cu).
// S_0 = h0 (or 0). Each S_{n+1} element depends only on the same element of S_n,
// so the forward can update one [K, V] buffer in place (state_chunk_stride = 0).
__device__ __forceinline__ void recur_head(const KdaFwdParams& p, int bh) {
  const int K = p.K, V = p.V, BT = p.BT, b = bh / p.H, h = bh % p.H;
  float* S0 = p.states + bh * p.state_bh_stride;  // S_0 of this head, [K, V]
  const float* h0 = p.h0 ? p.h0 + (size_t)bh * K * V : nullptr;
  for (int e = 0; e < K * V; ++e) S0[e] = h0 ? h0[e] : 0.f;

  for (int n = 0; n < p.NT; ++n) {
    const int base = n * BT, len = chunk_len(p, n);
    const size_t r0 = wrow(p, bh, base);
    const float* S = S0 + n * p.state_chunk_stride;      // S_n      [K, V]
    float* Snext = S0 + (n + 1) * p.state_chunk_stride;  // S_{n+1}  [K, V] (may alias S)
    const float* w = p.w + r0 * K;     // [BT, K]
#ifndef KDA_NO_PRECOMPUTE
    const float* qd = p.qd + r0 * K;   // [BT, K]
    const float* kr = p.kr + r0 * K;   // [BT, K]
    const float* el = p.el + wvec(p, bh, n);  // [K]
#else
    const float* qn = p.qn + r0 * K;   // [BT, K]
    const float* kn = p.kn + r0 * K;   // [BT, K]
    const double* gc = p.gc + r0 * K;  // [BT, K]
    const double* glast = gc + (size_t)(BT - 1) * K;  // [K]
#endif
    const float* u = p.u + r0 * V;     // [BT, V]
    float* vcorr = p.vcorr + r0 * V;   // [BT, V]
    const float* A = p.Aqk + wmat(p, bh, n);  // [BT, BT]

    // 1. vcorr = u - w @ S
    for (int c = 0; c < BT; ++c)
      for (int vd = 0; vd < V; ++vd) {
        float acc = u[c * V + vd];
        for (int d = 0; d < K; ++d) acc -= w[c * K + d] * S[d * V + vd];
        vcorr[c * V + vd] = acc;
      }
    // 2. o = qd @ S + Aqk @ vcorr, real tokens only
    if (p.o != nullptr)
      for (int c = 0; c < len; ++c) {
        float* orow = p.o + tok(p, b, base + c, h) * V;  // [V]
        for (int vd = 0; vd < V; ++vd) {
          float acc = 0.f;
#ifndef KDA_NO_PRECOMPUTE
          for (int d = 0; d < K; ++d) acc += qd[c * K + d] * S[d * V + vd];
#else
          for (int d = 0; d < K; ++d) acc += p.scale * qn[c * K + d] * decay(gc[c * K + d]) * S[d * V + vd];
#endif
          for (int j = 0; j <= c; ++j) acc += A[c * BT + j] * vcorr[j * V + vd];
          orow[vd] = acc;
        }
      }
    // 3. S_{n+1} = diag(exp(glast)) S + kr^T @ vcorr
    for (int d = 0; d < K; ++d) {
#ifndef KDA_NO_PRECOMPUTE
      const float eld = el[d];
#else
      const float eld = decay(glast[d]);
#endif
      for (int vd = 0; vd < V; ++vd) {
        float acc = eld * S[d * V + vd];
#ifndef KDA_NO_PRECOMPUTE
        for (int c = 0; c < BT; ++c) acc += kr[c * K + d] * vcorr[c * V + vd];
#else
        for (int c = 0; c < BT; ++c) acc += kn[c * K + d] * decay(glast[d], gc[c * K + d]) * vcorr[c * V + vd];
#endif
        Snext[d * V + vd] = acc;
      }
    }
  }
}

// The serial reverse chain of head bh on ONE thread (stage 03's bwd_recur_head
// loop order; each element summed as by the column threads of kda.cu):
//   du[c,vd] = kr[c] . dS'[:, vd] + sum_{j>=c} Aqk[j,c] do[j,vd]      (= dvcorr)
//   dS_n     = diag(exp(glast)) dS' + qd^T @ do - w^T @ du
// with dS' = dL/dS_{n+1}. Per-chunk states (stage 04): dS_n goes to slot n of
// dstates and kda_bwd_wy does the sums over V. With KDA_NO_BWD_CHUNK_STATES too
// (stage 03): one dS carried in place in slot 0, sums over V done here (bwd_sums_chunk).
__device__ __forceinline__ void bwd_recur_head(const KdaBwdParams& p, int bh) {
  const KdaFwdParams& f = p.f;
  const int K = f.K, V = f.V, BT = f.BT, NT = f.NT, b = bh / f.H, h = bh % f.H;
  const size_t KV = (size_t)K * V;
  float* dS0 = p.dstates + (size_t)bh * (NT + 1) * KV;  // slot n: dL/dS_n, [K, V]
  const float* dht = p.dht ? p.dht + (size_t)bh * KV : nullptr;
#ifndef KDA_NO_BWD_CHUNK_STATES
  float* dSlast = dS0 + NT * KV;  // slot NT: dL/dS_NT = dht
#else
  float* dSlast = dS0;            // the one carried dS
#endif
  for (size_t e = 0; e < KV; ++e) dSlast[e] = dht ? dht[e] : 0.f;

  for (int n = NT - 1; n >= 0; --n) {
    const int base = n * BT, len = chunk_len(f, n);
    const size_t r0 = wrow(f, bh, base);
#ifndef KDA_NO_BWD_CHUNK_STATES
    const float* dSn1 = dS0 + (n + 1) * KV;  // dL/dS_{n+1}
    float* dSn = dS0 + n * KV;               // dL/dS_n
#else
    const float* dSn1 = dS0;  // updated in place: each element needs only itself
    float* dSn = dS0;
#endif
    const float* w = f.w + r0 * K;      // [BT, K]
#ifndef KDA_NO_PRECOMPUTE
    const float* qd = f.qd + r0 * K;    // [BT, K]
    const float* kr = f.kr + r0 * K;    // [BT, K]
    const float* el = f.el + wvec(f, bh, n);  // [K]
#else
    const float* qn = f.qn + r0 * K;    // [BT, K]
    const float* kn = f.kn + r0 * K;    // [BT, K]
    const double* gc = f.gc + r0 * K;   // [BT, K]
    const double* glast = gc + (size_t)(BT - 1) * K;  // [K]
#endif
    const float* A = f.Aqk + wmat(f, bh, n);  // [BT, BT]
    float* du = p.du + r0 * V;          // [BT, V]
    const float* dout = p.dout + tok(f, b, base, h) * V;  // row c at dout[c * H * V] (c < len)
    const size_t dstride = (size_t)f.H * V;

    // 1. du = dvcorr = kr @ dS' + Aqk^T @ do  (do of padded tokens is 0)
    for (int c = 0; c < BT; ++c)
      for (int vd = 0; vd < V; ++vd) {
        float acc = 0.f;
#ifndef KDA_NO_PRECOMPUTE
        for (int d = 0; d < K; ++d) acc += kr[c * K + d] * dSn1[d * V + vd];
#else
        for (int d = 0; d < K; ++d) acc += kn[c * K + d] * decay(glast[d], gc[c * K + d]) * dSn1[d * V + vd];
#endif
        for (int j = c; j < len; ++j) acc += A[j * BT + c] * dout[j * dstride + vd];
        du[c * V + vd] = acc;
      }
#ifdef KDA_NO_BWD_CHUNK_STATES
    // 2-6. the sums over V (dEL, dkr, dqd, dw, dAqk), from dS' before it is overwritten
    bwd_sums_chunk(p, bh, n, f.states + bh * f.state_bh_stride + n * f.state_chunk_stride, dSn1, 0, 1);
#endif
    // 7. dS_n = diag(exp(glast)) dS' + qd^T @ do - w^T @ du
    for (int d = 0; d < K; ++d) {
#ifndef KDA_NO_PRECOMPUTE
      const float eld = el[d];
#else
      const float eld = decay(glast[d]);
#endif
      for (int vd = 0; vd < V; ++vd) {
        float acc = eld * dSn1[d * V + vd];
        for (int c = 0; c < BT; ++c) {
          const float doc = c < len ? dout[c * dstride + vd] : 0.f;
#ifndef KDA_NO_PRECOMPUTE
          acc += qd[c * K + d] * doc - w[c * K + d] * du[c * V + vd];
#else
          acc += f.scale * qn[c * K + d] * decay(gc[c * K + d]) * doc - w[c * K + d] * du[c * V + vd];
#endif
        }
        dSn[d * V + vd] = acc;
      }
    }
  }
  if (p.dh0 != nullptr) {
    float* dh0 = p.dh0 + (size_t)bh * KV;
    for (size_t e = 0; e < KV; ++e) dh0[e] = dS0[e];  // dL/dS_0 (slot 0 in both layouts)
  }
}

// fwd: recurrence (serial over chunks). vcorr, o, S_{n+1}.
// grid = B*H blocks of ONE thread, no shared memory. Profile: slot bh.
__global__ void kda_recur_kernel(const __grid_constant__ KdaFwdParams p) {
  const int bh = blockIdx.x;
  if (threadIdx.x != 0) return;  // launched with one thread per block
  KDA_PROF_START(t0);
  recur_head(p, bh);
  KDA_PROF_LAP(p.prof, bh, KDA_REG_FWD_RECUR, t0);
}

// bwd: reverse recurrence (serial over chunks), du and dL/dS_n (per-chunk slots, or with
// KDA_NO_BWD_CHUNK_STATES one dS in place plus the sums over V) -> dh0.
// grid = B*H blocks of ONE thread, no shared memory. Profile: slot bh.
__global__ void kda_bwd_recur_kernel(const __grid_constant__ KdaBwdParams p) {
  const int bh = blockIdx.x;
  if (threadIdx.x != 0) return;  // launched with one thread per block
  KDA_PROF_START(t0);
  bwd_recur_head(p, bh);
  KDA_PROF_LAP(p.prof, bh, KDA_REG_BWD_RECUR, t0);
}

// Block of the recurrences: one thread; no dynamic smem.
int recur_threads(int /*V*/) { return 1; }
size_t recur_smem_bytes(int /*rows*/, int /*BT*/, int /*threads*/) { return 0; }
#endif  // KDA_NO_COLUMN_THREADS

// ===========================================================================
// KDA_NO_PRECOMPUTE: kd, qd, kr, exp(glast) re-evaluated at each use
// (kda_pre_kernel skips writing them: `if constexpr` lines in kda.cu's pre_chunk)
// ===========================================================================
#ifndef KDA_NO_WARP_CHUNK  // called from kda.cu's warp-per-chunk functions
// wy_chunk, w = Af @ kd: the term a * kd[e] (a = Af[c, i], e = i * K + d) with
// kd = kn * exp(gc) evaluated here.
__device__ __forceinline__ float w_term_recompute(float a, const float* kn, const double* gc, int e) {
  return a * kn[e] * decay(gc[e]);
}

// Part C of kda.cu's bwd_wy_chunk (dAf += dw @ kd^T, dkd, and the adjoints of kd,
// qd, kr, EL) with kd, qd, kr and EL = exp(glast) evaluated where they are used.
__device__ __forceinline__ void bwd_wy_gated_recompute(const KdaFwdParams& f, int lane, int K, int BT,
                                                       const float* qn, const float* kn, const double* gc,
                                                       const float* Af, const float* dw, const float* dqd,
                                                       const float* dkr, const float* dEL, float* dA,
                                                       float* dqs, float* dkn, double* dgc) {
  double gl[kSlots], dgl[kSlots];  // glast and its gradient, lane's columns (fp64)
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int d = lane + 32 * s;
    gl[s] = d < K ? gc[(BT - 1) * K + d] : 0.0;
    dgl[s] = d < K ? dEL[d] * decay(gl[s]) : 0.0;  // EL = exp(glast)
  }
  for (int i = 0; i < BT; ++i) {
    float kdi[kSlots], dkd[kSlots];
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int d = lane + 32 * s;
      kdi[s] = d < K ? kn[i * K + d] * decay(gc[i * K + d]) : 0.f;
      dkd[s] = 0.f;
    }
    for (int c = i; c < BT; ++c) {
      const float af = Af[c * BT + i];
      float part = 0.f;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int d = lane + 32 * s;
        if (d < K) {
          const float dwv = dw[c * K + d];
          part += dwv * kdi[s];
          dkd[s] += af * dwv;
        }
      }
      part = warp_sum(part);
      if (lane == 0) dA[c * BT + i] += part;
    }
    // row i: kd = kn e^gc, qd = qs e^gc, kr = kn e^(glast - gc); first write of dqs, dkn, dgc
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int d = lane + 32 * s;
      if (d < K) {
        const int e = i * K + d;
        const float ex = decay(gc[e]), fr = decay(gl[s], gc[e]);
        const float g_qd = dqd[e], g_kr = dkr[e];
        const float kde = kn[e] * ex, qde = f.scale * qn[e] * ex, kre = kn[e] * fr;
        dqs[e] = g_qd * ex;
        dkn[e] = dkd[s] * ex + g_kr * fr;
        dgc[e] = (double)(dkd[s] * kde) + (double)(g_qd * qde) - (double)(g_kr * kre);
        dgl[s] += g_kr * kre;
      }
    }
  }
#pragma unroll
  for (int s = 0; s < kSlots; ++s) {
    const int d = lane + 32 * s;
    if (d < K) dgc[(BT - 1) * K + d] += dgl[s];  // glast = gc of the last row
  }
}
#endif  // !KDA_NO_WARP_CHUNK

// The recurrences' column threads with qd = scale * qn * exp(gc), exp(glast) and
// kr = kn * exp(glast - gc) evaluated where they are used, on each of the V threads
// (kda.cu's recur_column and bwd_recur_column otherwise), and their kernels.
#if defined(KDA_NO_PRECOMPUTE) && !defined(KDA_NO_COLUMN_THREADS)
__device__ __forceinline__ void recur_column_recompute(const KdaFwdParams& p, int bh, int vd, int nthr,
                                                       float* smem /* [BT, nthr] */) {
  const int K = p.K, V = p.V, BT = p.BT, b = bh / p.H, h = bh % p.H;
  float* vcs = smem + vd;  // this thread's column: vcorr[c] at vcs[c * nthr]
  float* S0 = p.states + bh * p.state_bh_stride;  // S_0 of this head, [K, V]
  const float* h0 = p.h0 ? p.h0 + (size_t)bh * K * V : nullptr;
  for (int d = 0; d < K; ++d) S0[d * V + vd] = h0 ? h0[d * V + vd] : 0.f;

  for (int n = 0; n < p.NT; ++n) {
    const int base = n * BT, len = chunk_len(p, n);
    const size_t r0 = wrow(p, bh, base);
    const float* S = S0 + n * p.state_chunk_stride;      // S_n      [K, V]
    float* Snext = S0 + (n + 1) * p.state_chunk_stride;  // S_{n+1}  [K, V] (may alias S)
    const float* w = p.w + r0 * K;      // [BT, K]
    const float* qn = p.qn + r0 * K;    // [BT, K]
    const float* kn = p.kn + r0 * K;    // [BT, K]
    const double* gc = p.gc + r0 * K;   // [BT, K]
    const double* glast = gc + (size_t)(BT - 1) * K;  // [K]
    const float* u = p.u + r0 * V;      // [BT, V]
    float* vcorr = p.vcorr + r0 * V;    // [BT, V]
    const float* A = p.Aqk + wmat(p, bh, n);   // [BT, BT]

    for (int c = 0; c < BT; ++c) {
      const float* wc = w + c * K;   // [K] (broadcast)
      // stage 03: qd = scale * qn * exp(gc) evaluated here, by every one of the V
      // threads, and (as in stage 03) only for the rows that produce an o
      float acc_v = u[c * V + vd], acc_o = 0.f;
      if (p.o != nullptr && c < len) {
        for (int d = 0; d < K; ++d) {
          const float sv = S[d * V + vd];
          acc_v -= wc[d] * sv;
          acc_o += p.scale * qn[c * K + d] * decay(gc[c * K + d]) * sv;
        }
      } else {
        for (int d = 0; d < K; ++d) acc_v -= wc[d] * S[d * V + vd];
      }
      vcs[c * nthr] = acc_v;
      vcorr[c * V + vd] = acc_v;
      if (p.o != nullptr && c < len) {
        const float* Ac = A + c * BT;  // [BT] (broadcast)
        for (int j = 0; j <= c; ++j) acc_o += Ac[j] * vcs[j * nthr];
        p.o[tok(p, b, base + c, h) * V + vd] = acc_o;
      }
    }
    for (int d = 0; d < K; ++d) {
      // stage 03: exp(glast) and kr = kn * exp(glast - gc) evaluated here, per thread
      const double gl = glast[d];
      float acc = decay(gl) * S[d * V + vd];
      for (int c = 0; c < BT; ++c) acc += kn[c * K + d] * decay(gl, gc[c * K + d]) * vcs[c * nthr];
      Snext[d * V + vd] = acc;
    }
  }
}

// fwd: recurrence (serial over chunks). vcorr, o, S_{n+1}.
// dynamic smem = BT * blockDim.x floats.
__global__ void __launch_bounds__(kMaxCols) kda_recur_kernel(const __grid_constant__ KdaFwdParams p) {
  extern __shared__ float smem[];  // [BT, blockDim.x]
  const int bh = blockIdx.x, vd = threadIdx.x, nthr = blockDim.x;
  KDA_PROF_START(t0);
  if (vd < p.V) recur_column_recompute(p, bh, vd, nthr, smem);
  __syncthreads();  // (profile: time the whole block)
  if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, bh, KDA_REG_FWD_RECUR, t0);
}

#ifndef KDA_NO_BWD_CHUNK_STATES
__device__ __forceinline__ void bwd_recur_column_recompute(const KdaBwdParams& p, int bh, int vd, int nthr,
                                                           float* smem /* [2, BT, nthr] */) {
  const KdaFwdParams& f = p.f;
  const int K = f.K, V = f.V, BT = f.BT, NT = f.NT, b = bh / f.H, h = bh % f.H;
  float* dos = smem + vd;              // do[c] at dos[c * nthr]
  float* dus = smem + BT * nthr + vd;  // du[c] at dus[c * nthr]
  const size_t KV = (size_t)K * V;
  float* dS0 = p.dstates + (size_t)bh * (NT + 1) * KV;  // slot n: dL/dS_n, [K, V]
  const float* dht = p.dht ? p.dht + (size_t)bh * KV : nullptr;
  for (int d = 0; d < K; ++d) dS0[NT * KV + d * V + vd] = dht ? dht[d * V + vd] : 0.f;

  for (int n = NT - 1; n >= 0; --n) {
    const int base = n * BT, len = chunk_len(f, n);
    const size_t r0 = wrow(f, bh, base);
    const float* dSn1 = dS0 + (n + 1) * KV;  // dL/dS_{n+1}
    float* dSn = dS0 + n * KV;               // dL/dS_n
    const float* w = f.w + r0 * K;      // [BT, K]
    const float* qn = f.qn + r0 * K;    // [BT, K]
    const float* kn = f.kn + r0 * K;    // [BT, K]
    const double* gc = f.gc + r0 * K;   // [BT, K]
    const double* glast = gc + (size_t)(BT - 1) * K;  // [K]
    const float* A = f.Aqk + wmat(f, bh, n);  // [BT, BT]
    float* du = p.du + r0 * V;          // [BT, V]
    const float* dout = p.dout + tok(f, b, base, h) * V;  // row c at dout[c * H * V] (c < len)
    const size_t dstride = (size_t)f.H * V;

    for (int c = 0; c < BT; ++c) dos[c * nthr] = c < len ? dout[c * dstride + vd] : 0.f;
    for (int c = 0; c < BT; ++c) {
      float acc = 0.f;  // stage 03: kr = kn * exp(glast - gc) evaluated here, per thread
      for (int d = 0; d < K; ++d) acc += kn[c * K + d] * decay(glast[d], gc[c * K + d]) * dSn1[d * V + vd];
      for (int j = c; j < BT; ++j) acc += A[j * BT + c] * dos[j * nthr];
      dus[c * nthr] = acc;
      du[c * V + vd] = acc;
    }
    for (int d = 0; d < K; ++d) {
      // stage 03: exp(glast) and qd = scale * qn * exp(gc) evaluated here, per thread
      const double gl = glast[d];
      float acc = decay(gl) * dSn1[d * V + vd];
      for (int c = 0; c < BT; ++c)
        acc += f.scale * qn[c * K + d] * decay(gc[c * K + d]) * dos[c * nthr] - w[c * K + d] * dus[c * nthr];
      dSn[d * V + vd] = acc;
    }
  }
  if (p.dh0 != nullptr) {
    float* dh0 = p.dh0 + (size_t)bh * KV;
    for (int d = 0; d < K; ++d) dh0[d * V + vd] = dS0[d * V + vd];
  }
}

// bwd: reverse recurrence (serial over chunks). du, dL/dS_n of every chunk (dstates) -> dh0.
// dynamic smem = 2 * BT * blockDim.x floats.
__global__ void __launch_bounds__(kMaxCols) kda_bwd_recur_kernel(const __grid_constant__ KdaBwdParams p) {
  extern __shared__ float smem[];  // [2, BT, blockDim.x]
  const int bh = blockIdx.x, vd = threadIdx.x, nthr = blockDim.x;
  KDA_PROF_START(t0);
  if (vd < p.f.V) bwd_recur_column_recompute(p, bh, vd, nthr, smem);
  __syncthreads();  // (profile: time the whole block)
  if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, bh, KDA_REG_BWD_RECUR, t0);
}
#endif  // !KDA_NO_BWD_CHUNK_STATES
#endif  // KDA_NO_PRECOMPUTE && !KDA_NO_COLUMN_THREADS

// ===========================================================================
// KDA_NO_BWD_CHUNK_STATES: one dS carried in place, the sums over V inside the chain
// ===========================================================================
#if defined(KDA_NO_BWD_CHUNK_STATES) && !defined(KDA_NO_COLUMN_THREADS)
// The reverse recurrence of head bh WITHOUT per-chunk states (ablation
// KDA_NO_BWD_CHUNK_STATES), run by the whole block (every thread calls it).
// Thread per value column for the column-local work (du and the dS update, as
// in kda.cu's bwd_recur_column), but, as in stage 03, ONE dS is carried backward and
// updated in place (slot 0 of this head's dstates, so it ends as dS_0 = dh0) and
// the sums over value columns the adjoint needs (dEL, dkr, dqd, dw, dAqk) are
// computed here, inside the serial chain: the whole block splits their elements
// (bwd_sums_chunk) between two __syncthreads per chunk. Threads vd >= V take part
// in the sums and barriers only.
__device__ __forceinline__ void bwd_recur_block(const KdaBwdParams& p, int bh,
                                                float* smem /* [2, BT, blockDim.x] */) {
  const KdaFwdParams& f = p.f;
  const int vd = threadIdx.x, nthr = blockDim.x;
  const int K = f.K, V = f.V, BT = f.BT, NT = f.NT, b = bh / f.H, h = bh % f.H;
  const bool col = vd < V;             // this thread owns value column vd
  float* dos = smem + vd;              // do[c] at dos[c * nthr]
  float* dus = smem + BT * nthr + vd;  // du[c] at dus[c * nthr]
  const size_t KV = (size_t)K * V;
  float* dS = p.dstates + (size_t)bh * (NT + 1) * KV;  // the carried dS, [K, V], in place
  const float* dht = p.dht ? p.dht + (size_t)bh * KV : nullptr;
  if (col)
    for (int d = 0; d < K; ++d) dS[d * V + vd] = dht ? dht[d * V + vd] : 0.f;

  for (int n = NT - 1; n >= 0; --n) {
    const int base = n * BT, len = chunk_len(f, n);
    const size_t r0 = wrow(f, bh, base);
    const float* S = f.states + bh * f.state_bh_stride + n * f.state_chunk_stride;  // S_n [K, V]
    if (col) {  // du = dvcorr of column vd (dS holds dL/dS_{n+1})
      const float* A = f.Aqk + wmat(f, bh, n);  // [BT, BT]
#ifndef KDA_NO_PRECOMPUTE
      const float* kr = f.kr + r0 * K;    // [BT, K]
#else
      const float* kn = f.kn + r0 * K;    // [BT, K]
      const double* gc = f.gc + r0 * K;   // [BT, K]
      const double* glast = gc + (size_t)(BT - 1) * K;  // [K]
#endif
      float* du = p.du + r0 * V;          // [BT, V]
      const float* dout = p.dout + tok(f, b, base, h) * V;  // row c at dout[c * H * V] (c < len)
      const size_t dstride = (size_t)f.H * V;
      for (int c = 0; c < BT; ++c) dos[c * nthr] = c < len ? dout[c * dstride + vd] : 0.f;
      for (int c = 0; c < BT; ++c) {
        float acc = 0.f;
#ifndef KDA_NO_PRECOMPUTE
        for (int d = 0; d < K; ++d) acc += kr[c * K + d] * dS[d * V + vd];
#else
        for (int d = 0; d < K; ++d) acc += kn[c * K + d] * decay(glast[d], gc[c * K + d]) * dS[d * V + vd];
#endif
        for (int j = c; j < BT; ++j) acc += A[j * BT + c] * dos[j * nthr];
        dus[c * nthr] = acc;
        du[c * V + vd] = acc;
      }
    }
    __syncthreads();  // du of every column written (global), dS = dL/dS_{n+1} of every column final
    bwd_sums_chunk(p, bh, n, S, dS, threadIdx.x, nthr);
    __syncthreads();  // every thread is done reading dS before it is updated in place
    if (col) {  // dS <- dL/dS_n, column vd
      const float* w = f.w + r0 * K;      // [BT, K]
#ifndef KDA_NO_PRECOMPUTE
      const float* qd = f.qd + r0 * K;    // [BT, K]
      const float* el = f.el + wvec(f, bh, n);  // [K]
      for (int d = 0; d < K; ++d) {
        float acc = el[d] * dS[d * V + vd];
        for (int c = 0; c < BT; ++c) acc += qd[c * K + d] * dos[c * nthr] - w[c * K + d] * dus[c * nthr];
        dS[d * V + vd] = acc;
      }
#else
      const float* qn = f.qn + r0 * K;    // [BT, K]
      const double* gc = f.gc + r0 * K;   // [BT, K]
      const double* glast = gc + (size_t)(BT - 1) * K;  // [K]
      for (int d = 0; d < K; ++d) {
        const double gl = glast[d];
        float acc = decay(gl) * dS[d * V + vd];
        for (int c = 0; c < BT; ++c)
          acc += f.scale * qn[c * K + d] * decay(gc[c * K + d]) * dos[c * nthr] - w[c * K + d] * dus[c * nthr];
        dS[d * V + vd] = acc;
      }
#endif
    }
  }
  if (col && p.dh0 != nullptr) {
    float* dh0 = p.dh0 + (size_t)bh * KV;
    for (int d = 0; d < K; ++d) dh0[d * V + vd] = dS[d * V + vd];
  }
}

// bwd: reverse recurrence; every thread of the block runs the chain (barriers inside).
// dynamic smem = 2 * BT * blockDim.x floats.
__global__ void __launch_bounds__(kMaxCols) kda_bwd_recur_kernel(const __grid_constant__ KdaBwdParams p) {
  extern __shared__ float smem[];  // [2, BT, blockDim.x]
  const int bh = blockIdx.x;
  KDA_PROF_START(t0);
  bwd_recur_block(p, bh, smem);
  __syncthreads();  // (profile: time the whole block)
  if (threadIdx.x == 0) KDA_PROF_LAP(p.prof, bh, KDA_REG_BWD_RECUR, t0);
}
#endif

#ifndef KDA_NO_WARP_CHUNK  // called from kda.cu's bwd_wy_chunk
// Part B of bwd_wy_chunk without dAqk (dEL, dkr, dqd, dw and dAqk, parts A and B's
// half, were computed by the reverse recurrence): dAf (v part) and dv, lanes split V.
__device__ __forceinline__ void bwd_wy_dv(int lane, int V, int BT, int len, const float* Af, const float* du,
                                          size_t tstride, const float* vin, float* dvo, float* dA) {
  for (int i = 0; i < BT; ++i) {
    const bool real_i = i < len;
    float vi[kSlots], dva[kSlots];
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      const int vd = lane + 32 * s;
      vi[s] = (vd < V && real_i) ? vin[i * tstride + vd] : 0.f;
      dva[s] = 0.f;
    }
    for (int c = i; c < BT; ++c) {
      const float af = Af[c * BT + i];
      float a_u = 0.f;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int vd = lane + 32 * s;
        if (vd < V) {
          const float duv = du[c * V + vd];
          a_u += duv * vi[s];
          dva[s] += af * duv;
        }
      }
      a_u = warp_sum(a_u);
      if (lane == 0) dA[c * BT + i] = a_u;
    }
    if (real_i) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int vd = lane + 32 * s;
        if (vd < V) dvo[i * tstride + vd] = dva[s];
      }
    }
  }
}
#endif  // !KDA_NO_WARP_CHUNK
