"""Text sampled from the dense model itself: distillation and calibration data that needs no corpus.

LLM-QAT (Liu et al., 2023) showed that a model's own generations preserve its output distribution
better than a subset of real data. Each sequence starts at a token drawn uniformly from the
vocabulary (special tokens excluded); its next `first_tokens` tokens are chosen among the model's
top `first_top_k` (1: greedy, as LLM-QAT does), and the rest are sampled from the full
distribution at `temperature`. End-of-text is suppressed, so every sequence is one continuous
text of the full length (transformers' `generate` would otherwise pad a finished row).

Sequences are generated in batches with the KV cache. Batch b always draws from the seed
(seed, b), so the result does not depend on how batches are spread over processes, and a run that
was cut short resumes at the first missing batch. The finished set is cached on disk under a key
made of the model's weight files and the settings: a second run, or the dense baseline trained on
the same data, reads it back instead of generating again.
"""

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from .source import Source

CACHE_ENV = "STEM_UPCYCLE_CACHE"
CACHE = "dynamic"


@dataclass(frozen=True)
class Sampling:
    """How the dense model's own text is sampled."""

    sequences: int  # how many sequences
    length: int  # tokens per sequence, the start token included
    batch_size: int = 16  # sequences generated at once (one KV cache)
    first_tokens: int = 4  # tokens after the start token chosen among the top `first_top_k`
    first_top_k: int = 1
    temperature: float = 1.0  # for every later token, sampled from the full distribution
    seed: int = 0

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
    """[n, length] int32 ids of batch `index` (n = batch_size, or what is left in the last batch)."""
    n = min(sampling.batch_size, sampling.sequences - index * sampling.batch_size)
    generator = torch.Generator().manual_seed(sampling.seed * 1_000_003 + index)
    vocab = model.config.vocab_size
    starts = start_tokens(vocab, tokenizer.all_special_ids, n, generator)[:, None].to(model.device)  # [n, 1]
    eos = tokenizer.eos_token_id
    config = GenerationConfig(do_sample=True, cache_implementation=CACHE, temperature=sampling.temperature, top_k=0, top_p=1.0,
                              max_new_tokens=sampling.length - 1, min_new_tokens=sampling.length - 1,
                              eos_token_id=eos, pad_token_id=eos)
    processors = LogitsProcessorList([_TopKFirst(1, sampling.first_tokens, sampling.first_top_k)])
    # generate() samples from torch's global generator: seed it for this batch, leave it as it was.
    with torch.random.fork_rng(devices=[model.device] if model.device.type == "cuda" else []):
        torch.manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
        out = model.generate(starts, attention_mask=torch.ones_like(starts), generation_config=config,
                             logits_processor=processors)
    return out.to("cpu", torch.int32)


def cache_key(source: Source, sampling: Sampling) -> str:
    """A digest of the model's weight files (path, size, modification time) and the settings."""
    files = sorted(source.weight_files)
    identity = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    payload = json.dumps({"weights": identity, "sampling": asdict(sampling)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir)
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "stem-upcycle") / "generated"


class GeneratedText:
    """The generated sequences of one (model, sampling) pair, in the on-disk cache."""

    def __init__(self, source: Source, sampling: Sampling, cache_dir: str | Path | None = None):
        self.sampling = sampling
        root = cache_root(cache_dir)
        key = cache_key(source, sampling)
        self.path = root / f"{key}.safetensors"
        self.parts = root / f"{key}.parts"  # one file per finished batch, while generating

    def cached(self) -> bool:
        return self.path.exists()

    def generate(self, model, tokenizer, rank: int = 0, world: int = 1, progress: bool = True) -> dict:
        """Generate the batches this process owns (b % world == rank) that are not on disk yet.

        Returns {"tokens", "seconds", "tokens_per_s"} for what this process generated."""
        from tqdm.auto import tqdm

        self.parts.mkdir(parents=True, exist_ok=True)
        todo = [b for b in range(rank, self.sampling.batches, world) if not self._part(b).exists()]
        started, tokens = time.perf_counter(), 0
        bar = tqdm(todo, desc="generate", unit="batch", disable=not progress, file=sys.stderr)
        for b in bar:
            ids = sample_batch(model, tokenizer, self.sampling, b)
            partial = self._part(b).with_suffix(".partial")
            save_file({"ids": ids}, partial)
            partial.rename(self._part(b))  # a batch file exists only once it is complete
            tokens += ids.numel()
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - started):.0f}")
        seconds = time.perf_counter() - started
        return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0}

    def finish(self) -> None:
        """Join the batch files into the cache file (once every batch exists), then drop them."""
        ids = torch.cat([load_file(self._part(b))["ids"] for b in range(self.sampling.batches)])
        partial = self.path.with_suffix(".partial")
        save_file({"ids": ids}, partial, metadata={"sampling": json.dumps(asdict(self.sampling))})
        partial.rename(self.path)
        shutil.rmtree(self.parts, ignore_errors=True)

    def load(self) -> torch.Tensor:
        """[sequences, length] int64 ids."""
        return load_file(self.path)["ids"].long()

    def _part(self, batch: int) -> Path:
        return self.parts / f"batch-{batch:06d}.safetensors"
