"""KV heads the model repeats for attention are exchanged before the repeat.

The pass recognises the ways models repeat KV heads for grouped-query attention (head ``h``
reads KV head ``h // n_rep``) and moves the all-to-all of k and v before the repeat, so it
carries ``Hk`` heads instead of ``H``; attention then reads them unrepeated (``enable_gqa``,
on CPU) or repeated on the rank's heads. A model that tiles its KV heads instead (head ``h``
reads KV head ``h % Hk``) must not be taken for one: the mapping of heads to ranks differs.
Every form is checked against one device on loss and gradients, at an even and an uneven
sequence length.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sp_harness import spawn
from torch import nn

from autosp.backend import AutoSPBackend
from autosp.passes.sac import SACConfig

VOCAB, HEADS, KV_HEADS, DIM = 32, 8, 4, 32  # 2 KV heads per rank: a wrong head order shows
N_REP = HEADS // KV_HEADS
FORMS = {
    # how models write "repeat each KV head n_rep times in place"
    "getitem_expand_reshape": lambda k: k[:, :, None, :, :].expand(k.shape[0], KV_HEADS, N_REP, k.shape[2], k.shape[3])
    .reshape(k.shape[0], HEADS, k.shape[2], k.shape[3]),
    "unsqueeze_expand_flatten": lambda k: k.unsqueeze(2).expand(-1, -1, N_REP, -1, -1).flatten(1, 2),
    "repeat_interleave": lambda k: k.repeat_interleave(N_REP, dim=1),
    # not a repeat in place: the KV heads tiled (head h reads KV head h % Hk)
    "tiled": lambda k: k[:, None].expand(k.shape[0], N_REP, KV_HEADS, k.shape[2], k.shape[3])
    .reshape(k.shape[0], HEADS, k.shape[2], k.shape[3]),
}


class GQALM(nn.Module):
    def __init__(self, repeat, layers=2):
        super().__init__()
        torch.manual_seed(7)
        self.repeat, self.hd = repeat, DIM // HEADS
        self.emb = nn.Embedding(VOCAB, DIM)
        self.q = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(layers)])
        self.kv = nn.ModuleList([nn.Linear(DIM, 2 * KV_HEADS * self.hd) for _ in range(layers)])
        self.o = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(layers)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        B, S = idx.shape
        x = self.emb(idx)
        for q_proj, kv_proj, o_proj in zip(self.q, self.kv, self.o):
            q = q_proj(x).view(B, S, HEADS, self.hd).transpose(1, 2)
            k, v = kv_proj(x).view(B, S, 2 * KV_HEADS, self.hd).transpose(1, 2).chunk(2, dim=1)
            y = F.scaled_dot_product_attention(q, self.repeat(k), self.repeat(v), is_causal=True)
            x = x + o_proj(y.transpose(1, 2).reshape(B, S, DIM))
        return self.head(x)


def _loss(model, ids, labels):
    return F.cross_entropy(model(ids).reshape(-1, VOCAB), labels.reshape(-1))


def _data(S):
    g = torch.Generator().manual_seed(S)
    return torch.randint(0, VOCAB, (2, S), generator=g), torch.randint(0, VOCAB, (2, S), generator=g)


def _single_device(form, S):
    model = GQALM(FORMS[form])
    loss = _loss(model, *_data(S))
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def _worker(rank, world, S, sac, native):
    torch.set_num_threads(1)
    out = {}
    for form, repeat in FORMS.items():
        torch._dynamo.reset()
        model = GQALM(repeat)
        backend = AutoSPBackend(
            sp_size=world, sp_rank=rank, group_name=dist.group.WORLD.group_name, backend="aot_eager",
            sac=SACConfig() if sac else None, native_gqa=native,
        )
        ids, labels = _data(S)
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(labels, 1)
        loss = torch.compile(_loss, backend=backend)(model, ids, labels)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        for g in grads:  # each rank's gradient carries the SP factor: the mean over ranks is the gradient
            dist.all_reduce(g)
            g /= world
        (record,) = backend.compiled_step().saved_activations
        stats = backend.pass_stats
        moved, native_calls = sum(s.kv_exchanged_unrepeated for s in stats), sum(s.native_gqa for s in stats)
        fallbacks = [f for s in stats for f in s.fallbacks]
        out[form] = (float(loss), grads, moved, native_calls, record.recomputed, fallbacks)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "S,sac,native",
    [(12, False, None), (11, False, None), (11, False, False), (12, True, None), (12, True, False)],
    ids=["even", "uneven", "uneven-repeat", "even-sac", "even-sac-repeat"],
)
@pytest.mark.full
def test_kv_exchanged_before_the_models_repeat(tmp_path, S, sac, native):
    """On CPU (``native_gqa=None``) attention gets the exchanged KV heads unrepeated with
    ``enable_gqa=True``; with ``native_gqa=False`` (as on CUDA) they are repeated after the
    exchange, and with SAC backward redoes that repeat from the exchanged KV heads (saved)
    instead of keeping the repeated copy: the partition recomputes one copy per k and v."""
    results = spawn(tmp_path, _worker, 2, S, sac, native)
    for form in FORMS:
        ref_loss, ref_grads = _single_device(form, S)
        for rank_result in results:
            loss, grads, moved, native_calls, recomputed, fallbacks = rank_result[form]
            assert fallbacks == [], (form, fallbacks)  # every repeat runs on the rank's tokens
            assert moved == (0 if form == "tiled" else 2 * 2), form  # k and v of 2 layers
            assert native_calls == (0 if form == "tiled" or native is False else 2), form  # one per attention
            if sac:  # the tiled model exchanges k, v as attention reads them; native GQA repeats nothing
                copies = 0 if form == "tiled" or native is None else 2 * 2
                assert recomputed.get("clone", 0) == copies, (form, recomputed)
            assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (form, loss, ref_loss)
            for g, r in zip(grads, ref_grads):
                assert float((g - r).norm()) <= 1e-5 * max(float(r.norm()), 1e-6), form
    # negative control: mistaking the tiled model for a repeat in place (exchanging k, v before
    # it) would compute the in-place model's loss and gradients, which the checks above tell apart
    tiled_loss, tiled_grads = _single_device("tiled", S)
    inplace_loss, inplace_grads = _single_device("repeat_interleave", S)
    assert abs(tiled_loss - inplace_loss) > 1e-3 * abs(tiled_loss)
    assert max(float((a - b).norm() / b.norm()) for a, b in zip(tiled_grads[1:], inplace_grads[1:])) > 1e-2
