#!/usr/bin/env python3
"""Relay's logits against Hugging Face transformers on the same checkpoint (the GPU machine's check of the
12-layer benchmark model, bf16 and FP8).

    python3 bench/hf_compare.py --model /tmp/relay-bench-30b-a3b-12l --relay build-gpu/relay \
        [--fp8 /tmp/relay-bench-30b-a3b-12l-fp8] [--device cuda] --out results.jsonl

A few prompts of random token ids (fixed seed; lengths --lengths, default 16, 64, 256, 512) are scored by
`relay score` (every position's fp32 logits, written to a file) and by transformers
(AutoModelForCausalLM, bf16, attn_implementation --attn, one forward per prompt, use_cache=False). With
--fp8 QDIR (a `relay quantize --format fp8-block128` checkpoint) transformers loads QDIR through its own
FP8 integration (FineGrainedFP8: FP8Linear / FP8Expert modules running its triton block-scaled kernels),
and Relay scores QDIR with --dtype auto, which keeps an FP8 checkpoint's linears in FP8 on the GPU.

Comparisons, one JSON line each ("mode": "hf-compare") appended to --out:
  relay-bf16 vs hf-bf16    requirement: Relay's GPU logits against transformers' bf16
  relay-fp8  vs hf-fp8     requirement: Relay's FP8 against transformers' own FP8 execution
  hf-fp8     vs hf-bf16    context: transformers' own FP8 error, the scale to judge the line above by
  relay-fp8  vs hf-bf16    context: Relay's FP8 error against the same bf16 reference
  relay-fp8  vs hf-fp8-dequantized   only when transformers cannot run FP8 (its FP8 kernels, DeepGEMM and
                           the Triton finegrained-fp8 kernel, are Hub kernels loaded through the `kernels`
                           package in transformers 5.17): transformers' bf16 forward of the dequantised
                           FP8 weights (FineGrainedFP8Config(dequantize=True)), which leaves Relay's
                           activation quantisation as the difference; the FP8 failure is still recorded
Metrics over every prompt position (teacher forced), per prompt and overall: top-1 agreement (arg-max of
the candidate == arg-max of the reference), max and mean |logit error|, relative L2 error, and
KL(p_reference || p_candidate) of the next-token distributions in nats (mean and max). Each part runs in
its own try/except: a part that fails is recorded with the exception ("status": "failed") and the others
still run. Random weights give nearly flat distributions with near-ties, so top-1 agreement between two
correct bf16 implementations is well below 100%; KL and the logit errors are the sharper measures.
"""
import argparse
import json
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="bf16 checkpoint directory (HF layout)")
    p.add_argument("--relay", default=str(ROOT / "build" / "relay"), help="relay binary")
    p.add_argument("--fp8", help="the same checkpoint quantised by `relay quantize --format fp8-block128`")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="device for both sides")
    p.add_argument("--relay-device", choices=["cuda", "cpu"], help="Relay's device (default --device)")
    p.add_argument("--relay-arg", action="append", default=[],
                   help="extra argument for `relay score` (repeat: --relay-arg=--threads --relay-arg=2)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="transformers attention")
    p.add_argument("--lengths", default="16,64,256,512", help="prompt lengths (random token ids)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="append one JSON line per comparison here")
    p.add_argument("--workdir", help="where Relay's logits go (default a temporary directory, removed after)")
    return p.parse_args()


class PartFailed(Exception):
    """A comparison whose inputs failed earlier; the message already names the exception."""


def short_error(e):
    if isinstance(e, PartFailed):
        return str(e)[:4000]
    return f"{type(e).__name__}: {e}".strip()[:4000]


def tail(text, n=20):
    return "\n".join(text.strip().splitlines()[-n:])


def make_prompts(model_dir, lengths, seed):
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    vocab = int(config["vocab_size"])
    context = int(config.get("max_position_embeddings") or max(lengths))
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=min(n, context)).tolist() for n in lengths], vocab


def relay_version(relay):
    r = subprocess.run([relay, "--version"], capture_output=True, text=True, timeout=60)
    return (r.stdout or r.stderr).strip()


def run_relay(relay, model_dir, prompts_path, out_path, device, extra):
    """`relay score`; returns ([num_tokens, vocab] float32 arrays, sidecar, wall seconds)."""
    cmd = [relay, "score", "--model", str(model_dir), "--prompts", str(prompts_path), "--out", str(out_path),
           "--device", device, *extra]
    start = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    seconds = time.time() - start
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{tail(r.stderr)}")
    meta = json.loads(pathlib.Path(str(out_path) + ".json").read_text())
    rows = np.memmap(out_path, dtype="<f4", mode="r", shape=(meta["num_rows"], meta["vocab_size"]))
    logits = [rows[p["row_offset"]:p["row_offset"] + p["num_tokens"]] for p in meta["prompts"]]
    return logits, meta, seconds


def load_hf(model_dir, device, attn, quantized, dequantize=False, info=None):
    """transformers' model in bf16 on `device`; `info` gets what it loaded (FP8 modules, missing keys).
    dequantize=True loads an FP8 checkpoint with FineGrainedFP8Config(dequantize=True): bf16 weights."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = dict(dtype=torch.bfloat16, attn_implementation=attn, output_loading_info=True)
    if dequantize:
        from transformers import FineGrainedFP8Config

        kwargs["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    info = {} if info is None else info
    info.update(attn_implementation=attn, dequantize=dequantize)
    start = time.time()
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(str(model_dir), device_map=device, **kwargs)
        info["device_map"] = device
    except ImportError as e:  # device_map needs accelerate; a bf16 model loads without it
        if quantized:
            raise
        info["device_map_error"] = short_error(e)
        model, loading = AutoModelForCausalLM.from_pretrained(str(model_dir), **kwargs)
        model.to(device)
    model.eval()
    info["load_seconds"] = time.time() - start
    info["loading_info"] = {k: sorted(map(str, v))[:20] for k, v in loading.items() if v}
    info["num_missing_keys"] = len(loading.get("missing_keys", []))
    info["num_unexpected_keys"] = len(loading.get("unexpected_keys", []))
    classes = {}
    for module in model.modules():
        name = type(module).__name__
        if "FP8" in name.upper():
            classes[name] = classes.get(name, 0) + 1
    info["fp8_modules"] = classes
    info["fp8_parameters"] = sum(1 for p in model.parameters() if p.dtype == torch.float8_e4m3fn)
    info["parameter_dtypes"] = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    qc = getattr(model.config, "quantization_config", None)
    if qc is not None:
        info["quantization_config"] = qc if isinstance(qc, dict) else qc.to_dict()
    return model, info


def run_hf(model, prompts, device):
    """One forward per prompt; the logits of every position, on the host, in the dtype transformers gave."""
    import torch

    out, seconds = [], []
    with torch.inference_mode():
        for ids in prompts:
            start = time.time()
            logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0]
            out.append(logits.to("cpu"))
            seconds.append(time.time() - start)
    return out, seconds


def compare(reference, candidate, device):
    """Metrics of candidate against reference, per prompt and overall; both lists of [num_tokens, vocab]."""
    import torch

    per_prompt = []
    total = dict(n=0, agree=0, abs_sum=0.0, abs_max=0.0, kl_sum=0.0, kl_max=0.0, sq_err=0.0, sq_ref=0.0, count=0)
    def on_device(x):  # a torch tensor (transformers, maybe bf16) or a numpy array (Relay's float32 file)
        if not torch.is_tensor(x):
            x = torch.from_numpy(np.array(x, dtype=np.float32))  # a copy: the memmap is read-only
        return x.to(device=device, dtype=torch.float32)

    for ref, got in zip(reference, candidate):
        ref, got = on_device(ref), on_device(got)
        assert ref.shape == got.shape, (tuple(ref.shape), tuple(got.shape))
        err = (got - ref).abs()
        lp_ref, lp_got = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
        kl = (lp_ref.exp() * (lp_ref - lp_got)).sum(-1)
        agree = int((got.argmax(-1) == ref.argmax(-1)).sum())
        m = dict(num_tokens=int(ref.shape[0]), top1_agreement=agree / ref.shape[0],
                 max_abs_error=float(err.max()), mean_abs_error=float(err.mean()),
                 rel_l2_error=float((got - ref).norm() / ref.norm().clamp_min(1e-30)),
                 mean_kl=float(kl.mean()), max_kl=float(kl.max()), reference_logit_std=float(ref.std()))
        per_prompt.append(m)
        total["n"] += ref.shape[0]
        total["agree"] += agree
        total["abs_sum"] += float(err.double().sum())
        total["count"] += err.numel()
        total["abs_max"] = max(total["abs_max"], m["max_abs_error"])
        total["kl_sum"] += float(kl.double().sum())
        total["kl_max"] = max(total["kl_max"], m["max_kl"])
        total["sq_err"] += float((got - ref).double().pow(2).sum())
        total["sq_ref"] += float(ref.double().pow(2).sum())
    overall = dict(positions=total["n"], top1_agreement=total["agree"] / total["n"],
                   max_abs_error=total["abs_max"], mean_abs_error=total["abs_sum"] / total["count"],
                   rel_l2_error=(total["sq_err"] / max(total["sq_ref"], 1e-30)) ** 0.5,
                   mean_kl=total["kl_sum"] / total["n"], max_kl=total["kl_max"])
    return overall, per_prompt


def main():
    args = parse_args()
    relay = str(pathlib.Path(args.relay).resolve())
    relay_device = args.relay_device or args.device
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    prompts, vocab = make_prompts(args.model, lengths, args.seed)
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="hf-compare-", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    prompts_path = workdir / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))

    env = dict(host=platform.node(), relay=relay, relay_device=relay_device, hf_device=args.device,
               prompt_lengths=[len(p) for p in prompts], seed=args.seed, vocab_size=vocab)
    try:
        env["relay_version"] = relay_version(relay)
    except Exception as e:  # noqa: BLE001 - recorded, the comparison still runs
        env["relay_version"] = short_error(e)
    try:
        import torch
        import transformers

        env["torch"], env["transformers"] = torch.__version__, transformers.__version__
        env["device_name"] = (torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available()
                              else platform.processor() or "cpu")
        try:
            import triton

            env["triton"] = triton.__version__
        except Exception as e:  # noqa: BLE001
            env["triton"] = short_error(e)
        try:
            import importlib.metadata

            env["kernels"] = importlib.metadata.version("kernels")
        except Exception as e:  # noqa: BLE001 - transformers 5.17 loads its FP8 kernels through it
            env["kernels"] = short_error(e)
        try:
            import accelerate

            env["accelerate"] = accelerate.__version__
        except Exception as e:  # noqa: BLE001
            env["accelerate"] = short_error(e)
    except Exception as e:  # noqa: BLE001 - without torch only Relay's side can run; recorded below
        env["torch_error"] = short_error(e)
    print("hf-compare:", json.dumps(env, default=str), flush=True)

    records = []

    def record(compare_name, model_dir, relay_dtype, hf_dtype, fn, extra=None):
        rec = dict(mode="hf-compare", compare=compare_name, model=str(model_dir), relay_dtype=relay_dtype,
                   hf_dtype=hf_dtype, **env, **(extra or {}))
        try:
            overall, per_prompt = fn()
            rec.update(status="ok", **overall, per_prompt=per_prompt)
        except Exception as e:  # noqa: BLE001 - one failed part never loses the others
            rec.update(status="failed", error=short_error(e))
            if not isinstance(e, PartFailed):
                rec["traceback"] = tail(traceback.format_exc(), 12)
        records.append(rec)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
        return rec

    # Relay first (its own process, so its GPU memory is free again before transformers loads).
    relay_runs = {}
    parts = [("bf16", args.model)] + ([("fp8", args.fp8)] if args.fp8 else [])
    for name, model_dir in parts:
        try:
            logits, meta, seconds = run_relay(relay, model_dir, prompts_path, workdir / f"relay-{name}.f32",
                                              relay_device, args.relay_arg)
            relay_runs[name] = dict(logits=logits, seconds=seconds, load_seconds=meta.get("load_seconds"),
                                    compute_seconds=meta.get("compute_seconds"))
            print(f"hf-compare: relay {name}: {seconds:.1f} s", flush=True)
        except Exception as e:  # noqa: BLE001
            relay_runs[name] = dict(error=short_error(e))
            print(f"hf-compare: relay {name} failed: {short_error(e)}", flush=True)

    hf_runs = {}
    hf_parts = list(parts)
    for name, model_dir in hf_parts:
        model, info = None, {}
        try:
            if "torch_error" in env:
                raise RuntimeError(f"torch/transformers are not importable: {env['torch_error']}")
            model, _ = load_hf(model_dir, args.device, args.attn, quantized=name != "bf16",
                               dequantize=name == "fp8-dequantized", info=info)
            if name == "fp8" and not info["fp8_modules"] and not info["fp8_parameters"]:
                info["note"] = "transformers loaded no FP8 module: it dequantised the checkpoint"
            logits, seconds = run_hf(model, prompts, args.device)
            hf_runs[name] = dict(logits=logits, info=info, forward_seconds=seconds)
            print(f"hf-compare: transformers {name}: load {info['load_seconds']:.1f} s, forward "
                  f"{sum(seconds):.1f} s, FP8 modules {info['fp8_modules']}, missing keys "
                  f"{info['num_missing_keys']}", flush=True)
        except Exception as e:  # noqa: BLE001
            info.update(error=short_error(e), traceback=tail(traceback.format_exc(), 12))
            hf_runs[name] = dict(error=info["error"], info=info)
            print(f"hf-compare: transformers {name} failed: {short_error(e)}", flush=True)
            # NOTE: when transformers cannot run FP8 (its FP8 kernels come from the Hub through the
            # `kernels` package), its bf16 execution of the dequantised FP8 weights still separates
            # Relay's weight error from its activation-quantisation error; recorded as context only.
            if name == "fp8" and "torch_error" not in env:
                hf_parts.append(("fp8-dequantized", model_dir))
        finally:
            del model
            try:
                import gc

                import torch

                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            except Exception:  # noqa: BLE001
                pass

    def pair(candidate, reference):
        def fn():
            for label, run in (candidate, reference):
                if "error" in run:
                    raise PartFailed(f"{label} failed: {run['error']}")
            return compare(reference[1]["logits"], candidate[1]["logits"], args.device)
        return fn

    def details(relay_name=None, hf_names=()):
        out = {}
        if relay_name:
            run = relay_runs[relay_name]
            out["relay_seconds"] = run.get("seconds")
            out["relay_compute_seconds"] = run.get("compute_seconds")
        for h in hf_names:
            run = hf_runs[h]
            out[f"hf_{h.replace('-', '_')}_load"] = run.get("info")
            if "forward_seconds" in run:
                out[f"hf_{h.replace('-', '_')}_forward_seconds"] = run["forward_seconds"]
        return out

    relay_bf16, hf_bf16 = ("relay bf16", relay_runs["bf16"]), ("transformers bf16", hf_runs["bf16"])
    record("relay-bf16 vs hf-bf16", args.model, "bf16" if relay_device == "cuda" else "fp32", "bf16",
           pair(relay_bf16, hf_bf16), details("bf16", ["bf16"]))
    if args.fp8:
        relay_fp8, hf_fp8 = ("relay fp8", relay_runs["fp8"]), ("transformers fp8", hf_runs["fp8"])
        relay_fp8_dtype = "fp8" if relay_device == "cuda" else "fp32 (FP8 checkpoint dequantised)"
        record("relay-fp8 vs hf-fp8", args.fp8, relay_fp8_dtype, "fp8", pair(relay_fp8, hf_fp8),
               details("fp8", ["fp8"]))
        record("hf-fp8 vs hf-bf16", args.fp8, None, "fp8 vs bf16", pair(hf_fp8, hf_bf16), details(None, ["fp8"]))
        record("relay-fp8 vs hf-bf16", args.fp8, relay_fp8_dtype, "bf16", pair(relay_fp8, hf_bf16),
               details("fp8", []))
        if "fp8-dequantized" in hf_runs:
            hf_deq = ("transformers fp8-dequantized", hf_runs["fp8-dequantized"])
            record("relay-fp8 vs hf-fp8-dequantized", args.fp8, relay_fp8_dtype, "bf16 (FP8 weights dequantised)",
                   pair(relay_fp8, hf_deq), details("fp8", ["fp8", "fp8-dequantized"]))

    print("\nhf-compare summary (reference = the right-hand side; KL(p_ref || p_candidate) in nats)")
    print(f"  device {env.get('device_name')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
          f"prompts {env['prompt_lengths']} tokens")
    for rec in records:
        if rec["status"] != "ok":
            print(f"  {rec['compare']:<32} FAILED: {rec['error'].splitlines()[0][:300]}")
            continue
        print(f"  {rec['compare']:<32} top-1 {rec['top1_agreement']:.2%} of {rec['positions']}, "
              f"|err| max {rec['max_abs_error']:.3g} mean {rec['mean_abs_error']:.3g}, rel L2 "
              f"{rec['rel_l2_error']:.3g}, KL mean {rec['mean_kl']:.3g} max {rec['max_kl']:.3g}")
        for n, m in zip(rec["prompt_lengths"], rec["per_prompt"]):
            print(f"      {n:>5} tokens: top-1 {m['top1_agreement']:.2%}, |err| max {m['max_abs_error']:.3g} "
                  f"mean {m['mean_abs_error']:.3g}, KL mean {m['mean_kl']:.3g}")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if records and all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
