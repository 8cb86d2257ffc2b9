"""Text sampled from the dense model itself: distillation and calibration data that needs no corpus.

LLM-QAT (Liu et al., 2023) showed that a model's own generations preserve its output distribution
better than a subset of real data. Each sequence starts at a token drawn uniformly from the
vocabulary (special tokens excluded); its next `first_tokens` tokens are chosen among the model's
top `first_top_k` (1: greedy, as LLM-QAT does), and the rest are sampled from the full
distribution at `temperature`. End-of-text is suppressed, so every sequence is one continuous
text of the full length (transformers' `generate` would otherwise pad a finished row).

Sequences are generated in batches with the KV cache. Batch b always draws from the seed
(seed, b), so the result does not depend on how batches are spread over processes or how many are
asked for. Batches are cached on disk as they finish, under a key made of the model's weight files
and the settings: a run cut short resumes at the missing batches, and a second run (or the dense
baseline trained on the same data, or a larger request) reads them back instead of generating again.
"""

import copy
import hashlib
import inspect
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .atomic import staged_file
from .source import Source

CACHE_ENV = "STEM_UPCYCLE_CACHE"


@dataclass(frozen=True)
class Sampling:
    """How the dense model's own text is sampled."""

    sequences: int  # how many sequences
    length: int = 256  # tokens per sequence, the start token included
    batch_size: int = 32  # sequences generated at once (one KV cache)
    first_tokens: int = 4  # tokens after the start token chosen among the top `first_top_k`
    first_top_k: int = 1
    temperature: float = 1.0  # for every later token, sampled from the full distribution
    seed: int = 0
    # The dtype the model samples in (loading.fast_dtype: bfloat16 where the device computes it natively). Other
    # dtypes sample other text, so it is part of the cache's key.
    dtype: str = "float32"

    @classmethod
    def covering(cls, tokens: int, **settings) -> "Sampling":
        """Enough sequences for `tokens` ids, in batches no larger than that (the one rule the CLI and the
        trainer both ask for text by)."""
        sequences = -(-tokens // settings.get("length", cls.length))
        if isinstance(settings.get("dtype"), torch.dtype):
            settings["dtype"] = str(settings["dtype"]).removeprefix("torch.")
        batch_size = min(settings.pop("batch_size", cls.batch_size), sequences)
        return cls(sequences=sequences, batch_size=batch_size, **settings)

    @property
    def batches(self) -> int:
        return -(-self.sequences // self.batch_size)


# Sequences `convert` samples at once for its calibration text: a decode step's fixed costs shared by more tokens.
# SmolLM2-135M on 2 cores, 256 tokens a sequence (benchmarks/README.md, convert_time.py): 224 -> 348 tokens/s in
# fp32 from 32 to 128 (301 at 256), 346 -> 603 in bf16 (749 at 256): 128 is best where bf16 is not native, where
# the time counts most. Another batch size samples another text (the cache's key holds it).
CALIBRATION_BATCH = 128


def calibration_sampling(tokens: int, device) -> Sampling:
    """How `convert` samples `tokens` of calibration text on `device`: in batches of CALIBRATION_BATCH, in the
    dtype that reads fastest there."""
    from .loading import fast_dtype

    return Sampling.covering(tokens, batch_size=CALIBRATION_BATCH, dtype=fast_dtype(device))


def start_tokens(vocab_size: int, special: list[int], count: int, generator: torch.Generator) -> torch.Tensor:
    """[count] ids drawn uniformly from the vocabulary without the special tokens."""
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[[i for i in special if 0 <= i < vocab_size]] = False
    candidates = allowed.nonzero()[:, 0]
    return candidates[torch.randint(candidates.numel(), (count,), generator=generator)]


def draw(logits: torch.Tensor, generator: torch.Generator, block: int = 256) -> torch.Tensor:
    """[n] ids sampled from softmax(logits [n, vocab]) by the inverse of each row's CDF at one uniform draw, in two
    levels: a block of `block` ids by the blocks' masses, then an id within it. (torch.multinomial draws an
    exponential variate per vocabulary entry, 57 ms of a 90 ms decode step of SmolLM2 at batch 64 on 2 CPU cores;
    a cumulative sum over the whole vocabulary, a sequential scan, 11 ms; this, two short ones.)"""
    n, vocab = logits.shape
    probs = torch.softmax(logits.float(), -1)
    probs = torch.nn.functional.pad(probs, (0, -vocab % block)).view(n, -1, block)  # [n, blocks, block]
    mass = probs.sum(-1)
    cdf = mass.cumsum(-1)  # [n, blocks]
    rows = torch.arange(n, device=logits.device)
    # u in (0, total): the first block (then id) whose CDF passes u has a positive mass (never a suppressed id)
    u = (torch.rand(n, generator=generator).to(cdf.device) * cdf[:, -1]).clamp(1e-30, None) * (1 - 1e-6)
    b = torch.searchsorted(cdf, u[:, None], right=True)[:, 0].clamp_max(cdf.shape[1] - 1)
    within = probs[rows, b].cumsum(-1)  # [n, block]
    rest = (u - (cdf[rows, b] - mass[rows, b])).clamp(1e-30, None).minimum(within[:, -1] * (1 - 1e-6))
    j = torch.searchsorted(within, rest[:, None], right=True)[:, 0].clamp_max(block - 1)
    return b * block + j


def cache_argument(model) -> str:
    """The name a model's forward takes its KV cache by (Transformers 5.25 renamed past_key_values to cache)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def sample_batch(model, tokenizer, sampling: Sampling, index: int) -> torch.Tensor:
    """[batch_size, length] int32 ids of batch `index` (always whole: the last batch may hold more than needed),
    sampled by `model` as it is, on its device in its dtype.

    The loop is written out rather than `generate()`'s: a decode step is the forward and one cumulative sum (`draw`),
    every random number drawn from the batch's own generator."""
    n = sampling.batch_size
    generator = torch.Generator().manual_seed(sampling.seed * 1_000_003 + index)
    ids = start_tokens(model.config.vocab_size, tokenizer.all_special_ids, n, generator)[:, None].to(model.device)
    eos, cache = tokenizer.eos_token_id, cache_argument(model)
    tokens = [ids]  # [n, 1] each
    out = model(ids, use_cache=True, logits_to_keep=1)
    for step in range(sampling.length - 1):
        logits = out.logits[:, -1].float()  # [n, vocab]
        if sampling.temperature != 1.0:
            logits = logits / sampling.temperature
        if eos is not None:  # end-of-text suppressed: every sequence is one text of the full length
            logits[:, eos] = float("-inf")
        if step < sampling.first_tokens:  # the start's continuation: among the top first_top_k
            kth = logits.topk(sampling.first_top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        greedy = step < sampling.first_tokens and sampling.first_top_k == 1
        ids = (logits.argmax(-1) if greedy else draw(logits, generator))[:, None]
        tokens.append(ids)
        if step < sampling.length - 2:
            out = model(ids, use_cache=True, logits_to_keep=1, **{cache: out[cache if cache in out else "past_key_values"]})
    return torch.cat(tokens, 1).to("cpu", torch.int32)


def as_stream(sequences: torch.Tensor, eos: int | None) -> torch.Tensor:
    """1-D ids: the sequences [n, length] one after another with EOS between them, as documents are packed
    (with no EOS token, simply one after another)."""
    if eos is None:
        return sequences.long().flatten()
    separators = torch.full((sequences.shape[0], 1), eos, dtype=torch.long)
    return torch.cat([sequences.long(), separators], 1).flatten()


def cache_key(source: Source, sampling: Sampling) -> str:
    """A digest of the model's weight files (path, size, modification time) and the settings."""
    files = sorted(source.weight_files)
    identity = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    payload = json.dumps({"weights": identity, "sampling": asdict(sampling)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def cache_root(cache_dir: str | Path | None = None, kind: str = "generated") -> Path:
    """`cache_dir` if given, else $STEM_UPCYCLE_CACHE/KIND or ~/.cache/stem-upcycle/KIND."""
    if cache_dir:
        return Path(cache_dir)
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "stem-upcycle") / kind


class GeneratedText:
    """Sequences sampled from one model with one set of settings, cached on disk batch by batch.

    The cache folder's key leaves out the number of sequences: batch b is the same text whatever that
    number, so a larger request reads the batches on disk and generates only the others."""

    def __init__(self, source: Source, sampling: Sampling, cache_dir: str | Path | None = None):
        self.sampling = sampling
        self.folder = cache_root(cache_dir) / cache_key(source, replace(sampling, sequences=0))

    def missing(self) -> list[int]:
        return [b for b in range(self.sampling.batches) if not self._batch(b).exists()]

    def generate(self, model, tokenizer, rank: int = 0, world: int = 1, progress: bool = True) -> dict:
        """Generate the missing batches this process owns (b % world == rank).

        Returns {"tokens", "seconds", "tokens_per_s"} for what this process generated."""
        from tqdm.auto import tqdm

        self.folder.mkdir(parents=True, exist_ok=True)
        settings = self.folder / "sampling.json"  # for people reading the cache; the key is the folder name
        if not settings.exists():
            settings.write_text(json.dumps(asdict(replace(self.sampling, sequences=0))) + "\n")
        todo = [b for b in self.missing() if b % world == rank]
        dtype = getattr(torch, self.sampling.dtype)
        if todo and next(model.parameters()).dtype != dtype:  # a copy that samples in the settings' dtype
            model = copy.deepcopy(model).to(dtype)
        started, tokens = time.perf_counter(), 0
        bar = tqdm(todo, desc="generate", unit="batch", disable=not progress, file=sys.stderr)
        for b in bar:
            ids = sample_batch(model, tokenizer, self.sampling, b)
            with staged_file(self._batch(b)) as partial:  # a batch file exists only once it is complete
                save_file({"ids": ids}, partial)
            tokens += ids.numel()
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - started):.0f}")
        seconds = time.perf_counter() - started
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0}

    def ensure(self, model, tokenizer, progress: bool = True) -> tuple[torch.Tensor, dict]:
        """(ids, generation figures) in one process: what is missing is generated (figures empty if nothing was)."""
        stats = self.generate(model, tokenizer, progress=progress) if self.missing() else {}
        return self.load(), stats

    def describe(self, tokens: int, seconds: float, processes: int = 1) -> str:
        """What the CLI and the trainer say of generating `tokens` in `seconds`."""
        return (f"{tokens:,} tokens generated ({tokens / max(seconds, 1e-9):.0f} tokens/s, {processes} process(es)) "
                f"into {self.folder}")

    def load(self) -> torch.Tensor:
        """[sequences, length] int64 ids."""
        batches = [load_file(self._batch(b))["ids"] for b in range(self.sampling.batches)]
        return torch.cat(batches)[: self.sampling.sequences].long()

    def _batch(self, index: int) -> Path:
        return self.folder / f"batch-{index:06d}.safetensors"
