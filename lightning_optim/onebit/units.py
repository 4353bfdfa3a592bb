r"""Compression units: 1-bit Adam's compression stage run per group of params instead of once for the
whole model, so that each group can be exchanged as soon as its gradients exist (``overlap.py``).

The units cut the layout's params, last to first (the order backward produces gradients, and DDP's
buckets), into runs of at most ``cap`` elements (a param larger than ``cap`` is a unit of its own). For
a unit :math:`U` with this rank's gradients :math:`g_U`, one call

.. math:: m_U \leftarrow C\big(\mathrm{lerp}(m_U, g_U, 1-\beta_1)\big)

runs the error-compensated 1-bit average :math:`C` (``compressed_allreduce``, one scale per param, as
the whole-model call) in place on the unit's slice of the flat momentum buffer, with its own error
buffers. The result depends only on the unit, its gradients and its error buffers, not on the thread,
the moment or the order in which units run: the overlapped path (a DDP comm hook hands each unit to a
communication thread once DDP has all its gradients) and the step-time path (every unit one after the
other in ``step()``) give identical momenta, error buffers and params, and so does a run resumed from
a checkpoint under DDP buckets that differ (a fresh DDP buckets differently until it rebuilds).

The units are a function of the layout and ``cap`` only; a checkpoint holds them with their error
buffers (``"units"`` in the ``"onebit"`` entry). Restored under other units (another cap or model), or
by another rank or world size, the error buffers restart at zero with a warning.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from lightning_optim.comm.compressed import compressed_allreduce, error_buffer_sizes
from lightning_optim.onebit.layout import Layout

if TYPE_CHECKING:  # the optimizer this is mixed into (see onebit/host.py)
    from lightning_optim.onebit.host import OnebitHost as _Host
else:
    _Host = object

__all__ = ["CompressionUnitsMixin", "cut_units"]

Unit = tuple[int, ...]


def cut_units(numels: list[int], cap: int) -> list[Unit]:
    """Positions ``len(numels) - 1 .. 0`` cut into runs of at most ``cap`` elements (at least one each);
    each run listed in ascending order, so that its momenta are one slice of the flat buffer."""
    units: list[Unit] = []
    run: list[int] = []
    size = 0
    for i in reversed(range(len(numels))):
        if run and size + numels[i] > cap:
            units.append(tuple(reversed(run)))
            run, size = [], 0
        run.append(i)
        size += numels[i]
    if run:
        units.append(tuple(reversed(run)))
    return units


class CompressionUnitsMixin(_Host):
    """Unit methods of :class:`~lightning_optim.onebit.adam.OnebitAdam`."""

    def _init_units(self) -> None:
        self._unit_cap: int | None = None  # None: the whole model in one call
        self._units_of: tuple[Layout, list[Unit], dict[int, int]] | None = None  # units, unit index by param id
        self._units_done: set[Unit] = set()  # units the hook compressed for the coming step
        self._unit_errors_map: dict[Unit, tuple[Tensor, Tensor]] = {}
        self._saved_units: dict[str, Any] | None = None  # from load_state_dict, used at first use

    @property
    def uses_units(self) -> bool:
        return self._unit_cap is not None

    def set_compression_units(self, cap: int | None) -> None:
        """Compress the compression stage's momenta in units of at most ``cap`` elements (None: the whole
        model in one call). Changing it drops the error buffers of the old units (with a warning)."""
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"cap must be a positive number of elements or None, got {cap!r}")
        if cap is not None and self.hierarchical:
            raise ValueError(f"{type(self).__name__}: compression units (overlap=True) exchange each unit over the "
                             f"whole group; with hierarchical={self.hierarchical!r} the model is exchanged in one "
                             "call per step: drop overlap or hierarchical")
        if cap != self._unit_cap and self._unit_errors_map:
            self._warn_errors_reset("the compression units changed")
            self._unit_errors_map = {}
        self._unit_cap = cap
        self._units_of = None

    def _units(self, layout: Layout) -> list[Unit]:
        return self._cut(layout)[1]

    def _cut(self, layout: Layout) -> tuple[Layout, list[Unit], dict[int, int]]:
        units_of = self._units_of
        if units_of is None or units_of[0] is not layout:
            units = cut_units(layout.numels, cast(int, self._unit_cap))  # only used with a cap set
            unit_of = {i: k for k, unit in enumerate(units) for i in unit}
            positions = {id(p): i for i, p in enumerate(layout.params)}
            units_of = self._units_of = (layout, units, {pid: unit_of[i] for pid, i in positions.items()})
        return units_of

    def _units_completed_by(self, layout: Layout, params: list[Tensor], ready: set[int]) -> list[Unit]:
        """Mark ``params`` (a DDP bucket) ready; the units that are now complete, in unit order."""
        _, units, unit_of = self._cut(layout)
        touched = set()
        for p in params:
            k = unit_of.get(id(p))
            if k is None:
                if p.requires_grad:
                    raise ValueError("params: a DDP bucket holds a param this optimizer does not train; give the "
                                     "optimizer every trainable param of the DDP model")
                continue
            ready.add(id(p))
            touched.add(k)
        return [units[k] for k in sorted(touched)
                if all(id(layout.params[i]) in ready for i in units[k])]

    def _unit_errors(self, layout: Layout, unit: Unit) -> tuple[Tensor, Tensor]:
        """The error buffers of ``unit`` (from the loaded checkpoint when it holds this unit, else zeros)."""
        found = self._unit_errors_map.get(unit)
        if found is None:
            numels = [layout.numels[i] for i in unit]
            sizes = error_buffer_sizes(sum(numels), self._world()[0], numels)
            found = self._saved_unit_errors(unit, sizes, layout.device)
            if found is None:
                worker_size, server_size = sizes
                found = (torch.zeros(worker_size, dtype=torch.float32, device=layout.device),
                         torch.zeros(server_size, dtype=torch.float32, device=layout.device))
            self._unit_errors_map[unit] = found
        return found

    def _saved_unit_errors(self, unit: Unit, sizes: tuple[int, int],
                           device: torch.device) -> tuple[Tensor, Tensor] | None:
        saved = self._saved_units
        if saved is None:
            return None
        why = None
        if tuple(saved["origin"]) != tuple(self._world()):
            why = f"they were saved by rank {saved['origin'][1]} of {saved['origin'][0]}"
        elif unit not in saved["units"] or tuple(saved["sizes"][saved["units"].index(unit)]) != tuple(sizes):
            why = "they were saved for other compression units (another cap or model)"
        if why is not None:
            self._saved_units = None
            self._warn_errors_reset(why)
            return None
        k = saved["units"].index(unit)
        worker = saved["worker"].split([s[0] for s in saved["sizes"]])[k]
        server = saved["server"].split([s[1] for s in saved["sizes"]])[k]
        return worker.to(device).clone(), server.to(device).clone()

    def _compress_unit(self, layout: Layout, unit: Unit, grads: list[Tensor | None], w1: float) -> None:
        """``m_U <- C(lerp(m_U, g_U, w1))`` for ``unit``; ``grads`` in the unit's order (``None``: zero)."""
        views = [self._flat_views["exp_avg"][i] for i in unit]
        numels = [layout.numels[i] for i in unit]
        filled = [torch.zeros_like(v) if g is None else g for g, v in zip(grads, views)]
        start = layout.offsets[unit[0]]
        buffer = self._flats["exp_avg"][start:start + sum(numels)]  # the unit's positions are consecutive
        worker, server = self._unit_errors(layout, unit)
        compressed_allreduce(buffer, worker, server, group=self.process_group, segments=numels,
                             momentum=([g for g, n in zip(filled, numels) if n], w1))

    def _compress_units(self, layout: Layout, grads: list[Tensor | None], w1: float) -> None:
        """Step time: every unit the hook did not compress for this step, in unit order."""
        for unit in self._units(layout):
            if unit not in self._units_done:
                self._compress_unit(layout, unit, [grads[i] for i in unit], w1)
        self._units_done.clear()

    # ------------------------------------------------------------------ checkpoints
    def _units_state(self) -> dict[str, Any] | None:
        """The units and their error buffers back to back, for ``state_dict`` (None: no units)."""
        if not self._unit_errors_map:
            return self._saved_units  # loaded and not used yet: keep them
        units = list(self._unit_errors_map)
        pairs = [self._unit_errors_map[u] for u in units]
        return {"units": units, "sizes": [(w.numel(), s.numel()) for w, s in pairs],
                "worker": torch.cat([w for w, _ in pairs]), "server": torch.cat([s for _, s in pairs]),
                "origin": tuple(self._world())}

    def _check_units_state(self, saved: dict[str, Any] | None) -> None:
        """A saved ``units`` entry: the units, their (worker, server) sizes and the two real floating-point
        buffers they split (checked at load, before anything changes; used at the first step)."""
        if saved is None:
            return
        if not isinstance(saved, dict) or not {"units", "sizes", "worker", "server", "origin"} <= set(saved):
            raise ValueError("state_dict: onebit units must be a dict with units, sizes, worker, server and origin")
        sizes = saved["sizes"]
        if len(saved["units"]) != len(sizes) or not all(len(pair) == 2 for pair in sizes):
            raise ValueError("state_dict: onebit units: one (worker, server) size pair per unit expected")
        for index, key in enumerate(("worker", "server")):
            buf = saved[key]
            if not isinstance(buf, Tensor) or not buf.is_floating_point() or buf.dim() != 1:
                raise ValueError(f"state_dict: onebit units {key} must be a 1-D real floating-point tensor, got "
                                 f"{getattr(buf, 'dtype', type(buf).__name__)}")
            if buf.numel() != sum(int(pair[index]) for pair in sizes):
                raise ValueError(f"state_dict: onebit units {key} holds {buf.numel()} elements, its sizes "
                                 f"{sum(int(pair[index]) for pair in sizes)}")

    def _load_units_state(self, saved: dict[str, Any] | None) -> None:
        cap = self._unit_cap
        self._init_units()
        self._unit_cap = cap
        if saved is not None:
            self._saved_units = {**saved, "units": [tuple(u) for u in saved["units"]]}
