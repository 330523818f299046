// Building blocks shared by the fused CPU routing kernels: routing_cpu.cpp (dynamic routing) and
// inverted_attention_cpu.cpp (inverted dot-product attention routing). capsnet.routing.extension splices this file
// into a kernel's source in place of its `#include "routing_common.h"` line, so the extension's name and build cache
// key follow this file too.
//
// Shapes, per sample: u [I, N] input capsules (child poses), W [I, J, N, M] transformation matrices, votes
// v_ij = W_ijᵀ u_i [I, J, M] (û_j|i of Sabour et al. Eq. 2; v_ij of Tsai et al. Eq. 1).

#ifndef CAPSNET_ROUTING_COMMON_H
#define CAPSNET_ROUTING_COMMON_H

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 32;  // input capsules per block (softmax batch, and the partial sums over i)

// --- exp for softmax inputs x ≤ 0, written so that GCC vectorizes the loop (std::exp is a scalar call) ---------------
// x = k·ln2 + r, |r| ≤ ln2/2 (Cody–Waite split of ln2 = ln2_hi + ln2_lo); exp(r) by its Taylor series (relative error
// < 2e-16 for double with degree 12, < 1e-8 for float with degree 7); 2^k from the exponent bits.
template <typename T>
struct ExpConstants;
template <>
struct ExpConstants<double> {
  using Int = int64_t;
  static constexpr int kDegree = 12, kMantissa = 52, kBias = 1023;
  static constexpr double kMin = -708.0, kLog2e = 1.4426950408889634;
  static constexpr double kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;
};
template <>
struct ExpConstants<float> {
  using Int = int32_t;
  static constexpr int kDegree = 7, kMantissa = 23, kBias = 127;
  static constexpr float kMin = -87.0f, kLog2e = 1.44269504f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
};

// The Taylor coefficients 1/k!, k = 0 … degree (k! is exact in T, so each is the correctly rounded quotient).
template <typename T>
constexpr std::array<T, ExpConstants<T>::kDegree + 1> exp_coefficients() {
  std::array<T, ExpConstants<T>::kDegree + 1> c{};
  int64_t factorial = 1;
  for (int k = 0; k <= ExpConstants<T>::kDegree; ++k) {
    factorial *= k > 1 ? k : 1;
    c[k] = T(1) / T(factorial);
  }
  return c;
}

template <typename T>
inline void exp_inplace(T* __restrict x, int64_t n) {
  using E = ExpConstants<T>;
  constexpr auto c = exp_coefficients<T>();
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) {
    const T xv = std::max(x[k], E::kMin);
    const T kf = std::floor(xv * E::kLog2e + T(0.5));
    const T r = (xv - kf * E::kLn2Hi) - kf * E::kLn2Lo;
    T p = c[E::kDegree];  // Horner: p = Σ_d c_d r^d
#pragma GCC unroll 16
    for (int d = E::kDegree - 1; d >= 0; --d) p = p * r + c[d];
    const typename E::Int bits = (static_cast<typename E::Int>(kf) + E::kBias) << E::kMantissa;
    x[k] = p * __builtin_bit_cast(T, bits);
  }
}

// The rows X_i [N, M] that multiply the weights in the votes: v_ij[m] = Σ_n W_ij[n, m] X_i[n, m]. Vector poses:
// X_i[n, m] = u_i[n]. Matrix poses (MAT; u_i a row-major S×S matrix P_i, N = S, M = S²): V_ij = A_ij P_i with the
// weights passed as W[k, (r, c)] = A_ij[r, k], so X_i[k, (r, c)] = P_i[k, c].
template <typename T, bool MAT>
inline void child_rows(const T* __restrict ui, T* __restrict x, int64_t N, int64_t M) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) x[n * M + m] = MAT ? ui[n * N + m % N] : ui[n];
}

// The votes of one sample: v[i, j, :] = Σ_n W[i, j, n, :] X_i[n, :].  u [I, D] (D = N, or M for matrix poses),
// W [I, J, N, M], v [I, J, M]. If s0 is given, also s0 = Σ_i v_ij [J, M] (a uniform pass's sum, before the 1/J), in
// blocks of kBlock; part [J, M] is then scratch, and x [N, M] is scratch for matrix poses. MC, NC: M and N as
// compile-time constants (0: the runtime M_, N_).
template <typename T, int MC, int NC, bool MAT>
void votes(const T* __restrict u, const T* __restrict W, T* __restrict v, T* __restrict s0, T* __restrict part,
           T* __restrict x, int64_t I, int64_t J, int64_t N_, int64_t M_) {
  const int64_t M = MC > 0 ? MC : M_, N = NC > 0 ? NC : N_;
  const int64_t JM = J * M, D = MAT ? M : N;
  if (s0 != nullptr) std::fill(s0, s0 + JM, T(0));
  for (int64_t i0 = 0; i0 < I; i0 += kBlock) {
    const int64_t i1 = std::min(I, i0 + kBlock);
    if (s0 != nullptr) std::fill(part, part + JM, T(0));
    for (int64_t i = i0; i < i1; ++i) {
      const T* __restrict ui = u + i * D;
      if (MAT) child_rows<T, MAT>(ui, x, N, M);
      for (int64_t j = 0; j < J; ++j) {
        const T* __restrict w = W + (i * J + j) * N * M;
        T* __restrict out = v + (i * J + j) * M;
        if (MAT) {
#pragma omp simd
          for (int64_t m = 0; m < M; ++m) out[m] = x[m] * w[m];
          for (int64_t n = 1; n < N; ++n) {
#pragma omp simd
            for (int64_t m = 0; m < M; ++m) out[m] += x[n * M + m] * w[n * M + m];
          }
        } else {
#pragma omp simd
          for (int64_t m = 0; m < M; ++m) out[m] = ui[0] * w[m];
          for (int64_t n = 1; n < N; ++n) {
#pragma omp simd
            for (int64_t m = 0; m < M; ++m) out[m] += ui[n] * w[n * M + m];
          }
        }
      }
      if (s0 != nullptr) {
        const T* __restrict row = v + i * JM;
#pragma omp simd
        for (int64_t k = 0; k < JM; ++k) part[k] += row[k];
      }
    }
    if (s0 != nullptr) {
#pragma omp simd
      for (int64_t k = 0; k < JM; ++k) s0[k] += part[k];
    }
  }
}

// s_j += Σ_(i0 ≤ i < i1) c_ij v_ij for one block of inputs (summed in part [J, M] first).  c [I, J], v [I, J, M].
template <typename T, int MC>
inline void add_weighted_votes(const T* __restrict c, const T* __restrict v, T* __restrict part, T* __restrict s,
                               int64_t i0, int64_t i1, int64_t J, int64_t M_) {
  const int64_t M = MC > 0 ? MC : M_, JM = J * M;
  std::fill(part, part + JM, T(0));
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t j = 0; j < J; ++j) {
      const T cij = c[i * J + j];
      const T* __restrict x = v + (i * J + j) * M;
#pragma omp simd
      for (int64_t m = 0; m < M; ++m) part[j * M + m] += cij * x[m];
    }
  }
#pragma omp simd
  for (int64_t k = 0; k < JM; ++k) s[k] += part[k];
}

// Back through the votes of input i for one sample: a[n, m] = Σ_j W_i[j, n, m] dv_j[m]  [N, M] from dv [J, M];
// with vector poses dL/du_i[n] = Σ_m a[n, m] (written to du [N] if given).  W_i [J, N, M].
template <typename T, int MC, int NC>
inline void votes_backward_input(const T* __restrict wi, const T* __restrict dv, T* __restrict a, T* __restrict du,
                                 int64_t J, int64_t N_, int64_t M_) {
  const int64_t M = MC > 0 ? MC : M_, N = NC > 0 ? NC : N_;
  for (int64_t k = 0; k < N * M; ++k) a[k] = 0;
  for (int64_t j = 0; j < J; ++j) {
    for (int64_t n = 0; n < N; ++n) {
#pragma omp simd
      for (int64_t m = 0; m < M; ++m) a[n * M + m] += wi[(j * N + n) * M + m] * dv[j * M + m];
    }
  }
  if (du == nullptr) return;
  for (int64_t n = 0; n < N; ++n) {
    T sum = 0;
    for (int64_t m = 0; m < M; ++m) sum += a[n * M + m];
    du[n] = sum;
  }
}

}  // namespace

// Runs the statement(s) `...` with MC_, NC_ = mc, nc (compile-time sizes) if `cond`, else with MC_ = NC_ = 0 (sizes
// known at run time only).
#define CAPSNET_WITH_SIZES(cond, mc, nc, ...) \
  do {                                        \
    if (cond) {                               \
      constexpr int MC_ = (mc), NC_ = (nc);   \
      __VA_ARGS__;                            \
    } else {                                  \
      constexpr int MC_ = 0, NC_ = 0;         \
      __VA_ARGS__;                            \
    }                                         \
  } while (0)

#endif  // CAPSNET_ROUTING_COMMON_H
