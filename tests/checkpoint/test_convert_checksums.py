"""Checksums of converted folders: a flipped byte in a piece used to convert back
with exit 0 and wrong weights; now every reader names the corrupted file and tensor."""
import json
import logging
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megarl.checkpoint import convert as cv
from megarl.checkpoint.convert_cli import main_convert
from megarl.checkpoint import export
from megarl.checkpoint.checksum import ChecksumMismatch
from megarl.models.config import ModelArgs
from megarl.models.hf_io import load_hf_state_dict
from tests.checkpoint.test_convert import make_hf, nothing_at

QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


@pytest.fixture
def converted(tmp_path) -> Path:
    cv.hf_to_mcore(make_hf("llama", tmp_path / "hf"), tmp_path / "mc", tp=2, pp=2, progress=False)
    return tmp_path / "mc"


def _data_offset(path: Path, tensor: str) -> int:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n + json.loads(raw[8:8 + n])[tensor]["data_offsets"][0]


def _flip(path: Path, offset: int, count: int = 4) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, offset + count):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def test_meta_records_a_checksum_per_piece_tensor_and_hf_file(converted):
    meta = json.loads((converted / "meta.json").read_text())
    sums = meta["checksums"]
    assert sums["algorithm"] == "crc32"
    assert sorted(sums["pieces"]) == sorted(meta["files"])
    assert sorted(sums["files"]) == sorted(meta["hf_files"])
    piece = cv.load_piece(converted, 0, 0)
    assert sorted(sums["pieces"]["model_tp0_pp0_ep0.safetensors"]) == sorted([*piece, "__header__"])


def test_flipped_bytes_in_a_piece_fail_naming_file_and_tensor(converted):
    piece = converted / "model_tp1_pp0_ep0.safetensors"
    _flip(piece, _data_offset(piece, QKV) + 100)
    out = converted.parent / "back"
    with pytest.raises(ChecksumMismatch, match=f"model_tp1_pp0_ep0.safetensors: tensor {QKV} does not match"):
        cv.mcore_to_hf(converted, out, progress=False)
    assert nothing_at(out)
    with pytest.raises(ChecksumMismatch, match="model_tp1_pp0_ep0.safetensors"):
        cv.load_piece(converted, 1, 0)   # what a trainer rank starting from the folder reads
    assert cv.load_piece(converted, 0, 0)   # the other pieces are intact
    with pytest.raises(ValueError, match="corrupted"):   # a ValueError: the CLI prints one line, exit 2
        main_convert(["mcore-to-hf", "--ckpt", str(converted), "--out", str(out), "--no-progress"])


def test_flipped_byte_in_a_header_fails_naming_the_file(converted):
    piece = converted / "model_tp0_pp1_ep0.safetensors"
    raw = piece.read_bytes()
    at = raw.index(b'"shape":[', 8) + len(b'"shape":[')   # a digit of a shape: still valid JSON
    data = bytearray(raw)
    data[at] = ord("9") if data[at] != ord("9") else ord("8")
    piece.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch, match="model_tp0_pp1_ep0.safetensors: its header does not match"):
        cv.mcore_to_hf(converted, converted.parent / "back", progress=False)


def test_corrupted_tokenizer_file_fails_naming_it(converted):
    (converted / "tokenizer.json").write_text('{"fake": "tokenizeR"}')
    out = converted.parent / "back"
    with pytest.raises(ChecksumMismatch, match="tokenizer.json does not match"):
        cv.mcore_to_hf(converted, out, progress=False)
    assert nothing_at(out)


def test_folder_without_checksums_still_converts_with_one_warning(converted, caplog):
    meta = json.loads((converted / "meta.json").read_text())
    del meta["checksums"]
    (converted / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="megarl.checkpoint.convert"):
        cv.mcore_to_hf(converted, converted.parent / "back", progress=False)
        cv.load_piece(converted, 0, 0)
    warned = [r.getMessage() for r in caplog.records if "no checksums" in r.getMessage()]
    assert len(warned) == 1 and str(converted) in warned[0] and "unverified" in warned[0]
    hf = load_hf_state_dict(converted.parent / "hf")
    back = load_hf_state_dict(converted.parent / "back")
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_changed_meta_json_is_refused_by_the_cli(converted, capsys):
    """One character of ``rope_theta`` changed in meta.json (whose hf_config becomes the output's
    config.json): ``megarl convert mcore-to-hf`` ends with one error line naming meta.json and its
    checksum, exit 2, nothing written; before, it exited 0 with the changed config."""
    from megarl.cli import main

    text = (converted / "meta.json").read_text()
    hf_config = json.loads(text)["hf_config"]
    # transformers 5.x writes it inside rope_parameters, 4.x at the top level
    theta = hf_config.get("rope_parameters", hf_config).get("rope_theta")
    assert text.count(f'"rope_theta": {theta}') == 1
    (converted / "meta.json").write_text(text.replace(f'"rope_theta": {theta}', f'"rope_theta": {theta}1'))
    out = converted.parent / "back"
    capsys.readouterr()
    rc = main(["convert", "mcore-to-hf", "--ckpt", str(converted), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and "Traceback" not in err, err
    assert lines[-1] == (f"megarl: error: {converted / 'meta.json'} does not match its own checksum (checksums.meta): "
                         f"the file was changed after it was written; convert the model again")
    assert nothing_at(out)


def test_meta_json_without_its_own_checksum_reads_with_one_warning(converted, caplog):
    """A folder converted before meta.json had a checksum of its own still converts, saying so."""
    meta = json.loads((converted / "meta.json").read_text())
    del meta["checksums"]["meta"]
    (converted / "meta.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="megarl.checkpoint.convert_checksums"):
        cv.mcore_to_hf(converted, converted.parent / "back", progress=False)
    assert any("no checksum of its own" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("checksums, match", [
    ("sha256", "field 'checksums' is not"),
    ({"algorithm": "md4", "pieces": {}, "files": {}}, "checksum algorithm .md4. is not supported"),
    ({"algorithm": "crc32", "pieces": {}, "files": {}}, "no entry for"),
])
def test_bad_checksums_field_is_a_clear_error(converted, checksums, match):
    meta = json.loads((converted / "meta.json").read_text())
    meta["checksums"] = checksums
    (converted / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=match):
        cv.read_meta(converted)


def test_export_writes_checksums_and_round_trips(tmp_path):
    """``export_hf`` (one process): pieces written with their checksums, gathered into meta.json,
    checked while the converter reads them back; the result equals the HF model."""
    hf = make_hf("llama", tmp_path / "hf")
    args = ModelArgs.from_hf_config(json.loads((hf / "config.json").read_text()))
    piece = cv.read_hf_piece(hf, args, 1, 1, 0, 0)
    dims = SimpleNamespace(rank=0, tp=1, pp=1, ep=1, vpp=1, tp_rank=0, ep_rank=0, trainer_group=None,
                           dp_group=None, expt_dp_group=None)
    trainer = SimpleNamespace(dims=dims, args=args, dtype=torch.float32, local_pieces=lambda: {0: piece})
    seen = {}
    real = cv.mcore_to_hf

    def spy(stage, out, **kw):
        seen["meta"] = json.loads((Path(stage) / "meta.json").read_text())
        return real(stage, out, **kw)

    export.convert.mcore_to_hf = spy
    try:
        export.export_hf(trainer, tmp_path / "out")
    finally:
        export.convert.mcore_to_hf = real
    recorded = seen["meta"]["checksums"]["pieces"]["model_tp0_pp0_ep0.safetensors"]
    assert sorted(recorded) == sorted([*piece, "__header__"])
    want, got = load_hf_state_dict(hf), load_hf_state_dict(tmp_path / "out")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert not list(tmp_path.glob(".out.*"))
