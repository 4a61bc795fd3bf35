//! Kernel micro-benchmark results (CSV, as `python/h100bench/bench.py` writes them) ->
//! measured kernels with the [`Work`] Prism prices them as.
//!
//! Header and columns: `kind,variant,m,n,k,batch,heads,seq_q,seq_kv,head_dim,causal,bytes,us`.
//!
//! * `kind = gemm`: `m,n,k` (and `batch`) of one `[m x k] x [k x n]` product; `variant` is the
//!   data type and layout (`bf16_nt`, `bf16_nn`, `bf16_tn`) or the FP8 scaling recipe
//!   (`fp8_tensor`, `fp8_row`, `fp8_block`);
//! * `kind = attn_fwd | attn_bwd`: fused attention of `batch` sequences, `heads` heads,
//!   `seq_q` queries over `seq_kv` keys of width `head_dim`, `causal` 0 or 1; `variant` is the
//!   backend (`cudnn`, `flash`);
//! * `kind = mem`: a memory-bound kernel moving `bytes` (read plus written); `variant` names it
//!   (`copy`, `add`, `rmsnorm`, `softmax`, ...);
//! * other kinds (`launch`, `nccl1`) are kept with no [`Work`].
//!
//! `us` is the median GPU time of one call in microseconds, positive and finite. Empty cells are
//! absent values. Every error names the file, the 1-based line and the rule.

use std::path::Path;

use prism_core::ops::Work;

/// One measured kernel configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchKernel {
    /// `gemm`, `attn_fwd`, `attn_bwd`, `mem`, ...
    pub kind: String,
    /// Data type / layout, backend or kernel name (see the module docs).
    pub variant: String,
    /// The work Prism prices it as (`None` for kinds Prism does not price alone).
    pub work: Option<Work>,
    /// Measured time of one call, seconds.
    pub seconds: f64,
}

/// Why a benchmark file could not be read.
#[derive(Debug, thiserror::Error)]
#[error("{path}{}: {rule}", line.map(|l| format!(":{l}")).unwrap_or_default())]
pub struct KernelBenchError {
    /// The file.
    pub path: String,
    /// 1-based line, when the error is in one.
    pub line: Option<u64>,
    /// The rule broken.
    pub rule: String,
}

#[derive(serde::Deserialize)]
struct Row {
    kind: String,
    variant: String,
    m: Option<u64>,
    n: Option<u64>,
    k: Option<u64>,
    batch: Option<u64>,
    heads: Option<u64>,
    seq_q: Option<u64>,
    seq_kv: Option<u64>,
    head_dim: Option<u64>,
    causal: Option<u8>,
    bytes: Option<u64>,
    us: f64,
}

const HEADER: [&str; 13] = [
    "kind", "variant", "m", "n", "k", "batch", "heads", "seq_q", "seq_kv", "head_dim", "causal",
    "bytes", "us",
];

/// Reads a benchmark CSV file.
pub fn read_kernel_bench(path: &Path) -> Result<Vec<BenchKernel>, KernelBenchError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| KernelBenchError {
        path: name.clone(),
        line: None,
        rule: format!("cannot read: {e}"),
    })?;
    parse_kernel_bench(&text, &name)
}

/// Parses benchmark CSV text; `origin` names it in errors.
pub fn parse_kernel_bench(text: &str, origin: &str) -> Result<Vec<BenchKernel>, KernelBenchError> {
    let err = |line: Option<u64>, rule: String| KernelBenchError {
        path: origin.to_string(),
        line,
        rule,
    };
    let mut r = csv::ReaderBuilder::new()
        .trim(csv::Trim::All)
        .from_reader(text.as_bytes());
    let header = r
        .headers()
        .map_err(|e| err(Some(1), format!("header: {e}")))?
        .clone();
    if header.iter().ne(HEADER) {
        return Err(err(
            Some(1),
            format!("the header must be `{}`", HEADER.join(",")),
        ));
    }
    let mut out = Vec::new();
    for rec in r.records() {
        let rec = rec.map_err(|e| err(e.position().map(|p| p.line()), e.to_string()))?;
        let line = rec.position().map(|p| p.line());
        let row: Row = rec
            .deserialize(Some(&header))
            .map_err(|e| err(line, format!("{e}")))?;
        if !(row.us.is_finite() && row.us > 0.0) {
            return Err(err(
                line,
                format!("`us` must be positive and finite (got {})", row.us),
            ));
        }
        let need = |v: Option<u64>, what: &str| {
            v.filter(|&x| x > 0).ok_or_else(|| {
                err(
                    line,
                    format!("a `{}` row needs a positive `{what}`", row.kind),
                )
            })
        };
        let work = match row.kind.as_str() {
            "gemm" => Some(Work::Gemm {
                m: need(row.m, "m")?,
                n: need(row.n, "n")?,
                k: need(row.k, "k")?,
                batch: row.batch.unwrap_or(1).max(1),
            }),
            "attn_fwd" | "attn_bwd" => {
                let causal = match row.causal {
                    Some(0) => false,
                    Some(1) => true,
                    c => return Err(err(line, format!("`causal` must be 0 or 1 (got {c:?})"))),
                };
                Some(Work::Attention {
                    batch: need(row.batch, "batch")?,
                    heads: need(row.heads, "heads")?,
                    seq_q: need(row.seq_q, "seq_q")?,
                    seq_kv: need(row.seq_kv, "seq_kv")?,
                    head_dim: need(row.head_dim, "head_dim")?,
                    causal,
                    window: 0,
                    backward: row.kind == "attn_bwd",
                })
            }
            "mem" => Some(Work::Memory {
                bytes: need(row.bytes, "bytes")?,
            }),
            _ => None,
        };
        out.push(BenchKernel {
            kind: row.kind,
            variant: row.variant,
            work,
            seconds: row.us * 1e-6,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: &str = "kind,variant,m,n,k,batch,heads,seq_q,seq_kv,head_dim,causal,bytes,us\n";

    #[test]
    fn reads_each_kind() {
        let t = format!(
            "{H}gemm,bf16_nt,1024,2048,4096,1,,,,,,,12.5\n\
             attn_bwd,cudnn,,,,2,32,8192,8192,128,1,,5498.4\n\
             mem,copy,,,,,,,,,,1073741824,360.9\n\
             launch,eager_tiny_add,,,,,,,,,,,7.45\n"
        );
        let v = parse_kernel_bench(&t, "b.csv").unwrap();
        assert_eq!(v.len(), 4);
        assert_eq!(
            v[0].work,
            Some(Work::Gemm {
                m: 1024,
                n: 2048,
                k: 4096,
                batch: 1
            })
        );
        assert!((v[0].seconds - 12.5e-6).abs() < 1e-18);
        assert!(matches!(
            v[1].work,
            Some(Work::Attention {
                backward: true,
                causal: true,
                heads: 32,
                ..
            })
        ));
        assert_eq!(v[2].work, Some(Work::Memory { bytes: 1 << 30 }));
        assert_eq!(v[3].work, None);
    }

    #[test]
    fn bad_rows_name_the_line_and_rule() {
        let e = parse_kernel_bench("a,b\n", "x.csv")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("x.csv:1: the header must be"), "{e}");
        let e = parse_kernel_bench(&format!("{H}gemm,bf16_nt,,2,3,1,,,,,,,1.0\n"), "x.csv")
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.csv:2") && e.contains("positive `m`"), "{e}");
        let e = parse_kernel_bench(&format!("{H}mem,copy,,,,,,,,,,100,-1\n"), "x.csv")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("x.csv:2") && e.contains("`us` must be positive"),
            "{e}"
        );
        let e = parse_kernel_bench(&format!("{H}attn_fwd,cudnn,,,,1,1,8,8,8,2,,1\n"), "x.csv")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`causal` must be 0 or 1"), "{e}");
        let e = parse_kernel_bench(&format!("{H}gemm,bf16_nt,x,2,3,1,,,,,,,1.0\n"), "x.csv")
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.csv:2"), "{e}");
    }
}
