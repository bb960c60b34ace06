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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.runner import fused, gemv
from specdec.runner.attention import AttnMeta, attention

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
        )


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
    ) -> None:
        self.args = args
        self.w = weights
        self.cos = cos  # [max_seq_len, head_dim] in the model dtype, as transformers casts it
        self.sin = sin
        self.use_kernels(weights["embed"].device.type == "cuda")

    @classmethod
    def from_hf_state(
        cls,
        args: ModelArgs,
        get: Callable[[str], torch.Tensor | None],
        cos: torch.Tensor,
        sin: torch.Tensor,
        device: torch.device,
        dtype: torch.dtype,
    ) -> "Transformer":
        """Builds from HF parameter names; `get(name)` returns a tensor or None if absent."""

        def need(name: str) -> torch.Tensor:
            t = get(name)
            if t is None:
                raise KeyError(name)
            return t.to(device=device, dtype=dtype)

        def cat(names: list[str]) -> torch.Tensor | None:
            parts = [get(n) for n in names]
            if all(p is None for p in parts):
                return None
            if any(p is None for p in parts):
                raise KeyError(names[[p is None for p in parts].index(True)])
            return torch.cat([p.to(device=device, dtype=dtype) for p in parts])  # type: ignore[union-attr]

        w: dict[str, torch.Tensor] = {
            "embed": need("model.embed_tokens.weight"),
            "norm": need("model.norm.weight"),
        }
        head = None if args.tie_word_embeddings else get("lm_head.weight")
        w["lm_head"] = w["embed"] if head is None else head.to(device=device, dtype=dtype)
        for i in range(args.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            opt: dict[str, torch.Tensor | None] = {
                "qkv_w": cat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                "qkv_b": cat([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
                "o_w": need(a + "o_proj.weight"),
                "o_b": get(a + "o_proj.bias"),
                "q_norm": get(a + "q_norm.weight"),
                "k_norm": get(a + "k_norm.weight"),
                "gate_up_w": cat([m + "gate_proj.weight", m + "up_proj.weight"]),
                "gate_up_b": cat([m + "gate_proj.bias", m + "up_proj.bias"]),
                "down_w": need(m + "down_proj.weight"),
                "down_b": get(m + "down_proj.bias"),
                "in_norm": need(p + "input_layernorm.weight"),
                "post_norm": need(p + "post_attention_layernorm.weight"),
            }
            for k, t in opt.items():
                if t is not None:
                    w[f"{i}.{k}"] = t.to(device=device, dtype=dtype)
        return cls(args, w, cos.to(device, dtype), sin.to(device, dtype))

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
            meta.positions,
        )
        out = attention(q, cache, meta, self.args.windows[i])  # [T, heads * head_dim]
        return self._linear(out, w[f"{i}.o_w"], w.get(f"{i}.o_b"))

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        w = self.w
        gate_up = self._linear(h, w[f"{i}.gate_up_w"], w.get(f"{i}.gate_up_b"))
        return self._linear(self._silu_mul(gate_up), w[f"{i}.down_w"], w.get(f"{i}.down_b"))

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
        return self._linear(hidden, self.w["lm_head"]).float()

    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in self.w.values():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total
