"""BENCHMARKING ONLY: a stand-in for "the draft on a GPU of its own", for one-GPU machines.

`StandInRunner` takes the place of the draft's `ModelRunner`. Each forward waits as long as
the real draft's forward of the same shape took on the GPU (`StandInTimes`, measured by
`measure` in the same benchmark run, on the same GPU, before the services start), touches no
GPU, and returns fixed logits: its drafts are no model's choice. So the target has the GPU to
itself while the draft's work takes the time it would take on a second GPU of the same kind.

A run with it means something only where the drafts' values do not matter: the target's
synthetic acceptance (its verdicts ignore the drafts) and, with draft-ahead, the draft's
synthetic hit rate. It serves greedy requests only (its logits are a few columns wide, so it
has no q over the vocabulary to send). It is a measuring instrument, never a server for users.

    python -m draft_service.stand_in --model DIR --device cuda --dtype bfloat16 \\
        --max-slots 64 --cuda-graph-batch-sizes 1 2 4 8 16 32 --guesses 3 --out times.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from specdec.errors import InvalidInputError
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from specdec.runner.config import CheckpointInfo
from specdec.runner.kv_cache import SlotCache
from specdec.runner.timing import StepClock

Head = Callable[..., tuple[torch.Tensor, ...]]
GRAPHED_TOKENS = (1, 2)  # tokens per request of the graphs the draft replays (GRAPHED_TAIL)
WIDTH = 64  # columns of the stand-in's logits: more than any draft-ahead guess count (<= 33)
SPIN_S = 100e-6  # the end of each wait is spun: time.sleep overshoots by tens of microseconds
WARMUP_CALLS = 3


@dataclass(frozen=True, slots=True)
class StandInTimes:
    """The real draft's device time per forward, as measured on `gpu`.

    graph_s: (captured batch size, tokens per request) → seconds of that graph's replay (the
    head included); forward_s and fork_s: (fixed seconds, seconds per token) of an eager
    forward and of draft-ahead's KV copies (per branch-token copied); info: the measured
    checkpoint's, which the stand-in reports as its own.
    """

    gpu: str
    graph_s: dict[tuple[int, int], float]
    forward_s: tuple[float, float]
    fork_s: tuple[float, float]
    info: CheckpointInfo

    def __post_init__(self) -> None:
        values = [*self.graph_s.values(), *self.forward_s, *self.fork_s]
        if not all(0.0 <= v < 10.0 for v in values):
            raise ValueError(f"stand-in times must be in [0, 10) seconds, got {values}.")

    def graph(self, batch: int, tokens: int) -> float | None:
        return self.graph_s.get((batch, tokens))

    def forward(self, tokens: int) -> float:
        return self.forward_s[0] + self.forward_s[1] * tokens

    def fork(self, tokens: int) -> float:
        return self.fork_s[0] + self.fork_s[1] * tokens

    def to_json(self) -> dict[str, Any]:
        graphs = [{"batch": b, "tokens": n, "seconds": s} for (b, n), s in self.graph_s.items()]
        return {"benchmarking_only": True, "gpu": self.gpu, "graph_s": graphs,
                "forward_s": list(self.forward_s), "fork_s": list(self.fork_s),
                "info": asdict(self.info)}  # fmt: skip

    @classmethod
    def from_json(cls, data: Any) -> StandInTimes:
        """ValueError (a whole sentence) on anything but `to_json`'s shape."""
        try:
            if not isinstance(data, dict) or not isinstance(data["graph_s"], list):
                raise TypeError("an object with a list graph_s")
            graphs: dict[tuple[int, int], float] = {}
            for g in data["graph_s"]:
                key = (_count(g["batch"], "batch"), _count(g["tokens"], "tokens"))
                if key in graphs:
                    raise ValueError(f"graph {key} is given twice")
                graphs[key] = _seconds(g["seconds"])
            forward, fork = _pair(data["forward_s"], "forward_s"), _pair(data["fork_s"], "fork_s")
            info = _info(data["info"])
            gpu = data["gpu"]
            if not isinstance(gpu, str):
                raise TypeError("gpu must be a string")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"stand-in times must be the JSON `python -m draft_service.stand_in` writes "
                f"({type(e).__name__}: {e})."
            ) from e
        return cls(gpu, graphs, forward, fork, info)

    @classmethod
    def load(cls, path: str | Path) -> StandInTimes:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the stand-in times {str(path)!r}: {e}") from e
        return cls.from_json(data)


def _count(value: Any, name: str, low: int = 1, high: int | None = 4096) -> int:
    """`value`, an integer (not a bool) in [low, high] (no upper bound with high None)."""
    if (isinstance(value, bool) or not isinstance(value, int) or value < low
            or (high is not None and value > high)):  # fmt: skip
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")
    return value


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"seconds must be numbers, got {value!r}")
    if not 0.0 <= value < 10.0:  # NaN fails this too
        raise ValueError(f"stand-in times must be in [0, 10) seconds, got {value!r}")
    return float(value)


def _pair(value: Any, name: str) -> tuple[float, float]:
    if not isinstance(value, list) or len(value) != 2:
        raise ValueError(f"{name} must be a [fixed, per token] pair, got {value!r}")
    return _seconds(value[0]), _seconds(value[1])


def _info(value: Any) -> CheckpointInfo:
    """The measured checkpoint's info, each field of its declared type."""
    if not isinstance(value, dict):
        raise TypeError("info must be an object")
    info = CheckpointInfo(**value)
    for name, kind in (("architecture", str), ("dtype", str), ("tokenizer_hash", str),
                       ("fast_path", bool)):  # fmt: skip
        if not isinstance(getattr(info, name), kind):
            raise TypeError(f"info.{name} must be a {kind.__name__}")
    for name, low in (("vocab_size", 1), ("tokenizer_vocab_size", 0), ("max_seq_len", 0)):
        _count(getattr(info, name), f"info.{name}", low, None)
    return info


def wait_until(deadline: float) -> None:
    """Sleeps until `deadline` (time.perf_counter), spinning only its last SPIN_S."""
    left = deadline - time.perf_counter()
    if left > SPIN_S:
        time.sleep(left - SPIN_S)
    while time.perf_counter() < deadline:
        pass


class StandInRunner:
    """BENCHMARKING ONLY (module docstring): the `ModelRunner` interface the draft engine uses,
    over KV bookkeeping without KV, each forward taking its measured time."""

    def __init__(self, config: RunnerConfig, times: StandInTimes) -> None:
        self.config = replace(config, device="cpu")  # the graph sizes stay: they are emulated
        self.times = times
        self.info = replace(times.info, max_seq_len=config.max_seq_len)
        self.vocab_size = times.info.vocab_size
        self.tokenizer = None
        self.graph_steps = self.eager_steps = 0
        self.forwards = 0  # `forward` calls: prefills, and catch-ups too long for a graph
        # lengths and slots only: one layer of one float per position, never read
        self._cache = SlotCache(
            1, config.max_slots, config.max_seq_len, 1, 1, torch.float16, torch.device("cpu")
        )
        self._sizes = sorted(config.cuda_graph_batch_sizes)
        graphed = range(1, min(len(GRAPHED_TOKENS), config.cuda_graph_max_tokens) + 1)
        missing = [(b, n) for b in self._sizes for n in graphed if times.graph(b, n) is None]
        if missing:  # each would silently wait an eager forward's time instead
            raise ValueError(
                f"the stand-in times hold no graph of (batch, tokens) {missing}: measure them "
                "with the served --cuda-graph-batch-sizes and a --max-slots that holds them."
            )
        width = min(WIDTH, self.vocab_size)
        self._row = -torch.arange(width, dtype=torch.float32)  # argmax 0, guesses 0, 1, ...

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def uses_graphs(self) -> bool:
        return bool(self._sizes)

    @property
    def can_fork(self) -> bool:
        return True

    @property
    def free_slots(self) -> int:
        return self._cache.num_free

    @property
    def graphs_captured(self) -> int:
        return 0

    def add_request(self, request_id: str) -> None:
        self._cache.add(request_id)

    def release(self, request_id: str) -> None:
        self._cache.release(request_id)

    def cached_length(self, request_id: str) -> int:
        return self._cache.length(request_id)

    def truncate(self, request_id: str, length: int) -> None:
        self._cache.truncate(request_id, length)

    def swap(self, a: str, b: str) -> None:
        self._cache.swap(a, b)

    def fork(self, branches: list[tuple[str, str, int]]) -> None:
        start = time.perf_counter()
        self._cache.fork(branches)
        if branches:
            longest = max(length for _, _, length in branches)
            wait_until(start + self.times.fork(len(branches) * longest))

    def forward(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        start = time.perf_counter()
        if len({it.request_id for it in items}) != len(items):
            raise InvalidInputError("Each request may appear at most once in a forward.")
        for it in items:
            self._check(it.request_id, list(it.token_ids))
            if not 0 <= it.num_logits <= len(it.token_ids):
                raise InvalidInputError(
                    f"num_logits must be in [0, {len(it.token_ids)}] for request "
                    f"{it.request_id!r}, got {it.num_logits}."
                )
        for it in items:
            self._cache.extend(it.request_id, len(it.token_ids))
        self.forwards += 1
        wait_until(start + self.times.forward(sum(len(it.token_ids) for it in items)))
        return self._row.expand(sum(it.num_logits for it in items), -1)

    def graph_step(
        self,
        request_ids: Sequence[str],
        token_ids: torch.Tensor,  # [B, n]
        head: Head | None = None,
        head_inputs: Sequence[torch.Tensor] = (),
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        rows = token_ids.tolist()
        logits, outs = self.ragged_step(request_ids, rows, head, head_inputs)
        return outs if head is not None else logits

    def ragged_step(
        self,
        request_ids: Sequence[str],
        token_ids: Sequence[Sequence[int]],
        head: Head | None = None,
        head_inputs: Sequence[torch.Tensor] = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """As `ModelRunner.ragged_step`, in the time of the graph of that shape where the real
        runner would replay one, else of an eager forward of the tokens."""
        start = time.perf_counter()
        if len(token_ids) != len(request_ids) or any(len(t) == 0 for t in token_ids):
            raise InvalidInputError("ragged_step needs one non-empty token list per request.")
        if len(set(request_ids)) != len(request_ids):
            raise InvalidInputError("ragged_step needs one distinct request id per row.")
        n = max(len(t) for t in token_ids)
        for rid, t in zip(request_ids, token_ids, strict=True):
            self._check(rid, list(t))
        padded = next((s for s in self._sizes if s >= len(request_ids)), None)
        graphed = (
            padded is not None
            and n <= self.config.cuda_graph_max_tokens
            and all(self._cache.length(r) + n <= self.config.max_seq_len for r in request_ids)
        )
        seconds = self.times.graph(padded, n) if graphed and padded is not None else None
        if seconds is None:
            seconds = self.times.forward(sum(len(t) for t in token_ids))
            self.eager_steps += 1
        else:
            self.graph_steps += 1
        for rid, t in zip(request_ids, token_ids, strict=True):
            self._cache.extend(rid, len(t))
        logits = self._row.expand(len(request_ids), n, -1)  # [B, n, WIDTH]
        outs = tuple(head(logits, *head_inputs)) if head is not None else ()
        wait_until(start + seconds)
        return logits, outs

    def _check(self, request_id: str, tokens: list[int]) -> None:
        self._cache.check_room(request_id, len(tokens))
        if tokens and not (min(tokens) >= 0 and max(tokens) < self.vocab_size):
            raise InvalidInputError(
                f"token ids of request {request_id!r} must be in [0, {self.vocab_size})."
            )

    def own_device(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def to_host(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        return list(tensors)

    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


# Measuring (on the GPU the benchmark runs on, before the services start)


def _timed(runner: ModelRunner, call: Callable[[], object], repeats: int) -> float:
    """Median device time of `call` over `repeats` runs after WARMUP_CALLS (graphs captured)."""
    samples = []
    for i in range(WARMUP_CALLS + repeats):
        runner.synchronize()
        clock = StepClock(runner.device)
        clock.mark()
        call()
        clock.mark()
        runner.synchronize()
        if i >= WARMUP_CALLS:
            samples.append(clock.seconds(0, 1))
    return statistics.median(samples)


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (fixed, per unit) through (units, seconds), both clamped at 0."""
    xs, ys = [float(x) for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = max(sum((x - mx) * (y - my) for x, y in points) / var, 0.0) if var else 0.0
    return max(my - slope * mx, 0.0), slope


def measure(runner: ModelRunner, guesses: int, repeats: int = 20) -> StandInTimes:
    """The times a `StandInRunner` for this runner waits: each captured batch size's one- and
    two-token steps with the greedy head (and `guesses` draft-ahead guesses, as served with
    draft-ahead), an eager forward at several lengths, and the KV copies of a fork."""
    from draft_service.drafting import make_greedy_head, with_guesses

    vocab = runner.info.tokenizer_vocab_size or runner.vocab_size
    head = make_greedy_head(vocab)
    if guesses:
        head = with_guesses(head, vocab, min(guesses, vocab))
    prompt = 64
    sizes = [s for s in runner.config.cuda_graph_batch_sizes if s <= runner.free_slots]
    graphs: dict[tuple[int, int], float] = {}
    for bs in sorted(sizes):
        ids = _added(runner, bs, prompt)
        try:
            for n in GRAPHED_TOKENS:
                graphs[(bs, n)] = _timed(runner, _graph_step(runner, ids, n, head, prompt), repeats)
        finally:
            for rid in ids:
                runner.release(rid)
    lengths = [n for n in (16, 64, 256, 1024) if n <= runner.config.max_seq_len]
    eager = [(n, _timed(runner, partial(_prefill, runner, n), max(repeats // 4, 3)))
             for n in lengths]  # fmt: skip
    return StandInTimes(
        _gpu_name(runner.device), graphs, _line(eager), _fork_line(runner, repeats), runner.info
    )


def _graph_step(
    runner: ModelRunner, ids: list[str], n: int, head: Head, length: int
) -> Callable[[], None]:
    """A step of n tokens for each of `ids` (held at `length`), rolled back after."""
    zeros = runner.upload(torch.zeros(len(ids), dtype=torch.long))
    tokens = runner.upload(torch.zeros(len(ids), n, dtype=torch.long))

    def step() -> None:
        runner.graph_step(ids, tokens, head, (zeros,))
        for rid in ids:
            runner.truncate(rid, length)

    return step


def _added(runner: ModelRunner, count: int, length: int, tag: str = "m") -> list[str]:
    ids = [f"\x1fstand-in {tag}{i}" for i in range(count)]
    for rid in ids:
        runner.add_request(rid)
    runner.forward([ForwardItem(rid, list(range(length)), 0) for rid in ids])
    return ids


def _prefill(runner: ModelRunner, length: int) -> None:
    (rid,) = _added(runner, 1, length, "p")
    runner.release(rid)


def _fork_line(runner: ModelRunner, repeats: int) -> tuple[float, float]:
    branches = min(8, runner.free_slots - 1)
    if branches < 1:
        return 0.0, 0.0
    points = []
    for length in (n for n in (64, 512) if n <= runner.config.max_seq_len):
        held = _added(runner, 1, length, "s")
        try:
            for i in range(branches):
                held.append(f"\x1fstand-in b{i}")
                runner.add_request(held[-1])
            forks = [(held[0], bid, length) for bid in held[1:]]
            seconds = _timed(runner, partial(runner.fork, forks), repeats)
            points.append((branches * length, seconds))
        finally:
            for rid in held:
                runner.release(rid)
    return _line(points)


def _gpu_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device)


def main(argv: list[str] | None = None) -> int:
    from specdec.serving.cli import add_runner_args, runner_config

    parser = argparse.ArgumentParser(
        prog="python -m draft_service.stand_in",
        description="BENCHMARKING ONLY: measures the draft's forwards on this device for the "
        "draft stand-in (`specdec serve --draft-stand-in`).",
    )
    add_runner_args(parser)
    parser.add_argument(
        "--guesses",
        type=int,
        default=0,
        help="draft-ahead's guesses per position (--draft-ahead + 1; 0: off)",
    )
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per shape")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args(argv)
    runner = ModelRunner.load(runner_config(args))
    runner.own_device()
    times = measure(runner, args.guesses, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(times.to_json(), indent=1) + "\n")
    for (b, n), s in sorted(times.graph_s.items()):
        print(f"graph batch {b:3d} x {n} tokens: {s * 1e3:.3f} ms")
    print(f"eager forward: {times.forward_s[0] * 1e3:.3f} ms + "
          f"{times.forward_s[1] * 1e6:.2f} us per token; fork: {times.fork_s[0] * 1e3:.3f} ms + "
          f"{times.fork_s[1] * 1e9:.1f} ns per branch-token ({times.gpu})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
