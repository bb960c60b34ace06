"""CUDA graphs of equal-length steps (decode, verify, draft), captured lazily per shape.

A graph is keyed by (padded batch size, tokens per request, head, head input layout). Its
inputs are static buffers the caller's values are copied into before replay (padding rows
point at the scratch KV slot); its outputs — float32 logits and whatever the head returns —
are static buffers allocated before capture and written by copy kernels inside the graph, so a
replay always rewrites every buffer a consumer reads (vLLM PR #37639 shipped replays that left
draft logits stale). The returned tensors are views of these buffers: valid until the next
step with the same key.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# step(tokens [B, n], starts [B], slots [B], kv_len, out [B, n, V]) -> out
StepFn = Callable[..., torch.Tensor]
Head = Callable[..., Sequence[torch.Tensor]]


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor  # [bs, n] int64
    starts: torch.Tensor  # [bs] int64
    slots: torch.Tensor  # [bs] int64; paged: block tables [bs, table_width]
    head_inputs: tuple[torch.Tensor, ...]  # each [bs, ...]
    logits: torch.Tensor  # [bs, n, V] float32
    head_outputs: tuple[torch.Tensor, ...]  # each [bs, ...]


class StepGraphs:
    def __init__(
        self,
        step: StepFn,
        batch_sizes: Sequence[int],
        vocab_size: int,
        max_seq_len: int,
        scratch_slot: int,
        device: torch.device,
        table_width: int | None = None,
    ) -> None:
        self._step = step
        self._sizes = sorted(batch_sizes)
        self._vocab = vocab_size
        self._kv_len = max_seq_len
        self._scratch = scratch_slot
        self._device = device
        # a paged cache's steps pass block tables [B, table_width] where slots [B] go
        self._slot_shape = () if table_width is None else (table_width,)
        self._graphs: dict[tuple[object, ...], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self._sizes else None

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def release(self) -> None:
        """Destroys every captured graph once the device's queued work is done (later steps
        capture again). A graph that captured a collective holds its NCCL communicator: the
        group's end, orderly or aborted, waits until that graph is destroyed."""
        if not self._graphs:
            return
        torch.cuda.synchronize(self._device)
        for g in self._graphs.values():
            g.graph.reset()
        self._graphs.clear()

    def padded_size(self, batch: int) -> int | None:
        return next((s for s in self._sizes if s >= batch), None)

    def run(
        self,
        bs: int,
        tokens: torch.Tensor,
        starts: torch.Tensor,
        slots: torch.Tensor,
        head: Head | None,
        head_inputs: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Replays (capturing first if new) for tokens [B, n], starts [B], slots [B], B <= bs."""
        b, n = tokens.shape
        layout = tuple((tuple(x.shape[1:]), x.dtype) for x in head_inputs)
        key = (bs, n, head, layout)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(bs, n, head, head_inputs)
        self._fill(g.tokens, tokens, 0)
        self._fill(g.starts, starts, 0)
        self._fill(g.slots, slots, self._scratch)
        for static, x in zip(g.head_inputs, head_inputs, strict=True):
            self._fill(static, x, 0)
        g.graph.replay()
        return g.logits[:b], tuple(o[:b] for o in g.head_outputs)

    @staticmethod
    def _fill(static: torch.Tensor, value: torch.Tensor, pad: int) -> None:
        b = value.shape[0]
        static[:b].copy_(value, non_blocking=True)
        if b < static.shape[0]:
            static[b:].fill_(pad)

    def _capture(
        self, bs: int, n: int, head: Head | None, head_inputs: Sequence[torch.Tensor]
    ) -> _Graph:
        dev = self._device
        tokens = torch.zeros(bs, n, dtype=torch.long, device=dev)
        starts = torch.zeros(bs, dtype=torch.long, device=dev)
        slots = torch.full((bs, *self._slot_shape), self._scratch, dtype=torch.long, device=dev)
        static_in = tuple(
            torch.zeros((bs, *x.shape[1:]), dtype=x.dtype, device=dev) for x in head_inputs
        )
        logits = torch.empty(bs, n, self._vocab, dtype=torch.float32, device=dev)

        def body() -> tuple[torch.Tensor, ...]:
            self._step(tokens, starts, slots, self._kv_len, out=logits)
            return tuple(head(logits, *static_in)) if head is not None else ()

        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                example = body()
        torch.cuda.current_stream(dev).wait_stream(side)
        outputs = tuple(torch.empty_like(x) for x in example)
        graph = torch.cuda.CUDAGraph()
        # on this device's own stream: torch.cuda.graph's default capture stream is made once
        # per process, on whichever device captured first, and entering it makes that device
        # current (Triton then launched cuda:1's kernels on cuda:0)
        with torch.cuda.graph(graph, pool=self._pool, stream=side):
            for buf, x in zip(outputs, body(), strict=True):
                buf.copy_(x)
        return _Graph(graph, tokens, starts, slots, static_in, logits, outputs)
