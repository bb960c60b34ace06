"""Fallback for architectures without a fast path: transformers' own model, one request at a time.

Correct but slower: each request keeps a transformers DynamicCache (cropped on rollback), and a
ragged batch is a loop of single-request forwards rather than one pass. Announced once in the
log by the runner.
"""

from typing import Any

import torch


class HFBackend:
    def __init__(self, model: Any, max_slots: int) -> None:
        self.model = model
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._caches: list[Any] = [None] * (max_slots + 1)

    def run(
        self, slots: list[int], starts: list[int], tokens: list[torch.Tensor], num_logits: list[int]
    ) -> torch.Tensor:
        """float32 logits [sum(num_logits), vocab]; tokens[i] [n_i] goes after starts[i]."""
        rows = []
        for slot, start, ids, keep in zip(slots, starts, tokens, num_logits, strict=True):
            cache = self._caches[slot] if start > 0 else None
            if cache is not None and cache.get_seq_length() > start:
                cache.crop(start - cache.get_seq_length())  # negative: tokens to drop (4.x and 5.x)
            assert (cache.get_seq_length() if cache is not None else 0) == start
            positions = torch.arange(start, start + ids.numel(), device=ids.device)[None]
            with torch.no_grad():
                out = self.model(
                    input_ids=ids[None],
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                )
            self._caches[slot] = out.past_key_values
            rows.append(out.logits[0, ids.numel() - keep :].float())
        return torch.cat(rows) if rows else torch.empty(0, self.vocab_size)

    def step(
        self,
        tokens: torch.Tensor,
        starts: torch.Tensor,
        slots: torch.Tensor,
        kv_len: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """float32 logits [B, n, vocab] for tokens [B, n] after starts [B] in slots [B]."""
        b, n = tokens.shape
        logits = self.run(slots.tolist(), starts.tolist(), list(tokens), [n] * b).view(b, n, -1)
        return logits if out is None else out.copy_(logits)
