"""A bounded soak of `relay serve`: ~60 s of random requests (chat and completions, streamed or not,
random lengths, n, stop strings, seeds), random client cancellations and bad requests, on a KV pool
small enough to preempt. It must end with no request lost, no server error, and no leaked block."""
import json
import os
import random
import socket
import threading
import time

import httpx

from relay_server import MODEL, RelayServer

SOAK_SECONDS = float(os.environ.get("RELAY_SOAK_SECONDS", "60"))
WORKERS = 12


def one_request(server, rng, stats):
    kind = rng.random()
    if kind < 0.08:  # a bad request
        r = httpx.post(server.base + "/v1/chat/completions", content=b'{"model": "' + MODEL.encode() + b'", "messages": []}',
                       timeout=30)
        stats["bad"] += 1
        assert r.status_code == 400, r.text
        return
    chat = rng.random() < 0.5
    stream = rng.random() < 0.5
    cancel_after = rng.choice([None, None, None, 1, 3, 8])
    body = {"model": MODEL, "max_tokens": rng.randint(1, 60), "temperature": rng.choice([0, 0.7, 1.0]),
            "seed": rng.randint(0, 1000), "n": rng.choice([1, 1, 1, 2]), "stream": stream}
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(["\n\n", ":", "return"])]
    words = " ".join(rng.choice(["def", "class", "x", "import", "return", "for", "in", "range"])
                     for _ in range(rng.randint(1, 120)))
    if chat:
        body["messages"] = [{"role": "user", "content": words}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = words
        path = "/v1/completions"
    if cancel_after is not None:
        # Hang up after reading a little of a stream, or (a non-streaming answer is written only
        # when complete) after a moment, as a client that goes away.
        data = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            got = b""
            if stream:
                while got.count(b"\n") < cancel_after:
                    part = sock.recv(4096)
                    if not part:
                        break
                    got += part
                assert got.startswith(b"HTTP/1.1 200"), got[:200]
            else:
                time.sleep(0.05 * cancel_after)
        stats["cancelled"] += 1
        return
    with httpx.Client(timeout=120) as http:
        if stream:
            with http.stream("POST", server.base + path, json=body) as r:
                assert r.status_code == 200, r.read()
                events = [l for l in r.iter_lines() if l.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e[6:])["choices"]
                        if c.get("finish_reason")]
            assert len(finishes) == body["n"] and all(f in ("stop", "length") for f in finishes), events[-3:]
        else:
            r = http.post(server.base + path, json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            assert len(out["choices"]) == body["n"]
            assert all(c["finish_reason"] in ("stop", "length") for c in out["choices"])
            assert out["usage"]["completion_tokens"] <= body["max_tokens"] * body["n"]
    stats["completed"] += 1


def test_soak(relay_bin):
    server = RelayServer(relay_bin, "--num-kv-blocks", 48, "--max-num-seqs", 8, "--max-num-batched-tokens", 128,
                         "--max-queue", 64)
    server.wait_ready()
    stats = {"completed": 0, "cancelled": 0, "bad": 0}
    failures = []
    deadline = time.time() + SOAK_SECONDS

    def worker(seed):
        rng = random.Random(seed)
        while time.time() < deadline:
            try:
                one_request(server, rng, stats)
            except Exception as e:  # noqa: BLE001 - collected and reported below
                failures.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert failures == []
        assert stats["completed"] > 20 and stats["cancelled"] > 5, stats
        m = server.wait_idle(timeout=30)
        label = f'{{model_name="{MODEL}"}}'
        assert m["relay:kv_cache_usage_perc" + label] == 0
        assert m["relay:num_requests_running" + label] == 0 and m["relay:num_requests_waiting" + label] == 0
        assert m[f'relay:request_success_total{{model_name="{MODEL}",finished_reason="error"}}'] == 0
        assert not any(f'status="{s}"' in k for k in m for s in (500, 503)), m
        assert httpx.get(server.base + "/health").status_code == 200
        assert " 500 " not in server.log_text()
    finally:
        assert server.stop() == 0
