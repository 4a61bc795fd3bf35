"""GPU timing shared by the measurement scripts of this folder."""

import statistics

import torch


def timed(fn, reps=10, loops=5, warmup=3):
    """Median over `loops` of the mean GPU time of `reps` back-to-back calls of `fn`, in
    microseconds (CUDA events around each loop, after `warmup` untimed calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(loops):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        res.append(s.elapsed_time(e) * 1e3 / reps)
    return statistics.median(res)
