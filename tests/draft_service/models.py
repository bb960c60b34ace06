"""Tiny local checkpoints and running services for the service tests (nothing is downloaded).

The draft is the target's weights plus noise, with a differently padded vocabulary (256 vs 300
rows; the tokenizer has 250 ids), so drafts are accepted often but not always.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.local import LocalPair, local_pair
from draft_service.config import DraftConfig
from specdec.runner import ForwardItem, ModelRunner, RunnerConfig
from specdec.serving.server import ServerConfig
from target_service.config import TargetConfig
from tests.specdec._runner_models import TOKENIZER_VOCAB, hf_model, save_checkpoint

DRAFT_VOCAB = 256


def build_checkpoints(root: Path, noise: float = 0.05) -> tuple[Path, Path]:
    """(target_dir, draft_dir) of a tiny Llama pair sharing one tokenizer."""
    target = hf_model("llama3", seed=0)
    save_checkpoint(target, root / "target")
    draft = hf_model("llama3", seed=0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * torch.randn(p.shape, generator=gen) * p.abs().mean())
    draft.resize_token_embeddings(DRAFT_VOCAB)
    draft.config.vocab_size = DRAFT_VOCAB
    save_checkpoint(draft, root / "draft")
    return root / "target", root / "draft"


def runner_config(path: Path, max_slots: int = 16) -> RunnerConfig:
    return RunnerConfig(str(path), max_slots=max_slots, max_seq_len=128)


@contextmanager
def services(
    target_dir: Path,
    draft: DraftConfig,
    server: ServerConfig | None = None,
    sampler_impl: str = "auto",
) -> Iterator[LocalPair]:
    """Both services on free loopback ports (`bench.local`); `server` configures the
    target's. sampler_impl "torch" runs the rejection sampler's pure-torch implementation
    (bit-equal to the kernels, tested in test_rejection_kernels): the Triton interpreter costs
    about 1 s per step on CPU."""
    target = TargetConfig(
        runner_config(target_dir),
        server or ServerConfig(),
        sampler_impl=sampler_impl,  # type: ignore[arg-type]
    )
    with local_pair(draft, target) as pair:
        yield pair


def model_draft(draft_dir: Path, q_form: str = "sparse", support: int = 8) -> DraftConfig:
    return DraftConfig(
        runner=runner_config(draft_dir),
        q_form=q_form,
        support_size=support,  # type: ignore[arg-type]
    )


def greedy_reference(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """Target-only greedy decoding over the tokenizer's ids (padding ids excluded)."""
    runner.add_request("reference")
    try:
        logits = runner.forward([ForwardItem("reference", prompt, 1)])
        out: list[int] = []
        for _ in range(n):
            token = int(logits[0, :TOKENIZER_VOCAB].argmax())
            out.append(token)
            logits = runner.forward([ForwardItem("reference", [token], 1)])
        return out
    finally:
        runner.release("reference")


def next_token_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """The target's float32 logits [V] for the token after `prompt`."""
    runner.add_request("reference")
    try:
        return runner.forward([ForwardItem("reference", prompt, 1)])[0]
    finally:
        runner.release("reference")
