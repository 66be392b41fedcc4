"""`relay tokenize` against live Hugging Face `tokenizers` (pinned in scripts/requirements-test.txt)
on strings generated fresh for each run, so the check does not rest on committed data alone; also
--decode, invalid UTF-8 on stdin, and tokenizer.json variants (added-token flags, normalized added
tokens, ignore_merges, split behaviours) that the real Qwen3 file does not exercise.

The seed is printed on failure; RELAY_TOKENIZER_SEED=<n> repeats a run.
"""
import json
import os
import random
import shutil
import subprocess
import time

import pytest
from tokenizers import Tokenizer

from conftest import DEMO_MODEL

SEED = int(os.environ.get("RELAY_TOKENIZER_SEED", time.time_ns() % 1_000_000_007))
TOKENIZER_JSON = DEMO_MODEL / "tokenizer.json"

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
           "</tool_call>", "<|fim_prefix|>", "<|vision_pad|>", "<tool_response>"]
PIECES = ["the", "The", " quick", "fox's", "THEY'RE", "we'll", "I'm", "don't", "naïve", "café", "Straße",
          "東京", "中文字符", "한국어", "مرحبا", "हिंदी", "ภาษาไทย", "Привет", "😀", "👍🏽", "👨‍👩‍👧", "🏳️‍🌈",
          "def f(x):\n    return x * 2\n", "int main() { return 0; }", "{\"a\": [1, 2.5e-3]}", "\t", "  ",
          "\n", "\r\n", "\n\n\n", "\u00a0", "\u3000", "\u2028", "\u0085", "e\u0301", "a\u0315\u0300\u0316",
          "12345678901234567890", "3.14159", "1,000", "٣٤٥", "Ⅻ", "'s", "'S", "'ll", "'ſ"]


def random_string(rng):
    parts = []
    for _ in range(rng.randint(1, 14)):
        r = rng.random()
        if r < 0.45:
            parts.append(rng.choice(PIECES))
        elif r < 0.55:
            parts.append(rng.choice(SPECIAL))
        elif r < 0.75:
            plane = rng.choice([0, 0, 0, 1, 2, 3, 14])
            cps = [plane * 0x10000 + rng.randrange(0x10000) for _ in range(rng.randint(1, 6))]
            parts.append("".join(chr(cp) for cp in cps if not 0xD800 <= cp < 0xE000))
        elif r < 0.9:
            parts.append(" " * rng.randint(0, 6) + rng.choice(["x", "1", "!", "é", "中", ""]))
        else:
            parts.append("".join(chr(rng.randrange(32, 127)) for _ in range(rng.randint(1, 30))))
    return "".join(parts)


def run_relay(relay_bin, args, stdin: bytes) -> bytes:
    proc = subprocess.run([str(relay_bin), "tokenize", *args], input=stdin, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc.stdout


def relay_encode_batch(relay_bin, model_dir, texts, special_as_text=False):
    stdin = "".join(json.dumps(t) + "\n" for t in texts).encode()
    args = ["--model", str(model_dir), "--batch"] + (["--special-as-text"] if special_as_text else [])
    return [json.loads(line) for line in run_relay(relay_bin, args, stdin).decode().splitlines()]


def assert_same_ids(relay_ids, hf, texts, label):
    assert len(relay_ids) == len(texts)
    bad = [(t, r, e) for t, r, e in zip(texts, relay_ids, (hf.encode(t, add_special_tokens=False).ids for t in texts))
           if r != e]
    assert not bad, f"{label}: {len(bad)} of {len(texts)} differ (seed {SEED}); first: {bad[0]!r}"


@pytest.fixture(scope="module")
def hf():
    return Tokenizer.from_file(str(TOKENIZER_JSON))


def test_encode_matches_hf_on_fresh_random_strings(relay_bin, hf):
    rng = random.Random(SEED)
    texts = [random_string(rng) for _ in range(400)]
    assert_same_ids(relay_encode_batch(relay_bin, DEMO_MODEL, texts), hf, texts, "encode")
    hf.encode_special_tokens = True
    try:
        assert_same_ids(relay_encode_batch(relay_bin, DEMO_MODEL, texts, special_as_text=True), hf, texts,
                        "encode with special tokens as text")
    finally:
        hf.encode_special_tokens = False


def test_encode_raw_invalid_utf8_on_stdin(relay_bin, hf):
    rng = random.Random(SEED + 1)
    for _ in range(8):
        raw = b"".join(rng.choice([bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))),
                                   random_string(rng).encode(), "😀".encode()[: rng.randint(1, 3)]])
                       for _ in range(rng.randint(1, 6)))
        got = json.loads(run_relay(relay_bin, ["--model", str(DEMO_MODEL)], raw))
        expected = hf.encode(raw.decode("utf-8", errors="replace"), add_special_tokens=False).ids
        assert got == expected, f"seed {SEED}: {raw!r}"


def test_decode_matches_hf(relay_bin, hf):
    rng = random.Random(SEED + 2)
    vocab = hf.get_vocab_size(with_added_tokens=True)
    id_lists = [[rng.randrange(vocab + 200) for _ in range(rng.randint(1, 30))] for _ in range(200)]
    id_lists += [hf.encode(random_string(rng), add_special_tokens=False).ids for _ in range(100)]
    stdin = "".join(json.dumps(ids) + "\n" for ids in id_lists).encode()
    for skip in (False, True):
        args = ["--model", str(DEMO_MODEL), "--batch", "--decode"] + (["--skip-special-tokens"] if skip else [])
        # split("\n"), not splitlines(): decoded text may hold U+2028 or U+0085, which JSON leaves raw.
        got = [json.loads(line) for line in run_relay(relay_bin, args, stdin).decode().split("\n")[:-1]]
        expected = [hf.decode(ids, skip_special_tokens=skip) for ids in id_lists]
        bad = [(i, g, e) for i, g, e in zip(id_lists, got, expected) if g != e]
        assert len(got) == len(expected) and not bad, f"seed {SEED}, skip={skip}: {bad[:1]!r}"
    # Plain (non-batch) decode writes the raw text.
    ids = hf.encode("héllo <|im_end|> 😀", add_special_tokens=False).ids
    assert run_relay(relay_bin, ["--decode"], json.dumps(ids).encode()).decode() == "héllo <|im_end|> 😀"


def test_help_and_errors(relay_bin, tmp_path):
    help_text = subprocess.run([str(relay_bin), "tokenize", "--help"], capture_output=True, text=True).stdout
    for option in ("--model", "--decode", "--skip-special-tokens", "--special-as-text", "--batch"):
        assert option in help_text
    proc = subprocess.run([str(relay_bin), "tokenize", "--model", str(tmp_path)], input=b"x", capture_output=True)
    assert proc.returncode == 1 and b"tokenizer.json: cannot open" in proc.stderr
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    proc = subprocess.run([str(relay_bin), "tokenize", "--model", str(tmp_path)], input=b"x", capture_output=True)
    assert proc.returncode == 1 and b"is not valid JSON" in proc.stderr


def variant(tmp_path, name, edit):
    doc = json.loads(TOKENIZER_JSON.read_text())
    edit(doc)
    d = tmp_path / name
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False))
    return d, Tokenizer.from_file(str(d / "tokenizer.json"))


def edit_added_flags(doc):
    tokens = {t["content"]: t for t in doc["added_tokens"]}
    tokens["<think>"]["lstrip"] = True
    tokens["</think>"]["rstrip"] = True
    tokens["<tool_call>"]["single_word"] = True
    tokens["</tool_call>"].update(lstrip=True, rstrip=True, single_word=True)
    tokens["<|im_start|>"]["normalized"] = True
    next_id = max(t["id"] for t in doc["added_tokens"]) + 1
    for i, content in enumerate(["Cafe\u0301", "ångström", " spaced "]):  # normalised added tokens
        doc["added_tokens"].append({"id": next_id + i, "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": True, "special": False})


def edit_split(behavior, invert):
    def edit(doc):
        split = doc["pre_tokenizer"]["pretokenizers"][0]
        split["behavior"], split["invert"] = behavior, invert
    return edit


VARIANTS = {
    "added_flags": edit_added_flags,
    "ignore_merges": lambda doc: doc["model"].update(ignore_merges=True),
    "no_normalizer": lambda doc: doc.update(normalizer=None),
    "removed": edit_split("Removed", False),
    "merged_prev": edit_split("MergedWithPrevious", False),
    "merged_next_inverted": edit_split("MergedWithNext", True),
    "contiguous": edit_split("Contiguous", False),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_tokenizer_json_variants_match_hf(relay_bin, tmp_path, name):
    model_dir, hf_variant = variant(tmp_path, name, VARIANTS[name])
    rng = random.Random(SEED + 3)
    texts = [random_string(rng) for _ in range(150)]
    texts += ["a <think> b</think>  c", "x<tool_call>y <tool_call> z", "  </tool_call>  w", "Café Cafe\u0301!",
              "Ångström ångström", "a spaced b", "<|im_start|>user", "word<think>", "\t<think>\t",
              "\U00013c7e</tool_call>", "</tool_call>\U00013c7e"]  # Unicode 16 letters are word characters
    assert_same_ids(relay_encode_batch(relay_bin, model_dir, texts), hf_variant, texts, name)
