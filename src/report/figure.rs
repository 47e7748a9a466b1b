//! Figure plumbing shared by the study reports: the [`Figure`] trait, [`render`] to SVG and
//! PNG, the legend, palette and label helpers, and a category x axis.
//!
//! Drawn with `plotters` (SVG backend, and the bitmap backend into an RGB buffer that the `png`
//! crate encodes). Text is rendered with `ab_glyph` from a bundled subset of DejaVu Sans
//! (`fonts/`, Bitstream Vera / DejaVu licence), so no system font is needed.
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, ValueFormatter};
use plotters::prelude::*;

use crate::{Error, Result};

static FONT: &[u8] = include_bytes!("fonts/DejaVuSans-subset.ttf");

pub(crate) type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// The legend of every figure: boxed, on a light backdrop, at `position`.
pub(crate) fn draw_legend<'a, DB, CT>(
    chart: &mut ChartContext<'a, DB, CT>,
    position: SeriesLabelPosition,
) -> DrawResult
where
    DB: DrawingBackend + 'a,
    DB::ErrorType: 'static,
    CT: CoordTranslate,
{
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 12))
        .draw()?;
    Ok(())
}

/// Line colours per configuration (the matplotlib "tab10" cycle).
pub(crate) const PALETTE: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

fn register_font() -> Result<()> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(Error::Output("plot: the bundled font is unreadable".into()))
    }
}

/// A figure that can be drawn on any plotters backend.
pub(crate) trait Figure {
    fn size(&self) -> (u32, u32);
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> DrawResult
    where
        DB::ErrorType: 'static;
}

fn plot_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Output(format!("plot {}: {e}", path.display()))
}

/// Write `stem.svg` and `stem.png`; returns both paths.
pub(crate) fn render(fig: &impl Figure, stem: &Path) -> Result<Vec<PathBuf>> {
    register_font()?;
    let (w, h) = fig.size();
    let svg = stem.with_extension("svg");
    {
        let root = SVGBackend::new(&svg, (w, h)).into_drawing_area();
        fig.draw(&root).map_err(|e| plot_err(&svg, e))?;
        root.present().map_err(|e| plot_err(&svg, e))?;
    }
    let png = stem.with_extension("png");
    let mut buf = vec![0u8; w as usize * h as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        fig.draw(&root).map_err(|e| plot_err(&png, e))?;
        root.present().map_err(|e| plot_err(&png, e))?;
    }
    write_png(&png, &buf, w, h)?;
    Ok(vec![png, svg])
}

fn write_png(path: &Path, rgb: &[u8], w: u32, h: u32) -> Result<()> {
    let file = File::create(path).map_err(|e| Error::io(path, e))?;
    let mut enc = png::Encoder::new(BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut writer = enc.write_header().map_err(|e| plot_err(path, e))?;
    writer
        .write_image_data(rgb)
        .map_err(|e| plot_err(path, e))?;
    writer.finish().map_err(|e| plot_err(path, e))
}

/// Labels for `names` with the prefix they all share, up to a `-`, `_` or space, left out
/// (`spectrum-credit-qwen15-zs-pdtrim-b03` among its siblings reads `pdtrim-b03`), each then
/// [`short`]ened to `n` characters. One name, or no shared prefix: the names as they are.
pub(crate) fn distinct_labels<'a>(
    names: impl IntoIterator<Item = &'a str>,
    n: usize,
) -> Vec<String> {
    let names: Vec<&str> = names.into_iter().collect();
    let cut = match names.as_slice() {
        [first, rest @ ..] if !rest.is_empty() => {
            let common = rest.iter().fold(first.len(), |len, s| {
                first
                    .bytes()
                    .zip(s.bytes())
                    .take(len)
                    .take_while(|(a, b)| a == b)
                    .count()
            });
            let cut = first
                .char_indices()
                .take_while(|(i, c)| i + c.len_utf8() <= common)
                .filter(|(_, c)| matches!(c, '-' | '_' | ' '))
                .last()
                .map_or(0, |(i, _)| i + 1);
            if names.iter().any(|s| s.len() <= cut) {
                0
            } else {
                cut
            }
        }
        _ => 0,
    };
    names.iter().map(|s| short(&s[cut..], n)).collect()
}

pub(crate) fn short(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('…');
        t
    }
}

/// A category x axis: categories at 0, 1, …, n − 1 (ticks there only), values in between
/// allowed so that grouped bars can sit beside each tick.
#[derive(Clone)]
pub(crate) struct CategoryAxis {
    pub(crate) labels: Vec<String>,
}

impl CategoryAxis {
    fn span(&self) -> (f64, f64) {
        (-0.5, self.labels.len() as f64 - 0.5)
    }
}

impl Ranged for CategoryAxis {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;

    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        let (lo, hi) = self.span();
        let frac = (v - lo) / (hi - lo);
        limit.0 + (frac * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        (0..self.labels.len()).map(|i| i as f64).collect()
    }

    fn range(&self) -> std::ops::Range<f64> {
        let (lo, hi) = self.span();
        lo..hi
    }
}

impl ValueFormatter<f64> for CategoryAxis {
    fn format(v: &f64) -> String {
        format!("{v}")
    }

    fn format_ext(&self, v: &f64) -> String {
        let i = v.round();
        if (v - i).abs() < 1e-9 && i >= 0.0 {
            self.labels.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::distinct_labels;

    #[test]
    fn labels_drop_the_shared_prefix_at_a_separator() {
        let names = [
            "spectrum-credit-qwen15-zs-pdtrim-b03",
            "spectrum-credit-qwen15-zs-snapkv-b05",
        ];
        assert_eq!(distinct_labels(names, 22), ["pdtrim-b03", "snapkv-b05"]);
        // A shared prefix that ends inside a word keeps that word whole.
        assert_eq!(distinct_labels(["run-ab", "run-ac"], 22), ["ab", "ac"]);
        // One name, or nothing shared: unchanged (shortened only).
        assert_eq!(distinct_labels(["spectrum-credit"], 9), ["spectrum…"]);
        assert_eq!(distinct_labels(["a-x", "b-x"], 22), ["a-x", "b-x"]);
        // A name that is the whole shared prefix keeps its own text.
        assert_eq!(distinct_labels(["zs", "zs-eager"], 22), ["zs", "zs-eager"]);
    }
}
