"""A model built on the ``meta`` device given its values, sharded, without any rank holding the
whole model: what ``AutoSPStrategy(fsdp=...)`` does with a model built in ``configure_model`` or
under ``Trainer.init_module()``.

* Initialised by the model's own initialisers (:func:`materialize_sharded`) in *units*: the
  top-most modules with an initialiser of their own (``reset_parameters()`` or
  ``init_weights()``). Each unit is materialised whole on every rank, initialised (children
  first, parents last, as construction runs them), made rank 0's everywhere and sharded before
  the next unit is materialised, so a rank holds its shards plus one unit. A model whose root
  has an initialiser (it overrides its children's, as GPT's or Hugging Face's ``post_init`` do)
  is one unit: the whole model, once, before it is sharded.
* Read from pretrained weights (:func:`load_pretrained`): a Hugging Face directory of
  ``*.safetensors`` files, one ``.safetensors`` file, or a ``torch.save``-d state dict (or
  Lightning checkpoint). The parameters become unfilled shards and each rank reads only the rows
  of its shard (plain reads of the safetensors bytes; a memory-mapped torch file), so what it
  holds is its shard.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from autosp.errors import AutoSPError
from autosp.sharded.fsdp import ShardingPolicy, _local_rows, broadcast_module, shard_parameters

__all__ = [
    "has_meta_tensors", "move_real_tensors", "materialize_meta", "init_units", "materialize_sharded", "load_pretrained",
    "load_whole", "WeightsFile",
]

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


def materialize_sharded(module: nn.Module, device: torch.device, policy: ShardingPolicy, src: int = 0) -> InitReport:
    """Give the meta tensors of ``module`` their values with the model's own initialisers and
    shard its parameters by ``policy``, one unit (:func:`init_units`) at a time: a rank never
    holds more than one unit whole. Parameters held by several units (tied) or outside any unit
    are materialised with the first and left unsharded for the caller's
    :func:`~autosp.sharded.fsdp.shard_module`. A collective (rank ``src``'s values everywhere)."""
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
        broadcast_module(unit, src)
        shard_parameters(unit, policy, keep=frozenset(id(fresh[k]) for k in shared if k in fresh))
        for k in [k for k in fresh if k not in shared]:  # the unit's whole tensors: sharded (or buffers, held)
            del fresh[k]
    log.debug("AutoSP: initialised %d units one at a time (largest %d bytes)", len(units), report.largest_unit_bytes)
    return report


# ---------------------------------------------------------------------------------- pretrained weights
#: safetensors dtype names (the format's header) -> torch dtypes
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class _SafetensorsFile:
    """One ``.safetensors`` file read by rows with plain file reads into new tensors: nothing is
    memory-mapped, so a rank's resident memory grows by what it reads and no more. The format:
    an 8-byte little-endian header length, a JSON header (``name -> {dtype, shape,
    data_offsets}``), then the tensors' bytes, row-major."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
        except (OSError, ValueError) as exc:
            raise AutoSPError(f"cannot read the safetensors header of {path}: {type(exc).__name__}: {exc}") from exc
        header.pop("__metadata__", None)
        self.start = 8 + size
        self.entries = {name: (_SAFETENSORS_DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"][0]) for name, e in header.items()}

    def read(self, name: str, rows: Optional[tuple[int, int]]) -> torch.Tensor:
        dtype, shape, offset = self.entries[name]
        row_bytes = dtype.itemsize * (int(torch.Size(shape[1:]).numel()) if shape else 1)
        first, last = rows if rows is not None and shape else (0, shape[0] if shape else 1)
        out = torch.empty((last - first) * row_bytes, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.start + offset + first * row_bytes)
            if out.numel() and f.readinto(out.numpy()) != out.numel():
                raise AutoSPError(f"{self.path} is truncated: {name} ends past the end of the file.")
        return out.view(dtype).reshape((last - first, *shape[1:]) if shape else ())


class WeightsFile:
    """Pretrained weights opened for reading rows: a directory of ``*.safetensors`` files (a
    Hugging Face checkpoint) or one ``.safetensors`` file (read with plain reads, only the rows
    asked for), or a ``torch.save``-d state dict or Lightning checkpoint (its ``state_dict``,
    memory-mapped)."""

    def __init__(self, path: Any):
        self.path = Path(path)
        self._files: dict[str, _SafetensorsFile] = {}  # tensor name -> its file
        self._state: Optional[dict[str, torch.Tensor]] = None
        if not self.path.exists():
            raise AutoSPError(f"pretrained weights {self.path} do not exist.")
        files = sorted(self.path.glob("*.safetensors")) if self.path.is_dir() else [self.path] if self.path.suffix == ".safetensors" else []
        if files:
            for file in map(_SafetensorsFile, files):
                self._files.update(dict.fromkeys(file.entries, file))
        elif self.path.is_dir():
            raise AutoSPError(f"pretrained weights {self.path}: a directory without *.safetensors files.")
        else:
            try:
                loaded = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as exc:
                raise AutoSPError(f"cannot read pretrained weights {self.path}: {type(exc).__name__}: {exc}") from exc
            state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise AutoSPError(f"{self.path} is not a state dict (name -> tensor) or a Lightning checkpoint.")
            self._state = state

    def names(self) -> set[str]:
        return set(self._files) if self._state is None else set(self._state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._state[name].shape) if self._state is not None else self._files[name].entries[name][1]

    def read(self, name: str, rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """Tensor ``name``, or only rows ``[start, stop)`` of it (the others are not read)."""
        if self._state is not None:
            t = self._state[name]
            return t if rows is None or t.dim() == 0 else t[rows[0] : rows[1]]
        return self._files[name].read(name, rows)


def load_pretrained(module: nn.Module, source: Any, policy: ShardingPolicy, device: torch.device, strict: bool = True) -> int:
    """Shard ``module`` (built on the meta device) by ``policy`` with its parameters read from
    ``source`` (:class:`WeightsFile`; keys as ``module.state_dict()`` names them), each rank
    reading only the rows of its own shards; return how many tensors were read. Persistent
    buffers are read whole; buffers computed in ``__init__`` (RoPE tables) are recomputed by
    their module's initialiser (or a Hugging Face model's ``_init_weights``). Everything is
    checked (names, shapes) before anything is read; ``strict=False`` leaves parameters the file
    does not hold to the model's initialisers."""
    weights = source if isinstance(source, WeightsFile) else WeightsFile(source)
    have = weights.names()
    names = _name_groups(module)
    params = {id(p): p for p in module.parameters()}
    wrong = [f"{n}: file {list(weights.shape(n))}, model {list(params[i].shape)}" for i, ns in names.items() for n in ns if n in have and weights.shape(n) != tuple(params[i].shape)]
    missing = [ns[0] for i, ns in names.items() if not any(n in have for n in ns)]
    persistent = {n for n, _ in module.named_buffers()} & set(module.state_dict())
    if wrong:
        raise AutoSPError(f"pretrained weights {weights.path} do not fit this model; shapes differ: {'; '.join(wrong[:6])}.")
    if missing and strict:
        raise AutoSPError(
            f"pretrained weights {weights.path} lack {len(missing)} parameter(s) of the model: {missing[:8]}. Pass the "
            "weights of this model (keys as its state_dict names them), or set the LightningModule's strict_loading = "
            "False to initialise those with the model's initialisers."
        )
    groups = list(names.values())  # the names of each parameter (several where tied)
    if missing:  # initialised by the model, then sharded with the rest
        materialize_sharded(module, device, policy)
    else:
        shard_parameters(module, policy, device=device)  # unfilled shards, no full tensor anywhere
        _init_buffers(module, device)
    return _read_into(module, weights, groups, policy, persistent)


def load_whole(module: nn.Module, source: Any, strict: bool = True) -> int:
    """``module.load_state_dict`` from pretrained weights (:class:`WeightsFile`): for a replica
    (a run that does not shard, such as ``trainer.validate``); return how many tensors were read."""
    from autosp.checkpoint import check_fits

    weights = source if isinstance(source, WeightsFile) else WeightsFile(source)
    have, wanted = weights.names(), module.state_dict()
    groups = _name_groups(module)
    state = {name: weights.read(name) for name in have if name in wanted or strict}
    for group in groups.values():  # a tied parameter stored once, under one of its names
        source = next((n for n in group if n in have), None)
        for name in group:
            if source is not None and name not in state:
                state[name] = state[source]
    check_fits(state, wanted, strict, f"pretrained weights {weights.path}")
    module.load_state_dict(state, strict=False)
    return len(state)


def _name_groups(module: nn.Module) -> dict[int, list[str]]:
    """The names of each parameter of ``module`` (several where it is tied), by its id."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def _read_into(module: nn.Module, weights: WeightsFile, groups: list[list[str]], policy: ShardingPolicy, persistent: set[str]) -> int:
    """Copy each parameter's rows (this rank's shard) and each persistent buffer from ``weights``."""
    have = weights.names()
    count = 0
    with torch.no_grad():
        for group in groups:
            source = next((n for n in group if n in have), None)
            if source is None:
                continue
            p = module.get_parameter(group[0])
            local = p.to_local() if getattr(p, "_autosp_shard", False) else p
            rows = _local_rows(p.shape[0], policy) if getattr(p, "_autosp_shard", False) and p.dim() > 0 else None
            local.copy_(weights.read(source, rows))
            count += 1
        for name, b in module.named_buffers():
            if name in persistent and name in have:
                b.copy_(weights.read(name))
                count += 1
    return count


def _init_buffers(module: nn.Module, device: torch.device) -> None:
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
