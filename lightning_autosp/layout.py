"""The ``(dp, sp)`` process layout, as pure functions (no process group needed).

Ranks are laid out row-major on a ``(dp_size, sp_size)`` grid: the ranks of one SP group are
contiguous (``[k*sp_size, (k+1)*sp_size)``), so with ``devices`` processes per node and
``devices % sp_size == 0`` an SP group never leaves a node - its all-to-alls stay on the
fast intra-node links. The DP groups are the strided columns.
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
