"""python -m specdec.demo: tiny draft and target models, both services on loopback, a few
requests driven through the draft → target loop over real gRPC (nothing is downloaded).

The target is a random 2-layer Llama; the draft is the same weights plus noise, so drafts are
accepted often but not always. Prints tokens/s and acceptance per q form.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Literal

import torch

from draft_service.config import DraftConfig
from draft_service.server import start as start_draft
from specdec.runner import RunnerConfig
from specdec.sampling_params import SamplingParams
from specdec.serving.client import make_channel
from specdec.serving.pipeline import Pipeline
from target_service.config import TargetConfig
from target_service.server import start as start_target

VOCAB = 512


def _tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0} | {f"w{i}": i for i in range(1, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def build_models(root: Path, noise: float) -> tuple[Path, Path]:
    """Saves (target, draft) checkpoints with one shared tokenizer under `root`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    paths = []
    for name, scale in (("target", 0.0), ("draft", noise)):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(scale * torch.randn_like(p) * p.abs().mean())
        model.save_pretrained(str(root / name))
        _tokenizer().save_pretrained(str(root / name))
        paths.append(root / name)
    return paths[0], paths[1]


def run(q_form: Literal["dense", "sparse"], root: Path, args: argparse.Namespace) -> None:
    target_dir, draft_dir = root / "target", root / "draft"
    rc = dict(max_slots=args.requests, max_seq_len=256)
    draft, _ = start_draft(
        DraftConfig(
            runner=RunnerConfig(str(draft_dir), **rc),  # type: ignore[arg-type]
            q_form=q_form,
            support_size=args.support,
        )
    )
    target, _ = start_target(
        TargetConfig(
            RunnerConfig(str(target_dir), **rc),  # type: ignore[arg-type]
            draft_address=f"127.0.0.1:{draft.port}",
        )
    )
    try:
        pipe = Pipeline(
            make_channel(f"127.0.0.1:{draft.port}"), make_channel(f"127.0.0.1:{target.port}")
        )
        gen = torch.Generator().manual_seed(1)
        for i in range(args.requests):
            prompt = torch.randint(1, VOCAB, (8,), generator=gen).tolist()
            temperature = 0.0 if i % 2 else 0.8
            pipe.admit(f"r{i}", prompt, SamplingParams(temperature, top_p=0.95, seed=i))
        start = time.perf_counter()
        pipe.generate({f"r{i}": args.k for i in range(args.requests)}, args.tokens)
        elapsed = time.perf_counter() - start
        seqs = pipe.requests.values()
        produced = sum(len(s.generated) for s in seqs)
        drafted = sum(s.num_draft_tokens for s in seqs)
        accepted = sum(s.num_accepted for s in seqs)
        steps = sum(s.next_step for s in seqs)  # verify steps, summed over requests
        print(
            f"q {q_form:6s}: {produced} tokens in {elapsed:.2f} s = {produced / elapsed:.0f} "
            f"tokens/s; acceptance {accepted}/{drafted} = "
            f"{accepted / max(drafted, 1):.2f}, mean acceptance length "
            f"{produced / max(steps, 1):.2f} tokens per verify step"
        )
        first = pipe.requests["r0"]
        print(f"  r0 (sampled): {first.generated[:16]} ...")
        pipe.close()
    finally:
        target.stop(0)
        draft.stop(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specdec.demo", description=__doc__)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per request")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step")
    parser.add_argument("--support", type=int, default=32, help="sparse q support size")
    parser.add_argument("--noise", type=float, default=0.03, help="draft = target + noise")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_models(root, args.noise)
        print(f"built tiny target and draft models in {root}; half the requests greedy")
        run("sparse", root, args)
        run("dense", root, args)


if __name__ == "__main__":
    main()
