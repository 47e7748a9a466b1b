//! `kvcredit spectrum report`: one Markdown report over run folders (one per model) from the
//! grids' finished units ([`super::grid`]; an older run's journals `ppl.rows.jsonl`,
//! `niah.rows.jsonl`), the probe verdicts (`probe*.parquet`) and the TTFT rows of
//! `spectrum send` (`ttft*.parquet`): the perplexity protocol of each run, PPL Δ% per variant
//! with a t-interval over windows, the paired policy differences at each b with their
//! intervals, Holm-adjusted p-values and power ([`super::compare`]), NIAH accuracy with Wilson
//! intervals and paired McNemar comparisons, the probe and gate per quantizer, and the TTFT
//! stage medians with the cut vs FP16; plus three figures as PNG and SVG
//! ([`super::figures`]): PPL Δ% vs b, NIAH accuracy by depth, TTFT stage stacks. A figure
//! without data is not drawn.
use super::compare::{self, NiahDiff, PplDiff};
use super::eval::{NiahRow, PplRow, window_delta};
use super::figures::{
    NIAH_STEM, NiahFigure, NiahPanel, PPL_STEM, PplFigure, PplPanel, PplSeries, TTFT_STAGES,
    TTFT_STEM, TtftBar, TtftFigure, TtftPanel,
};
use super::grid;
use crate::io::frame::Frame;
use crate::report::figure::render;
use crate::stats;
use crate::{Error, Result};
use std::fmt::Write;
use std::path::{Path, PathBuf};

/// Rows of a journal (its first line is the settings).
pub fn read_journal<R: serde::de::DeserializeOwned>(path: &Path) -> Result<Vec<R>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let mut rows = Vec::new();
    for line in text.lines().skip(1) {
        let Ok(mut v) = serde_json::from_str::<serde_json::Value>(line) else {
            break;
        };
        let r: Vec<R> = serde_json::from_value(v["rows"].take())
            .map_err(|e| Error::Spectrum(format!("{}: {e}", path.display())))?;
        rows.extend(r);
    }
    Ok(rows)
}

/// Mean per-window Δ% of `rows` and its 95% t-interval over windows (`None` with one window).
fn delta_stats(rows: &[&PplRow]) -> Result<(f64, Option<(f64, f64)>)> {
    let d: Vec<f64> = rows.iter().map(|r| window_delta(r)).collect();
    let w: Vec<u64> = rows.iter().map(|r| r.window as u64).collect();
    let t = stats::cluster_mean_t(&d, &w)?;
    Ok((t.estimate, t.confidence_interval(0.95)?))
}

fn interval(values: &[f64], windows: &[u64]) -> Result<String> {
    let t = stats::cluster_mean_t(values, windows)?;
    Ok(fmt_interval(t.confidence_interval(0.95)?))
}

fn fmt_interval(ci: Option<(f64, f64)>) -> String {
    match ci {
        Some((lo, hi)) => format!("[{lo:+.2}, {hi:+.2}]"),
        None => "n/a (1 window)".into(),
    }
}

fn key(policy: &str, q: &str, b: Option<f64>) -> String {
    format!("{policy} {q} b={}", b.map_or("-".into(), |b| b.to_string()))
}

/// Policy × quantizer × b of `rows`, in order of first appearance.
fn variants<'a>(
    rows: impl IntoIterator<Item = (&'a str, &'a str, Option<f64>)>,
) -> Vec<(String, String, Option<f64>)> {
    let mut keys: Vec<(String, String, Option<f64>)> = Vec::new();
    for (p, q, b) in rows {
        if !keys.iter().any(|k| k.0 == p && k.1 == q && k.2 == b) {
            keys.push((p.to_string(), q.to_string(), b));
        }
    }
    keys
}

/// A journal's settings line.
fn journal_header(path: &Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str(text.lines().next()?).ok()
}

/// The `model` of a journal's settings line.
fn journal_model(path: &Path) -> Option<String> {
    journal_header(path)?["model"].as_str().map(str::to_string)
}

/// Files of `dir` named `{prefix}*.parquet`, sorted, without those starting with one of `not`.
fn parquet_files(dir: &Path, prefix: &str, not: &[&str]) -> Result<Vec<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e.map_err(|e| Error::io(dir, e))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(prefix)
            && name.ends_with(".parquet")
            && !not.iter().any(|n| name.starts_with(n))
        {
            out.push(e.path());
        }
    }
    out.sort();
    Ok(out)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// One row of a `ttft*.parquet` (`kvcredit spectrum send`).
#[derive(Debug, Clone)]
struct TtftRow {
    model: String,
    transfer: String,
    tier_policy: String,
    quantizer: String,
    b: f64,
    b_real: f64,
    bytes: f64,
    context: u32,
    bandwidth_mbps: Option<f64>,
    repeat: u32,
    /// prefill, scoring, pack, send, receive, unpack, first step (ms).
    ms: [f64; 7],
    ttft: f64,
    /// The file's name.
    file: String,
}

const TTFT_MS: [&str; 7] = [
    "prefill_ms",
    "scoring_ms",
    "pack_ms",
    "send_ms",
    "receive_ms",
    "unpack_ms",
    "first_step_ms",
];

fn read_ttft(path: &Path) -> Result<Vec<TtftRow>> {
    let mut cols = vec![
        "model",
        "transfer",
        "tier_policy",
        "quantizer",
        "b",
        "b_real",
        "bytes",
        "context",
        "bandwidth_mbps",
        "repeat",
        "ttft_ms",
    ];
    cols.extend(TTFT_MS);
    let f = Frame::read(path, &cols)?;
    let (model, transfer) = (f.strings("model")?, f.strings("transfer")?);
    let (tp, q) = (f.strings("tier_policy")?, f.strings("quantizer")?);
    let (b, b_real, bytes) = (f.f64s("b")?, f.f64s("b_real")?, f.i64s("bytes")?);
    let (context, repeat) = (f.u32s("context")?, f.u32s("repeat")?);
    let bw = f.opt_f64s("bandwidth_mbps")?;
    let ttft = f.f64s("ttft_ms")?;
    let ms: Vec<Vec<f64>> = TTFT_MS.iter().map(|c| f.f64s(c)).collect::<Result<_>>()?;
    let file = path
        .file_name()
        .map_or(String::new(), |n| n.to_string_lossy().into_owned());
    Ok((0..f.len())
        .map(|j| TtftRow {
            model: model[j].clone(),
            transfer: transfer[j].clone(),
            tier_policy: tp[j].clone(),
            quantizer: q[j].clone(),
            b: b[j],
            b_real: b_real[j],
            bytes: bytes[j] as f64,
            context: context[j],
            bandwidth_mbps: bw[j].filter(|m| m.is_finite() && *m > 0.0),
            repeat: repeat[j],
            ms: std::array::from_fn(|k| ms[k][j]),
            ttft: ttft[j],
            file: file.clone(),
        })
        .collect())
}

fn link(mbps: Option<f64>) -> String {
    match mbps {
        None => "unlimited".into(),
        Some(m) if m >= 1000.0 => format!("{} Gbit/s", m / 1000.0),
        Some(m) => format!("{m} Mbit/s"),
    }
}

fn transfer_label(r: &TtftRow) -> String {
    if r.transfer == "fp16" {
        "fp16".into()
    } else if r.tier_policy == "pdtrim" {
        format!("pdtrim b={}", r.b)
    } else {
        format!("{} {} b={}", r.tier_policy, r.quantizer, r.b)
    }
}

/// Medians of one transfer over its measured repeats.
struct TtftMedian {
    label: String,
    used: usize,
    of: usize,
    b_real: f64,
    bytes: f64,
    ms: [f64; 7],
    ttft: f64,
}

impl TtftMedian {
    /// Repeat 0 is also the warm-up: it is left out when later repeats exist.
    fn of(label: String, rows: &[&TtftRow]) -> TtftMedian {
        let warm: Vec<&&TtftRow> = rows.iter().filter(|r| r.repeat > 0).collect();
        let used: Vec<&TtftRow> = if warm.is_empty() {
            rows.to_vec()
        } else {
            warm.into_iter().copied().collect()
        };
        let med = |f: &dyn Fn(&TtftRow) -> f64| {
            median(&mut used.iter().map(|r| f(r)).collect::<Vec<_>>())
        };
        TtftMedian {
            label,
            used: used.len(),
            of: rows.len(),
            b_real: med(&|r| r.b_real),
            bytes: med(&|r| r.bytes),
            ms: std::array::from_fn(|k| med(&|r| r.ms[k])),
            ttft: med(&|r| r.ttft),
        }
    }

    /// Stages of the stack ([`TTFT_STAGES`]): send and receive overlap on the wire, so the
    /// longer of the two stands for both; "other" is the rest of the median TTFT.
    fn stages(&self) -> [f64; 7] {
        let m = &self.ms;
        let mut s = [m[0], m[1], m[2], m[3].max(m[4]), m[5], m[6], 0.0];
        s[6] = (self.ttft - s[..6].iter().sum::<f64>()).max(0.0);
        s
    }
}

/// The transfers of one model × context × link (FP16 first).
struct TtftGroup {
    files: Vec<String>,
    model: String,
    context: u32,
    bandwidth_mbps: Option<f64>,
    transfers: Vec<TtftMedian>,
}

impl TtftGroup {
    fn fp16(&self) -> Option<f64> {
        self.transfers
            .iter()
            .find(|t| t.label == "fp16")
            .map(|t| t.ttft)
    }

    /// `100 · (FP16 − this) / FP16`: positive when this transfer is faster.
    fn cut(&self, t: &TtftMedian) -> Option<f64> {
        let f = self.fp16()?;
        (t.label != "fp16" && f > 0.0).then(|| 100.0 * (f - t.ttft) / f)
    }
}

/// Groups by model, then context, then link (unlimited first, then the fastest).
fn ttft_groups(rows: &[TtftRow]) -> Vec<TtftGroup> {
    let mut keys: Vec<(String, u32, Option<f64>)> = Vec::new();
    for r in rows {
        let k = (r.model.clone(), r.context, r.bandwidth_mbps);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.sort_by(|a, b| {
        let bw = |m: Option<f64>| -m.unwrap_or(f64::INFINITY);
        (&a.0, a.1)
            .cmp(&(&b.0, b.1))
            .then(bw(a.2).total_cmp(&bw(b.2)))
    });
    keys.into_iter()
        .map(|(model, context, bw)| {
            let mine: Vec<&TtftRow> = rows
                .iter()
                .filter(|r| r.model == model && r.context == context && r.bandwidth_mbps == bw)
                .collect();
            let mut labels: Vec<String> = vec!["fp16".into()];
            for r in &mine {
                let l = transfer_label(r);
                if !labels.contains(&l) {
                    labels.push(l);
                }
            }
            let mut files: Vec<String> = mine.iter().map(|r| r.file.clone()).collect();
            files.sort();
            files.dedup();
            let transfers = labels
                .into_iter()
                .filter_map(|l| {
                    let rs: Vec<&TtftRow> = mine
                        .iter()
                        .copied()
                        .filter(|r| transfer_label(r) == l)
                        .collect();
                    (!rs.is_empty()).then(|| TtftMedian::of(l, &rs))
                })
                .collect();
            TtftGroup {
                files,
                model,
                context,
                bandwidth_mbps: bw,
                transfers,
            }
        })
        .collect()
}

fn ttft_table(md: &mut String, g: &TtftGroup) {
    let _ = writeln!(
        md,
        "\nTTFT, {} at {} context tokens, link {} ({}): median ms over the repeats after the first (a warm-up; kept only when alone). Send and receive overlap on the wire; other = TTFT − (prefill + scoring + pack + max(send, receive) + unpack + first step), mostly the worker's KV hash and the reply; cut = (FP16 − this) / FP16, positive when faster.\n",
        g.model,
        g.context,
        link(g.bandwidth_mbps),
        g.files.join(", ")
    );
    md.push_str("| transfer | repeats | b_real | MB | prefill | scoring | quantize/pack | send | receive | unpack/dequantize | first step | other | TTFT | cut vs fp16 |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for t in &g.transfers {
        let s = t.stages();
        let _ = write!(
            md,
            "| {} | {} of {} | {:.4} | {:.1} |",
            t.label,
            t.used,
            t.of,
            t.b_real,
            t.bytes / 1e6
        );
        for v in t.ms.iter().chain([&s[6], &t.ttft]) {
            let _ = write!(md, " {v:.1} |");
        }
        let _ = writeln!(
            md,
            " {} |",
            g.cut(t).map_or("—".into(), |c| format!("{c:+.1}%"))
        );
    }
}

fn probe_tables(md: &mut String, files: &[PathBuf]) -> Result<()> {
    for path in files {
        let f = Frame::read(
            path,
            &[
                "model",
                "quantizer",
                "b",
                "context",
                "trials_passed",
                "probe_int4",
                "selected_policy",
                "gate_ppl_ratio",
                "gate_kl",
                "gate_max_ppl_ratio",
                "gate_int4",
            ],
        )?;
        let (model, q, sel) = (
            f.strings("model")?,
            f.strings("quantizer")?,
            f.strings("selected_policy")?,
        );
        let (b, ctx, passed) = (f.f64s("b")?, f.u32s("context")?, f.u32s("trials_passed")?);
        let (p4, g4) = (f.bools("probe_int4")?, f.bools("gate_int4")?);
        let (ratio, kl, max) = (
            f.f64s("gate_ppl_ratio")?,
            f.f64s("gate_kl")?,
            f.f64s("gate_max_ppl_ratio")?,
        );
        let on = |x: bool| if x { "on" } else { "off" };
        let name = path
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into_owned());
        let mut models: Vec<&String> = model.iter().collect();
        models.dedup();
        let verdicts: Vec<String> = (0..f.len())
            .map(|j| format!("{} → **{}** (INT4 {})", q[j], sel[j], on(p4[j])))
            .collect();
        let _ = writeln!(
            md,
            "\nProbe verdict ({name}, {}): {}.\n",
            models
                .iter()
                .map(|m| m.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            verdicts.join("; ")
        );
        md.push_str("| quantizer | probe b | context | NIAH trials passed | probe INT4 | selected policy | gate PPL ratio | gate limit | gate KL | gate INT4 |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
        for j in 0..f.len() {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {:.4} | {} | {:.5} | {} |",
                q[j],
                b[j],
                ctx[j],
                passed[j],
                on(p4[j]),
                sel[j],
                ratio[j],
                max[j],
                kl[j],
                on(g4[j])
            );
        }
    }
    Ok(())
}

fn ppl_panel(title: String, ppl: &[PplRow]) -> Result<PplPanel> {
    let keys = variants(
        ppl.iter()
            .map(|r| (r.policy.as_str(), r.quantizer.as_str(), r.b)),
    );
    let mut series: Vec<PplSeries> = Vec::new();
    for (p, q, b) in &keys {
        let mine: Vec<&PplRow> = ppl
            .iter()
            .filter(|r| &r.policy == p && &r.quantizer == q && r.b == *b)
            .collect();
        let (mean, ci) = delta_stats(&mine)?;
        let x = b.unwrap_or_else(|| mine.iter().map(|r| r.b_real).sum::<f64>() / mine.len() as f64);
        let line = b.is_some();
        match series
            .iter_mut()
            .find(|s| &s.policy == p && &s.quantizer == q && s.line == line)
        {
            Some(s) => s.points.push((x, mean, ci)),
            None => series.push(PplSeries {
                policy: p.clone(),
                quantizer: q.clone(),
                points: vec![(x, mean, ci)],
                line,
            }),
        }
    }
    for s in &mut series {
        s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    Ok(PplPanel { title, series })
}

/// `grid_depths`: the depth count of the grid's settings, so that the depths a cut-short grid
/// has not reached show as empty cells.
fn niah_panel(model: &str, niah: &[NiahRow], grid_depths: Option<u64>) -> NiahPanel {
    let mut depths: Vec<f64> = niah.iter().map(|r| r.depth).collect();
    if let Some(n) = grid_depths.filter(|&n| (1..=64).contains(&n)) {
        // The depths of `spectrum niah`: i / (n − 1), or 0.5 alone.
        depths.extend((0..n).map(|i| {
            if n == 1 {
                0.5
            } else {
                i as f64 / (n - 1) as f64
            }
        }));
    }
    depths.sort_by(f64::total_cmp);
    depths.dedup();
    let mut seeds: Vec<u64> = niah.iter().map(|r| r.seed).collect();
    seeds.sort_unstable();
    seeds.dedup();
    let mut formats: Vec<&str> = niah.iter().map(|r| r.prompt_format.as_str()).collect();
    formats.sort_unstable();
    formats.dedup();
    let keys = variants(
        niah.iter()
            .map(|r| (r.policy.as_str(), r.quantizer.as_str(), r.b)),
    );
    let rows = keys
        .iter()
        .map(|(p, q, b)| {
            let cells = depths
                .iter()
                .map(|&d| {
                    let mine = niah.iter().filter(|r| {
                        &r.policy == p && &r.quantizer == q && r.b == *b && r.depth == d
                    });
                    let (ok, n) = mine.fold((0, 0), |(k, n), r| (k + u64::from(r.correct), n + 1));
                    (n > 0).then_some((ok, n))
                })
                .collect();
            (key(p, q, *b), cells)
        })
        .collect();
    NiahPanel {
        title: format!(
            "{model}: NIAH correct/trials by needle depth ({} prompt, {} seed{})",
            formats.join("+"),
            seeds.len(),
            if seeds.len() == 1 { "" } else { "s" }
        ),
        depths,
        rows,
    }
}

/// What [`write_report`] wrote.
#[derive(Debug, Clone)]
pub struct Report {
    /// The Markdown of `report.md`.
    pub markdown: String,
    /// `out/report.md`.
    pub path: PathBuf,
    /// The figures, PNG and SVG of each (absent data: no figure).
    pub figures: Vec<PathBuf>,
}

/// The report of `dirs` as Markdown; written to `out/report.md` with its figures.
pub fn report(dirs: &[PathBuf], out: &Path) -> Result<String> {
    Ok(write_report(dirs, out)?.markdown)
}

/// Write `out/report.md` and the figures over `dirs` (one run folder per model).
pub fn write_report(dirs: &[PathBuf], out: &Path) -> Result<Report> {
    let mut md = String::from("# SpectrumKV report\n");
    md.push_str(READING);
    let mut panels = Panels::default();
    let mut models: Vec<String> = Vec::new();
    let mut claims: Vec<SeedRow> = Vec::new();
    for dir in dirs {
        let mut run = RunRows::read(dir)?;
        if !run.ppl.is_empty() || !run.niah.is_empty() {
            if models.contains(&run.model) {
                run.model = format!("{} ({})", run.model, dir.display());
            }
            models.push(run.model.clone());
        }
        let _ = writeln!(md, "\n## {}\n", dir.display());
        if !run.ppl.is_empty() {
            panels.ppl.push(ppl_section(&mut md, &run, &mut claims)?);
        }
        if !run.niah.is_empty() {
            panels.niah.push(niah_section(&mut md, &run, &mut claims)?);
        }
        probe_tables(&mut md, &parquet_files(dir, "probe", &["probe-trials"])?)?;
        ttft_section(&mut md, dir, &mut claims, &mut panels.ttft)?;
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let (figures, listed) = write_figures(panels, out)?;
    seed_claims(&mut md, &claims)?;
    md.push_str("\n## Figures\n\n");
    if listed.is_empty() {
        md.push_str("None: no PPL, NIAH or TTFT rows.\n");
    }
    for l in &listed {
        md.push_str(l);
        md.push('\n');
    }
    let path = out.join("report.md");
    crate::io::write_atomic(&path, md.as_bytes())?;
    Ok(Report {
        markdown: md,
        path,
        figures,
    })
}

/// The figure panels gathered over the run folders.
#[derive(Default)]
struct Panels {
    ppl: Vec<PplPanel>,
    niah: Vec<NiahPanel>,
    ttft: Vec<TtftPanel>,
}

/// One run folder's PPL and NIAH rows, their grids' manifests (none for an older run's
/// journals), the journals' paths and the model the panels are named after.
struct RunRows {
    ppl: Vec<PplRow>,
    niah: Vec<NiahRow>,
    ppl_run: Option<grid::GridManifest>,
    niah_run: Option<grid::GridManifest>,
    ppl_path: PathBuf,
    niah_path: PathBuf,
    model: String,
}

impl RunRows {
    /// Read `dir`'s rows; the model is the grids' spec's, else the journals', else the folder's
    /// name without its `spectrum-` prefix.
    fn read(dir: &Path) -> Result<RunRows> {
        // A grid's rows: its finished units (see [`super::grid`]), else a journal of an
        // older run.
        let ppl_path = dir.join("ppl.rows.jsonl");
        let ppl: Vec<PplRow> = match grid::read_rows(dir, "ppl")? {
            Some(rows) => rows,
            None if ppl_path.exists() => read_journal(&ppl_path)?,
            None => Vec::new(),
        };
        let niah_path = dir.join("niah.rows.jsonl");
        let niah: Vec<NiahRow> = match grid::read_rows(dir, "niah")? {
            Some(rows) => rows,
            None if niah_path.exists() => read_journal(&niah_path)?,
            None => Vec::new(),
        };
        let ppl_run = grid::read_manifest(dir, "ppl")?;
        let niah_run = grid::read_manifest(dir, "niah")?;
        // The model of the panels: the grids' specs, else the journals', else the folder's name.
        let model = ppl_run
            .as_ref()
            .or(niah_run.as_ref())
            .map(|m| m.spec.model.clone())
            .or_else(|| journal_model(&ppl_path))
            .or_else(|| journal_model(&niah_path))
            .unwrap_or_else(|| {
                let n = dir.file_name().map_or_else(
                    || dir.display().to_string(),
                    |n| n.to_string_lossy().into_owned(),
                );
                n.strip_prefix("spectrum-")
                    .map_or(n.clone(), str::to_string)
            });
        Ok(RunRows {
            ppl,
            niah,
            ppl_run,
            niah_run,
            ppl_path,
            niah_path,
            model,
        })
    }
}

/// The PPL protocol and tables of one run (per variant, the tiered − PDTrim contrast at
/// b = 0.5, the paired differences), its seed rows, and its figure panel.
fn ppl_section(md: &mut String, run: &RunRows, claims: &mut Vec<SeedRow>) -> Result<PplPanel> {
    let (ppl, model) = (&run.ppl, &run.model);
    ppl_protocol(
        md,
        ppl_settings(run.ppl_run.as_ref(), &run.ppl_path).as_ref(),
    );
    md.push_str("| variant | windows | Δ% pooled | mean per-window Δ% | 95% t-interval | b_real | shared |\n| --- | --- | --- | --- | --- | --- | --- |\n");
    let keys = variants(
        ppl.iter()
            .map(|r| (r.policy.as_str(), r.quantizer.as_str(), r.b)),
    );
    for (p, q, b) in &keys {
        let mine: Vec<&PplRow> = ppl
            .iter()
            .filter(|r| &r.policy == p && &r.quantizer == q && r.b == *b)
            .collect();
        let (_, _, pooled, _, b_real) = super::eval::ppl_summary(&mine);
        let (mean, ci) = delta_stats(&mine)?;
        let _ = writeln!(
            md,
            "| {} | {} | {pooled:+.2} | {mean:+.2} | {} | {b_real:.4} | {} |",
            key(p, q, *b),
            mine.len(),
            fmt_interval(ci),
            mine.iter().filter(|r| r.shared_with.is_some()).count()
        );
    }
    let at = |p: &str, q: &str| -> Vec<&PplRow> {
        ppl.iter()
            .filter(|r| r.policy == p && r.quantizer == q && r.b == Some(0.5))
            .collect()
    };
    let (tier, trim) = (at("spectrum", "kivi"), at("pdtrim", "none"));
    if !tier.is_empty() && tier.len() == trim.len() {
        let d: Vec<f64> = tier
            .iter()
            .zip(&trim)
            .map(|(a, b)| window_delta(a) - window_delta(b))
            .collect();
        let w: Vec<u64> = tier.iter().map(|r| r.window as u64).collect();
        let t = stats::cluster_mean_t(&d, &w)?;
        let _ = writeln!(
            md,
            "\nTiered (kivi) − PDTrim at b = 0.5, paired over windows: {:+.2} points Δ%, 95% {} (p {}).",
            t.estimate,
            interval(&d, &w)?,
            t.p_value.map_or("n/a".into(), |p| format!("{p:.3}"))
        );
        claims.push(SeedRow::Ppl {
            model: model.clone(),
            tiered: delta_stats(&tier)?,
            pdtrim: delta_stats(&trim)?,
            diff: (t.estimate, t.confidence_interval(0.95)?),
            windows: tier.len(),
        });
    }
    let keys: Vec<compare::Key> = variants(
        ppl.iter()
            .map(|r| (r.policy.as_str(), r.quantizer.as_str(), r.b)),
    );
    ppl_diff_table(md, &compare::ppl_diffs(ppl, &keys)?);
    let int4 = |q: &str| -> Vec<&PplRow> {
        ppl.iter()
            .filter(|r| r.policy == "uniform-int4" && r.quantizer == q)
            .collect()
    };
    let (kivi4, lab4) = (int4("kivi"), int4("lab-compat"));
    if !kivi4.is_empty() && !lab4.is_empty() {
        claims.push(SeedRow::Int4 {
            model: model.clone(),
            kivi: delta_stats(&kivi4)?,
            lab: delta_stats(&lab4)?,
        });
    }
    let mut windows: Vec<u32> = ppl.iter().map(|r| r.window).collect();
    windows.sort_unstable();
    windows.dedup();
    let title = format!(
        "{model}: {} window{}",
        windows.len(),
        if windows.len() == 1 { "" } else { "s" }
    );
    ppl_panel(title, ppl)
}

/// The NIAH table and paired differences of one run, its seed row, and its figure panel.
fn niah_section(md: &mut String, run: &RunRows, claims: &mut Vec<SeedRow>) -> Result<NiahPanel> {
    let (niah, model) = (&run.niah, &run.model);
    md.push_str("\n| NIAH variant | correct | n | accuracy | 95% Wilson | prompt |\n| --- | --- | --- | --- | --- | --- |\n");
    let keys = variants(
        niah.iter()
            .map(|r| (r.policy.as_str(), r.quantizer.as_str(), r.b)),
    );
    for (p, q, b) in &keys {
        let mine: Vec<&NiahRow> = niah
            .iter()
            .filter(|r| &r.policy == p && &r.quantizer == q && r.b == *b)
            .collect();
        let ok = mine.iter().filter(|r| r.correct).count() as u64;
        let n = mine.len() as u64;
        let ci = stats::wilson(ok, n, 0.95)?.map_or("n/a".into(), |(lo, hi)| {
            format!("[{:.1}, {:.1}]%", 100.0 * lo, 100.0 * hi)
        });
        let _ = writeln!(
            md,
            "| {} | {ok} | {n} | {:.1}% | {ci} | {} |",
            key(p, q, *b),
            100.0 * ok as f64 / n as f64,
            mine[0].prompt_format
        );
    }
    let count = |p: &str, q: &str| -> (u64, u64) {
        let mine: Vec<&NiahRow> = niah
            .iter()
            .filter(|r| r.policy == p && r.quantizer == q && r.b == Some(0.3))
            .collect();
        (
            mine.iter().filter(|r| r.correct).count() as u64,
            mine.len() as u64,
        )
    };
    let (tiered, pdtrim) = (count("spectrum", "kivi"), count("pdtrim", "none"));
    if tiered.1 > 0 && pdtrim.1 > 0 {
        claims.push(SeedRow::Niah {
            model: model.clone(),
            tiered,
            pdtrim,
        });
    }
    let keys: Vec<compare::Key> = variants(
        niah.iter()
            .filter(|r| r.policy != "full")
            .map(|r| (r.policy.as_str(), r.quantizer.as_str(), r.b)),
    );
    niah_diff_table(md, &compare::niah_diffs(niah, &keys)?);
    let grid_depths = match &run.niah_run {
        Some(m) => m.spec.niah.as_ref().map(|n| n.depths as u64),
        None => journal_header(&run.niah_path).and_then(|h| h["grid"]["depths"].as_u64()),
    };
    Ok(niah_panel(model, niah, grid_depths))
}

/// The TTFT tables of one run folder (`ttft*.parquet`), their seed rows and figure panels.
fn ttft_section(
    md: &mut String,
    dir: &Path,
    claims: &mut Vec<SeedRow>,
    ttft_panels: &mut Vec<TtftPanel>,
) -> Result<()> {
    let ttft_files = parquet_files(dir, "ttft", &[])?;
    let mut ttft = Vec::new();
    for f in &ttft_files {
        ttft.extend(read_ttft(f)?);
    }
    for g in ttft_groups(&ttft) {
        ttft_table(md, &g);
        for t in g
            .transfers
            .iter()
            .filter(|t| t.label.starts_with("spectrum"))
        {
            if let Some(cut) = g.cut(t) {
                claims.push(SeedRow::Ttft {
                    model: g.model.clone(),
                    link: link(g.bandwidth_mbps),
                    cut,
                    repeats: t.used,
                });
            }
        }
        let used = g.transfers.iter().map(|t| t.used).max().unwrap_or(0);
        ttft_panels.push(TtftPanel {
            title: format!(
                "{}, {} tokens, link {}",
                g.model,
                g.context,
                link(g.bandwidth_mbps)
            ),
            y_desc: format!(
                "TTFT ms (median of {used} repeat{})",
                if used == 1 { "" } else { "s" }
            ),
            bars: g
                .transfers
                .iter()
                .map(|t| TtftBar {
                    label: t.label.clone(),
                    stages: t.stages(),
                    total: t.ttft,
                    cut: g.cut(t),
                })
                .collect(),
        });
    }
    Ok(())
}

/// Draw the PPL, NIAH and TTFT figures that have panels into `out` (removing an earlier
/// report's figure that has none now); returns the files written and the report's list lines.
fn write_figures(panels: Panels, out: &Path) -> Result<(Vec<PathBuf>, Vec<String>)> {
    let Panels {
        ppl: ppl_panels,
        niah: niah_panels,
        ttft: ttft_panels,
    } = panels;
    let mut figures = Vec::new();
    let mut listed: Vec<String> = Vec::new();
    let mut figure = |stem: &str, drawn: Option<Result<Vec<PathBuf>>>, what: &str| -> Result<()> {
        match drawn {
            Some(files) => {
                figures.extend(files?);
                listed.push(format!(
                    "- [`{stem}.png`]({stem}.png) ([SVG]({stem}.svg)): {what}\n\n  ![{stem}]({stem}.png)\n"
                ));
            }
            None => {
                // No data: no figure, and none left from an earlier report in `out`.
                for ext in ["png", "svg"] {
                    let _ = std::fs::remove_file(out.join(stem).with_extension(ext));
                }
            }
        }
        Ok(())
    };
    figure(
        PPL_STEM,
        (!ppl_panels.is_empty())
            .then(|| render(&PplFigure { panels: ppl_panels }, &out.join(PPL_STEM))),
        "PPL Δ% vs budget b, one panel per model; a line per policy × quantizer (colour: policy; dashed/triangles: lab-compat and lab-compat-token, squares: keep/drop at FP16, i.e. PDTrim and snapkv), single markers for the uniform tiers at their real budget; error bars: 95% t-interval over windows (none with one window).",
    )?;
    figure(
        NIAH_STEM,
        (!niah_panels.is_empty()).then(|| {
            render(
                &NiahFigure {
                    panels: niah_panels,
                },
                &out.join(NIAH_STEM),
            )
        }),
        "NIAH accuracy by needle depth × variant (policy, quantizer, b), one heatmap per model; a cell is correct/trials over the seeds (red 0% → green 100%).",
    )?;
    figure(
        TTFT_STEM,
        (!ttft_panels.is_empty()).then(|| {
            render(
                &TtftFigure {
                    panels: ttft_panels,
                },
                &out.join(TTFT_STEM),
            )
        }),
        &format!(
            "TTFT stage stacks (median ms) per model × context × link: FP16 vs each tiered transfer; stages {}.",
            TTFT_STAGES.join(", ")
        ),
    )?;
    Ok((figures, listed))
}

/// How the paired comparisons are computed and read (printed under the title).
const READING: &str = "\nPaired comparisons: at each budget every variant is compared with PDTrim, with `snapkv` and with `uniform-int8` (same quantizer), and `spectrum` with `spectrum-position` (same quantizer), on the windows (perplexity) or haystacks (NIAH) both were measured on. Perplexity: the per-window difference of Δ% (points; negative: the variant's perplexity is closer to the uncompressed one), its 95% paired cluster-bootstrap interval over windows (10,000 replicates; the window is the cluster, drawn for both variants at once), the paired t test's p and Holm's adjustment over the model's perplexity comparisons. NIAH: the accuracy difference, the exact McNemar test on the haystacks only one of the two answers correctly, Holm over the model's NIAH comparisons, and a bootstrap interval over seeds (the haystacks of one seed share the needle). A verdict names a winner only where the Holm-adjusted p is below 0.05; otherwise the two are *not distinguishable* at that count, which is not a finding of equivalence. Power: MDE is the paired difference a two-sided t test at α = 0.05 detects with 80% probability given the observed SD of the paired differences and their count (α/m: at Holm's first step over the m comparisons); *windows for 80% power at this diff* is the window count at which that test would detect the observed mean difference with 80% probability, were it the true one.\n";

/// A perplexity grid's settings in the shape of a journal's settings line (`protocol`, and
/// `grid`: the `[ppl]` section with its `text`): from the grid's manifest, else from the
/// journal of an older run. A manifest that did not record the text normalization leaves
/// `text` out.
fn ppl_settings(run: Option<&grid::GridManifest>, journal: &Path) -> Option<serde_json::Value> {
    let Some(m) = run else {
        return journal_header(journal);
    };
    let mut section = serde_json::to_value(m.spec.ppl.as_ref()?).ok()?;
    let fields = section.as_object_mut()?;
    match m.text {
        Some(t) => fields.insert("text".into(), t.name().into()),
        None => fields.remove("text"),
    };
    Some(serde_json::json!({"protocol": m.protocol, "grid": section}))
}

/// The perplexity protocol of a run, from its settings ([`ppl_settings`]).
fn ppl_protocol(md: &mut String, header: Option<&serde_json::Value>) {
    let grid = header.map(|h| &h["grid"]);
    let num = |k: &str| grid.and_then(|g| g[k].as_u64());
    let text = match grid.and_then(|g| g["text"].as_str()) {
        Some("lf") => "`lf` (CRLF line ends → LF before tokenization)".to_string(),
        Some("raw") => "`raw` (CRLF line ends kept)".to_string(),
        Some(other) => format!("`{other}`"),
        None => "not recorded (a journal without the `text` setting: CRLF line ends kept)".into(),
    };
    let (n, m, w) = (num("context"), num("continuation"), num("windows"));
    let show = |x: Option<u64>| x.map_or("?".to_string(), |x| x.to_string());
    let _ = writeln!(
        md,
        "Perplexity protocol: WikiText-2 test text {text}, no special tokens; {} windows of n = {} context + m = {} continuation tokens from the start of the text, without overlap. The first n − 1 = {} context tokens are compressed; token n − 1 is fed uncompressed after the restored cache, so every one of the m continuation tokens, the first included, is scored against the compressed cache (teacher-forced, against the same window uncompressed).\n",
        show(w),
        show(n),
        show(m),
        n.map_or("?".to_string(), |n| n.saturating_sub(1).to_string()),
    );
}

fn fmt_p(p: Option<f64>) -> String {
    match p {
        Some(p) if p < 1e-4 => "<0.0001".into(),
        Some(p) => format!("{p:.4}"),
        None => "n/a".into(),
    }
}

fn fmt_opt(x: Option<f64>, digits: usize) -> String {
    x.map_or("n/a".into(), |x| format!("{x:.digits$}"))
}

fn fmt_bootstrap(ci: Option<stats::BootstrapCi>, scale: f64) -> String {
    ci.map_or("n/a".into(), |c| {
        format!("[{:+.2}, {:+.2}]", scale * c.lo, scale * c.hi)
    })
}

/// The model's paired perplexity comparisons, with their power.
fn ppl_diff_table(md: &mut String, diffs: &[PplDiff]) {
    if diffs.is_empty() {
        return;
    }
    let m = diffs.iter().filter(|d| d.p.is_some()).count();
    let _ = writeln!(
        md,
        "\nPaired perplexity differences (variant − reference, Δ% points per window; Holm over these {m} tests):\n"
    );
    md.push_str("| b | variant | reference | windows | mean Δ% diff | 95% paired bootstrap | p (paired t) | p (Holm) | SD | MDE 80% (α 0.05 / α/m) | windows for 80% power at this diff | verdict |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for d in diffs {
        let _ = writeln!(
            md,
            "| {} | {} {} | {} {} | {} | {:+.2} | {} | {} | {} | {} | {} / {} | {} | {} |",
            d.a.2.map_or("-".into(), |b| b.to_string()),
            d.a.0,
            d.a.1,
            d.r.0,
            d.r.1,
            d.windows,
            d.mean,
            fmt_bootstrap(d.ci, 1.0),
            fmt_p(d.p),
            fmt_p(d.p_holm),
            fmt_opt(d.sd, 2),
            fmt_opt(d.mde, 2),
            fmt_opt(d.mde_family, 2),
            d.windows_needed.map_or("n/a".into(), |n| n.to_string()),
            d.verdict()
        );
    }
    let decided = diffs
        .iter()
        .filter(|d| d.p_holm.is_some_and(|p| p < compare::ALPHA))
        .count();
    let mut mdes: Vec<f64> = diffs.iter().filter_map(|d| d.mde).collect();
    let _ = writeln!(
        md,
        "\n{decided} of {} comparisons decide at Holm p < 0.05. Power: the median MDE is {} points of Δ% (80% power, α = 0.05); a smaller true difference is likely to be missed at this window count.",
        diffs.len(),
        if mdes.is_empty() {
            "n/a".into()
        } else {
            format!("{:.2}", median(&mut mdes))
        }
    );
}

/// The model's paired NIAH comparisons, with their power.
fn niah_diff_table(md: &mut String, diffs: &[NiahDiff]) {
    if diffs.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "\nPaired NIAH comparisons (same haystacks; exact McNemar, Holm over these {} tests):\n",
        diffs.len()
    );
    md.push_str("| b | variant | reference | haystacks (seeds) | correct (variant / reference) | only variant / only reference | accuracy diff | 95% bootstrap over seeds | McNemar p | p (Holm) | MDE 80% | verdict |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for d in diffs {
        let _ = writeln!(
            md,
            "| {} | {} {} | {} {} | {} ({}) | {} / {} | {} / {} | {:+.1} pp | {} pp | {} | {} | {} | {} |",
            d.a.2.map_or("-".into(), |b| b.to_string()),
            d.a.0,
            d.a.1,
            d.r.0,
            d.r.1,
            d.haystacks,
            d.seeds,
            d.correct.0,
            d.correct.1,
            d.discordant.0,
            d.discordant.1,
            100.0 * d.diff,
            fmt_bootstrap(d.ci, 100.0),
            fmt_p(Some(d.p)),
            fmt_p(Some(d.p_holm)),
            d.mde
                .map_or("n/a".into(), |m| format!("{:.1} pp", 100.0 * m)),
            d.verdict()
        );
    }
    let m = diffs.len() as f64;
    let _ = writeln!(
        md,
        "\nPower: the exact McNemar test reaches p < 0.05 only with at least {} haystacks answered correctly by one of the two and not the other, all in one direction ({} at Holm's first step, α/{m}); MDE (80% power, α = 0.05) is from the per-haystack differences (n/a when no haystack is discordant).",
        compare::mcnemar_min_discordant(compare::ALPHA),
        compare::mcnemar_min_discordant(compare::ALPHA / m),
    );
}

/// One model's number for one of the seed's claims.
enum SeedRow {
    /// PPL Δ% at b = 0.5: tiered (KIVI) and PDTrim means with t-intervals, their paired difference.
    Ppl {
        model: String,
        tiered: (f64, Option<(f64, f64)>),
        pdtrim: (f64, Option<(f64, f64)>),
        diff: (f64, Option<(f64, f64)>),
        windows: usize,
    },
    /// Uniform INT4 PPL Δ% under KIVI and under lab-compat.
    Int4 {
        model: String,
        kivi: (f64, Option<(f64, f64)>),
        lab: (f64, Option<(f64, f64)>),
    },
    /// NIAH at b = 0.3: (correct, trials) of spectrum (KIVI) and of PDTrim.
    Niah {
        model: String,
        tiered: (u64, u64),
        pdtrim: (u64, u64),
    },
    /// TTFT cut of a tiered transfer vs FP16 (medians over `repeats` warm repeats).
    Ttft {
        model: String,
        link: String,
        cut: f64,
        repeats: usize,
    },
}

fn mean_ci((m, ci): (f64, Option<(f64, f64)>)) -> String {
    format!("{m:+.2}% {}", fmt_interval(ci))
}

/// "Seed claims beside ours": the seed's numbers, ours per model, and a verdict read off the
/// interval in the same row (the seed measured 7–8B models; ours are 135M–1.5B).
fn seed_claims(md: &mut String, rows: &[SeedRow]) -> Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    md.push_str("\n## Seed claims beside ours\n\nThe seed's numbers are for 7–8B models at its own contexts; a verdict is read off the interval in the same row (t over windows for PPL, Wilson for NIAH); TTFT cuts are medians of few repeats, with no interval, so they get no verdict.\n\n| claim (seed) | model | ours | verdict |\n| --- | --- | --- | --- |\n");
    let wilson = |(k, n): (u64, u64)| -> Result<(String, Option<(f64, f64)>)> {
        Ok((stats::wilson_rate(k, n, 0.95)?, stats::wilson(k, n, 0.95)?))
    };
    for row in rows {
        match row {
            SeedRow::Ppl {
                model,
                tiered,
                pdtrim,
                diff,
                windows,
            } => {
                let verdict = match diff.1 {
                    Some((_, hi)) if hi < 0.0 => "replicates (tiered better)",
                    Some((lo, _)) if lo > 0.0 => "does not replicate (PDTrim better)",
                    Some(_) => "inconclusive",
                    None => "no interval (1 window)",
                };
                let _ = writeln!(
                    md,
                    "| PPL Δ% at b = 0.5, {} | {model} | tiered {}, PDTrim {}; tiered − PDTrim {:+.2} points {} over {windows} windows | {verdict} |",
                    crate::seed::claims().spectrum.ppl_text(),
                    mean_ci(*tiered),
                    mean_ci(*pdtrim),
                    diff.0,
                    fmt_interval(diff.1)
                );
            }
            SeedRow::Int4 { model, kivi, lab } => {
                let verdict = match (kivi.1, lab.1) {
                    (Some((_, k_hi)), Some((l_lo, _))) if l_lo > k_hi => {
                        "lab-compat INT4 worse than per-channel keys"
                    }
                    (Some(_), Some(_)) => "intervals overlap",
                    _ => "no interval (1 window)",
                };
                let _ = writeln!(
                    md,
                    "| Qwen fails under INT4 (lab quantizer); per-channel keys are the cause we test | {model} | uniform INT4: KIVI {}, lab-compat {} | {verdict} |",
                    mean_ci(*kivi),
                    mean_ci(*lab)
                );
            }
            SeedRow::Niah {
                model,
                tiered,
                pdtrim,
            } => {
                let (t, tci) = wilson(*tiered)?;
                let (p, pci) = wilson(*pdtrim)?;
                let verdict = match (tci, pci) {
                    (Some((t_lo, _)), Some((_, p_hi))) if t_lo > p_hi => {
                        "replicates (tiered better)"
                    }
                    (Some((_, t_hi)), Some((p_lo, _))) if p_lo > t_hi => "does not replicate",
                    _ => "intervals overlap",
                };
                let _ = writeln!(
                    md,
                    "| NIAH at b = 0.3 (Qwen), tiered {:.1}% vs PDTrim {:.1}% | {model} | tiered {t}, PDTrim {p} | {verdict} |",
                    crate::seed::claims().spectrum.niah_pct.0,
                    crate::seed::claims().spectrum.niah_pct.1,
                );
            }
            SeedRow::Ttft {
                model,
                link,
                cut,
                repeats,
            } => {
                let _ = writeln!(
                    md,
                    "| TTFT cut {:.0}–{:.0}% at b = 0.5 | {model} ({link}) | {cut:+.1}% (medians of {repeats} repeat{}) | no test |",
                    crate::seed::claims().spectrum.ttft_cut_pct.0,
                    crate::seed::claims().spectrum.ttft_cut_pct.1,
                    if *repeats == 1 { "" } else { "s" }
                );
            }
        }
    }
    Ok(())
}
