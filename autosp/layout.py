"""The ``(dp, sp)`` process layout, as pure functions (no process group needed).

Ranks are laid out row-major on a ``(dp_size, sp_size)`` grid: the ranks of one SP group are
contiguous (``[k*sp_size, (k+1)*sp_size)``), so with ``devices`` processes per node and
``devices % sp_size == 0`` an SP group never leaves a node - its all-to-alls stay on the
fast intra-node links. The DP groups are the strided columns.

It is also the one home of the sequence split: each SP rank holds ``chunk = ceil(S / sp_size)``
consecutive tokens in rank order, and the last rank holds the rest (fewer when ``S`` is not
divisible by ``sp_size``). The functions below work on ints, SymInts and sympy expressions
alike, so the collectives, the SP pass and the strategy all use them.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def validate_layout(sp_size: int, world_size: int, devices_per_node: int) -> SPLayout:
    """Check that ``sp_size`` tiles the world and every node; raise a ``ValueError`` naming the fix."""
    validate_sp_size(sp_size)
    if world_size % sp_size:
        valid = [d for d in range(1, world_size + 1) if world_size % d == 0 and devices_per_node % d == 0]
        raise ValueError(
            f"AutoSPStrategy(sp_size={sp_size}): the world size {world_size} is not divisible by sp_size. "
            f"Use an sp_size that divides it (valid here: {valid}) or change `devices`/`num_nodes`."
        )
    if devices_per_node % sp_size:
        valid = [d for d in range(1, devices_per_node + 1) if devices_per_node % d == 0]
        raise ValueError(
            f"AutoSPStrategy(sp_size={sp_size}): devices per node ({devices_per_node}) is not divisible by sp_size, "
            f"so an SP group would span nodes. Use an sp_size that divides the devices per node (valid: {valid})."
        )
    return SPLayout(world_size, sp_size)
