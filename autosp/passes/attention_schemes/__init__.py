"""How the SP pass parallelises each attention it finds (:mod:`.base`: the interface and the
registry); :mod:`.ulysses`, DeepSpeed-Ulysses, is the default and, today, the only scheme."""

from autosp.passes.attention_schemes.base import DEFAULT_SCHEME, AttentionScheme, get_scheme, register_scheme, schemes
from autosp.passes.attention_schemes.ulysses import Ulysses

__all__ = ["AttentionScheme", "Ulysses", "get_scheme", "register_scheme", "schemes", "DEFAULT_SCHEME"]
