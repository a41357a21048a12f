"""What a hybrid's sequence mixers cost under SP: the bytes each rank sends per training step, at
two lengths in one run (2 processes on CPU, gloo, sp=2), for each scheme AutoSP has.

Two Hugging Face models, fp32, AutoSP + SAC (aot_eager), ``strict=True`` (nothing runs
replicated):

* LFM2 (short convolution layers next to attention layers): the convolutions take a halo;
* Mamba-2 alone (no attention): each layer's convolution takes a halo and its chunked scan runs
  on the rank's heads over the whole sequence, between all-to-alls (its inputs ``x``, ``dt``,
  ``B``, ``C`` in, its output back).

Counted by AutoSP's ops (``autosp.ops.collectives.SENT_BYTES``): ``halo``, the last
``kernel - 1`` positions of the rank's shard each convolution sends to the next rank and the
gradient of what it received sent back (``B x channels x (kernel-1)`` values each way, whatever
the length); ``exchange``, the all-to-alls (around attention for LFM2, around the scans for
Mamba-2; they grow with the length); ``gather``, all-gathers of a sequence (Mamba-2's one group of
``B``/``C``, read by every head, whole on every rank) and their reduce-scatters in backward. The
loss of each length is compared with one device.

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
    p.add_argument("--conv-kernel", type=int, default=3, help="the convolutions' kernel size")
    p.add_argument("--families", nargs="+", default=["lfm2", "mamba2"], choices=["lfm2", "mamba2"])
    return p.parse_args(argv)


def _model(family: str, args: argparse.Namespace):
    import transformers

    torch.manual_seed(0)
    if family == "mamba2":  # 2 layers: hidden -> 2*hidden channels in heads of 64, one group of B/C
        config = transformers.Mamba2Config(
            vocab_size=1024, hidden_size=args.hidden, num_hidden_layers=2, num_heads=2 * args.hidden // 64, head_dim=64,
            state_size=16, n_groups=1, chunk_size=64, expand=2, conv_kernel=args.conv_kernel,
        )
        return transformers.Mamba2ForCausalLM(config)
    config = transformers.Lfm2Config(
        vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=max(args.seq_lens),
        layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=args.conv_kernel,
        attn_implementation="sdpa",
    )
    return transformers.Lfm2ForCausalLM(config)


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    from autosp.backend import AutoSPBackend
    from autosp.compile_prep import prepare_for_compile
    from autosp.ops.collectives import SENT_BYTES
    from autosp.passes.sac import SACConfig

    res: dict = {"families": {}}
    for family in args.families:
        model = _model(family, args)
        prepare_for_compile(model)  # registers Mamba-2's scan as a mixer, as the strategy does
        found: dict = {}
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
            top = torch.tensor([float(sent["halo"]), float(sent["exchange"]), float(sent["gather"])], dtype=torch.float64)
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            stats = backend.pass_stats
            found[seq] = {
                "halo": int(top[0]), "exchange": int(top[1]), "gather": int(top[2]), "loss": float(loss.detach()), "reference": reference,
                "attention": sum(g.attention for g in stats), "mixers": sum(g.sequence_mixers for g in stats),
                "convolutions": sum(g.halo_convolutions for g in stats),
            }
        res["families"][family] = {"lengths": found}
    return res


def markdown(res: dict) -> str:
    a = res["args"]
    lines = [
        f"2 processes (gloo, CPU), hidden={a['hidden']}, convolutions of kernel {a['conv_kernel']}, batch 1, fp32, sp=2, "
        f"AutoSP + SAC (aot_eager), strict=True; per rank and training step (forward and backward), the larger of the two "
        f"ranks. LFM2: 4 layers (2 convolutions, 2 attention); Mamba-2: 2 layers (a convolution and a chunked scan "
        f"each, no attention). {res['machine']}",
        "",
        "| model | tokens | split (attention / scans / convolutions) | halo bytes sent | all-to-all bytes sent | all-gather bytes sent | halo / all-to-all | loss | one device |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for family, f in res["families"].items():
        for seq, r in f["lengths"].items():
            lines.append(
                f"| {family} | {int(seq):,} | {r['attention']} / {r['mixers']} / {r['convolutions']} | {r['halo']:,} | "
                f"{r['exchange']:,} | {r['gather']:,} | {r['halo'] / r['exchange']:.2e} | {r['loss']:.6f} | {r['reference']:.6f} |"
            )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    res = run_distributed(run, 2, args)
    res.update(args=arguments(args), machine=machine())
    return finish(res, args, markdown)


if __name__ == "__main__":
    main()
