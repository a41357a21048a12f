"""Sharded data parallelism for ``AutoSPStrategy(fsdp=True)``: parameters, gradients and
optimizer state split over every rank of the ``dp x sp`` world (ZeRO-3 semantics).

Each parameter is held as one flat shard per rank (its elements, padded to a multiple of the
world size, in rank order) behind a :mod:`torch.nn.utils.parametrize` parametrization whose
forward all-gathers the shards with a traceable, differentiable functional collective. Inside
the compiled step the gathers are ordinary graph nodes: the SP pass leaves them alone (no
sequence dim), AOT autograd derives their adjoint, a reduce-scatter that leaves each rank the
gradient of its own shard (averaged over the world, as DDP averages), and the optimizer only
ever sees the shards. No wrapper module and no DDP: the model keeps its own attribute names.

Tied parameters (one ``Parameter`` held by several modules, such as an output head tied to the
token embedding) stay tied: every owner reads the same shard.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.utils import parametrize

from lightning_autosp._compat import all_gather_autograd

__all__ = ["broadcast_module", "shard_parameters", "unshard_parameters", "is_sharded", "full_state_dict", "sharded_parameter_bytes"]

log = logging.getLogger(__name__)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` (averages the reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class GatherShards(nn.Module):
    """The parametrization: a flat shard of ``numel / world`` elements in, the full parameter
    of ``shape`` out (all-gathered over ``group_name``).

    ``right_inverse`` cuts this rank's shard out of the full tensor when the parametrization is
    registered; ``already_sharded`` marks a further owner of a tied parameter, whose tensor is
    the shard already.
    """

    def __init__(self, shape: torch.Size, rank: int, world: int, group_name: str, already_sharded: bool = False):
        super().__init__()
        self.shape = tuple(shape)
        self.numel = int(torch.Size(shape).numel())
        self.rank, self.world, self.group_name = rank, world, group_name
        self.chunk = -(-self.numel // world)
        self.already_sharded = already_sharded

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        full = all_gather_autograd(_ScaleGrad.apply(shard, 1.0 / self.world), 0, self.group_name)
        return full[: self.numel].view(self.shape)

    def right_inverse(self, full: torch.Tensor) -> torch.Tensor:
        if self.already_sharded:
            return full
        flat = full.detach().reshape(-1)
        padded = torch.cat([flat, flat.new_zeros(self.chunk * self.world - self.numel)])
        return padded[self.rank * self.chunk : (self.rank + 1) * self.chunk].clone()

    def extra_repr(self) -> str:
        return f"shape={self.shape}, shard={self.chunk} of {self.world}"


def _owners(module: nn.Module) -> dict[nn.Parameter, list[tuple[nn.Module, str]]]:
    """Every parameter and the (module, attribute) pairs that hold it, tied ones included."""
    owners: dict[nn.Parameter, list[tuple[nn.Module, str]]] = {}
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                owners.setdefault(p, []).append((mod, name))
    return owners


def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Give every rank ``src``'s parameters and buffers (in place)."""
    with torch.no_grad():
        for t in {id(t): t for t in [*module.parameters(), *module.buffers()]}.values():
            dist.broadcast(t, src=src)


def shard_parameters(module: nn.Module, group: dist.ProcessGroup) -> int:
    """Shard every parameter of ``module`` over ``group`` (in place); return how many.

    All ranks must hold the same values before (the strategy broadcasts rank 0's first).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    count = 0
    for p, owners in _owners(module).items():
        if parametrize.is_parametrized(owners[0][0], owners[0][1]):
            continue
        shape = p.shape
        for i, (mod, name) in enumerate(owners):
            gather = GatherShards(shape, rank, world, group.group_name, already_sharded=i > 0)
            parametrize.register_parametrization(mod, name, gather, unsafe=True)
        count += 1
    log.debug("AutoSP: sharded %d parameters over %d ranks", count, world)
    return count


def unshard_parameters(module: nn.Module) -> int:
    """Undo :func:`shard_parameters` (in place): every parameter full again on every rank, tied
    ones still tied, under the model's own names; return how many. A collective."""
    full: dict[int, nn.Parameter] = {}
    entries = list(_sharded_entries(module))
    with torch.no_grad():
        for _, mod, name in entries:
            shard = mod.parametrizations[name].original
            if id(shard) not in full:
                full[id(shard)] = nn.Parameter(getattr(mod, name).detach().clone(), requires_grad=shard.requires_grad)
    for _, mod, name in entries:
        shard = mod.parametrizations[name].original
        parametrize.remove_parametrizations(mod, name, leave_parametrized=False)
        delattr(mod, name)
        mod.register_parameter(name, full[id(shard)])
    return len(full)


def is_sharded(module: nn.Module) -> bool:
    return any(isinstance(m, GatherShards) for m in module.modules())


def _sharded_entries(module: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    for prefix, mod in module.named_modules():
        if parametrize.is_parametrized(mod):
            for name in mod.parametrizations:
                yield (f"{prefix}.{name}" if prefix else name), mod, name


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of a sharded ``module`` with its own key names (``head.weight``, not
    ``head.parametrizations.weight.original``) and full tensors, gathered on every rank.

    A collective: call it on every rank. Meant for small models and tests; every rank holds the
    whole model while it runs.
    """
    state = {}
    with torch.no_grad():
        for key, value in module.state_dict().items():
            if ".parametrizations." not in f".{key}":
                state[key] = value
        for key, mod, name in _sharded_entries(module):
            state[key] = getattr(mod, name).detach().clone()
    return state


def sharded_parameter_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for parameters, their gradients and the optimizer state (read from
    the tensors' storages, each counted once)."""
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    params = list(module.parameters())
    out = {"parameters": nbytes(params), "gradients": nbytes(p.grad for p in params if p.grad is not None)}
    if optimizer is not None:
        out["optimizer"] = nbytes(v for state in optimizer.state.values() for v in state.values())
    return out
