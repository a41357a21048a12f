"""The process groups of the ``dp x sp`` grid as device meshes (no Lightning here).

:class:`SPGrid` is what both strategies expose of it (``sp_size``, ``sp_rank``, ``dp_group``,
``device_mesh``, ...), as a mixin over their ranks.

:func:`sp_mesh` builds the ``("dp", "sp")`` mesh of an :class:`~autosp.layout.SPLayout`:
SP groups of ``sp_size`` contiguous ranks, DP groups across them. Every rank must call it, in
the same order.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from autosp.layout import SPLayout, validate_layout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from autosp.modes import Mode

__all__ = ["sp_mesh", "SPGrid"]


def sp_mesh(layout: SPLayout, device_type: str, timeout: Optional[timedelta] = None) -> "DeviceMesh":
    """The ``[dp, sp]`` mesh, dims named ``"dp"`` and ``"sp"``. The subgroups get ``timeout`` (a
    DeviceMesh would create them with the backend's default: 30 min on gloo, 10 min on NCCL)."""
    from torch.distributed.device_mesh import DeviceMesh

    sp_group, _ = dist.new_subgroups_by_enumeration(layout.all_sp_groups(), timeout=timeout)
    dp_group, _ = dist.new_subgroups_by_enumeration(layout.all_dp_groups(), timeout=timeout)
    return DeviceMesh.from_group(
        [dp_group, sp_group],
        device_type,
        mesh=torch.arange(layout.world_size).view(layout.dp_size, layout.sp_size),  # [dp, sp]
        mesh_dim_names=("dp", "sp"),
    )


class SPGrid:
    """What both strategies expose of their place in the ``dp x sp`` grid (a mixin).

    The class it is mixed into provides ``num_nodes``, ``num_processes``, ``global_rank`` (as
    Lightning's strategies do), ``_sp_size_arg`` (``None``: one SP group per node) and
    ``_device_mesh`` (set by :meth:`_build_grid`).
    """

    num_nodes: int
    num_processes: int
    global_rank: int
    _sp_size_arg: Optional[int]
    _device_mesh: Optional["DeviceMesh"]
    _step_config: Any

    @property
    def sp_size(self) -> int:
        if self._sp_size_arg is not None:
            return self._sp_size_arg
        layout = self._step_config.sp_layout
        return layout[0] * layout[1] if layout is not None else max(self.num_processes, 1)

    @property
    def sp_layout(self) -> Optional[tuple[int, int]]:
        """``(ulysses, ring)`` as given, or ``None``: chosen per model at its first compile (the
        largest Ulysses degree that divides the heads and stays inside a node; a ring for the rest)."""
        return self._step_config.sp_layout

    @property
    def layout(self) -> SPLayout:
        return SPLayout(self.num_nodes * self.num_processes, self.sp_size)

    @property
    def sp_rank(self) -> int:
        return self.layout.sp_rank(self.global_rank)

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank(self.global_rank)

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def device_mesh(self) -> "DeviceMesh":
        """The ``[dp, sp]`` mesh (dims ``"dp"`` and ``"sp"``), once the processes are set up."""
        if self._device_mesh is None:
            raise RuntimeError("AutoSPStrategy.device_mesh is available once the processes are set up (`setup` / `fabric.launch()`).")
        return self._device_mesh

    @property
    def sp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("sp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.device_mesh.get_group("dp")

    @property
    def distributed_sampler_kwargs(self) -> dict:
        # every rank of an SP group reads the same samples; SP groups read disjoint ones
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    def _validated_layout(self) -> SPLayout:
        return validate_layout(self.sp_size, self.num_nodes * self.num_processes, self.num_processes, self.sp_layout)

    def _runner_config(self) -> Any:
        """The step configuration with what the grid knows: Ulysses stays inside a node."""
        return replace(self._step_config, max_ulysses=max(self.num_processes, 1))

    def _build_grid(self, device_type: str, timeout: Optional[timedelta], mode: "Mode") -> SPLayout:
        """The ``[dp, sp]`` mesh, then what ``mode`` holds parameters on; a collective: every rank."""
        layout = self._validated_layout()
        self._device_mesh = sp_mesh(layout, device_type, timeout)
        mode.build_mesh(layout, self.num_processes, device_type, timeout)
        return layout

    def _grid_summary(self, layout: SPLayout) -> str:
        if self.sp_layout is not None:
            ulysses, ring = self.sp_layout
            split = f"attention split as ulysses={ulysses} x ring={ring} (Ulysses on contiguous ranks, the ring strided)"
        else:
            split = (
                f"attention split by Ulysses over up to {math.gcd(layout.sp_size, max(self.num_processes, 1))} ranks of a node where "
                "the heads allow, a ring over the rest (chosen at the first compile, from the model's heads)"
            )
        return f"AutoSP: {layout.world_size} processes as dp={layout.dp_size} x sp={layout.sp_size}; SP groups {layout.all_sp_groups()}; {split}"
