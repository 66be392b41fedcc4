#!/usr/bin/env python3
"""PyTorch's peers of Relay's kernels, timed on the same GPU in the same run as `relay bench`.

Run on the GPU machine (torch 2.11 there): python3 bench/torch_peers.py [--out FILE]. One JSON line
per result, the same shapes as `relay bench --mode kernels`:
  prefill attention  causal GQA 32/4, head_dim 128 (cuDNN and FlashAttention backends of SDPA)
  decode attention   one query per sequence, contiguous KV (SDPA), GB/s of KV read
  grouped GEMM       torch._grouped_mm, 4096 tokens top-8 over 128 experts (30B shapes) vs torch.mm
                     at equal FLOPs; and one row per expert (235B shapes), GB/s of expert weights
Timings are medians of triton.testing.do_bench (CUDA events) on random bf16 data.
"""
import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench


def emit(out, **kw):
    kw["device"] = torch.cuda.get_device_name()
    kw["torch"] = torch.__version__
    line = json.dumps(kw)
    print(line, flush=True)
    if out:
        out.write(line + "\n")
        out.flush()


def median_ms(fn):
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def prefill_attention(out, lengths):
    for backend, name in [(SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION, "flash")]:
        for n in lengths:
            q = torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, 4, n, 128, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(1, 4, n, 128, device="cuda", dtype=torch.bfloat16)
            try:
                with sdpa_kernel(backend):
                    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    fn()
                    ms = median_ms(fn)
            except RuntimeError as e:  # a backend that refuses the shape is reported, not fatal
                emit(out, mode="torch_peer", kernel="prefill_attention", backend=name, tokens=n, error=str(e)[:200])
                continue
            flops = 4.0 * 32 * 128 * n * n / 2
            emit(out, mode="torch_peer", kernel="prefill_attention", backend=name, tokens=n, ms=ms,
                 tflops=flops / (ms * 1e9))


def decode_attention(out, cases):
    for batch, ctx in cases:
        q = torch.randn(batch, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, 4, ctx, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch, 4, ctx, 128, device="cuda", dtype=torch.bfloat16)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        fn()
        ms = median_ms(fn)
        kv_bytes = 2.0 * batch * ctx * 4 * 128 * 2
        emit(out, mode="torch_peer", kernel="decode_attention", backend="sdpa", batch=batch, context=ctx, ms=ms,
             gbps=kv_bytes / (ms * 1e6))


def grouped_mm(out):
    experts, top_k, tokens = 128, 8, 4096
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).flatten()
    counts = torch.bincount(ids, minlength=experts)
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    rows = tokens * top_k
    for name, n, k in [("gate_up", 1536, 2048), ("down", 2048, 768)]:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        wt = w.transpose(-2, -1)
        fn = lambda: torch._grouped_mm(x, wt, offs=offs)
        fn()
        ms = median_ms(fn)
        dense = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        dms = median_ms(lambda: torch.mm(x, dense))
        flops = 2.0 * rows * n * k
        emit(out, mode="torch_peer", kernel="moe_grouped_gemm_prefill", backend="torch._grouped_mm", shape=name,
             tokens=tokens, n=n, k=k, ms=ms, tflops=flops / (ms * 1e9), dense_mm_tflops=flops / (dms * 1e9))
    # One row per active expert, 235B gate_up shapes: a weight-streaming problem.
    n, k = 3072, 4096
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    for active in (128, 16, 8):
        counts = torch.zeros(experts, dtype=torch.int64)
        counts[torch.arange(active) * (experts // active)] = 1
        offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
        x = torch.randn(active, k, device="cuda", dtype=torch.bfloat16)
        wt = w.transpose(-2, -1)
        fn = lambda: torch._grouped_mm(x, wt, offs=offs)
        fn()
        ms = median_ms(fn)
        emit(out, mode="torch_peer", kernel="moe_grouped_gemm_decode", backend="torch._grouped_mm",
             shape=f"235b_gate_up_{active}x1", active_experts=active, ms=ms, gbps=active * n * k * 2 / (ms * 1e6))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    out = open(a.out, "a") if a.out else None
    torch.manual_seed(0)
    prefill_attention(out, [8192] if a.quick else [4096, 8192, 16384])
    decode_attention(out, [(64, 4096)] if a.quick else [(1, 4096), (64, 4096), (256, 4096), (64, 16384)])
    grouped_mm(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
