"""What hostile or broken clients send, against the real server (issue: reliability and security).

Each test bounds its own traffic (connections, time) and checks the server both refuses the bad
input with an OpenAI-style error and keeps serving everyone else.
"""
import json
import signal
import socket
import threading
import time

import pytest
import requests

from relay_server import MODEL, RelayServer, server_fixture


server = server_fixture("--max-num-seqs", "4", "--max-queue", "4", "--request-head-timeout", "2",
                        "--keep-alive-timeout", "5")


def raw(server, data, timeout=10, half_close=False):
    """Sends raw bytes and returns everything the server answers until it closes (or the timeout)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        out = b""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            out += chunk
        return out


def http_post(path, body, extra=b"", close=True):
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + (b"Connection: close\r\n" if close else b"") + extra
            + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def error_body(response_bytes):
    head, _, body = response_bytes.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), json.loads(body)["error"]


def assert_alive(server):
    assert requests.get(server.base + "/health", timeout=5).status_code == 200
    r = requests.post(server.base + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": "def f(", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def nested(depth):
    return "[" * depth + "1" + "]" * depth


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions",
     '{"model": "relay-demo-moe", "messages": [{"role": "user", "content": "hi", "x": ' + nested(20000) + "}]}",
     "messages"),
    ("/v1/chat/completions",
     '{"model": "relay-demo-moe", "tools": ' + nested(20000) + ', "messages": []}', "tools"),
    ("/v1/completions", '{"model": "relay-demo-moe", "prompt": ' + nested(20000) + "}", "prompt"),
    ("/tokenize", '{"messages": ' + nested(20000) + "}", "messages"),
    ("/detokenize", '{"tokens": ' + nested(20000) + "}", "tokens"),
])
def test_deeply_nested_json_is_refused_on_every_route(server, path, body, param):
    r = requests.post(server.base + path, data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "nests JSON deeper than 128 levels" in err["message"]
    assert_alive(server)


def test_deep_json_inside_a_tool_call_argument_string(server):
    args = json.dumps({"a": json.loads(nested(500))})
    body = {"model": MODEL, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]}
    # The body itself nests within the limit; the argument string, parsed later, does not.
    r = requests.post(server.base + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[1].tool_calls" and "deeper than 128" in err["message"]
    assert_alive(server)


def test_slow_request_heads_are_cut_off_and_the_server_keeps_serving(server):
    # 200 connections that send one header line every 0.5 s: with a thread per connection (the old
    # server, 4 + 4 + 16 threads here) a few dozen of these stopped everything, /health included.
    conns = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        conns.append(s)
    try:
        start = time.time()
        latencies = []
        while time.time() - start < 3:
            for s in conns:
                try:
                    s.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    pass
            t = time.time()
            assert requests.get(server.base + "/health", timeout=5).status_code == 200
            assert requests.get(server.base + "/metrics", timeout=5).status_code == 200
            latencies.append(time.time() - t)
            time.sleep(0.5)
        assert max(latencies) < 1.0, latencies
        assert_alive(server)
        # --request-head-timeout 2: every slow head was answered 408 and closed.
        time.sleep(0.5)
        for s in conns:
            s.settimeout(5)
            data = b""
            while True:
                try:
                    chunk = s.recv(4096)
                except (socket.timeout, ConnectionResetError):
                    break
                if not chunk:
                    break
                data += chunk
            assert data.startswith(b"HTTP/1.1 408"), data[:100]
            assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    finally:
        for s in conns:
            s.close()


def test_connection_cap_evicts_idle_connections(relay_bin):
    s = RelayServer(relay_bin, "--max-connections", "16")
    s.wait_ready()
    try:
        idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(64)]
        time.sleep(0.2)
        # 64 idle connections against a cap of 16: the longest idle ones were closed to let later
        # ones in, and a health check still gets through.
        assert requests.get(s.base + "/health", timeout=5).status_code == 200
        closed = 0
        for c in idle:
            c.settimeout(0.2)
            try:
                closed += c.recv(1) == b""
            except socket.timeout:
                pass
            c.close()
        assert closed >= 64 - 16
        assert_alive(s)
    finally:
        s.stop()


def test_oversized_bodies_and_heads_get_openai_errors(server):
    # 413 from the declared length alone: the server answers before the body is sent.
    out = raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000000\r\n\r\n{")
    status, err = error_body(out)
    assert status.startswith("HTTP/1.1 413") and err["code"] == "request_too_large"
    assert err["type"] == "invalid_request_error"
    out = raw(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n")
    status, err = error_body(out)
    assert status.startswith("HTTP/1.1 431") and err["code"] == "request_header_fields_too_large"
    out = raw(server, b"NOT HTTP\r\n\r\n")
    status, err = error_body(out)
    assert status.startswith("HTTP/1.1 400") and "malformed HTTP request" in err["message"]
    assert_alive(server)


def test_a_client_that_half_closes_after_sending_gets_its_answer(server):
    body = json.dumps({"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0}).encode()
    out = raw(server, http_post("/v1/completions", body), half_close=True, timeout=30)
    # An interim 100 Continue (the server's probe of a client it saw end its stream), then the answer.
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"), out[:200]
    answer = json.loads(out.partition(b"\r\n\r\nHTTP/1.1 200 OK\r\n")[2].partition(b"\r\n\r\n")[2])
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 8


def test_a_client_that_closes_has_its_request_aborted(server):
    before = server.metric("relay:request_success_total", finished_reason="abort")
    body = json.dumps({"model": MODEL, "prompt": "import os", "max_tokens": 3000, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(http_post("/v1/completions", body))
        time.sleep(0.5)
    m = server.wait_idle(timeout=15)
    assert m[f'relay:kv_cache_usage_perc{{model_name="{MODEL}"}}'] == 0
    assert server.metric("relay:request_success_total", finished_reason="abort") == before + 1


def test_a_request_cut_off_by_a_drain_fails_with_503(relay_bin):
    s = RelayServer(relay_bin, "--drain-timeout", "0.5")
    s.wait_ready()
    result = {}

    def long_request():
        r = requests.post(s.base + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "import os", "max_tokens": 3000, "ignore_eos": True})
        result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(1.0)
    s.proc.send_signal(signal.SIGTERM)
    t.join(30)
    assert s.proc.wait(30) == 0
    assert result["status"] == 503, result
    assert result["body"]["error"]["type"] == "service_unavailable"
