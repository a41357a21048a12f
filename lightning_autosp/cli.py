"""``lightning-autosp``: the LightningCLI entry point, and ``plan``.

    lightning-autosp fit --config configs/demo_cpu.yaml
    lightning-autosp plan --config configs/llama8b_sp8_fsdp.yaml   (autosp.memory.plan)

Any LightningModule / LightningDataModule can be named by ``class_path``; when the data module
has a ``vocab_size`` it is passed on to the model's ``vocab_size``.
"""

from __future__ import annotations

import sys
from typing import Optional

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

import lightning_autosp  # noqa: F401  (registers the `autosp` strategy name)


class AutoSPCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")


def main(args: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["plan"]:  # not a LightningCLI subcommand: sizes a run before launch
        from autosp.memory.plan import main as plan

        plan(argv[1:])
        return
    AutoSPCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
