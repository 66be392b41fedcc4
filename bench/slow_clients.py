#!/usr/bin/env python3
"""Slow-client pressure on a running `relay serve`: N connections that each send one request-head line
every INTERVAL seconds (never finishing their head), while the script times /health, /metrics and a short
completion. Prints one JSON line: the probes' latencies (p50 / max), how many failed, and how many slow
connections the server had cut off (408 or closed) by the end.

    relay serve --port 8000 &
    python3 bench/slow_clients.py --port 8000 --connections 400 --interval 2 --seconds 20

Against a thread-per-connection server (Relay before its event-loop HTTP server) ~400 such clients
stopped everything, /health included. Traffic goes to 127.0.0.1 only; the run is bounded by --seconds.
"""
import argparse
import json
import socket
import statistics
import time
import urllib.request


def timed(url, data=None, timeout=10):
    start = time.time()
    try:
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            ok = r.status == 200
    except OSError:
        ok = False
    return time.time() - start, ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--connections", type=int, default=400)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between a slow client's header lines")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--model", default="relay-demo-moe")
    a = ap.parse_args()
    base = f"http://127.0.0.1:{a.port}"
    slow = []
    for _ in range(a.connections):
        s = socket.create_connection(("127.0.0.1", a.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        slow.append(s)
    latencies = {"health": [], "metrics": [], "completion": []}
    failures = {k: 0 for k in latencies}
    body = json.dumps({"model": a.model, "prompt": "def f(", "max_tokens": 4, "temperature": 0}).encode()
    start = time.time()
    next_line = start + a.interval
    while time.time() - start < a.seconds:
        if time.time() >= next_line:
            for s in slow:
                try:
                    s.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    pass
            next_line += a.interval
        for name, url, data in (("health", base + "/health", None), ("metrics", base + "/metrics", None),
                                ("completion", base + "/v1/completions", body)):
            t, ok = timed(url, data)
            latencies[name].append(t)
            failures[name] += not ok
        time.sleep(0.2)
    cut = 0
    for s in slow:
        s.settimeout(0.2)
        try:
            data = s.recv(64)
            cut += data == b"" or data.startswith(b"HTTP/1.1 408")
        except (socket.timeout, ConnectionResetError):
            pass
        s.close()
    print(json.dumps({
        "connections": a.connections, "interval_s": a.interval, "seconds": a.seconds,
        **{f"{k}_p50_ms": round(1000 * statistics.median(v), 1) for k, v in latencies.items()},
        **{f"{k}_max_ms": round(1000 * max(v), 1) for k, v in latencies.items()},
        **{f"{k}_failed": failures[k] for k in failures}, "probes": len(latencies["health"]),
        "slow_connections_cut": cut}))


if __name__ == "__main__":
    main()
