//! The figures of `kvcredit divergence analyze`: greedy divergence-rate bars, the τ ECDF, drift
//! per layer, accuracy ON/OFF with churn, log10 max|Δlogit| by dtype, flip rate vs position, the
//! patch-recovery heatmap over layer ranges, transplant donor-following bars and divergence vs
//! prefill chunk size. Each is drawn from the run-dir tables as [`super::analysis`] reads them,
//! as PNG + SVG through [`render`]; a figure whose table is absent (or holds nothing it could
//! draw) is skipped.
use super::analysis::{Cells, Drift, Forced, PatchRow, ReplayRow, Tables};
use crate::report::figure::{
    CategoryAxis, DrawResult, Figure, PALETTE, draw_legend, render, short,
};
use crate::stats::wilson;
use crate::{Error, Result};
use plotters::coord::Shift;
use plotters::coord::ranged1d::ValueFormatter;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Greedy divergence rate per model × dtype: (label, rate %, lo %, hi %).
struct RateFigure {
    bars: Vec<(String, f64, f64, f64)>,
}

impl Figure for RateFigure {
    fn size(&self) -> (u32, u32) {
        ((300 + 160 * self.bars.len() as u32).min(2400), 480)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let axis = CategoryAxis {
            labels: self.bars.iter().map(|b| short(&b.0, 28)).collect(),
        };
        let mut chart = ChartBuilder::on(root)
            .caption(
                "Greedy cache-ON vs cache-OFF divergence",
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(axis.clone(), 0.0..105.0)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_label_formatter(&|x| axis.format_ext(x))
            .y_desc("pairs diverged (%, 95% Wilson)")
            .label_style(("sans-serif", 12))
            .draw()?;
        chart.draw_series(self.bars.iter().enumerate().map(|(i, b)| {
            let x = i as f64;
            Rectangle::new([(x - 0.3, 0.0), (x + 0.3, b.1)], PALETTE[i % 10].filled())
        }))?;
        chart.draw_series(self.bars.iter().enumerate().map(|(i, b)| {
            ErrorBar::new_vertical(i as f64, b.2, b.1, b.3, BLACK.stroke_width(1), 8)
        }))?;
        Ok(())
    }
}

/// Named curves over x (ECDF of τ, or drift per layer).
struct LineFigure {
    title: String,
    x_desc: String,
    y_desc: String,
    log_y: bool,
    lines: Vec<(String, Vec<(f64, f64)>)>,
}

impl Figure for LineFigure {
    fn size(&self) -> (u32, u32) {
        (900, 520)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let pts = self.lines.iter().flat_map(|l| &l.1);
        let xmax = pts.clone().map(|p| p.0).fold(1.0_f64, f64::max);
        let ys = pts
            .map(|p| p.1)
            .filter(|y| y.is_finite() && (!self.log_y || *y > 0.0));
        let (ymin, ymax) = ys.fold((f64::INFINITY, 0.0_f64), |(a, b), y| (a.min(y), b.max(y)));
        let mut builder = ChartBuilder::on(root);
        builder
            .caption(&self.title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70);
        let style = |i: usize| PALETTE[i % 10].stroke_width(2);
        if self.log_y {
            let lo = if ymin.is_finite() { ymin / 2.0 } else { 1e-8 };
            let hi = (ymax * 2.0).max(lo * 10.0);
            let mut chart = builder.build_cartesian_2d(0.0..xmax, (lo..hi).log_scale())?;
            chart
                .configure_mesh()
                .x_desc(&self.x_desc)
                .y_desc(&self.y_desc)
                .label_style(("sans-serif", 12))
                .draw()?;
            for (i, (name, l)) in self.lines.iter().enumerate() {
                let l: Vec<(f64, f64)> = l.iter().copied().filter(|p| p.1 > 0.0).collect();
                chart
                    .draw_series(LineSeries::new(l, style(i)))?
                    .label(name.clone())
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], style(i)));
            }
            draw_legend(&mut chart, SeriesLabelPosition::MiddleRight)?;
        } else {
            let mut chart = builder.build_cartesian_2d(0.0..xmax, 0.0..1.02)?;
            chart
                .configure_mesh()
                .x_desc(&self.x_desc)
                .y_desc(&self.y_desc)
                .label_style(("sans-serif", 12))
                .draw()?;
            for (i, (name, l)) in self.lines.iter().enumerate() {
                chart
                    .draw_series(LineSeries::new(l.iter().copied(), style(i)))?
                    .label(name.clone())
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], style(i)));
            }
            draw_legend(&mut chart, SeriesLabelPosition::LowerRight)?;
        }
        Ok(())
    }
}

/// Stems of the divergence figures.
pub const RATE_STEM: &str = "divergence-rate";
/// See [`RATE_STEM`].
pub const TAU_STEM: &str = "tau-ecdf";
/// See [`RATE_STEM`] (written only with a `drift.parquet`).
pub const DRIFT_STEM: &str = "drift";

/// Accuracy ON/OFF with churn (`.png`/`.svg`).
pub const ACCURACY_STEM: &str = "accuracy-churn";
/// log10 max|Δlogit| per teacher-forced step, by dtype.
pub const LOGIT_STEM: &str = "logit-delta";
/// Teacher-forced flip rate vs generated-token position.
pub const FLIP_STEM: &str = "flip-position";
/// Patch recovery over layer ranges.
pub const PATCH_STEM: &str = "patch-recovery";
/// Transplant donor-following.
pub const TRANSPLANT_STEM: &str = "transplant-donor";
/// REPLAY's divergence from LIVE vs prefill chunk size.
pub const CHUNK_STEM: &str = "chunk-divergence";

/// Stems of the figures of [`write_all`].
const STEMS: [&str; 6] = [
    ACCURACY_STEM,
    LOGIT_STEM,
    FLIP_STEM,
    PATCH_STEM,
    TRANSPLANT_STEM,
    CHUNK_STEM,
];

/// A rate and its Wilson interval, in percent.
type Pt = (f64, f64, f64);
/// (model, dtype).
type Md<'a> = (&'a str, &'a str);
/// Successes and rows.
type Count = (u64, u64);
/// Patch rows of one model × dtype by (layer start, layer end, label).
type PatchSets<'a> = BTreeMap<(i64, i64, &'a str), Vec<&'a PatchRow>>;

fn pct(k: u64, n: u64, level: f64) -> Result<Option<Pt>> {
    if n == 0 {
        return Ok(None);
    }
    let (lo, hi) = wilson(k, n, level)?.unwrap_or((0.0, 1.0));
    Ok(Some((100.0 * k as f64 / n as f64, 100.0 * lo, 100.0 * hi)))
}

/// Fixed colours for the dtypes (others from the palette).
fn dtype_color(d: &str, i: usize) -> RGBColor {
    match d {
        "fp32" => PALETTE[2],
        "fp16" => PALETTE[0],
        "bf16" => PALETTE[1],
        _ => PALETTE[(i + 3) % PALETTE.len()],
    }
}

fn model_dtype(m: &str, d: &str) -> String {
    format!("{} {d}", short(m, 24))
}

/// Draw every figure its tables allow into `out` and remove those left from an earlier
/// analysis that are not drawn this time; returns (stem, what it shows) of each written.
pub(super) fn write(t: &Tables, out: &Path, level: f64) -> Result<Vec<(&'static str, String)>> {
    let mut figures = summary_figures(&t.cells, &t.drift, out, level)?;
    figures.extend(write_all(t, out, level)?);
    for stem in [RATE_STEM, TAU_STEM, DRIFT_STEM]
        .into_iter()
        .chain(STEMS)
        .filter(|s| figures.iter().all(|f| f.0 != *s))
    {
        for ext in ["png", "svg"] {
            let p = out.join(format!("{stem}.{ext}"));
            if p.exists() {
                std::fs::remove_file(&p).map_err(|e| Error::io(&p, e))?;
            }
        }
    }
    Ok(figures)
}

/// Divergence-rate bars and τ ECDFs (greedy pairs), and drift per layer when present; returns
/// each figure's stem and a line saying what it shows.
fn summary_figures(
    cells: &Cells,
    drift: &Drift,
    out: &Path,
    level: f64,
) -> Result<Vec<(&'static str, String)>> {
    let mut bars = vec![];
    let mut ecdfs = vec![];
    for ((m, _, d), c) in cells.iter().filter(|(k, _)| k.1 == "greedy") {
        let (lo, hi) = wilson(c.diverged, c.n, level)?.unwrap_or((0.0, 0.0));
        let rate = if c.n == 0 {
            0.0
        } else {
            c.diverged as f64 / c.n as f64
        };
        bars.push((
            format!("{} {d}", short(m, 20)),
            100.0 * rate,
            100.0 * lo,
            100.0 * hi,
        ));
        let mut t = c.taus.clone();
        t.sort_unstable();
        let n = t.len() as f64;
        let pts: Vec<(f64, f64)> = t
            .iter()
            .enumerate()
            .flat_map(|(i, &x)| [(x as f64, i as f64 / n), (x as f64, (i + 1) as f64 / n)])
            .collect();
        ecdfs.push((format!("{m} {d} (n={})", t.len()), pts));
    }
    let pct = 100.0 * level;
    render(&RateFigure { bars }, &out.join(RATE_STEM))?;
    let mut figures = vec![(
        RATE_STEM,
        format!(
            "greedy cache-ON vs cache-OFF divergence rate per model × dtype, {pct:.0}% Wilson intervals."
        ),
    )];
    render(
        &LineFigure {
            title: "τ (first divergence step), greedy: ECDF".into(),
            x_desc: "τ".into(),
            y_desc: "share of diverged pairs".into(),
            log_y: false,
            lines: ecdfs,
        },
        &out.join(TAU_STEM),
    )?;
    figures.push((
        TAU_STEM,
        "ECDF of the first divergence step τ over the diverged greedy pairs, per model × dtype."
            .into(),
    ));
    if !drift.is_empty() {
        let lines = drift
            .iter()
            .map(|((m, d), v)| {
                let pts = v.iter().enumerate().map(|(l, &y)| (l as f64, y)).collect();
                (format!("{m} {d}"), pts)
            })
            .collect();
        render(
            &LineFigure {
                title: "Residual drift per layer (teacher-forced, mean over steps)".into(),
                x_desc: "layer".into(),
                y_desc: "‖h_ON − h_OFF‖ / ‖h_OFF‖".into(),
                log_y: true,
                lines,
            },
            &out.join(DRIFT_STEM),
        )?;
        figures.push((
            DRIFT_STEM,
            "mean relative residual-stream drift ‖h_ON − h_OFF‖ / ‖h_OFF‖ per layer (log scale), per model × dtype.".into(),
        ));
    }
    Ok(figures)
}

/// Draw every figure past the summary ones whose table is present; returns (stem, what it
/// shows) of each written.
fn write_all(t: &Tables, out: &Path, level: f64) -> Result<Vec<(&'static str, String)>> {
    let ci = format!("{:.0}%", 100.0 * level);
    let mut done = vec![];
    if let Some(f) = accuracy(&t.cells, level)? {
        render(&f, &out.join(ACCURACY_STEM))?;
        done.push((
            ACCURACY_STEM,
            format!("accuracy cache-ON vs cache-OFF per model × strategy × dtype ({ci} Wilson), and churn: the problems correct under one path only (ON-only + OFF-only), with the McNemar p."),
        ));
    }
    if let Some(f) = logit_delta(&t.forced) {
        render(&f, &out.join(LOGIT_STEM))?;
        done.push((
            LOGIT_STEM,
            "log10 of max |Δlogit| per teacher-forced step, box per model × dtype (quartiles, median, whiskers at the 2.5 and 97.5 percentiles; exact zeros counted, not drawn).".into(),
        ));
    }
    if let Some(f) = flip_position(&t.forced, level)? {
        render(&f, &out.join(FLIP_STEM))?;
        done.push((
            FLIP_STEM,
            format!("teacher-forced argmax flip rate vs generated-token position (binned), per model × dtype, {ci} Wilson over the steps of a bin."),
        ));
    }
    if let Some(f) = patch_recovery(&t.patches) {
        render(&f, &out.join(PATCH_STEM))?;
        done.push((
            PATCH_STEM,
            "residual-stream patching at τ: share of reproduced problems whose next token (immediate) or whole continuation (trajectory) follows cache-OFF, per patched layer set drawn over the layers it spans, one panel per model × dtype with a reproduced problem (others omitted).".into(),
        ));
    }
    if let Some(f) = transplant(&t.replays, level)? {
        render(&f, &out.join(TRANSPLANT_STEM))?;
        done.push((
            TRANSPLANT_STEM,
            format!("KV transplants LIVE ← REPLAY and REPLAY ← LIVE: share of boundaries whose continuation equals the donor's own, per buffers (K+V, K, V) and layer range, {ci} Wilson."),
        ));
    }
    if let Some(f) = chunk_divergence(&t.replays, level)? {
        render(&f, &out.join(CHUNK_STEM))?;
        done.push((
            CHUNK_STEM,
            format!("share of boundaries whose REPLAY continuation (prefix re-prefilled in chunks of the given size; one shot = whole prefix) differs from LIVE's, per model × dtype, {ci} Wilson."),
        ));
    }
    Ok(done)
}

// ---------- horizontal bars (categories top to bottom) ----------

struct HSeries {
    name: String,
    color: RGBColor,
    values: Vec<Option<Pt>>,
}

struct HPanel {
    title: String,
    x_desc: String,
    series: Vec<HSeries>,
    /// Series end to end (no intervals) instead of side by side.
    stacked: bool,
    /// Text right of each category's bars.
    notes: Vec<String>,
    xmax: f64,
    /// x tick labels above this are left blank (room kept for the legend).
    tick_cap: f64,
    /// Legend: none, upper right, lower right.
    legend: Legend,
}

#[derive(Clone, Copy, PartialEq)]
enum Legend {
    None,
    Upper,
    Lower,
}

struct HBarFigure {
    categories: Vec<String>,
    panels: Vec<HPanel>,
    /// Plot width of each panel; the first panel also holds the category labels.
    widths: Vec<u32>,
    label_area: u32,
}

impl Figure for HBarFigure {
    fn size(&self) -> (u32, u32) {
        let per = self
            .panels
            .iter()
            .map(|p| if p.stacked { 1 } else { p.series.len() })
            .max()
            .unwrap_or(1) as u32;
        let row = (6 + 11 * per).max(24);
        let h = 120 + self.categories.len() as u32 * row;
        (
            self.label_area + self.widths.iter().sum::<u32>(),
            h.clamp(320, 3000),
        )
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let mut rest = root.clone();
        for (k, (p, &w)) in self.panels.iter().zip(&self.widths).enumerate() {
            let labels = if k == 0 { self.label_area } else { 10 };
            let (area, r) = rest.split_horizontally(w + labels);
            rest = r;
            draw_hpanel(&area, &self.categories, p, labels)?;
        }
        Ok(())
    }
}

fn draw_hpanel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    cats: &[String],
    p: &HPanel,
    label_area: u32,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let n = cats.len();
    let axis = CategoryAxis {
        labels: cats.iter().rev().cloned().collect(),
    };
    let show = label_area > 20;
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(44)
        .y_label_area_size(label_area)
        .build_cartesian_2d(0.0..p.xmax, axis.clone())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .bold_line_style(BLACK.mix(0.12))
        .light_line_style(TRANSPARENT)
        .y_label_formatter(&|y| {
            if show {
                axis.format_ext(y)
            } else {
                String::new()
            }
        })
        .x_label_formatter(&|x| {
            if *x <= p.tick_cap + 1e-9 {
                format!("{x:.0}")
            } else {
                String::new()
            }
        })
        .x_desc(&p.x_desc)
        .label_style(("sans-serif", 12))
        .draw()?;
    // Category i sits at n − 1 − i: the first on top.
    let pos = |i: usize| (n - 1 - i) as f64;
    let m = if p.stacked { 1 } else { p.series.len().max(1) };
    let thick = 0.8 / m as f64;
    let half = thick * 0.42;
    let mut ends = vec![0.0_f64; n];
    for (j, s) in p.series.iter().enumerate() {
        let color = s.color;
        let off = if p.stacked {
            0.0
        } else {
            ((m - 1) as f64 / 2.0 - j as f64) * thick
        };
        let bars: Vec<(f64, f64, Pt)> = s
            .values
            .iter()
            .enumerate()
            .filter_map(|(i, v)| {
                let v = (*v)?;
                Some((pos(i) + off, if p.stacked { ends[i] } else { 0.0 }, v))
            })
            .collect();
        chart
            .draw_series(bars.iter().map(|&(y, x0, (v, _, _))| {
                Rectangle::new([(x0, y - half), (x0 + v, y + half)], color.filled())
            }))?
            .label(s.name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        if !p.stacked {
            chart.draw_series(bars.iter().map(|&(y, _, (v, lo, hi))| {
                ErrorBar::new_horizontal(y, lo, v, hi, BLACK.stroke_width(1), 5)
            }))?;
        }
        for (i, v) in s.values.iter().enumerate() {
            if let Some((v, _, hi)) = v {
                ends[i] = if p.stacked {
                    ends[i] + v
                } else {
                    ends[i].max(*hi)
                };
            }
        }
    }
    let font = ("sans-serif", 11)
        .into_font()
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    chart.draw_series(
        p.notes
            .iter()
            .enumerate()
            .map(|(i, t)| Text::new(t.clone(), (ends[i] + p.xmax * 0.01, pos(i)), font.clone())),
    )?;
    if p.legend != Legend::None {
        draw_legend(
            &mut chart,
            if p.legend == Legend::Upper {
                SeriesLabelPosition::UpperRight
            } else {
                SeriesLabelPosition::LowerRight
            },
        )?;
    }
    Ok(())
}

/// Room on the right of the longest bar for the notes and the legend.
fn xmax_of(series: &[HSeries], stacked: bool, room: f64, floor: f64) -> f64 {
    let n = series.iter().map(|s| s.values.len()).max().unwrap_or(0);
    let top = (0..n)
        .map(|i| {
            let vals = series
                .iter()
                .filter_map(|s| s.values.get(i).copied().flatten());
            if stacked {
                vals.map(|v| v.0).sum::<f64>()
            } else {
                vals.map(|v| v.2).fold(0.0, f64::max)
            }
        })
        .fold(floor, f64::max);
    (top * room).min(100.0 * room)
}

fn accuracy(cells: &Cells, level: f64) -> Result<Option<HBarFigure>> {
    if cells.is_empty() {
        return Ok(None);
    }
    let mut cats = vec![];
    let (mut on, mut off, mut on_only, mut off_only, mut notes) =
        (vec![], vec![], vec![], vec![], vec![]);
    for ((m, s, d), c) in cells {
        cats.push(format!("{} · {s} · {d}", short(m, 24)));
        on.push(pct(c.correct_on, c.n, level)?);
        off.push(pct(c.correct_off, c.n, level)?);
        on_only.push(pct(c.on_only, c.n, level)?);
        off_only.push(pct(c.off_only, c.n, level)?);
        notes.push(format!(
            "{}+{} of {}, p = {:.2}",
            c.on_only,
            c.off_only,
            c.n,
            crate::stats::mcnemar_exact(c.on_only, c.off_only)
        ));
    }
    let acc = vec![
        HSeries {
            name: "cache-ON".into(),
            color: PALETTE[0],
            values: on,
        },
        HSeries {
            name: "cache-OFF".into(),
            color: PALETTE[1],
            values: off,
        },
    ];
    let churn = vec![
        HSeries {
            name: "correct ON only".into(),
            color: PALETTE[0],
            values: on_only,
        },
        HSeries {
            name: "correct OFF only".into(),
            color: PALETTE[1],
            values: off_only,
        },
    ];
    let (xa, xc) = (
        xmax_of(&acc, false, 1.35, 5.0),
        xmax_of(&churn, true, 2.2, 2.0),
    );
    Ok(Some(HBarFigure {
        categories: cats,
        panels: vec![
            HPanel {
                title: "Accuracy, cache-ON vs cache-OFF".into(),
                x_desc: format!("problems correct (%, {:.0}% Wilson)", 100.0 * level),
                series: acc,
                stacked: false,
                notes: vec![],
                xmax: xa,
                tick_cap: f64::INFINITY,
                legend: Legend::Upper,
            },
            HPanel {
                title: "Churn: correct under one path only".into(),
                x_desc: "problems (%); note: ON-only + OFF-only of n, McNemar p".into(),
                series: churn,
                stacked: true,
                notes,
                xmax: xc,
                tick_cap: f64::INFINITY,
                legend: Legend::Upper,
            },
        ],
        widths: vec![560, 520],
        label_area: 330,
    }))
}

// ---------- log10 max|Δlogit| boxes ----------

struct BoxStats {
    model: usize,
    dtype: usize,
    /// 2.5%, 25%, 50%, 75%, 97.5% of log10 max|Δlogit| over the non-zero steps.
    q: [f64; 5],
    n: usize,
    zeros: usize,
}

struct LogitFigure {
    models: Vec<String>,
    dtypes: Vec<String>,
    boxes: Vec<BoxStats>,
}

fn quantile_f(sorted: &[f64], q: f64) -> f64 {
    let h = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (h.floor() as usize, h.ceil() as usize);
    sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo])
}

fn logit_delta(forced: &Forced) -> Option<LogitFigure> {
    let models: Vec<String> = forced
        .keys()
        .map(|k| k.0.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    // fp32, fp16, bf16 first, in that order; then any other.
    let rank = |d: &str| {
        ["fp32", "fp16", "bf16"]
            .iter()
            .position(|x| *x == d)
            .unwrap_or(3)
    };
    let mut dtypes: Vec<String> = forced
        .keys()
        .map(|k| k.1.clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    dtypes.sort_by_key(|d| (rank(d), d.clone()));
    let mut boxes = vec![];
    for ((m, d), c) in forced {
        let mut v: Vec<f64> = c
            .rows
            .iter()
            .map(|r| r.1[0])
            .filter(|x| x.is_finite() && *x > 0.0)
            .map(f64::log10)
            .collect();
        let zeros = c.rows.iter().filter(|r| r.1[0] == 0.0).count();
        if v.is_empty() {
            continue;
        }
        v.sort_by(f64::total_cmp);
        boxes.push(BoxStats {
            model: models.iter().position(|x| x == m)?,
            dtype: dtypes.iter().position(|x| x == d)?,
            q: [0.025, 0.25, 0.5, 0.75, 0.975].map(|q| quantile_f(&v, q)),
            n: v.len(),
            zeros,
        });
    }
    (!boxes.is_empty()).then_some(LogitFigure {
        models,
        dtypes,
        boxes,
    })
}

impl Figure for LogitFigure {
    fn size(&self) -> (u32, u32) {
        let w = 260 + self.models.len() as u32 * (90 + 70 * self.dtypes.len() as u32);
        (w.clamp(700, 2400), 560)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let lo = self
            .boxes
            .iter()
            .map(|b| b.q[0])
            .fold(f64::INFINITY, f64::min);
        let hi = self
            .boxes
            .iter()
            .map(|b| b.q[4])
            .fold(f64::NEG_INFINITY, f64::max);
        let (lo, hi) = ((lo - 0.3).floor(), (hi + 0.6).ceil());
        let axis = CategoryAxis {
            labels: self.models.iter().map(|m| short(m, 30)).collect(),
        };
        let mut chart = ChartBuilder::on(root)
            .caption(
                "Teacher-forced max |Δlogit| per step, cache-ON vs cache-OFF, by dtype",
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(axis.clone(), lo..hi)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .bold_line_style(BLACK.mix(0.12))
            .light_line_style(TRANSPARENT)
            .x_label_formatter(&|x| axis.format_ext(x))
            .y_labels((hi - lo) as usize + 1)
            .y_label_formatter(&|y| format!("{y:.0}"))
            .y_desc("log10 max |Δlogit| (box: quartiles; whiskers: 2.5–97.5%)")
            .label_style(("sans-serif", 13))
            .draw()?;
        let nd = self.dtypes.len() as f64;
        let w = 0.8 / nd;
        let note = ("sans-serif", 11)
            .into_font()
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        for (di, d) in self.dtypes.iter().enumerate() {
            let color = dtype_color(d, di);
            let mine: Vec<&BoxStats> = self.boxes.iter().filter(|b| b.dtype == di).collect();
            let x = |b: &BoxStats| b.model as f64 + (b.dtype as f64 - (nd - 1.0) / 2.0) * w;
            let hw = w * 0.38;
            chart
                .draw_series(mine.iter().map(|b| {
                    let x = x(b);
                    Rectangle::new(
                        [(x - hw, b.q[1]), (x + hw, b.q[3])],
                        color.mix(0.45).filled(),
                    )
                }))?
                .label(d.clone())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                });
            for b in &mine {
                let x = x(b);
                let st = color.stroke_width(2);
                chart.draw_series([
                    PathElement::new(
                        vec![
                            (x - hw, b.q[1]),
                            (x + hw, b.q[1]),
                            (x + hw, b.q[3]),
                            (x - hw, b.q[3]),
                            (x - hw, b.q[1]),
                        ],
                        st,
                    ),
                    PathElement::new(
                        vec![(x - hw, b.q[2]), (x + hw, b.q[2])],
                        BLACK.stroke_width(2),
                    ),
                    PathElement::new(vec![(x, b.q[0]), (x, b.q[1])], st),
                    PathElement::new(vec![(x, b.q[3]), (x, b.q[4])], st),
                    PathElement::new(vec![(x - hw / 2.0, b.q[0]), (x + hw / 2.0, b.q[0])], st),
                    PathElement::new(vec![(x - hw / 2.0, b.q[4]), (x + hw / 2.0, b.q[4])], st),
                ])?;
                let mut t = format!("n={}", b.n);
                if b.zeros > 0 {
                    t.push_str(&format!(" (+{} exactly 0)", b.zeros));
                }
                chart.draw_series(std::iter::once(Text::new(
                    t,
                    (x, b.q[4] + 0.05 * (hi - lo)),
                    note.clone(),
                )))?;
            }
        }
        draw_legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        Ok(())
    }
}

// ---------- points with intervals joined by lines ----------

struct PSeries {
    name: String,
    color: RGBColor,
    /// (x, rate) in percent.
    points: Vec<(f64, Pt)>,
}

/// Lines through the points, markers, and the intervals; series `j` shifted by `dx · j` about
/// the centre so that their intervals stay apart.
fn draw_points<'a, DB, X>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, RangedCoordf64>>,
    series: &[PSeries],
    dx: f64,
    ymax: f64,
) -> DrawResult
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    X: Ranged<ValueType = f64>,
{
    let m = series.len() as f64;
    for (j, s) in series.iter().enumerate() {
        let off = (j as f64 - (m - 1.0) / 2.0) * dx;
        let color = s.color;
        let style = color.stroke_width(2);
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .map(|&(x, (v, _, _))| (x + off, v))
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), style))?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], style));
        chart.draw_series(pts.iter().map(|&c| Circle::new(c, 3, color.filled())))?;
        chart.draw_series(s.points.iter().map(|&(x, (v, lo, hi))| {
            ErrorBar::new_vertical(
                x + off,
                lo,
                v,
                hi.min(ymax),
                color.mix(0.6).stroke_width(1),
                6,
            )
        }))?;
    }
    draw_legend(chart, SeriesLabelPosition::UpperRight)?;
    Ok(())
}

/// Top of the y range: above every interval, or (`points_only`) 1.8 × the highest point, the
/// intervals cut there.
fn ymax_of(series: &[PSeries], points_only: bool) -> f64 {
    let top = series
        .iter()
        .flat_map(|s| &s.points)
        .map(|p| if points_only { 1.4 * p.1.0 } else { p.1.2 })
        .fold(1.0_f64, f64::max);
    (top * 1.3).min(105.0)
}

struct FlipFigure {
    bin: i64,
    series: Vec<PSeries>,
}

/// Bins of generated-token positions with fewer rows than this (or a quarter of the fullest
/// bin's, if less) are not drawn.
const MIN_BIN_ROWS: u64 = 50;
/// About this many position bins over the longest reference sequence.
const FLIP_BINS: f64 = 10.0;

fn flip_position(forced: &Forced, level: f64) -> Result<Option<FlipFigure>> {
    let max_step = forced.values().flat_map(|c| &c.flip_at).map(|s| s.0).max();
    let Some(max_step) = max_step else {
        return Ok(None);
    };
    let bin = nice_bin((max_step + 1) as f64 / FLIP_BINS);
    let mut series = vec![];
    for (i, ((m, d), c)) in forced.iter().enumerate() {
        let mut acc: BTreeMap<i64, (u64, u64)> = BTreeMap::new();
        for &(s, f) in &c.flip_at {
            let e = acc.entry(s.max(0) / bin).or_default();
            e.0 += u64::from(f);
            e.1 += 1;
        }
        // Sparse tail bins (few sequences reach them) are left out, unless every bin is small.
        let fullest = acc.values().map(|v| v.1).max().unwrap_or(0);
        let need = MIN_BIN_ROWS.min(fullest / 4).max(1);
        let mut points = vec![];
        for (b, (k, n)) in acc {
            if n < need {
                continue;
            }
            if let Some(p) = pct(k, n, level)? {
                points.push(((b as f64 + 0.5) * bin as f64, p));
            }
        }
        if !points.is_empty() {
            series.push(PSeries {
                name: model_dtype(m, d),
                color: PALETTE[i % PALETTE.len()],
                points,
            });
        }
    }
    Ok((!series.is_empty()).then_some(FlipFigure { bin, series }))
}

/// The smallest of 1, 2, 4, 5, 8 × 10^k at least `raw` (and at least 1).
fn nice_bin(raw: f64) -> i64 {
    let mut scale = 1_i64;
    loop {
        for m in [1, 2, 4, 5, 8] {
            if (m * scale) as f64 >= raw {
                return m * scale;
            }
        }
        scale *= 10;
    }
}

impl Figure for FlipFigure {
    fn size(&self) -> (u32, u32) {
        (1000, 560)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let ymax = ymax_of(&self.series, true);
        let xmax = self
            .series
            .iter()
            .flat_map(|s| &s.points)
            .map(|p| p.0)
            .fold(1.0_f64, f64::max)
            + self.bin as f64 / 2.0;
        let mut chart = ChartBuilder::on(root)
            .caption(
                format!(
                    "Teacher-forced argmax flip rate vs position (bins of {} steps)",
                    self.bin
                ),
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..xmax, 0.0..ymax)?;
        chart
            .configure_mesh()
            .bold_line_style(BLACK.mix(0.12))
            .light_line_style(TRANSPARENT)
            .x_desc("generated-token position (step of the reference sequence; bin centre)")
            .y_desc("steps whose argmax flips (%; Wilson, cut at the top)")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.1}"))
            .label_style(("sans-serif", 13))
            .draw()?;
        draw_points(&mut chart, &self.series, self.bin as f64 * 0.06, ymax)
    }
}

struct ChunkFigure {
    chunks: Vec<String>,
    series: Vec<PSeries>,
}

fn chunk_divergence(replays: &[ReplayRow], level: f64) -> Result<Option<ChunkFigure>> {
    let rows: Vec<&ReplayRow> = replays.iter().filter(|x| x.kind == "replay").collect();
    // Chunk sizes ascending, the one-shot prefill (chunk 0) last.
    let mut chunks: Vec<i64> = rows
        .iter()
        .map(|x| x.chunk)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    chunks.sort_by_key(|&c| (c <= 0, c));
    if chunks.is_empty() {
        return Ok(None);
    }
    let mut groups: BTreeMap<Md<'_>, BTreeMap<i64, Count>> = BTreeMap::new();
    for x in &rows {
        let e = groups
            .entry((x.model.as_str(), x.dtype.as_str()))
            .or_default()
            .entry(x.chunk)
            .or_default();
        e.0 += u64::from(!x.follows_live);
        e.1 += 1;
    }
    let mut series = vec![];
    for (i, ((m, d), by)) in groups.iter().enumerate() {
        let mut points = vec![];
        let n = by.values().map(|v| v.1).max().unwrap_or(0);
        for (ci, c) in chunks.iter().enumerate() {
            if let Some(&(k, n)) = by.get(c)
                && let Some(p) = pct(k, n, level)?
            {
                points.push((ci as f64, p));
            }
        }
        series.push(PSeries {
            name: format!("{} (n={n})", model_dtype(m, d)),
            color: PALETTE[i % PALETTE.len()],
            points,
        });
    }
    let chunks = chunks
        .iter()
        .map(|&c| {
            if c <= 0 {
                "one shot (whole prefix)".to_string()
            } else {
                format!("{c}")
            }
        })
        .collect();
    Ok(Some(ChunkFigure { chunks, series }))
}

impl Figure for ChunkFigure {
    fn size(&self) -> (u32, u32) {
        (1000, 560)
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let axis = CategoryAxis {
            labels: self.chunks.clone(),
        };
        let ymax = ymax_of(&self.series, false);
        let mut chart = ChartBuilder::on(root)
            .caption(
                "REPLAY (re-prefilled prefix) vs LIVE (decode-built cache) by prefill chunk size",
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(70)
            .build_cartesian_2d(axis.clone(), 0.0..ymax)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .bold_line_style(BLACK.mix(0.12))
            .light_line_style(TRANSPARENT)
            .x_label_formatter(&|x| axis.format_ext(x))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .x_desc("prefill chunk size (tokens)")
            .y_desc("boundaries: continuation ≠ LIVE's (%, Wilson)")
            .label_style(("sans-serif", 13))
            .draw()?;
        draw_points(&mut chart, &self.series, 0.05, ymax)
    }
}

// ---------- transplant donor-following ----------

/// Name of a transplant layer range relative to the model's depth `n`
/// ([`crate::divergence::replay::transplant_ranges`] order), and its rank.
fn range_name(lo: i64, hi: i64, n: i64) -> (usize, String) {
    const NAMES: [&str; 7] = [
        "all layers",
        "first half",
        "second half",
        "1st quarter",
        "2nd quarter",
        "3rd quarter",
        "4th quarter",
    ];
    let ranges = super::replay::transplant_ranges(n.max(0) as usize);
    match ranges
        .iter()
        .position(|&(a, b)| a as i64 == lo && b as i64 == hi)
    {
        Some(i) if i < NAMES.len() => (i, NAMES[i].to_string()),
        _ => (NAMES.len(), format!("layers {lo}..{hi}")),
    }
}

fn parts_name(p: &str) -> (usize, &'static str) {
    match p {
        "kv" => (0, "K+V"),
        "k" => (1, "K only"),
        "v" => (2, "V only"),
        _ => (3, "?"),
    }
}

fn transplant(replays: &[ReplayRow], level: f64) -> Result<Option<HBarFigure>> {
    let rows: Vec<&ReplayRow> = replays.iter().filter(|x| x.kind == "transplant").collect();
    if rows.is_empty() {
        return Ok(None);
    }
    let mut depth: BTreeMap<(&str, &str), i64> = BTreeMap::new();
    for x in &rows {
        let e = depth.entry((&x.model, &x.dtype)).or_default();
        *e = (*e).max(x.layers.1);
    }
    // Category: (parts rank, range rank, name); counts per direction × model/dtype × category.
    type Cat = (usize, usize, String);
    let mut cats: BTreeSet<Cat> = BTreeSet::new();
    let mut counts: BTreeMap<(&str, Md<'_>, Cat), Count> = BTreeMap::new();
    for x in &rows {
        let (pr, pn) = parts_name(&x.parts);
        let (rr, rn) = range_name(
            x.layers.0,
            x.layers.1,
            depth[&(x.model.as_str(), x.dtype.as_str())],
        );
        let cat = (pr, rr, format!("{pn}, {rn}"));
        cats.insert(cat.clone());
        let e = counts
            .entry((
                x.direction.as_str(),
                (x.model.as_str(), x.dtype.as_str()),
                cat,
            ))
            .or_default();
        e.0 += u64::from(x.follows_donor());
        e.1 += 1;
    }
    let cats: Vec<Cat> = cats.into_iter().collect();
    let mut directions: Vec<&str> = rows
        .iter()
        .map(|x| x.direction.as_str())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    // LIVE as the base first.
    directions.sort_by_key(|d| (!d.starts_with("live<-"), d.to_string()));
    let mut panels = vec![];
    for dir in &directions {
        let mut series = vec![];
        for (i, md) in depth.keys().enumerate() {
            let values = cats
                .iter()
                .map(|c| match counts.get(&(*dir, *md, c.clone())) {
                    Some(&(k, n)) => pct(k, n, level),
                    None => Ok(None),
                })
                .collect::<Result<Vec<_>>>()?;
            series.push(HSeries {
                name: format!("{} (n={})", model_dtype(md.0, md.1), {
                    counts
                        .iter()
                        .filter(|(k, _)| k.0 == *dir && k.1 == *md)
                        .map(|(_, v)| v.1)
                        .max()
                        .unwrap_or(0)
                }),
                color: PALETTE[i % PALETTE.len()],
                values,
            });
        }
        let title = match dir.split_once("<-") {
            Some((base, donor)) => format!(
                "{} continues with {}'s KV",
                base.to_uppercase(),
                donor.to_uppercase()
            ),
            None => (*dir).to_string(),
        };
        panels.push(HPanel {
            title,
            x_desc: format!(
                "boundaries whose continuation = the donor's own (%, {:.0}% Wilson)",
                100.0 * level
            ),
            series,
            stacked: false,
            notes: vec![],
            // Room right of 100% for the legend.
            xmax: 178.0,
            tick_cap: 100.0,
            legend: Legend::None,
        });
    }
    if let Some(p) = panels.last_mut() {
        p.legend = Legend::Lower;
    }
    let widths = vec![620; panels.len()];
    Ok(Some(HBarFigure {
        categories: cats.into_iter().map(|c| c.2).collect(),
        panels,
        widths,
        label_area: 170,
    }))
}

// ---------- patch-recovery heatmap ----------

/// Sequential colour map (viridis anchors) for `v` in [0, 1].
fn viridis(v: f64) -> RGBColor {
    const A: [(f64, f64, f64); 5] = [
        (68.0, 1.0, 84.0),
        (59.0, 82.0, 139.0),
        (33.0, 145.0, 140.0),
        (94.0, 201.0, 98.0),
        (253.0, 231.0, 37.0),
    ];
    let v = if v.is_finite() {
        v.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let h = v * (A.len() - 1) as f64;
    let i = (h.floor() as usize).min(A.len() - 2);
    let t = h - i as f64;
    let mix = |a: f64, b: f64| (a + t * (b - a)).round() as u8;
    RGBColor(
        mix(A[i].0, A[i + 1].0),
        mix(A[i].1, A[i + 1].1),
        mix(A[i].2, A[i + 1].2),
    )
}

struct HeatPanel {
    title: String,
    layers: i64,
    rows: Vec<String>,
    /// (row, layer start, layer end, share in [0, 1]).
    cells: Vec<(usize, i64, i64, f64)>,
}

struct PatchFigure {
    panels: Vec<HeatPanel>,
}

const HEAT_ROW: u32 = 30;
const HEAT_EXTRA: u32 = 100;
const HEAT_BAR: u32 = 120;

fn patch_recovery(patches: &[PatchRow]) -> Option<PatchFigure> {
    let mut groups: BTreeMap<Md<'_>, PatchSets<'_>> = BTreeMap::new();
    for p in patches {
        groups
            .entry((&p.model, &p.dtype))
            .or_default()
            .entry((p.layers.0, p.layers.1, &p.label))
            .or_default()
            .push(p);
    }
    let mut panels = vec![];
    for ((m, d), sets) in groups {
        let share = |rows: &[&PatchRow], f: fn(&PatchRow) -> bool| {
            let rep: Vec<&&PatchRow> = rows.iter().filter(|p| p.reproduced).collect();
            let n = rep.len();
            (n, rep.iter().filter(|p| f(p)).count())
        };
        let n = sets
            .values()
            .map(|r| share(r, PatchRow::immediate).0)
            .max()
            .unwrap_or(0);
        let total = sets.values().map(|r| r.len()).max().unwrap_or(0);
        if n == 0 {
            continue;
        }
        let depth = sets.keys().map(|k| k.1).max().unwrap_or(0);
        if depth <= 0 {
            continue;
        }
        // Kinds of set: single layers, blocks (greedy lanes so that none overlap), all layers.
        let mut lanes: Vec<Vec<(i64, i64)>> = vec![];
        let mut row_of: BTreeMap<(i64, i64), (usize, usize)> = BTreeMap::new();
        let mut control = None;
        for &(lo, hi, label) in sets.keys() {
            if label == "control" || hi <= lo {
                if label == "control" {
                    control = Some((lo, hi, label));
                }
                continue;
            }
            let kind = if hi - lo == 1 {
                0
            } else if lo == 0 && hi == depth {
                2
            } else {
                1
            };
            let lane = if kind == 1 {
                let l = lanes
                    .iter()
                    .position(|l| l.iter().all(|&(a, b)| hi <= a || lo >= b))
                    .unwrap_or_else(|| {
                        lanes.push(vec![]);
                        lanes.len() - 1
                    });
                lanes[l].push((lo, hi));
                l
            } else {
                0
            };
            row_of.insert((lo, hi), (kind, lane));
        }
        let mut kinds: Vec<(usize, usize)> = row_of
            .values()
            .copied()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        kinds.sort();
        let mut rows = vec![];
        let mut cells = vec![];
        for (ki, &(kind, lane)) in kinds.iter().enumerate() {
            let name = match kind {
                0 => "one layer".to_string(),
                2 => "all layers".to_string(),
                _ if lanes.len() > 1 => format!("layer block ({})", lane + 1),
                _ => "layer block".to_string(),
            };
            rows.push(format!("{name} · next token"));
            rows.push(format!("{name} · trajectory"));
            for ((lo, hi), _) in row_of.iter().filter(|(_, v)| **v == (kind, lane)) {
                let r = sets
                    .iter()
                    .filter(|(k, _)| (k.0, k.1) == (*lo, *hi) && k.2 != "control")
                    .flat_map(|(_, v)| v.iter().copied())
                    .collect::<Vec<_>>();
                for (j, f) in [
                    PatchRow::immediate as fn(&PatchRow) -> bool,
                    PatchRow::trajectory,
                ]
                .into_iter()
                .enumerate()
                {
                    let (nn, k) = share(&r, f);
                    if nn > 0 {
                        cells.push((2 * ki + j, *lo, *hi, k as f64 / nn as f64));
                    }
                }
            }
        }
        let ctrl = control.map_or(String::new(), |key| {
            let r = &sets[&key];
            let (nn, i) = share(r, PatchRow::immediate);
            let (_, t) = share(r, PatchRow::trajectory);
            format!("; unpatched control: next token {i}/{nn}, trajectory {t}/{nn}")
        });
        panels.push(HeatPanel {
            title: format!("{m} {d}: {n} of {total} problems reproduce the divergence{ctrl}"),
            layers: depth,
            rows,
            cells,
        });
    }
    (!panels.is_empty()).then_some(PatchFigure { panels })
}

impl PatchFigure {
    fn panel_height(p: &HeatPanel) -> u32 {
        HEAT_EXTRA + HEAT_ROW * p.rows.len() as u32
    }
}

impl Figure for PatchFigure {
    fn size(&self) -> (u32, u32) {
        let h: u32 = self.panels.iter().map(Self::panel_height).sum();
        (1200, (h + 40).clamp(360, 4000))
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static,
    {
        root.fill(&WHITE)?;
        let (w, h) = root.dim_in_pixel();
        let (head, body) = root.split_vertically(40);
        head.draw(&Text::new(
            "Residual-stream patching at τ: share of reproduced problems recovered",
            (12, 10),
            ("sans-serif", 18).into_font().color(&BLACK),
        ))?;
        let (main, bar) = body.split_horizontally(w - HEAT_BAR);
        let mut rest = main;
        for p in &self.panels {
            let (area, r) = rest.split_vertically(Self::panel_height(p));
            rest = r;
            draw_heat_panel(&area, p)?;
        }
        // Colour bar.
        let mut cb = ChartBuilder::on(&bar)
            .margin_top((h / 8).min(60))
            .margin_bottom((h / 8).min(60))
            .margin_right(50)
            .y_label_area_size(40)
            .caption("recovered (%)", ("sans-serif", 12))
            .build_cartesian_2d(0.0..1.0, 0.0..100.0)?;
        cb.configure_mesh()
            .disable_mesh()
            .disable_x_axis()
            .y_label_formatter(&|y| format!("{y:.0}"))
            .label_style(("sans-serif", 12))
            .draw()?;
        cb.draw_series((0..100).map(|i| {
            let v = i as f64;
            Rectangle::new([(0.0, v), (1.0, v + 1.0)], viridis(v / 100.0).filled())
        }))?;
        Ok(())
    }
}

fn draw_heat_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, p: &HeatPanel) -> DrawResult
where
    DB::ErrorType: 'static,
{
    let n = p.rows.len();
    let axis = CategoryAxis {
        labels: p.rows.iter().rev().cloned().collect(),
    };
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, ("sans-serif", 14))
        .margin(8)
        .x_label_area_size(36)
        .y_label_area_size(200)
        .build_cartesian_2d(0.0..p.layers as f64, axis.clone())?;
    chart
        .configure_mesh()
        .disable_mesh()
        .y_label_formatter(&|y| axis.format_ext(y))
        .x_labels((p.layers as usize + 1).min(16))
        .x_label_formatter(&|x| {
            if (x - x.round()).abs() < 1e-6 {
                format!("{x:.0}")
            } else {
                String::new()
            }
        })
        .x_desc("layer (a cell spans the patched layers [start, end))")
        .label_style(("sans-serif", 12))
        .draw()?;
    let pos = |r: usize| (n - 1 - r) as f64;
    let px_per_layer = chart.plotting_area().dim_in_pixel().0 as f64 / p.layers as f64;
    chart.draw_series(p.cells.iter().map(|&(r, lo, hi, v)| {
        Rectangle::new(
            [(lo as f64, pos(r) - 0.46), (hi as f64, pos(r) + 0.46)],
            viridis(v).filled(),
        )
    }))?;
    chart.draw_series(p.cells.iter().map(|&(r, lo, hi, _)| {
        Rectangle::new(
            [(lo as f64, pos(r) - 0.46), (hi as f64, pos(r) + 0.46)],
            WHITE.stroke_width(1),
        )
    }))?;
    let centre = Pos::new(HPos::Center, VPos::Center);
    chart.draw_series(
        p.cells
            .iter()
            .filter(|c| (c.2 - c.1) as f64 * px_per_layer >= 24.0)
            .map(|&(r, lo, hi, v)| {
                let ink = if v > 0.6 { BLACK } else { WHITE };
                Text::new(
                    format!("{:.0}", 100.0 * v),
                    ((lo + hi) as f64 / 2.0, pos(r)),
                    ("sans-serif", 11).into_font().color(&ink).pos(centre),
                )
            }),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transplant_ranges_are_named_relative_to_the_depth() {
        assert_eq!(range_name(0, 30, 30), (0, "all layers".into()));
        assert_eq!(range_name(15, 30, 30), (2, "second half".into()));
        assert_eq!(range_name(7, 15, 30), (4, "2nd quarter".into()));
        assert_eq!(range_name(3, 5, 30).1, "layers 3..5");
    }

    #[test]
    fn flip_bins_are_round_numbers() {
        assert_eq!(nice_bin(0.3), 1);
        assert_eq!(nice_bin(12.9), 20);
        assert_eq!(nice_bin(3.0), 4);
        assert_eq!(nice_bin(81.0), 100);
    }

    #[test]
    fn the_colour_map_runs_dark_to_light() {
        assert_eq!(viridis(0.0), RGBColor(68, 1, 84));
        assert_eq!(viridis(1.0), RGBColor(253, 231, 37));
        assert_eq!(viridis(f64::NAN), viridis(0.0));
    }
}
