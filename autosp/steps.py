"""Compiled steps: functions compiled with the AutoSP backend and run with the per-step checks.

:class:`StepRunner` knows nothing of Lightning. It compiles a step function - the Trainer's
``training_step``, or the loss computation a Fabric or plain PyTorch loop marks - with an
:class:`~autosp.backend.AutoSPBackend`, and runs each call:

* before: the SP group agrees on the batch (:mod:`autosp.batch_agreement`), the
  sequence fits the group, and the batch's sequence dims are marked dynamic, so one compile
  serves every length;
* during: errors from inside Dynamo become :class:`~autosp.errors.AutoSPError` with the
  cause (a size the code fixed, a graph break that hid the sequence, the pass's own refusal);
* after the first call: a step without attention to split is an error, the ops that ran
  replicated are logged.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError
from torch.utils._pytree import keystr, tree_flatten_with_path

from autosp._compat import checkpoint_tracing_config, graph_break_counter
from autosp.backend import AutoSPBackend, CompiledStep
from autosp.batch_agreement import check_sp_batch_agreement
from autosp.errors import AutoSPError, NoSequenceDim
from autosp.layout import check_sequence_fits
from autosp.passes.offload import OffloadConfig
from autosp.passes.rewrite import SPPassStats
from autosp.passes.sac import SACConfig
from autosp.passes.sequence_parallel import describe_fallbacks

__all__ = ["StepConfig", "StepRunner"]

log = logging.getLogger(__name__)

#: an op run replicated that holds this share of the step's saved bytes (or more) is warned about
LOUD_FALLBACK = 0.05


@dataclass(frozen=True)
class StepConfig:
    """How steps are compiled (the strategies' arguments of the same names)."""

    compile_backend: str = "inductor"
    sac: Optional[SACConfig] = field(default_factory=SACConfig)
    seq_dim: int = 1
    #: tokens per chunk of the fused vocabulary loss (0: sized from the vocabulary, None: off)
    loss_chunk: Optional[int] = 0
    #: rows/columns per tile of attention with a mask built from positions (0: automatic, None: dense masks)
    attention_tile: Optional[int] = 0
    #: an op the SP pass would run replicated is an error instead of a warning
    strict: bool = False
    #: saved activations moved to host memory (None: all stay on the device)
    offload: Optional[OffloadConfig] = None
    #: rows per tile of the MLPs (0: automatic, where it pays; None: off)
    mlp_tile: Optional[int] = 0
    #: ``(ulysses, ring)``: how the SP group splits attention (None: chosen per graph from its heads)
    sp_layout: Optional[tuple[int, int]] = None
    #: the largest Ulysses degree an automatic layout takes (the devices per node; None: sp_size)
    max_ulysses: Optional[int] = None


class StepRunner:
    """Compiles and runs the steps of one SP rank (see the module docstring).

    Args:
        config: how to compile.
        sp_size, sp_rank, sp_group: this rank's SP group.
        device: where batch fingerprints are compared (the rank's device).
    """

    def __init__(self, config: StepConfig, sp_size: int, sp_rank: int, sp_group: dist.ProcessGroup, device: torch.device):
        self.config = config
        self.sp_size, self.sp_rank, self.sp_group, self.device = sp_size, sp_rank, sp_group, device
        self.backends: dict[str, AutoSPBackend] = {}
        self._checked: set[str] = set()
        self._diverged: set[str] = set()  # steps whose SP ranks compiled different graphs (warned)
        self._packed_checked: set[str] = set()  # steps whose batch was checked for packed documents
        self.marked: list[str] = []  # the batch dims the last step marked as sequence dims
        self.marked_length: Optional[int] = None  # and their size: the last batch's sequence length

    def compile(self, name: str, fn: Callable) -> Callable:
        """``fn`` compiled with a backend of its own, recorded as step ``name``."""
        cfg = self.config
        backend = AutoSPBackend(
            sp_size=self.sp_size, sp_rank=self.sp_rank, group_name=self.sp_group.group_name, seq_dim=cfg.seq_dim,
            backend=cfg.compile_backend, sac=cfg.sac, loss_chunk=cfg.loss_chunk, attention_tile=cfg.attention_tile,
            strict=cfg.strict, offload=cfg.offload, mlp_tile=cfg.mlp_tile, sp_layout=cfg.sp_layout, max_ulysses=cfg.max_ulysses,
        )
        self.backends[name] = backend
        compiled = torch.compile(fn, backend=backend)

        def step(*args: Any, **kwargs: Any) -> Any:
            # Dynamo's DDP optimizer would split our graph per gradient bucket; the SP pass needs
            # the whole step in one graph, and DDP still overlaps the gradient all-reduce. Ops whose
            # output shape depends on the data (a router's torch.where(mask)) are traced into the
            # graph with data-dependent sizes instead of breaking it before the experts; regions
            # under gradient checkpointing are traced whole (autosp.passes.checkpoints).
            with torch._dynamo.config.patch(optimize_ddp=False, capture_dynamic_output_shape_ops=True, **checkpoint_tracing_config()):
                return compiled(*args, **kwargs)

        step.__wrapped__ = fn  # type: ignore[attr-defined]
        return step

    def compile_step(self, name: str, fn: Callable) -> Callable:
        """``fn`` compiled (:meth:`compile`) and run with the checks (:meth:`run`), its arguments
        taken as the batch: ``loss = step(model, batch)`` in a loop of one's own."""
        compiled = self.compile(name, fn)

        def step(*args: Any, **kwargs: Any) -> Any:
            return self.run(name, name, compiled, (args, kwargs), *args, **kwargs)

        step.__wrapped__ = fn  # type: ignore[attr-defined]
        return step

    @staticmethod
    def empty_view() -> Mapping[str, CompiledStep]:
        """What :attr:`compiled_steps` reads before anything is compiled."""
        return MappingProxyType({})

    @property
    def compiled_steps(self) -> Mapping[str, CompiledStep]:
        """Snapshots of what each step compiled (:class:`~autosp.backend.CompiledStep`)."""
        return MappingProxyType({name: backend.compiled_step() for name, backend in self.backends.items()})

    def run(self, name: str, where: str, fn: Callable, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a compiled step (or one that calls step ``name``), with the
        checks of ``batch`` before it and the translation of its errors; ``where`` names the step
        in messages (``"MyModule.training_step"``)."""
        self.prepare_batch(batch, name)
        breaks_before = Counter(graph_break_counter())
        backend = self.backends.get(name)
        compiles_before = len(backend.break_marks) if backend is not None else 0
        try:
            out = fn(*args, **kwargs)
        except Exception as exc:
            violation = _find_cause(exc, ConstraintViolationError)
            if violation is not None:
                raise _fixed_size_error(violation, self.marked) from exc
            cause = _find_cause(exc, AutoSPError)
            if cause is None:
                raise
            if isinstance(cause, NoSequenceDim) and self.marked_length in cause.fixed_sizes:
                raise _specialized_length_error(self.marked_length, self.marked) from exc
            if not cause.graph_breaks_may_explain:
                raise AutoSPError(str(cause)) from exc
            breaks_until = Counter(graph_break_counter())
            if cause.graph_has_loss and backend is not None:
                # a break that ended the graph with the loss (`float(loss)`) stands after the loss: only
                # those counted before that graph was traced (at the compile before it) can explain it
                marks = backend.break_marks[compiles_before:-1]
                breaks_until = Counter(marks[-1]) if marks else breaks_before
            breaks = list((breaks_until - breaks_before).keys())
            raise AutoSPError(f"{cause}{_describe_breaks(breaks)}") from exc
        self._check_rewritten(name, where)
        self._check_packed_positions(name, batch)
        return out

    def prepare_batch(self, batch: Any, step: str) -> None:
        """Check that the SP group agrees on the batch and that the sequence fits, and mark the
        sequence dims dynamic, so one compile serves every length.

        The sequence length is the size at ``seq_dim`` that most of the batch's tensors share
        (token ids and labels ``[B, S]``; ties go to integer tensors). Every dim (after the batch
        dim) of a batch tensor with that size is marked: ids and labels ``[B, S]``, masks
        ``[B, 1, S, S]``; other tensors (``[B, F]`` features) stay static.
        """
        seq_dim = self.config.seq_dim
        paths = [(keystr(path), t) for path, t in tree_flatten_with_path(batch)[0] if isinstance(t, torch.Tensor)]
        tensors = [t for _, t in paths]
        backend = self.backends.get(step)
        sp_graphs = backend.sp_graphs if backend is not None else 0
        counts = check_sp_batch_agreement(tensors, self.sp_group, self.sp_size, self.device, step, sp_graphs)
        self._check_same_graphs(step, counts)
        seq_len = _sequence_length([(p, t) for p, t in paths if t.dim() > seq_dim], seq_dim)
        if seq_len is None:
            return
        # The shift and the offset are known once the step has compiled; the pass checks the first batch itself.
        if backend is not None:
            check_sequence_fits(seq_len + backend.seq_offset, self.sp_size, backend.max_shift)
        else:
            check_sequence_fits(seq_len, self.sp_size)
        self.marked, self.marked_length = [], seq_len
        for path, t in paths:
            for d in range(1, t.dim()):
                if t.shape[d] == seq_len:
                    torch._dynamo.mark_dynamic(t, d)
                    self.marked.append(f"batch{path} dim {d}")

    def _check_same_graphs(self, step: str, counts: list[int]) -> None:
        """Every SP rank must compile the same graphs: a rank that recompiles alone is harmless
        until it reaches Dynamo's recompile limit, where it would run the step eagerly while its
        peers wait for it in an all-to-all. Warn when the counts part, stop before the limit."""
        if len(set(counts)) == 1:
            return
        what = (
            f"AutoSP: the ranks of an SP group compiled different numbers of graphs for `{step}` "
            f"(per SP rank: {counts}): a rank-dependent guard made some recompile where others did not. "
            "TORCH_LOGS=recompiles shows the guard; please report it with that output."
        )
        limit = torch._dynamo.config.recompile_limit
        if max(counts) >= limit - 1:
            raise AutoSPError(
                f"{what} One more recompile would reach Dynamo's recompile limit ({limit}), where a rank runs "
                "the step eagerly while its peers wait in an all-to-all, so AutoSP stops here. Raise "
                "torch._dynamo.config.recompile_limit, or keep the sequence lengths of the batches fixed."
            )
        if step not in self._diverged:
            self._diverged.add(step)
            log.warning(what)

    def _check_rewritten(self, step: str, where: str) -> None:
        if step in self._checked or step not in self.backends:
            return
        backend = self.backends[step]
        if backend.sdpa_rewritten == 0:
            raise AutoSPError(
                f"AutoSP found no attention or other sequence mixer to parallelize in `{where}`: "
                "sequence parallelism splits attention heads across the SP group, so the model must call "
                "`torch.nn.functional.scaled_dot_product_attention` (for Hugging Face models: "
                "attn_implementation='sdpa') or write attention over heads, `softmax(q @ k.transpose(-2, -1) * scale "
                "+ mask) @ v` with q, k, v laid out [B, H, S, D] (single-head [B, S, D] attention has no heads to "
                "split; see the supported-models page for the steps allowed between the two matmuls), or a sequence "
                "mixer registered with autosp.register_mixer (Hugging Face's Mamba-2 and gated delta rule scans are)."
            )
        layouts = sorted({g.layout for g in backend.pass_stats if g.attention})
        if layouts and self.sp_size > 1:
            how = "; ".join(
                f"ulysses={u} x ring={r}" + (" (heads split over the SP group)" if r == 1 else " (heads over contiguous ranks, a ring of key/value blocks over strided ranks)")
                for u, r in layouts
            )
            log.info("AutoSP: attention of %s at sp_size=%d runs as %s.", step, self.sp_size, how)
        tiled = sum(g.tiled_attention for g in backend.pass_stats)
        if tiled:
            log.info(
                "AutoSP: %d attention call(s) of %s read a mask built from positions: they run in AutoSP's tiled attention "
                "(%s tiles; autosp.ops.tiled_attention), the mask evaluated per tile.", tiled, step,
                f"{self.config.attention_tile}x{self.config.attention_tile}" if self.config.attention_tile else "automatic",
            )
        saved = None
        if any(g.fallbacks for g in backend.pass_stats):  # what the step saves for backward, to weigh them by
            saved = sum(sum(r.bytes_by_kind().values()) for r in backend.saved_activations if r.calls) or None
        for g in backend.pass_stats:
            self._report_fallbacks(step, g, saved)
            if g.dense_masks:
                log.warning(
                    "AutoSP keeps %d attention mask(s) of %s as dense S x S tensors on every SP rank (their memory grows "
                    "with the square of the sequence length): %s. Masks AutoSP evaluates per tile are built in the step "
                    "from positions (see the supported-models page).", len(g.dense_masks), step, "; ".join(g.dense_masks),
                )
        self._checked.add(step)

    def _report_fallbacks(self, step: str, stats: SPPassStats, saved: Optional[int]) -> None:
        """Ops run replicated: a warning with the bytes per rank of those that hold more than
        :data:`LOUD_FALLBACK` of the bytes the step saves for backward (all of them when that is
        unknown), an info line for the others."""
        if not stats.fallbacks:
            return
        loud = {i for i, b in enumerate(stats.fallback_bytes) if saved is None or b >= LOUD_FALLBACK * saved}
        quiet = [f for i, f in enumerate(stats.fallbacks) if i not in loud]
        if quiet:
            log.info("AutoSP ran %d small op(s) of %s replicated: %s", len(quiet), step, "; ".join(quiet))
        if loud:
            share = f" (the step saves {saved / 2**20:.2f} MiB per rank for backward)" if saved else ""
            log.warning(
                "AutoSP ran %d op(s) of %s replicated: each rank holds the whole sequence there%s:\n%s\nSequence "
                "parallelism does not split these: write them along another dim than the sequence (the supported-models "
                "page lists what is split), or pass strict=True to make any op run replicated an error.",
                len(loud), step, share, "\n".join(describe_fallbacks(stats, loud)),
            )

    def _check_packed_positions(self, step: str, batch: Any) -> None:
        """Warn once per step when the batch packs several documents in a row (position ids that
        restart) but no attention mask of the step reads them: every document then attends to the
        ones before it - on one device too. A Hugging Face model called with a cache (the default
        ``use_cache=True``) switches off its own packed-document detection this way."""
        if step in self._packed_checked or step not in self.backends:
            return
        self._packed_checked.add(step)
        restarting = [
            path for path, t in tree_flatten_with_path(batch)[0]
            if isinstance(t, torch.Tensor) and "position" in keystr(path) and t.dim() >= 1 and t.shape[-1] > 1
            and not t.is_floating_point() and bool((t.diff(dim=-1) != 1).any())
        ]
        if not restarting:
            return
        read = {name for g in self.backends[step].pass_stats for name in g.mask_inputs}
        if any("position" in name for name in read):
            return
        log.warning(
            "AutoSP: batch%s restarts within a row (packed documents), but no attention mask of %s reads it: every "
            "token attends to the documents before its own, on one device as under AutoSP. A Hugging Face model "
            "builds a document mask from position_ids only without a cache: call it with use_cache=False (or "
            "pass a mask that separates the documents).", keystr(restarting[0]), step,
        )


def _sequence_length(tensors: Sequence[tuple[str, torch.Tensor]], seq_dim: int) -> Optional[int]:
    """The size at ``seq_dim`` most of ``tensors`` share (ties: the size of integer tensors,
    token ids); ``None`` without tensors. An AutoSPError if that does not decide it."""
    if not tensors:
        return None
    votes = Counter(t.shape[seq_dim] for _, t in tensors)
    top = max(votes.values())
    sizes = [size for size, n in votes.items() if n == top]
    if len(sizes) > 1:
        integer = {t.shape[seq_dim] for _, t in tensors if not t.is_floating_point() and t.dtype != torch.bool}
        sizes = [size for size in sizes if size in integer] or sizes
    if len(sizes) > 1:
        found = ", ".join(f"batch{p}: {tuple(t.shape)}" for p, t in tensors)
        raise AutoSPError(
            f"AutoSP cannot tell the sequence length from the batch: its tensors disagree at seq_dim={seq_dim} "
            f"({found}). AutoSP takes the size most of them share, preferring integer (token id) tensors. Give "
            "the sequence tensors (token ids, labels, positions) the same length, keep other tensors' seq_dim "
            "size different from it, or set AutoSPStrategy(seq_dim=...)."
        )
    return sizes[0]


def _find_cause(exc: Optional[BaseException], kind: type) -> Optional[BaseException]:
    """The exception of type ``kind`` behind ``exc`` (Dynamo wraps backend errors), if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, kind):
            return exc
        exc = getattr(exc, "inner_exception", None) or exc.__cause__ or exc.__context__
    return None


def _fixed_size_error(violation: BaseException, marked: list[str]) -> AutoSPError:
    where = _specialized_at(str(violation))
    return AutoSPError(
        "AutoSP marks every dim of the batch whose size equals the sequence length as a sequence dim "
        f"({', '.join(marked)}), but the step uses one of them as a fixed size.\n"
        f"{str(violation).splitlines()[0]}\n"
        + (f"Dynamo fixed it here:\n{where}\n" if where else "")
        + "Either the code there turns the sequence length into a Python number (a loop "
        "`for i in range(T)` or a Python `if` over the length, e.g. a mask built row by row: "
        "build it with tensor ops such as `torch.arange(T)[:, None] - torch.arange(T)` instead), "
        "or that tensor has a feature dim that happens to equal the sequence length: give it a size "
        "other than the sequence length (or a sequence length other than its size), or move it out "
        "of the batch (a buffer of the module, for example)."
    )


def _specialized_length_error(length: int, marked: list[str]) -> AutoSPError:
    return AutoSPError(
        f"AutoSP marked the sequence dims of the batch ({', '.join(marked)}) dynamic, but Dynamo traced the "
        f"model with the sequence length fixed at {length}: some op of the step made it a constant. A common "
        "cause: a split along the sequence into chunks whose last piece has 1 element (Dynamo specialises sizes "
        "0 and 1), e.g. LitGPT's `model(x, lm_head_chunk_size=c)` when the length is a multiple of c plus one "
        "(513 tokens with c=128). "
        "Use a sequence length (or chunk size) that leaves no piece of 1 element; TORCH_LOGS=dynamic shows "
        "where the length was fixed."
    )


def _specialized_at(violation: str) -> str:
    """The innermost frame of the "User stack" in Dynamo's ConstraintViolationError: the code
    that made a marked size a constant."""
    lines = violation.split("User stack:", 1)[1].splitlines() if "User stack:" in violation else []
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    if not frames:
        return ""
    return "\n".join(line for line in lines[frames[-1] : frames[-1] + 2] if line.strip())


def _describe_breaks(breaks: Sequence[str]) -> str:
    if not breaks:
        return ""
    lines = "\n".join(f"  - {_break_summary(reason)}" for reason in breaks)
    if any("checkpoint" in reason for reason in breaks):
        lines += (
            "\n  (a break at torch.utils.checkpoint: a region under gradient checkpointing could not be traced whole. "
            "Turn gradient checkpointing off - model.gradient_checkpointing_disable() - and use "
            "AutoSPStrategy(sac='block'), which recomputes each transformer block whole as checkpointing every layer does.)"
        )
    data_dependent = any("depends on input Tensor data" in reason or reason.startswith("Dynamic shape operator") for reason in breaks)
    return (
        f"\nDynamo split this step into several graphs at these graph breaks:\n{lines}\n"
        "A graph break inside the model hides the sequence dim from the graphs after it. Remove "
        "print/logging calls from forward, replace data-dependent Python branches with torch.where, "
        "and keep such code in training_step after the loss (TORCH_LOGS=graph_breaks shows where they are)."
        + (
            "\nA value the model reads from the data into Python (`.item()`, `.tolist()`, `if tensor:`), or an op "
            "with a data-dependent output shape that Dynamo cannot trace, cannot be part of the graph AutoSP splits. "
            "Keep such values tensors (`torch.where(cond, a, b)` for a branch); ops such as `torch.where(mask)` and "
            "`nonzero` (a mixture-of-experts router gathering each expert's tokens) are traced with data-dependent sizes."
            if data_dependent else ""
        )
    )


def _break_summary(reason: str) -> str:
    """The first line of a Dynamo graph-break reason and its explanation (which names the op)."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    why = next((line.removeprefix("Explanation:").strip() for line in lines[1:] if line.startswith("Explanation:")), "")
    return (f"{lines[0]}: {why}" if why else lines[0] if lines else reason)[:300]
