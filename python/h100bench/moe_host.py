"""Host-side costs of training kernels on one GPU, and one rank's share of an MoE layer.

Usage: python3 python/h100bench/moe_host.py OUTDIR   (about two minutes on an H100)

Writes OUTDIR/moe_host.json with:
- `launch`: the host (CPU) time PyTorch eager spends issuing one small kernel, measured as the
  wall time of 20,000 back-to-back tiny adds before and after the final synchronisation, and the
  latency of one device-to-host read of a fresh result (`.item()`), the kind of synchronisation
  Megatron-Core's alltoall token dispatcher makes for the grouped GEMM's split sizes.
- `moe`: one expert-parallel rank's part of an MoE layer after the dispatch (router, top-k,
  permutation, two grouped GEMMs with a SwiGLU between, weighted un-permutation), forward and
  backward, at the shapes of GPT-OSS 120B at EP 8 and Qwen3 30B-A3B at EP 16 (4,096 tokens,
  balanced routing). Each is timed (a) with the split sizes read to the host every layer, as
  Megatron-Core does, and (b) without, leaving the offsets on the GPU; for each, the wall time per
  layer and the GPU time its kernels took (profiler), so host-bound time shows as the difference.
- `grouped_gemm`: the two grouped GEMMs alone (torch._grouped_mm, BF16), forward, against the
  same work as one dense GEMM per expert in a loop.
- `fp8_current_scaling`: the passes Transformer Engine's per-tensor current scaling runs on a
  BF16 activation before an FP8 GEMM (an amax reduction, then a scaled cast), each timed alone,
  with the bytes they move.
"""

import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import timed  # noqa: E402

DEV = "cuda"


def host_launch():
    x = torch.zeros(1024, device=DEV)
    n = 20000
    for _ in range(1000):
        x.add_(1.0)
    torch.cuda.synchronize()
    issue, total = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1.0)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        issue.append((t1 - t0) / n * 1e6)
        total.append((t2 - t0) / n * 1e6)
    # The kernel's own GPU time and the spacing of back-to-back launches, from a profile.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2000):
            x.add_(1.0)
        torch.cuda.synchronize()
    kern = sorted(kernels_of(prof, "launch"), key=lambda e: e["ts"])
    gpu = statistics.median(e["dur"] for e in kern)
    spacing = (kern[-1]["ts"] - kern[0]["ts"]) / (len(kern) - 1)
    sync = []
    for _ in range(200):
        y = x.sum()
        t0 = time.perf_counter()
        y.item()
        sync.append((time.perf_counter() - t0) * 1e6)
    return {
        "kernels": n,
        "host_issue_us_per_kernel": statistics.median(issue),
        "wall_us_per_kernel": statistics.median(total),
        "gpu_us_per_kernel": gpu,
        "gpu_start_spacing_us": spacing,
        "item_sync_us_median": statistics.median(sync),
        "item_sync_us_p90": sorted(sync)[int(0.9 * len(sync))],
    }


def kernels_of(prof, tag):
    """The GPU kernels, copies and memsets of a finished profile, as Kineto trace events."""
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"{tag}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        evs = json.load(f)["traceEvents"]
    os.remove(path)
    return [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


class MoeRank(torch.nn.Module):
    """One EP rank's experts after the dispatch: the received (token, expert) pairs of `tokens`
    tokens, top-`topk`, spread evenly over `local` experts."""

    def __init__(self, hidden, experts, local, ffn, topk, tokens, bias):
        super().__init__()
        s = hidden ** -0.5

        def param(*shape, scale=s):
            return torch.nn.Parameter(torch.randn(*shape, device=DEV, dtype=torch.bfloat16) * scale)

        self.router = param(experts, hidden)
        self.w1 = param(local, hidden, 2 * ffn)
        self.w2 = param(local, ffn, hidden, scale=ffn ** -0.5)
        self.b1 = param(local, 2 * ffn, scale=0.0) if bias else None
        self.b2 = param(local, hidden, scale=0.0) if bias else None
        self.local, self.topk, self.tokens, self.hidden = local, topk, tokens, hidden
        # Balanced routing (the recipes force it): pair p of token t goes to local expert
        # (t * topk + p) % local.
        pairs = tokens * topk
        self.register_buffer("pair_expert", torch.arange(pairs, device=DEV) % local)
        self.register_buffer("pair_token", torch.arange(pairs, device=DEV) // topk)

    def forward(self, x, host_sync):
        logits = x @ self.router.t()
        probs = torch.softmax(logits.float(), dim=-1)
        w, _ = torch.topk(probs, self.topk, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        order = torch.argsort(self.pair_expert, stable=True)
        tok = self.pair_token[order]
        counts = torch.bincount(self.pair_expert, minlength=self.local)
        if host_sync:
            splits = counts.tolist()  # device-to-host read, as Megatron-Core's dispatcher does
            offs = torch.tensor(splits, device=x.device).cumsum(0).to(torch.int32)
        else:
            offs = counts.cumsum(0).to(torch.int32)
        xp = x.index_select(0, tok)
        h = torch._grouped_mm(xp, self.w1, offs=offs)
        if self.b1 is not None:
            h = h + self.b1.repeat_interleave(counts, dim=0, output_size=xp.shape[0])
        a, b = h.chunk(2, dim=-1)
        h = torch.nn.functional.silu(a) * b
        y = torch._grouped_mm(h, self.w2, offs=offs)
        if self.b2 is not None:
            y = y + self.b2.repeat_interleave(counts, dim=0, output_size=xp.shape[0])
        y = y * w.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, tok, y)
        return out


def moe_case(name, hidden, experts, local, ffn, topk, tokens, bias, layers=8):
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    mods = [MoeRank(hidden, experts, local, ffn, topk, tokens, bias) for _ in range(layers)]
    x0 = torch.randn(tokens, hidden, device=DEV, dtype=torch.bfloat16)
    out = {"hidden": hidden, "experts": experts, "local_experts": local, "ffn": ffn,
           "topk": topk, "tokens": tokens, "bias": bias, "layers": layers}

    def step(host_sync):
        x = x0.detach().requires_grad_(True)
        y = x
        for m in mods:
            y = y + m(y, host_sync)
        y.float().square().mean().backward()

    for sync in (True, False):
        key = "host_sync" if sync else "no_sync"
        for _ in range(3):
            step(sync)
        torch.cuda.synchronize()
        walls = []
        for _ in range(10):
            t0 = time.perf_counter()
            step(sync)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(sync)
            torch.cuda.synchronize()
        kern = kernels_of(prof, f"moe_{name}_{key}")
        gpu_ms = sum(e["dur"] for e in kern) / 1e3
        by_name = {}
        for e in kern:
            n = e["name"][:100]
            c, t = by_name.get(n, (0, 0.0))
            by_name[n] = (c + 1, t + e["dur"])
        top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]
        out[key] = {
            "wall_ms_per_layer": statistics.median(walls) / layers,
            "gpu_kernel_ms_per_layer": gpu_ms / layers,
            "kernels_per_layer": len(kern) / layers,
            "kernels_by_name": [{"name": n, "per_layer": c / layers, "us_per_layer": t / layers}
                                for n, (c, t) in top],
        }
    # The grouped GEMMs alone, forward, and the same work as a loop of dense GEMMs.
    m = mods[0]
    pairs = tokens * topk
    per = pairs // local
    offs = torch.arange(1, local + 1, device=DEV, dtype=torch.int32) * per
    xp = torch.randn(pairs, hidden, device=DEV, dtype=torch.bfloat16)
    hp = torch.randn(pairs, ffn, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        w1, w2 = m.w1.detach(), m.w2.detach()
        g1 = timed(lambda: torch._grouped_mm(xp, w1, offs=offs))
        g2 = timed(lambda: torch._grouped_mm(hp, w2, offs=offs))
        l1 = timed(lambda: [xp[i * per:(i + 1) * per] @ w1[i] for i in range(local)])
        l2 = timed(lambda: [hp[i * per:(i + 1) * per] @ w2[i] for i in range(local)])
        g1o = torch.randn(pairs, 2 * ffn, device=DEV, dtype=torch.bfloat16)
        w1t = w1.transpose(-2, -1)
        d1 = timed(lambda: torch._grouped_mm(g1o, w1t, offs=offs))
        xpt = xp.t()
        try:
            wg1 = timed(lambda: torch._grouped_mm(xpt, g1o, offs=offs))
        except Exception as e:  # the weight-gradient form may be missing
            wg1 = repr(e)
    f1 = 2.0 * pairs * hidden * 2 * ffn
    f2 = 2.0 * pairs * ffn * hidden
    out["grouped_gemm"] = {
        "rows_per_expert": per,
        "fc1_grouped_us": g1, "fc1_loop_us": l1, "fc1_grouped_tflops": f1 / g1 / 1e6,
        "fc1_dgrad_grouped_us": d1, "fc1_wgrad_grouped_us": wg1,
        "fc2_grouped_us": g2, "fc2_loop_us": l2, "fc2_grouped_tflops": f2 / g2 / 1e6,
    }
    return name, out


def fp8_current_scaling():
    rows = []
    for t, h in ((8192, 8192), (8192, 28672), (16384, 16384)):
        x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
        n = x.numel()
        amax = timed(lambda: torch.amax(torch.abs(x)))
        fused_amax = torch.compile(lambda v: torch.amax(torch.abs(v)))
        famax = timed(lambda: fused_amax(x))
        scale = torch.tensor(1.0, device=DEV)
        cast = torch.compile(lambda v, s: (v.float() * s).to(torch.float8_e4m3fn))
        fcast = timed(lambda: cast(x, scale))
        castt = torch.compile(
            lambda v, s: ((v.float() * s).to(torch.float8_e4m3fn),
                          (v.float() * s).to(torch.float8_e4m3fn).t().contiguous()))
        fcastt = timed(lambda: castt(x, scale))
        rows.append({
            "tokens": t, "hidden": h, "elements": n,
            "amax_eager_us": amax, "amax_compiled_us": famax,
            "amax_GBps": 2 * n / famax / 1e3,
            "cast_us": fcast, "cast_GBps": 3 * n / fcast / 1e3,
            "cast_and_transpose_us": fcastt, "cast_and_transpose_GBps": 4 * n / fcastt / 1e3,
        })
    return rows


def main():
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    res = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": \t"),
    }
    for key, fn in (
        ("launch", host_launch),
        ("moe", lambda: dict([
            moe_case("gpt-oss-120b_ep8", 2880, 128, 16, 2880, 4, 4096, True),
            moe_case("qwen3-30b-a3b_ep16", 2048, 128, 8, 768, 8, 4096, False),
        ])),
        ("fp8_current_scaling", fp8_current_scaling),
    ):
        try:
            res[key] = fn()
        except Exception as e:  # keep what the other parts measured
            res[key] = {"error": repr(e)}
        print(key, json.dumps(res[key], indent=1), flush=True)
    with open(os.path.join(outdir, "moe_host.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
