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
from lightning_autosp.errors import AutoSPError

__all__ = ["materialize_meta", "broadcast_module", "shard_parameters", "unshard_parameters", "is_sharded", "full_state_dict", "sharded_parameter_bytes", "clip_grad_norm_"]

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


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def materialize_meta(module: nn.Module, device: torch.device) -> int:
    """Give every parameter and buffer of ``module`` left on the ``meta`` device real storage on
    ``device`` and initialise it (in place); return how many tensors were materialised.

    The initialisers are the model's own: each submodule's ``reset_parameters()`` (PyTorch's
    convention) or, where it has none, its ``init_weights()`` (Hugging Face ``PreTrainedModel``,
    torchtitan), called children first and parents last, as construction runs them: a model
    whose root initialises every weight (``GPT.reset_parameters``, HF ``post_init``) overrides
    the defaults of its ``nn.Linear`` children, as it does when built for real. Tied parameters
    stay tied.

    Only modules whose every tensor was on the meta device are initialised: real tensors keep
    their values, and a module that mixes both under one initialiser is an error.

    Never silent: new storage is filled with NaN (integers with their largest value) first, and a
    tensor that no initialiser overwrote is an :class:`AutoSPError` naming it - a non-persistent
    buffer computed in ``__init__`` (a RoPE frequency table) is the usual case.
    """
    fresh: dict[int, torch.Tensor] = {}

    def real(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fresh:
            new = torch.empty_like(t, device=device)
            with torch.no_grad():
                if new.is_floating_point() or new.is_complex():
                    new.fill_(float("nan"))
                elif new.dtype != torch.bool:
                    new.fill_(torch.iinfo(new.dtype).max)
            fresh[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return fresh[id(t)]

    for prefix, mod in module.named_modules(remove_duplicate=False):
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is not None and t.is_meta:
                    if t.dtype == torch.bool:
                        raise AutoSPError(
                            f"{prefix + '.' if prefix else ''}{name} is a bool tensor on the meta device: AutoSP cannot "
                            "tell whether an initialiser rewrites it. Build the model with real tensors "
                            "(Trainer.init_module(empty_init=False)) or hold it as a float or integer tensor."
                        )
                    table[name] = real(t)
    if not fresh:
        return 0
    new_ids = {id(v) for v in fresh.values()}
    with torch.no_grad():
        for name, mod in reversed(list(module.named_modules())):  # children before their parents
            init = getattr(mod, "reset_parameters", None) or getattr(mod, "init_weights", None)
            if not callable(init):
                continue
            mine = [id(t) in new_ids for t in [*mod.parameters(), *mod.buffers()]]
            if not any(mine):
                continue  # built for real (pretrained, say): its values stay
            if not all(mine):
                raise AutoSPError(
                    f"{name or type(mod).__name__} holds tensors built on the meta device next to real ones, and its "
                    "initialiser would overwrite the real ones. Build the whole module in configure_model (or under "
                    "Trainer.init_module()), or all of it for real (Trainer.init_module(empty_init=False))."
                )
            init()
    untouched = []
    for prefix, mod in module.named_modules():
        for name, t in [*mod._parameters.items(), *mod._buffers.items()]:
            if t is None or id(t) not in new_ids:
                continue
            blank = t.isnan() if t.is_floating_point() or t.is_complex() else t == torch.iinfo(t.dtype).max
            if bool(blank.any()):
                untouched.append(f"{prefix}.{name}" if prefix else name)
    if untouched:
        raise AutoSPError(
            f"the model was built on the meta device (fsdp=True builds configure_model and Trainer.init_module "
            f"there), and no initialiser wrote {', '.join(untouched[:8])}{' ...' if len(untouched) > 8 else ''}: AutoSP "
            "calls each module's reset_parameters() (or init_weights()) to initialise it. Compute these tensors in "
            "such a method, or build the model with real tensors: Trainer.init_module(empty_init=False), or "
            "construct it in the LightningModule's __init__."
        )
    log.debug("AutoSP: materialised %d meta tensors on %s", len(fresh), device)
    return len(fresh)


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


def clip_grad_norm_(parameters, max_norm: float, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip the gradients of sharded parameters to a total L2 norm of ``max_norm`` and return the
    total norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` does on one device.

    The norm is that of the whole model: the squared norms of every rank's shards are summed over
    ``group`` (the world by default; each element lives on exactly one rank, padding is zero), so
    every rank scales by the same factor. A collective: call it on every rank.
    """
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    device = grads[0].device if grads else torch.device("cpu")
    local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=device)
    squared = local.float().pow(2)
    dist.all_reduce(squared, group=group)
    total = squared.sqrt()
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


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
