"""Triton rejection-sampling kernels and their pure-torch reference.

Speculative sampling (Leviathan et al. 2022, arXiv:2211.17192; Chen et al. 2023). For request b
with k draft tokens x_0..x_{k-1}, q the draft distribution each was sampled from and p the
target distribution (after temperature, top-k, top-p) at each of the k + 1 scored positions:

- **accepted** token: x_j is kept with probability min(1, p_j(x_j) / q_j(x_j)), tested as
  u * q < p with u ~ U[0, 1) from stream ACCEPT at the token's absolute position;
- **recovered** token: at the first rejection f, one token from max(0, p_f - q_f) (normalised),
  drawn by an exponential race argmax_j r_j / E_j with E_j ~ Exp(1) from stream RECOVER;
- **bonus** token: if all k are accepted, one token from p_k, argmax_j p_j / E_j, stream BONUS;
- **placeholder** (-1): fills the output row after the committed tokens.

Greedy requests (temperature 0) accept while x_j == argmax p_j and emit argmax p_f. With no q
(n-gram or greedy drafts) q is one-hot at x_j. Every random number is Philox keyed by (seed,
absolute position, stream[, vocabulary index]) (`specdec.rng`), never the batch slot.

Two launches, so a big vocabulary is split across many programs:
1. `_row_stats_kernel` [rows, stats splits]: per vocabulary split of each scored row, the
   online softmax max/sum of the tempered, thresholded logits (sampled rows) or the raw argmax
   (greedy rows) and non-finite counts: the only full read of the logits.
2. `_decide_sample_kernel` [requests, race splits]: combines the row partials, runs all k
   acceptance tests at once (they need q only at the draft tokens), finds the first rejection
   f, and races over its split of row f (the second read of one logits row per request: the
   residual needs p normalised over the row). For dense q the same programs read all k q rows
   of the request, the only full read of q: the sums and invalid entries that validate them,
   and row f's q for the residual. The stats pass is bound by memory bandwidth and the race by
   latency, so q's bytes go where there is bandwidth to spare (the stats pass used to read q:
   134.8 µs at batch 64, k 4, V 128256 on an H200; see BENCHMARKS.md). The last of a
   request's programs to finish (a per-request counter) combines the race partials and the
   q-row partials, settles the status and writes the outputs (`_finalize`): a third launch
   cost more than its work.

Example, k = [2, 0, 1]: logits rows [a0 a1 a2 | b0 | c0 c1]; if a rejects at position 1 and c
accepts, the output is [[a0', r_a, -1], [bonus_b, -1, -1], [c0', bonus_c, -1]] with
num_committed [2, 1, 2] (x' a draft token, r a recovered token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specdec import rng
from specdec.gdc import gdc_launch_dependents, gdc_wait, launch_options, pdl_enabled
from specdec.serving.messages import QForm

PLACEHOLDER = -1
Q_NONE, Q_DENSE, Q_SPARSE = int(QForm.NONE), int(QForm.DENSE), int(QForm.SPARSE)
Q_SUM_TOLERANCE = 1e-4
SPARSE_PAD_ID = 2**31 - 1  # padding id after sorting a sparse support (sorts last)
# the sparse support width the race kernel is compiled for at least (a power of two): one
# compile serves every support up to the draft's default support_size (32)
MIN_SUPPORT_P2 = 32

# Status codes; target_service.rejection_sampler.SampleStatus names them.
OK, NONFINITE_LOGITS, INVALID_DRAFT_PROBS, DRAFT_PROBS_NOT_NORMALIZED = 0, 1, 2, 3
DRAFT_TOKEN_OUT_OF_SUPPORT, TOKEN_OUT_OF_VOCAB = 4, 5


@dataclass(slots=True)
class KernelInputs:
    """The sampler's inputs after validation and preparation (see rejection_sampler.py).

    Rows: request b owns rows row_start[b] .. row_start[b] + k[b] of `logits` (k drafts + 1).
    """

    logits: torch.Tensor  # [R, >= vocab] float32 | bf16 | fp16
    thresholds: torch.Tensor  # [R] float32, -inf = keep all
    row_req: torch.Tensor  # [R] int32, owning request
    row_draft: torch.Tensor  # [R] int32, draft-token index of the row, -1 for the last row
    num_draft: torch.Tensor  # [B] int32, k_b
    row_start: torch.Tensor  # [B] int32
    draft_start: torch.Tensor  # [B] int32
    draft_ids: torch.Tensor  # [T] int32
    inv_temperature: torch.Tensor  # [B] float32, 1/T (1 for greedy)
    greedy: torch.Tensor  # [B] int32, 1 if temperature == 0
    seed: torch.Tensor  # [B] int64
    position: torch.Tensor  # [B] int64, absolute position of the first draft token
    status_in: torch.Tensor  # [B] int32, errors found before the kernels (sparse q checks)
    q_mode: int  # Q_NONE | Q_DENSE | Q_SPARSE
    q_probs: torch.Tensor | None  # dense [T, Vq] or sparse [T, S] float32, sparse sorted by id
    q_ids: torch.Tensor | None  # sparse [T, S] int32 sorted, padding SPARSE_PAD_ID
    # [B * W] float32 conditional acceptance rates, request-major: W = len // B >= max_k
    synthetic_rates: torch.Tensor | None
    vocab_size: int  # ids >= vocab_size are padding: probability 0, never emitted
    max_k: int

    @property
    def q_vocab(self) -> int:
        return self.q_probs.shape[1] if self.q_mode == Q_DENSE and self.q_probs is not None else 0


@dataclass(slots=True)
class KernelOutputs:
    token_ids: torch.Tensor  # [B, max_k + 1] int32, PLACEHOLDER padded
    num_committed: torch.Tensor  # [B] int32, 0 on error
    accepted: torch.Tensor  # [B, max_k] bool, position j accepted (j < first rejection)
    status: torch.Tensor  # [B] int32


@triton.jit
def _philox4(seed, c0, c1, c2):
    """Philox-4x32-10's four words; seed int64, counters uint32 (`specdec.rng.philox4`)."""
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c3 = tl.zeros_like(c0)
    for _ in tl.static_range(10):
        a, b = c0, c2
        c0 = tl.umulhi(b, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(a, 0xD2511F53) ^ c3 ^ k1
        c1 = b * 0xCD9E8D57
        c3 = a * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _philox(seed, c0, c1, c2):
    return _philox4(seed, c0, c1, c2)[0]


@triton.jit
def _vocab_bits(seed, off, pos, stream, BLOCK: tl.constexpr):
    """Random words for ids off .. off + BLOCK (off a multiple of 4): id v takes word v % 4 of
    counter v // 4, one Philox call per four ids (`specdec.rng.vocab_bits`)."""
    quads = (off // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)
    w0, w1, w2, w3 = _philox4(seed, quads, pos, stream)
    # join adds a trailing axis: [q, j, i] = (w0, w2)[j] if i == 0 else (w1, w3)[j]
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK,))


@triton.jit
def _uniform(bits):
    return (bits >> 8).to(tl.float32) * (1.0 / 16777216.0)


# Arguments that vary from block to block are not specialised on: Triton specialises an int on
# == 1 and on divisibility by 16, and a pointer on 16-byte alignment (the small per-request
# inputs are views into one upload, at offsets that follow the batch). Each specialisation is
# one more compile, of about a second on an H200, in the middle of serving the first block that
# needs it. The vocabulary-wide rows (logits, dense q, the split partials) keep theirs.
@triton.jit(
    do_not_specialize=["B"],
    do_not_specialize_on_alignment=["thr_ptr", "row_req_ptr", "inv_temp_ptr", "greedy_ptr",
                                    "done_ptr"],
)  # fmt: skip
def _row_stats_kernel(
    logits_ptr,  # [R, >= V] float32 | bf16 | fp16
    logits_stride,
    thr_ptr,  # [R] float32
    row_req_ptr,  # [R] int32
    inv_temp_ptr,  # [B] float32
    greedy_ptr,  # [B] int32
    part_max_ptr,  # [R, NUM_SPLITS] float32
    part_sum_ptr,  # [R, NUM_SPLITS] float32
    part_amax_val_ptr,  # [R, NUM_SPLITS] float32
    part_amax_idx_ptr,  # [R, NUM_SPLITS] int32
    part_bad_ptr,  # [R, NUM_SPLITS] int32: non-finite logits
    done_ptr,  # [B] int32 out: zeroed here for _decide_sample_kernel's per-request counters
    V,
    B,
    split_size,
    NUM_SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # _decide_sample_kernel may start its input-only prologue as this grid drains
        gdc_launch_dependents()
    row = tl.program_id(0)
    split = tl.program_id(1)
    if (row == 0) & (split == 0):
        for i in range(0, B, BLOCK):
            tl.store(done_ptr + i + tl.arange(0, BLOCK), 0, mask=i + tl.arange(0, BLOCK) < B)
    start = split * split_size
    end = tl.minimum(start + split_size, V)
    thr = tl.load(thr_ptr + row)
    req = tl.load(row_req_ptr + row)
    inv_t = tl.load(inv_temp_ptr + req)
    greedy = tl.load(greedy_ptr + req) != 0
    row_ptr = logits_ptr + row.to(tl.int64) * logits_stride
    # Per-lane accumulators, reduced once after the loop: a cross-lane reduction per
    # iteration (max, sum, argmax) cost more than the loads on an H200.
    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_sum = tl.zeros((BLOCK,), tl.float32)
    lane_best = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_best_idx = tl.zeros((BLOCK,), tl.int32)
    lane_bad = tl.zeros((BLOCK,), tl.int32)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < end
        logit = tl.load(row_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        lane_bad += (logit - logit != 0.0).to(tl.int32)  # NaN or +-inf (masked lanes read 0)
        if greedy:  # greedy rows need the raw argmax only, sampled rows the softmax only
            better = mask & (logit > lane_best)
            lane_best_idx = tl.where(better, offs, lane_best_idx)
            lane_best = tl.where(better, logit, lane_best)
        else:
            scaled = tl.where(mask & (logit >= thr), logit * inv_t, float("-inf"))
            # Online softmax, one exp per element: exp(-|scaled - lane_max|) either rescales
            # the running sum (new maximum) or is the new term; 0 whenever one side is -inf.
            new_max = tl.maximum(lane_max, scaled)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            e = tl.exp(tl.minimum(lane_max, scaled) - safe)
            lane_sum = tl.where(scaled > lane_max, lane_sum * e + 1.0, lane_sum + e)
            lane_max = new_max
    run_max = tl.max(lane_max, 0)
    safe_max = tl.where(run_max == float("-inf"), 0.0, run_max)
    run_sum = tl.sum(lane_sum * tl.exp(lane_max - safe_max), 0)
    best = tl.max(lane_best, 0)
    best_idx = tl.min(tl.where(lane_best == best, lane_best_idx, 2147483647), 0)
    bad = tl.sum(lane_bad, 0)
    out = row * NUM_SPLITS + split
    tl.store(part_max_ptr + out, run_max)
    tl.store(part_sum_ptr + out, run_sum)
    tl.store(part_amax_val_ptr + out, best)
    tl.store(part_amax_idx_ptr + out, best_idx)
    tl.store(part_bad_ptr + out, bad)


@triton.jit
def _row_argmax(part_amax_val_ptr, part_amax_idx_ptr, row, n_splits, NUM_SPLITS: tl.constexpr):
    """First index of the row's largest raw logit (ties go to the lowest id, as torch.argmax)."""
    cols = tl.arange(0, NUM_SPLITS)
    splits = row * NUM_SPLITS + cols
    vals = tl.load(part_amax_val_ptr + splits, mask=cols < n_splits, other=float("-inf"))
    idx = tl.load(part_amax_idx_ptr + splits, mask=cols < n_splits, other=2147483647)
    return tl.min(tl.where(vals == tl.max(vals, 0), idx, 2147483647), 0)


@triton.jit(
    do_not_specialize=["Vq", "S", "n_splits", "n_race", "max_k", "rates_width"],
    do_not_specialize_on_alignment=[
        "thr_ptr", "num_draft_ptr", "row_start_ptr", "draft_start_ptr", "draft_ids_ptr",
        "inv_temp_ptr", "greedy_ptr", "seed_ptr", "position_ptr", "status_in_ptr", "rates_ptr",
        "q_ids_ptr", "done_ptr",
    ],
)  # fmt: skip
def _decide_sample_kernel(
    logits_ptr,  # [R, >= V]
    logits_stride,
    thr_ptr,  # [R] float32
    num_draft_ptr,  # [B] int32
    row_start_ptr,  # [B] int32
    draft_start_ptr,  # [B] int32
    draft_ids_ptr,  # [T] int32
    inv_temp_ptr,  # [B] float32
    greedy_ptr,  # [B] int32
    seed_ptr,  # [B] int64
    position_ptr,  # [B] int64
    status_in_ptr,  # [B] int32
    rates_ptr,  # [B, rates_width] float32 (SYNTHETIC only)
    q_ptr,  # dense [T, Vq] | sparse [T, S] float32
    q_stride,
    q_ids_ptr,  # sparse [T, S] int32, sorted ascending
    part_max_ptr,  # [R, NUM_SPLITS] (from _row_stats_kernel)
    part_sum_ptr,
    part_amax_val_ptr,
    part_amax_idx_ptr,
    part_bad_ptr,
    done_ptr,  # [B] int32: programs of the request done (zeroed by _row_stats_kernel)
    race_ptr,  # [B, RACE_SPLITS, 4] float32: (best r/E, its id, best p/E, its id)
    part_qsum_ptr,  # [T, RACE_SPLITS] float32 (dense q): split sums of each q row
    part_qmin_ptr,  # [B, RACE_SPLITS] float32 (dense q): split minimum, -1 for NaN/inf
    token_ids_ptr,  # [B, max_k + 1] int32 out
    num_committed_ptr,  # [B] int32 out
    accepted_ptr,  # [B, max_k] int8 out
    status_ptr,  # [B] int32 out
    V,
    Vq,
    S,
    race_split_size,
    n_splits,
    n_race,
    max_k,
    rates_width,  # columns of rates_ptr's rows (SYNTHETIC only)
    q_tolerance,  # Q_SUM_TOLERANCE
    NUM_SPLITS: tl.constexpr,
    RACE_SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    S_P2: tl.constexpr,
    Q_MODE: tl.constexpr,
    SYNTHETIC: tl.constexpr,
    K_P2: tl.constexpr,  # power of two > max_k
    Q_ROWS: tl.constexpr,  # power of two >= max_k (dense q rows read per program)
    PDL: tl.constexpr,  # launched as a programmatic dependent of _row_stats_kernel
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    k = tl.load(num_draft_ptr + b)
    row0 = tl.load(row_start_ptr + b)
    d0 = tl.load(draft_start_ptr + b)
    inv_t = tl.load(inv_temp_ptr + b)
    greedy = tl.load(greedy_ptr + b)
    seed = tl.load(seed_ptr + b)
    pos = tl.load(position_ptr + b)
    # All k + 1 positions at once (one round of dependent loads, not k + 1 rounds): the
    # per-position loop was latency-bound and ran before every race split.
    j = tl.arange(0, K_P2)
    is_row = j <= k
    is_draft = j < k
    rows = row0 + j
    x = tl.load(draft_ids_ptr + d0 + j, mask=is_draft, other=0)
    out_of_vocab = tl.sum((is_draft & ((x < 0) | (x >= V))).to(tl.int32), 0)
    x = tl.minimum(tl.maximum(x, 0), V - 1)
    t = d0 + j
    if Q_MODE == 1:
        q_x = tl.load(q_ptr + t.to(tl.int64) * q_stride + tl.minimum(x, Vq - 1), mask=is_draft)
        q_x = tl.where(x < Vq, q_x, 0.0)
    elif Q_MODE == 2:
        support = tl.arange(0, S_P2)
        entries = t[:, None] * S + support[None, :]
        in_support = is_draft[:, None] & (support < S)[None, :]
        ids = tl.load(q_ids_ptr + entries, mask=in_support, other=-1)
        probs = tl.load(q_ptr + entries, mask=in_support, other=0.0)
        q_x = tl.sum(tl.where(ids == x[:, None], probs, 0.0), 1)
    else:
        q_x = tl.full((K_P2,), 1.0, tl.float32)
    out_of_support = tl.sum((is_draft & (q_x <= 0.0)).to(tl.int32), 0)
    logit = tl.load(logits_ptr + rows.to(tl.int64) * logits_stride + x, mask=is_draft, other=0.0)
    logit = logit.to(tl.float32)
    keep = logit >= tl.load(thr_ptr + rows, mask=is_row, other=0.0)
    zero = tl.zeros((K_P2,), tl.uint32)
    u = _uniform(_philox(seed, zero, (pos + j).to(tl.uint32), zero))
    if PDL:
        # Everything above reads only inputs, so with programmatic dependent launch it runs
        # while the stats kernel finishes; its partials are read from here on.
        gdc_wait()
    cols = tl.arange(0, NUM_SPLITS)
    tile = rows[:, None] * NUM_SPLITS + cols[None, :]
    live = is_row[:, None] & (cols < n_splits)[None, :]
    pmax = tl.load(part_max_ptr + tile, mask=live, other=float("-inf"))
    row_max = tl.max(pmax, 1)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    psum = tl.load(part_sum_ptr + tile, mask=live, other=0.0)
    row_sum = tl.sum(psum * tl.exp(pmax - row_max[:, None]), 1)
    bad = tl.sum(tl.sum(tl.load(part_bad_ptr + tile, mask=live, other=0), 1), 0)
    p_x = tl.where(keep, tl.exp(logit * inv_t - row_max) / row_sum, 0.0)
    if SYNTHETIC:
        accept = u < tl.load(rates_ptr + b * rates_width + j, mask=is_draft, other=0.0)
    else:
        pval = tl.load(part_amax_val_ptr + tile, mask=live, other=float("-inf"))
        pidx = tl.load(part_amax_idx_ptr + tile, mask=live, other=2147483647)
        best = tl.max(pval, 1)
        argmax = tl.min(tl.where(pval == best[:, None], pidx, 2147483647), 1)
        accept = tl.where(greedy != 0, x == argmax, u * q_x < p_x)
    first_reject = tl.min(tl.where(is_draft & (accept == 0), j, k), 0)
    status = tl.load(status_in_ptr + b)
    status = tl.where((status == 0) & (out_of_vocab > 0), 5, status)
    status = tl.where((status == 0) & (bad > 0), 1, status)
    race = (status == 0) & (out_of_support == 0) & (greedy == 0)
    at_f = j == first_reject
    f_max = tl.sum(tl.where(at_f, row_max, 0.0), 0)
    f_sum = tl.sum(tl.where(at_f, row_sum, 0.0), 0)
    if Q_MODE == 1:
        # every q row is checked unless an earlier error already decides the status
        if race:
            _dense_q_pass(logits_ptr, logits_stride, thr_ptr, q_ptr, q_stride, f_max, f_sum,
                          race_ptr, part_qsum_ptr, part_qmin_ptr, b, split, row0, d0, k,
                          first_reject, inv_t, seed, pos, V, Vq, race_split_size, RACE_SPLITS,
                          BLOCK, Q_ROWS, RACE=True)  # fmt: skip
        elif status == 0:
            _dense_q_pass(logits_ptr, logits_stride, thr_ptr, q_ptr, q_stride, f_max, f_sum,
                          race_ptr, part_qsum_ptr, part_qmin_ptr, b, split, row0, d0, k,
                          first_reject, inv_t, seed, pos, V, Vq, race_split_size, RACE_SPLITS,
                          BLOCK, Q_ROWS, RACE=False)  # fmt: skip
    elif race:
        _race(logits_ptr, logits_stride, thr_ptr, draft_ids_ptr, q_ptr, q_ids_ptr,
              f_max, f_sum, race_ptr, b, split, row0 + first_reject,
              d0 + first_reject, first_reject < k, inv_t, seed, pos + first_reject,
              V, S, race_split_size, RACE_SPLITS, BLOCK, S_P2, Q_MODE)  # fmt: skip
    # The request's last program to finish writes its outputs. The barrier and the counter's
    # acquire-release order every program's partials before the last one reads them (the
    # split-K semaphore pattern); those reads bypass L1 (.cg).
    tl.debug_barrier()
    if tl.atomic_add(done_ptr + b, 1, sem="acq_rel", scope="gpu") == n_race - 1:
        _finalize(b, k, d0, row0 + first_reject, first_reject, status, out_of_support, greedy,
                  draft_ids_ptr, race_ptr, part_qsum_ptr, part_qmin_ptr, part_amax_val_ptr,
                  part_amax_idx_ptr, token_ids_ptr, num_committed_ptr, accepted_ptr, status_ptr,
                  max_k, n_splits, n_race, q_tolerance, NUM_SPLITS, RACE_SPLITS, K_P2, Q_ROWS,
                  Q_MODE == 1)  # fmt: skip


@triton.jit
def _race_step(
    logit, mask, offs, off, q, has_draft, thr, inv_t, row_max, row_sum, seed, pos,
    lane_best, lane_idx, lane_best_p, lane_idx_p, BLOCK: tl.constexpr,
):  # fmt: skip
    """One block of the exponential race: residual max(0, p - q)/E (p/E for a bonus) and p/E
    (the fallback if rounding left the residual empty), best of each per lane. E comes from
    stream RECOVER after a rejection, BONUS otherwise."""
    p = tl.where(mask & (logit >= thr), tl.exp(logit * inv_t - row_max) / row_sum, 0.0)
    stream = tl.where(has_draft, 1, 2).to(tl.uint32)
    bits = _vocab_bits(seed, off, pos, stream, BLOCK)
    expo = -tl.log(((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0))  # rng.exponential
    residual = tl.where(has_draft, tl.maximum(p - q, 0.0), p)
    score = tl.where(mask, residual / expo, -1.0)
    better = score > lane_best
    lane_idx = tl.where(better, offs, lane_idx)
    lane_best = tl.where(better, score, lane_best)
    score_p = tl.where(mask, p / expo, -1.0)
    better_p = score_p > lane_best_p
    lane_idx_p = tl.where(better_p, offs, lane_idx_p)
    lane_best_p = tl.where(better_p, score_p, lane_best_p)
    return lane_best, lane_idx, lane_best_p, lane_idx_p


@triton.jit
def _race_lanes(BLOCK: tl.constexpr):
    """Per-lane best residual score and its id, best p score and its id: nothing seen yet."""
    best = tl.full((BLOCK,), -1.0, tl.float32)
    return best, tl.zeros((BLOCK,), tl.int32), best, tl.zeros((BLOCK,), tl.int32)


@triton.jit
def _store_race(race_ptr, b, split, lane_best, lane_idx, lane_best_p, lane_idx_p,
                RACE_SPLITS: tl.constexpr):  # fmt: skip
    best = tl.max(lane_best, 0)
    best_p = tl.max(lane_best_p, 0)
    out = race_ptr + (b * RACE_SPLITS + split) * 4
    # ids < 2**24 travel exactly as float32
    tl.store(out, best)
    tl.store(out + 1, tl.min(tl.where(lane_best == best, lane_idx, 2147483647), 0).to(tl.float32))
    tl.store(out + 2, best_p)
    tl.store(
        out + 3, tl.min(tl.where(lane_best_p == best_p, lane_idx_p, 2147483647), 0).to(tl.float32)
    )


@triton.jit
def _dense_q_pass(
    logits_ptr, logits_stride, thr_ptr, q_ptr, q_stride, row_max, row_sum, race_ptr,
    part_qsum_ptr, part_qmin_ptr, b, split, row0, d0, k, f, inv_t, seed, pos, V, Vq, split_size,
    RACE_SPLITS: tl.constexpr, BLOCK: tl.constexpr, Q_ROWS: tl.constexpr, RACE: tl.constexpr,
):  # fmt: skip
    """Dense q, this split of the vocabulary: all k q rows of request b (split sums and minimum
    for their validation) and, with RACE, the race over row f, whose q comes from the same
    tile."""
    start = split * split_size
    end = tl.minimum(start + split_size, tl.maximum(V, Vq))
    q_end = tl.minimum(end, Vq)
    race_end = tl.minimum(end, V)
    if not RACE:  # the q rows only
        end = q_end
    j = tl.arange(0, Q_ROWS)
    q_rows = q_ptr + (d0 + j).to(tl.int64) * q_stride
    has_draft = f < k
    row = row0 + f
    thr = tl.load(thr_ptr + row)
    pos_f = (pos + f).to(tl.uint32)
    lane_qsum = tl.zeros((Q_ROWS, BLOCK), tl.float32)
    lane_qmin = tl.zeros((BLOCK,), tl.float32)
    lane_best, lane_idx, lane_best_p, lane_idx_p = _race_lanes(BLOCK)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        q_mask = (j < k)[:, None] & (offs < q_end)[None, :]
        q_tile = tl.load(q_rows[:, None] + offs[None, :], mask=q_mask, other=0.0)
        lane_qsum += q_tile
        # NaN and inf count as negative: one minimum flags every invalid entry
        lane_qmin = tl.minimum(lane_qmin, tl.min(tl.where(q_tile - q_tile != 0.0, -1.0, q_tile), 0))
        if RACE:
            mask = offs < race_end
            logit = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + offs, mask=mask)
            q = tl.sum(tl.where(j[:, None] == f, q_tile, 0.0), 0)
            lane_best, lane_idx, lane_best_p, lane_idx_p = _race_step(
                logit.to(tl.float32), mask, offs, off, q, has_draft, thr, inv_t, row_max,
                row_sum, seed, pos_f, lane_best, lane_idx, lane_best_p, lane_idx_p, BLOCK,
            )  # fmt: skip
    tl.store(part_qsum_ptr + (d0 + j) * RACE_SPLITS + split, tl.sum(lane_qsum, 1), mask=j < k)
    tl.store(part_qmin_ptr + b * RACE_SPLITS + split, tl.min(lane_qmin, 0))
    if RACE:
        _store_race(race_ptr, b, split, lane_best, lane_idx, lane_best_p, lane_idx_p, RACE_SPLITS)


@triton.jit
def _race(
    logits_ptr, logits_stride, thr_ptr, draft_ids_ptr, q_ptr, q_ids_ptr,
    row_max, row_sum, race_ptr, b, split, row, t, has_draft, inv_t, seed, pos,
    V, S, split_size,
    RACE_SPLITS: tl.constexpr, BLOCK: tl.constexpr, S_P2: tl.constexpr, Q_MODE: tl.constexpr,
):  # fmt: skip
    """Exponential race over this split of row `row` for sparse q or no q (dense q:
    `_dense_q_pass`)."""
    thr = tl.load(thr_ptr + row)
    t = tl.where(has_draft, t, 0)
    x = tl.where(has_draft, tl.load(draft_ids_ptr + t), -1)
    start = split * split_size
    end = tl.minimum(start + split_size, V)
    cols = tl.arange(0, S_P2)
    sparse_ids = tl.load(
        q_ids_ptr + t * S + cols, mask=cols < tl.where(has_draft, S, 0), other=2147483647
    )
    lane_best, lane_idx, lane_best_p, lane_idx_p = _race_lanes(BLOCK)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < end
        logit = tl.load(logits_ptr + row.to(tl.int64) * logits_stride + offs, mask=mask)
        if Q_MODE == 2:
            q = tl.zeros((BLOCK,), tl.float32)
            lo = tl.sum((sparse_ids < off).to(tl.int32), 0)
            hi = tl.sum((sparse_ids < off + BLOCK).to(tl.int32), 0)
            for i in range(lo, hi):
                q = tl.where(offs == tl.load(q_ids_ptr + t * S + i), tl.load(q_ptr + t * S + i), q)
        else:
            q = tl.where(offs == x, 1.0, 0.0)
        lane_best, lane_idx, lane_best_p, lane_idx_p = _race_step(
            logit.to(tl.float32), mask, offs, off, q, has_draft, thr, inv_t, row_max, row_sum,
            seed, pos.to(tl.uint32), lane_best, lane_idx, lane_best_p, lane_idx_p, BLOCK,
        )  # fmt: skip
    _store_race(race_ptr, b, split, lane_best, lane_idx, lane_best_p, lane_idx_p, RACE_SPLITS)


@triton.jit
def _finalize(
    b, k, d0, target_row, first_reject, status, out_of_support, greedy, draft_ids_ptr, race_ptr,
    part_qsum_ptr, part_qmin_ptr, part_amax_val_ptr, part_amax_idx_ptr, token_ids_ptr,
    num_committed_ptr, accepted_ptr, status_ptr, max_k, n_splits, n_race, q_tolerance,
    NUM_SPLITS: tl.constexpr, RACE_SPLITS: tl.constexpr, COLS: tl.constexpr,
    Q_ROWS: tl.constexpr, DENSE_Q: tl.constexpr,
):  # fmt: skip
    """Request b's outputs from the race partials and, for dense q, the q-row partials that
    settle the status. Dense q: 5 and 1 came first, then 2, 3, 4 here. Sparse q is checked
    before the kernels (`status_in`), so its 2 and 3 come before 5 and 1; the reference
    agrees."""
    if DENSE_Q:  # the q rows were read only where no earlier error had settled the status
        j = tl.arange(0, Q_ROWS)
        cols = tl.arange(0, RACE_SPLITS)
        rows_read = tl.where(status == 0, k, 0)
        tile = (d0 + j)[:, None] * RACE_SPLITS + cols[None, :]
        live = (j < rows_read)[:, None] & (cols < n_race)[None, :]
        qsum = tl.sum(tl.load(part_qsum_ptr + tile, mask=live, other=0.0, cache_modifier=".cg"), 1)
        unnormalized = (j < rows_read) & (tl.abs(qsum - 1.0) > q_tolerance)
        mins = tl.load(
            part_qmin_ptr + b * RACE_SPLITS + cols,
            mask=cols < tl.where(rows_read > 0, n_race, 0),
            other=0.0,
            cache_modifier=".cg",
        )
        status = tl.where((status == 0) & (tl.min(mins, 0) < 0.0), 2, status)
        status = tl.where((status == 0) & (tl.sum(unnormalized.to(tl.int32), 0) > 0), 3, status)
    status = tl.where((status == 0) & (out_of_support > 0), 4, status)
    tl.store(status_ptr + b, status)
    ok = status == 0
    greedy_token = _row_argmax(
        part_amax_val_ptr, part_amax_idx_ptr, target_row, n_splits, NUM_SPLITS
    )
    cols = tl.arange(0, RACE_SPLITS)
    race = race_ptr + (b * RACE_SPLITS + cols) * 4
    # race slots exist only for sampled requests without errors (never read garbage)
    live = cols < tl.where(ok & (greedy == 0), n_race, 0)
    score = tl.load(race, mask=live, other=-1.0, cache_modifier=".cg")
    score_id = tl.load(race + 1, mask=live, other=0.0, cache_modifier=".cg").to(tl.int32)
    score_p = tl.load(race + 2, mask=live, other=-1.0, cache_modifier=".cg")
    score_p_id = tl.load(race + 3, mask=live, other=0.0, cache_modifier=".cg").to(tl.int32)
    best = tl.max(score, 0)
    token = tl.min(tl.where(score == best, score_id, 2147483647), 0)
    token_p = tl.min(tl.where(score_p == tl.max(score_p, 0), score_p_id, 2147483647), 0)
    token = tl.where(best > 0.0, token, token_p)
    token = tl.where(greedy != 0, greedy_token, token)
    cols = tl.arange(0, COLS)
    drafts = tl.load(draft_ids_ptr + d0 + cols, mask=cols < first_reject)
    out = tl.where(cols < first_reject, drafts, tl.where(cols == first_reject, token, -1))
    out = tl.where(ok, out, -1)
    tl.store(token_ids_ptr + b * (max_k + 1) + cols, out, mask=cols <= max_k)
    tl.store(num_committed_ptr + b, tl.where(ok, first_reject + 1, 0))
    accepted = ok & (cols < first_reject) & (cols < k)
    tl.store(accepted_ptr + b * max_k + cols, accepted.to(tl.int8), mask=cols < max_k)


@dataclass(frozen=True, slots=True)
class LaunchShape:
    """BLOCK, vocabulary split size, warps and stages of the stats kernel and, apart, of the
    race (which also reads dense q), and whether the race is a programmatic dependent launch."""

    block: int
    stats_split: int
    race_split: int
    num_warps: int = 4
    num_stages: int = 1
    race_block: int = 0  # 0: same as block
    race_warps: int = 0  # 0: same as num_warps
    race_stages: int = 0  # 0: same as num_stages
    pdl: bool = True  # programmatic dependent launch of the race where the GPU has it
    # the widest split counts this device's shapes reach: the kernels' NUM_SPLITS and
    # RACE_SPLITS (powers of two) are at least these, so that a block's rows and batch, which
    # pick the split counts, do not pick a compile too
    min_stats_splits: int = 1
    min_race_splits: int = 1

    def __post_init__(self) -> None:
        # Philox serves four ids per call (_vocab_bits): every block must start at a
        # multiple of 4, or the race would draw other numbers than the reference.
        for name in ("block", "stats_split", "race_split", "race_block"):
            value = getattr(self, name)
            if value < 0 or value % 4 or (value == 0 and name != "race_block"):
                raise ValueError(
                    f"LaunchShape.{name} must be a positive multiple of 4, got {value}."
                )
        for name in ("block", "race_block"):
            value = getattr(self, name)
            if value and value & (value - 1):
                raise ValueError(f"LaunchShape.{name} must be a power of two, got {value}.")


def launch_shape(
    rows: int,
    batch: int,
    width: int,
    device: torch.device,
    block: int = 1024,
    programs_per_sm: int = 6,
    num_warps: int = 8,
    num_stages: int = 1,
    race_block: int = 512,
    race_programs_per_sm: int = 8,
    race_warps: int = 4,
    race_stages: int = 1,
    race_max_splits: int = 0,
) -> LaunchShape:
    """On a GPU, enough vocabulary splits for ~programs_per_sm programs per SM in the stats
    kernel (rows programs before splitting) and ~race_programs_per_sm in the race (batch
    programs); under the CPU interpreter one wide split (each program costs ~1 ms there).
    Defaults: the best of the shapes tried at batch 64, k 4, V 128256 on an H200
    (bench/rejection_bench.py, BENCHMARKS.md)."""
    if device.type != "cuda":
        block = max(4, min(triton.next_power_of_2(width), 16384))
        whole = triton.cdiv(width, block) * block
        return LaunchShape(block, whole, whole, num_warps, num_stages)
    sms = torch.cuda.get_device_properties(device).multi_processor_count

    def split(programs: int, per_sm: int, blk: int, cap: int) -> int:
        splits = max(1, min(triton.cdiv(per_sm * sms, programs), triton.cdiv(width, blk), cap))
        return triton.cdiv(triton.cdiv(width, splits), blk) * blk

    def race_cap(b: int) -> int:  # small batches want more race splits (H200 sweep)
        return race_max_splits or max(64, 256 // b)  # batch 1: 256; 64 from batch 4 on

    stats_cap = 64
    stats = split(rows, programs_per_sm, block, stats_cap)
    race = split(batch, race_programs_per_sm, race_block, race_cap(batch))
    return LaunchShape(
        block, stats, race, num_warps, num_stages, race_block, race_warps, race_stages,
        min_stats_splits=min(stats_cap, triton.cdiv(width, block)),
        min_race_splits=min(race_cap(1), triton.cdiv(width, race_block)),  # batch 1's: widest
    )  # fmt: skip


def rejection_sample_triton(
    inputs: KernelInputs, shape: LaunchShape | None = None
) -> KernelOutputs:
    """Run the two kernels (launch shape from `launch_shape` unless given)."""
    x = inputs
    device = x.logits.device
    rows, batch = x.row_req.shape[0], x.num_draft.shape[0]
    width = max(x.vocab_size, x.q_vocab)
    shape = shape or launch_shape(rows, batch, width, device)
    n_splits = triton.cdiv(x.vocab_size, shape.stats_split)
    # at least 4 splits: each partials buffer below then starts 16-byte aligned at any row count
    num_splits = triton.next_power_of_2(max(n_splits, shape.min_stats_splits, 4))
    n_race = triton.cdiv(width if x.q_mode == Q_DENSE else x.vocab_size, shape.race_split)
    race_splits = triton.next_power_of_2(max(n_race, shape.min_race_splits, 4))
    # One buffer for the split partials: max, sum, argmax value, argmax id, bad. Padded splits
    # (>= n_splits) are never read: loads are masked, so no fill kernels are needed.
    parts = torch.empty((5, rows, num_splits), dtype=torch.float32, device=device)
    pmax, psum, pval = parts[0], parts[1], parts[2]
    pidx, pbad = parts[3].view(torch.int32), parts[4].view(torch.int32)
    # placeholders for absent inputs, one entry per row: the race loads q_ids' entry t of each
    # draft token in every q form (only a sparse q uses it), so a shorter one is read past its
    # end. thresholds is a fresh tensor (q_ptr keeps its alignment); row_req's is not
    # specialised on
    dummy_f, dummy_i = x.thresholds, x.row_req
    q = x.q_probs if x.q_probs is not None else dummy_f
    q_ids = x.q_ids if x.q_ids is not None else dummy_i
    draft_ids = x.draft_ids if x.draft_ids.numel() else dummy_i  # no null pointers
    sparse_width = q.shape[1] if x.q_mode == Q_SPARSE else 1
    support_p2 = (
        max(MIN_SUPPORT_P2, triton.next_power_of_2(sparse_width)) if x.q_mode == Q_SPARSE else 1
    )
    # read only for dense q; one value otherwise (a sparse support's width would specialise it)
    q_stride = q.stride(0) if x.q_mode == Q_DENSE else 0
    done = torch.empty(batch, dtype=torch.int32, device=device)
    pdl = shape.pdl and pdl_enabled(device)
    _row_stats_kernel[(rows, n_splits)](
        x.logits, x.logits.stride(0), x.thresholds, x.row_req, x.inv_temperature, x.greedy,
        pmax, psum, pval, pidx, pbad, done, x.vocab_size, batch, shape.stats_split,
        NUM_SPLITS=num_splits, BLOCK=shape.block, num_warps=shape.num_warps,
        num_stages=shape.num_stages, PDL=pdl,
    )  # fmt: skip
    race = torch.empty((batch, race_splits, 4), device=device)
    # dense q: each q row's split sums [T, race splits], then each request's split minimum
    # [B, race splits]
    dense = x.q_mode == Q_DENSE
    q_parts = torch.empty(((x.draft_ids.numel() + batch) * race_splits if dense else 1,),
                          device=device)  # fmt: skip
    q_mins = q_parts[x.draft_ids.numel() * race_splits :] if dense else q_parts
    token_ids = torch.empty((batch, x.max_k + 1), dtype=torch.int32, device=device)
    num_committed = torch.empty(batch, dtype=torch.int32, device=device)
    accepted = torch.empty((batch, max(x.max_k, 1)), dtype=torch.int8, device=device)
    status = torch.empty(batch, dtype=torch.int32, device=device)
    rates = x.synthetic_rates if x.synthetic_rates is not None else dummy_f
    rates_width = rates.numel() // batch if x.synthetic_rates is not None else 0
    _decide_sample_kernel[(batch, n_race)](
        x.logits, x.logits.stride(0), x.thresholds, x.num_draft, x.row_start, x.draft_start,
        draft_ids, x.inv_temperature, x.greedy, x.seed, x.position, x.status_in, rates,
        q, q_stride, q_ids, pmax, psum, pval, pidx, pbad, done, race, q_parts, q_mins,
        token_ids, num_committed, accepted, status, x.vocab_size, x.q_vocab, sparse_width,
        shape.race_split, n_splits, n_race, x.max_k, rates_width, Q_SUM_TOLERANCE,
        NUM_SPLITS=num_splits,
        RACE_SPLITS=race_splits, BLOCK=shape.race_block or shape.block,
        S_P2=support_p2, Q_MODE=x.q_mode,
        SYNTHETIC=x.synthetic_rates is not None, num_warps=shape.race_warps or shape.num_warps,
        num_stages=shape.race_stages or shape.num_stages,
        K_P2=triton.next_power_of_2(x.max_k + 1), Q_ROWS=triton.next_power_of_2(max(x.max_k, 1)),
        PDL=pdl, **launch_options(pdl),
    )  # fmt: skip
    return KernelOutputs(token_ids, num_committed, accepted[:, : x.max_k].view(torch.bool), status)


def rejection_sample_torch(inputs: KernelInputs) -> KernelOutputs:
    """Pure-torch reference of the two kernels above: the same function, the same random
    numbers, vectorised over requests (used on CPU services and to test the kernels)."""
    x = inputs
    device, vocab = x.logits.device, x.vocab_size
    req, k = x.row_req.long(), x.num_draft.long()
    logits = x.logits[:, :vocab].float()
    keep = logits >= x.thresholds[:, None]
    scaled = torch.where(keep, logits * x.inv_temperature[req, None], float("-inf"))
    row_max = scaled.max(dim=1).values
    row_max = torch.where(row_max == float("-inf"), 0.0, row_max)
    probs = torch.exp(scaled - row_max[:, None])
    probs = probs / probs.sum(dim=1, keepdim=True)
    argmax = logits.argmax(dim=1)
    bad_rows = ~torch.isfinite(logits).all(dim=1)

    draft_rows = (x.row_draft >= 0).nonzero().flatten()  # row of draft token t, in order
    tok_req = req[draft_rows]
    j = torch.arange(draft_rows.numel(), device=device) - x.draft_start.long()[tok_req]
    draft = x.draft_ids.long()
    out_of_vocab = (draft < 0) | (draft >= vocab)
    draft = draft.clamp(0, vocab - 1)
    q_x, q_bad, q_unnormalized = _reference_draft_prob(x, draft)
    p_x = probs[draft_rows, draft]
    pos = x.position[tok_req] + j
    u = rng.position_uniform(x.seed[tok_req], pos, rng.Stream.ACCEPT)
    if x.synthetic_rates is not None:  # [B * W], request-major
        width = x.synthetic_rates.numel() // k.numel()
        accept = u < x.synthetic_rates.view(-1, width)[tok_req, j]
    else:
        accept = torch.where(x.greedy[tok_req] != 0, draft == argmax[draft_rows], u * q_x < p_x)
    first_reject = k.clone()
    rejected_at = torch.where(accept, k[tok_req], j)
    first_reject.scatter_reduce_(0, tok_req, rejected_at, reduce="amin")

    def any_per_request(flags: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(k).index_add_(0, owner, flags.long()) > 0

    status = x.status_in.clone()
    for code, flags, owner in (
        (TOKEN_OUT_OF_VOCAB, out_of_vocab, tok_req),
        (NONFINITE_LOGITS, bad_rows, req),
        (INVALID_DRAFT_PROBS, q_bad, tok_req),
        (DRAFT_PROBS_NOT_NORMALIZED, q_unnormalized, tok_req),
        (DRAFT_TOKEN_OUT_OF_SUPPORT, q_x <= 0, tok_req),
    ):
        status = torch.where((status == 0) & any_per_request(flags, owner), code, status)

    target_row = x.row_start.long() + first_reject
    token = _reference_race(x, probs[target_row], first_reject)
    token = torch.where(x.greedy != 0, argmax[target_row], token)
    return _assemble(x, first_reject, token, status)


def _reference_draft_prob(
    x: KernelInputs, draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_t(x_t), invalid-q flag, not-normalised flag) per draft token [T]."""
    none = torch.zeros_like(draft, dtype=torch.bool)
    if x.q_mode == Q_DENSE:
        assert x.q_probs is not None
        q = x.q_probs
        in_q = draft < q.shape[1]
        q_x = torch.where(in_q, q.gather(1, draft.clamp(max=q.shape[1] - 1)[:, None])[:, 0], 0.0)
        invalid = (~torch.isfinite(q) | (q < 0)).any(dim=1)
        return q_x, invalid, (q.sum(dim=1) - 1.0).abs() > Q_SUM_TOLERANCE
    if x.q_mode == Q_SPARSE:
        assert x.q_probs is not None and x.q_ids is not None
        q_x = torch.where(x.q_ids.long() == draft[:, None], x.q_probs, 0.0).sum(dim=1)
        return q_x, none, none
    return torch.ones_like(draft, dtype=torch.float32), none, none


def _reference_race(x: KernelInputs, p: torch.Tensor, first_reject: torch.Tensor) -> torch.Tensor:
    """Token per request from the exponential race over row first_reject: the residual
    max(0, p - q) after a rejection, p itself for a bonus."""
    vocab = p.shape[1]
    k = x.num_draft.long()
    has_draft = first_reject < k
    t = (x.draft_start.long() + first_reject).clamp(max=max(x.draft_ids.numel() - 1, 0))
    q = torch.zeros_like(p)
    if x.q_mode == Q_DENSE and x.q_probs is not None and x.draft_ids.numel():
        width = min(vocab, x.q_probs.shape[1])
        q[:, :width] = x.q_probs[t, :width]
    elif (
        x.q_mode == Q_SPARSE
        and x.q_probs is not None
        and x.q_ids is not None
        and x.draft_ids.numel()
    ):
        ids = x.q_ids[t].long()
        # ids below -1 are invalid q (the request's status says so; the kernel reads none of
        # them) and must not reach scatter_add_ as negative indices
        inside = (ids >= 0) & (ids < vocab)
        q.scatter_add_(1, torch.where(inside, ids, 0), torch.where(inside, x.q_probs[t], 0.0))
    elif x.draft_ids.numel():
        q.scatter_(1, x.draft_ids.long()[t].clamp(0, vocab - 1)[:, None], 1.0)
    stream = torch.where(has_draft, int(rng.Stream.RECOVER), int(rng.Stream.BONUS))
    expo = rng.exponential(rng.vocab_bits(x.seed, x.position + first_reject, stream, vocab))
    residual = torch.where(has_draft[:, None], (p - q).clamp(min=0.0), p)
    score = residual / expo
    token = score.argmax(dim=1)
    return torch.where(score.max(dim=1).values > 0, token, (p / expo).argmax(dim=1))


def _assemble(
    x: KernelInputs, first_reject: torch.Tensor, token: torch.Tensor, status: torch.Tensor
) -> KernelOutputs:
    cols = x.max_k + 1
    col = torch.arange(cols, device=token.device)[None, :]
    gather = (x.draft_start.long()[:, None] + col).clamp(max=max(x.draft_ids.numel() - 1, 0))
    drafts = x.draft_ids.long()[gather] if x.draft_ids.numel() else torch.zeros_like(gather)
    f = first_reject[:, None]
    out = torch.where(col < f, drafts, torch.where(col == f, token[:, None], PLACEHOLDER))
    ok = (status == 0)[:, None]
    out = torch.where(ok, out, PLACEHOLDER).to(torch.int32)
    accepted = ok & (col[:, : x.max_k] < f) & (col[:, : x.max_k] < x.num_draft.long()[:, None])
    num_committed = torch.where(status == 0, first_reject + 1, 0).to(torch.int32)
    return KernelOutputs(out, num_committed, accepted, status.to(torch.int32))
