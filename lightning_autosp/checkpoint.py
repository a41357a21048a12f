"""Checkpoints under ``AutoSPStrategy``: distributed (one file per rank) in the sharded mode,
readable on any layout, and a conversion to one file with the model's own key names.

A sharded checkpoint is a directory named as Lightning asks (``epoch=0-step=4.ckpt``)::

    meta.pt                    written by rank 0: everything that is not sharded (loops,
                               callbacks, schedulers, hyper-parameters, buffers, the optimizer's
                               hyper-parameters and scalar state such as Adam's ``step``) and an
                               index of the sharded tensors (name, shape, world size)
    shard-00000-of-00004.pt    written by rank r: its flat slice of every parameter and of every
    ...                        optimizer state tensor shaped like one (momentum, Adam's moments)

Every rank writes its own file; no rank gathers the model. The files go to
``<name>.partial`` first, and rank 0 moves the directory into place once every rank has
written, so an interrupted save never replaces an earlier checkpoint of the same name.

A reader cuts any element range of any tensor out of the shard files (memory-mapped: a rank
reads the bytes it needs), which is how a checkpoint saved by ``W`` ranks loads on ``W'`` ranks,
sharded or replicated. Tensors are named as in the model (``model.layers.0.wq.weight``: no
``parametrizations``), optimizer state by parameter name, not position.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
import torch.nn as nn

from lightning_autosp.errors import AutoSPError
from lightning_autosp.fsdp import _sharded_entries

__all__ = [
    "META_FILE",
    "shard_file_name",
    "is_sharded_checkpoint",
    "sharded_state_dict",
    "sharded_shapes",
    "sharded_param_names",
    "named_optimizer_state",
    "indexed_optimizer_state",
    "save_sharded",
    "ShardedCheckpoint",
    "FullCheckpoint",
    "open_checkpoint",
    "load_sharded_module",
    "load_sharded_optimizer",
]

log = logging.getLogger(__name__)

FORMAT = "lightning-autosp/sharded"
VERSION = 1
META_FILE = "meta.pt"
_PARTIAL = ".partial"


def shard_file_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.pt"


def is_sharded_checkpoint(path: Any) -> bool:
    return Path(path).is_dir()


def _own_name(key: str) -> str:
    """``a.parametrizations.weight.original`` -> ``a.weight``."""
    head, sep, tail = key.partition("parametrizations.")
    if not sep or not tail.endswith(".original"):
        return key
    return head + tail.removesuffix(".original")


def sharded_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every sharded parameter of ``module`` under its own name (tied ones under each name),
    with its full shape."""
    return {key: tuple(mod.parametrizations[name][0].shape) for key, mod, name in _sharded_entries(module)}


def sharded_param_names(module: nn.Module) -> dict[int, str]:
    """``id(shard parameter) -> name`` (a tied parameter: its first name)."""
    names: dict[int, str] = {}
    for key, mod, name in _sharded_entries(module):
        names.setdefault(id(mod.parametrizations[name].original), key)
    return names


def sharded_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` of a sharded module with its own key names; each parameter is this
    rank's flat shard (``sharded_shapes`` says which keys are shards, and of what)."""
    return {_own_name(k): v for k, v in module.state_dict().items()}


def named_optimizer_state(optimizer: torch.optim.Optimizer, param_names: Mapping[int, str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name instead of position."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    unnamed = [i for i, p in enumerate(params) if id(p) not in param_names]
    if unnamed:
        raise AutoSPError(
            f"the optimizer holds {len(unnamed)} tensor(s) that are not parameters of the LightningModule (positions "
            f"{unnamed[:8]}): AutoSP saves optimizer state by parameter name. Optimize the module's parameters only."
        )
    names = [param_names[id(p)] for p in params]
    state = optimizer.state_dict()
    return {
        "state": {names[i]: dict(s) for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]],
    }


def indexed_optimizer_state(
    named: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    param_names: Mapping[int, str],
    where: str,
    fill: Optional[Callable[[str, str, torch.Tensor], torch.Tensor]] = None,
    filled: Optional[Mapping[str, Iterable[str]]] = None,
) -> dict[str, Any]:
    """The inverse of :func:`named_optimizer_state` for ``optimizer``: positions from its own
    parameters' names. ``fill(name, key, param)`` supplies the state tensors listed in
    ``filled[name]`` (the sharded ones). Groups must hold the same parameters as when saved."""
    saved_groups = named["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise AutoSPError(
            f"{where}: the checkpoint's optimizer has {len(saved_groups)} parameter group(s), this one "
            f"{len(optimizer.param_groups)}: configure_optimizers must build the optimizer it saved."
        )
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for g, (saved, group) in enumerate(zip(saved_groups, optimizer.param_groups)):
        names = [param_names.get(id(p), "?") for p in group["params"]]
        if sorted(names) != sorted(saved["params"]):
            missing = sorted(set(saved["params"]) - set(names))
            extra = sorted(set(names) - set(saved["params"]))
            raise AutoSPError(
                f"{where}: parameter group {g} of the optimizer does not hold the parameters it held when saved "
                f"(not in the model now: {missing[:6]}; new: {extra[:6]}). Resume with the model and "
                "configure_optimizers that wrote the checkpoint."
            )
        ids = []
        for p, name in zip(group["params"], names):
            entry = dict(named["state"].get(name, {}))
            for key in (filled or {}).get(name, ()):
                entry[key] = fill(name, key, p)  # type: ignore[misc]
            if entry:
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**saved, "params": ids})
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------------- saving
def save_sharded(
    checkpoint: Mapping[str, Any],
    path: Any,
    *,
    rank: int,
    world: int,
    shapes: Mapping[str, tuple[int, ...]],
    barrier: Callable[[str], None],
) -> None:
    """Write ``checkpoint`` (as :meth:`Trainer.save_checkpoint` builds it on every rank, with a
    :func:`sharded_state_dict` and :func:`named_optimizer_state`\\ s) as a sharded checkpoint
    directory at ``path``. A collective: every rank calls it."""
    path = Path(path)
    partial = path.with_name(path.name + _PARTIAL)
    if rank == 0:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    barrier("autosp_checkpoint_start")
    meta = dict(checkpoint)
    state_dict = dict(checkpoint.get("state_dict", {}))
    shard: dict[str, Any] = {"params": {}, "optimizer": []}
    for key in shapes:
        if key in state_dict:
            shard["params"][key] = state_dict.pop(key)
    meta["state_dict"] = state_dict
    index: dict[str, Any] = {"format": FORMAT, "version": VERSION, "world_size": world, "params": {k: list(s) for k, s in shapes.items()}, "optimizer": []}
    meta_optimizers = []
    for named in checkpoint.get("optimizer_states", []):
        kept, cut, keys = {}, {}, {}
        for name, entry in named["state"].items():
            chunk = -(-_numel(shapes[name]) // world)
            kept[name] = {}
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if tuple(value.shape) != (chunk,):
                        raise AutoSPError(
                            f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, not that of the "
                            f"parameter's shard ({chunk},): AutoSP shards only elementwise optimizer state (SGD "
                            "momentum, Adam, AdamW, ...). Use such an optimizer with fsdp=True."
                        )
                    cut.setdefault(name, {})[key] = value
                    keys.setdefault(name, []).append(key)
                else:
                    kept[name][key] = value
        shard["optimizer"].append(cut)
        index["optimizer"].append(keys)
        meta_optimizers.append({"state": kept, "param_groups": named["param_groups"]})
    if "optimizer_states" in checkpoint:
        meta["optimizer_states"] = meta_optimizers
    meta["autosp"] = index
    torch.save(shard, partial / shard_file_name(rank, world))
    barrier("autosp_checkpoint_shards")
    if rank == 0:
        torch.save(meta, partial / META_FILE)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        partial.rename(path)
    barrier("autosp_checkpoint_done")
    log.debug("AutoSP: rank %d wrote its shard of %s", rank, path)


def _numel(shape: Iterable[int]) -> int:
    return int(torch.Size(list(shape)).numel())


# ---------------------------------------------------------------------------------- reading
class ShardedCheckpoint:
    """A sharded checkpoint directory, opened for reading: ``meta`` is the non-sharded part
    (as Lightning's loaders expect it), :meth:`read` cuts element ranges of sharded tensors."""

    def __init__(self, path: Any):
        self.path = Path(path)
        meta_path = self.path / META_FILE
        if not meta_path.is_file():
            partial = " (a save that did not finish)" if self.path.name.endswith(_PARTIAL) else ""
            raise AutoSPError(
                f"{self.path} is not a complete AutoSP checkpoint{partial}: {meta_path} is missing. Resume from "
                "a checkpoint whose save finished."
            )
        self.meta = _load(meta_path, weights_only=False)
        index = self.meta.get("autosp") if isinstance(self.meta, dict) else None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise AutoSPError(f"{meta_path} is not the index of an AutoSP sharded checkpoint.")
        if index.get("version", 0) > VERSION:
            raise AutoSPError(f"{meta_path} was written by a newer lightning-autosp (format {index['version']}); upgrade.")
        self.world: int = index["world_size"]
        self.shapes: dict[str, tuple[int, ...]] = {k: tuple(s) for k, s in index["params"].items()}
        self.optimizer_keys: list[dict[str, list[str]]] = index["optimizer"]
        missing = [shard_file_name(r, self.world) for r in range(self.world) if not (self.path / shard_file_name(r, self.world)).is_file()]
        if missing:
            raise AutoSPError(
                f"{self.path} is incomplete: {', '.join(missing)} missing (the checkpoint was written by "
                f"{self.world} ranks, one file each). Copy the whole directory, or resume from another checkpoint."
            )
        self._shards: dict[int, dict[str, Any]] = {}

    def _shard(self, rank: int) -> dict[str, Any]:
        if rank not in self._shards:
            self._shards[rank] = _load(self.path / shard_file_name(rank, self.world), weights_only=True, mmap=True)
        return self._shards[rank]

    def read(self, key: str, start: int, stop: int, optimizer: Optional[tuple[int, str]] = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened parameter ``key`` (or, with ``optimizer=(i,
        state_key)``, of that parameter's state in optimizer ``i``), zero past its end."""
        numel = _numel(self.shapes[key])
        chunk = -(-numel // self.world)
        pieces = []
        pos, end = start, min(stop, numel)
        while pos < end:
            rank = pos // chunk
            hi = min(end, (rank + 1) * chunk)
            pieces.append(self._piece(rank, key, chunk, optimizer)[pos - rank * chunk : hi - rank * chunk])
            pos = hi
        if stop > max(start, end):
            like = pieces[0] if pieces else self._piece(0, key, chunk, optimizer)
            pieces.append(like.new_zeros(stop - max(start, end)))
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]

    def _piece(self, rank: int, key: str, chunk: int, optimizer: Optional[tuple[int, str]]) -> torch.Tensor:
        shard = self._shard(rank)
        file = self.path / shard_file_name(rank, self.world)
        try:
            t = shard["params"][key] if optimizer is None else shard["optimizer"][optimizer[0]][key][optimizer[1]]
        except (KeyError, IndexError, TypeError) as exc:
            raise AutoSPError(f"{file} lacks {key}{'' if optimizer is None else f' (optimizer state {optimizer[1]!r})'}: the file does not belong to this checkpoint.") from exc
        if t.numel() != chunk:
            raise AutoSPError(f"{file}: {key} holds {t.numel()} elements, the index says {chunk}: the file does not belong to this checkpoint.")
        return t.reshape(-1)

    def full(self, key: str) -> torch.Tensor:
        return self.read(key, 0, _numel(self.shapes[key])).view(self.shapes[key])

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's whole state dict (full tensors), as the LightningModule names it."""
        return {**self.meta["state_dict"], **{k: self.full(k).clone() for k in self.shapes}}

    def to_full(self) -> dict[str, Any]:
        """The whole checkpoint in Lightning's single-file form, with optimizer state still keyed
        by name (:func:`indexed_optimizer_state` positions it for an optimizer)."""
        checkpoint = dict(self.meta)
        checkpoint["state_dict"] = self.model_state_dict()
        optimizers = []
        for i, named in enumerate(self.meta.get("optimizer_states", [])):
            state = {name: dict(entry) for name, entry in named["state"].items()}
            for name, keys in self.optimizer_keys[i].items():
                for key in keys:
                    state.setdefault(name, {})[key] = self.read(name, 0, _numel(self.shapes[name]), (i, key)).view(self.shapes[name]).clone()
            optimizers.append({"state": state, "param_groups": named["param_groups"]})
        if "optimizer_states" in self.meta:
            checkpoint["optimizer_states"] = optimizers
        return checkpoint


class FullCheckpoint:
    """A single-file checkpoint (replicated mode) behind :class:`ShardedCheckpoint`'s reading
    interface, so a sharded run can resume from it."""

    def __init__(self, checkpoint: Mapping[str, Any], path: Any, shapes: Mapping[str, tuple[int, ...]]):
        self.path = Path(path)
        state_dict = checkpoint.get("state_dict", {})
        self.shapes = {k: tuple(state_dict[k].shape) for k in shapes if k in state_dict}
        self.meta = dict(checkpoint)
        self.meta["state_dict"] = {k: v for k, v in state_dict.items() if k not in self.shapes}
        self._full = {k: state_dict[k] for k in self.shapes}
        self.optimizer_keys: list[dict[str, list[str]]] = []
        self._optimizer_full: list[dict[str, dict[str, torch.Tensor]]] = []
        optimizers = []
        names = (checkpoint.get("autosp") or {}).get("optimizer_param_names")
        for i, indexed in enumerate(checkpoint.get("optimizer_states", [])):
            if names is None or i >= len(names):
                raise AutoSPError(
                    f"{self.path} holds optimizer state by position only (it was not written by AutoSPStrategy), "
                    "and a sharded run needs it by parameter name. Resume it with fsdp=False, or load its "
                    "weights into the module before fit and start the optimizer afresh."
                )
            kept, full, keys = {}, {}, {}
            for pos, entry in indexed["state"].items():
                name = names[i][pos]
                kept[name] = {k: v for k, v in entry.items() if not (isinstance(v, torch.Tensor) and v.dim() > 0)}
                full[name] = {k: v for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
                keys[name] = list(full[name])
            self.optimizer_keys.append(keys)
            self._optimizer_full.append(full)
            groups = [{**g, "params": [names[i][p] for p in g["params"]]} for g in indexed["param_groups"]]
            optimizers.append({"state": kept, "param_groups": groups})
        self.meta["optimizer_states"] = optimizers

    def read(self, key: str, start: int, stop: int, optimizer: Optional[tuple[int, str]] = None) -> torch.Tensor:
        t = self._full[key] if optimizer is None else self._optimizer_full[optimizer[0]][key][optimizer[1]]
        flat = t.reshape(-1)
        piece = flat[start : min(stop, flat.numel())]
        if stop > flat.numel():
            piece = torch.cat([piece, flat.new_zeros(stop - max(start, flat.numel()))])
        return piece


def open_checkpoint(path: Any, loaded: Optional[Mapping[str, Any]] = None, shapes: Mapping[str, tuple[int, ...]] = {}):  # noqa: B006
    if Path(path).is_dir():
        return ShardedCheckpoint(path)
    assert loaded is not None
    return FullCheckpoint(loaded, path, shapes)


def _load(path: Path, weights_only: bool, mmap: bool = False) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)
    except Exception as exc:
        raise AutoSPError(f"cannot read {path}: {type(exc).__name__}: {exc}. The file is damaged or truncated; resume from another checkpoint.") from exc


# ---------------------------------------------------------------------------------- loading into a sharded module
def load_sharded_module(module: nn.Module, source: Any, rank: int, world: int, strict: bool = True) -> None:
    """Give the sharded ``module`` the checkpoint's values: each rank reads its slice of every
    parameter (whatever layout wrote it), buffers and other entries as they are. Everything is
    read and checked before anything is written: an incompatible checkpoint changes nothing."""
    shapes = sharded_shapes(module)
    others = {_own_name(k) for k in module.state_dict()} - set(shapes)
    saved_others = set(source.meta.get("state_dict", {}))
    where = str(source.path)
    wrong = [f"{k}: checkpoint {list(source.shapes[k])}, model {list(s)}" for k, s in shapes.items() if k in source.shapes and tuple(source.shapes[k]) != tuple(s)]
    if wrong:
        raise AutoSPError(f"{where} does not fit this model; shapes differ: {'; '.join(wrong[:6])}. Resume with the model that wrote it.")
    missing = sorted((set(shapes) - set(source.shapes)) | (others - saved_others))
    unexpected = sorted((set(source.shapes) - set(shapes)) | (saved_others - others))
    if strict and (missing or unexpected):
        raise AutoSPError(
            f"{where} does not fit this model: missing {missing[:8]}, unexpected {unexpected[:8]}. Resume with the model "
            "that wrote it (or set the LightningModule's strict_loading = False to load what matches)."
        )
    values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, mod, name in _sharded_entries(module):
        if key not in source.shapes:
            continue
        shard = mod.parametrizations[name].original
        if id(shard) in values:
            continue
        chunk = shard.numel()
        values[id(shard)] = (shard, source.read(key, rank * chunk, (rank + 1) * chunk))
    buffers = {k: v for k, v in source.meta.get("state_dict", {}).items() if k in others}
    with torch.no_grad():
        for shard, value in values.values():
            shard.copy_(value)
    if buffers:
        module.load_state_dict(buffers, strict=False)


def load_sharded_optimizer(optimizer: torch.optim.Optimizer, index: int, source: Any, module: nn.Module, rank: int) -> None:
    """Give ``optimizer`` (over the shards of ``module``) its state from the checkpoint: every
    elementwise state tensor cut to this rank's slice, whatever layout wrote it."""
    names = sharded_param_names(module)
    if index >= len(source.meta.get("optimizer_states", [])):
        raise AutoSPError(f"{source.path} holds no state for optimizer {index}: configure_optimizers must build the optimizers it saved.")

    def fill(name: str, key: str, param: torch.Tensor) -> torch.Tensor:
        chunk = param.numel()
        return source.read(name, rank * chunk, (rank + 1) * chunk, (index, key)).to(param.device).clone()

    state = indexed_optimizer_state(source.meta["optimizer_states"][index], optimizer, names, str(source.path), fill, source.optimizer_keys[index])
    optimizer.load_state_dict(state)
