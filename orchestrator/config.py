"""Configuration of `specdec serve`: the services each pair runs, where Ray places them, how
requests are scheduled, and where the client API listens.

Torch-free on purpose: the actors turn `ServiceConfig` into the services' own configs inside
their processes. Every command-line default is read from these dataclasses (`default_of`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from specdec.limits import (
    DEFAULT_MAX_NUM_DRAFT_TOKENS,
    MAX_DRAFT_DEADLINE_S,
    MAX_NUM_DRAFT_TOKENS,
    check_draft_ahead,
    check_range,
)
from specdec.message_limits import (
    MAX_MESSAGE_BYTES,
    MIN_MESSAGE_BYTES,
    request_bytes,
    served_seq_len,
)
from specdec.serving.auth import check_api_key
from specdec.serving.proposers import PROPOSERS, Proposer
from specdec.synthetic_keys import spread_fits
from specdec.tensor_parallel import MAX_TENSOR_PARALLEL

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SPARE_WORKERS = 16  # server threads kept from Generate/Complete for health checks and refusals


def _check_model_dir(name: str, value: str) -> None:
    """A model must be a local checkpoint directory; a hub id gets instructions instead."""
    if Path(value).is_dir():
        return
    hint = ""
    if "/" in value and not value.startswith(("/", ".", "~")) and value.count("/") == 1:
        hint = (
            f" {value!r} looks like a Hugging Face hub id: nothing is downloaded at run time, so "
            f"download it first on a machine with internet access, e.g. `huggingface-cli "
            f"download {value} --local-dir DIR`, and pass --{name} DIR."
        )
    raise ValueError(
        f"{name} must be a local checkpoint directory (config.json, safetensors, tokenizer); "
        f"{value!r} is not a directory.{hint}"
    )


def _check_pem(flag: str, path: Path) -> None:
    try:
        text = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {str(path)!r} cannot be read: {e.strerror or e}.") from None
    if b"-----BEGIN " not in text:
        raise ValueError(f"{flag} {str(path)!r} is not a PEM file (it has no -----BEGIN line).")


def _check_tls_pair(flag: str, cert: Path | None, key: Path | None) -> None:
    """`flag`-cert and `flag`-key go together, and both must be readable PEM files."""
    if (cert is None) != (key is None):
        raise ValueError(
            f"{flag}-cert and {flag}-key go together (a PEM certificate chain and its private "
            f"key), or neither; got only {flag}-{'cert' if key is None else 'key'}."
        )
    if cert is not None and key is not None:
        _check_pem(f"{flag}-cert", cert)
        _check_pem(f"{flag}-key", key)


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """What each pair's target and draft services load and the limits they hold.

    `draft` None runs no draft service: requests use n-gram prompt lookup (inside the target)
    or no speculation. `max_seq_len` None takes the checkpoint's own limit (the services cap
    it). `device` "auto" is CUDA when Ray gave the actor a GPU, else CPU; `dtype` "auto" is
    the checkpoint's own on a GPU and float32 on the CPU (`resolve_dtype`).
    """

    target: str
    draft: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    max_requests: int = 32
    max_seq_len: int | None = None
    max_num_draft_tokens: int = DEFAULT_MAX_NUM_DRAFT_TOKENS
    q_form: Literal["dense", "sparse"] = "sparse"
    support_size: int = 32
    sampler_impl: Literal["auto", "triton", "torch"] = "auto"
    cuda_graph_batch_sizes: tuple[int, ...] = ()
    # the target's model over this many ranks (GPUs) of one node (specdec.runner.parallel)
    target_tensor_parallel: int = 1
    # both services' KV caches (RunnerConfig): 0, fixed slots; N, paged in blocks of N
    # positions, kv_blocks of them (0: the target's what its slots would take; the draft's
    # the same for its requests plus two per draft-ahead hypothesis, which share blocks)
    kv_block_size: int = 0
    kv_blocks: int = 0
    prefix_caching: bool = True
    # draft-ahead (draft_service.ahead): the draft's guesses per accepted count, 0 = off, and
    # the extra KV slots its runner holds for the hypotheses
    draft_ahead: int = 0
    draft_ahead_slots: int = 0
    # with draft-ahead, a miss's backup proposal of no drafts (DraftConfig.draft_ahead_backup)
    draft_ahead_backup: Literal["auto", "always", "never"] = "auto"
    # with draft-ahead, the fan-out spread by the verdicts seen (DraftConfig.draft_ahead_spread)
    draft_ahead_spread: bool = False
    # the target chooses each step's k (target_service.speculation)
    dynamic_speculation: bool = False
    # chunked prefill: prompts longer than this prefilled this many tokens between two steps
    # (TargetConfig.prefill_chunk_tokens; 0: whole)
    prefill_chunk_tokens: int = 0
    # the hub's deadline for each Propose: past it the step goes on at k = 0 and the draft is
    # resynchronised once it answers again (TargetConfig.draft_deadline_s)
    draft_deadline_s: float = 0.3
    # with draft-ahead: the hub takes the chains the draft pushes before its asks
    # (TargetConfig.draft_push_chains)
    draft_push_chains: bool = True
    # with draft-ahead: Saguaro sampling's scale of the draft's top tokens (DraftConfig), 1 = off
    saguaro_scale: float = 1.0
    # BENCHMARKING ONLY: the target's acceptance test replaced by a synthetic mean acceptance
    # length L for k = synthetic_num_draft_tokens (target_service.synthetic); the output is
    # then NOT distributed as the target's. Both None (the default) or both set.
    synthetic_acceptance_length: float | None = None
    synthetic_num_draft_tokens: int | None = None
    # BENCHMARKING ONLY, with draft_ahead: the draft's hit rate set instead of guessed
    # (draft_service.ahead.synthetic_hit)
    synthetic_hit_rate: float | None = None
    # BENCHMARKING ONLY, mixed traffic: each request's own acceptance length and hit rate,
    # uniform within these spreads around the two (TargetConfig.synthetic, DraftConfig)
    synthetic_acceptance_spread: float = 0.0
    synthetic_hit_rate_spread: float = 0.0
    # BENCHMARKING ONLY, with synthetic acceptance: the draft service runs the stand-in of
    # draft_service.stand_in (no model, no GPU, each forward taking the time measured in this
    # file) instead of the draft model: "the draft on a GPU of its own" on a one-GPU machine
    draft_stand_in: Path | None = None
    # TLS of every service's server, and the CA (and the name in its certificate) that the
    # orchestrator -> target and target -> draft channels check. Paths, not PEM bytes: each
    # actor reads them on its own node (so they must exist there too, e.g. a Secret mounted at
    # the same path), and the private key is never pickled into Ray's object store and GCS
    # with the actors' arguments. The name is needed because the services listen on node IPs.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_root_cert: Path | None = None
    tls_server_name: str | None = None
    # mutual TLS: with a CA the services accept only peers presenting a certificate it signed,
    # and the orchestrator's and the targets' channels present this one
    tls_client_cert: Path | None = None
    tls_client_key: Path | None = None

    def __post_init__(self) -> None:
        _check_model_dir("target", self.target)
        if self.draft is not None:
            _check_model_dir("draft", self.draft)
        if not 0 < self.draft_deadline_s <= MAX_DRAFT_DEADLINE_S:
            raise ValueError(
                f"draft_deadline_s must be in (0, {MAX_DRAFT_DEADLINE_S:g}] seconds, "
                f"got {self.draft_deadline_s}."
            )
        check_draft_ahead(self.draft_ahead, self.saguaro_scale, self.synthetic_hit_rate,
                          self.synthetic_hit_rate_spread, self.draft_ahead_spread)  # fmt: skip
        if self.draft_ahead and (self.draft is None or self.draft_ahead_slots < 1):
            raise ValueError("draft_ahead needs a draft model and draft_ahead_slots >= 1.")
        if self.draft_stand_in is not None:
            if self.draft is None or self.synthetic_acceptance_length is None:
                raise ValueError(
                    "draft_stand_in needs a draft and synthetic acceptance: its drafts are no "
                    "model's, so only a synthetic acceptance test makes a run with it mean "
                    "anything."
                )
            if not Path(self.draft_stand_in).is_file():
                raise ValueError(f"draft_stand_in {str(self.draft_stand_in)!r} is not a file.")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}.")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}.")
        check_range(self.target_tensor_parallel, "target_tensor_parallel", 1, MAX_TENSOR_PARALLEL)
        check_range(self.kv_block_size, "kv_block_size", 0, 4096)
        check_range(self.kv_blocks, "kv_blocks", 0, 1 << 24)
        check_range(self.prefill_chunk_tokens, "prefill_chunk_tokens", 0, 1 << 20)
        if self.kv_blocks and not self.kv_block_size:
            raise ValueError("kv_blocks sizes a paged KV cache: set kv_block_size too.")
        if not 1 <= self.max_requests <= 4096:
            raise ValueError(f"max_requests must be in [1, 4096], got {self.max_requests}.")
        if self.max_seq_len is not None and not 2 <= self.max_seq_len <= 1 << 20:
            raise ValueError(f"max_seq_len must be in [2, 1048576], got {self.max_seq_len}.")
        if not 1 <= self.max_num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
            raise ValueError(
                f"max_num_draft_tokens must be in [1, {MAX_NUM_DRAFT_TOKENS}], "
                f"got {self.max_num_draft_tokens}."
            )
        if self.q_form not in ("dense", "sparse"):
            raise ValueError(f"q_form must be 'dense' or 'sparse', got {self.q_form!r}.")
        if self.support_size < 1:
            raise ValueError(f"support_size must be >= 1, got {self.support_size}.")
        if self.sampler_impl not in ("auto", "triton", "torch"):
            raise ValueError(
                f"sampler_impl must be 'auto', 'triton' or 'torch', got {self.sampler_impl!r}."
            )
        for size in self.cuda_graph_batch_sizes:
            if not 1 <= size <= self.max_requests:
                raise ValueError(
                    f"cuda_graph_batch_sizes entries must be in [1, max_requests="
                    f"{self.max_requests}], got {size}."
                )
        self._check_synthetic()
        self._check_tls()

    def _check_tls(self) -> None:
        _check_tls_pair("--service-tls", self.tls_cert, self.tls_key)
        if self.tls_cert is not None and self.tls_root_cert is None:
            raise ValueError(
                "--service-tls-cert needs --service-tls-root-cert: the CA that the orchestrator "
                "-> target and target -> draft channels trust."
            )
        if self.tls_root_cert is not None:
            if self.tls_cert is None:
                raise ValueError(
                    "--service-tls-root-cert needs --service-tls-cert and --service-tls-key: "
                    "without them the services listen in plaintext."
                )
            _check_pem("--service-tls-root-cert", self.tls_root_cert)
        _check_tls_pair("--service-tls-client", self.tls_client_cert, self.tls_client_key)
        if (self.tls_root_cert is None) != (self.tls_client_cert is None):
            raise ValueError(
                "--service-tls-root-cert and --service-tls-client-cert/--service-tls-client-key "
                "go together: the services accept only peers with a client certificate that CA "
                "signed (mutual TLS), which the orchestrator and the targets present."
            )
        if self.tls_server_name is not None and (
            self.tls_root_cert is None or not self.tls_server_name
        ):
            raise ValueError(
                "--service-tls-server-name must be a non-empty name in the services' "
                "certificate, given with --service-tls-root-cert."
            )

    def _check_synthetic(self) -> None:
        length, k = self.synthetic_acceptance_length, self.synthetic_num_draft_tokens
        spread = self.synthetic_acceptance_spread
        if (length is None) != (k is None):
            raise ValueError(
                "synthetic_acceptance_length and synthetic_num_draft_tokens go together."
            )
        if not (math.isfinite(spread) and spread >= 0.0):
            raise ValueError(f"synthetic_acceptance_spread must be >= 0, got {spread}.")
        if length is None or k is None:
            if spread:
                raise ValueError("synthetic_acceptance_spread needs synthetic_acceptance_length.")
            return
        if spread and not spread_fits(length, spread, 1.0, k + 1.0):
            raise ValueError(
                f"synthetic_acceptance_spread {spread} around synthetic_acceptance_length "
                f"{length} must stay in [1, {k + 1}] (1 + num_draft_tokens)."
            )
        if not 1 <= k <= self.max_num_draft_tokens:
            raise ValueError(
                f"synthetic acceptance needs num_draft_tokens in [1, max_num_draft_tokens="
                f"{self.max_num_draft_tokens}], got {k}."
            )
        if not (math.isfinite(length) and 1.0 <= length <= k + 1):
            raise ValueError(
                f"synthetic_acceptance_length must be in [1, {k + 1}] (1 + num_draft_tokens), "
                f"got {length}."
            )


def resolve_dtype(dtype: str, model_dir: str, device: str) -> str:
    """`dtype` with "auto" resolved where the device is known: float32 on the CPU (its bfloat16
    and float16 matmuls are slow), on a GPU the checkpoint's `torch_dtype` (`dtype` in newer
    config.json files) when it is one of DTYPES, else float32."""
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    saved = config.get("torch_dtype", config.get("dtype"))
    return saved if saved in DTYPES[1:] else "float32"


def _check_resources(name: str, resources: object) -> None:
    """Custom Ray resources: a mapping of names to positive amounts, CPU and GPU left out (the
    placement sets those itself)."""
    flag = "--" + name.replace("_", "-")
    example = f'{{"{name.removesuffix("_resources")}_gpu": 1}}'
    if not isinstance(resources, dict):
        raise ValueError(
            f"{flag} must be a JSON object of Ray custom resource names to positive amounts, "
            f"e.g. '{example}'; got {resources!r}."
        )
    for key, amount in resources.items():
        if not isinstance(key, str) or not key.strip():
            raise ValueError(f"{flag} names resources by non-empty strings, got {key!r}.")
        if key in ("CPU", "GPU"):
            raise ValueError(
                f"{flag} takes custom resources only: {key} per service comes from --device and "
                f"the GPUs the cluster has; name a resource your nodes offer, e.g. '{example}'."
            )
        if (
            isinstance(amount, bool)
            or not isinstance(amount, int | float)
            or not (math.isfinite(amount) and amount > 0)
        ):
            raise ValueError(f"{flag}: {key!r} must be a positive number, got {amount!r}.")


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    """How many pairs run and on which Ray cluster.

    `address` None starts a local cluster with `num_cpus` / `num_gpus` (None: what the machine
    has); otherwise it joins that cluster ("auto" reads RAY_ADDRESS, as on KubeRay).
    `draft_resources` / `target_resources` are custom Ray resources (name → amount) that each
    pair's draft / target bundle asks for besides its CPU and GPU, e.g. {"draft_gpu": 1} puts
    the drafts on nodes started with `--resources='{"draft_gpu": N}'`
    (`orchestrator.launch.placement`).
    """

    pairs: int = 1
    address: str | None = None
    num_cpus: int | None = None
    num_gpus: int | None = None
    start_timeout_s: float = 900.0
    restart_timeout_s: float = 600.0
    # a local cluster's start-up, retried (each failed attempt stopped) until this deadline:
    # Ray's raylet gets a fixed 30 s per attempt, which a loaded 2-core machine can miss
    ray_start_timeout_s: float = 120.0
    draft_resources: dict[str, float] = field(default_factory=dict)
    target_resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_resources("draft_resources", self.draft_resources)
        _check_resources("target_resources", self.target_resources)
        if not 1 <= self.pairs <= 256:
            raise ValueError(f"pairs must be in [1, 256], got {self.pairs}.")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"num_cpus must be >= 1, got {self.num_cpus}.")
        if self.num_gpus is not None and self.num_gpus < 0:
            raise ValueError(f"num_gpus must be >= 0, got {self.num_gpus}.")
        if self.start_timeout_s <= 0 or self.restart_timeout_s <= 0:
            raise ValueError("start_timeout_s and restart_timeout_s must be > 0 seconds.")
        if not 0 < self.ray_start_timeout_s <= 3600:
            raise ValueError(
                f"ray_start_timeout_s must be in (0, 3600] seconds (the local Ray cluster's "
                f"start-up deadline), got {self.ray_start_timeout_s}."
            )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Queueing and the speculation defaults of requests that do not choose their own."""

    max_queue: int = 256
    proposer: Proposer = "draft"
    num_draft_tokens: int = 4

    def __post_init__(self) -> None:
        if not 0 <= self.max_queue <= 1 << 20:
            raise ValueError(f"max_queue must be in [0, 1048576], got {self.max_queue}.")
        if self.proposer not in PROPOSERS:
            raise ValueError(f"proposer must be one of {PROPOSERS}, got {self.proposer!r}.")
        if not 0 <= self.num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
            raise ValueError(
                f"num_draft_tokens must be in [0, {MAX_NUM_DRAFT_TOKENS}], "
                f"got {self.num_draft_tokens}."
            )


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything `specdec serve` needs; `port` / `metrics_port` / `http_port` 0 pick free
    ports."""

    services: ServiceConfig
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    host: str = "0.0.0.0"
    port: int = 50050
    metrics_port: int | None = 9464
    http_port: int | None = None  # the OpenAI-compatible HTTP API; None: off
    # on SIGTERM: health NOT_SERVING (HTTP /health 503) with both ports open for drain_s,
    # then new calls are refused and the calls in flight get grace_s to finish
    grace_s: float = 10.0
    drain_s: float = 0.0
    max_workers: int = 256  # each streaming call holds a server thread while it runs
    max_concurrent_calls: int = 256 - SPARE_WORKERS  # more get RESOURCE_EXHAUSTED at once
    # PEM certificate chain and key: TLS on the client ports (gRPC, and HTTP with http_port)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # a CA (PEM): clients of both client ports must present a certificate it signed, else
    # the handshake fails (mutual TLS)
    tls_client_ca: Path | None = None
    # the client port's largest request; None derives it from max_seq_len
    # (`specdec.message_limits.request_bytes`)
    max_request_bytes: int | None = None
    # clients send `authorization: Bearer KEY` (specdec.serving.auth); None: no key
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.api_key is not None:
            check_api_key(self.api_key, "--api-key")
        if self.max_request_bytes is not None and not (
            MIN_MESSAGE_BYTES <= self.max_request_bytes <= MAX_MESSAGE_BYTES
        ):
            raise ValueError(
                f"max_request_bytes must be in [{MIN_MESSAGE_BYTES}, {MAX_MESSAGE_BYTES}] "
                f"(the client port's largest request, in bytes), got {self.max_request_bytes}."
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}.")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}.")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}.")
        if self.grace_s < 0 or self.drain_s < 0:
            raise ValueError("grace_s and drain_s must be >= 0 seconds.")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}.")
        if not 1 <= self.max_concurrent_calls <= self.max_workers - SPARE_WORKERS:
            raise ValueError(
                f"max_concurrent_calls must be in [1, max_workers - {SPARE_WORKERS}] (each call "
                f"holds a server thread; {SPARE_WORKERS} stay free for health checks and "
                f"refusals), got {self.max_concurrent_calls} with max_workers={self.max_workers}; "
                f"raise --max-workers to hold more calls."
            )
        _check_tls_pair("--tls", self.tls_cert, self.tls_key)
        if self.tls_client_ca is not None:
            if self.tls_cert is None:
                raise ValueError(
                    "--tls-client-ca needs --tls-cert and --tls-key: client certificates are "
                    "checked only over TLS."
                )
            _check_pem("--tls-client-ca", self.tls_client_ca)
        s = self.scheduler
        if s.proposer == "draft" and self.services.draft is None:
            raise ValueError(
                "proposer 'draft' needs a draft model (--draft DIR); without one use "
                "--proposer ngram or --proposer off."
            )
        if s.num_draft_tokens > self.services.max_num_draft_tokens:
            raise ValueError(
                f"num_draft_tokens must be in [0, max_num_draft_tokens="
                f"{self.services.max_num_draft_tokens}], got {s.num_draft_tokens}."
            )

    @property
    def request_bytes(self) -> int:
        """The client port's largest request: the flag's, else derived from max_seq_len."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return request_bytes(served_seq_len(self.services.target, self.services.max_seq_len))

    @property
    def model_name(self) -> str:
        """The served pair's name: the target directory's name."""
        return Path(self.services.target).resolve().name
