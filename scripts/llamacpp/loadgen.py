#!/usr/bin/env python3
"""A load generator for llama.cpp's server: N concurrent clients send streamed `/completion`
requests and time each one from the client's side. Standard library only (it runs on the GPU
machine, which has no network to install anything from).

    loadgen.py --url http://127.0.0.1:8080 --clients 8 --requests 64 \\
               --prompt-tokens 128 --n-predict 128 [--out load.json]

Each request's prompt is --prompt-tokens random token ids (so its length is exact, and no two
prompts share a cached prefix), with `n_predict`, `ignore_eos` (every request generates exactly
n_predict tokens) and `stream: true`. Per request:

- TTFT: from sending the request to its first streamed token;
- TPOT: (last token's arrival - first token's) / (tokens - 1), tokens as the server's final
  message reports them (`tokens_predicted`).

The totals (requests, failures, tokens predicted and prompt tokens as the server reported
them, TTFT and TPOT p50/p99 in ms, tokens/s) are printed as JSON, and written to --out.
The run is bounded: --requests in all, each given up after --timeout seconds.
"""

import argparse
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request


def percentile(values, q):
    """The q-quantile (0..1) with linear interpolation between ranks; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def one_request(url, prompt, n_predict, timeout):
    """Send one streamed completion; return its timings and the server's counts."""
    body = json.dumps({
        "prompt": prompt,
        "n_predict": n_predict,
        "ignore_eos": True,
        "stream": True,
        # Every request's prompt is processed in full, as the load asks.
        "cache_prompt": False,
    }).encode()
    request = urllib.request.Request(
        url + "/completion", data=body, headers={"Content-Type": "application/json"})
    sent = time.monotonic()
    first = last = None
    final = None
    partials = 0
    with urllib.request.urlopen(request, timeout=timeout) as response:
        # Server-sent events: `data: {json}` lines, blank lines between them.
        for raw in response:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                break
            message = json.loads(payload)
            now = time.monotonic()
            if "error" in message:
                raise RuntimeError(f"the server answered an error: {message['error']}")
            if message.get("stop"):
                final = message
                # The final message may carry the last token's text too.
                if message.get("content"):
                    last = now
                    first = first or now
                break
            partials += 1
            first = first or now
            last = now
    if final is None:
        raise RuntimeError("the stream ended without the server's final message")
    tokens = int(final.get("tokens_predicted", final.get("timings", {}).get("predicted_n", 0)))
    prompt_tokens = int(final.get("tokens_evaluated", final.get("timings", {}).get("prompt_n", 0)))
    return {
        "ttft_ms": None if first is None else (first - sent) * 1e3,
        "tpot_ms": (last - first) * 1e3 / (tokens - 1) if first is not None and tokens > 1 else None,
        "tokens_predicted": tokens,
        "prompt_tokens": prompt_tokens,
        "streamed_messages": partials,
        "seconds": time.monotonic() - sent,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the server, http://HOST:PORT")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32, help="requests in all")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--n-predict", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    for name in ("clients", "requests", "prompt_tokens", "n_predict"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    url = args.url.rstrip("/")
    rng = random.Random(args.seed)
    # Ids well inside any Llama-3 vocabulary and clear of its special tokens.
    prompts = [[rng.randrange(1000, 100000) for _ in range(args.prompt_tokens)]
               for _ in range(args.requests)]
    next_index = iter(range(args.requests))
    lock = threading.Lock()
    results, failures = [], []

    def client():
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            try:
                result = one_request(url, prompts[index], args.n_predict, args.timeout)
                with lock:
                    results.append(result)
            except (OSError, urllib.error.URLError, RuntimeError, ValueError) as e:
                with lock:
                    failures.append(f"request {index}: {e}")

    started = time.monotonic()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - started

    ttfts = [r["ttft_ms"] for r in results if r["ttft_ms"] is not None]
    tpots = [r["tpot_ms"] for r in results if r["tpot_ms"] is not None]
    tokens = sum(r["tokens_predicted"] for r in results)
    summary = {
        "url": url,
        "clients": args.clients,
        "prompt_tokens_asked": args.prompt_tokens,
        "n_predict": args.n_predict,
        "requests": len(results),
        "failed": len(failures),
        "failures": failures[:10],
        "tokens_predicted": tokens,
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_ms": {"p50": percentile(ttfts, 0.5), "p99": percentile(ttfts, 0.99)},
        "tpot_ms": {"p50": percentile(tpots, 0.5), "p99": percentile(tpots, 0.99)},
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
