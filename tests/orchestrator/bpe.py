"""A byte-level BPE tokenizer trained in the test, on text with accents, emoji and CJK."""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from orchestrator.detokenizer import TextTokenizer

EOS = "<eos>"
SENTENCES = [
    "Hello wörld, déjà vu: naïve café crème brûlée.",
    "Emoji: 😀 😃 🎉🎉 👍🏽 and flags 🇩🇪🇫🇷 in a row.",
    "中文分词测试，日本語のテキスト、한국어 문장도 있습니다。",
    "def main(): return sum(x ** 2 for x in range(10))  # ∑ x² ≤ ∞",
    "Ünïcödé ßtraße, Ωmega, Ελληνικά, русский текст, עברית.",
    "The quick brown fox jumps over the lazy dog. stop here and more text follows.",
]


@functools.cache
def train_bpe(vocab_size: int = 400) -> Tokenizer:
    """Byte-level BPE: its byte tokens split multi-byte characters, as GPT-2's and Llama 3's do."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(SENTENCES * 4, trainer=trainer)
    return tokenizer


def text_tokenizer() -> TextTokenizer:
    return TextTokenizer(train_bpe(), fast=True)
