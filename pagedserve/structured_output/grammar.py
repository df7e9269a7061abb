"""The grammar library's side (xgrammar): a constraint -> its grammar, checked (front end, no tokenizer) or
compiled for one tokenizer (engine core), and matchers over compiled grammars.

xgrammar over llguidance, measured on the default model's tokenizer (docs/benchmarks.md, "Structured
output", benchmarks/grammar_backends.py): computing a row's token mask took 0.010 ms a token on average with
xgrammar (its masks are precomputed at compile time) against 0.12 ms with llguidance (2.3 ms at worst), which at
16 constrained rows would cost llguidance ~2 ms of a ~28 ms decode step; xgrammar's cold compile (15 ms for a
nested schema) is paid once per schema, off the step loop. xgrammar ignores some JSON-schema keywords silently:
schema_check.py refuses those.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, Iterable

from pagedserve.structured_output.params import StructuredOutputsParams
from pagedserve.structured_output.schema_check import check_json_schema

if TYPE_CHECKING:
    import xgrammar

MAX_WHITESPACE = 8
"""Most whitespace characters between two JSON elements (xgrammar's max_whitespace_cnt): enough to pretty-print
three levels deep at indent 2, too few for a model to loop on spaces."""

CACHE_LIMIT_BYTES = 256 << 20
"""Memory xgrammar may keep for compiled grammars (its default is no limit)."""

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _message(e: Exception) -> str:
    """xgrammar's error text without its log prefix (time, C++ file and line)."""
    return _LOG_PREFIX.sub("", str(e).strip()).strip()


def is_ebnf(grammar: str) -> bool:
    """EBNF (GBNF: `rule ::= ...`) or else Lark (`rule: ...`), the two grammar languages xgrammar takes."""
    return "::=" in grammar


def choice_ebnf(choices: Iterable[str]) -> str:
    """A grammar whose only sentences are the choices, literally."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# xgrammar 0.2.9's JSON-string character classes, as its grammar prints them, and what they must be: bounded
# strings (min/maxLength) allow raw control characters, which JSON forbids, and every string allows UTF-8
# encoded surrogates, which are not UTF-8 (both measured: a random model wrote '"\\x1a..."', which json.loads
# refuses, and ED A0 80, which decodes to three U+FFFD and breaks maxLength).
_STRING_CLASSES = ((r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\ud800-\udfff]'),
                   (r'[^\0-\x1f\"\\\r\n]', r'[^\0-\x1f\"\\\ud800-\udfff]'))


def json_schema_ebnf(schema: Any, compact: bool = False, **options) -> str:
    """The schema as xgrammar's grammar (EBNF text), with its JSON-string character classes corrected.
    `compact`: no optional whitespace, separators exactly ", " and ": " (else at most MAX_WHITESPACE per gap)."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(json.dumps(schema), **_json_options(compact), **options))
    for wrong, right in _STRING_CLASSES:
        text = text.replace(wrong, right)
    return text


def _json_options(compact: bool) -> dict:
    if compact:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}


def validate(params: StructuredOutputsParams) -> None:
    """Check a constraint without compiling it for a tokenizer (fast; the front end does this so that a bad
    one is a ValueError before it reaches the engine)."""
    import xgrammar as xgr

    kind = params.kind
    try:
        if kind == "json":
            check_json_schema(params.schema)
            xgr.Grammar.from_ebnf(json_schema_ebnf(params.schema, params.disable_any_whitespace))
        elif kind == "regex":
            xgr.Grammar.from_regex(params.regex)
        elif kind == "grammar":
            (xgr.Grammar.from_ebnf if is_ebnf(params.grammar) else xgr.Grammar.from_lark)(params.grammar)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(params.structural_tag)
    except (RuntimeError, xgr.InvalidStructuralTagError) as e:
        raise ValueError(f"structured_outputs.{kind} cannot be compiled: {_message(e)}") from None


def _tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the vocabulary, with the special tokens (other than the stop tokens) left out.
    xgrammar 0.2.9 reads a special token as its literal text (<|im_start|>, <unk>), so a grammar that allows
    that text could emit the token, which the detokenizer then drops (measured: a Lark grammar for "<" word ">"
    produced <unk>, i.e. empty text). Empty strings are how xgrammar marks tokens it must never allow."""
    import xgrammar as xgr

    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)
    special = _special_ids(tokenizer) - set(base.stop_token_ids)
    if not special or base.vocab_type == xgr.VocabType.RAW or not hasattr(tokenizer, "get_vocab"):
        return base
    vocab = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in special:
            vocab[token_id] = token
    return xgr.TokenizerInfo(vocab, base.vocab_type, vocab_size=vocab_size, stop_token_ids=base.stop_token_ids,
                             add_prefix_space=base.add_prefix_space)


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return ids | {token_id for token_id, token in decoder.items() if getattr(token, "special", False)}


class GrammarCompiler:
    """Compiles constraints for one tokenizer (thread-safe; xgrammar caches compiled grammars itself)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], max_threads: int = 2) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = _tokenizer_info(tokenizer, vocab_size, sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=True,
                                             cache_limit_bytes=CACHE_LIMIT_BYTES)

    def compile(self, params: StructuredOutputsParams) -> "xgrammar.CompiledGrammar":
        """ValueError naming the problem when the constraint cannot be compiled."""
        import xgrammar as xgr

        compiler, kind = self._compiler, params.kind
        try:
            if kind == "json":
                ebnf = json_schema_ebnf(params.schema, params.disable_any_whitespace)
                return compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
            if kind == "json_object":
                ebnf = json_schema_ebnf({"type": "object"}, params.disable_any_whitespace, strict_mode=False)
                return compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_ebnf(params.choice))
            if kind == "structural_tag":
                return compiler.compile_structural_tag(params.structural_tag)
            if is_ebnf(params.grammar):
                return compiler.compile_grammar(params.grammar)
            return compiler.compile_grammar(xgr.Grammar.from_lark(params.grammar))
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {_message(e)}") from None


def new_matcher(compiled: "xgrammar.CompiledGrammar") -> "xgrammar.GrammarMatcher":
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)
