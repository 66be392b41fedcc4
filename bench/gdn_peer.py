#!/usr/bin/env python3
"""flash-linear-attention's Gated DeltaNet kernels on the shapes `relay bench --mode kernels` times
for Relay's (its "gated_delta_rule" lines): Qwen3.5-35B-A3B's heads (16 key heads repeated to 32
value heads, as transformers does before calling FLA; head dim 128), one layer.

    python3 bench/gdn_peer.py [--out FILE]

Needs torch with CUDA and fla-core (+ einops; pure Python over Triton); prints one JSON line per
shape, as bench/torch_peers.py does (its emit and median_ms): chunk_gated_delta_rule on prompts of
one 4096- and one 16384-token sequence and eight of 512 (varlen), and
fused_recurrent_gated_delta_rule on decode steps of 1, 64 and 256 sequences with their fp32 states.
"""
import argparse

import torch
import torch.nn.functional as F
from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

from torch_peers import emit, median_ms  # beside this script

HK, HV, D = 16, 32, 128


def inputs(seqs, length):
    t = seqs * length
    q = torch.randn(1, t, HK, D, device="cuda", dtype=torch.bfloat16).repeat_interleave(HV // HK, dim=2)
    k = torch.randn(1, t, HK, D, device="cuda", dtype=torch.bfloat16).repeat_interleave(HV // HK, dim=2)
    v = torch.randn(1, t, HV, D, device="cuda", dtype=torch.bfloat16)
    a_log = torch.log(1 + 0.25 * torch.arange(HV, device="cuda", dtype=torch.float32))
    g = -a_log.exp() * F.softplus(2 * torch.rand(1, t, HV, device="cuda") - 1)
    beta = torch.rand(1, t, HV, device="cuda", dtype=torch.bfloat16).sigmoid()
    h0 = torch.zeros(seqs, HV, D, D, device="cuda", dtype=torch.float32)
    cu = torch.arange(0, t + 1, length, device="cuda", dtype=torch.long) if seqs > 1 else None
    return q, k, v, g, beta, h0, cu


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="append the JSON lines to this file too")
    args = ap.parse_args()
    out = open(args.out, "a") if args.out else None
    for seqs, length in [(1, 4096), (1, 16384), (8, 512)]:
        q, k, v, g, beta, h0, cu = inputs(seqs, length)
        ms = median_ms(lambda: chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0,
                                                      output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu))
        emit(out, peer="fla", kernel="chunk_gated_delta_rule", seqs=seqs, tokens_per_seq=length, ms=ms,
             tok_per_s=seqs * length / (ms * 1e-3))
    for batch in [1, 64, 256]:
        q, k, v, g, beta, h0, _ = inputs(batch, 1)
        q, k, v, g, beta = (x.transpose(0, 1).contiguous() for x in (q, k, v, g, beta))  # [batch, 1, ...]
        ms = median_ms(lambda: fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0,
                                                                output_final_state=True,
                                                                use_qk_l2norm_in_kernel=True))
        emit(out, peer="fla", kernel="fused_recurrent_gated_delta_rule", seqs=batch, tokens_per_seq=1, ms=ms,
             gbps=2.0 * batch * HV * D * D * 4 / (ms * 1e6))


if __name__ == "__main__":
    main()
