//! `kvcredit bench campaign`: a credit campaign's throughput, per pass and for the whole run,
//! from its manifest's `cost` and the run's wall time (timed around the run, or taken from the
//! manifest's `started_at`/`finished_at` for an existing run folder).
use crate::credit::schema::{ExecRecord, Manifest, Pass, PassCost, RecordedSpec};
use crate::io::UtcTime;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::path::Path;

/// The file a timed run writes into its run folder.
pub const FILE_NAME: &str = "bench-campaign.json";

/// One pass's work and speed (`rollout` included).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PassThroughput {
    /// `rollout`, or the pass's name.
    pub pass: String,
    /// Continuations run (0 for the rollout).
    pub continuations: u64,
    /// Tokens decoded or prefilled (the manifest's `cost.<pass>.tokens`).
    pub tokens: u64,
    /// Synchronized device seconds (the manifest's `cost.<pass>.device_seconds`).
    pub device_seconds: f64,
    /// `tokens / device_seconds` (`None` when no time was recorded).
    pub tokens_per_s: Option<f64>,
}

/// Where the whole run's wall time comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WallSource {
    /// Timed around the run by `bench campaign SPEC` (model loading excluded).
    Measured,
    /// `finished_at − started_at` of the manifest (whole seconds).
    Manifest,
    /// Not known: the run was resumed, so its timestamps span the pauses.
    Resumed,
    /// Not known: the folder was merged from shards that ran separately.
    Merged,
    /// Not known: the manifest's timestamps span less than the passes' device seconds (its
    /// shards were computed by another invocation).
    Inconsistent,
}

impl WallSource {
    /// How the table shows a missing wall time.
    fn missing(self) -> &'static str {
        match self {
            WallSource::Resumed => "n/a (resumed)",
            WallSource::Merged => "n/a (merged)",
            WallSource::Inconsistent => "n/a (timestamps shorter than the device time)",
            WallSource::Measured | WallSource::Manifest => "n/a",
        }
    }
}

/// The whole run: every pass's tokens, the wall time and the summed device time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WholeRun {
    /// Continuations of every pass.
    pub continuations: u64,
    /// Tokens of every pass, the rollout's included.
    pub tokens: u64,
    /// Device seconds summed over the passes.
    pub device_seconds: f64,
    /// `tokens / device_seconds`.
    pub tokens_per_device_s: Option<f64>,
    /// Wall seconds of the run, when known.
    pub wall_seconds: Option<f64>,
    /// Where `wall_seconds` comes from, or why it is missing.
    pub wall_source: WallSource,
    /// `tokens / wall_seconds`.
    pub tokens_per_wall_s: Option<f64>,
}

/// A campaign's throughput report (`bench-campaign.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CampaignBench {
    /// Campaign name.
    pub spec_name: String,
    /// SHA-256 of the spec file.
    pub spec_sha256: String,
    /// The run folder.
    pub run_dir: String,
    /// Model name.
    pub model: String,
    /// Run dtype.
    pub dtype: String,
    /// Run device.
    pub device: String,
    /// Policy, tiles and engine, as the manifest records them.
    #[serde(flatten)]
    pub exec: ExecRecord,
    /// `passes.pool_problems` the run used.
    pub pool_problems: usize,
    /// Whether the passes ran as continuously refilled queues (`passes.refill`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub refill: bool,
    /// `passes.batch_size` (absent when the manifest does not record it).
    pub batch_size: Option<usize>,
    /// Replica batch size (`passes.replica_batch_size` or its default) when a replica pass ran.
    pub replica_batch_size: Option<usize>,
    /// Problems finished.
    pub problems: usize,
    /// Per pass, the rollout first, then the spec's passes in order.
    pub passes: Vec<PassThroughput>,
    /// The whole run.
    pub whole_run: WholeRun,
    /// Seconds spent loading the model before the run (measured runs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_seconds: Option<f64>,
    /// kvcredit version of the run.
    pub kvcredit_version: String,
    /// libtorch version of the run.
    pub libtorch_version: String,
}

fn rate(tokens: u64, seconds: f64) -> Option<f64> {
    (seconds > 0.0).then(|| tokens as f64 / seconds)
}

/// The run's wall seconds from its manifest: `finished_at − started_at` when it ran in one
/// invocation and its timestamps cover the passes' device time, else why not; an unfinished
/// run is an error.
pub fn manifest_wall(m: &Manifest) -> Result<(Option<f64>, WallSource)> {
    let Some(finished) = &m.run.finished_at else {
        return Err(Error::Spec(format!(
            "campaign `{}` has not finished ({} of {} problems); finish it with `kvcredit campaign run` first",
            m.run.name, m.problems_done, m.problems_total
        )));
    };
    if !m.merged_from.is_empty() {
        return Ok((None, WallSource::Merged));
    }
    if !m.run.resumed_at.is_empty() {
        return Ok((None, WallSource::Resumed));
    }
    let parse = |what: &str, t: &str| {
        UtcTime::parse_unix(t).ok_or_else(|| {
            Error::Output(format!("manifest {what} `{t}` is not an RFC 3339 UTC time"))
        })
    };
    let secs = (parse("finished_at", finished)? - parse("started_at", &m.run.started_at)?) as f64;
    // Device seconds are timed inside the run, so they fit in its wall time (to the second
    // the timestamps are rounded to) unless the shards came from elsewhere.
    let device: f64 = m.cost.values().map(|c| c.device_seconds).sum();
    if secs + 1.0 < device {
        return Ok((None, WallSource::Inconsistent));
    }
    Ok((Some(secs), WallSource::Manifest))
}

impl CampaignBench {
    /// The report of the finished run in `run_dir` described by `m`, with its wall time.
    pub fn from_manifest(
        m: &Manifest,
        run_dir: &Path,
        wall_seconds: Option<f64>,
        wall_source: WallSource,
    ) -> CampaignBench {
        let passes_run = m.spec.passes();
        // Rollout, the spec's passes in order, then any other cost the manifest holds.
        let mut names: Vec<String> = std::iter::once("rollout".to_string())
            .chain(passes_run.iter().map(|p| p.as_str().to_string()))
            .filter(|n| m.cost.contains_key(n))
            .collect();
        let others: Vec<String> = m
            .cost
            .keys()
            .filter(|k| !names.contains(k))
            .cloned()
            .collect();
        names.extend(others);
        let passes: Vec<PassThroughput> = names
            .iter()
            .map(|n| {
                let c = m.cost[n];
                PassThroughput {
                    pass: n.clone(),
                    continuations: c.continuations,
                    tokens: c.tokens,
                    device_seconds: c.device_seconds,
                    tokens_per_s: rate(c.tokens, c.device_seconds),
                }
            })
            .collect();
        let mut sum = PassCost::default();
        for c in m.cost.values() {
            sum.add(c);
        }
        let (pool_problems, batch_size, replica_batch_size) = match &m.spec {
            RecordedSpec::Full(s) => (
                s.passes.pool_problems,
                Some(s.passes.batch_size),
                passes_run.contains(&Pass::Replica).then(|| {
                    if s.passes.replica_schedule == crate::credit::schema::ReplicaSchedule::Same {
                        s.passes.batch_size
                    } else {
                        s.passes.effective_replica_batch_size()
                    }
                }),
            ),
            RecordedSpec::Passes { passes } => {
                let get = |k: &str| {
                    passes
                        .rest
                        .get(k)
                        .and_then(serde_json::Value::as_u64)
                        .map(|v| v as usize)
                };
                let batch = get("batch_size");
                (
                    m.pool_problems.unwrap_or(1),
                    batch,
                    passes_run
                        .contains(&Pass::Replica)
                        .then(|| get("replica_batch_size").or(batch.map(|b| b.div_ceil(2))))
                        .flatten(),
                )
            }
        };
        CampaignBench {
            spec_name: m.run.name.clone(),
            spec_sha256: m.run.spec_sha256.clone(),
            run_dir: run_dir.display().to_string(),
            model: m.run.model.clone(),
            dtype: m.dtype.to_string(),
            device: m.run.device.clone(),
            exec: m.run.exec,
            pool_problems,
            refill: m.refill.unwrap_or(false),
            batch_size,
            replica_batch_size,
            problems: m.problems_done,
            passes,
            whole_run: WholeRun {
                continuations: sum.continuations,
                tokens: sum.tokens,
                device_seconds: sum.device_seconds,
                tokens_per_device_s: rate(sum.tokens, sum.device_seconds),
                wall_seconds,
                wall_source,
                tokens_per_wall_s: wall_seconds.and_then(|w| rate(sum.tokens, w)),
            },
            load_seconds: None,
            kvcredit_version: m.run.kvcredit_version.clone(),
            libtorch_version: m.run.libtorch_version.clone(),
        }
    }

    /// The report of the finished campaign run folder `dir`, its wall time from the manifest
    /// ([`manifest_wall`]); a folder without a manifest or an unfinished run is an error.
    pub fn from_run_dir(dir: &Path) -> Result<CampaignBench> {
        let path = dir.join("manifest.json");
        if !path.is_file() {
            return Err(Error::Spec(format!(
                "{} has no manifest.json (not a campaign run folder)",
                dir.display()
            )));
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let m: Manifest = serde_json::from_str(&text).map_err(|e| {
            Error::Spec(format!(
                "{} is not a campaign manifest (another study's run?): {e}",
                path.display()
            ))
        })?;
        let (wall, source) = manifest_wall(&m)?;
        Ok(CampaignBench::from_manifest(&m, dir, wall, source))
    }

    /// Write the report as pretty JSON to `path`, atomically.
    pub fn write(&self, path: &Path) -> Result<()> {
        crate::study::write_json(path, self)
    }

    /// The report as a text table: a settings line, one row per pass and the whole run.
    pub fn table(&self) -> String {
        let fmt_rate = |r: Option<f64>| r.map_or("n/a".to_string(), |r| format!("{r:.1}"));
        let engine = self
            .exec
            .engine
            .map_or("unrecorded".to_string(), |e| e.to_string());
        let batches = match (self.batch_size, self.replica_batch_size) {
            (Some(b), Some(r)) => format!("batch {b} (replica {r})"),
            (Some(b), None) => format!("batch {b}"),
            (None, _) => "batch unrecorded".into(),
        };
        let mut t = String::new();
        let _ = writeln!(
            t,
            "campaign `{}` (spec sha256 {}): {} {} on {}, {} policy, {} engine, pool_problems {}{}, {}, {} problems",
            self.spec_name,
            &self.spec_sha256[..self.spec_sha256.len().min(12)],
            self.model,
            self.dtype,
            self.device,
            self.exec.policy,
            engine,
            self.pool_problems,
            if self.refill { ", refill" } else { "" },
            batches,
            self.problems
        );
        let _ = writeln!(
            t,
            "{:<10} {:>13} {:>10} {:>12} {:>12}",
            "pass", "continuations", "tokens", "device s", "tokens/s"
        );
        for p in &self.passes {
            let _ = writeln!(
                t,
                "{:<10} {:>13} {:>10} {:>12.3} {:>12}",
                p.pass,
                p.continuations,
                p.tokens,
                p.device_seconds,
                fmt_rate(p.tokens_per_s)
            );
        }
        let w = &self.whole_run;
        let wall = match w.wall_seconds {
            Some(s) => format!(
                "{s:.3} s wall ({}) = {} tok/s",
                if w.wall_source == WallSource::Measured {
                    "measured"
                } else {
                    "from the manifest"
                },
                fmt_rate(w.tokens_per_wall_s)
            ),
            None => format!("wall {}", w.wall_source.missing()),
        };
        let _ = writeln!(
            t,
            "whole run: {} continuations, {} tokens; {wall}; {:.3} device s summed = {} tok/s",
            w.continuations,
            w.tokens,
            w.device_seconds,
            fmt_rate(w.tokens_per_device_s)
        );
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-built manifest recording only `[passes]`, finished in one 10 s invocation.
    fn manifest() -> Manifest {
        serde_json::from_value(serde_json::json!({
            "name": "hand", "spec_sha256": "ab", "model": "m", "dtype": "bf16",
            "device": "cuda", "policy": "stock", "engine": "graph",
            "replica_schedule": "shuffled", "k": 2, "seed": 0,
            "kvcredit_version": "0", "libtorch_version": "0",
            "started_at": "2026-12-01T10:00:00Z", "finished_at": "2026-12-01T10:00:10Z",
            "problems_total": 1, "problems_done": 1, "snapshot_checks": 0,
            "snapshot_hits": 0, "snapshot_hit_rate": 1.0,
            "spec": {"passes": {"run": ["exact", "replica", "spectrum"], "batch_size": 8}},
            "cost": {
                "exact": {"device_seconds": 2.0, "tokens": 100, "continuations": 4},
                "replica": {"device_seconds": 4.0, "tokens": 100, "continuations": 4},
                "rollout": {"device_seconds": 1.0, "tokens": 50, "continuations": 0},
                "spectrum": {"device_seconds": 0.0, "tokens": 0, "continuations": 0}
            }
        }))
        .unwrap()
    }

    #[test]
    fn passes_in_run_order_and_their_sum() {
        let m = manifest();
        let (wall, source) = manifest_wall(&m).unwrap();
        assert_eq!((wall, source), (Some(10.0), WallSource::Manifest));
        let r = CampaignBench::from_manifest(&m, Path::new("d"), wall, source);
        let names: Vec<&str> = r.passes.iter().map(|p| p.pass.as_str()).collect();
        assert_eq!(names, ["rollout", "exact", "replica", "spectrum"]);
        assert_eq!(r.passes[1].tokens_per_s, Some(50.0));
        assert_eq!(r.passes[3].tokens_per_s, None);
        assert_eq!((r.batch_size, r.replica_batch_size), (Some(8), Some(4)));
        assert_eq!(r.pool_problems, 1);
        let w = &r.whole_run;
        assert_eq!((w.tokens, w.continuations, w.device_seconds), (250, 8, 7.0));
        assert_eq!(w.tokens_per_wall_s, Some(25.0));
        assert!(
            r.table()
                .contains("whole run: 8 continuations, 250 tokens; 10.000 s wall")
        );
    }

    #[test]
    fn wall_time_is_refused_where_the_timestamps_do_not_time_the_run() {
        let mut m = manifest();
        m.run.resumed_at.push("2026-12-01T11:00:00Z".into());
        assert_eq!(manifest_wall(&m).unwrap(), (None, WallSource::Resumed));
        let mut m = manifest();
        m.run.finished_at = Some("2026-12-01T10:00:05Z".into());
        assert_eq!(manifest_wall(&m).unwrap(), (None, WallSource::Inconsistent));
        m.run.finished_at = Some("yesterday".into());
        assert!(manifest_wall(&m).is_err());
        m.run.finished_at = None;
        assert!(
            manifest_wall(&m)
                .unwrap_err()
                .to_string()
                .contains("has not finished")
        );
    }
}
