"""`specdec generate "prompt"`: streams a completion from a running `specdec serve` to the
terminal, then prints the request's acceptance figures to stderr (or everything as JSON)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from specdec.client import DEFAULT_ADDRESS, Client, GenerateOutput, SpecdecClientError
from specdec.serving.proposers import PROPOSERS

ADDRESS_ENV = "SPECDEC_ADDRESS"


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help='prompt text ("-" reads stdin)')
    parser.add_argument(
        "--address",
        default=os.environ.get(ADDRESS_ENV, DEFAULT_ADDRESS),
        help=f"server host:port (${ADDRESS_ENV} sets the default)",
    )
    parser.add_argument(
        "--prompt-ids", action="store_true", help="the prompt is token ids: '1,2,3' or '1 2 3'"
    )
    parser.add_argument("--max-tokens", type=int, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, help="0 is greedy (server default 1)")
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    parser.add_argument("--top-p", type=float, help="nucleus mass in (0, 1]")
    parser.add_argument("--seed", type=int, help="seed of the request (default: random)")
    parser.add_argument("--proposer", choices=PROPOSERS, help="where drafts come from")
    parser.add_argument("-k", "--num-draft-tokens", type=int, dest="num_draft_tokens",
                        help="draft tokens per step (default: the server's)")  # fmt: skip
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--stop-token-id", type=int, action="append", default=[], help="stop token id (repeatable)"
    )
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument(
        "--include-stop", action="store_true", help="keep the matched stop string in the text"
    )
    parser.add_argument("--timeout", type=float, help="deadline of the request in seconds")
    parser.add_argument("--tls-root-cert", type=Path, help="PEM root certificate: use TLS")
    parser.add_argument(
        "--api-key", help="the server's API key (default: $SPECDEC_API_KEY; prefer the variable: "
        "a flag is visible in the process list)"
    )  # fmt: skip
    parser.add_argument(
        "--json", action="store_true", help="print the whole result as one JSON object"
    )


def _prompt(args: argparse.Namespace) -> str | list[int]:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not args.prompt_ids:
        return str(text)
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(
            f"--prompt-ids needs integers separated by commas, got {text!r}."
        ) from None


def _params(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.seed,
        "proposer": args.proposer,
        "num_draft_tokens": args.num_draft_tokens,
        "stop": args.stop,
        "stop_token_ids": args.stop_token_id,
        "ignore_eos": args.ignore_eos,
        "include_stop_str_in_output": args.include_stop,
    }


def summary_lines(final: GenerateOutput) -> list[str]:
    """The acceptance and latency figures of a finished request, for people."""
    usage, timing = final.usage, final.timing
    if usage is None or timing is None:
        return [f"finish: {final.finish_reason}"]
    stop = ""
    if final.stop_string is not None:
        stop = f" {final.stop_string!r}"
    elif final.stop_token_id is not None:
        stop = f" (token {final.stop_token_id})"
    lines = [
        f"finish: {final.finish_reason}{stop}; {usage.prompt_tokens} prompt tokens, "
        f"{usage.completion_tokens} generated in {timing.e2e_s:.3f} s "
        f"(first token {timing.time_to_first_token_s:.3f} s, queued {timing.queue_s:.3f} s)"
    ]
    decode_s = timing.e2e_s - timing.time_to_first_token_s
    if usage.completion_tokens > 1 and decode_s > 0:
        lines.append(f"decode: {(usage.completion_tokens - 1) / decode_s:.1f} tokens/s")
    spec = f"speculation: proposer {usage.proposer}, k {usage.num_draft_tokens_per_step}, "
    spec += f"{usage.num_steps} steps"
    if usage.acceptance_rate is not None and usage.mean_acceptance_length is not None:
        spec += (
            f", acceptance rate {usage.acceptance_rate:.3f} ({usage.num_accepted_tokens}/"
            f"{usage.num_draft_tokens} draft tokens), mean acceptance length "
            f"{usage.mean_acceptance_length:.2f}"
        )
        per_pos = [n / usage.num_drafts for n in usage.num_accepted_tokens_per_pos]
        spec += "; accepted by position " + " ".join(f"{r:.2f}" for r in per_pos)
    lines.append(spec)
    return lines


def _as_json(out: GenerateOutput) -> dict[str, Any]:
    result = dataclasses.asdict(out)
    if out.usage is not None:
        result["usage"]["acceptance_rate"] = out.usage.acceptance_rate
        result["usage"]["mean_acceptance_length"] = out.usage.mean_acceptance_length
    return result


def _stream(
    client: Client, prompt: str | list[int], args: argparse.Namespace, out: TextIO
) -> GenerateOutput | None:
    final = None
    for part in client.generate(prompt, timeout=args.timeout, **_params(args)):
        out.write(part.text)
        out.flush()
        final = part
    out.write("\n")
    return final


def run_generate(
    args: argparse.Namespace, *, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """Runs one request; 0 on success, 1 on a server error, 2 on a bad argument."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    try:
        prompt = _prompt(args)
        cert = args.tls_root_cert.read_bytes() if args.tls_root_cert is not None else None
        with Client(args.address, root_certificates=cert, api_key=args.api_key) as client:
            if args.json:
                result = client.complete(prompt, timeout=args.timeout, **_params(args))
                out.write(json.dumps(_as_json(result), ensure_ascii=False) + "\n")
                return 0
            final = _stream(client, prompt, args, out)
    except (ValueError, OSError) as e:
        err.write(f"specdec generate: {e}\n")
        return 2
    except SpecdecClientError as e:
        hint = ""
        if e.code.name == "UNAVAILABLE":
            hint = f" (is `specdec serve` running at {args.address}?)"
        err.write(f"specdec generate: {e}{hint}\n")
        return 1
    except KeyboardInterrupt:  # leaving the stream cancelled the request on the server
        err.write("specdec generate: interrupted\n")
        return 130
    if final is not None:
        for line in summary_lines(final):
            err.write(line + "\n")
    return 0
