//! The dashboard's charts: inline SVG drawn with plotters (no scripts, no assets).

use plotters::prelude::*;

/// One bucket of a time series: its start (Unix ms) and tokens in and out.
pub(super) struct Point {
    pub(super) at_ms: i64,
    pub(super) input: i64,
    pub(super) output: i64,
}

/// Tokens in and out per bucket over `[since_ms, until_ms)`, as an `<svg
/// id="chart">` element: two lines, x in hours from `since_ms` labelled with UTC
/// times, buckets without requests at 0. `bucket_ms` is the series' bucket width.
pub(super) fn tokens_chart(
    points: &[Point],
    since_ms: i64,
    until_ms: i64,
    bucket_ms: i64,
) -> String {
    const HOUR: f64 = 3_600_000.0;
    let span_h = ((until_ms - since_ms) as f64 / HOUR).max(1.0);
    let (first, last) = (
        since_ms.div_euclid(bucket_ms),
        (until_ms - 1).div_euclid(bucket_ms),
    );
    // Every bucket of the range, empty ones at 0, so a quiet hour reads as 0.
    let filled: Vec<(f64, i64, i64)> = (first..=last)
        .map(|b| {
            let at = b * bucket_ms;
            let p = points.iter().find(|p| p.at_ms == at);
            let x = ((at.max(since_ms) - since_ms) as f64 / HOUR).min(span_h);
            (x, p.map_or(0, |p| p.input), p.map_or(0, |p| p.output))
        })
        .collect();
    let y_max = filled
        .iter()
        .map(|p| p.1.max(p.2))
        .max()
        .unwrap_or(0)
        .max(1) as f64
        * 1.1;
    let label = move |x: &f64| super::web::utc_minute(since_ms + (x * HOUR) as i64);
    let mut svg = String::new();
    let drawn = (|| -> Result<(), Box<dyn std::error::Error + '_>> {
        let root = SVGBackend::with_string(&mut svg, (720, 260)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .margin(10)
            .x_label_area_size(28)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..span_h, 0f64..y_max)?;
        chart
            .configure_mesh()
            .x_labels(6)
            .y_labels(5)
            .x_label_formatter(&label)
            .y_label_formatter(&|y: &f64| format!("{y:.0}"))
            .light_line_style(WHITE.mix(0.0))
            .draw()?;
        for (name, color, pick) in [
            ("tokens in", RGBColor(0x1f, 0x6f, 0xeb), 0usize),
            ("tokens out", RGBColor(0xd9, 0x73, 0x1a), 1),
        ] {
            let pts = filled.iter().map(move |p| {
                let v = if pick == 0 { p.1 } else { p.2 };
                (p.0, v as f64)
            });
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
                .label(name)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    })();
    match drawn {
        Ok(()) => svg.replacen(
            "<svg ",
            "<svg id=\"chart\" role=\"img\" aria-label=\"Tokens in and out over time\" ",
            1,
        ),
        Err(e) => {
            tracing::warn!(error = %e, "dashboard chart failed");
            "<svg id=\"chart\" role=\"img\" aria-label=\"chart unavailable\"></svg>".into()
        }
    }
}
