"""Gradient checkpointing as users write it - Hugging Face's ``gradient_checkpointing_enable()``
(reentrant or not), LoRA adapters from ``peft`` on a frozen base, a loop of one's own with
``torch.utils.checkpoint.checkpoint(block, x)``, the ``checkpoint_wrapper`` FSDP/Fabric policies
wrap blocks in - one graph per step, against one device, with the naive sharding as the negative
control; the checkpointed regions recomputed as ``sac="block"`` recomputes blocks (the same saved
bytes); a region AutoSP cannot honour refused naming gradient checkpointing."""

import pytest
import torch
import torch.nn as nn
from mask_models import hf_factory
from sp_harness import FnModule, TokenData, check_against_references, lm_loss, make_model, run_fit

from autosp._compat import TRACES_CHECKPOINT_SIDE_EFFECTS
from autosp.compile_prep import _REQUIRE_GRADS_HOOKS
from autosp.errors import AutoSPError


def hf_llama(reentrant, lora=False, checkpointing=True):
    """A 2-layer Hugging Face Llama, its layers under gradient checkpointing; with ``lora``, LoRA
    adapters on q/v (the base frozen) and, for the reentrant variant, inputs that require grad
    (``enable_input_require_grads()``, what Hugging Face asks of reentrant checkpointing on a
    frozen embedding)."""
    model = hf_factory("llama", layers=2)()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(5)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        if reentrant and checkpointing:
            model.enable_input_require_grads()
    for m in model.modules():  # the same hooks as functions of this module: ranks started by a fork server unpickle them
        for key, hook in list(m._forward_hooks.items()):
            if getattr(hook, "__name__", "") in _REQUIRE_GRADS_HOOKS:
                m._forward_hooks[key] = make_inputs_require_grads
    return model


def make_inputs_require_grads(module, input, output):
    """Hugging Face's and peft's hook (``enable_input_require_grads``), under their name."""
    output.requires_grad_(True)


#: the four recipes of the done-when list, trained together (one step function, one fit)
RECIPES = {
    "reentrant": dict(reentrant=True),
    "non_reentrant": dict(reentrant=False),
    "reentrant_lora": dict(reentrant=True, lora=True),
    "non_reentrant_lora": dict(reentrant=False, lora=True),
}


class Recipes(nn.Module):
    def __init__(self, checkpointing=True):
        super().__init__()
        self.models = nn.ModuleDict({name: hf_llama(checkpointing=checkpointing, **kw) for name, kw in RECIPES.items()})


def recipes_loss(zoo, batch):
    return sum(m(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss for m in zoo.models.values())


def plain_recipes():  # the same models without gradient checkpointing (what sac="block" runs)
    return Recipes(checkpointing=False)


#: Hugging Face's checkpointed layers set Python state that older Dynamo cannot trace (refused there)
needs_side_effects = pytest.mark.skipif(not TRACES_CHECKPOINT_SIDE_EFFECTS, reason="this torch's Dynamo cannot trace HF's checkpointed layers")


@pytest.mark.slow
@needs_side_effects
@pytest.mark.parametrize("devices,sp_size", [(2, 2)], ids=["sp2"])
def test_hugging_face_gradient_checkpointing_matches_one_device(tmp_path, devices, sp_size):
    """Reentrant and non-reentrant, with and without LoRA, 31 tokens: one graph per step with
    every layer's region recomputed, losses and gradients (LoRA's adapters: the base gets none)
    equal one device; at sp=2 each rank saves what sac="block" saves for the same models without
    checkpointing (within 5%)."""
    run = run_fit(tmp_path, FnModule(Recipes, recipes_loss, log_loss=False), TokenData(4 * devices, 31), devices, sp_size)
    loss_err, grad_err, naive = check_against_references(run, sp_size, Recipes, recipes_loss)
    print(f"HF gradient checkpointing x4 recipes, {devices} devices: loss {loss_err:.2e} grad {grad_err:.2e} (naive {naive:.2e})")
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    assert graph.checkpoint_regions == 8 and graph.attention == 8 and not graph.fallbacks
    grads = run.ranks[0]["grads"][0]
    adapted = [n for n in grads if "_lora." in n]  # the LoRA recipes' parameters with a gradient: the adapters alone
    assert adapted and all(".lora_A." in n or ".lora_B." in n for n in adapted)
    recomputed, saved, _ = run.ranks[0]["saved"][0]
    assert recomputed.get("seq_gather", 0) and recomputed.get("tiled_attention", 0)  # the regions run again in backward
    if devices == 2:
        block = run_fit(tmp_path, FnModule(plain_recipes, recipes_loss, log_loss=False), TokenData(4, 31), 2, 2, steps=1, sac="block")
        block_saved = block.ranks[0]["saved"][0][1]
        print(f"saved per rank: checkpointed {saved}, sac='block' {block_saved} bytes")
        assert abs(saved - block_saved) <= 0.05 * block_saved


# ------------------------------------------------------------------ checkpointing written by hand
class LoopGPT(nn.Module):
    """The tiny GPT whose forward checkpoints each block itself: ``checkpoint(block, x)``."""

    def __init__(self):
        super().__init__()
        self.gpt = make_model("gpt", 2)

    def forward(self, idx):
        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1]))
        for block in g.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return g.head(g.ln_f(x))


def wrapped_llama():
    """The bundled Llama with its blocks wrapped as FSDP / Fabric activation-checkpointing
    policies wrap them (``checkpoint_wrapper``, LitGPT's recipe under those strategies)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = make_model("llama", 2)
    model.layers = nn.ModuleList(checkpoint_wrapper(block) for block in model.layers)
    return model


class HandWritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.loop, self.wrapped = LoopGPT(), wrapped_llama()


def hand_loss(m, batch):
    return sum(lm_loss(model(batch["input_ids"]), batch["labels"], True) for model in (m.loop, m.wrapped))


@pytest.mark.slow
@pytest.mark.full
def test_checkpointing_written_by_hand_matches_one_device(tmp_path):
    run = run_fit(tmp_path, FnModule(HandWritten, hand_loss, log_loss=False), TokenData(8, 30), 2, 2)
    loss_err, grad_err, naive = check_against_references(run, 2, HandWritten, hand_loss)
    print(f"checkpoint(block, x) and checkpoint_wrapper: loss {loss_err:.2e} grad {grad_err:.2e} (naive {naive:.2e})")
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    assert graph.checkpoint_regions == 4 and graph.attention == 4 and not graph.fallbacks


def test_a_region_autosp_cannot_honour_names_gradient_checkpointing():
    """A selective checkpointing policy (``context_fn``) would ask for other recomputations than
    the whole region: refused, naming gradient checkpointing and the fix."""
    from functools import partial

    from test_pass import capture
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from autosp.passes.checkpoints import inline_checkpoints

    policy = partial(create_selective_checkpoint_contexts, lambda ctx, op, *a, **k: CheckpointPolicy.PREFER_RECOMPUTE)

    class Selective(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = make_model("gpt", 1)

        def forward(self, idx):
            g = self.gpt
            x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1]))
            x = torch.utils.checkpoint.checkpoint(g.blocks[0], x, use_reentrant=False, context_fn=policy)
            return g.head(g.ln_f(x))

    ids = torch.randint(0, 64, (2, 16))
    gm = capture(Selective(), ids, ids.clone())
    with pytest.raises(AutoSPError, match=r"(?s)under gradient checkpointing.*context_fn.*Turn gradient checkpointing off.*sac='block'"):
        inline_checkpoints(gm)


@pytest.mark.skipif(TRACES_CHECKPOINT_SIDE_EFFECTS, reason="this torch traces HF's checkpointed layers (the test above)")
def test_hugging_face_checkpointing_is_refused_where_dynamo_cannot_trace_it():
    """On a torch whose Dynamo cannot trace HF's checkpointed layers (2.9), the error names gradient
    checkpointing and the fix before anything compiles, instead of blaming what a split step did."""
    from autosp.compile_prep import prepare_for_compile

    with pytest.raises(AutoSPError, match=r"(?s)gradient checkpointing on.*gradient_checkpointing_disable\(\).*sac='block'"):
        prepare_for_compile(hf_llama(reentrant=False))
