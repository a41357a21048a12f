"""Fast single-process tests for the bundled models, the KV-recall task and the demo module."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_autosp.examples.kv_recall import IGNORE_INDEX, KVRecallDataModule, KVRecallDataset
from lightning_autosp.examples.causal_lm import CausalLMModule, WarmupCosine
from autosp.models import GPT, GPTConfig, Llama, LlamaConfig, build_model, repeat_kv

torch.set_num_threads(1)

VOCAB = 48


def _tiny(arch: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "llama":
        return Llama(LlamaConfig.tiny(vocab_size=VOCAB, **overrides))
    return GPT(GPTConfig.tiny(vocab_size=VOCAB, **overrides))


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_output_shape_and_finite(arch):
    model = _tiny(arch)
    ids = torch.randint(VOCAB, (3, 17))
    logits = model(ids)
    assert logits.shape == (3, 17, VOCAB)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_causality(arch):
    model = _tiny(arch).eval()
    ids = torch.randint(VOCAB, (2, 24))
    t = 13
    changed = ids.clone()
    changed[:, t] = (changed[:, t] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    # ... and the change must be visible from position t on.
    assert (a[:, t:] - b[:, t:]).abs().amax(dim=-1).min() > 1e-6


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_explicit_position_ids_match_default(arch):
    model = _tiny(arch).eval()
    ids = torch.randint(VOCAB, (2, 20))
    pos = torch.arange(20).expand(2, 20)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model(ids, position_ids=pos))
        # Other relative positions must change the output (positions are actually used) ...
        assert not torch.allclose(model(ids), model(ids, position_ids=pos * 2), atol=1e-5)
        if arch == "gpt":  # absolute positions: a shift changes the output
            assert not torch.allclose(model(ids), model(ids, position_ids=pos + 5), atol=1e-5)
        else:  # ... while RoPE only depends on relative positions.
            torch.testing.assert_close(model(ids), model(ids, position_ids=pos + 5), rtol=1e-4, atol=1e-5)


def test_repeat_kv_matches_repeat_interleave():
    x = torch.randn(2, 3, 5, 4)  # [B, n_kv, S, D]
    torch.testing.assert_close(repeat_kv(x, 4), x.repeat_interleave(4, dim=1))
    assert repeat_kv(x, 1) is x


def test_gqa_matches_mha_with_copied_kv_heads():
    gqa = _tiny("llama", n_heads=4, n_kv_heads=2).eval()
    mha = _tiny("llama", n_heads=4, n_kv_heads=4).eval()
    cfg = gqa.config
    n_rep = cfg.n_heads // cfg.n_kv_heads
    state = dict(gqa.state_dict())
    for name, weight in gqa.state_dict().items():
        if name.endswith("attention.wk.weight") or name.endswith("attention.wv.weight"):
            per_head = weight.view(cfg.n_kv_heads, cfg.head_dim, cfg.dim)  # [H_kv, D, dim]
            state[name] = per_head.repeat_interleave(n_rep, dim=0).reshape(cfg.n_heads * cfg.head_dim, cfg.dim)
    mha.load_state_dict(state)
    ids = torch.randint(VOCAB, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids), mha(ids), rtol=1e-5, atol=1e-5)


def test_rmsnorm_reference_and_dtype():
    from autosp.models import RMSNorm

    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(3, 8)
    ref = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), ref)
    assert norm(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_gpt_head_is_tied_and_build_model():
    gpt = _tiny("gpt")
    assert gpt.head.weight is gpt.wte.weight
    llama = _tiny("llama")
    assert llama.output.weight is not llama.tok_embeddings.weight
    assert isinstance(build_model("gpt", vocab_size=VOCAB, dim=32, n_heads=4, n_kv_heads=2), GPT)
    assert isinstance(build_model("llama", vocab_size=VOCAB, dim=32, n_heads=4, n_kv_heads=2), Llama)
    with pytest.raises(ValueError):
        build_model("mamba", vocab_size=VOCAB)


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_models_capture_as_single_graph(arch):
    """Dynamo must capture the whole forward (no graph breaks) and see causal SDPA."""
    import torch._dynamo

    model = _tiny(arch)
    ids = torch.randint(VOCAB, (2, 16))
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(ids), model(ids))
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    n_sdpa = sum(t is F.scaled_dot_product_attention for t in targets)
    assert n_sdpa == model.config.n_layers
    torch._dynamo.reset()


def _kv_dataset(**overrides) -> KVRecallDataset:
    kwargs = dict(size=8, seq_len=96, num_pairs=6, num_queries=5, num_keys=10, num_values=7, num_filler=5, seed=3)
    kwargs.update(overrides)
    return KVRecallDataset(**kwargs)


def test_kv_recall_labels_point_at_paired_values():
    ds = _kv_dataset()
    P, Q = ds.num_pairs, ds.num_queries
    for i in range(len(ds)):
        sample = ds[i]
        ids, labels = sample["input_ids"], sample["labels"]
        assert ids.shape == labels.shape == (ds.seq_len,)
        assert ids.dtype == labels.dtype == torch.long
        assert ids.min() >= 0 and ids.max() < ds.vocab_size
        assert ids[0] == ds.BOS
        keys, values = ids[1 : 1 + 2 * P : 2], ids[2 : 2 + 2 * P : 2]
        assert ((keys >= ds.key_offset) & (keys < ds.value_offset)).all()
        assert ((values >= ds.value_offset) & (values < ds.filler_offset)).all()
        assert len(set(keys.tolist())) == P  # distinct keys
        filler = ids[1 + 2 * P : ds.query_start]
        assert (filler >= ds.filler_offset).all()
        answer_of = dict(zip(keys.tolist(), values.tolist()))
        query_pos = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
        assert query_pos == list(range(ds.query_start, ds.seq_len))
        assert len(query_pos) == Q
        for t in query_pos:
            key = ids[t].item()
            first = (ids == key).nonzero().flatten()[0].item()
            assert first < 1 + 2 * P  # the key was paired at the start
            assert labels[t].item() == answer_of[key] == ids[first + 1].item()
        # no value token after the pair region: every answer must be fetched from the start
        assert not ((ids[1 + 2 * P :] >= ds.value_offset) & (ids[1 + 2 * P :] < ds.filler_offset)).any()


def test_kv_recall_is_deterministic():
    a, b = _kv_dataset(), _kv_dataset()
    for i in range(len(a)):
        for k in ("input_ids", "labels"):
            assert torch.equal(a[i][k], b[i][k])
            assert torch.equal(a[i][k], a[i][k])
    assert not torch.equal(a[0]["input_ids"], a[1]["input_ids"])
    c = _kv_dataset(seed=4)
    assert torch.equal(c[0]["input_ids"], a[1]["input_ids"])  # sample i uses seed + i
    assert not torch.equal(c[0]["input_ids"], a[0]["input_ids"])


def test_kv_recall_datamodule():
    dm = KVRecallDataModule(seq_len=64, num_pairs=4, num_queries=4, num_keys=8, num_values=4,
                            train_size=12, val_size=6, batch_size=4, seed=1)
    assert dm.vocab_size == 1 + 8 + 4 + dm.num_filler
    assert dm.chance_accuracy == pytest.approx(0.25)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 64)
    assert len(dm.train_dataloader()) == 3 and len(dm.val_dataloader()) == 2
    train_ids = {tuple(dm.train_dataset[i]["input_ids"].tolist()) for i in range(12)}
    val_ids = {tuple(dm.val_dataset[i]["input_ids"].tolist()) for i in range(6)}
    assert not train_ids & val_ids
    with pytest.raises(ValueError):
        KVRecallDataset(size=1, seq_len=10, num_pairs=4, num_queries=4)


def test_demo_module_init_is_reproducible():
    torch.manual_seed(123)
    a = CausalLMModule(vocab_size=VOCAB, dim=32, ffn_hidden=64)
    a.configure_model()
    torch.manual_seed(456)
    b = CausalLMModule(vocab_size=VOCAB, dim=32, ffn_hidden=64)
    b.configure_model()
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    c = CausalLMModule(vocab_size=VOCAB, dim=32, ffn_hidden=64, init_seed=1)
    c.configure_model()
    assert not torch.equal(a.model.output.weight, c.model.output.weight)


def test_warmup_cosine_schedule():
    constant = WarmupCosine(warmup_steps=4)
    assert [constant(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = WarmupCosine(warmup_steps=4, total_steps=14)
    assert [cosine(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine(4) == 1.0
    assert cosine(9) == pytest.approx(0.5)
    assert cosine(14) == pytest.approx(0.0) and cosine(20) == pytest.approx(0.0)
    assert all(cosine(s) >= cosine(s + 1) for s in range(4, 20))


@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_tiny_training_lowers_loss(arch):
    torch.manual_seed(0)
    ds = KVRecallDataset(size=64, seq_len=48, num_pairs=4, num_queries=4, num_keys=4, num_values=4,
                         num_filler=2, seed=0)
    module = CausalLMModule(model=arch, vocab_size=ds.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                            ffn_hidden=64, max_seq_len=48, lr=1e-2, warmup_steps=1)
    module.configure_model()
    optimizer = module.configure_optimizers()["optimizer"]
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True)
    losses = []
    for _ in range(5):
        for batch in loader:
            logits = module(batch["input_ids"])
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), batch["labels"].view(-1), ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert len(losses) == 40
    start, end = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert end < start - 0.5, f"loss did not fall: {start:.3f} -> {end:.3f}"
