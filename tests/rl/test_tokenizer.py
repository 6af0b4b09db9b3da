import random

import pytest

from megarl.rl.task import AdditionTask
from megarl.rl.tokenizer import CHARS, CharTokenizer, HFTokenizer


def test_ids_and_round_trip():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(CHARS)
    text = "12+7=19;19+40=59|\n 3,#59"
    ids = tok.encode(text)
    assert len(ids) == len(text) and min(ids) >= 3
    assert tok.decode(ids) == text
    # Special tokens are dropped, decoding does not stop at EOS.
    assert tok.decode([tok.bos_id] + ids[:2] + [tok.eos_id] + ids[2:3] + [tok.pad_id]) == "12+"


def test_errors():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("1+x")
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFTokenizer("/nonexistent/tokenizer/dir")


def test_auto_tokenizer_parity(tmp_path):
    from transformers import AutoTokenizer

    tok = CharTokenizer()
    tok.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id, len(hf)) == (0, 1, 2, tok.vocab_size)
    task, rng = AdditionTask(), random.Random(0)
    texts = [CHARS, "  ,, \n\n||", "1 , 2"]
    texts += [p.prompt for p in task.problems()[:20]]
    texts += [task.solution(p, rng) for p in task.problems()[:50]]
    texts += ["".join(rng.choice(CHARS) for _ in range(rng.randrange(1, 40))) for _ in range(200)]
    for text in texts:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf(text)["input_ids"] == ids, text  # nothing added by default either
        with_specials = [tok.bos_id] + ids + [tok.eos_id, tok.pad_id]
        assert hf.decode(with_specials, skip_special_tokens=True) == tok.decode(with_specials) == text
    # The wrapper gives the same interface and results.
    wrapped = HFTokenizer(tmp_path)
    assert (wrapped.vocab_size, wrapped.eos_id, wrapped.pad_id) == (tok.vocab_size, tok.eos_id, tok.pad_id)
    assert wrapped.encode(texts[-1]) == tok.encode(texts[-1])
    assert wrapped.decode(tok.encode(texts[-1]) + [1]) == texts[-1]
    wrapped.save_pretrained(tmp_path / "copy")
    assert HFTokenizer(tmp_path / "copy").encode("12+3=") == tok.encode("12+3=")
