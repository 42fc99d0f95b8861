"""The one error type of constrained decoding."""

from __future__ import annotations


class GrammarError(ValueError):
    """A grammar request that cannot be served: a bad spec, a grammar xgrammar cannot
    compile, or a token the grammar does not allow. It fails that request alone."""
