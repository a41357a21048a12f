"""LightningCLI: the demo config and the `autosp` short name parse and run."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sp_harness import free_port

from lightning_autosp.examples.kv_recall import IGNORE_INDEX, KVRecallDataset

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "--trainer.fast_dev_run=1",
    "--data.init_args.seq_len=64",
    "--data.init_args.num_pairs=4",
    "--data.init_args.num_queries=4",
    "--data.init_args.batch_size=2",
    "--data.init_args.train_size=8",
    "--data.init_args.val_size=4",
    "--model.init_args.dim=32",
    "--model.init_args.n_layers=1",
]


@pytest.mark.slow
def test_demo_config_runs_as_users_launch_it(tmp_path):
    """The README's main job, shrunk: `lightning-autosp fit --config configs/demo_cpu.yaml`
    launched as users launch it (Lightning's default launcher re-runs the command per rank)."""
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "lightning_autosp.cli", "fit", "--config", str(ROOT / "configs" / "demo_cpu.yaml"), *SMALL],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dp=1 x sp=2" in out.stderr + out.stdout


def test_demo_task_needs_attention_across_the_sp_shards():
    """In the demo config every key/value pair lies in SP rank 0's half of the sequence and every
    query in rank 1's half, so no answer can be found without attending across the shards."""
    config = yaml.safe_load((ROOT / "configs" / "demo_cpu.yaml").read_text())
    sp_size = config["trainer"]["strategy"]["init_args"]["sp_size"]
    assert sp_size == config["trainer"]["devices"] == 2
    data = config["data"]["init_args"]
    ds = KVRecallDataset(size=4, **{k: v for k, v in data.items() if k != "batch_size"})
    shard = ds.seq_len // sp_size  # rank r holds positions [r * shard, (r + 1) * shard)
    assert ds.pairs_end <= shard <= ds.query_start
    for i in range(len(ds)):
        ids, labels = ds[i]["input_ids"], ds[i]["labels"]
        is_value = (ids >= ds.value_offset) & (ids < ds.filler_offset)
        asked = (labels != IGNORE_INDEX).nonzero().flatten()
        assert is_value.nonzero().max() < shard <= asked.min()
        assert set(labels[asked].tolist()) <= set(ids[:shard][is_value[:shard]].tolist())  # answers only on rank 0


@pytest.mark.slow
@pytest.mark.parametrize("config,fsdp", [("llama_sp8.yaml", "false"), ("llama8b_sp8_fsdp.yaml", "true")])
@pytest.mark.full
def test_gpu_config_parses(config, fsdp):
    out = subprocess.run(
        [sys.executable, "-m", "lightning_autosp.cli", "fit", "--config", str(ROOT / "configs" / config), "--ckpt_path=last", "--print_config"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lightning_autosp.AutoSPStrategy" in out.stdout and "sp_size: 8" in out.stdout
    assert f"fsdp: {fsdp}" in out.stdout
    assert "ckpt_path: last" in out.stdout  # as examples/slurm/llama_sp8.sbatch resumes
    if fsdp == "true":  # sharded checkpoints every 500 steps
        assert "every_n_train_steps: 500" in out.stdout and "save_last: link" in out.stdout


def test_short_name_strategy_under_the_cli(tmp_path, monkeypatch):
    """`strategy: autosp` from YAML/CLI: the CLI builds the Trainer with AutoSPStrategy (the
    default configuration, inductor + SAC; its numerics: tests/test_numerics.py)."""
    from lightning import LightningDataModule, LightningModule

    from lightning_autosp import AutoSPStrategy
    from lightning_autosp.cli import AutoSPCLI

    monkeypatch.chdir(tmp_path)
    args = ["--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--trainer.strategy=autosp", *SMALL]
    cli = AutoSPCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, args=args, run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, AutoSPStrategy) and strategy.sp_size == 2
    assert (strategy.compile_backend, strategy.sac) == ("inductor", True)
    # a layout with a ring level from the command line (YAML: `sp_layout: [1, 2]`)
    args = ["--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--trainer.strategy.init_args.sp_layout=[1, 2]", *SMALL]
    cli = AutoSPCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True, args=args, run=False)
    assert cli.trainer.strategy.sp_layout == (1, 2) and cli.trainer.strategy.sp_size == 2
