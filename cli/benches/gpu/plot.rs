//! The benchmark's charts: per section, the share of the same-run ceiling against pages, one
//! line per method (what a row measures, its page count taken out), written as SVG next to
//! `bench.md`. Drawn with plotters (criterion's plotting crate, already in the build) through its
//! SVG backend only: no font or image libraries.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::prelude::*;

use kvshard_cli::measure::pages_of;

use crate::harness::Row;

/// A chart's lines: each line's name and its (pages, % of ceiling) points.
type Lines = BTreeMap<String, Vec<(u64, f64)>>;

/// One chart per section with at least one line of two points or more; returns the files.
pub fn write(rows: &[Row], dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut sections: BTreeMap<&str, Lines> = BTreeMap::new();
    for r in rows {
        if let Some((pages, line)) = pages_of(&r.case) {
            let share = 100.0 * r.gbps() / r.ceiling.max(f64::MIN_POSITIVE);
            sections
                .entry(r.section)
                .or_default()
                .entry(line)
                .or_default()
                .push((pages, share));
        }
    }
    let mut written = Vec::new();
    for (section, mut lines) in sections {
        lines.retain(|_, points| points.len() >= 2);
        if lines.is_empty() {
            continue;
        }
        let path = dir.join(format!("bench-{section}.svg"));
        chart(section, &lines, &path).map_err(|e| format!("{}: {e}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

fn chart(section: &str, lines: &Lines, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let points = lines.values().flatten();
    let (lo, hi) = points.fold((u64::MAX, 1), |(lo, hi), &(p, _)| (lo.min(p), hi.max(p)));
    // Legend rows under the plot: one per line.
    let height = 420 + 18 * lines.len() as u32;
    let root = SVGBackend::new(path, (900, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let (plot, legend) = root.split_vertically(420);
    let mut chart = ChartBuilder::on(&plot)
        .caption(
            format!("{section}: % of the same-run ceiling"),
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(48)
        .build_cartesian_2d((lo as f64..hi as f64).log_scale(), 0.0..100.0)?;
    chart
        .configure_mesh()
        .x_desc("pages")
        .y_desc("% of ceiling")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()?;
    for (i, (name, points)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let mut sorted = points.clone();
        sorted.sort_by_key(|&(p, _)| p);
        chart.draw_series(LineSeries::new(
            sorted.iter().map(|&(p, share)| (p as f64, share)),
            color.stroke_width(2),
        ))?;
        chart.draw_series(
            sorted
                .iter()
                .map(|&(p, share)| Circle::new((p as f64, share), 3, color.filled())),
        )?;
        let y = 4 + 18 * i as i32;
        legend.draw(&Rectangle::new([(60, y + 4), (80, y + 8)], color.filled()))?;
        legend.draw(&Text::new(name.clone(), (88, y), ("sans-serif", 13)))?;
    }
    root.present()?;
    Ok(())
}
