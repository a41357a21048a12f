"""The process groups of the ``dp x sp`` grid as device meshes (no Lightning here).

:func:`sp_mesh` builds the ``("dp", "sp")`` mesh of an :class:`~lightning_autosp.layout.SPLayout`:
SP groups of ``sp_size`` contiguous ranks, DP groups across them. :func:`shard_mesh` builds the
mesh the sharded mode holds parameters on. Every rank must call them, in the same order.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from lightning_autosp.fsdp import FSDPConfig
from lightning_autosp.layout import SPLayout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["sp_mesh", "shard_mesh"]


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


def shard_mesh(config: FSDPConfig, world_size: int, devices_per_node: int, device_type: str, timeout: Optional[timedelta] = None) -> "DeviceMesh":
    """The mesh the sharded mode holds parameters on: the world (``"full"``, dim ``"shard"``) or
    ``(replicate, shard)`` = ``(nodes, ranks per node)`` (``"hybrid"``)."""
    from torch.distributed.device_mesh import DeviceMesh

    replicate, shard = config.shard_groups(world_size, devices_per_node)
    if config.mode == "full":
        return DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=("shard",))
    shard_group, _ = dist.new_subgroups_by_enumeration(shard, timeout=timeout)
    replicate_group, _ = dist.new_subgroups_by_enumeration(replicate, timeout=timeout)
    return DeviceMesh.from_group(
        [replicate_group, shard_group],
        device_type,
        mesh=torch.tensor(shard),  # [nodes, ranks per node]
        mesh_dim_names=("replicate", "shard"),
    )
