"""Masks as functions: the score program of one attention, read off the single-device graph.

A mask the model builds for attention is a graph of index arithmetic broadcast to ``S x S``:
positions ``arange(S)[:, None]`` and ``arange(S)[None, :]`` compared (causal, sliding windows),
a padding mask ``[B, S]`` indexed at the keys, document ids compared at the queries and the keys
(packed sequences), a per-head slope times a distance (ALiBi), a ``where`` to ``0``/``finfo.min``.
:class:`ProgramBuilder` walks back from the mask (or, for attention written by hand, from the
logits the softmax reads) and splits that graph in two:

* **region** nodes - tensors whose last two dims both run over the ``S`` positions attention
  splits (``[.., S, S]``): the element-wise ops, broadcasts and conversions between the leaves
  and the mask. They become the instructions of a :class:`~autosp.ops.tiled_attention.ScoreProgram`,
  which :func:`~autosp.ops.tiled_attention.tiled_attention` evaluates per tile, so no
  region node is ever materialised;
* **leaves** - the tensors the region reads that hold at most one sequence axis (``[.., S, 1]``,
  ``[.., 1, S]``, ``[B, 1, 1, S]``, scalars), computed by the graph as it is (replicated, ``O(S)``)
  and sliced per tile by the kernel. A leaf with all the query heads in its head dim (a bias per
  head) is narrowed to the rank's heads - or, when a view in the program changes the number of
  dims (so that a leaf's dim ``-3`` need not be the heads), the kernel narrows each term where it
  meets the scores instead.

A region node modified in place before attention reads it (LitGPT's ``mask = ones(S, S).triu(1);
mask.masked_fill_(mask.bool(), min)``) is what its in-place ops made of it: they join the program
as their out-of-place forms, in order. Anything else between the leaves and the mask - a mask
that arrives as data (a batch input or a buffer of ``S x S``), an op the kernel cannot evaluate
per tile, a write through a view of the mask, a leaf that needs a gradient, a size that depends
on the sequence length - raises :class:`NotAFunction`, and the attention keeps today's dense path
(the caller reports it, with the mask's size).
"""

from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import sympy
import torch
import torch.fx as fx

from autosp.passes.placement import is_tensor, shape_exprs
from autosp.ops.tiled_attention import KERNEL_VERSION, TANGENT_RULES, is_known_call

if TYPE_CHECKING:
    from autosp.passes.rewrite import SPRewrite

__all__ = ["NotAFunction", "ProgramBuilder", "ExtractedProgram", "sdpa_logits", "leaf_values"]

_CONVERT = frozenset({"to", "type", "float", "double", "half", "bfloat16", "bool", "int", "long", "type_as"})
_IDENTITY = frozenset({"contiguous", "clone", "detach"})
_RESHAPE = frozenset({"view", "reshape", "unsqueeze", "squeeze"})
_EXPAND = frozenset({"expand", "expand_as", "broadcast_to"})
_FACTORY = {"ones": 1, "zeros": 0, "ones_like": 1, "zeros_like": 0, "new_ones": 1, "new_zeros": 0}
_FULL = frozenset({"full", "full_like", "new_full"})


class NotAFunction(Exception):
    """The mask cannot be evaluated per tile: ``node`` is where the walk stopped, ``why`` says why."""

    def __init__(self, node: fx.Node, why: str):
        super().__init__(f"{node.name}: {why}")
        self.node, self.why = node, why


@dataclass(frozen=True)
class ExtractedProgram:
    """A score program (JSON for :func:`~autosp.ops.tiled_attention.tiled_attention`) and the
    old-graph nodes of its leaves, in order; ``narrow[j]``: leaf ``j`` holds every query head in
    dim ``-3`` and is narrowed to the rank's heads."""

    text: str
    leaves: tuple[fx.Node, ...]
    narrow: tuple[bool, ...]


def _call_name(node: fx.Node) -> tuple[str, str]:
    """``(kind, name)`` of a call: ``("operator", "le")``, ``("torch", "where")``, ``("method", "to")``."""
    if node.op == "call_method":
        return "method", node.target
    t = node.target
    if t is operator.getitem:
        return "special", "getitem"
    name = getattr(t, "__name__", None)
    if name is not None:
        if getattr(operator, name, None) is t:
            return "operator", name
        if getattr(torch, name, None) is t:
            return "torch", name
        if getattr(torch.Tensor, name, None) is t:
            return "method", name
    return "other", str(getattr(t, "__name__", t))


def _dtype_name(dtype: torch.dtype) -> dict:
    return {"dtype": str(dtype).removeprefix("torch.")}


class ProgramBuilder:
    """Builds the score program of one attention (see the module docstring).

    Args:
        rw: the pass's state (shapes of the old graph, the sequence length it splits).
        heads: the query heads of the attention (a leaf with this many in dim ``-3`` is per head).
        at: the attention node (old graph): in-place writes before it count, later ones do not.
    """

    def __init__(self, rw: "SPRewrite", heads: int, at: fx.Node):
        self.rw, self.seq, self.heads = rw, rw.seq, heads
        self._order = {n: i for i, n in enumerate(rw.gm.graph.nodes)}
        self._at = self._order[at]
        self.instructions: list[dict] = []
        self.leaves: list[fx.Node] = []
        self.leaf_axes: list[tuple[Optional[int], Optional[int]]] = []
        self.narrow: list[bool] = []
        self.seeds: dict[fx.Node, dict] = {}
        self._memo: dict[tuple, dict] = {}
        self._reshaped = False

    # ------------------------------------------------------------------ results
    def emit(self, kind: str, name: str, args: list, kwargs: Optional[dict] = None) -> dict:
        """Append an instruction; returns its reference. It depends on the scores if any argument does."""
        dep = self.depends(args) or self.depends(list((kwargs or {}).values()))
        if dep and name not in TANGENT_RULES:
            raise ValueError(f"internal: {kind}.{name} applied to the scores has no derivative rule")
        self.instructions.append({"kind": kind, "name": name, "args": args, "kwargs": kwargs or {}, "s": dep})
        return {"r": len(self.instructions) - 1}

    def depends(self, value: Any) -> bool:
        """Whether an encoded value reads the scores."""
        if isinstance(value, dict):
            if "s" in value:
                return True
            if "r" in value:
                return self.instructions[value["r"]]["s"]
            return any(self.depends(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(self.depends(v) for v in value)
        return False

    def finish(self, out: dict, out_dtype: torch.dtype) -> ExtractedProgram:
        heads = None
        if self._reshaped:  # leaves' dim -3 need not be the heads: narrow the terms that meet the scores instead
            scheme = self.rw.attention
            heads = [scheme.first_head(self.rw, self.heads), scheme.heads_per_rank(self.rw, self.heads), self.heads]
            self.narrow = [False] * len(self.leaves)
        text = json.dumps({
            "instructions": self.instructions, "out": out, "leaf_axes": self.leaf_axes,
            "out_dtype": str(out_dtype).removeprefix("torch."), "heads": heads, "kernel": KERNEL_VERSION,
        })
        return ExtractedProgram(text, tuple(self.leaves), tuple(self.narrow))

    # ------------------------------------------------------------------ the walk
    def tensor(self, node: fx.Node, at: Optional[int] = None) -> dict:
        """The reference of old node ``node`` (a tensor) as the op at position ``at`` of the old
        graph reads it (default: the attention): a seed, a leaf or an instruction."""
        if node in self.seeds:
            return self.seeds[node]
        at = self._at if at is None else at
        val = self.rw.val(node)
        if not is_tensor(val):
            raise NotAFunction(node, "is not a tensor")
        shape = shape_exprs(val)
        q_full = len(shape) >= 2 and shape[-2] == self.seq
        k_full = len(shape) >= 1 and shape[-1] == self.seq
        writes = [m for m in self.rw.mutations_of(node) if self._order[node] < self._order[m] < at]
        if not (q_full and k_full):
            if any(at <= self._order[m] < self._at for m in self.rw.mutations_of(node)):  # the kernel reads it at attention
                raise NotAFunction(node, "is written in place between its reads and the attention")
            key = (node, "leaf")
            if key not in self._memo:
                self._memo[key] = self._leaf(node, shape, q_full, k_full)
            return self._memo[key]
        key = (node, len(writes))
        if key not in self._memo:
            if writes:  # what the last write before ``at`` made of the value it read
                self._memo[key] = self._written(writes[-1], node, self.tensor(node, self._order[writes[-1]]))
            else:
                self._memo[key] = self._region(node, shape)
        return self._memo[key]

    def _written(self, m: fx.Node, node: fx.Node, ref: dict) -> dict:
        """In-place op ``m`` on ``node`` (whose value before it is ``ref``), as its out-of-place form."""
        name = m.target[:-1] if m.op == "call_method" else None
        if name is None or m.args[0] is not node or not is_known_call("method", name):
            raise NotAFunction(m, f"writes the mask {node.name} in place (`{getattr(m.target, '__name__', m.target)}`)")
        args = [self.arg(a, m) for a in m.args[1:]]
        kwargs = {k: self.arg(v, m) for k, v in m.kwargs.items()}
        return self.emit("method", name, [ref, *args], kwargs)

    def arg(self, a: Any, node: fx.Node) -> Any:
        """An argument of op ``node`` of the region, encoded (tensors walked, read where ``node`` runs)."""
        if isinstance(a, fx.Node):
            val = self.rw.val(a)
            if is_tensor(val):
                return self.tensor(a, self._order[node])
            if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                expr = val.node.expr
                if expr.is_number:
                    return int(expr) if expr.is_Integer else float(expr)
                raise NotAFunction(node, f"uses the size {expr} (a value that changes with the sequence length)")
            if isinstance(val, (int, float, bool)):
                return val
            raise NotAFunction(node, f"reads {a.name}, which is neither a tensor nor a number")
        if isinstance(a, (list, tuple)):
            return [self.arg(x, node) for x in a]
        if isinstance(a, torch.dtype):
            return _dtype_name(a)
        if isinstance(a, (bool, int)) or a is None:
            return a
        if isinstance(a, float):
            return a
        raise NotAFunction(node, f"has an argument {a!r} a tile cannot use")

    def _leaf(self, node: fx.Node, shape: list[sympy.Expr], q_full: bool, k_full: bool) -> dict:
        val = self.rw.val(node)  # (written in place or not: the kernel reads its value when attention runs)
        if val.requires_grad:
            raise NotAFunction(node, "needs a gradient (a learned bias); the kernel gives its leaves none")
        for d, e in enumerate(shape[: max(len(shape) - 2, 0)]):
            if e == self.seq or (e.free_symbols and not e.is_number):
                raise NotAFunction(node, f"has a size {e} in dim {d}; positions must be in its last two dims")
        self.leaves.append(node)
        self.leaf_axes.append((-2 if q_full else None, -1 if k_full else None))
        self.narrow.append(len(shape) >= 3 and self.heads > 1 and shape[-3] == self.heads)
        return {"l": len(self.leaves) - 1}

    def _region(self, node: fx.Node, shape: list[sympy.Expr]) -> dict:
        if node.op not in ("call_function", "call_method"):
            raise NotAFunction(node, "is data of S x S (an input or a buffer), not a function of positions")
        kind, name = _call_name(node)
        args, kwargs = node.args, node.kwargs
        x = args[0] if args else None
        if name in _CONVERT:
            return self._convert(node, x)
        if name in _IDENTITY:
            return self.tensor(x, self._order[node])
        if name in _EXPAND:
            src = self.rw.val(x) if isinstance(x, fx.Node) else None
            self._reshaped |= not is_tensor(src) or src.dim() != len(shape)
            return self.emit("special", "expand_lead", [self.tensor(x, self._order[node]), self._lead(node, shape)])
        if name in _RESHAPE and kind in ("method", "torch"):
            src = shape_exprs(self.rw.val(x)) if isinstance(x, fx.Node) and is_tensor(self.rw.val(x)) else []
            if len(src) < 2 or src[-2:] != shape[-2:]:
                raise NotAFunction(node, f"reshapes {list(src)} into the mask {list(shape)}")
            self._reshaped = True
            return self.emit("special", "reshape_lead", [self.tensor(x, self._order[node]), self._lead(node, shape)])
        if name == "getitem":
            return self._getitem(node, shape)
        if name in _FACTORY or name in _FULL:
            value = _FACTORY.get(name)
            if value is None:  # full(size, v) / full_like(x, v) / x.new_full(size, v)
                value = self.arg(args[1] if len(args) > 1 else kwargs.get("fill_value"), node)
                if not isinstance(value, (int, float, bool)):
                    raise NotAFunction(node, "fills with a value that is not a number")
            return self.emit("special", "const", [value, _dtype_name(self.rw.val(node).dtype)])
        if name in ("tril", "triu"):
            diagonal = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
            if not isinstance(diagonal, int):
                raise NotAFunction(node, f"{name} with diagonal {diagonal!r}")
            return self.emit("special", name, [self.tensor(x, self._order[node]), diagonal])
        if kind in ("operator", "torch", "method") and is_known_call(kind, name):
            enc_args = [self.arg(a, node) for a in args]
            enc_kwargs = {k: self.arg(v, node) for k, v in kwargs.items()}
            if (self.depends(enc_args) or self.depends(list(enc_kwargs.values()))) and name not in TANGENT_RULES:
                raise NotAFunction(node, f"applies `{name}` to the attention scores")
            return self.emit(kind, name, enc_args, enc_kwargs)
        raise NotAFunction(node, f"calls `{name}`, which the tiled attention cannot evaluate per tile")

    def _convert(self, node: fx.Node, x: Any) -> dict:
        """``x.to(...)``, ``x.float()``, ``x.type_as(y)``: only the dtype of the result matters."""
        return self.emit("special", "to", [self.tensor(x, self._order[node]), _dtype_name(self.rw.val(node).dtype)])

    def _lead(self, node: fx.Node, shape: list[sympy.Expr]) -> list[int]:
        lead = shape[:-2]
        if not all(e.is_Integer for e in lead):
            raise NotAFunction(node, f"has leading sizes {list(lead)} that are not fixed")
        return [int(e) for e in lead]

    def _getitem(self, node: fx.Node, shape: list[sympy.Expr]) -> dict:
        """``mask[:, :, :, :S]``, ``mask[None]``: indexing that keeps every position (full slices,
        ``None``, ``...``), the mask unchanged but for inserted dims."""
        x, index = node.args
        items = index if isinstance(index, tuple) else (index,)
        enc: list[Any] = []
        for it in items:
            if it is None:
                enc.append(None)
            elif it is Ellipsis:
                enc.append({"ellipsis": 1})
            elif isinstance(it, slice) and it.start in (None, 0) and it.step in (None, 1):
                enc.append({"slice": 1})
            else:
                raise NotAFunction(node, f"indexes the mask with {it!r}")
        src = shape_exprs(self.rw.val(x)) if isinstance(x, fx.Node) and is_tensor(self.rw.val(x)) else []
        if [e for e in src if e != 1] != [e for e in shape if e != 1] or len(shape) != len(src) + sum(i is None for i in items):
            raise NotAFunction(node, f"cuts the mask {list(src)} to {list(shape)}")
        self._reshaped |= len(shape) != len(src)
        return self.emit("special", "index", [self.tensor(x, self._order[node]), {"tuple": enc}])


def scaled_scores(builder: ProgramBuilder, scale: float) -> dict:
    """The raw scores times ``scale`` (SDPA's logits before its mask)."""
    return builder.emit("operator", "mul", [{"s": 0}, scale])


def sdpa_logits(builder: ProgramBuilder, mask: fx.Node, scale: float) -> dict:
    """SDPA's logits with ``attn_mask=mask``: ``where(mask, s * scale, -inf)`` for a bool mask,
    ``s * scale + mask`` for an additive one."""
    mask_ref = builder.tensor(mask)
    scores = scaled_scores(builder, scale)
    if builder.rw.val(mask).dtype == torch.bool:
        return builder.emit("torch", "where", [mask_ref, scores, -math.inf])
    return builder.emit("operator", "add", [scores, mask_ref])


def leaf_values(rw: "SPRewrite", program: ExtractedProgram, heads: int) -> list[Any]:
    """The leaves' values in the new graph: whole (gathered where split); those holding every
    query head in dim ``-3`` narrowed to this rank's ``heads / sp_size`` (``[.., H, ., .] ->
    [.., H/P, ., .]``)."""
    first, per_rank = rw.attention.first_head(rw, heads), rw.attention.heads_per_rank(rw, heads)
    out = []
    for leaf, narrow in zip(program.leaves, program.narrow):
        value = rw.redistribute.to_replicate(leaf)
        if narrow:
            dim = rw.val(leaf).dim() - 3
            value = rw.graph.call_function(torch.narrow, (value, dim, first, per_rank))
        out.append(value)
    return out
