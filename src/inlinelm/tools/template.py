"""Chat messages and tools as a model's chat template takes them.

A template that knows tools (it mentions ``tools``: Qwen2.5, Hermes, Llama 3.1, ...) gets
them as ``apply_chat_template(..., tools=...)``, and earlier calls with their arguments as
objects (what these templates ``tojson``). A template that does not (SmolLM2's) is taught
the ``hermes`` format in the system message instead, and earlier turns are written in it:
an assistant's calls as ``<tool_call>`` blocks, a tool's result as a user turn in
``<tool_response>`` tags. Either way the answer is read with the matching parser.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from inlinelm.tools.calls import FunctionTool

_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def chat_template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template source (all named templates joined; "" when none)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def template_supports_tools(template: str) -> bool:
    """Whether a chat template renders ``tools`` itself."""
    return "tools" in template


def tools_prompt(tools: Sequence[FunctionTool]) -> str:
    """The system-message text that teaches a model without tool support the ``hermes``
    format (Qwen2.5's wording)."""
    lines = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
    return _TOOLS_PROMPT.format(tools=lines)


def prepare_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[FunctionTool], *, native: bool
) -> list[dict[str, Any]]:
    """``messages`` ready for a template that renders tools (``native``) or not (see the
    module docstring). ``tools`` empty: no tools prompt, earlier turns still converted."""
    if native:
        return [_with_argument_objects(m) for m in messages]
    prepared = [_as_plain_turn(m) for m in messages]
    if not tools:
        return prepared
    prompt = tools_prompt(tools)
    if prepared and prepared[0]["role"] in ("system", "developer"):
        first = prepared[0]
        return [{**first, "content": f"{first['content']}\n\n{prompt}"}, *prepared[1:]]
    return [{"role": "system", "content": prompt}, *prepared]


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call["function"])
        function["arguments"] = _decoded(function["arguments"])
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}


def _as_plain_turn(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [
        "<tool_call>\n"
        + json.dumps(
            {"name": c["function"]["name"], "arguments": _decoded(c["function"]["arguments"])},
            ensure_ascii=False,
        )
        + "\n</tool_call>"
        for c in calls
    ]
    text = "\n".join([message["content"], *blocks] if message["content"] else blocks)
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": text}


def _decoded(arguments: Any) -> Any:
    """An arguments JSON string as its object; anything else as it is."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
