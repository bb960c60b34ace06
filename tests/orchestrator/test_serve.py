"""`specdec serve` end to end on a real local Ray cluster: both services as Ray actors on CPU,
the client API over real ports, tiny local checkpoints. One stack serves the whole module.

Greedy output is checked against transformers' `generate` on the target checkpoint (the
tokenizer has 250 ids and the embedding 300 rows: the padded ids are suppressed, as the services
never emit them).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.request import urlopen

import grpc
import pytest
import ray
import torch
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.config import PlacementConfig, SchedulerConfig, ServeConfig, ServiceConfig
from orchestrator.server import Orchestrator
from specdec.client import Client, SpecdecClientError
from specdec.pb import common_pb2, draft_pb2_grpc, target_pb2_grpc
from specdec.pb.specdec.v1 import generate_pb2 as pb
from specdec.pb.specdec.v1 import generate_pb2_grpc
from specdec.serving.proposers import TO_PB
from tests.draft_service.models import build_checkpoints
from tests.specdec._runner_models import TOKENIZER_VOCAB

MAX_REQUESTS = 16
MAX_QUEUE = 16
PROMPTS = ([5, 6, 7, 8], [9, 10, 9, 10, 9, 10, 11], [100, 37, 200, 4, 17])


@dataclass
class Stack:
    orchestrator: Orchestrator
    stub: generate_pb2_grpc.GenerateServiceStub
    address: str
    target_dir: Path

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        url = f"http://127.0.0.1:{self.orchestrator.metrics_port}/metrics"
        text = urlopen(url, timeout=10).read().decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


@contextmanager
def serve_stack(
    target: Path, draft: Path, max_requests: int, max_queue: int, **services: Any
) -> Iterator[Stack]:
    """An orchestrator serving the tiny pair on a local Ray cluster (both services on the CPU,
    k = 3), with a channel to its client port; `services`: more ServiceConfig fields."""
    config = ServeConfig(
        ServiceConfig(
            str(target), str(draft), device="cpu", max_requests=max_requests, max_seq_len=256,
            sampler_impl="torch",  # the Triton interpreter costs ~1 s per step on CPU
            **services,
        ),
        PlacementConfig(num_cpus=4, restart_timeout_s=120.0),
        SchedulerConfig(max_queue=max_queue, proposer="draft", num_draft_tokens=3),
        host="127.0.0.1", port=0, metrics_port=0, grace_s=2.0,
    )  # fmt: skip
    orchestrator = Orchestrator(config)
    port = orchestrator.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address)
    try:
        yield Stack(orchestrator, generate_pb2_grpc.GenerateServiceStub(channel), address, target)
    finally:
        channel.close()
        orchestrator.stop(1.0)
    assert not ray.is_initialized(), "the orchestrator shuts down the cluster it started"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    target, draft = build_checkpoints(tmp_path_factory.mktemp("serve"))
    with serve_stack(target, draft, MAX_REQUESTS, MAX_QUEUE) as s:
        yield s


@functools.cache
def _hf_model(target_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    model.generation_config.eos_token_id = None  # the requests ignore EOS too
    return model.eval()


@functools.cache
def oracle(target_dir: Path, prompt: tuple[int, ...], n: int) -> list[int]:
    """Target-only greedy decoding by transformers, padded ids suppressed."""
    model = _hf_model(target_dir)
    vocab = model.config.vocab_size
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            suppress_tokens=list(range(TOKENIZER_VOCAB, vocab)), pad_token_id=1,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def request(
    prompt: list[int], n: int, proposer: str = "draft", k: int = 3, **kw: Any
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        max_tokens=n,
        ignore_eos=True,
        temperature=kw.pop("temperature", 0.0),
        speculation=pb.Speculation(proposer=TO_PB[proposer], num_draft_tokens=k),
        **kw,
    )


def stream(stub: Any, req: pb.GenerateRequest, **kw: Any) -> tuple[list[int], list[Any], Any]:
    """(tokens, steps, final response) of a streamed request, checking order on the way."""
    tokens: list[int] = []
    steps: list[Any] = []
    final = None
    for r in stub.Generate(req, **kw):
        assert final is None, "nothing follows the final response"
        assert not req.request_id or r.request_id == req.request_id
        tokens += r.token_ids
        steps += r.steps
        if r.finish_reason:
            final = r
    assert final is not None
    assert [s.step for s in steps] == list(range(len(steps))), "steps in order, none lost"
    assert final.usage.completion_tokens == len(tokens)
    return tokens, steps, final


def eventually(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


@pytest.mark.parametrize("proposer", ["draft", "ngram", "off"])
def test_greedy_equals_target_only(stack: Stack, proposer: str) -> None:
    for prompt in PROMPTS[:2]:
        tokens, steps, final = stream(stack.stub, request(prompt, 40, proposer, k=4))
        assert tokens == oracle(stack.target_dir, tuple(prompt), 40)
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert final.usage.proposer == TO_PB[proposer]
        drafted = sum(s.num_draft_tokens for s in steps)
        assert final.usage.num_draft_tokens == drafted
        if proposer == "off":
            assert drafted == 0 and len(steps) == 40
    if proposer == "draft":  # the noisy draft is mostly right: fewer steps than tokens
        assert final.usage.num_accepted_tokens > 0 and len(steps) < 40


def test_complete_and_text_prompt(stack: Stack) -> None:
    full = stack.stub.Complete(request([5, 6, 7, 8], 12, "draft", 2))
    assert list(full.token_ids) == oracle(stack.target_dir, (5, 6, 7, 8), 12)
    assert full.finish_reason == pb.FINISH_REASON_LENGTH
    assert full.usage.num_steps == len(full.steps)
    text = stack.stub.Complete(pb.GenerateRequest(text="w5 w6 w7 w8", max_tokens=5, temperature=0))
    assert text.usage.prompt_tokens == 4 and text.usage.completion_tokens >= 1
    assert text.text.strip().startswith("w")


def test_32_concurrent_streams_get_their_own_tokens(stack: Stack) -> None:
    cases = []
    for i in range(32):
        proposer = ("draft", "ngram", "off")[i % 3]
        sampled = i % 4 == 0
        kw = {"temperature": 0.8, "top_k": 40, "seed": 1000 + i} if sampled else {}
        req = request(list(PROMPTS[i % 3]), 16 + i % 9, proposer, 1 + i % 4,
                      request_id=f"c{i}", **kw)  # fmt: skip
        if sampled:  # the same seeded request alone first
            expected = stream(stack.stub, req)[0]
        else:
            expected = oracle(stack.target_dir, tuple(req.token_ids.ids), req.max_tokens)
        cases.append((req, expected))
    results: dict[str, Any] = {}

    def run(req: pb.GenerateRequest) -> None:
        try:
            results[req.request_id] = stream(stack.stub, req)[0]
        except BaseException as e:
            results[req.request_id] = e

    threads = [threading.Thread(target=run, args=(req,)) for req, _ in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for req, expected in cases:
        assert results[req.request_id] == expected, req.request_id


def test_metrics_counters_equal_the_responses(stack: Stack) -> None:
    before = stack.metrics()
    finals = [
        stack.stub.Complete(request(list(p), 20, proposer, k=3))
        for p in PROMPTS
        for proposer in ("draft", "ngram")
    ]
    after = stack.metrics()

    def delta(name: str, **labels: str) -> float:
        keys = [k for k in after if k[0] == name and set(labels.items()) <= set(k[1])]
        assert keys, name
        return sum(after[k] - before.get(k, 0.0) for k in keys)

    for proposer in ("draft", "ngram"):
        mine = [f.usage for f in finals if f.usage.proposer == TO_PB[proposer]]
        prefix = "specdec:spec_decode_num_"
        assert delta(prefix + "drafts_total", proposer=proposer) == sum(u.num_drafts for u in mine)
        assert delta(prefix + "draft_tokens_total", proposer=proposer) == sum(
            u.num_draft_tokens for u in mine
        )
        assert delta(prefix + "accepted_tokens_total", proposer=proposer) == sum(
            u.num_accepted_tokens for u in mine
        )
    assert delta("specdec:generation_tokens_total") == sum(
        f.usage.completion_tokens for f in finals
    )
    assert delta("specdec:prompt_tokens_total") == sum(f.usage.prompt_tokens for f in finals)
    assert delta("specdec:request_success_total", finish_reason="length") == len(finals)


def _held(stack: Stack, request_ids: list[str]) -> int:
    """How many of the requests either service still holds (Release answers num_released)."""
    pair = stack.orchestrator.placement.pairs[0]
    held = 0
    for address, stub_cls in ((pair.target_address, target_pb2_grpc.TargetServiceStub),
                              (pair.draft_address, draft_pb2_grpc.DraftServiceStub)):  # fmt: skip
        with grpc.insecure_channel(address) as channel:
            response = stub_cls(channel).Release(
                common_pb2.ReleaseRequest(request_ids=request_ids), timeout=10
            )
            held += response.num_released
    return held


def test_cancel_disconnect_and_deadline_free_both_services(stack: Stack) -> None:
    before = stack.metrics()
    long = functools.partial(request, list(PROMPTS[0]), 200, "draft", 1)
    cancelled = stack.stub.Generate(long(request_id="cancelled"))
    next(cancelled)
    cancelled.cancel()
    channel = grpc.insecure_channel(stack.address)
    gone = generate_pb2_grpc.GenerateServiceStub(channel).Generate(long(request_id="gone"))
    next(gone)
    channel.close()
    # the deadline must pass while the request runs, on any machine: once it streams, its
    # target is stopped (SIGSTOP) until the call has failed, so it cannot finish first
    target_pid = ray.get(stack.orchestrator.placement.pairs[0].target.pid.remote(), timeout=30)
    stopped = False
    try:
        with pytest.raises(grpc.RpcError) as err:
            late = stack.stub.Generate(long(request_id="late"), timeout=2.0)
            next(late)
            os.kill(target_pid, signal.SIGSTOP)
            stopped = True
            for _ in late:
                pass
    finally:
        if stopped:
            os.kill(target_pid, signal.SIGCONT)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    sched = stack.orchestrator.scheduler
    assert sched is not None
    eventually(lambda: sched.snapshot()[:2] == (0, 0))
    # releases are applied at the hub's next step boundary, in order with the controls after
    # them: once a later request has run there, they were (the stopped target delays them)
    stream(stack.stub, request(list(PROMPTS[0]), 2, "draft", 1))
    time.sleep(0.5)  # and the hub's release to the draft is on its way
    assert _held(stack, ["cancelled", "gone", "late"]) == 0
    errors = {
        dict(labels)["code"]: value - before.get((name, labels), 0.0)
        for (name, labels), value in stack.metrics().items()
        if name == "specdec:request_errors_total"
    }
    assert {code: n for code, n in errors.items() if n} == {
        "CANCELLED": 2.0,
        "DEADLINE_EXCEEDED": 1.0,
    }


def test_full_queue_answers_resource_exhausted(stack: Stack) -> None:
    # 250 tokens a request (about 2 s at batch 16 here), so that none ends before all n are in
    n = MAX_REQUESTS + MAX_QUEUE
    results: dict[int, Any] = {}

    def run(i: int) -> None:
        try:
            results[i] = stream(stack.stub, request(list(PROMPTS[0]), 250, "off", 0))[0]
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    sched = stack.orchestrator.scheduler
    assert sched is not None
    eventually(lambda: sum(sched.snapshot()[:2]) == n, timeout_s=10)
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Complete(request(list(PROMPTS[0]), 5))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_queue=16" in (err.value.details() or "")
    name = stack.orchestrator.config.model_name
    refused = (("code", "RESOURCE_EXHAUSTED"), ("model_pair", name))
    assert stack.metrics()[("specdec:request_errors_total", refused)] == 1
    for t in threads:
        t.join(120)
    expected = oracle(stack.target_dir, tuple(PROMPTS[0]), 250)
    assert all(results[i] == expected for i in range(n)), "running and waiting ones untouched"


def test_invalid_requests_name_the_field(stack: Stack) -> None:
    unknown_proposer = request([5, 6], 3)
    unknown_proposer.speculation.proposer = 9  # type: ignore[assignment]
    cases = [
        (pb.GenerateRequest(max_tokens=3), "prompt must be set"),
        (request([5, 6], 0), "max_tokens must be in [1, 254]"),
        (request([5, 6], 300), "max_tokens must be in [1, 254]"),
        (request([5, TOKENIZER_VOCAB], 3), "must be in [0, 250)"),
        (request([5, 6], 3, temperature=101.0), "temperature must be in [0, 100]"),
        (request([5, 6], 3, top_p=0.0), "top_p must be in (0, 1]"),
        (request([5, 6], 3, k=17), "num_draft_tokens must be in [0, 16]"),
        (request([5] * 256, 1), "leaves no room"),
        (unknown_proposer, "not a known Proposer"),
        (request([5, 6], 3, stop_token_ids=[400]), "stop_token_ids[0] must be in [0, 250)"),
        (request([5, 6], 3, model="other"), "model must be empty or"),
        (request([5, 6], 3, request_id="x" * 129), "request_id must be at most 128"),
    ]  # fmt: skip
    for req, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            stack.stub.Complete(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, message
        assert message in (err.value.details() or ""), (message, err.value.details())


def test_health_reflection_and_model_info(stack: Stack) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(stack.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="specdec.v1.GenerateService"), timeout=5
        )
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        (answer,) = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([ask]), timeout=5
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    names = {s.name for s in answer.list_services_response.service}
    assert {"specdec.v1.GenerateService", "grpc.health.v1.Health"} <= names
    info = stack.stub.GetModelInfo(pb.GetServedModelInfoRequest()).models[0]
    assert info.vocab_size == TOKENIZER_VOCAB and info.max_seq_len == 256
    assert info.default_proposer == pb.PROPOSER_DRAFT and info.default_num_draft_tokens == 3
    assert info.draft.vocab_size == 256 and info.target.vocab_size == 300


def test_killed_draft_restarts_and_speculation_resumes(stack: Stack) -> None:
    """Kill the draft actor mid-generation: requests go on target-only with the same greedy
    output; Ray restarts the draft, the hub re-admits the running requests to it, and drafting
    resumes inside requests that span the restart."""
    prompt = list(PROMPTS[0])
    expected = oracle(stack.target_dir, tuple(prompt), 200)
    pair = stack.orchestrator.placement.pairs[0]
    outputs: list[tuple[list[int], list[Any]]] = []
    stop = threading.Event()
    live: dict[int, int] = {}  # each worker's tokens so far in its request in flight

    def keep_generating(worker: int) -> None:
        while not stop.is_set():
            tokens: list[int] = []
            steps: list[Any] = []
            # k = 1: about 100 steps a request, so that one in flight spans the kill
            for r in stack.stub.Generate(request(prompt, 200, "draft", 1)):
                tokens += r.token_ids
                steps += r.steps
                live[worker] = len(tokens)
            live[worker] = 0
            assert [s.step for s in steps] == list(range(len(steps))), "steps in order"
            outputs.append((tokens, steps))

    workers = [threading.Thread(target=keep_generating, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    # killed while a request that drafts is well inside its 200 tokens, not between two
    eventually(lambda: any(20 <= n <= 60 for n in live.values()), timeout_s=60)
    assert pair.draft is not None
    ray.kill(pair.draft, no_restart=False)
    info = lambda: stack.stub.GetModelInfo(pb.GetServedModelInfoRequest()).models[0]
    eventually(lambda: not info().draft_up, timeout_s=30)
    eventually(lambda: info().draft_up, timeout_s=120)

    def resumed() -> list[list[int]]:
        """The ks of finished requests that ran target-only a while, then drafted again."""
        ks = [[s.num_draft_tokens for s in steps[1:]] for _, steps in list(outputs)]
        return [k for k in ks if 0 in k and any(n > 0 for n in k[k.index(0) :])]

    # the requests that span the restart finish after it: on a loaded machine the one in
    # flight when the draft came back may end before its re-admission, so wait for one
    try:
        eventually(lambda: bool(resumed()), timeout_s=90)
    finally:
        stop.set()
        for w in workers:
            w.join(120)
    assert outputs and all(tokens == expected for tokens, _ in outputs)
    assert all(steps[0].num_draft_tokens == 0 for _, steps in outputs), "step 0: the admission"
    ks = [[s.num_draft_tokens for s in steps[1:]] for _, steps in outputs]
    assert any(0 in k and k[0] > 0 for k in ks), "some request ran target-only for a while"
    assert resumed(), "drafting resumed inside a request that spanned the restart"
    m = stack.metrics()
    labels = (("model_pair", stack.orchestrator.config.model_name),)
    assert m[("specdec:service_restarts_total", (*labels, ("role", "draft")))] >= 1
    assert m[("specdec:draft_fallback_steps_total", (*labels, ("reason", "unavailable")))] > 0
    assert m[("specdec:draft_fallback_requests_total", (*labels, ("reason", "unavailable")))] > 0


def health(stack: Stack) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(stack.address) as channel:
        ask = health_pb2.HealthCheckRequest(service="specdec.v1.GenerateService")
        status = health_pb2_grpc.HealthStub(channel).Check(ask, timeout=5).status
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def through_a_target_restart(
    stack: Stack, prompt: list[int], n: int, proposers: tuple[str, ...], fault: Any
) -> dict[str, Any]:
    """One stream of `n` greedy tokens per proposer; once each has its first response,
    `fault()` takes the target down: health turns NOT_SERVING (no pair has a target) and
    SERVING again, and each stream's tokens (or its error) are returned."""
    results: dict[str, Any] = {}
    started = threading.Barrier(len(proposers) + 1)

    def run(proposer: str) -> None:
        calls = stack.stub.Generate(request(prompt, n, proposer, 3, request_id=proposer))
        first = next(calls)
        started.wait()
        try:
            results[proposer] = [t for r in (first, *calls) for t in r.token_ids]
        except BaseException as e:
            results[proposer] = e

    threads = [threading.Thread(target=run, args=(p,)) for p in proposers]
    for t in threads:
        t.start()
    started.wait()
    fault()
    eventually(lambda: health(stack) == "NOT_SERVING", timeout_s=30)
    eventually(lambda: health(stack) == "SERVING", timeout_s=120)
    for t in threads:
        t.join(180)
    return results


def test_killed_target_restarts_and_its_requests_finish(stack: Stack) -> None:
    """Kill the target actor mid-generation: its requests wait for Ray to restart it, are
    admitted again from the orchestrator's records (prompt + committed tokens) and finish with
    target-only greedy output, steps numbered on without a gap. Health is NOT_SERVING while
    no pair has a target."""
    prompt = list(PROMPTS[1])
    expected = oracle(stack.target_dir, tuple(prompt), 150)
    pair = stack.orchestrator.placement.pairs[0]
    old_address = pair.target_address
    fault = lambda: ray.kill(pair.target, no_restart=False)
    results = through_a_target_restart(stack, prompt, 150, ("draft", "ngram", "off"), fault)
    assert results == {"draft": expected, "ngram": expected, "off": expected}
    assert pair.target_address != old_address, "a new target process serves the pair"
    m = stack.metrics()
    labels = (("model_pair", stack.orchestrator.config.model_name),)
    assert m[("specdec:service_restarts_total", (*labels, ("role", "target")))] >= 1
    assert m[("specdec:serve_reconnects_total", labels)] >= 1
    tokens, steps, _ = stream(stack.stub, request(prompt, 20, "draft", 3))
    assert tokens == expected[:20] and any(s.num_accepted for s in steps)


def test_set_speculation_applies_from_the_next_step(stack: Stack) -> None:
    prompt = list(PROMPTS[1])
    calls = stack.stub.Generate(request(prompt, 200, "draft", 4, request_id="respec"))
    first = next(calls)
    tokens, steps = list(first.token_ids), list(first.steps)
    with Client(stack.address, timeout=30) as client:
        assert client.set_speculation("respec", proposer="off") == ("off", 0)
        for r in calls:
            tokens += r.token_ids
            steps += r.steps
            final = r
        assert tokens == oracle(stack.target_dir, tuple(prompt), 200), "the output is unchanged"
        ks = [s.num_draft_tokens for s in steps]
        switched = next(i for i, k in enumerate(ks) if k == 0 and i > 0)
        assert all(k == 0 for k in ks[switched:]) and switched < len(ks) - 1, ks
        assert final.usage.proposer == pb.PROPOSER_OFF
        with pytest.raises(SpecdecClientError) as gone:
            client.set_speculation("respec", num_draft_tokens=2)
        assert gone.value.code == grpc.StatusCode.NOT_FOUND
        with pytest.raises(SpecdecClientError) as bad:
            client.set_speculation("respec", proposer="draft", num_draft_tokens=99)
        assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "num_draft_tokens" in bad.value.details
