"""Errors raised by lightning-autosp."""

from __future__ import annotations


class AutoSPError(RuntimeError):
    """A model or input that the sequence-parallel rewrite cannot handle correctly.

    The message says which op and shapes were found, and what to change. AutoSP raises this
    rather than run a partially transformed model. ``graph_breaks_may_explain``: a graph break
    before the graph that raised it could be its cause (the step runner then lists them).
    """

    graph_breaks_may_explain = False
    graph_has_loss = False


class GraphSplitError(AutoSPError):
    """A refusal that a graph break earlier in the step can cause: the graph AutoSP was given
    does not see the sequence as the batch has it (no symbolic sequence length, a length fixed
    or unrelated to the batch's)."""

    graph_breaks_may_explain = True
    #: the graph that raised it computes a loss: the graph break that ended it (if any) came after
    #: the loss, and cannot be the cause
    graph_has_loss = False


class NoSequenceDim(GraphSplitError):
    """A graph with attention but no input with a symbolic sequence length. ``fixed_sizes``: the
    sizes at ``seq_dim`` of its inputs that were marked dynamic there but traced as constants
    (Dynamo specialised the length)."""

    def __init__(self, message: str, fixed_sizes: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.fixed_sizes = fixed_sizes


def user_source(node) -> str:
    """Where the user wrote the op of FX node ``node``: the last frame of the stack trace
    Dynamo recorded (file, line, code)."""
    trace = (node.meta.get("stack_trace") or "").rstrip().splitlines()
    frames = [i for i, line in enumerate(trace) if line.lstrip().startswith('File "')]
    if not frames:
        return "(no source line recorded)"
    return "\n".join(line for line in trace[frames[-1] :] if line.strip().strip("^~") != "")
