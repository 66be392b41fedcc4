"""Encode throughput of Relay's tokenizer vs Hugging Face `tokenizers`, single thread, same text.

Each text is encoded two ways by both: as one string, and as documents of about 2 kB (cut at line
ends; one encode call each, as a server sees prompts). Relay runs through `relay tokenize --stats`
(which times the encode calls alone, after loading; --batch for documents), HF through
Tokenizer.encode(text, add_special_tokens=False) with its thread pool limited to one thread. The
ids are compared too, so a fast wrong answer shows. Times are CPU times (the machine may be busy). Texts: the conformance corpus (prose, code, CJK,
emoji, ... joined by newlines) and Python source from the standard library, about --megabytes each.

Usage: python3 bench/tokenizer_bench.py [--relay build/relay] [--megabytes 4] [--repeats 3]
"""
import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import time

os.environ["RAYON_NUM_THREADS"] = "1"  # before tokenizers starts its pool
os.environ["TOKENIZERS_PARALLELISM"] = "false"
from tokenizers import Tokenizer  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "relay-demo-moe"


def corpus_text(size):
    corpus = json.loads((ROOT / "tests" / "fixtures" / "tokenizer" / "corpus.json").read_text())
    text = "\n".join(c["t"] for c in corpus["cases"] if "t" in c)
    return (text * (size // len(text) + 1))[:size]


def python_source(size):
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(stdlib.rglob("*.py")):
        try:
            s = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(s)
        total += len(s)
        if total >= size:
            break
    return "".join(parts)[:size]


def documents(text, size=2000):
    docs, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        docs.append(text[start:end])
        start = end
    return docs


def relay_encode(relay, docs):
    """Ids per document and the seconds Relay spent in encode calls."""
    args = [relay, "tokenize", "--model", str(MODEL), "--stats"]
    if len(docs) == 1:
        proc = subprocess.run(args, input=docs[0].encode(), capture_output=True, check=True)
        ids = [json.loads(proc.stdout)]
    else:
        stdin = "".join(json.dumps(d) + "\n" for d in docs).encode()
        proc = subprocess.run(args + ["--batch"], input=stdin, capture_output=True, check=True)
        ids = [json.loads(line) for line in proc.stdout.decode().split("\n")[:-1]]
    ms = float(re.search(r"in ([0-9.]+) ms", proc.stderr.decode()).group(1))
    return ids, ms / 1e3


def hf_encode(hf, docs):
    start = time.process_time()
    ids = [hf.encode(d, add_special_tokens=False).ids for d in docs]
    return ids, time.process_time() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--relay", default=str(ROOT / "build" / "relay"))
    parser.add_argument("--megabytes", type=float, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size = int(args.megabytes * 1e6)
    hf = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    ok = True
    for name, text in (("corpus", corpus_text(size)), ("python source", python_source(size))):
        num_bytes = len(text.encode())
        for mode, docs in (("one string", [text]), ("2 kB docs", documents(text))):
            relay_s, hf_s = [], []
            for _ in range(args.repeats):  # interleaved, so machine load hits both alike
                relay_ids, seconds = relay_encode(args.relay, docs)
                relay_s.append(seconds)
                hf_ids, seconds = hf_encode(hf, docs)
                hf_s.append(seconds)
            same = relay_ids == hf_ids
            ok &= same
            relay_mbs, hf_mbs = num_bytes / 1e6 / min(relay_s), num_bytes / 1e6 / min(hf_s)
            print(f"{name:13s} {mode:10s} {num_bytes / 1e6:5.2f} MB, {sum(map(len, hf_ids)):8d} tokens: "
                  f"relay {relay_mbs:6.2f} MB/s, hf {hf_mbs:6.2f} MB/s, relay/hf {relay_mbs / hf_mbs:5.2f}x, "
                  f"ids {'identical' if same else 'DIFFER'}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
