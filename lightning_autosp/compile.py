"""The AutoSP ``torch.compile`` backend: SP pass on the Dynamo graph, then the chosen backend."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from lightning_autosp.passes import SPPassStats, sequence_parallel_pass

log = logging.getLogger(__name__)

__all__ = ["AutoSPBackend", "SUPPORTED_BACKENDS"]

SUPPORTED_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass
class AutoSPBackend:
    """A ``torch.compile`` backend for one SP rank.

    Holds only plain values (the group travels by name), so it pickles and deep-copies.
    ``graphs`` collects the :class:`SPPassStats` of every graph compiled through it.
    """

    sp_size: int
    sp_rank: int
    group_name: str
    seq_dim: int = 1
    backend: str = "inductor"
    graphs: list[SPPassStats] = field(default_factory=list)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        gm = sequence_parallel_pass(
            gm, example_inputs, sp_size=self.sp_size, sp_rank=self.sp_rank, group_name=self.group_name, seq_dim=self.seq_dim
        )
        self.graphs.append(gm.meta["autosp"])
        inner = torch._dynamo.lookup_backend(self.backend)
        return inner(gm, example_inputs)

    @property
    def sdpa_rewritten(self) -> int:
        return sum(g.sdpa for g in self.graphs)

    @property
    def max_shift(self) -> int:
        return max((g.max_shift for g in self.graphs), default=0)
