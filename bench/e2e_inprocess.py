"""The system benchmark's GPU work outside the services, in a child process so that all its
device memory is returned before the services start (`python -m bench.e2e_inprocess TASK IN OUT`).

prepare: builds (or reuses) the checkpoints, then loads them through `ModelRunner.load` and
  times graph steps as `runner_bench` does: target decode (n = 1), target verify (n = k + 1)
  and draft step (n = 1) at each batch size, with the services' CUDA graph sizes; with
  "prefill_len" in the job, also the target's prefill of one prompt of that many tokens.
diagnose: for greedy runs that diverged, the target's logits at the first divergence
  (teacher-forced along the common prefix): a gap within numerical noise is a near-tie
  between two kernels' batch shapes, a wide gap is a wrong token.
"""

from __future__ import annotations

import gc
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bench import e2e_models
from bench.runner_bench import prefill, runner_step_ms, timed
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig


def devices(smoke: bool) -> tuple[str, str]:
    """(draft device, target device): two GPUs where there are, one shared otherwise."""
    if smoke or not torch.cuda.is_available():
        return "cpu", "cpu"
    return "cuda:0", ("cuda:1" if torch.cuda.device_count() >= 2 else "cuda:0")


def environment() -> dict[str, Any]:
    """GPU, driver and library versions of this machine."""
    import grpc

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name(0) if cuda else "cpu"
    driver = "none"
    if cuda:
        try:
            smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            driver = subprocess.run(smi, capture_output=True, text=True, timeout=30).stdout
            driver = driver.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            driver = "unknown"
    return {
        "gpu": gpu,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "driver": driver,
        "torch": torch.__version__,
        "triton": triton_version,
        "grpcio": grpc.__version__,
        "python": platform.python_version(),
    }


def _load(path: str, device: str, dtype: str, slots: int, seq: int, sizes: list[int]) -> Any:
    graphs = tuple(s for s in sizes if s <= slots) if device.startswith("cuda") else ()
    config = RunnerConfig(
        path,
        device=device,
        dtype=dtype,
        max_slots=slots,
        max_seq_len=seq,
        cuda_graph_batch_sizes=graphs,
    )
    return ModelRunner.load(config)


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def graph_ms(
    job: dict[str, Any], path: str, device: str, ns: list[int], prefill_len: int = 0
) -> dict[str, float]:
    """ "n,b" → mean ms of one graph step of b requests × n tokens at job["ctx"] tokens of KV;
    with `prefill_len`, also "prefill,N": one request's N-token prompt in one `forward` (its
    next-token logits included), in a slot of its own."""
    batches, ctx = job["batches"], job["ctx"]
    slots, seq = max(batches) + (1 if prefill_len else 0), max(ctx + 64, prefill_len + 1)
    runner = _load(path, device, job["dtype"], slots, seq, job["graph_sizes"])
    dev = torch.device(device)
    ids = prefill(runner, max(batches), ctx, dev)
    out = {}
    for b in batches:
        for n in ns:
            out[f"{n},{b}"] = runner_step_ms(runner, ids[:b], n, ctx, True, dev, job["iters"])
    if prefill_len:
        out[f"prefill,{prefill_len}"] = prefill_ms(runner, prefill_len, dev, job["iters"])
    del runner
    _free(dev)
    return out


def prefill_ms(runner: ModelRunner, n: int, dev: torch.device, iters: int) -> float:
    """Mean ms of `ModelRunner.forward` of one n-token item (then rolled back)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(1, 1000, (n,), generator=g)
    runner.add_request("prefill")

    def step() -> None:
        runner.forward([ForwardItem("prefill", tokens, 1)])
        runner.truncate("prefill", 0)

    try:
        return timed(step, dev, warmup=2, iters=iters)
    finally:
        runner.release("prefill")


def prepare(job: dict[str, Any]) -> dict[str, Any]:
    draft_dev, target_dev = devices(job["smoke"])
    paths = e2e_models.build(Path(job["cache"]), job["smoke"], target_dev)
    _free(torch.device(target_dev))
    k = job["num_draft_tokens"]
    return {
        "environment": environment(),
        "draft_device": draft_dev,
        "target_device": target_dev,
        "paths": paths,
        "target_ms": graph_ms(
            job, paths["target"], target_dev, [1, k + 1], job.get("prefill_len", 0)
        ),
        "draft_ms": graph_ms(job, paths["draft"], draft_dev, [1]),
    }


def diagnose(job: dict[str, Any]) -> dict[str, Any]:
    """Each divergence's logit gap between the two runs' tokens, in units of the row's std."""
    longest = max(len(d["prompt"]) + len(d["prefix"]) for d in job["divergences"])
    runner = _load(job["path"], job["device"], job["dtype"], 1, longest + 1, [])
    out = []
    for d in job["divergences"]:
        runner.add_request("diagnose")
        try:
            ids = d["prompt"] + d["prefix"]
            logits = runner.forward([ForwardItem("diagnose", ids, 1)])[0].double().cpu()
        finally:
            runner.release("diagnose")
        a, b = d["target_only_token"], d["speculative_token"]
        gap = abs(float(logits[a] - logits[b]))
        std = float(logits.std())
        out.append(d | {"gap": gap, "gap_in_std": gap / std, "argmax": int(logits.argmax())})
    return {"divergences": out}


def main() -> None:
    task, job_path, out_path = sys.argv[1:4]
    job = json.loads(Path(job_path).read_text())
    result = prepare(job) if task == "prepare" else diagnose(job)
    Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
