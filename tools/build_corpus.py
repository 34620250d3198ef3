#!/usr/bin/env python
"""Build the offline training corpus of the embedded target from this machine's Python sources.

Sources: every ``*.py`` file under the Python install's stdlib directory (which contains
site-packages), walked in sorted order; anything under ``/work`` is excluded (after
resolving symlinks), as are byte-identical duplicate files.

Two kinds of JSONL records are written to ``{out}/train.jsonl`` and ``{out}/heldout.jsonl``:

* ``{"kind": "pair", "prompt": USER_TURN, "response": ASSISTANT_TURN, "source": ...}``
  from functions (top level or methods, dedented) that have a docstring, at least one
  statement after it, and 3..60 lines. The user turn is the HumanEval-style
  ``tools.chat_format.code_user_turn(signature + docstring)``; the response is
  ``tools.chat_format.code_response(whole function)``. Deduplicated on the function text.
* ``{"kind": "code", "text": CHUNK, "source": ...}``: whole-file windows of plain code
  (``--chunk-lines`` lines) for general language modelling, a ``--code-files-frac`` share
  of the files.

The split is by source file (hash of the relative path), so a held-out function's file is
never in train. Deterministic: sorted files, fixed seed. Never reads evaluation data.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import sys
import sysconfig
import textwrap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.chat_format import code_response, code_user_turn  # noqa: E402

EXCLUDE_PREFIXES = ("/work",)
SKIP_DIRS = frozenset({"__pycache__", ".git", "node_modules"})


def iter_py_files(roots: list[str], max_bytes: int, skip_dirs: frozenset[str] = SKIP_DIRS):
    seen_real = set()
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                real = os.path.realpath(path)
                if any(real == p or real.startswith(p + "/") for p in EXCLUDE_PREFIXES):
                    continue
                if real in seen_real or not os.path.isfile(real):
                    continue
                seen_real.add(real)
                try:
                    if os.path.getsize(real) > max_bytes:
                        continue
                except OSError:
                    continue
                yield os.path.relpath(path, root), real


def clean_lines_ok(text: str, max_line: int) -> bool:
    return all(len(line) <= max_line for line in text.splitlines()) and "\t" not in text


def extract_pairs(source: str, min_lines: int, max_lines: int, max_line: int):
    """Yield (signature+docstring, whole function) for the functions worth keeping."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if ast.get_docstring(node, clean=False) is None or len(node.body) < 2:
            continue
        start, end = node.lineno, node.end_lineno  # def line (decorators excluded), 1-based
        n = end - start + 1
        if not (min_lines <= n <= max_lines):
            continue
        doc_end = node.body[0].end_lineno
        func = textwrap.dedent("\n".join(lines[start - 1 : end])).rstrip()
        head = textwrap.dedent("\n".join(lines[start - 1 : doc_end])).rstrip()
        if not func.startswith(("def ", "async def ")) or len(head) >= len(func):
            continue
        if not clean_lines_ok(func, max_line):
            continue
        yield head, func


def split_of(rel: str, heldout_pct: float) -> str:
    h = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 10000
    return "heldout" if h < heldout_pct * 100 else "train"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data/corpus", help="output directory (default: data/corpus)")
    ap.add_argument("--roots", nargs="*", default=None,
                    help="source roots (default: the Python stdlib dir, which holds site-packages)")
    ap.add_argument("--min-lines", type=int, default=3)
    ap.add_argument("--max-lines", type=int, default=60)
    ap.add_argument("--max-line-chars", type=int, default=160, help="drop functions with longer lines")
    ap.add_argument("--max-file-bytes", type=int, default=400_000)
    ap.add_argument("--chunk-lines", type=int, default=60, help="lines per plain-code window")
    ap.add_argument("--code-files-frac", type=float, default=0.35,
                    help="share of (deduplicated) files also cut into plain-code windows")
    ap.add_argument("--heldout-pct", type=float, default=2.0, help="percent of source files held out")
    ap.add_argument("--max-files", type=int, default=0, help="stop after this many files (0 = all; smoke tests)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)

    roots = args.roots or [sysconfig.get_paths()["stdlib"]]
    roots = [os.path.realpath(r) for r in roots]
    for r in roots:
        if any(r == p or r.startswith(p + "/") for p in EXCLUDE_PREFIXES):
            sys.exit(f"refusing root under an excluded prefix: {r}")
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)

    seen_files, seen_funcs = set(), set()
    records = {"train": [], "heldout": []}
    stats = {"files": 0, "dup_files": 0, "unparsable_or_empty": 0, "pairs": 0, "dup_pairs": 0, "chunks": 0}
    for i, (rel, real) in enumerate(iter_py_files(roots, args.max_file_bytes)):
        if args.max_files and i >= args.max_files:
            break
        try:
            with open(real, "rb") as f:
                raw = f.read()
            source = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            stats["unparsable_or_empty"] += 1
            continue
        digest = hashlib.sha1(raw).hexdigest()
        if digest in seen_files:
            stats["dup_files"] += 1
            continue
        seen_files.add(digest)
        stats["files"] += 1
        split = split_of(rel, args.heldout_pct)
        for head, func in extract_pairs(source, args.min_lines, args.max_lines, args.max_line_chars):
            key = hashlib.sha1(func.encode()).hexdigest()
            if key in seen_funcs:
                stats["dup_pairs"] += 1
                continue
            seen_funcs.add(key)
            records[split].append({"kind": "pair", "prompt": code_user_turn(head),
                                   "response": code_response(func), "source": rel})
            stats["pairs"] += 1
        # rng is consumed once per unique file, so the choice is deterministic
        if rng.random() < args.code_files_frac and clean_lines_ok(source, 200) and source.strip():
            lines = source.splitlines()
            for s in range(0, len(lines), args.chunk_lines):
                chunk = "\n".join(lines[s : s + args.chunk_lines]).strip("\n")
                if len(chunk) < 200:
                    continue
                records[split].append({"kind": "code", "text": chunk + "\n", "source": f"{rel}:{s + 1}"})
                stats["chunks"] += 1

    for split, recs in records.items():
        rng.shuffle(recs)
        path = os.path.join(args.out, f"{split}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        n_pair = sum(r["kind"] == "pair" for r in recs)
        chars = sum(len(r.get("prompt", "")) + len(r.get("response", "")) + len(r.get("text", "")) for r in recs)
        stats[split] = {"records": len(recs), "pairs": n_pair, "chunks": len(recs) - n_pair, "chars": chars}
    stats["roots"] = roots
    stats["command"] = "python " + " ".join([os.path.relpath(os.path.abspath(sys.argv[0]))] + sys.argv[1:]) \
        if argv is None else f"build_corpus.main({argv!r})"
    with open(os.path.join(args.out, "stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    print(json.dumps(stats, indent=1))


if __name__ == "__main__":
    main()
