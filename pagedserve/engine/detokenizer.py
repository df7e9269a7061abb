"""Token ids to text, incrementally, with stop strings and a streaming hold-back.

Method (the prefix/read-offset scheme): keep a short window of token ids whose start is already-emitted
context. Decoding the window and cutting off the decoded context gives the new text; a decode that ends in
U+FFFD means a token stopped mid UTF-8 sequence, so nothing is emitted until a later token completes it.
Decoding relative to context (at first: the prompt's last tokens) keeps the first output token's leading
space with tokenizers whose decoder strips it at the start of a string (SentencePiece/Metaspace).
Each step costs two decodes of a few tokens, whatever the length of the output.

Cheap path: a request with no stop strings that is not streamed need not be detokenized step by step;
call :func:`decode_all` once when it finishes.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pagedserve.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded ahead of the first output token, as context."""
_REPLACEMENT = "\ufffd"


def decode_all(tokenizer, token_ids: Sequence[int], skip_special_tokens: bool = True,
               prompt_token_ids: Optional[Sequence[int]] = None) -> str:
    """The text of ``token_ids`` in one decode. With ``prompt_token_ids`` it is decoded after the prompt's
    last tokens, exactly as :class:`IncrementalDetokenizer` does (this only matters for tokenizers whose
    decoder drops a leading space, e.g. SentencePiece; for byte-level BPE both are ``tokenizer.decode``)."""
    ids = list(token_ids)
    context = _context(tokenizer, prompt_token_ids or [], skip_special_tokens)
    if not context:
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    prefix = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
    text = tokenizer.decode(context + ids, skip_special_tokens=skip_special_tokens)
    return text[len(prefix):]


def _context(tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool) -> list[int]:
    """The prompt's last tokens, or none if they end inside a character (they would change once the first
    output token completes it)."""
    context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
    if context and tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT):
        return []
    return context


class IncrementalDetokenizer:
    """Per-request text state. ``update`` takes each step's new token ids."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.token_ids: list[int] = []
        self.stop_string: Optional[str] = None
        # Streaming holds back text that might still turn out to be the start of a (removed) stop string.
        self._holdback = max(map(len, self.stop)) - 1 if self.stop and not self.include_stop_str_in_output else 0
        self._text = ""  # text of the read tokens (truncated at a stop string)
        self._window = _context(tokenizer, prompt_token_ids, self.skip_special_tokens)
        self._read = len(self._window)  # window[:read] is context already turned into text
        self._prefix_text = self._decode(self._window)  # decode(window[:read])
        self._sent = 0  # chars handed out by get_next_output_text(delta=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def update(self, new_token_ids: list[int]) -> Optional[str]:
        """Append tokens; return the stop string that matched (the request must then finish), else None."""
        self.token_ids.extend(new_token_ids)
        if self.stop_string is not None:
            return None
        text_before = len(self._text)
        for token_id in new_token_ids:
            self._window.append(token_id)
            text = self._decode(self._window)
            if len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT):
                self._text += text[len(self._prefix_text):]
                # The read tokens become the context of the next ones.
                self._window = self._window[self._read:]
                self._read = len(self._window)
                self._prefix_text = self._decode(self._window)
        if self.stop and len(self.token_ids) > self.min_tokens and len(self._text) > text_before:
            return self._check_stop(text_before)
        return None

    def _check_stop(self, text_before: int) -> Optional[str]:
        """Find the earliest stop string that ends in the new text; truncate the text there."""
        best: Optional[tuple[int, str]] = None
        for stop in self.stop:
            at = self._text.find(stop, max(0, text_before - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self._text = self._text[:at + len(stop)] if self.include_stop_str_in_output else self._text[:at]
        self.stop_string = stop
        return stop

    def _pending_text(self) -> str:
        """Text of tokens not read yet (they end inside a character): replacement characters, as a full
        decode would give them."""
        if self.stop_string is not None or self._read == len(self._window):
            return ""
        return self._decode(self._window)[len(self._prefix_text):]

    @property
    def output_text(self) -> str:
        """All the text so far; equals ``decode_all(tokenizer, token_ids, skip_special_tokens, prompt)``
        (stop string removed unless include_stop_str_in_output)."""
        return self._text + self._pending_text()

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to stream: the part that is new since the last delta call when ``delta``, else all of it.
        Until ``finished`` it leaves out the last len(longest stop string)-1 characters (they could still
        become a stop string that is removed; nothing is held back when stop strings are kept in the
        output) and any incomplete character."""
        if finished or self.stop_string is not None:
            text = self.output_text
            length = len(text)
        else:
            text = self._text
            length = max(0, len(text) - self._holdback)
        if not delta:
            return text[:length]
        if length <= self._sent:
            return ""
        chunk, self._sent = text[self._sent:length], length
        return chunk
