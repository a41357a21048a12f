"""A training job in which one rank raises at step 2, run by ``test_failures.py`` as a user
runs a script: ``python failing_job.py RANK TIMEOUT_S`` with Lightning's default launcher
(the script is re-run for the other rank). The failing rank prints the time it raised."""

import sys
import time
from datetime import timedelta

import lightning as L
import torch
from sp_harness import LMModule, TokenData

from lightning_autosp import AutoSPStrategy


class FailingAtStep2(LMModule):
    def __init__(self, fail_rank: int):
        super().__init__("gpt")
        self.fail_rank = fail_rank

    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.global_rank == self.fail_rank:
            raise RuntimeError(f"deliberate failure on rank {self.global_rank} at step 2 (t={time.time():.1f})")
        return super().training_step(batch, batch_idx)


if __name__ == "__main__":
    torch.set_num_threads(1)
    fail_rank, timeout_s = int(sys.argv[1]), float(sys.argv[2])
    strategy = AutoSPStrategy(sp_size=2, compile_backend="eager", sac=False, timeout=timedelta(seconds=timeout_s))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(FailingAtStep2(fail_rank), torch.utils.data.DataLoader(TokenData(16, 16), batch_size=2))
