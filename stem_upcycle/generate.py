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

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

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

    @classmethod
    def covering(cls, tokens: int, **settings) -> "Sampling":
        """Enough sequences for `tokens` ids, in batches no larger than that (the one rule the CLI and the
        trainer both ask for text by)."""
        sequences = -(-tokens // settings.get("length", cls.length))
        batch_size = min(settings.pop("batch_size", cls.batch_size), sequences)
        return cls(sequences=sequences, batch_size=batch_size, **settings)

    @property
    def batches(self) -> int:
        return -(-self.sequences // self.batch_size)


class _TopKFirst(LogitsProcessor):
    """Keeps only the top k logits for the first `count` generated tokens."""

    def __init__(self, prompt_length: int, count: int, k: int):
        self.prompt_length, self.count, self.k = prompt_length, count, k

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] - self.prompt_length >= self.count:
            return scores
        kth = scores.topk(self.k, dim=-1).values[:, -1:]  # [batch, 1]
        return scores.masked_fill(scores < kth, float("-inf"))


def start_tokens(vocab_size: int, special: list[int], count: int, generator: torch.Generator) -> torch.Tensor:
    """[count] ids drawn uniformly from the vocabulary without the special tokens."""
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[[i for i in special if 0 <= i < vocab_size]] = False
    candidates = allowed.nonzero()[:, 0]
    return candidates[torch.randint(candidates.numel(), (count,), generator=generator)]


@torch.no_grad()
def sample_batch(model, tokenizer, sampling: Sampling, index: int) -> torch.Tensor:
    """[batch_size, length] int32 ids of batch `index` (always whole: the last batch may hold more than needed)."""
    n = sampling.batch_size
    generator = torch.Generator().manual_seed(sampling.seed * 1_000_003 + index)
    vocab = model.config.vocab_size
    starts = start_tokens(vocab, tokenizer.all_special_ids, n, generator)[:, None].to(model.device)  # [n, 1]
    eos = tokenizer.eos_token_id
    config = GenerationConfig(do_sample=True, temperature=sampling.temperature, top_k=0, top_p=1.0,
                              max_new_tokens=sampling.length - 1, min_new_tokens=sampling.length - 1,
                              eos_token_id=eos, pad_token_id=eos)
    processors = LogitsProcessorList([_TopKFirst(1, sampling.first_tokens, sampling.first_top_k)])
    # generate() samples from torch's global generator: seed it for this batch, leave it as it was.
    with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
        torch.manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
        out = model.generate(starts, attention_mask=torch.ones_like(starts), generation_config=config,
                             logits_processor=processors)
    return out.to("cpu", torch.int32)


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
        """The line both the CLI and the trainer print after generating `tokens` in `seconds`."""
        return (f"generated {tokens} tokens in {seconds:.0f} s ({tokens / max(seconds, 1e-9):.0f} tokens/s, "
                f"{processes} process(es)) into {self.folder}")

    def load(self) -> torch.Tensor:
        """[sequences, length] int64 ids."""
        batches = [load_file(self._batch(b))["ids"] for b in range(self.sampling.batches)]
        return torch.cat(batches)[: self.sampling.sequences].long()

    def _batch(self, index: int) -> Path:
        return self.folder / f"batch-{index:06d}.safetensors"
