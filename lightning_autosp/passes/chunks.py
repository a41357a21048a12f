"""Losses computed in chunks of rows, merged back into one op before the SP pass.

LitGPT's ``chunked_cross_entropy`` (and code like it) bounds the memory of the loss on one device
by splitting the flattened logits and targets into chunks of rows and computing the loss per
chunk::

    losses = [F.cross_entropy(l, t, reduction="none") for l, t in zip(logits.split(128), targets.split(128))]
    loss = torch.cat(losses).sum() / n_tokens

The chunks' boundaries are fixed row counts of the whole ``[B*S, V]`` logits, so under sequence
parallelism a chunk would straddle ranks: the pass would have to all-gather the logits (every
rank holding all of them, the opposite of the chunking's purpose). Both rewrites below are exact
identities, so this module applies them to the Dynamo graph first:

* ``cat([f(x.split(c)[i], y.split(c)[i], ..) for i])`` along the split dim is ``f(x, y, ..)``
  when ``f`` works row by row (``cross_entropy``/``nll_loss`` with ``reduction="none"`` on
  ``[N, C]`` rows) - the pieces of every split are those of one split size, in order, each read
  only by its ``f``;
* ``cross_entropy(.., reduction="none").sum()`` is ``cross_entropy(.., reduction="sum")``.

The SP pass then computes the loss over the rank's own rows, and the fused vocabulary loss
(:mod:`lightning_autosp.fused_loss`) takes the summed form, so the logits never exist whole.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

__all__ = ["merge_row_chunks"]

_LOSSES = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}


def _is(node: Any, name: str) -> bool:
    """``node`` calls ``torch.<name>``/``Tensor.<name>``."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target == name
    return node.op == "call_function" and node.target is getattr(torch, name, None)


def _loss_args(node: fx.Node) -> Optional[dict[str, Any]]:
    """The bound arguments of a ``cross_entropy``/``nll_loss`` call, or ``None``."""
    if node.op != "call_function" or node.target not in _LOSSES:
        return None
    try:
        return dict(_LOSSES[node.target].bind(*node.args, **node.kwargs).arguments)
    except TypeError:
        return None


def _rowwise_loss(node: fx.Node) -> bool:
    """A per-row loss: ``reduction="none"`` on ``[N, C]`` logits and ``[N]`` targets."""
    a = _loss_args(node)
    if a is None or a.get("reduction", "mean") != "none" or a.get("size_average") is not None or a.get("reduce") is not None:
        return False
    val = node.args[0].meta.get("example_value") if isinstance(node.args[0], fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dim() == 2


def _split_piece(node: Any) -> Optional[tuple[fx.Node, int]]:
    """``(split, i)`` when ``node`` is piece ``i`` of a ``split(c)`` along dim 0 with an int ``c``."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    split, i = node.args
    if not _is(split, "split") or not isinstance(i, int):
        return None
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    size = split.kwargs.get("split_size_or_sections", split.kwargs.get("split_size", split.args[1] if len(split.args) > 1 else None))
    if dim != 0 or not isinstance(size, int) or set(split.kwargs) - {"dim", "split_size", "split_size_or_sections"}:
        return None
    return split, i


def _merge_cat(graph: fx.Graph, cat: fx.Node) -> bool:
    pieces = cat.args[0] if cat.args else cat.kwargs.get("tensors")
    dim = cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)
    if dim != 0 or not isinstance(pieces, (list, tuple)) or not pieces:
        return False
    first = pieces[0]
    if not all(isinstance(p, fx.Node) and _rowwise_loss(p) and p.target is first.target for p in pieces):
        return False
    if any(len(p.users) != 1 for p in pieces):
        return False
    # argument k of piece i is piece i of split k (tensors), or the same value in every piece
    n_args, keys = len(first.args), tuple(first.kwargs)
    if any(len(p.args) != n_args or tuple(p.kwargs) != keys for p in pieces):
        return False
    splits: dict[Any, fx.Node] = {}
    for slot in [*range(n_args), *keys]:
        values = [p.args[slot] if isinstance(slot, int) else p.kwargs[slot] for p in pieces]
        found = [_split_piece(v) for v in values]
        if all(f is not None for f in found):
            split = found[0][0]
            if any(f[0] is not split or f[1] != i or len(v.users) != 1 for i, (f, v) in enumerate(zip(found, values))):
                return False
            if len(split.meta.get("example_value") or ()) != len(pieces) or len(split.users) != len(pieces):
                return False
            splits[slot] = split
        elif any(f is not None for f in found) or any(v is not values[0] and v != values[0] for v in values):
            return False
    if not splits or len({s.args[1] if len(s.args) > 1 else None for s in splits.values()}) != 1:
        return False
    rows = [s.args[0].meta["example_value"].shape[0] for s in splits.values()]
    if len({str(r.node.expr if isinstance(r, torch.SymInt) else r) for r in rows}) != 1:
        return False
    whole = lambda slot, value: splits[slot].args[0] if slot in splits else value  # noqa: E731
    with graph.inserting_before(cat):
        merged = graph.call_function(
            first.target,
            tuple(whole(i, v) for i, v in enumerate(first.args)),
            {k: whole(k, v) for k, v in first.kwargs.items()},
        )
    merged.meta.update(cat.meta)
    merged.meta["stack_trace"] = first.meta.get("stack_trace", cat.meta.get("stack_trace"))
    cat.replace_all_uses_with(merged)
    for node in [cat, *pieces, *{v for p in pieces for v in p.all_input_nodes if _split_piece(v)}, *splits.values()]:
        if not node.users:
            graph.erase_node(node)
    return True


def _sum_of_rowwise_loss(node: fx.Node) -> bool:
    """``loss.sum()`` over every dim of a per-row loss read by nothing else: the loss with
    ``reduction="sum"``."""
    if not _is(node, "sum") or len(node.args) != 1 or node.kwargs:
        return False
    loss = node.args[0]
    if not (isinstance(loss, fx.Node) and loss.target is F.cross_entropy and _rowwise_loss(loss) and len(loss.users) == 1):
        return False
    with node.graph.inserting_before(node):
        merged = node.graph.call_function(loss.target, loss.args, {**loss.kwargs, "reduction": "sum"})
    merged.meta.update(node.meta)
    merged.meta["stack_trace"] = loss.meta.get("stack_trace", node.meta.get("stack_trace"))
    node.replace_all_uses_with(merged)
    node.graph.erase_node(node)
    node.graph.erase_node(loss)
    return True


def merge_row_chunks(gm: fx.GraphModule) -> int:
    """Apply both rewrites of the module docstring to ``gm``'s graph in place; the number of
    chunked losses merged (``cat`` of per-chunk losses) and summed losses turned into one."""
    graph, merged = gm.graph, 0
    for node in list(graph.nodes):
        if node.graph is graph and _is(node, "cat") and _merge_cat(graph, node):
            merged += 1
    for node in list(graph.nodes):
        if _is(node, "sum") and _sum_of_rowwise_loss(node):
            merged += 1
    if merged:
        graph.lint()
        gm.recompile()
    return merged
