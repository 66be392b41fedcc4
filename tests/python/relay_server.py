"""Starting and driving a `relay serve` process for the end-to-end tests.

Each RelayServer runs the real binary on a free loopback port with its log in a temporary file,
waits for /health, and hands out `openai` clients (max_retries=0, so a 429/503 is seen as such).
A server started with --ssl-* options is reached over https given the CA (`ca_file`) and, for
mutual TLS, a client certificate (`client_cert`: (cert, key)).
"""
import os
import re
import signal
import socket
import ssl
import subprocess
import tempfile
import time

import httpx
import openai
import pytest
import requests

MODEL = "relay-demo-moe"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RelayServer:
    def __init__(self, relay_bin, *args, api_key=None, port=None, ca_file=None, client_cert=None):
        self.port = port or free_port()
        self.api_key = api_key
        self.ca_file = ca_file
        self.client_cert = client_cert
        # requests' TLS arguments (none over http).
        self.tls_kw = {"verify": ca_file, "cert": client_cert} if ca_file else {}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="relay-serve-", suffix=".log", delete=False)
        cmd = [str(relay_bin), "serve", "--port", str(self.port), "--threads", "2", *map(str, args)]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.base = f"{'https' if ca_file else 'http'}://127.0.0.1:{self.port}"

    def wait_ready(self, timeout=120, path="/health"):
        """Polls /health; returns every status seen before it answered 200. A router answers 503 there
        until its workers are up: wait for it on path="/version" (200 once it listens)."""
        seen = []
        deadline = time.time() + timeout
        while time.time() < deadline:
            assert self.proc.poll() is None, f"relay serve exited early:\n{self.log_text()}"
            try:
                r = requests.get(self.base + path, timeout=2, **self.tls_kw)
                seen.append(r.status_code)
                if r.status_code == 200:
                    return seen
            except requests.ConnectionError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"relay serve not ready after {timeout}s:\n{self.log_text()}")

    def ssl_context(self):
        """The client side of this server's TLS: its CA, and the client certificate if given."""
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.client_cert:
            context.load_cert_chain(*self.client_cert)
        return context

    def client(self, api_key=None, timeout=120):
        http_client = httpx.Client(verify=self.ssl_context(), timeout=timeout) if self.ca_file else None
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key or self.api_key or "unused",
                             max_retries=0, timeout=timeout, http_client=http_client)

    def metrics(self):
        """The /metrics samples as {'name{labels}': value}."""
        text = requests.get(self.base + "/metrics", timeout=10, **self.tls_kw).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def metric(self, name, **labels):
        label_text = ",".join([f'model_name="{MODEL}"'] + [f'{k}="{v}"' for k, v in labels.items()])
        return self.metrics()[f"{name}{{{label_text}}}"]

    def wait_idle(self, timeout=30, model=MODEL):
        """Waits until no request runs or waits and the KV pool is empty; returns the last sample."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            label = f'{{model_name="{model}"}}'
            idle = (m["relay:num_requests_running" + label] == 0 and m["relay:num_requests_waiting" + label] == 0
                    and m["relay:kv_cache_usage_perc" + label] == 0)
            if idle or time.time() > deadline:
                return m
            time.sleep(0.1)

    def log_text(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def stop(self, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.flush()
        return self.proc.returncode

    def __del__(self):
        if getattr(self, "proc", None) is not None and self.proc.poll() is None:
            self.proc.kill()
        if getattr(self, "log", None) is not None:
            self.log.close()
            try:
                os.unlink(self.log.name)
            except OSError:
                pass


def completion_text(client, prompt, max_tokens=16, **kw):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
    return r.choices[0].text


def access_log_lines(server, route, timeout=5.0):
    """The access-log lines of `route`. The server writes a request's line once its response is sent,
    so a client that has its answer may look before the line is there: waits up to `timeout` for one."""
    deadline = time.time() + timeout
    while True:
        lines = [l for l in server.log_text().splitlines() if re.search(rf'"(GET|POST) {re.escape(route)}"', l)]
        if lines or time.time() > deadline:
            return lines
        time.sleep(0.05)


def server_fixture(*args, **kwargs):
    """A module-scoped pytest fixture: a `relay serve` with these arguments, ready, stopped after."""
    @pytest.fixture(scope="module")
    def server(relay_bin):
        s = RelayServer(relay_bin, *args, **kwargs)
        s.wait_ready()
        yield s
        s.stop()
    return server
