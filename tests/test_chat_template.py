"""The embedded target's tokenizer carries the project's chat template (tools/chat_format.py), so the model card's
`apply_chat_template` snippet and chat `pipeline("text-generation")` calls work on the embedded pair."""

import json
from types import SimpleNamespace

import pytest
import torch
from jinja2.exceptions import TemplateError
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline

import tools  # noqa: F401  (registers the repository root as the package `dspark`)
from tools import chat_format, train_target
from tools.common import REPO_ROOT, chat_prompt_ids

TARGET_DIR, DRAFT_DIR = REPO_ROOT / "embedded/target", REPO_ROOT / "embedded/dspark"

CONVERSATIONS = {
    "one turn": (["Write a Python function that checks whether a number is prime."], []),
    "three turns": (
        ["Define a stack.", "Now a queue, in Python:\n```python\nclass Queue:\n```", "Which is faster?"],
        ["A last-in, first-out list.", "```python\nclass Queue:\n    pass\n```"],
    ),
}


def messages(user_turns: list[str], assistant_turns: list[str]) -> list[dict]:
    turns = [None] * (len(user_turns) + len(assistant_turns))
    turns[::2] = [{"role": "user", "content": text} for text in user_turns]
    turns[1::2] = [{"role": "assistant", "content": text} for text in assistant_turns]
    return turns


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET_DIR)


def test_the_embedded_tokenizer_ships_the_project_template(tokenizer):
    config = json.loads((TARGET_DIR / "tokenizer_config.json").read_text())
    assert config["chat_template"] == chat_format.CHAT_TEMPLATE
    assert tokenizer.chat_template == chat_format.CHAT_TEMPLATE


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_apply_chat_template_equals_format_prompt(tokenizer, name):
    user_turns, assistant_turns = CONVERSATIONS[name]
    expected_text = chat_format.format_prompt(user_turns, assistant_turns)
    conversation = messages(user_turns, assistant_turns)

    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=True)["input_ids"]

    assert text == expected_text
    assert ids == tokenizer(expected_text, add_special_tokens=False)["input_ids"]
    if len(user_turns) == 1:
        assert ids == chat_prompt_ids(tokenizer, user_turns[0])


def test_a_finished_conversation_ends_with_the_trained_response(tokenizer):
    conversation = messages(["Say hi."], ["hi"])
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert text == chat_format.format_prompt(["Say hi."]) + chat_format.format_response("hi") + "\n"


@pytest.mark.parametrize("roles", [["system", "user"], ["user", "user"], ["assistant"]])
def test_roles_that_format_prompt_cannot_render_are_refused(tokenizer, roles):
    conversation = [{"role": role, "content": "x"} for role in roles]
    with pytest.raises(TemplateError, match="alternate user/assistant"):
        tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)


def test_chat_pipeline_with_the_dspark_draft_equals_the_pipeline_without(tokenizer):
    target = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    draft = AutoModel.from_pretrained(DRAFT_DIR, trust_remote_code=True, dtype=torch.float32).eval()
    chat = pipeline("text-generation", model=target, tokenizer=tokenizer)
    conversation = messages(*CONVERSATIONS["three turns"])

    plain = chat(conversation, max_new_tokens=32, do_sample=False)
    draft.last_stats = None
    speculative = chat(conversation, max_new_tokens=32, do_sample=False, assistant_model=draft)

    assert draft.last_stats is not None and draft.last_stats.rounds > 0  # the call went through DSpark
    assert speculative == plain
    assert plain[0]["generated_text"][-1]["role"] == "assistant"


def test_train_target_export_writes_the_template(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(TARGET_DIR)
    tokenizer.chat_template = None  # as a freshly trained tokenizer (tools/train_target.py's run dir) has none
    args = SimpleNamespace(
        final_dir=str(tmp_path), run_dir=str(tmp_path / "run"), corpus="data/corpus", seq_len=512, batch=8,
        code_frac=0.5, lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0, threads=1,
    )
    state = {"step": 1, "tokens": 512, "loss_tokens": 256, "elapsed": 1.0}

    train_target.export(args, model, tokenizer, state, extra={})

    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"] == chat_format.CHAT_TEMPLATE
    assert AutoTokenizer.from_pretrained(tmp_path).chat_template == chat_format.CHAT_TEMPLATE
