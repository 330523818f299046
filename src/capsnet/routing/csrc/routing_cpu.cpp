// Fused CPU kernel for dynamic routing (Procedure 1 of Sabour, Frosst & Hinton 2017), forward and backward.
//
// Shapes (the paper's symbols):  u [B, I, N] input capsules,  W [I, J, N, M] transformation matrices,
//   û_j|i = W_ijᵀ u_i (Eq. 2)  [I, J, M] per sample,  c_ij = softmax_j(b_ij) (Eq. 3)  [I, J],
//   s_j = Σ_i c_ij û_j|i  [J, M],  v_j = squash(s_j) (Eq. 1),  b_ij += û_j|i · v_j.
//
// Forward: parallel over the samples. Each thread computes one sample's votes û [I, J, M] (737 KB fp32 at the
// MNIST shape, so it stays in L2) and runs all r passes on them; a pass walks the input capsules in blocks of
// kBlock, doing agreement → softmax → weighted sum on a block while it is in L1. Saved: s_t [B, r, J, M] and
// c_t [r-1, B, I, J] (t ≥ 1; c_0 is the uniform 1/J).
//
// Backward (the derivation of capsnet/routing.py's FastRouting): with t = 0 … r-1 the passes and G_t = dL/db_t,
//   ds_{r-1} = squash'(s_{r-1})ᵀ dv;  for t = r-1 … 1:
//     dc_ij = û_j|i · ds_t,j (+ grad_c at t = r-1);  G_t = G_{t+1} + c_t ⊙ (dc − Σ_j c_t dc)  (softmax backward);
//     dv_{t-1,j} = Σ_i G_t,ij û_j|i  (b_t = b_{t-1} + a_{t-1}, a_ij = û_j|i · v_j);  ds_{t-1} = squash'ᵀ dv_{t-1};
//   dû_ij = (1/J) ds_0,j + Σ_{t≥1} (c_t,ij ds_t,j + G_t,ij v_{t-1,j})        (with detach_votes: c_{r-1} ds_{r-1}).
// Phase 1 (parallel over samples) recomputes û and writes the small G_t [r-1, B, I, J] and ds_t, v_t [B, r, J, M].
// Phase 2 (parallel over input capsules i) rebuilds dû_ij on the fly from those factors and forms
//   dL/du_i = W_i dû_i  and  dL/dW_ij = Σ_b u_bi ⊗ dû_bij,
// summing over the batch in a fixed order: dL/dW is deterministic and needs no per-thread copies.

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
#include <cstring>
#include <optional>
#include <vector>

#include "routing_common.h"  // kBlock, exp_inplace, votes, add_weighted_votes, votes_backward_input

namespace {

constexpr double kEps = 1e-8;  // inside the squash's square root, as capsnet.nn.squash

// Eq. 1 for each of the J rows of s [J, M]: v = s · q / ((1 + q) · sqrt(q + eps)), q = |s|².
template <typename T>
void squash_rows(const T* __restrict s, T* __restrict v, int64_t J, int64_t M) {
  for (int64_t j = 0; j < J; ++j) {
    T q = 0;
    for (int64_t m = 0; m < M; ++m) q += s[j * M + m] * s[j * M + m];
    const T f = q / ((T(1) + q) * std::sqrt(q + T(kEps)));
    for (int64_t m = 0; m < M; ++m) v[j * M + m] = s[j * M + m] * f;
  }
}

// dL/ds for v = s·f(q):  ds = f·dv + 2 f'(q) (s·dv) s,  f = q·g,  g = 1/((1+q) sqrt(q+eps)),
// f' = g (1 − q/(1+q) − q/(2(q+eps))).  s, dv, ds [J, M]; dv == nullptr means dv = 0.
template <typename T>
void squash_backward_rows(const T* __restrict s, const T* __restrict dv, T* __restrict ds, int64_t J, int64_t M) {
  for (int64_t j = 0; j < J; ++j) {
    if (dv == nullptr) {
      for (int64_t m = 0; m < M; ++m) ds[j * M + m] = 0;
      continue;
    }
    T q = 0, sd = 0;
    for (int64_t m = 0; m < M; ++m) {
      q += s[j * M + m] * s[j * M + m];
      sd += s[j * M + m] * dv[j * M + m];
    }
    const T g = T(1) / ((T(1) + q) * std::sqrt(q + T(kEps)));
    const T fp = g * (T(1) - q / (T(1) + q) - T(0.5) * q / (q + T(kEps)));
    const T a = q * g, c = T(2) * fp * sd;
    for (int64_t m = 0; m < M; ++m) ds[j * M + m] = dv[j * M + m] * a + s[j * M + m] * c;
  }
}


// Procedure 1 for all samples.  Outputs: v [B, J, M], s_all [B, r, J, M], c_all [r-1, B, I, J].
template <typename T, int MC>
void forward_impl(const T* u, const T* W, T* v, T* s_all, T* c_all, int64_t B, int64_t I, int64_t J, int64_t N,
                  int64_t M_, int64_t r) {
  const int64_t M = MC > 0 ? MC : M_;  // out_d, a compile-time constant for the common sizes
  const int64_t JM = J * M, IJ = I * J;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> uh(I * JM), logits(IJ), vt(JM), part(JM);
    for (int64_t b = begin; b < end; ++b) {
      T* s = s_all + b * r * JM;
      // t = 0: c_ij = 1/J, s_0 = (1/J) Σ_i û_j|i, computed with the votes.
      votes<T, MC, 0, false>(u + b * I * N, W, uh.data(), s, part.data(), nullptr, I, J, N, M);
      for (int64_t k = 0; k < JM; ++k) s[k] /= T(J);
      for (int64_t t = 1; t < r; ++t) {
        const T* __restrict sp = s + (t - 1) * JM;
        T* __restrict st = s + t * JM;
        T* __restrict ct = c_all + ((t - 1) * B + b) * IJ;
        T* __restrict lg = logits.data();
        squash_rows(sp, vt.data(), J, M);  // v_{t-1}
        const T* __restrict vp = vt.data();
        std::fill(st, st + JM, T(0));
        for (int64_t i0 = 0; i0 < I; i0 += kBlock) {
          const int64_t i1 = std::min(I, i0 + kBlock);
          // b_ij ← b_ij + û_j|i · v_j
          for (int64_t i = i0; i < i1; ++i) {
            for (int64_t j = 0; j < J; ++j) {
              const T* __restrict x = uh.data() + (i * J + j) * M;
              const T* __restrict y = vp + j * M;
              T a = 0;
#pragma omp simd reduction(+ : a)
              for (int64_t m = 0; m < M; ++m) a += x[m] * y[m];
              lg[i * J + j] = (t == 1 ? a : lg[i * J + j] + a);
            }
          }
          // Eq. 3: c_ij = softmax_j(b_ij), exp(b − max_j b) / Σ_j
          for (int64_t i = i0; i < i1; ++i) {
            T mx = lg[i * J];
            for (int64_t j = 1; j < J; ++j) mx = std::max(mx, lg[i * J + j]);
            for (int64_t j = 0; j < J; ++j) ct[i * J + j] = lg[i * J + j] - mx;
          }
          exp_inplace(ct + i0 * J, (i1 - i0) * J);
          for (int64_t i = i0; i < i1; ++i) {
            T sum = 0;
            for (int64_t j = 0; j < J; ++j) sum += ct[i * J + j];
            for (int64_t j = 0; j < J; ++j) ct[i * J + j] /= sum;
          }
          // s_j += Σ_(i in block) c_ij û_j|i
          add_weighted_votes<T, MC>(ct, uh.data(), part.data(), st, i0, i1, J, M);
        }
      }
      squash_rows(s + (r - 1) * JM, v + b * JM, J, M);
    }
  });
}

// Phase 1 of the backward pass (see the top of the file). Writes ds_all, v_all [B, r, J, M] and g_all [r-1, B, I, J]
// (G_t for t ≥ 1; only without detach_votes). gv [B, J, M] or nullptr (zero); gc [B, I, J] or nullptr.
template <typename T, int MC>
void backward_factors(const T* u, const T* W, const T* s_all, const T* c_all, const T* gv, const T* gc, T* ds_all,
                      T* v_all, T* g_all, int64_t B, int64_t I, int64_t J, int64_t N, int64_t M_, int64_t r,
                      bool detach) {
  const int64_t M = MC > 0 ? MC : M_;  // out_d, a compile-time constant for the common sizes
  const int64_t JM = J * M, IJ = I * J;
  const bool through_routing = !detach && r > 1;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> uh(through_routing ? I * JM : 0), dv(JM), part(JM), dc(J);
    T* __restrict dcp = dc.data();
    for (int64_t b = begin; b < end; ++b) {
      const T* s = s_all + b * r * JM;
      T* ds = ds_all + b * r * JM;
      for (int64_t t = 0; t < r; ++t) squash_rows(s + t * JM, v_all + (b * r + t) * JM, J, M);
      squash_backward_rows(s + (r - 1) * JM, gv ? gv + b * JM : nullptr, ds + (r - 1) * JM, J, M);
      if (!through_routing) continue;
      votes<T, MC, 0, false>(u + b * I * N, W, uh.data(), nullptr, nullptr, nullptr, I, J, N, M);
      for (int64_t t = r - 1; t >= 1; --t) {
        const T* __restrict ct = c_all + ((t - 1) * B + b) * IJ;
        const T* __restrict gnext = t < r - 1 ? g_all + (t * B + b) * IJ : nullptr;
        const T* __restrict gcb = (t == r - 1 && gc != nullptr) ? gc + b * IJ : nullptr;
        T* __restrict gt = g_all + ((t - 1) * B + b) * IJ;
        const T* __restrict dst = ds + t * JM;
        std::fill(dv.begin(), dv.end(), T(0));
        for (int64_t i0 = 0; i0 < I; i0 += kBlock) {
          const int64_t i1 = std::min(I, i0 + kBlock);
          std::fill(part.begin(), part.end(), T(0));
          T* __restrict pp = part.data();
          for (int64_t i = i0; i < i1; ++i) {
            // dc_ij = û_j|i · ds_j  (+ dL/dc of the output c at the last pass)
            for (int64_t j = 0; j < J; ++j) {
              const T* __restrict x = uh.data() + (i * J + j) * M;
              const T* __restrict y = dst + j * M;
              T a = 0;
#pragma omp simd reduction(+ : a)
              for (int64_t m = 0; m < M; ++m) a += x[m] * y[m];
              dcp[j] = gcb ? a + gcb[i * J + j] : a;
            }
            // softmax backward over j: dL/db_t = c ⊙ (dc − Σ_j c dc), plus dL/db_{t+1} (b_{t+1} = b_t + a_t)
            T cdc = 0;
            for (int64_t j = 0; j < J; ++j) cdc += ct[i * J + j] * dcp[j];
            for (int64_t j = 0; j < J; ++j) {
              const T g = ct[i * J + j] * (dcp[j] - cdc) + (gnext ? gnext[i * J + j] : T(0));
              gt[i * J + j] = g;
              // dv_{t-1,j} += G_t,ij û_j|i  (G_t = dL/da_{t-1})
              const T* __restrict x = uh.data() + (i * J + j) * M;
#pragma omp simd
              for (int64_t m = 0; m < M; ++m) pp[j * M + m] += g * x[m];
            }
          }
#pragma omp simd
          for (int64_t k = 0; k < JM; ++k) dv[k] += pp[k];
        }
        squash_backward_rows(s + (t - 1) * JM, dv.data(), ds + (t - 1) * JM, J, M);
      }
    }
  });
}

// Phase 2, parallel over input capsules i: dû_bij [B, J, M] from its factors (Eq. above), then
//   dL/du_bin = Σ_(j,m) W_ijnm dû_bijm  and  dL/dW_ijnm = Σ_b u_bin dû_bijm  (b in a fixed order: deterministic).
// du, dW may be nullptr. MC, NC: out_d and in_d as compile-time constants (0: runtime).
template <typename T, int MC, int NC>
void backward_inputs(const T* u, const T* W, const T* c_all, const T* ds_all, const T* v_all, const T* g_all, T* du,
                     T* dW, int64_t B, int64_t I, int64_t J, int64_t N_, int64_t M_, int64_t r, bool detach) {
  const int64_t M = MC > 0 ? MC : M_, N = NC > 0 ? NC : N_;
  const int64_t JM = J * M, IJ = I * J, NM = N * M, JNM = J * N * M;
  const bool through_routing = !detach && r > 1;
  const T inv_j = T(1) / T(J);
  at::parallel_for(0, I, 4, [&](int64_t begin, int64_t end) {
    std::vector<T> dhat(B * JM), acc(NM);
    T* __restrict a = acc.data();
    for (int64_t i = begin; i < end; ++i) {
      // dû_bij = (1/J) ds_0,j + Σ_{t≥1} (c_t,ij ds_t,j + G_t,ij v_{t-1,j})   [B, J, M]
      for (int64_t b = 0; b < B; ++b) {
        T* __restrict dh = dhat.data() + b * JM;
        const T* __restrict ds = ds_all + b * r * JM;
        const T* __restrict vv = v_all + b * r * JM;
        if (r == 1) {
#pragma omp simd
          for (int64_t k = 0; k < JM; ++k) dh[k] = inv_j * ds[k];
        } else if (!through_routing) {  // detach_votes: only the last pass, s_r = Σ_i c_r,ij û_j|i
          const T* ct = c_all + ((r - 2) * B + b) * IJ + i * J;
          for (int64_t j = 0; j < J; ++j) {
            const T cj = ct[j];
#pragma omp simd
            for (int64_t m = 0; m < M; ++m) dh[j * M + m] = cj * ds[(r - 1) * JM + j * M + m];
          }
        } else {
          for (int64_t j = 0; j < J; ++j) {
#pragma omp simd
            for (int64_t m = 0; m < M; ++m) dh[j * M + m] = inv_j * ds[j * M + m];
            for (int64_t t = 1; t < r; ++t) {
              const T cj = c_all[((t - 1) * B + b) * IJ + i * J + j];
              const T gj = g_all[((t - 1) * B + b) * IJ + i * J + j];
              const T* __restrict y = ds + t * JM + j * M;
              const T* __restrict z = vv + (t - 1) * JM + j * M;
#pragma omp simd
              for (int64_t m = 0; m < M; ++m) dh[j * M + m] += cj * y[m] + gj * z[m];
            }
          }
        }
      }
      const T* __restrict wi = W + i * JNM;
      if (du != nullptr) {
        for (int64_t b = 0; b < B; ++b)
          votes_backward_input<T, MC, NC>(wi, dhat.data() + b * JM, a, du + (b * I + i) * N, J, N, M);
      }
      if (dW != nullptr) {
        for (int64_t j = 0; j < J; ++j) {
          for (int64_t k = 0; k < NM; ++k) a[k] = 0;
          for (int64_t b = 0; b < B; ++b) {
            const T* __restrict ub = u + (b * I + i) * N;
            const T* __restrict dh = dhat.data() + b * JM + j * M;
            for (int64_t n = 0; n < N; ++n) {
              const T un = ub[n];
#pragma omp simd
              for (int64_t m = 0; m < M; ++m) a[n * M + m] += un * dh[m];
            }
          }
          std::copy(a, a + NM, dW + i * JNM + j * NM);
        }
      }
    }
  });
}

// Calls the kernel with MC_ = M, NC_ = N as compile-time constants for the paper's capsule sizes (8D → 16D), else
// with MC_ = NC_ = 0 (runtime sizes). (Uses N from the enclosing scope.)
#define FOR_M(M, ...) CAPSNET_WITH_SIZES((M) == 16 && N == 8, 16, 8, __VA_ARGS__)

void check_inputs(const at::Tensor& u, const at::Tensor& W) {
  TORCH_CHECK(u.device().is_cpu() && W.device().is_cpu(), "routing_cpu: CPU tensors expected");
  TORCH_CHECK(u.dim() == 3 && W.dim() == 4, "routing_cpu: u [B, I, N] and W [I, J, N, M] expected");
  TORCH_CHECK(u.size(1) == W.size(0) && u.size(2) == W.size(2), "routing_cpu: shapes of u and W do not match");
  TORCH_CHECK(u.scalar_type() == W.scalar_type(), "routing_cpu: u and W must have the same dtype");
  TORCH_CHECK(u.is_contiguous() && W.is_contiguous(), "routing_cpu: contiguous tensors expected");
}

// Returns v [B, J, M], c_all [r-1, B, I, J] (c_t of passes t = 1 … r-1) and s_all [B, r, J, M].
std::vector<at::Tensor> routing_forward(const at::Tensor& u, const at::Tensor& W, int64_t r) {
  check_inputs(u, W);
  TORCH_CHECK(r >= 1, "routing_cpu: iterations must be >= 1");
  const int64_t B = u.size(0), I = W.size(0), J = W.size(1), N = W.size(2), M = W.size(3);
  auto v = at::empty({B, J, M}, u.options());
  auto c_all = at::empty({r - 1, B, I, J}, u.options());
  auto s_all = at::empty({B, r, J, M}, u.options());
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "routing_cpu_forward", [&] {
    FOR_M(M, forward_impl<scalar_t, MC_>(u.data_ptr<scalar_t>(), W.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                           s_all.data_ptr<scalar_t>(), c_all.data_ptr<scalar_t>(), B, I, J, N, M, r));
  });
  return {v, c_all, s_all};
}

// Returns dL/du [B, I, N] and dL/dW [I, J, N, M] (undefined tensors where not needed).
std::vector<at::Tensor> routing_backward(const std::optional<at::Tensor>& grad_v,
                                         const std::optional<at::Tensor>& grad_c, const at::Tensor& u,
                                         const at::Tensor& W, const at::Tensor& c_all, const at::Tensor& s_all,
                                         int64_t r, bool detach, bool need_u, bool need_w) {
  check_inputs(u, W);
  const int64_t B = u.size(0), I = W.size(0), J = W.size(1), N = W.size(2), M = W.size(3);
  TORCH_CHECK(c_all.is_contiguous() && s_all.is_contiguous(), "routing_cpu: saved tensors must be contiguous");
  at::Tensor gv, gc;
  if (grad_v.has_value() && grad_v->defined()) gv = grad_v->to(u.scalar_type()).contiguous();
  if (grad_c.has_value() && grad_c->defined()) gc = grad_c->to(u.scalar_type()).contiguous();
  const bool through_routing = !detach && r > 1;
  auto ds_all = at::empty({B, r, J, M}, u.options());
  auto v_all = at::empty({B, r, J, M}, u.options());
  auto g_all = at::empty({through_routing ? r - 1 : 0, B, I, J}, u.options());
  at::Tensor du = need_u ? at::empty({B, I, N}, u.options()) : at::Tensor();
  at::Tensor dW = need_w ? at::empty({I, J, N, M}, u.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(u.scalar_type(), "routing_cpu_backward", [&] {
    using T = scalar_t;
    FOR_M(M, backward_factors<T, MC_>(u.data_ptr<T>(), W.data_ptr<T>(), s_all.data_ptr<T>(), c_all.data_ptr<T>(),
                        gv.defined() ? gv.data_ptr<T>() : nullptr, gc.defined() ? gc.data_ptr<T>() : nullptr,
                        ds_all.data_ptr<T>(), v_all.data_ptr<T>(), g_all.data_ptr<T>(), B, I, J, N, M, r, detach));
    if (need_u || need_w) {
      FOR_M(M, backward_inputs<T, MC_, NC_>(u.data_ptr<T>(), W.data_ptr<T>(), c_all.data_ptr<T>(), ds_all.data_ptr<T>(),
                         v_all.data_ptr<T>(), g_all.data_ptr<T>(), need_u ? du.data_ptr<T>() : nullptr,
                         need_w ? dW.data_ptr<T>() : nullptr, B, I, J, N, M, r, detach));
    }
  });
  return {du, dW};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &routing_forward, "Procedure 1, fused (CPU)");
  m.def("backward", &routing_backward, "Backward of Procedure 1, fused (CPU)");
}
