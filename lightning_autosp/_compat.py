"""Every torch version gate of the package lives here."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.fx as fx


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"2.9.1+cu128"`` -> ``(2, 9, 1)``,
    ``"2.16.0a0+git1234"`` -> ``(2, 16, 0)`` (a pre-release counts as its release)."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"cannot read a release number from version {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


TORCH_VERSION = release(torch.__version__)

# torch >= 2.10 renamed reduce_scatter_tensor (the old name warns on every call).
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# torch < 2.10: the min-cut partitioner (torch._functorch.partitioners.cleanup_recompute_tags)
# reads node.meta["ac_graph_id"] of every node tagged node.meta["recompute"] and raises KeyError
# without it; torch.utils.checkpoint sets both keys (one id per checkpointed region). 2.10 reads
# the id only where present ("no id" = outside any checkpoint region).
_PARTITIONER_NEEDS_AC_GRAPH_ID = TORCH_VERSION < (2, 10)
#: the region id of nodes tagged by our SAC policy (torch.utils.checkpoint numbers its regions from 1)
SAC_AC_GRAPH_ID = 0


def prepare_recompute_tags(joint: fx.GraphModule) -> fx.GraphModule:
    """Make the ``node.meta["recompute"]`` tags of an AOT joint graph readable by the installed
    partitioner (in place): on torch < 2.10, every tagged node without an ``ac_graph_id`` joins
    one region, :data:`SAC_AC_GRAPH_ID`, so the partitioner sees no region boundary between
    them, as 2.10 and newer do. No-op on torch >= 2.10."""
    if _PARTITIONER_NEEDS_AC_GRAPH_ID:
        for node in joint.graph.nodes:
            if "recompute" in node.meta:
                node.meta.setdefault("ac_graph_id", SAC_AC_GRAPH_ID)
    return joint


def graph_break_counter() -> dict:
    """Dynamo's running count of graph breaks by reason (read-only use, for error messages)."""
    from torch._dynamo.utils import counters

    return dict(counters.get("graph_break", {}))
