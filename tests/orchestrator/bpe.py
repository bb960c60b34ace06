"""A byte-level BPE tokenizer trained in the test, on text with accents, emoji and CJK."""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from orchestrator.core.detokenizer import TextTokenizer

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


@functools.cache
def train_metaspace() -> Tokenizer:
    """SentencePiece-style BPE (Llama 2): "▁" marks a space and the decoder drops the leading
    one, so a token decoded alone loses its space; byte fallback splits unknown characters.
    The byte tokens are registered as special tokens here: decode them with
    skip_special_tokens=False."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(  # Llama 2's tokenizer.json decoder
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", EOS, *(f"<0x{b:02X}>" for b in range(256))],
        show_progress=False,
    )
    tokenizer.train_from_iterator(SENTENCES[:1] + SENTENCES[4:] * 4, trainer=trainer)
    return tokenizer
