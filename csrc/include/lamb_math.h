// LAMB (lightning_optim/optim/lamb.py) in two phases, as the trust ratio needs whole-tensor norms.
//
// Phase 1 (LambMomentsOp): g <- g / clip_div + l2 p;  m <- beta1 m + a g;  v <- beta2 v + (1 - beta2) g^2
//   and, when NORMS, the sums of p^2 and u^2 per tensor with
//   u = (m / bc1) / (sqrt(v / bc2) + eps | sqrt(v / bc2 + eps)) + wd p
// Between the phases the caller turns the norms into per-tensor scales  -lr * clamp(|p| / |u|).
// Phase 2 (LambApplyOp): recomputes the same u from the updated moments (bit-identical) and
//   applies delta = scale[tensor] * u (Kahan for 16-bit params, no decoupled decay).
#pragma once

#include "apply_math.h"

namespace lo {

struct LambHyper {
  float clip_div, l2, beta1, m_coef /* 1 - beta1 or 1 */, beta2, c2, bc1, bc2, eps, wd;
  bool eps_inside_sqrt;
  const float* scale;  // phase 2: one per tensor
};

HOST_DEVICE LO_INLINE float lamb_direction(const LambHyper& h, float m, float v, float pc) {
  float d = v / h.bc2;
  d = h.eps_inside_sqrt ? sqrtf(d + h.eps) : sqrtf(d) + h.eps;
  float u = (m / h.bc1) / d;
  return u + h.wd * pc;
}

// Lists: 0 param (P), 1 grad (G), 2 exp_avg, 3 exp_avg_sq. Accumulates |p|^2, |u|^2.
template <typename P, typename G, bool NORMS>
struct LambMomentsOp {
  static constexpr int depth = 4;
  static constexpr int n_acc = 2;
  using lists = ListAccess<In<P>, In<G>, InOut<float>, InOut<float>>;
  struct Ptrs { P* p; const G* g; float* m; float* v; };
  LambHyper h;

  HOST_DEVICE Ptrs bind(void* const* b, int64_t) const {
    return Ptrs{static_cast<P*>(b[0]), static_cast<const G*>(b[1]), static_cast<float*>(b[2]),
                static_cast<float*>(b[3])};
  }

  HOST_DEVICE LO_INLINE void operator()(const Ptrs& t, int64_t i, float& p_sq, float& u_sq) const {
    float pc = to_float(t.p[i]);
    float g = to_float(t.g[i]) / h.clip_div + h.l2 * pc;
    float m = t.m[i] * h.beta1 + h.m_coef * g;
    float v = t.v[i] * h.beta2 + (h.c2 * g) * g;
    t.m[i] = m;
    t.v[i] = v;
    if constexpr (NORMS) {
      float u = lamb_direction(h, m, v, pc);
      p_sq += pc * pc;
      u_sq += u * u;
    }
  }
};

// Lists: 0 param (P), 1 exp_avg, 2 exp_avg_sq, 3 kahan_comp (P).
template <typename P, bool KAHAN>
struct LambApplyOp {
  static constexpr int depth = 4;
  using lists = ListAccess<InOut<P>, In<float>, In<float>, UsedIf<KAHAN, InOut<P>>>;
  struct Ptrs { P* p; const float* m; const float* v; P* comp; float scale; };
  LambHyper h;

  HOST_DEVICE Ptrs bind(void* const* b, int64_t tensor) const {
    return Ptrs{static_cast<P*>(b[0]), static_cast<const float*>(b[1]), static_cast<const float*>(b[2]),
                static_cast<P*>(b[3]), h.scale[tensor]};
  }

  HOST_DEVICE LO_INLINE void operator()(const Ptrs& t, int64_t i) const {
    float u = lamb_direction(h, t.m[i], t.v[i], to_float(t.p[i]));
    apply_delta<P, KAHAN>(t.p, t.comp, i, u * t.scale, Decay{1.0f, -0.0f});
  }
};

}  // namespace lo
