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
(:mod:`lightning_autosp.passes.sp_rules.score_program`).

Per query block it runs an online softmax over the key tiles (fp32 running max, sum and output,
``exp`` rescaling), and skips a tile whose logits are all masked (at or below :data:`MASKED`,
i.e. ``-inf`` or a dtype's ``finfo.min``) - found by evaluating the program with ``s = 0``
before any matmul. It returns the output and, per query row, the running max ``m`` and sum ``l``;
backward recomputes each tile (``p = exp(z - m) / l``) and the derivative ``dz/ds`` of the
program, which is element-wise in ``s`` (scaling, soft-capping ``tanh``, masks added or filled
in): the interpreter carries it along with the values (forward-mode, :data:`TANGENT_RULES`).
Leaves get no gradient (the pass keeps the dense path for a mask or bias that needs one).
Nothing larger than one tile of ``[B, H, tile, tile]`` exists at a time, forward or backward.

Rows whose every key is masked are what dense attention makes of them: with ``-inf`` (or a bool
mask) SDPA's output 0 and no gradient; with a finite fill such as ``finfo.min`` a softmax over
the fill values (the block is then computed with no tile skipped). The op computes in fp32 and
returns the output in the program's ``out_dtype`` (fp64 inputs: in fp64).

The ops live in their own namespace (``autosp_attn``): the memory report and SAC count every
``autosp::`` op as a collective; :mod:`~lightning_autosp.passes.accounting` counts these as
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

__all__ = ["tiled_attention", "tiled_attention_backward", "ScoreProgram", "MASKED", "DEFAULT_TILE", "TILE_COUNTS", "workspace_bytes"]

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
            uses_positions, tuple(raw["heads"]) if raw.get("heads") else None,
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

    def evaluate(
        self, s: torch.Tensor, leaves: list[torch.Tensor], positions: Optional[tuple], cache: dict, tangent: bool = False
    ) -> Any:
        """The tile's logits, and with ``tangent`` also ``dz/ds`` (``(z, dz_ds)``). ``positions``:
        ``(q_idx [tq, 1], kv_idx [1, tk])`` absolute positions (for ``tril``/``triu``); ``cache``
        keeps the results of instructions that do not depend on ``s`` between evaluations of the
        same tile (the skip probe, then the real scores)."""
        regs: list[Any] = []
        tangents: dict[int, Any] = {}

        one = torch.ones((), dtype=s.dtype, device=s.device)

        def tan(a: Any) -> Any:
            if isinstance(a, dict) and "s" in a:
                return one
            if isinstance(a, dict) and "r" in a:
                return tangents.get(a["r"])
            return None

        def ref(a: Any) -> Any:
            if isinstance(a, dict):
                if "r" in a:
                    return regs[a["r"]]
                if "l" in a:
                    return leaves[a["l"]]
                if "s" in a:
                    return s
                return {k: ref(v) for k, v in a.items()}
            if isinstance(a, list):
                return [ref(v) for v in a]
            if isinstance(a, tuple):
                return tuple(ref(v) for v in a)
            return a

        for i, (kind, name, args, kwargs, dep) in enumerate(self.instructions):
            if not dep and i in cache:
                regs.append(cache[i])
                continue
            a, kw = ref(args), ref(kwargs)
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
            if not dep:
                cache[i] = value
            elif tangent:
                rule = TANGENT_RULES[name]
                tangents[i] = rule(value, *a, *[tan(x) for x in args], **kw)
            regs.append(value)
        z = ref(self.out)
        return (z, tan(self.out)) if tangent else z

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


# --------------------------------------------------------------------------- the kernel
def _tiles(n: int, t: int) -> list[tuple[int, int]]:
    return [(i, min(i + t, n)) for i in range(0, n, t)]


def _positions(prog: ScoreProgram, q0: int, q1: int, k0: int, k1: int, device: torch.device) -> Optional[tuple]:
    if not prog.uses_positions:
        return None
    return torch.arange(q0, q1, device=device)[:, None], torch.arange(k0, k1, device=device)[None, :]


_ZERO = torch.zeros(())


def _all_masked(prog: ScoreProgram, leaves_t: list, positions: Optional[tuple], cache: dict) -> bool:
    """The tile's logits with ``s = 0`` are all masked: the mask terms alone mask it, whatever the scores."""
    probe = prog.evaluate(_ZERO, leaves_t, positions, cache)
    return bool((probe <= MASKED).all())


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, t, D]`` -> ``[B, Hk, (Hq/Hk)*t, D]``: query head ``i`` next to KV head ``i // (Hq/Hk)``."""
    B, Hq, t, D = x.shape
    return x.reshape(B, kv_heads, (Hq // kv_heads) * t, D)


def _acc_dtype(x: torch.Tensor) -> torch.dtype:
    """What the kernel computes in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


def _live_tiles(prog, leaves, q0, q1, S, tile, device, skip, counts):
    """The key tiles ``[k0, k1)`` of query rows ``[q0, q1)`` that the mask does not cover whole
    (every tile without ``skip``), with the leaves cut to the tile, the tile's positions and the
    cache of its mask terms; ``counts`` tallies the tiles computed and skipped."""
    for k0, k1 in _tiles(S, tile):
        leaves_t = prog.leaf_tiles(leaves, q0, q1, k0, k1)
        positions = _positions(prog, q0, q1, k0, k1, device)
        cache: dict = {}
        if skip and _all_masked(prog, leaves_t, positions, cache):
            counts["skipped"] += 1
            continue
        counts["computed"] += 1
        yield k0, k1, leaves_t, positions, cache


def _forward_block(prog, qg, k, v, leaves, q0, q1, tile, skip, shape):
    """Online softmax of query rows ``[q0, q1)`` over the key tiles: ``(m, l, acc, skipped)``."""
    B, Hq, Hk, S, Dv = shape
    tq = q1 - q0
    acc_dtype = qg.dtype
    m = torch.full((B, Hq, tq), -math.inf, dtype=acc_dtype, device=qg.device)
    l = torch.zeros((B, Hq, tq), dtype=acc_dtype, device=qg.device)
    acc = torch.zeros((B, Hq, tq, Dv), dtype=acc_dtype, device=qg.device)
    counts = {"computed": 0, "skipped": 0}
    for k0, k1, leaves_t, positions, cache in _live_tiles(prog, leaves, q0, q1, S, tile, qg.device, skip, counts):
        tk = k1 - k0
        kb = k[:, :, k0:k1].to(acc_dtype)
        s = (qg @ kb.transpose(-1, -2)).view(B, Hq, tq, tk)  # [B, Hq, tq, tk]
        z = prog.evaluate(s, leaves_t, positions, cache).to(acc_dtype).expand(B, Hq, tq, tk)
        m_new = torch.maximum(m, z.amax(-1))
        m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
        p = torch.exp(z - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(-1)
        pv = (p.reshape(B, Hk, -1, tk) @ v[:, :, k0:k1].to(acc_dtype)).view(B, Hq, tq, Dv)
        acc = acc * alpha[..., None] + pv
        m = m_new
    for key, n in counts.items():
        TILE_COUNTS[key] += n
    return m, l, acc, counts["skipped"] > 0


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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list[torch.Tensor], program: str, tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, m, l)``: ``softmax(z) @ v`` with ``z`` the score program's logits of ``q @ k^T``
    (q ``[B, Hq, Sq, D]``; k, v ``[B, Hk, S, D]`` with ``Hq`` a multiple of ``Hk``: query head
    ``i`` reads KV head ``i // (Hq/Hk)``), computed ``tile`` rows by ``tile`` columns at a time;
    ``m``, ``l`` ``[B, Hq, Sq]`` (fp32) are each row's max logit and softmax denominator (see the
    module docstring)."""
    _check(q, k, v)
    prog = ScoreProgram.parse(program)
    B, Hq, Sq, _ = q.shape
    Hk, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    shape = (B, Hq, Hk, S, Dv)
    out = _heads_inside(q, (B, Hq, Sq, Dv), prog.out_dtype)
    acc_dtype = _acc_dtype(q)
    m_all = torch.empty((B, Hq, Sq), dtype=acc_dtype, device=q.device)
    l_all = torch.empty((B, Hq, Sq), dtype=acc_dtype, device=q.device)
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        for q0, q1 in _tiles(Sq, tile):
            qg = _grouped(q[:, :, q0:q1].to(acc_dtype), Hk)
            m, l, acc, skipped = _forward_block(prog, qg, k, v, leaves, q0, q1, tile, True, shape)
            if skipped and bool((m <= MASKED).any()):  # rows with no key left: as dense attention, every tile
                m, l, acc, _ = _forward_block(prog, qg, k, v, leaves, q0, q1, tile, False, shape)
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
def _(q, k, v, leaves, program, tile):
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
    l: torch.Tensor, leaves: list[torch.Tensor], program: str, tile: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`tiled_attention`: every tile the forward did not skip, recomputed."""
    prog = ScoreProgram.parse(program)
    B, Hq, Sq, D = q.shape
    Hk, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    acc = _acc_dtype(q)
    dq = _heads_inside(q, tuple(q.shape))
    dk = _heads_inside(k, tuple(k.shape), acc, zero=True)
    dv = _heads_inside(v, tuple(v.shape), acc, zero=True)
    counts = {"computed": 0, "skipped": 0}  # (the forward's tally is the one reported)
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1)  # [B, Hq, Sq]
        for q0, q1 in _tiles(Sq, tile):
            tq = q1 - q0
            qg = _grouped(q[:, :, q0:q1].to(acc), Hk)  # [B, Hk, r*tq, D]
            dog = _grouped(grad_out[:, :, q0:q1].to(acc), Hk)  # [B, Hk, r*tq, Dv]
            mb, inv_l, deltab = m[:, :, q0:q1, None], 1.0 / l[:, :, q0:q1, None], delta[:, :, q0:q1, None]
            skip = not bool((mb <= MASKED).any())  # a row with no key left read every tile in forward
            dqg = torch.zeros_like(qg)
            for k0, k1, leaves_t, positions, cache in _live_tiles(prog, leaves, q0, q1, S, tile, q.device, skip, counts):
                tk = k1 - k0
                kb, vb = k[:, :, k0:k1].to(acc), v[:, :, k0:k1].to(acc)
                s = (qg @ kb.transpose(-1, -2)).view(B, Hq, tq, tk)
                z, dz_ds = prog.evaluate(s, leaves_t, positions, cache, tangent=True)
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
def _(grad_out, q, k, v, out, m, l, leaves, program, tile):
    return _heads_inside(q, tuple(q.shape)), _heads_inside(k, tuple(k.shape)), _heads_inside(v, tuple(v.shape))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, leaves, program, tile = inputs
    out, m, l = output
    ctx.program, ctx.tile, ctx.n_leaves = program, tile, len(leaves)
    ctx.save_for_backward(q, k, v, out, m, l, *leaves)


def _backward(ctx, grad_out, _grad_m, _grad_l):
    q, k, v, out, m, l, *leaves = ctx.saved_tensors
    dq, dk, dv = tiled_attention_backward(grad_out.contiguous(), q, k, v, out, m, l, leaves, ctx.program, ctx.tile)
    return dq, dk, dv, [None] * ctx.n_leaves, None, None


tiled_attention.register_autograd(_backward, setup_context=_setup_context)
