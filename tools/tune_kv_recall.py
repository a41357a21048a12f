"""Tune the KV-recall demo: plain eager, single-process training of the bundled Llama.

Trains ``Llama`` on ``KVRecallDataset`` with AdamW (+ linear warmup) and prints
``step, loss, acc, wall seconds`` so that a configuration can be picked which
learns well above chance within the CPU demo budget.

Example::

    .venv/bin/python tools/tune_kv_recall.py --threads 2 --steps 300

The defaults are the task, model and optimiser of ``configs/demo_cpu.yaml`` (without SP: one
process sees whole sequences, so sweeps run faster; confirm a pick with the real config).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a source checkout

from lightning_autosp.examples.causal_lm import WarmupCosine  # noqa: E402
from lightning_autosp.examples.kv_recall import KVRecallDataset  # noqa: E402
from autosp.models import build_model  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["llama", "gpt"], default="llama")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--num-pairs", type=int, default=1)
    p.add_argument("--num-queries", type=int, default=16)
    p.add_argument("--num-keys", type=int, default=16)
    p.add_argument("--num-values", type=int, default=8)
    p.add_argument("--num-filler", type=int, default=1)
    p.add_argument("--pair-repeats", type=int, default=1)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--ffn-hidden", type=int, default=128)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--init-std", type=float, default=0.02)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--cosine-decay", action=argparse.BooleanOptionalAction, default=True,
                   help="cosine decay to 0 at --steps after the warmup")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--val-size", type=int, default=32, help="held-out samples scored after training")
    p.add_argument("--max-seconds", type=float, default=None, help="stop after this much wall time")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=str, default=None, help="write the curve to this file")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    ds = KVRecallDataset(
        size=args.steps * args.batch_size, seq_len=args.seq_len, num_pairs=args.num_pairs,
        num_queries=args.num_queries, num_keys=args.num_keys, num_values=args.num_values,
        num_filler=args.num_filler, pair_repeats=args.pair_repeats, seed=args.seed,
    )
    model = build_model(
        args.model, vocab_size=ds.vocab_size, dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads, ffn_hidden=args.ffn_hidden, max_seq_len=args.seq_len,
        init_std=args.init_std, **({"rope_theta": args.rope_theta} if args.model == "llama" else {}),
    )
    n_params = sum(p.numel() for p in model.parameters())
    print(f"config: {json.dumps(vars(args))}")
    print(f"vocab={ds.vocab_size} params={n_params} chance_acc={ds.chance_accuracy:.4f}")

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    total = args.steps if args.cosine_decay else None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(args.warmup_steps, total))

    loader = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True, drop_last=True)
    curve = []
    t0 = time.perf_counter()
    run_loss = run_acc = 0.0
    n = 0
    step = 0
    for batch in loader:
        logits = model(batch["input_ids"])
        labels = batch["labels"]
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        with torch.no_grad():
            mask = labels != -100
            acc = (logits.argmax(-1)[mask] == labels[mask]).float().mean()
        run_loss += loss.item()
        run_acc += acc.item()
        n += 1
        wall = time.perf_counter() - t0
        if step % args.log_every == 0 or step == args.steps:
            rec = {"step": step, "loss": run_loss / n, "acc": run_acc / n, "wall_s": wall}
            curve.append(rec)
            print(f"step {step:5d}  loss {rec['loss']:.4f}  acc {rec['acc']:.3f}  wall {wall:7.1f}s", flush=True)
            run_loss = run_acc = 0.0
            n = 0
        if step >= args.steps or (args.max_seconds is not None and wall > args.max_seconds):
            break
    val_acc = evaluate(model, ds, args) if args.val_size else None
    if val_acc is not None:
        print(f"val_acc {val_acc:.4f} on {args.val_size} held-out samples", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "curve": curve, "val_acc": val_acc}, f, indent=1)


@torch.no_grad()
def evaluate(model: torch.nn.Module, train: KVRecallDataset, args: argparse.Namespace) -> float:
    """Recall accuracy on samples seeded after the training ones (as ``KVRecallDataModule`` does)."""
    val = KVRecallDataset(
        size=args.val_size, seq_len=train.seq_len, num_pairs=train.num_pairs, num_queries=train.num_queries,
        num_keys=train.num_keys, num_values=train.num_values, num_filler=train.num_filler,
        pair_repeats=train.pair_repeats, seed=train.seed + len(train),
    )
    model.eval()
    correct = total = 0
    for batch in torch.utils.data.DataLoader(val, batch_size=args.batch_size):
        labels = batch["labels"]
        mask = labels != -100
        correct += (model(batch["input_ids"]).argmax(-1)[mask] == labels[mask]).sum().item()
        total += mask.sum().item()
    model.train()
    return correct / total


if __name__ == "__main__":
    main()
