"""The grammar that enforces a tool choice: xgrammar structural tags over the parser's call format.

- required: one or more calls (one with parallel_tool_calls false), nothing else;
- a named function: exactly one call of it;
- auto: free text, and any call the model starts (its trigger) is completed under the grammar;
- none: no constraint.
Each call's arguments are held to the tool's `parameters` schema.
"""

from __future__ import annotations

import json
from typing import Optional

from pagedserve.structured_output.params import StructuredOutputsParams
from pagedserve.tool_calling.formats import ToolCallFormat
from pagedserve.tool_calling.tools import Tool, ToolChoice


def tool_constraint(tools: list[Tool], choice: ToolChoice, fmt: ToolCallFormat,
                    parallel: bool = True) -> Optional[StructuredOutputsParams]:
    if choice.mode == "none":
        return None
    if choice.name is not None:
        tags = [fmt.tag(next(t for t in tools if t.name == choice.name))]
        parallel = False
    else:
        tags = [fmt.tag(t) for t in tools]
    if choice.mode == "auto":
        body = {"type": "triggered_tags", "triggers": [fmt.trigger], "tags": tags, "at_least_one": False,
                "stop_after_first": not parallel}
    else:
        body = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator, "at_least_one": True,
                "stop_after_first": not parallel}
    return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": body}))
