"""Sequence placements of tensors in a Dynamo (torch IR) graph, and the size algebra they need.

Vocabulary: ``s`` is the global length of the sequence the pass splits (a SymInt symbol of the
graph's inputs, or that symbol plus a constant when the step slices the batch before the
model, ``model(tokens[:, :-1])``), ``c =
ceil(s / sp_size)`` is the base chunk each SP rank owns (the last rank owns ``s - (sp_size-1)*c``,
fewer when ``s`` is not divisible by ``sp_size``; :mod:`autosp.layout` holds this
arithmetic), "dim" is a tensor dim.

A tensor is either

* :data:`REPLICATE` - every SP rank holds the full (global) value,
* :data:`RANK_LOCAL` - inside a mixture-of-experts dispatch, this rank's rows in an order of
  its own (:mod:`.sp_rules.expert_dispatch`), or
* :class:`Shard` - rank ``r`` holds the part of the sequence axis that lies in its base chunk
  ``[r*c, (r+1)*c)``. The sequence axis lives in tensor dim ``dim``, possibly flattened with
  other axes as ``(outer, seq, inner)`` (e.g. ``logits.view(-1, V)`` gives ``outer=B``). A
  tensor sliced on the sequence (``logits[:, :-1]``) keeps its tokens where they are: position
  ``i`` of the tensor is base position ``off + i`` and the axis has ``length`` positions in
  all, so the first and last ranks hold a few fewer. No token is ever dropped or moved.

Every scalar (SymInt) in the rewritten graph keeps its global meaning; only tensor data is
local. Shapes are read from the *global* fake tensors Dynamo recorded in ``node.meta``.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Union

import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.functions import FloorDiv

from autosp._compat import provably_equal
from autosp.layout import chunk_size

__all__ = ["Replicate", "REPLICATE", "RankLocal", "RANK_LOCAL", "Shard", "SizeEmitter", "shape_exprs", "size_expr", "is_polynomial_quotient", "is_tensor", "norm_dim"]


class _Singleton:
    """One instance per class, compared with ``is``."""

    def __new__(cls):
        if cls.__dict__.get("_instance") is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Replicate(_Singleton):
    """Every SP rank holds the full value."""


REPLICATE = Replicate()


class RankLocal(_Singleton):
    """A value computed from this rank's own rows in an order of its own (inside a
    mixture-of-experts dispatch, :mod:`.sp_rules.expert_dispatch`): it has no global meaning,
    so it is neither gathered nor sliced, and only its region reads it."""


RANK_LOCAL = RankLocal()


@dataclass(frozen=True)
class Shard:
    """Sharded on the sequence axis held in tensor dim ``dim`` (see the module docstring).

    ``inner`` is the global size of the axes flattened after the sequence axis into ``dim``
    (1 unless a reshape merged them); ``off`` is the base position of the tensor's position 0
    and ``length`` the number of sequence positions (``s`` for an unsliced activation).
    """

    dim: int
    length: sympy.Expr
    inner: sympy.Expr = sympy.Integer(1)
    off: int = 0

    def with_dim(self, dim: int) -> "Shard":
        return Shard(dim, self.length, self.inner, self.off)

    def same_layout(self, other: "Shard") -> bool:
        return (
            sympy.simplify(self.length - other.length) == 0
            and sympy.simplify(self.inner - other.inner) == 0
            and self.off == other.off
        )


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def hinted_size(size: Any) -> int:
    """A size at the batch it was traced with; a data-dependent size (the rows ``torch.where``
    picks) at its upper bound, 0 when it has none."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    if size.node.hint is not None:
        return int(size.node.hint)
    upper = size.node.shape_env.bound_sympy(size.node.expr).upper
    return int(upper) if upper.is_finite else 0


def hinted_bytes(value: Any) -> int:
    """Bytes of a fake tensor at the sizes of the batch it was traced with."""
    numel = 1
    for size in value.shape:
        numel *= hinted_size(size)
    return numel * value.element_size()


def norm_dim(dim: int, ndim: int) -> int:
    """A tensor dim as a non-negative index."""
    return dim + ndim if dim < 0 else dim


def shape_exprs(t: torch.Tensor) -> list[sympy.Expr]:
    """Global sizes of a fake tensor as sympy expressions, simplified by what the graph's guards
    established (a sequence padded to a multiple of 16 where the length is known to be one: its
    own length, ``Mod(s, 16)`` being 0)."""
    return [size_expr(d) for d in t.shape]


def size_expr(d: Any) -> sympy.Expr:
    """One size (an int or a SymInt) as :func:`shape_exprs` gives it."""
    return _simplified(d) if isinstance(d, torch.SymInt) else sympy.Integer(int(d))


def _simplified(d: torch.SymInt) -> sympy.Expr:
    """A size that is not a polynomial of one symbol but that the guards prove equal to it (a
    sequence padded to a multiple of a chunk where the length is one: its padding is 0) as that
    symbol, else as it is."""
    expr = d.node.expr
    if expr.is_Symbol or expr.is_Integer or len(expr.free_symbols) != 1:
        return expr
    (sym,) = expr.free_symbols
    if expr.is_polynomial(sym):
        return expr
    return _proved_symbol(d, expr, sym)


#: per shape environment, what :func:`_proved_symbol` found (its guards are final when the pass runs)
_PROVED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _proved_symbol(d: torch.SymInt, expr: sympy.Expr, sym: sympy.Symbol) -> sympy.Expr:
    known = _PROVED.setdefault(d.node.shape_env, {})
    if (expr, sym) not in known:
        known[(expr, sym)] = sym if provably_equal(d, sym) else expr
    return known[(expr, sym)]


def is_polynomial_quotient(num: sympy.Expr, den: sympy.Expr) -> sympy.Expr | None:
    """``num / den`` if it is a polynomial (an exact division of sizes), else ``None``."""
    q = sympy.cancel(sympy.sympify(num) / sympy.sympify(den))
    n, d = sympy.fraction(q)
    if d != 1 and not (d.is_Integer and n.is_Integer and n % d == 0):
        return None
    return sympy.expand(q)


class SizeEmitter:
    """Turns size expressions into FX values (ints or nodes) in the graph being built.

    ``chunk`` (the symbol of the base chunk ``c``) maps to a call of
    :func:`~autosp.layout.chunk_size` on the sequence length;
    the global sequence symbol and every other shape symbol map to a SymInt placeholder or to
    a ``size()`` call on a placeholder.
    """

    def __init__(self, graph: fx.Graph, sources: dict[sympy.Symbol, Callable[[], fx.Node]], seq: sympy.Expr, sp_size: int):
        self.graph = graph
        self.sources = sources
        self.seq = seq
        self.sp_size = sp_size
        self.chunk = sympy.Symbol("autosp_chunk", integer=True, positive=True)
        self._cache: dict[Any, Any] = {}

    def emit(self, expr: sympy.Expr) -> Union[int, fx.Node]:
        expr = sympy.expand(sympy.sympify(expr))
        if expr.is_Integer:
            return int(expr)
        key = sympy.srepr(expr)
        if key not in self._cache:
            self._cache[key] = self._emit(expr)
        return self._cache[key]

    def _emit(self, expr: sympy.Expr) -> fx.Node:
        g = self.graph
        if expr == self.chunk:
            return g.call_function(chunk_size, (self.emit(self.seq), self.sp_size))
        if isinstance(expr, sympy.Symbol):
            if expr not in self.sources:
                raise KeyError(f"no graph value provides the size symbol {expr}")
            return self.sources[expr]()
        if isinstance(expr, (sympy.Add, sympy.Mul)):
            fn = operator.add if isinstance(expr, sympy.Add) else operator.mul
            terms = sorted(expr.args, key=lambda a: (not a.is_Integer, sympy.srepr(a)))
            acc: Any = self.emit(terms[0])
            for t in terms[1:]:
                acc = g.call_function(fn, (acc, self.emit(t)))
            return acc
        if isinstance(expr, FloorDiv):
            return g.call_function(operator.floordiv, (self.emit(expr.args[0]), self.emit(expr.args[1])))
        if isinstance(expr, sympy.Pow) and expr.exp.is_Integer and expr.exp > 0:
            acc = self.emit(expr.base)
            for _ in range(int(expr.exp) - 1):
                acc = g.call_function(operator.mul, (acc, self.emit(expr.base)))
            return acc
        raise NotImplementedError(f"cannot emit the size expression {expr}")
