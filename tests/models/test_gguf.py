"""``megarl convert gguf-to-hf`` on GGUF files written here by llama.cpp's own writer (``gguf``):
every weight back bitwise (Llama's q/k row permutation undone, Qwen2's biases, Qwen3's q/k norms,
tied and untied heads), the tokenizer's ids and specials, and clear errors. The real SmolLM2
GGUF is converted in tests/models/test_smollm2.py."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from megarl.models.config import ModelArgs
from megarl.models.gguf import GGUFError, gguf_to_hf, unpermute_qk
from megarl.models.llama import CausalLM

# A 3-character byte-level BPE: '<s>', '</s>' specials, then bytes for "ab c1" and merges "a b", "Ġ c".
TOKENS = ["<unk>", "<s>", "</s>", "a", "b", "c", "1", "2", "Ġ", "ab", "Ġc"]
TYPES = [3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1]
MERGES = ["a b", "Ġ c"]
_NAMES = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
          "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
          "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute`` (what the converter must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}"


def write_gguf(path, arch: str, tie: bool, pre: str = "smollm", add_bos: bool = False, seed: int = 0):
    import gguf

    args = ModelArgs(vocab_size=len(TOKENS), hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=5e4,
                     max_position_embeddings=64, tie_word_embeddings=tie, model_type=arch)
    torch.manual_seed(seed)
    model = CausalLM(args)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_feed_forward_length(24)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(5e4)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_types(TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    for name, t in sd.items():
        a = t.numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            a = _permute(a, 4)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            a = _permute(a, 2)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


def test_unpermute_inverts_llama_cpps_permutation():
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for n_head in (1, 2, 8):
        assert np.array_equal(unpermute_qk(_permute(w, n_head), n_head), w)
    assert not np.array_equal(_permute(w, 8), w)


@pytest.mark.parametrize("arch,tie", [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)])
def test_weights_come_back_bitwise(tmp_path, arch, tie):
    sd = write_gguf(tmp_path / "m.gguf", arch, tie)
    out = gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    got = load_file(out / "model.safetensors")
    want = {k: v for k, v in sd.items() if not (tie and k == "lm_head.weight")}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    cfg = json.loads((out / "config.json").read_text())
    args = ModelArgs.from_hf_config(cfg)
    assert (args.model_type, args.tie_word_embeddings, args.num_key_value_heads, args.rope_theta,
            args.rms_norm_eps) == (arch, tie, 2, 5e4, 1e-5)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    ours = CausalLM(args)
    ours.load_state_dict(want)
    ids = torch.tensor([[3, 4, 5, 6, 8, 9, 10]])
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max().item() < 1e-4


def test_tokenizer_specials_bos_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    write_gguf(tmp_path / "m.gguf", "llama", True)
    out = gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    assert tok("ab c12").input_ids == [9, 10, 6, 7]  # merges applied; digits one by one; no BOS
    assert tok.decode([9, 10, 2], skip_special_tokens=True) == "ab c"
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False) == "<s>ab</s>"
    write_gguf(tmp_path / "b.gguf", "llama", True, add_bos=True)
    tok = AutoTokenizer.from_pretrained(gguf_to_hf(tmp_path / "b.gguf", tmp_path / "hf_bos", progress=False))
    assert tok("ab").input_ids == [1, 9]  # the GGUF says add_bos_token: then, and only then, a BOS


def test_unsupported_inputs_fail_naming_what(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", True, pre="unknown-pre")
    with pytest.raises(GGUFError, match="pre-tokenizer 'unknown-pre' is not supported; supported: "):
        gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.tmp-*"))  # nothing half-written
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="is not a readable GGUF file"):
        gguf_to_hf(tmp_path / "junk.gguf", tmp_path / "hf", progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "hf", progress=False)
