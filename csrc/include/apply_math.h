// p <- p + delta - c p, Kahan-compensated for 16-bit params: the element-wise form of
// lightning_optim.optim.base.BaseOptimizer._apply when the compute (state) dtype is fp32.
//
//   fp32 params:           p <- p (1 - c);  p <- p + delta         (torch's order: decay, then step)
//   16-bit params:         delta <- delta + p (-c)                 (p read in fp32)
//     with Kahan (comp):   y = delta + comp; t = round(p + y); comp <- round(y - (t - p)); p <- t
//     without:             p <- round(p + delta)
// The kernels take `keep` = 1 - c and `neg_decay` = -c as computed by Python in double, so that
// the fp32 scalars equal those torch's foreach ops use. c = 0 leaves every finite value unchanged.
#pragma once

#include "list_access.h"
#include "lo_common.h"

namespace lo {

struct Decay {
  float keep;       // 1 - c
  float neg_decay;  // -c
};

template <typename P, bool KAHAN>
HOST_DEVICE LO_INLINE void apply_delta(P* p, P* comp, int64_t i, float delta, Decay d) {
  if constexpr (std::is_same<P, float>::value) {
    static_assert(!KAHAN, "fp32 params carry no Kahan compensation");
    p[i] = p[i] * d.keep + delta;
  } else {
    float old = to_float(p[i]);
    delta = delta + old * d.neg_decay;
    if constexpr (KAHAN) {
      float y = delta + to_float(comp[i]);
      P rounded = from_float<P>(old + y);
      p[i] = rounded;
      comp[i] = from_float<P>(y - (to_float(rounded) - old));
    } else {
      p[i] = from_float<P>(old + delta);
    }
  }
}

}  // namespace lo
