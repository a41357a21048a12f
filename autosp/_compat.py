"""Every torch version gate of the core lives here (Lightning's: :mod:`lightning_autosp._compat`).

The supported range is the versions the compatibility subset (``make test-compat``, the tests
the Makefile lists) passed on; ``pyproject.toml`` declares the same range (a test checks it)
and docs/testing.md lists the versions tried and when. Importing ``autosp`` with a torch outside
it raises ``ImportError`` at once instead of failing later inside a compile.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.distributed as dist
import torch.fx as fx


@dataclass(frozen=True)
class SupportedRange:
    """``minimum <= version < below``, compared on the release numbers (``2.9.1+cu128`` is 2.9.1)."""

    package: str
    minimum: str
    below: str

    @property
    def requirement(self) -> str:
        """The pip requirement, as written in ``pyproject.toml``."""
        return f"{self.package}>={self.minimum},<{self.below}"

    def contains(self, version: str) -> bool:
        return release(self.minimum) <= release(version) < release(self.below)


#: oldest tested 2.9.1, newest 2.15.0; 2.8 and older untested (see
#: :data:`FORK_AFTER_COMPILE_BREAKS_AUTOGRAD` for what changed in 2.14).
TORCH_RANGE = SupportedRange("torch", "2.9", "2.16")
def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"2.9.1+cu128"`` -> ``(2, 9, 1)``,
    ``"2.16.0a0+git1234"`` -> ``(2, 16, 0)`` (a pre-release counts as its release)."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    if match is None:
        raise ValueError(f"cannot read a release number from version {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def check_torch(torch_version: str) -> None:
    """Raise ``ImportError`` if ``torch_version`` is outside :data:`TORCH_RANGE`."""
    if not TORCH_RANGE.contains(torch_version):
        raise ImportError(
            f"lightning-autosp: torch {torch_version} is installed, but lightning-autosp supports {TORCH_RANGE.requirement}. "
            f"Install a supported version (pip install '{TORCH_RANGE.requirement}'); docs/testing.md in the "
            "repository lists every version run."
        )


TORCH_VERSION = release(torch.__version__)

#: torch >= 2.14: once a backward has run on fake tensors in a process - and the AOT tracing of
#: every ``torch.compile`` of a training step runs one - autograd's worker threads are started,
#: and a process forked from it afterwards cannot run autograd ("Unable to handle autograd's
#: threading in combination with fork-based multiprocessing"). 2.13 and older start no threads
#: there. A forked launch (``start_method="fork"``, Lightning's ``ddp_notebook``) then works
#: only from a process that has not compiled a training step itself (checked on 2.14.1 and
#: 2.15.0: a plain backward in the parent is fine, a compiled one is not).
FORK_AFTER_COMPILE_BREAKS_AUTOGRAD = TORCH_VERSION >= (2, 14)

# torch >= 2.10 renamed reduce_scatter_tensor (the old name warns on every call).
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# ... and all_gather_into_tensor (all_gather_single; 2.13 warns on every call of the old name)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

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


def all_gather_autograd(tensor: torch.Tensor, gather_dim: int, group_name: str) -> torch.Tensor:
    """The differentiable functional all-gather (its adjoint is a reduce-scatter):
    ``all_gather_single_autograd`` from torch 2.13, ``all_gather_tensor_autograd`` before (which
    2.13 still has, with a deprecation warning)."""
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return gather(tensor, gather_dim, group_name)


#: torch's FX bucketing merges the sharded mode's collectives correctly from 2.13 (checked on
#: 2.13.0, 2.14.1 and 2.15.0; 2.15 once each collective has one wait, see
#: ``passes.bucketing.merge_duplicate_waits``): 2.9.1 merges all-gathers of shards cast to
#: bfloat16 into NaN (its merge expects the cast as prims.convert_element_type; aot_eager graphs
#: hold aten._to_copy) and loses Dynamo's
#: nn_module_stack in the partitioned graphs (no blocks to bucket by). 2.10 - 2.12 are unchecked.
#: Below it the parameters are gathered one collective each (correct, more collectives).
BUCKETING_MERGES = TORCH_VERSION >= (2, 13)


def merge_collective_buckets(gm: fx.GraphModule, gather_buckets: list, scatter_buckets: list) -> None:
    """Merge each bucket of functional all-gathers (reduce-scatters) of ``gm`` into one, with
    torch's FX bucketing (``torch._inductor.fx_passes.bucketing``, the passes behind inductor's
    ``bucket_all_gathers_fx``), in place."""
    from torch._inductor.fx_passes.bucketing import merge_all_gather, merge_reduce_scatter
    from torch._inductor.pattern_matcher import stable_topological_sort

    if gather_buckets:
        merge_all_gather(gm, gather_buckets)
    if scatter_buckets:
        merge_reduce_scatter(gm, scatter_buckets)
    # a merged collective sits where the bucket's last one was: move the earlier ones' users after it
    stable_topological_sort(gm.graph)


def provably_equal(size: torch.SymInt, expr: Any) -> bool:
    """Whether the guards of ``size``'s shape environment prove ``size == expr`` - the static
    evaluation ``statically_known_true`` makes of a SymBool, here of a sympy expression (ShapeEnv's
    ``_maybe_evaluate_static``, in torch 2.9-2.15 under this name); ``False`` when it cannot tell."""
    try:
        return bool(size.node.shape_env._maybe_evaluate_static(sympy.Eq(size.node.expr, expr)))
    except Exception:
        return False


def dense_or_false(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s strides are non-overlapping and dense, ``False`` where symbolic sizes
    leave it open (torch 2.9-2.15 all have this helper under the same name)."""
    return bool(torch._prims_common._is_non_overlapping_and_dense_or_false(tensor.shape, tensor.stride()))


#: Dynamo can trace a region under torch.utils.checkpoint whose forward sets Python state
#: (``skip_fwd_side_effects_in_bwd_under_checkpoint``; 2.13 and 2.15 have it, 2.9 does not)
TRACES_CHECKPOINT_SIDE_EFFECTS = hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint")


def checkpoint_tracing_config() -> dict:
    """Dynamo settings under which a region under ``torch.utils.checkpoint`` whose forward sets
    Python state (Hugging Face's kernel-selection context) is traced as one region instead of
    splitting the step into several graphs (where torch lacks the switch, prepare_for_compile refuses
    Hugging Face gradient checkpointing, see :data:`TRACES_CHECKPOINT_SIDE_EFFECTS`)."""
    return {"skip_fwd_side_effects_in_bwd_under_checkpoint": True} if TRACES_CHECKPOINT_SIDE_EFFECTS else {}
