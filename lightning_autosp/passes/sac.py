"""Sequence-aware activation checkpointing (SAC): a partition policy on the AOT joint graph.

At long sequence lengths attention costs O(s^2) FLOPs while projections and MLPs cost O(s),
so recomputing the matmuls in backward is cheap next to attention and frees most activation
memory. PyTorch's min-cut partitioner refuses to recompute matmuls on its own; this module
tells it which forward ops to recompute through its public contract, ``node.meta["recompute"]``:

* every SP collective (``autosp::*``, ``_c10d_functional::*``), every attention op, its
  outputs and its inputs are ``MUST_SAVE`` (but for k and v that the SP pass repeats after
  exchanging them: the exchanged, smaller tensor is saved and the repeat redone in backward):
  attention never runs twice and no collective is
  re-issued in backward (the partitioner would otherwise recompute a custom-op collective
  under a memory budget); so are the outputs of the fused vocabulary loss
  (``autosp_loss::linear_cross_entropy``), whose gradients were computed in forward;
* forward ops of the kinds in :attr:`SACConfig.recompute` (default ``linear`` - matmuls and
  MLP activations - and ``norm``) are ``PREFER_RECOMPUTE``, which the min-cut partitioner
  treats as "recompute in backward": their outputs are not saved;
* everything else (residual adds, embeddings, the loss, RoPE tables) is left to the
  partitioner's own cost model, optionally under an ``activation_memory_budget``.

Op kinds are those of the memory report (:data:`lightning_autosp.memory.OP_KINDS`), so what
SAC recomputes is what the :class:`~lightning_autosp.memory.monitor.ActivationMemoryMonitor` shows
shrinking.

:class:`SACPartitioner` is the partition function of one AutoSP compile: tag (when SAC is on),
run ``min_cut_rematerialization_partition``, check the postcondition, and record the saved
activations (:class:`~lightning_autosp.memory.SavedActivations`). It is passed explicitly to
AOT autograd (``aot_eager``) or as inductor's ``custom_partitioner_fn`` config patch for our
compile only, so any other ``torch.compile`` in the process is unaffected.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

from lightning_autosp._compat import prepare_recompute_tags
from lightning_autosp.passes import accounting as memory
from lightning_autosp.errors import AutoSPError
from lightning_autosp.passes.accounting import OP_KINDS, SavedActivations, list_saved_activations, node_kind

__all__ = ["SACConfig", "RECOMPUTABLE_KINDS", "sac_tag_pass", "SACPartitioner"]

log = logging.getLogger(__name__)

#: kinds SAC may recompute; attention and collectives are always saved
RECOMPUTABLE_KINDS = ("linear", "norm", "embedding", "loss", "other")
_ALWAYS_SAVED = ("attention", "all_to_all")


@dataclass(frozen=True)
class SACConfig:
    """What sequence-aware activation checkpointing may recompute.

    Args:
        recompute: op kinds whose forward ops are recomputed in backward instead of saved, out
            of :data:`RECOMPUTABLE_KINDS`. ``"linear"`` covers matmuls (attention projections,
            MLPs, the LM head) and MLP activations; ``"norm"`` layer/RMS norms. Attention and
            collectives are always saved and cannot be listed.
        memory_budget: ``activation_memory_budget`` of the min-cut partitioner for the ops left
            to it, in ``(0, 1]``. ``1`` (default) keeps its runtime-optimal choice; smaller values
            let it recompute more to save memory. Attention and collectives stay saved at any
            budget.
    """

    recompute: tuple[str, ...] = ("linear", "norm")
    memory_budget: float = 1.0

    def __post_init__(self) -> None:
        rec = self.recompute
        if isinstance(rec, str) or not isinstance(rec, (tuple, list)):
            raise ValueError(
                f"sac_recompute={rec!r}: expected a list of op kinds out of {list(RECOMPUTABLE_KINDS)}."
            )
        bad = [k for k in rec if k not in RECOMPUTABLE_KINDS]
        if bad:
            why = (
                "attention and collectives are always saved (recomputing them would re-run O(s^2) "
                "attention or re-issue communication in backward)"
                if any(k in _ALWAYS_SAVED for k in bad)
                else f"known kinds are {list(OP_KINDS)}"
            )
            raise ValueError(
                f"sac_recompute={list(rec)!r}: cannot recompute {bad}; {why}. "
                f"Choose from {list(RECOMPUTABLE_KINDS)}."
            )
        object.__setattr__(self, "recompute", tuple(dict.fromkeys(rec)))
        b = self.memory_budget
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b <= 1:
            raise ValueError(
                f"sac_memory_budget={b!r}: expected a number in (0, 1]. 1 keeps the partitioner's "
                "runtime-optimal choice; 0 is not allowed because the partitioner then recomputes "
                "everything, collectives and attention included."
            )
        object.__setattr__(self, "memory_budget", float(b))


def _is_collective(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in memory.COLLECTIVE_NAMESPACES


_VIEWS = frozenset({"view", "_unsafe_view", "reshape", "slice", "alias", "expand", "t", "permute", "transpose", "unsqueeze"})


def _is_view(node: fx.Node) -> bool:
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
        if _is_collective(n) or (n.target is operator.getitem and _is_collective(n.args[0])):
            return chain if copies == 1 else []
        if _op_name(n) == "aten::clone":
            copies += 1
        elif not _is_view(n):
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
            todo.extend(u for u in n.users if u in fwd and (_is_view(u) or _op_name(u) == _WAIT))
    return out


#: what may stand between a parameter shard and its all-gather: a cast to ``param_dtype``, the
#: padding of an uneven shard to the common size
_SHARD_PREP = frozenset({"_to_copy", "convert_element_type", "constant_pad_nd", "contiguous", "clone"})


def _shard_prep(gather: fx.Node) -> list[fx.Node]:
    """The views and :data:`_SHARD_PREP` ops between an all-gather and what it reads first."""
    chain, src = [], gather.args[0]
    while isinstance(src, fx.Node) and src.op == "call_function" and (_is_view(src) or (_op_name(src) or "").rpartition("::")[2].split(".")[0] in _SHARD_PREP):
        chain.append(src)
        src = src.args[0]
    return chain


def gathered_input(node: fx.Node) -> Optional[fx.Node]:
    """If ``node`` is an all-gather of a graph input (through views and :data:`_SHARD_PREP`
    ops), that input (a placeholder); otherwise ``None``."""
    if _op_name(node) not in _GATHERS:
        return None
    chain = _shard_prep(node)
    src = chain[-1].args[0] if chain else node.args[0]
    return src if isinstance(src, fx.Node) and src.op == "placeholder" else None


# the functional all-gather (the autograd variant traces to the plain one) and its wait
_GATHERS = ("_c10d_functional::all_gather_into_tensor", "_c10d_functional_autograd::all_gather_into_tensor")
_WAIT = "_c10d_functional::wait_tensor"
_FUSED_LOSS = "autosp_loss::linear_cross_entropy"


def _op_name(node: fx.Node) -> Optional[str]:
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


def _recomputes(node: fx.Node, fw_names: set[str]) -> bool:
    """Whether backward node ``node`` runs a forward op again: it keeps the forward node's name,
    or replays a random forward op's RNG state."""
    return node.op == "call_function" and (node.name in fw_names or node.target is run_with_rng_state)


def _is_fused_loss(node: fx.Node) -> bool:
    return _op_name(node) == _FUSED_LOSS


def _is_attention(node: fx.Node) -> bool:
    name = _op_name(node)
    return name is not None and memory.op_kind(name) == "attention"


def _is_random(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags


def _has_tensor_output(node: fx.Node) -> bool:
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


def sac_tag_pass(joint: fx.GraphModule, *, num_fwd_outputs: int, config: SACConfig) -> fx.GraphModule:
    """Tag the forward nodes of an AOT joint graph with the SAC checkpoint policy (in place).

    Postcondition: the all-gathers of parameter shards (:func:`parameter_gathers`), the casts and
    pads before them, their waits and views are ``MUST_RECOMPUTE``; every other forward collective and the fused vocabulary
    loss, with their ``getitem`` outputs, and every attention op, its ``getitem`` outputs and
    its tensor inputs are ``MUST_SAVE``, except an input that is a copy of exchanged KV heads
    (:func:`repeat_of_exchange`), whose copy and views are ``PREFER_RECOMPUTE``; every other forward op whose kind is in
    ``config.recompute`` (random ops excepted) is ``PREFER_RECOMPUTE``, with the ``getitem``
    outputs of a multi-output op tagged like the op; nothing else is tagged.
    """
    fwd = forward_nodes(joint, num_fwd_outputs)

    def save(n: fx.Node) -> None:
        if n.op == "call_function":
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE

    for node in parameter_gathers(joint, fwd):
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    for node in joint.graph.nodes:
        if node.op != "call_function" or node not in fwd or "recompute" in node.meta:
            continue
        if _is_collective(node) or _is_fused_loss(node):
            for n in (node, *(u for u in node.users if u.target is operator.getitem)):
                save(n)
        elif _is_attention(node):
            save(node)
            for u in node.users:
                if u.target is operator.getitem:
                    save(u)
            for a in node.all_input_nodes:
                if not isinstance(a.meta.get("val"), torch.Tensor):
                    continue
                repeat = repeat_of_exchange(a)
                for n in repeat:  # a repeat of exchanged KV heads: keep the exchanged heads instead
                    n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
                if not repeat:
                    save(a)
    for node in joint.graph.nodes:
        if node.op != "call_function" or node not in fwd or "recompute" in node.meta:
            continue
        if node.target is operator.getitem or not _has_tensor_output(node) or _is_random(node):
            continue  # getitems follow the multi-output op they read
        kind = node_kind(node)
        if kind in config.recompute:
            for n in (node, *(u for u in node.users if u.target is operator.getitem)):
                n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    return joint


def _recomputed_ops(fw: fx.GraphModule, bw: fx.GraphModule) -> dict[str, int]:
    fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    counts: Counter = Counter()
    for n in bw.graph.nodes:
        if _recomputes(n, fw_names):
            name = _op_name(n) or getattr(n.target, "__name__", str(n.target))
            counts[name.rpartition("::")[2]] += 1
    return dict(counts)


class SACPartitioner(CustomPartitionerFn):
    """The partition function of one AutoSP compile.

    ``config=None``: ``partition_fn`` unchanged (only the bookkeeping is added). Otherwise
    :func:`sac_tag_pass`, then ``partition_fn`` under ``config.memory_budget``. Either way the
    result is checked - no collective and no attention op of the forward runs again in
    backward - and the saved activations of the forward graph are appended to :attr:`records`.

    Usable as AOT autograd's ``partition_fn`` and as inductor's ``custom_partitioner_fn``.

    Args:
        config: the SAC policy, or ``None`` for no tags.
        partition_fn: the AOT partition function that splits the (tagged) joint graph, with
            AOT autograd's signature ``(joint, joint_inputs, *, num_fwd_outputs, ...) -> (fw, bw)``.
            The default, PyTorch's min-cut partitioner, is the one that honours the tags;
            ``torch._functorch.partitioners.default_partition`` saves what eager autograd saves
            (the memory benchmark's eager baselines).
    """

    def __init__(
        self,
        config: Optional[SACConfig] = None,
        partition_fn: Callable[..., tuple[fx.GraphModule, fx.GraphModule]] = min_cut_rematerialization_partition,
    ) -> None:
        self.config = config
        self.partition_fn = partition_fn
        self.records: list[SavedActivations] = []
        self.seconds = 0.0  # spent in __call__ so far

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        start = time.perf_counter()
        num_fwd_outputs: int = kwargs["num_fwd_outputs"]
        budget = 1.0
        if self.config is not None:
            sac_tag_pass(gm, num_fwd_outputs=num_fwd_outputs, config=self.config)
            budget = self.config.memory_budget
        # a budget partition may be given up: it partitions a copy of the joint graph, since the
        # partitioner edits the graph it partitions (it functionalizes the RNG of the random ops it
        # recomputes, adding inputs), and those edits would carry into the fallback's partition
        trial = fx.GraphModule(gm, copy.deepcopy(gm.graph)) if budget < 1 else gm
        fw, bw = self._partition(trial, joint_inputs, budget, kwargs)
        violation = self._violation(trial, fw, bw, num_fwd_outputs)
        if violation and budget < 1:
            # torch's budget solver mishandles MUST_SAVE on multi-output ops (attention): it may
            # save the op's tuple, or neither the op nor its outputs. Keep the invariants and
            # give up the budget for this graph.
            log.warning(
                "AutoSP SAC: with sac_memory_budget=%s the partitioner %s; using the budget-free "
                "partition for this graph instead. Raise sac_memory_budget or recompute fewer kinds.",
                budget, violation,
            )
            fw, bw = self._partition(gm, joint_inputs, 1.0, kwargs)
            violation = self._violation(gm, fw, bw, num_fwd_outputs)
        if violation:
            raise AutoSPError(
                f"internal: the partitioner {violation}. Report this; `AutoSPStrategy(sac=False)` is a workaround."
            )
        record = SavedActivations(
            tensors=list_saved_activations(fw, num_fwd_outputs),
            fw_collectives=memory.count_ops(fw),
            bw_collectives=memory.count_ops(bw),
            recomputed=_recomputed_ops(fw, bw),
            sac=self.config is not None,
        )
        self.records.append(record)
        self.seconds += time.perf_counter() - start
        log.debug(
            "AutoSP partition (sac=%s): %d saved tensors, recomputed %s", self.config, len(record.tensors), record.recomputed
        )
        return fw, bw

    def _partition(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], budget: float, kwargs: dict
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        prepare_recompute_tags(gm)  # the tags as this torch's partitioner reads them
        ctx = torch._functorch.config.patch(activation_memory_budget=budget) if budget < 1 else contextlib.nullcontext()
        with ctx:
            return self.partition_fn(gm, joint_inputs, **kwargs)

    @staticmethod
    def _violation(joint: fx.GraphModule, fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> Optional[str]:
        """Why the partition is unusable - it saves a multi-output op's tuple, or a forward
        collective, attention op or fused vocabulary loss would run again in backward - or ``None``."""
        saved = torch.utils._pytree.tree_leaves(fw.graph.find_nodes(op="output")[0].args[0])[num_fwd_outputs:]
        tuples = [n.name for n in saved if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), (tuple, list))]
        if tuples:
            return f"would save multi-output op(s) {tuples} whole instead of their outputs"
        fwd = forward_nodes(joint, num_fwd_outputs)
        joint_bw = sum(1 for n in joint.graph.nodes if n not in fwd and _is_collective(n))
        regathered = {n.name for n in joint.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE}
        got_bw = memory.count_ops(bw) - sum(1 for n in bw.graph.nodes if n.name in regathered and _is_collective(n))
        if got_bw != joint_bw:
            return (
                f"put {got_bw} collectives in the backward graph where autograd needs {joint_bw} "
                "(a forward collective would be re-issued)"
            )
        fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}
        for what, is_op in (("attention op(s)", _is_attention), ("the fused vocabulary loss", _is_fused_loss)):
            ran = {_op_name(n) for n in fw.graph.nodes if is_op(n)}
            again = [f"{_op_name(n).rpartition('::')[2]} ({n.name})" for n in bw.graph.nodes if _recomputes(n, fw_names) and _op_name(n) in ran]
            if again:
                return f"would recompute {what} {again} in backward"
        return None

    # inductor's cache keys the compiled graph on this; the records are not part of it
    def uuid(self) -> Any:
        partition = f"{self.partition_fn.__module__}.{self.partition_fn.__qualname__}"
        return (get_hash_for_files((__file__, memory.__file__)), repr(self.config), partition)

    def __getstate__(self) -> dict:
        return {"config": self.config, "partition_fn": self.partition_fn}

    def __setstate__(self, state: dict) -> None:
        self.config = state["config"]
        self.partition_fn = state["partition_fn"]
        self.records = []
        self.seconds = 0.0
