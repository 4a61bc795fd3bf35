//! SVG plots: predicted vs published (validation) with the y = x line.

use plotters::prelude::*;

/// One labelled point.
#[derive(Clone, Debug, PartialEq)]
pub struct Point {
    /// Series (e.g. the source of a validation case).
    pub series: String,
    /// Published value.
    pub x: f64,
    /// Predicted value.
    pub y: f64,
}

/// The plots' series colours (matplotlib's tab10 order), shared by every SVG plot.
pub(crate) const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// Renders a predicted-vs-published scatter on log-log axes (cases mix units: utilisation,
/// TFLOP/s, tokens/s, seconds) with the y = x line and a +-10% band, as SVG text.
pub fn predicted_vs_published_svg(title: &str, points: &[Point]) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 700)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let finite: Vec<&Point> = points
            .iter()
            .filter(|p| p.x > 0.0 && p.y > 0.0 && p.x.is_finite() && p.y.is_finite())
            .collect();
        let lo = finite
            .iter()
            .map(|p| p.x.min(p.y))
            .fold(f64::INFINITY, f64::min);
        let hi = finite.iter().map(|p| p.x.max(p.y)).fold(0.0, f64::max);
        let (lo, hi) = if finite.is_empty() {
            (0.1, 10.0)
        } else {
            (lo / 1.5, hi * 1.5)
        };
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 22))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(70)
            .build_cartesian_2d((lo..hi).log_scale(), (lo..hi).log_scale())
            .map_err(|e| e.to_string())?;
        chart
            .configure_mesh()
            .x_desc("published")
            .y_desc("predicted")
            .draw()
            .map_err(|e| e.to_string())?;
        let line = |f: f64| {
            (0..=100).map(move |i| {
                let x = lo * (hi / lo).powf(i as f64 / 100.0);
                (x, x * f)
            })
        };
        chart
            .draw_series(LineSeries::new(line(1.0), BLACK.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label("y = x")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLACK));
        for f in [0.9, 1.1] {
            chart
                .draw_series(LineSeries::new(line(f), RGBColor(170, 170, 170)))
                .map_err(|e| e.to_string())?;
        }
        let mut series: Vec<&str> = finite.iter().map(|p| p.series.as_str()).collect();
        series.sort_unstable();
        series.dedup();
        for (i, s) in series.iter().enumerate() {
            let c = COLORS[i % COLORS.len()];
            chart
                .draw_series(
                    finite
                        .iter()
                        .filter(|p| p.series == *s)
                        .map(|p| Circle::new((p.x, p.y), 5, c.filled())),
                )
                .map_err(|e| e.to_string())?
                .label(*s)
                .legend(move |(x, y)| Circle::new((x + 10, y), 5, c.filled()));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_has_points_and_legend() {
        let pts = vec![
            Point {
                series: "a".into(),
                x: 0.4,
                y: 0.42,
            },
            Point {
                series: "b".into(),
                x: 300.0,
                y: 280.0,
            },
        ];
        let svg = predicted_vs_published_svg("test", &pts).unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(svg.matches("<circle").count() >= 2);
        assert!(svg.contains("y = x"));
    }
}

/// One empirical CDF panel: sorted samples, axis label, and an optional marked point
/// `(t, q, label)` drawn as a cross-hair (the guarantee `P(T <= t) >= q`).
#[derive(Clone, Debug)]
pub struct CdfPanel<'a> {
    /// Panel title.
    pub title: &'a str,
    /// X axis label (with unit).
    pub x_label: &'a str,
    /// Samples in ascending order.
    pub sorted: &'a [f64],
    /// Marked point.
    pub mark: Option<(f64, f64, String)>,
}

/// Renders empirical CDFs side by side as SVG text.
pub fn cdfs_svg(panels: &[CdfPanel<'_>]) -> Result<String, String> {
    let mut svg = String::new();
    {
        let width = 520 * panels.len().max(1) as u32;
        let root = SVGBackend::with_string(&mut svg, (width, 440)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let areas = root.split_evenly((1, panels.len().max(1)));
        for (panel, area) in panels.iter().zip(areas.iter()) {
            let xs = panel.sorted;
            let (lo, hi) = match (xs.first(), xs.last()) {
                (Some(&a), Some(&b)) if b > a => (a - 0.05 * (b - a), b + 0.05 * (b - a)),
                (Some(&a), _) => (a * 0.99 - 1e-9, a * 1.01 + 1e-9),
                _ => (0.0, 1.0),
            };
            let mut chart = ChartBuilder::on(area)
                .caption(panel.title, ("sans-serif", 18))
                .margin(15)
                .x_label_area_size(40)
                .y_label_area_size(50)
                .build_cartesian_2d(lo..hi, 0.0..1.0)
                .map_err(|e| e.to_string())?;
            chart
                .configure_mesh()
                .x_desc(panel.x_label)
                .y_desc("P(T <= t)")
                .draw()
                .map_err(|e| e.to_string())?;
            let n = xs.len().max(1) as f64;
            let steps = xs
                .iter()
                .enumerate()
                .flat_map(|(i, &x)| [(x, i as f64 / n), (x, (i + 1) as f64 / n)]);
            chart
                .draw_series(LineSeries::new(steps, COLORS[0].stroke_width(2)))
                .map_err(|e| e.to_string())?;
            if let Some((t, q, label)) = &panel.mark {
                let red = COLORS[3];
                chart
                    .draw_series(LineSeries::new(
                        [(lo, *q), (*t, *q), (*t, 0.0)],
                        red.stroke_width(1),
                    ))
                    .map_err(|e| e.to_string())?
                    .label(label.as_str())
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], red));
                chart
                    .configure_series_labels()
                    .background_style(WHITE.mix(0.8))
                    .border_style(BLACK)
                    .position(SeriesLabelPosition::UpperLeft)
                    .draw()
                    .map_err(|e| e.to_string())?;
            }
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(svg)
}

#[cfg(test)]
mod cdf_tests {
    use super::*;

    #[test]
    fn cdf_panels_render_with_mark() {
        let a: Vec<f64> = (1..=100).map(|i| i as f64).collect();
        let b = vec![5.0, 6.0, 7.0];
        let svg = cdfs_svg(&[
            CdfPanel {
                title: "step",
                x_label: "s",
                sorted: &a,
                mark: Some((95.0, 0.95, "P(T <= 95) >= 0.95".into())),
            },
            CdfPanel {
                title: "run",
                x_label: "days",
                sorted: &b,
                mark: None,
            },
        ])
        .unwrap();
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("P(T &lt;= 95) &gt;= 0.95") || svg.contains("P(T <= 95) >= 0.95"));
        // Two CDF staircases and the guarantee's cross-hair, besides the grid.
        assert!(svg.matches("<polyline").count() >= 3);
        assert!(svg.contains("P(T &lt;= t)") || svg.contains("P(T <= t)"));
    }
}
