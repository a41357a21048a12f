"""Hybrid models - a state-space mixer (Mamba-2's chunked scan) next to attention - as they run
today: their sequence mixers have no placement of their own yet, so the mixer runs replicated
(reported as a fallback; ``strict=True`` refuses it) and the model equals one device. The pass
follows a sequence padded to a multiple of the scan's chunk and cut back, where Dynamo's guards
prove the padding 0 (it stopped with an internal error there)."""

import pytest
import torch
from sp_harness import VOCAB, FnModule, TokenData, check_against_references, run_fit, trace_rank

import autosp.passes.placement as placement


def hybrid(family: str):
    """A tiny Hugging Face hybrid: Falcon-H1 (a Mamba-2 mixer beside attention in every layer) or
    Bamba (Mamba-2 layers, one attention layer)."""
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa")
    if family == "falcon_h1":
        cls, config = transformers.FalconH1ForCausalLM, transformers.FalconH1Config(
            **common, head_dim=8, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
            mamba_chunk_size=16,
        )
    else:
        cls, config = transformers.BambaForCausalLM, transformers.BambaConfig(
            **common, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16, mamba_expand=2,
            mamba_d_conv=4, attn_layer_indices=[1],
        )

    def build():
        torch.manual_seed(3)
        return cls(config)

    return build


def hf_loss(model, batch):
    return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss


class Tokens(TokenData):
    """Hugging Face batches: the labels are the ids (the model shifts them)."""

    def __init__(self, n, seq_len):
        super().__init__(n, seq_len, ignore="none")
        self.y = self.x.clone()


def _step(model):
    return lambda ids, labels: model(input_ids=ids, labels=labels, use_cache=False).loss


@pytest.mark.full
def test_a_length_the_guards_prove_equal_to_the_sequence_is_followed(monkeypatch):
    """Bamba at 64 tokens, traced as rank 0 of sp=2: Mamba-2 pads the sequence to a multiple of its
    chunk (16) and cuts it back only when the padding is not 0, so at 64 the scan's output is as
    long as ``s + Mod(16 - Mod(s, 16), 16)``, which Dynamo's guards make ``s``: the pass reads it as
    the sequence, and the mixer's entry ops run replicated, reported. The control: without the
    guards' proof the pass stops on that size with an internal error."""
    model = hybrid("bamba")()
    ids = torch.randint(0, VOCAB, (2, 64))
    found = trace_rank(_step(model), [ids, ids.clone()])
    assert [f.split(":")[0] for f in found["stats"].fallbacks] == ["conv1d (conv1d)", "tensor_split_1 (tensor_split)"]
    assert found["stats"].sdpa == 1
    torch._dynamo.reset()
    monkeypatch.setattr(placement, "_proved_symbol", lambda d, expr, sym: expr)
    with pytest.raises(Exception, match=r"internal: .* is not outer \* s\d+ \* 1"):
        trace_rank(_step(model), [ids, ids.clone()])


@pytest.mark.slow
@pytest.mark.parametrize("family,seq", [pytest.param("falcon_h1", 64, marks=pytest.mark.full), ("bamba", 61)])
def test_hybrids_equal_one_device_with_their_mixers_replicated(tmp_path, family, seq):
    """Falcon-H1 at 64 tokens (it stopped with an internal error there) and Bamba at 61 (padded to
    64 inside the scan), sp=2: loss and gradients equal one device, the naive sharding does not;
    attention is split, the Mamba-2 mixers run replicated (their convolution and the split of its
    output: the fallbacks reported)."""
    factory = hybrid(family)
    run = run_fit(tmp_path, FnModule(factory, hf_loss, log_loss=False), Tokens(4, seq), devices=2, sp_size=2, steps=2)
    loss_err, grad_err, naive = check_against_references(run, 2, factory, hf_loss)
    print(f"{family} {seq} tokens sp2: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    graphs = run.ranks[0]["graphs"]["training_step"]
    assert sum(g.sdpa for g in graphs) == (2 if family == "falcon_h1" else 1)
    assert {f.split(" ")[1] for g in graphs for f in g.fallbacks} == {"(conv1d):", "(tensor_split):"}
