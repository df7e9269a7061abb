"""Tools and tool-call history into the chat template's messages.

A template that knows tools (it uses a `tools` variable: Qwen2.5, Llama 3.x, Hermes) gets them through it, and
the history in Hugging Face's message format (assistant `tool_calls` with arguments as objects, `tool` messages
with `tool_call_id`). For a template that does not (the default model's), pagedserve adds TOOL_PROMPT to the
system message, writes past calls into the assistant text in the parser's format, and gives tool results as
user messages in `<tool_response>` tags.
"""

from __future__ import annotations

import json
from typing import Optional

from pagedserve.tool_calling.formats import ToolCallFormat
from pagedserve.tool_calling.tools import Tool

TOOL_PROMPT = """You may call functions to help with the user's request. The functions, as JSON schemas:
{tools}
To call a function, reply with exactly this for each call, and nothing after it:
{example}
When you do not need a function, answer normally."""


def template_knows_tools(chat_template: Optional[str]) -> bool:
    return bool(chat_template) and "tools" in chat_template


def tool_prompt(tools: list[Tool], fmt: ToolCallFormat) -> str:
    example = fmt.render_call("<function name>", '{"<argument>": "<value>"}')
    return TOOL_PROMPT.format(tools="\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools),
                              example=example)


def render_messages(messages: list[dict], tools: list[Tool], fmt: ToolCallFormat,
                    knows_tools: bool) -> tuple[list[dict], dict]:
    """(messages for apply_chat_template, its extra keyword arguments). `messages` are OpenAI's dicts: role,
    content (a string or None), tool_calls (assistant), tool_call_id (tool)."""
    if knows_tools:
        return [_hf_message(m) for m in messages], ({"tools": [t.openai() for t in tools]} if tools else {})
    out = [_plain_message(m, fmt) for m in messages]
    if tools:
        prompt = tool_prompt(tools, fmt)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _hf_message(m: dict) -> dict:
    out = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": _arguments_object(c["function"].get("arguments"))}}
                             for c in m["tool_calls"]]
    if m["role"] == "tool" and m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _plain_message(m: dict, fmt: ToolCallFormat) -> dict:
    content = m.get("content") or ""
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    if m.get("tool_calls"):
        calls = fmt.separator.join(fmt.render_call(c["function"]["name"], c["function"].get("arguments") or "{}")
                                   for c in m["tool_calls"])
        content = f"{content}\n{calls}" if content else calls
    return {"role": m["role"], "content": content}


def _arguments_object(arguments):
    try:
        return json.loads(arguments) if isinstance(arguments, str) else (arguments or {})
    except json.JSONDecodeError:
        return arguments
