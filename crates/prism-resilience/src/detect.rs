//! Streaming failure detectors over per-iteration, per-stage timing records and heartbeats.
//!
//! - [`ResihpDetector`] (ResiHP's workload-aware detector): each unit (a stage's
//!   tensor-parallel group of one replica, or a rank) has an online fit of its compute time
//!   `a x tokens + b x sum(len^2)` ([`crate::predictor::OnlineFit`]) learned on healthy
//!   iterations; a record whose observed / expected ratio exceeds `ratio` for `confirm`
//!   records in a row opens a fail-slow episode at that unit (starting at the first of them),
//!   and `confirm` records under `1 + (ratio - 1) / 2` close it (hysteresis). A unit whose heartbeats stop for
//!   `heartbeat_timeout_s` is reported fail-stop at its last heartbeat.
//! - [`ThresholdDetector`] (baseline): the job's iteration period against `ratio` times its
//!   median over the first healthy iterations, the same confirmation rule; a hang (no
//!   iteration for `hang_factor` median periods) is a fail-stop. Not localised.
//! - [`GreyhoundDetector`] (baseline, after Greyhound/FALCON): the iteration period, outliers
//!   beyond 3 standard deviations of the current segment dropped, Bayesian online change-point
//!   detection (Adams and MacKay 2007, normal-gamma model); a change point with posterior
//!   probability above 0.8 at least 10 iterations after the previous one opens a fail-slow
//!   episode when the new segment's mean is more than 10% above the healthy mean and closes it
//!   when it is back within 10%. Hangs as the threshold baseline. Not localised.

use std::collections::BTreeMap;

use crate::predictor::OnlineFit;

/// One per-iteration record of one unit.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    /// Iteration.
    pub iteration: u64,
    /// Unit: a stage of a replica (`dp3.pp1`), a rank (`rank17`), or `job` (a whole-job line).
    pub unit: String,
    /// Start of the unit's work in the iteration, seconds.
    pub start_s: f64,
    /// End of the unit's work in the iteration, seconds.
    pub end_s: f64,
    /// The unit's compute time in the iteration (forward + backward timers), seconds; `None`:
    /// `end_s - start_s`.
    pub busy_s: Option<f64>,
    /// Tokens the unit processed.
    pub tokens: u64,
    /// Sum of the squared sequence lengths it processed.
    pub sum_sq_len: u64,
}

impl StepRecord {
    /// The unit's compute time.
    pub fn busy(&self) -> f64 {
        self.busy_s.unwrap_or(self.end_s - self.start_s)
    }
}

/// One log event.
#[derive(Clone, Debug, PartialEq)]
pub enum LogEvent {
    /// A per-iteration record.
    Step(StepRecord),
    /// A heartbeat of `unit` at `time_s`.
    Heartbeat {
        /// Unit.
        unit: String,
        /// Time, seconds.
        time_s: f64,
    },
}

impl LogEvent {
    /// The time the event happened (a record: its end).
    pub fn time(&self) -> f64 {
        match self {
            LogEvent::Step(r) => r.end_s,
            LogEvent::Heartbeat { time_s, .. } => *time_s,
        }
    }
}

/// Fail-slow or fail-stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FaultKind {
    /// A device runs slower than it should.
    FailSlow,
    /// A device stopped.
    FailStop,
}

impl FaultKind {
    /// `fail-slow` / `fail-stop`.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::FailSlow => "fail-slow",
            FaultKind::FailStop => "fail-stop",
        }
    }
}

/// A detected (or true) fault episode.
#[derive(Clone, Debug, PartialEq)]
pub struct Episode {
    /// Kind.
    pub kind: FaultKind,
    /// Where (`None`: not localised).
    pub unit: Option<String>,
    /// Start, seconds.
    pub start_s: f64,
    /// End, seconds (`None`: still open at the end of the log).
    pub end_s: Option<f64>,
    /// When the detector raised it (for ground truth: the start).
    pub detected_at_s: f64,
}

/// A streaming detector.
pub trait Detector {
    /// Name for reports.
    fn name(&self) -> &'static str;
    /// Feeds one event (events in log order).
    fn push(&mut self, ev: &LogEvent);
    /// Ends the stream at `end_s` and returns every episode detected.
    fn finish(&mut self, end_s: f64) -> Vec<Episode>;
}

/// Settings shared by the detectors.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DetectorConfig {
    /// Observed / expected (or / healthy median) above which a record counts as slow.
    pub ratio: f64,
    /// Records in a row that confirm a start or an end.
    pub confirm: u32,
    /// Records per unit used to learn before judging.
    pub warmup: u32,
    /// Heartbeat silence that means fail-stop, seconds.
    pub heartbeat_timeout_s: f64,
    /// A job-level hang: no iteration for this many median periods (baselines), at least
    /// `heartbeat_timeout_s`.
    pub hang_factor: f64,
}

impl DetectorConfig {
    /// The ratio a record is compared with: `ratio` to open an episode, halfway between 1 and
    /// `ratio` to stay in one (hysteresis, so a slowdown near the threshold does not flap).
    pub fn threshold(&self, in_episode: bool) -> f64 {
        if in_episode {
            1.0 + (self.ratio - 1.0) / 2.0
        } else {
            self.ratio
        }
    }
}

impl Default for DetectorConfig {
    fn default() -> Self {
        DetectorConfig {
            ratio: 1.15,
            confirm: 3,
            warmup: 20,
            heartbeat_timeout_s: 30.0,
            hang_factor: 10.0,
        }
    }
}

#[derive(Clone, Debug, Default)]
struct UnitState {
    fit: OnlineFit,
    seen: u32,
    slow: bool,
    run: u32,
    run_start: f64,
    open_start: f64,
    last_hb: Option<f64>,
    stopped: bool,
}

/// ResiHP's workload-aware detector (module docs).
#[derive(Clone, Debug)]
pub struct ResihpDetector {
    cfg: DetectorConfig,
    units: BTreeMap<String, UnitState>,
    now: f64,
    out: Vec<Episode>,
}

impl ResihpDetector {
    /// A detector with these settings.
    pub fn new(cfg: DetectorConfig) -> Self {
        ResihpDetector {
            cfg,
            units: BTreeMap::new(),
            now: 0.0,
            out: Vec::new(),
        }
    }

    fn check_heartbeats(&mut self, now: f64) {
        let timeout = self.cfg.heartbeat_timeout_s;
        for (name, u) in self.units.iter_mut() {
            if let Some(hb) = u.last_hb
                && !u.stopped
                && now - hb > timeout
            {
                u.stopped = true;
                self.out.push(Episode {
                    kind: FaultKind::FailStop,
                    unit: Some(name.clone()),
                    start_s: hb,
                    end_s: None,
                    detected_at_s: hb + timeout,
                });
            }
        }
    }
}

impl Detector for ResihpDetector {
    fn name(&self) -> &'static str {
        "resihp"
    }

    fn push(&mut self, ev: &LogEvent) {
        self.now = self.now.max(ev.time());
        self.check_heartbeats(self.now);
        match ev {
            LogEvent::Heartbeat { unit, time_s } => {
                let u = self.units.entry(unit.clone()).or_default();
                if u.stopped {
                    // Back after a restart: close the fail-stop episode.
                    u.stopped = false;
                    if let Some(e) = (self.out.iter_mut())
                        .rev()
                        .find(|e| e.kind == FaultKind::FailStop && e.unit.as_deref() == Some(unit))
                        && e.end_s.is_none()
                    {
                        e.end_s = Some(*time_s);
                    }
                }
                u.last_hb = Some(*time_s);
            }
            LogEvent::Step(r) => {
                let cfg = self.cfg;
                let u = self.units.entry(r.unit.clone()).or_default();
                let (x1, x2, y) = (r.tokens as f64, r.sum_sq_len as f64, r.busy());
                u.seen += 1;
                let expected = if u.fit.count() >= cfg.warmup as u64 {
                    u.fit.predict(x1, x2).filter(|e| *e > 0.0)
                } else {
                    None
                };
                let Some(expected) = expected else {
                    u.fit.add(x1, x2, y);
                    return;
                };
                let slow_now = y / expected > cfg.threshold(u.slow);
                if slow_now != u.slow {
                    if u.run == 0 {
                        u.run_start = r.start_s;
                    }
                    u.run += 1;
                    if u.run >= cfg.confirm {
                        u.slow = slow_now;
                        u.run = 0;
                        if slow_now {
                            u.open_start = u.run_start;
                            self.out.push(Episode {
                                kind: FaultKind::FailSlow,
                                unit: Some(r.unit.clone()),
                                start_s: u.run_start,
                                end_s: None,
                                detected_at_s: r.end_s,
                            });
                        } else if let Some(e) = (self.out.iter_mut()).rev().find(|e| {
                            e.kind == FaultKind::FailSlow && e.unit.as_deref() == Some(&r.unit)
                        }) {
                            e.end_s = Some(u.run_start);
                        }
                    }
                } else {
                    u.run = 0;
                }
                if !u.slow && !slow_now {
                    // Healthy: keep learning.
                    u.fit.add(x1, x2, y);
                }
            }
        }
    }

    fn finish(&mut self, end_s: f64) -> Vec<Episode> {
        self.check_heartbeats(end_s.max(self.now));
        by_detection(&mut self.out)
    }
}

/// Job-level iteration periods from a record stream: an iteration's end is the latest end of
/// its records; its period the gap to the previous iteration's end.
#[derive(Clone, Debug, Default)]
struct Periods {
    cur: Option<(u64, f64)>,
    last_end: Option<f64>,
}

impl Periods {
    /// Feeds a record; returns `(iteration end, period, previous iteration end)` of an
    /// iteration that completed.
    fn push(&mut self, r: &StepRecord) -> Option<(f64, f64, f64)> {
        match self.cur {
            Some((it, end)) if it == r.iteration => {
                self.cur = Some((it, end.max(r.end_s)));
                None
            }
            prev => {
                self.cur = Some((r.iteration, r.end_s));
                let (_, end) = prev?;
                let out = self.last_end.map(|l| (end, end - l, l));
                self.last_end = Some(end);
                out
            }
        }
    }
}

#[derive(Clone, Debug)]
struct Hang {
    factor: f64,
    min_s: f64,
    hung: bool,
    /// The last record end before the hang.
    since: f64,
    /// The latest record end seen.
    last: Option<f64>,
}

impl Hang {
    /// A watcher with the configured hang factor and heartbeat time-out, nothing seen yet.
    fn new(cfg: &DetectorConfig) -> Self {
        Hang {
            factor: cfg.hang_factor,
            min_s: cfg.heartbeat_timeout_s,
            hung: false,
            since: f64::NEG_INFINITY,
            last: None,
        }
    }

    fn check(&mut self, now: f64, median: Option<f64>, out: &mut Vec<Episode>) {
        let (Some(last), Some(med)) = (self.last, median) else {
            return;
        };
        let limit = (self.factor * med).max(self.min_s);
        if !self.hung && now - last > limit {
            self.hung = true;
            self.since = last;
            out.push(Episode {
                kind: FaultKind::FailStop,
                unit: None,
                start_s: last,
                end_s: None,
                detected_at_s: last + limit,
            });
        }
    }

    /// A record ending at `end`; true when it ends a hang (the job is back).
    fn record(&mut self, end: f64, out: &mut [Episode]) -> bool {
        self.last = Some(self.last.map_or(end, |l| l.max(end)));
        if self.hung && end > self.since {
            self.hung = false;
            if let Some(e) = out.iter_mut().rev().find(|e| e.kind == FaultKind::FailStop) {
                e.end_s = Some(end);
            }
            return true;
        }
        false
    }
}

/// The healthy iteration period of a job-level detector: the median of its first `warmup`
/// periods.
#[derive(Clone, Debug, Default)]
struct Baseline {
    warm: Vec<f64>,
    base: Option<f64>,
}

impl Baseline {
    /// Feeds a period; returns the baseline once it was set by earlier periods (`None`
    /// while warming up, including the period that completes the warm-up).
    fn observe(&mut self, period: f64, warmup: u32) -> Option<f64> {
        if self.base.is_some() {
            return self.base;
        }
        self.warm.push(period);
        if self.warm.len() >= warmup as usize {
            self.base = Some(median(&self.warm));
        }
        None
    }
}

/// Episodes in the order they were detected.
fn by_detection(out: &mut Vec<Episode>) -> Vec<Episode> {
    let mut out = std::mem::take(out);
    out.sort_by(|a, b| a.detected_at_s.total_cmp(&b.detected_at_s));
    out
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// Raw iteration-time threshold (baseline; module docs).
#[derive(Clone, Debug)]
pub struct ThresholdDetector {
    cfg: DetectorConfig,
    periods: Periods,
    baseline: Baseline,
    slow: bool,
    run: u32,
    run_start: f64,
    now: f64,
    hang: Hang,
    out: Vec<Episode>,
}

impl ThresholdDetector {
    /// A detector with these settings.
    pub fn new(cfg: DetectorConfig) -> Self {
        ThresholdDetector {
            cfg,
            periods: Periods::default(),
            baseline: Baseline::default(),
            slow: false,
            run: 0,
            run_start: 0.0,
            now: 0.0,
            hang: Hang::new(&cfg),
            out: Vec::new(),
        }
    }
}

impl Detector for ThresholdDetector {
    fn name(&self) -> &'static str {
        "threshold"
    }

    fn push(&mut self, ev: &LogEvent) {
        self.now = self.now.max(ev.time());
        self.hang.check(self.now, self.baseline.base, &mut self.out);
        let LogEvent::Step(r) = ev else { return };
        self.hang.record(r.end_s, &mut self.out);
        let Some((end, period, start)) = self.periods.push(r) else {
            return;
        };
        let Some(base) = self.baseline.observe(period, self.cfg.warmup) else {
            return;
        };
        let slow_now = period / base > self.cfg.threshold(self.slow);
        if slow_now != self.slow {
            if self.run == 0 {
                self.run_start = start;
            }
            self.run += 1;
            if self.run >= self.cfg.confirm {
                self.slow = slow_now;
                self.run = 0;
                if slow_now {
                    self.out.push(Episode {
                        kind: FaultKind::FailSlow,
                        unit: None,
                        start_s: self.run_start,
                        end_s: None,
                        detected_at_s: end,
                    });
                } else if let Some(e) = (self.out.iter_mut())
                    .rev()
                    .find(|e| e.kind == FaultKind::FailSlow)
                {
                    e.end_s = Some(self.run_start);
                }
            }
        } else {
            self.run = 0;
        }
    }

    fn finish(&mut self, end_s: f64) -> Vec<Episode> {
        self.hang
            .check(end_s.max(self.now), self.baseline.base, &mut self.out);
        by_detection(&mut self.out)
    }
}

/// Bayesian online change-point detection over a normalised series (normal-gamma model,
/// constant hazard), run lengths truncated at `max_run`.
#[derive(Clone, Debug)]
struct Bocpd {
    hazard: f64,
    max_run: usize,
    /// Per run length: (log probability, mu, kappa, alpha, beta).
    runs: Vec<(f64, f64, f64, f64, f64)>,
    prior: (f64, f64, f64, f64),
}

impl Bocpd {
    fn new(hazard: f64, max_run: usize, prior: (f64, f64, f64, f64)) -> Self {
        Bocpd {
            hazard,
            max_run,
            runs: vec![(0.0, prior.0, prior.1, prior.2, prior.3)],
            prior,
        }
    }

    fn log_student_t(x: f64, mu: f64, kappa: f64, alpha: f64, beta: f64) -> f64 {
        let nu = 2.0 * alpha;
        let scale2 = beta * (kappa + 1.0) / (alpha * kappa);
        let z = (x - mu) * (x - mu) / (nu * scale2);
        ln_gamma((nu + 1.0) / 2.0)
            - ln_gamma(nu / 2.0)
            - 0.5 * (nu * std::f64::consts::PI * scale2).ln()
            - (nu + 1.0) / 2.0 * z.ln_1p()
    }

    /// Feeds `x`; returns the run-length posterior's probability mass at run lengths below
    /// `short`, and the most probable run length.
    fn push(&mut self, x: f64, short: usize) -> (f64, usize) {
        let lh = self.hazard.ln();
        let l1h = (-self.hazard).ln_1p();
        let mut next = Vec::with_capacity(self.runs.len() + 1);
        let mut cp = f64::NEG_INFINITY;
        for &(lp, mu, k, a, b) in &self.runs {
            let pred = Self::log_student_t(x, mu, k, a, b);
            cp = log_add(cp, lp + pred + lh);
            let k2 = k + 1.0;
            let mu2 = (k * mu + x) / k2;
            let a2 = a + 0.5;
            let b2 = b + k * (x - mu) * (x - mu) / (2.0 * k2);
            next.push((lp + pred + l1h, mu2, k2, a2, b2));
        }
        let (m0, k0, a0, b0) = self.prior;
        let k2 = k0 + 1.0;
        let first = (
            cp,
            (k0 * m0 + x) / k2,
            k2,
            a0 + 0.5,
            b0 + k0 * (x - m0) * (x - m0) / (2.0 * k2),
        );
        next.insert(0, first);
        next.truncate(self.max_run);
        let norm = next
            .iter()
            .fold(f64::NEG_INFINITY, |acc, r| log_add(acc, r.0));
        for r in next.iter_mut() {
            r.0 -= norm;
        }
        self.runs = next;
        let mass: f64 = self.runs.iter().take(short).map(|r| r.0.exp()).sum();
        let map = (0..self.runs.len())
            .max_by(|&i, &j| self.runs[i].0.total_cmp(&self.runs[j].0))
            .unwrap_or(0);
        (mass, map)
    }

    fn reset(&mut self) {
        let p = self.prior;
        self.runs = vec![(0.0, p.0, p.1, p.2, p.3)];
    }
}

fn log_add(a: f64, b: f64) -> f64 {
    if a == f64::NEG_INFINITY {
        return b;
    }
    if b == f64::NEG_INFINITY {
        return a;
    }
    let m = a.max(b);
    m + ((a - m).exp() + (b - m).exp()).ln()
}

/// `ln Gamma(x)` for `x > 0` (Lanczos, g = 7).
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = C[0];
    let t = x + 7.5;
    for (i, c) in C.iter().enumerate().skip(1) {
        a += c / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// Greyhound-style change-point baseline (module docs).
#[derive(Clone, Debug)]
pub struct GreyhoundDetector {
    cfg: DetectorConfig,
    periods: Periods,
    baseline: Baseline,
    cpd: Bocpd,
    /// Current segment's normalised values (outliers dropped).
    seg: Vec<f64>,
    seg_start: f64,
    since_cp: u32,
    slow: bool,
    now: f64,
    hang: Hang,
    out: Vec<Episode>,
    ends: Vec<f64>,
    pending: Option<f64>,
}

impl GreyhoundDetector {
    /// A detector with these settings (`ratio - 1` is not used: Greyhound's 10% shift rule
    /// and 0.8 probability are fixed).
    pub fn new(cfg: DetectorConfig) -> Self {
        GreyhoundDetector {
            cfg,
            periods: Periods::default(),
            baseline: Baseline::default(),
            cpd: Bocpd::new(1.0 / 250.0, 300, (1.0, 1.0, 2.0, 2.0 * 0.05 * 0.05)),
            seg: Vec::new(),
            seg_start: 0.0,
            since_cp: 0,
            slow: false,
            now: 0.0,
            hang: Hang::new(&cfg),
            out: Vec::new(),
            ends: Vec::new(),
            pending: None,
        }
    }
}

impl Detector for GreyhoundDetector {
    fn name(&self) -> &'static str {
        "greyhound"
    }

    fn push(&mut self, ev: &LogEvent) {
        self.now = self.now.max(ev.time());
        self.hang.check(self.now, self.baseline.base, &mut self.out);
        let LogEvent::Step(r) = ev else { return };
        if self.hang.record(r.end_s, &mut self.out) {
            // A restart: the series starts over.
            self.cpd.reset();
            self.seg.clear();
            self.seg_start = r.end_s;
        }
        let Some((end, period, _)) = self.periods.push(r) else {
            return;
        };
        self.ends.push(end - period);
        let Some(base) = self.baseline.observe(period, self.cfg.warmup) else {
            return;
        };
        let x = period / base;
        // Drop isolated outliers beyond 3 standard deviations of the current segment (two in a
        // row are a shift, not an outlier: both are kept).
        if self.seg.len() >= 10 {
            let n = self.seg.len() as f64;
            let m = self.seg.iter().sum::<f64>() / n;
            let sd = (self.seg.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / n).sqrt();
            if (x - m).abs() > 3.0 * sd.max(1e-3 * m) {
                if self.pending.is_none() {
                    self.pending = Some(x);
                    return;
                }
            } else {
                self.pending = None;
            }
        }
        let xs: Vec<f64> = self.pending.take().into_iter().chain([x]).collect();
        for x in xs {
            self.feed(x, end);
        }
    }

    fn finish(&mut self, end_s: f64) -> Vec<Episode> {
        self.hang
            .check(end_s.max(self.now), self.baseline.base, &mut self.out);
        by_detection(&mut self.out)
    }
}

impl GreyhoundDetector {
    fn feed(&mut self, x: f64, end: f64) {
        self.since_cp += 1;
        let (mass, map) = self.cpd.push(x, 10);
        self.seg.push(x);
        if mass > 0.8 && self.since_cp > 10 && map < self.seg.len() && map >= 2 {
            // A change point `map` values ago: the new segment is the last `map` values.
            let new: Vec<f64> = self.seg[self.seg.len() - map..].to_vec();
            let mean = new.iter().sum::<f64>() / new.len() as f64;
            let cp_start = self.ends[self.ends.len().saturating_sub(map)];
            self.seg = new;
            self.seg_start = cp_start;
            self.since_cp = map as u32;
            if !self.slow && mean > 1.1 {
                self.slow = true;
                self.out.push(Episode {
                    kind: FaultKind::FailSlow,
                    unit: None,
                    start_s: cp_start,
                    end_s: None,
                    detected_at_s: end,
                });
            } else if self.slow && mean < 1.1 {
                self.slow = false;
                if let Some(e) = (self.out.iter_mut())
                    .rev()
                    .find(|e| e.kind == FaultKind::FailSlow)
                {
                    e.end_s = Some(cp_start);
                }
            }
        }
    }
}

/// Runs a detector over a whole log.
pub fn run_detector(d: &mut dyn Detector, events: &[LogEvent]) -> Vec<Episode> {
    let mut end = 0.0f64;
    for e in events {
        end = end.max(e.time());
        d.push(e);
    }
    d.finish(end)
}

/// A detector's figures against the ground truth for one fault kind.
#[derive(Clone, Debug, PartialEq)]
pub struct Score {
    /// Fault kind.
    pub kind: FaultKind,
    /// True episodes.
    pub episodes: usize,
    /// Detections raised.
    pub detections: usize,
    /// Detections matching a true episode.
    pub true_positives: usize,
    /// Precision.
    pub precision: f64,
    /// Recall.
    pub recall: f64,
    /// F1.
    pub f1: f64,
    /// Unmatched detections per day of log.
    pub false_alarms_per_day: f64,
    /// Mean detection delay of matched episodes (detected at - true start), seconds.
    pub mean_delay_s: f64,
    /// Largest detection delay, seconds.
    pub max_delay_s: f64,
    /// Mean |detected end - true end| of matched fail-slow episodes with an end, seconds.
    pub mean_end_error_s: f64,
}

/// Scores `found` against `truth` for `kind` over a log of `duration_s` seconds. A detection
/// matches an unmatched true episode of the kind when it is raised between the episode's
/// start and `grace_s` after its end and, when `localised`, names the same unit. Each
/// episode and each detection matches at most once (in time order).
pub fn score(
    found: &[Episode],
    truth: &[Episode],
    kind: FaultKind,
    duration_s: f64,
    grace_s: f64,
    localised: bool,
) -> Score {
    let t: Vec<&Episode> = truth.iter().filter(|e| e.kind == kind).collect();
    let f: Vec<&Episode> = found.iter().filter(|e| e.kind == kind).collect();
    let mut used = vec![false; t.len()];
    let mut tp = 0usize;
    let (mut delays, mut end_err) = (Vec::new(), Vec::new());
    for d in &f {
        let hit = t.iter().enumerate().position(|(i, e)| {
            !used[i]
                && d.detected_at_s >= e.start_s
                && d.detected_at_s <= e.end_s.unwrap_or(f64::INFINITY) + grace_s
                && (!localised || d.unit == e.unit)
        });
        if let Some(i) = hit {
            used[i] = true;
            tp += 1;
            delays.push(d.detected_at_s - t[i].start_s);
            if let (Some(a), Some(b)) = (d.end_s, t[i].end_s) {
                end_err.push((a - b).abs());
            }
        }
    }
    let precision = if f.is_empty() {
        1.0
    } else {
        tp as f64 / f.len() as f64
    };
    let recall = if t.is_empty() {
        1.0
    } else {
        tp as f64 / t.len() as f64
    };
    let f1 = if precision + recall > 0.0 {
        2.0 * precision * recall / (precision + recall)
    } else {
        0.0
    };
    let mean = |v: &[f64]| {
        if v.is_empty() {
            0.0
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        }
    };
    Score {
        kind,
        episodes: t.len(),
        detections: f.len(),
        true_positives: tp,
        precision,
        recall,
        f1,
        false_alarms_per_day: (f.len() - tp) as f64 / (duration_s / 86400.0).max(1e-9),
        mean_delay_s: mean(&delays),
        max_delay_s: delays.iter().cloned().fold(0.0, f64::max),
        mean_end_error_s: mean(&end_err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(it: u64, unit: &str, start: f64, busy: f64, tokens: u64, sq: u64) -> LogEvent {
        LogEvent::Step(StepRecord {
            iteration: it,
            unit: unit.into(),
            start_s: start,
            end_s: start + busy,
            busy_s: Some(busy),
            tokens,
            sum_sq_len: sq,
        })
    }

    /// A workload-driven swing (attention-heavy iterations twice as long) raises nothing in
    /// the workload-aware detector but fools the raw threshold; a real slowdown is caught at
    /// the right unit, with its start and end.
    #[test]
    fn workload_swings_versus_real_slowdown() {
        let (a, b) = (1e-4, 1e-8);
        let mut ev = Vec::new();
        let mut t = 0.0;
        for it in 0..200u64 {
            // Every 7th iteration is attention-heavy.
            let sq = if it % 7 == 0 {
                1_000_000_000
            } else {
                (it % 5 + 1) * 10_000_000
            };
            let tokens = 10_000 + (it % 3) * 1000;
            let mut dur = 0.0f64;
            for (u, name) in ["dp0.pp0", "dp0.pp1"].iter().enumerate() {
                let mut busy = a * tokens as f64 + b * sq as f64;
                if u == 1 && (120..150).contains(&it) {
                    busy *= 1.6;
                }
                ev.push(LogEvent::Heartbeat {
                    unit: name.to_string(),
                    time_s: t,
                });
                ev.push(rec(it, name, t, busy, tokens, sq));
                dur = dur.max(busy);
            }
            t += dur;
        }
        let slow_start = match &ev[120 * 4 + 3] {
            LogEvent::Step(r) => r.start_s,
            _ => unreachable!(),
        };
        let found = run_detector(&mut ResihpDetector::new(DetectorConfig::default()), &ev);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].unit.as_deref(), Some("dp0.pp1"));
        assert!((found[0].start_s - slow_start).abs() < 1e-9);
        assert!(found[0].end_s.is_some());
        let thr = run_detector(&mut ThresholdDetector::new(DetectorConfig::default()), &ev);
        assert!(!thr.is_empty());
    }

    /// Silence of a unit's heartbeats is a fail-stop at its last heartbeat; a change-point
    /// detector sees a step in the period.
    #[test]
    fn heartbeats_and_change_points() {
        let mut ev = Vec::new();
        for k in 0..100 {
            ev.push(LogEvent::Heartbeat {
                unit: "a".into(),
                time_s: k as f64 * 10.0,
            });
            if k < 50 {
                ev.push(LogEvent::Heartbeat {
                    unit: "b".into(),
                    time_s: k as f64 * 10.0,
                });
            }
        }
        let found = run_detector(&mut ResihpDetector::new(DetectorConfig::default()), &ev);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].kind, FaultKind::FailStop);
        assert_eq!(found[0].unit.as_deref(), Some("b"));
        assert_eq!(found[0].start_s, 490.0);

        let mut ev = Vec::new();
        let mut t = 0.0;
        for it in 0..300u64 {
            let p = if (150..260).contains(&it) { 1.5 } else { 1.0 } + 0.01 * ((it * 7) % 5) as f64;
            ev.push(rec(it, "job", t, p, 1, 1));
            t += p;
        }
        let g = run_detector(&mut GreyhoundDetector::new(DetectorConfig::default()), &ev);
        assert!(
            g.iter()
                .any(|e| e.kind == FaultKind::FailSlow && e.end_s.is_some()),
            "{g:?}"
        );
    }

    #[test]
    fn scoring_counts_matches() {
        let ep = |unit: &str, s: f64, e: f64, at: f64| Episode {
            kind: FaultKind::FailSlow,
            unit: Some(unit.into()),
            start_s: s,
            end_s: Some(e),
            detected_at_s: at,
        };
        let truth = vec![ep("a", 100.0, 200.0, 100.0), ep("b", 500.0, 600.0, 500.0)];
        let found = vec![
            ep("a", 101.0, 201.0, 110.0),
            ep("c", 501.0, 601.0, 505.0),
            ep("b", 900.0, 901.0, 900.0),
        ];
        let s = score(&found, &truth, FaultKind::FailSlow, 86400.0, 30.0, true);
        assert_eq!((s.true_positives, s.detections, s.episodes), (1, 3, 2));
        assert!((s.precision - 1.0 / 3.0).abs() < 1e-12 && (s.recall - 0.5).abs() < 1e-12);
        assert!((s.false_alarms_per_day - 2.0).abs() < 1e-12);
        assert!((s.mean_delay_s - 10.0).abs() < 1e-12);
        let u = score(&found, &truth, FaultKind::FailSlow, 86400.0, 30.0, false);
        assert_eq!(u.true_positives, 2);
    }
}
