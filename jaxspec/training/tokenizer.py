"""Byte-level BPE tokenizer (HF `tokenizers`) trained on the training mixture.

Special tokens take the first ids (BOS 0, EOS 1, PAD 2, as DeepSeek-V4's bos 0 / eos 1), then the
256 byte symbols, then merges up to `vocab_size`. Saved next to the checkpoint as tokenizer.json.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from jaxspec.core.checks import is_int

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Any:
    """Train a byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` ids on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not is_int(vocab_size) or vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB} (256 bytes + specials), got {vocab_size!r}")
    vocab_size = int(vocab_size)
    if isinstance(texts, str):
        raise ValueError("texts must be an iterable of strings, not one string")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    check_tokenizer(tok, vocab_size)
    return tok


def check_tokenizer(tok: Any, vocab_size: int | None = None) -> None:
    """ValueError unless `tok` has our special ids (and `vocab_size` ids, when given)."""
    for name, want in zip(SPECIAL_TOKENS, (BOS_ID, EOS_ID, PAD_ID), strict=True):
        got = tok.token_to_id(name)
        if got != want:
            raise ValueError(f"tokenizer must map {name} to id {want}, got {got}")
    if vocab_size is not None and tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"tokenizer has {tok.get_vocab_size()} ids, model vocab_size is {vocab_size} "
            "(too little training text for that many merges?)"
        )


def load_tokenizer(path: str | os.PathLike) -> Any:
    """A tokenizer.json file, or a checkpoint folder holding one."""
    from tokenizers import Tokenizer

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(f"tokenizer file {path!r} does not exist")
    tok = Tokenizer.from_file(path)
    check_tokenizer(tok)
    return tok


def save_tokenizer(tok: Any, path: str | os.PathLike) -> None:
    """Write tokenizer.json to `path` (a file name, or a folder to put tokenizer.json in)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    tok.save(path)


def encode(tok: Any, text: str, bos: bool = True, eos: bool = False) -> list[int]:
    """Token ids of `text`, with BOS first / EOS last when asked."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    ids = tok.encode(text, add_special_tokens=False).ids
    return ([BOS_ID] if bos else []) + ids + ([EOS_ID] if eos else [])


def encode_batch(tok: Any, texts: Sequence[str], bos: bool = True, eos: bool = False) -> list[list[int]]:
    """`encode` over many texts (parallel inside `tokenizers`)."""
    if isinstance(texts, str):
        raise ValueError("texts must be a sequence of strings, not one string")
    encs = tok.encode_batch(list(texts), add_special_tokens=False)
    return [([BOS_ID] if bos else []) + e.ids + ([EOS_ID] if eos else []) for e in encs]


def decode(tok: Any, ids: Sequence[int], skip_special: bool = True) -> str:
    """Text of token ids (special tokens dropped unless skip_special=False)."""
    return tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)
