"""Incremental detokenisation: the deltas add up to the full decode, never emit half a character,
and honour stop strings that span tokens without leaking text after them."""

from __future__ import annotations

import json
import random

import pytest

from orchestrator.core.detokenizer import (
    REPLACEMENT,
    IncrementalDetokenizer,
    TextTokenizer,
    eos_token_ids,
)
from tests.orchestrator.bpe import EOS, SENTENCES, text_tokenizer, train_bpe, train_metaspace


def _run(
    detok: IncrementalDetokenizer, ids: list[int], *, full: str | None = None
) -> tuple[list[str], int | None]:
    """Feeds ids one at a time; returns the deltas and the index of the token that stopped."""
    deltas: list[str] = []
    for i, token in enumerate(ids):
        deltas.append(detok.add(token))
        if full is not None:
            # What was emitted is final: a prefix of the whole text, so never a U+FFFD that a
            # later byte would have completed.
            assert full.startswith("".join(deltas)), (ids, deltas)
        if detok.stop_string is not None:
            return deltas, i
    deltas.append(detok.finish())
    return deltas, None


def test_random_ids_concatenate_to_the_full_decode() -> None:
    tok = text_tokenizer()
    vocab = train_bpe().get_vocab_size()
    rng = random.Random(0)
    saw_split_char = 0
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        full = tok.decode(ids)
        deltas, stopped = _run(IncrementalDetokenizer(tok), ids, full=full)
        assert stopped is None
        assert "".join(deltas) == full
        if REPLACEMENT not in full:
            assert not any(REPLACEMENT in d for d in deltas)
        saw_split_char += any(REPLACEMENT in tok.decode([i]) for i in ids)
    assert saw_split_char > 100  # the sequences really do split characters across tokens


def test_text_with_multibyte_characters_never_emits_a_replacement_character() -> None:
    tok = text_tokenizer()
    split_sentences = 0
    for sentence in SENTENCES:
        ids = tok.encode(sentence)
        split_sentences += any(REPLACEMENT in tok.decode([i]) for i in ids)
        deltas, _ = _run(IncrementalDetokenizer(tok), ids, full=sentence)
        assert "".join(deltas) == sentence
        assert not any(REPLACEMENT in d for d in deltas)
    assert split_sentences >= 3  # characters really are split across tokens


def test_prompt_context_does_not_change_the_generated_text() -> None:
    tok = text_tokenizer()
    prompt = tok.encode(SENTENCES[0])
    for sentence in SENTENCES[1:]:
        ids = tok.encode(sentence)
        deltas, _ = _run(IncrementalDetokenizer(tok, prompt_ids=prompt), ids, full=sentence)
        assert "".join(deltas) == sentence
    vocab = train_bpe().get_vocab_size()
    rng = random.Random(3)
    for _ in range(200):  # random prompts end inside a character about half the time
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
        full = tok.decode(ids)
        deltas, _ = _run(IncrementalDetokenizer(tok, prompt_ids=prompt), ids, full=full)
        assert "".join(deltas) == full


def test_prompt_context_keeps_the_leading_space_of_sentencepiece_tokens() -> None:
    tok = TextTokenizer(train_metaspace(), fast=True)
    rng = random.Random(2)
    for sentence in ("Hello wörld 😀 and 中文", *SENTENCES) * 5:
        ids = tok.encode(sentence)
        cut = rng.randrange(1, len(ids))
        prompt, generated = ids[:cut], ids[cut:]
        whole, head = (tok.decode(x, skip_special_tokens=False) for x in (ids, prompt))
        expected = whole[len(head) :]
        if head.endswith(REPLACEMENT):  # the cut split a character: no context to keep
            expected = tok.decode(generated, skip_special_tokens=False)
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=False)
        deltas, _ = _run(detok, generated, full=expected)
        assert "".join(deltas) == expected
    # without the prompt's context the first token's space would be lost
    ids = tok.encode("Hello wörld")
    assert tok.decode(ids[6:], skip_special_tokens=False) == "wörld"
    detok = IncrementalDetokenizer(tok, prompt_ids=ids[:6], skip_special_tokens=False)
    assert "".join(_run(detok, ids[6:])[0]) == " wörld"


def _spanning_stop(tok: TextTokenizer, ids: list[int], text: str, stop: str) -> int:
    """Index of the token whose decode first contains `stop`; asserts it spans tokens."""
    assert all(stop not in tok.decode([i]) for i in ids)
    return next(i for i in range(len(ids)) if stop in tok.decode(ids[: i + 1]))


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens_ends_the_text_and_nothing_after_leaks(include: bool) -> None:
    tok = text_tokenizer()
    text = "Emoji: 😀 😃 and then stop here and more text follows."
    ids = tok.encode(text)
    stop = "stop here"
    completing = _spanning_stop(tok, ids, text, stop)
    expected = text[: text.index(stop) + (len(stop) if include else 0)]
    detok = IncrementalDetokenizer(tok, stop=[stop], include_stop_str_in_output=include)
    deltas, stopped = _run(detok, ids, full=expected)
    assert stopped == completing
    assert detok.stop_string == stop
    assert "".join(deltas) == expected == detok.text
    assert detok.finish() == ""


def _first_stop(tok: TextTokenizer, ids: list[int], stops: list[str]) -> tuple[int, str]:
    """Oracle: the first token after which the text (at a whole character) holds a stop string,
    and that text cut before the earliest stop string in it."""
    for i in range(len(ids)):
        text = tok.decode(ids[: i + 1])
        found = [text.find(s) for s in stops if s in text]
        if found and not text.endswith(REPLACEMENT):
            return i, text[: min(found)]
    raise AssertionError("no stop string in the text")


def test_random_stop_strings_cut_at_the_first_completed_match() -> None:
    tok = text_tokenizer()
    rng = random.Random(1)
    for _ in range(200):
        sentence = rng.choice(SENTENCES)
        ids = tok.encode(sentence)
        stops = []
        for _ in range(rng.randrange(1, 4)):
            start = rng.randrange(len(sentence))
            stops.append(sentence[start : start + rng.randrange(1, 8)])
        completing, expected = _first_stop(tok, ids, stops)
        detok = IncrementalDetokenizer(tok, stop=stops)
        deltas, stopped = _run(detok, ids, full=expected)
        assert stopped == completing
        assert "".join(deltas) == expected
        assert detok.stop_string is not None and detok.stop_string in sentence


def test_a_held_back_stop_prefix_is_released_when_it_does_not_match() -> None:
    tok = text_tokenizer()
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["dog!"])
    deltas, stopped = _run(detok, ids, full=text)
    assert stopped is None and "".join(deltas) == text
    held = IncrementalDetokenizer(tok, stop=["lazy cat"])
    emitted = "".join(held.add(i) for i in tok.encode("over the lazy"))
    assert emitted == "over the "  # "lazy" may begin the stop string
    assert held.finish() == "lazy"


class _ByteTokenizer(TextTokenizer):
    """Ids 0-255 are bytes; 256 is the two bytes b"b\\xc3" (a letter and half of "é")."""

    def __init__(self) -> None:
        pass

    def decode(self, token_ids, *, skip_special_tokens: bool = True) -> str:  # type: ignore[no-untyped-def]
        data = b"".join(b"b\xc3" if i == 256 else bytes([i]) for i in token_ids)
        return data.decode("utf-8", errors="replace")


def test_a_stop_string_in_text_flushed_by_finish_is_still_cut() -> None:
    # "a" waits as a possible start of "ab"; token 256 ends in half a character, so "b" waits
    # with it. Generation then ends (a stop token, say): the flush must still cut at "ab".
    detok = IncrementalDetokenizer(_ByteTokenizer(), stop=["ab"])
    assert detok.add(ord("a")) == ""
    assert detok.add(256) == ""
    assert detok.finish() == ""
    assert detok.stop_string == "ab"
    plain = IncrementalDetokenizer(_ByteTokenizer(), stop=["zz"])
    assert plain.add(ord("a")) + plain.add(256) == "a"
    assert plain.finish() == "b" + REPLACEMENT


def test_special_tokens_are_skipped() -> None:
    tok = text_tokenizer()
    eos = train_bpe().token_to_id(EOS)
    assert eos is not None
    ids = [*tok.encode("café"), eos]
    deltas, _ = _run(IncrementalDetokenizer(tok), ids)
    assert "".join(deltas) == "café"


def test_empty_stop_string_is_refused() -> None:
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        IncrementalDetokenizer(text_tokenizer(), stop=[""])


def test_tokenizer_and_eos_from_a_checkpoint_directory(tmp_path) -> None:
    train_bpe().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    tok = TextTokenizer.from_dir(tmp_path)
    assert tok.decode(tok.encode("naïve 😀")) == "naïve 😀"
    assert eos_token_ids(tmp_path) == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert eos_token_ids(tmp_path) == (5, 7)
    with pytest.raises(ValueError, match="does not exist"):
        TextTokenizer.from_dir(tmp_path / "missing")


def test_encoding_a_long_prompt_lets_other_threads_run() -> None:
    """`tokenizers`' encode holds the GIL for its whole run; TextTokenizer.encode must not
    (a 610,000-character prompt once stopped every other thread for 1.0 s)."""
    import threading
    import time

    tok = text_tokenizer()
    text = " ".join(SENTENCES) * 2000  # ~700,000 characters
    start = time.perf_counter()
    train_bpe().encode(text)
    once = time.perf_counter() - start
    if once < 0.4:  # a fast machine: a longer prompt, so that the encode below can tell
        text *= int(0.4 / once) + 1
    gaps: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            time.sleep(0.001)
            gaps.append(time.perf_counter() - start)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    start = time.perf_counter()
    ids = tok.encode(text)
    seconds = time.perf_counter() - start
    stop.set()
    ticker.join()
    assert ids == train_bpe().encode(text).ids
    assert seconds > 0.2, "too short a prompt to tell"
    assert max(gaps) < seconds / 3, (max(gaps), seconds)
