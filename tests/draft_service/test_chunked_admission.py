"""The draft's chunked admission (`DraftConfig.prefill_chunk_tokens`): a long prompt prefilled a
chunk at a time drafts what a whole prefill drafts; the engine's lock is let go between chunks,
so a running request's proposal is served while the prompt is prefilled; a release meanwhile
ends the admission and frees its slot; duplicates and a full engine are refused alike."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from draft_service.engine import DraftEngine
from draft_service.server import model_info
from specdec.errors import InvalidInputError
from specdec.runner import ForwardItem, ModelRunner
from specdec.sampling_params import SamplingParams
from specdec.serving.messages import AdmitRequest, ProposeEntry
from tests.draft_service.models import build_checkpoints, model_draft

LONG = tuple(range(3, 40))  # 36 tokens prefilled: 9 chunks of 4
SHORT = tuple(range(5, 12))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoints(tmp_path_factory.mktemp("ckpt"))[1]


def _engine(draft_dir: Path, chunk: int) -> DraftEngine:
    config = replace(model_draft(draft_dir), prefill_chunk_tokens=chunk)
    assert config.runner is not None
    runner = ModelRunner.load(config.runner)
    return DraftEngine(config, runner, model_info(config, runner))


def _drafts(engine: DraftEngine, rid: str, prompt: tuple[int, ...]) -> list[int]:
    block, errors = engine.propose([ProposeEntry(rid, 0, (), len(prompt), 4)])
    assert not errors
    return list(block.draft_token_ids)


def test_a_chunked_admission_drafts_what_a_whole_one_drafts(draft_dir: Path) -> None:
    whole, chunked = _engine(draft_dir, 0), _engine(draft_dir, 4)
    calls: list[int] = []
    real = chunked.runner.forward  # type: ignore[union-attr]

    def counted(items: list[ForwardItem]) -> torch.Tensor:
        calls.append(len(items[0].token_ids))
        return real(items)

    chunked.runner.forward = counted  # type: ignore[union-attr, method-assign]
    for e in (whole, chunked):
        e.admit(AdmitRequest("r", LONG, SamplingParams(0.0)))
    assert calls == [4] * 9, calls
    assert chunked.runner.cached_length("r") == whole.runner.cached_length("r") == len(LONG) - 1  # type: ignore[union-attr]
    assert _drafts(chunked, "r", LONG) == _drafts(whole, "r", LONG)


def test_a_proposal_is_served_between_the_chunks(draft_dir: Path) -> None:
    engine = _engine(draft_dir, 4)
    engine.admit(AdmitRequest("run", SHORT, SamplingParams(0.0)))
    real = engine.runner.forward  # type: ignore[union-attr]
    chunks: list[float] = []

    def slow(items: list[ForwardItem]) -> torch.Tensor:
        if items[0].request_id == "long":
            chunks.append(time.monotonic())
            time.sleep(0.05)  # a slow prefill chunk (the lock is held meanwhile)
        return real(items)

    engine.runner.forward = slow  # type: ignore[union-attr, method-assign]
    admitted = threading.Thread(
        target=engine.admit, args=(AdmitRequest("long", LONG, SamplingParams(0.0)),)
    )
    admitted.start()
    while not chunks:
        time.sleep(0.001)
    _drafts(engine, "run", SHORT)  # waits at most for the chunk in progress
    served = time.monotonic()
    admitted.join(10)
    assert len(chunks) == 9 and "long" in engine._requests
    assert served < chunks[-1], "the proposal waited for every chunk of the admission"


def test_a_release_during_the_chunks_ends_the_admission(draft_dir: Path) -> None:
    engine = _engine(draft_dir, 4)
    free = engine.runner.free_slots  # type: ignore[union-attr]
    real = engine.runner.forward  # type: ignore[union-attr]
    errors: list[BaseException] = []

    def release_at_third(items: list[ForwardItem]) -> torch.Tensor:
        out = real(items)
        if items[0].request_id == "long" and engine.runner.cached_length("long") == 12:  # type: ignore[union-attr]
            threading.Thread(target=engine.release, args=(["long"],)).start()
            time.sleep(0.05)  # the release waits for the lock, taken after this chunk
        return out

    engine.runner.forward = release_at_third  # type: ignore[union-attr, method-assign]

    def admit() -> None:
        try:
            engine.admit(AdmitRequest("long", LONG, SamplingParams(0.0)))
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=admit)
    t.start()
    t.join(10)
    assert len(errors) == 1 and isinstance(errors[0], InvalidInputError), errors
    assert "released" in str(errors[0])
    assert engine.runner.free_slots == free, "the admission's slot was not given back"  # type: ignore[union-attr]
    assert engine.release(["long"]) == 0
    engine.runner.forward = real  # type: ignore[union-attr, method-assign]
    engine.admit(AdmitRequest("long", LONG, SamplingParams(0.0)))  # the id may come back


def test_a_duplicate_is_refused_while_its_chunks_run(draft_dir: Path) -> None:
    engine = _engine(draft_dir, 4)
    real = engine.runner.forward  # type: ignore[union-attr]
    refused: list[BaseException] = []
    threads: list[threading.Thread] = []

    def try_admit() -> None:
        try:
            engine.admit(AdmitRequest("long", SHORT, SamplingParams(0.0)))
        except BaseException as e:
            refused.append(e)

    def duplicate_at_first(items: list[ForwardItem]) -> torch.Tensor:
        if items[0].request_id == "long" and not threads:
            threads.append(threading.Thread(target=try_admit))
            threads[0].start()  # it waits for the lock, taken between two chunks
        return real(items)

    engine.runner.forward = duplicate_at_first  # type: ignore[union-attr, method-assign]
    engine.admit(AdmitRequest("long", LONG, SamplingParams(0.0)))
    threads[0].join(10)
    assert len(refused) == 1 and isinstance(refused[0], InvalidInputError), refused
    assert "already admitted" in str(refused[0])
    assert engine.runner.cached_length("long") == len(LONG) - 1  # type: ignore[union-attr]
