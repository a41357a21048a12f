"""What a model would do lazily on its first call where Dynamo cannot trace it, done before the
step compiles.

Hugging Face models (transformers 5) install the hooks that collect router logits, hidden states
or attention weights on the first forward that asks for them, under a ``threading.Lock``. Dynamo
cannot trace the lock: it breaks the graph there, and what follows the break - the language-model
head, the loss, a mixture of experts' load-balancing loss (``output_router_logits=True``) - compiles
into a graph that sees the model's outputs whole (gathered), so it would run replicated, every rank
holding the whole sequence's logits. Installed before compiling - what transformers itself does
on that first call; the hooks record nothing unless a forward asks - the step is one graph.

Nothing here imports a library the user did not import.
"""

from __future__ import annotations

import logging
import sys

import torch

__all__ = ["prepare_for_compile"]

log = logging.getLogger(__name__)


def prepare_for_compile(module: torch.nn.Module) -> int:
    """Install the output-capturing hooks of every Hugging Face model in ``module`` that has not
    installed them yet; returns how many models were prepared."""
    if "transformers" not in sys.modules:
        return 0
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # another transformers version: nothing lazy to do ahead
        return 0
    prepared = 0
    for m in module.modules():
        if isinstance(m, PreTrainedModel) and not getattr(m, "_output_capturing_hooks_installed", False):
            maybe_install_capturing_hooks(m)
            prepared += 1
    if prepared:
        log.debug("AutoSP: installed the output-capturing hooks of %d Hugging Face model(s) before compiling", prepared)
    return prepared
