"""Every Lightning version gate of the package lives here (torch's: :mod:`autosp._compat`).

Importing ``lightning_autosp`` with a torch or Lightning outside the ranges the compatibility
subset passed on raises ``ImportError`` at once instead of failing later inside a fit or the CLI.
"""

from __future__ import annotations

from typing import Optional

from autosp._compat import TORCH_RANGE, SupportedRange, release

__all__ = ["LIGHTNING_RANGE", "TORCH_RANGE", "check_versions", "release", "load_checkpoint_kwargs", "FABRIC_SETUP_PASSES_SCHEDULER"]

#: oldest tested 2.5.3, newest 2.6.6. Lightning 2.4.0's LightningCLI puts its internal
#: ``_class_path`` into the hparams of both the model and the data module and then refuses to
#: merge them ("Error while merging hparams"); 2.5.0 skips that key. 2.5.0 - 2.5.2's
#: RichProgressBar calls ``Console.clear_live()`` on an empty live stack with rich 15.0
#: (IndexError at the start of fit); 2.5.3 checks first.
LIGHTNING_RANGE = SupportedRange("lightning", "2.5.3", "2.7")


def check_versions(torch_version: str, lightning_version: str) -> None:
    """Raise ``ImportError`` naming every installed version outside its supported range."""
    problems = [
        f"{supported.package} {version} is installed, but lightning-autosp supports {supported.requirement}"
        for supported, version in ((TORCH_RANGE, torch_version), (LIGHTNING_RANGE, lightning_version))
        if not supported.contains(version)
    ]
    if problems:
        raise ImportError(
            "lightning-autosp: " + "; ".join(problems) + ". Install a supported version "
            f"(pip install '{TORCH_RANGE.requirement}' '{LIGHTNING_RANGE.requirement}'); "
            "docs/testing.md in the repository lists every version run."
        )


def load_checkpoint_kwargs(weights_only: Optional[bool]) -> dict:
    """``Strategy.load_checkpoint``'s keyword arguments: Lightning < 2.6 has no ``weights_only``
    (passed only where given)."""
    return {} if weights_only is None else {"weights_only": weights_only}


def _fabric_setup_passes_scheduler() -> bool:
    import inspect

    from lightning.fabric.strategies import Strategy

    return "scheduler" in inspect.signature(Strategy.setup_module_and_optimizers).parameters


#: Fabric's ``Strategy.setup_module_and_optimizers`` takes and returns an LR scheduler since
#: Lightning 2.6 (``(module, optimizers, scheduler)``); 2.5 passes and expects ``(module, optimizers)``.
FABRIC_SETUP_PASSES_SCHEDULER = _fabric_setup_passes_scheduler()
