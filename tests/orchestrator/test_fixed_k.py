"""Which requests keep their k under dynamic speculation: sampled ones with a seed of their own
(their output must not depend on the batch), and the flag reaches the hub's admission."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.core.pair import PairAdmission
from orchestrator.core.requests import Served, parse_request
from specdec.pb.specdec.v1 import generate_pb2
from specdec.sampling_params import SamplingParams

SERVED = Served("pair", 100, 64, 8, "draft", 4, True, (0,))


class _Tokenizer:
    """What the request's detokenizer asks of a tokenizer, for token-id prompts."""

    def decode(self, ids: list[int], **_: Any) -> str:
        return " ".join(map(str, ids))


@pytest.mark.parametrize(
    ("fields", "fixed"),
    [
        ({"temperature": 0.8, "seed": 3}, True),
        ({"temperature": 0.8}, False),  # a random seed: no particular sample is promised
        ({"temperature": 0.0, "seed": 3}, False),  # greedy output does not depend on k
        ({"seed": 3}, True),  # temperature 1 by default
    ],
)
def test_a_seeded_sampled_request_keeps_its_k(fields: dict[str, Any], fixed: bool) -> None:
    request = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5, 6]), **fields)
    record, _ = parse_request(request, SERVED, _Tokenizer())  # type: ignore[arg-type]
    assert record.fixed_num_draft_tokens is fixed


def test_the_admission_carries_it() -> None:
    admission = PairAdmission("r", (1, 2), SamplingParams(0.8, seed=3), "draft", 4,
                              fixed_num_draft_tokens=True)  # fmt: skip
    assert admission.to_pb().fixed_num_draft_tokens
    assert (
        not PairAdmission("r", (1, 2), SamplingParams(), "draft", 4).to_pb().fixed_num_draft_tokens
    )
