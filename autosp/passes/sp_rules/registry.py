"""The registry of sequence-parallel rules: one entry per op, whatever its spelling.

A Dynamo graph spells one op several ways: ``torch.add(x, y)`` and ``operator.add`` are
``call_function`` nodes, ``x.add(y)`` is a ``call_method`` node, ``x.add_(y)`` is its in-place
method spelling. :func:`sp_rule` registers a rule for ops given by :func:`op`, which lists an
op's canonical name (also its method spelling) and its function spellings; :func:`lookup`
normalises a node into an :class:`OpCall` and finds the rule, so adding an op is a change in
one place.

A rule is ``rule(rw, node, call) -> (new_value, placement) | None``: ``rw`` is the pass's
:class:`~autosp.passes.rewrite.SPRewrite` (shapes of the old graph,
placements, the graph being built), ``new_value`` the node's value in the new graph and
``placement`` its :class:`~autosp.passes.placement.Shard`, ``REPLICATE``, a tuple
of them (for ops returning several tensors) or ``None`` (not a tensor). ``None`` instead of a
pair means the rule does not apply to these arguments: the pass then runs the op replicated
(its sharded inputs all-gathered) and reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from autosp.passes.rewrite import SPRewrite

__all__ = ["OpCall", "Rule", "op", "sp_rule", "lookup", "calls"]

RuleResult = Optional[tuple[Any, Any]]


@dataclass(frozen=True)
class OpCall:
    """One call of a registered op, normalised: ``name`` is the canonical op name (``"add"``,
    ``"sum"``, ``"transpose"``, ...); ``inplace`` is set for the in-place method spelling
    (``x.add_(y)``). The pass decides whether an in-place call may use the op's rule
    (:mod:`autosp.passes.inplace`); the rule copies the call as it is spelled."""

    name: str
    inplace: bool = False


@dataclass(frozen=True)
class Rule:
    """A registered rule. ``source`` rules run even when no input is sharded: they are where
    activations become sequence-sharded (token-wise ops such as embedding, linear, norms) or
    must be rewritten regardless (attention)."""

    fn: Callable[["SPRewrite", fx.Node, OpCall], RuleResult]
    source: bool = False

    def __call__(self, rw: "SPRewrite", node: fx.Node, call: OpCall) -> RuleResult:
        return self.fn(rw, node, call)


@dataclass(frozen=True)
class OpSpelling:
    name: str
    functions: tuple[Callable, ...]
    method: bool


def op(name: str, *functions: Callable, method: bool = True) -> OpSpelling:
    """An op and its spellings: ``functions`` (``call_function`` targets) and, unless
    ``method=False``, the method ``x.name(...)`` with its in-place form ``x.name_(...)``."""
    return OpSpelling(name, functions, method)


_BY_FUNCTION: dict[Callable, tuple[str, Rule]] = {}
_BY_METHOD: dict[str, tuple[str, Rule]] = {}


def sp_rule(*ops: OpSpelling, source: bool = False) -> Callable:
    """Register the decorated function as the rule of every op in ``ops``."""

    def register(fn: Callable[["SPRewrite", fx.Node, OpCall], RuleResult]) -> Rule:
        rule = Rule(fn, source)
        for spelling in ops:
            for target in spelling.functions:
                if target in _BY_FUNCTION:
                    raise ValueError(f"two sequence-parallel rules for {target}")
                _BY_FUNCTION[target] = (spelling.name, rule)
            if spelling.method:
                if spelling.name in _BY_METHOD:
                    raise ValueError(f"two sequence-parallel rules for the method {spelling.name!r}")
                _BY_METHOD[spelling.name] = (spelling.name, rule)
        return rule

    return register


def lookup(node: fx.Node) -> Optional[tuple[OpCall, Rule]]:
    """The normalised call and the rule for ``node``, or ``None`` if no rule is registered."""
    if node.op == "call_function":
        target = node.target
        if target is getattr:  # ``x.shape`` reads like ``x.size()``
            if len(node.args) == 2 and node.args[1] == "shape" and "size" in _BY_METHOD:
                name, rule = _BY_METHOD["size"]
                return OpCall(name), rule
            return None
        try:
            entry = _BY_FUNCTION.get(target)
        except TypeError:  # an unhashable target
            return None
        return (OpCall(entry[0]), entry[1]) if entry is not None else None
    if node.op == "call_method":
        method = node.target
        if method in _BY_METHOD:
            name, rule = _BY_METHOD[method]
            return OpCall(name), rule
        if method.endswith("_") and not method.startswith("__") and method[:-1] in _BY_METHOD:
            name, rule = _BY_METHOD[method[:-1]]
            return OpCall(name, inplace=True), rule
    return None


def calls(node: object, name: str) -> bool:
    """``node`` calls ``name`` in one of its out-of-place spellings - ``torch.<name>(x, ..)``,
    ``torch.Tensor.<name>(x, ..)`` or ``x.<name>(..)`` - whether or not a rule is registered
    for it (the pass's pattern matchers use it to read what the model computes)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target == name
    return node.op == "call_function" and node.target in (getattr(torch, name, None), getattr(torch.Tensor, name, None))
