//! Measured kernel-time tables (CSV) -> [`KernelTable`].
//!
//! Format: UTF-8 CSV with a header row and four columns,
//!
//! ```text
//! op,shape,dtype,us
//! fc1_fwd,8192x6656x16384,bf16,2310.5
//! attn_fwd,b1h16q8192k8192d128c,bf16,1750
//! "rmsnorm_fwd",268435456B,bf16,95.2
//! ```
//!
//! * `op`: the kernel name as the graph builder emits it (`ComputeOp::name`), or `gemm`: every
//!   GEMM of the row's shape whose own name has no row (a profiler trace knows shapes, not
//!   layer ops; `prism profile import` writes these). [`read_kernel_table_for`] refuses other names;
//! * `shape`: the canonical key of [`prism_core::cost::compute::shape_key`]: `MxNxK` or
//!   `BxMxNxK` for GEMMs, `b{batch}h{heads}q{seq_q}k{seq_kv}d{head_dim}{c|n}` for attention,
//!   `{bytes}B` for memory-bound kernels;
//! * `dtype`: `bf16` or `fp8`;
//! * the duration, positive and finite, in the unit its header names: `seconds` (or `s`), `ms`
//!   or `us`. It is the kernel's GPU duration as a profiler reports it; the cost model still
//!   adds its per-kernel launch overhead.
//!
//! Fields may be quoted with `"` (a doubled `""` inside is a literal quote); quoted fields do
//! not span lines, and blanks around a field are not part of it. Blank lines and lines starting
//! with `#` are skipped. A key may appear only once. The `csv` crate reads and writes the fields
//! (see `csv_text` for the quoting rules checked before it). Every error names the file, the
//! 1-based line and the rule broken.

use std::collections::BTreeMap;
use std::path::Path;

use csv::StringRecord;
use serde::Deserialize;

use crate::csv_text::{TableWriter, rows};
use prism_core::cost::compute::KernelTable;

/// One data row, as written (the time still in the header's unit).
#[derive(Deserialize)]
struct KernelRow<'a> {
    op: &'a str,
    shape: &'a str,
    dtype: &'a str,
    time: &'a str,
}

/// Why a kernel table could not be read.
#[derive(Debug, thiserror::Error)]
pub enum KernelTableError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A row names an op no kernel of the job has.
    #[error("{path}: op `{op}`: {rule}")]
    UnknownOp {
        /// The file.
        path: String,
        /// The op name.
        op: String,
        /// The rule broken.
        rule: String,
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

/// Reads a kernel table from a CSV file for `job`: every row's op must name a kernel of the
/// job's graph or be the class row `gemm` (any GEMM of that shape, as `prism profile import`
/// writes), else the table is refused (a row no op can use is a mistake, not a no-op).
pub fn read_kernel_table_for(
    path: &Path,
    job: &prism_core::job::Job,
) -> Result<KernelTable, KernelTableError> {
    let table = read_kernel_table(path)?;
    if prism_core::graph::size_check(job).is_err() {
        // Too large to build: the simulation refuses the job itself.
        return Ok(table);
    }
    let graph = prism_core::graph::ExecutionGraph::build(job);
    let known = graph.kernel_names();
    let unknown = table.unknown_ops(&known);
    if let Some(op) = unknown.first() {
        let some: Vec<&str> = known.iter().copied().take(8).collect();
        return Err(KernelTableError::UnknownOp {
            path: path.display().to_string(),
            op: op.to_string(),
            rule: format!(
                "{} op name(s) name no kernel of this job (first: `{op}`); an op is a kernel name \
                 the graph emits ({}, ...) or `gemm` for every GEMM of the row's shape",
                unknown.len(),
                some.join(", ")
            ),
        });
    }
    Ok(table)
}

/// Reads a kernel table from a CSV file.
pub fn read_kernel_table(path: &Path) -> Result<KernelTable, KernelTableError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| KernelTableError::Io {
        path: name.clone(),
        source,
    })?;
    parse_kernel_table(&text, &name)
}

/// Parses kernel-table CSV text; `origin` names the source in errors (usually the file path).
pub fn parse_kernel_table(text: &str, origin: &str) -> Result<KernelTable, KernelTableError> {
    let err = |line: usize, rule: String| KernelTableError::Row {
        path: origin.to_owned(),
        line,
        rule,
    };
    let mut table = KernelTable::new();
    let mut seen: BTreeMap<(String, String, String), usize> = BTreeMap::new();
    let mut divisor: Option<f64> = None;

    for (line, record) in rows(text) {
        let record = record.map_err(|rule| err(line, rule))?;
        if record.len() != 4 {
            return Err(err(
                line,
                format!(
                    "expected 4 fields (op, shape, dtype, time), found {}",
                    record.len()
                ),
            ));
        }
        let Some(per_second) = divisor else {
            divisor = Some(parse_header(&record).map_err(|rule| err(line, rule))?);
            continue;
        };
        let KernelRow {
            op,
            shape,
            dtype,
            time,
        } = record
            .deserialize(None)
            .map_err(|e| err(line, format!("row: {e}")))?;
        if op.is_empty() {
            return Err(err(line, "op must not be empty".into()));
        }
        if !valid_shape(shape) {
            return Err(err(
                line,
                format!(
                    "shape {shape:?} is not a canonical shape key (MxNxK, BxMxNxK, \
                     b<batch>h<heads>q<seq_q>k<seq_kv>d<head_dim>c|n, or <bytes>B)"
                ),
            ));
        }
        if dtype != "bf16" && dtype != "fp8" {
            return Err(err(
                line,
                format!("dtype must be \"bf16\" or \"fp8\" (got {dtype:?})"),
            ));
        }
        let value: f64 = time
            .parse()
            .map_err(|_| err(line, format!("time {time:?} is not a number")))?;
        if !(value.is_finite() && value > 0.0) {
            return Err(err(
                line,
                format!("time must be a positive finite number (got {time})"),
            ));
        }
        let key = (op.to_owned(), shape.to_owned(), dtype.to_owned());
        if let Some(first) = seen.get(&key) {
            return Err(err(
                line,
                format!(
                    "duplicate entry for ({op}, {shape}, {dtype}); first given on line {first}"
                ),
            ));
        }
        seen.insert(key, line);
        // Division by an exact power of ten rounds once: "1750" us reads as the double nearest
        // 1.75e-3 s.
        table.insert(op, shape, dtype, value / per_second);
    }
    if divisor.is_none() {
        return Err(err(
            text.lines().count().max(1),
            "missing header row \"op,shape,dtype,<seconds|s|ms|us>\"".into(),
        ));
    }
    Ok(table)
}

/// Writes a table as CSV (header `op,shape,dtype,seconds`), in key order; the inverse of
/// [`parse_kernel_table`].
pub fn write_kernel_table(table: &KernelTable) -> String {
    let mut out = TableWriter::new();
    out.record(&["op", "shape", "dtype", "seconds"]);
    for (op, shape, dtype, seconds) in table.iter() {
        // `{:?}` on f64 prints the shortest representation that reads back exactly.
        out.record(&[op, shape, dtype, &format!("{seconds:?}")]);
    }
    out.finish()
}

/// Checks the header (four fields) and returns how many of its time unit make one second.
fn parse_header(fields: &StringRecord) -> Result<f64, String> {
    let names = ["op", "shape", "dtype"];
    for (i, want) in names.iter().enumerate() {
        if fields[i] != **want {
            return Err(format!(
                "header column {} must be {want:?} (got {:?}); the header is \
                 \"op,shape,dtype,<seconds|s|ms|us>\"",
                i + 1,
                &fields[i]
            ));
        }
    }
    match &fields[3] {
        "seconds" | "s" => Ok(1.0),
        "ms" => Ok(1e3),
        "us" => Ok(1e6),
        other => Err(format!(
            "header column 4 names the time unit and must be \"seconds\", \"s\", \"ms\" or \"us\" \
             (got {other:?})"
        )),
    }
}

/// True for the canonical shape keys of `shape_key`.
fn valid_shape(s: &str) -> bool {
    fn number(s: &str) -> bool {
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && s.parse::<u64>().is_ok()
    }
    if let Some(bytes) = s.strip_suffix('B') {
        return number(bytes);
    }
    if let Some(rest) = s.strip_prefix('b') {
        // b{batch}h{heads}q{seq_q}k{seq_kv}d{head_dim}{c|n}
        let Some(rest) = rest.strip_suffix('c').or_else(|| rest.strip_suffix('n')) else {
            return false;
        };
        let mut rest = rest;
        for sep in ['h', 'q', 'k', 'd'] {
            let Some((num, tail)) = rest.split_once(sep) else {
                return false;
            };
            if !number(num) {
                return false;
            }
            rest = tail;
        }
        return number(rest);
    }
    let parts: Vec<&str> = s.split('x').collect();
    (parts.len() == 3 || parts.len() == 4) && parts.iter().all(|p| number(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_core::cost::compute::shape_key;
    use prism_core::ops::Work;

    fn data(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name)
    }

    fn row_error(text: &str) -> (usize, String) {
        match parse_kernel_table(text, "t.csv").unwrap_err() {
            KernelTableError::Row { path, line, rule } => {
                assert_eq!(path, "t.csv");
                (line, rule)
            }
            e => panic!("unexpected {e}"),
        }
    }

    #[test]
    fn reads_fixture() {
        let t = read_kernel_table(&data("kernels_h100.csv")).unwrap();
        assert_eq!(t.len(), 5);
        assert_eq!(t.get("fc1_fwd", "8192x6656x16384", "bf16"), Some(2310.5e-6));
        assert_eq!(t.get("fc1_fwd", "8192x6656x16384", "fp8"), Some(1310e-6));
        assert_eq!(
            t.get("attn_fwd", "b1h16q8192k8192d128c", "bf16"),
            Some(1750e-6)
        );
        assert_eq!(t.get("rms,norm_fwd", "268435456B", "bf16"), Some(95.25e-6));
        assert_eq!(
            t.get("expert_fc1_fwd", "8x512x1024x4096", "bf16"),
            Some(12e-6)
        );
    }

    #[test]
    fn bad_fixture_names_file_line_and_rule() {
        let path = data("kernels_bad.csv");
        let e = read_kernel_table(&path).unwrap_err().to_string();
        assert!(e.starts_with(&format!("{}:4: ", path.display())), "{e}");
        assert!(e.contains("dtype must be"), "{e}");
    }

    #[test]
    fn missing_file_is_io_error() {
        let e = read_kernel_table(&data("no_such_file.csv")).unwrap_err();
        assert!(matches!(e, KernelTableError::Io { .. }));
        assert!(e.to_string().contains("no_such_file.csv"));
    }

    #[test]
    fn units_and_quoting() {
        let t = parse_kernel_table(
            "\u{feff}op,shape,dtype,ms\r\n\"a\"\"b\" , 1x2x3 ,\"bf16\", 2.5\r\n",
            "t.csv",
        )
        .unwrap();
        assert_eq!(t.get("a\"b", "1x2x3", "bf16"), Some(2.5e-3));
        let t = parse_kernel_table("op,shape,dtype,seconds\nx,1B,fp8,1e-6\n", "t.csv").unwrap();
        assert_eq!(t.get("x", "1B", "fp8"), Some(1e-6));
    }

    #[test]
    fn tricky_valid_file_reads_the_same_values() {
        let text = "\u{feff}# measured on H100\r\n\
                    \r\n\
                    \x20op , shape ,dtype,\"us\"\r\n\
                    \x20  # indented comment\r\n\
                    \x20\t\r\n\
                    \x20\"fc1, \"\"fwd\"\"\" \t, 8x16x32,bf16 , 2310.5\r\n\
                    \"#3 gemm\",\"1B\", \"fp8\" ,1e3\r\n\
                    \" padded \",b1h2q3k4d5c,bf16,\"0.5\"";
        let t = parse_kernel_table(text, "t.csv").unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t.get("fc1, \"fwd\"", "8x16x32", "bf16"), Some(2310.5e-6));
        assert_eq!(t.get("#3 gemm", "1B", "fp8"), Some(1e-3));
        assert_eq!(t.get(" padded ", "b1h2q3k4d5c", "bf16"), Some(0.5e-6));
    }

    #[test]
    fn written_text() {
        let mut t = KernelTable::new();
        t.insert("fc1_fwd", "8x16x32", "bf16", 2.3105e-3);
        t.insert("#3", "1B", "fp8", 1e-6);
        t.insert("a,b", "1B", "bf16", 0.5);
        t.insert(" pad", "1B", "bf16", 2.0);
        assert_eq!(
            write_kernel_table(&t),
            "op,shape,dtype,seconds\n\
             \" pad\",\"1B\",\"bf16\",\"2.0\"\n\
             \"#3\",1B,fp8,1e-6\n\
             \"a,b\",1B,bf16,0.5\n\
             fc1_fwd,8x16x32,bf16,0.0023105\n"
        );
    }

    #[test]
    fn row_rules() {
        let h = "op,shape,dtype,us\n";
        let cases = [
            (format!("{h}a,1x2x3,bf16\n"), 2, "expected 4 fields"),
            (format!("{h}a,1x2x3,bf16,1,2\n"), 2, "expected 4 fields"),
            (
                format!("{h}\n# c\na,1x2,bf16,1\n"),
                4,
                "canonical shape key",
            ),
            (
                format!("{h}a,b1h2q3k4d5x,bf16,1\n"),
                2,
                "canonical shape key",
            ),
            (format!("{h}a,1x2x3,fp16,1\n"), 2, "dtype must be"),
            (format!("{h}a,1x2x3,bf16,abc\n"), 2, "not a number"),
            (format!("{h}a,1x2x3,bf16,-1\n"), 2, "positive finite"),
            (format!("{h}a,1x2x3,bf16,0\n"), 2, "positive finite"),
            (format!("{h}a,1x2x3,bf16,inf\n"), 2, "positive finite"),
            (format!("{h},1x2x3,bf16,1\n"), 2, "op must not be empty"),
            (
                format!("{h}\"a,1x2x3,bf16,1\n"),
                2,
                "unterminated quoted field 1",
            ),
            (
                format!("{h}\"a\"x,1x2x3,bf16,1\n"),
                2,
                "after the closing quote",
            ),
            (format!("{h}a\"b,1x2x3,bf16,1\n"), 2, "stray quote"),
            (
                format!("{h}a,1x2x3,bf16,1\n\n\"b\" x,1B,bf16,1\n"),
                4,
                "unexpected 'x' after the closing quote of field 1",
            ),
            (
                format!("{h}a,1x2x3,bf16,\"1"),
                2,
                "unterminated quoted field 4",
            ),
            (
                format!("{h}\"a\nb\",1x2x3,bf16,1\n"),
                2,
                "unterminated quoted field 1",
            ),
            // The first error of the file wins, whatever its kind.
            (
                format!("{h}a,1x2x3,fp16,1\na\"b,1B,bf16,1\n"),
                2,
                "dtype must be",
            ),
            (
                format!("{h}a,1x2x3,bf16,1\nb,1B,bf16,1\na,1x2x3,bf16,2\n"),
                4,
                "first given on line 2",
            ),
            ("op,shape,dtype,minutes\n".to_string(), 1, "time unit"),
            (
                "name,shape,dtype,us\n".to_string(),
                1,
                "header column 1 must be \"op\"",
            ),
            ("# only a comment\n".to_string(), 1, "missing header"),
            (String::new(), 1, "missing header"),
        ];
        for (text, line, rule) in cases {
            let (l, r) = row_error(&text);
            assert_eq!(l, line, "{text:?}: {r}");
            assert!(r.contains(rule), "{text:?}: {r}");
        }
    }

    #[test]
    fn shape_keys_of_the_core_are_valid() {
        for w in [
            Work::Gemm {
                m: 8192,
                n: 2304,
                k: 16384,
                batch: 1,
            },
            Work::Gemm {
                m: 1,
                n: 2,
                k: 3,
                batch: 64,
            },
            Work::Attention {
                batch: 2,
                heads: 16,
                seq_q: 4096,
                seq_kv: 8192,
                head_dim: 128,
                causal: false,
                window: 0,
                backward: true,
            },
            Work::Attention {
                batch: 1,
                heads: 1,
                seq_q: 1,
                seq_kv: 1,
                head_dim: 1,
                causal: true,
                window: 0,
                backward: false,
            },
            Work::Memory { bytes: 0 },
        ] {
            assert!(valid_shape(&shape_key(&w)), "{}", shape_key(&w));
        }
        for bad in [
            "",
            "B",
            "x1x2",
            "1x2x3x4x5",
            "1xx2",
            "b1h2q3k4d5",
            "bh2q3k4d5c",
            "12b",
            "-1B",
        ] {
            assert!(!valid_shape(bad), "{bad}");
        }
    }

    #[test]
    fn write_round_trips() {
        let mut t = KernelTable::new();
        t.insert("fc1_fwd", "8192x6656x16384", "bf16", 2.3105e-3);
        t.insert("odd, \"name\"", "1B", "fp8", 0.1 + 0.2);
        t.insert(" padded", "b1h2q3k4d5n", "bf16", 1e-7);
        // An op that starts with `#` is quoted, not read back as a comment line.
        t.insert("#3 gemm", "1B", "bf16", 2e-6);
        let text = write_kernel_table(&t);
        assert_eq!(parse_kernel_table(&text, "w.csv").unwrap(), t);
    }
}
