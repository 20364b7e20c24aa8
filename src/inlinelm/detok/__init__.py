"""Incremental detokenization and stop strings; runs on the event loop, once per request per step."""

from inlinelm.detok.incremental import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    make_detokenizer,
)
from inlinelm.detok.stop_strings import StopMatch, StopMatcher, StopStrings

__all__ = [
    "FastIncrementalDetokenizer",
    "IncrementalDetokenizer",
    "SlowIncrementalDetokenizer",
    "StopMatch",
    "StopMatcher",
    "StopStrings",
    "make_detokenizer",
]
