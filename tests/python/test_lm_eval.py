"""lm-eval's loglikelihood path (its `local-completions` model, as `lm_eval --model local-completions` runs it)
against the server, checked against `relay score`.

lm-eval scores (context, continuation) pairs by sending the token ids of context + continuation to
/v1/completions with echo, logprobs 1 and max_tokens 1, several prompts per request, and summing the
prompt logprobs of the continuation. It finds the server's tokenizer through /tokenizer_info and
/tokenize (its remote tokenizer). Before prompt logprobs existed the server returned logprobs for the
generated token only, so every loglikelihood came out 0 and every task scored perfect accuracy.
"""
import json
import subprocess

import lm_eval.models.openai_completions as lm_eval_api
import numpy as np
import pytest
from lm_eval.api.instance import Instance
from tokenizers import Tokenizer

from conftest import DEMO_MODEL
from relay_server import MODEL, server_fixture

PAIRS = [
    ("def fibonacci(n):\n    if n <", " 2:\n        return n"),
    ("import numpy as np\n\nx = np.", "zeros(3)"),
    ("class Stack:\n    def push(self, item):\n        self.items.", "append(item)"),
    ("for i in range(10):\n    print(", "i)"),
    ("The capital of France is", " Paris"),
]


server = server_fixture()


def relay_score_loglikelihoods(relay_bin, tmp_path, pairs):
    """Each pair's continuation logprob and greediness from `relay score`'s fp32 logits, with the
    ids lm-eval makes (the context's trailing whitespace moved to the continuation, the context
    encoded alone, the continuation the rest of the whole's encoding)."""
    tok = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    prompts, ctxlens = [], []
    for context, continuation in pairs:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        ctx = tok.encode(context, add_special_tokens=False).ids
        whole = tok.encode(context + continuation, add_special_tokens=False).ids
        prompts.append(ctx + whole[len(ctx):])
        ctxlens.append(len(ctx))
    prompts_path = tmp_path / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    out = tmp_path / "logits.f32"
    r = subprocess.run([str(relay_bin), "score", "--prompts", str(prompts_path), "--out", str(out), "--threads",
                        "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    meta = json.loads(out.with_name(out.name + ".json").read_text())
    rows = np.fromfile(out, dtype="<f4").reshape(meta["num_rows"], meta["vocab_size"]).astype(np.float64)
    results = []
    for ids, ctxlen, p in zip(prompts, ctxlens, meta["prompts"]):
        logits = rows[p["row_offset"]:p["row_offset"] + p["num_tokens"]]
        logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        total, greedy = 0.0, True
        for pos in range(ctxlen, len(ids)):
            total += logprobs[pos - 1, ids[pos]]
            greedy = greedy and int(np.argmax(logprobs[pos - 1])) == ids[pos]
        results.append((total, greedy))
    return results


def test_lm_eval_loglikelihood_equals_relay_score(relay_bin, server, tmp_path):
    lm = lm_eval_api.LocalCompletionsAPI(base_url=server.base + "/v1/completions", model=MODEL, batch_size=3,
                                         num_concurrent=1, max_retries=1)
    # /tokenizer_info and /tokenize answer, so lm-eval uses the server's own tokenizer.
    assert lm.tokenizer_backend == "remote"
    # One continuation the model itself would write (greedy), so both verdicts of is_greedy occur.
    context = "def add(a, b):"
    greedy = server.client().completions.create(model=MODEL, prompt=context, max_tokens=3, temperature=0)
    pairs = PAIRS + [(context, greedy.choices[0].text)]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    want = relay_score_loglikelihoods(relay_bin, tmp_path, pairs)
    assert want[-1][1] and not all(g for _, g in want)
    for (got_lp, got_greedy), (want_lp, want_greedy), pair in zip(got, want, pairs):
        assert got_lp < 0, pair  # the bug this guards against: every loglikelihood was 0
        assert abs(got_lp - want_lp) <= 1e-3 + 1e-4 * abs(want_lp), (pair, got_lp, want_lp)
        assert got_greedy == want_greedy, pair
    # lm-eval batched its prompts (batch_size 3): 6 pairs in 2 requests (after the one above).
    lines = [l for l in server.log_text().splitlines() if '"POST /v1/completions" 200' in l]
    assert len(lines) == 1 + 2, lines
