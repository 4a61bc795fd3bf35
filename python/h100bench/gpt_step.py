"""One data-parallel rank's training step of Megatron-Core's 2024 "1.7B" GPT, on one GPU.

    python3 python/h100bench/gpt_step.py OUTDIR

The model and per-rank work of the Megatron-LM README's weak-scaling table, first row
(validation case `mcore24_weak_1`): 24 layers, hidden 2048, FFN 8192, 16 heads, GeLU,
LayerNorm, biased linears, untied embeddings, vocabulary 131,072, sequence 4,096, four
micro-batches of one sequence (global batch 192 over DP 48), BF16 with FP32 master weights and
a fused AdamW (the distributed optimizer's share on 48 ranks is 1/48 of this step's). No
communication: what one rank computes.

Two variants: `eager` (plain PyTorch: every elementwise op a kernel) and `compiled` (each
layer under torch.compile, which fuses the elementwise work as Transformer Engine does).
Attention is cuDNN's fused kernel (SDPA) in both. Writes OUTDIR/gpt_step.json with, per
variant, the step times (median), the forward+backward time of the four micro-batches and the
optimizer time (CUDA events), and peak memory; and OUTDIR/gpt_step_trace.json.gz, the Kineto
trace of one compiled step.
"""

import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from timing import write_trace

OUT = sys.argv[1] if len(sys.argv) > 1 else "out"
os.makedirs(OUT, exist_ok=True)
DEV = torch.device("cuda")
CFG = dict(layers=24, hidden=2048, ffn=8192, heads=16, vocab=131072, seq=4096, micro_batches=4)


def log(*a):
    print(*a, flush=True)


class Layer(torch.nn.Module):
    def __init__(self, h, f, heads):
        super().__init__()
        self.heads, self.d = heads, h // heads
        self.ln1 = torch.nn.LayerNorm(h)
        self.ln2 = torch.nn.LayerNorm(h)
        self.qkv = torch.nn.Linear(h, 3 * h)
        self.o = torch.nn.Linear(h, h)
        self.fc1 = torch.nn.Linear(h, f)
        self.fc2 = torch.nn.Linear(f, h)

    def forward(self, x):  # x: [s, h]
        s = x.shape[0]
        q, k, v = self.qkv(self.ln1(x)).view(s, 3, self.heads, self.d).unbind(1)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.squeeze(0).transpose(0, 1).reshape(s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Gpt(torch.nn.Module):
    def __init__(self, c, compiled):
        super().__init__()
        self.emb = torch.nn.Embedding(c["vocab"], c["hidden"])
        self.pos = torch.nn.Embedding(c["seq"], c["hidden"])
        self.layers = torch.nn.ModuleList(Layer(c["hidden"], c["ffn"], c["heads"])
                                          for _ in range(c["layers"]))
        self.lnf = torch.nn.LayerNorm(c["hidden"])
        self.head = torch.nn.Linear(c["hidden"], c["vocab"], bias=False)
        self.run = [torch.compile(l) if compiled else l for l in self.layers]

    def forward(self, tok, tgt):
        x = self.emb(tok) + self.pos.weight
        for layer in self.run:
            x = layer(x)
        logits = self.head(self.lnf(x)).float()
        return F.cross_entropy(logits, tgt)


def measure(compiled):
    torch.manual_seed(3)
    c = CFG
    model = Gpt(c, compiled).to(DEV, dtype=torch.bfloat16)
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(master, lr=1e-5, fused=True)
    data = [(torch.randint(0, c["vocab"], (c["seq"],), device=DEV),
             torch.randint(0, c["vocab"], (c["seq"],), device=DEV))
            for _ in range(c["micro_batches"])]
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]

    def step():
        for p in params:
            p.grad = None
        ev[0].record()
        for tok, tgt in data:
            loss = model(tok, tgt) / len(data)
            loss.backward()
        ev[1].record()
        for m, p in zip(master, params):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            torch._foreach_copy_(params, master)
        ev[2].record()
        return loss

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        t0 = time.time()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        log(f"{'compiled' if compiled else 'eager'}: warm-up {time.time() - t0:.1f} s")
        torch.cuda.reset_peak_memory_stats()
        times, fb, op = [], [], []
        for _ in range(10):
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            fb.append(ev[0].elapsed_time(ev[1]) / 1e3)
            op.append(ev[1].elapsed_time(ev[2]) / 1e3)
        res = dict(step_s=times, median_s=statistics.median(times),
                   fwd_bwd_median_s=statistics.median(fb), optimizer_median_s=statistics.median(op),
                   peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30,
                   params=sum(p.numel() for p in params))
        log(f"  step {res['median_s'] * 1e3:.1f} ms, fwd+bwd {res['fwd_bwd_median_s'] * 1e3:.1f} ms, "
            f"optimizer {res['optimizer_median_s'] * 1e3:.1f} ms, {res['params'] / 1e9:.3f} B params, "
            f"peak {res['peak_mem_gib']:.1f} GiB")
        if compiled:
            write_trace(step, os.path.join(OUT, "gpt_step_trace.json"))
    return res


torch._dynamo.config.cache_size_limit = 64
torch.backends.cuda.matmul.allow_tf32 = False
out = dict(CFG, device=torch.cuda.get_device_name(), torch=torch.__version__)
for compiled in (False, True):
    name = "compiled" if compiled else "eager"
    try:
        out[name] = measure(compiled)
    except Exception as e:  # noqa: BLE001
        log(f"{name} failed: {type(e).__name__}: {str(e)[:600]}")
    torch.cuda.empty_cache()
with open(os.path.join(OUT, "gpt_step.json"), "w") as f:
    json.dump(out, f, indent=1)
