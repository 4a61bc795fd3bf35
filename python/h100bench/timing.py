"""GPU timing and tracing shared by the measurement scripts of this folder."""

import gzip
import os
import statistics

import torch


def loop_us(fn, reps):
    """Mean GPU time of one call over `reps` back-to-back calls of `fn`, in microseconds (CUDA
    events around the loop)."""
    s = torch.cuda.Event(enable_timing=True)
    e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3 / reps


def write_trace(fn, path):
    """Run `fn` once under the PyTorch profiler (CPU and CUDA, shapes recorded) and write its
    Kineto trace to `path` + ".gz"."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    with open(path, "rb") as fi, gzip.open(path + ".gz", "wb", compresslevel=6) as fo:
        fo.write(fi.read())
    os.remove(path)


def timed(fn, reps=10, loops=5, warmup=3):
    """Median over `loops` of the mean GPU time of `reps` back-to-back calls of `fn`, in
    microseconds (CUDA events around each loop, after `warmup` untimed calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(loop_us(fn, reps) for _ in range(loops))



def graphed_us(fn, calls=20):
    """GPU time of one call of `fn`: `calls` back-to-back calls captured in a CUDA graph,
    replayed (median of `timed`), divided by `calls`; the host's launches do not count."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return timed(g.replay) / calls

KERNEL_FIELDS = ("kind", "variant", "m", "n", "k", "batch", "heads", "seq_q", "seq_kv",
                 "head_dim", "causal", "bytes", "us")


def write_kernel_csv(path, rows):
    """Write `rows` (dicts over KERNEL_FIELDS; a field left out is blank) in kernels.csv's format,
    which crates/prism-io/src/kernel_bench.rs reads."""
    with open(path, "w") as f:
        f.write(",".join(KERNEL_FIELDS) + "\n")
        for r in rows:
            f.write(",".join(str(r.get(x, "")) for x in KERNEL_FIELDS) + "\n")
