"""Masks built from positions, tiled, end to end against one device: every family in one step (the
Hugging Face mask builders with packed documents, sliding windows, soft-capping and padding on
either side; hand-written document ids, ALiBi and windows), and documents that never leak."""

import logging

import pytest
import torch
import torch.nn as nn
from mask_models import (
    DocumentLM,
    ModelZoo,
    PackedData,
    PaddedBothSides,
    document_loss,
    hf_factory,
    packed_call,
    padded_call,
    plain_call,
)
from sp_harness import FnModule, check_against_references, run_fit


def padded_zoo_call(model, batch):
    """Padding on the right, the left or both sides (the zoo's rows carry their own labels for it)."""
    return padded_call(model, {**batch, "labels": batch["pad_labels"]})


#: (name, model factory, loss) - each reads the fields of the batch it needs
FAMILIES = [
    ("llama_use_cache_false", hf_factory("llama"), plain_call),  # plain causal through Hugging Face's mask builder
    ("llama_packed_sdpa", hf_factory("llama", seed=8), packed_call),
    ("llama_packed_eager", hf_factory("llama", "eager", seed=9), packed_call),
    ("mistral_window_in_documents", hf_factory("mistral", sliding_window=6, seed=10), packed_call),
    ("mistral_window_longer_than_the_row", hf_factory("mistral", sliding_window=64, seed=15), plain_call),
    ("gemma2_sliding_global_softcap", hf_factory("gemma2", "eager", layers=2, sliding_window=6, seed=11), plain_call),
    ("qwen2_padding", hf_factory("qwen2", seed=12), padded_zoo_call),
    ("documents_alibi_sdpa", lambda: DocumentLM(layers=1, seed=13), document_loss),
    ("documents_window_manual", lambda: DocumentLM(layers=1, attention="manual", window=5, alibi=False, seed=14), document_loss),
]


def Zoo():  # noqa: N802  (a model factory)
    return ModelZoo(FAMILIES)


#: four families for the ring's grid (the suite's time): packed documents, a window inside
#: them, padding, hand-written document ids
GRID_FAMILIES = ("llama_packed_sdpa", "mistral_window_in_documents", "qwen2_padding", "documents_alibi_sdpa")


def GridZoo():  # noqa: N802  (a model factory)
    return ModelZoo([f for f in FAMILIES if f[0] in GRID_FAMILIES])


zoo_loss = ModelZoo.loss


class ZooData(PackedData):
    """Packed documents and, in the same rows, padding on the right, the left or both sides."""

    def __init__(self, n, seq_len):
        super().__init__(n, seq_len)
        self.padded = PaddedBothSides(n, seq_len)

    def __getitem__(self, i):
        item = super().__getitem__(i)
        padded = self.padded[i]
        return {**item, "attention_mask": padded["attention_mask"], "pad_labels": padded["labels"]}


@pytest.mark.slow
@pytest.mark.full
@pytest.mark.parametrize("devices,sp_size,zoo,attentions", [(2, 2, Zoo, 10)], ids=["sp2"])
def test_every_mask_family_matches_one_device(tmp_path, devices, sp_size, zoo, attentions):
    """31 tokens (split 16 + 15) in tiles of 8: every attention of every family runs tiled - no
    dense mask, nothing replicated - and loss and gradients equal one device (sp=2: all nine
    families, eight one-layer models and Gemma-2's two layers; masks live inside one SP group, so
    no dp=2 x sp=2 fit: the DP composition has its own tests)."""
    run = run_fit(
        tmp_path, FnModule(zoo, zoo_loss, log_loss=False), ZooData(4 * devices, 31), devices=devices, sp_size=sp_size,
        tiled_attention=8,
    )
    loss_err, grad_err, naive = check_against_references(run, sp_size, zoo, zoo_loss)
    print(f"mask zoo {devices} devices sp{sp_size}: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    assert graph.dense_masks == [] and graph.fallbacks == []
    assert graph.tiled_attention == graph.attention == attentions


# ------------------------------------------------------------------ documents never leak
DOCS = [(0, 10), (10, 21), (21, 31)]  # three documents in a row of 31 tokens; ranks hold 0..15 and 16..30


class Probe(nn.Module):
    """A Hugging Face Llama whose inputs get a learned offset per position: its gradient is the
    gradient of the loss with respect to each position's embedding."""

    def __init__(self, use_cache=False):
        super().__init__()
        self.lm = hf_factory("llama", layers=2)()
        self.offset = nn.Parameter(torch.zeros(31, 32))
        self.use_cache = use_cache

    def forward(self, ids, pos, labels, rows=None):
        offset = self.offset[: ids.shape[1]] if rows is None else self.offset[rows]
        embeds = self.lm.get_input_embeddings()(ids) + offset
        kwargs = {} if self.use_cache else {"use_cache": False}
        return self.lm(inputs_embeds=embeds, position_ids=pos, labels=labels, **kwargs).loss


class OneRow(torch.utils.data.Dataset):
    """One packed row of three documents (``docs``); only the middle one has targets."""

    def __init__(self, docs=DOCS):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, 64, (31,), generator=g)
        self.pos = torch.cat([torch.arange(b - a) for a, b in docs])
        self.labels = torch.full((31,), -100)
        a, b = docs[1]
        self.labels[a + 1 : b] = self.ids[a + 1 : b]  # a document's first token is no target (as Hugging Face's flattening collator sets it)

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return {"input_ids": self.ids, "position_ids": self.pos, "labels": self.labels}


def probe_loss(model, batch):
    return model(batch["input_ids"], batch["position_ids"], batch["labels"])


@pytest.mark.slow
@pytest.mark.full
def test_documents_never_leak(tmp_path):
    """Under AutoSP (sp=2, the middle document split over both ranks): the gradient of the middle
    document's loss with respect to the other documents' embeddings is exactly zero, and its loss
    and every gradient equal training that document alone. Negative control: the same model called
    with its cache (Hugging Face then skips its packed-document mask) leaks."""
    run = run_fit(tmp_path, FnModule(Probe, probe_loss, log_loss=False), OneRow(), devices=2, sp_size=2, steps=1, batch_size=1,
                  tiled_attention=8)
    grads = run.ranks[0]["grads"][0]
    offset = grads["model.offset"]
    (a, b) = DOCS[1]
    assert offset[:a].abs().max() == 0 and offset[b:].abs().max() == 0
    assert offset[a : b - 1].abs().sum(-1).min() > 0  # the last token has no target and no later reader
    # the middle document alone, on one device: same embeddings' offsets, positions from 0
    alone = Probe()
    data = OneRow()
    loss = alone(data.ids[None, a:b], data.pos[None, a:b], data.labels[None, a:b], rows=slice(a, b))
    loss.backward()
    assert abs(run.ranks[0]["losses"][0] - loss.item()) <= 1e-5 * abs(loss.item())
    for name, p in alone.named_parameters():
        got = grads[f"model.{name}"]
        want = p.grad if name != "offset" else torch.zeros_like(got).index_copy(0, torch.arange(a, b), p.grad[a:b])
        assert (got - want).norm() <= 1e-4 * want.norm(), name

    leaky = run_fit(tmp_path, FnModule(lambda: Probe(use_cache=True), probe_loss, log_loss=False), OneRow(), devices=2,
                    sp_size=2, steps=1, batch_size=1)
    assert leaky.ranks[0]["grads"][0]["model.offset"][:a].abs().max() > 1e-4  # the first document leaks into the middle one


@pytest.mark.slow
def test_tiled_masks_with_inductor(tmp_path):
    """The default configuration users run (inductor, SAC): packed documents through Hugging Face's
    mask builder, tiled, equal one device."""
    factory, loss = next((f, lo) for n, f, lo in FAMILIES if n == "llama_packed_sdpa")
    run = run_fit(tmp_path, FnModule(factory, loss, log_loss=False), ZooData(4, 29), devices=2, sp_size=2, backend="inductor",
                  tiled_attention=8)
    loss_err, grad_err, naive = check_against_references(run, 2, factory, loss)
    print(f"tiled masks, inductor sp2: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    assert graph.tiled_attention == 1 and not graph.dense_masks


class PlainRows(PackedData):
    """Rows as most users feed a Hugging Face model: one document, no padding (its mask builder
    still builds a mask under ``use_cache=False``, exactly causal for these rows)."""

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


@pytest.mark.slow
def test_exactly_causal_with_inductor(tmp_path):
    """The default configuration (inductor, SAC) on an unpadded Hugging Face Llama: its mask is
    exactly causal for these rows, so every attention runs as one fused ``is_causal`` call, no
    tile - the path whose outputs once came back in the fused kernel's layout, not the fake
    kernel's, and stopped Inductor's stride check on the first step."""
    factory = hf_factory("llama", layers=2)
    run = run_fit(tmp_path, FnModule(factory, plain_call, log_loss=False), PlainRows(4, 64), devices=2, sp_size=2,
                  backend="inductor", tiled_attention=16, steps=2)
    loss_err, grad_err, naive = check_against_references(run, 2, factory, plain_call)
    print(f"exactly causal, inductor sp2: loss {loss_err:.2e} grad {grad_err:.2e} (naive: grad {naive:.2e})")
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    assert graph.tiled_attention == 2 and not graph.dense_masks
    for rec in run.ranks:  # two layers, two steps: each attention one fused call, no tile
        assert rec["tile_counts"]["causal"] == 4 and rec["tile_counts"]["computed"] == 0, rec["tile_counts"]


def test_packed_documents_no_mask_reads_are_warned_once(caplog):
    """Position ids that restart within a row (packed documents) while no attention mask of the step
    reads them - a Hugging Face model called with its cache - get one warning naming the fix;
    a step whose mask reads them, or rows of one document, get none."""
    from types import SimpleNamespace

    from autosp.passes import SPPassStats
    from autosp.steps import StepConfig, StepRunner

    packed = {"input_ids": torch.zeros(2, 12, dtype=torch.long), "position_ids": torch.cat([torch.arange(5), torch.arange(7)]).repeat(2, 1)}
    plain = {**packed, "position_ids": torch.arange(12).repeat(2, 1)}

    def runner(mask_inputs):
        r = StepRunner(StepConfig(), sp_size=2, sp_rank=0, sp_group=None, device=torch.device("cpu"))
        r.backends["training_step"] = SimpleNamespace(pass_stats=[SPPassStats(mask_inputs=set(mask_inputs))])
        return r

    with caplog.at_level(logging.WARNING, logger="autosp.steps"):
        r = runner({"s0"})
        r._check_packed_positions("training_step", packed)
        r._check_packed_positions("training_step", packed)
    assert caplog.text.count("restarts within a row") == 1 and "use_cache=False" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autosp.steps"):
        runner({"L_batch_position_ids_"})._check_packed_positions("training_step", packed)
        runner(set())._check_packed_positions("training_step", plain)
    assert "restarts within a row" not in caplog.text
