"""Errors raised by lightning-autosp."""

from __future__ import annotations


class AutoSPError(RuntimeError):
    """A model or input that the sequence-parallel rewrite cannot handle correctly.

    The message says which op and shapes were found, and what to change. AutoSP raises this
    rather than run a partially transformed model.
    """
