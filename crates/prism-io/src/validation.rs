//! Validation cases: published training runs written as Prism jobs, and the runner that compares
//! Prism's predictions with the published figures.
//!
//! The case set lives in `validation/cases.csv` (one row per row of
//! `shared/validation/calibration.csv`, see `validation/README.md`). Each row names the published
//! metric and value, the job (a model preset or inline sizes, a cluster preset, the parallel layout
//! and training settings, in columns named after the job-file keys), the assumptions made for
//! what the source does not give, and whether the case is modelled or excluded (with the reason).
//!
//! [`parse_cases`] checks every row, turns its job columns into a readable job file
//! ([`Case::job_toml`]) and loads that job with [`jobfile::load_job_str`] so that a broken case is
//! reported at its CSV line and column. [`run_case`] simulates one case (reduced mode, memory fit
//! ignored) and [`stats`] sums the errors up per source.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use prism_core::report::Summary;
use prism_core::{Mode, SimOptions};

use crate::csv_text::{Field, Record, split_csv};
use crate::files::read_limited;
use crate::jobfile;
use crate::presets;

/// A published figure Prism can predict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Metric {
    /// Hardware FLOPs utilisation (recompute included), a fraction of the dense peak.
    Hfu,
    /// Model FLOPs utilisation (no recompute), a fraction of the dense peak.
    Mfu,
    /// Model TFLOP/s per GPU (no recompute).
    TflopsModel,
    /// Hardware TFLOP/s per GPU (recompute included).
    TflopsHw,
    /// Tokens per second per GPU.
    TokensPerSPerGpu,
    /// Seconds per iteration.
    IterationTimeS,
}

impl Metric {
    /// Every metric, in display order.
    pub const ALL: [Metric; 6] = [
        Metric::Hfu,
        Metric::Mfu,
        Metric::TflopsModel,
        Metric::TflopsHw,
        Metric::TokensPerSPerGpu,
        Metric::IterationTimeS,
    ];

    /// The name used in `cases.csv`.
    pub fn name(self) -> &'static str {
        match self {
            Metric::Hfu => "hfu",
            Metric::Mfu => "mfu",
            Metric::TflopsModel => "tflops_model",
            Metric::TflopsHw => "tflops_hw",
            Metric::TokensPerSPerGpu => "tokens_per_s_per_gpu",
            Metric::IterationTimeS => "iteration_time_s",
        }
    }

    /// The metric called `name` (exact, lower case).
    pub fn from_name(name: &str) -> Option<Metric> {
        Metric::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Unit of the metric's values.
    pub fn unit(self) -> &'static str {
        match self {
            Metric::Hfu | Metric::Mfu => "fraction of peak",
            Metric::TflopsModel | Metric::TflopsHw => "TFLOP/s per GPU",
            Metric::TokensPerSPerGpu => "tokens/s per GPU",
            Metric::IterationTimeS => "s",
        }
    }

    /// True for the utilisation metrics, whose values are fractions in (0, 1].
    pub fn is_fraction(self) -> bool {
        matches!(self, Metric::Hfu | Metric::Mfu)
    }

    /// The metric's value in a simulation summary. MFU and HFU are against the dense peak of the
    /// job's precision, as [`Summary`] reports them.
    pub fn from_summary(self, s: &Summary) -> f64 {
        match self {
            Metric::Hfu => s.hfu,
            Metric::Mfu => s.mfu,
            Metric::TflopsModel => s.model_tflops_per_gpu,
            Metric::TflopsHw => s.hardware_tflops_per_gpu,
            Metric::TokensPerSPerGpu => s.tokens_per_s / s.num_gpus.max(1) as f64,
            Metric::IterationTimeS => s.iteration_time_s,
        }
    }

    /// The metric's value at the summary's expected iteration time with stragglers
    /// ([`Summary::expected_iteration_time_s`]): every rate is the nominal one times
    /// `T / E[T]`, and the iteration time is `E[T]`.
    pub fn from_summary_with_stragglers(self, s: &Summary) -> f64 {
        let nominal = self.from_summary(s);
        let (t, te) = (s.iteration_time_s, s.expected_iteration_time_s);
        match self {
            Metric::IterationTimeS => te,
            _ if te > 0.0 => nominal * (t / te),
            _ => nominal,
        }
    }
}

/// Which of Prism's two iteration times a case's published figure is compared with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compare {
    /// The simulated iteration on identical GPUs (the default: the calibrated parameters were
    /// fitted against it, so whatever a run loses to its slowest GPU is folded into them).
    #[default]
    Nominal,
    /// The expected iteration with stragglers: the nominal one stretched by the slowest of the
    /// job's GPUs at the job's `cluster.gpu_speed_cv` ([`prism_core::straggler`]).
    Stragglers,
}

impl Compare {
    /// The name in `prism validate --json` (`compared`).
    pub fn name(self) -> &'static str {
        match self {
            Compare::Nominal => "nominal",
            Compare::Stragglers => "stragglers",
        }
    }

    /// The comparison that is not this one.
    pub fn other(self) -> Compare {
        match self {
            Compare::Nominal => Compare::Stragglers,
            Compare::Stragglers => Compare::Nominal,
        }
    }
}

/// How [`run_case_with`] compares a case.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CaseOptions {
    /// Which iteration time the published figure is compared with.
    pub compare: Compare,
    /// Per-GPU speed spread to use in every case instead of the case job's
    /// `cluster.gpu_speed_cv` (for scans and for `prism calibrate --stragglers`).
    pub gpu_speed_cv: Option<f64>,
}

impl fmt::Display for Metric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether a case is simulated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// Prism models the run; the case is simulated.
    Modelled,
    /// Prism cannot model the run faithfully; the reason.
    Excluded(String),
}

impl Status {
    /// True for [`Status::Modelled`].
    pub fn is_modelled(&self) -> bool {
        matches!(self, Status::Modelled)
    }
}

/// One validation case: a published figure and the job that reproduces the run.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    /// Case id (the `calibration.csv` id).
    pub id: String,
    /// Short citation of the source.
    pub source: String,
    /// What was published.
    pub metric: Metric,
    /// The published value, in the metric's unit (utilisations as fractions).
    pub published: f64,
    /// Accepted relative error, percent.
    pub tolerance_pct: f64,
    /// The generated job file (TOML), with the case's provenance and assumptions as comments.
    pub job_toml: String,
    /// What was assumed for what the source does not give.
    pub assumptions: String,
    /// Modelled or excluded.
    pub status: Status,
}

/// A case file that could not be read: where, which column, which rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidationError {
    /// The case file (or the origin given to [`parse_cases`]).
    pub origin: String,
    /// 1-based line and column of the offending field, when one is at fault.
    pub location: Option<(usize, usize)>,
    /// The CSV column at fault, when one is.
    pub column: Option<String>,
    /// The rule broken, with the values involved.
    pub rule: String,
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.origin)?;
        if let Some((line, col)) = self.location {
            write!(f, ":{line}:{col}")?;
        }
        f.write_str(": ")?;
        if let Some(c) = &self.column {
            write!(f, "column `{c}`: ")?;
        }
        f.write_str(&self.rule)
    }
}

impl std::error::Error for ValidationError {}

/// The prediction for one case against its published value.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseResult {
    /// Case id.
    pub id: String,
    /// Short citation of the source.
    pub source: String,
    /// What was compared.
    pub metric: Metric,
    /// The published value.
    pub published: f64,
    /// Prism's prediction, same unit, at the iteration time named by `compared`.
    pub predicted: f64,
    /// Signed relative error, percent: `(predicted - published) / published x 100`.
    pub error_pct: f64,
    /// Which iteration time `predicted` and `error_pct` are at.
    pub compared: Compare,
    /// The prediction at the nominal iteration time (identical GPUs).
    pub predicted_nominal: f64,
    /// Signed error of `predicted_nominal`, percent.
    pub error_nominal_pct: f64,
    /// The prediction at the expected iteration time with stragglers.
    pub predicted_stragglers: f64,
    /// Signed error of `predicted_stragglers`, percent.
    pub error_stragglers_pct: f64,
    /// GPUs of the run.
    pub num_gpus: u64,
    /// The per-GPU speed spread the straggler prediction used.
    pub gpu_speed_cv: f64,
    /// Accepted relative error, percent.
    pub tolerance_pct: f64,
    /// `|error_pct| <= tolerance_pct`.
    pub within: bool,
    /// Prism's peak memory per GPU (the fullest pipeline stage), GiB.
    pub peak_memory_gib: f64,
    /// The GPU's memory, GiB. A published run ran, so a peak above it is a memory-model error.
    pub hbm_gib: f64,
}

impl CaseResult {
    /// The signed error at `compare`'s iteration time, percent.
    pub fn error_at(&self, compare: Compare) -> f64 {
        match compare {
            Compare::Nominal => self.error_nominal_pct,
            Compare::Stragglers => self.error_stragglers_pct,
        }
    }

    /// The signed error of the comparison that was not made (stragglers when `compared` is
    /// nominal, and the other way round), percent.
    pub fn other_error_pct(&self) -> f64 {
        self.error_at(self.compared.other())
    }

    /// Whether Prism's peak memory fits the GPU, as it must for a run that was published.
    pub fn fits(&self) -> bool {
        self.peak_memory_gib <= self.hbm_gib
    }
}

/// Error statistics of a group of cases.
#[derive(Clone, Debug, PartialEq)]
pub struct SourceStats {
    /// The group: a case-id prefix (`meg21`, `kor22`, ...) or `overall`.
    pub source: String,
    /// Cases in the group.
    pub count: usize,
    /// Mean absolute percentage error (0 for an empty group).
    pub mape: f64,
    /// Largest absolute percentage error (0 for an empty group).
    pub max_abs: f64,
}

// ---------------------------------------------------------------------------------------------
// Columns
// ---------------------------------------------------------------------------------------------

/// Columns every case file must have.
const REQUIRED_COLUMNS: &[&str] = &[
    "id",
    "source",
    "metric",
    "published",
    "tolerance_pct",
    "status",
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Free text.
    Text,
    /// A non-negative integer (job-file `int`).
    Int,
    /// `true` / `false`.
    Bool,
    /// One of the listed lower-case words.
    Choice(&'static [&'static str]),
}

/// A job column: its CSV name, the job-file section and key it sets, its kind.
struct JobColumn {
    name: &'static str,
    section: &'static str,
    key: &'static str,
    kind: Kind,
}

const fn jc(name: &'static str, section: &'static str, key: &'static str, kind: Kind) -> JobColumn {
    JobColumn {
        name,
        section,
        key,
        kind,
    }
}

/// Job columns in the order they are written into the job file.
const JOB_COLUMNS: &[JobColumn] = &[
    jc("model_preset", "model", "preset", Kind::Text),
    jc("layers", "model", "layers", Kind::Int),
    jc("hidden", "model", "hidden", Kind::Int),
    jc("ffn_hidden", "model", "ffn_hidden", Kind::Int),
    jc("heads", "model", "heads", Kind::Int),
    jc("kv_heads", "model", "kv_heads", Kind::Int),
    jc("vocab", "model", "vocab", Kind::Int),
    jc("seq_len", "model", "seq_len", Kind::Int),
    jc(
        "activation",
        "model",
        "activation",
        Kind::Choice(&["swiglu", "gelu"]),
    ),
    jc("tied_embeddings", "model", "tied_embeddings", Kind::Bool),
    jc("moe_experts", "model", "moe_experts", Kind::Int),
    jc("moe_top_k", "model", "moe_top_k", Kind::Int),
    jc("dropout", "model", "dropout", Kind::Bool),
    jc("cluster_preset", "cluster", "preset", Kind::Text),
    jc("nodes", "cluster", "nodes", Kind::Int),
    jc("tp", "parallel", "tp", Kind::Int),
    jc("pp", "parallel", "pp", Kind::Int),
    jc("cp", "parallel", "cp", Kind::Int),
    jc("ep", "parallel", "ep", Kind::Int),
    jc("dp", "parallel", "dp", Kind::Int),
    jc("vpp", "parallel", "vpp", Kind::Int),
    jc(
        "schedule",
        "parallel",
        "schedule",
        Kind::Choice(&["1f1b", "interleaved", "gpipe", "dualpipe", "1f1b-overlap"]),
    ),
    jc("micro_batch", "parallel", "micro_batch", Kind::Int),
    jc(
        "sequence_parallel",
        "parallel",
        "sequence_parallel",
        Kind::Bool,
    ),
    jc(
        "recompute",
        "parallel",
        "recompute",
        Kind::Choice(&["none", "selective", "full", "selective-op"]),
    ),
    jc(
        "distributed_optimizer",
        "parallel",
        "distributed_optimizer",
        Kind::Bool,
    ),
    jc("global_batch", "training", "global_batch", Kind::Int),
    jc(
        "precision",
        "training",
        "precision",
        Kind::Choice(&["bf16", "fp16", "fp8"]),
    ),
    jc("flash_attention", "training", "flash_attention", Kind::Bool),
];

/// Columns that are not job keys.
const OTHER_COLUMNS: &[&str] = &[
    "id",
    "source",
    "metric",
    "published",
    "tolerance_pct",
    "status",
    "exclusion_reason",
    "overrides",
    "assumptions",
];

/// Sections `overrides` may set, in job-file order.
const SECTIONS: &[&str] = &["model", "cluster", "parallel", "training"];

/// Inline model sizes a modelled case needs when it names no model preset.
const INLINE_MODEL_REQUIRED: &[&str] = &[
    "layers",
    "hidden",
    "ffn_hidden",
    "heads",
    "vocab",
    "seq_len",
    "activation",
];

/// Job columns a modelled case needs.
const MODELLED_REQUIRED: &[&str] = &["cluster_preset", "nodes", "tp", "pp", "global_batch"];

fn all_column_names() -> impl Iterator<Item = &'static str> {
    OTHER_COLUMNS
        .iter()
        .copied()
        .chain(JOB_COLUMNS.iter().map(|c| c.name))
}

// ---------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------

/// Reads and checks the case file at `path`; see [`parse_cases`].
pub fn read_cases(path: &Path) -> Result<Vec<Case>, ValidationError> {
    let origin = path.display().to_string();
    let text = read_limited(path).map_err(|rule| ValidationError {
        origin: origin.clone(),
        location: None,
        column: None,
        rule: format!("cannot read case file: {rule}"),
    })?;
    parse_cases(&text, &origin)
}

/// Parses and checks case-file text. `origin` names it in errors.
///
/// Checks, each reported as `origin:line:column: column `name`: rule`: CSV syntax; known, unique
/// header columns including `id, source, metric, published, tolerance_pct, status`; one field per
/// column in every row; unique, non-empty ids; a known metric; a positive published value (a
/// fraction at most 1 for `mfu` / `hfu`); a positive tolerance; `status` `modelled` (no
/// `exclusion_reason`) or `excluded` (with one); integers, booleans and choices in the job
/// columns; known presets; well-formed `overrides`. A modelled case must name a model (a preset
/// or the inline sizes), a cluster preset, `nodes`, `tp`, `pp` and `global_batch`, may not compare
/// MFU/HFU of an FP8 job (those are against the FP8 peak in Prism, against the BF16 peak in
/// publications), and its generated job must load and validate; a job error is reported at the
/// column that set the offending key.
pub fn parse_cases(text: &str, origin: &str) -> Result<Vec<Case>, ValidationError> {
    let err = |line: usize, col: usize, column: Option<&str>, rule: String| ValidationError {
        origin: origin.to_string(),
        location: Some((line, col)),
        column: column.map(str::to_string),
        rule,
    };
    let records = split_csv(text).map_err(|(l, c, rule)| err(l, c, None, rule))?;
    let Some((header, rows)) = records.split_first() else {
        return Err(err(
            1,
            1,
            None,
            format!(
                "empty case file: expected a header line naming the columns (at least {})",
                REQUIRED_COLUMNS.join(", ")
            ),
        ));
    };

    // Header.
    let mut columns: Vec<&str> = Vec::new();
    for f in &header.fields {
        let name = f.text.trim();
        if !all_column_names().any(|c| c == name) {
            let hint = match presets::closest(name, all_column_names()) {
                Some(c) => format!("; did you mean `{c}`?"),
                None => String::new(),
            };
            return Err(err(
                f.line,
                f.col,
                None,
                format!(
                    "unknown column `{name}`{hint} (known columns: {})",
                    all_column_names().collect::<Vec<_>>().join(", ")
                ),
            ));
        }
        if columns.contains(&name) {
            return Err(err(
                f.line,
                f.col,
                Some(name),
                "column given twice in the header".into(),
            ));
        }
        columns.push(name);
    }
    for req in REQUIRED_COLUMNS {
        if !columns.contains(req) {
            return Err(err(
                header.line,
                1,
                Some(req),
                "required column missing from the header".into(),
            ));
        }
    }

    let mut cases = Vec::with_capacity(rows.len());
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    for rec in rows {
        if rec.fields.len() != columns.len() {
            let (line, col) = rec
                .fields
                .get(columns.len())
                .map_or((rec.line, 1), |f| (f.line, f.col));
            return Err(err(
                line,
                col,
                None,
                format!(
                    "row has {} fields, the header has {} columns",
                    rec.fields.len(),
                    columns.len()
                ),
            ));
        }
        let row = Row {
            columns: &columns,
            record: rec,
        };
        let case = parse_row(&row, origin)?;
        if let Some(first) = seen.get(&case.id) {
            let f = row.field("id").expect("required column");
            return Err(err(
                f.line,
                f.col,
                Some("id"),
                format!("duplicate id `{}` (first on line {first})", case.id),
            ));
        }
        seen.insert(case.id.clone(), rec.line);
        cases.push(case);
    }
    Ok(cases)
}

/// One data row with its header.
struct Row<'a> {
    columns: &'a [&'a str],
    record: &'a Record,
}

impl Row<'_> {
    fn field(&self, name: &str) -> Option<&Field> {
        self.columns
            .iter()
            .position(|c| *c == name)
            .map(|i| &self.record.fields[i])
    }

    /// The trimmed text of a column; empty when the column is absent or blank.
    fn text(&self, name: &str) -> &str {
        self.field(name).map_or("", |f| f.text.trim())
    }

    /// Position of a column's field, or of the row's start when the column is absent.
    fn pos(&self, name: &str) -> (usize, usize) {
        self.field(name)
            .map_or((self.record.line, 1), |f| (f.line, f.col))
    }
}

/// A key of the generated job and where its value came from.
struct JobKey {
    section: &'static str,
    key: String,
    /// TOML value text.
    value: String,
    /// The CSV column that set it.
    column: &'static str,
}

fn parse_row(row: &Row<'_>, origin: &str) -> Result<Case, ValidationError> {
    let err = |column: &str, rule: String| {
        let (line, col) = row.pos(column);
        ValidationError {
            origin: origin.to_string(),
            location: Some((line, col)),
            column: Some(column.to_string()),
            rule,
        }
    };

    let id = row.text("id").to_string();
    if id.is_empty() {
        return Err(err("id", "must not be empty".into()));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')))
    {
        return Err(err(
            "id",
            format!("`{id}`: only letters, digits, `_`, `-` and `.` are allowed (found `{c}`)"),
        ));
    }
    let source = row.text("source").to_string();
    if source.is_empty() {
        return Err(err("source", "must not be empty (cite the source)".into()));
    }
    let metric_text = row.text("metric");
    let metric = Metric::from_name(metric_text).ok_or_else(|| {
        err(
            "metric",
            format!(
                "unknown metric `{metric_text}`; expected one of {}",
                Metric::ALL.map(Metric::name).join(", ")
            ),
        )
    })?;
    let published = parse_positive(row, "published").map_err(|r| err("published", r))?;
    if metric.is_fraction() && published > 1.0 {
        return Err(err(
            "published",
            format!(
                "{metric} is a fraction of the peak, at most 1 (got {published}; write 44 % as 0.44)"
            ),
        ));
    }
    let tolerance_pct =
        parse_positive(row, "tolerance_pct").map_err(|r| err("tolerance_pct", r))?;
    let reason = row.text("exclusion_reason");
    let status = match row.text("status") {
        "modelled" => {
            if !reason.is_empty() {
                return Err(err(
                    "exclusion_reason",
                    "must be empty for a modelled case (or set status = excluded)".into(),
                ));
            }
            Status::Modelled
        }
        "excluded" => {
            if reason.is_empty() {
                return Err(err(
                    "exclusion_reason",
                    "an excluded case must say why it is excluded".into(),
                ));
            }
            Status::Excluded(reason.to_string())
        }
        other => {
            return Err(err(
                "status",
                format!("expected `modelled` or `excluded`, found `{other}`"),
            ));
        }
    };
    let assumptions = row.text("assumptions").to_string();

    // Job columns.
    let mut keys: Vec<JobKey> = Vec::new();
    for c in JOB_COLUMNS {
        let v = row.text(c.name);
        if v.is_empty() {
            continue;
        }
        let value = match c.kind {
            Kind::Int => match v.parse::<u32>() {
                Ok(n) => n.to_string(),
                Err(_) => {
                    return Err(err(
                        c.name,
                        format!(
                            "expected a non-negative integer (at most {}), found `{v}`",
                            u32::MAX
                        ),
                    ));
                }
            },
            Kind::Bool => match v {
                "true" | "false" => v.to_string(),
                _ => {
                    return Err(err(
                        c.name,
                        format!("expected `true` or `false`, found `{v}`"),
                    ));
                }
            },
            Kind::Choice(options) => {
                if !options.contains(&v) {
                    return Err(err(
                        c.name,
                        format!("expected one of {}, found `{v}`", options.join(", ")),
                    ));
                }
                toml_string(v)
            }
            Kind::Text => toml_string(v),
        };
        keys.push(JobKey {
            section: c.section,
            key: c.key.to_string(),
            value,
            column: c.name,
        });
    }
    check_preset(row, "model_preset", &presets::model_preset_names(), "model")
        .map_err(|r| err("model_preset", r))?;
    check_preset(
        row,
        "cluster_preset",
        &presets::cluster_preset_names(),
        "cluster",
    )
    .map_err(|r| err("cluster_preset", r))?;
    for o in parse_overrides(row.text("overrides")).map_err(|r| err("overrides", r))? {
        if let Some(k) = keys
            .iter()
            .find(|k| k.section == o.section && k.key == o.key)
        {
            return Err(err(
                "overrides",
                format!(
                    "`{}.{}` is already set by column `{}`",
                    o.section, o.key, k.column
                ),
            ));
        }
        keys.push(o);
    }

    if status.is_modelled() {
        if row.text("model_preset").is_empty()
            && let Some(missing) = INLINE_MODEL_REQUIRED
                .iter()
                .find(|c| row.text(c).is_empty())
        {
            return Err(err(
                missing,
                "a modelled case needs `model_preset` or the inline model sizes \
                 (layers, hidden, ffn_hidden, heads, vocab, seq_len, activation)"
                    .into(),
            ));
        }
        if let Some(missing) = MODELLED_REQUIRED.iter().find(|c| row.text(c).is_empty()) {
            return Err(err(missing, "required for a modelled case".into()));
        }
        if metric.is_fraction() && row.text("precision") == "fp8" {
            return Err(err(
                "metric",
                format!(
                    "{metric} of an FP8 job is against the FP8 peak in Prism but against the BF16 \
                     peak in publications; compare tflops_model (or tflops_hw) instead"
                ),
            ));
        }
    }

    let job_toml = render_job(
        &id,
        &source,
        metric,
        published,
        tolerance_pct,
        &status,
        &assumptions,
        &keys,
    );
    if status.is_modelled()
        && let Err(e) = jobfile::load_job_str(&job_toml, &format!("case {id}"), None, &[])
    {
        let column = e
            .key
            .as_deref()
            .and_then(|k| k.split_once('.'))
            .and_then(|(section, key)| {
                keys.iter()
                    .find(|j| j.section == section && j.key == key)
                    .map(|j| j.column)
            })
            .unwrap_or("id");
        let mut rule = String::from("the generated job is invalid: ");
        if let Some(k) = &e.key {
            rule.push_str(k);
            rule.push_str(": ");
        }
        rule.push_str(&e.rule);
        if let Some(via) = &e.via {
            rule.push_str(&format!(" ({via})"));
        }
        return Err(err(column, rule));
    }

    Ok(Case {
        id,
        source,
        metric,
        published,
        tolerance_pct,
        job_toml,
        assumptions,
        status,
    })
}

fn parse_positive(row: &Row<'_>, column: &str) -> Result<f64, String> {
    let v = row.text(column);
    match v.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        Ok(_) => Err(format!("must be a positive finite number, found `{v}`")),
        Err(_) if v.is_empty() => Err("must not be empty".into()),
        Err(_) => Err(format!("expected a number, found `{v}`")),
    }
}

fn check_preset(row: &Row<'_>, column: &str, names: &[&str], kind: &str) -> Result<(), String> {
    let v = row.text(column);
    if v.is_empty() || names.contains(&v) {
        return Ok(());
    }
    let hint = match presets::closest(v, names.iter().copied()) {
        Some(c) => format!("did you mean `{c}`? "),
        None => String::new(),
    };
    Err(format!(
        "unknown {kind} preset `{v}`; {hint}known {kind} presets: {}",
        names.join(", ")
    ))
}

/// Parses `section.key=value; ...` (values are TOML values, e.g. `cluster.gpu="A100-SXM4-40GB"`).
fn parse_overrides(text: &str) -> Result<Vec<JobKey>, String> {
    let mut out: Vec<JobKey> = Vec::new();
    for item in text.split(';').map(str::trim).filter(|s| !s.is_empty()) {
        let Some((lhs, value)) = item.split_once('=') else {
            return Err(format!(
                "`{item}`: expected `section.key=value` (items separated by `;`)"
            ));
        };
        let (lhs, value) = (lhs.trim(), value.trim());
        let Some((section, key)) = lhs.split_once('.') else {
            return Err(format!("`{lhs}`: expected `section.key`"));
        };
        let Some(&section) = SECTIONS.iter().find(|s| **s == section) else {
            return Err(format!(
                "`{lhs}`: unknown section `{section}`; expected one of {}",
                SECTIONS.join(", ")
            ));
        };
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("`{lhs}`: `{key}` is not a job-file key"));
        }
        if value.is_empty() || toml::from_str::<toml::Table>(&format!("v = {value}")).is_err() {
            return Err(format!(
                "`{item}`: `{value}` is not a TOML value (quote strings: key=\"text\")"
            ));
        }
        if out.iter().any(|o| o.section == section && o.key == key) {
            return Err(format!("`{lhs}` is given twice"));
        }
        out.push(JobKey {
            section,
            key: key.to_string(),
            value: value.to_string(),
            column: "overrides",
        });
    }
    Ok(out)
}

/// A TOML basic string.
fn toml_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Appends `text` as `# ` comment lines wrapped at about 100 columns, the first line starting
/// with `label`.
fn push_comment(out: &mut String, label: &str, text: &str) {
    const WIDTH: usize = 100;
    let mut line = format!("# {label}");
    let indent = "#   ";
    for word in text.split_whitespace() {
        if line.len() + 1 + word.len() > WIDTH && line.len() > indent.len() {
            out.push_str(line.trim_end());
            out.push('\n');
            line = indent.to_string();
        } else if !line.ends_with(' ') {
            line.push(' ');
        }
        line.push_str(word);
    }
    out.push_str(line.trim_end());
    out.push('\n');
}

#[allow(clippy::too_many_arguments)]
fn render_job(
    id: &str,
    source: &str,
    metric: Metric,
    published: f64,
    tolerance_pct: f64,
    status: &Status,
    assumptions: &str,
    keys: &[JobKey],
) -> String {
    let mut out = String::new();
    push_comment(
        &mut out,
        "Validation case",
        &format!("{id} (validation/cases.csv)"),
    );
    push_comment(&mut out, "Source:", source);
    push_comment(
        &mut out,
        "Published:",
        &format!(
            "{metric} = {published} ({}), tolerance {tolerance_pct} %",
            metric.unit()
        ),
    );
    if let Status::Excluded(why) = status {
        push_comment(&mut out, "EXCLUDED:", why);
    }
    if !assumptions.is_empty() {
        push_comment(&mut out, "Assumptions:", assumptions);
    }
    out.push_str(&format!("name = {}\n", toml_string(id)));
    for section in SECTIONS {
        let in_section: Vec<&JobKey> = keys.iter().filter(|k| k.section == *section).collect();
        if in_section.is_empty() {
            continue;
        }
        out.push_str(&format!("\n[{section}]\n"));
        for k in in_section {
            out.push_str(&format!("{} = {}\n", k.key, k.value));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Running
// ---------------------------------------------------------------------------------------------

/// Simulates one modelled case and compares the prediction with the published value.
///
/// The job is loaded from [`Case::job_toml`] and simulated with `opts` in [`Mode::Reduced`]
/// (exact for symmetric placements); a placement the reduced mode rejects as asymmetric is
/// simulated in [`Mode::Full`] instead. A case is compared even when the memory model says a
/// stage would not fit; the result records the peak and the GPU's memory ([`CaseResult::fits`]).
/// Excluded cases, jobs that do not load, failed simulations and non-finite or non-positive
/// predictions are errors.
pub fn run_case(case: &Case, opts: &SimOptions) -> Result<CaseResult, String> {
    run_case_with(case, opts, &CaseOptions::default())
}

/// [`run_case`] with a choice of the compared iteration time and of the GPU speed spread. One
/// simulation gives both predictions; `predicted` and `error_pct` are the compared one.
pub fn run_case_with(
    case: &Case,
    opts: &SimOptions,
    how: &CaseOptions,
) -> Result<CaseResult, String> {
    if let Status::Excluded(why) = &case.status {
        return Err(format!("case {}: excluded: {why}", case.id));
    }
    let loaded = jobfile::load_job_str(&case.job_toml, &format!("case {}", case.id), None, &[])
        .map_err(|e| e.to_string())?;
    let mut job = loaded.job;
    if let Some(cv) = how.gpu_speed_cv {
        if !prism_core::straggler::is_valid_gpu_speed_cv(cv) {
            return Err(format!(
                "gpu speed spread {cv}: expected a coefficient of variation from 0 to {}",
                prism_core::straggler::MAX_GPU_SPEED_CV
            ));
        }
        job.cluster.gpu_speed_cv = cv;
    }
    let mut o = opts.clone();
    o.mode = Mode::Reduced;
    let result = prism_core::engine::simulate_or_full(&job, &o)
        .map_err(|e| format!("case {}: simulation failed: {e}", case.id))?;
    let nominal = case.metric.from_summary(&result.summary);
    let stragglers = case.metric.from_summary_with_stragglers(&result.summary);
    for v in [nominal, stragglers] {
        if !(v.is_finite() && v > 0.0) {
            return Err(format!(
                "case {}: predicted {} = {v} is not a positive finite number",
                case.id, case.metric
            ));
        }
    }
    let err = |v: f64| (v - case.published) / case.published * 100.0;
    let predicted = match how.compare {
        Compare::Nominal => nominal,
        Compare::Stragglers => stragglers,
    };
    let error_pct = err(predicted);
    Ok(CaseResult {
        id: case.id.clone(),
        source: case.source.clone(),
        metric: case.metric,
        published: case.published,
        predicted,
        error_pct,
        compared: how.compare,
        predicted_nominal: nominal,
        error_nominal_pct: err(nominal),
        predicted_stragglers: stragglers,
        error_stragglers_pct: err(stragglers),
        num_gpus: job.num_gpus(),
        gpu_speed_cv: job.cluster.gpu_speed_cv,
        tolerance_pct: case.tolerance_pct,
        within: error_pct.abs() <= case.tolerance_pct,
        peak_memory_gib: result.summary.peak_memory_bytes as f64 / prism_core::units::GIB,
        hbm_gib: job.cluster.gpu.hbm_gib,
    })
}

/// The group a case belongs to in [`stats`]: its id up to the first `_` (`meg21_t1_3` ->
/// `meg21`), i.e. the source prefix of `calibration.csv`.
pub fn source_prefix(id: &str) -> &str {
    id.split('_').next().unwrap_or(id)
}

fn group_stats(source: &str, errors: &[f64]) -> SourceStats {
    let count = errors.len();
    let abs = errors.iter().map(|e| e.abs());
    SourceStats {
        source: source.to_string(),
        count,
        mape: if count == 0 {
            0.0
        } else {
            abs.clone().sum::<f64>() / count as f64
        },
        max_abs: abs.fold(0.0, f64::max),
    }
}

/// Mean and largest absolute percentage error per source prefix ([`source_prefix`], in order of
/// first appearance) and over all results (`source = "overall"`).
pub fn stats(results: &[CaseResult]) -> (Vec<SourceStats>, SourceStats) {
    stats_by(results, |r| r.error_pct)
}

/// [`stats`] of another error of each result (e.g. `|r| r.error_stragglers_pct`).
pub fn stats_by(
    results: &[CaseResult],
    error: impl Fn(&CaseResult) -> f64,
) -> (Vec<SourceStats>, SourceStats) {
    let mut order: Vec<&str> = Vec::new();
    let mut groups: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in results {
        let p = source_prefix(&r.id);
        if !groups.contains_key(p) {
            order.push(p);
        }
        groups.entry(p).or_default().push(error(r));
    }
    let per = order.iter().map(|p| group_stats(p, &groups[p])).collect();
    let all: Vec<f64> = results.iter().map(&error).collect();
    (per, group_stats("overall", &all))
}

/// A fixed-width text table of results: id, metric, published, predicted, signed error,
/// within, and Prism's peak memory per GPU (marked where it exceeds the GPU's).
pub fn results_table(results: &[CaseResult]) -> String {
    let w = results.iter().map(|r| r.id.len()).max().unwrap_or(2).max(2);
    let compared = results.first().map(|r| r.compared).unwrap_or_default();
    let other = format!("{} %", compared.other().name());
    let mut out = format!(
        "{:<w$}  {:>6}  {:<20}  {:>12}  {:>12}  {:>8}  ok   {:>12}  {:>8}\n",
        "id", "GPUs", "metric", "published", "predicted", "error %", other, "peak GiB"
    );
    for r in results {
        out.push_str(&format!(
            "{:<w$}  {:>6}  {:<20}  {:>12}  {:>12}  {:>+8.1}  {:<3}  {:>+12.1}  {:>8.1}{}\n",
            r.id,
            r.num_gpus,
            r.metric.name(),
            fmt_value(r.published),
            fmt_value(r.predicted),
            r.error_pct,
            if r.within { "yes" } else { "no" },
            r.other_error_pct(),
            r.peak_memory_gib,
            if r.fits() {
                String::new()
            } else {
                format!("  > {:.0} GiB", r.hbm_gib)
            }
        ));
    }
    out
}

/// A fixed-width text table of [`stats`]: per source, then overall.
pub fn stats_table(per_source: &[SourceStats], overall: &SourceStats) -> String {
    stats_table_with(per_source, overall, None)
}

/// [`stats_table`] with a second pair of columns for the other comparison (`(label, per
/// source, overall)`, as [`stats_by`] gives them).
pub fn stats_table_with(
    per_source: &[SourceStats],
    overall: &SourceStats,
    other: Option<(&str, &[SourceStats], &SourceStats)>,
) -> String {
    let mut out = format!(
        "{:<12}  {:>5}  {:>8}  {:>9}",
        "source", "cases", "MAPE %", "max |e| %"
    );
    if let Some((label, _, _)) = other {
        out.push_str(&format!("  {:>24}", format!("{label}: MAPE / max")));
    }
    out.push('\n');
    let others: Vec<&SourceStats> = match other {
        Some((_, per, all)) => per.iter().chain(std::iter::once(all)).collect(),
        None => Vec::new(),
    };
    for (i, s) in per_source
        .iter()
        .chain(std::iter::once(overall))
        .enumerate()
    {
        out.push_str(&format!(
            "{:<12}  {:>5}  {:>8.1}  {:>9.1}",
            s.source, s.count, s.mape, s.max_abs
        ));
        if let Some(o) = others.get(i) {
            out.push_str(&format!(
                "  {:>24}",
                format!("{:.1} / {:.1}", o.mape, o.max_abs)
            ));
        }
        out.push('\n');
    }
    out
}

/// Four significant digits, without exponent for everyday magnitudes.
fn fmt_value(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let digits = (3 - v.abs().log10().floor() as i32).max(0) as usize;
    format!("{v:.digits$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_quotes_and_positions() {
        let recs = split_csv("a,\"b,\"\"c\"\"\",d\n\n1,2,3\r\n").unwrap();
        assert_eq!(recs.len(), 2);
        assert_eq!(recs[0].fields[1].text, "b,\"c\"");
        assert_eq!((recs[0].fields[2].line, recs[0].fields[2].col), (1, 13));
        assert_eq!(recs[1].line, 3);
        assert_eq!(recs[1].fields[2].text, "3");
        let e = split_csv("a,\"b\nc").unwrap_err();
        assert_eq!((e.0, e.1), (1, 3));
        let e = split_csv("a,b\"c\n").unwrap_err();
        assert_eq!((e.0, e.1), (1, 4));
    }

    #[test]
    fn overrides_parse() {
        let o = parse_overrides("cluster.hbm_gib=40.0; cluster.gpu=\"A\"").unwrap();
        assert_eq!(o.len(), 2);
        assert_eq!(o[1].value, "\"A\"");
        assert!(parse_overrides("cluster.gpu=A").is_err());
        assert!(parse_overrides("costs.x=1").is_err());
        assert!(parse_overrides("nodes=1").is_err());
    }

    #[test]
    fn comment_wrapping() {
        let mut s = String::new();
        push_comment(&mut s, "Label:", &"word ".repeat(60));
        assert!(s.lines().all(|l| l.starts_with('#') && l.len() <= 100));
        assert!(s.lines().count() > 2);
    }

    #[test]
    fn value_format() {
        assert_eq!(fmt_value(0.44), "0.4400");
        assert_eq!(fmt_value(137.0), "137.0");
        assert_eq!(fmt_value(23406.0), "23406");
    }
}
