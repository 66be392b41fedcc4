"""HTTPS and mutual TLS with vLLM's --ssl-keyfile/--ssl-certfile/--ssl-ca-certs/--ssl-cert-reqs, on a
throwaway CA made per run (tests/fixtures/make_test_certs.sh): the official openai client over https,
streaming included; plain HTTP to the TLS port refused without disturbing the server; --ssl-cert-reqs 2
refusing a client without a certificate the CA signed; and a disaggregated router and workers talking
mutual TLS to each other, with the shared secret's signatures on top."""
import subprocess
import time

import pytest
import requests

from conftest import FIXTURES
from relay_server import MODEL, RelayServer, completion_text


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    subprocess.run([str(FIXTURES / "make_test_certs.sh"), str(d)], check=True, capture_output=True)
    return d


def tls_args(certs, cert_reqs=None):
    args = ["--ssl-certfile", certs / "server.pem", "--ssl-keyfile", certs / "server.key"]
    if cert_reqs is not None:
        args += ["--ssl-ca-certs", certs / "ca.pem", "--ssl-cert-reqs", cert_reqs]
    return args


def pair(certs, name):
    return (str(certs / f"{name}.pem"), str(certs / f"{name}.key"))


def test_https_with_the_openai_client(relay_bin, certs):
    s = RelayServer(relay_bin, *tls_args(certs), ca_file=str(certs / "ca.pem"))
    try:
        s.wait_ready()
        client = s.client()
        text = completion_text(client, "def fibonacci(n):")
        assert text
        stream = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=16, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream) == text
        chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": "Hi"}])
        assert chat.choices[0].finish_reason in ("stop", "length")
        # Plain HTTP on the TLS port is closed unanswered; a client that does not trust the CA refuses the
        # server; neither disturbs it.
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{s.port}/health", timeout=5)
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(s.base + "/health", timeout=5)
        assert requests.get(s.base + "/health", timeout=5, **s.tls_kw).status_code == 200
    finally:
        assert s.stop() == 0, s.log_text()


def test_required_client_certificates(relay_bin, certs):
    s = RelayServer(relay_bin, *tls_args(certs, cert_reqs=2), ca_file=str(certs / "ca.pem"),
                    client_cert=pair(certs, "client"))
    try:
        s.wait_ready()
        assert completion_text(s.client(), "class Queue:")
        assert 'client "CN=relay-test-client"' in s.log_text()
        for cert in (None, pair(certs, "rogue")):
            with pytest.raises(requests.ConnectionError):
                requests.get(s.base + "/health", timeout=5, verify=str(certs / "ca.pem"), cert=cert)
        assert requests.get(s.base + "/health", timeout=5, **s.tls_kw).status_code == 200
    finally:
        assert s.stop() == 0, s.log_text()


def test_disaggregated_mutual_tls(relay_bin, certs, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef")
    # Every process serves with the server certificate, requires a certificate from the CA, and presents its
    # own to its peers; the shared secret still signs the control messages.
    common = [*tls_args(certs, cert_reqs=2), "--heartbeat-interval", 0.2, "--disagg-secret-file", secret]
    tls = {"ca_file": str(certs / "ca.pem"), "client_cert": pair(certs, "client")}
    router = RelayServer(relay_bin, "--role", "router", *common, api_key="router-key", **tls)
    servers = [router]
    try:
        router.wait_ready(path="/version")
        for role in ("prefill", "decode"):
            w = RelayServer(relay_bin, "--role", role, "--router", f"127.0.0.1:{router.port}", *common, **tls)
            servers.append(w)
            w.wait_ready()
        deadline = time.time() + 60
        while time.time() < deadline:
            listed = requests.get(router.base + "/disagg/workers", timeout=5, **router.tls_kw,
                                  headers={"Authorization": "Bearer router-key"}).json()
            if sum(w["up"] for w in listed) == 2:
                break
            time.sleep(0.1)
        assert sorted(w["role"] for w in listed if w["up"]) == ["decode", "prefill"], listed
        assert all(w["url"].startswith("https://") for w in listed)
        client = router.client()
        text = completion_text(client, "def fibonacci(n):")
        assert text
        stream = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=16, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream) == text
        # The workers saw the router's certificate on its control messages.
        assert 'client "CN=localhost"' in servers[1].log_text()
    finally:
        for s in reversed(servers):
            assert s.stop() == 0, s.log_text()
