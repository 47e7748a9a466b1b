//! The two figures of the credit report, each as PNG and SVG: disagreement rates against the
//! replica floor per configuration (bars with cluster-bootstrap CIs), and critical-set Jaccard
//! vs `τ` with the replica ceiling. Drawn with the shared plumbing of [`crate::report::figure`].
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::prelude::*;

use crate::Result;
use crate::report::figure::{
    CategoryAxis, DrawResult, Figure, PALETTE, distinct_labels, draw_legend, render,
};

use super::read::Pass;
use super::summary::{Comparison, Conditioning, ConfigSummary};

const REPLICA: RGBColor = RGBColor(0x8c, 0x8c, 0x8c);
const REFEED: RGBColor = RGBColor(0x1f, 0x77, 0xb4);

fn conditioning_title(c: Conditioning) -> &'static str {
    match c {
        Conditioning::AnyInformative => "any-informative",
        Conditioning::TreatmentIndependent => "treatment-independent (exact informative)",
    }
}

struct DisagreementFigure<'a> {
    summaries: &'a [ConfigSummary],
}

/// `(rate, lo, hi)` in percent; the CI collapses to the point when absent.
fn rate_pct(c: &Comparison) -> Option<(f64, f64, f64)> {
    let r = c.rate?;
    let (lo, hi) = c.rate_ci.map_or((r, r), |ci| (ci.lo, ci.hi));
    Some((100.0 * r, 100.0 * lo, 100.0 * hi))
}

impl Figure for DisagreementFigure<'_> {
    fn size(&self) -> (u32, u32) {
        let n = self.summaries.len() as u32;
        ((500 + 140 * n).min(2400) * 2, 520)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let ymax = self
            .summaries
            .iter()
            .flat_map(|s| &s.rows)
            .flat_map(|r| [&r.replica, &r.treatment])
            .filter_map(rate_pct)
            .map(|(_, _, hi)| hi)
            .fold(5.0_f64, f64::max)
            * 1.15;
        let panels = root.split_evenly((1, 2));
        for (p, cond) in panels.iter().zip(Conditioning::ALL) {
            let axis = CategoryAxis {
                labels: distinct_labels(self.summaries.iter().map(|s| s.meta.config.as_str()), 22),
            };
            let mut chart = ChartBuilder::on(p)
                .caption(
                    format!("Disagreement with exact: {}", conditioning_title(cond)),
                    ("sans-serif", 18),
                )
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(60)
                .build_cartesian_2d(axis.clone(), 0.0..ymax)?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .bold_line_style(BLACK.mix(0.12))
                .light_line_style(TRANSPARENT)
                .x_label_formatter(&|x| axis.format_ext(x))
                .y_desc("eligible estimates that disagree (%)")
                .y_label_formatter(&|y| format!("{y:.0}"))
                .label_style(("sans-serif", 13))
                .draw()?;
            let treated = format!(
                "exact ≠ {}",
                self.summaries
                    .first()
                    .map_or("refeed", |s| s.treatment.as_str())
            );
            for (pass_idx, (label, color)) in [
                ("exact ≠ replica (floor)".to_string(), REPLICA),
                (treated, REFEED),
            ]
            .into_iter()
            .enumerate()
            {
                let off = if pass_idx == 0 { -0.19 } else { 0.19 };
                let bars: Vec<(f64, (f64, f64, f64))> = self
                    .summaries
                    .iter()
                    .enumerate()
                    .filter_map(|(i, s)| {
                        let row = s.rows.iter().find(|r| r.conditioning == cond)?;
                        let cmp = if pass_idx == 0 {
                            &row.replica
                        } else {
                            &row.treatment
                        };
                        rate_pct(cmp).map(|v| (i as f64 + off, v))
                    })
                    .collect();
                chart
                    .draw_series(bars.iter().map(|&(x, (r, _, _))| {
                        Rectangle::new([(x - 0.17, 0.0), (x + 0.17, r)], color.filled())
                    }))?
                    .label(label)
                    .legend(move |(x, y)| {
                        Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                    });
                chart.draw_series(bars.iter().map(|&(x, (r, lo, hi))| {
                    ErrorBar::new_vertical(x, lo, r, hi, BLACK.stroke_width(1), 8)
                }))?;
            }
            draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        }
        Ok(())
    }
}

struct JaccardFigure<'a> {
    summaries: &'a [ConfigSummary],
}

/// Runs of consecutive defined points (an empty union breaks the line).
fn segments(points: &[(f64, Option<f64>)]) -> Vec<Vec<(f64, f64)>> {
    let mut out = vec![Vec::new()];
    for &(x, y) in points {
        match y {
            Some(y) => out.last_mut().expect("non-empty").push((x, y)),
            None => out.push(Vec::new()),
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

impl Figure for JaccardFigure<'_> {
    fn size(&self) -> (u32, u32) {
        (900, 560)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        // Critical sets are over every complete key, so one panel serves both conditionings.
        let cond = Conditioning::AnyInformative;
        let mut chart = ChartBuilder::on(root)
            .caption(
                "Critical-set Jaccard vs τ (every estimate; both conditionings)",
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0.0..1.05_f64, 0.0..1.05_f64)?;
        chart
            .configure_mesh()
            .bold_line_style(BLACK.mix(0.12))
            .light_line_style(TRANSPARENT)
            .x_desc("τ (threshold on |Â|)")
            .y_desc("Jaccard with exact")
            .x_label_formatter(&|x| format!("{x:.2}"))
            .y_label_formatter(&|y| format!("{y:.1}"))
            .label_style(("sans-serif", 13))
            .draw()?;
        let names = distinct_labels(self.summaries.iter().map(|s| s.meta.config.as_str()), 24);
        for (i, (s, name)) in self.summaries.iter().zip(&names).enumerate() {
            let Some(row) = s.rows.iter().find(|r| r.conditioning == cond) else {
                continue;
            };
            let color = PALETTE[i % PALETTE.len()];
            for (cmp, is_refeed) in [(&row.treatment, true), (&row.replica, false)] {
                let pts: Vec<(f64, Option<f64>)> = cmp
                    .jaccard
                    .iter()
                    .map(|j| (j.tau, j.result.value))
                    .collect();
                let style = color.stroke_width(2);
                let label = if is_refeed {
                    format!("{name}: {}", s.treatment)
                } else {
                    format!("{name}: replica ceiling")
                };
                for (n_seg, seg) in segments(&pts).into_iter().enumerate() {
                    let anno = if is_refeed {
                        chart.draw_series(LineSeries::new(seg.clone(), style))?
                    } else {
                        chart.draw_series(DashedLineSeries::new(seg.clone(), 8, 5, style))?
                    };
                    if n_seg == 0 && is_refeed {
                        anno.label(label.clone()).legend(move |(x, y)| {
                            PathElement::new(vec![(x, y), (x + 18, y)], style)
                        });
                    } else if n_seg == 0 {
                        anno.label(label.clone()).legend(move |(x, y)| {
                            EmptyElement::at((x, y))
                                + PathElement::new(vec![(0, 0), (6, 0)], style)
                                + PathElement::new(vec![(10, 0), (16, 0)], style)
                        });
                    }
                    if is_refeed {
                        chart
                            .draw_series(seg.iter().map(|&c| Circle::new(c, 4, color.filled())))?;
                    } else {
                        chart.draw_series(
                            seg.iter()
                                .map(|&c| TriangleMarker::new(c, 5, color.filled())),
                        )?;
                    }
                }
                // Replica bars sit slightly right of τ so both CIs stay visible.
                let dx = if is_refeed { 0.0 } else { 0.012 };
                let bars = cmp.jaccard.iter().filter_map(|j| {
                    let (v, ci) = (j.result.value?, j.ci?);
                    Some(ErrorBar::new_vertical(
                        j.tau + dx,
                        ci.lo,
                        v,
                        ci.hi,
                        color.stroke_width(1),
                        6,
                    ))
                });
                chart.draw_series(bars)?;
            }
        }
        draw_legend(&mut chart, SeriesLabelPosition::LowerLeft)?;
        Ok(())
    }
}

/// File stem of the disagreement figure (`.png`/`.svg`).
pub const DISAGREEMENT_STEM: &str = "disagreement";
/// File stem of the Jaccard figure (`.png`/`.svg`).
pub const JACCARD_STEM: &str = "jaccard";

/// The file stem of figure `base` for `treatment`: `base` for refeed, `base-<pass>` else.
pub fn stem(base: &str, treatment: Pass) -> String {
    if treatment == Pass::Refeed {
        base.to_string()
    } else {
        format!("{base}-{treatment}")
    }
}

/// Draw both figures into `out_dir` per treatment pass present (refeed's under the plain
/// stems, the others' under [`stem`]); returns the paths (PNG, SVG of each).
pub fn write_plots(summaries: &[ConfigSummary], out_dir: &Path) -> Result<Vec<PathBuf>> {
    let mut paths = Vec::new();
    for t in Pass::TREATMENTS {
        let summaries: Vec<ConfigSummary> = summaries
            .iter()
            .filter(|s| s.treatment == t)
            .cloned()
            .collect();
        if summaries.is_empty() {
            continue;
        }
        let summaries = &summaries[..];
        paths.extend(render(
            &DisagreementFigure { summaries },
            &out_dir.join(stem(DISAGREEMENT_STEM, t)),
        )?);
        paths.extend(render(
            &JaccardFigure { summaries },
            &out_dir.join(stem(JACCARD_STEM, t)),
        )?);
    }
    Ok(paths)
}
