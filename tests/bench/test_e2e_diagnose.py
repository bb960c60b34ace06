"""The greedy check's diagnosis (`bench.e2e_inprocess.diagnose`): both runs are replayed as
they ran (target-only's one-token steps, speculation's verify steps with its own step
boundaries), and a divergence is numerics only when each replay gives its own run's token."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bench import e2e_models
from bench.e2e_bench import greedy_passed
from bench.e2e_driver import prompts
from bench.e2e_inprocess import _load, diagnose, replay, verdict
from bench.e2e_report import _greedy


def test_verdict_is_numerics_only_when_both_rows_give_their_own_run_token() -> None:
    a = torch.tensor([0.0, 2.0, 1.99, -1.0], dtype=torch.float64)  # target-only picks 1
    b = torch.tensor([0.0, 1.98, 1.99, -1.0], dtype=torch.float64)  # the verify picks 2
    d = verdict(a, b, plain=1, spec=2)
    assert d["numerics"] and d["one_token_reproduces_target_only"]
    assert d["verify_reproduces_speculative"] and (d["argmax_one_token"], d["argmax_verify"]) == (
        1,
        2,
    )
    assert d["noise"] == pytest.approx(0.02) and d["gap"] == pytest.approx(0.01)
    assert d["gap_in_std"] == pytest.approx(0.01 / float(a.std()))
    assert d["logits_verify"] == {"target_only_token": 1.98, "speculative_token": 1.99}
    # the verify row did not flip: the speculative token is not what its shape computes
    d = verdict(a, a.clone(), plain=1, spec=2)
    assert not d["numerics"] and not d["verify_reproduces_speculative"] and d["noise"] == 0
    # target-only's token is not what a one-token step computes
    d = verdict(b, b.clone(), plain=1, spec=2)
    assert not d["numerics"] and not d["one_token_reproduces_target_only"]
    # an exact tie at the maximum: greedy may take either token
    tie = torch.tensor([0.0, 2.0, 2.0], dtype=torch.float64)
    assert verdict(tie, tie.clone(), plain=1, spec=2)["numerics"]


def _result(smoke: bool, numerics: bool | None) -> dict:
    d = {"request": 3, "position": 5, "noise_in_std": 0.01, "gap_in_std": 0.02,
         "numerics": bool(numerics), "one_token_reproduces_target_only": True,
         "verify_reproduces_speculative": bool(numerics)}  # fmt: skip
    diagnosis = None if numerics is None else {"divergences": [d], "numerics": numerics}
    greedy = {"passed": False, "batch": 8, "new_tokens": 16, "num_draft_tokens": 4,
              "divergences": [d]}  # fmt: skip
    return {"settings": {"smoke": smoke}, "greedy_check": greedy, "greedy_diagnosis": diagnosis}


def test_greedy_verdict_and_its_report() -> None:
    gpu = _result(smoke=False, numerics=True)
    assert greedy_passed(gpu)
    text = _greedy(gpu)
    assert "1 of 8 requests diverged; each divergence reproduced" in text
    assert "up to 0.0100 row stds, token gap up to 0.0200" in text and "passed (numerics)" in text
    smoke = _result(smoke=True, numerics=True)  # float32 on the CPU: exact equality only
    assert not greedy_passed(smoke) and "FAILED (--smoke requires identical tokens)" in _greedy(
        smoke
    )
    wrong = _result(smoke=False, numerics=False)
    assert not greedy_passed(wrong)
    assert "request 3 at token 5: verify replay not the speculative token" in _greedy(wrong)
    assert _greedy(wrong).endswith("FAILED.")
    assert not greedy_passed(_result(smoke=False, numerics=None))
    passed = _result(smoke=True, numerics=None)
    passed["greedy_check"]["passed"] = True
    assert greedy_passed(passed) and "identical tokens (passed)" in _greedy(passed)


def test_diagnose_replays_each_run_on_a_tiny_model(tmp_path: Path) -> None:
    path = e2e_models.build(tmp_path, True, "cpu")["target"]
    vocab = e2e_models.plan(True)["target"][2]["vocab_size"]
    batch, new, k = 3, 7, 4
    ps = prompts(batch, 5, vocab, 1)
    # transformers' own model, greedy on whole sequences, is the reference for both replays
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    made, rows = [], []
    with torch.no_grad():
        for p in ps:
            ids = list(p)
            for _ in range(new):
                rows.append(model(torch.tensor([ids])).logits[0, -1].double())
                ids.append(int(rows[-1].argmax()))
            made.append(ids[len(p) :])
    # speculation with uneven step boundaries (float32: the same tokens); request 2 stops early
    steps = [[2, 1, 3, 1], [1, 1, 1, 4], [5, 3]]
    plain_0, spec_1 = made[0][3], made[1][4]
    divergences = [
        {"request": 0, "position": 3, "target_only_token": plain_0,
         "speculative_token": (plain_0 + 1) % vocab},
        {"request": 1, "position": 4, "target_only_token": (spec_1 + 1) % vocab,
         "speculative_token": spec_1},
        {"request": 2, "position": 6, "target_only_token": made[2][6],
         "speculative_token": made[2][6]},
    ]  # fmt: skip
    job = {"path": path, "device": "cpu", "dtype": "float32", "max_slots": batch,
           "max_seq_len": 64, "graph_sizes": [1, 2, 4], "num_draft_tokens": k, "prompts": ps,
           "target_only": made, "speculative": made, "speculative_steps": steps,
           "divergences": divergences}  # fmt: skip
    out = diagnose(job)
    d0, d1, d2 = out["divergences"]
    assert not out["numerics"]
    # target-only's token reproduced by one-token steps, not the made-up speculative one
    assert d0["one_token_reproduces_target_only"] and not d0["verify_reproduces_speculative"]
    assert not d1["one_token_reproduces_target_only"] and d1["verify_reproduces_speculative"]
    assert d2["numerics"] and d2["gap"] == 0  # the same token both ways: both reproduce it
    for d in out["divergences"]:
        reference = rows[d["request"] * new + d["position"]]
        a, b = d["logits_one_token"], d["logits_verify"]
        for logits in (a, b):
            for key in ("target_only_token", "speculative_token"):
                assert logits[key] == pytest.approx(float(reference[d[key]]), abs=1e-4)
        assert d["noise_in_std"] < 1e-4  # float32 on the CPU: the two shapes barely differ
        assert d["argmax_one_token"] == d["argmax_verify"] == int(reference.argmax())


def test_replay_takes_the_row_of_the_step_that_scored_the_position(tmp_path: Path) -> None:
    path = e2e_models.build(tmp_path, True, "cpu")["target"]
    runner = _load(path, "cpu", "float32", 2, 64, [])
    ps = [[5, 6, 7], [8, 9]]
    tokens = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    whole = replay(runner, ps, tokens, [[5], [5]], 5, {0: 4, 1: 0})
    split = replay(runner, ps, tokens, [[1, 3, 1], [2, 3]], 5, {0: 4, 1: 0})
    for i in (0, 1):
        torch.testing.assert_close(whole[i], split[i], atol=1e-4, rtol=0)
    # a position the run never reached is not there
    assert replay(runner, ps, tokens, [[1], [1]], 5, {0: 2}) == {}
