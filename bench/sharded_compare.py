#!/usr/bin/env python3
"""Sharded CUDA layouts against one GPU on the same checkpoint (issue 8, run 1): every position's logits
of a few prompts through `relay score`, and a greedy continuation through `relay generate`, for each
layout given, against the same on one GPU.

    python3 bench/sharded_compare.py --model /tmp/relay-bench-30b-a3b-12l --relay build-gpu/relay \
        --layout "tp2=--tp 2 --gpus 0,1" --layout "dp2ep2=--dp 2 --ep 2 --gpus 0,1" --out results.jsonl

One JSON line per layout ("mode": "sharded-compare") with the metrics of bench/hf_compare.py's compare
(top-1 agreement, max / mean |logit error|, relative L2, KL) over all positions, whether the greedy texts
are identical, and the wall time of each score run. Sharding changes which bf16 roundings happen (each rank
rounds its partial sums before the all-reduce), so the logits agree within bf16 noise, not bitwise; on
random weights near-ties make top-1 and greedy text the coarser measures.
"""
import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import hf_compare  # noqa: E402  (the prompt maker, `relay score` runner and metrics)

PROMPT = "def merge_sort(values):"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--relay", default=str(hf_compare.ROOT / "build" / "relay"))
    p.add_argument("--layout", action="append", required=True,
                   help="NAME=ARGS: the relay flags of one layout, e.g. 'tp2=--tp 2 --gpus 0,1' (repeat)")
    p.add_argument("--lengths", default="16,256,1024", help="prompt lengths (random token ids)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens generated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="append one JSON line per layout here")
    return p.parse_args()


def generate(relay, model, args, max_tokens):
    cmd = [relay, "generate", "--device", "cuda", "--model", model, "--prompt", PROMPT, "--max-tokens",
           str(max_tokens), "--ignore-eos", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{hf_compare.tail(r.stderr)}")
    return r.stdout


def main():
    a = parse_args()
    layouts = []
    for spec in a.layout:
        name, _, args = spec.partition("=")
        layouts.append((name, args.split()))
    lengths = [int(n) for n in a.lengths.split(",")]
    prompts, _ = hf_compare.make_prompts(a.model, lengths, a.seed)
    ok = True
    with tempfile.TemporaryDirectory() as work:
        work = pathlib.Path(work)
        prompts_path = work / "prompts.json"
        prompts_path.write_text(json.dumps(prompts))
        want, _, want_s = hf_compare.run_relay(a.relay, a.model, prompts_path, work / "one.f32", "cuda", [])
        want_text = generate(a.relay, a.model, [], a.max_tokens)
        for name, args in layouts:
            line = {"mode": "sharded-compare", "model": pathlib.Path(a.model).name, "layout": name,
                    "args": " ".join(args), "one_gpu_score_s": round(want_s, 3)}
            try:
                got, _, got_s = hf_compare.run_relay(a.relay, a.model, prompts_path, work / f"{name}.f32", "cuda",
                                                     args)
                overall, per_prompt = hf_compare.compare(want, got, "cuda")
                text = generate(a.relay, a.model, args, a.max_tokens)
                line.update(status="ok", score_s=round(got_s, 3), identical_greedy_text=text == want_text,
                            **overall, per_prompt=per_prompt)
                if text != want_text:
                    line.update(one_gpu_text=want_text, layout_text=text)
            except Exception as e:  # one layout failing must not hide the others
                ok = False
                line.update(status="failed", error=hf_compare.short_error(e))
            out = json.dumps(line)
            print(out, flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(out + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
