"""cuDNN fused attention at long context (up to 131,072 keys), forward and backward, on one GPU.

    python3 python/h100bench/long_attention.py OUTDIR

The attention of Llama 3 405B at TP 8 (16 query heads and 1 KV head per GPU, head width 128)
over a 131,072-token sequence: the whole causal sequence on one GPU, and 8,192 queries against
all 131,072 keys without a mask (the work of one context-parallel rank's late chunk). Appends
rows in kernels.csv's format to OUTDIR/long_attention.csv (`kind,variant,m,n,k,batch,heads,
seq_q,seq_kv,head_dim,causal,bytes,us`; the median GPU time of one call).
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
rows = []
for sq, skv, causal, heads, kvh in [(131072, 131072, True, 16, 1), (65536, 65536, True, 16, 1),
                                     (32768, 32768, True, 16, 1), (8192, 131072, False, 16, 1),
                                     (4096, 131072, False, 16, 1), (131072, 131072, True, 16, 16)]:
    q = torch.randn(1, heads, sq, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, kvh, skv, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, kvh, skv, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    gqa = kvh != heads
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            f = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            fwd = timed(f, reps=2, loops=3, warmup=2)
            o = f()
            g = torch.randn_like(o)
            bwd = timed(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True),
                        reps=2, loops=3, warmup=2)
    except Exception as e:  # noqa: BLE001
        print(f"{sq}x{skv} skipped: {str(e)[:300]}", flush=True)
        continue
    flops = 4.0 * heads * sq * skv * 128 * (0.5 if causal else 1.0)
    print(f"q {sq:6} kv {skv:6} causal {causal!s:5} heads {heads}/{kvh}: fwd {fwd:10.1f} us "
          f"({flops / fwd / 1e6:6.1f} TFLOP/s)  bwd {bwd:10.1f} us ({2.5 * flops / bwd / 1e6:6.1f})",
          flush=True)
    for kind, us in (("attn_fwd", fwd), ("attn_bwd", bwd)):
        rows.append(dict(kind=kind, variant="cudnn", batch=1, heads=heads, seq_q=sq, seq_kv=skv,
                         head_dim=128, causal=int(causal), us=f"{us:.3f}"))
    del q, k, v
    torch.cuda.empty_cache()
write_kernel_csv(os.path.join(OUT, "long_attention.csv"), rows)
