//! The project's targets and reference baselines, read from a data file
//! (`benches/targets.toml`), and their evaluation against a [`BenchReport`].
use super::{BenchReport, ContinuationResult};
use crate::decode::engine::EngineMode;
use crate::exec::PolicyKind;
use crate::sampling::Sampler;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// A project target (`benches/targets.toml`), checked against the measurements.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Target {
    /// What is measured.
    pub name: String,
    /// Measured value.
    pub value: Option<f64>,
    /// Threshold.
    pub target: String,
    /// Whether it is met (`None`: not measurable in this run).
    pub met: Option<bool>,
    /// Context: the baseline, the roofline, the gap.
    pub note: String,
}

/// Hugging Face `generate` baseline of one batch size (from `benches/hf_generate.py`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HfBaseline {
    /// Where the number comes from.
    pub source: String,
    /// Batch size.
    pub batch: usize,
    /// `generate` tokens/s.
    pub generate_tokens_per_s: f64,
    /// `generate` with a static cache (compiled, CUDA graphs) tokens/s, when the file has it
    /// (`hf_generate.py --static`).
    #[serde(default)]
    pub static_tokens_per_s: Option<f64>,
}

/// Which Hugging Face `generate` a "vs HF" ratio divides by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfComparison {
    /// Static-cache compiled `generate` (CUDA graphs; `benches/hf_generate.py --static`): the
    /// fast path a user who cares about speed runs, so the strong baseline.
    Static,
    /// Eager `generate` only: the weak baseline (about 10x slower on the H200).
    Eager,
}

impl HfComparison {
    /// The table's column header.
    pub fn column(self) -> &'static str {
        match self {
            HfComparison::Static => "vs HF static",
            HfComparison::Eager => "vs eager HF",
        }
    }

    /// What the ratios are taken against, in words.
    pub fn label(self) -> &'static str {
        match self {
            HfComparison::Static => "vs static-cache compiled HF generate",
            HfComparison::Eager => "vs eager HF generate (weak baseline)",
        }
    }
}

impl HfBaseline {
    /// The tokens/s a ratio divides by and which baseline it is: static-cache compiled
    /// `generate` when the baseline has it, else eager `generate`.
    pub fn reference(&self) -> (f64, HfComparison) {
        match self.static_tokens_per_s {
            Some(st) => (st, HfComparison::Static),
            None => (self.generate_tokens_per_s, HfComparison::Eager),
        }
    }
}

/// The comparison a report's ratios make over `baselines`: `Static` when every baseline has a
/// static-cache number, `Eager` when at least one has only eager `generate` (so a table never
/// passes a weak ratio off as a strong one), `None` without baselines.
pub fn hf_comparison(baselines: &[HfBaseline]) -> Option<HfComparison> {
    if baselines.is_empty() {
        None
    } else if baselines.iter().all(|b| b.static_tokens_per_s.is_some()) {
        Some(HfComparison::Static)
    } else {
        Some(HfComparison::Eager)
    }
}

/// The line under the bench tables that says what "vs HF" means, with the sources.
pub fn hf_legend(baselines: &[HfBaseline]) -> Option<String> {
    let kind = hf_comparison(baselines)?;
    let mut sources: Vec<&str> = baselines.iter().map(|b| b.source.as_str()).collect();
    sources.sort_unstable();
    sources.dedup();
    let sources = sources.join(", ");
    Some(match kind {
        HfComparison::Static => format!("{}: tokens/s ÷ {sources}", kind.label()),
        HfComparison::Eager => format!(
            "{}: tokens/s ÷ eager generate of {sources}; for the strong baseline pass \
             --hf with the JSON of `benches/hf_generate.py --static`",
            kind.label()
        ),
    })
}

/// The `benches/hf_generate.py` JSON files the repository ships (static-cache compiled and
/// eager `generate`, measured on the H200): `kvcredit bench`'s baselines when no `--hf` is
/// given, matched on shape, dtype and device.
pub fn default_hf_files() -> Vec<std::path::PathBuf> {
    let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/results/throughput"));
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("hf-generate-") && n.ends_with(".json"))
        })
        .collect();
    files.sort();
    files
}

/// The project's targets and the H200 reference baselines, as `benches/targets.toml` holds
/// them; read with [`TargetFile::load`].
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetFile {
    /// Continuation throughput against Hugging Face `generate`.
    pub continuation: ContinuationTarget,
    /// Batch-1 stock decode step time.
    pub decode: DecodeTarget,
    /// Batch sizes at which the batch-invariant / stock decode cost is reported.
    pub invariant_cost_batches: Vec<usize>,
    /// Snapshot memory of the pivots against the rollout's KV.
    pub snapshot: SnapshotTarget,
    /// Reference `generate` numbers used when no baseline file is given.
    pub hf_baselines: ReferenceBaselines,
}

/// Continuations at `batch` must reach `min_speedup` × HF `generate` at that batch.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContinuationTarget {
    /// Batch size compared.
    pub batch: usize,
    /// Required ratio to HF `generate`.
    pub min_speedup: f64,
}

/// The batch-1 stock decode step of `shape` must take at most `max_ms`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeTarget {
    /// Synthetic shape the target is for.
    pub shape: String,
    /// How the report names that shape (e.g. `1.5B`).
    pub label: String,
    /// Milliseconds per step.
    pub max_ms: f64,
}

/// Snapshot references must hold every pivot in at most `max_ratio` × the rollout's KV.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotTarget {
    /// Ratio bound.
    pub max_ratio: f64,
}

/// Measured `generate` tokens/s per (shape, batch) and where they come from.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReferenceBaselines {
    /// Provenance, recorded as each baseline's `source`.
    pub source: String,
    /// Runs these numbers apply to (device kind and dtype), e.g. `cuda` and `bf16`.
    pub device: String,
    /// Dtype of the reference runs.
    pub dtype: String,
    /// One entry per (shape, batch).
    pub results: Vec<ReferenceBaseline>,
}

/// One reference `generate` number.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReferenceBaseline {
    /// Synthetic shape.
    pub shape: String,
    /// Batch size.
    pub batch: usize,
    /// `generate` tokens/s.
    pub generate_tokens_per_s: f64,
}

impl TargetFile {
    /// The targets the repository ships (`benches/targets.toml`), embedded in the binary so
    /// `kvcredit bench` runs without a source tree beside it.
    pub const SHIPPED: &'static str = include_str!("../../benches/targets.toml");

    /// The shipped targets, parsed and validated.
    pub fn shipped() -> Result<TargetFile> {
        TargetFile::parse(TargetFile::SHIPPED, "(built in: benches/targets.toml)")
    }

    /// Read and validate `path`; any problem is one `spec:` line naming the file.
    pub fn load(path: &std::path::Path) -> Result<TargetFile> {
        let source = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::Spec(format!("bench targets {source}: {e}")))?;
        TargetFile::parse(&text, &source)
    }

    /// Parse and validate `text`; any problem is one `spec:` line naming `source`.
    pub fn parse(text: &str, source: &str) -> Result<TargetFile> {
        let bad = |msg: String| Error::Spec(format!("bench targets {source}: {msg}"));
        let file: TargetFile = toml::from_str(text).map_err(|e| {
            let line = e
                .span()
                .map(|r| text[..r.start.min(text.len())].lines().count().max(1));
            let msg = e.message().trim();
            bad(match line {
                Some(l) => format!("line {l}: {msg}"),
                None => msg.to_string(),
            })
        })?;
        file.validate().map_err(bad)?;
        Ok(file)
    }

    /// Positive, finite thresholds; positive batches; no (shape, batch) given twice.
    fn validate(&self) -> std::result::Result<(), String> {
        let positive = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!("{name} must be a positive number (got {v})"))
            }
        };
        positive("continuation.min_speedup", self.continuation.min_speedup)?;
        positive("decode.max_ms", self.decode.max_ms)?;
        positive("snapshot.max_ratio", self.snapshot.max_ratio)?;
        let mut batches = std::iter::once(self.continuation.batch)
            .chain(self.invariant_cost_batches.iter().copied())
            .chain(self.hf_baselines.results.iter().map(|r| r.batch));
        if batches.any(|b| b == 0) {
            return Err("batch sizes must be positive".into());
        }
        let mut seen = std::collections::BTreeSet::new();
        for r in &self.hf_baselines.results {
            positive(
                &format!("hf_baselines {} batch {}", r.shape, r.batch),
                r.generate_tokens_per_s,
            )?;
            if !seen.insert((r.shape.as_str(), r.batch)) {
                return Err(format!(
                    "hf_baselines: {} batch {} is given twice",
                    r.shape, r.batch
                ));
            }
        }
        Ok(())
    }

    /// The reference `generate` baseline of `shape` at `batch` for a run on `device` in
    /// `dtype`, if the file has one.
    pub fn reference_baseline(
        &self,
        shape: &str,
        batch: usize,
        device: &str,
        dtype: &str,
    ) -> Option<HfBaseline> {
        let refs = &self.hf_baselines;
        if refs.device != device || refs.dtype != dtype {
            return None;
        }
        refs.results
            .iter()
            .find(|r| r.shape == shape && r.batch == batch)
            .map(|r| HfBaseline {
                source: refs.source.clone(),
                batch,
                generate_tokens_per_s: r.generate_tokens_per_s,
                static_tokens_per_s: None,
            })
    }
}

/// Read the `generate` numbers of `benches/hf_generate.py`'s JSON that match this run's shape,
/// dtype and device kind (`cuda` or `cpu`; a file without a `device` field matches any).
pub fn read_hf_baselines(
    path: &std::path::Path,
    shape: &str,
    dtype: &str,
    device: &str,
) -> Result<Vec<HfBaseline>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Spec(format!("{}: {e}", path.display())))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::Spec(format!("{}: not JSON: {e}", path.display())))?;
    let mut out = Vec::new();
    if v["device"].as_str().is_some_and(|d| d != device) {
        return Ok(out);
    }
    for r in v["results"].as_array().into_iter().flatten() {
        let same = r["shape"].as_str() == Some(shape) && r["dtype"].as_str() == Some(dtype);
        if let (true, Some(b), Some(tps)) = (
            same,
            r["batch"].as_u64(),
            r["generate"]["tokens_per_s"].as_f64(),
        ) {
            out.push(HfBaseline {
                source: path.display().to_string(),
                batch: b as usize,
                generate_tokens_per_s: tps,
                static_tokens_per_s: r["generate_static"]["tokens_per_s"].as_f64(),
            });
        }
    }
    Ok(out)
}

impl BenchReport {
    fn decode_ms(&self, policy: PolicyKind, batch: usize) -> Option<(f64, EngineMode)> {
        self.decode
            .iter()
            .filter(|d| d.policy == policy && d.batch == batch)
            .map(|d| (d.step_ms, d.engine))
            .min_by(|a, b| a.0.total_cmp(&b.0))
    }

    fn best_continuation(&self, policy: PolicyKind, batch: usize) -> Option<&ContinuationResult> {
        self.continuations
            .iter()
            .filter(|c| c.policy == policy && c.batch == batch)
            .max_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s))
    }

    /// Check the report against `file`'s targets (continuation speed, decode step,
    /// batch-invariant cost, token identity, kernel checks, snapshot memory, in that order);
    /// fills [`Self::targets`].
    pub fn evaluate_targets(&mut self, file: &TargetFile) {
        let mut targets = Vec::new();
        self.continuation_speed_targets(file, &mut targets);
        self.decode_step_targets(file, &mut targets);
        self.token_identity_targets(&mut targets);
        self.kernel_check_targets(&mut targets);
        self.memory_target(file, &mut targets);
        self.targets = targets;
    }

    /// Continuations at the target batch against HF generate, per policy.
    fn continuation_speed_targets(&self, file: &TargetFile, targets: &mut Vec<Target>) {
        // 1. Continuations at batch B ≥ S× HF generate at batch B.
        let (cb, speedup) = (file.continuation.batch, file.continuation.min_speedup);
        let base = self
            .hf
            .iter()
            .find(|h| h.batch == cb)
            .map(|h| h.generate_tokens_per_s);
        for policy in [PolicyKind::Stock, PolicyKind::BatchInvariant] {
            let Some(c) = self.best_continuation(policy, cb) else {
                continue;
            };
            let (met, note) = match base {
                Some(hf) => (
                    Some(c.tokens_per_s >= speedup * hf),
                    format!(
                        "eager HF generate {hf:.0} tok/s at batch {cb} ({}); ratio {:.1}x (engine {}){}",
                        self.hf
                            .iter()
                            .find(|h| h.batch == cb)
                            .map(|h| h.source.as_str())
                            .unwrap_or("?"),
                        c.tokens_per_s / hf,
                        c.engine,
                        self.hf
                            .iter()
                            .find(|h| h.batch == cb)
                            .and_then(|h| h.static_tokens_per_s)
                            .map_or(String::new(), |st| format!(
                                "; static-cache compiled generate {st:.0} tok/s, ratio {:.2}x",
                                c.tokens_per_s / st
                            ))
                    ),
                ),
                None => (
                    None,
                    "no HF baseline for this shape, dtype and device (pass --hf)".into(),
                ),
            };
            targets.push(Target {
                name: format!("continuation tok/s, batch {cb}, {policy}"),
                value: Some(c.tokens_per_s),
                target: base.map_or(format!("≥ {speedup}× HF generate"), |b| {
                    format!("≥ {:.0}", speedup * b)
                }),
                met,
                note,
            });
        }
    }

    /// The batch-1 decode step against its target and roofline, and the batch-invariant cost relative to stock.
    fn decode_step_targets(&self, file: &TargetFile, targets: &mut Vec<Target>) {
        // 2. Batch-1 decode step (of the target's shape), with the roofline.
        if let Some((ms, mode)) = self.decode_ms(PolicyKind::Stock, 1) {
            let floor = self.decode.first().and_then(|d| d.floor_ms);
            let d = &file.decode;
            let is_shape = self.shape.as_deref() == Some(d.shape.as_str());
            targets.push(Target {
                name: "decode step, batch 1, stock (ms)".into(),
                value: Some(ms),
                target: if is_shape {
                    format!("≤ {} ({} shape)", d.max_ms, d.label)
                } else {
                    format!("— (target is for {})", d.label)
                },
                met: is_shape.then_some(ms <= d.max_ms),
                note: match (floor, self.config.bandwidth_gbs) {
                    (Some(f), Some(bw)) => format!(
                        "roofline {f:.3} ms at {bw:.0} GB/s; {:.1}x the roofline (engine {mode})",
                        ms / f
                    ),
                    _ => format!("no roofline (give --bandwidth-gbs); engine {mode}"),
                },
            });
        }
        // 3. Batch-invariant cost relative to stock.
        for &b in &file.invariant_cost_batches {
            if let (Some((s, _)), Some((i, _))) = (
                self.decode_ms(PolicyKind::Stock, b),
                self.decode_ms(PolicyKind::BatchInvariant, b),
            ) {
                targets.push(Target {
                    name: format!("batch_invariant / stock decode step, batch {b}"),
                    value: Some(i / s),
                    target: "report".into(),
                    met: None,
                    note: format!("{i:.3} ms vs {s:.3} ms"),
                });
            }
        }
    }

    /// Whether engines and batch sizes sample the same tokens, per policy.
    fn token_identity_targets(&self, targets: &mut Vec<Target>) {
        // Correctness beside speed: do engines and batch sizes sample the same tokens?
        for policy in [PolicyKind::Stock, PolicyKind::BatchInvariant] {
            let runs: Vec<&ContinuationResult> = self
                .continuations
                .iter()
                .filter(|c| c.policy == policy)
                .collect();
            if runs.len() < 2 {
                continue;
            }
            let distinct: std::collections::BTreeSet<&str> =
                runs.iter().map(|c| c.tokens_sha256.as_str()).collect();
            let invariant = policy == PolicyKind::BatchInvariant;
            targets.push(Target {
                name: format!("continuation tokens identical across engines and batches, {policy}"),
                value: Some(distinct.len() as f64),
                target: if invariant {
                    "1 distinct digest".into()
                } else {
                    "report".into()
                },
                met: invariant.then_some(distinct.len() == 1),
                note: format!(
                    "{} runs ({}), {} distinct token digests",
                    runs.len(),
                    runs.iter()
                        .map(|c| match c.sampler {
                            Some(s) => format!("{} b{} {}", c.engine, c.batch, s.name()),
                            None => format!("{} b{}", c.engine, c.batch),
                        })
                        .collect::<Vec<_>>()
                        .join(", "),
                    distinct.len()
                ),
            });
        }
    }

    /// The fused sampler and glue bitwise their ATen references, and tokens identical across samplers.
    fn kernel_check_targets(&self, targets: &mut Vec<Target>) {
        // The fused sampler must choose bitwise the reference's tokens, in the check and in
        // every continuation measurement run under both samplers.
        if let Some(c) = &self.sampler_check {
            targets.push(Target {
                name: "fused sampler bitwise the ATen reference (noise and tokens)".into(),
                value: Some((c.noise_mismatches + c.token_mismatches) as f64),
                target: "0 differences, control > 0".into(),
                met: Some(c.passed()),
                note: format!(
                    "{} noise values, {} token rows; the fp32-log control differs in {} values",
                    c.noise_elements, c.token_rows, c.control_mismatches
                ),
            });
        }
        if let Some(c) = &self.glue_check {
            targets.push(Target {
                name: "fused glue bitwise the ATen ops (kernels and model logits)".into(),
                value: Some((c.mismatches + c.logits_mismatches) as f64),
                target: "0 differences, control > 0".into(),
                met: Some(c.passed()),
                note: format!(
                    "{} kernel outputs, {} logits; the unrounded-SiLU control differs in {} values",
                    c.elements, c.logits_elements, c.control_mismatches
                ),
            });
        }
        let mut by_cell: std::collections::BTreeMap<
            (String, String, usize),
            Vec<&ContinuationResult>,
        > = Default::default();
        for c in self.continuations.iter().filter(|c| c.sampler.is_some()) {
            by_cell
                .entry((c.policy.to_string(), c.engine.to_string(), c.batch))
                .or_default()
                .push(c);
        }
        for ((policy, engine, batch), runs) in by_cell.into_iter().filter(|(_, r)| r.len() > 1) {
            let distinct: std::collections::BTreeSet<&str> =
                runs.iter().map(|c| c.tokens_sha256.as_str()).collect();
            let rate = |s: Sampler| {
                runs.iter()
                    .find(|c| c.sampler == Some(s))
                    .map(|c| c.tokens_per_s)
            };
            targets.push(Target {
                name: format!(
                    "continuation tokens identical across samplers, {policy} {engine} b{batch}"
                ),
                value: Some(distinct.len() as f64),
                target: "1 distinct digest".into(),
                met: Some(distinct.len() == 1),
                note: match (rate(Sampler::Fused), rate(Sampler::Aten)) {
                    (Some(f), Some(a)) => {
                        format!("fused {f:.0} tok/s vs aten {a:.0} tok/s ({:.2}x)", f / a)
                    }
                    _ => format!("{} runs", runs.len()),
                },
            });
        }
    }

    /// Snapshot memory for the pivots against the rollout's KV.
    fn memory_target(&self, file: &TargetFile, targets: &mut Vec<Target>) {
        // 4. Snapshot memory for the pivots ≤ R× the rollout's KV.
        if let Some(m) = &self.memory {
            let max = file.snapshot.max_ratio;
            targets.push(Target {
                name: format!("snapshot memory, {} pivots / rollout KV", m.pivots),
                value: Some(m.snapshot_ref_ratio),
                target: format!("≤ {max}"),
                met: Some(m.snapshot_ref_ratio <= max),
                note: format!(
                    "copying each prefix instead: {:.2}x ({} MiB vs {} MiB)",
                    m.prefix_copy_ratio,
                    m.prefix_copy_bytes >> 20,
                    m.rollout_kv_bytes >> 20
                ),
            });
        }
    }
}
