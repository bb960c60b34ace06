"""The target's gRPC server: load, warm up, serve; NOT_SERVING until warm (see
`specdec.serving.server`). Refuses a draft with an incompatible tokenizer at start-up."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import grpc
import torch

from specdec.errors import CacheFullError, CheckpointError
from specdec.pb import common_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specdec.runner import ModelRunner
from specdec.serving.blocks import DenseQ, DraftBlock, DraftProposal, DraftQ, SparseQ, block_to_pb
from specdec.serving.client import make_channel, set_client_identity
from specdec.serving.messages import AdmitRequest, ModelInfo, check_compatible
from specdec.serving.server import Server
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from target_service.hub import HubServicer

log = logging.getLogger(__name__)
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
WARMUP_ID = "__warmup__"


def warm_up(engine: TargetEngine, ks: Iterable[int] = (1,), vocab_size: int | None = None) -> None:
    """Per k, an admit → verify of k draft tokens, then of a block mixing k and 0 (a request
    with drafts beside one without: draft-ahead's backup proposals, dynamic speculation) →
    release; then a block of one request without drafts (a backup proposal at batch 1, or k =
    0), so that the first real step of each kind pays no compile, capture or allocation: the
    sampler's kernels are compiled per k and for the gather of a block whose rows' k differ (on
    an H100, a first mixed block at batch 8 stood out as a 244 ms p99 step), and a lone
    one-token step is a CUDA graph of its own that the blocks before it never run.

    With `vocab_size` (on a GPU), each k's drafts are verified once more with a sparse q and
    once with a dense q over that many ids: the q a sampled request's drafts carry is a kernel
    variant of its own (a first sampled step at batch 1 was 0.9 s on an H200). The kernels are
    compiled for every batch and row count at once (`kernels.LaunchShape`), so batch 1 covers
    the batches that come later."""
    blocks: list[list[tuple[str, tuple[int, ...], DraftQ]]] = []
    for k in ks:
        drafts = tuple(range(1, k + 1))
        blocks += [
            [(WARMUP_ID, drafts, None)],
            [(WARMUP_ID, drafts, None), (f"{WARMUP_ID}0", (), None)],
        ]
        if vocab_size is not None:
            one = torch.ones(k, 1)
            sparse = SparseQ(torch.tensor(drafts, dtype=torch.int32)[:, None], one)
            dense = DenseQ(torch.nn.functional.one_hot(torch.tensor(drafts), vocab_size).float())
            blocks += [[(WARMUP_ID, drafts, sparse)], [(WARMUP_ID, drafts, dense)]]
    blocks.append([(f"{WARMUP_ID}0", (), None)])
    for block in blocks:
        admitted: list[str] = []
        try:
            for rid, _, _ in block:
                engine.admit(AdmitRequest(rid, (0, 1)))
                admitted.append(rid)
            proposals = [DraftProposal(rid, 0, 2, d, q) for rid, d, q in block]
            engine.verify(DraftBlock.from_pb(block_to_pb(proposals)))
        except CacheFullError:  # one slot: no block of two requests ever comes either
            continue
        finally:
            engine.release(admitted)


def check_draft(engine: TargetEngine, config: TargetConfig) -> None:
    """Fetches the draft's ModelInfo and raises CheckpointError if its tokenizer differs."""
    assert config.draft_address is not None
    root = config.draft_tls_root_cert
    channel = make_channel(
        config.draft_address, config.server.max_message_bytes,
        None if root is None else root.read_bytes(), config.draft_tls_server_name,
    )  # fmt: skip
    with channel:
        grpc.channel_ready_future(channel).result(timeout=config.draft_wait_s)
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        pb = stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=config.draft_wait_s)
    try:
        check_compatible(engine.info, ModelInfo.from_pb(pb))
    except ValueError as e:
        raise CheckpointError(f"Refusing the draft at {config.draft_address}: {e}") from e


def build_server(engine: TargetEngine, config: TargetConfig) -> Server:
    servicer = HubServicer(engine)
    return Server(
        config.server,
        [SERVICE_NAME],
        lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s),
    )


def start(config: TargetConfig, runner: ModelRunner | None = None) -> tuple[Server, TargetEngine]:
    """Loads (unless given a runner), binds, warms up, checks the draft, then SERVING."""
    cert, key = config.draft_tls_client_cert, config.draft_tls_client_key
    if cert is not None and key is not None:  # every channel to the draft presents it
        set_client_identity(cert.read_bytes(), key.read_bytes())
    loaded = runner is None
    runner = runner or ModelRunner.load(config.runner)
    try:
        return _serve(config, runner)
    except BaseException:
        if loaded:  # a tensor-parallel runner's other ranks
            runner.close()
        raise


def _serve(config: TargetConfig, runner: ModelRunner) -> tuple[Server, TargetEngine]:
    runner.own_device()
    engine = TargetEngine(runner, config)
    server = build_server(engine, config)
    server.start()
    try:
        # dynamic speculation runs any k up to the limit: compile each before the first request
        k_max = min(config.max_num_draft_tokens, engine.info.max_seq_len - 3)
        if config.synthetic is not None:  # BENCHMARKING ONLY: it refuses any larger k
            k_max = min(k_max, config.synthetic.num_draft_tokens)
        # any k up to the limit can come (the hub lowers k at a request's last tokens, dynamic
        # speculation every step): on a GPU the sampler's kernels are specialised by powers of
        # two of k and k + 1, so each k is compiled before the first request; the CPU compiles
        # nothing, and under dynamic speculation each k is warmed up there as before
        on_gpu = engine.runner.device.type == "cuda"
        every_k = config.dynamic_speculation or on_gpu
        warm_up(engine, range(1, k_max + 1) if every_k else (1,),
                engine.vocab_size if on_gpu else None)  # fmt: skip
        if config.draft_address is not None:
            check_draft(engine, config)
    except BaseException:
        server.stop(0)
        raise
    server.ready()
    log.info("target service serving on port %d", server.port)
    return server, engine
