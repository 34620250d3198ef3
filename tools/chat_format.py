"""The one chat template of the embedded pair (target training, draft training, evaluation, demo).

A conversation is rendered as plain text containing the special tokens; the tokenizer
(trained by ``tools/train_target.py``) maps each special token to a single id and adds
nothing on its own, so ``tokenizer(text)["input_ids"]`` is exactly the rendered text::

    <|bos|><|user|>
    {user turn 1}
    <|assistant|>
    {assistant turn 1}<|eos|>
    <|user|>
    {user turn 2}
    <|assistant|>
    <- generation starts here and ends with <|eos|>

``<|mask|>`` never appears in text: it is the DSpark draft's mask token. ``<|pad|>`` only pads.
"""

from __future__ import annotations

BOS = "<|bos|>"
EOS = "<|eos|>"  # also ends every assistant turn
PAD = "<|pad|>"
MASK = "<|mask|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"

#: In id order: the tokenizer gives these ids 0..5.
SPECIAL_TOKENS = [PAD, BOS, EOS, MASK, USER, ASSISTANT]

#: The HumanEval-style instruction used for the code prompt/response pairs.
CODE_INSTRUCTION = "Write a solution to the following problem and make sure that it passes the tests:\n"


def code_user_turn(code_prompt: str) -> str:
    """User turn for a code problem (signature + docstring), HumanEval eval style."""
    return f"{CODE_INSTRUCTION}```python\n{code_prompt.strip(chr(10))}\n```"


def code_response(code: str) -> str:
    """Assistant turn for a code answer (a whole function), without the closing EOS."""
    return f"```python\n{code.strip(chr(10))}\n```"


def format_prompt(user_turns: list[str], assistant_turns: list[str] | None = None) -> str:
    """Render a conversation ending with an open assistant turn.

    ``assistant_turns`` holds the answers to all but the last user turn (default: none,
    so ``user_turns`` must then have one element).
    """
    assistant_turns = list(assistant_turns or [])
    if not user_turns or len(assistant_turns) != len(user_turns) - 1:
        raise ValueError("need len(assistant_turns) == len(user_turns) - 1 >= 0")
    text = BOS
    for i, user in enumerate(user_turns):
        text += f"{USER}\n{user}\n{ASSISTANT}\n"
        if i < len(assistant_turns):
            text += f"{assistant_turns[i]}{EOS}\n"
    return text


#: The same rendering as a Jinja chat template (``tokenizer.apply_chat_template``), shipped in the embedded
#: target's ``tokenizer_config.json`` and written by ``tools/train_target.py``'s export. Turns alternate user,
#: assistant, user, ... (no system turn); ``add_generation_prompt`` opens the assistant turn.
CHAT_TEMPLATE = (
    f"{BOS}"
    "{% for message in messages %}"
    "{% if message['role'] != ['user', 'assistant'][loop.index0 % 2] %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/... starting with user.') }}"
    "{% elif message['role'] == 'user' %}"
    f"{USER}\n{{{{ message['content'] }}}}\n"
    "{% else %}"
    f"{ASSISTANT}\n{{{{ message['content'] }}}}{EOS}\n"
    "{% endif %}"
    "{% endfor %}"
    f"{{% if add_generation_prompt %}}{ASSISTANT}\n{{% endif %}}"
)


def format_response(response: str) -> str:
    """The assistant text as trained (the response followed by the EOS that ends the turn)."""
    return response + EOS


def format_plain(text: str) -> str:
    """A plain (non-chat) document, e.g. a code chunk for language modelling."""
    return BOS + text + EOS
