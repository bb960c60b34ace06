"""Transport cost of one draft → target step on loopback: dense vs sparse q.

    python bench/transport_bench.py [--steps 300] [--out bench/results]

Per step: pack the draft's block (its columns and whole q tensors, as the draft engine builds
them) into a DraftBlock (draft side, `DraftBlock.to_pb`: one buffer per q field), serialise,
send over a real gRPC stream (`specdec.serving` server: interceptor, message limits), parse it
into columns and whole q tensors (target side, `DraftBlock.from_pb`, as the target servicer
does), answer the verdicts as the columns of one VerifyResponse (`VerifyResponse.to_pb`),
receive and decode them (`VerifyResponse.from_pb`, as the driver does). The model and the
sampler are left out:
this is the cost the split adds. V = 128,256 (Llama 3), k = 4.

The fraction of a verify step needs the 8B target's verify-step time on a GPU, produced by the
runner's benchmark: put it in bench/results/verify_step_8b.json as
{"verify_step_ms": {"1": ..., "8": ..., "32": ...}, "device": "..."}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import torch

from bench.provenance import cpu_model
from specdec.pb import common_pb2, target_pb2, target_pb2_grpc
from specdec.serving.blocks import DenseQ, DraftBlock, DraftProposal, SparseQ
from specdec.serving.client import LockstepStream, make_channel
from specdec.serving.server import Server, ServerConfig
from specdec.serving.verdicts import VerifyResponse

VOCAB = 128256
K = 4
SUPPORT = 32
VERIFY_INPUT = "verify_step_8b.json"


class EchoTarget(target_pb2_grpc.TargetServiceServicer):
    """Parses the block as the target does, then accepts every draft without scoring."""

    def Verify(
        self, request_iterator: Iterator[common_pb2.DraftBlock], context: grpc.ServicerContext
    ) -> Iterator[target_pb2.VerifyResponse]:
        for block in request_iterator:
            parsed = DraftBlock.from_pb(block)
            assert not parsed.errors, parsed.errors
            out = VerifyResponse.pending(parsed.request_ids, parsed.steps)
            for i in range(len(parsed)):
                out.commit(i, [*parsed.tokens(i), 0], K, K, 99)
            yield out.to_pb()


def proposals(batch: int, form: str) -> list[DraftProposal]:
    gen = torch.Generator().manual_seed(batch)
    out = []
    for b in range(batch):
        ids = tuple(torch.randint(0, VOCAB, (K,), generator=gen).tolist())
        if form == "dense":
            q: DenseQ | SparseQ = DenseQ(torch.softmax(torch.randn(K, VOCAB, generator=gen), -1))
        else:
            support = torch.randint(0, VOCAB, (K, SUPPORT), generator=gen, dtype=torch.int32)
            q = SparseQ(support, torch.softmax(torch.randn(K, SUPPORT, generator=gen), -1))
        out.append(DraftProposal(f"r{b}", 7, 100, ids, q))
    return out


def measure(stream: LockstepStream, batch: int, form: str, steps: int) -> dict[str, float]:
    proposed = DraftBlock.from_proposals(proposals(batch, form))
    times, sent, received = [], 0, 0
    for i in range(steps + 3):
        start = time.perf_counter()
        block = proposed.to_pb()  # packing q is part of the draft's cost
        response = stream(block)
        VerifyResponse.from_pb(response)  # decoding the verdicts is part of the driver's cost
        elapsed = time.perf_counter() - start
        if i >= 3:  # warm-up
            times.append(elapsed)
        sent, received = block.ByteSize(), response.ByteSize()
    return {
        "batch": batch, "q": form, "ms_median": 1e3 * statistics.median(times),
        "ms_p90": 1e3 * sorted(times)[int(0.9 * (len(times) - 1))],
        "bytes_sent": sent, "bytes_received": received,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--q", default="sparse,dense", help="q forms to measure, comma-separated")
    args = parser.parse_args()
    server = Server(
        ServerConfig(), ["specdec.v1.TargetService"],
        lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(EchoTarget(), s),
    )  # fmt: skip
    port = server.start()
    load_before, rows = os.getloadavg()[0], []
    with make_channel(f"127.0.0.1:{port}") as channel:
        stream = LockstepStream(target_pb2_grpc.TargetServiceStub(channel).Verify)
        for form in args.q.split(","):
            for batch in (1, 8, 32):
                steps = args.steps if form == "sparse" or batch < 32 else max(args.steps // 3, 5)
                rows.append(measure(stream, batch, form, steps))
                print(json.dumps(rows[-1]))
        stream.close()
    server.stop(0)
    write(rows, args.out, (load_before, os.getloadavg()[0]))


def machine() -> str:
    """CPU model and core count of this machine (the transport runs on the CPU)."""
    model = cpu_model()
    python = platform.python_version()
    return f"{model}, {os.cpu_count()} cores, Python {python}, grpcio {grpc.__version__}"


def write(rows: list[dict[str, float]], out: Path, load: tuple[float, float]) -> None:
    """transport.json and transport.md; `load` is the 1-minute load average before and after
    (another busy process on a 2-core machine inflates every figure)."""
    verify_path = out / VERIFY_INPUT
    verify = json.loads(verify_path.read_text()) if verify_path.exists() else None
    out.mkdir(parents=True, exist_ok=True)
    for r in rows:
        step = verify["verify_step_ms"].get(str(r["batch"])) if verify else None
        r["fraction_of_verify_step"] = None if step is None else r["ms_median"] / step
    result = {"machine": machine(), "vocab_size": VOCAB, "num_draft_tokens": K,
              "support_size": SUPPORT, "verify_step": verify, "load_average": load,
              "rows": rows}  # fmt: skip
    (out / "transport.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# Transport per step, loopback, V = {VOCAB}, k = {K}, sparse support {SUPPORT}",
        "",
        f"Measured on {machine()} (`python bench/transport_bench.py`), 1-minute load average "
        f"{load[0]:.2f} before and {load[1]:.2f} after. The verify step is "
        + (f"{verify['device']}'s ({verify['source']})." if verify else "missing."),
        "",
        "| q | batch | ms (median) | ms (p90) | bytes sent | bytes back | % of 8B verify step |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        f = r["fraction_of_verify_step"]
        frac = "needs " + VERIFY_INPUT if f is None else f"{100 * f:.1f}%"
        lines.append(
            f"| {r['q']} | {r['batch']} | {r['ms_median']:.2f} | {r['ms_p90']:.2f} | "
            f"{r['bytes_sent']:,} | {r['bytes_received']:,} | {frac} |"
        )
    (out / "transport.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
