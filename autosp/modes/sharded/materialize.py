"""A model built on the ``meta`` device given its values, sharded, without any rank holding the
whole model: what ``AutoSPStrategy(fsdp=...)`` does with a model built in ``configure_model`` or
under ``Trainer.init_module()``.

Initialised by the model's own initialisers (:func:`materialize_sharded`) in *units*: the
top-most modules with an initialiser of their own (``reset_parameters()`` or ``init_weights()``).
Each unit is materialised whole on every rank, initialised (children first, parents last, as
construction runs them), made rank 0's everywhere and sharded before the next unit is
materialised, so a rank holds its shards plus one unit. A model whose root has an initialiser
(it overrides its children's, as GPT's or Hugging Face's ``post_init`` do) is one unit: the whole
model, once, before it is sharded. Pretrained weights are read by :mod:`.pretrained`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from autosp.errors import AutoSPError
from autosp.modes.sharded.config import ShardingPolicy
from autosp.modes.sharded.params import broadcast_module, shard_parameters

__all__ = ["has_meta_tensors", "move_real_tensors", "materialize_meta", "init_units", "materialize_sharded", "InitReport", "init_buffers"]


log = logging.getLogger(__name__)


def _initializer(module: nn.Module) -> Any:
    init = getattr(module, "reset_parameters", None) or getattr(module, "init_weights", None)
    return init if callable(init) else None


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def materialize_meta(module: nn.Module, device: torch.device, fresh: Optional[dict[int, torch.Tensor]] = None) -> int:
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

    ``fresh`` (``id(meta tensor) -> its storage``) is shared by calls on parts of one model, so
    that a tensor two parts hold (tied) is materialised once.
    """
    fresh = {} if fresh is None else fresh
    before = len(fresh)

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
    if len(fresh) == before:
        return 0
    new_ids = {id(v) for v in fresh.values()}
    with torch.no_grad():
        for name, mod in _post_order(module):  # children (in order) before their parents, as construction
            init = _initializer(mod)
            if init is None:
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
    log.debug("AutoSP: materialised %d meta tensors on %s", len(fresh) - before, device)
    return len(fresh) - before


def move_real_tensors(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for its plain tensors only (in place, ties kept): meta tensors wait for
    their values and shards are where they were made (``Module.to`` would replace a DTensor
    parameter with a new one, untying it)."""
    with torch.no_grad():
        for t in {id(t): t for t in [*module.parameters(), *module.buffers()]}.values():
            if not t.is_meta and not getattr(t, "_autosp_shard", False) and t.device != device:
                t.data = t.data.to(device)


def _post_order(module: nn.Module, prefix: str = "", seen: Optional[set[int]] = None) -> list[tuple[str, nn.Module]]:
    """``named_modules()`` with every module after its children, children in order: the order
    in which construction runs their initialisers."""
    seen = set() if seen is None else seen
    out: list[tuple[str, nn.Module]] = []
    if id(module) in seen:
        return out
    seen.add(id(module))
    for name, child in module.named_children():
        out += _post_order(child, f"{prefix}.{name}" if prefix else name, seen)
    return out + [(prefix, module)]


def _own_meta(module: nn.Module) -> bool:
    return any(t is not None and t.is_meta for t in [*module._parameters.values(), *module._buffers.values()])


def init_units(module: nn.Module) -> list[nn.Module]:
    """The units :func:`materialize_sharded` initialises one at a time, in module order: the
    top-most modules with an initialiser; a module without one is split into its children's
    units, followed by itself where it holds meta tensors of its own (which then no initialiser
    writes: an error names them)."""
    if _initializer(module) is not None or not any(True for _ in module.children()):
        return [module] if has_meta_tensors(module) else []
    units = [unit for child in module.children() for unit in init_units(child)]
    return units + [module] if _own_meta(module) else units


@dataclass
class InitReport:
    """What :func:`materialize_sharded` did: the units it initialised one at a time, the bytes of
    the largest (what a rank held whole at most) and of the whole model."""

    units: int = 0
    largest_unit_bytes: int = 0
    model_bytes: int = 0


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def materialize_sharded(module: nn.Module, device: torch.device, policy: ShardingPolicy) -> InitReport:
    """Give the meta tensors of ``module`` their values with the model's own initialisers and
    shard its parameters by ``policy``, one unit (:func:`init_units`) at a time: a rank never
    holds more than one unit whole. Parameters held by several units (tied) or outside any unit
    are materialised with the first and left unsharded for the caller's
    :func:`~autosp.modes.sharded.params.shard_module`. A collective (rank 0's values everywhere)."""
    units = init_units(module)
    holders: dict[int, set[int]] = {}
    for index, unit in enumerate(units):
        for p in unit.parameters():
            holders.setdefault(id(p), set()).add(index)
    in_units = {id(m) for unit in units for m in unit.modules()}
    for mod in module.modules():
        if id(mod) not in in_units:
            for p in mod._parameters.values():
                if p is not None:
                    holders.setdefault(id(p), set()).add(-1)
    fresh: dict[int, torch.Tensor] = {}
    # the ids of the meta parameters; tied ones are kept by the id of their new storage
    report = InitReport(units=len(units), model_bytes=_nbytes([*module.parameters(), *module.buffers()]))
    shared = {k for k, held in holders.items() if len(held) > 1}  # tied across units, or held outside them
    for unit in units:
        materialize_meta(unit, device, fresh)
        report.largest_unit_bytes = max(report.largest_unit_bytes, _nbytes([*unit.parameters(), *unit.buffers()]))
        broadcast_module(unit, parameters=False)  # (sharding scatters rank 0's parameters)
        shard_parameters(unit, policy, keep=frozenset(id(fresh[k]) for k in shared if k in fresh))
        for k in [k for k in fresh if k not in shared]:  # the unit's whole tensors: sharded (or buffers, held)
            del fresh[k]
    log.debug("AutoSP: initialised %d units one at a time (largest %d bytes)", len(units), report.largest_unit_bytes)
    return report


def init_buffers(module: nn.Module, device: torch.device) -> None:
    """Give the meta buffers of ``module`` storage and their values from their module's
    initialiser, or from the nearest ancestor's ``_init_weights(module)`` (Hugging Face's
    per-module initialiser); an :class:`AutoSPError` names any left unwritten."""
    parents = {id(child): mod for mod in module.modules() for child in mod.children()}
    unwritten = []
    for prefix, mod in module.named_modules():
        metas = [n for n, b in mod._buffers.items() if b is not None and b.is_meta]
        if not metas:
            continue
        for n in metas:
            b = mod._buffers[n]
            mod._buffers[n] = torch.full(b.shape, float("nan"), dtype=b.dtype, device=device) if b.is_floating_point() else torch.zeros(b.shape, dtype=b.dtype, device=device)
        owner, init = mod, _initializer(mod) if not mod._parameters else None
        while init is None and id(owner) in parents:
            owner = parents[id(owner)]
            per_module = getattr(owner, "_init_weights", None)
            init = (lambda m=mod, f=per_module: f(m)) if callable(per_module) else None
        if init is not None:
            with torch.no_grad():
                init()
        for n in metas:
            b = mod._buffers[n]
            if b.is_floating_point() and bool(b.isnan().any()):
                unwritten.append(f"{prefix}.{n}" if prefix else n)
    if unwritten:
        raise AutoSPError(
            f"buffers {unwritten[:8]} were built on the meta device and are not in the pretrained weights, and no "
            "initialiser wrote them: compute them in the module's reset_parameters(), or build the model with "
            "real tensors (Trainer.init_module(empty_init=False))."
        )
