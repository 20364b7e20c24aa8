"""Tool calling: the calls a model's text holds, and how a chat offers tools to a model.

- :mod:`~inlinelm.tools.calls`: :class:`ToolCall` and :class:`ParsedOutput`, plain data.
- :mod:`~inlinelm.tools.parsers`: text → tool calls, one parser per model family, in a
  registry (``hermes``: ``<tool_call>{json}</tool_call>``, SmolLM2/Hermes/Qwen2/Qwen2.5;
  ``llama3_json``: a bare ``{"name", "parameters"}`` object, Llama 3.1/3.2/3.3), and
  :mod:`~inlinelm.tools.family_parsers` (``qwen3_coder``, ``mistral``, ``pythonic``), all
  by name in :mod:`~inlinelm.tools.registry`.
- :mod:`~inlinelm.tools.forced`: ``tool_choice`` "required" or a named function as a JSON
  Schema the output must fit, and that output read back as calls.
- :mod:`~inlinelm.tools.template`: tools and tool turns for chat templates that know no tools.
"""

from inlinelm.tools.calls import FunctionTool, ParsedOutput, ToolCall, new_call_id
from inlinelm.tools.family_parsers import MistralParser, PythonicParser, Qwen3CoderParser
from inlinelm.tools.forced import (
    ForcedCallParser,
    ForcedHermesParser,
    forced_schema,
    forced_structure,
    hermes_forced_structure,
)
from inlinelm.tools.parsers import HermesParser, Llama3JsonParser, ToolParser
from inlinelm.tools.registry import PARSERS, get_parser, parser_for_template
from inlinelm.tools.template import (
    chat_template_text,
    prepare_messages,
    template_supports_tools,
    tools_prompt,
)

__all__ = [
    "PARSERS",
    "ForcedCallParser",
    "ForcedHermesParser",
    "FunctionTool",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedOutput",
    "PythonicParser",
    "Qwen3CoderParser",
    "ToolCall",
    "ToolParser",
    "chat_template_text",
    "forced_schema",
    "forced_structure",
    "get_parser",
    "hermes_forced_structure",
    "new_call_id",
    "parser_for_template",
    "prepare_messages",
    "template_supports_tools",
    "tools_prompt",
]
