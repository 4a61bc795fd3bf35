//! Measured duration samples (CSV) and fitted distribution tables (CSV).
//!
//! # Duration samples
//!
//! One row per observation of an operation's duration, grouped by a free-form signature (for
//! example a kernel name and shape, or a collective and its size):
//!
//! ```text
//! signature,duration_us
//! gemm_8192x8192x8192,1412.5
//! gemm_8192x8192x8192,1398.1
//! all_reduce_256MiB,3012.0
//! ```
//!
//! The second header column names the unit: `duration_s`, `duration_ms` or `duration_us`;
//! values are converted to seconds. Every duration must be a positive finite number.
//!
//! # Distribution tables
//!
//! One fitted distribution per signature, as `prism fit` writes it:
//!
//! ```text
//! signature,family,p1,p2,ks,n
//! gemm_8192x8192x8192,lognormal,-6.5612,0.0213,0.0081,400
//! all_reduce_256MiB,gamma,11.8,0.000255,0.0122,400
//! ```
//!
//! | family        | p1            | p2                   |
//! |---------------|---------------|----------------------|
//! | `normal`      | mean (s)      | standard deviation (s) |
//! | `lognormal`   | mu (of ln s)  | sigma (of ln s)      |
//! | `gamma`       | shape         | scale (s)            |
//! | `exponential` | mean (s)      | empty                |
//! | `constant`    | value (s)     | empty                |
//!
//! `ks` (the Kolmogorov-Smirnov distance of the fit) and `n` (the sample size) are informational
//! and may be left empty. Parameters are validated with [`Dist::validate`].
//!
//! Both formats: UTF-8, fields may be quoted with `"` (a doubled `""` inside is a literal quote;
//! quoted fields do not span lines; blanks around a field are not part of it), blank lines and
//! lines starting with `#` are skipped. The `csv` crate reads and writes the fields (see
//! `csv_text` for the quoting rules checked before it). Every error names the file, the 1-based
//! line and the rule broken.

use std::collections::BTreeMap;
use std::path::Path;

use csv::StringRecord;
use serde::Deserialize;

use crate::csv_text::{TableWriter, rows};
use prism_predict::stats::Fit;
use prism_predict::variability::Dist;

/// One row of a samples file, as written (the duration still in the header's unit).
#[derive(Deserialize)]
struct SampleRow<'a> {
    signature: &'a str,
    duration: &'a str,
}

/// One row of a distribution table, as written.
#[derive(Deserialize)]
struct DistRow<'a> {
    signature: &'a str,
    family: &'a str,
    p1: &'a str,
    p2: &'a str,
    ks: &'a str,
    n: &'a str,
}

/// Why a samples file or distribution table could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SamplesError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A row broke a rule.
    #[error("{path}:{line}: {rule}")]
    Row {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// The rule broken, with the offending value.
        rule: String,
    },
}

fn read_text(path: &Path) -> Result<(String, String), SamplesError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| SamplesError::Io {
        path: name.clone(),
        source,
    })?;
    Ok((text, name))
}

/// The longest duration a samples file may hold, seconds (about 31 years).
pub const MAX_DURATION_S: f64 = 1e9;

/// Reads a duration-samples CSV file: observations in seconds by signature, in file order.
pub fn read_samples(path: &Path) -> Result<BTreeMap<String, Vec<f64>>, SamplesError> {
    let (text, name) = read_text(path)?;
    parse_samples(&text, &name)
}

/// Parses duration-samples CSV text; `origin` names the source in errors (usually the path).
pub fn parse_samples(text: &str, origin: &str) -> Result<BTreeMap<String, Vec<f64>>, SamplesError> {
    let err = |line: usize, rule: String| SamplesError::Row {
        path: origin.to_owned(),
        line,
        rule,
    };
    let mut out: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut per_second: Option<f64> = None;
    for (line, record) in rows(text) {
        let record = record.map_err(|rule| err(line, rule))?;
        if record.len() != 2 {
            return Err(err(
                line,
                format!(
                    "expected 2 fields (signature, duration), found {}",
                    record.len()
                ),
            ));
        }
        let Some(divisor) = per_second else {
            per_second = Some(samples_header(&record).map_err(|rule| err(line, rule))?);
            continue;
        };
        let SampleRow {
            signature,
            duration: value,
        } = record
            .deserialize(None)
            .map_err(|e| err(line, format!("row: {e}")))?;
        if signature.is_empty() {
            return Err(err(line, "signature must not be empty".into()));
        }
        let v: f64 = value
            .parse()
            .map_err(|_| err(line, format!("duration {value:?} is not a number")))?;
        if !(v.is_finite() && v > 0.0) {
            return Err(err(
                line,
                format!("duration must be a positive finite number (got {value})"),
            ));
        }
        if v / divisor > MAX_DURATION_S {
            return Err(err(
                line,
                format!(
                    "duration {value} is more than {MAX_DURATION_S:e} s (about 31 years): not a \
                     kernel, step or iteration time, and past what a mean and a fit can sum"
                ),
            ));
        }
        out.entry(signature.to_owned())
            .or_default()
            .push(v / divisor);
    }
    let last = text.lines().count().max(1);
    if per_second.is_none() {
        return Err(err(
            last,
            "missing header row \"signature,duration_<s|ms|us>\"".into(),
        ));
    }
    if out.is_empty() {
        return Err(err(
            last,
            "no observations (one row per measured duration)".into(),
        ));
    }
    Ok(out)
}

/// Checks the samples header (two fields) and returns how many of its unit make one second.
fn samples_header(fields: &StringRecord) -> Result<f64, String> {
    if &fields[0] != "signature" {
        return Err(format!(
            "header column 1 must be \"signature\" (got {:?}); the header is \
             \"signature,duration_<s|ms|us>\"",
            &fields[0]
        ));
    }
    match &fields[1] {
        "duration_s" => Ok(1.0),
        "duration_ms" => Ok(1e3),
        "duration_us" => Ok(1e6),
        other => Err(format!(
            "header column 2 names the unit and must be \"duration_s\", \"duration_ms\" or \
             \"duration_us\" (got {other:?})"
        )),
    }
}

/// The table header.
const TABLE_HEADER: [&str; 6] = ["signature", "family", "p1", "p2", "ks", "n"];

/// Writes fitted distributions as a distribution table (header `signature,family,p1,p2,ks,n`),
/// in the given order; the inverse of [`parse_dist_table`]. Numbers are written in the shortest
/// form that reads back exactly. An empirical distribution has no row in this format: it is
/// written as a `#` comment line naming the signature.
pub fn write_dist_table(rows: &[(String, Fit)]) -> String {
    let mut out = TableWriter::new();
    out.record(&TABLE_HEADER);
    for (signature, fit) in rows {
        let (p1, p2) = match &fit.dist {
            Dist::Normal { mean, std } => (*mean, Some(*std)),
            Dist::LogNormal { mu, sigma } => (*mu, Some(*sigma)),
            Dist::Gamma { shape, scale } => (*shape, Some(*scale)),
            Dist::Exponential { mean } => (*mean, None),
            Dist::Constant(c) => (*c, None),
            Dist::Empirical(v) => {
                out.comment(&format!(
                    "{signature}: empirical distribution of {} values is not representable here",
                    v.len()
                ));
                continue;
            }
        };
        out.record(&[
            signature,
            fit.dist.family(),
            &format!("{p1:?}"),
            &p2.map(|v| format!("{v:?}")).unwrap_or_default(),
            &format!("{:?}", fit.ks),
            &fit.n.to_string(),
        ]);
    }
    out.finish()
}

/// Reads a distribution-table file (see [`parse_dist_table`]).
pub fn read_dist_table(path: &Path) -> Result<BTreeMap<String, Dist>, SamplesError> {
    let (text, name) = read_text(path)?;
    parse_dist_table(&text, &name)
}

/// Parses distribution-table CSV text into one validated [`Dist`] per signature; `origin`
/// names the source in errors. A signature may appear only once.
pub fn parse_dist_table(text: &str, origin: &str) -> Result<BTreeMap<String, Dist>, SamplesError> {
    let err = |line: usize, rule: String| SamplesError::Row {
        path: origin.to_owned(),
        line,
        rule,
    };
    let mut out = BTreeMap::new();
    let mut first_line: BTreeMap<String, usize> = BTreeMap::new();
    let mut header = false;
    for (line, record) in rows(text) {
        let record = record.map_err(|rule| err(line, rule))?;
        if record.len() != TABLE_HEADER.len() {
            return Err(err(
                line,
                format!(
                    "expected 6 fields (signature, family, p1, p2, ks, n), found {}",
                    record.len()
                ),
            ));
        }
        if !header {
            if record.iter().ne(TABLE_HEADER) {
                return Err(err(
                    line,
                    format!(
                        "the header must be \"signature,family,p1,p2,ks,n\" (got {:?})",
                        record.iter().collect::<Vec<_>>().join(",")
                    ),
                ));
            }
            header = true;
            continue;
        }
        let row: DistRow<'_> = record
            .deserialize(None)
            .map_err(|e| err(line, format!("row: {e}")))?;
        let (signature, family) = (row.signature, row.family);
        if signature.is_empty() {
            return Err(err(line, "signature must not be empty".into()));
        }
        let number = |f: &str, what: &str| -> Result<f64, SamplesError> {
            f.parse::<f64>()
                .map_err(|_| err(line, format!("{what} {f:?} is not a number")))
        };
        let two = |a: &str, b: &str| -> Result<(f64, f64), SamplesError> {
            Ok((
                number(row.p1, &format!("p1 ({a})"))?,
                number(row.p2, &format!("p2 ({b})"))?,
            ))
        };
        let one = |a: &str| -> Result<f64, SamplesError> {
            if !row.p2.is_empty() {
                return Err(err(
                    line,
                    format!("p2 must be empty for family {family} (got {:?})", row.p2),
                ));
            }
            number(row.p1, &format!("p1 ({a})"))
        };
        let dist = match family {
            "normal" => {
                let (mean, std) = two("mean", "std")?;
                Dist::Normal { mean, std }
            }
            "lognormal" => {
                let (mu, sigma) = two("mu", "sigma")?;
                Dist::LogNormal { mu, sigma }
            }
            "gamma" => {
                let (shape, scale) = two("shape", "scale")?;
                Dist::Gamma { shape, scale }
            }
            "exponential" => Dist::Exponential { mean: one("mean")? },
            "constant" => Dist::Constant(one("value")?),
            other => {
                return Err(err(
                    line,
                    format!(
                        "family must be \"normal\", \"lognormal\", \"gamma\", \"exponential\" \
                         or \"constant\" (got {other:?})"
                    ),
                ));
            }
        };
        dist.validate().map_err(|rule| err(line, rule))?;
        if !row.ks.is_empty() {
            let ks = number(row.ks, "ks")?;
            if !(0.0..=1.0).contains(&ks) {
                return Err(err(line, format!("ks must be in [0, 1] (got {ks})")));
            }
        }
        if !row.n.is_empty() && row.n.parse::<u64>().is_err() {
            return Err(err(
                line,
                format!("n must be a whole number (got {:?})", row.n),
            ));
        }
        if let Some(first) = first_line.get(signature) {
            return Err(err(
                line,
                format!("duplicate signature {signature:?}; first given on line {first}"),
            ));
        }
        first_line.insert(signature.to_owned(), line);
        out.insert(signature.to_owned(), dist);
    }
    if !header {
        return Err(err(
            text.lines().count().max(1),
            "missing header row \"signature,family,p1,p2,ks,n\"".into(),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_predict::stats::fit_best;

    fn data(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name)
    }

    #[test]
    fn samples_fixture_reads_in_seconds() {
        let s = read_samples(&data("samples.csv")).unwrap();
        let names: Vec<&str> = s.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "all_reduce_256MiB",
                "attn_fwd_b1h16q8192k8192d128c",
                "gemm_8192x8192x8192"
            ]
        );
        for v in s.values() {
            assert_eq!(v.len(), 400);
            assert!(v.iter().all(|x| *x > 1e-4 && *x < 1e-1), "seconds");
        }
        // Every family fits the mild jitter of 400 draws (KS below the 5% critical value), and
        // the all-reduce's gamma (shape 16, scale 190 us; see the fixture's header) is
        // recovered within its sampling error (shape: about 7% standard error at n = 400).
        let crit = 1.36 / 400f64.sqrt();
        for (k, v) in &s {
            let (best, all) = fit_best(v).unwrap();
            assert_eq!(all.len(), 3);
            assert!(best.ks < crit, "{k}: {best:?}");
        }
        let fit = prism_predict::stats::fit_gamma(&s["all_reduce_256MiB"]).unwrap();
        let Dist::Gamma { shape, scale } = fit.dist else {
            unreachable!()
        };
        assert!((shape / 16.0 - 1.0).abs() < 0.25, "{shape}");
        assert!(
            (shape * scale / 3040e-6 - 1.0).abs() < 0.05,
            "{}",
            shape * scale
        );
    }

    #[test]
    fn samples_units_and_quoting() {
        let s = parse_samples(
            "# comment\nsignature, duration_ms\n\"a,b\",1.5\r\nc,2\n\nc,3e0\n",
            "x.csv",
        )
        .unwrap();
        assert_eq!(s["a,b"], vec![1.5e-3]);
        assert_eq!(s["c"], vec![2e-3, 3e-3]);
        let s = parse_samples("signature,duration_us\nk,250\n", "x.csv").unwrap();
        assert_eq!(s["k"], vec![250.0 / 1e6]);
        let s = parse_samples("\u{feff}signature,duration_s\nk,0.25\n", "x.csv").unwrap();
        assert_eq!(s["k"], vec![0.25]);
    }

    #[test]
    fn samples_errors_name_file_line_and_rule() {
        let cases = [
            ("", "x.csv:1: missing header row"),
            ("signature,duration_s\n", "x.csv:1: no observations"),
            (
                "sig,duration_s\nk,1\n",
                "x.csv:1: header column 1 must be \"signature\"",
            ),
            (
                "signature,duration_ns\nk,1\n",
                "x.csv:1: header column 2 names the unit",
            ),
            (
                "signature,duration_s\nk,1\nk,-2\n",
                "x.csv:3: duration must be a positive",
            ),
            (
                "signature,duration_s\nk,abc\n",
                "x.csv:2: duration \"abc\" is not a number",
            ),
            (
                "signature,duration_s\nk,1\nk,1e300\n",
                "x.csv:3: duration 1e300 is more than 1e9 s",
            ),
            (
                "signature,duration_s\nk,inf\n",
                "x.csv:2: duration must be a positive finite",
            ),
            (
                "signature,duration_s\n,1\n",
                "x.csv:2: signature must not be empty",
            ),
            (
                "signature,duration_s\nk,1,2\n",
                "x.csv:2: expected 2 fields",
            ),
            (
                "signature,duration_s\n\"k,1\n",
                "x.csv:2: unterminated quoted field 1",
            ),
            (
                "signature,duration_s\nk,1\n# c\n\"k\"x,1\n",
                "x.csv:4: unexpected 'x' after the closing quote of field 1",
            ),
            (
                "signature,duration_s\nk\"1,1\n",
                "x.csv:2: stray quote in unquoted field 1",
            ),
            (
                "signature,duration_s\nk,\"1",
                "x.csv:2: unterminated quoted field 2",
            ),
        ];
        for (text, want) in cases {
            let e = parse_samples(text, "x.csv").unwrap_err().to_string();
            assert!(e.starts_with(want), "{text:?}: {e}");
        }
        let e = read_samples(Path::new("/nonexistent/samples.csv")).unwrap_err();
        assert!(e.to_string().starts_with("/nonexistent/samples.csv: "));
    }

    #[test]
    fn dist_table_round_trips_exactly() {
        let fit = |dist| Fit {
            dist,
            ks: 0.012_345_678_9,
            n: 400,
        };
        let rows = vec![
            (
                "gemm, \"big\"".to_string(),
                fit(Dist::LogNormal {
                    mu: -6.561_234_567_890_123,
                    sigma: 0.021_3,
                }),
            ),
            (
                "ar".to_string(),
                fit(Dist::Gamma {
                    shape: 11.8,
                    scale: 2.55e-4,
                }),
            ),
            (
                "n".to_string(),
                fit(Dist::Normal {
                    mean: 1e-3,
                    std: 1e-5,
                }),
            ),
            ("e".to_string(), fit(Dist::Exponential { mean: 3.0 })),
            ("c".to_string(), fit(Dist::Constant(0.1))),
            ("emp".to_string(), fit(Dist::Empirical(vec![1.0, 2.0]))),
        ];
        let text = write_dist_table(&rows);
        assert!(text.starts_with("signature,family,p1,p2,ks,n\n"));
        assert!(text.contains("# emp: empirical distribution of 2 values"));
        let back = parse_dist_table(&text, "t.csv").unwrap();
        assert_eq!(back.len(), 5);
        for (sig, f) in &rows[..5] {
            assert_eq!(back[sig], f.dist, "{sig}");
        }
    }

    #[test]
    fn tricky_valid_dist_table() {
        let text = "\u{feff}signature, family ,p1,p2,ks,n\r\n\
                    \r\n\
                    \x20 # gemm: empirical distribution of 3 values\r\n\
                    \x20\"a, \"\"b\"\"\"\t,\"gamma\", 2 ,0.5, , \r\n\
                    \" c \",constant,1e-3,\"\",\"0.25\",\"7\"";
        let t = parse_dist_table(text, "t.csv").unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(
            t["a, \"b\""],
            Dist::Gamma {
                shape: 2.0,
                scale: 0.5
            }
        );
        assert_eq!(t[" c "], Dist::Constant(1e-3));
    }

    #[test]
    fn dist_table_errors_name_file_line_and_rule() {
        let h = "signature,family,p1,p2,ks,n\n";
        let cases = [
            (String::new(), "t.csv:1: missing header row"),
            (
                "signature,family,a,b,ks,n\n".into(),
                "t.csv:1: the header must be",
            ),
            (format!("{h}k,weibull,1,2,,\n"), "t.csv:2: family must be"),
            (
                format!("{h}k,gamma,-1,2,,\n"),
                "t.csv:2: gamma shape must be positive",
            ),
            (
                format!("{h}k,normal,1,x,,\n"),
                "t.csv:2: p2 (std) \"x\" is not a number",
            ),
            (
                format!("{h}k,exponential,1,2,,\n"),
                "t.csv:2: p2 must be empty",
            ),
            (
                format!("{h}k,normal,1,0.1,2,\n"),
                "t.csv:2: ks must be in [0, 1]",
            ),
            (
                format!("{h}k,normal,1,0.1,,1.5\n"),
                "t.csv:2: n must be a whole number",
            ),
            (
                format!("{h}k,normal,1,0.1,,\n# c\nk,gamma,1,1,,\n"),
                "t.csv:4: duplicate signature \"k\"; first given on line 2",
            ),
            (format!("{h}k,normal,1\n"), "t.csv:2: expected 6 fields"),
            (
                format!("{h}\"k\"\"\",normal,1,0.1,,\n\"k\",normal,1,0.1,,\"4\"0\n"),
                "t.csv:3: unexpected '0' after the closing quote of field 6",
            ),
            (
                format!("{h}k,nor\"mal,1,0.1,,\n"),
                "t.csv:2: stray quote in unquoted field 2",
            ),
            (
                format!("{h}k,normal,1,0.1,,\"4"),
                "t.csv:2: unterminated quoted field 6",
            ),
        ];
        for (text, want) in cases {
            let e = parse_dist_table(&text, "t.csv").unwrap_err().to_string();
            assert!(e.starts_with(want), "{text:?}: {e}");
        }
    }
}
