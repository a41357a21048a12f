"""Pretrained weights read into a model built on the ``meta`` device, each rank only its shards.

A Hugging Face directory of ``*.safetensors`` files, one ``.safetensors`` file, or a
``torch.save``-d state dict (or Lightning checkpoint) (:class:`WeightsFile`). The parameters
become unfilled shards and each rank reads only the rows of its shard (plain reads of the
safetensors bytes; a memory-mapped torch file), so what it holds is its shard.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from autosp.errors import AutoSPError
from autosp.modes.sharded.config import ShardingPolicy
from autosp.modes.sharded.materialize import init_buffers, materialize_sharded
from autosp.modes.sharded.params import local_rows, shard_parameters

__all__ = ["load_pretrained", "load_whole", "WeightsFile"]


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
        init_buffers(module, device)
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
            rows = local_rows(p.shape[0], policy) if getattr(p, "_autosp_shard", False) and p.dim() > 0 else None
            local.copy_(weights.read(source, rows))
            count += 1
        for name, b in module.named_buffers():
            if name in persistent and name in have:
                b.copy_(weights.read(name))
                count += 1
    return count
