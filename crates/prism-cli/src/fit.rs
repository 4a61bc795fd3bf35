//! `prism fit`: measured duration samples -> fitted distributions per signature.
//!
//! For every signature of a samples CSV (`signature,duration_<s|ms|us>`, see
//! `prism_io::samples`), fits a normal, a log-normal and a gamma by maximum likelihood, prints
//! each family's parameters and Kolmogorov-Smirnov distance with the closest one marked, the
//! sample's quantiles and a distribution-free 95%-confidence bound of its p99, and optionally
//! writes the chosen fits as a distribution table (`signature,family,p1,p2,ks,n`). See
//! docs/fit.md.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use prism_predict::stats::{self, Fit};
use prism_predict::variability::Dist;

/// Arguments of `prism fit`.
#[derive(Debug, clap::Args)]
pub struct FitArgs {
    /// Duration samples (CSV with header `signature,duration_s`, `duration_ms` or
    /// `duration_us`; one row per observation).
    pub samples: PathBuf,
    /// Write the chosen fit of every signature here (CSV `signature,family,p1,p2,ks,n`).
    #[arg(long, short, value_name = "TABLE.csv")]
    pub out: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Quantile and confidence of the distribution-free bound that is reported.
const BOUND_Q: f64 = 0.99;
const BOUND_CONFIDENCE: f64 = 0.95;

/// One signature's result.
struct Entry {
    signature: String,
    samples: Vec<f64>,
    /// Best fit and every fit, or why none could be made.
    fits: Result<(Fit, Vec<Fit>), String>,
}

/// Runs `prism fit`.
pub fn run(args: &FitArgs) -> Result<()> {
    let samples = prism_io::samples::read_samples(&args.samples)?;
    let entries: Vec<Entry> = samples
        .into_iter()
        .map(|(signature, samples)| {
            let fits = stats::fit_best(&samples);
            Entry {
                signature,
                samples,
                fits,
            }
        })
        .collect();
    let chosen: Vec<(String, Fit)> = entries
        .iter()
        .filter_map(|e| {
            e.fits
                .as_ref()
                .ok()
                .map(|(best, _)| (e.signature.clone(), best.clone()))
        })
        .collect();
    if chosen.is_empty() {
        let reasons: Vec<String> = entries
            .iter()
            .filter_map(|e| {
                e.fits
                    .as_ref()
                    .err()
                    .map(|r| format!("{}: {r}", e.signature))
            })
            .collect();
        bail!(
            "{}: no signature could be fitted ({})",
            args.samples.display(),
            reasons.join("; ")
        );
    }
    if let Some(out) = &args.out {
        std::fs::write(out, prism_io::samples::write_dist_table(&chosen))
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    if args.json {
        print_json(args, &entries)?;
    } else {
        print_text(args, &entries, chosen.len())?;
    }
    Ok(())
}

/// Parameter names and values of a fitted family.
fn params(d: &Dist) -> Vec<(&'static str, f64)> {
    match d {
        Dist::Normal { mean, std } => vec![("mean", *mean), ("std", *std)],
        Dist::LogNormal { mu, sigma } => vec![("mu", *mu), ("sigma", *sigma)],
        Dist::Gamma { shape, scale } => vec![("shape", *shape), ("scale", *scale)],
        Dist::Exponential { mean } => vec![("mean", *mean)],
        Dist::Constant(c) => vec![("value", *c)],
        Dist::Empirical(v) => vec![("values", v.len() as f64)],
    }
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s
}

/// Seconds in a readable unit.
fn duration(s: f64) -> String {
    if !s.is_finite() {
        format!("{s}")
    } else if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.3} ms", s * 1e3)
    } else {
        format!("{:.2} us", s * 1e6)
    }
}

/// A parameter value: fixed-point when of moderate size, scientific otherwise.
fn number(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 || (1e-2..1e4).contains(&a) {
        format!("{v:.5}")
    } else {
        format!("{v:.4e}")
    }
}

fn print_text(args: &FitArgs, entries: &[Entry], fitted: usize) -> Result<()> {
    let observations: usize = entries.iter().map(|e| e.samples.len()).sum();
    outln!(
        "{}: {} signatures, {observations} observations",
        args.samples.display(),
        entries.len()
    )?;
    for e in entries {
        let s = stats::summarize(&e.samples);
        let bound = stats::guarantee(&sorted(&e.samples), BOUND_Q, BOUND_CONFIDENCE)
            .map(|t| format!("p99 <= {} at 95% confidence", duration(t)))
            .unwrap_or_else(|| "too few samples for a 95% bound of p99".into());
        outln!()?;
        outln!("{}  (n = {})", e.signature, e.samples.len())?;
        outln!(
            "  mean {}  p50 {}  p90 {}  p99 {}  max {}; {bound}",
            duration(s.mean),
            duration(s.p50),
            duration(s.p90),
            duration(s.p99),
            duration(s.max)
        )?;
        match &e.fits {
            Err(reason) => outln!("  not fitted: {reason}")?,
            Ok((best, all)) => {
                let crit = 1.358 / (e.samples.len() as f64).sqrt();
                for f in all {
                    let mark = if f == best { '*' } else { ' ' };
                    let p: Vec<String> = params(&f.dist)
                        .into_iter()
                        .map(|(k, v)| format!("{k:<5} {:<12}", number(v)))
                        .collect();
                    outln!(
                        "  {mark} {:<10} {}  ks {:.4}{}",
                        f.dist.family(),
                        p.join(" "),
                        f.ks,
                        if f.ks > crit {
                            "  (above 1.36/sqrt(n))"
                        } else {
                            ""
                        }
                    )?;
                }
            }
        }
    }
    outln!()?;
    outln!(
        "* = smallest Kolmogorov-Smirnov distance; times in the table are seconds \
         (lognormal mu/sigma of ln seconds)"
    )?;
    if let Some(out) = &args.out {
        outln!("wrote {fitted} rows to {}", out.display())?;
    }
    Ok(())
}

fn print_json(args: &FitArgs, entries: &[Entry]) -> Result<()> {
    use serde_json::{Value, json};
    let signatures: Vec<Value> = entries
        .iter()
        .map(|e| {
            let s = stats::summarize(&e.samples);
            let bound = stats::guarantee(&sorted(&e.samples), BOUND_Q, BOUND_CONFIDENCE);
            let mut v = json!({
                "signature": e.signature,
                "n": e.samples.len(),
                "summary_s": {
                    "mean": s.mean, "p50": s.p50, "p90": s.p90, "p95": s.p95, "p99": s.p99,
                    "min": s.min, "max": s.max,
                },
                "p99_upper_bound_95_s": bound,
            });
            match &e.fits {
                Ok((best, all)) => {
                    v["chosen"] = json!(best.dist.family());
                    v["fits"] = all
                        .iter()
                        .map(|f| {
                            let p = params(&f.dist);
                            json!({
                                "family": f.dist.family(),
                                "params": p.iter().map(|(k, x)| ((*k).to_owned(), json!(x)))
                                    .collect::<serde_json::Map<String, Value>>(),
                                "ks": f.ks,
                            })
                        })
                        .collect();
                }
                Err(reason) => v["error"] = json!(reason),
            }
            v
        })
        .collect();
    let out = json!({
        "samples": args.samples.display().to_string(),
        "table": args.out.as_ref().map(|p| p.display().to_string()),
        "signatures": signatures,
    });
    outln!("{}", serde_json::to_string_pretty(&out)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../prism-io/tests/data/samples.csv")
    }

    #[test]
    fn fit_writes_a_table_that_reads_back() {
        let dir = std::env::temp_dir().join(format!("prism-fit-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("table.csv");
        let args = FitArgs {
            samples: fixture(),
            out: Some(out.clone()),
            json: true,
        };
        run(&args).unwrap();
        let table = prism_io::samples::read_dist_table(&out).unwrap();
        assert_eq!(table.len(), 3);
        for d in table.values() {
            let m = d.mean();
            assert!(m > 1e-3 && m < 4e-3, "{d:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn fit_reports_bad_files() {
        let args = FitArgs {
            samples: PathBuf::from("/nonexistent/samples.csv"),
            out: None,
            json: false,
        };
        let e = run(&args).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/samples.csv"), "{e}");
    }
}
