"""Process-wide state of lightning-optim that a long-lived process puts back between runs, so
each run starts as a freshly started process would: used by the phased torchrun scripts (``tests/accel/phases.py``)
between phases."""

from __future__ import annotations

import sys

# lightning-optim modules whose globals are caches of the disk (the loaded extension): kept across runs
KEPT_BY_DEFAULT = frozenset({"lightning_optim.ops._loader"})
# process-wide objects lightning-optim mutates in place, emptied after every run (a fresh process starts with
# them empty): the byte counter behind comm_stats(), the compressed allreduce's plan cache and this thread's
# scratch buffers
_EMPTIED = (("lightning_optim.comm.stats", "_DEFAULT", "reset"), ("lightning_optim.comm.plan", "_PLANS", "clear"))
_PER_THREAD = (("lightning_optim.comm.compressed", "_CACHE"),)


def library_globals(kept: frozenset[str] = KEPT_BY_DEFAULT) -> dict[str, dict[str, object]]:
    """The module globals of every imported lightning_optim / accel_plugins module but those in ``kept``."""
    return {name: dict(vars(module)) for name, module in list(sys.modules.items())
            if module is not None and name.split(".")[0] in ("lightning_optim", "accel_plugins")
            and name not in kept}


def restore_library_state(saved_globals: dict[str, dict[str, object]]) -> None:
    """Empty the in-place caches and counters, and rebind every global rebound since ``saved_globals`` was
    taken (``set_collective_timeout``'s bound, a warn-once flag) to its saved value."""
    for module_name, attribute, method in _EMPTIED:
        target = getattr(sys.modules.get(module_name), attribute, None)
        if target is not None:
            getattr(target, method)()
    for module_name, attribute in _PER_THREAD:
        target = getattr(sys.modules.get(module_name), attribute, None)
        if target is not None:
            vars(target).clear()
    for name, saved in saved_globals.items():
        module = sys.modules.get(name)
        if module is None:
            continue
        current = vars(module)
        for key, value in saved.items():
            if current.get(key, saved) is not value:
                current[key] = value

