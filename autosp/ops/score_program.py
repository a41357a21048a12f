"""Score programs: the logits of one tile of attention as a function of its raw scores.

A mask a model builds for attention - causal, padding, packed documents, sliding windows, ALiBi
biases, soft-capping - is index arithmetic broadcast to ``S x S``: comparisons of positions,
document ids and windows. The SP pass extracts it from the traced graph
(:mod:`autosp.passes.sp_rules.score_program`) as a *score program*: the ops that turn the raw
scores ``s = q @ k^T`` of a tile into the logits the softmax reads (``s * scale`` plus the mask,
``where(keep, s * scale, -inf)``, ``tanh(s * scale / c) * c + mask`` ...), written as a small list
of torch calls (JSON, see :class:`ScoreProgram`), and its *leaves*: tensors with at most one
sequence axis (positions ``[.., S, 1]`` and ``[.., 1, S]``, a padding mask ``[B, 1, 1, S]``,
document ids, per-head slopes), which are sliced per tile.

This module evaluates a program on one tile - its logits, their derivative ``dz/ds`` (forward
mode, :data:`TANGENT_RULES`), or the mask terms alone - and recognises the programs whose logits
are ``s * scale + bias`` (:func:`_additive_form`), whose tiles can run in PyTorch's fused kernel.
Positions are absolute: a tile of query rows ``[q0, q1)`` and key columns ``[k0, k1)`` reads the
leaves there, wherever the rows and columns sit in the tensors a kernel holds (a ring step's
blocks are parts of the sequence).
"""

from __future__ import annotations

import functools
import json
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["ScoreProgram", "TANGENT_RULES", "MASKED", "is_known_call", "tile_positions"]

#: logits at or below this contribute nothing to a softmax whose row holds any real score
#: (``exp(-1e30 - m)`` is 0 in fp32): such entries are masked, and tiles holding only them are skipped
MASKED = -1e30

#: functions a program may call (``operator.X`` / ``torch.X``) and methods (``x.X(..)``)
_OPERATOR = frozenset({
    "add", "sub", "mul", "truediv", "floordiv", "mod", "neg", "pos", "abs", "eq", "ne", "lt", "le", "gt", "ge",
    "and_", "or_", "xor", "invert", "not_", "pow",
})
_TORCH = frozenset({
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "neg", "abs", "eq", "ne", "lt", "le",
    "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_not",
    "bitwise_xor", "where", "masked_fill", "tanh", "exp", "log", "sigmoid", "clamp", "clamp_min", "clamp_max", "minimum",
    "maximum", "pow", "square", "sqrt", "rsub", "sign", "signbit", "isin",
})
_METHODS = _TORCH | frozenset({"__and__", "__or__", "__xor__", "__invert__", "__eq__", "__ne__", "__lt__", "__le__",
                               "__gt__", "__ge__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                               "__truediv__", "__rtruediv__", "__neg__"})
#: program-level ops (not torch calls): see :meth:`ScoreProgram._special`
_SPECIAL = frozenset({"to", "const", "tril", "triu", "expand_lead", "reshape_lead", "index"})


def _add(a, b, da, db, sign=1.0):
    if da is None:
        return None if db is None else db * sign
    return da if db is None else da + db * sign


def _mul_rule(y, a, b, da, db):
    out = None
    if da is not None:
        out = da * b
    if db is not None:
        out = db * a if out is None else out + db * a
    return out


def _div_rule(y, a, b, da, db):
    out = None if da is None else da / b
    if db is not None:
        term = -db * y / b
        out = term if out is None else out + term
    return out


#: d(result)/ds of an instruction that depends on the scores ``s``, from its result ``y``, its
#: arguments and their tangents (``None``: zero); the ops a score program may apply to ``s``
TANGENT_RULES: dict[str, Any] = {
    "add": lambda y, a, b, da, db, **_: _add(a, b, da, db),
    "__add__": lambda y, a, b, da, db, **_: _add(a, b, da, db),
    "__radd__": lambda y, a, b, da, db, **_: _add(a, b, da, db),
    "sub": lambda y, a, b, da, db, **_: _add(a, b, da, db, -1.0),
    "__sub__": lambda y, a, b, da, db, **_: _add(a, b, da, db, -1.0),
    "rsub": lambda y, a, b, da, db, **_: _add(b, a, db, da, -1.0),
    "__rsub__": lambda y, a, b, da, db, **_: _add(b, a, db, da, -1.0),
    "mul": _mul_rule, "__mul__": _mul_rule, "__rmul__": _mul_rule,
    "truediv": _div_rule, "div": _div_rule, "true_divide": _div_rule, "__truediv__": _div_rule,
    "neg": lambda y, a, da, **_: -da, "__neg__": lambda y, a, da, **_: -da,
    "pos": lambda y, a, da, **_: da,
    "tanh": lambda y, a, da, **_: da * (1 - y * y),
    "exp": lambda y, a, da, **_: da * y,
    "sigmoid": lambda y, a, da, **_: da * y * (1 - y),
    "where": lambda y, c, a, b, dc, da, db, **_: torch.where(c, 0.0 if da is None else da, 0.0 if db is None else db),
    "masked_fill": lambda y, a, mask, value, da, dmask, dvalue, **_: da.masked_fill(mask, 0.0),
    "to": lambda y, a, dtype, da, ddtype, **_: da,
}


def is_known_call(kind: str, name: str) -> bool:
    """Whether a score program may call ``name`` (``kind``: ``"operator"``, ``"torch"``, ``"method"``)."""
    return name in {"operator": _OPERATOR, "torch": _TORCH, "method": _METHODS, "special": _SPECIAL}.get(kind, ())


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if "dtype" in value:
            return getattr(torch, value["dtype"])
        if "slice" in value:
            return slice(None)
        if "ellipsis" in value:
            return Ellipsis
        if "tuple" in value:
            return tuple(_decode(v) for v in value["tuple"])
        return value  # a reference, resolved when evaluated
    return value


@dataclass(frozen=True)
class ScoreProgram:
    """The logits of one tile as a function of its raw scores ``s`` and the leaves' slices.

    ``instructions``: ``{"kind", "name", "args", "kwargs", "s"}`` each - a call of an allowed
    torch function or method, or a special op - whose arguments are constants, ``{"s": 0}`` (the
    raw scores ``[B, Hq, tq, tk]``, fp32), ``{"l": j}`` (leaf ``j`` cut to the tile) or ``{"r": i}``
    (the result of instruction ``i``); ``"s"`` marks the instructions that depend on the scores.
    ``out``: the reference holding the logits. ``leaf_axes[j]``: ``(q_dim, kv_dim)``, the dims of
    leaf ``j`` (negative, or ``None``) that run over the query rows and the key columns.
    ``out_dtype``: the output's dtype. ``heads``: ``(start, count, total)`` when terms of the
    program may hold every one of ``total`` heads in dim ``-3``: where such a term meets the
    scores (which hold the rank's ``count`` heads from ``start``) it is narrowed to those heads;
    ``None`` when the pass narrowed the leaves instead.
    """

    instructions: tuple
    out: Any
    leaf_axes: tuple
    out_dtype: torch.dtype
    uses_positions: bool
    heads: Optional[tuple] = None
    #: ``(scale, bias_ops)`` when the logits are ``s * scale + bias`` with a bias made of the mask
    #: terms alone (:func:`_additive_form`): then each tile runs in PyTorch's fused attention kernel
    additive: Optional[tuple] = None

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def parse(text: str) -> "ScoreProgram":
        raw = json.loads(text)
        instructions = []
        for ins in raw["instructions"]:
            if not is_known_call(ins["kind"], ins["name"]):
                raise ValueError(f"score program: {ins['kind']}.{ins['name']} is not an allowed op")
            if ins.get("s") and ins["name"] not in TANGENT_RULES:
                raise ValueError(f"score program: {ins['kind']}.{ins['name']} applied to the scores has no derivative rule")
            instructions.append((ins["kind"], ins["name"], _decode(ins["args"]), _decode(ins.get("kwargs", {})), bool(ins.get("s"))))
        uses_positions = any(name in ("tril", "triu") for _, name, *_ in instructions)
        return ScoreProgram(
            tuple(instructions), raw["out"], tuple(tuple(a) for a in raw["leaf_axes"]), getattr(torch, raw["out_dtype"]),
            uses_positions, tuple(raw["heads"]) if raw.get("heads") else None, _additive_form(instructions, raw["out"]),
        )

    # ------------------------------------------------------------------ evaluation
    def leaf_tiles(self, leaves: list[torch.Tensor], q0: int, q1: int, k0: int, k1: int) -> list[torch.Tensor]:
        """Each leaf cut to query rows ``[q0, q1)`` and key columns ``[k0, k1)``."""
        out = []
        for leaf, (qd, kd) in zip(leaves, self.leaf_axes):
            t = leaf
            if qd is not None and t.shape[qd] != 1:
                t = t.narrow(qd, q0, q1 - q0)
            if kd is not None and t.shape[kd] != 1:
                t = t.narrow(kd, k0, k1 - k0)
            out.append(t)
        return out

    def bias(self, leaves: list[torch.Tensor], positions: Optional[tuple], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The tile's ``bias`` of an additive program (``z = s * scale + bias``) in ``dtype``, or
        ``None`` for none: the mask terms alone, evaluated and combined."""
        regs = self.evaluate(None, leaves, positions, terms_only=True)
        bias: Any = None
        for op, *a in self.additive[1]:
            x = self._rank_heads(_resolve(a[0], regs, leaves, None)) if self.heads is not None else _resolve(a[0], regs, leaves, None)
            if op == "add":
                bias = x if bias is None else bias + x
            elif op == "sub":
                bias = -x if bias is None else bias - x
            elif op == "keep":  # where(x, scores, fill)
                bias = torch.where(x, 0.0 if bias is None else bias, a[1])
            else:  # "fill": masked_fill(scores, x, fill)
                bias = torch.where(x, a[1], 0.0 if bias is None else bias)
        if bias is None:
            return None
        bias = torch.as_tensor(bias).to(dtype)
        return bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)) if bias.dim() < 4 else bias  # the fused kernel takes 2-D or 4-D

    def evaluate(
        self, s: Any, leaves: list[torch.Tensor], positions: Optional[tuple], tangent: bool = False, terms_only: bool = False
    ) -> Any:
        """The tile's logits, and with ``tangent`` also ``dz/ds`` (``(z, dz_ds)``). ``positions``:
        ``(q_idx [tq, 1], kv_idx [1, tk])`` absolute positions (for ``tril``/``triu``). With
        ``terms_only``, the results of the instructions that do not read the scores (``None`` for
        the others)."""
        regs: list[Any] = []
        tangents: list[Any] = []
        one = torch.ones((), dtype=s.dtype, device=s.device) if tangent else None
        for kind, name, args, kwargs, dep in self.instructions:
            if dep and terms_only:
                regs.append(None)
                continue
            a, kw = _resolve(args, regs, leaves, s), _resolve(kwargs, regs, leaves, s)
            if dep and self.heads is not None:  # terms of every head meet the rank's scores: their heads
                a = [self._rank_heads(x) for x in a]
            if kind == "operator":
                value = getattr(operator, name)(*a, **kw)
            elif kind == "torch":
                value = getattr(torch, name)(*a, **kw)
            elif kind == "method":
                value = getattr(a[0], name)(*a[1:], **kw)
            else:
                value = self._special(name, a, positions)
            tangents.append(TANGENT_RULES[name](value, *a, *[_tangent(x, tangents, one) for x in args], **kw) if dep and tangent else None)
            regs.append(value)
        if terms_only:
            return regs
        z = _resolve(self.out, regs, leaves, s)
        return (z, _tangent(self.out, tangents, one)) if tangent else z

    def _rank_heads(self, x: Any) -> Any:
        """The rank's heads of a term that holds every head in dim ``-3`` (aligned with the scores)."""
        start, count, total = self.heads
        if isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[-3] == total:
            return x.narrow(x.dim() - 3, start, count)
        return x

    @staticmethod
    def _special(name: str, a: list, positions: Optional[tuple]) -> Any:
        if name == "to":  # a dtype conversion (devices and other tensors' dtypes resolved by the pass)
            x, dtype = a
            return x.to(dtype) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)
        if name == "const":  # a factory of the full S x S (``ones``, ``full``): its value, broadcast
            value, dtype = a
            return torch.tensor(value, dtype=dtype)
        if name in ("tril", "triu"):  # x kept on/below (above) the diagonal ``k``: kv - q <= k (>= k)
            x, k = a
            q_idx, kv_idx = positions
            keep = (kv_idx - q_idx <= k) if name == "tril" else (kv_idx - q_idx >= k)
            return torch.where(keep, x, torch.zeros((), dtype=x.dtype))
        if name == "expand_lead":  # expand(*lead, S, S): the leading sizes, the tile's own last two
            x, lead = a
            if x.dim() < 2:
                x = x.reshape([1] * (2 - x.dim()) + list(x.shape))
            return x.expand(*lead, -1, -1)
        if name == "reshape_lead":  # view(*lead, S, S) of a tensor whose last two dims are the tile's
            x, lead = a
            if x.numel() == 1:  # a constant: it broadcasts
                return x.reshape([1] * (len(lead) + 2))
            return x.reshape(*lead, x.shape[-2], x.shape[-1])
        if name == "index":  # x[...] with full slices, None and Ellipsis only
            x, index = a
            return x[tuple(index)]
        raise ValueError(f"score program: unknown special op {name}")


_MUL, _DIV = ("mul", "__mul__", "__rmul__"), ("truediv", "div", "true_divide", "__truediv__")
_ADD, _SUB = ("add", "__add__", "__radd__"), ("sub", "__sub__")


def _additive_form(instructions: list, out: Any) -> Optional[tuple]:
    """``(scale, bias_ops)`` when the scores enter the logits only as ``s * scale + bias``: scaled by
    numbers first, then terms added or subtracted (``("add", ref)``, ``("sub", ref)``) and masks
    applied with a fill of at most :data:`MASKED` (``("keep", cond, fill)``: ``where(cond, x, fill)``;
    ``("fill", mask, fill)``: ``masked_fill(x, mask, fill)``), dtype conversions aside; else ``None``
    (soft-capping, say)."""
    scale, ops, cur = 1.0, [], {"s": 0}
    number = lambda a: isinstance(a, (int, float)) and not isinstance(a, bool)  # noqa: E731
    for i, (kind, name, args, kwargs, dep) in enumerate(instructions):
        if not dep:
            continue
        if kwargs:
            return None
        a = list(args)
        if name in _MUL and len(a) == 2 and not ops and cur in a and number(a[1 - a.index(cur)]):
            scale *= a[1 - a.index(cur)]
        elif name in _DIV and len(a) == 2 and not ops and a[0] == cur and number(a[1]):
            scale /= a[1]
        elif name in _ADD and len(a) == 2 and cur in a and not _reads(a[1 - a.index(cur)], instructions):
            ops.append(("add", a[1 - a.index(cur)]))
        elif name in _SUB and len(a) == 2 and a[0] == cur and not _reads(a[1], instructions):
            ops.append(("sub", a[1]))
        elif name == "where" and len(a) == 3 and a[1] == cur and number(a[2]) and a[2] <= MASKED and not _reads(a[0], instructions):
            ops.append(("keep", a[0], a[2]))
        elif name == "where" and len(a) == 3 and a[2] == cur and number(a[1]) and a[1] <= MASKED and not _reads(a[0], instructions):
            ops.append(("fill", a[0], a[1]))
        elif name == "masked_fill" and len(a) == 3 and a[0] == cur and number(a[2]) and a[2] <= MASKED and not _reads(a[1], instructions):
            ops.append(("fill", a[1], a[2]))
        elif name == "to" and kind == "special" and a[0] == cur and a[1].is_floating_point:
            pass
        else:
            return None
        cur = {"r": i}
    return (scale, tuple(ops)) if out == cur else None


def _reads(a: Any, instructions: list) -> bool:
    """Whether an encoded argument reads the scores."""
    if isinstance(a, dict):
        return "s" in a or ("r" in a and instructions[a["r"]][4])
    return False


def _resolve(a: Any, regs: list, leaves: list, s: Any) -> Any:
    """An encoded argument with its references replaced by their values (a plain function: a nested,
    recursive one would keep every tile's intermediates alive in a reference cycle until the next
    garbage collection)."""
    if isinstance(a, dict):
        if "r" in a:
            return regs[a["r"]]
        if "l" in a:
            return leaves[a["l"]]
        if "s" in a:
            return s
        return {k: _resolve(v, regs, leaves, s) for k, v in a.items()}
    if isinstance(a, list):
        return [_resolve(v, regs, leaves, s) for v in a]
    if isinstance(a, tuple):
        return tuple(_resolve(v, regs, leaves, s) for v in a)
    return a


def _tangent(a: Any, tangents: list, one: torch.Tensor) -> Any:
    """d(a)/ds of an encoded argument: 1 for the scores, an instruction's tangent, else None (zero)."""
    if isinstance(a, dict) and "s" in a:
        return one
    if isinstance(a, dict) and "r" in a:
        return tangents[a["r"]]
    return None


def tile_positions(prog: ScoreProgram, q0: int, q1: int, k0: int, k1: int, device: torch.device) -> Optional[tuple]:
    """``(q_idx [tq, 1], kv_idx [1, tk])``: the absolute positions of a tile's rows and columns,
    for the programs that read them (``tril``/``triu``); ``None`` for the others."""
    if not prog.uses_positions:
        return None
    return torch.arange(q0, q1, device=device)[:, None], torch.arange(k0, k1, device=device)[None, :]
