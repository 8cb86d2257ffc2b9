"""Training data: text, JSON-lines and parquet files, tokenised into a cached token stream, cut into sequences.

Documents (a .txt file, a .jsonl record, a .parquet row; see documents.py) are tokenised once into a file of ids on
disk, joined with the EOS token between them (see tokens.py), and cut into sequences of
`seq_len + 1` tokens (inputs and their next-token targets) read as each step needs them. The
order is a permutation drawn from the recipe's seed, so step s reads the same sequences on every
run, on any number of processes; that is what makes resume exact.
"""

import glob
import math
import sys
from pathlib import Path

import torch

from ..generate import as_stream, cache_root
from ..hub import DiskNeed, check_disk, download_need
from ..hub_datasets import DatasetSpec, Resolved, download, is_dataset, resolve
from .tokens import DataError, Sequences, token_dtype, tokenised, tokenize_corpus, tokenize_prefix


def expand_files(patterns: list[str], what: str, datasets: dict[str, Resolved] | None = None) -> list[Path]:
    """Files named by paths, glob patterns or `hf:` datasets (their files as `fetch_datasets` resolved them), in
    sorted order, each named once."""
    files = []
    for pattern in patterns:
        if is_dataset(pattern):
            if not datasets or pattern not in datasets:
                raise DataError(f"{what}: {pattern} is not fetched yet")  # a plan's estimate: the callers go without
            files += [f for f in datasets[pattern].paths if f not in files]
            continue
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not found or not all(Path(f).is_file() for f in found):
            raise DataError(f"{what}: {pattern!r} matches no file; check the path (relative to {Path.cwd()})")
        files += [Path(f) for f in found if Path(f) not in files]
    return files


def text_needs(recipe) -> dict[str, int]:
    """Tokens the run reads of each `hf:` dataset it names (the most any of its uses reads from its start): the
    training steps' sequences (a weighted entry its share, plain entries an equal share each), the calibration's
    share of model.calib_tokens, and each held-out set's data.eval_tokens."""
    from ..table_init import INITIALISERS

    d, g, m = recipe.data, recipe.generated, recipe.model
    needs: dict[str, int] = {}

    def need(entry: str, tokens: float) -> None:
        if is_dataset(entry):
            needs[entry] = max(needs.get(entry, 0), math.ceil(tokens))

    for entry, tokens in training_reads(recipe):
        need(entry, tokens)
    calib = m.calib_data or d.train_sources()
    if calib and not m.init_from and INITIALISERS[m.init].needs_data:
        generated = g.calib_share if g.tokens else 0.0
        for entry in calib:
            need(entry, m.calib_tokens * (1 - generated) / len(calib))
    for entry in (entry for entries in d.eval.values() for entry in entries):
        need(entry, max(1, d.eval_tokens // d.seq_len) * d.seq_len + 1)
    return needs


def training_reads(recipe) -> list[tuple[str, int]]:
    """(entry, tokens the training steps read of it) for each data.train entry: a weighted entry its weight's share,
    plain entries (one corpus) an equal share each."""
    d, t, g = recipe.data, recipe.train, recipe.generated
    sources = d.train_sources()
    if not sources:
        return []
    text_per_step = t.batch_size - (round(t.batch_size * g.train_share) if g.tokens else 0)
    tokens = (t.steps * text_per_step * d.seq_len + 1) / (1 - (d.heldout_fraction if not d.eval else 0))  # the
    # held-out tail is cut from the same text
    cap = d.max_train_tokens or math.inf  # of the corpus, or of each weighted entry (load_data)
    if weights := d.train_weights():
        return [(entry, math.ceil(min(tokens * weight, cap))) for entry, weight in zip(sources, weights)]
    return [(entry, math.ceil(min(tokens, cap) / len(sources))) for entry in sources]


def resolve_datasets(recipe, tokenizer, token: str | None = None, pinned: dict | None = None) -> dict[str, Resolved]:
    """{entry: which files of it the run reads} for every `hf:` entry of the recipe; nothing is downloaded.
    `pinned`: a resumed run's records ({entry: Resolved.record()}), read as they are."""
    pinned = pinned or {}
    return {entry: resolve(DatasetSpec.parse(entry, "data"), tokens, tokenizer, recipe.data.text_field, token,
                           pinned.get(entry))
            for entry, tokens in text_needs(recipe).items()}


def dataset_disk_needs(recipe, datasets: dict[str, Resolved], tokenizer) -> list[DiskNeed]:
    """The download (files not cached yet) and the token cache of the files not tokenised yet: twice their ids, the
    processes' parts and the joined files being on disk together for a while."""
    pending = sum(size for r in datasets.values() for _, size in r.pending)
    root = cache_root(recipe.data.cache_dir, "tokens")
    untokenised = sum(size * r.tokens_per_byte for r in datasets.values() for path, (_, size) in zip(r.paths, r.files)
                      if not tokenised(path, tokenizer, recipe.data.text_field, root))
    return [download_need(pending),
            DiskNeed(root, round(2 * untokenised * token_dtype(tokenizer).itemsize), "the token cache")]


def fetch_datasets(recipe, tokenizer, token: str | None = None, progress: bool = True, pinned: dict | None = None
                   ) -> dict[str, Resolved]:
    """The recipe's `hf:` entries resolved and downloaded, once the disk holds them and their token cache."""
    datasets = resolve_datasets(recipe, tokenizer, token, pinned)
    if not datasets:
        return {}
    if any(r.pending for r in datasets.values()):
        check_disk(dataset_disk_needs(recipe, datasets, tokenizer))
    for entry, resolved in datasets.items():
        if resolved.short:
            print(f"warning: {resolved.short}", file=sys.stderr)
        if progress and resolved.pending:
            print(f"fetching {len(resolved.pending)} of the {len(resolved.files)} files of {entry} this run reads "
                  f"({sum(size for _, size in resolved.pending) / 1e9:.2f} GB)", file=sys.stderr)
        download(resolved, token, progress)
    return datasets


def pack_ids(sequences: torch.Tensor, tokenizer, seq_len: int) -> Sequences:
    """Token sequences [m, length] (generated text) joined with EOS, cut as the training text is cut."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token to put between documents")
    return Sequences(as_stream(sequences, tokenizer.eos_token_id), seq_len)


class Batches:
    """Which sequences each optimizer step reads: a seeded permutation, repeated epoch after epoch."""

    def __init__(self, sequences, batch_size: int, seed: int, what: str = "the training data"):
        """`sequences`: a `Sequences` or a [n, seq_len + 1] tensor."""
        if len(sequences) < batch_size:
            raise DataError(f"{what} makes {len(sequences)} sequences, fewer than the {batch_size} a batch takes "
                            f"from it; add data or lower train.batch_size")
        self.sequences, self.batch_size, self.seed = sequences, batch_size, seed
        self.per_epoch = len(sequences) // batch_size

    def take(self, start: int, count: int) -> torch.Tensor:
        """[count] indices of the sequences at places start.. of the order: epoch e is a permutation drawn from
        seed + e, of which the first per_epoch x batch_size places are read (no batch spans two epochs)."""
        length = self.per_epoch * self.batch_size
        places = torch.arange(start, start + count)
        epochs = places // length
        out = torch.empty(count, dtype=torch.long)
        for epoch in epochs.unique().tolist():
            order = torch.randperm(len(self.sequences), generator=torch.Generator().manual_seed(self.seed + epoch))
            here = epochs == epoch
            out[here] = order[places[here] - epoch * length]
        return out

    def step(self, step: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] for optimizer step `step` (0-based), the same on every run."""
        return self.sequences[self.take(step * self.batch_size, self.batch_size)]


class Mixture:
    """A step's training-text sequences drawn from weighted sources: how many from each is a multinomial draw
    seeded by the step, and each source reads its own seeded order onward from where the earlier steps left it,
    so step s reads the same sequences on every run, a resumed one too."""

    def __init__(self, sources: list, weights: list[float], count: int, seed: int):
        """`sources`: a `Sequences` each; `count`: sequences per step."""
        self.orders = [Batches(source, 1, seed + 104729 * k, f"data.train entry {k + 1}")
                       for k, source in enumerate(sources)]
        self.weights, self.count, self.seed = torch.tensor(weights, dtype=torch.float64), count, seed
        self.offsets = [torch.zeros(len(sources), dtype=torch.long)]  # offsets[s]: each source's places before step s

    def counts(self, step: int) -> torch.Tensor:
        """[sources] sequences of each source in step `step`."""
        generator = torch.Generator().manual_seed(self.seed * 1000003 + step)
        draws = torch.multinomial(self.weights, self.count, replacement=True, generator=generator)
        return torch.bincount(draws, minlength=len(self.orders))

    def step(self, step: int) -> torch.Tensor:
        while len(self.offsets) <= step + 1:  # each step's draw once; a resumed run draws the earlier steps' too
            self.offsets.append(self.offsets[-1] + self.counts(len(self.offsets) - 1))
        start, counts = self.offsets[step], self.offsets[step + 1] - self.offsets[step]
        return torch.cat([order.sequences[order.take(int(start[k]), int(counts[k]))]
                          for k, order in enumerate(self.orders) if counts[k]])


class MixedBatches:
    """Each step's batch: sequences of the training text, then sequences generated by the teacher.

    The generated share of a batch is fixed (`round(batch_size * share)`); each source has its own
    seeded order, so step s reads the same sequences on every run. The training text is one corpus, or a
    `Mixture` of weighted entries."""

    def __init__(self, text: "Sequences | list | None", generated: Sequences | None, batch_size: int, share: float,
                 seed: int, weights: list[float] | None = None):
        """`text`: the corpus's sequences, or with `weights` each entry's."""
        n_generated = round(batch_size * share) if generated is not None else 0
        self.parts = []  # (Batches or Mixture, generated?)
        if n_generated < batch_size:
            text_part = (Mixture(text, weights, batch_size - n_generated, seed) if weights is not None
                         else Batches(text, batch_size - n_generated, seed))
            self.parts.append((text_part, False))
        if n_generated:
            self.parts.append((Batches(generated, n_generated, seed + 7919, "the generated text"), True))

    def step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([batch_size, seq_len + 1] ids, [batch_size] bool: which sequences are generated)."""
        batches = [(part.step(step), generated) for part, generated in self.parts]
        ids = torch.cat([b for b, _ in batches])
        flags = torch.cat([torch.full((b.shape[0],), generated) for b, generated in batches])
        return ids, flags


def eval_files(recipe, datasets: dict[str, Resolved] | None = None) -> dict[str, list[Path]]:
    """The held-out sets' files by set name."""
    return {name: expand_files(files, f"data.eval.{name}", datasets) for name, files in recipe.data.eval.items()}


def heldout_paths(recipe, datasets: dict[str, Resolved] | None = None) -> set[Path]:
    """Every held-out file of every set, resolved: never trained or calibrated on (`f.resolve() not in` it: a Hub
    file is the same blob whichever revision's folder names it)."""
    return {f.resolve() for files in eval_files(recipe, datasets).values() for f in files}


def load_data(recipe, tokenizer, rank: int = 0, world: int = 1, wait=lambda: None, run: str = "",
              datasets: dict[str, Resolved] | None = None, progress: bool = False
              ) -> tuple["Sequences | list[Sequences] | None", dict[str, torch.Tensor]]:
    """(training-text sequences, a list of them for a weighted data.train, or None; {held-out set: [n, seq_len + 1]
    ids}). Every process calls this: each tokenises its share of what is not cached yet (`wait`: a barrier across
    them; `run`: `tokenize_corpus`). `datasets`: the recipe's `hf:` entries, fetched (`fetch_datasets`)."""
    d = recipe.data
    sets = eval_files(recipe, datasets)
    heldout = heldout_paths(recipe, datasets)
    root = cache_root(d.cache_dir, "tokens")

    def stream(files):
        return tokenize_corpus(files, tokenizer, d.text_field, root, rank, world, wait, run=run, progress=progress)

    def training(entries: list[str], what: str) -> Sequences:
        files = [f for f in expand_files(entries, what, datasets) if f.resolve() not in heldout]  # never trained on
        if not files:
            raise DataError(f"{what} names only held-out files; list training text that data.eval does not name")
        sequences = Sequences(stream(files), d.seq_len, max_tokens=d.max_train_tokens)
        if not len(sequences):
            raise DataError(f"{what} has {len(sequences.stream)} tokens, fewer than one sequence of "
                            f"data.seq_len + 1 = {d.seq_len + 1}")
        return sequences

    sequences = None
    if d.train_weights() is not None:  # a mixture: each entry its own sequences
        sequences = [training([entry], f"data.train entry {entry}") for entry in d.train_sources()]
    elif d.train:
        sequences = training(d.train_sources(), "data.train")
    per_set = max(1, d.eval_tokens // d.seq_len)
    if sets:  # the first sequences of each set: only as much of its files is tokenised as they take
        return sequences, {name: _heldout(Sequences(tokenize_prefix(files, tokenizer, d.text_field, root,
                                                                    per_set * d.seq_len + 1, rank, wait),
                                                    d.seq_len, count=per_set), name)
                           for name, files in sets.items()}
    count = max(1, round(len(sequences) * d.heldout_fraction)) if d.heldout_fraction else 0
    if count >= len(sequences):
        raise DataError("data.heldout_fraction leaves no training sequence; lower it or give data.eval files")
    sequences, tail = sequences.split(count)
    return sequences, ({"heldout": Sequences(tail.stream, d.seq_len, tail.first, per_set).tensor()} if count else {})


def _heldout(sequences: Sequences, name: str) -> torch.Tensor:
    if not len(sequences):
        raise DataError(f"held-out set {name!r} has {len(sequences.stream)} tokens, fewer than one sequence of "
                        f"data.seq_len + 1; give it more text or lower data.seq_len")
    return sequences.tensor()
