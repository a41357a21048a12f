"""A distributed sampler that shards over the data-parallel axis only."""

from __future__ import annotations

import copy
import warnings
from typing import Callable, Iterator, Optional

import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler

from autosp.layout import SPLayout, validate_sp_size

__all__ = ["SequenceParallelSampler", "ResumableOrder", "make_resumable"]


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


class ResumableOrder(Sampler[int]):
    """The index sampler of a training loader under AutoSP, in place of its ``DistributedSampler``
    (``inner``): iterates exactly as ``inner`` does, and after a mid-epoch resume on the same DP
    size continues the interrupted epoch's order where the checkpoint stopped - no sample seen
    twice, none skipped. :func:`make_resumable` installs it and gives the loader the
    ``state_dict``/``load_state_dict`` Lightning saves in checkpoints.

    The position saved is global (samples of the epoch's order consumed by all DP ranks together).
    Lightning counts an epoch's progress in batches of the layout that saved it, so on another DP
    size the interrupted epoch cannot be continued: the epoch starts its order over (a warning
    says so) and later epochs are exact.
    """

    def __init__(self, inner: DistributedSampler):
        self.inner = inner
        self._resume: Optional[dict] = None  # set by load_state_dict, used by the next __iter__
        self._base = (-1, 0, 0)  # (epoch, position, batches) where this epoch's count starts

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[int]:
        resume, self._resume = self._resume, None
        if resume is None or resume["epoch"] != self.inner.epoch or resume["position"] == 0:
            return iter(self.inner)
        if resume["dp_size"] != self.inner.num_replicas:
            _warn_on_rank_zero(
                f"AutoSP: resuming in the middle of epoch {resume['epoch']} (after {resume['batches']} batches) on "
                f"{self.inner.num_replicas} data-parallel groups, saved on {resume['dp_size']}: Lightning counts the "
                "epoch in batches of the saving layout, so this epoch starts its sample order over (samples seen "
                "before the checkpoint may be seen again, the epoch's last ones not at all); later epochs are "
                "exact. To resume on another DP size exactly, resume from a checkpoint saved at the end of an epoch."
            )
            return iter(self.inner)
        self._base = (resume["epoch"], resume["position"], resume["batches"])
        order = self.global_order()
        return iter(order[resume["position"] + self.inner.rank :: self.inner.num_replicas])

    def global_order(self) -> list[int]:
        """The epoch's indices over all DP ranks, as ``inner`` deals them (rank r gets
        ``order[r::num_replicas]``)."""
        per_rank = []
        for rank in range(self.inner.num_replicas):
            other = copy.copy(self.inner)
            other.rank = rank
            per_rank.append(list(other))
        return [index for dealt in zip(*per_rank) for index in dealt]

    def state_dict(self, epoch: int, batches: int, batch_size: int) -> dict:
        """Where epoch ``epoch`` stands after ``batches`` batches of ``batch_size`` per rank."""
        base_epoch, position, base_batches = self._base
        if base_epoch != epoch:
            position, base_batches = 0, 0
        consumed = position + (batches - base_batches) * batch_size * self.inner.num_replicas
        return {"epoch": epoch, "position": consumed, "batches": batches, "dp_size": self.inner.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        self._resume = dict(state)


def make_resumable(loader: object, progress: Callable[[], tuple[int, int]]) -> bool:
    """Give a training ``DataLoader`` whose indices come from a ``DistributedSampler`` (as
    Lightning sets up under AutoSP) a :class:`ResumableOrder` and the ``state_dict`` /
    ``load_state_dict`` pair Lightning checkpoints; ``progress()`` returns ``(epoch, batches
    fetched this epoch)``. Loaders with their own batch sampler or state are left alone (False)."""
    if not isinstance(loader, DataLoader) or loader.batch_size is None or hasattr(loader, "state_dict"):
        return False
    batch_sampler = loader.batch_sampler
    if type(batch_sampler) is not BatchSampler or not isinstance(batch_sampler.sampler, DistributedSampler):
        return False
    order = ResumableOrder(batch_sampler.sampler)
    batch_sampler.sampler = order
    loader.state_dict = lambda: order.state_dict(*progress(), loader.batch_size)  # type: ignore[attr-defined]
    loader.load_state_dict = order.load_state_dict  # type: ignore[attr-defined]
    return True


def _warn_on_rank_zero(message: str) -> None:
    """A ``UserWarning`` from the first process only (every rank of a layout reaches the same one)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(message, stacklevel=3)
