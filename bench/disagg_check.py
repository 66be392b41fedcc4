"""Disaggregated serving on one machine, end to end, with the standard library only (so it runs on the
GPU machine as is): a colocated `relay serve` and a router + prefill + decode deployment on the same
device(s) answer the same greedy requests; the texts must be identical. Prints each KV hand-off the
prefill worker logged (tokens, bytes, copies, ms, GB/s) and the router's TTFT for a long prompt.

    python3 bench/disagg_check.py --relay build/relay [--device cuda] [--model DIR] [--long-prompt N]
        [--colocated-args "--gpu 0"] [--prefill-args "--tp 2 --gpus 0,1"] [--decode-args "--dp 2 --ep 2 --gpus 2,3"]

The --*-args strings (split on spaces) go to that server only: on a machine with several GPUs they
place the prefill and decode workers on different GPUs, each sharded its own way.
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, relay, args):
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen([relay, "serve", "--port", str(self.port), *map(str, args)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"

    def wait(self, path="/health", timeout=300):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"server exited: {self.text()}")
            try:
                with urllib.request.urlopen(self.base + path, timeout=2) as r:
                    if r.status == 200:
                        return json.loads(r.read() or b"{}")
            except OSError:
                pass
            time.sleep(0.1)
        sys.exit(f"server not ready: {self.text()}")

    def post(self, path, body):
        req = urllib.request.Request(self.base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def text(self):
        self.log.flush()
        return open(self.log.name).read()

    def stop(self):
        self.proc.terminate()
        self.proc.wait(60)


def complete(server, model, prompt, max_tokens):
    t0 = time.time()
    r = server.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                        "temperature": 0, "ignore_eos": True})
    return r["choices"][0]["text"], time.time() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--relay", default="build/relay")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="")
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--long-prompt", type=int, default=3000, help="token ids in the hand-off measurement")
    ap.add_argument("--out", default="")
    ap.add_argument("--colocated-args", default="", help="extra arguments of the colocated server")
    ap.add_argument("--prefill-args", default="", help="extra arguments of the prefill worker")
    ap.add_argument("--decode-args", default="", help="extra arguments of the decode worker")
    a = ap.parse_args()
    extra = {"colocated": a.colocated_args.split(), "prefill": a.prefill_args.split(),
             "decode": a.decode_args.split()}
    common = ["--device", a.device, "--num-kv-blocks", a.num_kv_blocks] + (["--model", a.model] if a.model else [])
    model = os.path.basename(os.path.normpath(a.model)) if a.model else "relay-demo-moe"
    prompts = ["def fibonacci(n):", "import os\n\ndef walk(path):", "class Stack:\n    def __init__(self):"]
    long_prompt = list(range(1000, 1000 + a.long_prompt))

    colocated = Server(a.relay, common + extra["colocated"])
    colocated.wait()
    want = [complete(colocated, model, p, 32)[0] for p in prompts]
    want_long, _ = complete(colocated, model, long_prompt, 8)
    colocated.stop()

    router = Server(a.relay, ["--role", "router"] + (["--model", a.model] if a.model else []))
    router.wait("/version")  # its /health is 503 until a prefill and a decode worker are up
    workers = [Server(a.relay, ["--role", role, "--router", f"127.0.0.1:{router.port}"] + common + extra[role])
               for role in ("prefill", "decode")]
    for w in workers:
        w.wait()
    deadline = time.time() + 30
    while sum(w["up"] for w in router.wait("/disagg/workers")) < 2 and time.time() < deadline:
        time.sleep(0.1)
    got = [complete(router, model, p, 32)[0] for p in prompts]
    got_long, long_s = complete(router, model, long_prompt, 8)
    _, warm_long_s = complete(router, model, long_prompt[::-1], 1)
    handoffs = re.findall(r"KV hand-off: (\d+) tokens, (\d+) bytes in (\d+) copies, ([\d.]+) ms \(([\d.]+) GB/s\)",
                          workers[0].text())
    for w in workers + [router]:
        w.stop()
    ok = got == want and got_long == want_long
    result = {"mode": "disagg_check", "device": a.device, "model": model, "identical_text": ok,
              "colocated_args": a.colocated_args, "prefill_args": a.prefill_args, "decode_args": a.decode_args,
              "requests": len(prompts) + 2, "long_prompt_tokens": a.long_prompt,
              "long_request_s": round(long_s, 4), "long_prompt_1_token_s": round(warm_long_s, 4),
              "handoffs": [{"tokens": int(t), "bytes": int(b), "copies": int(c), "ms": float(ms), "gbps": float(g)}
                           for t, b, c, ms, g in handoffs]}
    line = json.dumps(result)
    print(line)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")
    if not ok:
        for w, g in zip(want + [want_long], got + [got_long]):
            if w != g:
                print(f"MISMATCH\n  colocated:      {w!r}\n  disaggregated:  {g!r}")
        sys.exit(1)


if __name__ == "__main__":
    main()
