//! Dense kernels on row-major `f32` slices (plain loops, fixed summation order).

use std::cell::Cell;

use super::mem::Buf;

thread_local! {
    /// Floating-point operations the kernels of this thread have done.
    static WORK_FLOP: Cell<f64> = const { Cell::new(0.0) };
}

/// The nominal rate of the work clock, FLOP/s.
pub const WORK_FLOP_PER_S: f64 = 1e9;

fn count(flop: usize) {
    WORK_FLOP.with(|w| w.set(w.get() + flop as f64));
}

/// The work clock: floating-point operations this thread's kernels have done, at
/// [`WORK_FLOP_PER_S`], in seconds. A deterministic stand-in for CPU time: the same steps give
/// the same reading whatever else shares the cores (`--compute-clock work`).
pub fn work_clock_s() -> f64 {
    WORK_FLOP.with(|w| w.get()) / WORK_FLOP_PER_S
}

/// `a [n, k] @ b [k, m]` into a new `[n, m]`.
pub fn matmul(a: &[f32], b: &[f32], n: usize, k: usize, m: usize) -> Buf {
    count(2 * n * k * m);
    let mut out = Buf::zeros(n * m);
    for i in 0..n {
        let o = &mut out[i * m..(i + 1) * m];
        for p in 0..k {
            let x = a[i * k + p];
            let row = &b[p * m..(p + 1) * m];
            for (oj, bj) in o.iter_mut().zip(row) {
                *oj += x * bj;
            }
        }
    }
    out
}

/// `g [n, m] @ w[k, m]^T` into a new `[n, k]` (the input gradient of `x @ w`).
pub fn matmul_nt(g: &[f32], w: &[f32], n: usize, m: usize, k: usize) -> Buf {
    count(2 * n * k * m);
    let mut out = Buf::zeros(n * k);
    for i in 0..n {
        let gi = &g[i * m..(i + 1) * m];
        for p in 0..k {
            let wp = &w[p * m..(p + 1) * m];
            let mut s = 0.0f32;
            for (x, y) in gi.iter().zip(wp) {
                s += x * y;
            }
            out[i * k + p] = s;
        }
    }
    out
}

/// `acc [k, m] += x[n, k]^T @ g[n, m]` (the weight gradient of `x @ w`).
pub fn matmul_tn_acc(acc: &mut [f32], x: &[f32], g: &[f32], n: usize, k: usize, m: usize) {
    count(2 * n * k * m);
    for i in 0..n {
        let gi = &g[i * m..(i + 1) * m];
        for p in 0..k {
            let xv = x[i * k + p];
            let row = &mut acc[p * m..(p + 1) * m];
            for (r, gv) in row.iter_mut().zip(gi) {
                *r += xv * gv;
            }
        }
    }
}

/// Layer norm over rows of `[n, h]`: returns (output, per-row mean, per-row 1/std).
pub fn layer_norm(x: &[f32], gamma: &[f32], beta: &[f32], n: usize, h: usize) -> (Buf, Buf, Buf) {
    count(8 * n * h);
    let mut y = Buf::zeros(n * h);
    let mut mean = Buf::zeros(n);
    let mut rstd = Buf::zeros(n);
    for i in 0..n {
        let r = &x[i * h..(i + 1) * h];
        let mu = r.iter().sum::<f32>() / h as f32;
        let var = r.iter().map(|v| (v - mu) * (v - mu)).sum::<f32>() / h as f32;
        let rs = 1.0 / (var + 1e-5).sqrt();
        mean[i] = mu;
        rstd[i] = rs;
        for j in 0..h {
            y[i * h + j] = (r[j] - mu) * rs * gamma[j] + beta[j];
        }
    }
    (y, mean, rstd)
}

/// Layer-norm backward: returns `dx`, accumulating `dgamma`, `dbeta`.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_back(
    dy: &[f32],
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
    n: usize,
    h: usize,
) -> Buf {
    count(12 * n * h);
    let mut dx = Buf::zeros(n * h);
    for i in 0..n {
        let (mu, rs) = (mean[i], rstd[i]);
        let mut s1 = 0.0f32;
        let mut s2 = 0.0f32;
        for j in 0..h {
            let xhat = (x[i * h + j] - mu) * rs;
            let g = dy[i * h + j];
            dgamma[j] += g * xhat;
            dbeta[j] += g;
            let gx = g * gamma[j];
            s1 += gx;
            s2 += gx * xhat;
        }
        for j in 0..h {
            let xhat = (x[i * h + j] - mu) * rs;
            let gx = dy[i * h + j] * gamma[j];
            dx[i * h + j] = rs * (gx - s1 / h as f32 - xhat * s2 / h as f32);
        }
    }
    dx
}

const GELU_C: f32 = 0.797_884_6; // sqrt(2 / pi)

/// GELU (tanh approximation).
pub fn gelu(u: &[f32]) -> Buf {
    count(10 * u.len());
    Buf::from_vec(
        u.iter()
            .map(|&x| 0.5 * x * (1.0 + (GELU_C * (x + 0.044715 * x * x * x)).tanh()))
            .collect(),
    )
}

/// `dy * gelu'(u)`.
pub fn gelu_back(dy: &[f32], u: &[f32]) -> Buf {
    count(14 * u.len());
    Buf::from_vec(
        u.iter()
            .zip(dy)
            .map(|(&x, &g)| {
                let t = (GELU_C * (x + 0.044715 * x * x * x)).tanh();
                let dt = (1.0 - t * t) * GELU_C * (1.0 + 3.0 * 0.044715 * x * x);
                g * (0.5 * (1.0 + t) + 0.5 * x * dt)
            })
            .collect(),
    )
}
