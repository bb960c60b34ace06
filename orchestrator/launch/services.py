"""Starts one service inside its Ray actor's process: `ServiceConfig` → the service's own
config → its gRPC server, warmed up and SERVING. Only actors import this module (it pulls in
torch through the services)."""

from __future__ import annotations

import logging
from typing import Any

from orchestrator.config import ServiceConfig, resolve_dtype
from specdec.serving.messages import ModelInfo

log = logging.getLogger(__name__)


def actor_device(config: ServiceConfig) -> str:
    """'cuda' when Ray gave this actor a GPU (it sets CUDA_VISIBLE_DEVICES), else 'cpu'."""
    import ray

    if config.device != "auto":
        return config.device
    return "cuda" if ray.get_gpu_ids() else "cpu"


def _runner(
    config: ServiceConfig, model: str, device: str, extra_slots: int = 0, tensor_parallel: int = 1
) -> Any:
    from specdec.runner import RunnerConfig
    from specdec.serving.cli import MAX_DEFAULT_SEQ_LEN, checkpoint_seq_len

    max_seq_len = config.max_seq_len
    if max_seq_len is None:  # the checkpoint's own limit, capped as the services' mains do
        limit = checkpoint_seq_len(model)
        max_seq_len = min(limit or MAX_DEFAULT_SEQ_LEN, MAX_DEFAULT_SEQ_LEN)
    return RunnerConfig(
        model_path=model,
        device=device,
        dtype=resolve_dtype(config.dtype, model, device),
        max_slots=config.max_requests + extra_slots,
        max_seq_len=max_seq_len,
        cuda_graph_batch_sizes=config.cuda_graph_batch_sizes if device != "cpu" else (),
        tensor_parallel=tensor_parallel,
        kv_block_size=config.kv_block_size,
        kv_blocks=kv_blocks(config, max_seq_len, extra_slots),
        prefix_caching=config.prefix_caching,
    )


def kv_blocks(config: ServiceConfig, max_seq_len: int, hypotheses: int) -> int:
    """A paged cache's blocks: the configured number, or a full sequence for each request
    (and the scratch); and for each draft-ahead hypothesis, which shares its request's blocks,
    the one it copies on writing into it and those its k + 1 positions run into past it."""
    if not config.kv_block_size:
        return 0
    # a hypothesis writes up to k + 1 positions: the block it shares, copied, and past it
    per_hypothesis = 1 + -(-(config.max_num_draft_tokens + 1) // config.kv_block_size)
    if config.kv_blocks:
        return config.kv_blocks + per_hypothesis * hypotheses
    per_request = -(-max_seq_len // config.kv_block_size)
    return (config.max_requests + 1) * per_request + per_hypothesis * hypotheses


def synthetic_acceptance(config: ServiceConfig) -> Any:
    """BENCHMARKING ONLY: the target's `SyntheticAcceptance` (None unless configured)."""
    if config.synthetic_acceptance_length is None:
        return None
    from target_service.synthetic import SyntheticAcceptance

    assert config.synthetic_num_draft_tokens is not None
    synthetic = SyntheticAcceptance(
        config.synthetic_num_draft_tokens,
        mean_acceptance_length=config.synthetic_acceptance_length,
        length_spread=config.synthetic_acceptance_spread,
    )
    log.warning(
        "synthetic acceptance is on (rates %s for k = %d): BENCHMARKING ONLY, the output is "
        "NOT distributed as the target's",
        synthetic.unconditional_rates(),
        synthetic.num_draft_tokens,
    )
    return synthetic


def message_bytes(config: ServiceConfig) -> int:
    """The largest message a service of this pair takes (`specdec.message_limits`): dense q
    over the wider of the two vocabularies, or every request's tokens."""
    from specdec.message_limits import checkpoint_vocab_size, served_seq_len, service_message_bytes

    models = [config.target] if config.draft is None else [config.target, config.draft]
    vocab = max(checkpoint_vocab_size(m) for m in models)
    max_seq_len = served_seq_len(config.target, config.max_seq_len)
    return service_message_bytes(
        config.max_requests, config.max_num_draft_tokens, vocab, max_seq_len
    )


def start_service(role: str, config: ServiceConfig, host: str) -> tuple[Any, ModelInfo]:
    """Starts the target (role "target") or the draft (role "draft") listening on `host` (its
    node's address, not every interface: a service without TLS must not be reachable from
    every network the node is on); returns the running server and the service's ModelInfo.
    The target starts without a draft: the orchestrator checks the pair's tokenizers and then
    points the hub at it."""
    from specdec.serving.server import ServerConfig

    device = actor_device(config)
    server = ServerConfig(
        host=host, port=0, tls_cert=config.tls_cert, tls_key=config.tls_key,
        tls_client_ca=config.tls_root_cert, max_message_bytes=message_bytes(config),
    )  # fmt: skip
    if role == "draft":
        from draft_service.config import DraftConfig
        from draft_service.server import start as start_draft

        assert config.draft is not None
        runner = _runner(config, config.draft, device, config.draft_ahead_slots)
        stand_in = config.draft_stand_in
        if stand_in is not None:  # BENCHMARKING ONLY
            from dataclasses import replace

            # the stand-in runs on the CPU whatever the device, emulating the served sizes' graphs
            runner = replace(runner, cuda_graph_batch_sizes=config.cuda_graph_batch_sizes)
        d_srv, d_engine = start_draft(
            DraftConfig(
                runner=runner,
                q_form=config.q_form,
                support_size=config.support_size,
                max_num_draft_tokens=config.max_num_draft_tokens,
                draft_ahead=config.draft_ahead,
                draft_ahead_slots=config.draft_ahead_slots,
                draft_ahead_backup=config.draft_ahead_backup,
                draft_ahead_spread=config.draft_ahead_spread,
                synthetic_hit_rate=config.synthetic_hit_rate,
                synthetic_hit_rate_spread=config.synthetic_hit_rate_spread,
                saguaro_scale=config.saguaro_scale,
                stand_in=None if stand_in is None else str(stand_in),
                prefill_chunk_tokens=config.prefill_chunk_tokens,
                server=server,
            )
        )
        return d_srv, d_engine.info
    assert role == "target", role
    from target_service.config import TargetConfig
    from target_service.server import start as start_target

    srv, engine = start_target(
        TargetConfig(
            _runner(config, config.target, device, tensor_parallel=config.target_tensor_parallel),
            server,
            max_num_draft_tokens=config.max_num_draft_tokens,
            sampler_impl=config.sampler_impl,
            draft_deadline_s=config.draft_deadline_s,
            draft_push_chains=config.draft_push_chains,
            synthetic=synthetic_acceptance(config),
            dynamic_speculation=config.dynamic_speculation,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            draft_tls_root_cert=config.tls_root_cert,
            draft_tls_server_name=config.tls_server_name,
            draft_tls_client_cert=config.tls_client_cert,
            draft_tls_client_key=config.tls_client_key,
        )
    )
    log.info("%s service on %s", role, device)
    return srv, engine.info
