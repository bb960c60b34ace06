"""Training and measuring the demo pair on CPU (see `models`, which caches the result).

Everything here imports torch, transformers and tokenizers inside functions, so that
`import orchestrator` stays torch-free.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.demo.budget import DemoBudget, DemoPair, LlamaShape

if TYPE_CHECKING:
    import torch

EOS = "<|endoftext|>"


def read_sources(files: Sequence[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str], vocab_size: int, progress: bool) -> Any:
    """A byte-level BPE (every byte is an id, so any text round-trips) with one EOS id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, clean_up_tokenization_spaces=False
    )


def encode_corpus(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """All texts as one stream of ids [n], each file followed by EOS."""
    import torch

    eos = int(tokenizer.eos_token_id)
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def llama(shape: LlamaShape, budget: DemoBudget, eos_id: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=budget.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=budget.seq_len,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    config.architectures = ["LlamaForCausalLM"]  # the runner's fast path reads it
    torch.manual_seed(budget.seed)
    return LlamaForCausalLM(config)


@dataclass(frozen=True, slots=True)
class PhaseStats:
    steps: int
    seconds: float
    tokens_per_s: float
    final_loss: float  # mean of the last 20 steps' training losses


def train_phase(
    model: Any,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    batches: Callable[[], torch.Tensor],
    budget: DemoBudget,
    max_steps: int,
    desc: str,
    progress: bool,
    device: str = "cpu",
) -> PhaseStats:
    """`max_steps` of AdamW with warm-up and cosine decay; the time they took is recorded. On
    a GPU (`device` "cuda"), the forwards run under bfloat16 autocast."""
    import contextlib

    import torch
    from tqdm import tqdm

    def autocast() -> Any:
        if device.startswith("cuda"):
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    opt = torch.optim.AdamW(model.parameters(), lr=budget.lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    losses: list[float] = []
    start, step, tokens = time.perf_counter(), 0, 0
    bar = tqdm(total=max_steps, desc=desc, disable=not progress, unit="step", mininterval=0.5)
    while step < max_steps:
        for group in opt.param_groups:
            group["lr"] = budget.lr * _schedule(step / max_steps)
        batch = batches().to(device)  # [batch, seq_len + 1]
        with autocast():
            loss = loss_of(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step, tokens = step + 1, tokens + batch[:, 1:].numel()
        losses.append(float(loss.detach()))
        elapsed = time.perf_counter() - start
        bar.update()
        bar.set_postfix(
            loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", tok_s=f"{tokens / elapsed:.0f}"
        )
    bar.close()
    model.eval()
    seconds = time.perf_counter() - start
    tail = losses[-20:] or [math.nan]
    return PhaseStats(step, seconds, tokens / seconds, sum(tail) / len(tail))


def _schedule(done: float) -> float:
    warm = 0.05
    if done < warm:
        return done / warm
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (done - warm) / (1 - warm)))


def batch_sampler(data: torch.Tensor, budget: DemoBudget, seed: int) -> Callable[[], torch.Tensor]:
    """Random windows [batch, seq_len + 1] of the token stream, reproducible from `seed`."""
    import torch

    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(budget.seq_len + 1)

    def sample() -> torch.Tensor:
        starts = torch.randint(
            0, data.numel() - budget.seq_len - 1, (budget.batch_size, 1), generator=g
        )
        return data[starts + offsets]

    return sample


def lm_loss(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    import torch.nn.functional as F

    def loss(batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1]).logits  # [batch, seq_len, vocab]
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    return loss


def distill_loss(draft: Any, target: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """Forward KL(target || draft) per position: the draft learns the target's whole
    next-token distribution, not only the text's next token."""
    import torch
    import torch.nn.functional as F

    def loss(batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher = F.log_softmax(target(batch[:, :-1]).logits, dim=-1)  # [b, t, vocab]
        student = F.log_softmax(draft(batch[:, :-1]).logits, dim=-1)  # [b, t, vocab]
        return F.kl_div(
            student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction="batchmean"
        )

    return loss


def train_pair(
    out: Path, budget: DemoBudget, files: Sequence[Path], progress: bool, device: str = "cpu"
) -> dict[str, Any]:
    """Tokenizer, target, then draft, trained on `files` on `device`, saved under `out`
    (target/, draft/) in float32."""
    t0 = time.perf_counter()
    texts = read_sources(files)
    tokenizer = train_tokenizer(texts, budget.vocab_size, progress)
    data = encode_corpus(tokenizer, texts)
    stats: dict[str, Any] = {
        "tokenizer_seconds": time.perf_counter() - t0,
        "train_tokens": data.numel(),
    }
    eos = int(tokenizer.eos_token_id)
    target = llama(budget.target, budget, eos).to(device)
    phase = train_phase(
        target, lm_loss(target), batch_sampler(data, budget, budget.seed), budget,
        budget.target_steps, "target", progress, device,
    )  # fmt: skip
    stats["target"] = asdict(phase) | {"parameters": target.num_parameters()}
    # random init: starting from the target's embeddings, head and first layer measured worse
    # (held-out mean acceptance length 3.44 against 3.75 after 400 steps)
    draft = llama(budget.draft, budget, eos).to(device)
    phase = train_phase(
        draft, distill_loss(draft, target), batch_sampler(data, budget, budget.seed + 1), budget,
        budget.draft_steps, "draft (distilled)", progress, device,
    )  # fmt: skip
    stats["draft"] = asdict(phase) | {"parameters": draft.num_parameters()}
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per tiny file is noise
    for name, model in (("target", target), ("draft", draft)):
        model.to("cpu").save_pretrained(str(out / name), safe_serialization=True)
        tokenizer.save_pretrained(str(out / name))
    stats["total_seconds"] = time.perf_counter() - t0
    return stats


def heldout_prompts(
    files: Sequence[Path], heldout: Callable[[Path], bool], count: int, chars: int = 160
) -> list[str]:
    """Prompts from held-out source files: up to `chars` characters from a line that begins a
    `def` or `class`, cut back to a line end (before its newline, which the tokenizer merges
    with the next line's indentation)."""
    prompts: list[str] = []
    for text in read_sources([f for f in files if heldout(f)]):
        for start in _definition_starts(text)[1::7]:
            piece = text[start : start + chars]
            prompts.append(piece[: piece.rfind("\n")] or piece)
            if len(prompts) == count:
                return prompts
    return prompts


def _definition_starts(text: str) -> list[int]:
    starts, pos = [], 0
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith(("def ", "class ")):
            starts.append(pos)
        pos += len(line)
    return starts


@dataclass(frozen=True, slots=True)
class AcceptanceReport:
    k: int
    prompts: int
    verify_steps: int
    committed_tokens: int
    mean_acceptance_length: float  # committed tokens per verify step: accepted drafts + 1
    acceptance_rate: float  # accepted / drafted tokens
    sample: str  # the first prompt and the target's greedy continuation


def measure_acceptance(
    pair: DemoPair, prompts: Sequence[str], k: int = 4, new_tokens: int = 64
) -> AcceptanceReport:
    """Greedy speculative decoding, replayed: the target continues each prompt greedily, and
    each verify step commits the draft's leading greedy proposals that equal the target's
    tokens, plus one. While its proposals match, the draft's context is the target's own text,
    so one draft pass over that text gives every proposal (`replay`)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(pair.target))
    target = LlamaForCausalLM.from_pretrained(str(pair.target)).eval()
    draft = LlamaForCausalLM.from_pretrained(str(pair.draft)).eval()
    steps = accepted = 0
    samples = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, p]
        with torch.no_grad():
            seq = target.generate(
                ids,
                max_new_tokens=new_tokens + k,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )[0]  # [n]
            guess = draft(seq[None]).logits[0].argmax(-1)  # [n]: the guess for token i + 1
        right = [False, *(guess[:-1] == seq[1:]).tolist()]
        end = min(ids.shape[1] + new_tokens, seq.numel())
        s, a = replay(right, ids.shape[1], end, k)
        steps, accepted = steps + s, accepted + a
        samples.append(str(tokenizer.decode(seq)))
    return AcceptanceReport(
        k, len(prompts), steps, steps + accepted, 1 + accepted / max(steps, 1),
        accepted / max(k * steps, 1), samples[0] if samples else "",
    )  # fmt: skip


def replay(right: Sequence[bool], start: int, end: int, k: int) -> tuple[int, int]:
    """(verify steps, accepted draft tokens) to commit tokens start..end-1 greedily, where
    right[j] says whether the draft's greedy guess for token j, from the tokens before it, is
    token j. A step at position p accepts the leading run of right[p], right[p + 1], ... (at
    most k, and one token short of the end of `right`: the step's own token is the target's).

    right = [_, T, T, F, T, T, T, T, T, T], start 1, end 9, k 4: the step at 1 accepts 2 and
    commits 3 tokens; the step at 4 accepts 4 (k) and commits 5; (2 steps, 6 accepted)."""
    steps = accepted = 0
    pos = start
    while pos < end:
        run = 0
        while run < k and pos + run < len(right) - 1 and right[pos + run]:
            run += 1
        steps, accepted, pos = steps + 1, accepted + run, pos + run + 1
    return steps, accepted
