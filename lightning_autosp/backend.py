"""The AutoSP ``torch.compile`` backend: SP pass on the Dynamo graph, then the chosen backend."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import sympy
import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop

from lightning_autosp.memory.accounting import SavedActivations
from lightning_autosp.passes import SPPassStats, sequence_parallel_pass
from lightning_autosp.passes.sac import SACConfig, SACPartitioner

log = logging.getLogger(__name__)

__all__ = ["AutoSPBackend", "SUPPORTED_BACKENDS"]

SUPPORTED_BACKENDS = ("inductor", "aot_eager", "eager")
_AOT_BACKENDS = ("inductor", "aot_eager")


@dataclass
class AutoSPBackend:
    """A ``torch.compile`` backend for one SP rank.

    Holds only plain values (the group travels by name), so it pickles and deep-copies.
    ``graphs`` collects the :class:`SPPassStats` of every graph compiled through it.

    With ``backend="aot_eager"`` or ``"inductor"`` the joint graph is partitioned by a
    :class:`~lightning_autosp.passes.sac.SACPartitioner` given to this compile only (AOT
    autograd's ``partition_fn``, or inductor's ``custom_partitioner_fn`` config patch): with
    ``sac`` set it applies sequence-aware activation checkpointing, and either way it records
    the activations each training graph saves for backward in ``saved`` (one
    :class:`~lightning_autosp.memory.SavedActivations` per graph, sized for its latest call).
    Any other registered backend name is looked up and called unchanged (no SAC, no records).
    """

    sp_size: int
    sp_rank: int
    group_name: str
    seq_dim: int = 1
    backend: str = "inductor"
    sac: Optional[SACConfig] = None
    graphs: list[SPPassStats] = field(default_factory=list)
    saved: list[SavedActivations] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.sac is not None and self.backend not in _AOT_BACKENDS and self.backend != "eager":
            raise ValueError(
                f"AutoSPBackend(backend={self.backend!r}, sac=...): sequence-aware activation checkpointing "
                f"partitions the AOT joint graph, which only the {list(_AOT_BACKENDS)} backends expose here. "
                "Use one of them or pass sac=None."
            )

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        gm = sequence_parallel_pass(
            gm, example_inputs, sp_size=self.sp_size, sp_rank=self.sp_rank, group_name=self.group_name, seq_dim=self.seq_dim
        )
        self.graphs.append(gm.meta["autosp"])
        if self.backend not in _AOT_BACKENDS:
            if self.sac is not None:
                log.debug("AutoSP: backend %r runs eager autograd; SAC does not apply", self.backend)
            return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)
        partitioner = SACPartitioner(self.sac)
        compiled = self._compile_aot(gm, example_inputs, partitioner)
        if not partitioner.records:  # an inference graph (no_grad): nothing is saved
            return compiled
        record = partitioner.records[-1]
        getters = _size_getters(gm)
        record.symbols = tuple(name for name, _, _ in getters)
        self.saved.append(record)
        return _recording_sizes(compiled, record, getters)

    def _compile_aot(self, gm: fx.GraphModule, example_inputs: list[Any], partitioner: SACPartitioner) -> Callable:
        if self.backend == "aot_eager":
            # torch's aot_eager, with our partition function
            return aot_autograd(
                fw_compiler=boxed_nop, bw_compiler=boxed_nop, partition_fn=partitioner, keep_inference_input_mutations=True
            )(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        # The AOT autograd cache would skip partitioning (and so our records) on a hit; inductor's
        # FX graph cache still serves the compiled kernels.
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, config_patches={"custom_partitioner_fn": partitioner})

    @property
    def sdpa_rewritten(self) -> int:
        return sum(g.sdpa for g in self.graphs)

    @property
    def max_shift(self) -> int:
        return max((g.max_shift for g in self.graphs), default=0)


def _size_getters(gm: fx.GraphModule) -> list[tuple[str, int, Optional[int]]]:
    """For every size symbol of the graph's inputs: (name, input index, dim or None for a SymInt input)."""
    out: dict[str, tuple[str, int, Optional[int]]] = {}
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        val = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
            out.setdefault(str(val.node.expr), (str(val.node.expr), i, None))
        elif isinstance(val, torch.Tensor):
            for d, s in enumerate(val.shape):
                if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                    out.setdefault(str(s.node.expr), (str(s.node.expr), i, d))
    return list(out.values())


def _recording_sizes(compiled: Callable, record: SavedActivations, getters: list[tuple[str, int, Optional[int]]]) -> Callable:
    """Wrap a compiled graph so that each call stores its size-symbol values in ``record``.

    Dynamo calls a backend's result with the graph inputs as positional arguments.
    """

    def run(*args: Any) -> Any:
        record.binding = tuple(int(args[i]) if d is None else int(args[i].shape[d]) for _, i, d in getters)
        record.calls += 1
        return compiled(*args)

    return run
