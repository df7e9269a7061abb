"""StructuredOutputsParams: vLLM's request object for constrained decoding. Plain data, no torch or xgrammar
import (it travels with SamplingParams to the engine-core process)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (a list of
    strings), `grammar` (EBNF in xgrammar's GBNF dialect, `rule ::= ...`, or Lark, `rule: ...`), `json_object=True` (any JSON object) or
    `structural_tag` (xgrammar's structural tag, as JSON text: free text and tagged, schema-checked parts; tool
    calling builds these).

    `disable_any_whitespace` (vLLM's name): JSON without optional whitespace (the separators exactly ", " and
    ": "). Otherwise
    JSON may have whitespace between elements, at most `MAX_WHITESPACE` characters per gap, so a model cannot
    loop on spaces until max_tokens. Invalid values raise ValueError naming the field."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[str] = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                parsed = self.json
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(parsed).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty grammar text")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs.json_object must be true when given")
        if self.structural_tag is not None:
            try:
                if not isinstance(json.loads(self.structural_tag), dict):
                    raise ValueError
            except (TypeError, ValueError):
                raise ValueError("structured_outputs.structural_tag must be a JSON object as text") from None
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def schema(self) -> Any:
        """The JSON schema as parsed JSON (kind "json" only)."""
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    def key(self) -> tuple:
        """What identifies the compiled grammar (compilations are cached by it)."""
        kind = self.kind
        if kind == "json":
            value = json.dumps(self.schema, sort_keys=True, separators=(",", ":"))
        else:
            value = getattr(self, kind)
        return kind, value, self.disable_any_whitespace
