"""Factual recall: short prompts that a model completes greedily, scored by the expected answer.

Perplexity on held-out text says how well a model predicts text on average; it can stay close to
the parent's while the model forgets what the parent knew ("The capital of Spain is" -> "the
Spanish capital" instead of "Madrid"). This scores that directly. The packaged set
(`facts.jsonl`) holds prompts that the demo model, SmolLM2-135M-Instruct, completes correctly;
a user's own set is a JSON-lines file of {"prompt": ..., "answers": [...]} records.

A completion is correct when one of the answers appears in its first line as whole words,
ignoring case.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError

PACKAGED = Path(__file__).parent / "facts.jsonl"
NEW_TOKENS = 8  # greedy tokens per completion: room for a name of several words


class FactsError(UserError):
    pass


@dataclass(frozen=True)
class Fact:
    prompt: str
    answers: tuple[str, ...]

    def is_answered_by(self, completion: str) -> bool:
        first_line = completion.strip().split("\n", 1)[0]
        return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", first_line, re.IGNORECASE) for a in self.answers)


def load_facts(path: str | Path | None = None) -> list[Fact]:
    path = Path(path) if path else PACKAGED
    facts = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise FactsError(f"cannot read the facts file {path}: {err.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            facts.append(Fact(str(record["prompt"]), tuple(str(a) for a in record["answers"])))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise FactsError(f"{path}:{number} is not a JSON object with a prompt and a list of answers") from None
    if not facts:
        raise FactsError(f"{path} holds no facts; one JSON object per line: {{\"prompt\": ..., \"answers\": [...]}}")
    return facts


@torch.no_grad()
def complete(model, tokenizer, prompt: str, new_tokens: int = NEW_TOKENS) -> str:
    """The greedy completion of `prompt`, decoded (one prompt at a time: no padding to get wrong)."""
    inputs = tokenizer(prompt, return_tensors="pt", return_token_type_ids=False).to(model.device)
    out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def score_facts(model, tokenizer, facts: list[Fact]) -> dict:
    """{"correct", "total", "accuracy", "completions": [{"prompt", "completion", "correct"}]}."""
    rows = []
    for fact in facts:
        text = complete(model, tokenizer, fact.prompt)
        rows.append({"prompt": fact.prompt, "completion": text, "correct": fact.is_answered_by(text)})
    correct = sum(r["correct"] for r in rows)
    return {"correct": correct, "total": len(rows), "accuracy": correct / len(rows), "completions": rows}
