"""Training data: text and JSON-lines files, tokenised, packed into fixed-length sequences.

Documents (a .txt file, or one record of a .jsonl file) are tokenised, joined with the EOS token
between them and cut into sequences of `seq_len + 1` tokens (inputs and their next-token targets).
The order is a permutation drawn from the recipe's seed, so step s reads the same sequences on
every run, on any number of processes; that is what makes resume exact.
"""

import glob
import json
from pathlib import Path

import torch

from ..errors import UserError


class DataError(UserError):
    pass


def expand_files(patterns: list[str], what: str) -> list[Path]:
    """Files named by paths or glob patterns, in sorted order, each named once."""
    files = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not found or not all(Path(f).is_file() for f in found):
            raise DataError(f"{what}: {pattern!r} matches no file; check the path (relative to {Path.cwd()})")
        files += [Path(f) for f in found if Path(f) not in files]
    return files


def read_documents(files: list[Path], text_field: str = "text") -> list[str]:
    documents = []
    for path in files:
        if path.suffix == ".jsonl":
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise DataError(f"{path}:{number} is not valid JSON; a .jsonl file has one object per line") from None
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise DataError(f"{path}:{number} has no string field {text_field!r}; set data.text_field")
                documents.append(record[text_field])
        else:
            documents.append(path.read_text(encoding="utf-8", errors="replace"))
    return documents


def pack(documents: list[str], tokenizer, seq_len: int, max_tokens: int = 0) -> torch.Tensor:
    """[n, seq_len + 1] token ids: documents joined with EOS, cut into equal sequences (the tail dropped)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no EOS token to put between documents")
    stream = []
    for text in documents:
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        if max_tokens and len(stream) >= max_tokens:
            break
    if max_tokens:
        stream = stream[:max_tokens]
    n = (len(stream) - 1) // seq_len
    if n == 0:
        raise DataError(f"the data has {len(stream)} tokens, fewer than one sequence of {seq_len + 1}")
    ids = torch.tensor(stream[: n * seq_len + 1], dtype=torch.long)
    # Sequence i is ids[i*seq_len : (i+1)*seq_len + 1]: consecutive sequences share one token, so
    # that every token of the stream but the first is a target exactly once.
    return ids.unfold(0, seq_len + 1, seq_len).contiguous()


class Batches:
    """Which sequences each optimizer step reads: a seeded permutation, repeated epoch after epoch."""

    def __init__(self, sequences: torch.Tensor, batch_size: int, seed: int):
        if sequences.shape[0] < batch_size:
            raise DataError(f"the training data makes {sequences.shape[0]} sequences, fewer than one batch of {batch_size}; "
                            f"add data or lower train.batch_size")
        self.sequences, self.batch_size, self.seed = sequences, batch_size, seed
        self.per_epoch = sequences.shape[0] // batch_size

    def step(self, step: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] for optimizer step `step` (0-based), the same on every run."""
        epoch, index = divmod(step, self.per_epoch)
        order = torch.randperm(self.sequences.shape[0], generator=torch.Generator().manual_seed(self.seed + epoch))
        return self.sequences[order[index * self.batch_size : (index + 1) * self.batch_size]]


def load_data(recipe, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(train sequences, held-out sequences), both [n, seq_len + 1]."""
    d = recipe.data
    eval_files = expand_files(d.eval, "data.eval")
    train_files = [f for f in expand_files(d.train, "data.train") if f not in eval_files]  # held out: never trained on
    if not train_files:
        raise DataError("data.train names only held-out files; list training text that data.eval does not name")
    sequences = pack(read_documents(train_files, d.text_field), tokenizer, d.seq_len, d.max_train_tokens)
    if d.eval:
        heldout = pack(read_documents(eval_files, d.text_field), tokenizer, d.seq_len, d.eval_tokens + 1)
    else:
        count = max(1, round(sequences.shape[0] * d.heldout_fraction)) if d.heldout_fraction else 0
        if count >= sequences.shape[0]:
            raise DataError("data.heldout_fraction leaves no training sequence; lower it or give data.eval files")
        sequences, heldout = sequences[: sequences.shape[0] - count], sequences[sequences.shape[0] - count :]
        heldout = heldout[: max(1, d.eval_tokens // d.seq_len)]
    return sequences, heldout
