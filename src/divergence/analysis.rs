//! The divergence study's tables as the report reads them: per-cell counts from
//! `pairs.parquet`, teacher-forced metrics, patch, replay and drift rows, and the statistics
//! over them (exact McNemar, paired bootstrap of ratios) that the report and its figures share.
use crate::io::frame::Frame;
use crate::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One model × strategy × dtype cell of the report.
#[derive(Debug, Clone, PartialEq)]
pub struct Cell {
    /// Problems with a pair.
    pub n: u64,
    /// Pairs whose sequences differ.
    pub diverged: u64,
    /// First-divergence steps of the diverged pairs.
    pub taus: Vec<usize>,
    /// Correct answers of cache-ON.
    pub correct_on: u64,
    /// Correct answers of cache-OFF.
    pub correct_off: u64,
    /// Problems correct ON only (McNemar's b).
    pub on_only: u64,
    /// Problems correct OFF only (McNemar's c).
    pub off_only: u64,
    /// Per problem: whether its pair diverged.
    pub by_problem: BTreeMap<u64, bool>,
}

pub(super) type Cells = BTreeMap<(String, String, String), Cell>;

/// Quantile `q` of sorted values (linear interpolation).
pub(super) fn quantile(sorted: &[usize], q: f64) -> f64 {
    let h = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (h.floor() as usize, h.ceil() as usize);
    sorted[lo] as f64 + (h - lo as f64) * (sorted[hi] as f64 - sorted[lo] as f64)
}

pub(super) fn first_difference(a: &[i64], b: &[i64]) -> Option<usize> {
    super::lockstep::first_difference(a, b)
}

/// Read the cells of one run dir's `pairs.parquet`, keyed by (model, strategy, dtype).
pub fn read_cells(dir: &Path) -> Result<BTreeMap<(String, String, String), Cell>> {
    let path = dir.join("pairs.parquet");
    let cols = [
        "model",
        "dtype",
        "strategy",
        "problem",
        "tokens_on",
        "tokens_off",
        "correct_on",
        "correct_off",
    ];
    let f = Frame::read(&path, &cols)?;
    let (model, dtype, strategy) = (
        f.strings("model")?,
        f.strings("dtype")?,
        f.strings("strategy")?,
    );
    let problem = f.u32s("problem")?;
    let (on, off) = (f.int_lists("tokens_on")?, f.int_lists("tokens_off")?);
    let (ok_on, ok_off) = (f.bools("correct_on")?, f.bools("correct_off")?);
    let mut cells: BTreeMap<(String, String, String), Cell> = BTreeMap::new();
    for j in 0..f.len() {
        let c = cells
            .entry((model[j].clone(), strategy[j].clone(), dtype[j].clone()))
            .or_insert(Cell {
                n: 0,
                diverged: 0,
                taus: vec![],
                correct_on: 0,
                correct_off: 0,
                on_only: 0,
                off_only: 0,
                by_problem: BTreeMap::new(),
            });
        c.n += 1;
        let tau = first_difference(&on[j], &off[j]);
        if let Some(t) = tau {
            c.diverged += 1;
            c.taus.push(t);
        }
        c.by_problem.insert(u64::from(problem[j]), tau.is_some());
        c.correct_on += u64::from(ok_on[j]);
        c.correct_off += u64::from(ok_off[j]);
        c.on_only += u64::from(ok_on[j] && !ok_off[j]);
        c.off_only += u64::from(ok_off[j] && !ok_on[j]);
    }
    Ok(cells)
}

/// Per-problem teacher-forced metrics of one (model, dtype): problem → (max|Δ|, MSE, KL) means.
pub(super) type Forced = BTreeMap<(String, String), ForcedCell>;

/// Teacher-forced rows of one model × dtype.
#[derive(Debug, Clone, Default)]
pub(super) struct ForcedCell {
    pub(super) flips: u64,
    pub(super) steps: u64,
    /// Per row: problem id and (max|Δlogit|, MSE, KL).
    pub(super) rows: Vec<(u64, [f64; 3])>,
    /// Per row: generated-token position and whether the argmax flipped (empty when the table
    /// has no `step` column).
    pub(super) flip_at: Vec<(i64, bool)>,
}

impl ForcedCell {
    /// Per-problem means of metric `i`, ascending problem id.
    pub(crate) fn problem_means(&self, i: usize) -> BTreeMap<u64, f64> {
        let mut acc: BTreeMap<u64, (f64, usize)> = BTreeMap::new();
        for (p, v) in &self.rows {
            let e = acc.entry(*p).or_default();
            e.0 += v[i];
            e.1 += 1;
        }
        acc.into_iter()
            .map(|(p, (s, n))| (p, s / n as f64))
            .collect()
    }
}

pub(super) const METRICS: [&str; 3] = ["max abs Δlogit", "MSE", "KL(OFF‖ON)"];
pub(super) const BOOT_REPS: usize = 2000;
pub(super) const BOOT_SEED: u64 = 0x005E_EDB0;

pub(super) fn read_forced(dir: &Path) -> Result<Forced> {
    let path = dir.join("forced.parquet");
    let mut out = Forced::new();
    if !path.exists() {
        return Ok(out);
    }
    let cols = [
        "model",
        "dtype",
        "problem",
        "max_abs",
        "mse",
        "kl_off_on",
        "flip",
    ];
    let f = Frame::read_optional(&path, &cols, &["step"])?;
    let (model, dtype, flip) = (f.strings("model")?, f.strings("dtype")?, f.bools("flip")?);
    let problem = f.u32s("problem")?;
    let step = if f.has("step") {
        Some(f.i64s("step")?)
    } else {
        None
    };
    let (ma, mse, kl) = (f.f64s("max_abs")?, f.f64s("mse")?, f.f64s("kl_off_on")?);
    for j in 0..f.len() {
        let e = out.entry((model[j].clone(), dtype[j].clone())).or_default();
        e.flips += u64::from(flip[j]);
        e.steps += 1;
        e.rows.push((u64::from(problem[j]), [ma[j], mse[j], kl[j]]));
        if let Some(s) = &step {
            e.flip_at.push((s[j], flip[j]));
        }
    }
    Ok(out)
}

/// Mean over problems (each weighs the same) with its t interval over problems.
pub(super) fn mean_t(c: &ForcedCell, i: usize, level: f64) -> Result<String> {
    let (v, g): (Vec<f64>, Vec<u64>) = c.rows.iter().map(|(p, x)| (x[i], *p)).unzip();
    let t = crate::stats::cluster_mean_t(&v, &g)?;
    Ok(match t.confidence_interval(level)? {
        Some((lo, hi)) => format!("{:.3e} [{lo:.3e}, {hi:.3e}]", t.estimate),
        None => format!("{:.3e} (one problem)", t.estimate),
    })
}

/// A ratio, its interval (if any draw is finite) and the problems it is over.
pub(super) type Ratio = (f64, Option<(f64, f64)>, usize);

/// Patch rows grouped by model, dtype, sort keys and label.
pub(super) type PatchKey = (String, String, bool, bool, i64, i64, String);
/// Replay rows grouped by model, dtype, kind, chunk, direction, parts and layers.
pub(super) type ReplayKey = (String, String, String, i64, String, String, i64, i64);

/// Ratio of means over problems `a / b` on the problems both have, with a percentile
/// bootstrap over problems (paired: one draw picks a problem for both).
pub(super) fn ratio_boot(
    a: &BTreeMap<u64, f64>,
    b: &BTreeMap<u64, f64>,
    level: f64,
) -> Option<Ratio> {
    let common: Vec<(f64, f64)> = a
        .iter()
        .filter_map(|(p, x)| b.get(p).map(|y| (*x, *y)))
        .collect();
    let g = common.len();
    if g == 0 {
        return None;
    }
    let ratio = |it: &mut dyn Iterator<Item = (f64, f64)>| {
        let (sa, sb) = it.fold((0.0, 0.0), |(sa, sb), (x, y)| (sa + x, sb + y));
        sa / sb
    };
    let point = ratio(&mut common.iter().copied());
    let mut rng = crate::stats::SplitMix64::new(BOOT_SEED);
    let mut reps: Vec<f64> = (0..BOOT_REPS)
        .map(|_| ratio(&mut (0..g).map(|_| common[rng.below(g)])))
        .filter(|r| r.is_finite())
        .collect();
    reps.sort_by(f64::total_cmp);
    let ci = (!reps.is_empty()).then(|| {
        let q = |p: f64| {
            let h = p * (reps.len() - 1) as f64;
            let (lo, hi) = (h.floor() as usize, h.ceil() as usize);
            reps[lo] + (h - lo as f64) * (reps[hi] - reps[lo])
        };
        let a = (1.0 - level) / 2.0;
        (q(a), q(1.0 - a))
    });
    Some((point, ci, g))
}

/// Three significant digits, plain or scientific by size.
pub(super) fn sig(x: f64) -> String {
    if x != 0.0 && (x.abs() >= 1e4 || x.abs() < 1e-2) {
        format!("{x:.2e}")
    } else {
        format!("{x:.3}")
    }
}

pub(super) fn fmt_ratio(r: Option<Ratio>) -> String {
    match r {
        None => "no common problems".into(),
        Some((p, Some((lo, hi)), g)) if p.is_finite() => {
            format!("{} [{}, {}] (G={g})", sig(p), sig(lo), sig(hi))
        }
        Some((p, _, g)) => format!("{p} (G={g}; interval undefined)"),
    }
}

/// One `patches.parquet` row, reduced.
#[derive(Debug, Clone)]
pub(super) struct PatchRow {
    pub(super) model: String,
    pub(super) dtype: String,
    pub(super) label: String,
    pub(super) layers: (i64, i64),
    pub(super) reproduced: bool,
    pub(super) off_prefix: i64,
    pub(super) k: usize,
}

impl PatchRow {
    /// The patched step's greedy token is cache-OFF's.
    pub(super) fn immediate(&self) -> bool {
        self.off_prefix >= 1
    }

    /// The whole continuation of k tokens follows cache-OFF.
    pub(super) fn trajectory(&self) -> bool {
        self.k > 0 && self.off_prefix as usize >= self.k
    }
}

pub(super) fn read_patches(dir: &Path) -> Result<Vec<PatchRow>> {
    let path = dir.join("patches.parquet");
    if !path.exists() {
        return Ok(vec![]);
    }
    let cols = [
        "model",
        "dtype",
        "label",
        "layer_start",
        "layer_end",
        "reproduced",
        "off_prefix",
        "continuation",
    ];
    let f = Frame::read(&path, &cols)?;
    let (model, dtype, label) = (
        f.strings("model")?,
        f.strings("dtype")?,
        f.strings("label")?,
    );
    let (ls, le) = (f.i64s("layer_start")?, f.i64s("layer_end")?);
    let (rep, op, cont) = (
        f.bools("reproduced")?,
        f.i64s("off_prefix")?,
        f.int_lists("continuation")?,
    );
    Ok((0..f.len())
        .map(|j| PatchRow {
            model: model[j].clone(),
            dtype: dtype[j].clone(),
            label: label[j].clone(),
            layers: (ls[j], le[j]),
            reproduced: rep[j],
            off_prefix: op[j],
            k: cont[j].len(),
        })
        .collect())
}

/// One `replay.parquet` row, reduced.
#[derive(Debug, Clone)]
pub(super) struct ReplayRow {
    pub(super) model: String,
    pub(super) dtype: String,
    pub(super) problem: u32,
    pub(super) boundary: i64,
    pub(super) kind: String,
    pub(super) chunk: i64,
    pub(super) direction: String,
    pub(super) parts: String,
    pub(super) layers: (i64, i64),
    pub(super) replica_equal: bool,
    pub(super) follows_live: bool,
    pub(super) follows_replay: bool,
}

impl ReplayRow {
    /// Transplant continuation equals its donor's own (LIVE's donor is REPLAY and back).
    pub(super) fn follows_donor(&self) -> bool {
        if self.direction.starts_with("live<-") {
            self.follows_replay
        } else {
            self.follows_live
        }
    }
}

pub(super) fn read_replay(dir: &Path) -> Result<Vec<ReplayRow>> {
    let path = dir.join("replay.parquet");
    if !path.exists() {
        return Ok(vec![]);
    }
    let cols = [
        "model",
        "dtype",
        "problem",
        "boundary",
        "kind",
        "chunk",
        "direction",
        "parts",
        "layer_start",
        "layer_end",
        "replica_equal",
        "follows_live",
        "follows_replay",
    ];
    let f = Frame::read(&path, &cols)?;
    let (model, dtype, kind) = (f.strings("model")?, f.strings("dtype")?, f.strings("kind")?);
    let (dir_, parts) = (f.strings("direction")?, f.strings("parts")?);
    let (problem, boundary, chunk) = (f.u32s("problem")?, f.i64s("boundary")?, f.i64s("chunk")?);
    let (ls, le) = (f.i64s("layer_start")?, f.i64s("layer_end")?);
    let (eq, fl, fr) = (
        f.bools("replica_equal")?,
        f.bools("follows_live")?,
        f.bools("follows_replay")?,
    );
    Ok((0..f.len())
        .map(|j| ReplayRow {
            model: model[j].clone(),
            dtype: dtype[j].clone(),
            problem: problem[j],
            boundary: boundary[j],
            kind: kind[j].clone(),
            chunk: chunk[j],
            direction: dir_[j].clone(),
            parts: parts[j].clone(),
            layers: (ls[j], le[j]),
            replica_equal: eq[j],
            follows_live: fl[j],
            follows_replay: fr[j],
        })
        .collect())
}

/// Per (model, dtype): the mean relative residual drift of each layer.
pub(super) type Drift = BTreeMap<(String, String), Vec<f64>>;

/// Per layer drift of one run dir: (model, dtype) → per layer mean relative residual drift.
pub(super) fn read_drift(dir: &Path) -> Result<Drift> {
    let path = dir.join("drift.parquet");
    let mut out = BTreeMap::new();
    if !path.exists() {
        return Ok(out);
    }
    let f = Frame::read(&path, &["model", "dtype", "layer", "resid_rel"])?;
    let (model, dtype) = (f.strings("model")?, f.strings("dtype")?);
    let (layer, rel) = (f.i64s("layer")?, f.f64s("resid_rel")?);
    let mut acc: BTreeMap<(String, String), Vec<(f64, usize)>> = BTreeMap::new();
    for j in 0..f.len() {
        let v = acc.entry((model[j].clone(), dtype[j].clone())).or_default();
        let l = layer[j].max(0) as usize;
        if v.len() <= l {
            v.resize(l + 1, (0.0, 0));
        }
        if rel[j].is_finite() {
            v[l].0 += rel[j];
            v[l].1 += 1;
        }
    }
    for (k, v) in acc {
        out.insert(
            k,
            v.into_iter()
                .map(|(s, n)| if n == 0 { f64::NAN } else { s / n as f64 })
                .collect(),
        );
    }
    Ok(out)
}

/// A Hugging Face reference file (`hf-*.json`) of a run dir: its path, its text and the models
/// of the run dir's pairs it is set beside.
pub(super) type HfFile = (PathBuf, String, Vec<String>);

/// Every table of the run dirs, read and reduced.
pub(super) struct Tables {
    pub(super) cells: Cells,
    pub(super) forced: Forced,
    pub(super) patches: Vec<PatchRow>,
    pub(super) replays: Vec<ReplayRow>,
    pub(super) drift: Drift,
    pub(super) hf: Vec<HfFile>,
}

/// Read the tables of every run dir (one per model), and its `hf-*.json` files in name order.
pub(super) fn read_tables(run_dirs: &[PathBuf]) -> Result<Tables> {
    let mut t = Tables {
        cells: Cells::new(),
        forced: Forced::new(),
        patches: Vec::new(),
        replays: Vec::new(),
        drift: Drift::new(),
        hf: Vec::new(),
    };
    for d in run_dirs {
        let dir_cells = read_cells(d)?;
        let mut models: Vec<String> = dir_cells.keys().map(|k| k.0.clone()).collect();
        models.dedup();
        t.cells.extend(dir_cells);
        t.forced.extend(read_forced(d)?);
        t.patches.extend(read_patches(d)?);
        t.replays.extend(read_replay(d)?);
        t.drift.extend(read_drift(d)?);
        let entries = std::fs::read_dir(d).map_err(|e| Error::io(d, e))?;
        let mut names: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("hf-") && n.ends_with(".json"))
            })
            .collect();
        names.sort();
        for p in names {
            let text = std::fs::read_to_string(&p).map_err(|e| Error::io(&p, e))?;
            t.hf.push((p, text, models.clone()));
        }
    }
    Ok(t)
}
