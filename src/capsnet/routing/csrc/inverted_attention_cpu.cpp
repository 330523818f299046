// Fused CPU kernel for inverted dot-product attention routing (Procedure 1 of Tsai, Srivastava, Goh &
// Salakhutdinov, ICLR 2020), forward and backward.
//
// Shapes (the paper's symbols):  u [B, I, N] child poses p_i,  W [I, J, N, M],  v_ij = W_ijᵀ u_i (Eq. 1) [I, J, M]
// per sample (matrix poses: child_rows in routing_common.h),  a_ij = scale · q_jᵀ v_ij (Eq. 2, q the parents'
// previous poses),  r_ij = softmax_j(a_ij) (Eq. 3),  s_j = Σ_i r_ij v_ij,  p_j = LayerNorm(s_j) = γ ⊙ x̂_j + β (Eq. 4).
//
// Passes t = 0 … T-1. Pass 0 starts from q = p0 if it is given, else from p_j = 0: then r = 1/J (no agreement)
// and s_0 is the mean vote, summed while the votes are formed. Pass t ≥ 1 starts from q = p_{t-1}.
//
// Forward: parallel over the samples. Each thread forms one sample's votes v [I, J, M] (737 KB fp32 at CapsNet's
// size, so they stay in L2) and runs all passes on them, walking the children in blocks of kBlock: agreement →
// softmax over the parents → weighted sum on a block while it is in L1. Saved: s_t [B, T, J, M] and r_k
// [K, B, I, J] for the K passes with agreement (k = t − t0, t0 = 1 without p0, else 0).
//
// Backward, with dp = dL/dp_{T-1} (the output's gradient) and passes walked from the last:
//   ds_t = LayerNorm'ᵀ(dp):  g = γ ⊙ dp,  ds = rstd (g − mean(g) − x̂ mean(g ⊙ x̂));  dγ += dp ⊙ x̂,  dβ += dp;
//   for a pass with agreement:  dr_ij = v_ij · ds_t,j (+ dL/dr at the last pass);
//     G_ij = scale · r_ij (dr_ij − Σ_k r_ik dr_ik)  (softmax backward, = scale · dL/da_ij);
//     dp_{t-1,j} = Σ_i G_ij v_ij  (the only use of the previous poses; dL/dp0 at t = 0);
//   dv_ij = Σ_t c_t,ij ds_t,j + Σ_(passes with agreement) G_ij q_j,  c_t = r_t (or 1/J at a uniform pass).
// Phase 1 (parallel over samples) recomputes the votes and writes the small factors ds_t [B, T, J, M], q_k
// [B, K, J, M], G_k [K, B, I, J] and the per-sample dγ, dβ [B, M]. Phase 2 (parallel over the children i) rebuilds
// dv_ij from them and forms dL/du_i = W_i dv_i and dL/dW_ij = Σ_b u_bi ⊗ dv_bij, summing over the batch in a fixed
// order (deterministic, no per-thread copies).

// ATen's tensor, the ATen functions used, and pybind11 with its at::Tensor conversion: the C++ frontend that
// <torch/extension.h> adds is not used, and leaving it out halves the build (13 s against 33 s for the headers here).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "routing_common.h"  // kBlock, exp_inplace, child_rows, votes, add_weighted_votes, votes_backward_input

namespace {

// Eq. 4 on the J rows of s [J, M]: x̂ = (s − mean) · rstd, rstd = 1/sqrt(var + eps) (biased variance, as
// torch.nn.LayerNorm); p = γ ⊙ x̂ + β if p is given.
template <typename T>
void layer_norm_rows(const T* __restrict s, const T* __restrict gamma, const T* __restrict beta, T* __restrict xhat,
                     T* __restrict rstd, T* __restrict p, int64_t J, int64_t M, double eps) {
  for (int64_t j = 0; j < J; ++j) {
    const T* x = s + j * M;
    T mean = 0, var = 0;
    for (int64_t m = 0; m < M; ++m) mean += x[m];
    mean /= T(M);
    for (int64_t m = 0; m < M; ++m) var += (x[m] - mean) * (x[m] - mean);
    const T rs = T(1) / std::sqrt(var / T(M) + T(eps));
    rstd[j] = rs;
    for (int64_t m = 0; m < M; ++m) xhat[j * M + m] = (x[m] - mean) * rs;
    if (p != nullptr) {
      for (int64_t m = 0; m < M; ++m) p[j * M + m] = gamma[m] * xhat[j * M + m] + beta[m];
    }
  }
}

// dL/ds of Eq. 4 for the J rows, from dp [J, M]; adds dp ⊙ x̂ to dgamma and dp to dbeta [M].
template <typename T>
void layer_norm_backward_rows(const T* __restrict dp, const T* __restrict xhat, const T* __restrict rstd,
                              const T* __restrict gamma, T* __restrict ds, T* __restrict dgamma, T* __restrict dbeta,
                              int64_t J, int64_t M) {
  for (int64_t j = 0; j < J; ++j) {
    T mg = 0, mgx = 0;
    for (int64_t m = 0; m < M; ++m) {
      const T g = gamma[m] * dp[j * M + m];
      mg += g;
      mgx += g * xhat[j * M + m];
      dgamma[m] += dp[j * M + m] * xhat[j * M + m];
      dbeta[m] += dp[j * M + m];
    }
    mg /= T(M);
    mgx /= T(M);
    for (int64_t m = 0; m < M; ++m)
      ds[j * M + m] = rstd[j] * (gamma[m] * dp[j * M + m] - mg - xhat[j * M + m] * mgx);
  }
}

// One pass with agreement for one sample: r [I, J] (Eqs. 2, 3) and s = Σ_i r_ij v_ij [J, M].
template <typename T, int MC>
void attention_pass(const T* __restrict v, const T* __restrict q, T* __restrict r, T* __restrict s,
                    T* __restrict part, int64_t I, int64_t J, int64_t M_, T scale) {
  const int64_t M = MC > 0 ? MC : M_;
  const int64_t JM = J * M;
  std::fill(s, s + JM, T(0));
  for (int64_t i0 = 0; i0 < I; i0 += kBlock) {
    const int64_t i1 = std::min(I, i0 + kBlock);
    for (int64_t i = i0; i < i1; ++i) {
      T* __restrict ri = r + i * J;
      T mx = -INFINITY;
      for (int64_t j = 0; j < J; ++j) {  // Eq. 2: a_ij = scale · q_jᵀ v_ij
        const T* __restrict x = v + (i * J + j) * M;
        const T* __restrict y = q + j * M;
        T a = 0;
#pragma omp simd reduction(+ : a)
        for (int64_t m = 0; m < M; ++m) a += x[m] * y[m];
        ri[j] = a * scale;
        mx = std::max(mx, ri[j]);
      }
      for (int64_t j = 0; j < J; ++j) ri[j] -= mx;
    }
    exp_inplace(r + i0 * J, (i1 - i0) * J);  // Eq. 3: softmax over the parents j
    for (int64_t i = i0; i < i1; ++i) {
      T* __restrict ri = r + i * J;
      T sum = 0;
      for (int64_t j = 0; j < J; ++j) sum += ri[j];
      const T inv = T(1) / sum;
      for (int64_t j = 0; j < J; ++j) ri[j] *= inv;
    }
    add_weighted_votes<T, MC>(r, v, part, s, i0, i1, J, M);  // s_j += Σ_(i in block) r_ij v_ij
  }
}

struct Sizes {
  int64_t B, I, J, N, M, D, T, K, t0;  // D: u's pose size (N, or M for matrix poses); K passes with agreement,
  bool mat;                             // the first at pass t0; mat: matrix poses
};

// Procedure 1 for all samples. Outputs p [B, J, M], r_all [K, B, I, J], s_all [B, T, J, M].
template <typename T, int MC, int NC, bool MAT>
void forward_impl(const T* u, const T* W, const T* gamma, const T* beta, const T* p0, T* p, T* r_all, T* s_all,
                  Sizes z, T scale, double eps) {
  const int64_t JM = z.J * z.M, IJ = z.I * z.J;
  at::parallel_for(0, z.B, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> v(z.I * JM), part(JM), q(JM), xhat(JM), rstd(z.J), x(z.N * z.M);
    for (int64_t b = begin; b < end; ++b) {
      T* s = s_all + b * z.T * JM;
      votes<T, MC, NC, MAT>(u + b * z.I * z.D, W, v.data(), z.t0 ? s : nullptr, part.data(), x.data(), z.I, z.J, z.N,
                            z.M);
      if (z.t0) {  // p_j = 0: r = 1/J and s_0 = the mean vote
        for (int64_t k = 0; k < JM; ++k) s[k] /= T(z.J);
      }
      for (int64_t t = z.t0; t < z.T; ++t) {
        const T* qt = q.data();
        if (t == 0) {
          qt = p0 + b * JM;
        } else {
          layer_norm_rows(s + (t - 1) * JM, gamma, beta, xhat.data(), rstd.data(), q.data(), z.J, z.M, eps);
        }
        T* rt = r_all + ((t - z.t0) * z.B + b) * IJ;
        attention_pass<T, MC>(v.data(), qt, rt, s + t * JM, part.data(), z.I, z.J, z.M, scale);
      }
      layer_norm_rows(s + (z.T - 1) * JM, gamma, beta, xhat.data(), rstd.data(), p + b * JM, z.J, z.M, eps);
    }
  });
}

// Phase 1 of the backward pass (see the top of the file). gp [B, J, M] or nullptr (zero), gr [B, I, J] or nullptr.
// Writes ds_all [B, T, J, M], q_all [B, K, J, M], g_all [K, B, I, J], dgb [B, 2, M] (dγ, dβ per sample) and dp0.
template <typename T, int MC, int NC, bool MAT>
void backward_factors(const T* u, const T* W, const T* gamma, const T* beta, const T* p0, const T* r_all,
                      const T* s_all, const T* gp, const T* gr, T* ds_all, T* q_all, T* g_all, T* dgb, T* dp0,
                      Sizes z, T scale, double eps) {
  const int64_t M = MC > 0 ? MC : z.M;
  const int64_t JM = z.J * M, IJ = z.I * z.J;
  at::parallel_for(0, z.B, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> v(z.K > 0 ? z.I * JM : 0), dp(JM), dq(JM), xhat(JM), rstd(z.J), dr(z.J), x(z.N * M);
    for (int64_t b = begin; b < end; ++b) {
      const T* s = s_all + b * z.T * JM;
      T* ds = ds_all + b * z.T * JM;
      T* dgamma = dgb + b * 2 * M;
      T* dbeta = dgamma + M;
      std::fill(dgamma, dgamma + 2 * M, T(0));
      if (gp != nullptr) {
        std::copy(gp + b * JM, gp + (b + 1) * JM, dp.begin());
      } else {
        std::fill(dp.begin(), dp.end(), T(0));
      }
      if (z.K > 0)
        votes<T, MC, NC, MAT>(u + b * z.I * z.D, W, v.data(), nullptr, nullptr, x.data(), z.I, z.J, z.N, M);
      for (int64_t t = z.T - 1; t >= 0; --t) {
        layer_norm_rows(s + t * JM, gamma, beta, xhat.data(), rstd.data(), static_cast<T*>(nullptr), z.J, M, eps);
        layer_norm_backward_rows(dp.data(), xhat.data(), rstd.data(), gamma, ds + t * JM, dgamma, dbeta, z.J, M);
        if (t < z.t0) break;  // the uniform pass: no agreement, nothing before it
        const int64_t k = t - z.t0;
        T* qk = q_all + (b * z.K + k) * JM;  // the poses this pass started from
        if (t == 0) {
          std::copy(p0 + b * JM, p0 + (b + 1) * JM, qk);
        } else {
          layer_norm_rows(s + (t - 1) * JM, gamma, beta, xhat.data(), rstd.data(), qk, z.J, M, eps);
        }
        const T* __restrict rk = r_all + (k * z.B + b) * IJ;
        const T* __restrict grb = (t == z.T - 1 && gr != nullptr) ? gr + b * IJ : nullptr;
        const T* __restrict dst = ds + t * JM;
        T* __restrict gk = g_all + (k * z.B + b) * IJ;
        T* __restrict dqp = dq.data();
        std::fill(dq.begin(), dq.end(), T(0));
        for (int64_t i = 0; i < z.I; ++i) {
          T rdr = 0;
          for (int64_t j = 0; j < z.J; ++j) {  // dr_ij = v_ij · ds_j (+ dL/dr of the output at the last pass)
            const T* __restrict x = v.data() + (i * z.J + j) * M;
            const T* __restrict y = dst + j * M;
            T a = 0;
#pragma omp simd reduction(+ : a)
            for (int64_t m = 0; m < M; ++m) a += x[m] * y[m];
            dr[j] = grb ? a + grb[i * z.J + j] : a;
            rdr += rk[i * z.J + j] * dr[j];
          }
          for (int64_t j = 0; j < z.J; ++j) {  // G = scale · r ⊙ (dr − Σ_j r dr);  dq_j += G_ij v_ij
            const T g = scale * rk[i * z.J + j] * (dr[j] - rdr);
            gk[i * z.J + j] = g;
            const T* __restrict x = v.data() + (i * z.J + j) * M;
#pragma omp simd
            for (int64_t m = 0; m < M; ++m) dqp[j * M + m] += g * x[m];
          }
        }
        if (t == 0) {
          std::copy(dq.begin(), dq.end(), dp0 + b * JM);
        } else {
          std::copy(dq.begin(), dq.end(), dp.begin());
        }
      }
    }
  });
}

// Phase 2, parallel over the children i: dv_bij [B, J, M] from its factors, then dL/du_bin = Σ_(j,m) W_ijnm dv_bijm
// and dL/dW_ijnm = Σ_b u_bin dv_bijm (b in a fixed order). r_t, g_t: r and G transposed to [I, K, B, J], so a
// child's rows are contiguous. du, dW may be nullptr.
template <typename T, int MC, int NC, bool MAT>
void backward_inputs(const T* u, const T* W, const T* r_t, const T* ds_all, const T* q_all, const T* g_t, T* du,
                     T* dW, Sizes z) {
  const int64_t M = MC > 0 ? MC : z.M, N = NC > 0 ? NC : z.N;
  const int64_t JM = z.J * M, NM = N * M, JNM = z.J * N * M, D = MAT ? M : N;
  const T inv_j = T(1) / T(z.J);
  at::parallel_for(0, z.I, 4, [&](int64_t begin, int64_t end) {
    std::vector<T> dv(JM), acc(NM), dwi(JNM), xs(NM);  // one sample's dv_ij [J, M]; child i's dL/dW [J, N, M]
    T* __restrict dh = dv.data();
    T* __restrict x = xs.data();
    T* __restrict a = acc.data();
    T* __restrict dwa = dwi.data();
    for (int64_t i = begin; i < end; ++i) {
      const T* __restrict wi = W + i * JNM;
      std::fill(dwi.begin(), dwi.end(), T(0));
      for (int64_t b = 0; b < z.B; ++b) {  // in a fixed order: dL/dW does not depend on the threads
        const T* __restrict ds = ds_all + b * z.T * JM;
        for (int64_t j = 0; j < z.J; ++j) {  // dv_bij = Σ_t c_t,ij ds_t,j + Σ_k G_k,ij q_k,j
          if (z.t0) {
#pragma omp simd
            for (int64_t m = 0; m < M; ++m) dh[j * M + m] = inv_j * ds[j * M + m];
          } else {
            std::fill(dh + j * M, dh + (j + 1) * M, T(0));
          }
          for (int64_t k = 0; k < z.K; ++k) {
            const T c = r_t[((i * z.K + k) * z.B + b) * z.J + j];
            const T g = g_t[((i * z.K + k) * z.B + b) * z.J + j];
            const T* __restrict y = ds + (k + z.t0) * JM + j * M;
            const T* __restrict qq = q_all + (b * z.K + k) * JM + j * M;
#pragma omp simd
            for (int64_t m = 0; m < M; ++m) dh[j * M + m] += c * y[m] + g * qq[m];
          }
        }
        if (du != nullptr) {  // dL/du_bi = W_i dv_bi
          votes_backward_input<T, MC, NC>(wi, dh, a, MAT ? nullptr : du + (b * z.I + i) * N, z.J, N, M);
          if (MAT) {  // dL/dP_i[k, c] = Σ_r a[k, (r, c)]
            for (int64_t k = 0; k < N; ++k) {
              for (int64_t c = 0; c < N; ++c) {
                T sum = 0;
                for (int64_t r = 0; r < N; ++r) sum += a[k * M + r * N + c];
                du[(b * z.I + i) * D + k * N + c] = sum;
              }
            }
          }
        }
        if (dW != nullptr) {  // dL/dW_ij[n, m] += X_bi[n, m] dv_bij[m]
          const T* __restrict ub = u + (b * z.I + i) * D;
          if (MAT) {
            child_rows<T, MAT>(ub, x, N, M);
            for (int64_t j = 0; j < z.J; ++j) {
              for (int64_t n = 0; n < N; ++n) {
#pragma omp simd
                for (int64_t m = 0; m < M; ++m) dwa[(j * N + n) * M + m] += x[n * M + m] * dh[j * M + m];
              }
            }
          } else {
            for (int64_t j = 0; j < z.J; ++j) {
              for (int64_t n = 0; n < N; ++n) {
                const T un = ub[n];
#pragma omp simd
                for (int64_t m = 0; m < M; ++m) dwa[(j * N + n) * M + m] += un * dh[j * M + m];
              }
            }
          }
        }
      }
      if (dW != nullptr) std::copy(dwa, dwa + JNM, dW + i * JNM);
    }
  });
}

// Calls the kernel with MC_ = M, NC_ = N as compile-time constants for the common capsule sizes (8D → 16D as in
// CapsNet; 4×4 matrix poses, N = 4, M = 16), else with MC_ = NC_ = 0 (runtime sizes); MAT_: matrix poses.
#define FOR_SIZES(z, ...)                                                   \
  do {                                                                      \
    if ((z).mat) {                                                          \
      constexpr bool MAT_ = true;                                           \
      CAPSNET_WITH_SIZES((z).M == 16 && (z).N == 4, 16, 4, __VA_ARGS__);    \
    } else {                                                                \
      constexpr bool MAT_ = false;                                          \
      CAPSNET_WITH_SIZES((z).M == 16 && (z).N == 8, 16, 8, __VA_ARGS__);    \
    }                                                                       \
  } while (0)

Sizes check_inputs(const at::Tensor& u, const at::Tensor& W, const at::Tensor& gamma, const at::Tensor& beta,
                   const std::optional<at::Tensor>& p0, int64_t passes, bool matrix) {
  TORCH_CHECK(u.device().is_cpu() && W.device().is_cpu(), "inverted_attention_cpu: CPU tensors expected");
  TORCH_CHECK(u.dim() == 3 && W.dim() == 4, "inverted_attention_cpu: u [B, I, N] and W [I, J, N, M] expected");
  TORCH_CHECK(u.size(1) == W.size(0) && u.size(2) == (matrix ? W.size(3) : W.size(2)),
              "inverted_attention_cpu: shapes of u, W differ");
  TORCH_CHECK(!matrix || W.size(3) == W.size(2) * W.size(2), "inverted_attention_cpu: matrix weights [I, J, S, S²]");
  TORCH_CHECK(u.scalar_type() == W.scalar_type() && gamma.scalar_type() == u.scalar_type() &&
                  beta.scalar_type() == u.scalar_type(),
              "inverted_attention_cpu: u, W, gamma, beta must have the same dtype");
  TORCH_CHECK(u.is_contiguous() && W.is_contiguous() && gamma.is_contiguous() && beta.is_contiguous(),
              "inverted_attention_cpu: contiguous tensors expected");
  TORCH_CHECK(gamma.numel() == W.size(3) && beta.numel() == W.size(3), "inverted_attention_cpu: gamma, beta [M]");
  TORCH_CHECK(passes >= 1, "inverted_attention_cpu: passes must be >= 1");
  const bool has_p0 = p0.has_value() && p0->defined();
  if (has_p0) {
    TORCH_CHECK(p0->scalar_type() == u.scalar_type() && p0->is_contiguous() && p0->dim() == 3 &&
                    p0->size(0) == u.size(0) && p0->size(1) == W.size(1) && p0->size(2) == W.size(3),
                "inverted_attention_cpu: p0 [B, J, M], contiguous, of u's dtype expected");
  }
  const int64_t t0 = has_p0 ? 0 : 1;
  return Sizes{u.size(0), W.size(0), W.size(1), W.size(2), W.size(3), u.size(2), passes, passes - t0, t0, matrix};
}

// Returns p [B, J, M], r_all [K, B, I, J] and s_all [B, T, J, M].
std::vector<at::Tensor> ia_forward(const at::Tensor& u, const at::Tensor& W, const at::Tensor& gamma,
                                   const at::Tensor& beta, const std::optional<at::Tensor>& p0, int64_t passes,
                                   double scale, double eps, bool matrix) {
  const Sizes z = check_inputs(u, W, gamma, beta, p0, passes, matrix);
  auto p = at::empty({z.B, z.J, z.M}, u.options());
  auto r_all = at::empty({z.K, z.B, z.I, z.J}, u.options());
  auto s_all = at::empty({z.B, z.T, z.J, z.M}, u.options());
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "inverted_attention_cpu_forward", [&] {
    using T = scalar_t;
    const T* p0p = z.t0 ? nullptr : p0->data_ptr<T>();
    FOR_SIZES(z, forward_impl<T, MC_, NC_, MAT_>(u.data_ptr<T>(), W.data_ptr<T>(), gamma.data_ptr<T>(),
                                                   beta.data_ptr<T>(), p0p, p.data_ptr<T>(), r_all.data_ptr<T>(),
                                                   s_all.data_ptr<T>(), z, T(scale), eps));
  });
  return {p, r_all, s_all};
}

// Returns dL/du [B, I, N], dL/dW [I, J, N, M] (undefined where not needed), dγ and dβ per sample [B, 2, M] and
// dL/dp0 [B, J, M] (undefined without p0).
std::vector<at::Tensor> ia_backward(const std::optional<at::Tensor>& grad_p, const std::optional<at::Tensor>& grad_r,
                                    const at::Tensor& u, const at::Tensor& W, const at::Tensor& gamma,
                                    const at::Tensor& beta, const std::optional<at::Tensor>& p0,
                                    const at::Tensor& r_all, const at::Tensor& s_all, int64_t passes, double scale,
                                    double eps, bool matrix, bool need_u, bool need_w) {
  const Sizes z = check_inputs(u, W, gamma, beta, p0, passes, matrix);
  TORCH_CHECK(r_all.is_contiguous() && s_all.is_contiguous(), "inverted_attention_cpu: saved tensors not contiguous");
  at::Tensor gp, gr;
  if (grad_p.has_value() && grad_p->defined()) gp = grad_p->to(u.scalar_type()).contiguous();
  if (grad_r.has_value() && grad_r->defined() && z.K > 0) gr = grad_r->to(u.scalar_type()).contiguous();
  auto ds_all = at::empty({z.B, z.T, z.J, z.M}, u.options());
  auto q_all = at::empty({z.B, z.K, z.J, z.M}, u.options());
  auto g_all = at::empty({z.K, z.B, z.I, z.J}, u.options());
  auto dgb = at::empty({z.B, 2, z.M}, u.options());
  at::Tensor dp0 = z.t0 ? at::Tensor() : at::empty({z.B, z.J, z.M}, u.options());
  at::Tensor du = need_u ? at::empty({z.B, z.I, z.D}, u.options()) : at::Tensor();
  at::Tensor dW = need_w ? at::empty({z.I, z.J, z.N, z.M}, u.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "inverted_attention_cpu_backward", [&] {
    using T = scalar_t;
    const T* p0p = z.t0 ? nullptr : p0->data_ptr<T>();
    FOR_SIZES(z, backward_factors<T, MC_, NC_, MAT_>(
        u.data_ptr<T>(), W.data_ptr<T>(), gamma.data_ptr<T>(), beta.data_ptr<T>(), p0p, r_all.data_ptr<T>(),
        s_all.data_ptr<T>(), gp.defined() ? gp.data_ptr<T>() : nullptr, gr.defined() ? gr.data_ptr<T>() : nullptr,
        ds_all.data_ptr<T>(), q_all.data_ptr<T>(), g_all.data_ptr<T>(), dgb.data_ptr<T>(),
        z.t0 ? nullptr : dp0.data_ptr<T>(), z, T(scale), eps));
    if (need_u || need_w) {
      const auto r_t = r_all.permute({2, 0, 1, 3}).contiguous(), g_t = g_all.permute({2, 0, 1, 3}).contiguous();
      FOR_SIZES(z, backward_inputs<T, MC_, NC_, MAT_>(
          u.data_ptr<T>(), W.data_ptr<T>(), r_t.data_ptr<T>(), ds_all.data_ptr<T>(), q_all.data_ptr<T>(),
          g_t.data_ptr<T>(), need_u ? du.data_ptr<T>() : nullptr, need_w ? dW.data_ptr<T>() : nullptr, z));
    }
  });
  return {du, dW, dgb, dp0};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &ia_forward, "Inverted dot-product attention routing, fused (CPU)");
  m.def("backward", &ia_backward, "Backward of inverted dot-product attention routing, fused (CPU)");
}
