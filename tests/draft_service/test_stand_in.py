"""The draft stand-in (BENCHMARKING ONLY, draft_service.stand_in): its times are measured from
the real draft runner, written and read back as the file `specdec serve --draft-stand-in`
takes; served in place of the draft model it uses no model, waits at least the measured time
per forward, drafts ahead with hits, refuses sampled requests, and (its drafts being verified
like any draft's) leaves greedy output equal to target-only greedy."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from draft_service import stand_in
from draft_service.stand_in import StandInRunner, StandInTimes
from specdec.errors import InvalidInputError
from specdec.runner import ForwardItem, ModelRunner
from specdec.sampling_params import SamplingParams
from tests.draft_service.models import greedy_reference, model_draft, runner_config, services
from tests.draft_service.test_ahead import _prompts, with_ahead

SIZES = (1, 2, 4)


@pytest.fixture(scope="module")
def times_file(checkpoints: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in times of the tiny draft, measured on the CPU by the module's command."""
    out = tmp_path_factory.mktemp("stand_in") / "times.json"
    argv = ["--model", str(checkpoints[1]), "--max-slots", "16", "--max-seq-len", "128",
            "--cuda-graph-batch-sizes", *map(str, SIZES), "--guesses", "3", "--repeats", "3",
            "--out", str(out)]  # fmt: skip
    assert stand_in.main(argv) == 0
    return out


def test_measured_times_cover_every_graph_and_read_back(
    times_file: Path, checkpoints: tuple[Path, Path]
) -> None:
    data = json.loads(times_file.read_text())
    assert data["benchmarking_only"] is True
    times = StandInTimes.load(times_file)
    assert set(times.graph_s) == {(b, n) for b in SIZES for n in (1, 2)}
    assert all(s > 0 for s in times.graph_s.values())
    assert times.forward(64) > 0 and times.forward_s[1] >= 0 and times.fork(64) >= 0
    real = ModelRunner.load(runner_config(checkpoints[1])).info
    assert times.info == real  # the stand-in reports the measured checkpoint as its own
    assert StandInTimes.from_json(times.to_json()) == times


GRAPH = {"batch": 1, "tokens": 1, "seconds": 0.001}


@pytest.mark.parametrize(
    "broken",
    [{}, {"graph_s": "x"}, {"forward_s": [0.1]}, {"forward_s": [0.1, 20.0]}, {"info": {"a": 1}},
     {"forward_s": "12"}, {"fork_s": [float("nan"), 0.0]}, {"gpu": 3},
     {"graph_s": [GRAPH, GRAPH]}, {"graph_s": [GRAPH | {"batch": 0}]},
     {"graph_s": [GRAPH | {"batch": 1.9}]}, {"graph_s": [GRAPH | {"batch": float("inf")}]},
     {"graph_s": [GRAPH | {"seconds": "1"}]}],
)  # fmt: skip
def test_a_malformed_times_file_is_refused_with_a_sentence(times_file: Path, broken: dict) -> None:
    data = json.loads(times_file.read_text())
    data = {} if not broken else data | broken
    with pytest.raises(ValueError, match="stand-in"):
        StandInTimes.from_json(data)


def _times(graph_s: float, forward_s: float = 0.01) -> StandInTimes:
    from specdec.runner.config import CheckpointInfo

    info = CheckpointInfo("LlamaForCausalLM", 256, 250, 128, "float32", True, "h")
    graphs = {(b, n): graph_s for b in SIZES for n in (1, 2)}
    return StandInTimes("test", graphs, (forward_s, 0.0), (0.0, 0.0), info)


@pytest.mark.parametrize(
    "field", [("vocab_size", "x"), ("vocab_size", 0), ("fast_path", 1), ("architecture", None)]
)
def test_a_times_file_with_a_wrong_info_field_is_refused(
    times_file: Path, field: tuple[str, object]
) -> None:
    data = json.loads(times_file.read_text())
    data["info"][field[0]] = field[1]
    with pytest.raises(ValueError, match="stand-in times must be"):
        StandInTimes.from_json(data)


def test_a_file_without_every_served_graph_is_refused() -> None:
    """A missing (batch, tokens) entry would make each such step wait an eager forward."""
    times = _times(0.001)
    config = replace(runner_config(Path("unused")), max_slots=8, cuda_graph_batch_sizes=(1, 8))
    with pytest.raises(ValueError, match=r"no graph of \(batch, tokens\) \[\(8, 1\), \(8, 2\)\]"):
        StandInRunner(config, times)


def test_each_call_waits_exactly_the_time_of_its_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The padded batch size's graph for steps of one or two tokens, the eager line for longer
    steps and forwards, the fork line for the longest branch times the branches."""
    from specdec.runner.config import CheckpointInfo

    info = CheckpointInfo("LlamaForCausalLM", 256, 250, 128, "float32", True, "h")
    graphs = {(b, n): b * 0.01 + n * 0.001 for b in SIZES for n in (1, 2)}
    times = StandInTimes("test", graphs, (0.5, 0.001), (0.2, 1e-6), info)
    config = replace(runner_config(Path("unused")), cuda_graph_batch_sizes=SIZES)
    runner = StandInRunner(config, times)
    waits: list[float] = []
    monkeypatch.setattr(stand_in.time, "perf_counter", lambda: 100.0)
    monkeypatch.setattr(stand_in, "wait_until", lambda deadline: waits.append(deadline - 100.0))
    for rid in "abcde":
        runner.add_request(rid)
    runner.forward([ForwardItem("a", [1] * 10, 1), ForwardItem("b", [1] * 6, 0)])
    runner.ragged_step(["a", "b", "c"], [[1], [2, 3], [4]])  # 3 requests: the graph of 4
    runner.graph_step(["a"], torch.zeros(1, 1, dtype=torch.long))
    runner.graph_step(["d", "e"], torch.zeros(2, 3, dtype=torch.long))  # 3 tokens: eager
    runner.add_request("f")
    runner.fork([("a", "f", 9)])
    assert waits == pytest.approx([0.5 + 0.016, 0.042, 0.011, 0.5 + 0.006, 0.2 + 9e-6])


def test_each_forward_waits_at_least_its_measured_time() -> None:
    """A lower bound only: how much longer it takes is the host's business (and the
    benchmark's, which reports the hub's step parts)."""
    config = replace(runner_config(Path("unused")), cuda_graph_batch_sizes=SIZES)
    runner = StandInRunner(config, _times(0.02, forward_s=0.03))
    for rid in ("a", "b", "c"):
        runner.add_request(rid)
    start = time.perf_counter()
    logits = runner.forward([ForwardItem("a", [1, 2, 3], 1), ForwardItem("b", [4], 0)])
    assert time.perf_counter() - start >= 0.03 and logits.shape[0] == 1
    start = time.perf_counter()
    _, (ids,) = runner.ragged_step(["a", "b", "c"], [[5], [6, 7], [8]],
                                   lambda lg, *_: (lg[:, 0].argmax(-1),))  # fmt: skip
    assert time.perf_counter() - start >= 0.02 and runner.graph_steps == 1
    assert ids.tolist() == [0, 0, 0]
    assert [runner.cached_length(r) for r in "abc"] == [4, 3, 1]
    runner.graph_step(["a"], torch.zeros(1, 3, dtype=torch.long))  # 3 tokens: no graph of 3
    assert runner.eager_steps == 1 and runner.cached_length("a") == 7
    with pytest.raises(InvalidInputError, match="token ids"):
        runner.ragged_step(["a"], [[300]])
    assert runner.cached_length("a") == 7  # a refused step changes nothing


def test_served_stand_in_drafts_ahead_and_greedy_output_is_the_targets(
    checkpoints: tuple[Path, Path], reference: ModelRunner, times_file: Path
) -> None:
    target_dir, draft_dir = checkpoints
    draft = with_ahead(model_draft(draft_dir), 2)
    assert draft.runner is not None
    runner = replace(draft.runner, cuda_graph_batch_sizes=SIZES)
    draft = replace(draft, runner=runner, synthetic_hit_rate=1.0, stand_in=str(times_file))
    prompts = _prompts(2)
    with services(target_dir, draft, sampler_impl="torch") as svc:
        assert isinstance(svc.draft_engine.runner, StandInRunner)
        pipe = svc.pipeline()
        greedy = SamplingParams(temperature=0.0)
        for i, prompt in enumerate(prompts):
            pipe.admit(f"r{i}", prompt, greedy)
        pipe.generate({"r0": 3, "r1": 3}, 12)
        for i, prompt in enumerate(prompts):
            assert pipe.requests[f"r{i}"].generated[:12] == greedy_reference(reference, prompt, 12)
        engine = svc.draft_engine
        assert engine.ahead_hits > 0 and engine.runner.graph_steps > 0
        with pytest.raises(Exception, match="greedy requests only"):
            pipe.admit("sampled", prompts[0], SamplingParams(temperature=0.8, seed=1))
        pipe.close()


def test_the_orchestrator_starts_the_stand_in_in_place_of_the_draft(
    checkpoints: tuple[Path, Path], times_file: Path, tmp_path: Path
) -> None:
    """`specdec serve --draft-stand-in`'s actor path (orchestrator.launch.services), in process: the
    draft service runs the stand-in on the CPU, emulating the graphs of the served sizes."""
    from orchestrator.config import ServiceConfig
    from orchestrator.launch.services import start_service

    target_dir, draft_dir = checkpoints
    data = json.loads(times_file.read_text())
    data["info"]["architecture"] = "MarkedByTheTimesFile"  # the model's would say Llama
    marked = tmp_path / "times.json"
    marked.write_text(json.dumps(data))
    config = ServiceConfig(
        str(target_dir), str(draft_dir), device="cpu", max_requests=8, max_seq_len=128,
        cuda_graph_batch_sizes=SIZES, synthetic_acceptance_length=2.0,
        synthetic_num_draft_tokens=3, draft_stand_in=marked,
    )  # fmt: skip
    server, info = start_service("draft", config, "127.0.0.1")
    try:
        assert info.architecture == "MarkedByTheTimesFile" and info.max_requests == 8
    finally:
        server.stop(0)


def test_with_synthetic_acceptance_every_catch_up_fits_a_graph(
    checkpoints: tuple[Path, Path], times_file: Path
) -> None:
    """The benchmark's set-up: synthetic acceptance accepts the stand-in's drafts, and a
    synthetic hit's chain assumed another verdict token. Its KV counts as holding the committed
    tokens, as a real hit's does, so no catch-up outgrows the graphs: an eager prefill of up to
    k + 1 tokens each step would time work a real hit never does."""
    from bench.local import local_pair
    from target_service.config import TargetConfig
    from target_service.synthetic import SyntheticAcceptance

    target_dir, draft_dir = checkpoints
    draft = with_ahead(model_draft(draft_dir), 2)
    assert draft.runner is not None
    runner = replace(draft.runner, cuda_graph_batch_sizes=SIZES)
    draft = replace(draft, runner=runner, synthetic_hit_rate=0.5, stand_in=str(times_file))
    synthetic = SyntheticAcceptance(4, mean_acceptance_length=3.0)
    target = TargetConfig(runner_config(target_dir), sampler_impl="torch", synthetic=synthetic)
    with local_pair(draft, target) as svc:
        pipe = svc.pipeline()
        # 4 requests for 100 tokens: past 16 verdicts the passes draft only the counts that come
        # true (always 2 here) and stop forwarding d_k for the all-accepted one, which had
        # also re-labelled the KV; that is where a synthetic hit's catch-up grew long
        ids = [f"r{i}" for i in range(4)]
        for rid, prompt in zip(ids, _prompts(4), strict=True):
            pipe.admit(rid, prompt, SamplingParams(temperature=0.0))
        admitted = svc.draft_engine.runner.forwards
        pipe.generate(dict.fromkeys(ids, 4), 100)
        engine = svc.draft_engine
        # a miss after a hit drafts from the verdict: the catch-up that showed the bug
        assert engine.ahead_hits > 0 and engine.ahead_misses > 0 and engine.runner.graph_steps
        assert engine.runner.forwards == admitted and engine.runner.eager_steps == 0
        pipe.close()
