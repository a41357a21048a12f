"""A notebook's order of work as one script: fit under ``AutoSPStrategy(start_method="fork")``
(what Lightning's ``ddp_notebook`` does) twice, compile a training step in this, the
launching, process, then fit forked again. Prints one line per stage."""

import os

import lightning as L
import torch
from sp_harness import LMModule, TokenData, free_port, lm_loss, make_model
from torch.utils.data import DataLoader

from lightning_autosp import AutoSPStrategy


def fit() -> str:
    os.environ["MASTER_PORT"] = str(free_port())
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, strategy=AutoSPStrategy(sp_size=2, compile_backend="aot_eager", start_method="fork"),
    )
    try:
        trainer.fit(LMModule("gpt"), DataLoader(TokenData(4, 16), batch_size=2))
    except Exception as err:  # the launcher re-raises a rank's error with its traceback as text
        return f"failed: {err}"
    return "trained"


def autograd_in_a_forked_child() -> str:
    pid = os.fork()
    if pid == 0:
        try:
            torch.ones(1, requires_grad=True).sum().backward()
            os._exit(0)
        except RuntimeError:
            os._exit(3)
    return "works" if os.waitpid(pid, 0)[1] == 0 else "fails"


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("fit before compiling:", fit(), flush=True)
    print("second fit (its first one compiled in the ranks only):", fit(), flush=True)
    model = make_model("gpt")
    step = torch.compile(lambda ids: lm_loss(model(ids), ids, True), backend="aot_eager")
    step(torch.randint(0, 64, (2, 16))).backward()
    print("autograd in a child forked after compiling:", autograd_in_a_forked_child(), flush=True)
    print("fit after compiling:", fit(), flush=True)
