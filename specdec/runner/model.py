"""A plain-torch decoder for the Llama family: Llama 2/3, Mistral, Qwen2/2.5, Qwen3.

One module covers the four, since they differ only in switches read from the config: grouped
query attention (`num_key_value_heads`), biases on q/k/v (Qwen2; read from the checkpoint, so any
bias present is used), RMSNorm on q and k per head (Qwen3), tied embeddings, a sliding window,
and the rope variant (inverse frequencies come from transformers' own rope functions, so
llama3, linear and yarn scaling match it exactly).

q/k/v and gate/up are fused into one matrix each, and the pointwise work between GEMMs runs as
three Triton kernels on CUDA (`fused`: residual add + RMSNorm, q/k norm + rope + K/V store,
silu * up), to keep the kernel count of a decode step low: at batch 1 a step is a few hundred
small kernels and their launch gaps are what separates it from the memory floor.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from specdec.runner import fused, gemv
from specdec.runner.attention import AttnMeta, attention
from specdec.tensor_parallel import split_problem

FAST_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


@dataclass(frozen=True, slots=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    windows: tuple[int | None, ...]  # sliding window per layer, None for full attention
    intermediate_size: int = 0  # the MLP's width (0: unknown, only tensor parallelism needs it)

    @classmethod
    def from_hf(cls, config: object) -> "ModelArgs":
        c = config
        heads = int(c.num_attention_heads)  # type: ignore[attr-defined]
        hidden = int(c.hidden_size)  # type: ignore[attr-defined]
        layers = int(c.num_hidden_layers)  # type: ignore[attr-defined]
        window = getattr(c, "sliding_window", None)
        types = getattr(c, "layer_types", None) or ["full_attention"] * layers
        if c.model_type == "mistral":  # type: ignore[attr-defined]
            windows = tuple(window for _ in range(layers))
        else:
            windows = tuple(window if t == "sliding_attention" else None for t in types)
        return cls(
            model_type=str(c.model_type),  # type: ignore[attr-defined]
            vocab_size=int(c.vocab_size),  # type: ignore[attr-defined]
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(c, "head_dim", None) or hidden // heads),
            rms_norm_eps=float(c.rms_norm_eps),  # type: ignore[attr-defined]
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            windows=windows,
            intermediate_size=int(getattr(c, "intermediate_size", 0) or 0),
        )

    def sharded(self, world: int) -> "ModelArgs":
        """One rank's part when `world` ranks split the heads and the MLP (`Shard`)."""
        if world == 1:
            return self
        check_tensor_parallel(self, world)
        return replace(self, num_heads=self.num_heads // world,
                       num_kv_heads=self.num_kv_heads // world,
                       intermediate_size=self.intermediate_size // world)  # fmt: skip


def check_tensor_parallel(args: ModelArgs, world: int) -> None:
    """ValueError unless `world` ranks can split this model's heads, KV heads and MLP evenly."""
    problem = split_problem(args.num_heads, args.num_kv_heads, args.intermediate_size, world)
    if problem is not None:
        raise ValueError(problem)


@dataclass(frozen=True, slots=True)
class Shard:
    """Which part of a tensor-parallel model this rank holds: rank `rank` of `world` ranks
    of one node, whose activations' collectives run in `group` (a torch.distributed process
    group; None with world 1).

    Megatron's split: q/k/v and gate/up are column-parallel (rank r holds heads
    [r H/N, (r+1) H/N), KV heads likewise, and the r-th N-th of the MLP's width), o_proj and
    down_proj row-parallel (their partial sums are all-reduced; their biases are added on rank
    0 only), the output head vocabulary-parallel (the ranks' logits are all-gathered), and the
    embedding and the norms replicated."""

    rank: int = 0
    world: int = 1
    group: Any = None

    def span(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of `n` rows split evenly (n divisible by world)."""
        part = n // self.world
        return self.rank * part, (self.rank + 1) * part

    def vocab_span(self, vocab: int) -> tuple[int, int]:
        """This rank's rows of the output head: ceil(vocab / world) each, the last fewer."""
        part = -(-vocab // self.world)
        return min(vocab, self.rank * part), min(vocab, (self.rank + 1) * part)

    def vocab_rows(self, vocab: int) -> int:
        return -(-vocab // self.world)


ONE_RANK = Shard()
# get(name) -> the whole tensor, or get(name, (dim, start, stop)) -> its slice [start, stop)
# along dim, read without reading the rest where the source allows it; None if absent
Getter = Callable[..., torch.Tensor | None]


def slicing_getter(tensors: dict[str, torch.Tensor]) -> Getter:
    """A `Getter` over tensors in memory (tests, benchmarks)."""

    def get(name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor | None:
        t = tensors.get(name)
        if t is None or part is None:
            return t
        dim, start, stop = part
        return t.narrow(dim, start, stop - start)

    return get


def rope_type(config: object) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = params or {}
    return str(params.get("rope_type", params.get("type", "default")))


def rope_tables(config: object, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq_len, head_dim] in float32, computed as transformers computes them."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)  # type: ignore[arg-type]
    freqs = torch.arange(max_seq_len, dtype=torch.float32)[:, None] * rotary.inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * rotary.attention_scaling, emb.sin() * rotary.attention_scaling


class Transformer:
    """Weights (a flat dict of tensors) plus the forward pass over a flat batch of tokens."""

    def __init__(
        self,
        args: ModelArgs,
        weights: dict[str, torch.Tensor],
        cos: torch.Tensor,
        sin: torch.Tensor,
        shard: Shard = ONE_RANK,
        vocab_size: int | None = None,
    ) -> None:
        """`args`: this rank's part (`ModelArgs.sharded`); `vocab_size`: the whole output
        head's rows (default: this one's, which is the whole head on one rank)."""
        self.args = args
        self.w = weights
        self.cos = cos  # [max_seq_len, head_dim] in the model dtype, as transformers casts it
        self.sin = sin
        self.shard = shard
        self.vocab_size = int(weights["lm_head"].shape[0]) if vocab_size is None else vocab_size
        self.use_kernels(weights["embed"].device.type == "cuda")

    @classmethod
    def from_hf_state(
        cls,
        args: ModelArgs,
        get: Getter,
        cos: torch.Tensor,
        sin: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
        shard: Shard = ONE_RANK,
    ) -> "Transformer":
        """Builds from HF parameter names (`args` describes the whole model); `get` as
        `Getter`. With a `shard`, only this rank's part of each tensor is read."""
        world = shard.world
        h, kv = args.head_dim * args.num_heads, args.head_dim * args.num_kv_heads
        local = args.sharded(world)

        def load(name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor | None:
            t = get(name) if part is None or world == 1 else get(name, part)
            return None if t is None else t.to(device=device, dtype=dtype)

        def need(name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
            t = load(name, part)
            if t is None:
                raise KeyError(name)
            return t

        def cat(names: list[str], widths: list[int]) -> torch.Tensor | None:
            parts = [load(n, (0, *shard.span(w))) for n, w in zip(names, widths, strict=True)]
            if all(p is None for p in parts):
                return None
            if any(p is None for p in parts):
                raise KeyError(names[[p is None for p in parts].index(True)])
            return torch.cat(parts)  # type: ignore[arg-type]

        def first_rank(name: str) -> torch.Tensor | None:  # a row-parallel bias: added once
            return load(name) if shard.rank == 0 else None

        w: dict[str, torch.Tensor] = {
            "embed": need("model.embed_tokens.weight"),
            "norm": need("model.norm.weight"),
        }
        w["lm_head"] = cls._head(args, get, load, w["embed"], shard)
        inner = args.intermediate_size
        for i in range(args.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            qkv = [a + "q_proj.", a + "k_proj.", a + "v_proj."]
            opt: dict[str, torch.Tensor | None] = {
                "qkv_w": cat([n + "weight" for n in qkv], [h, kv, kv]),
                "qkv_b": cat([n + "bias" for n in qkv], [h, kv, kv]),
                "o_w": need(a + "o_proj.weight", (1, *shard.span(h))),
                "o_b": first_rank(a + "o_proj.bias"),
                "q_norm": load(a + "q_norm.weight"),
                "k_norm": load(a + "k_norm.weight"),
                "gate_up_w": cat([m + "gate_proj.weight", m + "up_proj.weight"], [inner, inner]),
                "gate_up_b": cat([m + "gate_proj.bias", m + "up_proj.bias"], [inner, inner]),
                "down_w": need(m + "down_proj.weight", (1, *shard.span(inner))),
                "down_b": first_rank(m + "down_proj.bias"),
                "in_norm": need(p + "input_layernorm.weight"),
                "post_norm": need(p + "post_attention_layernorm.weight"),
            }
            for k, t in opt.items():
                if t is not None:
                    w[f"{i}.{k}"] = t
        return cls(local, w, cos.to(device, dtype), sin.to(device, dtype), shard, args.vocab_size)

    @staticmethod
    def _head(
        args: ModelArgs,
        get: Getter,
        load: Callable[..., torch.Tensor | None],
        embed: torch.Tensor,
        shard: Shard,
    ) -> torch.Tensor:
        """The output head, or this rank's rows of it padded to vocab_rows with zeros (the
        embedding's where the checkpoint ties them or has no head)."""
        if shard.world == 1:
            head = None if args.tie_word_embeddings else load("lm_head.weight")
            return embed if head is None else head
        # one row tells whether the checkpoint has a head, without reading the rest
        tied = args.tie_word_embeddings or get("lm_head.weight", (0, 0, 1)) is None
        start, stop = shard.vocab_span(args.vocab_size)
        head = embed[start:stop] if tied else load("lm_head.weight", (0, start, stop))
        assert head is not None
        rows = shard.vocab_rows(args.vocab_size)
        if head.shape[0] < rows:
            head = torch.cat([head, head.new_zeros(rows - head.shape[0], head.shape[1])])
        return head

    def use_kernels(self, on: bool) -> None:
        """The Triton kernels of `fused` (default on CUDA) or their torch references."""
        self._add_norm = fused.add_rms_norm if on else fused.add_rms_norm_reference
        self._silu_mul = fused.silu_mul if on else fused.silu_mul_reference
        self._rope_store = fused.rope_store if on else fused.rope_store_reference
        self._linear: Callable[..., torch.Tensor] = F.linear
        if on:  # the split products' counters: this model's own (gemv.split_counters)
            counters = gemv.split_counters(self.w["embed"].device)
            self._linear = functools.partial(gemv.linear, counters=counters)

    def compile_pointwise(self) -> None:
        """The torch references of the pointwise pieces (norms, rope, silu * up) fused by
        torch.compile instead of the hand-written kernels; the K/V store stays an index_put.
        Kept to measure one against the other (bench/runner_bench.py)."""
        compiled_rope = torch.compile(fused.qk_rope_reference, dynamic=True)
        self._add_norm = torch.compile(fused.add_rms_norm_reference, dynamic=True)
        self._silu_mul = torch.compile(fused.silu_mul_reference, dynamic=True)
        self._rope_store = functools.partial(fused.rope_store_reference, qk_rope=compiled_rope)

    def _attention(
        self, i: int, h: torch.Tensor, meta: AttnMeta, cache: torch.Tensor
    ) -> torch.Tensor:
        # h [T, hidden] (normed); cache [slots, 2, kv_heads, max_seq_len, head_dim]
        w = self.w
        qkv = self._linear(h, w[f"{i}.qkv_w"], w.get(f"{i}.qkv_b"))
        q = self._rope_store(
            qkv,
            meta.cos[:, 0],
            meta.sin[:, 0],
            w.get(f"{i}.q_norm"),
            w.get(f"{i}.k_norm"),
            self.args.rms_norm_eps,
            cache,
            meta.token_slot,
            meta.write_pos,
        )
        out = attention(q, cache, meta, self.args.windows[i])  # [T, heads * head_dim]
        return self._all_reduce(self._linear(out, w[f"{i}.o_w"], w.get(f"{i}.o_b")))

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        w = self.w
        gate_up = self._linear(h, w[f"{i}.gate_up_w"], w.get(f"{i}.gate_up_b"))
        down = self._linear(self._silu_mul(gate_up), w[f"{i}.down_w"], w.get(f"{i}.down_b"))
        return self._all_reduce(down)

    def _all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of a row-parallel product (itself on one rank)."""
        if self.shard.world > 1:
            import torch.distributed as dist

            dist.all_reduce(partial, group=self.shard.group)
        return partial

    def hidden(
        self, token_ids: torch.Tensor, meta: AttnMeta, caches: list[torch.Tensor]
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] for token_ids [T]; writes their K/V into `caches`.

        Each block's output `delta` is added to the residual stream `x` by the next norm."""
        eps, w = self.args.rms_norm_eps, self.w
        x, delta = F.embedding(token_ids, w["embed"]), None
        for i in range(self.args.num_layers):
            h, x = self._add_norm(x, delta, w[f"{i}.in_norm"], eps)
            delta = self._attention(i, h, meta, caches[i])
            h, x = self._add_norm(x, delta, w[f"{i}.post_norm"], eps)
            delta = self._mlp(i, h)
        return self._add_norm(x, delta, w["norm"], eps)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for hidden [N, hidden_size]."""
        return self.head(hidden, self._linear).float()

    def head(
        self, hidden: torch.Tensor, linear: Callable[..., torch.Tensor] = F.linear
    ) -> torch.Tensor:
        """Logits [N, vocab] in the model's dtype: on several ranks each computes its rows of
        the vocabulary and every rank gets them all."""
        local = linear(hidden, self.w["lm_head"])
        if self.shard.world == 1:
            return local
        if local.shape[0] == 0:  # no rows asked (a prefill whose logits nobody reads): the
            # same on every rank, so no rank gathers
            return local.new_empty(0, self.vocab_size)
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.shard.world)]
        dist.all_gather(parts, local.contiguous(), group=self.shard.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]

    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in self.w.values():
            storage = t.untyped_storage()  # a tied head's rows share the embedding's
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total
