"""Write data/sft/chat.jsonl: a small chat set about the bundled public-domain novels.

Questions and answers about the chapters of Moby-Dick (Herman Melville, 1851) and the first
eleven chapters of Emma (Jane Austen, 1815), taken from data/corpus/mobydick.jsonl and
data/corpus/austen_emma_excerpt.jsonl: chapter titles, chapter openings, which chapter a title or
an opening belongs to, and who wrote each book. Some conversations have a system prompt and
several turns; some rows hold two conversations (each starting at its system message). The
output is deterministic (a fixed seed); run from the repository root:

    python examples/sft/make_chat_set.py [--output data/sft/chat.jsonl]
"""

import argparse
import json
import os
import random
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSTEM = (
    "You are a librarian who answers questions about two public-domain novels, Moby-Dick by "
    "Herman Melville and Emma by Jane Austen. Answer in one sentence."
)
ROMAN = ["I", "II", "III", "IV", "V", "VI", "VII", "VIII", "IX", "X", "XI"]


def _opening(body: str, words: int = 28) -> str:
    """The first sentence of a chapter body, cut after `words` words."""
    text = " ".join(body.split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    sentence = match.group(1) if match else text
    parts = sentence.split(" ")
    return sentence if len(parts) <= words else " ".join(parts[:words]) + " ..."


def _chapters():
    """(book, chapter label, title or None, opening) for every chapter of both books."""
    out = []
    with open(os.path.join(REPO, "data", "corpus", "mobydick.jsonl")) as f:
        for line in f:
            text = json.loads(line)["text"]
            m = re.match(r"CHAPTER (\d+)\. (.*?)\n(.*)", text, flags=re.S)
            if m:
                out.append(("Moby-Dick", m.group(1), m.group(2).strip(), _opening(m.group(3))))
    with open(os.path.join(REPO, "data", "corpus", "austen_emma_excerpt.jsonl")) as f:
        for line in f:
            text = json.loads(line)["text"]
            m = re.match(r"CHAPTER ([IVX]+)\n(.*)", text, flags=re.S)
            if m:
                out.append(("Emma", m.group(1), None, _opening(m.group(2))))
    return out


def _author(book):
    return "Herman Melville" if book == "Moby-Dick" else "Jane Austen"


def _turns(rng, book, label, title, opening):
    """Two question-answer pairs about one chapter."""
    pairs = []
    if title is not None:
        title = title.rstrip(".")
        asks = [
            (
                f"What is the title of chapter {label} of {book}?",
                f"Chapter {label} of {book} is titled \u201c{title}\u201d.",
            ),
            (
                f"Which chapter of {book} is called \u201c{title}\u201d?",
                f"\u201c{title}\u201d is chapter {label} of {book}.",
            ),
        ]
        rng.shuffle(asks)
        pairs += asks[: 1 + (rng.random() < 0.5)]
    first_words = " ".join(opening.split()[:8])
    pairs.append(
        rng.choice(
            [
                (
                    f"How does chapter {label} of {book} begin?",
                    f"It begins: \u201c{opening}\u201d",
                ),
                (
                    f"Which book and chapter open with \u201c{first_words}\u201d?",
                    f"That is the opening of chapter {label} of {book} by {_author(book)}.",
                ),
            ]
        )
    )
    if title is None:
        pairs.append(
            (f"Who wrote {book}?", f"{book} was written by {_author(book)}.")
            if rng.random() < 0.5
            else (
                f"Is chapter {label} of {book} from the first volume?",
                f"Yes, chapter {label} of {book} is in its first volume.",
            )
        )
    return pairs


def _conversation(rng, chapter):
    pairs = _turns(rng, *chapter)
    style = rng.random()
    if style < 0.3:  # system prompt, several turns
        messages = [{"role": "system", "content": SYSTEM}]
        for q, a in pairs:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return [messages]
    # single-turn conversations, one per pair, some with a system prompt
    out = []
    for q, a in pairs:
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
        out.append(messages + [{"role": "user", "content": q}, {"role": "assistant", "content": a}])
    return out


def build_rows(seed: int = 1234):
    """The rows of the chat set (a list of {"messages": [...]})."""
    rng = random.Random(seed)
    conversations = []
    for chapter in _chapters():
        conversations += _conversation(rng, chapter)
    rng.shuffle(conversations)
    rows = []
    i = 0
    while i < len(conversations):
        first = conversations[i]
        second = conversations[i + 1] if i + 1 < len(conversations) else None
        # Two conversations share a row when the second starts with its system message.
        if second is not None and second[0]["role"] == "system" and rng.random() < 0.5:
            rows.append({"messages": first + second})
            i += 2
        else:
            rows.append({"messages": first})
            i += 1
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=os.path.join(REPO, "data", "sft", "chat.jsonl"))
    args = parser.parse_args(argv)
    rows = build_rows()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    conversations = sum(1 + sum(m["role"] == "system" for m in r["messages"][1:]) for r in rows)
    print(f"wrote {len(rows)} rows ({conversations} conversations) to {args.output}")


if __name__ == "__main__":
    main()
