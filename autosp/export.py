"""Turn any checkpoint AutoSP wrote (a sharded directory or a single file) into the model's own
state dict, in one file, for one device::

    python -m autosp.export CHECKPOINT OUT.pt [--module model]
    python -m autosp.export CHECKPOINT OUT_DIR --hf-config CONFIG   # Hugging Face

``OUT.pt`` loads with ``model.load_state_dict(torch.load("OUT.pt"))``: keys are the model's own
(``layers.0.attention.wq.weight``), without the LightningModule attribute that holds the model
(``--module``; by default the one prefix every key shares) or ``torch.compile``'s ``_orig_mod.``.
A sharded checkpoint (a torch distributed checkpoint directory) is read whole in this process. With ``--hf-config`` (a directory or ``config.json``
of a Hugging Face causal LM) the weights go through ``save_pretrained`` into ``OUT_DIR``, ready
for ``from_pretrained``. The whole model is assembled in host memory.

Checkpoints are pickles: export only checkpoints you trust.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from autosp.checkpoint import is_distributed_checkpoint, read_model_state_dict
from autosp.errors import AutoSPError

__all__ = ["export_state_dict", "main"]

log = logging.getLogger(__name__)


def _clean(key: str) -> str:
    return ".".join(part for part in key.split(".") if part != "_orig_mod")


def export_state_dict(checkpoint: Any, module: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The model's state dict from ``checkpoint`` (a path), full tensors on the CPU.

    ``module`` is the LightningModule attribute holding the model (``"model"``): its prefix is
    removed and other entries dropped. ``None`` removes the first key component when every key
    shares it, and keeps the keys otherwise. ``""`` keeps every key as the LightningModule has it.
    """
    path = Path(checkpoint)
    if not path.exists():
        raise AutoSPError(f"export: {path} does not exist.")
    if is_distributed_checkpoint(path):
        state = read_model_state_dict(path)
    else:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as exc:
            raise AutoSPError(f"export: cannot read {path}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(loaded, dict) or "state_dict" not in loaded:
            raise AutoSPError(f"export: {path} is not a Lightning checkpoint (no 'state_dict').")
        state = loaded["state_dict"]
    state = {_clean(k): v for k, v in state.items()}
    if module is None:
        firsts = {k.split(".", 1)[0] for k in state}
        if len(firsts) == 1 and all("." in k for k in state):
            module = firsts.pop()
            log.info("export: removed the prefix %r shared by every key (--module '' keeps it)", module + ".")
        else:
            module = ""
    if module:
        prefix = module + "."
        kept = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if not kept:
            raise AutoSPError(f"export: no key of {path} starts with {prefix!r}; its keys start with {sorted({k.split('.', 1)[0] for k in state})}.")
        state = kept
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def _save_hugging_face(state: dict[str, torch.Tensor], config: str, out: Path) -> None:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise AutoSPError("export --hf-config needs the transformers package: pip install transformers") from exc
    cfg = AutoConfig.from_pretrained(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    result = model.load_state_dict(state, strict=False, assign=True)
    tied = set()
    if getattr(cfg, "tie_word_embeddings", False):
        tied = {k for k in result.missing_keys if k == "lm_head.weight"}
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise AutoSPError(
            f"export: the checkpoint does not fit {type(model).__name__} built from {config}: missing {missing[:8]}, "
            f"unexpected {result.unexpected_keys[:8]}. Pass the config the model was trained with (and --module if "
            "the LightningModule holds it under another attribute)."
        )
    if tied:
        model.tie_weights()
    model.save_pretrained(out)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m autosp.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint AutoSPStrategy wrote: a sharded directory or a .ckpt file")
    parser.add_argument("out", help="the state dict file to write (or, with --hf-config, the directory)")
    parser.add_argument("--module", default=None, help="the LightningModule attribute holding the model (default: the prefix every key shares)")
    parser.add_argument("--hf-config", default=None, help="a Hugging Face config (directory or config.json): write save_pretrained files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    state = export_state_dict(args.checkpoint, args.module)
    if args.hf_config:
        _save_hugging_face(state, args.hf_config, out)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, out)
    log.info("export: %d tensors (%.1f MB) from %s to %s", len(state), sum(v.numel() * v.element_size() for v in state.values()) / 1e6, args.checkpoint, out)


if __name__ == "__main__":
    main()
