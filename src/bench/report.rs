//! What a [`BenchReport`] looks like on the page: the stdout table and the Parquet rows.
use super::BenchReport;
use super::targets::{hf_comparison, hf_legend};
use std::fmt::Write as _;

impl BenchReport {
    /// One row per measurement (prefill, decode, continuations), for Parquet: columns
    /// `measurement, policy, engine, batch, tokens, seconds, tokens_per_s, step_ms, floor_ms,
    /// launches_per_step, hf_generate_tokens_per_s, tokens_sha256, sampler` plus the run's
    /// `model, shape, dtype, device`.
    pub fn to_table(&self) -> crate::io::parquet::Table {
        use crate::io::parquet::{Column, Table};
        struct Row {
            measurement: &'static str,
            policy: String,
            engine: Option<String>,
            batch: i64,
            tokens: i64,
            seconds: f64,
            tokens_per_s: f64,
            step_ms: Option<f64>,
            floor_ms: Option<f64>,
            launches: Option<i64>,
            digest: Option<String>,
            sampler: Option<String>,
        }
        let mut rows = Vec::new();
        for p in &self.prefill {
            rows.push(Row {
                measurement: "prefill",
                policy: p.policy.to_string(),
                engine: None,
                batch: 1,
                tokens: p.tokens as i64,
                seconds: p.seconds,
                tokens_per_s: p.tokens_per_s,
                step_ms: None,
                floor_ms: None,
                launches: None,
                digest: None,
                sampler: None,
            });
        }
        for d in &self.decode {
            rows.push(Row {
                measurement: "decode",
                policy: d.policy.to_string(),
                engine: Some(d.engine.to_string()),
                batch: d.batch as i64,
                tokens: d.batch as i64,
                seconds: d.step_ms / 1e3,
                tokens_per_s: d.tokens_per_s,
                step_ms: Some(d.step_ms),
                floor_ms: d.floor_ms,
                launches: d.launches_per_step.map(|n| n as i64),
                digest: None,
                sampler: None,
            });
        }
        for c in &self.continuations {
            rows.push(Row {
                measurement: "continuations",
                policy: c.policy.to_string(),
                engine: Some(c.engine.to_string()),
                batch: c.batch as i64,
                tokens: c.tokens as i64,
                seconds: c.seconds,
                tokens_per_s: c.tokens_per_s,
                step_ms: None,
                floor_ms: None,
                launches: c
                    .stats
                    .as_ref()
                    .and_then(|s| s.graph_nodes)
                    .map(|n| n as i64),
                digest: Some(c.tokens_sha256.clone()),
                sampler: c.sampler.map(|s| s.name().to_string()),
            });
        }
        let hf = |b: i64| {
            self.hf
                .iter()
                .find(|h| h.batch as i64 == b)
                .map(|h| h.generate_tokens_per_s)
        };
        let n = rows.len();
        let same = |v: &str| Column::Str(vec![v.to_string(); n]);
        Table::new()
            .with("model", same(&self.model))
            .with("shape", Column::OptStr(vec![self.shape.clone(); n]))
            .with("dtype", same(&self.dtype))
            .with("device", same(&self.device))
            .with(
                "measurement",
                Column::Str(rows.iter().map(|r| r.measurement.to_string()).collect()),
            )
            .with(
                "policy",
                Column::Str(rows.iter().map(|r| r.policy.clone()).collect()),
            )
            .with(
                "engine",
                Column::OptStr(rows.iter().map(|r| r.engine.clone()).collect()),
            )
            .with("batch", Column::I64(rows.iter().map(|r| r.batch).collect()))
            .with(
                "tokens",
                Column::I64(rows.iter().map(|r| r.tokens).collect()),
            )
            .with(
                "seconds",
                Column::F64(rows.iter().map(|r| r.seconds).collect()),
            )
            .with(
                "tokens_per_s",
                Column::F64(rows.iter().map(|r| r.tokens_per_s).collect()),
            )
            .with(
                "step_ms",
                Column::OptF64(rows.iter().map(|r| r.step_ms).collect()),
            )
            .with(
                "floor_ms",
                Column::OptF64(rows.iter().map(|r| r.floor_ms).collect()),
            )
            .with(
                "launches_per_step",
                Column::OptI64(rows.iter().map(|r| r.launches).collect()),
            )
            .with(
                "hf_generate_tokens_per_s",
                Column::OptF64(
                    rows.iter()
                        .map(|r| {
                            if r.measurement == "prefill" {
                                None
                            } else {
                                hf(r.batch)
                            }
                        })
                        .collect(),
                ),
            )
            .with(
                "tokens_sha256",
                Column::OptStr(rows.iter().map(|r| r.digest.clone()).collect()),
            )
            .with(
                "sampler",
                Column::OptStr(rows.iter().map(|r| r.sampler.clone()).collect()),
            )
    }

    /// The human-readable summary.
    pub fn table(&self) -> String {
        let mut s = String::new();
        self.header(&mut s);
        let hf_column = hf_comparison(&self.hf).map_or("vs HF", |k| k.column());
        self.decode_lines(&mut s, hf_column);
        if !self.continuations.is_empty() {
            self.continuation_lines(&mut s, hf_column);
        }
        self.checks_and_memory(&mut s);
        self.profile_lines(&mut s);
        self.errors_and_targets(&mut s);
        s
    }

    /// The run's model, device and roofline, then the prefill rows.
    fn header(&self, s: &mut String) {
        let _ = writeln!(
            s,
            "{} | {} {} | threads {} | libtorch {} | {:.0} MB of weights per decode step{}",
            self.model,
            self.dtype,
            self.device,
            self.threads,
            self.libtorch_version,
            self.decode_weight_bytes as f64 / 1e6,
            match (
                self.config.bandwidth_gbs,
                self.decode.first().and_then(|d| d.floor_ms)
            ) {
                (Some(bw), Some(f)) => format!(" | floor {f:.3} ms at {bw:.0} GB/s"),
                _ => String::new(),
            }
        );
        let _ = writeln!(s, "\nprefill (batch 1)");
        for p in &self.prefill {
            let _ = writeln!(
                s,
                "  {:<16} {:>6} tokens {:>10.1} ms {:>12.0} tok/s",
                p.policy.to_string(),
                p.tokens,
                p.seconds * 1e3,
                p.tokens_per_s
            );
        }
    }

    /// Ratio to the Hugging Face baseline at `batch` (static-cache compiled generate when
    /// measured), or `-`.
    fn vs_hf(&self, tokens_per_s: f64, batch: usize) -> String {
        self.hf
            .iter()
            .find(|h| h.batch == batch)
            .map_or("-".to_string(), |h| {
                format!("{:.1}x", tokens_per_s / h.reference().0)
            })
    }

    /// The decode-step rows, with the roofline and baseline ratios.
    fn decode_lines(&self, s: &mut String, hf_column: &str) {
        let _ = writeln!(
            s,
            "\ndecode step (forward + greedy pick + readback) after {} cached tokens",
            self.config.prompt
        );
        let _ = writeln!(
            s,
            "  {:<16} {:<8} {:>6} {:>11} {:>12} {:>9} {:>20} {:>13}",
            "policy", "engine", "batch", "ms/step", "tok/s", "x floor", "launches/step", hf_column
        );
        for d in &self.decode {
            let launches = d
                .launches_per_step
                .map_or("-".to_string(), |n| format!("{n} {}", d.launches_source));
            let hf = self.vs_hf(d.tokens_per_s, d.batch);
            let _ = writeln!(
                s,
                "  {:<16} {:<8} {:>6} {:>11.3} {:>12.0} {:>9} {:>20} {:>13}",
                d.policy.to_string(),
                d.engine.to_string(),
                d.batch,
                d.step_ms,
                d.tokens_per_s,
                d.floor_ms
                    .map_or("-".to_string(), |f| format!("{:.1}", d.step_ms / f)),
                launches,
                hf
            );
            if let Some(why) = &d.graph_fallback {
                let _ = writeln!(s, "  {:<16} graphs abandoned: {why}", "");
            }
        }
    }

    /// The continuation rows, one per policy, engine, sampler and batch size.
    fn continuation_lines(&self, s: &mut String, hf_column: &str) {
        let c0 = &self.config;
        let _ = writeln!(
            s,
            "\ncontinuations: {} pivots × 2 branches × k={} from a rollout of {} tokens, {} tokens each (temperature {})",
            self.memory.as_ref().map_or(c0.pivots, |m| m.pivots),
            c0.k,
            c0.rollout_tokens,
            c0.new_tokens,
            c0.temperature
        );
        let _ = writeln!(
            s,
            "  {:<16} {:<8} {:<7} {:>6} {:>6} {:>9} {:>10} {:>12} {:>13}",
            "policy", "engine", "sampler", "batch", "jobs", "tokens", "seconds", "tok/s", hf_column
        );
        for c in &self.continuations {
            let hf = self.vs_hf(c.tokens_per_s, c.batch);
            let _ = writeln!(
                s,
                "  {:<16} {:<8} {:<7} {:>6} {:>6} {:>9} {:>10.2} {:>12.0} {:>13}",
                c.policy.to_string(),
                c.engine.to_string(),
                c.sampler.map_or("-", |s| s.name()),
                c.batch,
                c.jobs,
                c.tokens,
                c.seconds,
                c.tokens_per_s,
                hf
            );
            if let Some(st) = &c.stats {
                let _ = writeln!(s, "  {:<16} {}", "", st.describe());
            }
        }
    }

    /// The baseline legend, the fused-kernel checks and the snapshot memory.
    fn checks_and_memory(&self, s: &mut String) {
        if let Some(legend) = hf_legend(&self.hf) {
            let _ = writeln!(s, "\n{legend}");
        }
        if let Some(c) = &self.sampler_check {
            let _ = writeln!(
                s,
                "\nfused sampler vs ATen reference: {} of {} noise values and {} of {} tokens differ bitwise; negative control (fp32 logs): {} values differ",
                c.noise_mismatches,
                c.noise_elements,
                c.token_mismatches,
                c.token_rows,
                c.control_mismatches
            );
        }
        if let Some(c) = &self.glue_check {
            let _ = writeln!(
                s,
                "fused glue vs ATen ops: {} of {} kernel outputs and {} of {} model logits differ bitwise; negative control (SiLU unrounded): {} values differ",
                c.mismatches,
                c.elements,
                c.logits_mismatches,
                c.logits_elements,
                c.control_mismatches
            );
        }
        if let Some(m) = &self.memory {
            let _ = writeln!(
                s,
                "\nsnapshot memory: {} pivots of a rollout of {} positions ({} KiB/position)",
                m.pivots,
                m.rollout_len,
                m.kv_bytes_per_token / 1024
            );
            let _ = writeln!(
                s,
                "  rollout KV {:.1} MiB; as references {:.1} MiB ({:.4}x); as prefix copies {:.1} MiB ({:.2}x)",
                m.rollout_kv_bytes as f64 / 1048576.0,
                m.snapshot_ref_bytes as f64 / 1048576.0,
                m.snapshot_ref_ratio,
                m.prefix_copy_bytes as f64 / 1048576.0,
                m.prefix_copy_ratio
            );
        }
    }

    /// One block per device profile: GPU ms per step by family and the top kernels.
    fn profile_lines(&self, s: &mut String) {
        for p in &self.profiles {
            let families: Vec<String> = p
                .families
                .iter()
                .map(|(f, ms)| format!("{f} {ms:.3}"))
                .collect();
            let families = if families.is_empty() {
                "no device kernels seen".to_string()
            } else {
                families.join(", ")
            };
            let _ = writeln!(
                s,
                "\ndevice profile: {} batch {}, eager, {} steps after {} cached tokens: {:.3} GPU ms/step ({})",
                p.policy, p.batch, p.steps, p.context, p.gpu_ms_per_step, families
            );
            for k in p.kernels.iter().take(PROFILE_SHOWN) {
                let name: String = k.name.chars().take(90).collect();
                let _ = writeln!(
                    s,
                    "  {:>9.3} ms {:>6.1} calls  {:<11} {name}",
                    k.ns as f64 / 1e6 / p.steps as f64,
                    k.calls as f64 / p.steps as f64,
                    k.family
                );
            }
            if let Some(t) = &p.trace {
                let _ = writeln!(s, "  trace: {t}");
            }
        }
    }

    /// The failed measurements and the targets with their verdicts.
    fn errors_and_targets(&self, s: &mut String) {
        if !self.errors.is_empty() {
            let _ = writeln!(s, "\nfailed measurements");
            for e in &self.errors {
                let _ = writeln!(s, "  {e}");
            }
        }
        if !self.targets.is_empty() {
            let _ = writeln!(s, "\ntargets");
            for t in &self.targets {
                let verdict = match t.met {
                    Some(true) => "MET",
                    Some(false) => "MISSED",
                    None => "-",
                };
                let _ = writeln!(
                    s,
                    "  [{verdict:^6}] {}: {} (target {}) — {}",
                    t.name,
                    t.value.map_or("n/a".into(), |v| format!("{v:.3}")),
                    t.target,
                    t.note
                );
            }
        }
    }
}

/// Kernels listed per device profile in the table (the JSON keeps more).
const PROFILE_SHOWN: usize = 12;
