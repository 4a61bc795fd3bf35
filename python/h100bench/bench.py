"""Kernel and training-step measurements on one NVIDIA GPU, for checking Prism's cost model.

Run on a machine with a CUDA GPU and PyTorch (>= 2.5):

    python3 python/h100bench/bench.py OUTDIR [--quick]

Writes into OUTDIR:

* ``kernels.csv``: one row per measured kernel configuration,
  ``kind,variant,m,n,k,batch,heads,seq_q,seq_kv,head_dim,causal,bytes,us``, where ``us`` is the
  median GPU time of one call (CUDA events around a loop of calls, median of several loops).
  Kinds: ``gemm`` (variant ``bf16_nt``/``bf16_nn``/``bf16_tn``, ``fp8_tensor``, ``fp8_row``,
  ``fp8_block``), ``attn_fwd``/``attn_bwd`` (variant = SDPA backend), ``mem`` (variant = kernel:
  copy, add, swiglu, rmsnorm, layernorm, softmax, cast_fp8, adamw, ...), ``launch``;
* ``step.json``: a Llama-shaped training step (4 layers, hidden 4096, ffn 14336, 32 heads, 8 KV
  heads, vocab 128256, sequence 8192, 4 micro-batches of 1) in plain PyTorch eager with SDPA and
  a Megatron-style mixed-precision AdamW: per-step wall times and their median;
* ``step_trace.json.gz``: the PyTorch-profiler (Kineto) trace of one such step with shapes
  recorded, for ``prism profile import`` and ``prism calibrate --kineto``;
* ``env.json``: the device, driver, library versions and clocks seen.

Every timing runs on random data (never zeros) after warm-up.
"""

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from timing import KERNEL_FIELDS, timed, write_kernel_csv, write_trace
import torch.nn.functional as F

OUT = sys.argv[1] if len(sys.argv) > 1 else "out"
QUICK = "--quick" in sys.argv
os.makedirs(OUT, exist_ok=True)
DEV = torch.device("cuda")
ROWS = []


def log(*a):
    print(*a, flush=True)


def row(kind, variant, us, **kw):
    r = {f: "" for f in KERNEL_FIELDS}
    r.update(kind=kind, variant=variant, us=f"{us:.3f}")
    for k, v in kw.items():
        r[k] = v
    ROWS.append(r)


def write_rows():
    write_kernel_csv(os.path.join(OUT, "kernels.csv"), ROWS)


def env():
    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "device": torch.cuda.get_device_name(0),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "mem_gib": torch.cuda.get_device_properties(0).total_memory / 2**30,
    }
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001
        info["nccl"] = f"unavailable: {e}"
    try:
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem,power.limit,"
             "clocks.sm,temperature.gpu", "--format=csv"],
            capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = q.stdout.strip()
    except Exception as e:  # noqa: BLE001
        info["nvidia_smi"] = f"unavailable: {e}"
    return info


# ---------------------------------------------------------------- GEMMs
# (N, K) of the forward GEMMs of Llama 3 layers (Prism's `linear` shape: tokens x out x in):
# 8B at tp 1, 70B and 405B at tp 8, and the 8B LM head.
NK = [
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
    (1280, 8192), (8192, 1024), (7168, 8192), (8192, 3584),
    (2560, 16384), (16384, 2048), (13312, 16384), (16384, 6656),
    (128256, 4096),
]
MS = [2048, 8192] if QUICK else [1024, 2048, 4096, 8192, 16384]


def gemms():
    torch.manual_seed(0)
    for m in MS:
        for (n, k) in NK:
            if m * n > 16384 * 128256 or (n == 128256 and m > 8192):
                continue
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
            dy = torch.randn(m, n, device=DEV, dtype=torch.bfloat16)
            flops_reps = max(1, min(20, int(2e13 / (2 * m * n * k))))
            # forward: y = x w^T (m x n x k); dgrad: dx = dy w (m x k x n); wgrad: dw = dy^T x.
            t = timed(lambda: torch.mm(x, w.t()), reps=flops_reps)
            row("gemm", "bf16_nt", t, m=m, n=n, k=k, batch=1)
            t = timed(lambda: torch.mm(dy, w), reps=flops_reps)
            row("gemm", "bf16_nn", t, m=m, n=k, k=n, batch=1)
            t = timed(lambda: torch.mm(dy.t(), x), reps=flops_reps)
            row("gemm", "bf16_tn", t, m=n, n=k, k=m, batch=1)
            fp8(x, w, m, n, k, flops_reps)
            del x, w, dy
        torch.cuda.empty_cache()
        log(f"gemm m={m} done ({len(ROWS)} rows)")
        write_rows()


def fp8(x, w, m, n, k, reps):
    if not hasattr(torch, "float8_e4m3fn"):
        return
    xf = x.to(torch.float8_e4m3fn)
    wf = w.to(torch.float8_e4m3fn)
    one = torch.ones((), device=DEV, dtype=torch.float32)
    try:
        t = timed(lambda: torch._scaled_mm(xf, wf.t(), scale_a=one, scale_b=one,
                                           out_dtype=torch.bfloat16), reps=reps)
        row("gemm", "fp8_tensor", t, m=m, n=n, k=k, batch=1)
    except Exception as e:  # noqa: BLE001
        log("fp8 tensorwise unavailable:", e)
        return
    try:
        sa = torch.rand(m, 1, device=DEV, dtype=torch.float32) + 0.5
        sb = torch.rand(1, n, device=DEV, dtype=torch.float32) + 0.5
        t = timed(lambda: torch._scaled_mm(xf, wf.t(), scale_a=sa, scale_b=sb,
                                           out_dtype=torch.bfloat16), reps=reps)
        row("gemm", "fp8_row", t, m=m, n=n, k=k, batch=1)
    except Exception as e:  # noqa: BLE001
        log("fp8 rowwise unavailable:", str(e)[:200])
    try:
        # DeepSeek-V3 style: 1x128 tiles for activations, 128x128 blocks for weights.
        from torch.nn.functional import ScalingType, SwizzleType  # noqa: F401

        sa = (torch.rand(m, k // 128, device=DEV) + 0.5).t().contiguous().t()
        sb = torch.rand(n // 128, k // 128, device=DEV) + 0.5
        t = timed(lambda: F.scaled_mm(
            xf, wf.t(), scale_a=sa, scale_recipe_a=ScalingType.BlockWise1x128,
            scale_b=sb.t(), scale_recipe_b=ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16), reps=reps)
        row("gemm", "fp8_block", t, m=m, n=n, k=k, batch=1)
    except Exception as e:  # noqa: BLE001
        if m == MS[0] and (n, k) == NK[0]:
            log("fp8 blockwise unavailable:", str(e)[:300])


# ---------------------------------------------------------------- attention
def attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(1)
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    configs = []
    seqs = [2048, 8192] if QUICK else [1024, 2048, 4096, 8192, 16384, 32768]
    for s in seqs:
        configs.append((max(1, 16384 // s), 32, s, 128, True))
    configs += [(4, 32, 4096, 128, False), (2, 32, 8192, 64, True), (2, 16, 8192, 256, True),
                (1, 8, 8192, 128, True), (1, 16, 8192, 128, True)]
    for (b, h, s, d, causal) in configs:
        q = torch.randn(b, h, s, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        kk = torch.randn(b, h, s, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, h, s, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(b, h, s, d, device=DEV, dtype=torch.bfloat16)
        for name, be in backends:
            try:
                with sdpa_kernel([be]):
                    fwd = lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=causal)  # noqa: E731
                    t = timed(fwd, reps=5)
                    row("attn_fwd", name, t, batch=b, heads=h, seq_q=s, seq_kv=s, head_dim=d,
                        causal=int(causal))
                    o = fwd()
                    bwd = lambda: torch.autograd.grad(o, (q, kk, v), g, retain_graph=True)  # noqa: E731
                    t = timed(bwd, reps=5)
                    row("attn_bwd", name, t, batch=b, heads=h, seq_q=s, seq_kv=s, head_dim=d,
                        causal=int(causal))
                    del o
            except Exception as e:  # noqa: BLE001
                log(f"attention {name} b{b} h{h} s{s} d{d}: {str(e)[:160]}")
        del q, kk, v, g
        torch.cuda.empty_cache()
    log(f"attention done ({len(ROWS)} rows)")
    write_rows()


# ---------------------------------------------------------------- memory-bound kernels
def memory():
    torch.manual_seed(2)
    n = 1 << 28  # 256 Mi elements = 512 MiB in bf16
    a = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    row("mem", "copy", timed(lambda: c.copy_(a)), bytes=4 * n)
    row("mem", "add", timed(lambda: torch.add(a, b, out=c)), bytes=6 * n)
    half = n // 2
    gate = a[:half]
    up = b[:half]
    out = c[:half]
    row("mem", "swiglu", timed(lambda: torch.mul(F.silu(gate), up, out=out)), bytes=6 * half)
    x2 = a.view(-1, 4096)
    w = torch.randn(4096, device=DEV, dtype=torch.bfloat16)
    row("mem", "rmsnorm", timed(lambda: F.rms_norm(x2, (4096,), w)), bytes=4 * n)
    row("mem", "layernorm", timed(lambda: F.layer_norm(x2, (4096,), w)), bytes=4 * n)
    xs = a.view(-1, 8192)
    row("mem", "softmax", timed(lambda: torch.softmax(xs, dim=-1)), bytes=4 * n)
    if hasattr(torch, "float8_e4m3fn"):
        f8 = torch.empty(n, device=DEV, dtype=torch.float8_e4m3fn)

        def cast():
            amax = a.abs().amax()
            s = 448.0 / amax.float().clamp(min=1e-12)
            f8.copy_((a.float() * s).to(torch.float8_e4m3fn))

        # amax pass (read 2n) + scaled cast (read 2n, write n); unfused PyTorch does more.
        row("mem", "cast_fp8_unfused", timed(cast), bytes=5 * n)
        row("mem", "cast_fp8_plain", timed(lambda: f8.copy_(a)), bytes=3 * n)
    del a, b, c
    torch.cuda.empty_cache()
    # Cross entropy over a 128256 vocabulary, 8192 tokens, fp32 logits.
    logits = torch.randn(8192, 128256, device=DEV, dtype=torch.float32)
    tgt = torch.randint(0, 128256, (8192,), device=DEV)
    row("mem", "cross_entropy_fwd", timed(lambda: F.cross_entropy(logits, tgt)),
        bytes=logits.numel() * 4)
    del logits
    # Megatron-style optimizer: fp32 master, fp32 grads, two fp32 moments, fused AdamW.
    p = torch.randn(1 << 28, device=DEV, dtype=torch.float32, requires_grad=True)
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()
    # read p, g, m, v; write p, m, v: 28 bytes per parameter
    row("mem", "adamw_fused_fp32", timed(opt.step, reps=3), bytes=28 * p.numel())
    del p, opt
    torch.cuda.empty_cache()
    # Launch gap: back-to-back tiny kernels, eager and replayed from a CUDA graph.
    t1 = torch.randn(1024, device=DEV)
    t2 = torch.randn(1024, device=DEV)
    row("launch", "eager_tiny_add", timed(lambda: torch.add(t1, t2), reps=1000, loops=5))
    gr = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            torch.add(t1, t2)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(gr):
        for _ in range(100):
            torch.add(t1, t2)
    row("launch", "graph_tiny_add", timed(gr.replay, reps=10, loops=5) / 100)
    # One-rank NCCL all-reduce: the fixed cost of a collective call on this machine.
    try:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("nccl", rank=0, world_size=1)
        for nbytes in (1 << 10, 1 << 20, 1 << 26):
            buf = torch.randn(nbytes // 2, device=DEV, dtype=torch.bfloat16)
            row("nccl1", "all_reduce_1rank", timed(lambda: dist.all_reduce(buf), reps=20),
                bytes=nbytes)
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        log("nccl 1-rank:", str(e)[:200])
    log(f"memory done ({len(ROWS)} rows)")
    write_rows()


# ---------------------------------------------------------------- a training step
class Layer(torch.nn.Module):
    def __init__(self, h, f, heads, kv, d):
        super().__init__()
        self.heads, self.kv, self.d = heads, kv, d
        self.n1 = torch.nn.Parameter(torch.ones(h))
        self.n2 = torch.nn.Parameter(torch.ones(h))
        self.qkv = torch.nn.Linear(h, (heads + 2 * kv) * d, bias=False)
        self.o = torch.nn.Linear(heads * d, h, bias=False)
        self.fc1 = torch.nn.Linear(h, 2 * f, bias=False)
        self.fc2 = torch.nn.Linear(f, h, bias=False)

    def forward(self, x):  # x: [s, h]
        s = x.shape[0]
        y = F.rms_norm(x, (x.shape[-1],), self.n1)
        qkv = self.qkv(y)
        q, k, v = qkv.split([self.heads * self.d, self.kv * self.d, self.kv * self.d], dim=-1)
        q = q.view(1, s, self.heads, self.d).transpose(1, 2)
        k = k.view(1, s, self.kv, self.d).transpose(1, 2)
        v = v.view(1, s, self.kv, self.d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        a = a.transpose(1, 2).reshape(s, self.heads * self.d)
        x = x + self.o(a)
        y = F.rms_norm(x, (x.shape[-1],), self.n2)
        gu = self.fc1(y)
        g, u = gu.chunk(2, dim=-1)
        return x + self.fc2(F.silu(g) * u)


class Model(torch.nn.Module):
    def __init__(self, layers, h, f, heads, kv, vocab):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, h)
        self.layers = torch.nn.ModuleList(Layer(h, f, heads, kv, h // heads) for _ in range(layers))
        self.nf = torch.nn.Parameter(torch.ones(h))
        self.head = torch.nn.Linear(h, vocab, bias=False)

    def forward(self, tok, tgt):
        x = self.emb(tok)
        for layer in self.layers:
            x = layer(x)
        x = F.rms_norm(x, (x.shape[-1],), self.nf)
        logits = self.head(x).float()
        return F.cross_entropy(logits, tgt)


STEP = dict(layers=4, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, seq=8192,
            micro_batches=4)


def train_step():
    torch.manual_seed(3)
    c = STEP
    model = Model(c["layers"], c["hidden"], c["ffn"], c["heads"], c["kv_heads"], c["vocab"])
    model = model.to(DEV, dtype=torch.bfloat16)
    params = [p for p in model.parameters()]
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=1e-5, fused=True)
    data = [(torch.randint(0, c["vocab"], (c["seq"],), device=DEV),
             torch.randint(0, c["vocab"], (c["seq"],), device=DEV))
            for _ in range(c["micro_batches"])]

    def step():
        for p in params:
            p.grad = None
        for tok, tgt in data:
            loss = model(tok, tgt) / len(data)
            loss.backward()
        for m, p in zip(master, params):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, master)
        return loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(5 if QUICK else 12):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    res = dict(c)
    res.update(params=sum(p.numel() for p in params), step_s=times,
               median_s=statistics.median(times), peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30)
    log(f"step: median {res['median_s']*1e3:.1f} ms over {len(times)} ({min(times)*1e3:.1f}-{max(times)*1e3:.1f})")
    with open(os.path.join(OUT, "step.json"), "w") as f:
        json.dump(res, f, indent=1)
    write_trace(step, os.path.join(OUT, "step_trace.json"))
    log("trace written")


def main():
    t0 = time.time()
    info = env()
    log(json.dumps(info, indent=1))
    with open(os.path.join(OUT, "env.json"), "w") as f:
        json.dump(info, f, indent=1)
    torch.backends.cuda.matmul.allow_tf32 = False
    parts = [("step", train_step), ("gemm", gemms), ("attention", attention), ("memory", memory)]
    only = [a[len("--only="):] for a in sys.argv if a.startswith("--only=")]
    for name, fn in parts:
        if only and name not in only[0].split(","):
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            log(f"{name} failed: {type(e).__name__}: {str(e)[:400]}")
        torch.cuda.empty_cache()
        log(f"[{time.time() - t0:.0f} s] {name} finished")
    write_rows()
    # Short summary last.
    for r in ROWS:
        if r["kind"] == "gemm" and r["m"] == 8192 and r["variant"] in ("bf16_nt", "fp8_tensor", "fp8_row", "fp8_block"):
            fl = 2 * r["m"] * r["n"] * r["k"]
            log(f"{r['variant']:10} {r['m']}x{r['n']}x{r['k']}: {float(r['us']):9.1f} us "
                f"{fl / float(r['us']) / 1e6:7.1f} TFLOP/s")


if __name__ == "__main__":
    main()
