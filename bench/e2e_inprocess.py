"""The system benchmark's GPU work outside the services, in a child process so that all its
device memory is returned before the services start (`python -m bench.e2e_inprocess TASK IN OUT`).

prepare: builds (or reuses) the checkpoints, then loads them through `ModelRunner.load` and
  times graph steps as `runner_bench` does: target decode (n = 1), target verify (n = k + 1)
  and draft step (n = 1) at each batch size, with the services' CUDA graph sizes; with
  "prefill_len" in the job, also the target's prefill of one prompt of that many tokens.
diagnose: for greedy runs that diverged, the target's logits at each first divergence computed
  twice, each the way its run computed them (`replay`, with the service's runner settings: its
  dtype, slots, sequence length and CUDA graph sizes): (a) the target-only run replayed as it
  ran, the prompt but its last token prefilled, then one-token steps of the whole batch along
  its tokens; (b) the speculative run replayed step by step with its own step boundaries, every
  step a (k + 1)-token verify of its batch. The divergence is explained by numerics iff each
  computation's argmax is its own run's token (`verdict`): the flip is reproduced by the two
  kernel shapes alone. Anything else (a run's token not reproduced) is a failure.
"""

from __future__ import annotations

import gc
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import e2e_models
from bench.runner_bench import prefill, runner_step_ms, timed
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig


def devices(smoke: bool, target_tp: int = 1) -> tuple[str, str]:
    """(draft device, target device): two GPUs where there are, one shared otherwise; a
    target over `target_tp` > 1 GPUs starts at cuda:1 (its ranks on cuda:1 .. cuda:N)."""
    if smoke or not torch.cuda.is_available():
        return "cpu", "cpu"
    if target_tp > 1 and torch.cuda.device_count() < target_tp + 1:
        raise ValueError(
            f"a target over {target_tp} GPUs and its draft need {target_tp + 1}; this machine "
            f"has {torch.cuda.device_count()}."
        )
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


def _load(
    path: str, device: str, dtype: str, slots: int, seq: int, sizes: list[int], tp: int = 1
) -> Any:
    graphs = tuple(s for s in sizes if s <= slots) if device.startswith("cuda") else ()
    config = RunnerConfig(
        path,
        device=device,
        dtype=dtype,
        max_slots=slots,
        max_seq_len=seq,
        cuda_graph_batch_sizes=graphs,
        tensor_parallel=tp,
    )
    return ModelRunner.load(config)


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def graph_ms(
    job: dict[str, Any], path: str, device: str, ns: list[int], prefill_len: int = 0, tp: int = 1
) -> dict[str, float]:
    """ "n,b" → mean ms of one graph step of b requests × n tokens at job["ctx"] tokens of KV;
    with `prefill_len`, also "prefill,N": one request's N-token prompt in one `forward` (its
    next-token logits included), in a slot of its own, from an idle device to the logits on it
    (one call's latency, what a request's time to first token contains); and
    "prefill_pipelined,N": the mean of back-to-back calls, each launched while the previous one
    runs (throughput, which no single request sees); "prefill_idle,N": one call after the
    process and the device sat idle for IDLE_S, as a request reaching an idle server finds
    them."""
    batches, ctx = job["batches"], job["ctx"]
    slots, seq = max(batches) + (1 if prefill_len else 0), max(ctx + 64, prefill_len + 1)
    runner = _load(path, device, job["dtype"], slots, seq, job["graph_sizes"], tp)
    dev = torch.device(device)
    ids = prefill(runner, max(batches), ctx, dev)
    out = {}
    for b in batches:
        for n in ns:
            out[f"{n},{b}"] = runner_step_ms(runner, ids[:b], n, ctx, True, dev, job["iters"])
    if prefill_len:
        out[f"prefill,{prefill_len}"] = prefill_ms(runner, prefill_len, dev, job["iters"], True)
        out[f"prefill_pipelined,{prefill_len}"] = prefill_ms(
            runner, prefill_len, dev, job["iters"], False
        )
        out[f"prefill_idle,{prefill_len}"] = prefill_idle_ms(runner, prefill_len, dev, job["iters"])
    runner.close()  # a tensor-parallel target's other ranks
    del runner
    _free(dev)
    return out


def prefill_ms(runner: ModelRunner, n: int, dev: torch.device, iters: int, each: bool) -> float:
    """Mean ms of `ModelRunner.forward` of one n-token item (then rolled back); `each`: the
    device is synchronised after every call (one call's latency), else only after the last."""
    g = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(1, 1000, (n,), generator=g)
    runner.add_request("prefill")

    def step() -> None:
        runner.forward([ForwardItem("prefill", tokens, 1)])
        if each:
            runner.synchronize()
        runner.truncate("prefill", 0)

    try:
        return timed(step, dev, warmup=2, iters=iters)
    finally:
        runner.release("prefill")


IDLE_S = 0.2  # the TTFT requests' gaps are at least this long (wait_idle)


def prefill_idle_ms(runner: ModelRunner, n: int, dev: torch.device, iters: int) -> float:
    """Mean ms of one `forward` of an n-token item to its synchronised end, each call after
    IDLE_S with nothing running."""
    g = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(1, 1000, (n,), generator=g)
    runner.add_request("prefill")
    times = []
    try:
        for i in range(iters + 1):
            runner.synchronize()
            time.sleep(IDLE_S)
            start = time.perf_counter()
            runner.forward([ForwardItem("prefill", tokens, 1)])
            runner.synchronize()
            if i:  # the first one warms up
                times.append(time.perf_counter() - start)
            runner.truncate("prefill", 0)
    finally:
        runner.release("prefill")
    return 1e3 * sum(times) / len(times)


def prepare(job: dict[str, Any]) -> dict[str, Any]:
    tp = job.get("target_tp", 1)
    draft_dev, target_dev = devices(job["smoke"], tp)
    pair = job.get("pair", e2e_models.DEFAULT_PAIR)
    paths = e2e_models.build(Path(job["cache"]), job["smoke"], target_dev, pair)
    _free(torch.device(target_dev))
    k = job["num_draft_tokens"]
    return {
        "environment": environment(),
        "draft_device": draft_dev,
        "target_device": target_dev,
        "paths": paths,
        "target_ms": graph_ms(
            job, paths["target"], target_dev, [1, k + 1], job.get("prefill_len", 0), tp
        ),
        "draft_ms": graph_ms(job, paths["draft"], draft_dev, [1]),
    }


def replay(
    runner: ModelRunner,
    prompts: list[list[int]],
    tokens: list[list[int]],
    steps: list[list[int]],
    n: int,
    wanted: dict[int, int],
) -> dict[int, torch.Tensor]:
    """Replays a greedy run as the target service ran it (`target_service.engine`): admission
    prefills each prompt but its last token, then every step scores, for each request still
    running, [last committed token, its next n - 1 tokens] in one `ragged_step` of the whole
    batch and keeps what the run committed (steps[i]: request i's tokens per step; a verify's
    rows past what it committed only depend on what it committed, by causality, so the
    rejected drafts, unknown here, are filled with 0). Returns request → the float64 logits
    row that scored its position wanted[request] (0 = the first new token)."""
    rids = [f"replay-{i}" for i in range(len(prompts))]
    done = [0] * len(prompts)  # tokens committed so far
    out: dict[int, torch.Tensor] = {}
    for rid, prompt in zip(rids, prompts, strict=True):
        runner.add_request(rid)
        if len(prompt) > 1:
            runner.forward([ForwardItem(rid, prompt[:-1], 0)])
    try:
        for s in range(max(len(c) for c in steps)):
            batch = [i for i, c in enumerate(steps) if len(c) > s]
            rows = []
            for i in batch:
                last = tokens[i][done[i] - 1] if done[i] else prompts[i][-1]
                ahead = tokens[i][done[i] : done[i] + n - 1]
                rows.append([last, *ahead, *([0] * (n - 1 - len(ahead)))])
            logits, _ = runner.ragged_step([rids[i] for i in batch], rows)
            for b, i in enumerate(batch):
                row = wanted.get(i, -1) - done[i]
                if i not in out and 0 <= row < steps[i][s]:
                    out[i] = logits[b, row].double().cpu()
            for i in batch:
                done[i] += steps[i][s]
                runner.truncate(rids[i], len(prompts[i]) - 1 + done[i])
    finally:
        for rid in rids:
            runner.release(rid)
    return out


def verdict(a: torch.Tensor, b: torch.Tensor, plain: int, spec: int) -> dict[str, Any]:
    """The record of one divergence from the target's logits rows for its position: `a` as
    target-only computed it, `b` as speculation did. Numerics iff each row's maximum is at its
    own run's token (a tie at the maximum counts: greedy may take either)."""
    std = float(a.std())
    gap = float(a[plain] - a[spec])
    noise = float((a - b).abs().max())
    reproduced_a = bool(a[plain] == a.max())
    reproduced_b = bool(b[spec] == b.max())
    return {
        "logits_one_token": {
            "target_only_token": float(a[plain]),
            "speculative_token": float(a[spec]),
        },
        "logits_verify": {
            "target_only_token": float(b[plain]),
            "speculative_token": float(b[spec]),
        },
        "argmax_one_token": int(a.argmax()),
        "argmax_verify": int(b.argmax()),
        "one_token_reproduces_target_only": reproduced_a,
        "verify_reproduces_speculative": reproduced_b,
        "numerics": reproduced_a and reproduced_b,
        "std": std,
        "gap": abs(gap),
        "gap_in_std": abs(gap) / std,
        "noise": noise,
        "noise_in_std": noise / std,
    }


def diagnose(job: dict[str, Any]) -> dict[str, Any]:
    """Each divergence's two logits rows (see the module's docstring) and their verdict."""
    runner = _load(
        job["path"], job["device"], job["dtype"], job["max_slots"], job["max_seq_len"],
        job["graph_sizes"], job.get("target_tp", 1),
    )  # fmt: skip
    prompts, k = job["prompts"], job["num_draft_tokens"]
    plain, spec = job["target_only"], job["speculative"]
    wanted = {d["request"]: d["position"] for d in job["divergences"]}
    one_token = replay(runner, prompts, plain, [[1] * len(t) for t in plain], 1, wanted)
    verify = replay(runner, prompts, spec, job["speculative_steps"], k + 1, wanted)
    out = []
    for d in job["divergences"]:
        i = d["request"]
        record = verdict(one_token[i], verify[i], d["target_only_token"], d["speculative_token"])
        out.append(d | record)
    return {"divergences": out, "numerics": all(d["numerics"] for d in out)}


def main() -> None:
    task, job_path, out_path = sys.argv[1:4]
    job = json.loads(Path(job_path).read_text())
    result = prepare(job) if task == "prepare" else diagnose(job)
    Path(out_path).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
