"""Queries on the AOT joint graph of a compiled step (forward and backward in one graph):
which nodes compute the forward outputs, which op a node runs (through the RNG wrappers the
partitioner adds), collectives, views, attention, and the sharded mode's parameter all-gathers
with what stands between a shard and its gather. :mod:`.sac` partitions with them and
:mod:`.bucketing` finds the gathers to merge.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Optional

import sympy
import torch
import torch.fx as fx
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

from autosp.passes import accounting as memory

__all__ = [
    "forward_nodes", "gathered_input", "parameter_gathers", "repeat_of_exchange", "op_name", "recomputes",
    "is_attention", "is_collective", "is_fused_loss", "is_random", "has_tensor_output", "WAIT", "score_program_leaves",
    "contiguous_before_variable_pads",
]


def is_collective(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in memory.COLLECTIVE_NAMESPACES


_VIEWS = frozenset({"view", "_unsafe_view", "reshape", "slice", "alias", "expand", "t", "permute", "transpose", "unsqueeze"})


def is_view(node: fx.Node) -> bool:
    name = memory.qualified_op_name(node.target) if node.op == "call_function" else None
    return name is not None and name.rpartition("::")[2].split(".")[0] in _VIEWS


def repeat_of_exchange(node: fx.Node) -> list[fx.Node]:
    """When attention reads ``node`` as a copy of an all-to-all's output seen through views -
    the KV heads the SP pass repeats after exchanging them (``transpose``, ``unsqueeze``,
    ``expand``, ``clone``, ``_unsafe_view``) - the nodes from that copy on (the copy and its
    views), which backward can redo from the saved all-to-all output instead of keeping ``Hk``
    /``H`` of a repeated copy; otherwise ``[]``."""
    chain: list[fx.Node] = []
    copies = 0
    n = node
    while isinstance(n, fx.Node) and n.op == "call_function":
        if is_collective(n) or (n.target is operator.getitem and is_collective(n.args[0])):
            return chain if copies == 1 else []
        if op_name(n) == "aten::clone":
            copies += 1
        elif not is_view(n):
            return []
        chain.append(n)
        n = n.args[0]
    return []


def parameter_gathers(joint: fx.GraphModule, fwd: set[fx.Node]) -> list[fx.Node]:
    """The forward all-gathers of a graph input (``fsdp``'s parameter shards, seen through
    views, a dtype cast or the padding of an uneven shard: :func:`gathered_input`), with those
    ops before them, their waits and the views of the gathered value: what SAC recomputes in
    backward instead of saving a full weight per layer - or, under ``param_dtype``, the
    low-precision copy of every shard for the whole forward."""
    out: list[fx.Node] = []
    for node in joint.graph.nodes:
        if node not in fwd or gathered_input(node) is None:
            continue
        out.extend(_shard_prep(node))
        todo = [node]
        while todo:
            n = todo.pop()
            out.append(n)
            todo.extend(u for u in n.users if u in fwd and (is_view(u) or op_name(u) == WAIT))
    return out


#: what may stand between a parameter shard and its all-gather: a cast to ``param_dtype``, the
#: padding of an uneven shard to the common size
_SHARD_PREP = frozenset({"_to_copy", "convert_element_type", "constant_pad_nd", "contiguous", "clone"})


def _shard_prep(gather: fx.Node) -> list[fx.Node]:
    """The views and :data:`_SHARD_PREP` ops between an all-gather and what it reads first."""
    chain, src = [], gather.args[0]
    while isinstance(src, fx.Node) and src.op == "call_function" and (is_view(src) or (op_name(src) or "").rpartition("::")[2].split(".")[0] in _SHARD_PREP):
        chain.append(src)
        src = src.args[0]
    return chain


def gathered_input(node: fx.Node) -> Optional[fx.Node]:
    """If ``node`` is an all-gather of a graph input (through views and :data:`_SHARD_PREP`
    ops), that input (a placeholder); otherwise ``None``."""
    if op_name(node) not in _GATHERS:
        return None
    chain = _shard_prep(node)
    src = chain[-1].args[0] if chain else node.args[0]
    return src if isinstance(src, fx.Node) and src.op == "placeholder" else None


# the functional all-gather (the autograd variant traces to the plain one) and its wait
_GATHERS = ("_c10d_functional::all_gather_into_tensor", "_c10d_functional_autograd::all_gather_into_tensor")
WAIT = "_c10d_functional::wait_tensor"
_FUSED_LOSS = "autosp_loss::linear_cross_entropy"


def op_name(node: fx.Node) -> Optional[str]:
    """The qualified name of the op ``node`` runs; a random op the partitioner wrapped to save or
    replay its RNG state (``run_and_save_rng_state`` in the forward, ``run_with_rng_state`` where
    it is recomputed in backward) is named by the op it wraps."""
    if node.op != "call_function":
        return None
    if node.target is run_and_save_rng_state and node.args:
        return memory.qualified_op_name(node.args[0])
    if node.target is run_with_rng_state and len(node.args) > 1:
        return memory.qualified_op_name(node.args[1])
    return memory.qualified_op_name(node.target)


def recomputes(node: fx.Node, fw_names: set[str]) -> bool:
    """Whether backward node ``node`` runs a forward op again: it keeps the forward node's name,
    or replays a random forward op's RNG state."""
    return node.op == "call_function" and (node.name in fw_names or node.target is run_with_rng_state)


def is_fused_loss(node: fx.Node) -> bool:
    return op_name(node) == _FUSED_LOSS


def is_attention(node: fx.Node) -> bool:
    name = op_name(node)
    return name is not None and memory.op_kind(name) == "attention"


#: the tiled attention ops and the position of their list of score-program leaves
_LEAVES_ARG = {"autosp_attn::tiled_attention": 3, "autosp_attn::live_tiles": 0, "autosp_attn::ring_live_tiles": 0}


def score_program_leaves(node: fx.Node) -> list[fx.Node]:
    """The leaves a tiled attention (or the map of its live tiles) evaluates its score program on, else ``[]``."""
    i = _LEAVES_ARG.get(op_name(node) or "")
    if i is None or len(node.args) <= i or not isinstance(node.args[i], (list, tuple)):
        return []
    return [a for a in node.args[i] if isinstance(a, fx.Node)]


def is_random(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


def has_tensor_output(node: fx.Node) -> bool:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return any(isinstance(v, torch.Tensor) for v in val)
    return isinstance(val, torch.Tensor)


def forward_nodes(joint: fx.GraphModule, num_fwd_outputs: int) -> set[fx.Node]:
    """Nodes of the joint graph needed to compute its forward outputs."""
    out = joint.graph.find_nodes(op="output")[0]
    todo = [n for n in torch.utils._pytree.tree_leaves(out.args[0])[:num_fwd_outputs] if isinstance(n, fx.Node)]
    seen: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo.extend(n.all_input_nodes)
    return seen


def contiguous_before_variable_pads(joint: fx.GraphModule) -> int:
    """Feed every ``constant_pad_nd`` whose amounts are remainders of the batch's length (a sequence
    padded to a multiple of a chunk: ``(chunk - s % chunk) % chunk``) a contiguous input (in place);
    returns how many.

    Where the amounts are all 0 at run time, torch's ``constant_pad_nd`` returns a clone that
    keeps its input's strides, while the fake kernel the graph was traced with returns a new
    contiguous tensor; a ``view`` traced after it then fails at run time on a non-contiguous
    input ("view size is not compatible with input tensor's size and stride": Qwen3-Next's gated
    delta rule at a multiple of its chunk of 64, with or without AutoSP, where
    ``x.transpose(1, 2).to(memory_format=torch.contiguous_format)`` traces to no copy). Done on the
    joint graph, it reaches the pads inside sequence mixers kept whole in the Dynamo graph too."""
    pad = torch.ops.aten.constant_pad_nd.default
    done = 0
    for node in list(joint.graph.find_nodes(op="call_function", target=pad)):
        x, amounts = node.args[0], node.args[1]
        if not isinstance(amounts, (list, tuple)) or not any(_remainder(a) for a in amounts):
            continue  # AutoSP's own pads (an uneven shard to its base chunk) are affine in the length: never 0 by surprise
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        with joint.graph.inserting_before(node):
            copy = joint.graph.call_function(torch.ops.aten.clone.default, (x,), {"memory_format": torch.contiguous_format})
        with val.fake_mode if hasattr(val, "fake_mode") else contextlib.nullcontext():
            copy.meta["val"] = val.clone(memory_format=torch.contiguous_format)
        node.args = (copy, *node.args[1:])
        done += 1
    if done:
        joint.recompile()
    return done


def _remainder(amount: object) -> bool:
    """Whether a pad amount is a size computed with a remainder of the batch's length (``Mod``)."""
    val = amount.meta.get("val") if isinstance(amount, fx.Node) else None
    if not isinstance(val, torch.SymInt):
        return False
    return any("Mod" in type(e).__name__ for e in sympy.preorder_traversal(val.node.expr))
