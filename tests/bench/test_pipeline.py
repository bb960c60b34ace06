"""End to end over real gRPC on loopback: draft service → target service, tiny local models.

Greedy: committed tokens equal target-only greedy decoding, token for token, for the draft
model and for prompt lookup, with mixed k and many requests at once. Sampled: chi-square tests
that the first committed token is distributed as the target's own sampling, dense and sparse q.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from scipy import stats

from draft_service.config import DraftConfig
from specdec.pb import common_pb2
from specdec.runner import ModelRunner
from specdec.sampling_params import SamplingParams
from target_service.logits_processing import target_distribution
from tests.draft_service.models import (
    TOKENIZER_VOCAB,
    greedy_reference,
    model_draft,
    next_token_logits,
    services,
)
from tests.specdec.entries import results


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        head = torch.randint(2, TOKENIZER_VOCAB, (3 + i % 5,), generator=gen).tolist()
        prompts.append(head + head[:2] + head)  # repeats, so prompt lookup finds matches
    return prompts


@pytest.mark.parametrize("proposer", ["model", "ngram"])
def test_greedy_equals_target_only_decoding(
    checkpoints: tuple[Path, Path], reference: ModelRunner, proposer: str
) -> None:
    target_dir, draft_dir = checkpoints
    draft = (
        model_draft(draft_dir)
        if proposer == "model"
        else DraftConfig(proposer="ngram", tokenizer_path=str(target_dir))
    )
    prompts, new_tokens = _prompts(12), 16
    with services(target_dir, draft) as svc:
        pipe = svc.pipeline()
        ks = {}
        for i, prompt in enumerate(prompts):
            pipe.admit(f"r{i}", prompt, SamplingParams(temperature=0.0))
            ks[f"r{i}"] = [0, 1, 2, 3, 4, 6][i % 6]
        pipe.generate(ks, new_tokens)
        for i, prompt in enumerate(prompts):
            got = pipe.requests[f"r{i}"].generated
            assert got == greedy_reference(reference, prompt, len(got)), f"request r{i}"
        accepted = sum(r.num_accepted for r in pipe.requests.values())
        assert accepted > 0, "no draft was ever accepted: the test would not exercise acceptance"
        pipe.close()


SAMPLING = SamplingParams(temperature=1.3, top_k=6, top_p=0.95)
NUM_SAMPLES = 960


@pytest.mark.parametrize("q_form", ["dense", "sparse"])
def test_sampled_tokens_follow_target_distribution(
    checkpoints: tuple[Path, Path], reference: ModelRunner, q_form: str
) -> None:
    target_dir, draft_dir = checkpoints
    prompt = _prompts(1, seed=3)[0]
    logits = next_token_logits(reference, prompt)[None]
    p = target_distribution(
        logits[:, :TOKENIZER_VOCAB], torch.tensor([SAMPLING.temperature]),
        torch.tensor([SAMPLING.top_k], dtype=torch.int32), torch.tensor([SAMPLING.top_p]),
    )[0]  # fmt: skip
    counts = torch.zeros(TOKENIZER_VOCAB)
    accepted = rejected = 0
    draft = model_draft(draft_dir, q_form, support=4)
    with services(target_dir, draft, sampler_impl="torch") as svc:
        pipe = svc.pipeline()
        for start in range(0, NUM_SAMPLES, 16):
            ids = [f"s{start + i}" for i in range(16)]
            for i, rid in enumerate(ids):
                seed = 1000 + start + i
                params = SamplingParams(SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p, seed)
                pipe.admit(rid, prompt, params)
            for result in results(pipe.step(dict.fromkeys(ids, 2))):
                assert result.error is None, result.error
                counts[result.token_ids[0]] += 1
                accepted += result.accepted[0]
                rejected += not result.accepted[0]
            pipe.release(ids)
        pipe.close()
    assert accepted > 20 and rejected > 20, "both acceptance and recovery must be exercised"
    support = p > 0
    assert counts[~support].sum() == 0
    expected = (p[support] * NUM_SAMPLES).numpy()
    assert stats.chisquare(counts[support].numpy(), expected).pvalue > 1e-3


def test_model_info_and_padded_vocabularies(checkpoints: tuple[Path, Path]) -> None:
    from specdec.pb import draft_pb2_grpc, target_pb2_grpc
    from specdec.serving.client import make_channel

    target_dir, draft_dir = checkpoints
    with services(target_dir, model_draft(draft_dir)) as svc:
        req = common_pb2.GetModelInfoRequest()
        t = target_pb2_grpc.TargetServiceStub(make_channel(svc.target_address)).GetModelInfo(req)
        d = draft_pb2_grpc.DraftServiceStub(make_channel(svc.draft_address)).GetModelInfo(req)
    assert (t.vocab_size, d.vocab_size) == (300, 256)
    assert t.tokenizer_vocab_size == d.tokenizer_vocab_size == TOKENIZER_VOCAB
    assert t.tokenizer_hash == d.tokenizer_hash != ""
    assert t.architecture == "LlamaForCausalLM" and t.max_seq_len == 128
