"""Find the step's MLPs and run each over tiles of rows (:mod:`lightning_autosp.tiled_rows`).

Runs on the Dynamo graph before the SP pass. A region starts at a ``linear`` that widens its
input (``x [..., d] -> [..., f]`` with ``f >= 2 d``: an MLP's up or gate projection) and grows over
every op that reads only region values, ``x`` and weights (graph inputs of fixed shape) and that is
token-wise along the last dim: linear layers, elementwise math and activations, dtype casts, and
splits of the last dim. Every region value keeps ``x``'s leading dims, so each row of the output
depends on its own row of ``x`` alone. It ends where its one output, no wider than ``x``, leaves it (the down
projection, before the residual add). Anything else - a second output, a random op, a view, another token
tensor - stops the region there, and a region without exactly one output of ``x``'s leading dims,
or whose widest value is not wider than ``x``, is left alone.

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

from lightning_autosp.passes.sp_rules.registry import lookup
from lightning_autosp.passes.sp_rules.shape import ELEMENTWISE_OPS
from lightning_autosp.tiled_rows import auto_tile_rows, register_region

__all__ = ["TiledRegion", "tile_token_regions"]

log = logging.getLogger(__name__)

#: the widest value of a region over its input's width at which tiling pays
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


def _is_weight(n: fx.Node) -> bool:
    """A graph input of fixed shape (a parameter or buffer)."""
    v = _val(n)
    return n.op in ("placeholder", "get_attr") and isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in v.shape)


def _op_name(n: fx.Node) -> Optional[str]:
    found = lookup(n)
    if found is None:
        return None
    call, _ = found
    return None if call.inplace else call.name


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
    return name in _ELEMENTWISE or name in ("to", "type_as")


def _grow(x: fx.Node, order: dict[fx.Node, int], taken: set[fx.Node]) -> list[fx.Node]:
    lead = _dims(_val(x).shape[:-1])
    region: set[fx.Node] = set()
    frontier = sorted(x.users, key=order.__getitem__)
    while frontier:
        n = frontier.pop(0)
        if n in region or n in taken or n.op not in ("call_function", "call_method") or not _tokenwise(n, lead):
            continue
        inputs = n.all_input_nodes
        if not all(i is x or i in region or _is_weight(i) for i in inputs):
            continue
        region.add(n)
        frontier.extend(sorted(n.users, key=order.__getitem__))
        frontier.sort(key=order.__getitem__)
    return sorted(region, key=order.__getitem__)


def tile_token_regions(gm: fx.GraphModule, tile: int = 0, min_tiles: int = 0, sp_size: int = 1) -> list[TiledRegion]:
    """Replace each MLP of ``gm`` by a tiled call (in place); ``tile``: rows per tile (``0``:
    :func:`~lightning_autosp.tiled_rows.auto_tile_rows`). With ``min_tiles``, a region whose input
    holds fewer than that many tiles per SP rank at the traced sizes is left alone (it would run in
    one tile: tiling would not pay)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    taken: set[fx.Node] = set()
    done: list[TiledRegion] = []
    autocast = _autocast_states(gm)
    for start in list(gm.graph.nodes):
        if start in taken or _op_name(start) != "linear" or start.op != "call_function":
            continue
        x = start.args[0]
        xv, sv = _val(x), _val(start)
        if not isinstance(xv, torch.Tensor) or not isinstance(sv, torch.Tensor) or xv.dim() < 2:
            continue
        d_in, d_out = _int(xv.shape[-1]), _int(sv.shape[-1])
        if d_in is None or d_out is None or d_out < MIN_WIDENING * d_in:
            continue
        region = _grow(x, order, taken)
        if start not in region:
            continue
        members = set(region)
        exits = [n for n in region if any(u not in members for u in n.users)]
        ev = _val(exits[0])
        if len(exits) != 1 or not isinstance(ev, torch.Tensor) or _dims(ev.shape[:-1]) != _dims(xv.shape[:-1]):
            continue
        if _int(ev.shape[-1]) is None or ev.shape[-1] > d_in:
            continue  # it widens and stays wide (an LM head, whose logits the fused loss handles): not an MLP
        width = max(_int(_val(n).shape[-1]) or 0 for n in region if isinstance(_val(n), torch.Tensor))
        states = {autocast.get(n) for n in region}
        if len(states) != 1:
            continue  # the region crosses an autocast boundary
        (state,) = states
        rows = _rows(xv)
        item = _val(exits[0]).element_size()
        rows_per_tile = tile or auto_tile_rows(width, item)
        if min_tiles and (rows is None or rows < min_tiles * rows_per_tile * sp_size):
            continue
        _replace(gm, x, region, exits[0], rows_per_tile, state)
        taken |= members
        done.append(TiledRegion(len(region), int(width), rows_per_tile))
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


def _replace(gm: fx.GraphModule, x: fx.Node, region: list[fx.Node], exit_node: fx.Node, tile: int, autocast: Optional[torch.dtype]) -> None:
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
