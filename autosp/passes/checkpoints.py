"""Gradient checkpointing as users write it, inside the one graph AutoSP splits.

Hugging Face's ``model.gradient_checkpointing_enable()`` (reentrant or not), a loop of one's own
with ``torch.utils.checkpoint.checkpoint(block, x)``, and wrappers such as
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` reach the Dynamo graph as calls of
the ``tag_activation_checkpoint`` higher-order op, each with its region's body as a sub-graph
(AutoSP compiles with ``skip_fwd_side_effects_in_bwd_under_checkpoint``, so that a region whose
forward sets Python state - Hugging Face's kernel-selection context - is traced instead of
splitting the step into several graphs: that state is read when a region runs forward, not when
it is recomputed).

The SP pass rewrites one flat graph, so :func:`inline_checkpoints` puts each body back in place
of its call and tags the region's nodes (``node.meta["custom"]["autosp_checkpoint"]``, a tag AOT
autograd carries onto the joint graph). The partition then honours the regions the way
``sac="block"`` honours transformer blocks (:func:`~autosp.passes.sac.block_tag_pass` with
:func:`checkpoint_region_of`): what a region hands on is saved, everything else in it - the SP
pass's exchanges and attention included - is recomputed in backward, from the region's input.
Outside the regions SAC's policy (or the partitioner's own, with ``sac=False``) applies.

Postcondition of :func:`inline_checkpoints`: no ``tag_activation_checkpoint`` call is left; the
graph computes what it computed.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from autosp.errors import AutoSPError, user_source

__all__ = ["inline_checkpoints", "checkpoint_region_of", "REGION_KEY", "CHECKPOINT_OP"]

#: where a node of a checkpointed region carries its region's number (in ``node.meta["custom"]``)
REGION_KEY = "autosp_checkpoint"
#: what Dynamo records for ``torch.utils.checkpoint.checkpoint``
CHECKPOINT_OP = torch.ops.higher_order.tag_activation_checkpoint
#: keyword arguments of the op that only say how eager autograd would checkpoint: the block
#: partition does the same (every op of the region recomputed from its inputs)
_PLAIN_KWARGS = frozenset({"use_reentrant", "preserve_rng_state", "determinism_check", "debug"})


def checkpoint_region_of(node: fx.Node) -> Optional[str]:
    """``"checkpoint <k>"`` for a node of the ``k``-th checkpointed region, else ``None``."""
    region = (node.meta.get("custom") or {}).get(REGION_KEY)
    return None if region is None else f"checkpoint {region}"


def _refuse(node: fx.Node, why: str) -> AutoSPError:
    return AutoSPError(
        f"{node.name}: a region under gradient checkpointing (torch.utils.checkpoint, Hugging Face's "
        f"gradient_checkpointing_enable()) {why}, which AutoSP cannot honour inside the graph it splits.\n"
        + user_source(node) + "\n"
        + "Turn gradient checkpointing off (model.gradient_checkpointing_disable(), or drop the checkpoint call) and "
        "let AutoSP recompute instead: AutoSPStrategy(sac='block') recomputes each transformer block whole, as "
        "checkpointing every layer does; sac=True (the default) recomputes the cheap ops and keeps attention saved."
    )


def _inline_one(gm: fx.GraphModule, node: fx.Node, region: int) -> None:
    body_attr, *args = node.args
    body = getattr(gm, body_attr.target)
    extra = sorted(k for k, v in node.kwargs.items() if k not in _PLAIN_KWARGS and v is not None)
    if body.meta.get("_checkpoint_context_fn") is not None:  # where Dynamo keeps a non-default context_fn
        extra.append("context_fn")
    if extra:
        raise _refuse(node, f"has {extra} (a selective checkpointing policy recomputes only part of the region)")
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise AutoSPError(f"internal: {node.name}: {len(args)} inputs for a checkpointed region of {len(placeholders)}")
    env: dict[fx.Node, Any] = dict(zip(placeholders, args))
    outputs: Any = None
    with gm.graph.inserting_before(node):
        for bn in body.graph.nodes:
            if bn.op == "placeholder":
                continue
            if bn.op == "output":
                outputs = fx.map_arg(bn.args[0], env.__getitem__)
                continue
            if bn.op == "get_attr":  # a region inside the region: its body moves up to gm
                name = f"{body_attr.target}_{bn.target}"
                setattr(gm, name, getattr(body, bn.target))
                new = gm.graph.get_attr(name)
                new.meta.update(bn.meta)
            else:
                new = gm.graph.node_copy(bn, env.__getitem__)
                new.meta["custom"] = {**(bn.meta.get("custom") or {}), REGION_KEY: region}
            env[bn] = new
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise _refuse(user, "has its outputs read other than one by one")
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    if not body_attr.users:
        gm.graph.erase_node(body_attr)


def inline_checkpoints(gm: fx.GraphModule) -> int:
    """Put every checkpointed region of ``gm`` in place, its nodes tagged with the region's number
    (see the module docstring); returns how many regions there were."""
    regions = 0
    while True:
        calls = gm.graph.find_nodes(op="call_function", target=CHECKPOINT_OP)
        if not calls:
            break
        for node in calls:
            _inline_one(gm, node, regions)
            regions += 1
    if regions:
        gm.graph.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return regions
