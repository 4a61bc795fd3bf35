//! Formats of `prism geo`: JSON reports and SVG timelines (WAN link use; a GPU's schedule with
//! admitted prefill).

use plotters::prelude::*;
use prism_geo::plan::{Evaluated, Plan};
use serde_json::{Value, json};

fn evaluated_json(e: &Evaluated, iterations: u64) -> Value {
    let p = &e.placement;
    let names = &e.job.cluster.topology.wan.datacenters;
    let dcs: Vec<Value> = p
        .dcs
        .iter()
        .zip(&p.per_dc)
        .enumerate()
        .map(|(k, (&d, &units))| {
            let name = names
                .get(k)
                .map_or_else(|| format!("dc{d}"), |x| x.name.clone());
            json!({ "datacenter": name, "units": units })
        })
        .collect();
    json!({
        "design": e.design.name(),
        "pp": p.pp,
        "dp": p.dp,
        "tp": e.job.parallel.tp,
        "micro_batch": p.micro_batch,
        "recompute_full": p.recompute_full,
        "gpus": e.gpus(),
        "datacenters": dcs,
        "iteration_time_s": e.iteration_s,
        "training_time_s": e.iteration_s * iterations as f64,
        "mfu": e.mfu,
        "bubble_fraction": e.bubble_fraction,
        "wan_utilisation": e.wan_utilisation(),
        "wan_bytes_per_iteration": e.wan_bytes.iter().sum::<u64>(),
        "wan_sharing": e.job.cluster.topology.wan.sharing.name(),
    })
}

/// `prism geo plan --json`.
pub fn plan_json(plan: &Plan) -> Value {
    let it = plan.options.iterations;
    let baselines: Vec<Value> = plan
        .baselines
        .iter()
        .map(|b| {
            let mut v = evaluated_json(b, it);
            v["atlas_speedup"] = json!(b.iteration_s / plan.atlas.iteration_s);
            v
        })
        .collect();
    json!({
        "atlas": evaluated_json(&plan.atlas, it),
        "baselines": baselines,
        "iterations": it,
        "candidates_simulated": plan.simulated,
        "options": {
            "temporal_sharing": plan.options.temporal,
            "multi_connection": plan.options.multi_connection,
            "dc_order_search": plan.options.dc_order_search,
            "micro_batches": plan.options.micro_batches,
        },
    })
}

/// Rows of a Gantt-style timeline: a label and its bars `(start s, end s, level in [0, 1],
/// colour index)`.
#[derive(Clone, Debug, Default)]
pub struct TimelineRow {
    /// Row label.
    pub label: String,
    /// Bars: start and end in seconds, height as a fraction of the row, colour index.
    pub bars: Vec<(f64, f64, f64, usize)>,
}

const COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
];

/// Bars of one colour closer than `min_gap` merged into one (height: their time-weighted
/// mean), so a plot of thousands of kernels stays small.
fn merge_bars(bars: &[(f64, f64, f64, usize)], min_gap: f64) -> Vec<(f64, f64, f64, usize)> {
    let mut v: Vec<(f64, f64, f64, usize)> = bars.to_vec();
    v.sort_by(|a, b| a.3.cmp(&b.3).then(a.0.total_cmp(&b.0)));
    let mut out: Vec<(f64, f64, f64, usize)> = Vec::new();
    let mut area = 0.0;
    for b in v {
        match out.last_mut() {
            Some(l) if l.3 == b.3 && b.0 - l.1 <= min_gap => {
                area += (b.1 - b.0) * b.2;
                l.1 = l.1.max(b.1);
                l.2 = (area / (l.1 - l.0).max(1e-15)).min(1.0);
            }
            _ => {
                area = (b.1 - b.0) * b.2;
                out.push(b);
            }
        }
    }
    out
}

/// Renders rows of bars over time as SVG text (`legend`: the meaning of each colour index).
pub fn timeline_svg(
    title: &str,
    rows: &[TimelineRow],
    end_s: f64,
    legend: &[&str],
) -> Result<String, String> {
    let mut svg = String::new();
    {
        let h = 160 + 60 * rows.len() as u32;
        let root = SVGBackend::with_string(&mut svg, (1100, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let n = rows.len().max(1) as f64;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(160)
            .build_cartesian_2d(0.0..end_s.max(1e-9), 0.0..n)
            .map_err(|e| e.to_string())?;
        let labels: Vec<String> = rows.iter().map(|r| r.label.clone()).collect();
        chart
            .configure_mesh()
            .x_desc("time in the iteration (s)")
            .y_labels(rows.len().max(1))
            .y_label_formatter(&|y| {
                let i = (n - y - 0.5).round() as i64;
                labels
                    .get(i.max(0) as usize)
                    .filter(|_| (y.fract() - 0.5).abs() < 0.01)
                    .cloned()
                    .unwrap_or_default()
            })
            .disable_y_mesh()
            .draw()
            .map_err(|e| e.to_string())?;
        for (i, row) in rows.iter().enumerate() {
            let base = n - 1.0 - i as f64 + 0.1;
            for &(s, e, level, c) in &merge_bars(&row.bars, end_s / 2000.0) {
                let top = base + 0.8 * level.clamp(0.0, 1.0);
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(s, base), (e.max(s), top)],
                        COLORS[c % COLORS.len()].mix(0.8).filled(),
                    )))
                    .map_err(|e| e.to_string())?;
            }
        }
        for (c, name) in legend.iter().enumerate() {
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(0.0, -1.0), (0.0, -1.0)],
                    COLORS[c % COLORS.len()].filled(),
                )))
                .map_err(|e| e.to_string())?
                .label(*name)
                .legend(move |(x, y)| {
                    Rectangle::new(
                        [(x, y - 5), (x + 12, y + 5)],
                        COLORS[c % COLORS.len()].filled(),
                    )
                });
        }
        if !legend.is_empty() {
            chart
                .configure_series_labels()
                .border_style(BLACK)
                .background_style(WHITE.mix(0.9))
                .draw()
                .map_err(|e| e.to_string())?;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// The WAN links' use over one iteration of `e`: one row per directed link that carries
/// traffic, each transfer a bar whose height is its mean rate over the link's capacity.
pub fn wan_timeline_rows(e: &Evaluated) -> Vec<TimelineRow> {
    let w = &e.job.cluster.topology.wan;
    let mut rows = Vec::new();
    for (i, l) in w.links.iter().enumerate() {
        for dir in 0..2u32 {
            let idx = 2 * i as u32 + dir;
            let (a, b) = if dir == 0 { (l.a, l.b) } else { (l.b, l.a) };
            let cap = l.bytes_per_s() as f64;
            let bars: Vec<(f64, f64, f64, usize)> = e
                .wan_transfers
                .iter()
                .filter(|t| t.link == idx && t.end > t.start)
                .map(|t| {
                    let (s, en) = (t.start as f64 * 1e-12, t.end as f64 * 1e-12);
                    (s, en, t.bytes as f64 / (en - s) / cap, dir as usize)
                })
                .collect();
            if !bars.is_empty() {
                rows.push(TimelineRow {
                    label: format!(
                        "{} -> {}",
                        w.datacenters[a as usize].name, w.datacenters[b as usize].name
                    ),
                    bars,
                });
            }
        }
    }
    rows
}

/// Reads an arrival trace (CSV with a header naming `arrived_at` (s) and `num_prefill_tokens`
/// columns, as Vidur's processed Splitwise traces; other columns ignored), sorted by arrival.
pub fn read_arrival_trace(
    path: &std::path::Path,
) -> Result<Vec<prism_geo::bubbles::Request>, String> {
    let shown = path.display();
    let mut rd = csv::Reader::from_path(path).map_err(|e| format!("{shown}: {e}"))?;
    let headers = rd.headers().map_err(|e| format!("{shown}: {e}"))?.clone();
    let col = |name: &str| {
        headers
            .iter()
            .position(|h| h.trim() == name)
            .ok_or_else(|| format!("{shown}: no column `{name}` in the header"))
    };
    let (ta, tn) = (col("arrived_at")?, col("num_prefill_tokens")?);
    let mut out = Vec::new();
    for (i, rec) in rd.records().enumerate() {
        let line = i + 2;
        let rec = rec.map_err(|e| format!("{shown}:{line}: {e}"))?;
        let field = |c: usize, what: &str| {
            rec.get(c)
                .map(str::trim)
                .ok_or_else(|| format!("{shown}:{line}: missing {what}"))
        };
        let t: f64 = field(ta, "arrived_at")?
            .parse()
            .map_err(|_| format!("{shown}:{line}: arrived_at must be a number of seconds"))?;
        let n: f64 = field(tn, "num_prefill_tokens")?
            .parse()
            .map_err(|_| format!("{shown}:{line}: num_prefill_tokens must be a number"))?;
        if !(t.is_finite() && t >= 0.0 && n.is_finite() && (1.0..=1e7).contains(&n)) {
            return Err(format!(
                "{shown}:{line}: arrived_at must be >= 0 and num_prefill_tokens in [1, 1e7]"
            ));
        }
        out.push(prism_geo::bubbles::Request {
            arrival_s: t,
            prompt_tokens: n.round() as u32,
        });
    }
    out.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    Ok(out)
}

/// `prism geo bubbles --json`.
pub fn bubbles_json(r: &prism_geo::bubbles::BubbleReport, model: &str, tp: u32) -> Value {
    let grid: Vec<Value> = r
        .prefill
        .grid
        .iter()
        .map(|&(n, s)| json!({"tokens": n, "seconds": s}))
        .collect();
    json!({
        "iteration_time_s": r.iteration_s,
        "iteration_time_with_prefill_s": r.iteration_with_prefill_s,
        "training_slowdown": r.training_slowdown,
        "max_kernel_shift_s": r.max_kernel_shift_s,
        "idle_fraction": r.idle_fraction,
        "gpu_utilisation_without": r.utilisation_without,
        "gpu_utilisation_with": r.utilisation_with,
        "requests": r.requests,
        "admitted": r.admitted.len(),
        "admitted_fraction": r.admitted.len() as f64 / r.requests.max(1) as f64,
        "prefill_per_s": r.prefill_per_s(),
        "prefill_tokens_per_s": r.tokens_per_s(),
        "ttft_p50_s": r.ttft_p50_s,
        "ttft_p99_s": r.ttft_p99_s,
        "slo_s": r.slo_s,
        "horizon_s": r.horizon_s,
        "inference_model": model,
        "inference_tp": tp,
        "instances_per_stage": r.instances_per_stage,
        "stages_fitting_memory": r.stages_fitting.iter().filter(|&&f| f).count(),
        "prefill_latency_grid": grid,
    })
}

/// Renders line series `(label, points)` as SVG text; `log_x` puts x on a log scale.
pub fn lines_svg(
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
    log_x: bool,
) -> Result<String, String> {
    use crate::plot::COLORS as PALETTE;
    let pts = series.iter().flat_map(|s| s.1.iter());
    let (mut x0, mut x1, mut y1) = (f64::INFINITY, 0.0f64, 0.0f64);
    for &(x, y) in pts {
        if x.is_finite() && y.is_finite() {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y1 = y1.max(y);
        }
    }
    if !x0.is_finite() {
        (x0, x1, y1) = (1.0, 10.0, 1.0);
    }
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1000, 650)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let mut b = ChartBuilder::on(&root);
        b.caption(title, ("sans-serif", 20))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(60);
        let y_range = 0.0..(y1 * 1.1).max(1e-9);
        macro_rules! draw {
            ($chart:expr) => {{
                let mut chart = $chart;
                chart
                    .configure_mesh()
                    .x_desc(x_desc)
                    .y_desc(y_desc)
                    .draw()
                    .map_err(|e| e.to_string())?;
                for (i, (label, p)) in series.iter().enumerate() {
                    let c = PALETTE[i % PALETTE.len()];
                    chart
                        .draw_series(LineSeries::new(p.iter().copied(), c.stroke_width(2)))
                        .map_err(|e| e.to_string())?
                        .label(label.as_str())
                        .legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2))
                        });
                    chart
                        .draw_series(p.iter().map(|&q| Circle::new(q, 3, c.filled())))
                        .map_err(|e| e.to_string())?;
                }
                chart
                    .configure_series_labels()
                    .border_style(BLACK)
                    .background_style(WHITE.mix(0.9))
                    .position(SeriesLabelPosition::UpperLeft)
                    .draw()
                    .map_err(|e| e.to_string())?;
            }};
        }
        if log_x {
            draw!(
                b.build_cartesian_2d((x0 * 0.9..x1 * 1.1).log_scale(), y_range)
                    .map_err(|e| e.to_string())?
            );
        } else {
            draw!(
                b.build_cartesian_2d(x0..x1, y_range)
                    .map_err(|e| e.to_string())?
            );
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

/// `prism geo sweep --json`.
pub fn sweep_json(rows: &[prism_geo::sweep::SweepRow]) -> Value {
    use prism_geo::plan::Design;
    let rows: Vec<Value> = rows
        .iter()
        .map(|r| {
            let sp = |d: Design| r.speedup(d);
            json!({
                "model": r.model,
                "datacenters": r.dcs,
                "wan_gbps": r.gbps,
                "rtt_ms": r.rtt_ms,
                "gpus": r.gpus,
                "atlas_iteration_s": r.atlas_s,
                "atlas_layout": r.atlas_layout.map(|(pp, dp, mb, g)| json!({"pp": pp, "dp": dp, "micro_batch": mb, "gpus": g})),
                "baselines": r.baselines.iter().map(|(d, t)| json!({"design": d.name(), "iteration_s": t})).collect::<Vec<_>>(),
                "speedup_over_dp_across_dcs": sp(Design::DpAcrossDcs),
                "speedup_over_pp_fair": sp(Design::PpFairSharing),
                "speedup_over_one_connection": sp(Design::OneConnection),
                "wan_utilisation": r.wan_utilisation,
                "gpu_utilisation_without_prefill": r.utilisation.map(|u| u.0),
                "gpu_utilisation_with_prefill": r.utilisation.map(|u| u.1),
                "training_slowdown": r.utilisation.map(|u| u.2),
            })
        })
        .collect();
    json!({ "rows": rows })
}
