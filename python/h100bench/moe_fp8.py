"""FP8 expert GEMMs of one expert-parallel rank, as Transformer Engine's GroupedLinear runs them
under per-tensor scaling: one cuBLASLt FP8 GEMM per local expert (`torch._scaled_mm`,
tensor-wise scales, BF16 output), back to back on one stream; beside the same work in BF16, as
one grouped kernel (`torch._grouped_mm`) and as a loop of dense GEMMs.

Usage: python3 python/h100bench/moe_fp8.py OUTDIR   (about 20 s on an H100)

Writes OUTDIR/moe_fp8.json: for GPT-OSS 120B at EP 8 (16 local experts, 1,024 rows each) and
Qwen3 30B-A3B at EP 16 (8 local experts, 4,096 rows each), 4,096 tokens, balanced routing, the
forward GEMMs fc1 (hidden -> 2 x ffn) and fc2 (ffn -> hidden): median GPU time of one whole
layer's GEMM set in microseconds (CUDA events around back-to-back repeats), the loops also
captured in a CUDA graph (`*_graph_us`) so that the host's launches do not count; and
`dense_sweep`: single BF16 and FP8 GEMMs at m x n = 4096 x 4096, 8192 x 2048 and 1024 x 5760
over k = 256 to 8192 (20 calls in a CUDA graph each).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graphed_us, timed  # noqa: E402

DEV = "cuda"
E4M3 = torch.float8_e4m3fn


def case(hidden, local, ffn, rows):
    out = {"hidden": hidden, "local_experts": local, "ffn": ffn, "rows_per_expert": rows}
    for name, k, n in (("fc1", hidden, 2 * ffn), ("fc2", ffn, hidden)):
        x = torch.randn(local * rows, k, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(local, n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5
        offs = torch.arange(1, local + 1, device=DEV, dtype=torch.int32) * rows
        wt = w.transpose(-2, -1)
        xs = [x[i * rows:(i + 1) * rows] for i in range(local)]
        x8 = [a.to(E4M3) for a in xs]
        w8 = [w[i].to(E4M3) for i in range(local)]  # (n, k) row-major: its .t() is column-major
        one = torch.ones((), device=DEV)
        flops = 2.0 * local * rows * k * n
        def loop8():
            return [torch._scaled_mm(x8[i], w8[i].t(), scale_a=one, scale_b=one,
                                     out_dtype=torch.bfloat16) for i in range(local)]

        def loop16():
            return [xs[i] @ wt[i] for i in range(local)]

        grouped = timed(lambda: torch._grouped_mm(x, wt, offs=offs))
        loop_bf16 = timed(loop16)
        loop_fp8 = timed(loop8)
        # The same loops captured in a CUDA graph: the GPU time without the host's launches.
        graphed = {"fp8": graphed_us(loop8, calls=1), "bf16": graphed_us(loop16, calls=1)}
        out[name] = {
            "fp8_loop_graph_us": graphed["fp8"], "bf16_loop_graph_us": graphed["bf16"],
            "m": rows, "n": n, "k": k, "flops": flops,
            "bf16_grouped_us": grouped, "bf16_loop_us": loop_bf16, "fp8_loop_us": loop_fp8,
            "fp8_loop_tflops": flops / graphed["fp8"] / 1e6,
            "fp8_over_bf16_grouped": grouped / graphed["fp8"],
        }
    return out


def sweep():
    """Dense BF16 and FP8 (tensor-wise) GEMMs over the reduction length k at three output
    shapes: where FP8's speed-up over BF16 goes with k."""
    rows = []
    one = torch.ones((), device=DEV)
    for m, n in ((4096, 4096), (8192, 2048), (1024, 5760)):
        for k in (256, 512, 768, 1024, 1536, 2048, 2880, 4096, 8192):
            a = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            b = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * k ** -0.5
            a8, b8 = a.to(E4M3), b.to(E4M3)
            bf16 = graphed_us(lambda: a @ b.t())
            fp8 = graphed_us(lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                      out_dtype=torch.bfloat16))
            rows.append({"m": m, "n": n, "k": k, "bf16_us": bf16, "fp8_us": fp8,
                         "speedup": bf16 / fp8})
            print(rows[-1], flush=True)
    return rows


def main():
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "gpt-oss-120b_ep8": case(2880, 16, 2880, 1024),
           "qwen3-30b-a3b_ep16": case(2048, 8, 768, 4096)}
    res["dense_sweep"] = sweep()
    print(json.dumps(res, indent=1))
    with open(os.path.join(outdir, "moe_fp8.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
