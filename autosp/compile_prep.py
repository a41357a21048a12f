"""What a model would do lazily on its first call where Dynamo cannot trace it, done before the
step compiles.

Hugging Face models (transformers 5) install the hooks that collect router logits, hidden states
or attention weights on the first forward that asks for them, under a ``threading.Lock``. Dynamo
cannot trace the lock: it breaks the graph there, and what follows the break - the language-model
head, the loss, a mixture of experts' load-balancing loss (``output_router_logits=True``) - compiles
into a graph that sees the model's outputs whole (gathered), so it would run replicated, every rank
holding the whole sequence's logits. Installed before compiling - what transformers itself does
on that first call; the hooks record nothing unless a forward asks - the step is one graph.

The forward hook Hugging Face's ``enable_input_require_grads()`` puts on the input embeddings
(``peft`` adds it to a model under gradient checkpointing, for eager reentrant checkpointing on a
frozen embedding) calls ``requires_grad_()`` on an intermediate, which Dynamo cannot trace: the
step would split into several graphs. The compiled step differentiates through checkpointed
regions itself (:mod:`autosp.passes.checkpoints`), so the hook is not needed there; it is taken
off while AutoSP compiles the module and put back by :meth:`Prepared.undo` (the strategies'
``teardown``).

A model that reaches the process unpickled (a rank started by ``spawn`` or a fork server) was
not constructed there: transformers registers what a model class records (router logits for the
load-balancing loss) in its ``__init__``, so the rank's registry lacks it and the loss would see
no router logits. :func:`prepare_for_compile` registers it as ``__init__`` does.

Nothing here imports a library the user did not import.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from autosp._compat import TRACES_CHECKPOINT_SIDE_EFFECTS
from autosp.errors import AutoSPError
from autosp.passes.sp_rules.mixers import register_hf_mixers

__all__ = ["prepare_for_compile", "Prepared"]

log = logging.getLogger(__name__)


#: the names transformers' ``enable_input_require_grads`` and peft give the hook
_REQUIRE_GRADS_HOOKS = frozenset({"make_inputs_require_grads", "make_inputs_require_grad"})


@dataclass
class Prepared:
    """What :func:`prepare_for_compile` did: ``models`` Hugging Face models prepared, and the
    changes :meth:`undo` reverts."""

    models: int = 0
    undo_calls: list[Callable[[], Any]] = field(default_factory=list)

    def undo(self) -> None:
        for call in self.undo_calls:
            call()
        self.undo_calls.clear()


def prepare_for_compile(module: torch.nn.Module) -> Prepared:
    """Install the output-capturing hooks of every Hugging Face model in ``module`` that has not
    installed them yet, and take off input-require-grads hooks until :meth:`Prepared.undo` (see
    the module docstring)."""
    prepared = Prepared()
    if "transformers" not in sys.modules:
        return prepared
    for m in module.modules():  # Hugging Face's and peft's input-require-grads hooks (named so in both)
        hooks = getattr(m, "_forward_hooks", None) or {}
        taken = {key: hook for key, hook in hooks.items() if getattr(hook, "__name__", "") in _REQUIRE_GRADS_HOOKS}
        for key in taken:
            del hooks[key]
        if taken:
            prepared.undo_calls.append(lambda hooks=hooks, taken=taken: hooks.update(taken))
    if prepared.undo_calls:
        log.info(
            "AutoSP: took the input-require-grads hooks (Hugging Face's enable_input_require_grads, peft's) off %d module(s) "
            "while they run compiled (the compiled step differentiates through checkpointed layers itself); they are put "
            "back at teardown.", len(prepared.undo_calls),
        )
    mixers = register_hf_mixers(module)
    if mixers:
        log.debug("AutoSP: sequence mixers placed over heads: %s", ", ".join(mixers))
    try:
        from transformers import PreTrainedModel
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, maybe_install_capturing_hooks
    except ImportError:  # another transformers version: nothing lazy to do ahead
        return prepared
    models = [m for m in module.modules() if isinstance(m, PreTrainedModel)]
    if not TRACES_CHECKPOINT_SIDE_EFFECTS and any(getattr(sub, "gradient_checkpointing", False) is True for m in models for sub in m.modules()):
        raise AutoSPError(
            f"AutoSP: a Hugging Face model has gradient checkpointing on (gradient_checkpointing_enable()), which this torch "
            f"({torch.__version__}) cannot trace as one graph: its Dynamo lacks skip_fwd_side_effects_in_bwd_under_checkpoint, and "
            "each checkpointed layer sets Python state that would split the step. Turn gradient checkpointing off "
            "(model.gradient_checkpointing_disable()) and use AutoSPStrategy(sac='block'), which recomputes each layer whole "
            "as checkpointing does, or use torch >= 2.13."
        )
    for m in models:  # every class first: a model's hooks read its sub-models' registrations
        if not _CAN_RECORD_REGISTRY.get(m) and getattr(m, "_can_record_outputs", None):
            # unpickled into this process (a rank started by spawn or a fork server), the model was not
            # constructed here, where its class registers what it records: register it as __init__ does
            _CAN_RECORD_REGISTRY[m] = m._can_record_outputs
    for m in models:
        if not getattr(m, "_output_capturing_hooks_installed", False):
            maybe_install_capturing_hooks(m)
            prepared.models += 1
    if prepared.models:
        log.debug("AutoSP: installed the output-capturing hooks of %d Hugging Face model(s) before compiling", prepared.models)
    return prepared
