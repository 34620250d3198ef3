"""tools/build_prompts.py: the chat-model prompt mix keeps every evaluation prompt out."""

import json

from tools import build_prompts
from tools.chat_format import code_user_turn
from tools.common import read_jsonl

EVAL_QUESTION = "Tom has 3 apples and buys 5 more apples at the market. How many apples does he have now?"
SOURCE = '''
def area_of_circle(radius):
    """Returns the area of a circle with the given radius."""
    import math
    return math.pi * radius ** 2


def _private_helper(x):
    """Returns the private value of x for tests."""
    y = x
    return y
'''


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_prompts_sharing_an_ngram_with_an_eval_prompt_are_dropped_but_boilerplate_is_not(tmp_path):
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    # Five HumanEval-style rows share the instruction line (boilerplate); one GSM8K row is a real question.
    stubs = [code_user_turn(f"def task_{i}():\n    pass") for i in range(5)]
    write_jsonl(eval_dir / "humaneval.jsonl", [{"turns": [stub]} for stub in stubs])
    write_jsonl(eval_dir / "gsm8k.jsonl", [{"turns": [EVAL_QUESTION]}])
    gsm8k = tmp_path / "gsm8k_train.jsonl"
    write_jsonl(gsm8k, [{"question": EVAL_QUESTION.replace("Tom", "Ann")},  # shares 8-grams: contaminated
                        {"question": "A farmer plants 12 rows of 9 trees each. How many trees are planted?"}])
    (tmp_path / "src" / "site-packages" / "installed").mkdir(parents=True)
    (tmp_path / "src" / "geometry.py").write_text(SOURCE)
    # Installed packages vary between machines: left out, so the prompts depend on the Python version alone.
    (tmp_path / "src" / "site-packages" / "installed" / "shapes.py").write_text(SOURCE.replace("circle", "square"))

    report = build_prompts.main(["--out", str(tmp_path / "out"), "--gsm8k", str(gsm8k), "--roots",
                                 str(tmp_path / "src"), "--eval-dir", str(eval_dir), "--per-kind", "10",
                                 "--heldout-per-kind", "0"])
    train = read_jsonl(tmp_path / "out" / "train.jsonl")
    prompts = [row["prompt"] for row in train]

    assert report["kinds"]["math"] == {"candidates": 2, "overlapping_eval": 1, "train": 1, "heldout": 0}
    assert not any("apples" in prompt for prompt in prompts)
    code = sorted(row["prompt"] for row in train if row["kind"] == "code")  # the instruction is boilerplate
    assert len(code) == 2 and "def area_of_circle(radius):" in code[0] + code[1]
    assert not any("square" in prompt for prompt in prompts)
    assert report["kinds"]["chat"]["train"] == 10 and report["train_heldout_overlap"] == 0


def test_a_prompt_shorter_than_an_ngram_is_dropped_when_its_words_appear_in_an_eval_turn(tmp_path):
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    write_jsonl(eval_dir / "mbpp.jsonl", [{"turns": ["Write a function to reverse words in a given string."]}])
    overlaps_eval = build_prompts.EvalOverlap(eval_dir, n=8, boilerplate_rows=5)
    assert overlaps_eval("Write a function to reverse words")  # 6 words: no 8-gram, but inside the turn
    assert not overlaps_eval("Write a function to sort words")
    assert overlaps_eval("Please write a function to reverse words in a given string now")  # an 8-gram


def test_mbpp_style_requests_read_as_tasks():
    head = 'def area_of_circle(radius):\n    """Returns the area of a circle with the given radius."""'
    assert build_prompts.mbpp_request(head) == (
        "Write a python function `area_of_circle` to return the area of a circle with the given radius."
    )
    assert build_prompts.mbpp_request('def f():\n    """area."""') is None


def test_a_later_batch_of_training_prompts_is_disjoint_and_keeps_the_heldout_prompts(tmp_path):
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    write_jsonl(eval_dir / "gsm8k.jsonl", [{"turns": [EVAL_QUESTION]}])
    gsm8k = tmp_path / "gsm8k_train.jsonl"
    questions = [f"A shop sells {n} pens a day for {n + 3} days. How many pens?" for n in range(40)]
    write_jsonl(gsm8k, [{"question": question} for question in questions])
    (tmp_path / "src").mkdir()
    common = ["--gsm8k", str(gsm8k), "--roots", str(tmp_path / "src"), "--eval-dir", str(eval_dir),
              "--heldout-per-kind", "5"]

    def prompts(folder, *extra):
        build_prompts.main(["--out", str(tmp_path / folder), *common, *extra])
        return ({row["prompt"] for row in read_jsonl(tmp_path / folder / f"{split}.jsonl")}
                for split in ("train", "heldout"))

    first_train, first_heldout = prompts("first", "--per-kind", "12")
    later_train, later_heldout = prompts("later", "--per-kind", "12", "--train-skip-per-kind", "12")
    both_train, _ = prompts("both", "--per-kind", "24")

    assert later_heldout == first_heldout and not later_train & first_train
    assert len(later_train) == 24  # 12 math + 12 chat
    assert first_train | later_train == both_train  # the two batches are one larger run, split in two
