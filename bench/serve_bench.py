"""Serving benchmark: drives a running `relay serve` over HTTP the way `vllm bench serve` does.

For each (input length, output length, concurrency) it keeps `concurrency` streaming requests in
flight (random token-id prompts, ignore_eos so every request produces exactly the output length),
and reports TTFT, TPOT, ITL (p50/p99), output tok/s and request throughput, one JSON line each.
The streams are spread over several client processes (--client-procs): one Python process parsing
tens of thousands of SSE events a second falls behind the server and inflates every latency it
measures. The server's own view of the level comes from /metrics read before and after it: its
decode-only step rate (relay:engine_step_*{kind="decode"}: the number `relay bench` measures for a
batch) and the mean inter-token latency it recorded.
Needs only httpx (present on the GPU machine; pinned for tests here).

  python3 bench/serve_bench.py --base http://127.0.0.1:8000 --model NAME \
      --shapes 1024x1024,4096x256 --concurrency 1,16,64,256 --out results.jsonl
"""
import argparse
import asyncio
import json
import multiprocessing
import random
import re
import statistics
import time

import httpx


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


async def one_request(client, args, prompt, max_tokens):
    body = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    token_times = []
    completion_tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                token_times.append(time.perf_counter())
    end = time.perf_counter()
    ttft = token_times[0] - start if token_times else end - start
    itls = [b - a for a, b in zip(token_times, token_times[1:])]
    tpot = (end - token_times[0]) / max(completion_tokens - 1, 1) if token_times else float("nan")
    return {"ttft": ttft, "itls": itls, "tpot": tpot, "tokens": completion_tokens, "latency": end - start}


async def run_streams(args, prompts, output_len, concurrency):
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=args.base, timeout=httpx.Timeout(3600.0), limits=limits) as client:
        queue = list(prompts)
        results = []

        async def worker():
            while queue:
                prompt = queue.pop()
                results.append(await one_request(client, args, prompt, output_len))

        await asyncio.gather(*[worker() for _ in range(concurrency)])
    return results


def client_proc(args, prompts, output_len, concurrency, conn):
    try:
        conn.send(asyncio.run(run_streams(args, prompts, output_len, concurrency)))
    except Exception as e:  # reported by the parent, which fails the level
        conn.send(e)
    conn.close()


def server_counters(base):
    """The engine-step counters and the ITL histogram's sum/count from /metrics."""
    text = httpx.get(base + "/metrics", timeout=30).text
    out = {}
    for name, kind, value in re.findall(
            r'^relay:(engine_steps_total|engine_step_sequences_total|engine_step_seconds_total)'
            r'\{[^}]*kind="(\w+)"\} (\S+)$', text, re.M):
        out[f"{name}:{kind}"] = float(value)
    for name in ("inter_token_latency_seconds_sum", "inter_token_latency_seconds_count"):
        m = re.search(rf"^relay:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def run_level(args, input_len, output_len, concurrency, num_requests):
    rng = random.Random(1000 * input_len + concurrency)
    prompts = [[rng.randrange(1000, 100000) for _ in range(input_len)] for _ in range(num_requests)]
    procs = max(1, min(args.client_procs, concurrency))
    before = server_counters(args.base)
    start = time.perf_counter()
    children = []
    for p in range(procs):
        share = concurrency // procs + (1 if p < concurrency % procs else 0)
        parent, child = multiprocessing.Pipe(duplex=False)
        proc = multiprocessing.Process(target=client_proc,
                                       args=(args, prompts[p::procs], output_len, share, child))
        proc.start()
        children.append((proc, parent))
    results = []
    for proc, parent in children:
        got = parent.recv()
        proc.join()
        if isinstance(got, Exception):
            raise got
        results.extend(got)
    duration = time.perf_counter() - start
    after = server_counters(args.base)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    itls = [x for r in results for x in r["itls"]]
    out_tokens = sum(r["tokens"] for r in results)
    decode_s = delta.get("engine_step_seconds_total:decode", 0.0)
    decode_steps = delta.get("engine_steps_total:decode", 0.0)
    decode_seqs = delta.get("engine_step_sequences_total:decode", 0.0)
    all_s = decode_s + delta.get("engine_step_seconds_total:mixed", 0.0)
    itl_count = delta.get("inter_token_latency_seconds_count", 0.0)
    return {
        "mode": "serve", "input_len": input_len, "output_len": output_len, "concurrency": concurrency,
        "num_requests": len(results), "duration_s": duration, "client_procs": procs,
        "output_tok_per_s": out_tokens / duration, "request_per_s": len(results) / duration,
        "ttft_ms_p50": 1e3 * percentile([r["ttft"] for r in results], 0.5),
        "ttft_ms_p99": 1e3 * percentile([r["ttft"] for r in results], 0.99),
        "tpot_ms_p50": 1e3 * percentile([r["tpot"] for r in results], 0.5),
        "tpot_ms_p99": 1e3 * percentile([r["tpot"] for r in results], 0.99),
        "itl_ms_p50": 1e3 * percentile(itls, 0.5), "itl_ms_p99": 1e3 * percentile(itls, 0.99),
        "mean_latency_s": statistics.mean(r["latency"] for r in results),
        # The server's side of the same interval.
        "server_itl_ms_mean": 1e3 * delta.get("inter_token_latency_seconds_sum", 0.0) / itl_count
        if itl_count else float("nan"),
        "server_decode_steps": decode_steps,
        "server_decode_batch_mean": decode_seqs / decode_steps if decode_steps else float("nan"),
        "server_decode_ms_per_step": 1e3 * decode_s / decode_steps if decode_steps else float("nan"),
        "server_decode_tok_per_s": decode_seqs / decode_s if decode_s else float("nan"),
        "server_decode_time_share": decode_s / all_s if all_s else float("nan"),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--shapes", default="1024x1024,4096x256", help="INPUTxOUTPUT,...")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--requests-per-level", type=int, default=0,
                    help="requests per level (default: 2 x concurrency, at least 4)")
    ap.add_argument("--client-procs", type=int, default=8,
                    help="client processes the streams are spread over")
    ap.add_argument("--device", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        input_len, output_len = map(int, shape.split("x"))
        for c in map(int, args.concurrency.split(",")):
            n = args.requests_per_level or max(4, 2 * c)
            result = run_level(args, input_len, output_len, c, n)
            result["device"] = args.device
            line = json.dumps(result)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
