"""LightningCLI: the demo config and the `autosp` short name parse and run."""

import os
import subprocess
import sys
from pathlib import Path

from sp_harness import free_port

from lightning_autosp.cli import main

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
]


def test_demo_config_fast_dev_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "demo_cpu.yaml"),
            "--trainer.strategy.init_args.start_method=fork",
            *SMALL,
        ]
    )


def test_gpu_config_parses():
    from lightning_autosp.cli import AutoSPCLI  # noqa: F401

    out = subprocess.run(
        [sys.executable, "-m", "lightning_autosp.cli", "fit", "--config", str(ROOT / "configs" / "llama_sp8.yaml"), "--print_config"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "lightning_autosp.AutoSPStrategy" in out.stdout and "sp_size: 8" in out.stdout


def test_short_name_strategy_runs_under_the_cli(tmp_path):
    """`strategy: autosp` from YAML/CLI, launched as users launch it (popen, 2 processes)."""
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "lightning_autosp.cli", "fit", "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
         "--trainer.strategy=autosp", *SMALL],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dp=1 x sp=2" in out.stderr + out.stdout
