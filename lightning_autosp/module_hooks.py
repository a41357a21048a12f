"""What the Lightning strategy changes on the user's LightningModule while its steps are compiled.

Dynamo would trace ``self.log``/``self.log_dict`` and torchmetrics' bookkeeping into the step
and recompile as their counters change; :func:`keep_out_of_graphs` keeps them out (set on the
instances only, undone by :func:`restore`). A ``self.log`` of tensors, numbers and strings inside a
compiled step is recorded in the graph (the values as they were at the call) and made when the step
returns (:func:`replay_deferred`): a graph break there would make Dynamo trace the step up to it
twice, the whole forward when the loss is logged. Other calls (a metric object logged, a metric
updated) run eagerly at a graph break, after the calls recorded before them. In the sharded mode,
logged DTensors are logged whole, and the error Lightning's ``grad_norm`` raises on DTensor
gradients is turned into one that names the fix (:func:`explaining_dtensor_errors`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

import torch

from autosp.errors import AutoSPError
from autosp.modes.sharded.values import whole

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ABSENT", "keep_out_of_graphs", "explaining_dtensor_errors", "restore", "replay_deferred", "drop_deferred"]

ABSENT = object()
_EAGER_METRIC_CALLS = ("forward", "update", "compute", "reset")
_EAGER_MODULE_CALLS = ("log", "log_dict")


#: ``self.log`` calls recorded inside compiled steps, ``(call, args, kwargs)``: made by
#: :func:`replay_deferred` (the step's caller runs it when the step returns)
_DEFERRED: list[tuple[Callable, tuple, dict]] = []


def replay_deferred() -> None:
    """Make the ``self.log`` calls a compiled step recorded, in order."""
    while _DEFERRED:
        call, args, kwargs = _DEFERRED.pop(0)
        call(*args, **kwargs)


def drop_deferred() -> None:
    """Forget the recorded calls of a step that raised (as eager logging before the error would
    not be reported either: the fit stops)."""
    _DEFERRED.clear()


def _replayable(value: Any) -> bool:
    """Values Dynamo can keep for a later call: tensors (graph outputs), numbers, strings, and
    lists, tuples and string-keyed dicts of them (``self.log_dict``)."""
    if value is None or isinstance(value, (torch.Tensor, bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_replayable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _replayable(v) for k, v in value.items())
    return False


def _snapshot(value: Any) -> Any:
    """``value`` with its tensors copied: what was logged, whatever the step does to them after."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def _deferring(call: Callable) -> Callable:
    """``call`` (``self.log``) recorded for :func:`replay_deferred` when a compiled step makes it with
    replayable arguments; otherwise made eagerly (a graph break in a compiled step), after the
    calls recorded before it."""

    def in_order(*args: Any, **kwargs: Any) -> Any:
        replay_deferred()
        return call(*args, **kwargs)

    eager = torch.compiler.disable(in_order, recursive=True)

    @functools.wraps(call)
    def log_or_defer(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and _replayable(args) and _replayable(kwargs):
            _DEFERRED.append((call, _snapshot(args), _snapshot(kwargs)))
            return None
        return eager(*args, **kwargs)

    return log_or_defer


def keep_out_of_graphs(module: "pl.LightningModule") -> list[tuple[Any, str, Any]]:
    """Keep the module's ``self.log``/``self.log_dict`` and its torchmetrics objects out of the
    compiled steps: Dynamo would trace their bookkeeping and, as a metric's counters change,
    recompile those frames at every step up to its recompile limit. ``self.log`` calls are
    recorded and made when the step returns (:func:`_deferring`); metric calls run eagerly at a
    graph break. Set on these objects only (instance attributes, undone in ``teardown``); return
    what was replaced."""
    from torchmetrics import Metric

    replaced = []
    targets = [(module, _EAGER_MODULE_CALLS)] + [(m, _EAGER_METRIC_CALLS) for m in module.modules() if isinstance(m, Metric)]
    for owner, names in targets:
        for name in names:
            before = owner.__dict__.get(name, ABSENT)
            replaced.append((owner, name, before))
            call = getattr(owner, name)
            if owner is module:  # a logged DTensor (a norm of sharded parameters) is logged whole
                setattr(owner, name, _deferring(_logging_whole(call, name)))
            else:
                setattr(owner, name, torch.compiler.disable(call, recursive=True))
    return replaced


def _logging_whole(log_fn: Callable, name: str) -> Callable:
    """``self.log(name, value, ...)`` / ``self.log_dict(dictionary, ...)`` with DTensor values whole
    (:func:`autosp.modes.sharded.values.whole`): Lightning would read one rank's part of them."""
    values = "dictionary" if name == "log_dict" else "value"
    position = 0 if name == "log_dict" else 1

    @functools.wraps(log_fn)
    def logging_whole(*args: Any, **kwargs: Any) -> Any:
        if values in kwargs:
            kwargs[values] = whole(kwargs[values])
        elif len(args) > position:
            args = (*args[:position], whole(args[position]), *args[position + 1 :])
        return log_fn(*args, **kwargs)

    return logging_whole


def explaining_dtensor_errors(hook: Callable, hook_name: str) -> Callable:
    """The module's ``hook`` (``on_before_optimizer_step``), with the error Lightning's
    ``grad_norm`` raises on DTensor gradients turned into one that names the fix."""

    @functools.wraps(hook)
    def explained(*args: Any, **kwargs: Any) -> Any:
        try:
            return hook(*args, **kwargs)
        except RuntimeError as exc:
            if "data is not allocated" not in str(exc):
                raise
            raise AutoSPError(
                f"`{hook_name}` read a DTensor's storage directly: with AutoSPStrategy(fsdp=...) parameters and their "
                "gradients are DTensors, and Lightning's `lightning.pytorch.utilities.grad_norm` (like any code that "
                "builds `torch.tensor` from their norms) cannot read them. Use `lightning_autosp.grad_norm(self, "
                "norm_type)`: the same keys with the whole model's norms. Norms of single DTensors are partial per "
                "rank: call `.full_tensor()` before `.item()`."
            ) from exc

    return explained


def restore(replaced: list[tuple[Any, str, Any]]) -> None:
    """Undo what :func:`keep_out_of_graphs` (and the strategy) set on the instances."""
    for owner, name, before in reversed(replaced):
        if before is ABSENT:
            owner.__dict__.pop(name, None)
        else:
            setattr(owner, name, before)
