// Adan (lightning_optim/optim/adan.py): Adam-like steps on gradient differences.
//
//   prev <- g at the first step (d = 0);  d = g - prev
//   m <- lerp(m, g, 1 - b1);  n <- lerp(n, d, 1 - b2);  v <- b3 v + (1 - b3) (g + b2 d)^2;  prev <- g
//   u = (m / bc1 + (b2 / bc2) n) / (sqrt(v) / sqrt_bc3 + eps)
//   delta = step u   (step = -lr, or -lr / (1 + kappa) for the proximal decay), then apply_delta
#pragma once

#include "apply_math.h"

namespace lo {

struct AdanHyper {
  float w1 /* 1 - b1 */, w2 /* 1 - b2 */, beta2, beta3, c3 /* 1 - b3 */, bc1, n_coef /* beta2 / bc2 */, sqrt_bc3, eps, step;
  bool first;
  Decay decay;
};

// Lists: 0 param (P), 1 grad (G), 2 exp_avg, 3 exp_avg_diff, 4 exp_avg_sq, 5 prev_grad, 6 kahan_comp (P).
template <typename P, typename G, bool KAHAN, bool APPLY>
struct AdanOp {
  static constexpr int depth = 7;
  using lists = ListAccess<Access<P, APPLY, APPLY>, In<G>, InOut<float>, InOut<float>, InOut<float>, InOut<float>,
                           UsedIf<KAHAN && APPLY, InOut<P>>>;
  struct Ptrs { P* p; const G* g; float* m; float* n; float* v; float* prev; P* comp; };
  AdanHyper h;

  HOST_DEVICE Ptrs bind(void* const* b, int64_t) const {
    return Ptrs{static_cast<P*>(b[0]), static_cast<const G*>(b[1]), static_cast<float*>(b[2]),
                static_cast<float*>(b[3]), static_cast<float*>(b[4]), static_cast<float*>(b[5]),
                static_cast<P*>(b[6])};
  }

  HOST_DEVICE LO_INLINE void operator()(const Ptrs& t, int64_t i) const {
    float g = to_float(t.g[i]);
    float prev = t.prev[i];  // read unconditionally: a select, not a branch, keeps the loop vectorised
    prev = h.first ? g : prev;
    float d = g - prev;
    float m = lerp(t.m[i], g, h.w1);
    float n = lerp(t.n[i], d, h.w2);
    float nest = g + h.beta2 * d;
    float v = t.v[i] * h.beta3;
    v = v + (h.c3 * nest) * nest;
    t.m[i] = m;
    t.n[i] = n;
    t.v[i] = v;
    t.prev[i] = g;
    if constexpr (APPLY) {
      float denom = sqrtf(v) / h.sqrt_bc3 + h.eps;
      float u = (m / h.bc1 + h.n_coef * n) / denom;
      apply_delta<P, KAHAN>(t.p, t.comp, i, u * h.step, h.decay);
    }
  }
};

}  // namespace lo
