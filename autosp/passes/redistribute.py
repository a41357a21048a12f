"""Moving tensors between placements in the graph being built: Replicate <-> Shard.

The SP pass reads shapes from the *old* (single-device) graph and emits nodes into the *new*
one. :class:`Redistributor` owns the arithmetic that ties the two: which window of a sequence
axis this rank holds (:func:`~autosp.layout.shard_window` in symbolic form), the
slice that turns a replicated value into this rank's shard, and the all-gather that turns a
shard back into the full value. Each redistribution of an old node is emitted once and cached.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import sympy
import torch.fx as fx

from autosp.errors import AutoSPError
from autosp.layout import shard_window
from autosp.passes import runtime
from autosp.passes.placement import Shard, SizeEmitter, is_polynomial_quotient, shape_exprs

__all__ = ["Redistributor"]


class Redistributor:
    """Slices and gathers for one SP rank, emitted into ``graph``.

    Args:
        graph: the graph being built.
        new_value: old node -> its value in ``graph`` (filled by the pass as it goes).
        placements: old node -> its placement (filled by the pass as it goes).
        size_sources: size symbol -> a function emitting a node that holds it.
        seq: the global length of the sequence the pass splits (a size symbol, plus a constant
            when the step slices the batch before the model).
        sp_size, sp_rank, group_name: this rank's SP group.
    """

    def __init__(
        self,
        graph: fx.Graph,
        new_value: Mapping[fx.Node, Any],
        placements: Mapping[fx.Node, Any],
        size_sources: dict[sympy.Symbol, Callable[[], fx.Node]],
        seq: sympy.Expr,
        sp_size: int,
        sp_rank: int,
        group_name: str,
    ):
        self.graph = graph
        self.new_value = new_value
        self.placements = placements
        self.seq = seq
        self.sp_size = sp_size
        self.sp_rank = sp_rank
        self.group_name = group_name
        self.sizes = SizeEmitter(graph, size_sources, seq, sp_size)
        self._gathered: dict[fx.Node, fx.Node] = {}
        self._sliced: dict[tuple[fx.Node, Shard], fx.Node] = {}

    def emit(self, expr: Any) -> Any:
        """A size expression as an FX value (an int or a node) of the new graph."""
        return self.sizes.emit(expr)

    def window(self, shard: Shard) -> tuple[sympy.Expr, sympy.Expr]:
        """(first position of the sequence axis this rank holds, number held), symbolic."""
        start, count = shard_window(self.sp_rank, self.sp_size, self.sizes.chunk, shard.length, shard.off)
        return sympy.sympify(start), sympy.expand(count)

    def outer(self, node: fx.Node, shard: Shard) -> sympy.Expr:
        """The global size of the axes flattened before the sequence axis in ``shard.dim``."""
        outer = is_polynomial_quotient(shape_exprs(node.meta["example_value"])[shard.dim], shard.length * shard.inner)
        if outer is None:
            raise AutoSPError(f"internal: {node.name}'s dim {shard.dim} is not outer * {shard.length} * {shard.inner}")
        return outer

    def local_size(self, outer: sympy.Expr, shard: Shard) -> Any:
        """The local size of ``shard.dim`` on this rank, as an FX value."""
        _, count = self.window(shard)
        return self.emit(outer * count * shard.inner)

    def to_replicate(self, node: Any) -> Any:
        """The new-graph value of old node ``node`` with full (replicated) data."""
        if not isinstance(node, fx.Node):
            return node
        shard = self.placements.get(node)
        if not isinstance(shard, Shard):
            return self.new_value[node]
        if node not in self._gathered:  # [.., outer*len_r*inner, ..] -> [.., outer*length*inner, ..]
            start, count = self.window(shard)
            chunk = self.sizes.chunk
            # pad this rank's part to its whole base chunk (only a shifted axis needs it)
            left_pad = start + shard.off - self.sp_rank * chunk
            right_pad = (self.sp_rank + 1) * chunk - (start + count + shard.off)
            self._gathered[node] = self.graph.call_function(
                runtime.shard_gather,
                (
                    self.new_value[node], shard.dim, self.emit(self.outer(node, shard)), self.emit(shard.inner), shard.off,
                    self.emit(shard.length), self.emit(sympy.expand(left_pad)), self.emit(sympy.expand(right_pad)),
                    self.group_name, self.sp_size,
                ),
            )
        return self._gathered[node]

    def forget(self, nodes: Iterable[fx.Node]) -> None:
        """Drop the cached slices and gathers of ``nodes``: they were mutated in place, so the
        next use must slice or gather the mutated value again."""
        nodes = set(nodes)
        for node in nodes:
            self._gathered.pop(node, None)
        for key in [k for k in self._sliced if k[0] in nodes]:
            del self._sliced[key]

    def to_shard(self, node: fx.Node, shard: Shard) -> fx.Node:
        """The new-graph value of old node ``node`` sliced to placement ``shard``."""
        current = self.placements.get(node)
        if isinstance(current, Shard):
            if current.dim != shard.dim or not current.same_layout(shard):
                raise AutoSPError(f"internal: {node.name} has placement {current}, wanted {shard}")
            return self.new_value[node]
        key = (node, shard)
        if key not in self._sliced:  # [.., outer*length*inner, ..] -> [.., outer*len_r*inner, ..]
            self._sliced[key] = self.graph.call_function(
                runtime.shard_slice, (self.new_value[node], *self.slice_args(node, shard))
            )
        return self._sliced[key]

    def slice_args(self, node: fx.Node, shard: Shard) -> tuple:
        """``(dim, outer, seq_len, inner, start, length)`` of :func:`runtime.shard_slice` that cut
        this rank's ``shard`` out of old node ``node``'s global value."""
        start, count = self.window(shard)
        return (
            shard.dim, self.emit(self.outer(node, shard)), self.emit(shard.length), self.emit(shard.inner),
            self.emit(start), self.emit(count),
        )
