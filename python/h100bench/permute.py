"""Fused MoE token permutation kernels on one GPU: how fast the passes Prism adds around an MoE
layer's experts (`moe_permute_*`, `moe_sort_*`) can run when each is one kernel, as
Megatron-Core's `moe_permute_fusion` runs them (Transformer Engine's Triton kernels, not
available here: these are stand-ins written for the measurement).

Usage: python3 python/h100bench/permute.py OUTDIR   (about 15 s on an H100)

Writes OUTDIR/permute.json: for GPT-OSS 120B (hidden 2880, top-4) and Qwen3 30B-A3B (hidden
2048, top-8) at 4,096 tokens, the GPU time (20 calls in a CUDA graph) of
- `permute`: gather each token's top-k copies into expert order (reads the tokens, writes
  tokens x top_k rows);
- `unpermute`: for each token, the probability-weighted sum of its top-k expert outputs (reads
  the copies, writes the tokens);
- `sort`: reorder rows by a permutation (reads and writes the copies; Megatron-Core's
  `sort_chunks_by_idxs`);
- `copy`: a plain device copy of the copies' bytes, for reference;
with the bytes Prism prices each pass at.
"""

import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graphed_us  # noqa: E402

DEV = "cuda"


@triton.jit
def gather_rows(src, idx, dst, h, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    s = tl.load(idx + row)
    for start in range(0, h, BLOCK):
        off = start + tl.arange(0, BLOCK)
        m = off < h
        v = tl.load(src + s * h + off, mask=m)
        tl.store(dst + row * h + off, v, mask=m)


@triton.jit
def weighted_sum_rows(src, pos, w, dst, h, K: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0)
    for start in range(0, h, BLOCK):
        off = start + tl.arange(0, BLOCK)
        m = off < h
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(K):
            p = tl.load(pos + tok * K + j)
            wj = tl.load(w + tok * K + j)
            acc += wj * tl.load(src + p * h + off, mask=m).to(tl.float32)
        tl.store(dst + tok * h + off, acc.to(tl.bfloat16), mask=m)


def case(hidden, topk, tokens, experts):
    torch.manual_seed(0)
    pairs = tokens * topk
    x = torch.randn(tokens, hidden, device=DEV, dtype=torch.bfloat16)
    # Random top-k routing; copies sorted by expert.
    expert = torch.stack([torch.randperm(experts, device=DEV)[:topk] for _ in range(tokens)])
    order = torch.argsort(expert.reshape(-1), stable=True)
    src_token = (order // topk).to(torch.int64)
    pos = torch.empty(pairs, device=DEV, dtype=torch.int64)
    pos[order] = torch.arange(pairs, device=DEV)
    w = torch.rand(tokens, topk, device=DEV, dtype=torch.float32)
    xp = torch.empty(pairs, hidden, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(pairs, hidden, device=DEV, dtype=torch.bfloat16)
    out = torch.empty(tokens, hidden, device=DEV, dtype=torch.bfloat16)
    ys = torch.empty_like(y)
    perm = torch.randperm(pairs, device=DEV)
    block = 1024
    permute = graphed_us(lambda: gather_rows[(pairs,)](x, src_token, xp, hidden, BLOCK=block))
    unpermute = graphed_us(lambda: weighted_sum_rows[(tokens,)](y, pos, w, out, hidden, K=topk,
                                                                BLOCK=block))
    sort = graphed_us(lambda: gather_rows[(pairs,)](y, perm, ys, hidden, BLOCK=block))
    copy = graphed_us(lambda: ys.copy_(y))
    # Check the kernels against PyTorch once.
    assert torch.equal(xp, x[src_token])
    ref = torch.zeros(tokens, hidden, device=DEV, dtype=torch.float32)
    ref.index_add_(0, src_token, y[torch.arange(pairs, device=DEV)].float()
                   * w.reshape(-1)[order].unsqueeze(1))
    err = (out.float() - ref).abs().max().item()
    row = 2 * hidden
    return {
        "hidden": hidden, "topk": topk, "tokens": tokens, "experts": experts,
        "permute_us": permute, "permute_bytes": (tokens + pairs) * row,
        "unpermute_us": unpermute, "unpermute_bytes": (tokens + pairs) * row,
        "sort_us": sort, "sort_bytes": 2 * pairs * row,
        "copy_us": copy, "copy_bytes": 2 * pairs * row,
        "unpermute_max_abs_err": err,
    }


def main():
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__,
           "gpt-oss-120b": case(2880, 4, 4096, 128),
           "qwen3-30b-a3b": case(2048, 8, 4096, 128)}
    for k in ("gpt-oss-120b", "qwen3-30b-a3b"):
        r = res[k]
        for p in ("permute", "unpermute", "sort", "copy"):
            r[p + "_TBps"] = r[p + "_bytes"] / r[p + "_us"] / 1e6
    print(json.dumps(res, indent=1))
    with open(os.path.join(outdir, "permute.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
