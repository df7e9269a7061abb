"""One choice's tool calls while it streams: each delta of text in, the content and the calls that became
certain out. The calls are parsed from the whole text so far every time (texts are short), with their ids
kept, so the streamed content and calls add up to what the non-streaming response holds."""

from __future__ import annotations

from pagedserve.tool_calling.formats import ToolCall, ToolCallFormat


class ToolCallStream:
    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.text = ""
        self.calls: list[ToolCall] = []
        self._sent_content = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """(content not sent yet, calls completed since the last feed)."""
        self.text += delta
        parsed = self.fmt.parse(self.text, final=finished, ids=[c.id for c in self.calls])
        content = parsed.content[self._sent_content:]
        self._sent_content = max(self._sent_content, len(parsed.content))
        new = parsed.calls[len(self.calls):]
        self.calls = parsed.calls if len(parsed.calls) >= len(self.calls) else self.calls
        return content, new
