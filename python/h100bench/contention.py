"""Kernels beside a communication-like kernel, and the clock under sustained load, on one GPU.

    python3 python/h100bench/contention.py OUTDIR

NCCL runs its collectives as kernels of one 640-thread block per channel, each with about
80 KB of dynamic shared memory on Hopper (`NCCL_MAX_NTHREADS`, `ncclShmemDynamicSize` in
NCCL's `src/include/device.h`): while they run, the SMs they sit on cannot take a large GEMM's
tiles. One GPU cannot run a multi-GPU collective, so this script launches a stand-in of that
footprint on `k` SMs (compiled with nvcc at run time) and times kernels beside it:

* `hold`: the blocks poll a timer and touch no memory (an NCCL kernel waiting on its peers);
* `copy`: the blocks stream device memory (the reads and writes of an NCCL kernel moving data);
* `copy_paced`: the same, each block sleeping between 64 KiB chunks, to a lower bandwidth.

Writes OUTDIR/contention.csv: `kernel,m,n,k,interferer,sms,alone_us,beside_us,interferer_gbps`
(median GPU time of one call alone and beside the stand-in; the stand-in's own measured
bandwidth while it ran). Then runs the largest Llama 3 405B (TP 8) GEMM back to back for
`SUSTAIN_S` seconds and writes OUTDIR/sustained.csv: `t_s,tflops,sm_clock_mhz,power_w`, one row
per second (throughput from CUDA events; clock and power from NVML through torch).
"""

import ctypes
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from timing import loop_us

OUT = sys.argv[1] if len(sys.argv) > 1 else "out"
SUSTAIN_S = float(os.environ.get("SUSTAIN_S", "60"))
os.makedirs(OUT, exist_ok=True)
DEV = torch.device("cuda")
HERE = os.path.dirname(os.path.abspath(__file__))

CU = r"""
#include <cuda_runtime.h>
#include <stdint.h>

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// One block per SM, 640 threads, `smem` bytes of dynamic shared memory: NCCL's footprint.
// mode 0 polls the timer; mode 1 copies `per_block` int4 from src to dst, over and over,
// sleeping `sleep_ns` after each 64 KiB chunk when non-zero. Runs `dur_ns` from its start.
extern "C" __global__ void __launch_bounds__(640, 1)
interferer(const int4* __restrict__ src, int4* __restrict__ dst, unsigned long long per_block,
           unsigned long long dur_ns, int mode, unsigned sleep_ns,
           unsigned long long* bytes) {
  extern __shared__ int4 smem[];
  __shared__ uint64_t t0;
  if (threadIdx.x == 0) t0 = now_ns();
  smem[threadIdx.x] = make_int4(threadIdx.x, 0, 0, 0);
  __syncthreads();
  const uint64_t end = t0 + dur_ns;
  const int4* s = src + blockIdx.x * per_block;
  int4* d = dst + blockIdx.x * per_block;
  unsigned long long moved = 0;
  const unsigned long long chunk = 4096;  // int4: 64 KiB
  unsigned long long off = 0;
  int stop = 0;
  while (!stop) {
    if (mode == 1) {
      for (unsigned long long i = threadIdx.x; i < chunk; i += blockDim.x) d[off + i] = s[off + i];
      moved += chunk * 16;
      off += chunk;
      if (off + chunk > per_block) off = 0;
      if (sleep_ns) __nanosleep(sleep_ns);
    }
    __syncthreads();
    if (threadIdx.x == 0) t0 = (now_ns() >= end);
    __syncthreads();
    stop = (int)t0;
    __syncthreads();
  }
  if (threadIdx.x == 0 && mode == 1) atomicAdd(bytes, moved);
  if (smem[threadIdx.x].y == 12345) dst[0] = smem[threadIdx.x];
}

extern "C" int launch(const void* src, void* dst, unsigned long long per_block, int blocks,
                      unsigned long long dur_ns, int mode, unsigned sleep_ns, void* bytes,
                      int smem, void* stream) {
  cudaError_t e = cudaFuncSetAttribute(interferer, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return (int)e;
  interferer<<<blocks, 640, smem, (cudaStream_t)stream>>>(
      (const int4*)src, (int4*)dst, per_block, dur_ns, mode, sleep_ns,
      (unsigned long long*)bytes);
  return (int)cudaGetLastError();
}
"""

# NCCL 2.28 on sm_90: (ncclCollUnroll 8 x 32 + 1) x 16 bytes per warp, 20 warps.
NCCL_SMEM = (8 * 32 + 1) * 16 * 20


def log(*a):
    print(*a, flush=True)


def build():
    src = os.path.join(OUT, "interferer.cu")
    lib = os.path.join("/tmp", "libinterferer.so")
    with open(src, "w") as f:
        f.write(CU)
    cap = torch.cuda.get_device_capability()
    arch = f"sm_{cap[0]}{cap[1]}"
    cmd = ["nvcc", "-O3", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC",
           "-cudart", "shared", "-o", lib, src]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        log("nvcc failed:", r.stderr[-2000:])
        raise SystemExit(1)
    os.remove(src)
    return ctypes.CDLL(lib)


LIB = build()
LIB.launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int,
                       ctypes.c_ulonglong, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_void_p]
SMS = torch.cuda.get_device_properties(0).multi_processor_count
PER_BLOCK = 1 << 20  # int4 per block: 16 MiB
SRC = torch.randn(SMS * PER_BLOCK * 4, device=DEV)
DST = torch.empty_like(SRC)
BYTES = torch.zeros(1, dtype=torch.int64, device=DEV)
SIDE = torch.cuda.Stream()


def beside(fn, reps, mode, sms, sleep_ns, dur_us):
    """One timed loop of `fn` while the stand-in runs on `sms` SMs; returns (us per call,
    stand-in GB/s, whether the stand-in outlasted the loop)."""
    torch.cuda.synchronize()
    BYTES.zero_()
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    c = torch.cuda.Event(enable_timing=True)
    d = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(SIDE):
        a.record(SIDE)
        rc = LIB.launch(SRC.data_ptr(), DST.data_ptr(), PER_BLOCK, sms, int(dur_us * 1e3), mode,
                        sleep_ns, BYTES.data_ptr(), NCCL_SMEM, SIDE.cuda_stream)
        if rc != 0:
            raise RuntimeError(f"launch failed: cuda error {rc}")
        d.record(SIDE)
    time.sleep(0.003)  # let its blocks become resident before the kernels under test
    b.record()
    for _ in range(reps):
        fn()
    c.record()
    torch.cuda.synchronize()
    per_call = b.elapsed_time(c) * 1e3 / reps
    covered = a.elapsed_time(d) >= a.elapsed_time(c)
    gbps = BYTES.item() / (a.elapsed_time(d) * 1e-3) / 1e9
    return per_call, gbps, covered


def measure(name, fn, shape, configs, rows):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    one = loop_us(fn, 3)
    reps = max(3, min(200, int(20000 / max(one, 1.0))))  # ~20 ms per loop
    alone = statistics.median(loop_us(fn, reps) for _ in range(5))
    for mode_name, mode, sms, sleep_ns in configs:
        res = []
        for _ in range(5):
            us, gbps, covered = beside(fn, reps, mode, sms, sleep_ns, dur_us=alone * reps * 4 + 10000)
            if covered:
                res.append((us, gbps))
        if not res:
            log(f"{name} {mode_name} {sms}: stand-in never outlasted the loop")
            continue
        us = statistics.median(r[0] for r in res)
        gbps = statistics.median(r[1] for r in res)
        rows.append((name, *shape, mode_name, sms, alone, us, gbps))
        log(f"{name:10} {str(shape):22} {mode_name:10} {sms:3} SMs: alone {alone:9.1f} us  "
            f"beside {us:9.1f} us  x{us / alone:.3f}  stand-in {gbps:7.1f} GB/s")


CONFIGS = [("hold", 0, k, 0) for k in (4, 8, 16, 24, 32, 66)]
CONFIGS += [("copy", 1, k, 0) for k in (4, 16, 32)]
CONFIGS += [("copy_paced", 1, 16, ns) for ns in (2000, 8000)]

torch.manual_seed(0)
rows = []
# Llama 3 405B (TP 8), 70B (TP 8) and 8B (TP 1) layer GEMMs at 8,192 tokens, x w^T.
GEMMS = [(8192, 2304, 16384), (8192, 16384, 2048), (8192, 13312, 16384), (8192, 16384, 6656),
         (8192, 1280, 8192), (8192, 7168, 8192), (8192, 8192, 3584),
         (8192, 6144, 4096), (8192, 28672, 4096), (8192, 4096, 14336), (2048, 4096, 4096)]
for m, n, k in GEMMS:
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    measure("gemm", lambda: torch.mm(x, w.t()), (m, n, k), CONFIGS, rows)
    del x, w
# cuDNN attention of the 405B at TP 8 (16 query heads, 1 KV head per GPU), 8,192 tokens.
q = torch.randn(1, 16, 8192, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
kk = torch.randn(1, 16, 8192, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
v = torch.randn(1, 16, 8192, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        measure("attn_fwd", lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True),
                (8192, 8192, 128), CONFIGS, rows)
        o = F.scaled_dot_product_attention(q, kk, v, is_causal=True)
        g = torch.randn_like(o)
        measure("attn_bwd", lambda: torch.autograd.grad(o, (q, kk, v), g, retain_graph=True),
                (8192, 8192, 128), CONFIGS, rows)
except Exception as e:  # noqa: BLE001
    log("attention skipped:", str(e)[:300])
# Memory-bound: a 256 MiB copy and an RMSNorm of 8,192 x 16,384.
a = torch.randn(64 << 20, device=DEV)
b = torch.empty_like(a)
measure("copy", lambda: b.copy_(a), (a.numel() * 4, 0, 0), CONFIGS, rows)
xn = torch.randn(8192, 16384, device=DEV, dtype=torch.bfloat16)
wn = torch.randn(16384, device=DEV, dtype=torch.bfloat16)
measure("rmsnorm", lambda: F.rms_norm(xn, (16384,), wn), (8192, 16384, 0), CONFIGS, rows)
del a, b, xn

with open(os.path.join(OUT, "contention.csv"), "w") as f:
    f.write("kernel,m,n,k,interferer,sms,alone_us,beside_us,interferer_gbps\n")
    for r in rows:
        f.write(f"{r[0]},{r[1]},{r[2]},{r[3]},{r[4]},{r[5]},{r[6]:.3f},{r[7]:.3f},{r[8]:.1f}\n")

# Sustained load: the 405B MLP GEMM back to back, one sample per second.
m, n, k = 8192, 13312, 16384
x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
flop = 2.0 * m * n * k
one = loop_us(lambda: torch.mm(x, w.t()), 10)
per_s = max(1, int(1e6 / one))
samples = []
t_start = time.time()
while time.time() - t_start < SUSTAIN_S:
    us = loop_us(lambda: torch.mm(x, w.t()), per_s)
    try:
        clk = torch.cuda.clock_rate()
        pw = torch.cuda.power_draw() / 1000.0
    except Exception:  # noqa: BLE001
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw",
                                "--format=csv,noheader,nounits"], capture_output=True,
                               text=True).stdout.split(",")
            clk, pw = float(q[0]), float(q[1])
        except Exception:  # noqa: BLE001
            clk, pw = float("nan"), float("nan")
    samples.append((time.time() - t_start, flop / (us * 1e-6) / 1e12, clk, pw))
with open(os.path.join(OUT, "sustained.csv"), "w") as f:
    f.write("t_s,tflops,sm_clock_mhz,power_w\n")
    for t, tf, clk, pw in samples:
        f.write(f"{t:.2f},{tf:.1f},{clk},{pw:.1f}\n")
for t, tf, clk, pw in samples[:: max(1, len(samples) // 12)]:
    log(f"t {t:5.1f} s  {tf:6.1f} TFLOP/s  {clk} MHz  {pw:.0f} W")
