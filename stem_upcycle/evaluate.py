"""`stem-upcycle eval`: perplexity on held-out text, and agreement with a reference model.

Text is tokenised once and cut into fixed, non-overlapping windows; every window is scored on its
own (no context carried across windows), so figures are comparable between models that share a
tokenizer, whatever their architecture.
"""

import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from .documents import read_documents
from .errors import UserError
from .hub_datasets import DatasetSpec, is_dataset


class EvalError(UserError):
    pass


def parse_sets(specs: list[str]) -> dict[str, list[str]]:
    """Held-out sets from `--data` values: `NAME=FILE` puts FILE into set NAME (repeat a name to join files),
    a bare FILE is a set named after the file."""
    sets: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or Path(spec).exists() or not re.fullmatch(r"[\w.-]+", name):
            name, path = Path(spec).stem, spec
        if is_dataset(path):  # a Hub dataset (fetched by the caller), named after its repository
            repo = DatasetSpec.parse(path, f"--data {spec}").repo
            name = name if sep and name != Path(spec).stem else repo.split("/")[1]
        elif not Path(path).is_file():
            raise EvalError(f"--data {spec}: {path} is not a file; give FILE, NAME=FILE or hf:ORG/NAME[/GLOB]")
        sets.setdefault(name, []).append(path)
    return sets


def read_token_ids(files: list[str], tokenizer, max_tokens: int | None, text_field: str = "text") -> torch.Tensor:
    """[n] ids of the files' documents (.txt, .jsonl records, .parquet rows: their `text_field`) joined by blank
    lines, at most `max_tokens`: only as much text is read as that many tokens can take (16 characters a token)."""
    budget = 16 * max_tokens if max_tokens else None
    texts, chars = [], 0
    for document in read_documents([Path(f) for f in files], text_field, max_chars=budget):
        texts.append(document)
        chars += len(document) + 2
        if budget and chars >= budget:
            break
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids[:max_tokens] if max_tokens else ids, dtype=torch.long)


def evaluate(model, ids: torch.Tensor, window: int = 512, reference=None, progress=None, before_window=None) -> dict:
    """Perplexity of `model` on `ids` in windows; with `reference`, also KL(ref || model) and top-1 agreement.
    `before_window(chunk)` runs before each window's forward (e.g. to hand a hooked dense model its ids)."""
    if ids.numel() < window:
        raise EvalError(f"the text has {ids.numel()} tokens, fewer than one window of {window}; give more text or a smaller --window")
    nll = ref_nll = kl = agree = 0.0
    tokens = 0
    starts = range(0, ids.numel() - window + 1, window)
    with torch.no_grad():
        for start in starts if progress is None else progress(starts):
            chunk = ids[start : start + window][None].to(model.device)  # [1, window]
            targets = chunk[0, 1:]  # each position predicts the next token
            if before_window is not None:
                before_window(chunk)
            logp = F.log_softmax(model(chunk, use_cache=False).logits[0, :-1].float(), -1)  # [window - 1, vocab]
            nll += F.nll_loss(logp, targets, reduction="sum").item()
            tokens += targets.numel()
            if reference is not None:
                ref_logits = reference(chunk.to(reference.device), use_cache=False).logits[0, :-1].to(logp.device)
                ref_logp = F.log_softmax(ref_logits.float(), -1)
                ref_nll += F.nll_loss(ref_logp, targets, reduction="sum").item()
                kl += F.kl_div(logp, ref_logp, log_target=True, reduction="sum").item()
                agree += (logp.argmax(-1) == ref_logp.argmax(-1)).sum().item()
    return {**figures(nll, tokens, *((ref_nll, kl, agree) if reference is not None else ())), "window": window}


def figures(nll: float, tokens: int, ref_nll: float | None = None, kl: float | None = None,
            agree: float | None = None) -> dict:
    """The figures every perplexity in stem-upcycle reports, from sums over `tokens` predicted tokens:
    {"ppl", "tokens"} and, with a reference's sums, {"ref_ppl", "ppl_ratio", "kl", "top1_agreement"}."""
    result = {"ppl": math.exp(nll / tokens), "tokens": tokens}
    if ref_nll is not None:
        result.update(ref_ppl=math.exp(ref_nll / tokens), ppl_ratio=math.exp((nll - ref_nll) / tokens),
                      kl=kl / tokens, top1_agreement=agree / tokens)
    return result


def check_same_vocabulary(model, reference, model_spec: str, reference_spec: str) -> None:
    a, b = model.config.vocab_size, reference.config.vocab_size
    if a != b:
        raise EvalError(f"{model_spec} has a vocabulary of {a} and {reference_spec} one of {b}; a reference must share the tokenizer")


def describe(results: dict, model_spec: str, reference_spec: str | None) -> str:
    """A table, one row per held-out set; factual recall below it when scored."""
    sets = results["sets"]
    window = results["window"]
    where = f", {results['device']}, {results['dtype']}" if "device" in results else ""
    lines = [f"{model_spec} (windows of {window} tokens{where})" + (f" against {reference_spec}" if reference_spec else "")]
    header = f"{'set':<16} {'tokens':>7} {'perplexity':>11}"
    if reference_spec:
        header += f" {'reference':>10} {'ratio':>7} {'KL(ref||model)':>15} {'top-1 agreement':>16}"
    lines.append(header)
    for name, r in sets.items():
        row = f"{name:<16} {r['tokens']:>7} {r['ppl']:>11.4g}"
        if reference_spec:
            row += (f" {r['ref_ppl']:>10.4g} {r['ppl_ratio']:>6.3f}x {r['kl']:>15.4g} "
                    f"{r['top1_agreement']:>16.1%}")
        lines.append(row)
    if facts := results.get("facts"):
        line = f"factual recall   {facts['correct']}/{facts['total']} greedy completions correct"
        if ref := results.get("reference_facts"):
            line += f" (reference {ref['correct']}/{ref['total']})"
        lines.append(line)
    return "\n".join(lines)
