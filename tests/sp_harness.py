"""Shared machinery of the multi-process tests: run a Trainer under AutoSP (or plain DDP) with
``START_METHOD`` (fork, or a fork server on torch >= 2.14) on CPU/gloo, record what every rank saw and computed, and replay the
same batches on one device, eagerly, as the reference."""

from __future__ import annotations

import math
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch.utils.data import DataLoader, Dataset

from lightning_autosp import AutoSPStrategy
from autosp._compat import FORK_AFTER_COMPILE_BREAKS_AUTOGRAD, graph_break_counter
from autosp.launch import unshare
from autosp.ops import kernels
from autosp.ops.tile_kernels import TILE_COUNTS
from autosp.modes.sharded.values import full_state_dict, sharded_parameter_bytes
from autosp.passes import sequence_parallel_pass
from autosp.passes.sac import SACConfig, SACPartitioner
from autosp.models import GPT, GPTConfig, Llama, LlamaConfig

VOCAB = 64

#: How the tests start their ranks: forked from the test process (fast) where torch allows it;
#: on torch >= 2.14, where a process forked after a compile in the test process cannot run
#: autograd, from a fork server - a fresh process that imported this module once (conftest) and
#: forks each rank from there. ``AUTOSP_TEST_START_METHOD`` overrides it.
START_METHOD = os.environ.get("AUTOSP_TEST_START_METHOD") or ("forkserver" if FORK_AFTER_COMPILE_BREAKS_AUTOGRAD else "fork")


def make_model(kind: str, layers: int = 2) -> torch.nn.Module:
    """The tiny GPT or Llama (2 layers; 1 compiles ~30% faster where a second adds nothing)."""
    torch.manual_seed(1234)
    if kind == "gpt":
        return GPT(GPTConfig.tiny(vocab_size=VOCAB, n_layers=layers))
    if kind == "llama":
        return Llama(LlamaConfig.tiny(vocab_size=VOCAB, n_layers=layers))
    raise ValueError(kind)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """The loss as a user writes it: aligned labels, or shifting the logits in the loss."""
    if shift:
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)


class LMModule(L.LightningModule):
    """An unmodified user module: the loss is computed in ``training_step``."""

    def __init__(
        self, kind: str, shift: bool = False, lr: float = 0.1, optimizer: str = "sgd", in_configure_model: bool = False,
        layers: int = 2, log_loss: bool = True,
    ):
        super().__init__()
        self.kind, self.layers, self.log_loss = kind, layers, log_loss
        self.model = None if in_configure_model else make_model(kind, layers)
        self.shift = shift
        self.lr = lr
        self.optimizer = optimizer
        self.built_on: Optional[str] = None

    def configure_model(self):
        if self.model is None:  # the large-model way: built by the strategy's rules (meta for fsdp=True)
            self.model = make_model(self.kind, self.layers)
            self.built_on = next(self.model.parameters()).device.type

    def training_step(self, batch, batch_idx):
        logits = self.model(batch["input_ids"])
        loss = lm_loss(logits, batch["labels"], self.shift)
        if self.log_loss:  # made when the compiled step returns (no graph break)
            self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        logits = self.model(batch["input_ids"])
        loss = lm_loss(logits, batch["labels"], self.shift)
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self):
        return make_optimizer(self.optimizer, self.parameters(), self.lr)


def make_optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    return torch.optim.SGD(params, lr=lr)


class FnModule(L.LightningModule):
    """A user module around any model: ``loss_fn(model, batch) -> loss`` in every step."""

    def __init__(
        self, model_factory: Callable[[], torch.nn.Module], loss_fn: Callable, lr: float = 0.1, optimizer: str = "sgd",
        log_loss: bool = True,
    ):
        super().__init__()
        self.model = model_factory()
        self.loss_fn = loss_fn
        self.lr = lr
        self.optimizer = optimizer
        self.log_loss = log_loss

    def training_step(self, batch, batch_idx):
        loss = self.loss_fn(self.model, batch)
        if self.log_loss:  # made when the compiled step returns (no graph break)
            self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.loss_fn(self.model, batch)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch, batch_idx):
        loss = self.loss_fn(self.model, batch)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch, batch_idx):
        return self.model(batch["input_ids"])

    def configure_optimizers(self):
        return make_optimizer(self.optimizer, self.parameters(), self.lr)


def replay(
    model_factory: Callable, step_loss: Callable, run: "Run", sp_size: int, lr: float = 0.1,
    optimizer: str = "sgd", final: Optional[dict] = None, accumulate: int = 1,
    initial: Optional[dict] = None, clip: Optional[float] = None, norms: Optional[list] = None,
):
    """Replay the batches each DP group saw on one device, eagerly: per-step losses of each group
    and the DP-averaged gradients before each optimizer step (``final``, if given, receives the
    parameters after the last one). ``step_loss(model, batch) -> loss``. ``initial``: a state
    dict to start from; ``clip``: clip the gradients to this total norm before each step, as
    ``Trainer(gradient_clip_val=clip)`` does (``norms`` receives the norms before clipping)."""
    dp = run.world // sp_size
    model = model_factory()
    if initial is not None:
        model.load_state_dict(initial)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    losses: list[list[float]] = []
    grads: list[dict[str, torch.Tensor]] = []
    for i in range(len(run.ranks[0]["batches"])):
        step_losses = []
        for g in range(dp):
            loss = step_loss(model, run.ranks[g * sp_size]["batches"][i])
            (loss / (dp * accumulate)).backward()
            step_losses.append(loss.item())
        losses.append(step_losses)
        if (i + 1) % accumulate == 0:
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})  # (frozen: none)
            if clip is not None:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                if norms is not None:
                    norms.append(float(norm))
            opt.step()
            opt.zero_grad()
    if final is not None:
        final.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    return losses, grads


def reference_fn(
    model_factory: Callable, loss_fn: Callable, run: "Run", sp_size: int, lr: float = 0.1, bf16: bool = False, **kwargs: Any
):
    """Like :func:`reference` for a :class:`FnModule` (``bf16``: under CPU bf16 autocast;
    ``optimizer``, ``final``: as for :func:`replay`)."""

    def step_loss(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return loss_fn(model, batch)

    return replay(model_factory, step_loss, run, sp_size, lr, **kwargs)


class TokenData(Dataset):
    """Random tokens; labels are ignored (-100) on an uneven, sample-dependent set of positions
    so that SP ranks hold very different numbers of real targets. ``ignore``: ``"uneven"``,
    ``"first_shard_only"`` (targets on the first quarter only; only on the samples in
    ``first_shard_rows`` if given, the others uneven) or ``"none"``."""

    def __init__(self, n: int, seq_len: int, ignore: str = "uneven", seed: int = 0, first_shard_rows=None):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, VOCAB, (n, seq_len), generator=g)
        self.y = torch.randint(0, VOCAB, (n, seq_len), generator=g)
        if ignore == "uneven" or first_shard_rows is not None:
            for i in range(n):
                # most of the first half ignored, a stripe near the end ignored
                self.y[i, 1 : seq_len // 2 - i % 3] = -100
                self.y[i, seq_len - 3 : seq_len - 1] = -100
        if ignore == "first_shard_only":
            rows = list(range(n)) if first_shard_rows is None else list(first_shard_rows)
            self.y[rows] = torch.randint(0, VOCAB, (len(rows), seq_len), generator=g)
            self.y[rows, seq_len // 4 :] = -100

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.y[i]}


class Recorder(L.Callback):
    """Saves, per rank: the batches seen, the loss returned by each training step, the
    gradients after DDP's sync (just before each optimizer step) and the SP/DP groups."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.rec: dict[str, Any] = {"batches": [], "losses": [], "grads": [], "val_losses": []}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.rec["batches"].append({k: v.clone() for k, v in batch.items()})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rec["losses"].append(float(outputs["loss"]) * trainer.accumulate_grad_batches)
        if "train_loss" in trainer.callback_metrics:
            self.rec.setdefault("logged", []).append(float(trainer.callback_metrics["train_loss"]))
        self.rec.setdefault("metrics", []).append({k: float(v) for k, v in trainer.callback_metrics.items()})

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.rec["val_losses"].append(float(outputs))

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.rec.setdefault("test_losses", []).append(float(outputs))
        self.rec.setdefault("eval_batches", []).append({k: v.clone() for k, v in batch.items()})

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.rec.setdefault("predictions", []).append(outputs.detach().clone())
        self.rec.setdefault("eval_batches", []).append({k: v.clone() for k, v in batch.items()})

    def _save_eval(self, trainer):
        st = trainer.strategy
        if isinstance(st, AutoSPStrategy):
            self.rec["graphs"] = {k: list(c.pass_stats) for k, c in st.compiled_steps.items()}
        torch.save(self.rec, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))

    def on_test_end(self, trainer, pl_module):
        self._save_eval(trainer)

    def on_predict_end(self, trainer, pl_module):
        self._save_eval(trainer)

    def on_train_start(self, trainer, pl_module):
        self.rec["built_on"] = getattr(pl_module, "built_on", None)
        self._tiles_before = dict(TILE_COUNTS)
        self._kernels_before, self._reads_before = dict(kernels.KERNEL_COUNTS), kernels.HOST_READS["count"]
        self._breaks_before = sum(graph_break_counter().values())
        st = trainer.strategy
        if isinstance(st, AutoSPStrategy) and st.fsdp:  # a collective: every rank
            self.rec["initial"] = {k.removeprefix("model."): v for k, v in full_state_dict(pl_module).items()}
            self.rec["placement"] = {  # where each parameter lives: mesh, placements, this rank's part
                n: (p.device_mesh.mesh.tolist(), tuple(str(x) for x in p.placements), local_tensor(p).detach().clone())
                for n, p in pl_module.named_parameters()
            }
        for optimizer in trainer.optimizers:  # the gradients' norm the optimizer stepped with (after clipping)
            optimizer.register_step_post_hook(self._record_stepped_norm)

    def _record_stepped_norm(self, optimizer, args, kwargs):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        self.rec.setdefault("stepped_norms", []).append(float(full_tensor(torch.nn.utils.get_total_norm(grads))))
        # this rank's part of them alone (its shards: what a shard-local clip would use)
        self.rec.setdefault("local_norms", []).append(float(torch.nn.utils.get_total_norm([local_tensor(g) for g in grads])))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        # a DTensor gradient (fsdp) whole: a collective, every rank records
        self.rec["grads"].append({n: full_tensor(p.grad).detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None})

    def on_train_end(self, trainer, pl_module):
        st = trainer.strategy
        self.rec["graph_breaks"] = sum(graph_break_counter().values()) - self._breaks_before  # Dynamo's, in this rank's fit
        # the tiled attention kernel's paths in this rank's fit: tiles computed and skipped, calls run as is_causal
        self.rec["tile_counts"] = {k: TILE_COUNTS[k] - self._tiles_before[k] for k in TILE_COUNTS}
        # the kernel table's calls per (case, kernel), and the reads of the device the masks' maps made
        self.rec["kernel_counts"] = {k: n - self._kernels_before.get(k, 0) for k, n in kernels.KERNEL_COUNTS.items() if n > self._kernels_before.get(k, 0)}
        self.rec["host_reads"] = kernels.HOST_READS["count"] - self._reads_before
        if isinstance(st, AutoSPStrategy):
            self.rec["sp_group"] = dist.get_process_group_ranks(st.sp_group)
            self.rec["dp_group"] = dist.get_process_group_ranks(st.dp_group)
            self.rec["graphs"] = {k: list(c.pass_stats) for k, c in st.compiled_steps.items()}
            self.rec["buckets"] = {k: list(c.bucket_stats) for k, c in st.compiled_steps.items()}
            self.rec["saved"] = [  # per training graph: ops recomputed in backward, bytes saved on the device and in host memory
                (dict(r.recomputed), sum(r.bytes_by_kind().values()), r.host_bytes())
                for r in st.compiled_steps["training_step"].saved_activations
            ] if "training_step" in st.compiled_steps else []
            if "training_step" in st.compiled_steps:  # how each compile's sizes follow the sequence length
                self.rec["length_symbols"] = [dict(r.length_symbols) for r in st.compiled_steps["training_step"].saved_activations]
            if not st.fsdp:
                self.rec["final"] = {k.removeprefix("model."): v.detach().clone() for k, v in pl_module.state_dict().items()}
            else:  # collectives: every rank
                self.rec["final"] = {k.removeprefix("model."): v for k, v in full_state_dict(pl_module).items()}
                self.rec["bytes"] = sharded_parameter_bytes(pl_module, trainer.optimizers[0])
                saved = st.compiled_steps["training_step"].saved_activations
                self.rec["saved_names"] = [t.name for r in saved for t in r.tensors]
        else:  # another strategy (plain DDP, Lightning's ModelParallelStrategy): its parameters whole
            self.rec["final"] = {k.removeprefix("model."): full_tensor(v).detach().clone() for k, v in pl_module.state_dict().items()}
        torch.save(self.rec, os.path.join(self.out_dir, f"rank{trainer.global_rank}.pt"))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Unshared(L.Callback):
    """What AutoSPStrategy does in each rank started from a fork server, for plain DDP runs: own
    copies of the parameters that torch's multiprocessing put in memory shared by every rank
    (Lightning undoes that for ``start_method="spawn"`` only)."""

    def setup(self, trainer, pl_module, stage):
        unshare(pl_module)


@dataclass
class Run:
    ranks: list[dict]

    @property
    def world(self) -> int:
        return len(self.ranks)


def run_eval(tmp_path: Path, module: L.LightningModule, data: Dataset, devices: int, sp_size: int, stage: str, **strategy_kwargs: Any) -> Run:
    """``trainer.validate/test/predict`` on ``devices`` forked CPU processes under AutoSP
    (``strategy_kwargs``: further ``AutoSPStrategy`` arguments)."""
    os.environ["MASTER_PORT"] = str(free_port())
    out = tmp_path / f"eval_{stage}_{devices}_{sp_size}"
    out.mkdir()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=AutoSPStrategy(sp_size=sp_size, compile_backend="aot_eager", start_method=START_METHOD, **strategy_kwargs),
        callbacks=[Recorder(str(out))],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    getattr(trainer, stage)(module, DataLoader(data, batch_size=2, shuffle=False))
    return Run([torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)])


def run_fit(
    tmp_path: Path,
    module: L.LightningModule,
    data: Dataset,
    devices: int,
    sp_size: Optional[int],
    steps: int = 3,
    batch_size: int = 2,
    accumulate: int = 1,
    backend: str = "aot_eager",
    val_data: Optional[Dataset] = None,
    precision: str = "32-true",
    sac: bool = True,
    fsdp: bool = False,
    gradient_clip_val: Optional[float] = None,
    callbacks: Sequence[L.Callback] = (),
    ckpt_path: Optional[str] = None,
    chunked_loss: Any = True,
    pretrained: Optional[dict] = None,
    start_method: str = START_METHOD,
    ddp_unshared: bool = True,
    distributed_sampler: bool = True,
    tiled_attention: Any = True,
    tiled_mlp: Any = True,
    activation_offload: Any = "auto",
    strategy: Any = None,
    sp_layout: Any = None,
    strict: bool = False,
) -> Run:
    """Fit on ``devices`` CPU processes (started by ``start_method``); ``sp_size=None`` means
    plain DDP (``ddp_unshared``: with :class:`Unshared`; ``distributed_sampler=False``: every
    rank reads every batch); ``strategy``: another Lightning strategy, run as given."""
    os.environ["MASTER_PORT"] = str(free_port())
    # a fresh directory per fit (a name from id(module) repeated when a test's second module
    # reused the freed first one's address)
    out = Path(tempfile.mkdtemp(prefix=f"run_{devices}_{sp_size}_", dir=tmp_path))
    if strategy is not None:
        pass
    elif sp_size is None:
        strategy: Any = L.pytorch.strategies.DDPStrategy(start_method=start_method)
        callbacks = (*callbacks, Unshared()) if ddp_unshared else callbacks
    else:
        strategy = AutoSPStrategy(
            sp_size=sp_size, compile_backend=backend, start_method=start_method, sac=sac, fsdp=fsdp, chunked_loss=chunked_loss,
            pretrained=pretrained, tiled_attention=tiled_attention, tiled_mlp=tiled_mlp,
            activation_offload=activation_offload, sp_layout=sp_layout, strict=strict,
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        use_distributed_sampler=distributed_sampler,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=gradient_clip_val,
        precision=precision,
        limit_val_batches=2 if val_data is not None else 0,
        num_sanity_val_steps=0,
        val_check_interval=steps * accumulate if val_data is not None else None,
        callbacks=[Recorder(str(out)), *callbacks],
        logger=False,
        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loaders = [DataLoader(data, batch_size=batch_size, shuffle=False)]
    if val_data is not None:
        loaders.append(DataLoader(val_data, batch_size=batch_size, shuffle=False))
    trainer.fit(module, *loaders, ckpt_path=ckpt_path)
    return Run([torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)])


def reference(kind: str, run: Run, sp_size: int, lr: float = 0.1, shift: bool = False, layers: int = 2, **kwargs: Any):
    """:func:`replay` for an :class:`LMModule` of ``kind``."""
    step_loss = lambda m, b: lm_loss(m(b["input_ids"]), b["labels"], shift)  # noqa: E731
    return replay(lambda: make_model(kind, layers), step_loss, run, sp_size, lr, **kwargs)


def finite(err: float) -> float:
    """An error that is NaN (a NaN loss or gradient) as infinitely wrong: ``max`` and ``<=``
    would pass it silently."""
    return math.inf if math.isnan(err) else err


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return finite(float((a - b).norm() / b.norm().clamp_min(1e-30)))


def scalar_err(got: float, want: float) -> float:
    return finite(abs(got - want) / abs(want))


def compare(run: Run, sp_size: int, ref_losses, ref_grads) -> tuple[float, float]:
    """Largest relative error of (losses, gradients) over every rank and step."""
    loss_err = grad_err = 0.0
    for r, rec in enumerate(run.ranks):
        g = r // sp_size
        for got, want in zip(rec["losses"], ref_losses):
            loss_err = max(loss_err, scalar_err(got, want[g]))
        assert len(rec["grads"]) == len(ref_grads)
        for got, want in zip(rec["grads"], ref_grads):
            names = [n.removeprefix("model.") for n in got]
            assert sorted(names) == sorted(want), "gradient names differ from the reference"
            for n, t in got.items():
                grad_err = max(grad_err, rel_err(t, want[n.removeprefix("model.")]))
    return loss_err, grad_err


def _spawn_entry(rank: int, world: int, port: int, fn: Callable, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn(tmp_path: Path, fn: Callable, world: int, *args: Any, start_method: Optional[str] = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo processes (``start_method``, default
    ``START_METHOD``); return each result."""
    import torch.multiprocessing as mp

    import tempfile

    out = Path(tempfile.mkdtemp(prefix=f"spawn_{fn.__name__}_{world}_", dir=tmp_path))
    mp.start_processes(
        _spawn_entry, args=(world, free_port(), fn, str(out), args), nprocs=world, start_method=start_method or START_METHOD
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def naive_reference_fn(model_factory: Callable, loss_fn: Callable, run: "Run", sp_size: int, lr: float = 0.1, **kwargs: Any):
    """The negative control on one device: each SP rank's slice of the sequence on its own
    (every dim of size S sliced, masks included), losses averaged - sharding without the pass
    (``kwargs``: as for :func:`replay`)."""
    from autosp.layout import seq_split_sizes

    def chunks(batch):
        S = batch["input_ids"].shape[1]
        sizes = seq_split_sizes(S, sp_size)
        starts = [sum(sizes[:r]) for r in range(sp_size)]
        for r in range(sp_size):
            out = {}
            for k, t in batch.items():
                for d in range(1, t.dim()):
                    if t.shape[d] == S:
                        t = t.narrow(d, starts[r], sizes[r])
                out[k] = t.contiguous()
            yield out

    def step_loss(model, batch):
        return torch.stack([loss_fn(model, c) for c in chunks(batch)]).mean()

    return replay(model_factory, step_loss, run, sp_size, lr, **kwargs)


def check_against_references(run: "Run", sp_size: int, model_factory: Callable, loss_fn: Callable, tol: float = 1e-4):
    """SP run vs one device (must match) and vs the naive sharding (must not): returns the errors."""
    loss_err, grad_err = compare(run, sp_size, *reference_fn(model_factory, loss_fn, run, sp_size))
    naive_loss, naive_grad = compare(run, sp_size, *naive_reference_fn(model_factory, loss_fn, run, sp_size))
    assert loss_err <= tol and grad_err <= tol, (loss_err, grad_err)
    assert max(naive_loss, naive_grad) > 100 * tol, "negative control: naive sharding should not match"
    return loss_err, grad_err, naive_grad


# ---------------------------------------------------------------------- one rank's pass, traced only
class TraceStop(Exception):
    """Raised by a test backend once it has what it needs (no process group to run with)."""


def hint_int(size) -> int:
    """A size at the sizes the step was traced with (a data-dependent one at its upper bound)."""
    from autosp.passes.placement import hinted_size

    return hinted_size(size)


def trace_rank(step, inputs, attention_tile=0, sp_size=2, sp_rank=0, sac=True, **pass_kwargs):
    """One SP rank's step, traced and partitioned (with SAC unless ``sac=False``) without running
    it: the SP pass's stats, the largest tensor of the joint graph (elements) and the bytes the
    forward saves for backward, at the inputs' sizes. ``pass_kwargs`` go to the SP pass."""
    found = {}

    def partition(joint, joint_inputs, **kwargs):
        found["joint_max"] = max(hint_int(n.meta["val"].numel()) for n in joint.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor))
        fw, bw = SACPartitioner(SACConfig() if sac else None)(joint, joint_inputs, **kwargs)
        outs = fw.graph.find_nodes(op="output")[0].args[0][kwargs["num_fwd_outputs"]:]
        saved = {n for n in outs if isinstance(n, torch.fx.Node) and n.op != "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
        found["saved"] = sum(hint_int(n.meta["val"].numel()) * n.meta["val"].element_size() for n in saved)
        raise TraceStop

    def backend(gm, example_inputs):
        gm = sequence_parallel_pass(gm, sp_size=sp_size, sp_rank=sp_rank, group_name="unused", attention_tile=attention_tile, **pass_kwargs)
        found["stats"] = gm.meta["autosp"]
        return aot_autograd(fw_compiler=lambda g, _: g.forward, partition_fn=partition)(gm, example_inputs)

    seq = inputs[0].shape[1]
    for t in inputs:  # every dim as long as the sequence, as AutoSPStrategy marks them
        for d in range(1, t.dim()):
            if t.shape[d] == seq:
                torch._dynamo.mark_dynamic(t, d)
    try:
        torch.compile(step, backend=backend)(*inputs)
    except Exception as exc:  # Dynamo wraps the backend's exception
        cause = exc
        while cause is not None and not isinstance(cause, TraceStop):
            cause = cause.__cause__ or getattr(cause, "inner_exception", None)
        if cause is None:
            raise
    return found
