"""Activation offload: saved activations moved to host memory in forward, back in backward.

After the partition, the forward graph returns, after the user outputs, the tensors backward
needs. :func:`offload_saved_activations` picks some of them (:func:`plan_offload`) and, in the
partitioned graphs:

* forward: the saved tensor ``x`` is returned as ``autosp_offload::offload(x)``, a copy in host
  memory made right after ``x`` is computed, so the device copy is freed after its last forward
  use instead of living until backward;
* backward: the host copy is brought back with ``autosp_offload::reload(h, device)`` just before
  its first use.

Both are ``torch.library`` ops of our own (the same on every torch of the declared range; torch's
``ao::offload`` ops are private and missing from older releases). They keep shape, dtype and
strides, so the backward graph reads exactly the values it read before: same loss and gradients.

On CUDA the host buffers are pinned and both copies are queued on the current stream without
blocking the CPU; the stream orders them after the producer and before the consumer. They do not
yet overlap with compute (no copy stream, no prefetch). On CPU the same graph runs and the copies
are host to host: what is tested here is the numerics and the graph; the device peak waits for a
GPU (``benchmarks/gpu_check.py``).

Planning (:func:`plan_offload`): ``activation_offload=True`` offloads every saved activation;
``"auto"`` offloads the ones saved earliest in forward (the last backward needs), until what stays
on the device fits ``memory_budget`` - nothing when everything fits, nothing without a budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.fx as fx
from autosp._compat import dense_or_false
from torch.utils._pytree import tree_leaves

from autosp.passes.accounting import producer
from autosp.passes.placement import hinted_bytes

__all__ = ["OffloadConfig", "OffloadPlan", "offload", "reload", "plan_offload", "offload_saved_activations", "parse_bytes"]

log = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Union[int, float, str], name: str = "memory_budget") -> int:
    """``80_000_000_000``, ``"80GB"``, ``"74.5GiB"`` -> bytes; a ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool):
        value = None  # type: ignore[assignment]
    if isinstance(value, (int, float)) and value >= 0:
        return int(value)
    if isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(digits):]
        try:
            number = float(digits)
        except ValueError:
            number = -1.0
        if unit in _UNITS and number >= 0:
            return int(number * _UNITS[unit])
    raise ValueError(
        f"{name}={value!r}: expected bytes per rank as a non-negative number or a string such as '60GB' or '55.5GiB'."
    )


@dataclass(frozen=True)
class OffloadConfig:
    """Which saved activations go to host memory (the strategies' ``activation_offload`` and
    ``memory_budget``).

    Args:
        mode: ``True`` offloads every saved activation, ``"auto"`` only what ``budget`` requires.
        budget: bytes of saved activations per rank that may stay on the device (``"auto"``;
            ``None``: nothing is offloaded).
    """

    mode: Union[bool, str] = "auto"
    budget: Optional[int] = None

    def __post_init__(self) -> None:
        if self.mode not in (True, "auto"):
            raise ValueError(
                f"activation_offload={self.mode!r}: pass True (every saved activation to host memory), 'auto' "
                "(only what memory_budget requires) or False (keep them on the device)."
            )
        if self.budget is not None:
            object.__setattr__(self, "budget", parse_bytes(self.budget))


@dataclass
class OffloadPlan:
    """What :func:`offload_saved_activations` did to one partitioned graph pair."""

    #: forward nodes whose saved value now lives in host memory
    offloaded: tuple[str, ...] = ()
    #: bytes of those, at the sizes the graph was traced with
    offloaded_bytes: int = 0
    #: bytes saved for backward in all, at the same sizes
    saved_bytes: int = 0
    #: the budget planned against (``None``: offload forced on)
    budget: Optional[int] = None


# --------------------------------------------------------------------------- the ops
def _empty_like_strided(x: torch.Tensor, device: torch.device, pin: bool = False) -> torch.Tensor:
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device, pin_memory=pin)


@torch.library.custom_op("autosp_offload::offload", mutates_args=())
def offload(x: torch.Tensor) -> torch.Tensor:
    """A host-memory copy of ``x`` with its shape and strides (pinned when ``x`` is on CUDA)."""
    out = _empty_like_strided(x, torch.device("cpu"), pin=x.is_cuda)
    out.copy_(x, non_blocking=x.is_cuda)
    return out


@offload.register_fake
def _offload_fake(x: torch.Tensor) -> torch.Tensor:
    return _empty_like_strided(x, torch.device("cpu"))


def _fake_on(val: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor like the fake ``val`` on ``device`` (the meta of a node the rewrite adds)."""
    with val.fake_mode:
        return _empty_like_strided(val, device)


@torch.library.custom_op("autosp_offload::reload", mutates_args=())
def reload(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of the host tensor ``x`` on ``device``, with its shape and strides."""
    out = _empty_like_strided(x, device)
    out.copy_(x, non_blocking=out.is_cuda)
    return out


@reload.register_fake
def _reload_fake(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return _empty_like_strided(x, device)


def is_offload(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.autosp_offload.offload.default


# --------------------------------------------------------------------------- planning and rewriting
def _candidates(fw: fx.GraphModule, num_fwd_outputs: int) -> list[tuple[int, fx.Node, int]]:
    """``(position in the forward's outputs, node, bytes)`` of each saved activation that can move:
    a tensor computed in forward (not a graph input, not a view of one), dense (its copy keeps its
    strides), not also returned to the caller (that one stays on the device anyway), in forward
    order."""
    outs = tree_leaves(fw.graph.find_nodes(op="output")[0].args[0])
    order = {n: i for i, n in enumerate(fw.graph.nodes)}
    returned = {producer(n) for n in outs[:num_fwd_outputs] if isinstance(n, fx.Node)}
    seen: set[fx.Node] = set()
    found = []
    for pos, n in enumerate(outs):
        if pos < num_fwd_outputs or not isinstance(n, fx.Node) or n.op != "call_function":
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.numel() == 0 or not dense_or_false(val):
            continue
        if producer(n).op == "placeholder" or producer(n) in returned or n in seen:
            continue
        seen.add(n)
        found.append((pos, n, hinted_bytes(val)))
    return sorted(found, key=lambda item: order[item[1]])


def plan_offload(sizes: list[int], config: OffloadConfig) -> tuple[list[bool], Optional[int]]:
    """Which of the saved activations (their bytes, in forward order) to offload, and the budget
    used: all of them when forced on; with ``"auto"`` the earliest until the rest fits."""
    if config.mode is True:
        return [True] * len(sizes), None
    budget = config.budget
    if budget is None:
        return [False] * len(sizes), None
    remaining = sum(sizes)
    chosen = []
    for size in sizes:
        take = remaining > budget
        chosen.append(take)
        if take:
            remaining -= size
    return chosen, budget


def offload_saved_activations(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, config: OffloadConfig) -> OffloadPlan:
    """Move the saved activations :func:`plan_offload` picks to host memory (in place on both
    graphs): offload right after forward computes them, reload right before backward first reads
    them."""
    found = _candidates(fw, num_fwd_outputs)
    total = sum(size for _, _, size in found)
    if not found:
        return OffloadPlan(saved_bytes=total, budget=config.budget)
    chosen, budget = plan_offload([size for _, _, size in found], config)
    placeholders = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    out_node = fw.graph.find_nodes(op="output")[0]
    outs = list(out_node.args[0])  # AOT's partitioned forward returns a flat tuple
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    moved, moved_bytes = [], 0
    for (pos, node, size), take in zip(found, chosen):
        ph = placeholders.get(node.name)
        if not take or ph is None:  # a saved value the backward does not read under its name: leave it
            continue
        val = node.meta["val"]
        with fw.graph.inserting_after(node):
            host = fw.graph.call_function(torch.ops.autosp_offload.offload.default, (node,))
        host.meta["val"] = _fake_on(val, torch.device("cpu"))
        for i, o in enumerate(outs):
            if o is node and i >= num_fwd_outputs:
                outs[i] = host
        first = min(ph.users, key=order.__getitem__, default=None)
        if first is None:
            continue
        dev_val = ph.meta["val"]
        with bw.graph.inserting_before(first):
            back = bw.graph.call_function(torch.ops.autosp_offload.reload.default, (ph, dev_val.device))
        back.meta["val"] = dev_val
        ph.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
        ph.meta["val"] = _fake_on(dev_val, torch.device("cpu"))
        moved.append(node.name)
        moved_bytes += size
    out_node.args = (type(out_node.args[0])(outs),)
    fw.graph.lint()
    bw.graph.lint()
    fw.recompile()
    bw.recompile()
    log.debug("AutoSP offload: %d of %d saved tensors (%d of %d bytes) to host memory", len(moved), len(found), moved_bytes, total)
    return OffloadPlan(tuple(moved), moved_bytes, total, budget)

