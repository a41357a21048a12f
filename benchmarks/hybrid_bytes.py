"""What a hybrid's short convolutions cost under SP: the bytes each rank sends per training step
for their halos, next to the all-to-alls around attention, at two lengths in one run (2
processes on CPU, gloo, sp=2).

The model is Hugging Face's LFM2 (short convolution layers next to attention layers), fp32,
AutoSP + SAC (aot_eager), ``strict=True`` (nothing runs replicated). Counted by AutoSP's ops
(``autosp.ops.collectives.SENT_BYTES``): ``halo``, the last ``kernel - 1`` positions of the
rank's shard each convolution sends to the next rank and the gradient of what it received sent
back (``B x channels x (kernel-1)`` values each way, whatever the length); ``exchange``, Ulysses'
all-to-alls (they grow with the length). The loss of each length is compared with one device.

    .venv/bin/python benchmarks/hybrid_bytes.py --seq-lens 1024 4096 --out benchmarks/results/hybrid_bytes.json
"""

from __future__ import annotations

import argparse
from typing import Optional

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.distributed as dist
from _common import arguments, finish, machine, parser, run_distributed


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--conv-kernel", type=int, default=3, help="LFM2's conv_L_cache: the kernel size")
    return p.parse_args(argv)


def _model(args: argparse.Namespace):
    import transformers

    config = transformers.Lfm2Config(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=max(args.seq_lens),
        layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=args.conv_kernel,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.Lfm2ForCausalLM(config)


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    from autosp.backend import AutoSPBackend
    from autosp.ops.collectives import SENT_BYTES
    from autosp.passes.sac import SACConfig

    model = _model(args)
    res: dict = {"lengths": {}}
    for seq in args.seq_lens:
        ids = torch.randint(0, 1024, (1, seq), generator=torch.Generator().manual_seed(seq))
        reference = float(model(input_ids=ids, labels=ids, use_cache=False).loss) if rank == 0 else 0.0
        torch._dynamo.reset()
        torch._dynamo.mark_dynamic(ids, 1)
        backend = AutoSPBackend(sp_size=world, sp_rank=rank, group_name=dist.group.WORLD.group_name, backend="aot_eager",
                                sac=SACConfig(), strict=True)
        step = torch.compile(lambda a: model(input_ids=a, labels=a, use_cache=False).loss, backend=backend)
        model.zero_grad()
        step(ids).backward()  # compile
        before = dict(SENT_BYTES)
        loss = step(ids)
        loss.backward()
        sent = {k: SENT_BYTES[k] - before[k] for k in SENT_BYTES}
        top = torch.tensor([float(sent["halo"]), float(sent["exchange"])], dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        res["lengths"][seq] = {"halo": int(top[0]), "exchange": int(top[1]), "loss": float(loss.detach()), "reference": reference}
    return res


def markdown(res: dict) -> str:
    a = res["args"]
    lines = [
        f"2 processes (gloo, CPU), Hugging Face LFM2 hidden={a['hidden']}, 4 layers (2 convolutions of kernel "
        f"{a['conv_kernel']}, 2 attention), batch 1, fp32, sp=2, AutoSP + SAC (aot_eager), strict=True; per rank and "
        f"training step (forward and backward), the larger of the two ranks. {res['machine']}",
        "",
        "| tokens | halo bytes sent | all-to-all bytes sent | halo / all-to-all | loss | one device |",
        "|---|---|---|---|---|---|",
    ]
    for seq, r in res["lengths"].items():
        lines.append(f"| {int(seq):,} | {r['halo']:,} | {r['exchange']:,} | {r['halo'] / r['exchange']:.2e} | {r['loss']:.6f} | {r['reference']:.6f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    res = run_distributed(run, 2, args)
    res.update(args=arguments(args), machine=machine())
    return finish(res, args, markdown)


if __name__ == "__main__":
    main()
