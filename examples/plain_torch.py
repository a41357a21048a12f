"""Sequence parallelism in a plain PyTorch loop: the ``autosp`` core, no Lightning.

    torchrun --nproc-per-node 2 examples/plain_torch.py                  # sp=2: each sequence split over 2 ranks
    torchrun --nproc-per-node 4 examples/plain_torch.py --sp 2 --fsdp    # dp=2 x sp=2, parameters sharded

The process groups (``SPLayout``, ``sp_mesh``), the compiled step (``StepRunner``: the loss of
an unmodified Llama rewritten into DeepSpeed-Ulysses SP), the sampler (the SP ranks of a group
read the same rows), the mode (replicas or DTensor shards) and its checkpoint, by hand. The loss
and the gradients are those of one device; the task (tokens that count with a random stride) is
learnt once attention reads the previous position.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from autosp import FSDPConfig, SequenceParallelSampler, SPLayout, StepConfig, StepRunner, make_mode, sp_mesh
from autosp.models import Llama, LlamaConfig


def counting(rows: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    start, stride = torch.randint(vocab, (rows, 1), generator=g), torch.randint(1, 5, (rows, 1), generator=g)
    return (start + stride * torch.arange(length + 1)) % vocab


def loss_fn(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def train(args: argparse.Namespace) -> list[float]:
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo")  # from torchrun's environment
    torch.manual_seed(0)  # the same initial model on every rank
    layout, rank = SPLayout(dist.get_world_size(), args.sp), dist.get_rank()
    mesh = sp_mesh(layout, "cpu")
    mode = make_mode(FSDPConfig.from_arguments(args.fsdp))
    mode.build_mesh(layout, devices_per_node=layout.world_size, device_type="cpu", timeout=None)
    model = mode.setup_module(Llama(LlamaConfig(vocab_size=64, n_layers=2)), "32-true", ddp=lambda m: m)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    runner = StepRunner(StepConfig(compile_backend=args.backend), layout.sp_size, layout.sp_rank(rank), mesh.get_group("sp"), torch.device("cpu"))
    step = runner.compile_step("loss", loss_fn)
    data = counting(rows=8 * args.steps, length=args.seq_len, vocab=64)
    loader = DataLoader(data, batch_size=8 // layout.dp_size, sampler=SequenceParallelSampler(data, layout.sp_size, shuffle=False))
    losses = []
    for i, tokens in enumerate(loader):
        loss = step(model, tokens)  # the whole sequence's loss, on every rank
        loss.backward()
        mode.reduce_gradients(model)  # replicas: averaged as DDP would; shards: done in the step
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if rank == 0:
            print(f"step {i}: loss {loss.item():.4f}", flush=True)
    if args.out:
        checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [mode.optimizer_state(model, optimizer, ddp=lambda o: o.state_dict())], "losses": losses}
        mode.save(checkpoint, args.out, model, [optimizer])
    mode.leave(model)
    if started:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sp", type=int, default=None, help="ranks per SP group (default: every rank)")
    parser.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and optimizer state")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--backend", default="aot_eager", help="the compile backend after the SP pass (inductor, aot_eager)")
    parser.add_argument("--out", default=None, help="write a checkpoint here at the end")
    args = parser.parse_args()
    args.sp = args.sp or int(os.environ["WORLD_SIZE"])
    train(args)
