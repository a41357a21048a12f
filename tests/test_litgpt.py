"""LitGPT (Lightning's LLM library) as a tested family: its ``GPT`` in several configurations,
trained the way LitGPT's own recipes train it, each at sp=2 against one device (loss and
gradients) with the naive-sharding negative control.

* the pretraining recipe: the token batch sliced *before* the model (``tokens[:, :-1]`` in,
  ``tokens[:, 1:]`` as targets), ``chunked_cross_entropy``;
* the fine-tuning recipe: ``model(input_ids, lm_head_chunk_size=...)`` returns the logits in
  chunks of the sequence, the last one shifted, ``chunked_cross_entropy`` over the list.

LitGPT pins an older jsonargparse than ours; it imports fine with our dependencies, so
``make install`` adds it without its dependencies (plus ``psutil``, which it imports).
"""

import pytest
import torch
from sp_harness import VOCAB, FnModule, TokenData, check_against_references, run_fit

pytest.importorskip("litgpt")
from litgpt.model import GPT, Config  # noqa: E402
from litgpt.utils import chunked_cross_entropy  # noqa: E402

#: a LitGPT configuration by name, shrunk (2 layers, 4 query heads of 8 dims), and what it exercises
FAMILIES = {
    "llama": ("Llama-3.2-1B", dict(n_query_groups=2, intermediate_size=64)),  # GQA, RoPE, RMSNorm, SwiGLU
    "pythia": ("pythia-14m", {}),  # parallel residual, partial RoPE (a quarter of the head dims), LayerNorm, GELU
    "falcon": ("falcon-7b", dict(n_query_groups=1)),  # MQA (1 KV head for 2 ranks), one norm shared by attention and MLP
    # soft-capped logits (attention written by hand), GeGLU, extra norms; its sliding-window layers off
    "gemma2": ("Gemma-2-2b", dict(n_query_groups=2, intermediate_size=64, sliding_window_size=None)),
    "mixtral": (  # a mixture of experts routed with torch.where(mask): data-dependent sizes
        "Mixtral-8x7B-v0.1", dict(n_query_groups=2, intermediate_size=64, n_expert=4, n_expert_per_token=2)
    ),
}


def tiny_gpt(family: str, block_size: int = 64) -> GPT:
    name, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = Config.from_name(
        name, n_layer=2, n_embd=32, n_head=4, head_size=8, vocab_size=VOCAB, padded_vocab_size=VOCAB, block_size=block_size, **extra
    )
    return GPT(config)


def pretrain_loss(model: GPT, batch) -> torch.Tensor:
    """LitGPT's pretraining step: inputs and targets sliced from one token batch before the model."""
    tokens = batch["input_ids"]
    input_ids, targets = tokens[:, :-1], tokens[:, 1:]
    return chunked_cross_entropy(model(input_ids), targets)


def pretrain_loss_chunk8(model: GPT, batch) -> torch.Tensor:
    """The pretraining step with the loss in chunks of 8 rows: the 2 x 17 flattened positions in
    5 chunks, which straddle the ranks' tokens."""
    tokens = batch["input_ids"]
    return chunked_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], chunk_size=8)


def finetune_loss(model: GPT, batch) -> torch.Tensor:
    """LitGPT's fine-tuning step: logits in chunks of the sequence, shifted after the model
    (chunks of 5 of the 18 tokens: the last, 3 long, keeps 2 after the shift - a size of 1
    would make Dynamo specialize the sequence length)."""
    logits = model(batch["input_ids"], lm_head_chunk_size=5)
    logits[-1] = logits[-1][..., :-1, :]
    return chunked_cross_entropy(logits, batch["labels"][..., 1:])


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,recipe,devices",
    [pytest.param(*case, marks=() if case == ("llama", "pretrain-chunk8", 2) else pytest.mark.full) for case in [
        ("llama", "pretrain", 2), ("pythia", "pretrain", 2), ("falcon", "pretrain", 2), ("gemma2", "pretrain", 2),
        ("llama", "pretrain-chunk8", 2), ("llama", "finetune", 2), ("mixtral", "pretrain", 4), ("mixtral", "finetune", 2),
    ]],
)
def test_litgpt_matches_one_device(tmp_path, family, recipe, devices):
    """18 tokens: the pretraining recipe's 17 positions split 9 + 8 over the two ranks of an SP
    group; LitGPT's Mixtral (Llama with a mixture of experts) at dp=2 x sp=2 (pretraining) and sp=2."""
    factory = lambda: tiny_gpt(family)  # noqa: E731
    loss_fn = {"pretrain": pretrain_loss, "pretrain-chunk8": pretrain_loss_chunk8, "finetune": finetune_loss}[recipe]
    run = run_fit(tmp_path, FnModule(factory, loss_fn, log_loss=False), TokenData(4 * devices, 18), devices=devices, sp_size=2, steps=2)
    check_against_references(run, 2, factory, loss_fn)
    graphs = run.ranks[0]["graphs"]["training_step"]
    # LLaMAMoE routes with torch.where(mask) per expert: traced with data-dependent sizes, each of
    # the 4 experts of the 2 layers runs on the rank's own tokens
    assert sum(g.expert_dispatch for g in graphs) == (8 if family == "mixtral" else 0)
    assert sum(g.attention for g in graphs) == 2
    assert sum(g.manual_attention for g in graphs) == (2 if family == "gemma2" else 0)
    # Gemma-2's soft-capped attention adds a mask it builds as ones(S, S).triu(1).masked_fill_(..): tiled
    assert sum(g.tiled_attention for g in graphs) == (2 if family == "gemma2" else 0)
    assert not [m for g in graphs for m in g.dense_masks]
    # KV heads repeated by repeat_interleave (GQA, MQA) run on the rank's tokens and travel unrepeated
    assert sum(g.kv_exchanged_unrepeated for g in graphs) == (4 if FAMILIES[family][1].get("n_query_groups") == 2 else 0)
    assert {g.seq_offset for g in graphs if g.attention} == {0 if recipe == "finetune" else -1}
    # chunked_cross_entropy (over chunks of rows, or over the model's lm_head chunks): one loss over
    # the rank's rows, fused with lm_head - nothing runs replicated
    assert [g.fallbacks for g in graphs if g.attention] == [[]]
    assert sum(g.merged_losses for g in graphs) == (1 if recipe == "finetune" else 2)
    # Gemma-2 soft-caps the logits before the loss: its rank's logits exist, not fused
    assert sum(g.fused_losses for g in graphs) == (0 if family == "gemma2" else 1)


@pytest.mark.slow
@pytest.mark.full
def test_litgpt_sliding_window_mask_is_a_clear_error(tmp_path):
    """LitGPT builds Gemma-2's sliding-window mask row by row (``for i in range(T)``), which makes
    the sequence length a Python number: the error points at that line, not at the batch."""
    def factory():
        model = tiny_gpt("gemma2")
        for block in model.transformer.h:
            block.attn.apply_sliding_window_attention = True
            block.attn.config.sliding_window_size = 4
        return model

    with pytest.raises(Exception, match=r"(?s)fixed size.*Dynamo fixed it here:.*litgpt/model\.py.*for i in range\(T\)"):
        run_fit(tmp_path, FnModule(factory, pretrain_loss, log_loss=False), TokenData(4, 18), devices=2, sp_size=2, steps=1)


@pytest.mark.slow
def test_litgpt_lm_head_chunk_of_one_token_is_a_clear_error(tmp_path):
    """LitGPT's fine-tuning recipe at 18 tokens with chunks of 17: the last lm_head chunk has one
    position, so Dynamo fixes the sequence length. The error says so, instead of blaming the
    graph break of the module's logging after the loss (its own, unrelated)."""
    def loss_fn(model, batch):
        logits = model(batch["input_ids"], lm_head_chunk_size=17)
        logits[-1] = logits[-1][..., :-1, :]
        return chunked_cross_entropy(logits, batch["labels"][..., 1:])

    with pytest.raises(Exception, match=r"(?s)sequence length fixed at 18.*last piece has 1 element") as info:
        run_fit(tmp_path, FnModule(lambda: tiny_gpt("llama"), loss_fn), TokenData(4, 18), devices=1, sp_size=1, steps=1)
    assert "split this step into several graphs" not in str(info.value)
