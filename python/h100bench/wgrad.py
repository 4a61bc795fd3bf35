"""Weight-gradient GEMMs with FP32 gradient accumulation (Megatron's
`--gradient-accumulation-fusion`: cuBLAS with an FP32 C and beta = 1), against the plain BF16
weight-gradient GEMM, on one GPU.

    python3 python/h100bench/wgrad.py OUTDIR

Writes OUTDIR/wgrad.csv: `m,n,k,variant,us` where the GEMM is dW[n x k] = dY^T[n x m] X[m x k]
(m tokens), variant `bf16_out` (BF16 output, no accumulation), `fp32_out` (FP32 output, no
accumulation) or `fp32_accum` (FP32 output accumulated into an existing FP32 gradient).
"""

import os
import sys

import torch

from timing import timed

OUT = sys.argv[1] if len(sys.argv) > 1 else "out"
os.makedirs(OUT, exist_ok=True)
DEV = torch.device("cuda")


SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1280, 8192), (8192, 1024),
          (7168, 8192), (8192, 3584), (2560, 16384), (16384, 2048), (13312, 16384), (16384, 6656),
          (6144, 2048), (2048, 8192), (8192, 2048)]
rows = []
torch.manual_seed(0)
for m in (1024, 2048, 4096, 8192, 16384):
    for n, k in SHAPES:
        dy = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        g = torch.randn(n, k, device=DEV, dtype=torch.float32)
        reps = max(1, min(20, int(2e13 / (2 * m * n * k))))
        rows.append((m, n, k, "bf16_out", timed(lambda: torch.mm(dy.t(), x), reps=reps)))
        try:
            rows.append((m, n, k, "fp32_out",
                         timed(lambda: torch.mm(dy.t(), x, out_dtype=torch.float32), reps=reps)))
        except Exception as e:  # noqa: BLE001
            print("fp32_out unavailable:", str(e)[:200], flush=True)
        try:
            rows.append((m, n, k, "fp32_accum", timed(
                lambda: torch.addmm(g, dy.t(), x, out_dtype=torch.float32, out=g), reps=reps)))
        except Exception as e:  # noqa: BLE001
            try:
                rows.append((m, n, k, "fp32_accum", timed(
                    lambda: g.add_(torch.mm(dy.t(), x, out_dtype=torch.float32)), reps=reps)))
                if m == 1024 and (n, k) == SHAPES[0]:
                    print("addmm out_dtype unavailable, using mm + add_:", str(e)[:200], flush=True)
            except Exception as e2:  # noqa: BLE001
                print("fp32_accum unavailable:", str(e2)[:200], flush=True)
        del dy, x, g
    torch.cuda.empty_cache()
with open(os.path.join(OUT, "wgrad.csv"), "w") as f:
    f.write("m,n,k,variant,us\n")
    for r in rows:
        f.write(f"{r[0]},{r[1]},{r[2]},{r[3]},{r[4]:.3f}\n")
by = {}
for m, n, k, v, us in rows:
    by.setdefault((m, n, k), {})[v] = us
for (m, n, k), d in sorted(by.items()):
    if "fp32_accum" in d:
        print(f"{m:6} {n:6} {k:6}  bf16 {d['bf16_out']:9.1f}  fp32 {d.get('fp32_out', 0):9.1f}  "
              f"accum {d['fp32_accum']:9.1f}  accum/bf16 {d['fp32_accum'] / d['bf16_out']:.3f}")
