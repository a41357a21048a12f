"""Tiled MLPs: each MLP of the step run over tiles of the rank's rows, recomputed per tile in
backward (``AutoSPStrategy(tiled_mlp=...)``), with the same loss and gradients as one device.

The zoo trains four MLP shapes in one step - Hugging Face Llama (SwiGLU) over two layers, Qwen2
over padded rows, our Llama and our GPT (GELU, biases) - 31 tokens split 16 + 15, tiles of 5 rows
(so every rank has a partial last tile). The control recomputes each tile's forward in backward on
its rows shifted by one: the forward is unchanged, the gradients are not.
"""

import pytest
import torch
import torch.nn.functional as F
from mask_models import ModelZoo, PaddedBothSides, hf_factory, padded_call, plain_call
from sp_harness import START_METHOD, FnModule, check_against_references, compare, lm_loss, make_model, reference_fn, run_fit

from lightning_autosp import AutoSPStrategy
from autosp.passes.tiled_mlp import tile_token_regions
from autosp.ops.tiled_rows import auto_tile_rows


def example_call(model, batch):
    return lm_loss(model(batch["input_ids"]), batch["labels"], False)


def _llama():
    return make_model("llama")


def _gpt():
    return make_model("gpt")


FAMILIES = [
    ("hf_llama", hf_factory("llama", layers=2, seed=31), plain_call),
    ("hf_qwen2_padded", hf_factory("qwen2", seed=32), padded_call),
    ("llama", _llama, example_call),
    ("gpt", _gpt, example_call),
]

def test_arguments():
    assert AutoSPStrategy(sp_size=2)._step_config.mlp_tile == 0  # on, sized automatically
    assert AutoSPStrategy(sp_size=2, tiled_mlp=False)._step_config.mlp_tile is None
    assert AutoSPStrategy(sp_size=2, tiled_mlp=256)._step_config.mlp_tile == 256
    for bad in (0, -4, "big", 2.5):
        with pytest.raises(ValueError, match=r"tiled_mlp=.*pass True .* the rows per tile \(an int >= 1\), or False"):
            AutoSPStrategy(sp_size=2, tiled_mlp=bad)
    assert auto_tile_rows(14336, 2) == 2340 and auto_tile_rows(64, 4) == 262144


def _graph(model, *args):
    graphs = []

    def keep(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    for a in args:
        torch._dynamo.mark_dynamic(a, 1)
    torch.compile(lambda *a: lm_loss(model(a[0]), a[1], False), backend=keep)(*args)
    return graphs[0]


def _calls(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.autosp_tile.rows.default]


def test_regions_are_the_mlps_with_their_norms():
    """A two-layer Llama: each block's MLP with the norm before it and the residual add after it
    (one region per block, its output the block's); a GPT: its two MLPs (its layer norms are not
    elementwise). Never the LM head (whose logits widen and stay wide: the fused loss's) or the
    attention projections, and never across blocks. In fp32 a norm alone is not tiled: its widest
    value is as wide as its rows. Automatic tiles hold ~64 MiB and tile only where a rank holds two."""
    ids = torch.randint(0, 64, (2, 40))
    for kind, ops, attention_linears in (("llama", 14, 4), ("gpt", 3, 2)):
        gm = _graph(make_model(kind), ids, ids)
        regions = tile_token_regions(gm, tile=8)
        assert [r.ops for r in regions] == [ops, ops] and all(r.tile == 8 for r in regions), regions
        assert all(r.width == 4 * 32 or r.width > 32 for r in regions)
        assert len(_calls(gm)) == 2
        linears = [n for n in gm.graph.nodes if n.target is F.linear]
        assert len(linears) == attention_linears * 2 + 1, "the attention projections and the LM head stay as they were"
        if kind == "llama":  # the second block's region ends at the block's output: the final norm is outside it
            assert [u.target for u in _calls(gm)[1].users] == ["float"], _calls(gm)[1].users
        # automatic tiles hold ~64 MiB: 40 tokens are far from two tiles
        assert tile_token_regions(_graph(make_model(kind), ids, ids), tile=0, min_tiles=2) == []


@pytest.mark.slow
def test_bf16_norms_are_tiled_too():
    """In bf16 an RMSNorm's fp32 intermediates are twice as wide as its rows: the norm before each
    attention and the final norm become regions of their own (3 + 2 regions in a two-layer Llama),
    and the attention projections and LM head read the tiled norm's rows. Loss and gradients
    against one device without tiles, in bf16 (a few eps: the tiles' matmuls run on other row
    counts); the control recomputes each tile on rows shifted by one."""
    from torch._dynamo.backends.registry import lookup_backend

    from autosp.ops import tiled_rows

    ids = torch.randint(0, 64, (2, 23))

    def run(model, broken=False):
        found = []

        def backend(gm, inputs):
            found.extend(tile_token_regions(gm, tile=5))
            if broken:
                for key in {n.args[2] for n in _calls(gm)}:
                    tiled_rows._REGIONS[key] = _shifted(tiled_rows._REGIONS[key])
            return lookup_backend("aot_eager")(gm, inputs)

        torch._dynamo.reset()
        torch._dynamo.mark_dynamic(ids, 1)
        step = lambda i: lm_loss(model(i), i, False)  # noqa: E731
        loss = torch.compile(step, backend=backend)(ids)
        loss.backward()
        grads = [p.grad.float() for p in model.parameters()]
        return loss.float(), grads, found

    def error(a, b):
        loss = (a[0] - b[0]).abs() / b[0].abs()
        grad = max(((x - y).norm() / y.norm()).item() for x, y in zip(a[1], b[1]))
        return loss.item(), grad

    bf16 = lambda: make_model("llama").to(torch.bfloat16)  # noqa: E731
    reference = bf16()
    loss = lm_loss(reference(ids), ids, False)
    loss.backward()
    ref = (loss.float(), [p.grad.float() for p in reference.parameters()])
    tiled = run(bf16())
    assert sorted(r.ops for r in tiled[2]) == [8, 8, 8, 14, 14], tiled[2]
    loss_err, grad_err = error(tiled, ref)
    original = dict(tiled_rows._REGIONS)
    try:
        broken = run(bf16(), broken=True)
    finally:
        tiled_rows._REGIONS.clear()
        tiled_rows._REGIONS.update(original)
    control = error(broken, ref)
    print(f"bf16 tiled norms and MLPs: loss {loss_err:.2e} grad {grad_err:.2e} (shifted recompute: grad {control[1]:.2e})")
    assert loss_err <= 2e-2 and grad_err <= 2e-2, (loss_err, grad_err)
    assert control[1] > 0.2, control


def _zoo_of(names):
    return lambda: ModelZoo([f for f in FAMILIES if f[0] in names])


@pytest.mark.slow
@pytest.mark.parametrize(
    "devices,sp_size,backend,names",
    [
        (2, 2, "aot_eager", [f[0] for f in FAMILIES]),
        pytest.param(2, 2, "inductor", ["llama"], marks=pytest.mark.full),  # the default configuration: inductor and SAC
    ],
    ids=["sp2", "sp2-inductor"],
)
def test_tiled_mlps_are_exact(tmp_path, devices, sp_size, backend, names):
    factory = _zoo_of(names)
    run = run_fit(
        tmp_path, FnModule(factory, ModelZoo.loss, log_loss=False), PaddedBothSides(4 * devices, 31), devices=devices,
        sp_size=sp_size, backend=backend, tiled_mlp=5,
    )
    loss_err, grad_err, naive = check_against_references(run, sp_size, factory, ModelZoo.loss)
    print(f"tiled MLP zoo {names} {devices} devices sp{sp_size} {backend}: loss {loss_err:.2e} grad {grad_err:.2e} (naive: {naive:.2e})")
    graphs = run.ranks[0]["graphs"]["training_step"]
    mlps = {"hf_llama": 2, "hf_qwen2_padded": 1, "llama": 2, "gpt": 2}
    assert sum(g.tiled_regions for g in graphs) == sum(mlps[n] for n in names)
    assert [f for g in graphs for f in g.fallbacks] == []


def _shifted(region):
    import dataclasses

    def backward(rows, *args):
        return region.backward(torch.roll(rows, 1, 0), *args)

    return dataclasses.replace(region, backward=backward)


@pytest.mark.slow
@pytest.mark.skipif(START_METHOD != "fork", reason="the broken recompute is patched in this process: only forked ranks see it")
def test_a_recompute_on_other_rows_is_caught(tmp_path, monkeypatch):
    from autosp.ops import tiled_rows

    original = tiled_rows.register_region

    def register_broken(*args, **kwargs):
        key = original(*args, **kwargs)
        tiled_rows._REGIONS[key] = _shifted(tiled_rows._REGIONS[key])
        return key

    monkeypatch.setattr("autosp.passes.tiled_mlp.register_region", register_broken)
    factory = lambda: ModelZoo(FAMILIES[2:3])  # noqa: E731
    run = run_fit(tmp_path, FnModule(factory, ModelZoo.loss, log_loss=False), PaddedBothSides(4, 31), devices=2, sp_size=2, tiled_mlp=5)
    loss_err, grad_err = compare(run, 2, *reference_fn(factory, ModelZoo.loss, run, 2))
    assert sum(g.tiled_regions for g in run.ranks[0]["graphs"]["training_step"]) == 2
    assert grad_err > 1e-2, (loss_err, grad_err)
