"""Reference loss-scale schedule, written from the rule (DeepSpeed's dynamic scaler with
``delayed_shift`` = hysteresis; apex/mlbench's without it):

* a step is skipped iff any rank overflowed;
* the h-th overflowing step in a row multiplies the scale by ``backoff``; a clean step resets the run;
* ``window`` clean steps since the last change (or overflow) multiply it by ``factor`` (capped);
* a back-off below ``min_scale`` is an error.
"""

from __future__ import annotations


def simulate(overflows: list[bool], *, init: float, factor: float, window: int, min_scale: float,
             max_scale: float = float("inf"), hysteresis: int = 1, backoff: float | None = None):
    """Returns (scales used at each step, skipped step indices, index that underflowed or None)."""
    backoff = 1 / factor if backoff is None else backoff
    scale, clean, bad_run = init, 0, 0
    used, skipped = [], []
    for i, overflow in enumerate(overflows):
        used.append(scale)
        if overflow:
            skipped.append(i)
            clean = 0
            bad_run += 1
            if bad_run == hysteresis:
                if scale * backoff < min_scale:
                    return used, skipped, i
                scale *= backoff
                bad_run = 0
        else:
            bad_run = 0
            clean += 1
            if clean == window:
                scale = min(scale * factor, max_scale)
                clean = 0
    return used, skipped, None
