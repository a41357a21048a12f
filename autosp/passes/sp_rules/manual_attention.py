"""Attention written by hand - ``softmax(q @ k^T * scale + mask) @ v`` and its variants - rewritten
with the same all-to-alls as ``F.scaled_dot_product_attention`` (:mod:`.attention`).

:func:`find_manual_attention` matches, in the old (single-device) graph, a chain from one matmul
to the next::

    scores = q @ k^T                 # k^T: k.transpose(-2, -1), k.mT or a permute of the last two dims
    ... any number of:               #   scaling (mul / div by a number or a tensor), soft-capping
                                     #   (tanh(x / c) * c), an additive mask or bias (add / sub),
                                     #   masked_fill / where with a mask, softmax or log_softmax over
                                     #   the last dim, dtype conversions, dropout with p=0
    out = probs @ v

with q, k, v laid out ``[B, H, S, D]`` (k and v may have one head, broadcast to every query head,
or be the model's repeat of fewer KV heads) and every value of the chain read only by the next
step. :func:`rewrite_manual_attention` exchanges q, k and v like SDPA's inputs (``[B, H, S/P, D]
-> [B, H/P, S, D]``), runs the chain for this rank's heads - the ``S x S`` scores exist only for
``H/P`` heads - with masks that have a head dim narrowed to those heads, and exchanges the output
back. A chain with anything else between the two matmuls is not matched: the first matmul then
runs replicated (its inputs all-gathered; correct, slower, reported as a fallback).

A chain whose steps before the softmax are a score program (:mod:`.score_program`: scaling,
soft-capping, masks built from positions) and whose steps after it only convert dtypes (or drop
out with ``p=0``) does not even keep the ``S x S`` scores of the rank's heads: it runs in
:func:`~autosp.ops.tiled_attention.tiled_attention`, one tile at a time. Other chains keep
them (reported in :attr:`SPPassStats.dense_masks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import sympy
import torch
import torch.fx as fx

from autosp.errors import AutoSPError
from autosp.passes.placement import is_tensor, norm_dim, shape_exprs
from autosp.passes.sp_rules.attention import (
    _repeat_heads,
    _sequence_local,
    refuse_dense,
    repeated_heads,
    report_dense,
)
from autosp.passes.sp_rules.registry import RuleResult, lookup
from autosp.passes.sp_rules.score_program import ExtractedProgram, NotAFunction, ProgramBuilder

if TYPE_CHECKING:
    from autosp.passes.rewrite import SPRewrite

__all__ = ["ManualAttention", "find_manual_attention", "rewrite_manual_attention"]

#: element-wise steps of the chain (the names :func:`~.registry.lookup` gives)
_ELEMENTWISE = {"mul", "div", "true_divide", "add", "sub", "neg", "tanh", "masked_fill", "where", "clamp"}
#: dtype conversions: only their first argument is data
_CONVERT = {"to", "type_as", "float", "half", "bfloat16", "double", "type", "contiguous"}


@dataclass
class ManualAttention:
    """One matched chain: ``first = q @ k^T``, the ``steps`` after it, ``last = probs @ v``."""

    first: fx.Node
    steps: list[fx.Node]
    last: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    #: ``k^T``, part of the chain when only ``first`` reads it
    kt: Optional[fx.Node] = None

    @property
    def nodes(self) -> list[fx.Node]:
        return [*([self.kt] if self.kt is not None else []), self.first, *self.steps, self.last]


def _shape(n: Any) -> Optional[list[sympy.Expr]]:
    val = n.meta.get("example_value") if isinstance(n, fx.Node) else None
    return shape_exprs(val) if is_tensor(val) else None


def _name(n: fx.Node) -> Optional[str]:
    found = lookup(n) if n.op in ("call_function", "call_method") else None
    return found[0].name if found is not None and not found[0].inplace else None


def _untransposed(kt: Any) -> Optional[fx.Node]:
    """``k`` when ``kt`` is ``k`` with its last two dims swapped."""
    if not isinstance(kt, fx.Node) or not isinstance(kt.args[0] if kt.args else None, fx.Node):
        return None
    k = kt.args[0]
    shape = _shape(k)
    if shape is None:
        return None
    ndim = len(shape)
    last_two = {ndim - 2, ndim - 1}
    if kt.op == "call_function" and kt.target is getattr and kt.args[1:] == ("mT",):
        return k
    if _name(kt) == "mT" and len(kt.args) == 1:  # torch >= 2.15 traces ``k.mT`` as aten.mT
        return k
    name = _name(kt)
    if name in ("transpose", "swapaxes") and len(kt.args) == 3 and not kt.kwargs:
        dims = kt.args[1:]
        return k if all(isinstance(d, int) for d in dims) and {norm_dim(d, ndim) for d in dims} == last_two else None
    if name == "permute" and not kt.kwargs:
        dims = kt.args[1] if len(kt.args) == 2 and isinstance(kt.args[1], (tuple, list)) else kt.args[1:]
        expect = [*range(ndim - 2), ndim - 1, ndim - 2]
        return k if all(isinstance(d, int) for d in dims) and [norm_dim(d, ndim) for d in dims] == expect else None
    return None


def _matmul_args(n: fx.Node) -> Optional[tuple[Any, Any]]:
    if _name(n) != "matmul" or n.kwargs or len(n.args) != 2:
        return None
    return n.args[0], n.args[1]


def _is_step(node: fx.Node, prev: fx.Node, scores: list[sympy.Expr]) -> bool:
    """Whether ``node`` is an allowed step of the chain after ``prev`` (see the module docstring)."""
    name = _name(node)
    if name is None or _shape(node) != scores:
        return False
    if name in _ELEMENTWISE:  # prev is one operand, the others are numbers or tensors from outside the chain
        tensors = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node) and _shape(a) is not None]
        return sum(a is prev for a in tensors) == 1
    if name in _CONVERT:
        return node.args[0] is prev
    if name in ("softmax", "log_softmax"):
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        return node.args[0] is prev and isinstance(dim, int) and norm_dim(dim, len(scores)) == len(scores) - 1
    if name == "dropout":
        bound = dict(zip(("input", "p", "training", "inplace"), node.args))
        bound.update(node.kwargs)
        return bound.get("input") is prev and (bound.get("p", 0.5) == 0 or bound.get("training", True) is False)
    return False


def _match(first: fx.Node) -> Optional[ManualAttention]:
    args = _matmul_args(first)
    if args is None:
        return None
    q, kt = args
    k = _untransposed(kt)
    qs, ks, scores = _shape(q), _shape(k), _shape(first)
    if k is None or qs is None or ks is None or len(qs) < 4 or len(ks) != len(qs):
        return None
    length = qs[-2]
    if not length.free_symbols or ks[-2] != length or scores[-2:] != [length, length]:
        return None
    steps: list[fx.Node] = []
    cur = first
    while True:
        if len(cur.users) != 1:
            return None
        (user,) = cur.users
        mm = _matmul_args(user)
        if mm is not None and mm[0] is cur:
            v = mm[1]
            vs = _shape(v)
            if vs is None or len(vs) != len(qs) or vs[-2] != length:
                return None
            return ManualAttention(first, steps, user, q, k, v, kt if len(kt.users) == 1 else None)
        if not _is_step(user, cur, scores):
            return None
        steps.append(user)
        cur = user


def find_manual_attention(gm: fx.GraphModule) -> list[ManualAttention]:
    """Every hand-written attention chain of ``gm`` (see the module docstring)."""
    return [m for n in gm.graph.nodes if n.op in ("call_function", "call_method") for m in [_match(n)] if m is not None]


def _exchanged(rw: "SPRewrite", attn: ManualAttention, n: fx.Node, heads: int, head_dim: int, seq_dim: int) -> fx.Node:
    """q, k or v as this rank's ``[B, H/P, S, D]`` (or ``[B, 1, S, D]``, a head every query head reads)."""
    n_heads = int(rw.shape(n)[head_dim])
    if n_heads == heads:
        return rw.attention.to_heads(rw, _sequence_local(rw, attn.last, n, seq_dim), heads, head_dim, seq_dim)
    if n_heads == 1:  # broadcast over the query heads: every rank needs it whole
        return rw.redistribute.to_replicate(n)
    raise AutoSPError(f"internal: {n.name} has {n_heads} heads, the query {heads}")


def _side(rw: "SPRewrite", a: Any, scores: list[sympy.Expr], heads: int) -> Any:
    """An operand from outside the chain (a mask, a bias, a scale): whole, narrowed to this rank's
    heads when it has a head dim."""
    if not isinstance(a, fx.Node):
        return a
    shape = _shape(a)
    if shape is None:
        return rw.new(a)
    rw.record_mask_inputs([a])
    full = rw.redistribute.to_replicate(a)
    head_dim = len(shape) - 3
    if head_dim >= 0 and shape[head_dim] != 1:
        if shape[head_dim] != heads:
            raise AutoSPError(f"internal: {a.name} {shape} does not broadcast against the scores {scores}")
        first, per_rank = rw.attention.first_head(rw, heads), rw.attention.heads_per_rank(rw, heads)
        full = rw.graph.call_function(torch.narrow, (full, head_dim, first, per_rank))
    return full


def rewrite_manual_attention(rw: "SPRewrite", attn: ManualAttention) -> RuleResult:
    """The chain on this rank's heads, between the all-to-alls (called at ``attn.last``)."""
    qs = rw.shape(attn.q)
    ndim = len(qs)
    seq_dim, head_dim = ndim - 2, ndim - 3
    if not qs[head_dim].is_Integer:
        raise AutoSPError(f"{attn.first.name}: attention heads must be static, got q {qs}")
    heads = int(qs[head_dim])
    rw.attention.check_heads(rw, attn.first, heads, qs)
    program = _chain_program(rw, attn, heads)
    if program is None and rw.attention.owns_attention:
        raise refuse_dense(rw, attn.first, "its scores are not a score program (reported: " + rw.stats.dense_masks[-1] + ")")
    kv, kv_heads = {}, {}
    for n in (attn.k, attn.v):
        found = _exchanged_before_repeat(rw, n, head_dim)  # the model's repeat of fewer KV heads: exchange them before it
        if found is not None:
            x, n_rep = found
            local = rw.attention.to_heads(rw, _sequence_local(rw, attn.last, x, seq_dim), heads // n_rep, head_dim, seq_dim)
            kv[n], kv_heads[n] = local, rw.attention.heads_per_rank(rw, heads // n_rep)
            if program is None:  # the tiled kernel reads them unrepeated
                kv[n], kv_heads[n] = _repeat_heads(rw, local, n_rep, head_dim), rw.attention.heads_per_rank(rw, heads)
            rw.stats.kv_exchanged_unrepeated += 1
        else:
            kv[n] = _exchanged(rw, attn, n, heads, head_dim, seq_dim)
            kv_heads[n] = 1 if int(rw.shape(n)[head_dim]) == 1 else rw.attention.heads_per_rank(rw, heads)
    q = _exchanged(rw, attn, attn.q, heads, head_dim, seq_dim)
    if program is not None:  # k and v must hold the same heads: repeat the one with fewer
        most = max(kv_heads.values())
        for n in (attn.k, attn.v):
            if kv_heads[n] < most:
                kv[n] = _repeat_heads(rw, kv[n], most // kv_heads[n], head_dim)
        out = rw.attention.attend(rw, q, kv[attn.k], kv[attn.v], program, heads, rw.val(attn.q).device)  # [B, H/P, S, Dv]
        rw.stats.manual_attention += 1
        return rw.attention.to_sequence(rw, out, head_dim, seq_dim), rw.base_shard(seq_dim)
    g = rw.graph
    value = g.call_function(torch.matmul, (q, g.call_function(torch.transpose, (kv[attn.k], -2, -1))))  # [B, H/P, S, S]
    prev = attn.first
    scores = rw.shape(attn.first)
    for step in attn.steps:
        local = lambda a, prev=prev, value=value: value if a is prev else _side(rw, a, scores, heads)  # noqa: E731
        value = rw.copy(step, fx.map_arg(step.args, local), fx.map_arg(step.kwargs, local))
        prev = step
    out = g.call_function(torch.matmul, (value, kv[attn.v]))  # [B, H/P, S, D]
    rw.stats.manual_attention += 1
    return rw.attention.to_sequence(rw, out, head_dim, seq_dim), rw.base_shard(seq_dim)


def _chain_program(rw: "SPRewrite", attn: ManualAttention, heads: int) -> Optional[ExtractedProgram]:
    """The chain's logits before its softmax as a score program of ``s = q @ k^T``, when the steps
    after the softmax only convert dtypes (or drop out with ``p=0``); else ``None`` (the chain keeps
    the scores of the rank's heads, reported)."""
    if rw.attention_tile is None:
        return None
    names = [_name(step) for step in attn.steps]
    why = None
    if "softmax" not in names:
        why = "it ends in log_softmax (the tiled kernel computes a softmax)" if "log_softmax" in names else "it has no softmax"
    else:
        i = names.index("softmax")
        after = [n for n in names[i + 1 :] if n not in _CONVERT and n != "dropout"]
        if after:
            why = f"it applies {after} after the softmax"
    if why is None:
        builder = ProgramBuilder(rw, heads, attn.last)
        builder.seeds[attn.first] = {"s": 0}
        pre = attn.steps[i - 1] if i > 0 else attn.first
        try:
            return builder.finish(builder.tensor(pre), rw.val(attn.last).dtype)
        except NotAFunction as exc:
            why = f"{exc.node.name} {exc.why}"
    report_dense(rw, attn.first, "the scores", rw.val(attn.first), why, per_rank=rw.sp_size)
    return None


def _exchanged_before_repeat(rw: "SPRewrite", n: fx.Node, head_dim: int) -> Optional[tuple[fx.Node, int]]:
    """``(x, n_rep)`` when ``n`` is the model's repeat of KV heads ``x`` that split over the SP group."""
    found = repeated_heads(rw, n, head_dim)
    return found if found is not None and int(rw.shape(found[0])[head_dim]) % rw.attention.head_split(rw) == 0 else None


def expected_all_to_alls(rw: "SPRewrite", attn: ManualAttention) -> int:
    """The all-to-alls :func:`rewrite_manual_attention` emits for ``attn`` (for the pass's postcondition):
    q and the output, and each of k and v unless it is one head every query head reads (gathered)."""
    head_dim = len(rw.shape(attn.q)) - 3
    return 2 + sum(
        _exchanged_before_repeat(rw, n, head_dim) is not None or rw.shape(n)[head_dim] == rw.shape(attn.q)[head_dim]
        for n in (attn.k, attn.v)
    )

