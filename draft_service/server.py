"""The draft's gRPC server: load, warm up, serve; NOT_SERVING until warm (see
`specdec.serving.server`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from draft_service.config import DraftConfig
from draft_service.engine import DraftEngine
from draft_service.servicer import DraftServicer
from specdec.pb import draft_pb2, draft_pb2_grpc
from specdec.runner import ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.serving.messages import AdmitRequest, ModelInfo, ProposeEntry
from specdec.serving.server import Server

log = logging.getLogger(__name__)
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
WARMUP_ID = "__warmup__"
NGRAM_MAX_SEQ_LEN = 1 << 20


def model_info(config: DraftConfig, runner: ModelRunner | None) -> ModelInfo:
    """The draft model's info, or the shared tokenizer's for prompt lookup."""
    limits: dict[str, int] = dict(
        max_num_draft_tokens=config.max_num_draft_tokens,
        max_message_bytes=config.server.max_message_bytes,
    )
    if runner is not None:
        i = runner.info
        return ModelInfo(
            architecture=i.architecture, vocab_size=runner.vocab_size,
            tokenizer_vocab_size=i.tokenizer_vocab_size or runner.vocab_size,
            tokenizer_hash=i.tokenizer_hash, max_seq_len=runner.config.max_seq_len,
            max_requests=runner.config.max_slots - config.draft_ahead_slots, dtype=i.dtype,
            drafts_ahead=bool(config.draft_ahead) and runner.can_fork, **limits,
        )  # fmt: skip
    from transformers import AutoTokenizer

    from specdec.runner.loader import tokenizer_hash

    tok = AutoTokenizer.from_pretrained(config.tokenizer_path, local_files_only=True)
    return ModelInfo(
        architecture="ngram", vocab_size=len(tok), tokenizer_vocab_size=len(tok),
        tokenizer_hash=tokenizer_hash(tok), max_seq_len=NGRAM_MAX_SEQ_LEN,
        max_requests=config.max_requests, dtype="none",
        max_num_draft_tokens=limits["max_num_draft_tokens"],
        max_message_bytes=limits["max_message_bytes"],
    )  # fmt: skip


def warm_up(engine: DraftEngine) -> None:
    """One admit → propose → release, so the first real block pays no allocation; then the
    CUDA graphs of every captured batch size (`DraftEngine.capture_graphs`)."""
    greedy = engine.config.stand_in is not None  # the stand-in drafts for greedy requests only
    sampling = SamplingParams(temperature=0.0) if greedy else SamplingParams()
    engine.admit(AdmitRequest(WARMUP_ID, (0, 1, 0), sampling))
    try:
        k = min(2, engine.info.max_num_draft_tokens)
        engine.propose([ProposeEntry(WARMUP_ID, 0, (), 3, k)])
    finally:
        engine.release([WARMUP_ID])
    start = time.perf_counter()
    captured = engine.capture_graphs()
    if captured:
        log.info("draft: %d CUDA graphs captured in %.1f s", captured, time.perf_counter() - start)


def _stand_in(config: DraftConfig) -> Any:
    """BENCHMARKING ONLY: the stand-in runner (`draft_service.stand_in`) of `config.stand_in`."""
    from draft_service.stand_in import StandInRunner, StandInTimes

    assert config.runner is not None and config.stand_in is not None
    times = StandInTimes.load(config.stand_in)
    log.warning(
        "the draft is a STAND-IN (BENCHMARKING ONLY): no model, no GPU; each forward waits the "
        "time the draft's took on %s (%s), and its drafts are no model's choice",
        times.gpu,
        config.stand_in,
    )
    return StandInRunner(config.runner, times)


def start(config: DraftConfig, runner: ModelRunner | None = None) -> tuple[Server, DraftEngine]:
    """Loads (unless given a runner), binds, warms up, then SERVING."""
    if runner is None and config.stand_in is not None:
        runner = _stand_in(config)
    if runner is None and config.proposer == "model":
        assert config.runner is not None
        runner = ModelRunner.load(config.runner)
    if runner is not None:
        runner.own_device()
    engine = DraftEngine(config, runner, model_info(config, runner))
    servicer = DraftServicer(engine)
    server = Server(
        config.server,
        [SERVICE_NAME],
        lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s),
    )
    server.start()
    try:
        warm_up(engine)
    except BaseException:
        server.stop(0)
        raise
    server.ready()
    log.info("draft service (%s) serving on port %d", config.proposer, server.port)
    return server, engine
