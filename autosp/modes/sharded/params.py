"""Sharded data parallelism for ``AutoSPStrategy(fsdp=...)``: every parameter a
:class:`~torch.distributed.tensor.DTensor` sharded over a device mesh, gathered inside the
compiled step (ZeRO-3 semantics, as torchtitan's SimpleFSDP does it).

What user code sees is what it sees on one device, because the parameters *are* the model's
parameters, only distributed: ``named_parameters()`` gives the model's own names, each
parameter has its global shape and ``dim()``, its ``.grad`` is a DTensor of the same shape, and
elementwise optimizer state (SGD momentum, Adam's moments) follows as DTensors. Norms of
DTensors are whole-model values, so ``torch.nn.utils.clip_grad_norm_`` (what Lightning's
``gradient_clip_val`` calls) clips by the norm of the whole model, and torch's distributed
checkpoint (DCP) saves and reshards them.

Each parameter is held as ``Shard(0)`` on the mesh (``Replicate()`` for a 0-d one): rows in
rank order, the last ranks holding fewer when the rows do not divide. With ``"hybrid"`` the
mesh has two dims, ``("replicate", "shard")``: shards within a node, replicas across nodes.

A module that holds parameters gets a subclass of its own class (``Sharded<Name>``) whose
parameter names are properties: reading ``linear.weight`` in a forward (compiled, or eager:
forward hooks on every module of the tree count the forwards running) returns the full weight,
and anywhere else the parameter itself. The full weight is the parameter ``redistribute``-d to
``Replicate`` (an all-gather, in ``param_dtype`` if set) and taken ``to_local`` with
``Partial("avg")`` gradients, so autograd derives a reduce-scatter (in ``reduce_dtype``) that
leaves each rank the world-average gradient of its shard, as DDP averages. Under ``torch.compile`` these are ordinary graph nodes: the SP pass leaves them alone
(no sequence dim), SAC gathers them again in backward instead of saving full weights, and
:mod:`autosp.passes.bucketing` groups them per transformer block. ``state_dict()``
reads the parameters themselves (DTensors, under the model's own keys); nothing is gathered.

Tied parameters (one ``Parameter`` held by several modules, such as an output head tied to the
token embedding) stay one DTensor.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from autosp.errors import AutoSPError
from autosp.modes.sharded.config import ShardingPolicy

__all__ = ["shard_parameters", "shard_module", "unshard_module", "is_sharded", "broadcast_module"]


log = logging.getLogger(__name__)


class _Gather:
    """``param -> full local tensor`` for the properties of a sharded module: all-gather in
    ``param_dtype``, gradients reduce-scattered (and averaged) in ``reduce_dtype``."""

    def __init__(self, policy: ShardingPolicy):
        from torch.distributed.tensor import Partial, Replicate

        self.policy = policy
        self.replicate = (Replicate(),) * policy.mesh.ndim
        self.grad_placements = (Partial("avg"),) * policy.mesh.ndim

    def __call__(self, param: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        if not isinstance(param, DTensor):  # assigned a plain tensor after sharding
            return param
        forward = backward = None
        if param.is_floating_point() and self.policy.param_dtype not in (None, param.dtype):
            forward, backward = self.policy.param_dtype, self.policy.reduce_dtype or param.dtype
        elif param.is_floating_point() and self.policy.reduce_dtype not in (None, param.dtype):
            backward = self.policy.reduce_dtype
        full = param.redistribute(placements=self.replicate, forward_dtype=forward, backward_dtype=backward)
        return full.to_local(grad_placements=self.grad_placements)


#: (original class, parameter names) -> the subclass with a property per parameter name
_SHARDED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


#: forwards of sharded modules running eagerly now (nested calls count each)
_eager_forwards = 0


def _read_parameter(module: nn.Module, name: str) -> torch.Tensor:
    """What ``module.<name>`` gives: inside a forward (compiled, or eager through the hooks of
    :func:`shard_module`) the gathered full tensor, elsewhere the parameter itself - a DTensor
    whose ``.grad``, ``.data`` and ties are those user code expects of a parameter."""
    param = module._parameters[name]
    if _eager_forwards or torch.compiler.is_compiling():
        return module._autosp_gather(param)
    return param


def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    key = (cls, names)
    if key not in _SHARDED_CLASSES:
        props: dict[str, Any] = {name: property(lambda self, name=name: _read_parameter(self, name)) for name in names}
        props["_autosp_original_class"] = cls
        _SHARDED_CLASSES[key] = type(f"Sharded{cls.__name__}", (cls,), props)
    return _SHARDED_CLASSES[key]


def _enter_forward(module: nn.Module, args: Any) -> None:
    global _eager_forwards
    if not torch.compiler.is_compiling():
        _eager_forwards += 1


def _leave_forward(module: nn.Module, args: Any, output: Any) -> None:
    global _eager_forwards
    if not torch.compiler.is_compiling():
        _eager_forwards -= 1


def local_rows(rows: int, policy: ShardingPolicy) -> tuple[int, int]:
    """``(start, stop)``: the rows of a ``Shard(0)`` tensor of ``rows`` rows this rank holds
    (``torch.chunk``'s split: ``ceil(rows / n)`` each in mesh order, the last ones fewer)."""
    n = policy.mesh.size(policy.mesh.ndim - 1)
    coordinate = policy.mesh.get_coordinate()[-1]
    chunk = -(-rows // n)
    start = min(coordinate * chunk, rows)
    return start, min(start + chunk, rows)


def _shard(param: torch.Tensor, policy: ShardingPolicy, device: Optional[torch.device]) -> torch.Tensor:
    """This rank's shard of rank 0's ``param`` as a DTensor with storage of its own (scattered by
    ``distribute_tensor``: no rank receives more than its shard); a ``meta`` parameter becomes an
    unfilled (NaN) shard on ``device``, for its values to be read in."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    placements = policy.placements(param)
    if not param.is_meta:
        with torch.no_grad():
            dt = distribute_tensor(param.detach(), policy.mesh, placements, src_data_rank=0)
            return DTensor.from_local(dt.to_local().clone(), policy.mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride())
    shape = param.shape
    if param.dim() > 0:
        start, stop = local_rows(shape[0], policy)
        shape = torch.Size([stop - start, *shape[1:]])
    local = torch.full(shape, float("nan"), dtype=param.dtype, device=device) if param.is_floating_point() else torch.empty(shape, dtype=param.dtype, device=device)
    return DTensor.from_local(local, policy.mesh, placements, run_check=False, shape=param.shape, stride=param.stride())


def shard_parameters(
    module: nn.Module,
    policy: ShardingPolicy,
    done: Optional[dict[int, nn.Parameter]] = None,
    keep: frozenset[int] = frozenset(),
    device: Optional[torch.device] = None,
) -> int:
    """Make the parameters of ``module`` DTensors sharded by ``policy`` and each module's class a
    ``Sharded<Name>`` subclass (in place); return how many were sharded. ``done`` maps the id of
    each parameter sharded to its DTensor, so that a parameter held by several modules stays one;
    parameters whose id is in ``keep`` are left for a later call, and parameters an earlier call
    sharded are left as they are.
    ``meta`` parameters become unfilled shards on ``device``; the others take rank 0's values (a
    collective: every rank calls it, with the same parameters). Each rank keeps a copy of its
    shard, so the full tensor can be freed."""
    from torch.distributed.tensor import DTensor

    done = {} if done is None else done
    gather = _Gather(policy)
    count = 0
    for mod in list(module.modules()):
        names = tuple(n for n, p in mod._parameters.items() if p is not None)
        if not names:
            continue
        for name in names:
            p = mod._parameters[name]
            if id(p) in keep or getattr(p, "_autosp_shard", False):
                continue
            if id(p) not in done:
                if isinstance(p, DTensor):
                    raise AutoSPError(
                        f"{type(mod).__name__}.{name} is a DTensor already (placements {p.placements}): AutoSP's fsdp "
                        "shards plain parameters. Build the model without applying another parallelism to it."
                    )
                done[id(p)] = nn.Parameter(_shard(p, policy, device), requires_grad=p.requires_grad)
                done[id(p)]._autosp_shard = True  # ours: a later call leaves it alone
                count += 1
            mod._parameters[name] = done[id(p)]
        if not hasattr(type(mod), "_autosp_original_class"):
            object.__setattr__(mod, "_autosp_gather", gather)
            mod.__class__ = _sharded_class(type(mod), names)
    return count


def shard_module(module: nn.Module, policy: ShardingPolicy) -> int:
    """Make every parameter of ``module`` a DTensor sharded by ``policy`` (in place,
    :func:`shard_parameters`; parts sharded before stay as they are) and count the forwards
    running in it, so that its modules read gathered weights there; return how many parameters
    this call sharded."""
    count = shard_parameters(module, policy)
    handles = []
    for mod in module.modules():  # a forward reads its own and its children's parameters
        handles.append(mod.register_forward_pre_hook(_enter_forward))
        handles.append(mod.register_forward_hook(_leave_forward, always_call=True))
    object.__setattr__(module, "_autosp_forward_hooks", handles)
    log.debug("AutoSP: sharded %d parameters over %s", count, policy.mesh)
    return count


def unshard_module(module: nn.Module) -> int:
    """Undo :func:`shard_module` (in place): every parameter a full plain tensor again on every
    rank, tied ones still tied, each module of its own class again; return how many. A
    collective: call it on every rank."""
    from torch.distributed.tensor import DTensor

    for handle in module.__dict__.pop("_autosp_forward_hooks", ()):
        handle.remove()
    done: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        original = getattr(type(mod), "_autosp_original_class", None)
        if original is None:
            continue
        for name, p in list(mod._parameters.items()):
            if isinstance(p, DTensor):
                if id(p) not in done:
                    done[id(p)] = nn.Parameter(p.detach().full_tensor(), requires_grad=p.requires_grad)
                mod._parameters[name] = done[id(p)]
        mod.__class__ = original
        del mod._autosp_gather
    return len(done)


def is_sharded(module: nn.Module) -> bool:
    return any(hasattr(type(m), "_autosp_original_class") for m in module.modules())


def broadcast_module(module: nn.Module, src: int = 0, parameters: bool = True) -> None:
    """Give every rank ``src``'s buffers and (with ``parameters``) parameters, in place; shards stay
    as they are. Parameters about to be sharded need none: sharding scatters rank 0's."""
    with torch.no_grad():
        for t in {id(t): t for t in [*(module.parameters() if parameters else ()), *module.buffers()]}.values():
            if not getattr(t, "_autosp_shard", False):
                dist.broadcast(t, src=src)
