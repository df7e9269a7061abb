"""A request's tools and tool choice, checked. Plain data; errors are ToolError naming the request field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from pagedserve.structured_output.schema_check import check_json_schema


class ToolError(ValueError):
    """A tools / tool_choice problem; `param` is the request field it is about."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: Optional[str]
    parameters: dict
    """A JSON schema of type object (the function's arguments); {} when the tool declared none."""

    def openai(self) -> dict:
        """The tool as OpenAI's `tools` entry (what chat templates and the tool prompt show the model)."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


def check_tools(tools: list[dict]) -> list[Tool]:
    """OpenAI `tools` entries -> Tools; ToolError for a non-function tool, a missing or repeated name, or
    `parameters` that are not an object schema the engine can enforce."""
    out: list[Tool] = []
    for i, entry in enumerate(tools):
        param = f"tools[{i}]"
        if entry.get("type") != "function" or not isinstance(entry.get("function"), dict):
            raise ToolError(f"{param}: only tools of type 'function' with a 'function' object are supported", param)
        function = entry["function"]
        name = function.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise ToolError(f"{param}.function.name must be a non-empty string of at most 64 characters", param)
        if any(t.name == name for t in out):
            raise ToolError(f"{param}: function name {name!r} is given twice", param)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        where = f"{param}.function.parameters"
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ToolError(f"{where} must be a JSON schema of type object", where)
        try:
            check_json_schema(parameters)
        except ValueError as e:
            raise ToolError(f"{where}: {e}", where) from None
        # Arguments are always an object: a schema that leaves the type out (or is {}) says so explicitly.
        parameters = {"type": "object", "properties": {}, **parameters}
        out.append(Tool(name, function.get("description"), parameters))
    return out


@dataclass(frozen=True)
class ToolChoice:
    mode: str
    """none, auto or required (a named function is `required` with `name` set)."""
    name: Optional[str] = None


def check_tool_choice(choice: Union[str, dict, None], tools: list[Tool]) -> ToolChoice:
    """OpenAI's tool_choice (omitted: auto when there are tools, none otherwise), checked against the tools."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolError(f"tool_choice must be none, auto, required or a function, got {choice!r}", "tool_choice")
        if choice != "none" and not tools:
            raise ToolError(f"tool_choice {choice!r} needs tools", "tool_choice")
        return ToolChoice(choice)
    name = _named(choice)
    if name is None:
        raise ToolError('tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
    if not any(t.name == name for t in tools):
        raise ToolError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return ToolChoice("required", name)


def _named(choice: Any) -> Optional[str]:
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        return name if isinstance(name, str) else None
    return None
