"""Eager prefill at shapes the process has not seen yet, under SDPA's default backends (cuDNN
first on Hopper) and without cuDNN: the whole prompt, and the prompt in chunks of 256 and 1,024
tokens, each timed the first time and again (8B shapes, random bf16 weights, one GPU).

    PYTHONPATH=. python bench/experiments/prefill_sdpa_backends.py
"""

import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.runner_bench import MODELS, build, sync
from specdec.runner import ForwardItem, ModelRunner

PROMPT = 8192


def timed_ms(dev: torch.device, fn) -> float:  # type: ignore[no-untyped-def]
    sync(dev)
    start = time.perf_counter()
    fn()
    sync(dev)
    return round((time.perf_counter() - start) * 1e3, 1)


def prefill(runner: ModelRunner, tokens: torch.Tensor, n: int, chunk: int) -> None:
    """A request's first n tokens in forwards of `chunk` (n: one forward), then released."""
    runner.add_request("p")
    for s in range(0, n, chunk):
        last = s + chunk >= n
        runner.forward([ForwardItem("p", tokens[s : min(n, s + chunk)], 1 if last else 0)])
    runner.release("p")


def main() -> None:
    dev = torch.device("cuda")
    hf, runner = build("Llama-3.1-8B", MODELS["Llama-3.1-8B"], dev, PROMPT + 64, 3, (1,))
    del hf
    torch.cuda.empty_cache()
    tokens = torch.randint(0, 1000, (PROMPT,), generator=torch.Generator().manual_seed(0))
    prefill(runner, tokens, 64, 64)  # the process's first forward, outside every row
    everything_but_cudnn = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    print("| backends | prompt | chunk | first time ms | again ms |\n|---|---|---|---|---|")
    for shift, (label, backends) in enumerate(
        [("default", None), ("no cuDNN", everything_but_cudnn)]
    ):
        for n, chunk in [(8000, 8000), (4000, 4000), (8150, 256), (8150, 1024)]:
            n -= 7 * shift  # lengths this process has not run yet

            def run(n: int = n, chunk: int = chunk) -> None:
                prefill(runner, tokens, n, chunk)

            if backends is None:
                cold, warm = timed_ms(dev, run), timed_ms(dev, run)
            else:
                with sdpa_kernel(backends):
                    cold, warm = timed_ms(dev, run), timed_ms(dev, run)
            print(f"| {label} | {n} | {chunk} | {cold} | {warm} |", flush=True)


if __name__ == "__main__":
    main()
