"""Checkpoints under ``AutoSPStrategy``: torch distributed checkpoints (DCP) in the sharded mode,
Lightning's single file with replicas, and each resumable in the other mode and on any layout.

A sharded checkpoint is a directory named as Lightning asks (``epoch=0-step=4.ckpt``), laid
out as Lightning's own ``ModelParallelStrategy`` writes one::

    .metadata, __0_0.distcp, ...   torch.distributed.checkpoint: {"state_dict": the module's state
                                   dict (DTensors, the model's own keys), "optimizer_0": the first
                                   optimizer's state dict keyed by parameter name
                                   (torch.distributed.checkpoint.state_dict), ...}; each rank
                                   writes its shards
    meta.pt                        written by rank 0: everything else Lightning saves (loops,
                                   callbacks, schedulers, hyper-parameters)

The files go to ``<name>.partial`` first, and rank 0 moves the directory into place once every
rank has written, so an interrupted save never replaces an earlier checkpoint of the same name.
DCP reshards on load: a checkpoint saved by ``W`` ranks loads on ``W'`` ranks, sharded or into
replicas (every rank then reads whole tensors); other DCP readers work on it too
(``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``, Lightning's
``ModelParallelStrategy``). Loading checks the checkpoint's keys and shapes first and reads into
fresh tensors, so a checkpoint that does not fit changes nothing.

A replicated checkpoint is Lightning's file, plus the optimizer's parameter names
(``checkpoint["autosp"]["optimizer_param_names"]``) so that a sharded run can place its
optimizer state (:func:`named_optimizer_state`).
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from autosp.errors import AutoSPError

__all__ = [
    "META_FILE",
    "is_distributed_checkpoint",
    "save_distributed",
    "load_distributed",
    "check_fits",
    "saved_names",
    "current_names",
    "read_model_state_dict",
    "optimizer_param_names",
    "named_optimizer_state",
]

log = logging.getLogger(__name__)

#: the file of everything that is not a tensor of the model or an optimizer (Lightning's name)
META_FILE = "meta.pt"
_DCP_METADATA = ".metadata"
_PARTIAL = ".partial"
_MODEL_KEY = "state_dict"


def _optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def is_distributed_checkpoint(path: Any) -> bool:
    """A directory: what the sharded mode writes (complete or not)."""
    return Path(path).is_dir()


# ---------------------------------------------------------------------------------- saving
def save_distributed(checkpoint: Mapping[str, Any], path: Any, *, rank: int, barrier: Callable[[str], None]) -> None:
    """Write ``checkpoint`` (as :meth:`Trainer.save_checkpoint` builds it on every rank: the
    module's state dict of DTensors and the optimizers' state dicts from
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``) as a DCP directory at
    ``path``. A collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    partial = path.with_name(path.name + _PARTIAL)
    if rank == 0:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    barrier("autosp_checkpoint_start")
    meta = dict(checkpoint)
    tensors: dict[str, Any] = {}
    if _MODEL_KEY in meta:
        tensors[_MODEL_KEY] = meta.pop(_MODEL_KEY)
    for i, state in enumerate(meta.pop("optimizer_states", [])):
        tensors[_optimizer_key(i)] = state
    dcp.save(tensors, checkpoint_id=partial)
    barrier("autosp_checkpoint_tensors")
    if rank == 0:
        torch.save(meta, partial / META_FILE)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        partial.rename(path)
    barrier("autosp_checkpoint_done")
    log.debug("AutoSP: rank %d wrote its shards of %s", rank, path)


# ---------------------------------------------------------------------------------- reading
class _Reader:
    """A DCP directory opened for reading: its index (keys, shapes) and its ``meta.pt``."""

    def __init__(self, path: Any):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = Path(path)
        index = self.path / _DCP_METADATA
        meta_path = self.path / META_FILE
        if not index.is_file() or not meta_path.is_file():
            partial = " (a save that did not finish)" if self.path.name.endswith(_PARTIAL) else ""
            missing = ", ".join(p.name for p in (index, meta_path) if not p.is_file())
            earlier = (
                " It holds shard-*.pt files: it was written by lightning-autosp 0.1's own format, which this version "
                "no longer reads; export it with that version (python -m autosp.export) and load the file."
                if any(self.path.glob("shard-*-of-*.pt")) else ""
            )
            raise AutoSPError(
                f"{self.path} is not a complete AutoSP checkpoint{partial}: {missing} missing.{earlier} Resume from "
                "a checkpoint whose save finished."
            )
        try:
            self.metadata = FileSystemReader(self.path).read_metadata()
        except Exception as exc:
            raise AutoSPError(f"cannot read {index}: {type(exc).__name__}: {exc}. The checkpoint is damaged; resume from another one.") from exc
        self.tensors = {
            key: (tuple(item.size), item.properties.dtype)
            for key, item in self.metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)
        }
        self.keys = set(self.metadata.state_dict_metadata)
        self._meta_path = meta_path

    def meta(self, weights_only: Optional[bool] = None) -> dict[str, Any]:
        try:
            return torch.load(self._meta_path, map_location="cpu", weights_only=bool(weights_only))
        except Exception as exc:
            raise AutoSPError(f"cannot read {self._meta_path}: {type(exc).__name__}: {exc}. The file is damaged or truncated; resume from another checkpoint.") from exc

    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        prefix = _MODEL_KEY + "."
        return {k[len(prefix) :]: size for k, (size, _) in self.tensors.items() if k.startswith(prefix)}

    @property
    def optimizers(self) -> int:
        """How many optimizers' states the checkpoint holds."""
        return len({k.split(".", 1)[0] for k in self.keys if k.startswith("optimizer_")})

    def load(self, state: dict[str, Any], what: str) -> None:
        """``dcp.load`` into ``state`` (in place), errors naming the checkpoint."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        try:
            dcp.load(state, checkpoint_id=self.path)
        except (Exception, CheckpointException) as exc:
            raise AutoSPError(
                f"cannot read {what} from {self.path}: {type(exc).__name__}: {str(exc).strip()[:600]}. The checkpoint is "
                "damaged or incomplete (every rank's __*.distcp file is needed); resume from another one."
            ) from exc


def _fresh(state: Any) -> Any:
    """A copy of a (nested) state dict with new storage for every tensor (DCP fills it)."""
    from torch.distributed.tensor import DTensor

    def copy(t: Any) -> Any:
        if isinstance(t, DTensor):
            return DTensor.from_local(torch.empty_like(t.to_local()), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
        if isinstance(t, torch.Tensor):
            return torch.empty_like(t)
        return t

    return torch.utils._pytree.tree_map(copy, state)


def load_distributed(
    path: Any,
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    strict: bool = True,
    weights_only: Optional[bool] = None,
) -> dict[str, Any]:
    """Load a DCP checkpoint directory into ``module`` (DTensor or plain parameters: DCP reads
    this rank's shards or whole tensors) and ``optimizers`` (each from its ``optimizer_<i>``),
    and return the rest (``meta.pt``). Keys and shapes are checked before anything is read, and
    tensors are read into new storage first: a checkpoint that does not fit changes nothing. A
    collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    reader = _Reader(path)
    where = str(reader.path)
    saved = reader.model_shapes()
    current = get_model_state_dict(module)
    name = saved_names(saved, current)  # written by the other front door (Trainer <-> Fabric)?
    back = {name(k): k for k in current}
    check_fits(saved, {name(k): v for k, v in current.items()}, strict, where)
    if len(optimizers) > reader.optimizers:
        raise AutoSPError(
            f"{where} holds the state of {reader.optimizers} optimizer(s) (none: saved with save_weights_only), this "
            f"run has {len(optimizers)}: configure_optimizers must build the optimizers it saved."
        )
    meta = reader.meta(weights_only)
    # one read of everything (DCP plans and reads once), into fresh tensors
    state = {_MODEL_KEY: _fresh({name(k): v for k, v in current.items() if name(k) in saved})}
    for i, optimizer in enumerate(optimizers):  # (get_optimizer_state_dict creates lazily held state)
        state[_optimizer_key(i)] = _fresh(_renamed_optimizer_state(get_optimizer_state_dict(module, optimizer), name))
    reader.load(state, "the model" + (" and the optimizer state" if optimizers else ""))
    # everything read: now write
    module.load_state_dict({back[k]: v for k, v in state[_MODEL_KEY].items()}, strict=False)
    for i, optimizer in enumerate(optimizers):
        loaded = _renamed_optimizer_state(state[_optimizer_key(i)], back.__getitem__)
        set_optimizer_state_dict(module, optimizer, loaded, options=StateDictOptions(strict=strict))
    return meta


def saved_names(saved: Iterable[str], current: Iterable[str]) -> Callable[[str], str]:
    """``current key -> saved key``, where the two sets name the same tensors under a different
    root: a Trainer checkpoint of a LightningModule that holds the model as ``self.model``
    (``model.transformer.wte.weight``) and a Fabric checkpoint of the model itself
    (``transformer.wte.weight``), either way round. The identity when the keys agree, or when
    no prefix of whole attribute names makes them agree."""
    saved, current = set(saved), set(current)
    if not saved or not current or current <= saved or saved <= current:
        return lambda key: key
    for longer, shorter, add in ((saved, current, True), (current, saved, False)):
        prefix = os.path.commonprefix(sorted(longer)[:1] + sorted(longer)[-1:])
        prefix = prefix[: prefix.rfind(".") + 1]
        if prefix and {k[len(prefix):] for k in longer} & shorter and all(k.startswith(prefix) for k in longer):
            return (lambda key: prefix + key) if add else (lambda key: key[len(prefix):] if key.startswith(prefix) else key)
    return lambda key: key


def current_names(saved: Iterable[str], current: Iterable[str]) -> Callable[[str], str]:
    """``saved key -> current key``: the inverse of :func:`saved_names`."""
    current = list(current)
    name = saved_names(saved, current)
    back = {name(k): k for k in current}
    return lambda key: back.get(key, key)


def _renamed_optimizer_state(state: Mapping[str, Any], name: Callable[[str], str]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (``get_optimizer_state_dict``), renamed."""
    return {
        "state": {name(k): v for k, v in state.get("state", {}).items()},
        "param_groups": [{**g, "params": [name(p) for p in g["params"]]} for g in state.get("param_groups", [])],
    }


def check_fits(saved: Mapping[str, Any], current: Mapping[str, Any], strict: bool, where: str) -> None:
    """Raise an :class:`AutoSPError` naming ``where`` unless a checkpoint's model tensors (``saved``:
    key -> tensor or shape) fit a module's state dict (``current``): the same shapes, and with
    ``strict`` the same keys. Called before anything is loaded."""

    def shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v) for k, v in state.items() if isinstance(v, (torch.Tensor, tuple, list))}

    saved, current = shapes(saved), shapes(current)
    wrong = [f"{k}: checkpoint {list(s)}, model {list(current[k])}" for k, s in saved.items() if k in current and s != current[k]]
    if wrong:
        raise AutoSPError(f"{where} does not fit this model; shapes differ: {'; '.join(wrong[:6])}. Resume with the model that wrote it.")
    missing, unexpected = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
    if strict and (missing or unexpected):
        raise AutoSPError(
            f"{where} does not fit this model: missing {missing[:8]}, unexpected {unexpected[:8]}. Resume with the model "
            "that wrote it (or set the LightningModule's strict_loading = False to load what matches)."
        )


def read_model_state_dict(path: Any) -> dict[str, torch.Tensor]:
    """The module state dict of a DCP checkpoint directory, whole tensors on the CPU, read in
    this process (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = _Reader(path)
    prefix = _MODEL_KEY + "."
    state = {k[len(prefix) :]: torch.empty(size, dtype=dtype) for k, (size, dtype) in reader.tensors.items() if k.startswith(prefix)}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*load in a single process")
            dcp.load({_MODEL_KEY: state}, checkpoint_id=reader.path, no_dist=True)
    except (Exception, CheckpointException) as exc:
        raise AutoSPError(f"cannot read the model from {reader.path}: {type(exc).__name__}: {str(exc).strip()[:600]}") from exc
    return state


# ---------------------------------------------------------------------------------- single files
def optimizer_param_names(module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[list[str]]:
    """Per optimizer, the name of each parameter in the order ``optimizer.state_dict()`` indexes
    them (what a replicated checkpoint stores, so that a sharded run can place the state)."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names.get(id(p), "?") for g in opt.param_groups for p in g["params"]] for opt in optimizers]


def named_optimizer_state(indexed: Mapping[str, Any], names: Sequence[str], where: str) -> dict[str, Any]:
    """``optimizer.state_dict()`` (positions) keyed by parameter name instead, as
    ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` takes it."""
    try:
        return {
            "state": {names[i]: dict(s) for i, s in indexed["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in indexed["param_groups"]],
        }
    except (IndexError, KeyError, TypeError) as exc:
        raise AutoSPError(f"{where}: its optimizer state does not match its parameter names ({exc!r}); the file is not one AutoSPStrategy wrote.") from exc
