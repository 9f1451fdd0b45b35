"""lm-evaluation-harness scoring through sluice: loglikelihood requests per second at several batch sizes.

    python benchmarks/generative/lm_eval_bench.py --url http://127.0.0.1:8000 --model tiny-lm \\
        --tokenizer PATH_TO_THE_MODEL_FOLDER [--requests 64] [--batch-sizes 1 4 16] [--rounds 2]

lm-eval's `local-completions` model sends each batch of loglikelihood requests as one completions
request whose `prompt` is a list of token-id lists (echo, logprobs 1, max_tokens 1); sluice runs
each prompt as a sequence of its own, so a batch is computed together by the engine. The same
synthetic (context, continuation) pairs are scored at every batch size, the sizes alternating
`--rounds` times; each request's prompts are new to the server (a random word starts every
context), so neither the result cache nor the prefix cache answers them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def pairs(count: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    words = ["the", "model", "serves", "requests", "in", "batches", "of", "tokens", "on", "a", "device", "quickly",
             "while", "tenants", "share", "it", "fairly", "under", "load"]
    out = []
    for _ in range(count):
        context = " ".join([f"w{rng.randrange(10**9)}"] + [rng.choice(words) for _ in range(rng.randint(60, 160))])
        out.append((context, " " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 8)))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tiny-lm")
    parser.add_argument("--tokenizer", required=True, help="the model's folder (its tokenizer.json)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    taken: dict[int, list[float]] = {size: [] for size in args.batch_sizes}
    for r in range(args.rounds):
        for size in args.batch_sizes:
            harness = LocalCompletionsAPI(base_url=f"{args.url}/v1/completions", model=args.model,
                                          tokenizer_backend="huggingface", tokenizer=args.tokenizer,
                                          batch_size=size, max_length=1024, max_retries=1)
            requests = [Instance("loglikelihood", {}, pair, i)
                        for i, pair in enumerate(pairs(args.requests, seed=1000 * r + size))]
            start = time.perf_counter()
            results = harness.loglikelihood(requests, disable_tqdm=True)
            elapsed = time.perf_counter() - start
            assert len(results) == args.requests
            taken[size].append(args.requests / elapsed)
    summary = {f"batch_size={size}": {"requests_per_s": statistics.median(rates), "runs": rates}
               for size, rates in taken.items()}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
