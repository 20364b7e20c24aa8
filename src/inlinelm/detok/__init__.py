"""Incremental detokenization and stop strings; runs on the event loop, once per request per step."""

from inlinelm.detok.incremental import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    make_detokenizer,
)
from inlinelm.detok.stop_strings import StopMatch, StopStrings

__all__ = [
    "FastIncrementalDetokenizer",
    "IncrementalDetokenizer",
    "SlowIncrementalDetokenizer",
    "StopMatch",
    "StopStrings",
    "make_detokenizer",
]
