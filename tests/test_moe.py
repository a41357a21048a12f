"""Mixtures of experts on the rank's own tokens, against one device: Hugging Face Mixtral and
Qwen3-MoE with their load-balancing losses (Qwen3-MoE's over padded rows, masked with a
``scatter_add_``) and DeepSeek-V3 (grouped routing, a dense layer first) in one step. The experts' dispatch - a sort of every token's choices, the gathers by it,
grouped matmuls, the inverse permutation - runs on each rank's rows: nothing is all-gathered."""

import pytest
import torch
import torch.nn as nn
from mask_models import ModelZoo, PaddedBothSides, padded_call, plain_call
from sp_harness import START_METHOD, FnModule, check_against_references, run_fit

from autosp.backend import collectives_keep_their_order

VOCAB = 64


def moe_factory(family: str, seed: int, layers: int = 2, **extra):
    """A tiny Hugging Face mixture of experts (DeepSeek-V3: ``layers`` layers, the first dense
    when there are two)."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa",
    )

    def build():
        torch.manual_seed(seed)
        if family == "mixtral":
            return transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, **extra))
        if family == "qwen3_moe":
            return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
                **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8, **extra))
        return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4, "num_hidden_layers": layers}, moe_intermediate_size=16, n_routed_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=layers - 1, q_lora_rank=None, kv_lora_rank=16,
            qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, **extra))

    return build


def ids_call(model, batch):
    return model(batch["input_ids"])


FAMILIES = [
    ("mixtral_aux_loss", moe_factory("mixtral", 21, output_router_logits=True, router_aux_loss_coef=0.5), plain_call),
    ("qwen3_moe_padding_aux_loss", moe_factory("qwen3_moe", 22, output_router_logits=True), padded_call),
    ("deepseek_v3", moe_factory("deepseek_v3", 23), plain_call),
    ("sorted_dispatch_written_out", lambda: SortedMoE(seed=24), ids_call),
]


#: the default configuration's test: one MoE layer of DeepSeek-V3 (inductor compiles slowly on 2 cores)
INDUCTOR_FAMILIES = [("deepseek_v3_moe_layer", moe_factory("deepseek_v3", 25, layers=1), plain_call)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "devices,sp_size,backend",
    [
        pytest.param(2, 2, "inductor", marks=[pytest.mark.full, pytest.mark.skipif(
            not collectives_keep_their_order(), reason="this torch has no control_deps: inductor may reorder collectives")]),
    ],
    ids=["sp2-inductor"],
)
def test_experts_run_on_the_rank_tokens(tmp_path, devices, sp_size, backend):
    """31 tokens split 16 + 15: loss and gradients equal one device (the aux loss's counts and
    means summed over the SP group), no op runs replicated, every dispatch runs per rank. At sp=2
    in the default configuration (inductor, SAC) with DeepSeek-V3's MoE layer: the ranks'
    different token counts once made inductor order their all-to-alls differently there, a
    collective mismatch."""
    families = FAMILIES if backend == "aot_eager" else INDUCTOR_FAMILIES
    factory = lambda: ModelZoo(families)  # noqa: E731
    run = run_fit(
        tmp_path, FnModule(factory, ModelZoo.loss, log_loss=False), PaddedBothSides(4 * devices, 31), devices=devices,
        sp_size=sp_size, backend=backend,
    )
    loss_err, grad_err, naive = check_against_references(run, sp_size, factory, ModelZoo.loss)
    print(f"MoE zoo {devices} devices sp{sp_size} {backend}: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    graphs = run.ranks[0]["graphs"]["training_step"]
    assert len(graphs) == 1, "one graph per step (Hugging Face's lazy hooks installed before compiling)"
    assert [f for g in graphs for f in g.fallbacks] == []
    assert sum(g.expert_dispatch for g in graphs) == len(families)


@pytest.mark.slow
@pytest.mark.skipif(START_METHOD != "fork", reason="the broken dispatch is patched in this process: only forked ranks see it")
def test_a_dispatch_on_other_tokens_is_caught(tmp_path, monkeypatch):
    """The negative control: the same dispatch gathering from the whole sequence instead of the
    rank's rows (the local permutation then picks other tokens) is far from one device."""
    from sp_harness import compare, reference_fn

    from autosp.passes.sp_rules import expert_dispatch

    monkeypatch.setattr(expert_dispatch, "_rank_rows", lambda rw, base, want: rw.redistribute.to_replicate(base))
    factory, loss = (lambda: SortedMoE(seed=24)), ids_call
    run = run_fit(tmp_path, FnModule(factory, loss, log_loss=False), PaddedBothSides(4, 31), devices=2, sp_size=2)
    loss_err, grad_err = compare(run, 2, *reference_fn(factory, loss, run, 2))
    print(f"broken dispatch sp2: loss {loss_err:.2e} grad {grad_err:.2e}")
    assert run.ranks[0]["graphs"]["training_step"][0].expert_dispatch == 1
    assert min(loss_err, grad_err) > 1e-2


@pytest.mark.slow
@pytest.mark.skipif(START_METHOD != "fork", reason="the broken sums are patched in this process: only forked ranks see it")
@pytest.mark.full
def test_load_balancing_counts_summed_over_ranks_are_checked(tmp_path, monkeypatch):
    """The negative control of the load-balancing losses: each rank's ``histc`` count of its tokens'
    experts (Mixtral) and ``scatter_add_`` of its unpadded tokens (Qwen3-MoE) kept to itself - the
    all-reduce over the SP group dropped - is far from one device."""
    from sp_harness import compare, reference_fn

    from autosp.passes import runtime

    def local_only(kind, d, dim, index, src, group_name, group_size):
        part = torch.zeros_like(d).scatter_add(dim, index, src) if kind == "scatter_add" else torch.zeros_like(d).index_add(dim, index, src)
        return d + part

    monkeypatch.setattr(runtime, "group_sum", lambda x, group_name, group_size: x)
    monkeypatch.setattr(runtime, "add_over_group", local_only)
    families = [f for f in FAMILIES if f[0] in ("mixtral_aux_loss", "qwen3_moe_padding_aux_loss")]
    factory = lambda: ModelZoo(families)  # noqa: E731
    run = run_fit(tmp_path, FnModule(factory, ModelZoo.loss, log_loss=False), PaddedBothSides(4, 31), devices=2, sp_size=2)
    loss_err, grad_err = compare(run, 2, *reference_fn(factory, ModelZoo.loss, run, 2))
    print(f"load-balancing counts not summed over ranks: loss {loss_err:.2e} grad {grad_err:.2e}")
    assert min(loss_err, grad_err) > 1e-3


@pytest.mark.slow
@pytest.mark.full
def test_the_moe_zoo_is_one_graph_only_once_prepared():
    """Hugging Face installs its router-logit hooks lazily, under a lock Dynamo cannot trace:
    without :func:`prepare_for_compile` the step splits into several graphs (the loss and the
    load-balancing loss after the break would run on gathered outputs), with it the step is one -
    what test_experts_run_on_the_rank_tokens asserts of every compiled step."""
    from mask_models import PaddedBothSides as Data

    from autosp.compile_prep import prepare_for_compile

    data = Data(2, 31)
    batch = {k: torch.stack([data[i][k] for i in range(2)]) for k in data[0]}
    counts = {}
    for prepared in (False, True):
        zoo = ModelZoo(FAMILIES[:2])
        if prepared:
            prepare_for_compile(zoo)
        torch._dynamo.reset()
        counts[prepared] = torch._dynamo.explain(lambda b: ModelZoo.loss(zoo, b))(batch).graph_count
    assert counts == {False: counts[False], True: 1} and counts[False] > 1, counts


# ------------------------------------------------------------------ the region, traced on one rank
class SortedMoE(nn.Module):
    """Causal attention, then the dispatch of Hugging Face's grouped experts written out: sort the ``tokens x k``
    choices, gather each row's token, each row through its expert (a per-row matrix), weight,
    un-permute, sum the ``k`` rows of each token. ``variant`` breaks one of its premises."""

    def __init__(self, variant: str = "", dim: int = 16, experts: int = 4, k: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.variant, self.k = variant, k
        self.embed = nn.Embedding(VOCAB, dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.Parameter(torch.randn(experts, dim, dim) / dim**0.5)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        B, S, D = x.shape
        heads = x.view(B, S, 4, D // 4).transpose(1, 2)
        x = x + torch.nn.functional.scaled_dot_product_attention(heads, heads, heads, is_causal=True).transpose(1, 2).reshape(B, S, D)
        h = x.reshape(-1, D)
        weights, chosen = self.router(h).softmax(-1).topk(self.k, dim=-1)
        keys, perm = torch.sort(chosen.reshape(-1))
        rows = h[perm // self.k]
        out = torch.bmm(rows.unsqueeze(1), self.experts[keys]).squeeze(1) * weights.reshape(-1)[perm].unsqueeze(-1)
        if self.variant == "capacity":  # a row's place in its expert's queue: depends on the rows before it
            place = torch.nn.functional.one_hot(keys, self.experts.shape[0]).cumsum(0)
            out = out * (place.gather(1, keys[:, None]) <= 8)
        if self.variant == "returned":
            return out
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.shape[0])
        y = out[inverse].view(B * S, self.k, D).sum(1).view(B, S, D)
        return torch.nn.functional.cross_entropy(self.head(y).flatten(0, 1), ids.flatten())


def _trace(variant):
    from sp_harness import trace_rank

    model = SortedMoE(variant)
    return trace_rank(lambda ids: model(ids), [torch.randint(0, VOCAB, (2, 31))])["stats"]


def test_a_sorted_dispatch_runs_on_the_rank_rows():
    stats = _trace("")
    assert stats.expert_dispatch == 1 and stats.fallbacks == [] and stats.dispatch_rejections == []


@pytest.mark.parametrize("variant,why", [("capacity", "one_hot"), ("returned", "returned")])
def test_a_dispatch_that_is_not_row_wise_runs_replicated(variant, why):
    """Expert capacity (a row's fate depends on the rows before it) and permuted rows leaving the
    region cannot run per rank: the sort and its gathers run replicated, reported, with the reason."""
    stats = _trace(variant)
    assert stats.expert_dispatch == 0
    assert len(stats.dispatch_rejections) == 1 and why in stats.dispatch_rejections[0], stats.dispatch_rejections
    assert any("(sort)" in f for f in stats.fallbacks), stats.fallbacks
