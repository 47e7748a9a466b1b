//! Figures of `kvcredit spectrum report`, drawn with the plotting machinery of
//! [`crate::report::figure`] (each written as PNG and SVG by its `render`): PPL Δ% vs the
//! budget per model, NIAH accuracy by depth per model, and the TTFT stage stacks.
use crate::report::figure::{CategoryAxis, DrawResult, Figure, PALETTE, short};
use plotters::coord::Shift;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// File stem of the PPL Δ% figure.
pub const PPL_STEM: &str = "ppl-delta";
/// File stem of the NIAH heatmaps.
pub const NIAH_STEM: &str = "niah-depth";
/// File stem of the TTFT stacks.
pub const TTFT_STEM: &str = "ttft-stages";

const LEGEND_W: u32 = 250;

/// Colour of a tier policy (fixed per name so that every panel and figure agrees).
fn policy_color(policy: &str) -> RGBColor {
    let i = match policy {
        "spectrum" => 0,
        "snapkv" => 1,
        "spectrum-2tier" => 2,
        "pdtrim" => 3,
        "spectrum-position" => 6,
        "pdtrim-first" => 8,
        "uniform-int8" => 4,
        "uniform-int4" => 5,
        "uniform-fp16" => 7,
        "full" => 7,
        other => 8 + other.len() % 2,
    };
    PALETTE[i % PALETTE.len()]
}

#[derive(Clone, Copy, PartialEq)]
enum Marker {
    Circle,
    Triangle,
    Square,
}

/// Line dash and marker of a quantizer: `lab-compat` and `lab-compat-token` dashed with
/// triangles, `none` (PDTrim, snapkv: no INT tier) solid with squares, the rest (`kivi`) solid
/// with circles.
fn quantizer_style(q: &str) -> (bool, Marker) {
    match q {
        "lab-compat" | "lab-compat-token" => (true, Marker::Triangle),
        "none" => (false, Marker::Square),
        _ => (false, Marker::Circle),
    }
}

/// How a legend row shows its series.
#[derive(Clone, Copy)]
enum Key {
    /// A line, dashed or not, with its marker.
    Line(bool, Marker),
    /// A marker alone (a series of one point).
    Marker(Marker),
    /// A filled swatch (a bar segment).
    Swatch,
}

/// One legend row.
pub(crate) struct LegendEntry {
    label: String,
    color: RGBColor,
    key: Key,
}

fn draw_marker<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    at: (i32, i32),
    marker: Marker,
    color: RGBColor,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    match marker {
        Marker::Circle => area.draw(&Circle::new(at, 4, color.filled()))?,
        Marker::Triangle => area.draw(&TriangleMarker::new(at, 5, color.filled()))?,
        Marker::Square => area.draw(&Rectangle::new(
            [(at.0 - 4, at.1 - 4), (at.0 + 4, at.1 + 4)],
            color.filled(),
        ))?,
    }
    Ok(())
}

/// A legend in its own strip (pixel coordinates of `area`), so it never covers data.
fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    entries: &[LegendEntry],
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let font = ("sans-serif", 13).into_font();
    area.draw(&Text::new(
        title.to_string(),
        (8, 40),
        ("sans-serif", 14).into_font(),
    ))?;
    for (i, e) in entries.iter().enumerate() {
        let y = 68 + 22 * i as i32;
        match e.key {
            Key::Line(dashed, marker) => {
                let style = e.color.stroke_width(2);
                if dashed {
                    area.draw(&PathElement::new([(8, y), (17, y)], style))?;
                    area.draw(&PathElement::new([(23, y), (32, y)], style))?;
                } else {
                    area.draw(&PathElement::new([(8, y), (32, y)], style))?;
                }
                draw_marker(area, (20, y), marker, e.color)?;
            }
            Key::Marker(marker) => draw_marker(area, (20, y), marker, e.color)?,
            Key::Swatch => {
                area.draw(&Rectangle::new(
                    [(10, y - 7), (30, y + 7)],
                    e.color.filled(),
                ))?;
            }
        }
        area.draw(&Text::new(
            short(&e.label, 30),
            (40, y),
            TextStyle::from(font.clone()).pos(Pos::new(HPos::Left, VPos::Center)),
        ))?;
    }
    Ok(())
}

/// `(rows, cols)` of a grid of `n` panels, at most `max_cols` wide.
fn grid(n: usize, max_cols: usize) -> (usize, usize) {
    let cols = n.clamp(1, max_cols);
    (n.div_ceil(cols).max(1), cols)
}

/// A PPL point: `(x, mean Δ%, 95% t-interval)`.
pub(crate) type PplPoint = (f64, f64, Option<(f64, f64)>);

/// One policy × quantizer of a PPL panel: points `(x, mean Δ%, t-interval)`; `line` joins them
/// (a budgeted policy over b), otherwise one marker at its real budget (uniform tiers).
pub(crate) struct PplSeries {
    pub(crate) policy: String,
    pub(crate) quantizer: String,
    pub(crate) points: Vec<PplPoint>,
    pub(crate) line: bool,
}

/// One model's PPL panel.
pub(crate) struct PplPanel {
    pub(crate) title: String,
    pub(crate) series: Vec<PplSeries>,
}

pub(crate) struct PplFigure {
    pub(crate) panels: Vec<PplPanel>,
}

impl PplFigure {
    fn legend(&self) -> Vec<LegendEntry> {
        let mut out: Vec<LegendEntry> = Vec::new();
        for s in self.panels.iter().flat_map(|p| &p.series) {
            let label = format!("{} {}", s.policy, s.quantizer);
            if !out.iter().any(|e| e.label == label) {
                let (dashed, marker) = quantizer_style(&s.quantizer);
                out.push(LegendEntry {
                    label,
                    color: policy_color(&s.policy),
                    key: if s.line {
                        Key::Line(dashed, marker)
                    } else {
                        Key::Marker(marker)
                    },
                });
            }
        }
        out
    }
}

/// y range of a PPL panel: every point and interval, but intervals reach at most 1.5 point
/// spans past the points (a 2-window t-interval can be ±20 points and would flatten the
/// lines); `true` when an interval was cut.
fn ppl_y_range(series: &[PplSeries]) -> ((f64, f64), bool) {
    let pts = series.iter().flat_map(|s| &s.points);
    let (pmin, pmax) = pts
        .clone()
        .map(|p| p.1)
        .fold((0.0_f64, 0.0_f64), |(a, b), y| (a.min(y), b.max(y)));
    let span = (pmax - pmin).max(1.0);
    let (lo_cap, hi_cap) = (pmin - 1.5 * span, pmax + 1.5 * span);
    let (cmin, cmax) = pts
        .filter_map(|p| p.2)
        .fold((pmin, pmax), |(a, b), (lo, hi)| (a.min(lo), b.max(hi)));
    let (lo, hi) = (cmin.max(lo_cap), cmax.min(hi_cap));
    let pad = 0.06 * (hi - lo);
    ((lo - pad, hi + pad), cmin < lo_cap || cmax > hi_cap)
}

impl Figure for PplFigure {
    fn size(&self) -> (u32, u32) {
        let (rows, cols) = grid(self.panels.len(), 3);
        (640 * cols as u32 + LEGEND_W, 500 * rows as u32)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let (w, _) = self.size();
        let (main, legend) = root.split_horizontally(w - LEGEND_W);
        draw_legend(&legend, "policy  quantizer", &self.legend())?;
        let panels = main.split_evenly(grid(self.panels.len(), 3));
        for (area, panel) in panels.iter().zip(&self.panels) {
            let xs = panel.series.iter().flat_map(|s| &s.points).map(|p| p.0);
            let (xmin, xmax) = xs.fold((1.0_f64, 0.0_f64), |(a, b), x| (a.min(x), b.max(x)));
            let (xlo, xhi) = ((xmin - 0.05).min(0.25), (xmax + 0.05).max(1.05));
            let ((ylo, yhi), cut) = ppl_y_range(&panel.series);
            let caption = if cut {
                format!("{} (intervals cut at the edge)", panel.title)
            } else {
                panel.title.clone()
            };
            let mut chart = ChartBuilder::on(area)
                .caption(caption, ("sans-serif", 16))
                .margin(12)
                .x_label_area_size(45)
                .y_label_area_size(60)
                .build_cartesian_2d(xlo..xhi, ylo..yhi)?;
            chart
                .configure_mesh()
                .bold_line_style(BLACK.mix(0.12))
                .light_line_style(TRANSPARENT)
                .x_desc("budget b (uniform tiers: at their real budget)")
                .y_desc("PPL Δ% vs uncompressed (mean, 95% t)")
                .x_label_formatter(&|x| format!("{x:.1}"))
                .y_label_formatter(&|y| format!("{y:+.1}"))
                .label_style(("sans-serif", 12))
                .draw()?;
            chart.draw_series(LineSeries::new(
                [(xlo, 0.0), (xhi, 0.0)],
                BLACK.mix(0.5).stroke_width(1),
            ))?;
            let n = panel.series.len();
            for (k, s) in panel.series.iter().enumerate() {
                // Series side by side at one b so that their intervals stay apart.
                let dx = (k as f64 - (n as f64 - 1.0) / 2.0) * 0.005;
                let color = policy_color(&s.policy);
                let (dashed, marker) = quantizer_style(&s.quantizer);
                let pts: Vec<(f64, f64)> = s.points.iter().map(|p| (p.0 + dx, p.1)).collect();
                if s.line {
                    let style = color.stroke_width(2);
                    if dashed {
                        chart.draw_series(DashedLineSeries::new(pts.clone(), 8, 5, style))?;
                    } else {
                        chart.draw_series(LineSeries::new(pts.clone(), style))?;
                    }
                }
                // An interval cut at the panel's edge has no cap there.
                let inside =
                    |&&(_, _, ci): &&PplPoint| ci.is_some_and(|(lo, hi)| lo >= ylo && hi <= yhi);
                chart.draw_series(s.points.iter().filter(inside).filter_map(|&(x, y, ci)| {
                    let (lo, hi) = ci?;
                    Some(ErrorBar::new_vertical(
                        x + dx,
                        lo,
                        y,
                        hi,
                        color.stroke_width(1),
                        6,
                    ))
                }))?;
                chart.draw_series(
                    s.points
                        .iter()
                        .filter(|p| p.2.is_some() && !inside(p))
                        .filter_map(|&(x, _, ci)| {
                            let (lo, hi) = ci?;
                            Some(PathElement::new(
                                [(x + dx, lo.max(ylo)), (x + dx, hi.min(yhi))],
                                color.stroke_width(1),
                            ))
                        }),
                )?;
                match marker {
                    Marker::Circle => {
                        chart.draw_series(pts.iter().map(|&c| Circle::new(c, 4, color.filled())))?
                    }
                    Marker::Triangle => chart.draw_series(
                        pts.iter()
                            .map(|&c| TriangleMarker::new(c, 5, color.filled())),
                    )?,
                    Marker::Square => chart.draw_series(pts.iter().map(|&c| {
                        EmptyElement::at(c) + Rectangle::new([(-4, -4), (4, 4)], color.filled())
                    }))?,
                };
            }
        }
        Ok(())
    }
}

/// A NIAH row: its label and per depth `(correct, trials)`.
pub(crate) type NiahRowCells = (String, Vec<Option<(u64, u64)>>);

/// One model's NIAH heatmap: rows are variants (top first), columns depths; a cell holds
/// `(correct, trials)` over the seeds, `None` where the grid has no trial.
pub(crate) struct NiahPanel {
    pub(crate) title: String,
    pub(crate) depths: Vec<f64>,
    pub(crate) rows: Vec<NiahRowCells>,
}

pub(crate) struct NiahFigure {
    pub(crate) panels: Vec<NiahPanel>,
}

/// Red (0) → yellow (0.5) → green (1), the ColorBrewer RdYlGn end and middle colours.
fn accuracy_color(a: f64) -> RGBColor {
    let stops = [(0xd7, 0x30, 0x27), (0xfe, 0xe0, 0x8b), (0x1a, 0x98, 0x50)];
    let a = a.clamp(0.0, 1.0) * 2.0;
    let (i, t) = if a >= 1.0 { (1, a - 1.0) } else { (0, a) };
    let mix = |p: u8, q: u8| (f64::from(p) + t * (f64::from(q) - f64::from(p))).round() as u8;
    let (p, q) = (stops[i], stops[i + 1]);
    RGBColor(mix(p.0, q.0), mix(p.1, q.1), mix(p.2, q.2))
}

impl NiahFigure {
    fn panel_height(&self) -> u32 {
        let rows = self.panels.iter().map(|p| p.rows.len()).max().unwrap_or(1);
        110 + 30 * rows as u32
    }
}

impl Figure for NiahFigure {
    fn size(&self) -> (u32, u32) {
        let cols = self
            .panels
            .iter()
            .map(|p| p.depths.len())
            .max()
            .unwrap_or(1);
        (
            (260 + 72 * cols as u32).max(700),
            self.panel_height() * self.panels.len().max(1) as u32,
        )
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let panels = root.split_evenly((self.panels.len().max(1), 1));
        for (area, panel) in panels.iter().zip(&self.panels) {
            let xaxis = CategoryAxis {
                labels: panel.depths.iter().map(|d| format!("{d:.2}")).collect(),
            };
            // Row 0 at the top: the y axis counts from the bottom.
            let n = panel.rows.len();
            let yaxis = CategoryAxis {
                labels: panel.rows.iter().rev().map(|r| short(&r.0, 30)).collect(),
            };
            let mut chart = ChartBuilder::on(area)
                .caption(&panel.title, ("sans-serif", 16))
                .margin(10)
                .x_label_area_size(40)
                .y_label_area_size(210)
                .build_cartesian_2d(xaxis.clone(), yaxis.clone())?;
            chart
                .configure_mesh()
                .disable_mesh()
                .x_label_formatter(&|x| xaxis.format_ext(x))
                .y_label_formatter(&|y| yaxis.format_ext(y))
                .x_desc("needle depth")
                .label_style(("sans-serif", 12))
                .draw()?;
            for (i, (_, cells)) in panel.rows.iter().enumerate() {
                let y = (n - 1 - i) as f64;
                for (j, cell) in cells.iter().enumerate() {
                    let x = j as f64;
                    let (fill, text) = match *cell {
                        Some((k, t)) if t > 0 => {
                            (accuracy_color(k as f64 / t as f64), format!("{k}/{t}"))
                        }
                        _ => (RGBColor(0xee, 0xee, 0xee), "–".to_string()),
                    };
                    chart.draw_series([Rectangle::new(
                        [(x - 0.48, y - 0.46), (x + 0.48, y + 0.46)],
                        fill.filled(),
                    )])?;
                    let lum = 0.299 * f64::from(fill.0)
                        + 0.587 * f64::from(fill.1)
                        + 0.114 * f64::from(fill.2);
                    let ink = if lum < 110.0 { WHITE } else { BLACK };
                    chart.draw_series([Text::new(
                        text,
                        (x, y),
                        ("sans-serif", 12)
                            .into_font()
                            .color(&ink)
                            .pos(Pos::new(HPos::Center, VPos::Center)),
                    )])?;
                }
            }
        }
        Ok(())
    }
}

/// TTFT stages of a bar, in stacking order.
pub const TTFT_STAGES: [&str; 7] = [
    "prefill",
    "scoring",
    "quantize/pack",
    "send ∥ receive (overlap)",
    "unpack/dequantize",
    "first decode step",
    "other (KV hash, reply)",
];

/// One transfer's bar: stage medians (ms, [`TTFT_STAGES`] order), the median TTFT and the
/// cut vs FP16 in % (positive: faster).
pub(crate) struct TtftBar {
    pub(crate) label: String,
    pub(crate) stages: [f64; 7],
    pub(crate) total: f64,
    pub(crate) cut: Option<f64>,
}

/// One model × context × link of the TTFT figure.
pub(crate) struct TtftPanel {
    pub(crate) title: String,
    pub(crate) y_desc: String,
    pub(crate) bars: Vec<TtftBar>,
}

pub(crate) struct TtftFigure {
    pub(crate) panels: Vec<TtftPanel>,
}

fn stage_color(i: usize) -> RGBColor {
    if i == 6 {
        RGBColor(0xc7, 0xc7, 0xc7)
    } else {
        PALETTE[i]
    }
}

impl Figure for TtftFigure {
    fn size(&self) -> (u32, u32) {
        let (rows, cols) = grid(self.panels.len(), 4);
        let bars = self.panels.iter().map(|p| p.bars.len()).max().unwrap_or(1);
        (
            (250 + 130 * bars as u32).max(440) * cols as u32 + LEGEND_W,
            520 * rows as u32,
        )
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let (w, _) = self.size();
        let (main, legend) = root.split_horizontally(w - LEGEND_W);
        let entries: Vec<LegendEntry> = TTFT_STAGES
            .iter()
            .enumerate()
            .rev()
            .map(|(i, s)| LegendEntry {
                label: s.to_string(),
                color: stage_color(i),
                key: Key::Swatch,
            })
            .collect();
        draw_legend(&legend, "stage (top to bottom)", &entries)?;
        let panels = main.split_evenly(grid(self.panels.len(), 4));
        for (area, panel) in panels.iter().zip(&self.panels) {
            let axis = CategoryAxis {
                labels: panel.bars.iter().map(|b| short(&b.label, 24)).collect(),
            };
            let top = panel
                .bars
                .iter()
                .map(|b| b.total.max(b.stages.iter().sum()))
                .fold(1.0_f64, f64::max)
                * 1.18;
            let mut chart = ChartBuilder::on(area)
                .caption(&panel.title, ("sans-serif", 15))
                .margin(12)
                .x_label_area_size(40)
                .y_label_area_size(65)
                .build_cartesian_2d(axis.clone(), 0.0..top)?;
            chart
                .configure_mesh()
                .disable_x_mesh()
                .bold_line_style(BLACK.mix(0.12))
                .light_line_style(TRANSPARENT)
                .x_label_formatter(&|x| axis.format_ext(x))
                .y_desc(&panel.y_desc)
                .y_label_formatter(&|y| format!("{y:.0}"))
                .label_style(("sans-serif", 12))
                .draw()?;
            for (i, bar) in panel.bars.iter().enumerate() {
                let x = i as f64;
                let mut base = 0.0;
                for (s, &v) in bar.stages.iter().enumerate() {
                    if v <= 0.0 {
                        continue;
                    }
                    chart.draw_series([Rectangle::new(
                        [(x - 0.32, base), (x + 0.32, base + v)],
                        stage_color(s).filled(),
                    )])?;
                    base += v;
                }
                let label = match bar.cut {
                    Some(c) => format!("{:.0} ms ({:+.1}% vs fp16)", bar.total, -c),
                    None => format!("{:.0} ms", bar.total),
                };
                chart.draw_series([Text::new(
                    label,
                    (x, base.max(bar.total)),
                    TextStyle::from(("sans-serif", 12).into_font())
                        .pos(Pos::new(HPos::Center, VPos::Bottom)),
                )])?;
            }
        }
        Ok(())
    }
}
