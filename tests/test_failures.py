"""What must never be silent or hang: SP ranks that see different batches, collectives on the
SP/DP subgroups that would wait longer than the user's ``timeout``, and a rank that raises while
its peers wait for it."""

import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from sp_harness import START_METHOD, LMModule, TokenData, free_port, run_fit

from lightning_autosp import AutoSPStrategy
from autosp._compat import FORK_AFTER_COMPILE_BREAKS_AUTOGRAD


class RankDependentData(TokenData):
    """Random masking drawn per rank - what DataLoader workers seeded by the global rank do."""

    def __init__(self, n, seq_len, per_rank: bool):
        super().__init__(n, seq_len)
        self.per_rank = per_rank

    def __getitem__(self, i):
        item = dict(super().__getitem__(i))
        seed = 1000 * (dist.get_rank() if self.per_rank and dist.is_initialized() else 0) + i
        keep = torch.rand(item["input_ids"].shape, generator=torch.Generator().manual_seed(seed)) > 0.1
        item["input_ids"] = item["input_ids"] * keep  # token 0 as the mask token
        return item


def test_sp_ranks_with_different_batches_are_stopped(tmp_path):
    with pytest.raises(Exception, match=r"ranks of an SP group received different batches in `training_step`"):
        run_fit(tmp_path, LMModule("gpt"), RankDependentData(8, 16, per_rank=True), devices=2, sp_size=2, steps=1)


@pytest.mark.slow
def test_sp_ranks_with_the_same_random_batches_train(tmp_path):
    """Negative control: the same randomness on every rank (seeded by the sample) passes the check."""
    run = run_fit(tmp_path, LMModule("gpt"), RankDependentData(8, 16, per_rank=False), devices=2, sp_size=2, steps=1)
    assert len(run.ranks[0]["losses"]) == 1


class TimeoutProbe(L.Callback):
    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_fit_start(self, trainer, pl_module):
        st = trainer.strategy
        seconds = {
            name: group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name, group in (("sp", st.sp_group), ("dp", st.dp_group))
        }
        torch.save(seconds, f"{self.out_dir}/rank{trainer.global_rank}.pt")


@pytest.mark.slow
@pytest.mark.full
def test_user_timeout_applies_to_sp_and_dp_groups(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    strategy = AutoSPStrategy(sp_size=2, compile_backend="aot_eager", start_method=START_METHOD, timeout=timedelta(seconds=123))
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[TimeoutProbe(str(tmp_path))],
    )
    trainer.fit(LMModule("gpt"), torch.utils.data.DataLoader(TokenData(8, 16), batch_size=2))
    for rank in range(4):
        # the backend default would be 1800 s (gloo)
        assert torch.load(tmp_path / f"rank{rank}.pt") == {"sp": 123.0, "dp": 123.0}


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_job_with_its_error(tmp_path):
    """The default launcher (the script re-run per rank), rank 1 raising at step 2 while rank 0
    waits for it in an all-to-all: the job exits non-zero with rank 1's message, long before
    the 300 s timeout (the peer sees the failed rank's connection close)."""
    env = {**os.environ, "MASTER_PORT": str(free_port()), "PYTHONPATH": str(Path(__file__).parent)}
    start = time.time()
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "failing_job.py"), "1", "300"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    end = time.time()
    output = proc.stdout + proc.stderr
    raised = re.search(r"deliberate failure on rank 1 at step 2 \(t=([0-9.]+)\)", output)
    assert proc.returncode != 0 and raised, output[-3000:]
    print(f"job: {end - start:.0f} s in all; exit {proc.returncode} {end - float(raised.group(1)):.1f} s after rank 1 raised")
    assert end - float(raised.group(1)) < 60


@pytest.mark.slow
@pytest.mark.full
def test_fork_launch_in_a_notebook(tmp_path):
    """``start_method="fork"`` (Lightning's ``ddp_notebook``) from a process that compiled
    nothing trains, twice. After the launching process compiled a training step, a forked child cannot
    run autograd on torch >= 2.14 (shown first, outside AutoSP: the control) and the forked fit
    then fails with AutoSP's error naming the launchers that work, not torch's; on older torch
    it trains."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "fork_launch_job.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0 and "fit before compiling: trained" in out, (out + proc.stderr)[-3000:]
    assert "second fit (its first one compiled in the ranks only): trained" in out, out
    if FORK_AFTER_COMPILE_BREAKS_AUTOGRAD:
        assert "autograd in a child forked after compiling: fails" in out, out
        assert "fit after compiling: failed: " in out and "AutoSPStrategy(start_method='fork'): this process was forked" in out, out
        assert "Use start_method='popen' (the default, for scripts) or 'spawn'" in out
    else:
        assert "autograd in a child forked after compiling: works" in out, out
        assert "fit after compiling: trained" in out, out


@pytest.mark.slow
@pytest.mark.full
def test_forkserver_launch_gives_each_rank_its_own_parameters(tmp_path):
    """``start_method="forkserver"`` on the CPU: torch's multiprocessing hands the ranks the
    module's tensors in shared memory. AutoSP gives each rank its own copy, so the run equals one
    device over 3 steps. Control: plain DDP launched the same way, without that copy, leaves one
    device after its first step (each rank's optimizer step lands on the same parameters)."""
    from sp_harness import compare, reference

    kwargs = dict(sac=False, chunked_loss=False, start_method="forkserver")
    run = run_fit(tmp_path, LMModule("llama", layers=1, log_loss=False), TokenData(16, 32), 2, 2, **kwargs)
    loss_err, grad_err = compare(run, 2, *reference("llama", run, 2, layers=1))
    assert loss_err <= 1e-4 and grad_err <= 1e-4, (loss_err, grad_err)
    shared = run_fit(tmp_path, LMModule("llama", layers=1, log_loss=False), TokenData(16, 32), 2, None, **kwargs, ddp_unshared=False)
    want_losses, want_grads = reference("llama", shared, 1, layers=1)
    assert [rec["losses"][0] for rec in shared.ranks] == pytest.approx(want_losses[0], rel=1e-5)  # step 1: the same
    bad_loss, bad_grad = compare(shared, 1, want_losses, want_grads)
    assert bad_loss > 1e-4 and bad_grad > 1e-2, (bad_loss, bad_grad)
