"""LoRA as a supported recipe: ``peft`` adapters on a frozen Hugging Face Llama, with and without
gradient checkpointing, replicated and sharded (``fsdp=True``), against one device - the
adapters' gradients equal, the frozen base's absent - with the naive sharding as the control."""

import pytest
import torch.nn as nn

from autosp._compat import TRACES_CHECKPOINT_SIDE_EFFECTS
from sp_harness import FnModule, TokenData, check_against_references, run_fit
from test_checkpointing import hf_llama


class Adapted(nn.Module):
    """LoRA without and, where this torch traces Hugging Face's checkpointed layers, with gradient checkpointing."""

    def __init__(self):
        super().__init__()
        self.models = nn.ModuleList([hf_llama(reentrant=False, lora=True, checkpointing=False)])
        if TRACES_CHECKPOINT_SIDE_EFFECTS:
            self.models.append(hf_llama(reentrant=False, lora=True))


def adapted_loss(m, batch):
    return sum(model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss for model in m.models)


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, pytest.param(True, marks=pytest.mark.full)], ids=["replicated", "sharded"])
def test_lora_matches_one_device(tmp_path, fsdp):
    run = run_fit(tmp_path, FnModule(Adapted, adapted_loss, log_loss=False), TokenData(8, 30), 2, 2, fsdp=fsdp)
    loss_err, grad_err, naive = check_against_references(run, 2, Adapted, adapted_loss)
    print(f"LoRA (fsdp={fsdp}): loss {loss_err:.2e} grad {grad_err:.2e} (naive {naive:.2e})")
    grads = run.ranks[0]["grads"][0]
    assert grads and all(".lora_A." in n or ".lora_B." in n for n in grads), "only the adapters get gradients"
    (graph,) = run.ranks[0]["graphs"]["training_step"]
    checkpointed = int(TRACES_CHECKPOINT_SIDE_EFFECTS)  # Adapted's second model
    assert graph.checkpoint_regions == 2 * checkpointed and graph.attention == 2 + 2 * checkpointed and not graph.fallbacks
