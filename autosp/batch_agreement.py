"""Every rank of an SP group must train on the same batch: each holds one part of the same
sequences. The sampler gives them the same sample indices, but randomness inside the data
pipeline (random crops or masking in ``__getitem__``/``collate_fn`` running in DataLoader
workers, which ``seed_everything(workers=True)`` - and so LightningCLI - seeds per rank) can
still hand each rank a different batch, and the rewrite would then silently train on a
sequence stitched together from different samples.

:func:`check_sp_batch_agreement` compares a fingerprint of the batch over the SP group before
each step: one all-gather of a few float64 numbers per rank. The same all-gather carries how
many sequence-parallel graphs each rank has compiled for the step, so that a rank which
recompiled where its peers did not is seen before Dynamo's recompile limit could make it run
the step eagerly, without the collectives its peers wait in.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from autosp.errors import AutoSPError

__all__ = ["batch_fingerprint", "check_sp_batch_agreement"]


def batch_fingerprint(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[3]`` float64 on ``device``: the number of tensors, a digest of their shapes and one of
    their values (position-weighted, so a permutation changes it). Equal batches give equal
    fingerprints bit for bit (the same reduction on the same device type)."""
    shapes = 0.0
    values = torch.zeros((), dtype=torch.float64, device=device)
    for i, t in enumerate(tensors):
        shapes += (i + 1) * sum((d + 1) * 31.0**k for k, d in enumerate(t.shape))
        flat = t.detach().reshape(-1).to(device=device, dtype=torch.float64)
        weights = torch.arange(flat.numel(), device=device, dtype=torch.float64).remainder_(9973).add_(1)
        values = values + (i + 1) * (flat * weights).sum()
    head = torch.tensor([float(len(tensors)), shapes], dtype=torch.float64, device=device)
    return torch.cat([head, values.reshape(1)])


def check_sp_batch_agreement(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup,
    sp_size: int,
    device: torch.device,
    step: str,
    sp_graphs: int = 0,
) -> list[int]:
    """Raise an :class:`AutoSPError` on every rank of the SP group if their batches differ;
    return every SP rank's ``sp_graphs`` (the graphs it compiled for ``step`` so far)."""
    if sp_size == 1:
        return [sp_graphs]
    local = torch.cat([batch_fingerprint(tensors, device), torch.tensor([float(sp_graphs)], dtype=torch.float64, device=device)])
    gathered = [torch.empty_like(local) for _ in range(sp_size)]
    dist.all_gather(gathered, local, group=group)
    differ = [r for r, fp in enumerate(gathered) if not torch.equal(fp[:-1], gathered[0][:-1])]
    if differ:
        raise AutoSPError(
            f"AutoSP: the ranks of an SP group received different batches in `{step}` (SP ranks {differ} differ "
            "from SP rank 0). All ranks of an SP group must see the same samples, since each holds one part of "
            "every sequence. The usual cause is randomness in the dataset or collate_fn (random crops, masking) "
            "running in DataLoader workers seeded per rank, as seed_everything(workers=True) and LightningCLI do. "
            "Seed that randomness from the sample index and the epoch (or the DP rank, "
            "`trainer.strategy.dp_rank`) rather than the global rank, or draw it in the LightningModule."
        )
    return [int(fp[-1].item()) for fp in gathered]
