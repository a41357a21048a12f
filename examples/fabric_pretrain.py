"""Pretrain a small LitGPT model with Lightning Fabric and AutoSP sequence parallelism.

    pip install --no-deps litgpt psutil      # LitGPT pins an older jsonargparse; it runs with ours
    python examples/fabric_pretrain.py                          # 2 CPU processes, sp=2
    python examples/fabric_pretrain.py --devices 4 --fsdp       # dp=2 x sp=2, parameters sharded

The loop is LitGPT's pretraining loop in miniature: the token batch is sliced before the model
(``tokens[:, :-1]`` in, ``tokens[:, 1:]`` as targets), AdamW, gradient accumulation, clipping, a
checkpoint at the end. The only AutoSP-specific lines are the strategy and
``fabric.strategy.compile_step``, which marks the function AutoSP compiles: the model's forward
*and* its loss, so the logits never leave the graph whole. Each sequence is split over the
``sp_size`` ranks of its SP group; the losses and gradients are those of one device.

The data counts with a random stride per sequence, so the loss falls from ``ln(vocab)`` once
attention learns to read the previous position.
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_autosp.fabric import AutoSPStrategy

try:
    from litgpt.model import GPT, Config
    from litgpt.utils import chunked_cross_entropy
except ImportError as exc:  # pragma: no cover
    raise SystemExit("This example trains LitGPT's GPT: pip install --no-deps litgpt psutil") from exc


class CountingTask(Dataset):
    """Sequences of ``seq_len + 1`` tokens that count from a random start with a random stride
    (1 to 4) modulo the vocabulary: the next token follows from the last two, so a model that
    attends to the previous position predicts it."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 5, (n, 1), generator=g)
        self.tokens = (start + stride * torch.arange(seq_len + 1)) % vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.tokens[i]


def main(args: argparse.Namespace) -> None:
    strategy = AutoSPStrategy(sp_size=args.sp_size, fsdp=args.fsdp, compile_backend=args.compile_backend)
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(42)

    config = Config.from_name(
        "pythia-14m", n_layer=2, n_embd=64, n_head=4, head_size=16, vocab_size=args.vocab, padded_vocab_size=args.vocab,
        block_size=args.seq_len,
    )
    with fabric.init_module(empty_init=args.fsdp):  # sharded: built on the meta device, initialised in setup
        model = GPT(config)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1))
    loader = fabric.setup_dataloaders(  # every rank of an SP group reads the same samples
        DataLoader(CountingTask(args.micro_batch * args.accumulate * args.steps * strategy.dp_size, args.seq_len, args.vocab), batch_size=args.micro_batch)
    )

    @fabric.strategy.compile_step
    def loss_fn(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
        input_ids, targets = tokens[:, :-1], tokens[:, 1:]
        return chunked_cross_entropy(model(input_ids), targets)

    fabric.print(f"{fabric.world_size} processes as dp={strategy.dp_size} x sp={strategy.sp_size}; ln(vocab) = {math.log(args.vocab):.2f}")
    for i, tokens in enumerate(loader):
        step, last = i // args.accumulate + 1, (i + 1) % args.accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = loss_fn(model, tokens)
            fabric.backward(loss / args.accumulate)
        if not last:
            continue
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % args.log_every == 0 or step == args.steps:
            fabric.print(f"step {step:4d}  loss {loss.item():.3f}  grad norm {norm.item():.3f}")
    fabric.save(args.checkpoint, {"model": model, "optimizer": optimizer, "step": args.steps})
    fabric.print(f"saved {args.checkpoint}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--sp-size", type=int, default=2)
    p.add_argument("--fsdp", action="store_true", help="shard parameters, gradients and optimizer state")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint", default="out/fabric_pretrain/final.ckpt")
    return p.parse_args()


if __name__ == "__main__":
    main(parse_args())
