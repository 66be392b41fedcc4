#!/usr/bin/env python3
"""Decode tok/s against batch size, bf16 and FP8, with each dtype's roofline, from `relay bench
--mode model` logs as the GPU run scripts write them: each run headed by a line `== NAME: relay bench
ARGS` (a run is FP8 when ARGS hold `--dtype fp8`), then its JSON lines; one bf16 run and one FP8
run of the same model on one GPU:

    python3 bench/plot_decode.py RESULTS.jsonl... --out docs/decode-throughput.png

The roofline of a batch is batch / read_roofline_ms (the step's bytes at the read-bandwidth
ceiling measured in the same run; lines from before that ceiling use the copy figure). Needs
matplotlib (pip install matplotlib==3.10.7); it is not one of the project's dependencies.
"""
import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_runs(paths):
    """(dtype, JSON line) for each JSON line, dtype from the run's header line."""
    for path in paths:
        dtype = "bf16"
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("== ") and "relay bench" in line:
                    dtype = "fp8" if "--dtype fp8" in line else "bf16"
                elif line.startswith("{"):
                    yield dtype, json.loads(line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=512, help="decode context to plot (default 512)")
    ap.add_argument("--title", default="")
    args = ap.parse_args()

    curves = defaultdict(dict)  # dtype -> batch -> (tok/s, roofline tok/s)
    basis = {}  # dtype -> the roofline's bandwidth ceiling
    device = ""
    for dtype, j in read_runs(args.results):
        if j.get("mode") != "decode" or j.get("context") != args.context:
            continue
        device = j.get("device", device)
        roof_ms = j.get("read_roofline_ms", j["roofline_ms"])
        basis[dtype] = "read bandwidth" if "read_roofline_ms" in j else "copy bandwidth"
        curves[dtype][j["batch"]] = (j["tok_per_s"], j["batch"] / (roof_ms / 1e3))

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    colors = {"bf16": "tab:blue", "fp8": "tab:orange"}
    for dt, points in sorted(curves.items()):
        batches = sorted(points)
        ax.plot(batches, [points[b][0] for b in batches], "o-", color=colors.get(dt), label=f"Relay {dt}")
        ax.plot(batches, [points[b][1] for b in batches], "--", color=colors.get(dt), alpha=0.6,
                label=f"{dt} roofline ({basis[dt]})")
        for b in batches:
            # the fraction of the roofline: bf16's below its point, FP8's above
            ax.annotate(f"{points[b][0] / points[b][1]:.2f}", (b, points[b][0]), textcoords="offset points",
                        xytext=(4, -12 if dt == "bf16" else 6), fontsize=7, color=colors.get(dt))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch (sequences)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(args.title or f"Decode throughput, context {args.context} ({device})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}: " + ", ".join(f"{dt} {sorted(p)}" for dt, p in curves.items()))


if __name__ == "__main__":
    main()
