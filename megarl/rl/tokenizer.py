"""Tokenizers behind one small interface: ``encode``/``decode``/``vocab_size``/``eos_id``/``pad_id``.

``CharTokenizer`` is the fixed character-level vocabulary of the synthetic task (one character =
one token, so response lengths in tokens are response lengths in characters, which keeps the
long-tail bookkeeping of the schedulers easy to read). ``save_pretrained`` writes a real
``tokenizer.json`` so that checkpoints exported for Hugging Face tools load with
``AutoTokenizer.from_pretrained`` and tokenize identically. ``HFTokenizer`` wraps any local HF
tokenizer (real models: byte-level BPE, chat templates, several stop tokens) behind the same
interface.

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
    stop_ids: tuple[int, ...]
    """Every token id that ends a response (EOS first)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]:
        """The ids the policy sees for a prompt (chat template and special tokens applied)."""

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
        self.stop_ids = (self.eos_id,)

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

    def encode_prompt(self, text: str) -> list[int]:
        """Prompts are used as written: no chat template, no BOS."""
        return self.encode(text)

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
    """``transformers.AutoTokenizer`` from a local folder, behind the ``Tokenizer`` interface.

    - ``encode`` adds no special tokens (response pieces, SFT targets); ``encode_prompt`` turns a
      prompt into the ids the policy sees: with the chat template (``chat_template``; default:
      when the tokenizer has one) a user turn, an optional system turn and the generation prompt,
      exactly as ``apply_chat_template(..., add_generation_prompt=True)``; without one, the text
      with the tokenizer's own special tokens (a BOS only where its config adds one).
    - ``stop_ids``: every token that ends a response: the tokenizer's EOS and each
      ``eos_token_id`` of the folder's ``generation_config.json`` (an int or a list).
    - ``decode`` skips special tokens; bytes of a character cut by the length limit decode to
      U+FFFD, never an error (rewards still get a string).
    - ``pad_id`` falls back to the EOS when there is no pad token (padding is never sampled).
    - Folders saved by transformers 5.x (``tokenizer_class: TokenizersBackend``, the chat template in
      ``chat_template.jinja``) load under transformers 4.x too (:func:`load_hf_tokenizer`).
    """

    def __init__(self, path: str | os.PathLike, chat_template: bool | None = None,
                 system_prompt: str | None = None, generation_config: str | os.PathLike | None = None) -> None:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"HFTokenizer: tokenizer directory {str(path)!r} does not exist; expected a "
                                    f"local directory holding tokenizer.json / tokenizer_config.json")
        self.path = path
        self.hf = load_hf_tokenizer(path)
        if self.hf.eos_token_id is None:
            raise ValueError(f"HFTokenizer: tokenizer at {str(path)!r} defines no eos_token; generation needs one")
        self.eos_id = int(self.hf.eos_token_id)
        self.pad_id = int(self.hf.pad_token_id) if self.hf.pad_token_id is not None else self.eos_id
        has_template = bool(getattr(self.hf, "chat_template", None))
        if chat_template and not has_template:
            raise ValueError(f"data.chat_template=true but the tokenizer at {str(path)!r} has no chat template "
                             f"(tokenizer_config.json 'chat_template' or chat_template.jinja); use "
                             f"data.chat_template=false to feed prompts as plain text")
        if system_prompt is not None and not has_template:
            raise ValueError(f"data.system_prompt needs a chat template; the tokenizer at {str(path)!r} has none")
        self.uses_chat_template = has_template if chat_template is None else bool(chat_template)
        self.system_prompt = system_prompt
        self.generation_config = _read_generation_config(Path(generation_config or path))
        stops = [self.eos_id] + _as_list(self.generation_config.get("eos_token_id"))
        self.stop_ids = tuple(dict.fromkeys(int(t) for t in stops))  # ordered, unique
        bad = [t for t in self.stop_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"generation_config.json eos_token_id {bad} is outside the tokenizer's vocabulary "
                             f"[0, {self.vocab_size}) ({str(path)!r})")

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        if not self.uses_chat_template:
            return list(self.hf.encode(text, add_special_tokens=True))
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        messages.append({"role": "user", "content": text})
        ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5.x returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """The tokenizer files, and the stop tokens in ``generation_config.json`` (the export's
        own file, written before this runs, gets every stop id, so HF ``generate`` stops alike)."""
        directory = Path(directory)
        self.hf.save_pretrained(str(directory))
        gen_path = directory / "generation_config.json"
        if gen_path.is_file() and len(self.stop_ids) > 1:
            gen = json.loads(gen_path.read_text())
            gen["eos_token_id"] = list(self.stop_ids)
            gen_path.write_text(json.dumps(gen, indent=2) + "\n")


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _read_json_object(path: Path, fix: str = "") -> dict:
    """The JSON object in ``path`` ({} if there is no such file); a ValueError naming the file if
    it is not UTF-8 JSON or not an object."""
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}){fix}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(obj).__name__}")
    return obj


def _read_generation_config(folder: Path) -> dict:
    return _read_json_object(folder / "generation_config.json", "; fix or delete it")


def load_hf_tokenizer(path: Path):
    """``AutoTokenizer.from_pretrained(path)``, and folders saved by transformers 5.x under 4.x:
    5.x writes ``tokenizer_class: TokenizersBackend`` (a class 4.x lacks; it is a plain fast
    tokenizer over ``tokenizer.json``), extra special tokens as a list, and the chat template in
    ``chat_template.jinja``. Such a folder becomes a ``PreTrainedTokenizerFast`` with the same
    special tokens and template: the same ids as 5.x gives."""
    import transformers

    cfg = _read_json_object(path / "tokenizer_config.json")
    cls = cfg.get("tokenizer_class")
    if cls != "TokenizersBackend" or hasattr(transformers, "TokenizersBackend"):
        try:
            return transformers.AutoTokenizer.from_pretrained(str(path))
        except Exception as e:  # noqa: BLE001 - transformers/tokenizers raise many kinds for a bad folder
            raise ValueError(f"tokenizer folder {path} cannot be loaded by transformers {transformers.__version__} "
                             f"({type(e).__name__}: {' '.join(str(e).split())}); expected tokenizer.json and/or "
                             f"tokenizer_config.json as saved by transformers' save_pretrained") from e
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path}: tokenizer_class TokenizersBackend (saved by transformers 5.x) needs "
                                f"tokenizer.json beside it")
    kwargs = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "model_max_length",
                                  "clean_up_tokenization_spaces") if cfg.get(k) is not None}
    extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens")
    if isinstance(extra, dict):
        extra = list(extra.values())
    if extra:
        kwargs["additional_special_tokens"] = list(extra)
    try:
        tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), **kwargs)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exceptions for a bad file
        raise ValueError(f"{path / 'tokenizer.json'} cannot be loaded ({type(e).__name__}: "
                         f"{' '.join(str(e).split())}); the folder was saved by transformers 5.x "
                         f"(tokenizer_class TokenizersBackend in tokenizer_config.json), whose tokenizer.json megarl "
                         f"reads directly: save the tokenizer again, or use transformers >= 5") from e
    jinja = path / "chat_template.jinja"
    try:
        template = jinja.read_text() if jinja.is_file() else cfg.get("chat_template")
    except UnicodeDecodeError as e:
        raise ValueError(f"{jinja} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if template:
        tok.chat_template = template
    return tok
