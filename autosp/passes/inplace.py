"""In-place ops under the SP pass: applied exactly, or refused with the user's source line.

A mutation in the single-device graph changes one storage and every view of it. After the
rewrite a tensor may exist as this rank's shard, as a slice of a replicated value, or as a
gathered copy; a mutation of one of them must not leave another stale. The policy:

* every alias of the mutated tensor (old nodes sharing its storage) is **replicated**, and no
  sharded value flows into the op: the op runs as on one device, and the cached slices of those
  aliases are dropped so that later uses slice the mutated value;
* every alias is replicated and the op adds sequence-sharded values into it along the sequence
  (``zeros(E).scatter_add_(0, expert_ids, mask)``, ``index_add_``): the rank's sums, added over
  the SP group, are written into the replicated tensor;
* every alias is **sequence-sharded** and the op's rule applies with the mutated tensor's own
  placement (``x.mul_(2)``, ``x += residual``, ``F.relu(x, inplace=True)``): the op runs on the
  local shard, and cached gathers of the aliases are dropped;
* anything else - a replicated tensor receiving sharded data (``buf[..., :d].copy_(k)``), an
  op without a rule (``x[:, 0] = 0`` on a shard, ``scatter_``), aliases that are sharded on one
  side and gathered on the other - is an :class:`~autosp.errors.AutoSPError` naming
  the op and the user's line, with the out-of-place form to write instead.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.fx as fx

from autosp.errors import AutoSPError, user_source
from autosp.passes.placement import REPLICATE, Shard
from autosp.passes.rewrite import SPRewrite, mutated_input
from autosp.passes.sp_rules.registry import OpCall, Rule

__all__ = ["mutated_input", "visit_inplace"]

#: ops whose rule sums sequence-sharded values into a replicated tensor (``zeros(E).scatter_add_(0, ids, w)``)
_SUMS_INTO_REPLICATED = {"scatter_add", "index_add"}


def visit_inplace(
    rw: SPRewrite, node: fx.Node, target: fx.Node, lookup: Callable[[fx.Node], Optional[tuple[OpCall, Rule]]]
) -> None:
    aliases = rw.aliases(target)
    placements = [rw.placements[n] for n in aliases]
    sharded_inflow = [n for n in rw.tensor_inputs(node) if n not in aliases and rw.is_shard(n)]
    if all(p is REPLICATE for p in placements):
        if not sharded_inflow:
            rw.redistribute.forget(aliases)
            new = rw.copy(node)
            rw.mutations.add(new)
            rw.record(node, new, rw.replicated_placement(node))
            return
        found = lookup(node)
        result = found[1](rw, node, found[0]) if found is not None and found[0].name in _SUMS_INTO_REPLICATED else None
        if result is not None and result[1] is REPLICATE:  # the whole result, overwriting the tensor
            rw.redistribute.forget(aliases)
            new = rw.graph.call_method("copy_", (rw.new_value[target], result[0]))
            rw.mutations.add(new)
            rw.record(node, new, REPLICATE)
            return
        raise _refusal(node, target, f"it writes {sharded_inflow[0].name}, which is split over the sequence, into a tensor that every rank holds whole")
    if not all(isinstance(p, Shard) for p in placements):
        raise _refusal(node, target, "the tensor is split over the sequence and also used whole (gathered) through a view")
    found = lookup(node)
    if found is None:
        raise _refusal(node, target, "the op has no sequence-parallel rule")
    call, rule = found
    result = rule(rw, node, call)
    shard = rw.placements[target]
    if result is None or not (isinstance(result[1], Shard) and result[1].dim == shard.dim and result[1].same_layout(shard)):
        raise _refusal(node, target, "the op's result would not keep the tensor's split over the sequence")
    rw.redistribute.forget(aliases)
    rw.mutations.add(result[0])
    rw.record(node, *result)


def _refusal(node: fx.Node, target: fx.Node, why: str) -> AutoSPError:
    op = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return AutoSPError(
        f"AutoSP cannot apply the in-place op `{op}` ({node.name}, mutating {target.name}) exactly: {why}.\n"
        f"{user_source(node)}\n"
        "Write it out of place - `x = x.mul(2)` for `x.mul_(2)`, `x = torch.where(mask, 0, x)` or "
        "`torch.cat` for `x[..., i] = v`, a new tensor from `torch.cat`/`torch.stack` for `copy_` into slices "
        "of `new_empty`, `scatter` for `scatter_`."
    )
