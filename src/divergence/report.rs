//! Divergence-study report (`kvcredit divergence analyze RUN_DIR...`): per model × strategy ×
//! dtype, the divergence rate with its Wilson interval, the τ quartiles, accuracy ON/OFF with
//! Wilson intervals and an exact McNemar test, the teacher-forced flip rate with its interval,
//! and any Hugging Face reference (`hf-*.json` in a run dir) listed beside it. Reads the
//! `pairs.parquet` and `forced.parquet` of `kvcredit divergence run` (and `patches.parquet`,
//! `replay.parquet`, `drift.parquet` where present) through [`super::analysis`]; writes the
//! figures ([`super::figures`], PNG + SVG), then `report.md` atomically, with a "Figures"
//! section listing the ones written.
use super::analysis::*;
use crate::seed::DivergenceClaims;
use crate::stats::mcnemar_exact;
use crate::stats::{wilson, wilson_rate as rate};
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Write `out/report.md` for the run dirs (one per model); returns its path.
pub fn write_report(run_dirs: &[PathBuf], out: &Path, level: f64) -> Result<PathBuf> {
    let t = read_tables(run_dirs)?;
    let mut r = String::new();
    cell_table(&mut r, &t.cells, level)?;
    extra_sections(&mut r, &t, level)?;
    hf_section(&mut r, &t.hf, &t.cells, level)?;
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let figures = super::figures::write(&t, out, level)?;
    let _ = writeln!(r, "\n## Figures\n");
    let _ = writeln!(
        r,
        "Each as PNG and SVG beside this report; a figure whose table is absent is not drawn.\n"
    );
    for (stem, what) in &figures {
        let _ = writeln!(r, "- [`{stem}.png`]({stem}.png) (`{stem}.svg`): {what}");
    }
    let path = out.join("report.md");
    let tmp = out.join(".report.md.tmp");
    std::fs::write(&tmp, r).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
    Ok(path)
}

/// The title, how to read the intervals, and one row per model × strategy × dtype: divergence
/// rate, τ quartiles, accuracy ON and OFF, the discordant counts and McNemar's p.
fn cell_table(r: &mut String, cells: &Cells, level: f64) -> Result<()> {
    let pct = 100.0 * level;
    let _ = writeln!(r, "# Divergence report (cache-ON vs cache-OFF)\n");
    let _ = writeln!(
        r,
        "Intervals are {pct:.0}% Wilson; accuracy ON vs OFF by an exact two-sided McNemar test on the discordant problems. τ = first step where the two sequences differ, over diverged pairs.\n"
    );
    let _ = writeln!(
        r,
        "| model | strategy | dtype | diverged | τ median [q1, q3] | accuracy ON | accuracy OFF | ON-only / OFF-only | McNemar p |"
    );
    let _ = writeln!(r, "| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for ((model, strategy, dtype), c) in cells {
        let mut t = c.taus.clone();
        t.sort_unstable();
        let tau = if t.is_empty() {
            "none diverged".to_string()
        } else {
            format!(
                "{:.1} [{:.1}, {:.1}] (n={})",
                quantile(&t, 0.5),
                quantile(&t, 0.25),
                quantile(&t, 0.75),
                t.len()
            )
        };
        let _ = writeln!(
            r,
            "| {model} | {strategy} | {dtype} | {} | {tau} | {} | {} | {} / {} | {:.3} |",
            rate(c.diverged, c.n, level)?,
            rate(c.correct_on, c.n, level)?,
            rate(c.correct_off, c.n, level)?,
            c.on_only,
            c.off_only,
            mcnemar_exact(c.on_only, c.off_only)
        );
    }
    Ok(())
}

/// The Hugging Face references beside kvcredit's divergence rate over the same problems.
fn hf_section(r: &mut String, hf: &[HfFile], cells: &Cells, level: f64) -> Result<()> {
    if hf.is_empty() {
        return Ok(());
    }
    let _ = writeln!(r, "\n## Hugging Face reference\n");
    let _ = writeln!(
        r,
        "transformers loading the same GGUF, batch 1, on the same prompt ids (`benches/hf_divergence.py`); kvcredit's rate is over the same problems, read from this report's pairs.\n"
    );
    let _ = writeln!(
        r,
        "| file | model | dtype | strategy | problems | diverged (transformers) | diverged (kvcredit, same problems) |"
    );
    let _ = writeln!(r, "| --- | --- | --- | --- | --- | --- | --- |");
    for (p, text, models) in hf {
        let file = p
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into());
        let json: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::Output(format!("{}: {e}", p.display())))?;
        let problems: Vec<u64> = json["problems"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_u64()).collect())
            .unwrap_or_default();
        let runs = json["runs"].as_array().cloned().unwrap_or_default();
        for run in runs {
            let (k, n) = (run["diverged"].as_u64(), run["problems"].as_u64());
            let (Some(k), Some(n)) = (k, n) else {
                return Err(Error::Output(format!(
                    "{}: a run without `diverged` and `problems` counts",
                    p.display()
                )));
            };
            let (dtype, strategy) = (
                run["dtype"].as_str().unwrap_or("?"),
                run["strategy"].as_str().unwrap_or("?"),
            );
            for m in models {
                let key = (m.clone(), strategy.to_string(), dtype.to_string());
                let ours = match cells.get(&key) {
                    Some(c) if !problems.is_empty() => {
                        let flags: Vec<bool> = problems
                            .iter()
                            .filter_map(|q| c.by_problem.get(q).copied())
                            .collect();
                        let d = flags.iter().filter(|&&x| x).count() as u64;
                        rate(d, flags.len() as u64, level)?
                    }
                    _ => "not in these runs".into(),
                };
                // Overflowed logits make both paths agree on garbage: no rate then.
                let theirs = match run["non_finite"].as_u64().unwrap_or(0) {
                    0 => rate(k, n, level)?,
                    bad => format!("non-finite logits in {bad}/{n} pairs"),
                };
                let _ = writeln!(
                    r,
                    "| {file} | {m} | {dtype} | {strategy} | {n} | {theirs} | {ours} |"
                );
            }
        }
    }
    Ok(())
}

/// Teacher-forced, ratio, patching, replay and seed-claim sections.
fn extra_sections(r: &mut String, t: &Tables, level: f64) -> Result<()> {
    if !t.forced.is_empty() {
        forced_table(r, &t.forced, level)?;
        ratio_table(r, &t.forced, level);
    }
    if !t.patches.is_empty() {
        patch_table(r, &t.patches, level)?;
    }
    let informative = if t.replays.is_empty() {
        (0, 0)
    } else {
        replay_section(r, &t.replays, level)?
    };
    seed_claims(r, t, informative, level)
}

/// Teacher-forced means per model × dtype with their t intervals, and the flip rate.
fn forced_table(r: &mut String, forced: &Forced, level: f64) -> Result<()> {
    let pct = 100.0 * level;
    let _ = writeln!(r, "\n## Teacher-forced comparison\n");
    let _ = writeln!(
        r,
        "Means over problems (each problem weighs the same) with {pct:.0}% t intervals over problems (G − 1 df); flip rate with its Wilson interval over steps (steps of one sequence are not independent: that interval treats them as if they were).\n"
    );
    let _ = writeln!(
        r,
        "| model | dtype | problems | mean max abs Δlogit | mean MSE | mean KL(OFF‖ON) | flip rate over steps |"
    );
    let _ = writeln!(r, "| --- | --- | --- | --- | --- | --- | --- |");
    for ((model, dtype), c) in forced {
        let g = c.problem_means(0).len();
        let _ = writeln!(
            r,
            "| {model} | {dtype} | {g} | {} | {} | {} | {} |",
            mean_t(c, 0, level)?,
            mean_t(c, 1, level)?,
            mean_t(c, 2, level)?,
            rate(c.flips, c.steps, level)?
        );
    }
    Ok(())
}

/// Dtype ratios (fp16/fp32, bf16/fp32, bf16/fp16) of the teacher-forced means per model, with
/// paired bootstrap intervals.
fn ratio_table(r: &mut String, forced: &Forced, level: f64) {
    let pct = 100.0 * level;
    let _ = writeln!(r, "\n## Dtype ratios of the teacher-forced means\n");
    let _ = writeln!(
        r,
        "Ratio of means over the problems both dtypes have, {pct:.0}% percentile bootstrap over problems ({BOOT_REPS} draws, paired). The seed's \"eight orders of magnitude\" fits a squared metric (MSE), not max abs Δ (fp16 vs fp32 rounding is ≈ 2^13).\n"
    );
    let _ = writeln!(
        r,
        "| model | ratio | {} | {} | {} |",
        METRICS[0], METRICS[1], METRICS[2]
    );
    let _ = writeln!(r, "| --- | --- | --- | --- | --- |");
    let models: std::collections::BTreeSet<&String> = forced.keys().map(|k| &k.0).collect();
    for m in models {
        let get = |d: &str| forced.get(&(m.clone(), d.to_string()));
        for (a, b) in [("fp16", "fp32"), ("bf16", "fp32"), ("bf16", "fp16")] {
            let (ca, cb) = (get(a), get(b));
            let cols: Vec<String> = match (ca, cb) {
                (Some(ca), Some(cb)) => (0..3)
                    .map(|i| {
                        fmt_ratio(ratio_boot(
                            &ca.problem_means(i),
                            &cb.problem_means(i),
                            level,
                        ))
                    })
                    .collect(),
                _ => {
                    let missing = if cb.is_none() { b } else { a };
                    vec![format!("{missing} missing"); 3]
                }
            };
            let _ = writeln!(
                r,
                "| {m} | {a}/{b} | {} | {} | {} |",
                cols[0], cols[1], cols[2]
            );
        }
    }
}

/// Residual-stream patching at τ: immediate and trajectory recovery per layer set.
fn patch_table(r: &mut String, patches: &[PatchRow], level: f64) -> Result<()> {
    let pct = 100.0 * level;
    let _ = writeln!(r, "\n## Residual-stream patching at τ\n");
    let _ = writeln!(
        r,
        "Over problems whose rebuilt states reproduce the divergence (`reproduced`). Immediate recovery: the patched step's greedy token is cache-OFF's. Trajectory recovery: the whole continuation of k tokens follows cache-OFF. {pct:.0}% Wilson intervals over problems.\n"
    );
    let _ = writeln!(
        r,
        "| model | dtype | layer set | reproduced | immediate recovery | trajectory recovery |"
    );
    let _ = writeln!(r, "| --- | --- | --- | --- | --- | --- |");
    let mut groups: BTreeMap<PatchKey, Vec<&PatchRow>> = BTreeMap::new();
    for p in patches {
        let wide = p.layers.1 - p.layers.0 > 1;
        groups
            .entry((
                p.model.clone(),
                p.dtype.clone(),
                p.label != "control",
                wide,
                p.layers.0,
                p.layers.1,
                p.label.clone(),
            ))
            .or_default()
            .push(p);
    }
    for ((model, dtype, _, _, _, _, label), rows) in &groups {
        let rep: Vec<&&PatchRow> = rows.iter().filter(|p| p.reproduced).collect();
        let n = rep.len() as u64;
        let imm = rep.iter().filter(|p| p.immediate()).count() as u64;
        let traj = rep.iter().filter(|p| p.trajectory()).count() as u64;
        let _ = writeln!(
            r,
            "| {model} | {dtype} | {label} | {n}/{} | {} | {} |",
            rows.len(),
            rate(imm, n, level)?,
            rate(traj, n, level)?
        );
    }
    Ok(())
}

/// Live vs replay and the KV transplants per construction; returns the informative boundaries'
/// (all-layer K+V transplants following the donor, transplants) counts.
fn replay_section(r: &mut String, replays: &[ReplayRow], level: f64) -> Result<(u64, u64)> {
    let pct = 100.0 * level;
    let mut informative = (0u64, 0u64);
    let _ = writeln!(r, "\n## Live vs replay and KV transplants\n");
    let _ = writeln!(
        r,
        "Per construction (replay chunk; 0 = one shot) or transplant (direction base<-donor, buffers, layers): replicas bitwise equal, continuation equal to LIVE's and, for transplants, to the donor's own; {pct:.0}% Wilson intervals over (problem, boundary) rows.\n"
    );
    let _ = writeln!(
        r,
        "| model | dtype | kind | chunk / transplant | rows | replica equal | follows LIVE | follows donor |"
    );
    let _ = writeln!(r, "| --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut groups: BTreeMap<ReplayKey, Vec<&ReplayRow>> = BTreeMap::new();
    for x in replays {
        groups
            .entry((
                x.model.clone(),
                x.dtype.clone(),
                x.kind.clone(),
                x.chunk,
                x.direction.clone(),
                x.parts.clone(),
                x.layers.0,
                x.layers.1,
            ))
            .or_default()
            .push(x);
    }
    for ((model, dtype, kind, chunk, direction, parts, l0, l1), rows) in &groups {
        let n = rows.len() as u64;
        let eq = rows.iter().filter(|x| x.replica_equal).count() as u64;
        let fl = rows.iter().filter(|x| x.follows_live).count() as u64;
        let what = if kind == "transplant" {
            format!("{direction} {parts} {l0}..{l1}")
        } else if *chunk < 0 {
            "-".into()
        } else {
            format!("chunk {chunk}")
        };
        let donor = if kind == "transplant" {
            rate(
                rows.iter().filter(|x| x.follows_donor()).count() as u64,
                n,
                level,
            )?
        } else {
            "-".into()
        };
        let _ = writeln!(
            r,
            "| {model} | {dtype} | {kind} | {what} | {n} | {} | {} | {donor} |",
            rate(eq, n, level)?,
            rate(fl, n, level)?
        );
    }
    // Donor-following where it can tell: boundaries whose one-shot REPLAY differs from LIVE.
    let differ: std::collections::BTreeSet<(&str, &str, u32, i64)> = replays
        .iter()
        .filter(|x| x.kind == "replay" && x.chunk == 0 && !x.follows_live)
        .map(|x| (x.model.as_str(), x.dtype.as_str(), x.problem, x.boundary))
        .collect();
    for x in replays.iter().filter(|x| {
        x.kind == "transplant"
            && x.parts == "kv"
            && x.layers.0 == 0
            && differ.contains(&(x.model.as_str(), x.dtype.as_str(), x.problem, x.boundary))
    }) {
        let full = replays
            .iter()
            .filter(|y| {
                y.model == x.model
                    && y.dtype == x.dtype
                    && y.kind == "transplant"
                    && y.parts == "kv"
            })
            .map(|y| y.layers.1)
            .max()
            == Some(x.layers.1);
        if full {
            informative.0 += u64::from(x.follows_donor());
            informative.1 += 1;
        }
    }
    let _ = writeln!(
        r,
        "\nInformative boundaries (one-shot REPLAY's continuation ≠ LIVE's): {}; all-layer K+V transplants there follow the donor in {}.",
        differ.len(),
        rate(informative.0, informative.1, level)?
    );
    Ok(informative)
}

/// The seed's claims, one a row, beside our matching number.
fn seed_claims(r: &mut String, t: &Tables, informative: (u64, u64), level: f64) -> Result<()> {
    let seed = &crate::seed::claims().divergence;
    let _ = writeln!(r, "\n## Seed claims beside ours\n");
    let _ = writeln!(
        r,
        "The seed measured 7B/2B models (LLaMA-2-7B, Mistral-7B-v0.3, Gemma-2-2B); ours are 135M–1.5B (SmolLM2-135M, Gemma-3-270M, Qwen2.5-Coder-0.5B and -1.5B). A verdict is read off the interval or test in the same row.\n"
    );
    let _ = writeln!(r, "| seed claim | ours | verdict |");
    let _ = writeln!(r, "| --- | --- | --- |");
    claim_fp16(r, seed, &t.cells, level)?;
    claim_on_better(r, seed, &t.cells, level);
    claim_fp32(r, seed, &t.forced, level)?;
    claim_drift(r, &t.drift);
    claim_patching(r, &t.patches, level)?;
    claim_transplant(r, informative, level)
}

/// Seed: 100% fp16 divergence under every strategy, greedy included.
fn claim_fp16(r: &mut String, seed: &DivergenceClaims, cells: &Cells, level: f64) -> Result<()> {
    let fp16_rate = seed.fp16_divergence_pct / 100.0;
    let fp16: Vec<(&(String, String, String), &Cell)> =
        cells.iter().filter(|(k, _)| k.2 == "fp16").collect();
    let (ours, verdict) = if fp16.is_empty() {
        ("no fp16 pairs".to_string(), "not measured")
    } else {
        let mut parts = vec![];
        let mut all_contain = true;
        for ((m, s, _), c) in &fp16 {
            let hi = wilson(c.diverged, c.n, level)?.map_or(0.0, |x| x.1);
            all_contain &= hi >= fp16_rate - 1e-12;
            parts.push(format!("{m} {s}: {}", rate(c.diverged, c.n, level)?));
        }
        (
            parts.join("; "),
            if all_contain {
                "replicates"
            } else {
                "does not replicate"
            },
        )
    };
    let _ = writeln!(
        r,
        "| {:.0}% fp16 divergence under every strategy, greedy included | {ours} | {verdict} |",
        seed.fp16_divergence_pct
    );
    Ok(())
}

/// Seed: cache-ON more accurate in most conditions (a sign test over the conditions).
fn claim_on_better(r: &mut String, seed: &DivergenceClaims, cells: &Cells, level: f64) {
    let (on_better, off_better, ties) = cells.values().fold((0u64, 0u64, 0u64), |(a, b, t), c| {
        match c.correct_on.cmp(&c.correct_off) {
            std::cmp::Ordering::Greater => (a + 1, b, t),
            std::cmp::Ordering::Less => (a, b + 1, t),
            std::cmp::Ordering::Equal => (a, b, t + 1),
        }
    });
    let significant = cells
        .values()
        .filter(|c| mcnemar_exact(c.on_only, c.off_only) < 1.0 - level)
        .count();
    let p_sign = mcnemar_exact(on_better, off_better);
    let (k, of) = seed.on_better;
    let v2 = if on_better * of >= k * (on_better + off_better + ties) && p_sign < 1.0 - level {
        "replicates"
    } else {
        "does not replicate"
    };
    let _ = writeln!(
        r,
        "| cache-ON more accurate in {k} of {of} conditions | ON better in {on_better} of {} conditions (OFF better {off_better}, ties {ties}); sign test p = {p_sign:.3}; conditions with McNemar p < {:.2}: {significant} | {v2} |",
        cells.len(),
        1.0 - level
    );
}

/// Seed: fp32 flips exactly as often as the seed says, and reduces divergence by its orders of
/// magnitude (MSE fp16/fp32).
fn claim_fp32(r: &mut String, seed: &DivergenceClaims, forced: &Forced, level: f64) -> Result<()> {
    const WORDS: [&str; 13] = [
        "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve",
    ];
    let orders = WORDS
        .get(seed.fp32_orders as usize)
        .map_or_else(|| seed.fp32_orders.to_string(), |w| w.to_string());
    let magnitude = 10f64.powi(seed.fp32_orders as i32);
    let fp32: Vec<(&String, &ForcedCell)> = forced
        .iter()
        .filter(|(k, _)| k.1 == "fp32")
        .map(|(k, c)| (&k.0, c))
        .collect();
    if fp32.is_empty() {
        let _ = writeln!(
            r,
            "| fp32 flip rate exactly {:.1}% | fp32 missing | not measured |",
            seed.fp32_flip_pct
        );
        let _ = writeln!(
            r,
            "| fp32 reduces divergence by {orders} orders of magnitude | fp32 missing (bf16/fp16 ratios above) | not measured |"
        );
    } else {
        let mut parts = vec![];
        let mut zero = true;
        for (m, c) in &fp32 {
            zero &= c.flips as f64 <= seed.fp32_flip_pct / 100.0 * c.steps as f64;
            parts.push(format!("{m}: {}", rate(c.flips, c.steps, level)?));
        }
        let v = if zero {
            "replicates"
        } else {
            "does not replicate"
        };
        let _ = writeln!(
            r,
            "| fp32 flip rate exactly {:.1}% | {} | {v} |",
            seed.fp32_flip_pct,
            parts.join("; ")
        );
        let mut parts = vec![];
        let mut eight = true;
        for (m, c32) in &fp32 {
            if let Some(c16) = forced.get(&((*m).clone(), "fp16".into())) {
                let rb = ratio_boot(&c16.problem_means(1), &c32.problem_means(1), level);
                eight &= rb
                    .and_then(|x| x.1)
                    .is_some_and(|(lo, hi)| lo <= magnitude && hi >= magnitude / 10.0);
                parts.push(format!("{m} MSE fp16/fp32: {}", fmt_ratio(rb)));
            }
        }
        let v = if parts.is_empty() {
            "not measured"
        } else if eight {
            "replicates"
        } else {
            "does not replicate"
        };
        let _ = writeln!(
            r,
            "| fp32 reduces divergence by {orders} orders of magnitude | {} | {v} |",
            parts.join("; ")
        );
    }
    Ok(())
}

/// Seed: the layer-wise drift pattern (listed, not tested).
fn claim_drift(r: &mut String, drift: &Drift) {
    let drift_txt = if drift.is_empty() {
        ("drift.parquet absent".to_string(), "not measured")
    } else {
        let parts: Vec<String> = drift
            .iter()
            .map(|((m, d), v)| {
                let first = v.first().copied().unwrap_or(f64::NAN);
                let last = v.last().copied().unwrap_or(f64::NAN);
                format!("{m} {d}: layer-0 {first:.2e}, last {last:.2e}")
            })
            .collect();
        (parts.join("; "), "see drift figure (no test)")
    };
    let _ = writeln!(
        r,
        "| GQA models spike at the first layer; Gemma accumulates uniformly | {} | {} |",
        drift_txt.0, drift_txt.1
    );
}

/// Seed: patching the whole residual stream does not recover the cache-free trajectory.
fn claim_patching(r: &mut String, patches: &[PatchRow], level: f64) -> Result<()> {
    let all: Vec<&PatchRow> = patches
        .iter()
        .filter(|p| p.label == "all" && p.reproduced)
        .collect();
    let traj = all.iter().filter(|p| p.trajectory()).count() as u64;
    let n = all.len() as u64;
    let v5 = if n == 0 {
        "not measured"
    } else if traj == 0 {
        "replicates"
    } else {
        "does not replicate"
    };
    let _ = writeln!(
        r,
        "| patching the entire residual stream fails to recover the cache-free trajectory | all-layer patch, trajectory recovered: {} | {v5} |",
        rate(traj, n, level)?
    );
    Ok(())
}

/// Seed: divergence follows the KV cache (all-layer K+V transplants at informative boundaries).
fn claim_transplant(r: &mut String, informative: (u64, u64), level: f64) -> Result<()> {
    let v6 = if informative.1 == 0 {
        "not measured (REPLAY = LIVE at every boundary)"
    } else {
        match wilson(informative.0, informative.1, level)? {
            Some((lo, _)) if lo > 0.5 => "replicates",
            Some((_, hi)) if hi < 0.5 => "does not replicate",
            _ => "inconclusive (interval straddles 50%)",
        }
    };
    let _ = writeln!(
        r,
        "| stage-replay divergence follows the KV cache (transplanted KV carries the donor's continuation) | all-layer K+V transplants following the donor at informative boundaries: {} | {v6} |",
        rate(informative.0, informative.1, level)?
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_bootstrap_is_paired_over_common_problems() {
        // Problem 2 only in `a`: left out. Every problem has ratio 3 → a point interval.
        let a: BTreeMap<u64, f64> = [(0, 3.0), (1, 9.0), (2, 100.0)].into();
        let b: BTreeMap<u64, f64> = [(0, 1.0), (1, 3.0)].into();
        let (p, ci, g) = ratio_boot(&a, &b, 0.95).unwrap();
        assert_eq!(g, 2);
        assert!((p - 3.0).abs() < 1e-12);
        let (lo, hi) = ci.unwrap();
        assert!((lo - 3.0).abs() < 1e-12 && (hi - 3.0).abs() < 1e-12);
        assert!(ratio_boot(&a, &BTreeMap::new(), 0.95).is_none());
        assert_eq!(fmt_ratio(None), "no common problems");
    }
}
