"""On a GPU, the sampler's kernels are compiled once per k and q form: a block's batch, its
row count and its sparse support width pick no compile of their own, and the target's warm-up
compiles every variant a served step can need. (A compile in the middle of serving was one
0.93 s step on an H200: a first block at batch 8 with backup proposals in it.)"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specdec.runner import ModelRunner, RunnerConfig
from specdec.runner.runner import on_device
from specdec.sampling_params import SamplingParams
from specdec.serving.blocks import DenseQ, DraftBlock, DraftProposal, SparseQ, block_to_pb
from specdec.serving.messages import AdmitRequest
from target_service import kernels
from target_service.config import TargetConfig
from target_service.engine import TargetEngine
from target_service.rejection_sampler import prepare
from target_service.server import warm_up
from tests.draft_service.models import build_checkpoints
from tests.target_service.helpers import Batch, random_batch
from tests.target_service.test_rejection_kernels import ks

pytestmark = pytest.mark.gpu
VOCAB = 128256  # Llama 3's: enough vocabulary splits that the batch would pick their count


def keys() -> set[str]:
    """The compiled variants of the sampler's two kernels held in this process (their cache
    keys: the specialisation of each argument, the constexprs), on every device."""
    fns = (kernels._row_stats_kernel, kernels._decide_sample_kernel)
    return {f"{fn.fn.__name__}: {key}" for fn in fns for entry in fn.device_caches.values()
            for key in entry[0]}  # fmt: skip


def variants() -> int:
    return len(keys())


def sample(b: Batch, device: torch.device) -> None:
    b = b.to(device)
    kernels.rejection_sample_triton(prepare(b.k, b.draft_ids, b.logits, b.q, b.sampling))
    torch.cuda.synchronize(device)


def test_one_compile_per_k_and_q_form_serves_every_batch() -> None:
    device = torch.device("cuda:0")
    with on_device(device):
        for k in range(1, 5):  # what the warm-up compiles: batch 1, each k and q form
            for form in ("none", "sparse", "dense"):
                sample(random_batch([k], VOCAB, form, seed=k), device)
        sample(random_batch([0], VOCAB, "none"), device)
        warmed, seen = variants(), keys()
        first = sorted(seen)
        assert warmed > 0, "no compiled kernel was counted: the check would pass blind"
        compiled = []
        for batch in (1, 2, 3, 8, 13, 16, 33):
            for form, support in (("none", 16), ("dense", 16), ("sparse", 1), ("sparse", 7),
                                  ("sparse", 31)):  # fmt: skip
                k = ks(batch, 4, seed=batch)
                if form != "none" and not any(k):
                    k[0] = 1
                sample(random_batch(k, VOCAB, form, seed=batch, support=support), device)
                if variants() != warmed:
                    compiled.append((batch, form, support, max(k), sorted(keys() - seen)))
                    warmed = variants()
                seen = keys()
    assert not compiled, (
        f"blocks that compiled a kernel after the warm-up: {compiled}; warmed up: {first}"
    )


def test_the_warm_up_compiles_what_served_blocks_need(tmp_path: Path) -> None:
    """Through the target's engine: after `warm_up`, blocks of any batch mixing k = 0 .. 4,
    greedy and sampled requests, and no, sparse or dense q compile nothing."""
    target_dir, _ = build_checkpoints(tmp_path)
    runner = RunnerConfig(str(target_dir), max_slots=16, max_seq_len=128)
    config = TargetConfig(replace(runner, device="cuda", cuda_graph_batch_sizes=(1, 2, 4, 8)))
    engine = TargetEngine(ModelRunner.load(config.runner), config)
    vocab = engine.vocab_size
    warm_up(engine, range(1, 5), vocab)
    warmed = variants()
    gen = torch.Generator().manual_seed(3)
    compiled = []
    for batch in (2, 3, 8, 13, 16):
        k = ks(batch, 4, seed=batch)
        forms = [
            ("none", "sparse", "dense")[int(f)]
            for f in torch.randint(0, 3, (batch,), generator=gen)
        ]
        proposals, ids = [], []
        for i, (n, form) in enumerate(zip(k, forms, strict=True)):
            rid = f"r{batch}-{i}"
            sampling = SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i)
            engine.admit(AdmitRequest(rid, (1, 2, 3), sampling))
            ids.append(rid)
            drafts = tuple(int(t) for t in torch.randint(0, vocab, (n,), generator=gen))
            q = None
            if n and form == "sparse":
                q = SparseQ(torch.tensor(drafts, dtype=torch.int32)[:, None], torch.ones(n, 1))
            elif n and form == "dense":
                q = DenseQ(torch.softmax(torch.randn(n, vocab, generator=gen), -1))
            proposals.append(DraftProposal(rid, 0, 3, drafts, q))
        try:
            engine.verify(DraftBlock.from_pb(block_to_pb(proposals)))
        finally:
            engine.release(ids)
        if variants() != warmed:
            compiled.append((batch, k, forms))
            warmed = variants()
    assert not compiled, f"served blocks that compiled a sampler kernel: {compiled}"
