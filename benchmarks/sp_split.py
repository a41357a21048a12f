"""Does every op run on the rank's own tokens? Per model and recipe, the bytes a rank keeps for
backward at sp=2 (and more) against the same step at sp=1, and the ops the SP pass ran replicated
(all-gathering their inputs) - side by side in one run on CPU/gloo.

Sequence parallelism pays only where each rank holds about ``1/P`` of the activations; an op run
replicated holds the whole sequence on every rank. Cases (small configs, AutoSP's default SAC,
the aot_eager backend):

* ``hf-llama``: Hugging Face Llama, ``model(input_ids, labels, use_cache=False).loss``;
* ``hf-mixtral`` / ``hf-qwen3_moe`` / ``hf-deepseek_v3``: Hugging Face mixtures of experts (top-2 of
  4 experts; Mixtral with its load-balancing loss, ``output_router_logits=True``; DeepSeek-V3 with
  grouped routing and a dense first layer);
* ``litgpt-pretrain``: LitGPT's Llama (GQA, ``repeat_interleave``) with its pretraining loss,
  ``chunked_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])`` (chunks of 128 rows);
* ``litgpt-finetune``: the same model with its fine-tuning loss, ``model(x, lm_head_chunk_size=128)``,
  the last chunk shifted, ``chunked_cross_entropy`` over the list;
* ``litgpt-moe``: LitGPT's Mixtral (``LLaMAMoE``, top-2 of 4 experts routed with ``torch.where(mask)``)
  with the pretraining loss.

Per case: autograd's saved bytes per rank (``saved_tensors_hooks``, rank 0) at each sp, the ratio
to sp=1 (1/P is the ideal; the gap is what stays replicated: weights' gradients are not counted,
parameters and inputs are left out) and the ops run replicated at the largest sp::

    .venv/bin/python benchmarks/sp_split.py --seq-len 1024 --sp 2
"""

from __future__ import annotations

import argparse
import re
from typing import Optional

import _common  # noqa: F401  (puts the checkout on sys.path)
import torch
import torch.distributed as dist
from _common import MiB, SavedBytes, arguments, finish, machine, parser, run_distributed

from autosp.backend import AutoSPBackend
from autosp.compile_prep import prepare_for_compile
from autosp.passes.sac import SACConfig

CASES = ("hf-llama", "hf-mixtral", "hf-qwen3_moe", "hf-deepseek_v3", "litgpt-pretrain", "litgpt-finetune", "litgpt-moe")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = parser(__doc__, threads=True)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--sp", type=int, nargs="+", default=[2], help="SP sizes to compare with sp=1")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    return p.parse_args(argv)


def build(case: str, args: argparse.Namespace):
    """The model and its loss ``loss(model, ids)``."""
    torch.manual_seed(0)
    if case.startswith("litgpt"):
        from litgpt.model import GPT, Config
        from litgpt.utils import chunked_cross_entropy

        moe = dict(n_expert=4, n_expert_per_token=2) if case == "litgpt-moe" else {}
        config = Config.from_name(
            "Mixtral-8x7B-v0.1" if moe else "Llama-3.2-1B", n_layer=2, n_embd=64, n_head=4, head_size=16, n_query_groups=2,
            intermediate_size=128, vocab_size=args.vocab, padded_vocab_size=args.vocab, block_size=args.seq_len, **moe,
        )
        if case in ("litgpt-pretrain", "litgpt-moe"):
            def loss(model, ids):
                return chunked_cross_entropy(model(ids[:, :-1]), ids[:, 1:])
        else:
            def loss(model, ids):
                logits = model(ids, lm_head_chunk_size=128)
                logits[-1] = logits[-1][..., :-1, :]
                return chunked_cross_entropy(logits, ids[..., 1:])
        return GPT(config), loss
    import transformers

    common = dict(
        vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=args.seq_len, attn_implementation="sdpa",
    )
    if case == "hf-llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif case == "hf-mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True))
    elif case == "hf-deepseek_v3":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
            n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16))

    def loss(model, ids):
        return model(input_ids=ids, labels=ids, use_cache=False).loss

    return model, loss


def run(rank: int, world: int, args: argparse.Namespace) -> dict:
    ids = torch.randint(0, args.vocab, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    results: dict = {"config": arguments(args), "machine": machine(), "cases": {}}
    # every rank creates every group (new_group is collective); ranks >= sp sit out that size
    groups = {sp: dist.new_group(list(range(sp))) if sp < world else dist.group.WORLD for sp in [1, *args.sp]}
    for case in args.cases:
        if case.startswith("litgpt"):
            try:
                import litgpt  # noqa: F401
            except ImportError:
                continue
        row: dict = {}
        for sp in [1, *args.sp]:
            if rank >= sp:  # this rank sits out the smaller group: keep the collectives matched
                dist.barrier()
                continue
            saved, fallbacks = _in_group(rank, sp, case, args, ids, groups[sp])
            row[sp] = {"saved": saved, "fallbacks": fallbacks}
            dist.barrier()
        results["cases"][case] = row
        if rank == 0:
            base = row[1]["saved"]
            cols = ", ".join(f"sp={sp} {row[sp]['saved'] / MiB:.2f} MiB ({row[sp]['saved'] / base:.2f}x)" for sp in args.sp)
            print(f"{case}: sp=1 {base / MiB:.2f} MiB, {cols}; replicated at sp={args.sp[-1]}: "
                  f"{len(row[args.sp[-1]]['fallbacks'])} {row[args.sp[-1]]['fallbacks']}", flush=True)
    return results


def _in_group(rank: int, sp: int, case: str, args: argparse.Namespace, ids: torch.Tensor, group) -> tuple[int, list[str]]:
    model, loss = build(case, args)
    prepare_for_compile(model)  # as AutoSPStrategy does (Hugging Face's lazy hooks would break the graph)
    backend = AutoSPBackend(sp_size=sp, sp_rank=rank, group_name=group.group_name, backend="aot_eager", sac=SACConfig())
    compiled = torch.compile(lambda x: loss(model, x), backend=backend)
    x = ids.clone()
    torch._dynamo.mark_dynamic(x, 1)
    # as AutoSPStrategy compiles steps: data-dependent shapes (LitGPT's router) traced into the graph
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled(x).backward()  # compile
        saved = SavedBytes([*model.parameters(), *model.buffers(), x])
        with saved.hooks():
            out = compiled(x)
    out.backward()
    fallbacks = [f for s in backend.pass_stats for f in s.fallbacks]
    torch._dynamo.reset()
    return saved.total, fallbacks


def report(res: dict) -> str:
    sps = res["config"]["sp"]
    lines = [f"S = {res['config']['seq_len']}, per-rank bytes kept for backward (rank 0), ratio to sp=1 (ideal 1/sp)", ""]
    lines.append("| case | sp=1 | " + " | ".join(f"sp={sp}" for sp in sps) + " | ops run replicated |")
    lines.append("|---|---|" + "---|" * len(sps) + "---|")
    for case, row in res["cases"].items():
        row = {int(k): v for k, v in row.items()}
        base = row[1]["saved"]
        cells = " | ".join(f"{row[sp]['saved'] / MiB:.2f} MiB ({row[sp]['saved'] / base:.2f}x)" for sp in sps)
        ops = sorted({re.search(r"\((.*?)\)", f).group(1) for f in row[sps[-1]]["fallbacks"]})
        lines.append(f"| {case} | {base / MiB:.2f} MiB | {cells} | {len(row[sps[-1]]['fallbacks'])} {', '.join(ops)} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    res = run_distributed(run, max(args.sp), args, threads=args.threads)
    return finish(res, args, report)


if __name__ == "__main__":
    main()
