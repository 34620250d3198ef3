#!/usr/bin/env python
"""Build the chat-model prompt mix (math, code, general chat) for regenerated draft-training data.

Three sources, all disjoint from the evaluation sets in eval/ (checked below):

- math: questions of the GSM8K *training* split (`--gsm8k`, MIT; eval/gsm8k.jsonl is the test split);
- code: functions with a docstring from the Python standard library's sources (tools/build_corpus.py's walk,
  `site-packages` left out so that the prompts depend on the Python version alone, not on what is installed), asked
  two ways: HumanEval style (signature + docstring, `chat_format.code_user_turn`) and MBPP style ("Write a
  python function to <the docstring's first sentence>");
- chat: instructions composed from the templates and topics below (written for this project, MIT), in the
  manner of MT-Bench's writing, reasoning and advice prompts.

Contamination check: a prompt is dropped when it shares any word `--ngram`-gram (lower-cased words) with
any turn of any evaluation set, format boilerplate aside (n-grams found in `--boilerplate-rows` or more
evaluation rows, such as HumanEval's instruction line); the counts are reported. Prompts are deduplicated.
Each source is shuffled with `--seed` and split into held-out prompts (the first `--heldout-per-kind`) and
training prompts (the next `--per-kind`, after skipping `--train-skip-per-kind`): the split depends only on the
seed and the sources, so a later run with `--train-skip-per-kind` equal to an earlier run's `--per-kind` gives new
training prompts, disjoint from that run's, and the same held-out prompts. Output in --out: `train.jsonl`,
`heldout.jsonl` (`{"prompt", "kind", "source"}` per line, what tools/regenerate_data.py reads) and
`prompts.json` (counts, overlap report).

Examples (the shipped prompt sets; the second is the next 400 training prompts per kind):
    python tools/build_prompts.py --out data/chat_prompts --per-kind 400 --heldout-per-kind 48
    python tools/build_prompts.py --out data/chat_prompts_2 --per-kind 400 --train-skip-per-kind 400
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import sys
import sysconfig
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere
from tools.build_corpus import SKIP_DIRS, extract_pairs, iter_py_files  # noqa: E402
from tools.chat_format import code_user_turn  # noqa: E402
from tools.common import EVAL_DIR, REPO_ROOT, read_jsonl, write_json  # noqa: E402

KINDS = ("math", "code", "chat")
CODE_SKIP_DIRS = SKIP_DIRS | {"site-packages"}  # installed packages differ between machines; the stdlib does not

CHAT_TEMPLATES = (
    "Write a short blog post about {topic}.",
    "Explain {topic} to a curious ten-year-old.",
    "Give me five practical tips about {topic}.",
    "What are the main advantages and disadvantages of {topic}?",
    "Write a persuasive paragraph arguing that everyone should learn about {topic}.",
    "Summarize the history of {topic} in a few sentences.",
    "Compose a short poem about {topic}.",
    "Draft a friendly email inviting a colleague to a workshop on {topic}.",
    "What are common misconceptions about {topic}, and what is the truth?",
    "Describe a typical day for someone whose job involves {topic}.",
    "Write a dialogue between a teacher and a student about {topic}.",
    "Create a simple three-step plan for a beginner interested in {topic}.",
    "Compare {topic} today with how it was fifty years ago.",
    "Write a product description for a new app related to {topic}.",
    "What questions should I ask an expert in {topic}?",
    "Tell a short story in which {topic} plays an important role.",
)
CHAT_TOPICS = (
    "gardening", "renewable energy", "time management", "the solar system", "baking bread", "public libraries",
    "learning a second language", "urban cycling", "volcanoes", "personal budgeting", "classical music",
    "ocean currents", "board games", "healthy sleep", "recycling", "the printing press", "photography",
    "remote work", "bees and pollination", "chess", "marathon training", "cloud computing", "ancient Egypt",
    "climate change", "first aid", "museums", "rainforests", "electric cars", "meditation", "job interviews",
    "the human heart", "street food", "wind turbines", "public speaking", "birdwatching", "the Olympic Games",
    "coffee", "friendship", "space exploration", "the water cycle", "online privacy", "composting",
    "jazz", "mountain hiking", "robots", "vaccines", "small businesses", "volunteering", "desert animals",
    "three-dimensional printing", "trains", "origami", "the immune system", "writing a novel", "tea",
    "earthquakes", "video games", "fossils", "kindness", "the internet",
)


# ---------------------------------------------------------------------------------------------- sources
def math_prompts(gsm8k_path: str) -> list[dict]:
    return [{"prompt": row["question"], "kind": "math", "source": f"gsm8k-train:{index}"}
            for index, row in enumerate(read_jsonl(gsm8k_path))]


def code_prompts(roots: list[str], max_files: int) -> list[dict]:
    """Per function with a docstring (3..40 lines): a HumanEval-style stub, and where the docstring's first
    sentence reads as a task, an MBPP-style request; alternating, one prompt per function."""
    prompts, seen = [], set()
    for index, (relative, real) in enumerate(iter_py_files(roots, 200_000, CODE_SKIP_DIRS)):
        if max_files and index >= max_files:
            break
        try:
            source = Path(real).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for head, function in extract_pairs(source, 3, 40, 120):
            if head in seen:
                continue
            seen.add(head)
            request = mbpp_request(head)
            if request is not None and len(prompts) % 2:
                prompts.append({"prompt": request, "kind": "code", "source": f"mbpp-style:{relative}"})
            else:
                prompts.append({"prompt": code_user_turn(head), "kind": "code",
                                "source": f"humaneval-style:{relative}"})
    return prompts


def mbpp_request(head: str) -> str | None:
    """'Write a python function to <first docstring sentence>.' or None when it does not read as a task."""
    match = re.search(r'"""\s*(.+?)(?:\.\s|\.?"""|\n\s*\n)', head, re.S)
    if match is None:
        return None
    sentence = " ".join(match.group(1).split())
    words = sentence.split()
    if not 4 <= len(words) <= 30 or not words[0][0].isupper() or not words[0].endswith("s"):
        return None  # "Returns the ...", "Computes ...": an imperative-ish summary
    verb = words[0][:-1].lower()  # "Returns" -> "return"
    name = re.search(r"def\s+(\w+)", head).group(1)
    return f"Write a python function `{name}` to {verb} {' '.join(words[1:])}."


def chat_prompts() -> list[dict]:
    return [{"prompt": template.format(topic=topic), "kind": "chat", "source": f"template:{t}:{topic}"}
            for (t, template), topic in itertools.product(enumerate(CHAT_TEMPLATES), CHAT_TOPICS)]


# ---------------------------------------------------------------------------------------------- overlap
def words_of(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = words_of(text)
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


class EvalOverlap:
    """Whether a prompt overlaps the evaluation sets: it shares a word n-gram with an evaluation turn (format
    boilerplate aside: n-grams found in `boilerplate_rows` rows or more), or, when shorter than n words, all its
    words appear in a row of a turn (an n-gram test cannot see a prompt that short)."""

    def __init__(self, eval_dir: Path, n: int, boilerplate_rows: int):
        rows_with, self.turns = Counter(), []
        for path in sorted(eval_dir.glob("*.jsonl")):
            for row in read_jsonl(path):
                rows_with.update(set().union(*(word_ngrams(turn, n) for turn in row["turns"])))
                self.turns += [f" {' '.join(words_of(turn))} " for turn in row["turns"]]
        self.ngrams = {gram for gram, rows in rows_with.items() if rows < boilerplate_rows}
        self.n = n

    def __call__(self, prompt: str) -> bool:
        words = words_of(prompt)
        if len(words) < self.n:
            return any(f" {' '.join(words)} " in turn for turn in self.turns)
        return bool(word_ngrams(prompt, self.n) & self.ngrams)


# ---------------------------------------------------------------------------------------------- main
def build(args) -> dict:
    roots = args.roots or [sysconfig.get_paths()["stdlib"]]
    sources = {"math": math_prompts(args.gsm8k), "code": code_prompts(roots, args.max_files), "chat": chat_prompts()}
    overlaps_eval = EvalOverlap(Path(args.eval_dir), args.ngram, args.boilerplate_rows)
    rng = random.Random(args.seed)
    splits = {"train": [], "heldout": []}
    report = {"ngram": args.ngram, "train_skip_per_kind": args.train_skip_per_kind, "kinds": {}}
    for kind in KINDS:
        prompts = list({p["prompt"]: p for p in sources[kind]}.values())  # deduplicated
        clean = [p for p in prompts if not overlaps_eval(p["prompt"])]
        rng.shuffle(clean)
        heldout = clean[: args.heldout_per_kind]
        train = clean[args.heldout_per_kind + args.train_skip_per_kind :][: args.per_kind]
        splits["heldout"] += heldout
        splits["train"] += train
        report["kinds"][kind] = {"candidates": len(prompts), "overlapping_eval": len(prompts) - len(clean),
                                 "train": len(train), "heldout": len(heldout)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, prompts in splits.items():
        rng.shuffle(prompts)  # kinds interleaved: any prefix of a file is a mix
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts)
    train_prompts = {p["prompt"] for p in splits["train"]}
    report["train_heldout_overlap"] = sum(p["prompt"] in train_prompts for p in splits["heldout"])
    write_json(out / "prompts.json", report)
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/chat_prompts", help="output folder (default: %(default)s)")
    parser.add_argument("--gsm8k", default=str(REPO_ROOT.parent / "shared/data/train/gsm8k_train.jsonl"),
                        help="GSM8K training split, JSON lines with `question` (default: %(default)s)")
    parser.add_argument("--roots", nargs="*", default=None,
                        help="Python source roots, installed packages left out (default: the stdlib dir)")
    parser.add_argument("--max-files", type=int, default=0, help="source files to walk (default: 0 = all)")
    parser.add_argument("--eval-dir", default=str(EVAL_DIR), help="evaluation sets checked for overlap")
    parser.add_argument("--ngram", type=int, default=8, help="word n-gram length of the overlap check")
    parser.add_argument("--boilerplate-rows", type=int, default=5,
                        help="eval n-grams in this many rows or more are format boilerplate, not content")
    parser.add_argument("--per-kind", type=int, default=400, help="training prompts per kind")
    parser.add_argument("--train-skip-per-kind", type=int, default=0,
                        help="training prompts per kind to skip (an earlier run's --per-kind: a disjoint batch)")
    parser.add_argument("--heldout-per-kind", type=int, default=48, help="held-out prompts per kind")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv=None) -> dict:
    report = build(build_parser().parse_args(argv))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
