import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedserve.engine.detokenizer import IncrementalDetokenizer, decode_all
from pagedserve.sampling_params import SamplingParams as SP

TEXTS = [
    "Hello world, this is a test of the detokenizer.",
    "Héllo wörld — naïve café, déjà vu.",
    "日本語のテキストです。中文文本也在这里。",
    "emoji 😀🎉 fun 👍🏽 and flags 🇫🇷 too",
    "Ελληνικά κείμενο και русский текст",
    "the quick brown fox jumps over the lazy dog",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>"]


def _train(pre_tokenizer, decoder, alphabet, vocab_size) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoder
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=alphabet)
    tok.train_from_iterator(TEXTS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[0], additional_special_tokens=SPECIALS[1:])


@pytest.fixture(scope="module")
def byte_tok():
    """GPT-2 style byte-level BPE: multi-byte characters are split over tokens."""
    return _train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(),
                  pre_tokenizers.ByteLevel.alphabet(), vocab_size=330)  # few merges: characters get split


@pytest.fixture(scope="module")
def sp_tok():
    """SentencePiece-style (Metaspace): the decoder drops the leading space of a string."""
    return _train(pre_tokenizers.Metaspace(), decoders.Metaspace(), [], vocab_size=400)


@pytest.fixture(scope="module")
def gguf_tok():
    try:
        from pagedserve.loader.gguf import GGUFCheckpoint
        from pagedserve.loader.model_loader import default_model_path

        return GGUFCheckpoint(default_model_path()).tokenizer()
    except Exception as e:  # noqa: BLE001 - optional: the default model or its loader may be missing
        pytest.skip(f"default model tokenizer unavailable: {e}")


def run(tok, prompt_ids, output_ids, step=1, finished=True, **params):
    """Feed output_ids `step` at a time; return (detokenizer, streamed deltas, stop string)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, SP(**params))
    deltas, stop = [], None
    for i in range(0, len(output_ids), step):
        stop = detok.update(output_ids[i:i + step])
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            return detok, deltas, stop
    if finished:
        deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return detok, deltas, stop


def random_sequences(tok, count, length, seed):
    rng = random.Random(seed)
    ids = list(range(len(tok)))
    return [[rng.choice(ids) for _ in range(rng.randint(1, length))] for _ in range(count)]


@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences_match_full_decode(byte_tok, skip):
    prompt = byte_tok.encode("Hello world")
    for ids in random_sequences(byte_tok, 300, 25, seed=int(skip)):
        detok, deltas, _ = run(byte_tok, prompt, ids, skip_special_tokens=skip)
        expected = byte_tok.decode(ids, skip_special_tokens=skip)
        assert detok.output_text == expected
        assert decode_all(byte_tok, ids, skip) == expected
        assert "".join(deltas) == expected


def test_random_sequences_several_tokens_per_update(byte_tok):
    for ids in random_sequences(byte_tok, 100, 30, seed=7):
        detok, deltas, _ = run(byte_tok, [], ids, step=3)
        assert detok.output_text == "".join(deltas) == byte_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_no_broken_characters_mid_stream(byte_tok, text):
    ids = byte_tok.encode(text)
    assert any("\ufffd" in byte_tok.decode([i]) for i in ids) or text.isascii()  # really split
    detok, deltas, _ = run(byte_tok, byte_tok.encode("Say:"), ids, finished=False)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.output_text


def test_incomplete_character_held_until_complete(byte_tok):
    ids = byte_tok.encode("ab 😀")
    cut = next(i for i in range(1, len(ids) + 1) if byte_tok.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(byte_tok, [], SP())
    detok.update(ids[:cut])
    assert "\ufffd" not in detok.get_next_output_text(finished=False, delta=True)
    # A full decode of the unfinished sequence shows the replacement character; so does output_text.
    assert detok.output_text == byte_tok.decode(ids[:cut])
    detok.update(ids[cut:])
    assert detok.get_next_output_text(finished=False, delta=False) == "ab 😀" == detok.output_text


def test_first_token_keeps_leading_space(sp_tok):
    prompt = sp_tok.encode("Hello")
    out = sp_tok.encode("Hello world")[len(prompt):]
    assert sp_tok.decode(out) == "world"  # the decoder drops a string's leading space
    detok, deltas, _ = run(sp_tok, prompt, out)
    assert next(d for d in deltas if d).startswith(" ")
    assert detok.output_text == " world" == decode_all(sp_tok, out, True, prompt_token_ids=prompt)


def test_metaspace_random_sequences_match_decode_after_prompt(sp_tok):
    prompt = sp_tok.encode("the quick")
    for ids in random_sequences(sp_tok, 200, 20, seed=3):
        detok, deltas, _ = run(sp_tok, prompt, ids)
        assert detok.output_text == "".join(deltas) == decode_all(sp_tok, ids, True, prompt_token_ids=prompt)


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(byte_tok, skip):
    ids = byte_tok.encode("Hello") + [byte_tok.convert_tokens_to_ids("<|im_start|>")] + byte_tok.encode(" world")
    detok, deltas, _ = run(byte_tok, [], ids, skip_special_tokens=skip)
    expected = "Hello world" if skip else "Hello<|im_start|> world"
    assert detok.output_text == "".join(deltas) == expected


# -- stop strings ------------------------------------------------------------------------------------

SENTENCE = "Hello world, this is a test of the detokenizer."


def token_spans(tok, ids):
    """Text of each prefix of ids."""
    return [tok.decode(ids[:i + 1]) for i in range(len(ids))]


def test_stop_string_spanning_tokens(byte_tok):
    ids = byte_tok.encode(SENTENCE)
    stop = "o w"
    prefixes = token_spans(byte_tok, ids)
    assert not any(stop in byte_tok.decode([i]) for i in ids)  # no single token holds all of it
    detok, deltas, hit = run(byte_tok, [], ids, stop=["zzz", stop])
    assert hit == stop
    assert detok.output_text == "Hell" == "".join(deltas)
    assert len(detok.token_ids) == next(i + 1 for i, p in enumerate(prefixes) if stop in p)
    # Later tokens change nothing.
    assert detok.update(byte_tok.encode(" more")) is None and detok.output_text == "Hell"


def test_stop_string_kept_with_include(byte_tok):
    ids = byte_tok.encode(SENTENCE)
    detok, deltas, hit = run(byte_tok, [], ids, stop="is a", include_stop_str_in_output=True)
    assert hit == "is a"
    assert detok.output_text == "Hello world, this is a" == "".join(deltas)


def test_earliest_stop_string_wins_within_one_update(byte_tok):
    ids = byte_tok.encode(SENTENCE)
    detok = IncrementalDetokenizer(byte_tok, [], SP(stop=["test", "world"]))
    assert detok.update(ids) == "world"
    assert detok.output_text == "Hello "


def test_stop_strings_wait_for_min_tokens(byte_tok):
    ids = byte_tok.encode("ab ab ab ab")
    n_first = next(i + 1 for i, p in enumerate(token_spans(byte_tok, ids)) if "ab" in p)
    detok, _, hit = run(byte_tok, [], ids, stop="ab", min_tokens=len(ids) - 1, max_tokens=50)
    assert hit == "ab" and len(detok.token_ids) == len(ids)
    assert n_first < len(ids)
    assert detok.output_text == "ab ab ab "


def test_streaming_holds_back_possible_stop_prefix(byte_tok):
    ids = byte_tok.encode(SENTENCE)
    stop = "xyz!!"  # never matches: everything is streamed, the last 4 chars only at the end
    detok = IncrementalDetokenizer(byte_tok, [], SP(stop=stop))
    streamed = ""
    for i in ids:
        assert detok.update([i]) is None
        streamed += detok.get_next_output_text(finished=False, delta=True)
        assert streamed == detok.output_text[:max(0, len(detok.output_text) - 4)]
        assert detok.get_next_output_text(finished=False, delta=False) == streamed
    streamed += detok.get_next_output_text(finished=True, delta=True)
    assert streamed == SENTENCE == detok.get_next_output_text(finished=True, delta=False)


def test_streaming_never_emits_part_of_removed_stop(byte_tok):
    ids = byte_tok.encode(SENTENCE)
    for stop in ("test of", "s is", "er.", "H", "detok"):
        detok, deltas, hit = run(byte_tok, [], ids, stop=stop)
        assert hit == stop
        expected = SENTENCE[:SENTENCE.index(stop)]
        for k in range(len(deltas)):
            assert expected.startswith("".join(deltas[:k + 1]))
        assert "".join(deltas) == expected == detok.output_text


def test_no_holdback_when_stop_kept(byte_tok):
    ids = byte_tok.encode(SENTENCE)
    detok = IncrementalDetokenizer(byte_tok, [], SP(stop="zzzzz", include_stop_str_in_output=True))
    detok.update(ids)
    assert detok.get_next_output_text(finished=False, delta=True) == SENTENCE


def test_stop_string_in_multibyte_text(byte_tok):
    text = "日本語のテキストです。中文文本也在这里。"
    detok, deltas, hit = run(byte_tok, [], byte_tok.encode(text), stop="。中")
    assert hit == "。中" and detok.output_text == "日本語のテキストです" == "".join(deltas)


# -- the default model's tokenizer (skipped when missing) --------------------------------------------

def test_gguf_tokenizer_incremental_equals_decode(gguf_tok):
    prompt = gguf_tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    texts = TEXTS + ["<|im_end|> after special", "  double  spaces\n\nnewlines\ttabs"]
    for text in texts:
        ids = gguf_tok.encode(text)
        for skip in (True, False):
            detok, deltas, _ = run(gguf_tok, prompt, ids, finished=False, skip_special_tokens=skip)
            expected = gguf_tok.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) == detok.output_text == expected
            assert all("\ufffd" not in d for d in deltas)
    for ids in random_sequences(gguf_tok, 100, 20, seed=11):
        detok, deltas, _ = run(gguf_tok, prompt, ids)
        assert detok.output_text == "".join(deltas) == gguf_tok.decode(ids, skip_special_tokens=True)
