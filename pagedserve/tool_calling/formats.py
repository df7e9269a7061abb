"""How tool calls look in the model's text, one class per `--tool-call-parser` (vLLM's names): the tag a call
is written in (for the grammar), how a past call is written back into a prompt, and parsing calls out.

- hermes (Qwen2.5, Hermes, and pagedserve's own tool prompt): `<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>`, several separated by a newline.
- llama3_json (Llama 3.1+): `{"name": ..., "parameters": {...}}`, several separated by "; ", optionally after
  `<|python_tag|>`; "arguments" is accepted for "parameters" when parsing.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

from pagedserve.structured_output.grammar import json_schema_ebnf
from pagedserve.tool_calling.tools import Tool


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """The arguments object as JSON text (OpenAI's `function.arguments`)."""

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Parsed:
    content: str
    """Text outside the calls (for a partial text: only what can no longer turn into a call)."""
    calls: list[ToolCall]
    """Calls complete so far, in order."""


class ToolCallFormat(ABC):
    name: str
    trigger: str
    """Text that starts every call."""
    separator: str
    arguments_key: str

    def tag(self, tool: Tool) -> dict:
        """xgrammar's structural-tag format of a call of `tool` (its arguments checked against its schema)."""
        return {"type": "tag", "begin": self._begin(tool.name),
                "content": {"type": "grammar", "grammar": json_schema_ebnf(tool.parameters), "syntax": "ebnf"},
                "end": self._end}

    def _begin(self, name: str) -> str:
        return f'{self._open}{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.arguments_key}": '

    _open = ""
    _end = "}"

    def render_call(self, name: str, arguments: str) -> str:
        """A past call as the model would have written it (for prompts with tool-call history)."""
        try:
            value = json.loads(arguments)
        except (TypeError, json.JSONDecodeError):
            value = arguments
        return self._begin(name) + json.dumps(value, ensure_ascii=False) + self._end

    @abstractmethod
    def parse(self, text: str, final: bool = True, ids: Optional[list[str]] = None) -> Parsed:
        """The content and the calls of a text (`final`: the whole output; else a prefix, whose content stops
        where a call may still begin). `ids` are the ids to give the first calls (kept while streaming)."""

    def _call(self, obj: dict, calls: list[ToolCall], ids: Optional[list[str]]) -> bool:
        arguments = obj.get("arguments", obj.get("parameters"))
        if not isinstance(obj.get("name"), str) or not isinstance(arguments, dict):
            return False
        call_id = ids[len(calls)] if ids is not None and len(calls) < len(ids) else new_call_id()
        calls.append(ToolCall(call_id, obj["name"], json.dumps(arguments, ensure_ascii=False)))
        return True


def _held_back(text: str, trigger: str) -> int:
    """How many trailing characters of `text` could be the start of `trigger` (kept back while streaming)."""
    for n in range(min(len(trigger) - 1, len(text)), 0, -1):
        if trigger.startswith(text[-n:]):
            return n
    return 0


def _certain(text: str, trigger: str) -> str:
    """The part of a partial text that is content whatever comes next: without a trailing piece that may start
    a call, nor trailing whitespace (stripped from content that precedes a call)."""
    return text[:len(text) - _held_back(text, trigger)].rstrip()


class HermesFormat(ToolCallFormat):
    name, trigger, separator, arguments_key = "hermes", "<tool_call>", "\n", "arguments"
    _open, _end = "<tool_call>\n", "}\n</tool_call>"
    _close = "</tool_call>"

    def parse(self, text: str, final: bool = True, ids: Optional[list[str]] = None) -> Parsed:
        start = text.find(self.trigger)
        if start < 0:
            return Parsed(text if final else _certain(text, self.trigger), [])
        calls: list[ToolCall] = []
        position = start
        while position >= 0:
            end = text.find(self._close, position)
            body = text[position + len(self.trigger):end if end >= 0 else len(text)]
            if end < 0 and not final:
                break
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict) or not self._call(obj, calls, ids):
                if final and not calls:  # not a call after all: the text stays content
                    return Parsed(text, [])
                break  # a broken call after complete ones (cut by max_tokens): the complete ones stand
            position = text.find(self.trigger, end + len(self._close)) if end >= 0 else -1
        return Parsed(text[:start].rstrip(), calls)


class Llama3JsonFormat(ToolCallFormat):
    name, trigger, separator, arguments_key = "llama3_json", '{"name": ', "; ", "parameters"
    _python_tag = "<|python_tag|>"

    def parse(self, text: str, final: bool = True, ids: Optional[list[str]] = None) -> Parsed:
        body = text.replace(self._python_tag, "")
        start = body.find(self.trigger)
        if start < 0:
            return Parsed(body if final else _certain(_certain(body, self.trigger), self._python_tag), [])
        decoder, calls, position = json.JSONDecoder(), [], start
        while position < len(body):
            try:
                obj, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                if final and not calls:
                    return Parsed(body, [])
                break
            if not isinstance(obj, dict) or not self._call(obj, calls, ids):
                if final and not calls:
                    return Parsed(body, [])
                break
            while position < len(body) and body[position] in " ;\n":
                position += 1
        return Parsed(body[:start].rstrip(), calls)


FORMATS = {f.name: f for f in (HermesFormat(), Llama3JsonFormat())}
"""--tool-call-parser choices."""
