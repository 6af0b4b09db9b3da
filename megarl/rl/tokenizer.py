"""Tokenizers behind one small interface: ``encode``/``decode``/``vocab_size``/``eos_id``/``pad_id``.

``CharTokenizer`` is the fixed character-level vocabulary of the synthetic task (one character =
one token, so response lengths in tokens are response lengths in characters, which keeps the
long-tail bookkeeping of the schedulers easy to read). ``save_pretrained`` writes a real
``tokenizer.json`` so that checkpoints exported for Hugging Face tools load with
``AutoTokenizer.from_pretrained`` and tokenize identically. ``HFTokenizer`` wraps any local HF
tokenizer (real datasets) behind the same interface.

Ids: ``<pad>`` = 0, ``<eos>`` = 1, ``<bos>`` = 2 (never added by ``encode``: prompts are used as
written; it exists for models that want a start token), then the characters of ``CHARS`` in order.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol, Sequence

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
SPECIAL_TOKENS = (PAD, EOS, BOS)
# Every character the synthetic task (and hand-written JSONL variants of it) may use. Appending
# characters at the end keeps earlier ids stable; never reorder.
CHARS = "0123456789+-*=#;,.:|() \n"


class Tokenizer(Protocol):
    """What the engine, the rewards and the data loaders need from a tokenizer."""

    vocab_size: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save_pretrained(self, directory: str | os.PathLike) -> None: ...


class CharTokenizer:
    """Character-level tokenizer over ``SPECIAL_TOKENS + CHARS``.

    ``encode`` adds no special tokens; ``decode`` drops special tokens (it does not stop at
    ``<eos>``: the engine truncates at EOS before decoding).
    """

    def __init__(self, chars: str = CHARS) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError(f"CharTokenizer chars: duplicate characters in {chars!r}")
        self.chars = chars
        self.id_to_token = list(SPECIAL_TOKENS) + list(chars)
        self._char_to_id = {c: i + len(SPECIAL_TOKENS) for i, c in enumerate(chars)}
        self.pad_id = SPECIAL_TOKENS.index(PAD)
        self.eos_id = SPECIAL_TOKENS.index(EOS)
        self.bos_id = SPECIAL_TOKENS.index(BOS)

    @property
    def vocab_size(self) -> int:
        return len(self.id_to_token)

    def encode(self, text: str) -> list[int]:
        ids = []
        for pos, ch in enumerate(text):
            tid = self._char_to_id.get(ch)
            if tid is None:
                raise ValueError(f"CharTokenizer.encode: character {ch!r} at position {pos} of {text!r} is not "
                                 f"in the vocabulary; valid characters: {self.chars!r}")
            ids.append(tid)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"CharTokenizer.decode: id {i} is out of range [0, {self.vocab_size})")
            if i >= len(SPECIAL_TOKENS):
                out.append(self.id_to_token[i])
        return "".join(out)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` (WordLevel over single characters, every character split off
        by the pre-tokenizer, ``Fuse`` decoder so decoding concatenates without spaces) plus the
        two config files ``transformers.AutoTokenizer`` reads."""
        from tokenizers import Regex, Tokenizer as HFTok, decoders, models, pre_tokenizers

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        vocab = {tok: i for i, tok in enumerate(self.id_to_token)}
        # No unk token in the vocabulary: an unknown character fails loudly instead of being
        # silently mapped to some id, mirroring CharTokenizer.encode's ValueError.
        tok = HFTok(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        # "[\s\S]" (not ".") so that "\n" is split off as a token like every other character.
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        tok.add_special_tokens(list(SPECIAL_TOKENS))
        tok.save(str(directory / "tokenizer.json"))
        special_map = {"pad_token": PAD, "eos_token": EOS, "bos_token": BOS}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            # The default cleanup would turn "7 ," into "7," and break round trips.
            "clean_up_tokenization_spaces": False,
            "add_bos_token": False,
            "add_eos_token": False,
            "model_max_length": 1 << 20,
            "model_input_names": ["input_ids", "attention_mask"],
            **special_map,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (directory / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


class HFTokenizer:
    """``transformers.AutoTokenizer`` from a local directory, behind the ``Tokenizer`` interface.

    ``encode`` adds no special tokens (the chat template / prompt text is the caller's business);
    ``decode`` skips special tokens. ``pad_id`` falls back to ``eos_id`` when the tokenizer has no
    pad token (common for Llama-family tokenizers); padding is never sampled, so this is harmless.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"HFTokenizer: tokenizer directory {str(path)!r} does not exist; expected a "
                                    f"local directory holding tokenizer.json / tokenizer_config.json")
        from transformers import AutoTokenizer

        self.path = path
        self.hf = AutoTokenizer.from_pretrained(str(path))
        if self.hf.eos_token_id is None:
            raise ValueError(f"HFTokenizer: tokenizer at {str(path)!r} defines no eos_token; generation needs one")
        self.eos_id = int(self.hf.eos_token_id)
        self.pad_id = int(self.hf.pad_token_id) if self.hf.pad_token_id is not None else self.eos_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        self.hf.save_pretrained(str(directory))
