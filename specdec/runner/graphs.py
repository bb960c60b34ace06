"""CUDA graphs of equal-length steps (decode, verify, draft), captured lazily per shape.

A graph is keyed by (padded batch size, tokens per request, head, head input layout). Its
inputs are static buffers the caller's values are copied into before replay (padding rows
point at the scratch KV slot); its outputs — float32 logits and whatever the head returns —
are static buffers allocated before capture and written by copy kernels inside the graph, so a
replay always rewrites every buffer a consumer reads (vLLM PR #37639 shipped replays that left
draft logits stale). The returned tensors are views of these buffers: valid until the next
step with the same key.
"""

from collections.abc import Callable, Iterator, Sequence
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
        self._chain_logits: dict[int, torch.Tensor] = {}  # by batch size (`_buffers`)
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
        self._replay(g, tokens, starts, slots, head_inputs)
        return g.logits[:b], tuple(o[:b] for o in g.head_outputs)

    def run_chain(
        self,
        bs: int,
        tokens: torch.Tensor,
        starts: torch.Tensor,
        slots: torch.Tensor,
        head: Head,
        head_inputs: Sequence[torch.Tensor],
        steps: int,
        advance: int,
    ) -> tuple[torch.Tensor, ...]:
        """`chain_body` in one replay (capturing first if new) for tokens [B, 1], B <= bs:
        the head's outputs stacked [steps, B, ...], views of static buffers valid until the
        next chain of the same key."""
        b = tokens.shape[0]
        layout = tuple((tuple(x.shape[1:]), x.dtype) for x in head_inputs)
        key = ("chain", bs, steps, advance, head, layout)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(bs, 1, head, head_inputs, (steps, advance))
        self._replay(g, tokens, starts, slots, head_inputs)
        return tuple(o[:, :b] for o in g.head_outputs)

    def _replay(
        self,
        g: _Graph,
        tokens: torch.Tensor,
        starts: torch.Tensor,
        slots: torch.Tensor,
        head_inputs: Sequence[torch.Tensor],
    ) -> None:
        """The inputs copied into the graph's buffers (padding rows: the scratch slot), then
        the replay."""
        self._fill(g.tokens, tokens, 0)
        self._fill(g.starts, starts, 0)
        self._fill(g.slots, slots, self._scratch)
        for static, x in zip(g.head_inputs, head_inputs, strict=True):
            self._fill(static, x, 0)
        g.graph.replay()

    @staticmethod
    def _fill(static: torch.Tensor, value: torch.Tensor, pad: int) -> None:
        b = value.shape[0]
        static[:b].copy_(value, non_blocking=True)
        if b < static.shape[0]:
            static[b:].fill_(pad)

    def _capture(
        self,
        bs: int,
        n: int,
        head: Head | None,
        head_inputs: Sequence[torch.Tensor],
        chain: tuple[int, int] | None = None,  # (steps, advance): `chain_body`'s graph
    ) -> _Graph:
        dev = self._device
        inputs, logits, body = self._buffers(bs, n, head, head_inputs, chain)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                example = body(None)
        torch.cuda.current_stream(dev).wait_stream(side)
        outputs = tuple(torch.empty_like(x) for x in example)
        graph = torch.cuda.CUDAGraph()
        # on this device's own stream: torch.cuda.graph's default capture stream is made once
        # per process, on whichever device captured first, and entering it makes that device
        # current (Triton then launched cuda:1's kernels on cuda:0)
        with torch.cuda.graph(graph, pool=self._pool, stream=side):
            body(outputs)
        return _Graph(graph, *inputs, logits, outputs)

    def _buffers(
        self,
        bs: int,
        n: int,
        head: Head | None,
        head_inputs: Sequence[torch.Tensor],
        chain: tuple[int, int] | None,
    ) -> tuple[
        tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]],
        torch.Tensor,
        Callable[[tuple[torch.Tensor, ...] | None], tuple[torch.Tensor, ...]],
    ]:
        """A graph's static inputs (tokens, starts, slots — the scratch slot — and head
        inputs), its logits buffer, and its body: the step (or `chain_body`) that writes its
        outputs into the buffers it is given, or returns them where given None. A chain's
        logits are its own business: one buffer per batch size serves them all."""
        dev = self._device
        tokens = torch.zeros(bs, n, dtype=torch.long, device=dev)
        starts = torch.zeros(bs, dtype=torch.long, device=dev)
        slots = torch.full((bs, *self._slot_shape), self._scratch, dtype=torch.long, device=dev)
        static_in = tuple(
            torch.zeros((bs, *x.shape[1:]), dtype=x.dtype, device=dev) for x in head_inputs
        )
        if chain is not None:
            logits = self._chain_logits.get(bs)
            if logits is None:
                logits = self._chain_logits[bs] = torch.empty(
                    bs, 1, self._vocab, dtype=torch.float32, device=dev
                )
        else:
            logits = torch.empty(bs, n, self._vocab, dtype=torch.float32, device=dev)

        def body(out: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, ...]:
            if chain is not None:
                assert head is not None
                return chain_body(self._step, tokens, starts, slots, self._kv_len, logits,
                                  head, static_in, *chain, out=out)  # fmt: skip
            self._step(tokens, starts, slots, self._kv_len, out=logits)
            made = tuple(head(logits, *static_in)) if head is not None else ()
            if out is None:
                return made
            for buf, x in zip(out, made, strict=True):
                buf.copy_(x)
            return out

        return (tokens, starts, slots, static_in), logits, body


def fed_steps(
    step: Callable[[int, torch.Tensor, list[torch.Tensor]], tuple[torch.Tensor, ...]],
    token_ids: torch.Tensor,
    head_inputs: Sequence[torch.Tensor],
    steps: int,
    advance: int,
) -> Iterator[tuple[torch.Tensor, ...]]:
    """A chain's rule, one place for the graph (`chain_body`) and the host's loop
    (`runner.steps_in_turn`): step j (`step(j, tokens [B, 1], head inputs)`, its head's
    outputs) takes the token the head sampled in step j - 1 (its first output; token_ids
    for step 0) and head input `advance` (the position a counter-based sampler draws at)
    + j. Yields each step's outputs."""
    inputs = list(head_inputs)
    tokens = token_ids
    for j in range(steps):
        if j:
            inputs[advance] = head_inputs[advance] + j
        made = step(j, tokens, inputs)
        yield made
        tokens = made[0].view(-1, 1).long()


def stacked(outs: Sequence[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Each output of the steps stacked: [steps, B, ...]."""
    return tuple(torch.stack([o[i] for o in outs]) for i in range(len(outs[0])))


def chain_body(
    step: StepFn,
    tokens: torch.Tensor,  # [B, 1]: the first step's input
    starts: torch.Tensor,  # [B]: the rows' lengths before the first step
    slots: torch.Tensor,
    kv_len: int,
    logits: torch.Tensor,  # [B, 1, V] float32, rewritten by each step
    head: Head,
    head_inputs: Sequence[torch.Tensor],
    steps: int,
    advance: int,
    out: tuple[torch.Tensor, ...] | None = None,  # each [steps, B, ...]: written, returned
) -> tuple[torch.Tensor, ...]:
    """`steps` one-token steps fed by `fed_steps`, at starts + j: what `steps` graph steps fed
    back by the host do, with no host work between them. Returns the head's outputs stacked
    [steps, B, ...] (into `out` where given). Captured whole as one graph
    (`StepGraphs.run_chain`); runs eagerly as well."""

    def one(j: int, t: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        step(t, starts + j, slots, kv_len, out=logits)
        return tuple(head(logits, *inputs))

    made = fed_steps(one, tokens, head_inputs, steps, advance)
    if out is None:
        return stacked(list(made))
    for j, outputs in enumerate(made):
        for buf, x in zip(out, outputs, strict=True):
            buf[j].copy_(x)
    return out
