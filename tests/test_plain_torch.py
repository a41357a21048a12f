"""The core without Lightning: ``import autosp`` pulls in no Lightning, and the plain PyTorch loop
of ``examples/plain_torch.py`` (launched as users launch it, with torchrun) trains as one device."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sp_harness import free_port, rel_err, spawn

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plain_torch.py"
STEPS, SEQ_LEN = 3, 128
TOL = 1e-4

_LOADED = (  # preparing a model that is not Hugging Face's imports no transformers (seconds per rank)
    "import sys, autosp, autosp.modes, autosp.steps, autosp.checkpoint, autosp.memory.plan, autosp.models; "
    "from autosp.compile_prep import prepare_for_compile; prepare_for_compile(autosp.models.GPT(autosp.models.GPTConfig.tiny(vocab_size=64))); "
    "print(sorted({m.split('.')[0] for m in sys.modules} & {'lightning', 'lightning_fabric', 'pytorch_lightning', 'lightning_autosp', 'transformers'}))"
)


@pytest.mark.full
def test_core_imports_without_lightning():
    """Every core module imports with no Lightning package loaded, and preparing a model that is not
    Hugging Face's for compiling imports no transformers; the same probe after
    ``import lightning_autosp`` finds Lightning (the probe can fail)."""
    probes = [  # both at once (each imports torch: seconds)
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for code in (_LOADED, "import lightning_autosp; " + _LOADED)
    ]
    (core, core_err), (doors, doors_err) = (p.communicate(timeout=120) for p in probes)
    assert [p.returncode for p in probes] == [0, 0], core_err[-2000:] + doors_err[-2000:]
    assert core.strip() == "[]", core
    assert "lightning" in doors and "lightning_autosp" in doors, doors


def _torchrun(tmp_path: Path, nproc: int, *args: str) -> Path:
    out = tmp_path / f"n{nproc}{''.join(args).replace('-', '_')}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           str(EXAMPLE), f"--steps={STEPS}", f"--seq-len={SEQ_LEN}", f"--out={out}", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return out


def _optimizer_moments(checkpoint: dict) -> dict[str, torch.Tensor]:
    """AdamW's first moments by parameter name: a weighted sum of every step's gradients."""
    names = checkpoint["autosp"]["optimizer_param_names"][0]
    return {names[i]: s["exp_avg"] for i, s in checkpoint["optimizer_states"][0]["state"].items()}


@pytest.mark.slow
def test_plain_torch_example_matches_one_device(tmp_path):
    """sp=2 replicas and sp=2 shards under torchrun against one process: the losses of every step,
    the gradients (AdamW's first moments) and the trained parameters."""
    from autosp.checkpoint import read_model_state_dict

    one = torch.load(_torchrun(tmp_path, 1), weights_only=False)
    sp2 = torch.load(_torchrun(tmp_path, 2), weights_only=False)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(sp2["losses"], one["losses"]))
    grad_err = max(rel_err(sp2_m, _optimizer_moments(one)[n]) for n, sp2_m in _optimizer_moments(sp2).items())
    param_err = max(rel_err(v, one["state_dict"][k]) for k, v in sp2["state_dict"].items())
    sharded_dir = _torchrun(tmp_path, 2, "--fsdp")
    sharded = torch.load(sharded_dir / "meta.pt", weights_only=False)
    sharded_loss_err = max(abs(a - b) / abs(b) for a, b in zip(sharded["losses"], one["losses"]))
    sharded_param_err = max(rel_err(v, one["state_dict"][k]) for k, v in read_model_state_dict(sharded_dir).items())
    print(f"plain torch sp=2: loss {loss_err:.1e}, gradients {grad_err:.1e}, parameters {param_err:.1e}; "
          f"sharded: loss {sharded_loss_err:.1e}, parameters {sharded_param_err:.1e}")
    assert len(one["losses"]) == len(sp2["losses"]) == STEPS and set(_optimizer_moments(sp2)) == set(_optimizer_moments(one))
    assert max(loss_err, grad_err, param_err, sharded_loss_err, sharded_param_err) <= TOL


def _naive_rank(rank: int, world: int, out: str) -> None:
    """The example's loop with each rank's half of every sequence given to the model as it is
    (sequence sharding without the AutoSP pass)."""
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("plain_torch_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    def naive(self, name, fn):
        return lambda model, tokens: fn(model, tokens.tensor_split(world, dim=1)[rank])

    example.StepRunner.compile_step = naive  # (this forked rank's copy of the class)
    example.train(argparse.Namespace(sp=world, fsdp=False, steps=STEPS, seq_len=SEQ_LEN, backend="aot_eager", out=out))


@pytest.mark.slow
def test_negative_control_plain_torch_without_the_pass(tmp_path):
    """The comparison above fails for the same loop run with naive sequence sharding."""
    one = torch.load(_torchrun(tmp_path, 1), weights_only=False)
    spawn(tmp_path, _naive_rank, 2, str(tmp_path / "naive.pt"))
    naive = torch.load(tmp_path / "naive.pt", weights_only=False)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(naive["losses"], one["losses"]))
    grad_err = max(rel_err(m, _optimizer_moments(one)[n]) for n, m in _optimizer_moments(naive).items())
    print(f"negative control, naive sharding: loss {loss_err:.1e}, gradients {grad_err:.1e}")
    assert min(loss_err, grad_err) > 10 * TOL
