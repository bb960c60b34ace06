"""Incremental detokenisation with stop strings, for streaming text as tokens are committed.

Decoding each new token alone is wrong twice over: a byte-level token may hold part of a UTF-8
character (alone it decodes to U+FFFD), and SentencePiece-style decoders drop the leading space
of the first token they see. So every step decodes a small window: the tokens since the last
stable point (`prefix`) plus the new ones, and emits what the window adds beyond the text of its
old part, once that no longer ends in U+FFFD. Example with byte-level ids for "é" split in two:

    add(0xC3) -> window [C3]     decodes to "\ufffd"  ends in U+FFFD: hold, emit ""
    add(0xA9) -> window [C3 A9]  decodes to "é"       emit "é", the window restarts after A9

Stop strings are matched on the stable text. Text that could be the start of a stop string is
held back until the next token decides it; on a match the text ends before the stop string
(or after it, with `include_stop_str_in_output`) and nothing after it is ever emitted.

The tokenizer is the `tokenizers` library's, read from the checkpoint's tokenizer.json, so the
orchestrator needs neither torch nor transformers' model code.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPLACEMENT = "\ufffd"
# Prompt tokens decoded with the first generated ones, for decoders whose output depends on the
# previous token (a leading space); vLLM uses the same window.
PROMPT_CONTEXT = 5


# Prompts tokenised at once; each runs without the GIL (below), on a CPU of its own.
ENCODE_CONCURRENCY = 2


class TextTokenizer:
    """encode / decode over a `tokenizers.Tokenizer` or, failing that, transformers'.

    `encode` runs off the path that serves other requests: `tokenizers`' `encode` holds the GIL
    for its whole run (a 610,000-character prompt stopped every other thread for 1.0 s), its
    `encode_batch` releases it (the same prompt: other threads ran every 23 ms), so prompts
    are tokenised with `encode_batch`, at most ENCODE_CONCURRENCY at once, while the scheduler
    and the other calls' threads go on.
    """

    def __init__(self, backend: Any, *, fast: bool) -> None:
        self._backend = backend
        self._fast = fast
        self._encoding = threading.BoundedSemaphore(ENCODE_CONCURRENCY)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TextTokenizer:
        """The tokenizer of a checkpoint directory; tokenizer.json if present."""
        path = Path(model_dir)
        if (path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            return cls(Tokenizer.from_file(str(path / "tokenizer.json")), fast=True)
        if not path.is_dir():
            raise ValueError(f"model directory {str(path)!r} does not exist.")
        from transformers import AutoTokenizer  # tokenizer code only, no model code

        return cls(AutoTokenizer.from_pretrained(str(path)), fast=False)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        with self._encoding:
            if self._fast:
                (encoding,) = self._backend.encode_batch(
                    [text], add_special_tokens=add_special_tokens
                )
                return list(encoding.ids)
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def vocab(self) -> dict[str, int]:
        """Every token (added ones included) and its id."""
        if self._fast:
            return dict(self._backend.get_vocab(with_added_tokens=True))
        return dict(self._backend.get_vocab())


def check_shared_tokenizer(target_dir: str | Path, draft_dir: str | Path) -> None:
    """Raises ValueError unless the two checkpoints' tokenizers have the same vocabulary. It
    reads only their tokenizer files, so a mismatched pair is refused before any model loads
    (the services' own check, after loading, came 32 s into an 8B target's start)."""
    vocabs = []
    for role, path in (("target", target_dir), ("draft", draft_dir)):
        try:
            vocabs.append(TextTokenizer.from_dir(path).vocab())
        except (OSError, ValueError) as e:
            raise ValueError(
                f"The {role}'s tokenizer in {str(path)!r} could not be read: {e}"
            ) from e
    target, draft = vocabs
    if target != draft:
        differ = sorted(set(target.items()) ^ set(draft.items()))[:3]
        raise ValueError(
            f"Refusing the draft {str(draft_dir)!r} for the target {str(target_dir)!r}: their "
            f"tokenizers differ ({len(draft)} and {len(target)} ids; e.g. "
            f"{', '.join(f'{t!r}: {i}' for t, i in differ)}); draft and target must share one."
        )


def eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The checkpoint's EOS ids: generation_config.json's, else config.json's; () if none."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        if eos is None:
            continue
        return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))
    return ()


class IncrementalDetokenizer:
    """Turns one request's generated token ids, one at a time, into text deltas.

    `add(token_id)` returns the text that became safe to emit; `finish()` returns what was held
    back when generation ends for another reason. Once `stop_string` is set the request is done.
    """

    def __init__(
        self,
        tokenizer: TextTokenizer,
        *,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty.")
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_ids[-PROMPT_CONTEXT:])
        if self._decode(self._ids).endswith(REPLACEMENT):
            # The prompt ends inside a character: its missing bytes are generated, and text
            # is positional, so the generated tokens are decoded on their own.
            self._ids = []
        self._prefix = 0  # window start: a stable point
        self._read = len(self._ids)  # ids before it are in `_text` (or are prompt)
        self._text = ""  # stable generated text
        self._sent = 0  # characters of `_text` already returned
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._text[: self._sent]

    def add(self, token_id: int) -> str:
        assert self.stop_string is None, "add() after a stop string matched"
        self._ids.append(token_id)
        old_len = len(self._text)
        old_part = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        if len(window) > len(old_part) and not window.endswith(REPLACEMENT):
            self._text += window[len(old_part) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(old_len, final=False)

    def finish(self) -> str:
        """Everything still held back: an incomplete character, a possible stop-string start."""
        if self.stop_string is not None:
            return ""
        old_len = len(self._text)
        old_part = self._decode(self._ids[self._prefix : self._read])
        window = self._decode(self._ids[self._prefix :])
        if len(window) > len(old_part):
            self._text += window[len(old_part) :]
        self._prefix = self._read = len(self._ids)
        return self._release(old_len, final=True)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _release(self, old_len: int, *, final: bool) -> str:
        """Checks the new text for stop strings and returns what may be emitted now."""
        end = len(self._text)
        if self._stop:
            match = self._find_stop(old_len)
            if match is not None:
                start, stop = match
                self.stop_string = stop
                end = start + len(stop) if self._include_stop else start
                self._text = self._text[:end]
            elif not final:
                end -= self._stop_prefix_len()
        delta = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """The earliest stop string that ends in text added since `old_len`."""
        longest = max(len(s) for s in self._stop)
        lo = max(self._sent, old_len - longest + 1)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            i = self._text.find(stop, lo)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        return best

    def _stop_prefix_len(self) -> int:
        """Length of the longest unsent suffix of the text that begins some stop string."""
        tail = self._text[self._sent :]
        held = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(tail)), held, -1):
                if tail.endswith(stop[:n]):
                    held = n
                    break
        return held
