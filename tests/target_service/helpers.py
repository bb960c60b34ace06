"""Random ragged batches for the rejection-sampler tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling_params import SamplingParams
from target_service.rejection_sampler import DenseQ, RequestSampling, SparseQ


@dataclass
class Batch:
    k: torch.Tensor  # [B] int32
    draft_ids: torch.Tensor  # [T] int32
    logits: torch.Tensor  # [T + B, V]
    q: DenseQ | SparseQ | None
    sampling: RequestSampling
    params: list[SamplingParams]
    positions: list[int]

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on `device`."""
        q = self.q
        if q is not None:
            q = type(q)(*(getattr(q, f).to(device) for f in q.__slots__))  # type: ignore[union-attr]
        s = self.sampling
        tensors = (s.temperature, s.top_k, s.top_p, s.seed, s.position)
        sampling = RequestSampling(*(t.to(device) for t in tensors), truncated=s.truncated)
        return Batch(
            self.k.to(device), self.draft_ids.to(device), self.logits.to(device), q, sampling,
            self.params, self.positions,
        )  # fmt: skip


def random_params(gen: torch.Generator, greedy_fraction: float = 0.25) -> SamplingParams:
    r = torch.rand(4, generator=gen).tolist()
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    if r[0] < greedy_fraction:
        return SamplingParams(temperature=0.0, seed=seed)
    top_k = int(r[2] * 20) if r[1] < 0.3 else 0
    top_p = 0.5 + 0.5 * r[3] if r[1] > 0.7 else 1.0
    return SamplingParams(temperature=0.5 + r[1], top_k=top_k, top_p=top_p, seed=seed)


def draft_distribution(
    logits: torch.Tensor, q_form: str, support: int, gen: torch.Generator
) -> tuple[DenseQ | SparseQ | None, torch.Tensor]:
    """Draft probs for T rows of draft logits and the tokens sampled from them."""
    t, vocab = logits.shape
    if q_form == "none":
        ids = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen) if t else None
        return None, (ids.flatten() if ids is not None else torch.zeros(0, dtype=torch.long))
    if q_form == "dense":
        q = torch.softmax(logits, -1)
        ids = torch.multinomial(q, 1, generator=gen).flatten() if t else torch.zeros(0).long()
        return DenseQ(q.float().contiguous()), ids
    s = min(support, vocab)
    top = logits.topk(s, dim=-1)
    probs = torch.softmax(top.values, -1)
    pick = torch.multinomial(probs, 1, generator=gen).flatten() if t else torch.zeros(0).long()
    ids = top.indices.gather(1, pick[:, None]).flatten() if t else pick
    perm = torch.randperm(s, generator=gen)  # the kernels must not rely on the sender's order
    token_ids, probs = top.indices[:, perm].int(), probs[:, perm].float()
    if s > 2:  # pad one column as a sender with a smaller support would
        token_ids = torch.cat([token_ids, torch.full((t, 1), -1, dtype=torch.int32)], 1)
        probs = torch.cat([probs, torch.zeros(t, 1)], 1)
    return SparseQ(token_ids.contiguous(), probs.contiguous()), ids


def random_batch(
    k: list[int],
    vocab: int,
    q_form: str,
    seed: int = 0,
    greedy_fraction: float = 0.25,
    support: int = 16,
    dtype: torch.dtype = torch.float32,
    scale: float = 3.0,
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    total, batch = sum(k), len(k)
    logits = (torch.randn(total + batch, vocab, generator=gen) * scale).to(dtype)
    draft_logits = torch.randn(total, vocab, generator=gen) * scale
    q, ids = draft_distribution(draft_logits, q_form, support, gen)
    params = [random_params(gen, greedy_fraction) for _ in k]
    positions = [int(p) for p in torch.randint(0, 4096, (batch,), generator=gen)]
    sampling = RequestSampling.from_params(params, positions, "cpu")
    k_t = torch.tensor(k, dtype=torch.int32)
    return Batch(k_t, ids.int(), logits, q, sampling, params, positions)
