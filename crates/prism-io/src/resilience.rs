//! Formats of `prism detect` and `prism resilience`: timing logs (CSV and Megatron-LM
//! iteration lines), ground-truth episodes (CSV), scenarios (TOML), JSON results and the
//! throughput-timeline SVG. Documented in `docs/resilience.md`. Every error names the line and
//! the rule broken.

use std::collections::BTreeMap;
use std::fmt;

use plotters::prelude::*;
use prism_resilience::detect::{Episode, FaultKind, LogEvent, Score, StepRecord};
use prism_resilience::scenario::{Fault, Scenario, ScenarioResult};

/// The header of a timing log.
pub const LOG_HEADER: &str = "kind,iteration,unit,start_s,end_s,busy_s,tokens,sum_sq_len";

/// The header of a ground-truth file.
pub const TRUTH_HEADER: &str = "kind,unit,start_s,end_s";

/// A file that could not be read: which line, which rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FormatError {
    /// The file (or `<input>`).
    pub origin: String,
    /// 1-based line (`None`: the whole file).
    pub line: Option<usize>,
    /// Key or column, when one is at fault.
    pub key: Option<String>,
    /// The rule broken.
    pub rule: String,
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.origin)?;
        if let Some(l) = self.line {
            write!(f, ":{l}")?;
        }
        f.write_str(": ")?;
        if let Some(k) = &self.key {
            write!(f, "{k}: ")?;
        }
        f.write_str(&self.rule)
    }
}

impl std::error::Error for FormatError {}

/// Largest log, truth or scenario file read, bytes.
pub const MAX_LOG_BYTES: u64 = 4 << 30;

/// Reads a log, truth or scenario file (a regular UTF-8 file of at most [`MAX_LOG_BYTES`]).
pub fn read_file(path: &std::path::Path) -> Result<String, FormatError> {
    let origin = path.display().to_string();
    let whole = |rule: String| FormatError {
        origin: origin.clone(),
        line: None,
        key: None,
        rule,
    };
    let meta = std::fs::metadata(path).map_err(|e| whole(format!("cannot read: {e}")))?;
    if !meta.is_file() {
        return Err(whole("not a regular file".into()));
    }
    if meta.len() > MAX_LOG_BYTES {
        return Err(whole(format!("larger than the {MAX_LOG_BYTES}-byte limit")));
    }
    std::fs::read_to_string(path).map_err(|e| whole(format!("cannot read as UTF-8 text: {e}")))
}

fn err(origin: &str, line: usize, key: Option<&str>, rule: impl Into<String>) -> FormatError {
    FormatError {
        origin: origin.to_string(),
        line: Some(line),
        key: key.map(str::to_string),
        rule: rule.into(),
    }
}

fn num(origin: &str, line: usize, key: &str, s: &str) -> Result<f64, FormatError> {
    let v: f64 = s.trim().parse().map_err(|_| {
        err(
            origin,
            line,
            Some(key),
            format!("expected a number, found \"{s}\""),
        )
    })?;
    if !v.is_finite() || v < 0.0 {
        return Err(err(
            origin,
            line,
            Some(key),
            format!("must be a finite number >= 0 (got {s})"),
        ));
    }
    if key.ends_with("_s") && v > MAX_LOG_TIME_S {
        return Err(err(
            origin,
            line,
            Some(key),
            format!(
                "a time of at most {MAX_LOG_TIME_S:e} s (about 31 years) is expected (got {s})"
            ),
        ));
    }
    Ok(v)
}

/// The latest time a timing log or a ground-truth file may name, seconds (about 31 years): a
/// training log is never longer, and larger values only print as hundreds of digits.
pub const MAX_LOG_TIME_S: f64 = 1e9;

fn int(origin: &str, line: usize, key: &str, s: &str) -> Result<u64, FormatError> {
    s.trim().parse().map_err(|_| {
        err(
            origin,
            line,
            Some(key),
            format!("expected a non-negative integer, found \"{s}\""),
        )
    })
}

/// Reads a timing log: the CSV format ([`LOG_HEADER`]) or Megatron-LM's iteration lines
/// (`iteration N/ M | ... | elapsed time per iteration (ms): X | ... | global batch size: B |`;
/// other lines are skipped), which become whole-job records of unit `job` (tokens: the global
/// batch in sequences; no sequence statistics).
pub fn parse_log(text: &str, origin: &str) -> Result<Vec<LogEvent>, FormatError> {
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    if first.trim() == LOG_HEADER {
        parse_csv_log(text, origin)
    } else if text.contains("elapsed time per iteration (ms)") {
        parse_megatron(text, origin)
    } else {
        Err(FormatError {
            origin: origin.into(),
            line: Some(1),
            key: None,
            rule: format!(
                "not a timing log: the first line must be the header `{LOG_HEADER}`, or the file must hold Megatron-LM iteration lines (`elapsed time per iteration (ms)`)"
            ),
        })
    }
}

fn parse_csv_log(text: &str, origin: &str) -> Result<Vec<LogEvent>, FormatError> {
    let mut out = Vec::new();
    let mut last_iter: BTreeMap<String, u64> = BTreeMap::new();
    let mut header_seen = false;
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let l = raw.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        if !header_seen {
            header_seen = true;
            continue;
        }
        let f: Vec<&str> = l.split(',').collect();
        if f.len() != 8 {
            return Err(err(
                origin,
                line,
                None,
                format!(
                    "expected 8 comma-separated fields ({LOG_HEADER}), found {}",
                    f.len()
                ),
            ));
        }
        let unit = f[2].trim();
        if unit.is_empty() {
            return Err(err(origin, line, Some("unit"), "must not be empty"));
        }
        match f[0].trim() {
            "heartbeat" => {
                let t = num(origin, line, "start_s", f[3])?;
                out.push(LogEvent::Heartbeat {
                    unit: unit.into(),
                    time_s: t,
                });
            }
            "step" => {
                let iteration = int(origin, line, "iteration", f[1])?;
                let start_s = num(origin, line, "start_s", f[3])?;
                let end_s = num(origin, line, "end_s", f[4])?;
                if end_s < start_s {
                    return Err(err(
                        origin,
                        line,
                        Some("end_s"),
                        format!("ends ({end_s}) before it starts ({start_s})"),
                    ));
                }
                let busy_s = if f[5].trim().is_empty() {
                    None
                } else {
                    let b = num(origin, line, "busy_s", f[5])?;
                    if b > end_s - start_s + 1e-9 * end_s.max(1.0) {
                        return Err(err(
                            origin,
                            line,
                            Some("busy_s"),
                            format!(
                                "busy time {b} exceeds the window end_s - start_s = {}",
                                end_s - start_s
                            ),
                        ));
                    }
                    Some(b)
                };
                let tokens = int(origin, line, "tokens", f[6])?;
                let sum_sq_len = int(origin, line, "sum_sq_len", f[7])?;
                if tokens == 0 {
                    return Err(err(
                        origin,
                        line,
                        Some("tokens"),
                        "a step processes at least one token",
                    ));
                }
                if sum_sq_len != 0
                    && (sum_sq_len < tokens || sum_sq_len as u128 > tokens as u128 * tokens as u128)
                {
                    return Err(err(
                        origin,
                        line,
                        Some("sum_sq_len"),
                        format!(
                            "must lie between tokens ({tokens}, all sequences of length 1) and tokens^2 (one sequence), or be 0 (unknown); got {sum_sq_len}"
                        ),
                    ));
                }
                if let Some(&prev) = last_iter.get(unit)
                    && iteration <= prev
                {
                    return Err(err(
                        origin,
                        line,
                        Some("iteration"),
                        format!(
                            "iteration {iteration} of unit {unit} does not follow its iteration {prev} (one record per unit per iteration, in order)"
                        ),
                    ));
                }
                last_iter.insert(unit.to_string(), iteration);
                out.push(LogEvent::Step(StepRecord {
                    iteration,
                    unit: unit.into(),
                    start_s,
                    end_s,
                    busy_s,
                    tokens,
                    sum_sq_len,
                }));
            }
            other => {
                return Err(err(
                    origin,
                    line,
                    Some("kind"),
                    format!("must be \"step\" or \"heartbeat\" (got \"{other}\")"),
                ));
            }
        }
    }
    if out.is_empty() {
        return Err(FormatError {
            origin: origin.into(),
            line: None,
            key: None,
            rule: "the log holds no records".into(),
        });
    }
    Ok(out)
}

fn field_after<'a>(l: &'a str, label: &str) -> Option<&'a str> {
    let i = l.find(label)? + label.len();
    let rest = &l[i..];
    Some(rest.split('|').next().unwrap_or("").trim())
}

fn parse_megatron(text: &str, origin: &str) -> Result<Vec<LogEvent>, FormatError> {
    let mut out = Vec::new();
    let mut t = 0.0f64;
    let mut prev: Option<u64> = None;
    for (i, l) in text.lines().enumerate() {
        let line = i + 1;
        let Some(ms) = field_after(l, "elapsed time per iteration (ms):") else {
            continue;
        };
        let it_text = field_after(l, "iteration").unwrap_or("");
        let it_num = it_text.split('/').next().unwrap_or("").trim();
        let iteration = int(origin, line, "iteration", it_num)?;
        let ms = num(origin, line, "elapsed time per iteration (ms)", ms)?;
        if ms <= 0.0 {
            return Err(err(
                origin,
                line,
                Some("elapsed time per iteration (ms)"),
                "must be positive",
            ));
        }
        if let Some(p) = prev
            && iteration <= p
        {
            return Err(err(
                origin,
                line,
                Some("iteration"),
                format!("iteration {iteration} does not follow iteration {p}"),
            ));
        }
        prev = Some(iteration);
        let gbs = match field_after(l, "global batch size:") {
            Some(g) => int(origin, line, "global batch size", g)?.max(1),
            None => 1,
        };
        let start = t;
        t += ms / 1e3;
        out.push(LogEvent::Step(StepRecord {
            iteration,
            unit: "job".into(),
            start_s: start,
            end_s: t,
            busy_s: None,
            tokens: gbs,
            sum_sq_len: 0,
        }));
    }
    if out.is_empty() {
        return Err(FormatError {
            origin: origin.into(),
            line: None,
            key: None,
            rule: "no Megatron-LM iteration line".into(),
        });
    }
    Ok(out)
}

/// Writes a timing log in the CSV format (times in their shortest exact form).
pub fn write_log(events: &[LogEvent]) -> String {
    let mut s = String::with_capacity(events.len() * 64);
    s.push_str(LOG_HEADER);
    s.push('\n');
    for e in events {
        match e {
            LogEvent::Heartbeat { unit, time_s } => {
                s.push_str(&format!("heartbeat,,{unit},{time_s},,,,\n"));
            }
            LogEvent::Step(r) => {
                let busy = r.busy_s.map(|b| format!("{b}")).unwrap_or_default();
                s.push_str(&format!(
                    "step,{},{},{},{},{busy},{},{}\n",
                    r.iteration, r.unit, r.start_s, r.end_s, r.tokens, r.sum_sq_len
                ));
            }
        }
    }
    s
}

/// Writes ground-truth (or detected) episodes.
pub fn write_truth(eps: &[Episode]) -> String {
    let mut s = String::from(TRUTH_HEADER);
    s.push('\n');
    for e in eps {
        s.push_str(&format!(
            "{},{},{},{}\n",
            e.kind.name(),
            e.unit.as_deref().unwrap_or(""),
            e.start_s,
            e.end_s.map(|x| format!("{x}")).unwrap_or_default()
        ));
    }
    s
}

fn kind_of(s: &str) -> Option<FaultKind> {
    match s.trim() {
        "fail-slow" => Some(FaultKind::FailSlow),
        "fail-stop" => Some(FaultKind::FailStop),
        _ => None,
    }
}

/// Reads a ground-truth file ([`TRUTH_HEADER`]).
pub fn parse_truth(text: &str, origin: &str) -> Result<Vec<Episode>, FormatError> {
    let mut out = Vec::new();
    let mut header = false;
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let l = raw.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        if !header {
            if l != TRUTH_HEADER {
                return Err(err(
                    origin,
                    line,
                    None,
                    format!("the first line must be the header `{TRUTH_HEADER}`"),
                ));
            }
            header = true;
            continue;
        }
        let f: Vec<&str> = l.split(',').collect();
        if f.len() != 4 {
            return Err(err(
                origin,
                line,
                None,
                format!("expected 4 fields ({TRUTH_HEADER}), found {}", f.len()),
            ));
        }
        let kind = kind_of(f[0]).ok_or_else(|| {
            err(
                origin,
                line,
                Some("kind"),
                format!("must be \"fail-slow\" or \"fail-stop\" (got \"{}\")", f[0]),
            )
        })?;
        let start = num(origin, line, "start_s", f[2])?;
        let end = if f[3].trim().is_empty() {
            None
        } else {
            Some(num(origin, line, "end_s", f[3])?)
        };
        if let Some(e) = end
            && e < start
        {
            return Err(err(
                origin,
                line,
                Some("end_s"),
                format!("ends ({e}) before it starts ({start})"),
            ));
        }
        let unit = f[1].trim();
        out.push(Episode {
            kind,
            unit: (!unit.is_empty()).then(|| unit.to_string()),
            start_s: start,
            end_s: end,
            detected_at_s: start,
        });
    }
    if !header {
        return Err(FormatError {
            origin: origin.into(),
            line: None,
            key: None,
            rule: format!("empty; expected the header `{TRUTH_HEADER}`"),
        });
    }
    Ok(out)
}

/// Reads a scenario (TOML; `docs/resilience.md`).
pub fn parse_scenario(text: &str, origin: &str) -> Result<Scenario, FormatError> {
    let table: toml::Table = toml::from_str(text).map_err(|e| {
        let line = e
            .span()
            .map(|s| text[..s.start.min(text.len())].lines().count().max(1));
        FormatError {
            origin: origin.into(),
            line,
            key: None,
            rule: format!("not valid TOML: {}", e.message()),
        }
    })?;
    let lines: Vec<&str> = text.lines().collect();
    // Header lines of the [[fault]] blocks, in order.
    let headers: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].trim() == "[[fault]]")
        .collect();
    let key_line = |block: Option<usize>, key: &str| -> Option<usize> {
        let (lo, hi) = match block {
            None => (0, headers.first().copied().unwrap_or(lines.len())),
            Some(k) => (
                headers.get(k).copied().unwrap_or(0),
                headers.get(k + 1).copied().unwrap_or(lines.len()),
            ),
        };
        (lo..hi)
            .find(|&i| {
                let t = lines[i].trim_start();
                t.starts_with(key) && t[key.len()..].trim_start().starts_with('=')
            })
            .map(|i| i + 1)
            .or(block.map(|k| headers.get(k).map_or(1, |h| h + 1)))
    };
    let bad = |block: Option<usize>, key: &str, rule: String| FormatError {
        origin: origin.into(),
        line: key_line(block, key),
        key: Some(match block {
            None => key.to_string(),
            Some(k) => format!("fault[{}].{key}", k + 1),
        }),
        rule,
    };
    const TOP: &[&str] = &[
        "name",
        "duration_h",
        "horizon_s",
        "detect_fail_slow_s",
        "detect_fail_stop_s",
        "fault",
    ];
    const FAULT: &[&str] = &["kind", "at_min", "device", "speed", "duration_min"];
    for k in table.keys() {
        if !TOP.contains(&k.as_str()) {
            return Err(bad(
                None,
                k,
                format!("unknown key; expected one of {}", TOP.join(", ")),
            ));
        }
    }
    let get_f = |t: &toml::Table,
                 block: Option<usize>,
                 key: &str,
                 ok: fn(f64) -> bool,
                 rule: &str|
     -> Result<Option<f64>, FormatError> {
        match t.get(key) {
            None => Ok(None),
            Some(v) => {
                let x = v
                    .as_float()
                    .or(v.as_integer().map(|i| i as f64))
                    .ok_or_else(|| {
                        bad(
                            block,
                            key,
                            format!("expected a number, found {}", v.type_str()),
                        )
                    })?;
                if !x.is_finite() || !ok(x) {
                    return Err(bad(block, key, format!("{rule} (got {x})")));
                }
                Ok(Some(x))
            }
        }
    };
    let name = match table.get("name") {
        None => "scenario".to_string(),
        Some(v) => v
            .as_str()
            .ok_or_else(|| {
                bad(
                    None,
                    "name",
                    format!("expected a string, found {}", v.type_str()),
                )
            })?
            .to_string(),
    };
    let duration_h = get_f(
        &table,
        None,
        "duration_h",
        |x| x > 0.0 && x <= 24.0 * 365.0,
        "must be positive hours, at most a year",
    )?
    .ok_or_else(|| {
        bad(
            None,
            "duration_h",
            "missing required key: the training time simulated, hours".into(),
        )
    })?;
    let horizon_s =
        get_f(&table, None, "horizon_s", |x| x > 0.0, "must be positive")?.unwrap_or(1800.0);
    let detect_fail_slow_s = get_f(
        &table,
        None,
        "detect_fail_slow_s",
        |x| x >= 0.0,
        "must be >= 0",
    )?
    .unwrap_or(30.0);
    let detect_fail_stop_s = get_f(
        &table,
        None,
        "detect_fail_stop_s",
        |x| x >= 0.0,
        "must be >= 0",
    )?
    .unwrap_or(30.0);
    let mut faults = Vec::new();
    if let Some(v) = table.get("fault") {
        let arr = v.as_array().ok_or_else(|| {
            bad(
                None,
                "fault",
                "must be an array of tables ([[fault]])".into(),
            )
        })?;
        for (k, f) in arr.iter().enumerate() {
            let b = Some(k);
            let t = f
                .as_table()
                .ok_or_else(|| bad(b, "kind", "each fault must be a table".into()))?;
            for key in t.keys() {
                if !FAULT.contains(&key.as_str()) {
                    return Err(bad(
                        b,
                        key,
                        format!("unknown key; expected one of {}", FAULT.join(", ")),
                    ));
                }
            }
            let kind_s = t.get("kind").and_then(|v| v.as_str()).ok_or_else(|| {
                bad(
                    b,
                    "kind",
                    "missing or not a string: \"fail-slow\" or \"fail-stop\"".into(),
                )
            })?;
            let kind = kind_of(kind_s).ok_or_else(|| {
                bad(
                    b,
                    "kind",
                    format!("must be \"fail-slow\" or \"fail-stop\" (got \"{kind_s}\")"),
                )
            })?;
            let at_min = get_f(t, b, "at_min", |x| x >= 0.0, "must be >= 0")?.ok_or_else(|| {
                bad(
                    b,
                    "at_min",
                    "missing required key: onset, minutes from the start".into(),
                )
            })?;
            if at_min * 60.0 >= duration_h * 3600.0 {
                return Err(bad(
                    b,
                    "at_min",
                    format!("onset {at_min} min is after the scenario ends ({duration_h} h)"),
                ));
            }
            let device = match t.get("device") {
                Some(v) => v
                    .as_integer()
                    .filter(|&i| (0..=u32::MAX as i64).contains(&i))
                    .ok_or_else(|| {
                        bad(
                            b,
                            "device",
                            "must be a non-negative integer (global device id)".into(),
                        )
                    })? as u32,
                None => {
                    return Err(bad(
                        b,
                        "device",
                        "missing required key: the global device id".into(),
                    ));
                }
            };
            let duration_min = get_f(t, b, "duration_min", |x| x > 0.0, "must be positive")?.ok_or_else(|| bad(b, "duration_min", "missing required key: how long the slowdown lasts / until the device is replaced, minutes".into()))?;
            let speed = get_f(
                t,
                b,
                "speed",
                |x| x > 0.0 && x < 1.0,
                "must be in (0, 1): the slow device's speed relative to healthy",
            )?;
            let speed = match (kind, speed) {
                (FaultKind::FailSlow, Some(s)) => s,
                (FaultKind::FailSlow, None) => {
                    return Err(bad(
                        b,
                        "speed",
                        "missing required key for a fail-slow fault".into(),
                    ));
                }
                (FaultKind::FailStop, Some(_)) => {
                    return Err(bad(b, "speed", "applies to fail-slow faults only".into()));
                }
                (FaultKind::FailStop, None) => 1.0,
            };
            faults.push(Fault {
                kind,
                at_s: at_min * 60.0,
                device,
                speed,
                duration_s: duration_min * 60.0,
            });
        }
    }
    Ok(Scenario {
        name,
        duration_s: duration_h * 3600.0,
        horizon_s,
        detect_fail_slow_s,
        detect_fail_stop_s,
        faults,
    })
}

/// JSON of one detector's score.
pub fn score_json(s: &Score) -> serde_json::Value {
    serde_json::json!({
        "kind": s.kind.name(),
        "episodes": s.episodes,
        "detections": s.detections,
        "true_positives": s.true_positives,
        "precision": s.precision,
        "recall": s.recall,
        "f1": s.f1,
        "false_alarms_per_day": s.false_alarms_per_day,
        "mean_delay_s": s.mean_delay_s,
        "max_delay_s": s.max_delay_s,
        "mean_end_error_s": s.mean_end_error_s,
    })
}

/// JSON of detected episodes.
pub fn episodes_json(eps: &[Episode]) -> serde_json::Value {
    serde_json::Value::Array(
        eps.iter()
            .map(|e| {
                serde_json::json!({
                    "kind": e.kind.name(),
                    "unit": e.unit,
                    "start_s": e.start_s,
                    "end_s": e.end_s,
                    "detected_at_s": e.detected_at_s,
                })
            })
            .collect(),
    )
}

/// JSON of a scenario's result.
pub fn scenario_json(sc: &Scenario, r: &ScenarioResult) -> serde_json::Value {
    let resihp = r.timelines.first().map(|t| t.tokens).unwrap_or(0.0);
    serde_json::json!({
        "scenario": sc.name,
        "duration_s": sc.duration_s,
        "faults": sc.faults.len(),
        "healthy_tokens_per_s": r.healthy_tokens_per_s,
        "policies": r.timelines.iter().map(|t| serde_json::json!({
            "policy": t.strategy.name(),
            "tokens": t.tokens,
            "mean_tokens_per_s": t.mean_tokens_per_s,
            "goodput": t.goodput,
            "resihp_speedup": if t.tokens > 0.0 { resihp / t.tokens } else { f64::INFINITY },
            "reconfigurations": t.reconfigurations,
            "paused_s": t.paused_s,
            "timeline": t.segments.iter().map(|(a, b, v)| serde_json::json!([a, b, v])).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

const COLORS: [RGBColor; 7] = [
    RGBColor(214, 39, 40),
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(0, 0, 0),
];

/// The throughput timelines of a scenario as SVG: tokens/s over hours, one step line per
/// policy.
pub fn timeline_svg(title: &str, r: &ScenarioResult) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1000, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let end_h = (r.timelines.iter())
            .flat_map(|t| t.segments.last())
            .map(|s| s.1 / 3600.0)
            .fold(0.0, f64::max)
            .max(1e-6);
        let top = r.healthy_tokens_per_s.max(1.0) * 1.1 / 1e3;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d(0.0..end_h, 0.0..top)
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("hours")
            .y_desc("throughput, k tokens/s")
            .draw()
            .map_err(|e| e.to_string())?;
        for (i, t) in r.timelines.iter().enumerate() {
            let mut pts = Vec::new();
            for &(a, b, v) in &t.segments {
                pts.push((a / 3600.0, v / 1e3));
                pts.push((b / 3600.0, v / 1e3));
            }
            let c = COLORS[i % COLORS.len()];
            let width = if i == 0 { 3 } else { 1 };
            chart
                .draw_series(LineSeries::new(pts, c.stroke_width(width)))
                .map_err(|e| e.to_string())?
                .label(format!(
                    "{} (goodput {:.1}%)",
                    t.strategy.name(),
                    100.0 * t.goodput
                ))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::LowerLeft)
            .draw()
            .map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_err(text: &str) -> FormatError {
        parse_log(text, "t.csv").unwrap_err()
    }

    #[test]
    fn logs_round_trip_and_bad_logs_name_line_and_rule() {
        let text = format!(
            "{LOG_HEADER}\nheartbeat,,dp0.pp0,0.5,,,,\nstep,0,dp0.pp0,0,1.5,1.2,4096,4194304\nstep,1,dp0.pp0,1.5,3,,4096,8000000\n"
        );
        let ev = parse_log(&text, "t.csv").unwrap();
        assert_eq!(ev.len(), 3);
        assert_eq!(parse_log(&write_log(&ev), "t.csv").unwrap(), ev);
        let cases = [
            (format!("{LOG_HEADER}\nstep,0,a,0,1,,10\n"), 2, "expected 8"),
            (
                format!("{LOG_HEADER}\nstep,0,a,2,1,,10,100\n"),
                2,
                "before it starts",
            ),
            (
                format!("{LOG_HEADER}\nstep,0,a,0,1,,10,5\n"),
                2,
                "between tokens",
            ),
            (
                format!("{LOG_HEADER}\nstep,0,a,0,1,,10,100\nstep,0,a,1,2,,10,100\n"),
                3,
                "does not follow",
            ),
            (
                format!("{LOG_HEADER}\nstep,x,a,0,1,,10,100\n"),
                2,
                "non-negative integer",
            ),
            (
                format!("{LOG_HEADER}\nbeat,,a,0,,,,\n"),
                2,
                "\"step\" or \"heartbeat\"",
            ),
            (
                format!("{LOG_HEADER}\nstep,0,a,0,1,3,10,100\n"),
                2,
                "exceeds the window",
            ),
            (
                format!("{LOG_HEADER}\nstep,0,a,0,nan,,10,100\n"),
                2,
                "finite",
            ),
            ("hello\n".to_string(), 1, "not a timing log"),
        ];
        for (text, line, rule) in cases {
            let e = log_err(&text);
            assert_eq!(e.line, Some(line), "{e}");
            assert!(e.rule.contains(rule), "{e}");
        }
    }

    #[test]
    fn megatron_lines() {
        let text = " [2024-05-01 10:00:00] iteration      100/  500000 | consumed samples:        51200 | elapsed time per iteration (ms): 1500.0 | learning rate: 1.0E-04 | global batch size:   512 | lm loss: 2.1E+00 |\nsome other line\n [2024-05-01 10:00:02] iteration      101/  500000 | consumed samples:        51712 | elapsed time per iteration (ms): 2000.0 | global batch size:   512 |\n";
        let ev = parse_log(text, "m.log").unwrap();
        assert_eq!(ev.len(), 2);
        let LogEvent::Step(r) = &ev[1] else { panic!() };
        assert_eq!((r.iteration, r.tokens), (101, 512));
        assert!((r.start_s - 1.5).abs() < 1e-12 && (r.end_s - 3.5).abs() < 1e-12);
        let bad = text.replace("2000.0", "-3");
        let e = parse_log(&bad, "m.log").unwrap_err();
        assert_eq!(e.line, Some(3));
    }

    #[test]
    fn scenarios_parse_and_bad_ones_name_line_and_rule() {
        let ok = "name = \"x\"\nduration_h = 2\n\n[[fault]]\nkind = \"fail-slow\"\nat_min = 10\ndevice = 3\nspeed = 0.5\nduration_min = 20\n\n[[fault]]\nkind = \"fail-stop\"\nat_min = 60\ndevice = 7\nduration_min = 30\n";
        let sc = parse_scenario(ok, "s.toml").unwrap();
        assert_eq!(sc.faults.len(), 2);
        assert_eq!(sc.faults[1].kind, FaultKind::FailStop);
        assert_eq!(sc.duration_s, 7200.0);
        let cases = [
            (
                ok.replace("speed = 0.5", "speed = 1.5"),
                Some(8),
                "fault[1].speed",
            ),
            (
                ok.replace("device = 7\n", "device = 7\nspeed = 0.5\n"),
                Some(15),
                "fault[2].speed",
            ),
            (
                ok.replace("kind = \"fail-stop\"", "kind = \"crash\""),
                Some(12),
                "fault[2].kind",
            ),
            (
                ok.replace("at_min = 60", "at_min = 600"),
                Some(13),
                "fault[2].at_min",
            ),
            (
                ok.replace("duration_h = 2", "duration_h = 2\nhorizon = 5"),
                Some(3),
                "horizon",
            ),
            (
                ok.replace("device = 3", "device = -3"),
                Some(7),
                "fault[1].device",
            ),
            // A missing top-level key concerns the whole file.
            (ok.replace("duration_h = 2\n", ""), None, "duration_h"),
        ];
        for (text, line, key) in cases {
            let e = parse_scenario(&text, "s.toml").unwrap_err();
            assert_eq!(e.line, line, "{e}");
            assert_eq!(e.key.as_deref(), Some(key), "{e}");
        }
        let e = parse_scenario("duration_h = [", "s.toml").unwrap_err();
        assert_eq!(e.line, Some(1));
    }

    /// `[resilience]` keys: absent -> defaults; given -> read; wrong -> the dotted key, the rule
    /// and the line.
    #[test]
    fn resilience_job_keys() {
        use crate::jobfile::load_job_str;
        use prism_resilience::scenario::ResilienceSettings;
        let job = include_str!("../../../examples/resilience/llama70b-256-a100.toml");
        let base = job.split("[resilience]").next().unwrap();
        let plain = load_job_str(base, "j.toml", None, &[]).unwrap();
        assert_eq!(plain.resilience, ResilienceSettings::default());
        let full = load_job_str(job, "j.toml", None, &[]).unwrap();
        assert_eq!(full.resilience.seq_len_median, Some(1024.0));
        assert_eq!(full.resilience.seq_len_sigma, 1.2);
        let with = |extra: &str| {
            load_job_str(
                &format!("{base}[resilience]\n{extra}\n"),
                "j.toml",
                None,
                &[],
            )
        };
        let ok = with("stage_tp = \"8,4,8,8\"").unwrap();
        assert_eq!(ok.resilience.stage_tp, Some(vec![8, 4, 8, 8]));
        let line = base.lines().count() + 2;
        for (extra, key, rule) in [
            (
                "stage_tp = \"8,3,8,8\"",
                "resilience.stage_tp",
                "power of two",
            ),
            (
                "stage_tp = \"8,8\"",
                "resilience.stage_tp",
                "one TP degree per pipeline stage",
            ),
            (
                "stage_tp = \"8,x,8,8\"",
                "resilience.stage_tp",
                "not a positive integer",
            ),
            ("seq_len_sigma = 9", "resilience.seq_len_sigma", "[0, 5]"),
            (
                "memory_fraction = 0",
                "resilience.memory_fraction",
                "(0, 1]",
            ),
            (
                "state_bytes_per_param = 0",
                "resilience.state_bytes_per_param",
                "1..=64",
            ),
            (
                "reconfig_restart_s = -2",
                "resilience.reconfig_restart_s",
                ">= 0",
            ),
            ("restart = 2", "resilience.restart", "unknown key"),
        ] {
            let e = with(extra).unwrap_err();
            assert_eq!(e.key.as_deref(), Some(key), "{e}");
            assert!(e.rule.contains(rule), "{e}");
            assert_eq!(e.location.map(|l| l.0), Some(line), "{e}");
        }
    }

    #[test]
    fn truth_round_trip() {
        let eps = vec![Episode {
            kind: FaultKind::FailStop,
            unit: Some("dp1.pp0".into()),
            start_s: 10.0,
            end_s: Some(20.0),
            detected_at_s: 10.0,
        }];
        assert_eq!(parse_truth(&write_truth(&eps), "t").unwrap(), eps);
        assert!(
            parse_truth("kind,unit\n", "t")
                .unwrap_err()
                .rule
                .contains("header")
        );
        // Issue 51: a time of 1e301 s printed as a 300-digit number of hours.
        let far = write_truth(&eps).replace(",20", ",1e301");
        let e = parse_truth(&far, "t").unwrap_err();
        assert_eq!(e.key.as_deref(), Some("end_s"), "{e}");
        assert!(e.rule.contains("at most 1e9 s"), "{e}");
    }
}
