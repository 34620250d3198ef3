"""The model card: its usage snippet runs as written (on a tiny local pair), and its metadata and commands hold."""

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from huggingface_hub import metadata_load
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

import tools
from dspark.configuration_dspark import DSparkConfig
from dspark.modeling_dspark import DSparkDraftModel
from test_config import tiny_kwargs
from tools.convert_checkpoint import write_hub_checkpoint

README = tools.REPO_ROOT / "README.md"
TESTED_MARKER = "<!-- tested: tests/test_readme.py"
HUB_IDS = {"target": "moonshotai/Kimi-K3", "draft": "RadixArk/Kimi-K3-DSpark"}
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "[UNK]"]  # ids 0..5
CHAIN_LENGTH = 20
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def readme_snippets(text: str) -> list[str]:
    """The python code blocks that directly follow a `<!-- tested: tests/test_readme.py ... -->` marker."""
    pattern = re.escape(TESTED_MARKER) + r"[^\n]*-->\n```python\n(.*?)```"
    return re.findall(pattern, text, flags=re.DOTALL)


def save_tiny_target(directory: Path) -> None:
    """A tiny Qwen3 (4 layers, hidden 32, vocabulary 64) and a word-level tokenizer with a chat template.

    The weights are random except for a chain laid into the embedding and the LM head: after `<|assistant|>`
    the greedy continuation is w0, w1, ..., w{CHAIN_LENGTH - 1}, <|eos|>, so the snippet's generation ends
    after CHAIN_LENGTH + 1 tokens instead of running to max_new_tokens on a slow CPU.
    """
    kwargs = tiny_kwargs()
    words = [f"w{i}" for i in range(kwargs["vocab_size"] - len(SPECIAL_TOKENS) - 1)]
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *words, "<|mask|>"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIAL_TOKENS + ["<|mask|>"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>", unk_token="[UNK]"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=kwargs["vocab_size"], hidden_size=kwargs["hidden_size"], intermediate_size=64,
        num_hidden_layers=kwargs["num_target_layers"], num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    chain = [vocab[token] for token in ["<|assistant|>", *words[:CHAIN_LENGTH], "<|eos|>"]]
    with torch.no_grad():
        embedding, lm_head = model.model.embed_tokens.weight, model.lm_head.weight
        embedding.normal_()  # large next to the layers' small random updates: the last token decides the argmax
        lm_head.zero_()
        for token, successor in zip(chain, chain[1:]):
            lm_head[successor] = 8 * F.normalize(embedding[token], dim=0)
    model.save_pretrained(directory)


def save_tiny_draft(directory: Path) -> None:
    """A tiny random DSpark draft for the tiny target, in the Hub layout (config, weights, remote code)."""
    torch.manual_seed(1)
    draft = DSparkDraftModel(DSparkConfig(**tiny_kwargs()))
    write_hub_checkpoint(draft.state_dict(), draft.config, directory, dtype="float32")


def test_readme_snippets_use_the_hub_ids():
    snippets = readme_snippets(README.read_text())
    assert len(snippets) == 2  # quick start, then the explicit `dspark_generate` loop
    assert all(f'"{repo_id}"' in snippets[0] for repo_id in HUB_IDS.values())
    assert "assistant_model=draft" in snippets[0] and 'device_map="auto"' in snippets[0]


def test_readme_snippets_run_as_written_on_a_tiny_pair(tmp_path):
    """Runs the README's tested snippets in order, with only the Hub ids replaced by local tiny models.

    Greedy DSpark (through `target.generate(..., assistant_model=draft)`, then through `dspark_generate`) must
    reproduce the target's own greedy output exactly.
    """
    paths = {"target": tmp_path / "tiny_target", "draft": tmp_path / "tiny_dspark_draft"}
    save_tiny_target(paths["target"])
    save_tiny_draft(paths["draft"])
    namespace, reference = {}, None
    for index, code in enumerate(readme_snippets(README.read_text())):
        for role, repo_id in HUB_IDS.items():
            code = code.replace(f'"{repo_id}"', repr(str(paths[role])))
        exec(compile(code, f"{README} (tested snippet {index + 1})", "exec"), namespace)

        target, inputs, output = namespace["target"], namespace["inputs"], namespace["output"]
        if reference is None:
            reference = target.generate(**inputs, max_new_tokens=256, do_sample=False)
            assert reference.shape[1] == inputs["input_ids"].shape[1] + CHAIN_LENGTH + 1  # ends at <|eos|>
        assert torch.equal(output, reference)
        assert namespace["draft"].last_stats.rounds > 0


def test_model_card_metadata():
    metadata = metadata_load(README)
    assert metadata["base_model"] == "moonshotai/Kimi-K3"
    assert metadata["library_name"] == "transformers" and metadata["pipeline_tag"] == "text-generation"
    assert {"speculative-decoding", "dspark", "dflash", "draft-model", "kimi"} <= set(metadata["tags"])
    assert metadata["license_link"] == "LICENSE" and (tools.REPO_ROOT / "LICENSE").is_file()


def test_quickstart_commands_match_ci():
    """The README's two developer commands: the demo, and the test command, which must be exactly .ci/run's."""
    ci_commands = [line for line in (tools.REPO_ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert len(ci_commands) == 1
    for command in ("pip install -r requirements.txt && python demo.py", ci_commands[0]):
        assert f"```bash\n{command}\n```" in README.read_text()
