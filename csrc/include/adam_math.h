// Adam / AdamW element-wise update (lightning_optim/optim/adam.py), fp32 math and state.
//
//   g <- g + l2 p                                   (L2 mode; l2 = 0 otherwise)
//   m <- lerp(m, g, 1 - beta1);  v <- beta2 v + (1 - beta2) g^2;  vmax <- max(vmax, v) (amsgrad)
//   delta = step * m / (sqrt(v) / sqrt_bc2 + eps)   with step = -lr / bc1
//   then apply_delta: decoupled decay (keep/neg_decay), Kahan for 16-bit params,
//   and optionally a rounded copy of the new fp32 param (master-weight layout).
// APPLY=false is optimizer accumulation: the moments move, the params stay.
#pragma once

#include "apply_math.h"

namespace lo {

struct AdamHyper {
  float w1 /* 1 - beta1 */, beta2, c2 /* 1 - beta2 */, step, sqrt_bc2, eps, l2;
  Decay decay;
};

// Lists: 0 param (P), 1 grad (G), 2 exp_avg, 3 exp_avg_sq, 4 max_exp_avg_sq, 5 kahan_comp (P),
// 6 param copy (C; void: none). States are fp32.
template <typename P, typename G, typename C, bool AMSGRAD, bool KAHAN, bool APPLY>
struct AdamOp {
  static constexpr int depth = 7;
  using lists = ListAccess<Access<P, true, APPLY>, In<G>, InOut<float>, InOut<float>, UsedIf<AMSGRAD, InOut<float>>,
                           UsedIf<KAHAN && APPLY, InOut<P>>, UsedIf<APPLY && !std::is_void<C>::value, Out<C>>>;
  struct Ptrs { P* p; const G* g; float* m; float* v; float* vmax; P* comp; C* copy; };
  AdamHyper h;

  HOST_DEVICE Ptrs bind(void* const* b, int64_t) const {
    return Ptrs{static_cast<P*>(b[0]), static_cast<const G*>(b[1]), static_cast<float*>(b[2]),
                static_cast<float*>(b[3]), static_cast<float*>(b[4]), static_cast<P*>(b[5]),
                static_cast<C*>(b[6])};
  }

  HOST_DEVICE LO_INLINE void operator()(const Ptrs& t, int64_t i) const {
    float g = to_float(t.g[i]);
    float pc = to_float(t.p[i]);
    g = g + h.l2 * pc;
    float m = lerp(t.m[i], g, h.w1);
    float v = t.v[i] * h.beta2;
    v = v + (h.c2 * g) * g;
    t.m[i] = m;
    t.v[i] = v;
    if constexpr (AMSGRAD) {
      float vm = t.vmax[i];
      vm = vm > v ? vm : v;  // torch.maximum (NaN in v propagates)
      vm = v != v ? v : vm;
      t.vmax[i] = vm;
      v = vm;
    }
    if constexpr (APPLY) {
      float denom = sqrtf(v) / h.sqrt_bc2 + h.eps;
      float delta = (m / denom) * h.step;
      apply_delta<P, KAHAN>(t.p, t.comp, i, delta, h.decay);
      if constexpr (!std::is_void<C>::value) t.copy[i] = from_float<C>(to_float(t.p[i]));
    }
  }
};

// 1-bit Adam's compression-stage step: the momentum m arrives final (in the grads' list, fp32) and v
// is frozen, so neither is written back: reads p, m, v, writes p. The same delta as AdamOp with
// beta1 = 0, beta2 = 1 (m <- lerp(m, m', 1) = m', v <- v) for finite m'.
template <typename P, bool KAHAN>
struct AdamFrozenOp {
  static constexpr int depth = 7;
  using lists = ListAccess<InOut<P>, In<float>, Unused, In<float>, Unused, UsedIf<KAHAN, InOut<P>>, Unused>;
  struct Ptrs { P* p; const float* m; const float* v; P* comp; };
  AdamHyper h;

  HOST_DEVICE Ptrs bind(void* const* b, int64_t) const {
    return Ptrs{static_cast<P*>(b[0]), static_cast<const float*>(b[1]), static_cast<const float*>(b[3]),
                static_cast<P*>(b[5])};
  }

  HOST_DEVICE LO_INLINE void operator()(const Ptrs& t, int64_t i) const {
    float denom = sqrtf(t.v[i]) / h.sqrt_bc2 + h.eps;
    float delta = (t.m[i] / denom) * h.step;
    apply_delta<P, KAHAN>(t.p, t.comp, i, delta, h.decay);
  }
};

}  // namespace lo
