"""Saved activations of an eager forward (single device, plain DDP), per op kind.

:class:`EagerSavedTensors` records, during one forward, the aten op and innermost module that
produced every tensor (a ``TorchDispatchMode`` plus module hooks) and the tensors autograd saves
(``torch.autograd.graph.saved_tensors_hooks``), in the vocabulary of :mod:`.accounting`.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autosp.passes.accounting import empty_by_kind, is_alias, op_kind

__all__ = ["EagerSavedTensors"]

def _storage_key(t: torch.Tensor) -> Optional[int]:
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    ptr = st.data_ptr()
    return ptr if ptr else None


def _storage_bytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return t.numel() * t.element_size()


class _ProducerMode(TorchDispatchMode):
    """Remembers, for every allocation made during the forward, the kind of op that made it."""

    def __init__(self, owner: "EagerSavedTensors") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_alias(func):
            return out
        ins = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        kind = None
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)
                if key is None or key in ins:  # in-place / out= ops keep their producer
                    continue
                if kind is None:
                    stack = self.owner._module_stack
                    kind = op_kind(func._schema.name, stack[-1] if stack else None)
                self.owner._producers[key] = kind
        return out


class EagerSavedTensors:
    """Measure, for one eager forward, the bytes autograd saves for backward per op kind.

    ``start(module)`` before the forward, ``stop()`` after it (before backward); then
    :attr:`by_kind` holds the bytes per :data:`OP_KINDS` entry. Module hooks stay registered
    on ``module`` between calls (they only act while a measurement runs); :meth:`close`
    removes them. Holds no reference to any tensor.
    """

    def __init__(self) -> None:
        self._module_stack: list[str] = []
        self._producers: dict[int, str] = {}
        self._saved: dict[int, tuple[int, str]] = {}
        self._handles: list[Any] = []
        self._hooked: Optional[weakref.ref] = None
        self._ctx: list[Any] = []
        self.active = False
        self.by_kind: dict[str, int] = empty_by_kind()

    # module context -----------------------------------------------------------
    def _hook(self, module: torch.nn.Module) -> None:
        if self._hooked is not None and self._hooked() is module:
            return
        self.close()
        names = {m: type(m).__name__ for m in module.modules()}

        def pre(mod, args):
            if self.active:
                self._module_stack.append(names.get(mod, type(mod).__name__))

        def post(mod, args, out):
            if self.active and self._module_stack:
                self._module_stack.pop()

        for m in names:
            self._handles.append(m.register_forward_pre_hook(pre))
            self._handles.append(m.register_forward_hook(post, always_call=True))
        self._hooked = weakref.ref(module)

    @property
    def hooked(self) -> bool:
        """Whether module hooks are registered (from the first :meth:`start` until :meth:`close`)."""
        return bool(self._handles)

    def close(self) -> None:
        if self.active:
            self.stop()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked = None

    # saved tensors --------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in self._saved:
            kind = self._producers.get(key)
            if kind is not None:  # produced during this forward: an activation
                self._saved[key] = (_storage_bytes(t), kind)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def start(self, module: torch.nn.Module) -> None:
        if self.active:
            self.stop()
        self._hook(module)
        self._module_stack.clear()
        self._producers.clear()
        self._saved.clear()
        self.active = True
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        mode = _ProducerMode(self)
        hooks.__enter__()
        mode.__enter__()
        self._ctx = [hooks, mode]

    def stop(self) -> dict[str, int]:
        if not self.active:
            return self.by_kind
        for ctx in reversed(self._ctx):
            ctx.__exit__(None, None, None)
        self._ctx = []
        self.active = False
        out = empty_by_kind()
        for nbytes, kind in self._saved.values():
            out[kind] += nbytes
        self.by_kind = out
        self._producers.clear()
        self._saved.clear()
        self._module_stack.clear()
        return out

