//! The SpectrumKV grids (`ppl`, `niah`, `probe`, `ttft`) on the study runtime: each grid is a
//! run in the output folder with its own manifest (`<grid>.manifest.json`, a [`RunHeader`] plus
//! the spec), one atomic shard per finished unit under `shards/<grid>/` (a text window, a
//! haystack, the whole probe, or one repeat of both transfers over one link), and its table
//! written from the shards at the end. A rerun skips the
//! finished units; a folder holding a run of another spec, dtype, device, numerical path,
//! measurement protocol ([`eval::PROTOCOL`]) or text normalization is refused before anything
//! is written.
use super::eval::{self, NiahRow, PplOptions, PplRow, TextNorm, Variant};
use super::spec::{ProbeSpec, SpectrumSpec};
use super::ttft::{TtftRow, TtftRun, ttft_table};
use crate::exec::ExecPolicy;
use crate::exec::ExecRecord;
use crate::io::integrity::verify_shard_file;
use crate::io::parquet::{Column, Table};
use crate::runtime::{Dtype, LoadedModel};
use crate::study::header::{RunHeader, RunOrigin};
use crate::study::progress::{bar, unit_line};
use crate::study::{
    RunLock, commit_shard, lock_run, now_rfc3339, prepare_dir, read_json, table_hashes, write_json,
};
use crate::{Error, Result};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What a grid's run records about itself (`<grid>.manifest.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GridManifest {
    /// Study (`spectrum`), spec, model, execution (engine `eager`: the grids step the
    /// decoder themselves), build and times.
    #[serde(flatten)]
    pub run: RunHeader,
    /// `ppl`, `niah`, `probe` or `ttft`.
    pub grid: String,
    /// The spec as parsed (its device as resolved for this run).
    pub spec: SpectrumSpec,
    /// Run dtype.
    pub dtype: Dtype,
    /// Version of what decides a row beyond the spec ([`eval::PROTOCOL`]); absent in a
    /// manifest written before it was recorded, which is then not resumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<u32>,
    /// Normalization of the grid's WikiText-2 windows (`ppl`: `[ppl] text`; `probe`: the
    /// gate's `gate_text`; `ttft`: `[ttft] text`); absent for `niah`, whose haystacks are not
    /// WikiText.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextNorm>,
    /// Units of the grid.
    pub units_total: usize,
    /// Units with a finished shard.
    pub units_done: usize,
    /// sha256 of each table written (file name → hex digest); empty while unfinished.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files_sha256: BTreeMap<String, String>,
}

/// One finished unit: its label and its rows (`shard.json` of the unit's shard).
#[derive(Debug, Serialize, Deserialize)]
struct UnitRows<R> {
    unit: String,
    rows: Vec<R>,
}

/// A unit's tables, by name (none for the ppl and niah grids, whose tables are built from rows).
type UnitTables = Vec<(&'static str, Table)>;

/// Everything a grid runs with.
pub struct GridRun<'a> {
    /// The spec (device as resolved).
    pub spec: &'a SpectrumSpec,
    /// SHA-256 of the spec file's bytes.
    pub spec_sha256: &'a str,
    /// The loaded model.
    pub model: &'a LoadedModel,
    /// Run dtype.
    pub dtype: Dtype,
    /// Execution policy with its tiles.
    pub policy: ExecPolicy,
    /// The same, as recorded (engine `eager`).
    pub exec: ExecRecord,
    /// Output folder.
    pub out: &'a Path,
    /// Hide the progress bar and the per-unit lines.
    pub quiet: bool,
}

/// A grid's run opened in its folder: the manifest, held under the folder's lock.
struct Opened {
    manifest: GridManifest,
    path: PathBuf,
    shards: PathBuf,
    _lock: RunLock,
}

/// The manifest file of grid `grid` in `out`.
pub fn manifest_path(out: &Path, grid: &str) -> PathBuf {
    out.join(format!("{grid}.manifest.json"))
}

/// Refuse, in one line, to resume a grid recorded as `m` under another protocol or text
/// normalization than this run's (`text`).
fn check_protocol(m: &GridManifest, text: Option<TextNorm>, what: &str) -> Result<()> {
    if m.protocol != Some(eval::PROTOCOL) {
        let was = m
            .protocol
            .map_or("an unrecorded".to_string(), |p| p.to_string());
        return Err(Error::Spec(format!(
            "{what} was measured under protocol {was} and this binary measures under protocol {} (quantizer granularity or perplexity protocol differ); remove it or use another --out",
            eval::PROTOCOL
        )));
    }
    if m.text != text {
        let name = |t: Option<TextNorm>| t.map_or("none", TextNorm::name);
        return Err(Error::Spec(format!(
            "{what} was measured on text `{}` and this run asks for `{}`; remove it or use another --out",
            name(m.text),
            name(text)
        )));
    }
    Ok(())
}

/// Open (or resume) grid `grid` of `units_total` units in `g.out`, its text windows normalized
/// by `text`: everything that can refuse the folder is checked before the first write.
fn open(g: &GridRun, grid: &str, units_total: usize, text: Option<TextNorm>) -> Result<Opened> {
    let path = manifest_path(g.out, grid);
    let manifest = if path.exists() {
        let mut m: GridManifest = read_json(&path)?;
        let what = format!("{} ({grid})", g.out.display());
        m.run.check_resume(g.spec_sha256, g.out)?;
        if (m.dtype, m.run.device.as_str()) != (g.dtype, g.spec.device.as_str()) {
            return Err(Error::Spec(format!(
                "{what} was run as {} on {} and this run asks for {} on {}; use another --out",
                m.dtype, m.run.device, g.dtype, g.spec.device
            )));
        }
        check_protocol(&m, text, &what)?;
        m.run.exec.resume_with(&g.exec, &what)?;
        m.run.resumed_at.push(now_rfc3339());
        m
    } else {
        let origin = RunOrigin {
            study: "spectrum",
            name: &g.spec.name,
            spec_sha256: g.spec_sha256,
            model: &g.model.name,
            model_sha256: g.model.sha256.as_deref(),
            device: &g.spec.device,
        };
        GridManifest {
            run: RunHeader::start(origin, g.exec),
            grid: grid.to_string(),
            spec: g.spec.clone(),
            dtype: g.dtype,
            protocol: Some(eval::PROTOCOL),
            text,
            units_total,
            units_done: 0,
            files_sha256: BTreeMap::new(),
        }
    };
    let lock = lock_run(g.out)?;
    write_json(&path, &manifest)?;
    let shards = prepare_dir(&g.out.join("shards").join(grid))?;
    Ok(Opened {
        manifest,
        path,
        shards,
        _lock: lock,
    })
}

/// The rows of every unit of `units` (shard names, in order): read from a finished shard, or
/// computed by `work(i)` (rows and the unit's tables) and committed as one shard.
fn run_units<R: Serialize + DeserializeOwned>(
    g: &GridRun,
    run: &mut Opened,
    units: &[(String, String)],
    what: &str,
    mut work: impl FnMut(usize) -> Result<(Vec<R>, UnitTables)>,
) -> Result<Vec<R>> {
    let pb = bar(units.len(), what, g.quiet)?;
    let mut rows = Vec::new();
    for (i, (name, label)) in units.iter().enumerate() {
        let dir = run.shards.join(name);
        if !dir.exists() {
            let (mine, tables) = work(i).map_err(|e| e.context(label))?;
            let named: Vec<(&str, &Table)> = tables.iter().map(|(n, t)| (*n, t)).collect();
            let unit = UnitRows {
                unit: label.clone(),
                rows: mine,
            };
            commit_shard(&dir, &named, &unit)?;
            run.manifest.units_done = units
                .iter()
                .filter(|(n, _)| run.shards.join(n).exists())
                .count();
            write_json(&run.path, &run.manifest)?;
        }
        let unit: UnitRows<R> = read_json(&dir.join("shard.json"))?;
        rows.extend(unit.rows);
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(rows)
}

/// Record the tables `names` (already written to the folder) and finish the run.
fn finish(run: &mut Opened, out: &Path, names: &[&str]) -> Result<()> {
    run.manifest.files_sha256 = table_hashes(out, names)?;
    run.manifest.run.finished_at = Some(now_rfc3339());
    write_json(&run.path, &run.manifest)
}

/// Rows of the finished units of grid `grid` in the run folder `dir`, in unit order; `None`
/// when the folder holds no run of that grid. A run whose shards are gone (a results folder
/// that keeps only the merged tables) is an error, not an empty grid.
pub fn read_rows<R: DeserializeOwned>(dir: &Path, grid: &str) -> Result<Option<Vec<R>>> {
    if !manifest_path(dir, grid).exists() {
        return Ok(None);
    }
    let shards = dir.join("shards").join(grid);
    let mut names: Vec<PathBuf> = match std::fs::read_dir(&shards) {
        Ok(entries) => entries
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .map(|e| e.path())
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::Output(format!(
                "{}: {grid}.manifest.json but no shards/{grid}/: the report reads a grid's shards, which this folder does not keep",
                dir.display()
            )));
        }
        Err(e) => return Err(Error::io(&shards, e)),
    };
    names.sort();
    let mut rows = Vec::new();
    for d in names {
        let unit: UnitRows<R> = read_json(&d.join("shard.json"))?;
        rows.extend(unit.rows);
    }
    Ok(Some(rows))
}

/// The manifest of grid `grid` in `dir`, if it has one.
pub fn read_manifest(dir: &Path, grid: &str) -> Result<Option<GridManifest>> {
    let path = manifest_path(dir, grid);
    if !path.exists() {
        return Ok(None);
    }
    read_json(&path).map(Some)
}

/// The WikiText-2 perplexity grid: one unit per text window; writes `ppl.parquet`.
pub fn ppl(g: &GridRun) -> Result<(Vec<PplRow>, PplOptions, PathBuf)> {
    let p = g
        .spec
        .ppl
        .clone()
        .ok_or_else(|| Error::Spec("the spec has no [ppl] section".into()))?;
    let o = PplOptions {
        context: p.context,
        continuation: p.continuation,
        windows: p.windows,
        variants: g.spec.ppl_variants()?,
        importance: g.spec.importance,
        protect: g.spec.protect,
        policy: g.policy,
        text: p.text,
    };
    let ids = eval::wikitext_ids(g.model, p.windows * (p.context + p.continuation), p.text)?;
    let units: Vec<(String, String)> = (0..o.windows)
        .map(|w| (format!("window-{w:05}"), format!("window {w}")))
        .collect();
    let mut run = open(g, "ppl", units.len(), Some(p.text))?;
    let t0 = Instant::now();
    let rows = run_units(g, &mut run, &units, "ppl windows", |w| {
        let t = Instant::now();
        let mine = eval::perplexity_window(&g.model.decoder, &ids, &o, w)?;
        let shared = mine.iter().filter(|r| r.shared_with.is_some()).count();
        unit_line(
            g.quiet,
            format_args!(
                "ppl window {}/{} done in {:.1} s ({} variants, {shared} shared a plan; {:.0} s total)",
                w + 1,
                o.windows,
                t.elapsed().as_secs_f64(),
                o.variants.len(),
                t0.elapsed().as_secs_f64()
            ),
        );
        Ok((mine, vec![]))
    })?;
    let path = g.out.join("ppl.parquet");
    eval::ppl_table(&rows, &g.model.name, &o).write(&path)?;
    finish(&mut run, g.out, &["ppl"])?;
    Ok((rows, o, path))
}

/// Needle depths of a grid of `n`: evenly spaced over `[0, 1]`, or the middle alone.
fn depths(n: usize) -> Vec<f64> {
    if n == 1 {
        return vec![0.5];
    }
    (0..n).map(|i| i as f64 / (n - 1) as f64).collect()
}

/// The single-needle NIAH grid: one unit per haystack, seed-major (a grid cut short still
/// spans every depth); writes `niah.parquet`, rows ordered by depth, then seed.
pub fn niah(g: &GridRun) -> Result<(Vec<NiahRow>, PathBuf)> {
    let n = g
        .spec
        .niah
        .clone()
        .ok_or_else(|| Error::Spec("the spec has no [niah] section".into()))?;
    let variants: Vec<Variant> = g.spec.niah_variants()?;
    let ds = depths(n.depths);
    let cases: Vec<(f64, u64)> = (0..n.seeds as u64)
        .flat_map(|s| ds.iter().map(move |&d| (d, s)))
        .collect();
    let units: Vec<(String, String)> = (0..n.seeds)
        .flat_map(|s| {
            ds.iter().enumerate().map(move |(i, d)| {
                (
                    format!("seed-{s:05}-depth-{i:04}"),
                    format!("depth {d} seed {s}"),
                )
            })
        })
        .collect();
    let mut run = open(g, "niah", units.len(), None)?;
    let (t0, total) = (Instant::now(), cases.len());
    let mut rows = run_units(g, &mut run, &units, "niah haystacks", |k| {
        let (depth, seed) = cases[k];
        let t = Instant::now();
        let case = eval::niah_case(g.model, n.context, depth, seed)?;
        let mine = eval::niah(
            g.model,
            &case,
            &variants,
            &g.spec.importance,
            g.spec.protect,
            &g.policy,
            n.max_new_tokens,
        )?;
        let shared = mine.iter().filter(|r| r.shared_with.is_some()).count();
        unit_line(
            g.quiet,
            format_args!(
                "niah haystack {}/{total} (depth {depth:.3}, seed {seed}, {} tokens, {} prompt) done in {:.1} s ({} variants, {shared} shared a plan; {:.0} s total)",
                k + 1,
                case.ids.len(),
                case.prompt_format,
                t.elapsed().as_secs_f64(),
                variants.len(),
                t0.elapsed().as_secs_f64()
            ),
        );
        Ok((mine, vec![]))
    })?;
    rows.sort_by(|x, y| x.depth.total_cmp(&y.depth).then(x.seed.cmp(&y.seed)));
    let path = g.out.join("niah.parquet");
    eval::niah_table(&rows, &g.model.name, &g.spec.importance).write(&path)?;
    finish(&mut run, g.out, &["niah"])?;
    Ok((rows, path))
}

/// Time to first token over the decode worker at `stream`: one unit per link and repeat (both
/// transfers); writes `ttft.parquet`. A resumed run measures only the missing repeats, so its
/// first one may run on cold workers.
pub fn ttft(g: &GridRun, stream: &mut std::net::TcpStream) -> Result<(Vec<TtftRow>, PathBuf)> {
    let t = g
        .spec
        .ttft
        .clone()
        .ok_or_else(|| Error::Spec("the spec has no [ttft] section".into()))?;
    let links = t.links();
    let cases: Vec<(Option<f64>, u32)> = links
        .iter()
        .flat_map(|&l| (0..t.repeats as u32).map(move |r| (l, r)))
        .collect();
    let units: Vec<(String, String)> = (0..links.len())
        .flat_map(|i| {
            let link = links[i].map_or("unlimited".to_string(), |m| format!("{m} Mbit/s"));
            (0..t.repeats).map(move |r| {
                (
                    format!("link-{i:03}-repeat-{r:05}"),
                    format!("link {link} repeat {r}"),
                )
            })
        })
        .collect();
    let ids = eval::wikitext_ids(g.model, t.context, t.text)?;
    let mut run = open(g, "ttft", units.len(), Some(t.text))?;
    let measure = TtftRun {
        model: &g.model.decoder,
        spec: &t,
        importance: &g.spec.importance,
        protect: g.spec.protect,
        policy: &g.policy,
        ids: &ids,
    };
    let rows = run_units(g, &mut run, &units, "ttft repeats", |k| {
        let (link, repeat) = cases[k];
        Ok((measure.repeat(stream, link, repeat)?, vec![]))
    })?;
    let path = g.out.join("ttft.parquet");
    ttft_table(&rows, &g.model.name, &t).write(&path)?;
    finish(&mut run, g.out, &["ttft"])?;
    Ok((rows, path))
}

/// The INT4 probe and the continuous gate, as one unit: writes `probe-trials.parquet` and
/// `probe.parquet`; returns one summary line per quantizer.
pub fn probe(g: &GridRun) -> Result<(Vec<String>, PathBuf)> {
    let p = g
        .spec
        .probe
        .clone()
        .ok_or_else(|| Error::Spec("the spec has no [probe] section".into()))?;
    let mut run = open(g, "probe", 1, Some(p.gate_text))?;
    let units = [("probe".to_string(), "probe".to_string())];
    let lines = run_units(g, &mut run, &units, "probe", |_| probe_unit(g, &p))?;
    let shard = run.shards.join("probe");
    for name in ["probe-trials", "probe"] {
        let file = format!("{name}.parquet");
        verify_shard_file(&shard, &file)?;
        let src = shard.join(&file);
        let bytes = std::fs::read(&src).map_err(|e| Error::io(&src, e))?;
        crate::io::write_atomic(&g.out.join(&file), &bytes)?;
    }
    finish(&mut run, g.out, &["probe-trials", "probe"])?;
    Ok((lines, g.out.join("probe.parquet")))
}

/// The probe's summary lines and its two tables.
fn probe_unit(g: &GridRun, p: &ProbeSpec) -> Result<(Vec<String>, UnitTables)> {
    let model = g.model;
    let (mut trials, mut verdicts) = (Vec::new(), Vec::new());
    for &q in &p.quantizers {
        let (v, rows) = eval::probe(
            model,
            p.context,
            p.b,
            q,
            &g.spec.importance,
            g.spec.protect,
            &g.policy,
            p.max_new_tokens,
        )?;
        trials.extend(rows);
        verdicts.push(v);
    }
    let o = PplOptions {
        context: p.gate_context,
        continuation: p.gate_continuation,
        windows: p.gate_windows,
        variants: Vec::new(),
        importance: g.spec.importance,
        protect: g.spec.protect,
        policy: g.policy,
        text: p.gate_text,
    };
    let ids = eval::wikitext_ids(
        model,
        p.gate_windows * (p.gate_context + p.gate_continuation),
        p.gate_text,
    )?;
    let gates = eval::gate(
        &model.decoder,
        &ids,
        &o,
        &p.quantizers,
        p.gate_max_ppl_ratio,
    )?;
    let n = verdicts.len();
    let strs = |f: &dyn Fn(usize) -> String| Column::Str((0..n).map(f).collect());
    let table = Table::new()
        .with("model", Column::Str(vec![model.name.clone(); n]))
        .with(
            "quantizer",
            strs(&|i| verdicts[i].quantizer.name().to_string()),
        )
        .with("b", Column::F64(vec![p.b; n]))
        .with("context", Column::U32(vec![p.context as u32; n]))
        .with(
            "trials_passed",
            Column::U32(verdicts.iter().map(|v| v.passed as u32).collect()),
        )
        .with(
            "probe_int4",
            Column::Bool(verdicts.iter().map(|v| v.int4).collect()),
        )
        .with(
            "selected_policy",
            strs(&|i| verdicts[i].selected.to_string()),
        )
        .with(
            "gate_ppl_ratio",
            Column::F64(gates.iter().map(|g| g.ppl_ratio).collect()),
        )
        .with("gate_kl", Column::F64(gates.iter().map(|g| g.kl).collect()))
        .with(
            "gate_max_ppl_ratio",
            Column::F64(vec![p.gate_max_ppl_ratio; n]),
        )
        .with(
            "gate_int4",
            Column::Bool(gates.iter().map(|g| g.int4).collect()),
        )
        .with("gate_text", Column::Str(vec![p.gate_text.to_string(); n]));
    let on = |b: bool| if b { "on" } else { "off" };
    let lines = verdicts
        .iter()
        .zip(&gates)
        .map(|(v, gt)| {
            format!(
                "{} {:<10} probe {}/3 → {} (INT4 {}); gate PPL ratio {:.4}, KL {:.5} → INT4 {}",
                model.name,
                v.quantizer.name(),
                v.passed,
                v.selected,
                on(v.int4),
                gt.ppl_ratio,
                gt.kl,
                on(gt.int4)
            )
        })
        .collect();
    let trials = eval::niah_table(&trials, &model.name, &g.spec.importance);
    Ok((lines, vec![("probe-trials", trials), ("probe", table)]))
}
