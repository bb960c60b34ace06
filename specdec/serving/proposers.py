"""Where a request's drafts come from: one name for each proposer in the protocol
(`specdec.v1.Proposer`), the services, the orchestrator, the metrics' `proposer` label and the
client APIs.

- "draft": the draft model, run by the draft service, which sends the q it sampled from;
- "ngram": prompt lookup (`specdec.serving.ngram`), computed in the target's process, no q;
- "off": no drafts; the target decodes one token per step (k = 0).

The client APIs also take "default", the server's own choice (`specdec serve --proposer`).
"""

from __future__ import annotations

from typing import Literal

from specdec.pb.specdec.v1 import generate_pb2

Proposer = Literal["draft", "ngram", "off"]
PROPOSERS: tuple[Proposer, ...] = ("draft", "ngram", "off")
TO_PB: dict[str, generate_pb2.Proposer] = {
    "draft": generate_pb2.PROPOSER_DRAFT,
    "ngram": generate_pb2.PROPOSER_NGRAM,
    "off": generate_pb2.PROPOSER_OFF,
}
FROM_PB: dict[int, Proposer] = {
    generate_pb2.PROPOSER_DRAFT: "draft",
    generate_pb2.PROPOSER_NGRAM: "ngram",
    generate_pb2.PROPOSER_OFF: "off",
}
