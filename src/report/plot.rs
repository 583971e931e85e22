//! The picture: four panels over the step, one under the other (plotters, SVG backend: text
//! stays text, so no font is needed to draw it).

use super::{Metrics, PHASES};
use anyhow::Result;
use plotters::prelude::*;

/// Panel titles, in order (the test reads them back from the SVG).
pub const TITLES: [&str; 4] = [
    "loss",
    "learning rate",
    "tokens/s",
    "peak memory per phase (GiB)",
];

const PHASE_COLORS: [RGBColor; 5] = [
    RGBColor(120, 120, 120),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
];

/// A named line: (step, value) points.
struct Series {
    name: String,
    color: RGBColor,
    points: Vec<(f64, f64)>,
}

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing the report: {e:?}")
}

/// The SVG text of the four panels for `m`, titled `title`.
pub(crate) fn svg(m: &Metrics, title: &str) -> Result<String> {
    let pts = |f: &dyn Fn(&super::Row) -> Option<f64>| -> Vec<(f64, f64)> {
        m.rows
            .iter()
            .filter_map(|r| f(r).filter(|v| v.is_finite()).map(|v| (r.step as f64, v)))
            .collect()
    };
    let blue = RGBColor(31, 119, 180);
    let orange = RGBColor(255, 127, 14);
    let line = |name: &str, color, points| Series {
        name: name.into(),
        color,
        points,
    };
    let mut mem = Vec::new();
    let ranks: std::collections::BTreeSet<usize> = m
        .rows
        .iter()
        .filter_map(|r| r.mem.as_ref().map(|m| m.rank))
        .collect();
    for &rank in &ranks {
        for (i, phase) in PHASES.iter().enumerate() {
            let points: Vec<(f64, f64)> = m
                .rows
                .iter()
                .filter_map(|r| {
                    let mm = r.mem.as_ref().filter(|mm| mm.rank == rank)?;
                    let g = mm.phases().into_iter().find(|(p, _)| p == phase)?.1;
                    Some((r.step as f64, g))
                })
                .collect();
            if !points.is_empty() {
                let name = match ranks.len() {
                    1 => phase.to_string(),
                    _ => format!("rank {rank} {phase}"),
                };
                mem.push(line(&name, PHASE_COLORS[i], points));
            }
        }
    }
    let panels = [
        vec![
            line("train", blue, pts(&|r| r.loss)),
            line("eval", orange, pts(&|r| r.eval_loss)),
        ],
        vec![line("lr", blue, pts(&|r| r.lr))],
        vec![line("tok/s", blue, pts(&|r| r.tok_per_s))],
        mem,
    ];
    let mut buf = String::new();
    {
        let root = SVGBackend::with_string(&mut buf, (960, 1200)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let root = root
            .titled(&format!("lora-train run: {title}"), ("sans-serif", 22))
            .map_err(err)?;
        let areas = root.split_evenly((4, 1));
        for ((area, series), name) in areas.iter().zip(&panels).zip(TITLES) {
            panel(area, name, series)?;
        }
        root.present().map_err(err)?;
    }
    Ok(buf)
}

/// One panel: its title, axes over the series' range, the lines and their legend (or a note
/// when there is nothing to draw).
fn panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    series: &[Series],
) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let all: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .collect();
    let (x0, x1) = range(all.iter().map(|p| p.0));
    let (y0, y1) = range(all.iter().map(|p| p.1));
    let pad = (y1 - y0) * 0.05;
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(x0..x1, (y0 - pad)..(y1 + pad))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_label_formatter(&|v| short(*v))
        .draw()
        .map_err(err)?;
    if all.is_empty() {
        let note = match title {
            t if t.starts_with("peak memory") => "no memory rows (recorded on CUDA only)",
            _ => "no data",
        };
        chart
            .draw_series(std::iter::once(Text::new(
                note,
                ((x0 + x1) / 2.0, (y0 + y1) / 2.0),
                ("sans-serif", 16),
            )))
            .map_err(err)?;
        return Ok(());
    }
    for s in series.iter().filter(|s| !s.points.is_empty()) {
        let color = s.color;
        let style = color.stroke_width(2);
        chart
            .draw_series(LineSeries::new(s.points.iter().copied(), style))
            .map_err(err)?
            .label(s.name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
        if s.points.len() == 1 {
            chart
                .draw_series(s.points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(err)?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// (min, max) of `v`, widened when empty or flat so that the axes have a span.
fn range(v: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = v.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    if hi - lo < 1e-12 * hi.abs().max(1.0) {
        let d = hi.abs().max(1.0) * 0.5;
        return (lo - d, hi + d);
    }
    (lo, hi)
}

/// An axis label: 3 significant digits, scientific for small or large values.
fn short(v: f64) -> String {
    let a = v.abs();
    if a != 0.0 && !(1e-2..1e5).contains(&a) {
        format!("{v:.1e}")
    } else {
        format!("{v:.3}")
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string()
    }
}
