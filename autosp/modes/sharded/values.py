"""Sharded tensors read as one device would read them: a rank's part, whole values (a collective),
Lightning's ``grad_norm`` over DTensor gradients, and the bytes a rank holds."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.nn as nn

__all__ = ["local_tensor", "whole", "grad_norm", "full_state_dict", "sharded_parameter_bytes"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (``t`` itself unless it is a DTensor)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def whole(value: Any) -> Any:
    """``value`` with every DTensor in it (a tensor, or the values of a dict) replaced by its whole
    value, the same on every rank (a collective where it is sharded or partial). A DTensor's
    ``.item()`` gives this rank's part: a norm of a sharded gradient is ``Partial``, its local
    value one rank's share of the sum of squares."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: whole(v) for k, v in value.items()}
    return value


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """Lightning's :func:`lightning.pytorch.utilities.grad_norm` for modules whose gradients may
    be DTensors (``AutoSPStrategy(fsdp=...)``): the same keys (``grad_2.0_norm/<name>`` and
    ``grad_2.0_norm_total``) with whole-model values on every rank, as on one device. Lightning's
    own builds ``torch.tensor`` from the per-parameter norms, which DTensors cannot pass. A
    collective with DTensor gradients: call it on every rank."""
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
    norms = {
        f"grad_{norm_type}_norm{group_separator}{name}": whole(p.grad.detach().norm(norm_type))
        for name, p in module.named_parameters()
        if p.grad is not None
    }
    if norms:
        norms[f"grad_{norm_type}_norm_total"] = torch.stack(list(norms.values())).norm(norm_type)
    return norms


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every DTensor gathered whole, on every rank (a collective).
    Meant for small models and tests: every rank holds the whole model while it runs."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}


def sharded_parameter_bytes(module: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
    """Bytes this rank holds for parameters, their gradients and the optimizer state (its local
    shards, read from the storages, each counted once)."""
    seen: set[int] = set()

    def nbytes(tensors: Iterable[Any]) -> int:
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storage = local_tensor(t).untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    params = list(module.parameters())
    out = {"parameters": nbytes(params), "gradients": nbytes(p.grad for p in params if p.grad is not None)}
    if optimizer is not None:
        out["optimizer"] = nbytes(v for state in optimizer.state.values() for v in state.values())
    return out
