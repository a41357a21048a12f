"""The ``(dp, sp)`` process layout, as pure functions (no process group needed).

Ranks are laid out row-major on a ``(dp_size, sp_size)`` grid: the ranks of one SP group are
contiguous (``[k*sp_size, (k+1)*sp_size)``), so with ``devices`` processes per node and
``devices % sp_size == 0`` an SP group never leaves a node - its all-to-alls stay on the
fast intra-node links. The DP groups are the strided columns.

Inside an SP group attention may run in two levels (:class:`AttentionLayout`): Ulysses over
contiguous ranks (heads split) and a ring over strided ones (positions split, key/value blocks
passed around), ``sp_size = ulysses * ring``; the ring's share of the positions is
:func:`ring_segment`.

It is also the one home of the sequence split: each SP rank holds ``chunk = ceil(S / sp_size)``
consecutive tokens in rank order, and the last rank holds the rest (fewer when ``S`` is not
divisible by ``sp_size``). The functions below work on ints, SymInts and sympy expressions
alike, so the collectives, the SP pass and the strategy all use them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class SPLayout:
    world_size: int
    sp_size: int

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    def sp_rank(self, global_rank: int) -> int:
        return global_rank % self.sp_size

    def dp_rank(self, global_rank: int) -> int:
        return global_rank // self.sp_size

    def sp_group_ranks(self, global_rank: int) -> list[int]:
        start = self.dp_rank(global_rank) * self.sp_size
        return list(range(start, start + self.sp_size))

    def dp_group_ranks(self, global_rank: int) -> list[int]:
        return list(range(self.sp_rank(global_rank), self.world_size, self.sp_size))

    def all_sp_groups(self) -> list[list[int]]:
        return [list(range(k * self.sp_size, (k + 1) * self.sp_size)) for k in range(self.dp_size)]

    def all_dp_groups(self) -> list[list[int]]:
        return [list(range(j, self.world_size, self.sp_size)) for j in range(self.sp_size)]


def chunk_size(seq_len, sp_size: int):
    """Tokens held by every SP rank but the last: ``ceil(seq_len / sp_size)``."""
    return (seq_len + sp_size - 1) // sp_size


def shard_window(sp_rank: int, sp_size: int, chunk, length, offset=0):
    """``(start, count)``: the positions of a sequence axis that SP rank ``sp_rank`` holds.

    The axis is a window of the base sequence: it has ``length`` positions and its position 0
    is base position ``offset`` (``logits[:, :-1]``: ``length=S-1``, ``offset=0``;
    ``labels[:, 1:]``: ``length=S-1``, ``offset=1``). Rank ``r`` holds the positions that fall
    in its base chunk ``[r*chunk, (r+1)*chunk)``, so a shift only takes positions from the
    first and the last rank; no position moves to another rank.
    """
    start = 0 if sp_rank == 0 else sp_rank * chunk - offset
    stop = length if sp_rank == sp_size - 1 else (sp_rank + 1) * chunk - offset
    return start, stop - start


def seq_split_sizes(seq_len, sp_size: int) -> list:
    """Tokens held by each SP rank when ``seq_len`` tokens are split in rank order."""
    chunk = chunk_size(seq_len, sp_size)
    return [shard_window(r, sp_size, chunk, seq_len)[1] for r in range(sp_size)]


#: every SP rank must keep at least this many tokens after the model's largest slice: a local
#: length of 0 or 1 is a size Dynamo specializes, so the rank holding it would compile (and
#: recompile) different graphs from its peers.
MIN_LOCAL_TOKENS = 2


def check_sequence_fits(seq_len: int, sp_size: int, shift: int = 0) -> None:
    """Raise a ``ValueError`` unless the last SP rank (which holds the fewest tokens) holds at
    least ``shift + MIN_LOCAL_TOKENS`` of them; ``shift`` is the largest slice of the sequence
    the model takes (``logits[:, :-1]``: 1), which only the first and the last rank absorb."""
    fewest = seq_split_sizes(seq_len, sp_size)[-1]
    needed = shift + MIN_LOCAL_TOKENS
    if fewest < needed:
        sliced = f" ({shift} for the model's slice of the sequence)" if shift else ""
        raise ValueError(
            f"AutoSPStrategy: a sequence of {seq_len} tokens split over sp_size={sp_size} ranks leaves the "
            f"last rank {fewest} token(s); it needs at least {needed}{sliced}, so that every rank keeps "
            f"{MIN_LOCAL_TOKENS} or more (a part of 0 or 1 token would make that rank compile other graphs than "
            f"its peers). Use longer sequences (any multiple of sp_size from {needed * sp_size} tokens fits) "
            "or a smaller sp_size."
        )


def validate_sp_size(sp_size: int | None) -> None:
    if sp_size is not None and (not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1):
        raise ValueError(f"AutoSPStrategy(sp_size={sp_size!r}): sp_size must be an integer >= 1 (or None for one SP group per node).")


def validate_layout(
    sp_size: int, world_size: int, devices_per_node: int, sp_layout: Optional[tuple[int, int]] = None
) -> SPLayout:
    """Check that ``sp_size`` tiles the world and the nodes; raise a ``ValueError`` naming the fix.

    An SP group lies inside a node (``sp_size`` divides the devices per node) or spans whole
    nodes (a multiple of them): then Ulysses stays inside a node and a ring level joins the nodes
    (:func:`choose_attention_layout`). ``sp_layout`` (``(ulysses, ring)``) must multiply to ``sp_size``."""
    validate_sp_size(sp_size)
    if world_size % sp_size:
        valid = [d for d in range(1, world_size + 1) if world_size % d == 0 and (devices_per_node % d == 0 or d % devices_per_node == 0)]
        raise ValueError(
            f"AutoSPStrategy(sp_size={sp_size}): the world size {world_size} is not divisible by sp_size. "
            f"Use an sp_size that divides it (valid here: {valid}) or change `devices`/`num_nodes`."
        )
    if devices_per_node % sp_size and sp_size % devices_per_node:
        valid = [d for d in range(1, world_size + 1) if world_size % d == 0 and (devices_per_node % d == 0 or d % devices_per_node == 0)]
        raise ValueError(
            f"AutoSPStrategy(sp_size={sp_size}): an SP group must lie inside a node or span whole nodes, but the "
            f"devices per node ({devices_per_node}) neither divide sp_size nor are divided by it, so an SP group would "
            f"span part of a node. Use an sp_size that divides the devices per node or is a multiple of them "
            f"(valid here: {valid})."
        )
    if sp_layout is not None:
        validate_sp_layout(sp_layout, sp_size)
    return SPLayout(world_size, sp_size)


def validate_sp_layout(sp_layout: Any, sp_size: Optional[int]) -> tuple[int, int]:
    """``sp_layout`` as ``(ulysses, ring)`` positive ints whose product is ``sp_size`` (when known)."""
    ok = (
        isinstance(sp_layout, (tuple, list)) and len(sp_layout) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in sp_layout)
    )
    if not ok:
        raise ValueError(
            f"AutoSPStrategy(sp_layout={sp_layout!r}): sp_layout must be (ulysses, ring), two integers >= 1 whose "
            "product is sp_size, e.g. sp_layout=(4, 2) for sp_size=8 (YAML: `sp_layout: [4, 2]`); leave it None "
            "to choose automatically."
        )
    ulysses, ring = int(sp_layout[0]), int(sp_layout[1])
    if sp_size is not None and ulysses * ring != sp_size:
        raise ValueError(
            f"AutoSPStrategy(sp_layout={tuple(sp_layout)}): ulysses x ring = {ulysses * ring}, not sp_size={sp_size}. "
            f"Layouts of sp_size={sp_size}: {[(d, sp_size // d) for d in range(sp_size, 0, -1) if sp_size % d == 0]}."
        )
    return ulysses, ring


# ---------------------------------------------------------------------------- Ulysses x ring
@dataclass(frozen=True)
class AttentionLayout:
    """How an SP group of ``ulysses * ring`` ranks splits attention: Ulysses over ``ulysses``
    contiguous SP ranks (heads), a ring over the ``ring`` strided ones (positions). SP rank
    ``s`` is ``(ring_rank, ulysses_rank) = divmod(s, ulysses)``."""

    ulysses: int
    ring: int = 1

    @property
    def sp_size(self) -> int:
        return self.ulysses * self.ring

    def ring_rank(self, sp_rank: int) -> int:
        return sp_rank // self.ulysses

    def ulysses_rank(self, sp_rank: int) -> int:
        return sp_rank % self.ulysses

    def ulysses_group(self, sp_rank: int) -> list[int]:
        """The SP ranks that exchange heads with ``sp_rank`` (contiguous)."""
        start = self.ring_rank(sp_rank) * self.ulysses
        return list(range(start, start + self.ulysses))

    def ring_group(self, sp_rank: int) -> list[int]:
        """The SP ranks that pass key/value blocks around a ring with ``sp_rank`` (strided)."""
        return list(range(self.ulysses_rank(sp_rank), self.sp_size, self.ulysses))

    def __str__(self) -> str:
        return f"ulysses={self.ulysses} x ring={self.ring}"


def attention_layouts(sp_size: int, heads: int) -> list[AttentionLayout]:
    """Every layout of ``sp_size`` whose Ulysses degree divides ``heads``, most Ulysses first."""
    return [AttentionLayout(u, sp_size // u) for u in range(sp_size, 0, -1) if sp_size % u == 0 and heads % u == 0]


def choose_attention_layout(sp_size: int, heads: Sequence[int], max_ulysses: Optional[int] = None) -> AttentionLayout:
    """The default layout: the largest Ulysses degree that divides ``sp_size``, every attention's
    query ``heads`` and ``max_ulysses`` (the devices per node: Ulysses stays inside a node); the
    ring takes the rest."""
    limit = sp_size if max_ulysses is None else math.gcd(sp_size, max_ulysses)
    best = 1
    for u in range(1, sp_size + 1):
        if sp_size % u == 0 and limit % u == 0 and all(h % u == 0 for h in heads):
            best = u
    return AttentionLayout(best, sp_size // best)


def ring_chunk_sizes(seq_len, parts: int) -> list:
    """``seq_len`` positions split into ``parts`` chunks in order, sizes differing by at most one
    (the first ``seq_len % parts`` one longer); ints and SymInts alike."""
    return [(seq_len + parts - 1 - i) // parts for i in range(parts)]


def ring_segment(seq_len, ring: int, ring_rank: int, zigzag: bool = True) -> list:
    """``[(start, stop), (start, stop)]``: the two chunks of the sequence ring rank ``ring_rank``
    attends for, in position order. The sequence is cut into ``2 * ring`` chunks
    (:func:`ring_chunk_sizes`); with ``zigzag`` (head-tail balancing) rank ``r`` holds chunks ``r``
    and ``2*ring-1-r`` - under a causal mask every rank then has the same work - else chunks
    ``2r`` and ``2r+1`` (contiguous: the last rank's queries read every key, the first's few)."""
    sizes = ring_chunk_sizes(seq_len, 2 * ring)
    starts = [sum(sizes[:i]) for i in range(2 * ring)]
    picks = (ring_rank, 2 * ring - 1 - ring_rank) if zigzag else (2 * ring_rank, 2 * ring_rank + 1)
    return [(starts[i], starts[i] + sizes[i]) for i in picks]


def ring_segment_length(seq_len, ring: int, ring_rank: int, zigzag: bool = True):
    """How many positions :func:`ring_segment` gives ring rank ``ring_rank`` (ints and SymInts)."""
    sizes = ring_chunk_sizes(seq_len, 2 * ring)
    picks = (ring_rank, 2 * ring - 1 - ring_rank) if zigzag else (2 * ring_rank, 2 * ring_rank + 1)
    return sizes[picks[0]] + sizes[picks[1]]
