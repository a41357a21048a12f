"""Errors raised by lightning-autosp."""

from __future__ import annotations


class AutoSPError(RuntimeError):
    """A model or input that the sequence-parallel rewrite cannot handle correctly.

    The message says which op and shapes were found, and what to change. AutoSP raises this
    rather than run a partially transformed model.
    """


class NoSequenceDim(AutoSPError):
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
