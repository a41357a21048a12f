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
* ``cross_entropy(.., reduction="none").sum()`` is ``cross_entropy(.., reduction="sum")``;
* ``cat([cross_entropy(L_i, T_i, reduction="none") for i]).sum()``, where ``L_i``/``T_i`` come from
  piece ``i`` of splits along the same dim through the same token-wise steps (``linear`` with the
  same weights, flattening reshapes, dtype casts; the last piece of the logits may drop trailing
  positions) - LitGPT's fine-tuning recipe, ``model(x, lm_head_chunk_size=c)`` then
  ``chunked_cross_entropy`` - is ``cross_entropy(L, T, reduction="sum")`` of the same steps applied
  to the whole split inputs: every logits row still meets its own target, and the sum does not
  depend on the order of the rows.

The SP pass then computes the loss over the rank's own rows, and the fused vocabulary loss
(:mod:`autosp.ops.fused_loss`) takes the summed form, so the logits never exist whole.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from autosp.passes.sp_rules.reduction import loss_arguments

__all__ = ["merge_row_chunks"]

def _is(node: Any, name: str) -> bool:
    """``node`` calls ``torch.<name>``/``Tensor.<name>``."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target == name
    return node.op == "call_function" and node.target is getattr(torch, name, None)


def _split_args(split: fx.Node) -> tuple[Any, Any]:
    """``(size, dim)`` of a ``split`` call, positional or by keyword."""
    size = split.kwargs.get("split_size_or_sections", split.kwargs.get("split_size", split.args[1] if len(split.args) > 1 else None))
    return size, split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)


def _cat_dim(cat: fx.Node) -> Any:
    return cat.kwargs.get("dim", cat.args[1] if len(cat.args) > 1 else 0)


def _rowwise_loss(node: fx.Node) -> bool:
    """A per-row loss: ``reduction="none"`` on ``[N, C]`` logits and ``[N]`` targets."""
    a = loss_arguments(node)
    if a is None or a["reduction"] != "none" or a.get("size_average") is not None or a.get("reduce") is not None:
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
    size, dim = _split_args(split)
    if dim != 0 or not isinstance(size, int) or set(split.kwargs) - {"dim", "split_size", "split_size_or_sections"}:
        return None
    return split, i


def _merge_cat(graph: fx.Graph, cat: fx.Node) -> bool:
    pieces = cat.args[0] if cat.args else cat.kwargs.get("tensors")
    if _cat_dim(cat) != 0 or not isinstance(pieces, (list, tuple)) or not pieces:
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
    if not splits or len({_split_args(s)[0] for s in splits.values()}) != 1:
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


_CASTS = ("float", "double", "half", "bfloat16", "to", "contiguous")


def _chain(node: Any, last: bool) -> Optional[tuple[fx.Node, int, list[fx.Node]]]:
    """``(split, i, steps)``: ``node`` is computed from piece ``i`` of ``split`` (an int split
    size, or any when it makes one piece) by ``steps`` (in forward order), each read only by the next: ``linear`` (the split
    not along the last dim), dtype casts, reshapes to ``(-1,)`` or ``(-1, C)`` and, on the last
    piece only (``last``) and before any reshape, ``x[..., :-k, :]`` dropping trailing positions
    of the split dim. ``None`` for anything else."""
    steps: list[fx.Node] = []
    while isinstance(node, fx.Node) and not (node.op == "call_function" and node.target is operator.getitem and _is(node.args[0], "split")):
        if len(node.users) != 1 or not node.args:
            return None
        steps.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node) or len(node.users) != 1 or not steps:
        return None
    split, i = node.args
    steps.reverse()
    x = split.args[0].meta.get("example_value") if isinstance(split.args[0], fx.Node) else None
    size, dim = _split_args(split)
    whole = len(split.meta.get("example_value") or ()) == 1  # one piece: the split is the identity
    if x is None or not (isinstance(size, int) or whole) or not isinstance(dim, int) or not isinstance(i, int):
        return None
    dim, reshaped = dim % x.dim(), False
    for step in steps:
        if step.op == "call_function" and step.target is F.linear or _is(step, "linear"):
            if reshaped or dim == x.dim() - 1:
                return None
        elif step.op == "call_method" and step.target in _CASTS:
            pass
        elif step.op == "call_method" and step.target in ("reshape", "view"):
            shape = step.args[1] if len(step.args) == 2 and isinstance(step.args[1], (tuple, list)) else step.args[1:]
            if not (1 <= len(shape) <= 2 and shape[0] == -1 and all(isinstance(v, int) for v in shape[1:])):
                return None
            reshaped = True
        elif step.target is operator.getitem and last and not reshaped and _trims_end(step) and dim == x.dim() - 2:
            pass
        else:
            return None
    if sum(step.target is operator.getitem for step in steps) > 1:
        return None
    return split, i, steps


def _trims_end(node: fx.Node) -> bool:
    """``x[..., :-k, :]``: drops the last ``k`` positions of the second-to-last dim."""
    idx = node.args[1]
    return (
        isinstance(idx, tuple) and len(idx) == 3 and idx[0] is Ellipsis and idx[2] == slice(None)
        and isinstance(idx[1], slice) and idx[1].start is None and idx[1].step is None
        and isinstance(idx[1].stop, int) and idx[1].stop < 0
    )


def _same_step(a: fx.Node, b: fx.Node) -> bool:
    """Steps of two pieces that do the same to their piece (same op, same other arguments)."""
    return a.op == b.op and a.target == b.target and a.args[1:] == b.args[1:] and a.kwargs == b.kwargs


def _fake(node: fx.Node) -> None:
    """``node.meta["example_value"]`` from its inputs' example values (in their fake mode)."""
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: n.meta["example_value"])
    mode = next(v.fake_mode for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
    fn = getattr(torch.Tensor, node.target) if node.op == "call_method" else node.target
    with mode:
        node.meta["example_value"] = fn(*args, **kwargs)


def _merge_summed_chunks(graph: fx.Graph, total: fx.Node) -> bool:
    """The third rewrite of the module docstring at ``total = cat(losses).sum()``."""
    if not _is(total, "sum") or len(total.args) != 1 or total.kwargs:
        return False
    cat = total.args[0]
    if not _is(cat, "cat") or len(cat.users) != 1 or _cat_dim(cat) != 0:
        return False
    losses = cat.args[0]
    if not isinstance(losses, (list, tuple)) or not losses:
        return False
    if not all(isinstance(p, fx.Node) and p.target is F.cross_entropy and _rowwise_loss(p) and len(p.users) == 1 for p in losses):
        return False
    first, n = losses[0], len(losses)
    if any(len(p.args) != len(first.args) or p.args[2:] != first.args[2:] or p.kwargs != first.kwargs for p in losses):
        return False
    wholes = []  # per argument (logits, targets): the split and the last piece's steps
    for slot in (0, 1):
        chains = [_chain(p.args[slot], last=i == n - 1) for i, p in enumerate(losses)]
        if any(c is None for c in chains):
            return False
        split = chains[0][0]
        if any(c[0] is not split or c[1] != i for i, c in enumerate(chains)):
            return False
        if len(split.users) != n or len(split.meta.get("example_value") or ()) != n:
            return False
        last = chains[-1][2]
        base, plain_last = ([s for s in c[2] if s.target is not operator.getitem] for c in (chains[0], chains[-1]))
        for steps in [*(c[2] for c in chains[1:-1]), plain_last]:
            if len(steps) != len(base) or not all(_same_step(a, b) for a, b in zip(base, steps)):
                return False
        wholes.append((split, last))
    (l_split, _), (t_split, _) = wholes
    if n > 1 and _split_args(l_split) != _split_args(t_split):
        return False  # the pieces of logits and targets must be the same positions
    with graph.inserting_before(total):
        new_args = []
        for split, last in wholes:
            value = split.args[0]
            for step in last:  # the last piece's steps (with its trim) on the whole input
                value = graph.create_node(step.op, step.target, (value, *step.args[1:]), dict(step.kwargs))
                value.meta["stack_trace"] = step.meta.get("stack_trace")
                _fake(value)
            new_args.append(value)
        merged = graph.call_function(first.target, (*new_args, *first.args[2:]), {**first.kwargs, "reduction": "sum"})
    merged.meta.update(total.meta)
    merged.meta["stack_trace"] = first.meta.get("stack_trace", total.meta.get("stack_trace"))
    total.replace_all_uses_with(merged)
    dead = [total, cat, *losses]
    for p in losses:
        for slot in (0, 1):
            node = p.args[slot]
            while not _is(node, "split"):
                dead.append(node)
                node = node.args[0]
    for node in [*dead, l_split, t_split]:
        graph.erase_node(node)
    return True


def merge_row_chunks(gm: fx.GraphModule) -> int:
    """Apply the rewrites of the module docstring to ``gm``'s graph in place; the number of
    chunked losses merged (``cat`` of per-chunk losses) and summed losses turned into one."""
    graph, merged = gm.graph, 0
    for node in list(graph.nodes):
        if _is(node, "cat") and _merge_cat(graph, node):
            merged += 1
    for node in list(graph.nodes):
        if _is(node, "sum") and (_sum_of_rowwise_loss(node) or _merge_summed_chunks(graph, node)):
            merged += 1
    if merged:
        graph.lint()
        gm.recompile()
    return merged
