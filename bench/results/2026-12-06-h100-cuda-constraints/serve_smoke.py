# On the GPU machine: relay serve --device cuda on the demo model, and the same on the CPU; a
# json_schema request, a logit_bias request, a forced tool call and an echo + logprobs scoring
# request on both; prints what each returned and the largest prompt-logprob difference.
import json, subprocess, sys, time, urllib.request

relay = sys.argv[1]
def start(device, port):
    return subprocess.Popen([relay, "serve", "--model", "models/relay-demo-moe", "--device", device,
                             "--port", str(port), "--max-num-seqs", "8"],
                            stdout=subprocess.DEVNULL, stderr=open(f"/tmp/serve-{device}.log", "w"))
def post(port, path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
def wait(port):
    for _ in range(240):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200: return True
        except Exception: time.sleep(0.5)
    return False
procs = {"cuda": (start("cuda", 8101), 8101), "cpu": (start("cpu", 8102), 8102)}
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
          "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False}
reqs = {
  "json_schema": ("/v1/chat/completions", {"model": "relay-demo-moe", "max_tokens": 60, "temperature": 0,
      "messages": [{"role": "user", "content": "Give a person as JSON."}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}),
  "logit_bias": ("/v1/completions", {"model": "relay-demo-moe", "prompt": "Hello", "max_tokens": 4, "temperature": 0,
      "logit_bias": {"87": 100}}),
  "tool_required": ("/v1/chat/completions", {"model": "relay-demo-moe", "max_tokens": 80, "temperature": 0,
      "messages": [{"role": "user", "content": "weather in Paris?"}], "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
          "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]}),
  "score": ("/v1/completions", {"model": "relay-demo-moe", "prompt": "The quick brown fox jumps over the lazy dog",
      "max_tokens": 0, "echo": True, "logprobs": 1}),
}
out = {}
try:
    for dev, (p, port) in procs.items():
        ok = wait(port)
        print(dev, "up", ok, flush=True)
        if not ok: continue
        for name, (path, body) in reqs.items():
            out[(dev, name)] = post(port, path, body)
            st, js = out[(dev, name)]
            print(dev, name, st, json.dumps(js)[:400], flush=True)
    for name in ["json_schema"]:
        for dev in procs:
            st, js = out.get((dev, name), (0, {}))
            if st == 200:
                txt = js["choices"][0]["message"]["content"]
                try: print(dev, "schema output parses:", json.loads(txt))
                except Exception as e: print(dev, "schema output does NOT parse:", txt, e)
    a = out.get(("cuda", "score")); b = out.get(("cpu", "score"))
    if a and b and a[0] == 200 and b[0] == 200:
        la = a[1]["choices"][0]["logprobs"]["token_logprobs"]; lb = b[1]["choices"][0]["logprobs"]["token_logprobs"]
        d = max(abs(x - y) for x, y in zip(la[1:], lb[1:]))
        print("score rows", len(la), "max |cuda - cpu| prompt logprob", d, "sum cuda", sum(la[1:]), "sum cpu", sum(lb[1:]))
finally:
    for p, _ in procs.values(): p.terminate()
