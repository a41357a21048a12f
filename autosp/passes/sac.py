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

Op kinds are those of the memory report (:data:`autosp.passes.accounting.OP_KINDS`), so what
SAC recomputes is what the :class:`~lightning_autosp.monitor.ActivationMemoryMonitor` shows
shrinking.

:class:`SACPartitioner` is the partition function of one AutoSP compile: tag (when SAC is on),
run ``min_cut_rematerialization_partition``, check the postcondition, and record the saved
activations (:class:`~autosp.passes.accounting.SavedActivations`). It is passed explicitly to
AOT autograd (``aot_eager``) or as inductor's ``custom_partitioner_fn`` config patch for our
compile only, so any other ``torch.compile`` in the process is unaffected.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import re
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

from autosp._compat import prepare_recompute_tags
from autosp.ops import live_tiles as _live_tiles, ring_attention as _ring_attention  # noqa: F401  (register the map ops)
from autosp.passes.attention_schemes import schemes
from autosp.passes.checkpoints import checkpoint_region_of
from autosp.passes import accounting as memory
from autosp.passes import offload as offload_module
from autosp.passes.offload import OffloadConfig, OffloadPlan
from autosp.errors import AutoSPError
from autosp.passes.accounting import OP_KINDS, SavedActivations, list_saved_activations, node_kind
from autosp.passes.joint_graph import (
    contiguous_before_variable_pads,
    forward_nodes,
    has_tensor_output,
    is_attention,
    is_collective,
    is_fused_loss,
    is_random,
    op_name,
    score_program_leaves,
    parameter_gathers,
    recomputes,
    repeat_of_exchange,
)

__all__ = ["SACConfig", "RECOMPUTABLE_KINDS", "sac_tag_pass", "block_tag_pass", "block_of", "SACPartitioner"]

log = logging.getLogger(__name__)

#: kinds SAC may recompute; attention and collectives are always saved
RECOMPUTABLE_KINDS = ("linear", "norm", "embedding", "loss", "other")
_ALWAYS_SAVED = ("attention", *dict.fromkeys(s.collective_kind for s in schemes()))


@dataclass(frozen=True)
class SACConfig:
    """What sequence-aware activation checkpointing may recompute.

    Args:
        recompute: op kinds whose forward ops are recomputed in backward instead of saved, out
            of :data:`RECOMPUTABLE_KINDS`. ``"linear"`` covers matmuls (attention projections,
            MLPs, the LM head) and MLP activations; ``"norm"`` layer/RMS norms. Attention and
            collectives are always saved and cannot be listed.
        block: save only what each transformer block (a module of a ``ModuleList``, as
            ``model.layers.3``) hands on and recompute the rest of the block in backward, attention
            and its all-to-alls included (:func:`block_tag_pass`): the least memory, for one more
            forward of every block. Ops outside the blocks (embedding, final norm, the loss) keep
            the policy above.
        memory_budget: ``activation_memory_budget`` of the min-cut partitioner for the ops left
            to it, in ``(0, 1]``. ``1`` (default) keeps its runtime-optimal choice; smaller values
            let it recompute more to save memory. Attention and collectives stay saved at any
            budget.
    """

    recompute: tuple[str, ...] = ("linear", "norm")
    memory_budget: float = 1.0
    #: recompute each transformer block whole from its input (``AutoSPStrategy(sac="block")``):
    #: attention and its all-to-alls run again in backward; only the blocks' outputs are saved
    block: bool = False

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


def sac_tag_pass(joint: fx.GraphModule, *, num_fwd_outputs: int, config: SACConfig) -> fx.GraphModule:
    """Tag the forward nodes of an AOT joint graph with the SAC checkpoint policy (in place).

    Postcondition: the all-gathers of parameter shards (:func:`parameter_gathers`), the casts and
    pads before them, their waits and views are ``MUST_RECOMPUTE``; every other forward collective and the fused vocabulary
    loss, with their ``getitem`` outputs, and every attention op, its ``getitem`` outputs and
    its tensor inputs are ``MUST_SAVE``, except an input that is a copy of exchanged KV heads
    (:func:`repeat_of_exchange`), whose copy and views are ``PREFER_RECOMPUTE``, and the leaves of a
    tiled attention's score program (positions, document ids, padding: :func:`score_program_leaves`),
    which with the untagged forward ops they come from are ``PREFER_RECOMPUTE``; every other forward op whose kind is in
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
        if is_collective(node) or is_fused_loss(node):
            for n in (node, *(u for u in node.users if u.target is operator.getitem)):
                save(n)
        elif is_attention(node):
            save(node)
            for u in node.users:
                if u.target is operator.getitem:
                    save(u)
            leaves = set(score_program_leaves(node))
            for n in _recomputable_ancestors(leaves, fwd):  # the score program's index arithmetic: redone from the inputs
                n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
            for a in node.all_input_nodes:
                if a in leaves:
                    continue
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
        if node.target is operator.getitem or not has_tensor_output(node) or is_random(node):
            continue  # getitems follow the multi-output op they read
        kind = node_kind(node)
        if kind in config.recompute:
            for n in (node, *(u for u in node.users if u.target is operator.getitem)):
                n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    return joint


_BLOCK = re.compile(r"^(.*)\.(\d+)$")
_MODULES_ITEM = re.compile(r"\._modules\['([^']+)'\]")


def block_of(node: fx.Node) -> Optional[str]:
    """The outermost module of ``node`` that is an element of a ``ModuleList`` (``...layers.3``;
    torch 2.9's Dynamo spells it ``..._modules['layers']._modules['3']``)."""
    for value in (node.meta.get("nn_module_stack") or {}).values():
        path = _MODULES_ITEM.sub(r".\1", value[0] if isinstance(value, tuple) else str(value))
        if _BLOCK.match(path):
            return path
    return None


def block_tag_pass(
    joint: fx.GraphModule, *, num_fwd_outputs: int, block_of: Callable[[fx.Node], Optional[str]] = block_of,
) -> fx.GraphModule:
    """Tag a joint graph for whole-block recomputation (in place): in every transformer block,
    the forward values a later block, the rest of the step or the caller reads are ``MUST_SAVE``
    and every other forward op of the block is ``MUST_RECOMPUTE`` - attention and collectives
    included. Untagged ops (outside the blocks) are left to :func:`sac_tag_pass`. ``block_of``
    names a node's block (default: its ``ModuleList`` element; the user's checkpointed regions:
    :func:`~autosp.passes.checkpoints.checkpoint_region_of`)."""
    fwd = forward_nodes(joint, num_fwd_outputs)
    # ops a pass inserted (the SP pass's all-to-alls, pads, slices) carry no module stack: they are
    # in a block when the ops around them, in program order, are in that same block - so every SP
    # rank, whatever its token count, tags the same collectives
    order = [n for n in joint.graph.nodes if n in fwd and n.op == "call_function"]
    own = {n: block_of(n) for n in order if n.meta.get("nn_module_stack") or n.meta.get("custom")}
    before: list[Optional[str]] = []
    last: Optional[str] = None
    for n in order:
        last = own[n] if n in own else last
        before.append(last)
    blocks: dict[fx.Node, Optional[str]] = {}
    nxt: Optional[str] = None
    for n, prev in zip(reversed(order), reversed(before)):
        if n in own:
            blocks[n] = nxt = own[n]
        else:
            blocks[n] = prev if prev is not None and prev == nxt else None
    output = joint.graph.find_nodes(op="output")[0]
    fwd_outputs = set(torch.utils._pytree.tree_leaves(output.args[0])[:num_fwd_outputs])
    for n, block in blocks.items():
        if block is None:
            continue
        leaves = n in fwd_outputs or any(u in fwd and blocks.get(u) != block for u in n.users if u is not output)
        # a mask's map of live tiles (a few bytes on the host) is made once per step: recomputing it would read the device again
        leaves = leaves or n.target in _MASK_MAPS
        n.meta["recompute"] = CheckpointPolicy.MUST_SAVE if leaves else CheckpointPolicy.MUST_RECOMPUTE
    return joint


#: the ops that make a mask's maps of live tiles on the host (:mod:`autosp.ops.live_tiles`, the ring's)
_MASK_MAPS = (torch.ops.autosp_attn.live_tiles.default, torch.ops.autosp_attn.ring_live_tiles.default)


def _recomputable_ancestors(leaves: set[fx.Node], fwd: set[fx.Node]) -> list[fx.Node]:
    """The leaves of a tiled attention's score program and the forward ops they are computed from
    (positions, document ids, padding masks: ``O(S)`` index arithmetic on the step's inputs), up to
    the graph inputs - but none that is a collective, random, or already tagged."""
    out, todo, seen = [], list(leaves), set()
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function" or n not in fwd:
            continue
        seen.add(n)
        if is_collective(n) or is_random(n) or is_attention(n) or "recompute" in n.meta:
            continue
        out.append(n)
        todo.extend(n.all_input_nodes)
    return out


def _recomputed_ops(fw: fx.GraphModule, bw: fx.GraphModule) -> dict[str, int]:
    fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    counts: Counter = Counter()
    for n in bw.graph.nodes:
        if recomputes(n, fw_names):
            name = op_name(n) or getattr(n.target, "__name__", str(n.target))
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
        checked: refuse a partition that runs attention or a collective again in backward;
            ``False`` accepts it (the memory benchmark's full activation checkpointing, which
            recomputes attention by design).
        offload: move saved activations to host memory after the partition
            (:mod:`autosp.passes.offload`); ``None``: keep them on the device. What each
            graph moved is appended to :attr:`offload_plans`.
    """

    def __init__(
        self,
        config: Optional[SACConfig] = None,
        partition_fn: Callable[..., tuple[fx.GraphModule, fx.GraphModule]] = min_cut_rematerialization_partition,
        checked: bool = True,
        offload: Optional[OffloadConfig] = None,
    ) -> None:
        self.config = config
        self.partition_fn = partition_fn
        self.checked = checked
        self.offload = offload
        self.offload_plans: list[OffloadPlan] = []
        self.records: list[SavedActivations] = []
        self.seconds = 0.0  # spent in __call__ so far

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        start = time.perf_counter()
        num_fwd_outputs: int = kwargs["num_fwd_outputs"]
        contiguous_before_variable_pads(gm)
        budget = 1.0
        regions = any(checkpoint_region_of(n) is not None for n in gm.graph.nodes)
        if self.config is not None and self.config.block:
            block_tag_pass(gm, num_fwd_outputs=num_fwd_outputs)
        elif regions:  # the user's gradient checkpointing: each region recomputed whole, as sac="block" does a block
            block_tag_pass(gm, num_fwd_outputs=num_fwd_outputs, block_of=checkpoint_region_of)
        if self.config is not None:
            sac_tag_pass(gm, num_fwd_outputs=num_fwd_outputs, config=self.config)
            budget = self.config.memory_budget
        # a budget partition may be given up: it partitions a copy of the joint graph, since the
        # partitioner edits the graph it partitions (it functionalizes the RNG of the random ops it
        # recomputes, adding inputs), and those edits would carry into the fallback's partition
        trial = fx.GraphModule(gm, copy.deepcopy(gm.graph)) if budget < 1 else gm
        fw, bw = self._partition(trial, joint_inputs, budget, kwargs)
        block = regions or (self.config is not None and self.config.block)  # recomputes attention and collectives by design
        violation = self._violation(trial, fw, bw, num_fwd_outputs, tuples_only=block) if self.checked else None
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
            violation = self._violation(gm, fw, bw, num_fwd_outputs, tuples_only=block)
        if violation:
            raise AutoSPError(
                f"internal: the partitioner {violation}. Report this; `AutoSPStrategy(sac=False)` is a workaround."
            )
        if self.offload is not None:
            self.offload_plans.append(offload_module.offload_saved_activations(fw, bw, num_fwd_outputs, self.offload))
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
    def _violation(
        joint: fx.GraphModule, fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, tuples_only: bool = False
    ) -> Optional[str]:
        """Why the partition is unusable - it saves a multi-output op's tuple, or (unless
        ``tuples_only``) a forward collective, attention op or fused vocabulary loss would run again
        in backward - or ``None``."""
        saved = torch.utils._pytree.tree_leaves(fw.graph.find_nodes(op="output")[0].args[0])[num_fwd_outputs:]
        tuples = [n.name for n in saved if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), (tuple, list))]
        if tuples:
            return f"would save multi-output op(s) {tuples} whole instead of their outputs"
        if tuples_only:
            return None
        fwd = forward_nodes(joint, num_fwd_outputs)
        joint_bw = sum(1 for n in joint.graph.nodes if n not in fwd and is_collective(n))
        regathered = {n.name for n in joint.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE}
        got_bw = memory.count_ops(bw) - sum(1 for n in bw.graph.nodes if n.name in regathered and is_collective(n))
        if got_bw != joint_bw:
            return (
                f"put {got_bw} collectives in the backward graph where autograd needs {joint_bw} "
                "(a forward collective would be re-issued)"
            )
        fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}
        for what, is_op in (("attention op(s)", is_attention), ("the fused vocabulary loss", is_fused_loss)):
            ran = {op_name(n) for n in fw.graph.nodes if is_op(n)}
            again = [f"{op_name(n).rpartition('::')[2]} ({n.name})" for n in bw.graph.nodes if recomputes(n, fw_names) and op_name(n) in ran]
            if again:
                return f"would recompute {what} {again} in backward"
        return None

    # inductor's cache keys the compiled graph on this; the records are not part of it
    def uuid(self) -> Any:
        partition = f"{self.partition_fn.__module__}.{self.partition_fn.__qualname__}"
        files = (__file__, memory.__file__, offload_module.__file__)
        return (get_hash_for_files(files), repr(self.config), partition, self.checked, repr(self.offload))

    def __getstate__(self) -> dict:
        return {"config": self.config, "partition_fn": self.partition_fn, "checked": self.checked, "offload": self.offload}

    def __setstate__(self, state: dict) -> None:
        self.config = state["config"]
        self.partition_fn = state["partition_fn"]
        self.checked = state.get("checked", True)
        self.offload = state.get("offload")
        self.offload_plans = []
        self.records = []
        self.seconds = 0.0
