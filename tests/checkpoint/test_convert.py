"""``megarl convert``: HF <-> per-rank Megatron pieces, on tiny random transformers models of each
family: bitwise round trips, pieces == mcore_sharding.shard_rank, sharded HF output, logits of the
trainer's GPTModel and the engine's CausalLM loaded from converted checkpoints, and loud failures
that leave nothing behind."""
import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megarl.checkpoint import convert as cv
from megarl.checkpoint.convert_cli import main_convert
from megarl.models import mcore_mapping as mm
from megarl.models import mcore_sharding as ms
from megarl.models.config import ModelArgs
from megarl.models.hf_io import INDEX_FILE, SINGLE_FILE, load_hf_model, load_hf_state_dict

COMMON = dict(vocab_size=53, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rope_theta=5000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
              attn_implementation="eager")
FAMILIES = ["llama_tied", "llama", "qwen2", "qwen3", "qwen3_moe"]
TOKENIZER = {"tokenizer.json": '{"fake": "tokenizer"}', "tokenizer_config.json": '{"model_max_length": 64}',
             "special_tokens_map.json": '{"eos_token": "x"}'}


def make_hf(family: str, path: Path, dtype=torch.float32, seed: int = 0, **overrides) -> Path:
    """A tiny random HF model saved with save_pretrained (safetensors) plus fake tokenizer files
    (``overrides``: config fields other than COMMON's)."""
    common = {**COMMON, **overrides}
    if family.startswith("llama"):
        cfg = transformers.LlamaConfig(tie_word_embeddings=family == "llama_tied", **common)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=False, **common)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, tie_word_embeddings=False, **common)
    else:
        cfg = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                                          tie_word_embeddings=False, **common)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):  # HF inits norms to 1, biases to 0
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("gate.weight") and "experts" not in name:  # sharp router, no near-ties
                p.normal_(0.0, 0.5)
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    for name, text in TOKENIZER.items():
        (path / name).write_text(text)
    return path


def parallel(family: str) -> dict:
    return dict(tp=1, pp=2, ep=2) if family == "qwen3_moe" else dict(tp=2, pp=2, ep=1)


def assert_same_tensors(got: dict, want: dict) -> None:
    assert list(got) == list(want) or sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


def nothing_at(out: Path) -> bool:
    return not out.exists() and not list(out.parent.glob(f".{out.name}.*"))


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bitwise_and_pieces_are_shard_rank(tmp_path, family):
    hf = make_hf(family, tmp_path / "hf")
    par = parallel(family)
    report = cv.hf_to_mcore(hf, tmp_path / "mc", **par, progress=False)
    hf_sd = load_hf_state_dict(hf)
    args = ModelArgs.from_hf_config(json.loads((hf / "config.json").read_text()))
    full = mm.hf_to_mcore(hf_sd, args)
    n = 0
    for e in range(par["ep"]):
        for p in range(par["pp"]):
            for t in range(par["tp"]):
                piece = load_file(tmp_path / "mc" / cv.piece_file(t, p, e))
                want = ms.shard_rank(full, args, par["tp"], par["pp"], t, p, ep=par["ep"], ep_rank=e)
                assert_same_tensors(piece, want)
                # What a trainer rank loads at start, read straight from the HF folder.
                assert_same_tensors(cv.read_hf_piece(hf, args, par["tp"], par["pp"], t, p, par["ep"], e), want)
                n += len(piece)
    assert report.tensors == n
    meta = json.loads((tmp_path / "mc" / "meta.json").read_text())
    assert meta["hf_config"] == json.loads((hf / "config.json").read_text())
    assert (meta["tp"], meta["pp"], meta["ep"], meta["dtype"]) == (par["tp"], par["pp"], par["ep"], "F32")
    assert meta["padded_vocab_size"] == (256 if par["tp"] == 2 else 53)
    assert sorted(meta["hf_files"]) == sorted([*TOKENIZER, "generation_config.json"])

    # Back, in shards of at most ~20 KB: several files and an index naming each tensor's file.
    back = tmp_path / "back"
    cv.mcore_to_hf(tmp_path / "mc", back, max_shard_mb=0.02, progress=False)
    index = json.loads((back / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(hf_sd)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (back / SINGLE_FILE).exists()
    total = 0
    for f in files:
        shard = load_file(back / f)
        assert {k for k, v in index["weight_map"].items() if v == f} == set(shard)
        total += sum(v.numel() * v.element_size() for v in shard.values())
        assert (back / f).stat().st_size <= 0.02 * 2**20 + 4096 or len(shard) == 1
    assert index["metadata"]["total_size"] == total
    assert_same_tensors(load_hf_state_dict(back), hf_sd)
    assert json.loads((back / "config.json").read_text()) == meta["hf_config"]
    for name in [*TOKENIZER, "generation_config.json"]:
        assert (back / name).read_bytes() == (hf / name).read_bytes()

    # Default shard size: one model.safetensors, no index.
    single = tmp_path / "single"
    cv.mcore_to_hf(tmp_path / "mc", single, progress=False)
    assert (single / SINGLE_FILE).is_file() and not (single / INDEX_FILE).exists()
    assert_same_tensors(load_file(single / SINGLE_FILE), hf_sd)


@pytest.mark.parametrize("family", ["llama_tied", "qwen3_moe"])
def test_vpp_pieces_are_the_stage_shards_and_round_trip(tmp_path, family):
    """--vpp 2 with --pp 2: 4 stages of one layer; rank p's chunk v is the shard of stage v*pp + p
    (what the interleaved trainer's chunk loads), the tied model's last-stage copy on pp_rank 1's
    last chunk; back to HF bitwise."""
    hf = make_hf(family, tmp_path / "hf", num_hidden_layers=4)
    par = dict(parallel(family), vpp=2)
    report = main_convert(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc"), "--no-progress",
                              *[a for k, v in par.items() for a in (f"--{k}", str(v))]])
    args = ModelArgs.from_hf_config(json.loads((hf / "config.json").read_text()))
    full = mm.hf_to_mcore(load_hf_state_dict(hf), args)
    tp, pp, ep = par["tp"], par["pp"], par["ep"]
    meta = json.loads((tmp_path / "mc" / "meta.json").read_text())
    assert (meta["pp"], meta["vpp"]) == (2, 2) and len(meta["files"]) == tp * pp * 2 * ep
    n = 0
    for e in range(ep):
        for p in range(pp):
            for v in range(2):
                for t in range(tp):
                    piece = cv.load_piece(tmp_path / "mc", t, p, e, vp=v)
                    want = ms.shard_rank(full, args, tp, pp * 2, t, v * pp + p, ep=ep, ep_rank=e)
                    assert_same_tensors(piece, want)
                    assert_same_tensors(cv.read_hf_piece(hf, args, tp, pp * 2, t, v * pp + p, ep, e), want)
                    assert sorted(k for k in piece if k.startswith("decoder.layers.")) == sorted(
                        k for k in piece if k.startswith("decoder.layers.0."))  # one layer per chunk
                    assert ("embedding.word_embeddings.weight" in piece) == (p == 0 and v == 0)
                    assert ("output_layer.weight" in piece) == (p == pp - 1 and v == 1)
                    n += len(piece)
    assert report.tensors == n
    with pytest.raises(ValueError, match="has vpp=2: pass vp in 0..1"):
        cv.load_piece(tmp_path / "mc", 0, 0)
    cv.mcore_to_hf(tmp_path / "mc", tmp_path / "back", progress=False)
    assert_same_tensors(load_hf_state_dict(tmp_path / "back"), load_hf_state_dict(hf))


def test_bf16_round_trip_keeps_dtype(tmp_path):
    hf = make_hf("qwen2", tmp_path / "hf", dtype=torch.bfloat16)
    cv.hf_to_mcore(hf, tmp_path / "mc", tp=2, pp=1, progress=False)
    assert json.loads((tmp_path / "mc" / "meta.json").read_text())["dtype"] == "BF16"
    cv.mcore_to_hf(tmp_path / "mc", tmp_path / "back", progress=False)
    want = load_hf_state_dict(hf)
    assert {v.dtype for v in want.values()} == {torch.bfloat16}
    assert_same_tensors(load_hf_state_dict(tmp_path / "back"), want)


def test_cli_round_trip(tmp_path, capsys):
    hf = make_hf("llama", tmp_path / "hf")
    main_convert(["hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc"), "--tp", "2", "--pp", "2",
                     "--no-progress"])
    main_convert(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "back"),
                     "--no-progress"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("converted ") and "MiB/s" in line for line in lines)
    assert_same_tensors(load_hf_state_dict(tmp_path / "back"), load_hf_state_dict(hf))


# ------------------------------------------------------------------------------ logits (TP=PP=1)


@pytest.fixture(scope="module")
def dims():
    from megatron.core import parallel_state as ps

    from megarl.parallel.dist import init_parallel, teardown
    if ps.model_parallel_is_initialized():
        pytest.skip("Megatron parallel state already initialised by another test module")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = init_parallel(tp=1, pp=1)
    yield d
    teardown(d)


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_checkpoint_logits_match_transformers(tmp_path, dims, family):
    from megarl.trainer.model import build_gpt_model, gpt_logits, load_state

    hf = make_hf(family, tmp_path / "hf", seed=5)
    cv.hf_to_mcore(hf, tmp_path / "mc", tp=1, pp=1, progress=False)
    cv.mcore_to_hf(tmp_path / "mc", tmp_path / "back", progress=False)
    ids = torch.randint(0, COMMON["vocab_size"], (3, 13), generator=torch.Generator().manual_seed(1))
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, attn_implementation="eager").eval()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    meta, args = cv.read_meta(tmp_path / "mc")
    gpt = build_gpt_model(args, dims, torch.float32, seed=0)
    load_state(gpt, cv.load_piece(tmp_path / "mc", 0, 0))
    engine = load_hf_model(tmp_path / "back", torch.float32).eval()
    with torch.no_grad():
        want = ref(ids).logits
        assert torch.equal(back(ids).logits, want)  # the HF export is the same model to transformers
        got_gpt, got_engine = gpt_logits(gpt, ids).cpu(), engine(ids)
    assert got_gpt.shape == got_engine.shape == want.shape == (3, 13, COMMON["vocab_size"])
    assert (got_gpt - want).abs().max().item() <= 1e-5
    assert (got_engine - want).abs().max().item() <= 1e-5


# ---------------------------------------------------------------------------------- loud failures


def hf_folder(tmp_path, family="qwen2") -> Path:
    return make_hf(family, tmp_path / "hf")


def rewrite_weights(hf: Path, change) -> None:
    sd = load_file(hf / SINGLE_FILE)
    change(sd)
    save_file(sd, str(hf / SINGLE_FILE), metadata={"format": "pt"})


def test_unsupported_architecture(tmp_path):
    hf = hf_folder(tmp_path)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (hf / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "mc"
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        cv.hf_to_mcore(hf, out, progress=False)
    assert nothing_at(out)


@pytest.mark.parametrize("change,match", [
    (lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"), r"missing \['model.layers.1.mlp.up_proj.weight'\]"),
    (lambda sd: sd.__setitem__("model.layers.0.extra.weight", torch.zeros(2)),
     r"unexpected \['model.layers.0.extra.weight'\]"),
    (lambda sd: sd.__setitem__("model.layers.0.self_attn.o_proj.weight", torch.zeros(48, 47)),
     r"model.layers.0.self_attn.o_proj.weight has shape \(48, 47\), expected \(48, 48\)"),
    (lambda sd: sd.__setitem__("model.norm.weight", sd["model.norm.weight"].double()),
     r"mixed dtypes.*torch.float64 \(e.g. model.norm.weight\)"),
])
def test_bad_hf_tensors(tmp_path, change, match):
    hf = hf_folder(tmp_path)
    rewrite_weights(hf, change)
    out = tmp_path / "mc"
    with pytest.raises(ValueError, match=match):
        cv.hf_to_mcore(hf, out, tp=2, pp=2, progress=False)
    assert nothing_at(out)


def test_tied_model_with_differing_lm_head(tmp_path):
    hf = hf_folder(tmp_path, "llama_tied")
    rewrite_weights(hf, lambda sd: sd.__setitem__("lm_head.weight", torch.zeros(53, 48)))
    with pytest.raises(ValueError, match="lm_head.weight is present and differs"):
        cv.hf_to_mcore(hf, tmp_path / "mc", progress=False)
    assert nothing_at(tmp_path / "mc")


@pytest.mark.parametrize("family,par,match", [
    ("qwen2", dict(tp=3), "tp=3 does not divide num_attention_heads=4"),
    ("qwen2", dict(tp=4), "tp=4 does not divide num_key_value_heads=2"),
    ("qwen2", dict(pp=3), "pp=3 does not divide num_hidden_layers=2"),
    ("qwen2", dict(pp=2, vpp=2), r"pp \* vpp = 2 \* 2 pipeline stages do not divide num_hidden_layers=2"),
    ("qwen2", dict(pp=1, vpp=2), "--vpp 2 .* needs --pp >= 2"),
    ("qwen2", dict(ep=2), "ep=2 needs an MoE model"),
    ("qwen3_moe", dict(tp=2), "MoE models need tp=1"),
    ("qwen3_moe", dict(ep=3), "ep=3 does not divide num_experts=4"),
])
def test_parallel_sizes_must_divide(tmp_path, family, par, match):
    hf = hf_folder(tmp_path, family)
    with pytest.raises(ValueError, match=match):
        cv.hf_to_mcore(hf, tmp_path / "mc", **par, progress=False)
    assert nothing_at(tmp_path / "mc")


def test_ffn_must_divide(tmp_path):
    hf = hf_folder(tmp_path)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["intermediate_size"] = 41  # weights now misshaped too; the parallel check comes first
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="tp=2 does not divide intermediate_size=41"):
        cv.hf_to_mcore(hf, tmp_path / "mc", tp=2, progress=False)
    assert nothing_at(tmp_path / "mc")


def test_existing_out_needs_force(tmp_path):
    hf = hf_folder(tmp_path)
    out = tmp_path / "mc"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty; pass --force"):
        cv.hf_to_mcore(hf, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine" and not list(tmp_path.glob(".mc.*"))
    cv.hf_to_mcore(hf, out, force=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "meta.json").is_file()


@pytest.fixture
def converted(tmp_path) -> Path:
    cv.hf_to_mcore(hf_folder(tmp_path), tmp_path / "mc", tp=2, pp=2, progress=False)
    return tmp_path / "mc"


def _edit_meta(ckpt: Path, **fields) -> None:
    """meta.json with ``fields`` changed and its own checksum recomputed (as a writer with a bug
    would leave it): the field checks must catch it, not the checksum."""
    from megarl.checkpoint.convert_checksums import seal_meta

    meta = json.loads((ckpt / "meta.json").read_text())
    meta.update(fields)
    (ckpt / "meta.json").write_text(json.dumps(seal_meta(meta)))


def _hand_edited(ckpt: Path) -> None:
    """A folder whose pieces were rewritten by hand, meta.json's checksums dropped with them (else
    the checksum would report the rewrite first): the structural checks must still catch it."""
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["checksums"]
    (ckpt / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("breakage,exc,match", [
    (lambda c: (c / "meta.json").write_text("{not json"), ValueError, "meta.json is corrupted"),
    (lambda c: _edit_meta(c, tp="two"), ValueError, "field 'tp' is 'two'"),
    (lambda c: _edit_meta(c, padded_vocab_size=53), ValueError, "field 'padded_vocab_size' is 53, expected 256"),
    (lambda c: _edit_meta(c, dtype="F16"), ValueError, "model_tp0_pp0_ep0.safetensors.*has dtype torch.float32"),
    (lambda c: (c / "model_tp1_pp1_ep0.safetensors").unlink(), FileNotFoundError,
     r"missing: \['model_tp1_pp1_ep0.safetensors'\]"),
    (lambda c: (c / "meta.json").unlink(), FileNotFoundError, "meta.json is missing"),
    (lambda c: (_hand_edited(c), save_file({"decoder.layers.0.input_layernorm.weight": torch.zeros(48)},
                                           str(c / "model_tp1_pp0_ep0.safetensors"))), ValueError,
     r"model_tp1_pp0_ep0.safetensors \(tp_rank=1, pp_rank=0, ep_rank=0\) state dict.*missing"),
])
def test_bad_mcore_checkpoint(converted, breakage, exc, match):
    breakage(converted)
    out = converted.parent / "back"
    with pytest.raises(exc, match=match):
        cv.mcore_to_hf(converted, out, progress=False)
    assert nothing_at(out)


def test_replicated_pieces_must_agree(converted):
    path = converted / "model_tp1_pp1_ep0.safetensors"
    sd = load_file(path)
    sd["decoder.final_layernorm.weight"] = sd["decoder.final_layernorm.weight"] + 1
    save_file(sd, str(path))
    _hand_edited(converted)
    with pytest.raises(ValueError, match="replicated tensor decoder.final_layernorm.weight of pp_rank=1 differs"):
        cv.mcore_to_hf(converted, converted.parent / "back", progress=False)
    assert nothing_at(converted.parent / "back")


def test_init_from_mcore_needs_the_run_layout(tmp_path):
    """A run started from a converted folder checks its layout before anything is built: the error
    names both layouts and the convert command that fixes it."""
    from megarl.config import load_config
    from megarl.setup_run import prepare_inputs

    cv.hf_to_mcore(hf_folder(tmp_path), tmp_path / "mc", tp=2, pp=2, progress=False)
    config = Path(__file__).resolve().parents[2] / "configs" / "smoke.yaml"
    with pytest.raises(ValueError, match=r"converted with \{'tp': 2, 'pp': 2, 'vpp': 1, 'ep': 1\}, this run's trainer "
                                         r"has \{'tp': 1, 'pp': 1, 'vpp': 1, 'ep': 1\}.*hf-to-mcore --tp 1 --pp 1"):
        prepare_inputs(load_config(config, [f"model.init_from_mcore={tmp_path / 'mc'}"]))
    with pytest.raises(ValueError, match="init_from_hf and model.init_from_mcore are both set"):
        load_config(config, [f"model.init_from_mcore={tmp_path / 'mc'}", f"model.init_from_hf={tmp_path}"])
