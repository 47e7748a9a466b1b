//! `kvcredit spectrum report`: one Markdown report over run folders (one per model) from the
//! grids' journals (`ppl.rows.jsonl`, `niah.rows.jsonl`): PPL Δ% per variant with a t-interval
//! over windows, the paired tiered − PDTrim difference at b = 0.5, and NIAH accuracy with
//! Wilson intervals.
use super::eval::{NiahRow, PplRow};
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

/// Per-window Δ% of one row.
pub fn window_delta(r: &PplRow) -> f64 {
    100.0 * (((r.nll - r.nll_base) / r.tokens as f64).exp() - 1.0)
}

fn interval(values: &[f64], windows: &[u64]) -> Result<String> {
    let t = stats::cluster_mean_t(values, windows)?;
    Ok(match t.confidence_interval(0.95)? {
        Some((lo, hi)) => format!("[{lo:+.2}, {hi:+.2}]"),
        None => "n/a (1 window)".into(),
    })
}

fn key(policy: &str, q: &str, b: Option<f64>) -> String {
    format!("{policy} {q} b={}", b.map_or("-".into(), |b| b.to_string()))
}

/// The report of `dirs` as Markdown; written to `out/report.md`.
pub fn report(dirs: &[PathBuf], out: &Path) -> Result<String> {
    let mut md = String::from("# SpectrumKV report\n");
    for dir in dirs {
        let ppl_path = dir.join("ppl.rows.jsonl");
        let ppl: Vec<PplRow> = if ppl_path.exists() {
            read_journal(&ppl_path)?
        } else {
            Vec::new()
        };
        let niah_path = dir.join("niah.rows.jsonl");
        let niah: Vec<NiahRow> = if niah_path.exists() {
            read_journal(&niah_path)?
        } else {
            Vec::new()
        };
        let _ = writeln!(md, "\n## {}\n", dir.display());
        if !ppl.is_empty() {
            md.push_str("| variant | windows | Δ% pooled | mean per-window Δ% | 95% t-interval | b_real | shared |\n| --- | --- | --- | --- | --- | --- | --- |\n");
            let mut keys: Vec<(String, String, Option<f64>)> = Vec::new();
            for r in &ppl {
                let k = (r.policy.clone(), r.quantizer.clone(), r.b);
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
            for (p, q, b) in &keys {
                let mine: Vec<&PplRow> = ppl
                    .iter()
                    .filter(|r| &r.policy == p && &r.quantizer == q && r.b == *b)
                    .collect();
                let (_, _, pooled, _, b_real) = super::eval::ppl_summary(&mine);
                let d: Vec<f64> = mine.iter().map(|r| window_delta(r)).collect();
                let w: Vec<u64> = mine.iter().map(|r| r.window as u64).collect();
                let _ = writeln!(
                    md,
                    "| {} | {} | {pooled:+.2} | {:+.2} | {} | {b_real:.4} | {} |",
                    key(p, q, *b),
                    mine.len(),
                    d.iter().sum::<f64>() / d.len() as f64,
                    interval(&d, &w)?,
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
            }
        }
        if !niah.is_empty() {
            md.push_str("\n| NIAH variant | correct | n | accuracy | 95% Wilson | prompt |\n| --- | --- | --- | --- | --- | --- |\n");
            let mut keys: Vec<(String, String, Option<f64>)> = Vec::new();
            for r in &niah {
                let k = (r.policy.clone(), r.quantizer.clone(), r.b);
                if !keys.contains(&k) {
                    keys.push(k);
                }
            }
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
        }
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    crate::io::write_atomic(&out.join("report.md"), md.as_bytes())?;
    Ok(md)
}
