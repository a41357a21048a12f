"""The sharded mode's arguments and layout: which mode (``"full"`` / ``"hybrid"``), the dtypes
parameters are gathered and gradients reduced in, and the mesh parameters are held on.

With ``"full"`` every parameter is sharded over every rank of the ``dp x sp`` world (a 1-D mesh,
dim ``"shard"``); with ``"hybrid"`` the mesh has two dims, ``("replicate", "shard")``: shards within a
node, replicas across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["FSDP_MODES", "DDP_ONLY_ARGUMENTS", "FSDPConfig", "ShardingPolicy", "shard_mesh"]


#: ``fsdp="full"`` (or ``True``): shard over every rank; ``"hybrid"``: shard within a node,
#: replicate across nodes
FSDP_MODES = ("full", "hybrid")


@dataclass(frozen=True)
class ShardingPolicy:
    """How parameters are sharded and gathered.

    Attributes:
        mesh: a 1-D mesh (shard over all of it) or a 2-D ``(replicate, shard)`` mesh (HSDP).
        param_dtype: the dtype parameters are all-gathered and computed in (``None``: their own);
            only floating-point parameters are cast.
        reduce_dtype: the dtype gradients are reduce-scattered in (``None``: the gradient's own).
    """

    mesh: Any  # DeviceMesh
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None

    def placements(self, param: torch.Tensor) -> tuple:
        from torch.distributed.tensor import Replicate, Shard

        sharded = Shard(0) if param.dim() > 0 else Replicate()
        return (Replicate(), sharded) if self.mesh.ndim == 2 else (sharded,)


_PRECISION_PARAM_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


#: DDPStrategy arguments that only configure the DDP wrapper, which the sharded mode does not use
DDP_ONLY_ARGUMENTS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


def _dtype(value: Any, name: str) -> Optional[torch.dtype]:
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"AutoSPStrategy({name}={value!r}): pass a floating-point torch dtype or its name ('bfloat16', 'float32', ...), or None.")
    return dtype


@dataclass(frozen=True)
class FSDPConfig:
    """The sharded mode's arguments, checked (``AutoSPStrategy(fsdp=..., param_dtype=...,
    reduce_dtype=...)``).

    ``mode`` is ``"full"`` (shard over every rank of the ``dp x sp`` world) or ``"hybrid"``
    (shard over the ranks of a node, replicate across nodes: parameters are gathered over
    intra-node links only). ``param_dtype=None`` follows the Trainer's precision: ``bf16-mixed``
    gathers in bfloat16, ``16-mixed`` in float16, anything else in the parameters' own dtype.
    ``reduce_dtype=None`` reduces gradients in float32 where parameters are gathered in a lower
    precision.
    """

    mode: str
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None

    @classmethod
    def from_arguments(cls, fsdp: Any, param_dtype: Any = None, reduce_dtype: Any = None) -> Optional["FSDPConfig"]:
        """``None`` for the replicated mode (``fsdp=False``); a ``ValueError`` naming the argument
        for anything else that is not a mode."""
        if fsdp is False or fsdp is None:
            if param_dtype is not None or reduce_dtype is not None:
                raise ValueError(
                    "AutoSPStrategy(param_dtype=..., reduce_dtype=...) set the sharded mode's gather and reduce dtypes; "
                    "with fsdp=False parameters are replicas (no gathers). Pass fsdp=True, or leave them unset and "
                    "use the Trainer's precision."
                )
            return None
        mode = "full" if fsdp is True else fsdp
        if mode not in FSDP_MODES:
            raise ValueError(
                f"AutoSPStrategy(fsdp={fsdp!r}): pass True or 'full' (shard over every rank), 'hybrid' (shard within "
                "a node, replicate across nodes) or False (a replica per rank)."
            )
        return cls(mode, _dtype(param_dtype, "param_dtype"), _dtype(reduce_dtype, "reduce_dtype"))

    def policy(self, mesh: Any, precision: str) -> ShardingPolicy:
        param_dtype = self.param_dtype if self.param_dtype is not None else _PRECISION_PARAM_DTYPES.get(str(precision))
        reduce_dtype = self.reduce_dtype
        if reduce_dtype is None and param_dtype is not None and param_dtype != torch.float32:
            reduce_dtype = torch.float32
        return ShardingPolicy(mesh, param_dtype, reduce_dtype)

    def shard_groups(self, world_size: int, devices_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
        """``(replicate groups, shard groups)`` of the ranks: with ``"hybrid"`` a shard group is a
        node's ranks and a replicate group the ranks with one local rank; otherwise one shard
        group of every rank (and a replicate group per rank)."""
        per = devices_per_node if self.mode == "hybrid" else world_size
        nodes = world_size // per
        shard = [list(range(n * per, (n + 1) * per)) for n in range(nodes)]
        replicate = [list(range(j, world_size, per)) for j in range(per)]
        return replicate, shard


def shard_mesh(config: "FSDPConfig", world_size: int, devices_per_node: int, device_type: str, timeout: Optional[timedelta] = None) -> "DeviceMesh":
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
