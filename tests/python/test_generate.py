"""`relay generate`: streams the same text the server answers for the same request, reports timing,
and honours its sampling options."""
import re
import subprocess

import pytest

from relay_server import MODEL, RelayServer


def generate(relay_bin, *args):
    r = subprocess.run([str(relay_bin), "generate", "--threads", "2", *map(str, args)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n")
    return r.stdout[:-1], r.stderr


@pytest.fixture(scope="module")
def client(relay_bin):
    s = RelayServer(relay_bin)
    s.wait_ready()
    yield s.client()
    assert s.stop() == 0


def test_greedy_text_equals_the_server(relay_bin, client):
    text, err = generate(relay_bin, "--prompt", "def fib(n):", "--max-tokens", 24, "--ignore-eos")
    served = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert text == served.choices[0].text
    m = re.search(r"prompt (\d+) tokens in [\d.]+ s \(([\d.]+) tok/s\); decode (\d+) tokens in [\d.]+ s "
                  r"\(([\d.]+) tok/s\); finish: length", err)
    assert m, err
    assert int(m.group(1)) == served.usage.prompt_tokens and int(m.group(3)) == 23
    assert float(m.group(2)) > 0 and float(m.group(4)) > 0


def test_chat_renders_the_template(relay_bin, client):
    text, _ = generate(relay_bin, "--prompt", "Write a sorting function.", "--chat", "--max-tokens", 12)
    served = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                            messages=[{"role": "user", "content": "Write a sorting function."}])
    assert text == served.choices[0].message.content


def test_seeded_sampling(relay_bin):
    args = ["--prompt", "import", "--max-tokens", 16, "--temperature", 1.0, "--top-p", 0.95, "--top-k", 40,
            "--min-p", 0.01]
    a, _ = generate(relay_bin, *args, "--seed", 11)
    b, _ = generate(relay_bin, *args, "--seed", 11)
    c, _ = generate(relay_bin, *args, "--seed", 12)
    assert a == b and a != c


def test_bad_options_fail_cleanly(relay_bin):
    r = subprocess.run([str(relay_bin), "generate", "--prompt", "x", "--model", "/nonexistent"], capture_output=True,
                       text=True)
    assert r.returncode != 0 and "relay: error:" in r.stderr
    r = subprocess.run([str(relay_bin), "generate"], capture_output=True, text=True)
    assert r.returncode != 0 and "--prompt" in r.stderr
    # --dtype picks the GPU's weight format; the CPU device computes in fp32 and says so.
    r = subprocess.run([str(relay_bin), "generate", "--prompt", "x", "--dtype", "fp8"], capture_output=True,
                       text=True)
    assert r.returncode != 0 and "--dtype fp8 is a GPU weight format" in r.stderr
    r = subprocess.run([str(relay_bin), "generate", "--prompt", "x", "--dtype", "fp4"], capture_output=True,
                       text=True)
    assert r.returncode != 0 and "--dtype" in r.stderr
    # --gpus places CUDA ranks; on the CPU device it is a mistake, said as such.
    r = subprocess.run([str(relay_bin), "generate", "--prompt", "x", "--tp", "2", "--gpus", "0,0"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "--gpus places ranks on CUDA devices; it needs --device cuda" in r.stderr
    # --enforce-eager turns the GPU's CUDA graphs off; the CPU device has none.
    r = subprocess.run([str(relay_bin), "generate", "--prompt", "x", "--enforce-eager"], capture_output=True,
                       text=True)
    assert r.returncode != 0 and "--enforce-eager turns the cuda device's CUDA graphs off" in r.stderr
