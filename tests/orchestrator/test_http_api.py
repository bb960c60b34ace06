"""The OpenAI-compatible HTTP API of `specdec serve` end to end: a real local Ray cluster, both
services as actors on CPU, the HTTP port beside the gRPC one, queried with the `openai` client,
raw HTTP and curl. One stack serves the whole module.

The target's tokenizer gets a chat template of its own words (w3 user, w4 assistant, w5 the
generation prompt), so chat completions run through a real template.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

# a GPU machine running `pytest -m gpu` may have only the services' dependencies
DEV_EXTRAS = "needs the HTTP API's dependencies and the dev extras: pip install -e '.[dev]'"
pytest.importorskip("starlette", reason=DEV_EXTRAS)
openai = pytest.importorskip("openai", reason=DEV_EXTRAS)

from orchestrator.config import PlacementConfig, SchedulerConfig, ServeConfig, ServiceConfig  # noqa: E402
from orchestrator.core.frontend import Frontend  # noqa: E402
from orchestrator.launch.ports import PortError, bind  # noqa: E402
from orchestrator.server import Orchestrator  # noqa: E402
from orchestrator.web.api import HttpApi  # noqa: E402
from orchestrator.web.server import HttpServer  # noqa: E402
from specdec.pb.specdec.v1 import generate_pb2 as pb  # noqa: E402
from specdec.pb.specdec.v1 import generate_pb2_grpc  # noqa: E402
from tests import needs  # noqa: E402
from tests.draft_service.models import build_checkpoints  # noqa: E402
from tests.orchestrator.test_serve import Stack, eventually  # noqa: E402

MAX_REQUESTS = 4
MAX_QUEUE = 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ 'w3' if m['role'] == 'user' else 'w4' }} {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w5{% endif %}"
)
MESSAGES = [
    {"role": "user", "content": "w10 w11"},
    {"role": "assistant", "content": "w12"},
    {"role": "user", "content": "w13 w14"},
]
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@dataclass
class HttpStack(Stack):
    base_url: str
    client: openai.OpenAI

    @property
    def name(self) -> str:
        return self.orchestrator.config.model_name


def _with_chat_template(target: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(target))


def _config(target: Path, draft: Path, **server: Any) -> ServeConfig:
    return ServeConfig(
        ServiceConfig(
            str(target), str(draft), device="cpu", max_requests=MAX_REQUESTS, max_seq_len=256,
            sampler_impl="torch",  # the Triton interpreter costs ~1 s per step on CPU
        ),
        PlacementConfig(num_cpus=4, restart_timeout_s=120.0),
        SchedulerConfig(max_queue=MAX_QUEUE, proposer="draft", num_draft_tokens=3),
        **{"host": "127.0.0.1", "port": 0, "metrics_port": 0, "http_port": 0, "grace_s": 2.0}
        | server,
    )  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpStack]:
    target, draft = build_checkpoints(tmp_path_factory.mktemp("http"))
    _with_chat_template(target)
    orchestrator = Orchestrator(_config(target, draft))
    port = orchestrator.start()
    address = f"127.0.0.1:{port}"
    base_url = f"http://127.0.0.1:{orchestrator.http_port}/v1"
    channel = grpc.insecure_channel(address)
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    stub = generate_pb2_grpc.GenerateServiceStub(channel)
    try:
        yield HttpStack(orchestrator, stub, address, target, base_url, client)
    finally:
        client.close()
        channel.close()
        orchestrator.stop(1.0)


def grpc_complete(stack: HttpStack, prompt: str | list[int], **kw: Any) -> pb.GenerateResponse:
    request = pb.GenerateRequest(temperature=0.0, ignore_eos=True, **kw)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return stack.stub.Complete(request)


@dataclass
class Reply:
    status_code: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def call(url: str, data: bytes | None = None, headers: dict[str, str] | None = None) -> Reply:
    """GET (or POST `data` as JSON) with the standard library: the raw status and body."""
    request = urllib.request.Request(
        url, data, {"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return Reply(response.status, response.read().decode())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read().decode())


def post(stack: HttpStack, path: str, body: dict[str, Any]) -> Reply:
    return call(stack.base_url.removesuffix("/v1") + path, json.dumps(body).encode())


@pytest.mark.parametrize("prompt", [[5, 6, 7, 8], "w9 w10 w9 w10 w11"])
def test_greedy_completion_equals_the_grpc_api(stack: HttpStack, prompt: Any) -> None:
    before = stack.metrics()
    out = stack.client.completions.create(model=stack.name, prompt=prompt, max_tokens=24,
                                          **GREEDY)  # fmt: skip
    expected = grpc_complete(stack, prompt, max_tokens=24)
    assert out.choices[0].text == expected.text and expected.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == 24 == expected.usage.completion_tokens
    assert out.usage.prompt_tokens == expected.usage.prompt_tokens
    assert out.usage.total_tokens == out.usage.prompt_tokens + 24
    generated = [v - before.get(k, 0.0) for k, v in stack.metrics().items()
                 if k[0] == "specdec:generation_tokens_total"]  # fmt: skip
    assert sum(generated) == 48, "the HTTP request is counted by the same metrics"


def test_streamed_completion_is_the_whole_one_in_pieces(stack: HttpStack) -> None:
    kw: dict[str, Any] = {"model": stack.name, "prompt": [9, 10, 9, 10, 11], "max_tokens": 30}
    whole = stack.client.completions.create(**kw, **GREEDY)
    chunks = list(stack.client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))  # fmt: skip
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 1 and "".join(texts) == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 30
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")


def test_chat_goes_through_the_chat_template(stack: HttpStack) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(stack.target_dir)).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == [3, 10, 11, 4, 12, 3, 13, 14, 5]
    expected = grpc_complete(stack, ids, max_tokens=20).text
    chat = stack.client.chat.completions.create(
        model=stack.name, messages=MESSAGES, max_tokens=20, **GREEDY
    )
    message = chat.choices[0].message
    assert message.content == expected and message.role == "assistant"
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ids)
    chunks = list(stack.client.chat.completions.create(
        model=stack.name, messages=MESSAGES, max_completion_tokens=20, stream=True, **GREEDY
    ))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    tokenized = post(stack, "/tokenize", {"messages": MESSAGES}).json()
    assert tokenized["tokens"] == ids and tokenized["count"] == len(ids)


def test_stop_strings_and_max_tokens(stack: HttpStack) -> None:
    prompt = [5, 6, 7, 8]
    words = grpc_complete(stack, prompt, max_tokens=12).text.split()
    stop = words[5]
    assert stop not in words[:5], "the test needs a word that first appears at position 5"
    out = stack.client.completions.create(model=stack.name, prompt=prompt, max_tokens=12,
                                          stop=[stop, "w999"], **GREEDY)  # fmt: skip
    assert out.choices[0].text.split() == words[:5]
    assert out.choices[0].finish_reason == "stop"
    assert out.model_dump()["choices"][0]["stop_reason"] == stop
    short = stack.client.completions.create(model=stack.name, prompt=prompt, max_tokens=3,
                                            **GREEDY)  # fmt: skip
    assert short.usage is not None and short.usage.completion_tokens == 3
    assert short.choices[0].text.split() == words[:3]


def test_same_seed_same_text(stack: HttpStack) -> None:
    def sample(seed: int) -> str:
        out = stack.client.completions.create(
            model=stack.name, prompt="w5 w6 w7", max_tokens=20, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True, "top_k": 50,
                        "speculation": {"proposer": "ngram", "num_draft_tokens": 2}},
        )  # fmt: skip
        assert out.usage is not None
        assert out.usage.model_dump()["speculation"]["proposer"] == "ngram"
        return out.choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first


def test_speculation_settings_are_taken(stack: HttpStack) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    usages = {
        proposer: post(stack, "/v1/completions", body | {"speculation": {
            "proposer": proposer, "num_draft_tokens": 2}}).json()["usage"]["speculation"]
        for proposer in ("draft", "off")
    }  # fmt: skip
    assert usages["draft"]["proposer"] == "draft" and usages["draft"]["num_draft_tokens"] > 0
    assert usages["draft"]["num_draft_tokens_per_step"] == 2
    assert usages["off"] == usages["off"] | {"proposer": "off", "num_draft_tokens": 0}


BAD_REQUESTS = [
    ({"n": 2}, "n must be 1", "n"),
    ({"logprobs": 1}, "logprobs is not supported", "logprobs"),
    ({"temperature": -1}, "temperature must be in [0, 100]", "temperature"),
    ({"max_tokens": 0}, "max_tokens must be in [1,", "max_tokens"),
    ({"max_tokens": "many"}, "The field max_tokens is invalid", "max_tokens"),
    ({"top_p": 0}, "top_p must be in (0, 1]", "top_p"),
    ({"stop_token_ids": [400]}, "stop_token_ids[0] must be in [0, 250)", "stop_token_ids"),
    ({"stop_token_ids": [2**40]}, "The field stop_token_ids[0] is invalid",
     "stop_token_ids[0]"),
    ({"prompt": ["w5", "w6"]}, "a batch of 2 prompts is not supported", "prompt"),
    ({"prompt": [5, 900]}, "prompt token_ids[1] must be in [0, 250)", "prompt"),
    ({"bogus": 1}, "The field bogus is not supported by this server", "bogus"),
    ({"speculation": {"num_draft_tokens": 17}}, "num_draft_tokens must be in [0, 16], got 17",
     "speculation.num_draft_tokens"),
    ({"speculation": {"proposer": "eagle"}}, "The field speculation.proposer is invalid",
     "speculation.proposer"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "message", "param"), BAD_REQUESTS)
def test_bad_input_is_a_400_naming_the_field(
    stack: HttpStack, change: dict[str, Any], message: str, param: str
) -> None:
    response = post(stack, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4} | change)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"] and error["message"].endswith(".")
    assert error["type"] == "invalid_request_error" and error["param"] == param


def errors_since(stack: HttpStack, before: dict[Any, float]) -> dict[str, float]:
    """request_errors_total's increase since `before`, by code."""
    deltas = {dict(labels)["code"]: value - before.get((name, labels), 0.0)
              for (name, labels), value in stack.metrics().items()
              if name == "specdec:request_errors_total"}  # fmt: skip
    return {code: n for code, n in deltas.items() if n}


def test_error_statuses_through_the_openai_client(stack: HttpStack) -> None:
    before = stack.metrics()
    with pytest.raises(openai.NotFoundError) as missing:
        stack.client.completions.create(model="gpt-4", prompt="w5", max_tokens=2)
    assert missing.value.status_code == 404
    assert missing.value.body == {
        "message": "The model 'gpt-4' does not exist: this server serves 'target' (GET "
        "/v1/models lists it).", "type": "not_found_error", "param": "model",
        "code": "model_not_found",
    }  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="logprobs and top_logprobs"):
        stack.client.chat.completions.create(model=stack.name, messages=MESSAGES, logprobs=True)
    bad_json = call(stack.base_url + "/completions", b"{")
    assert bad_json.status_code == 400 and "must be a JSON object" in bad_json.text
    assert errors_since(stack, before) == {"NOT_FOUND": 1, "INVALID_ARGUMENT": 2}, "as gRPC's"


@contextmanager
def served(api: HttpApi) -> Iterator[str]:
    """`api` on a port of its own; yields its base URL."""
    server = HttpServer(api.app, bind("127.0.0.1", 0, "--http-port"), grace_s=1.0)
    server.start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.join(5.0)


def test_without_a_chat_template_chat_is_a_clear_400(stack: HttpStack) -> None:
    api = HttpApi(stack.orchestrator.frontend, chat_template=None)  # the served backend
    with served(api) as url:
        response = call(url + "/v1/chat/completions", json.dumps({"messages": MESSAGES}).encode())
    assert response.status_code == 400
    assert "tokenizer has no chat template" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "messages"


def test_not_ready_is_a_503() -> None:
    with served(HttpApi(Frontend(4), chat_template=None)) as url:  # services not up yet
        health = call(url + "/health")
        refused = call(url + "/v1/completions", json.dumps({"prompt": "w5"}).encode())
    assert health.status_code == 503 and refused.status_code == 503
    error = refused.json()["error"]
    assert error["type"] == "service_unavailable_error" and error["code"] == "unavailable"
    assert "The services are still starting" in error["message"]


def test_models_health_tokenize_detokenize(stack: HttpStack) -> None:
    (model,) = stack.client.models.list().data
    assert model.id == stack.name == "target"
    assert model.model_dump()["max_model_len"] == 256
    assert call(stack.base_url.removesuffix("/v1") + "/health").status_code == 200
    tokens = post(stack, "/tokenize", {"prompt": "w5 w6 w249"}).json()
    assert tokens == {"count": 3, "max_model_len": 256, "tokens": [5, 6, 249], "token_strs": None}
    assert post(stack, "/detokenize", {"tokens": [5, 6, 249]}).json() == {"prompt": "w5 w6 w249"}
    bad = post(stack, "/detokenize", {"tokens": [5, 250]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    nowhere = call(stack.base_url + "/embeddings", b"{}")
    assert nowhere.status_code == 404
    assert nowhere.json()["error"]["message"] == "POST /v1/embeddings: Not Found."


def test_curl_streams_server_sent_events(stack: HttpStack) -> None:
    curl = needs.program(
        "curl", "`sudo apt-get install curl` (scripts/test.sh installs it as root)"
    )
    body = {"model": stack.name, "prompt": "w5 w6 w7 w8", "max_tokens": 10, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    out = subprocess.run(
        [curl, "-sS", "-N", f"{stack.base_url}/completions", "-H",
         "Content-Type: application/json", "-d", json.dumps(body)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    events = [line for line in out.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == grpc_complete(stack, "w5 w6 w7 w8", max_tokens=10).text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_closing_a_stream_cancels_its_request(stack: HttpStack) -> None:
    before = stack.metrics()
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True, "stream": True}
    url = stack.base_url + "/completions"
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.readline().startswith(b"data: {")
    sched = stack.orchestrator.scheduler
    assert sched is not None
    eventually(lambda: sched.snapshot()[:2] == (0, 0), timeout_s=30)
    assert errors_since(stack, before) == {"CANCELLED": 1}


def test_full_queue_is_a_429(stack: HttpStack) -> None:
    off = pb.Speculation(proposer=pb.PROPOSER_OFF)
    long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), max_tokens=200,
                              ignore_eos=True, speculation=off)  # fmt: skip
    calls = [stack.stub.Generate(long) for _ in range(MAX_REQUESTS + MAX_QUEUE)]
    sched = stack.orchestrator.scheduler
    assert sched is not None
    try:
        eventually(lambda: sum(sched.snapshot()[:2]) == MAX_REQUESTS + MAX_QUEUE, timeout_s=30)
        response = post(stack, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
        assert response.status_code == 429
        error = response.json()["error"]
        assert error["type"] == "rate_limit_error" and "max_queue=2" in error["message"]
    finally:
        for call in calls:
            call.cancel()
    eventually(lambda: sched.snapshot()[:2] == (0, 0), timeout_s=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port"])
def test_a_port_in_use_is_refused_naming_it(stack: HttpStack, flag: str) -> None:
    o = stack.orchestrator
    taken = {"--port": o.port, "--http-port": o.http_port, "--metrics-port": o.metrics_port}[flag]
    ports = {"port": _free_port(), "http_port": _free_port(), "metrics_port": _free_port()}
    ports[flag.removeprefix("--").replace("-", "_")] = taken
    threads = threading.active_count()
    second = Orchestrator(_config(stack.target_dir, stack.target_dir, **ports))
    with pytest.raises(PortError) as err:
        second.start()
    assert f"127.0.0.1:{taken} ({flag} {taken}): the port is in use" in str(err.value)
    assert all(_bindable(p) for p in ports.values() if p != taken), "nothing left listening"
    time.sleep(0.5)
    assert threading.active_count() <= threads, "nothing left running"
    assert stack.client.completions.create(model="target", prompt="w5", max_tokens=2).choices


def test_with_an_api_key_every_route_but_health_needs_it() -> None:
    key = "k3y-0123456789-abcdef"
    with served(HttpApi(Frontend(4), chat_template=None, api_key=key)) as url:
        body = json.dumps({"prompt": "w5"}).encode()
        health = call(url + "/health")
        refused = [call(url + "/v1/completions", body, headers=h) for h in
                   ({}, {"Authorization": "Bearer wrong-key-0123456789"})]  # fmt: skip
        models = call(url + "/v1/models")
        taken = call(url + "/v1/completions", body, headers={"Authorization": f"Bearer {key}"})
    assert health.status_code == 503  # open: not ready yet, but not 401
    for response in (*refused, models):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert taken.status_code == 503  # past the key: the services are still starting
