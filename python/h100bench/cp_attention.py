"""FlashAttention-2 against cuDNN fused attention for the work of one context-parallel rank.

    python3 python/h100bench/cp_attention.py OUTDIR

NeMo Framework Launcher 24.03 to 24.07 set NVTE_FUSED_ATTN=0 for every run
(launcher_scripts/conf/config.yaml), so Transformer Engine ran the flash-attn 2 kernels rather
than cuDNN on Hopper. This times both, through PyTorch SDPA's flash and cuDNN back-ends, for the
attention of the NeMo runs in validation/cases.csv, one micro-batch on one GPU:

* NeMo's long-context Llama 2 7B runs (NeMo 24.03.01, 16k-1M tokens): 32 heads / TP query
  heads of width 128; context parallelism with Transformer Engine's load-balanced ring keeps
  two chunks of c = s / (2 CP) tokens per rank and runs, per ring step, either the causal
  diagonal (2c queries, 2c keys) or an unmasked block (2c x c or c x 2c);
* the NeMo 24.07 rows' single-GPU shapes (Llama 2 7B at 4,096, Llama 3 8B with 8 KV heads at
  8,192 over CP 2, GPT-3 5B at 2,048 with micro-batch 4).

Writes OUTDIR/cp_attention.csv in kernels.csv's format (`kind,variant,m,n,k,batch,heads,seq_q,
seq_kv,head_dim,causal,bytes,us`; variant = back-end, the median GPU time of one call).
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from timing import timed, write_kernel_csv

OUT = sys.argv[1] if len(sys.argv) > 1 else "out"
os.makedirs(OUT, exist_ok=True)
DEV = torch.device("cuda")

# (batch, query heads, kv heads, queries, keys, causal)
SHAPES = [
    # Llama 2 7B, 16k, TP 2, CP 1
    (1, 16, 16, 16384, 16384, True),
    # 32k, TP 2, CP 2: c = 8k
    (1, 16, 16, 16384, 16384, True),
    (1, 16, 16, 16384, 8192, False),
    (1, 16, 16, 8192, 16384, False),
    # 64k-256k, TP 4, 32k tokens per rank: c = 16k
    (1, 8, 8, 32768, 32768, True),
    (1, 8, 8, 32768, 16384, False),
    (1, 8, 8, 16384, 32768, False),
    # 512k and 1M, TP 8, 32k tokens per rank
    (1, 4, 4, 32768, 32768, True),
    (1, 4, 4, 32768, 16384, False),
    (1, 4, 4, 16384, 32768, False),
    # NeMo 24.07 rows
    (1, 32, 32, 4096, 4096, True),  # Llama 2 7B
    (1, 32, 8, 4096, 4096, True),  # Llama 3 8B, CP 2 diagonal
    (1, 32, 8, 4096, 2048, False),
    (1, 32, 8, 2048, 4096, False),
    (1, 32, 8, 8192, 8192, True),  # Llama 3 8B whole sequence
    (4, 32, 32, 2048, 2048, True),  # GPT-3 5B, micro-batch 4
]
BACKENDS = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]

rows = []
seen = set()
for b, hq, hkv, sq, skv, causal in SHAPES:
    if (b, hq, hkv, sq, skv, causal) in seen:
        continue
    seen.add((b, hq, hkv, sq, skv, causal))
    q = torch.randn(b, hq, sq, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, skv, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, skv, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    gqa = hkv != hq
    flops = 4.0 * b * hq * sq * skv * 128 * (0.5 if causal else 1.0)
    for name, be in BACKENDS:
        try:
            with sdpa_kernel(be):
                def f():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
                fwd = timed(f, reps=3, loops=5, warmup=2)
                o = f()
                g = torch.randn_like(o)
                bwd = timed(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True),
                            reps=3, loops=5, warmup=2)
                del o, g
        except Exception as e:  # noqa: BLE001
            print(f"{name} {b}x{hq}/{hkv} {sq}x{skv} skipped: {str(e)[:200]}", flush=True)
            continue
        print(f"{name:5} b {b} heads {hq:2}/{hkv:2} q {sq:6} kv {skv:6} causal {causal!s:5}: "
              f"fwd {fwd:9.1f} us ({flops / fwd / 1e6:6.1f} TFLOP/s)  "
              f"bwd {bwd:9.1f} us ({2.5 * flops / bwd / 1e6:6.1f})", flush=True)
        for kind, us in (("attn_fwd", fwd), ("attn_bwd", bwd)):
            rows.append(dict(kind=kind, variant=name, batch=b, heads=hq, seq_q=sq, seq_kv=skv,
                             head_dim=128, causal=int(causal), us=f"{us:.3f}"))
    del q, k, v
    torch.cuda.empty_cache()

write_kernel_csv(os.path.join(OUT, "cp_attention.csv"), rows)
