"""Find the step's token-wise regions - each MLP with its norm and residual add, the norms - and run
each over tiles of rows (:mod:`autosp.ops.tiled_rows`).

Runs on the Dynamo graph before the SP pass. From every floating-point value ``x`` of rows
(``[..., d]``), a region grows over every op that reads only region values, ``x`` and fixed
tensors (graph inputs of fixed shape - parameters, buffers - and what is computed from them
alone, such as ``weight.float()``) and that is token-wise along the last dim: linear layers,
elementwise math and activations, dtype casts, splits of the last dim and reductions over it
(an RMSNorm's mean of squares). Every region value keeps ``x``'s leading dims, so each row of its
output depends on its own row of ``x`` alone. A random op, a view, another token tensor stop it.

Of what grew, the pass keeps the largest part with one output: an output no wider than ``x``
with the ops it is computed from, none of which is read elsewhere, all in one transformer block
(an element of a ``ModuleList``: ``sac="block"`` recomputes each block whole). In a Llama block
that is the norm before the MLP, the MLP and the residual add after it, the output the block's
(the norm before attention feeds three projections: it is a region of its own). A wide output -
an LM head, whose logits the fused loss handles - is never one. A part is tiled where its widest
value takes at least twice the bytes of a row of ``x`` (an MLP's ``4 x d``; a bf16 norm's fp32
intermediates); otherwise tiling would not pay.

The region is cut out into a graph of its own and replaced by one ``autosp_tile::rows`` call,
which the SP pass runs on the rank's tokens like any token-wise op.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from autosp.passes.sac import block_of
from autosp.passes.sp_rules.registry import lookup
from autosp.passes.sp_rules.shape import ELEMENTWISE_OPS
from autosp.ops.tiled_rows import ROW_REDUCTIONS as _ROW_REDUCTIONS, auto_tile_rows, register_region

__all__ = ["TiledRegion", "tile_token_regions"]

log = logging.getLogger(__name__)

#: the bytes of a region's widest value per row, over its input's, at which tiling pays
MIN_WIDENING = 2
_ELEMENTWISE = {o.name for o in ELEMENTWISE_OPS} - {
    "copy", "iadd", "isub", "imul", "itruediv", "zeros_like", "ones_like", "empty_like", "full_like", "where", "masked_fill",
}
_SPLITS = {"chunk", "split"}


@dataclass
class TiledRegion:
    """One region :func:`tile_token_regions` replaced."""

    ops: int
    width: int  # its widest value's last dim
    tile: int
    weights: list[str] = field(default_factory=list)


def _dims(shape: Any) -> tuple:
    """Sizes as keys that compare without guards (a comparison of SymInts would add a guard on
    the sequence length to the compiled graph)."""
    return tuple(str(d.node.expr) if isinstance(d, torch.SymInt) else int(d) for d in shape)


def _int(size: Any) -> Optional[int]:
    return int(size) if isinstance(size, int) else None


def _val(n: Any) -> Any:
    return n.meta.get("example_value") if isinstance(n, fx.Node) else None


def _fixed(gm: fx.GraphModule) -> set[fx.Node]:
    """The graph's fixed tensors: inputs of fixed shape (parameters and buffers), and ops computed
    from those alone (``weight.float()``). A region reads them like weights."""
    out: set[fx.Node] = set()
    for n in gm.graph.nodes:
        v = _val(n)
        if not isinstance(v, torch.Tensor) or not all(isinstance(s, int) for s in v.shape):
            continue
        if n.op in ("placeholder", "get_attr") or (
            n.op in ("call_function", "call_method") and n.all_input_nodes and all(i in out for i in n.all_input_nodes)
        ):
            out.add(n)
    return out


def _op_name(n: fx.Node) -> Optional[str]:
    found = lookup(n)
    if found is None:
        return None
    call, _ = found
    return None if call.inplace else call.name


def _last_dim_reduction(n: fx.Node, x: Any) -> bool:
    """``x.mean(-1, keepdim=True)`` and the like: one value per row."""
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    keepdim = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False)
    dims = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
    return isinstance(x, torch.Tensor) and keepdim is True and dims in ((-1,), (x.dim() - 1,))


def _tokenwise(n: fx.Node, lead: tuple) -> bool:
    """``n`` is an op the region may hold, with ``x``'s leading dims."""
    name = _op_name(n)
    if name == "getitem":
        src = n.args[0]
        return isinstance(src, fx.Node) and _op_name(src) in _SPLITS and isinstance(n.args[1], int)
    v = _val(n)
    if name in _SPLITS:
        dim = n.kwargs.get("dim", n.args[2] if len(n.args) > 2 else 0)
        x = _val(n.args[0])
        return isinstance(x, torch.Tensor) and isinstance(dim, int) and dim in (-1, x.dim() - 1)
    if not isinstance(v, torch.Tensor) or _dims(v.shape[:-1]) != lead or _int(v.shape[-1]) is None:
        return False
    if name == "linear":
        return True
    if name in _ROW_REDUCTIONS:
        return _last_dim_reduction(n, _val(n.args[0]) if n.args else None)
    return name in _ELEMENTWISE or name in ("to", "type_as", "float")


def _grow(x: fx.Node, order: dict[fx.Node, int], taken: set[fx.Node], fixed: set[fx.Node]) -> list[fx.Node]:
    """Every op reachable from ``x`` that reads only ``x``, the region and weights and is token-wise."""
    lead = _dims(_val(x).shape[:-1])
    region: set[fx.Node] = set()
    frontier = sorted(x.users, key=order.__getitem__)
    while frontier:
        n = frontier.pop(0)
        if n in region or n in taken or n.op not in ("call_function", "call_method") or not _tokenwise(n, lead):
            continue
        inputs = n.all_input_nodes
        if not all(i is x or i in region or i in fixed for i in inputs):
            continue
        region.add(n)
        frontier.extend(sorted(n.users, key=order.__getitem__))
        frontier.sort(key=order.__getitem__)
    return sorted(region, key=order.__getitem__)


def _row_bytes(v: Any) -> int:
    """Bytes of one row (the last dim) of a region value."""
    if not isinstance(v, torch.Tensor) or _int(v.shape[-1] if v.dim() else 1) is None:
        return 0
    return int(v.shape[-1] if v.dim() else 1) * v.element_size()


def _single_exit(x: fx.Node, grown: list[fx.Node], order: dict[fx.Node, int]) -> list[tuple[list[fx.Node], fx.Node]]:
    """The sub-regions of ``grown`` with one output: for each candidate output ``e`` (``x``'s
    leading dims, no wider than ``x``), ``e`` and its ancestors in ``grown``, kept when no value but
    ``e`` is read outside them. Largest first."""
    xv = _val(x)
    lead, width = _dims(xv.shape[:-1]), xv.shape[-1]
    members = set(grown)
    found = []
    for e in grown:
        ev = _val(e)
        if not isinstance(ev, torch.Tensor) or _dims(ev.shape[:-1]) != lead or _int(ev.shape[-1]) is None or ev.shape[-1] > width:
            continue  # a wide output (an LM head, whose logits the fused loss handles) or not rows
        sub, todo = {e}, [e]
        while todo:
            for i in todo.pop().all_input_nodes:
                if i in members and i not in sub:
                    sub.add(i)
                    todo.append(i)
        if len({block_of(n) for n in sub}) > 1:
            continue  # it would cross transformer blocks (sac="block" recomputes each block whole)
        if all(u in sub for n in sub if n is not e for u in n.users):
            found.append((sorted(sub, key=order.__getitem__), e))
    return sorted(found, key=lambda f: -len(f[0]))


def tile_token_regions(gm: fx.GraphModule, tile: int = 0, min_tiles: int = 0, sp_size: int = 1) -> list[TiledRegion]:
    """Replace each token-wise region of ``gm`` that widens its rows by a tiled call (in place);
    ``tile``: rows per tile (``0``: :func:`~autosp.ops.tiled_rows.auto_tile_rows`). With
    ``min_tiles``, a region whose input holds fewer than that many tiles per SP rank at the traced
    sizes is left alone (it would run in one tile: tiling would not pay)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    taken: set[fx.Node] = set()
    done: list[TiledRegion] = []
    autocast = _autocast_states(gm)
    fixed = _fixed(gm)
    nodes, at = list(gm.graph.nodes), 0
    while at < len(nodes):
        x, at = nodes[at], at + 1
        xv = _val(x)
        if x in taken or not isinstance(xv, torch.Tensor) or xv.dim() < 2 or not xv.is_floating_point() or x in fixed:
            continue
        if _int(xv.shape[-1]) is None:
            continue
        grown = _grow(x, order, taken, fixed)
        for region, exit_node in _single_exit(x, grown, order) if grown else ():
            widest = max(_row_bytes(_val(n)) for n in region)
            if widest < MIN_WIDENING * _row_bytes(xv):
                continue  # nothing in it is much wider than its rows: tiling would not pay
            states = {autocast.get(n) for n in region}
            if len(states) != 1:
                continue  # the region crosses an autocast boundary
            (state,) = states
            rows = _rows(xv)
            rows_per_tile = tile or auto_tile_rows(widest, 1)
            if min_tiles and (rows is None or rows < min_tiles * rows_per_tile * sp_size):
                break
            call = _replace(gm, x, region, exit_node, rows_per_tile, state)
            taken |= set(region)
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            nodes.insert(at, call)  # its rows may start the next region (the next block's norm)
            width = max(_int(_val(n).shape[-1]) or 0 for n in region if isinstance(_val(n), torch.Tensor) and _val(n).dim())
            done.append(TiledRegion(len(region), width, rows_per_tile))
            break
    if done:
        gm.graph.lint()
        gm.recompile()
        log.debug("AutoSP tiled %d token-wise region(s): %s", len(done), done)
    return done


def _rows(v: torch.Tensor) -> Optional[int]:
    n = 1
    for s in v.shape[:-1]:
        if isinstance(s, torch.SymInt):
            hint = s.node.hint
            if hint is None:
                return None
            s = hint
        n *= int(s)
    return n


def _autocast_states(gm: fx.GraphModule) -> dict[fx.Node, Optional[torch.dtype]]:
    """Each node's autocast dtype as Dynamo recorded it (``_enter_autocast`` / ``_exit_autocast``
    pairs; ``None``: off)."""
    from torch.amp.autocast_mode import _enter_autocast, _exit_autocast

    stack: list[Optional[torch.dtype]] = [None]
    states: dict[fx.Node, Optional[torch.dtype]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is _enter_autocast:
            args = list(n.args) + [None] * 4
            device, dtype, enabled = args[0], args[1], args[2]
            stack.append(dtype if enabled is not False and dtype is not None else None)
        elif n.op == "call_function" and n.target is _exit_autocast:
            if len(stack) > 1:
                stack.pop()
        states[n] = stack[-1]
    return states


def _replace(
    gm: fx.GraphModule, x: fx.Node, region: list[fx.Node], exit_node: fx.Node, tile: int, autocast: Optional[torch.dtype]
) -> fx.Node:
    members = set(region)
    weights: list[fx.Node] = []
    for n in region:
        for i in n.all_input_nodes:
            if i is not x and i not in members and i not in weights:
                weights.append(i)
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {x: sub.placeholder("x")}
    for i, w in enumerate(weights):
        env[w] = sub.placeholder(f"w{i}")
    for n in region:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(env[exit_node])
    sub_gm = fx.GraphModule(torch.nn.Module(), sub)
    key = register_region(sub_gm, _val(x), [_val(w) for w in weights], autocast)
    with gm.graph.inserting_before(exit_node):
        call = gm.graph.call_function(torch.ops.autosp_tile.rows.default, (x, weights, key, tile))
    call.meta.update({k: v for k, v in exit_node.meta.items() if k in ("example_value", "stack_trace", "nn_module_stack", "source_fn_stack")})
    exit_node.replace_all_uses_with(call)
    for n in reversed(region):
        if not n.users:
            gm.graph.erase_node(n)
    return call
