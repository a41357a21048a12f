"""A distributed sampler that shards over the data-parallel axis only."""

from __future__ import annotations

from typing import Optional

from torch.utils.data import Dataset, DistributedSampler

from lightning_autosp.layout import SPLayout, validate_sp_size

__all__ = ["SequenceParallelSampler"]


class SequenceParallelSampler(DistributedSampler):
    """``DistributedSampler`` over the DP axis of a ``(dp, sp)`` layout.

    Every rank of an SP group gets the same samples, in the same order (the SP pass then
    splits each sequence across them); different SP groups get disjoint samples. Use it with
    ``Trainer(use_distributed_sampler=False)`` when you build your own loaders - otherwise
    :class:`~lightning_autosp.AutoSPStrategy` sets this up for you.

    Args:
        dataset: the dataset to sample from.
        sp_size: ranks per SP group.
        world_size, global_rank: this process's place; by default read from
            ``torch.distributed``.
        shuffle, seed, drop_last: as for ``DistributedSampler``; the seed must be the same on
            every rank.
    """

    def __init__(
        self,
        dataset: Dataset,
        sp_size: int,
        world_size: Optional[int] = None,
        global_rank: Optional[int] = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        validate_sp_size(sp_size)
        if world_size is None or global_rank is None:
            import torch.distributed as dist

            if not dist.is_available() or not dist.is_initialized():
                raise ValueError(
                    "SequenceParallelSampler: pass `world_size` and `global_rank`, or initialize torch.distributed first."
                )
            world_size = dist.get_world_size() if world_size is None else world_size
            global_rank = dist.get_rank() if global_rank is None else global_rank
        if world_size % sp_size:
            raise ValueError(f"SequenceParallelSampler: world_size={world_size} is not divisible by sp_size={sp_size}.")
        if not 0 <= global_rank < world_size:
            raise ValueError(f"SequenceParallelSampler: global_rank={global_rank} must lie in [0, {world_size}).")
        layout = SPLayout(world_size, sp_size)
        self.sp_size = sp_size
        super().__init__(
            dataset,
            num_replicas=layout.dp_size,
            rank=layout.dp_rank(global_rank),
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
