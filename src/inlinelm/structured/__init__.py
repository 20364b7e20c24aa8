"""Structured output: constrain what a request may generate (JSON Schema, any JSON object,
a regular expression, a list of choices, or a Lark/EBNF grammar).

:class:`StructuredOutput` is what a caller puts in ``SamplingParams(structured=...)``; the
engine compiles it once (off the event loop and the engine thread, cached by its text) and
masks each step's logits with it.
"""

from inlinelm.structured.spec import StructuredKind, StructuredOutput

__all__ = ["StructuredKind", "StructuredOutput"]
