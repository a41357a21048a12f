"""Per-block buckets for the sharded mode's parameter collectives (``AutoSPStrategy(fsdp=...)``).

Each parameter of the sharded mode is all-gathered where forward reads it (and, with SAC, again
in backward) and its gradient reduce-scattered: one collective per parameter, tens per block.
This pass runs on the forward and the backward graph after the partition and merges them per
transformer block, with torch's own FX bucketing (``merge_all_gather`` /
``merge_reduce_scatter``, the passes behind inductor's ``bucket_all_gathers_fx``): one gather
per block in forward, one per block in backward, one reduce-scatter per block.

A block is read off the module the collective came from (Dynamo's ``nn_module_stack``, or
``fwd_nn_module_stack`` for backward nodes): the path up to its last list index
(``model.layers.3.attention.wq`` -> ``model.layers.3``); parameters outside any numbered list
(embeddings, the final norm, the head) form groups of their own. Only collectives that follow
each other in the graph with the same block (and group and dtype) are merged, never the whole
model: the working set stays one block of gathered weights (two while the next block's gather
is in flight), where torch's default size cap (2000 MB) would gather a small model up front.

Postcondition: every all-gather of a graph input and every reduce-scatter is in the bucket of
its run; the graph lints. Torch versions whose bucketing is not known to merge these graphs
correctly (:data:`autosp._compat.BUCKETING_MERGES`) keep one collective per parameter.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from autosp.passes.joint_graph import gathered_input

__all__ = ["BucketStats", "block_of", "parameter_collective_buckets", "bucket_parameter_collectives_pass"]

log = logging.getLogger(__name__)

_REDUCE_SCATTER = "_c10d_functional::reduce_scatter_tensor"
_INDEX = re.compile(r"(?:\.(\d+)|\[(\d+)\])(?=\.|\[|$)")


@dataclass
class BucketStats:
    """What :func:`bucket_parameter_collectives_pass` did to one graph: its parameter
    all-gathers and reduce-scatters before bucketing and after (``*_buckets``), the dtypes they
    move and the bytes each rank receives from the gathers / hands to the reduce-scatters per call
    of the graph."""

    all_gathers: int = 0
    gather_buckets: int = 0
    reduce_scatters: int = 0
    scatter_buckets: int = 0
    gather_dtypes: tuple[str, ...] = ()
    scatter_dtypes: tuple[str, ...] = ()
    gathered_bytes: int = 0
    scattered_bytes: int = 0


def _module_path(node: fx.Node) -> Optional[str]:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1]
    return path[0] if isinstance(path, tuple) else str(path)


def block_of(node: fx.Node) -> Optional[str]:
    """The transformer block a collective belongs to: its module's path up to the last list
    index (``L['self'].model.layers.3.attention.wq`` -> ``L['self'].model.layers.3``), or
    ``None`` outside any numbered list (or without module information)."""
    path = _module_path(node)
    if path is None:
        return None
    last = None
    for match in _INDEX.finditer(path):
        last = match
    return path[: last.end()] if last is not None else None


def _op_name(node: fx.Node) -> Optional[str]:
    target = node.target
    return f"{target.namespace}::{target._opname}" if isinstance(target, torch._ops.OpOverload) else None


def _runs(nodes: list[fx.Node], key: Callable[[fx.Node], Any]) -> list[list[fx.Node]]:
    """Maximal runs of consecutive ``nodes`` with the same key; runs of two or more."""
    runs: list[list[fx.Node]] = []
    last: Any = object()
    for node in nodes:
        k = key(node)
        if runs and k == last:
            runs[-1].append(node)
        else:
            runs.append([node])
        last = k
    return [r for r in runs if len(r) > 1]


def _dtype(node: fx.Node) -> Any:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _nbytes(node: Any) -> int:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return int(val.numel()) * val.element_size() if isinstance(val, torch.Tensor) else 0


_WAIT = "_c10d_functional::wait_tensor"


def merge_duplicate_waits(gm: fx.GraphModule) -> int:
    """Give every collective one ``wait_tensor`` (in place): later waits on the same collective
    are replaced by its first (a wait returns the collective's result; the first comes earlier
    in the graph, so it precedes every user of the later ones). torch 2.14 and newer trace a
    parameter read twice in a forward - tied embedding and head - as one all-gather with a wait
    per read, which torch's bucketing cannot merge. Returns how many waits were removed."""
    removed = 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        waits = sorted((u for u in node.users if _op_name(u) == _WAIT), key=order.__getitem__)
        for extra in waits[1:]:
            extra.replace_all_uses_with(waits[0])
            gm.graph.erase_node(extra)
            removed += 1
    return removed


def parameter_collective_buckets(gm: fx.GraphModule) -> tuple[list[list[fx.Node]], list[list[fx.Node]]]:
    """``(all-gather buckets, reduce-scatter buckets)`` of ``gm``: runs of parameter all-gathers
    and of reduce-scatters with the same block, process group and dtype, in graph order; none
    where no collective carries module information (a run would then be the whole model)."""
    gathers, scatters = [], []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if gathered_input(node) is not None and len(node.users) == 1:
            gathers.append(node)
        elif _op_name(node) == _REDUCE_SCATTER and len(node.users) == 1:
            scatters.append(node)
    if all(block_of(n) is None for n in [*gathers, *scatters]):
        return [], []  # no module information in this graph: blocks cannot be told apart
    gather_key = lambda n: (block_of(n), n.args[2], _dtype(n))  # noqa: E731  (input, group_size, group_name)
    scatter_key = lambda n: (block_of(n), n.args[1], n.args[3], _dtype(n))  # noqa: E731  (input, op, group_size, group_name)
    return _runs(gathers, gather_key), _runs(scatters, scatter_key)


def bucket_parameter_collectives_pass(gm: fx.GraphModule, stats: Optional[BucketStats] = None, merge: bool = True) -> fx.GraphModule:
    """Merge the parameter all-gathers and reduce-scatters of ``gm`` per block (in place; see
    the module docstring). ``stats``, if given, receives the counts before and after;
    ``merge=False`` only counts (the buckets then are the collectives themselves)."""
    from autosp._compat import BUCKETING_MERGES, merge_collective_buckets

    merge = merge and BUCKETING_MERGES
    if merge and merge_duplicate_waits(gm):
        gm.graph.lint()
    gather_buckets, scatter_buckets = parameter_collective_buckets(gm) if merge else ([], [])
    if stats is not None:
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        gathers = [n for n in nodes if gathered_input(n) is not None]
        scatters = [n for n in nodes if _op_name(n) == _REDUCE_SCATTER]
        stats.all_gathers, stats.reduce_scatters = len(gathers), len(scatters)
        stats.gather_buckets = stats.all_gathers - sum(len(b) - 1 for b in gather_buckets)
        stats.scatter_buckets = stats.reduce_scatters - sum(len(b) - 1 for b in scatter_buckets)
        stats.gather_dtypes = tuple(sorted({str(_dtype(n)) for n in gathers}))
        stats.scatter_dtypes = tuple(sorted({str(_dtype(n)) for n in scatters}))
        stats.gathered_bytes = sum(_nbytes(n) for n in gathers)
        stats.scattered_bytes = sum(_nbytes(n.args[0]) for n in scatters)
    if gather_buckets or scatter_buckets:
        merge_collective_buckets(gm, gather_buckets, scatter_buckets)
        gm.graph.lint()
        gm.recompile()
    log.debug("AutoSP: bucketed %d all-gather and %d reduce-scatter runs", len(gather_buckets), len(scatter_buckets))
    return gm
