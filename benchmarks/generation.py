"""Throughput of sampling text from the dense model (stem_upcycle.generate), by batch size and length.

    python benchmarks/generation.py                       # SmolLM2-135M-Instruct, fp32, this CPU
    python benchmarks/generation.py --batch-sizes 16,64 --lengths 256,512

One batch per setting, with the KV cache, as `stem-upcycle train` generates its distillation
text; also the forward throughput of the same model on full sequences (the cost of a training
token's teacher forward), so the two can be compared.
"""

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stem_upcycle.loading import load_model, load_tokenizer  # noqa: E402
from stem_upcycle.generate import Sampling, sample_batch  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch-sizes", default="16,32,64")
    parser.add_argument("--lengths", default="256,512")
    args = parser.parse_args()
    print(f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    model, source = load_model(args.model)
    tokenizer = load_tokenizer(source)
    with torch.no_grad():
        ids = torch.randint(0, model.config.vocab_size, (4, 512))
        model(ids[:, :64])  # warm-up
        started = time.perf_counter()
        model(ids, use_cache=False)
        forward = ids.numel() / (time.perf_counter() - started)
    print(f"forward, 4 x 512 tokens, no cache: {forward:.0f} tokens/s")
    print(f"{'batch':>6} {'length':>7} {'seconds':>8} {'tokens/s':>9}")
    for length in map(int, args.lengths.split(",")):
        for batch in map(int, args.batch_sizes.split(",")):
            sampling = Sampling(sequences=batch, length=length, batch_size=batch)
            started = time.perf_counter()
            out = sample_batch(model, tokenizer, sampling, 0)
            seconds = time.perf_counter() - started
            print(f"{batch:>6} {length:>7} {seconds:>8.1f} {out.numel() / seconds:>9.0f}", flush=True)


if __name__ == "__main__":
    main()
