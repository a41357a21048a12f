"""Attention over tiles of (query rows x key columns), with the mask evaluated as a function per tile.

A mask a model builds for attention - causal, padding, packed documents, sliding windows, ALiBi
biases, soft-capping - is index arithmetic broadcast to ``S x S``: comparisons of positions,
document ids and windows. :func:`tiled_attention` never materialises it. It receives the
*score program*: the ops that turn the raw scores ``s = q @ k^T`` of a tile into the logits the
softmax reads (``s * scale`` plus the mask, ``where(keep, s * scale, -inf)``, ``tanh(s * scale /
c) * c + mask`` ...), written as a small list of torch calls (JSON, see :class:`ScoreProgram`),
and the program's *leaves*: tensors with at most one sequence axis (positions ``[.., S, 1]`` and
``[.., 1, S]``, a padding mask ``[B, 1, 1, S]``, document ids, per-head slopes), which are
sliced per tile. The SP pass extracts program and leaves from the graph the model traced
(:mod:`autosp.passes.sp_rules.score_program`).

Three ops:

* :func:`live_tiles` - which tiles may hold an unmasked logit (above :data:`MASKED`, i.e. not
  ``-inf`` nor a dtype's ``finfo.min``), with the scores left out (``s = 0``: the mask terms
  alone). It evaluates the program once in interval arithmetic, on each leaf's bounds over every
  tile of the grid (:data:`_INTERVAL_RULES`): ``O((S / tile)^2)`` work, conservative, so exact
  (a tile it cannot prove masked is computed, and masked logits contribute nothing). A program
  with an op it has no bounds for is evaluated element by element instead. The map depends on the
  mask alone: the SP pass emits it once for every attention that reads the same mask.
* :func:`tiled_attention` - per query block, an online softmax over its live key tiles (fp32
  running max, sum and output, ``exp`` rescaling). It returns the output and, per query row, the
  running max ``m`` and sum ``l``.
* :func:`tiled_attention_backward` - each live tile recomputed (``p = exp(z - m) / l``) with the
  derivative ``dz/ds`` of the program, which is element-wise in ``s`` (scaling, soft-capping
  ``tanh``, masks added or filled in): the interpreter carries it along with the values
  (forward-mode, :data:`TANGENT_RULES`). Leaves get no gradient (the pass keeps the dense path
  for a mask or bias that needs one).

Nothing larger than one tile of ``[B, H, tile, tile]`` exists at a time, forward or backward.
Rows whose every key is masked are what dense attention makes of them: with ``-inf`` (or a bool
mask) SDPA's output 0 and no gradient; with a finite fill such as ``finfo.min`` a softmax over
the fill values (such a row's block is computed over every tile, forward and backward). The ops
compute in fp32 and return the output in the program's ``out_dtype`` (fp64 inputs: in fp64).

The ops live in their own namespace (``autosp_attn``): the memory report and SAC count every
``autosp::`` op as a collective; :mod:`~autosp.passes.accounting` counts these as
attention.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import operator
import pathlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

__all__ = ["attend", "tiled_attention", "tiled_attention_backward", "live_tiles", "ScoreProgram", "MASKED", "DEFAULT_TILE", "TILE_COUNTS", "workspace_bytes"]

#: key tiles the mask is evaluated over at once to find the ones it covers whole
PROBE_TILES = 8
#: the entries of :func:`live_tiles`' map: a tile to compute, and one to compute without its bias (0 there)
LIVE, LIVE_NO_BIAS = 1, 2
#: logits at or below this contribute nothing to a softmax whose row holds any real score
#: (``exp(-1e30 - m)`` is 0 in fp32): such entries are masked, and tiles holding only them are skipped
MASKED = -1e30
#: query rows and key columns per tile on CPU (one tile of fp32 scores for 8 heads: 8 MiB)
DEFAULT_TILE = 512


#: tiles the forward computed and skipped in this process so far (read by the tests and benchmarks)
TILE_COUNTS = {"computed": 0, "skipped": 0}
#: this file's hash, part of every score program: a graph compiled (and cached by inductor) for
#: another version of the kernel - with other output layouts, say - is not reused
KERNEL_VERSION = hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()[:16]


def workspace_bytes(q_shape: tuple, kv_shape: tuple, dtype: torch.dtype, tile: int, backward: bool) -> int:
    """Bytes :func:`tiled_attention` (``backward``: its backward) allocates while it runs, beyond
    its inputs and outputs (what a memory model adds at the op): a few ``[B, Hq, tile, tile]``
    tiles (scores, logits, probabilities, their gradient) and one query block's running sums, in
    the compute dtype (fp32, fp64 for fp64 inputs); backward also the fp32 accumulators of the
    key and value gradients over the whole sequence when the inputs are in a lower precision."""
    B, Hq, S, D = q_shape
    item = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    t = min(tile, int(S))
    tiles = (6 if backward else 4) * B * Hq * t * t * item
    block = 3 * B * Hq * t * D * item
    acc = 2 * math.prod(kv_shape) * item if backward and item != torch.empty((), dtype=dtype).element_size() else 0
    return tiles + block + acc


def probe_bytes(batch: int, heads: int, seq_len: int, tile: int) -> int:
    """Bytes :func:`live_tiles` allocates while it runs: the mask of one query block over
    :data:`PROBE_TILES` key tiles, as fp32 logits (an upper bound: a mask without heads is smaller)."""
    t = min(tile, int(seq_len))
    return 2 * batch * heads * t * min(PROBE_TILES * t, int(seq_len)) * 4


# --------------------------------------------------------------------------- the score program
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


# --------------------------------------------------------------------------- the kernel
def _tiles(n: int, t: int) -> list[tuple[int, int]]:
    return [(i, min(i + t, n)) for i in range(0, n, t)]


def _positions(prog: ScoreProgram, q0: int, q1: int, k0: int, k1: int, device: torch.device) -> Optional[tuple]:
    if not prog.uses_positions:
        return None
    return torch.arange(q0, q1, device=device)[:, None], torch.arange(k0, k1, device=device)[None, :]


_ZERO = torch.zeros(())


def _probe_block(prog: ScoreProgram, leaves: list, q0: int, q1: int, S: int, tile: int, device: torch.device) -> list[bool]:
    """Per key tile, whether the mask leaves any logit of query rows ``[q0, q1)`` unmasked: the
    program evaluated element by element with ``s = 0`` (the mask terms alone, whatever the
    scores), over :data:`PROBE_TILES` tiles of columns at a time (programs without interval rules)."""
    live: list[bool] = []
    chunk = tile * PROBE_TILES
    for c0 in range(0, S, chunk):
        c1 = min(c0 + chunk, S)
        n = -(-(c1 - c0) // tile)
        probe = prog.evaluate(_ZERO, prog.leaf_tiles(leaves, q0, q1, c0, c1), _positions(prog, q0, q1, c0, c1, device))
        alive = torch.as_tensor(probe > MASKED)
        cols = alive.reshape(-1, alive.shape[-1]).any(0) if alive.dim() else alive.reshape(1)  # [C] or [1]: any row, head, batch
        if cols.numel() == 1:
            live += [bool(cols)] * n
        else:
            padded = torch.cat([cols, cols.new_zeros(n * tile - (c1 - c0))]) if n * tile > c1 - c0 else cols
            live += padded.view(n, tile).any(1).tolist()
    return live


# --------------------------------------------------------------------------- the map of live tiles
class _NoIntervalRule(Exception):
    pass


@dataclass
class _Interval:
    """Bounds of a value over each tile of the grid: ``lo <= x <= hi`` (for bools, ``lo``: true
    everywhere in the tile, ``hi``: true somewhere)."""

    lo: Any
    hi: Any


def _bounds(x: Any) -> _Interval:
    return x if isinstance(x, _Interval) else _Interval(x, x)


def _tile_bounds(leaf: torch.Tensor, axes: tuple, tile: int) -> _Interval:
    """``leaf``'s bounds over each tile: its query and key axes reduced to ``ceil(S/tile)`` blocks."""
    lo = hi = leaf
    for dim in (d for d in axes if d is not None and leaf.shape[d] != 1):
        n = leaf.shape[dim]
        blocks = -(-n // tile)

        def blocked(x: torch.Tensor, dim: int = dim) -> torch.Tensor:
            x = x.movedim(dim, -1)
            if blocks * tile > n:  # the last block padded with its own last value: the bounds do not move
                x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], blocks * tile - n)], dim=-1)
            return x.reshape(*x.shape[:-1], blocks, tile)

        lo = blocked(lo).amin(-1).movedim(-1, dim) if lo.dtype != torch.bool else blocked(lo).all(-1).movedim(-1, dim)
        hi = blocked(hi).amax(-1).movedim(-1, dim) if hi.dtype != torch.bool else blocked(hi).any(-1).movedim(-1, dim)
    return _Interval(lo, hi)


def _cmp(name: str, a: _Interval, b: _Interval) -> _Interval:
    if name in ("gt", "__gt__"):
        return _cmp("lt", b, a)
    if name in ("ge", "__ge__"):
        return _cmp("le", b, a)
    if name in ("lt", "__lt__"):
        return _Interval(a.hi < b.lo, a.lo < b.hi)
    if name in ("le", "__le__"):
        return _Interval(a.hi <= b.lo, a.lo <= b.hi)
    point = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
    overlap = (a.lo <= b.hi) & (b.lo <= a.hi)
    if name in ("eq", "__eq__"):
        return _Interval(point, overlap)
    return _Interval(~overlap, ~point)  # ne


def _mul(a: _Interval, b: _Interval) -> _Interval:
    products = [a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi]
    lo, hi = products[0], products[0]
    for p in products[1:]:
        lo, hi = torch.minimum(torch.as_tensor(lo), torch.as_tensor(p)), torch.maximum(torch.as_tensor(hi), torch.as_tensor(p))
    return _Interval(lo, hi)


def _where(c: _Interval, a: _Interval, b: _Interval) -> _Interval:
    lo = torch.where(c.lo, a.lo, torch.where(c.hi, torch.minimum(torch.as_tensor(a.lo), torch.as_tensor(b.lo)), b.lo))
    hi = torch.where(c.lo, a.hi, torch.where(c.hi, torch.maximum(torch.as_tensor(a.hi), torch.as_tensor(b.hi)), b.hi))
    return _Interval(lo, hi)


def _monotone(fn: Any) -> Any:
    return lambda a: _Interval(fn(torch.as_tensor(a.lo)), fn(torch.as_tensor(a.hi)))


#: bounds of an op's result from its arguments' bounds, per op name (of the program's torch calls)
_INTERVAL_RULES: dict[str, Any] = {
    **{n: (lambda n: lambda a, b: _cmp(n, a, b))(n) for n in (
        "lt", "le", "gt", "ge", "eq", "ne", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__")},
    **dict.fromkeys(("and_", "logical_and", "bitwise_and", "__and__"), lambda a, b: _Interval(a.lo & b.lo, a.hi & b.hi)),
    **dict.fromkeys(("or_", "logical_or", "bitwise_or", "__or__"), lambda a, b: _Interval(a.lo | b.lo, a.hi | b.hi)),
    **dict.fromkeys(("invert", "not_", "logical_not", "bitwise_not", "__invert__"), lambda a: _Interval(~torch.as_tensor(a.hi), ~torch.as_tensor(a.lo))),
    **dict.fromkeys(("add", "__add__", "__radd__"), lambda a, b: _Interval(a.lo + b.lo, a.hi + b.hi)),
    **dict.fromkeys(("sub", "__sub__"), lambda a, b: _Interval(a.lo - b.hi, a.hi - b.lo)),
    **dict.fromkeys(("rsub", "__rsub__"), lambda a, b: _Interval(b.lo - a.hi, b.hi - a.lo)),
    **dict.fromkeys(("neg", "__neg__"), lambda a: _Interval(-a.hi, -a.lo)),
    "pos": lambda a: a,
    **dict.fromkeys(("mul", "__mul__", "__rmul__"), _mul),
    "where": _where,
    "masked_fill": lambda x, mask, value: _where(mask, value, x),
    **{n: _monotone(getattr(torch, n)) for n in ("tanh", "exp", "sigmoid")},
}


def _grid(x: Any, nq: int, nk: int, reduce: str) -> torch.Tensor:
    """A per-tile bool over the grid ``[nq, nk]``, reduced over batch and heads (``"any"``/``"all"``)."""
    x = torch.as_tensor(x)
    x = x.reshape((1,) * max(0, 2 - x.dim()) + tuple(x.shape))
    if x.dim() > 2:
        x = getattr(x.flatten(0, -3), reduce)(0)
    return x.expand(nq, nk)


def _interval_live(prog: ScoreProgram, leaves: list, tile: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``[ceil(q_len/tile), ceil(kv_len/tile)]`` (int8): :data:`LIVE` for the tiles whose logits may be
    unmasked - the program evaluated once, on bounds over each tile (an interval per tile of the
    grid) - and :data:`LIVE_NO_BIAS` for those among them where an additive program's bias is 0
    everywhere (the tile is then computed without a mask). A tile it cannot prove masked is live:
    computing a tile the mask covers changes nothing. Raises :class:`_NoIntervalRule` for an op
    without bounds."""
    regs: list[Any] = []
    bounds = [_tile_bounds(leaf, axes, tile) for leaf, axes in zip(leaves, prog.leaf_axes)]
    nq, nk = -(-q_len // tile), -(-kv_len // tile)
    for kind, name, args, kwargs, dep in prog.instructions:
        a = [_resolve(x, regs, bounds, _Interval(_ZERO, _ZERO)) for x in args]
        if kwargs:
            raise _NoIntervalRule(name)
        if dep and prog.heads is not None:
            a = [_Interval(prog._rank_heads(x.lo), prog._rank_heads(x.hi)) if isinstance(x, _Interval) else x for x in a]
        if kind == "special":
            value = _interval_special(name, a, tile, nq, nk, device)
        elif name in _INTERVAL_RULES:
            value = _INTERVAL_RULES[name](*[_bounds(x) for x in a])
        else:
            raise _NoIntervalRule(name)
        regs.append(value)
    out = _bounds(_resolve(prog.out, regs, bounds, _Interval(_ZERO, _ZERO)))
    live = _grid(out.hi > MASKED, nq, nk, "any").to(torch.int8)
    if prog.additive is not None:  # the bias's bounds: 0 everywhere in the tile, for every batch and head?
        bias = _Interval(_ZERO, _ZERO)
        for op, *a in prog.additive[1]:
            x = _bounds(_resolve(a[0], regs, bounds, None))
            if prog.heads is not None:
                x = _Interval(prog._rank_heads(x.lo), prog._rank_heads(x.hi))
            if op == "add":
                bias = _INTERVAL_RULES["add"](bias, x)
            elif op == "sub":
                bias = _INTERVAL_RULES["sub"](bias, x)
            elif op == "keep":
                bias = _where(x, bias, _bounds(torch.tensor(a[1])))
            else:
                bias = _where(x, _bounds(torch.tensor(a[1])), bias)
        zero = _grid((torch.as_tensor(bias.lo) == 0) & (torch.as_tensor(bias.hi) == 0), nq, nk, "all")
        live = torch.where(zero & (live > 0), LIVE_NO_BIAS, live)
    return live.to(device)


def _interval_special(name: str, a: list, tile: int, nq: int, nk: int, device: torch.device) -> _Interval:
    if name == "to":
        x, dtype = _bounds(a[0]), a[1]
        return _Interval(torch.as_tensor(x.lo).to(dtype), torch.as_tensor(x.hi).to(dtype))
    if name == "const":
        return _bounds(ScoreProgram._special(name, a, None))
    if name in ("tril", "triu"):  # kv - q <= k (>= k) over the tile's rows and columns
        x, k = _bounds(a[0]), a[1]
        q = _Interval(torch.arange(nq, device=device)[:, None] * tile, (torch.arange(nq, device=device)[:, None] + 1) * tile - 1)
        kv = _Interval(torch.arange(nk, device=device)[None, :] * tile, (torch.arange(nk, device=device)[None, :] + 1) * tile - 1)
        d = _INTERVAL_RULES["sub"](kv, q)
        keep = _cmp("le", d, _bounds(torch.tensor(k))) if name == "tril" else _cmp("ge", d, _bounds(torch.tensor(k)))
        zero = _bounds(torch.zeros((), dtype=torch.as_tensor(x.lo).dtype))
        return _where(keep, x, zero)
    if name in ("expand_lead", "reshape_lead", "index"):
        x = _bounds(a[0])
        return _Interval(*(ScoreProgram._special(name, [torch.as_tensor(v), *a[1:]], None) for v in (x.lo, x.hi)))
    raise _NoIntervalRule(name)


@torch.library.custom_op("autosp_attn::live_tiles", mutates_args=())
def live_tiles(leaves: list[torch.Tensor], program: str, tile: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """``[ceil(q_len/tile), ceil(kv_len/tile)]`` (int8): the tiles of (query rows x key columns)
    :func:`tiled_attention` computes (nonzero) - those whose logits the score program's mask may
    leave unmasked, from the program's bounds over each tile (:func:`_interval_live`, which also
    marks the tiles where a bias is 0 throughout), or element by element for a program with an op
    interval arithmetic does not cover. It depends on the mask alone: the SP pass computes it once
    for the attention calls that share a mask."""
    prog = ScoreProgram.parse(program)
    with torch.no_grad():
        try:
            return _interval_live(prog, leaves, tile, q_len, kv_len, device).clone()
        except _NoIntervalRule:
            out = torch.zeros((-(-q_len // tile), -(-kv_len // tile)), dtype=torch.int8)
            for i, (q0, q1) in enumerate(_tiles(q_len, tile)):
                out[i] = torch.tensor(_probe_block(prog, leaves, q0, q1, kv_len, tile, device), dtype=torch.int8)
            return out.to(device)


@live_tiles.register_fake
def _(leaves, program, tile, q_len, kv_len, device):
    return torch.empty(((q_len + tile - 1) // tile, (kv_len + tile - 1) // tile), dtype=torch.int8, device=device)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, t, D]`` -> ``[B, Hk, (Hq/Hk)*t, D]``: query head ``i`` next to KV head ``i // (Hq/Hk)``."""
    B, Hq, t, D = x.shape
    return x.reshape(B, kv_heads, (Hq // kv_heads) * t, D)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """What the kernel computes in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _key_tiles(prog, leaves, q0, q1, S, tile, cols, device):
    """Key tiles ``cols`` of query rows ``[q0, q1)``: ``j``, ``[k0, k1)``, the leaves cut to the tile and its positions."""
    for j in cols:
        k0, k1 = j * tile, min((j + 1) * tile, S)
        yield j, k0, k1, prog.leaf_tiles(leaves, q0, q1, k0, k1), _positions(prog, q0, q1, k0, k1, device)


def _forward_block(prog, qg, k, v, leaves, q0, q1, tile, cols, shape):
    """Online softmax of query rows ``[q0, q1)`` over the key tiles ``cols``: ``(m, l, acc)``."""
    B, Hq, Hk, S, Dv = shape
    tq = q1 - q0
    acc_dtype = qg.dtype
    m = torch.full((B, Hq, tq), -math.inf, dtype=acc_dtype, device=qg.device)
    l = torch.zeros((B, Hq, tq), dtype=acc_dtype, device=qg.device)
    acc = torch.zeros((B, Hq, tq, Dv), dtype=acc_dtype, device=qg.device)
    for _, k0, k1, leaves_t, positions in _key_tiles(prog, leaves, q0, q1, S, tile, cols, qg.device):
        tk = k1 - k0
        kb = k[:, :, k0:k1].to(acc_dtype)
        s = (qg @ kb.transpose(-1, -2)).view(B, Hq, tq, tk)  # [B, Hq, tq, tk]
        z = prog.evaluate(s, leaves_t, positions).to(acc_dtype).expand(B, Hq, tq, tk)
        m_new = torch.maximum(m, z.amax(-1))
        m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
        p = torch.exp(z - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(-1)
        pv = (p.reshape(B, Hk, -1, tk) @ v[:, :, k0:k1].to(acc_dtype)).view(B, Hq, tq, Dv)
        acc = acc * alpha[..., None] + pv
        m = m_new
    return m, l, acc


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _fused(prog: ScoreProgram, q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the tiles run in PyTorch's fused CPU attention kernel: an additive program on CPU
    tensors (the kernel takes the bias as its mask and returns the log-sum-exp) whose values have
    the queries' head size (not DeepSeek's MLA, say)."""
    return prog.additive is not None and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]


def _fused_forward_block(prog, q_blk, k, v, leaves, q0, q1, tile, cols, no_bias, acc_dtype):
    """Query rows ``[q0, q1)`` over the key tiles ``cols``, each tile in the fused kernel with its
    bias as the mask (none for the tiles in ``no_bias``), merged by their log-sum-exps:
    ``(lse, out)``. A row with no unmasked key in a tile gets ``-inf`` there (the kernel reports 0)."""
    B, Hq, tq, _ = q_blk.shape
    out = torch.zeros((B, Hq, tq, v.shape[-1]), dtype=acc_dtype, device=q_blk.device)
    lse = torch.full((B, Hq, tq), -math.inf, dtype=acc_dtype, device=q_blk.device)
    scale = prog.additive[0]
    for j, k0, k1, leaves_t, positions in _key_tiles(prog, leaves, q0, q1, k.shape[2], tile, cols, q_blk.device):
        bias = None if j in no_bias else prog.bias(leaves_t, positions, q_blk.dtype)
        o, l = _FLASH(q_blk, k[:, :, k0:k1], v[:, :, k0:k1], attn_mask=bias, scale=scale)
        l = l.to(acc_dtype)
        if bias is not None:
            l = torch.where((bias > MASKED).any(-1), l, -math.inf)
        new = torch.logaddexp(lse, l)
        safe = new.masked_fill(new == -math.inf, 0.0)
        out = out * torch.exp(lse - safe)[..., None] + o.to(acc_dtype) * torch.exp(l - safe)[..., None]
        lse = new
    return lse, out


def _fused_backward_block(prog, grad_blk, q_blk, out_blk, lse, k, v, leaves, q0, q1, tile, cols, no_bias, dk, dv):
    """The gradients of query rows ``[q0, q1)`` (returned) and their key tiles ``cols`` (added to
    ``dk``, ``dv``): each tile's backward in the fused kernel, with the rows' global output and
    log-sum-exp."""
    scale = prog.additive[0]
    dq = torch.zeros(q_blk.shape, dtype=dk.dtype, device=q_blk.device)
    for j, k0, k1, leaves_t, positions in _key_tiles(prog, leaves, q0, q1, k.shape[2], tile, cols, q_blk.device):
        bias = None if j in no_bias else prog.bias(leaves_t, positions, q_blk.dtype)
        gq, gk, gv = _FLASH_BACKWARD(grad_blk, q_blk, k[:, :, k0:k1], v[:, :, k0:k1], out_blk, lse, 0.0, False, attn_mask=bias, scale=scale)
        dq += gq
        dk[:, :, k0:k1] += gk
        dv[:, :, k0:k1] += gv
    return dq


def _heads_inside(like: torch.Tensor, shape: tuple, dtype: Optional[torch.dtype] = None, zero: bool = False) -> torch.Tensor:
    """A new ``[B, H, S, D]`` tensor laid out as ``[B, S, H, D]`` (a transposed view), as the SP
    pass's exchanges read attention's inputs and outputs: its transpose is contiguous."""
    B, H, S, D = shape
    make = like.new_zeros if zero else like.new_empty
    return make((B, S, H, D), dtype=dtype or like.dtype).transpose(1, 2)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"tiled_attention expects [B, H, S, D] q, k, v; got {list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"tiled_attention: heads q {q.shape[1]}, k {k.shape[1]}, v {v.shape[1]} do not group")


@torch.library.custom_op("autosp_attn::tiled_attention", mutates_args=())
def tiled_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list[torch.Tensor], live: torch.Tensor, program: str, tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, m, l)``: ``softmax(z) @ v`` with ``z`` the score program's logits of ``q @ k^T``
    (q ``[B, Hq, Sq, D]``; k, v ``[B, Hk, S, D]`` with ``Hq`` a multiple of ``Hk``: query head
    ``i`` reads KV head ``i // (Hq/Hk)``), computed ``tile`` rows by ``tile`` columns at a time,
    over the tiles :func:`live_tiles` marks (``live``); ``m``, ``l`` ``[B, Hq, Sq]`` (fp32) are
    each row's max logit and softmax denominator (see the module docstring)."""
    _check(q, k, v)
    prog = ScoreProgram.parse(program)
    B, Hq, Sq, _ = q.shape
    Hk, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    shape = (B, Hq, Hk, S, Dv)
    out = _heads_inside(q, (B, Hq, Sq, Dv), prog.out_dtype)
    acc_dtype = _acc_dtype(q)
    m_all = torch.empty((B, Hq, Sq), dtype=acc_dtype, device=q.device)
    l_all = torch.empty((B, Hq, Sq), dtype=acc_dtype, device=q.device)
    rows = live.tolist()
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        fused = _fused(prog, q, v)
        for i, (q0, q1) in enumerate(_tiles(Sq, tile)):
            cols = [j for j, alive in enumerate(rows[i]) if alive]
            m = None
            if fused:
                no_bias = {j for j, alive in enumerate(rows[i]) if alive == LIVE_NO_BIAS}
                m, acc = _fused_forward_block(prog, q[:, :, q0:q1], k, v, leaves, q0, q1, tile, cols, no_bias, acc_dtype)
                l = torch.ones_like(m)
            if m is None or bool((m <= MASKED).any()):  # a row with no key left: every tile, as dense attention
                qg = _grouped(q[:, :, q0:q1].to(acc_dtype), Hk)
                cols = cols if m is None else list(range(len(rows[i])))
                m, l, acc = _forward_block(prog, qg, k, v, leaves, q0, q1, tile, cols, shape)
                if len(cols) < len(rows[i]) and bool((m <= MASKED).any()):
                    cols = list(range(len(rows[i])))
                    m, l, acc = _forward_block(prog, qg, k, v, leaves, q0, q1, tile, cols, shape)
            TILE_COUNTS["computed"] += len(cols)
            TILE_COUNTS["skipped"] += len(rows[i]) - len(cols)
            dead = m == -math.inf  # every logit -inf (a bool mask): output 0, no gradient (SDPA's rule)
            res = acc / l[..., None]
            if bool(dead.any()):
                res = res.masked_fill(dead[..., None], 0.0)
                m = m.masked_fill(dead, math.inf)
                l = l.masked_fill(dead, 1.0)
            out[:, :, q0:q1] = res.to(out.dtype)
            m_all[:, :, q0:q1] = m
            l_all[:, :, q0:q1] = l
    return out, m_all, l_all


@tiled_attention.register_fake
def _(q, k, v, leaves, live, program, tile):
    prog = ScoreProgram.parse(program)
    B, Hq, Sq, _ = q.shape
    acc_dtype = _acc_dtype(q)
    return (
        _heads_inside(q, (B, Hq, Sq, v.shape[-1]), prog.out_dtype),
        q.new_empty((B, Hq, Sq), dtype=acc_dtype),
        q.new_empty((B, Hq, Sq), dtype=acc_dtype),
    )


@torch.library.custom_op("autosp_attn::tiled_attention_backward", mutates_args=())
def tiled_attention_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, m: torch.Tensor,
    l: torch.Tensor, live: torch.Tensor, leaves: list[torch.Tensor], program: str, tile: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`tiled_attention`: the tiles the forward computed (``live``), recomputed."""
    prog = ScoreProgram.parse(program)
    B, Hq, Sq, D = q.shape
    Hk, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    acc = _acc_dtype(q)
    dq = _heads_inside(q, tuple(q.shape))
    dk = _heads_inside(k, tuple(k.shape), acc, zero=True)
    dv = _heads_inside(v, tuple(v.shape), acc, zero=True)
    live_tiles = live.tolist()
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)  # [B, Hq, Sq]
        for i, (q0, q1) in enumerate(_tiles(Sq, tile)):
            tq = q1 - q0
            qg = _grouped(q[:, :, q0:q1].to(acc), Hk)  # [B, Hk, r*tq, D]
            dog = _grouped(grad_out[:, :, q0:q1].to(acc), Hk)  # [B, Hk, r*tq, Dv]
            mb, inv_l, deltab = m[:, :, q0:q1, None], 1.0 / l[:, :, q0:q1, None], delta[:, :, q0:q1, None]
            dqg = torch.zeros_like(qg)
            if bool(((mb <= MASKED) & (mb > -math.inf)).any()):  # its softmax over the fill values read every tile
                cols = list(range(len(live_tiles[i])))
            else:  # (rows whose every logit is -inf have no gradient: p = 0 wherever they are read)
                cols = [j for j, alive in enumerate(live_tiles[i]) if alive]
                if _fused(prog, q, v):
                    lse = (m[:, :, q0:q1] + torch.log(l[:, :, q0:q1])).to(m.dtype)
                    dq_blk = _fused_backward_block(
                        prog, grad_out[:, :, q0:q1].to(q.dtype), q[:, :, q0:q1], out[:, :, q0:q1].to(q.dtype), lse, k, v, leaves,
                        q0, q1, tile, cols, {j for j, alive in enumerate(live_tiles[i]) if alive == LIVE_NO_BIAS}, dk, dv,
                    )
                    dq[:, :, q0:q1] = dq_blk.to(q.dtype)
                    continue
            for _, k0, k1, leaves_t, positions in _key_tiles(prog, leaves, q0, q1, S, tile, cols, q.device):
                tk = k1 - k0
                kb, vb = k[:, :, k0:k1].to(acc), v[:, :, k0:k1].to(acc)
                s = (qg @ kb.transpose(-1, -2)).view(B, Hq, tq, tk)
                z, dz_ds = prog.evaluate(s, leaves_t, positions, tangent=True)
                p = torch.exp(z.to(acc) - mb) * inv_l  # [B, Hq, tq, tk]
                pg = p.reshape(B, Hk, -1, tk)
                dv[:, :, k0:k1] += pg.transpose(-1, -2) @ dog
                dp = (dog @ vb.transpose(-1, -2)).view(B, Hq, tq, tk)
                ds = (p * (dp - deltab) * dz_ds).reshape(B, Hk, -1, tk)  # dL/ds = dL/dz * dz/ds
                dqg += ds @ kb
                dk[:, :, k0:k1] += ds.transpose(-1, -2) @ qg
            dq[:, :, q0:q1] = dqg.view(B, Hq, tq, D).to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype)  # .to keeps the layout


@tiled_attention_backward.register_fake
def _(grad_out, q, k, v, out, m, l, live, leaves, program, tile):
    return _heads_inside(q, tuple(q.shape)), _heads_inside(k, tuple(k.shape)), _heads_inside(v, tuple(v.shape))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, leaves, live, program, tile = inputs
    out, m, l = output
    ctx.program, ctx.tile, ctx.n_leaves = program, tile, len(leaves)
    ctx.save_for_backward(q, k, v, out, m, l, live, *leaves)


def _backward(ctx, grad_out, _grad_m, _grad_l):
    q, k, v, out, m, l, live, *leaves = ctx.saved_tensors
    dq, dk, dv = tiled_attention_backward(grad_out.contiguous(), q, k, v, out, m, l, live, leaves, ctx.program, ctx.tile)
    return dq, dk, dv, [None] * ctx.n_leaves, None, None, None


tiled_attention.register_autograd(_backward, setup_context=_setup_context)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list[torch.Tensor], program: str, tile: int) -> torch.Tensor:
    """:func:`tiled_attention`'s output over the tiles :func:`live_tiles` finds (differentiable)."""
    live = live_tiles(leaves, program, tile, q.shape[2], k.shape[2], q.device)
    return tiled_attention(q, k, v, leaves, live, program, tile)[0]
