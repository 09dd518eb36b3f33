"""Write the two text workloads the speculative-decoding benchmarks use (`toolkit bench --dataset`
JSONL: {"prompt", "max_tokens"} per line), from CPython's own documentation (`pydoc_data.topics`):

- copy_workload.jsonl: a paragraph, then the request to write it again and its first words. A model
  that continues by copying produces text that n-gram lookup finds in the prompt (n-gram's case).
- python_questions.jsonl: "What is ...?" questions about the language, one per documentation topic,
  the prompts the built-in model is trained to answer (a draft model's case).

    python recipes/make_workloads.py
    toolkit bench throughput --dataset recipes/copy_workload.jsonl \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def topics() -> dict[str, str]:
    import pydoc_data.topics

    return {key: pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)}


def paragraphs(min_chars: int, max_chars: int) -> list[str]:
    found = []
    for text in topics().values():
        for block in re.split(r"\n\s*\n", text):
            para = " ".join(line.strip() for line in block.splitlines())
            if min_chars <= len(para) <= max_chars and para[0].isupper() and para.endswith(".") and "::" not in para:
                found.append(para)
    return found


def questions() -> list[str]:
    """One question per topic heading ("The with statement" -> "What is the with statement?")."""
    found = []
    for text in topics().values():
        lines = text.splitlines()
        for title, underline in zip(lines, lines[1:]):
            if re.fullmatch(r"[*=\-]{3,}", underline.strip()) and 3 < len(title.strip()) < 50:
                subject = title.strip().rstrip(".:")
                subject = subject[0].lower() + subject[1:]
                if not subject.lower().startswith(("note", "footnote", "example")):
                    found.append(f"What is {subject}?")
    return sorted(set(found))


def evenly(items: list, n: int) -> list:
    step = max(1, len(items) // n)
    return items[::step][:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    copy = []
    for text in evenly(paragraphs(300, 700), args.num):
        start = " ".join(text.split()[:6])
        copy.append({"prompt": f"{text}\n\nThe same paragraph again, word for word:\n\n{start}",
                     "max_tokens": args.max_tokens})
    asks = [{"prompt": q, "max_tokens": args.max_tokens} for q in evenly(questions(), args.num)]
    for name, lines in (("copy_workload.jsonl", copy), ("python_questions.jsonl", asks)):
        (args.dir / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
        print(f"{len(lines)} prompts -> {args.dir / name}")


if __name__ == "__main__":
    main()
