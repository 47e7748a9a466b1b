//! The records a campaign writes and the analysis reads, defined once: pass names, per-pass
//! cost, the manifest, and the file names of a run dir. Policy, dtype, engine and replica
//! schedule are enums that serialize to the same strings earlier runs hold.
use super::spec::CampaignSpec;
use crate::runtime::Dtype;
use crate::study::header::RunHeader;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

pub use super::spec::{Pass, PassSchedule, PassState, ReplicaSchedule};
pub use crate::exec::ExecRecord;
pub use crate::tasks::spec::TaskRecord;

/// File names inside a run dir.
pub const MANIFEST: &str = "manifest.json";
/// One row per problem.
pub const ROLLOUTS: &str = "rollouts.parquet";
/// One row per pivot × alternative.
pub const PIVOTS: &str = "pivots.parquet";
/// One row per continuation.
pub const CONTINUATIONS: &str = "continuations.parquet";
/// One row per problem × pivot × alternative × pass.
pub const ESTIMATES: &str = "estimates.parquet";
/// The four tables of a campaign (file stems), in write order.
pub const TABLES: [&str; 4] = ["rollouts", "pivots", "continuations", "estimates"];

/// Column names of the four tables, shared by the writer (`credit::records`) and the reader
/// (`analysis::read`).
pub mod col {
    /// `config`.
    pub const CONFIG: &str = "config";
    /// `model`.
    pub const MODEL: &str = "model";
    /// `dtype`.
    pub const DTYPE: &str = "dtype";
    /// `policy`.
    pub const POLICY: &str = "policy";
    /// `problem`.
    pub const PROBLEM: &str = "problem";
    /// `prompt_len`.
    pub const PROMPT_LEN: &str = "prompt_len";
    /// `n_tokens`.
    pub const N_TOKENS: &str = "n_tokens";
    /// `tokens`.
    pub const TOKENS: &str = "tokens";
    /// `logprobs`.
    pub const LOGPROBS: &str = "logprobs";
    /// `margins`.
    pub const MARGINS: &str = "margins";
    /// `stop`.
    pub const STOP: &str = "stop";
    /// `text`.
    pub const TEXT: &str = "text";
    /// `answer`.
    pub const ANSWER: &str = "answer";
    /// `extraction_rule`.
    pub const EXTRACTION_RULE: &str = "extraction_rule";
    /// `correct`.
    pub const CORRECT: &str = "correct";
    /// `n_candidates`.
    pub const N_CANDIDATES: &str = "n_candidates";
    /// `n_pivots`.
    pub const N_PIVOTS: &str = "n_pivots";
    /// `pivot_pos`.
    pub const PIVOT_POS: &str = "pivot_pos";
    /// `abs_pos`.
    pub const ABS_POS: &str = "abs_pos";
    /// `token`.
    pub const TOKEN: &str = "token";
    /// `token_text`.
    pub const TOKEN_TEXT: &str = "token_text";
    /// `margin`.
    pub const MARGIN: &str = "margin";
    /// `margin_at_temperature`.
    pub const MARGIN_AT_TEMPERATURE: &str = "margin_at_temperature";
    /// `logprob`.
    pub const LOGPROB: &str = "logprob";
    /// `alt_rank`.
    pub const ALT_RANK: &str = "alt_rank";
    /// `alt_token`.
    pub const ALT_TOKEN: &str = "alt_token";
    /// `alt_text`.
    pub const ALT_TEXT: &str = "alt_text";
    /// `fingerprint`.
    pub const FINGERPRINT: &str = "fingerprint";
    /// `branch`.
    pub const BRANCH: &str = "branch";
    /// `pass`.
    pub const PASS: &str = "pass";
    /// `sample`.
    pub const SAMPLE: &str = "sample";
    /// `chunk`.
    pub const CHUNK: &str = "chunk";
    /// `row`.
    pub const ROW: &str = "row";
    /// `batch_rows`.
    pub const BATCH_ROWS: &str = "batch_rows";
    /// `fill` (refill runs only).
    pub const FILL: &str = "fill";
    /// `snapshot_verified`.
    pub const SNAPSHOT_VERIFIED: &str = "snapshot_verified";
    /// `path_steps`.
    pub const PATH_STEPS: &str = "path_steps";
    /// `path_rows_min`.
    pub const PATH_ROWS_MIN: &str = "path_rows_min";
    /// `path_rows_max`.
    pub const PATH_ROWS_MAX: &str = "path_rows_max";
    /// `path_keys_min`.
    pub const PATH_KEYS_MIN: &str = "path_keys_min";
    /// `path_keys_max`.
    pub const PATH_KEYS_MAX: &str = "path_keys_max";
    /// `path_rows_digest`.
    pub const PATH_ROWS_DIGEST: &str = "path_rows_digest";
    /// `path_keys_digest`.
    pub const PATH_KEYS_DIGEST: &str = "path_keys_digest";
    /// `keys_as_exact`.
    pub const KEYS_AS_EXACT: &str = "keys_as_exact";
    /// `estimate`.
    pub const ESTIMATE: &str = "estimate";
    /// `orig_successes`.
    pub const ORIG_SUCCESSES: &str = "orig_successes";
    /// `alt_successes`.
    pub const ALT_SUCCESSES: &str = "alt_successes";
    /// `k`.
    pub const K: &str = "k";
    /// `informative`.
    pub const INFORMATIVE: &str = "informative";
    /// `orig_token`.
    pub const ORIG_TOKEN: &str = "orig_token";
    /// `orig_text`.
    pub const ORIG_TEXT: &str = "orig_text";
}

/// The columns every table starts with.
pub const COMMON_COLUMNS: [&str; 5] = [
    col::CONFIG,
    col::MODEL,
    col::DTYPE,
    col::POLICY,
    col::PROBLEM,
];

/// Columns of `rollouts` (one row per problem) after [`COMMON_COLUMNS`], in file order.
pub const ROLLOUT_COLUMNS: [&str; 12] = [
    col::PROMPT_LEN,
    col::N_TOKENS,
    col::TOKENS,
    col::LOGPROBS,
    col::MARGINS,
    col::STOP,
    col::TEXT,
    col::ANSWER,
    col::EXTRACTION_RULE,
    col::CORRECT,
    col::N_CANDIDATES,
    col::N_PIVOTS,
];

/// Columns of `pivots` (one row per pivot × alternative) after [`COMMON_COLUMNS`], in file order.
pub const PIVOT_COLUMNS: [&str; 11] = [
    col::PIVOT_POS,
    col::ABS_POS,
    col::TOKEN,
    col::TOKEN_TEXT,
    col::MARGIN,
    col::MARGIN_AT_TEMPERATURE,
    col::LOGPROB,
    col::ALT_RANK,
    col::ALT_TOKEN,
    col::ALT_TEXT,
    col::FINGERPRINT,
];

/// Columns of `continuations` that record where and how a continuation ran (its batch placement
/// and numerical path) rather than what it produced: two schedules of the same jobs differ there
/// and, where the numerics are batch-invariant, nowhere else.
pub const SCHEDULE_COLUMNS: [&str; 11] = [
    col::CHUNK,
    col::ROW,
    col::BATCH_ROWS,
    col::FILL,
    col::PATH_ROWS_MIN,
    col::PATH_ROWS_MAX,
    col::PATH_KEYS_MIN,
    col::PATH_KEYS_MAX,
    col::PATH_ROWS_DIGEST,
    col::PATH_KEYS_DIGEST,
    col::KEYS_AS_EXACT,
];

/// Columns of `continuations` (one row per continuation) after [`COMMON_COLUMNS`], in file order.
pub const CONTINUATION_COLUMNS: [&str; 23] = [
    col::PIVOT_POS,
    col::ALT_RANK,
    col::BRANCH,
    col::PASS,
    col::SAMPLE,
    col::TOKENS,
    col::N_TOKENS,
    col::STOP,
    col::ANSWER,
    col::EXTRACTION_RULE,
    col::CORRECT,
    col::CHUNK,
    col::ROW,
    col::BATCH_ROWS,
    col::SNAPSHOT_VERIFIED,
    col::PATH_STEPS,
    col::PATH_ROWS_MIN,
    col::PATH_ROWS_MAX,
    col::PATH_KEYS_MIN,
    col::PATH_KEYS_MAX,
    col::PATH_ROWS_DIGEST,
    col::PATH_KEYS_DIGEST,
    col::KEYS_AS_EXACT,
];

/// Columns of `estimates` (one row per pivot × alternative × pass) after [`COMMON_COLUMNS`], in file order.
pub const ESTIMATE_COLUMNS: [&str; 15] = [
    col::PIVOT_POS,
    col::ABS_POS,
    col::ALT_RANK,
    col::PASS,
    col::ESTIMATE,
    col::ORIG_SUCCESSES,
    col::ALT_SUCCESSES,
    col::K,
    col::INFORMATIVE,
    col::MARGIN,
    col::ORIG_TOKEN,
    col::ALT_TOKEN,
    col::ORIG_TEXT,
    col::ALT_TEXT,
    col::SNAPSHOT_VERIFIED,
];

/// The columns of a table (by file stem, see [`TABLES`]) in file order, common ones first.
pub fn columns(table: &str) -> Option<Vec<&'static str>> {
    let rest: &[&str] = match table {
        "rollouts" => &ROLLOUT_COLUMNS,
        "pivots" => &PIVOT_COLUMNS,
        "continuations" => &CONTINUATION_COLUMNS,
        "estimates" => &ESTIMATE_COLUMNS,
        _ => return None,
    };
    Some(COMMON_COLUMNS.iter().chain(rest).copied().collect())
}

/// [`columns`] of a run with `passes.refill` as `refill` says: a refill run's continuations
/// also have `fill`, right after `batch_rows`.
pub fn run_columns(table: &str, refill: bool) -> Option<Vec<&'static str>> {
    let mut cols = columns(table)?;
    if refill && table == "continuations" {
        let at = cols.iter().position(|&c| c == col::BATCH_ROWS)? + 1;
        cols.insert(at, col::FILL);
    }
    Some(cols)
}

/// Work and time spent in one pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PassCost {
    /// Wall seconds on the device (synchronized).
    #[serde(default)]
    pub device_seconds: f64,
    /// Tokens decoded (continuations) or prefilled (refeed and spectrum prefixes are counted
    /// too).
    #[serde(default)]
    pub tokens: u64,
    /// Continuations run.
    #[serde(default)]
    pub continuations: u64,
}

impl PassCost {
    /// Add another cost to this one.
    pub fn add(&mut self, other: &PassCost) {
        self.device_seconds += other.device_seconds;
        self.tokens += other.tokens;
        self.continuations += other.continuations;
    }
}

/// The spec a manifest records: the whole campaign spec as parsed, or (in hand-built run dirs)
/// only its passes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RecordedSpec {
    /// The spec as parsed.
    Full(Box<CampaignSpec>),
    /// Only `[passes]`.
    Passes {
        /// `[passes]` of the spec.
        passes: RecordedPasses,
    },
}

/// The passes of a partial recorded spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedPasses {
    /// Passes run.
    pub run: Vec<Pass>,
    /// Every other key of `[passes]`, kept as written.
    #[serde(flatten)]
    pub rest: BTreeMap<String, serde_json::Value>,
}

impl RecordedSpec {
    /// The passes the spec ran, in order.
    pub fn passes(&self) -> &[Pass] {
        match self {
            RecordedSpec::Full(s) => &s.passes.run,
            RecordedSpec::Passes { passes } => &passes.run,
        }
    }
}

/// What a campaign run records about itself (`manifest.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Study, spec, model, execution, build and times; `run.name` is the campaign
    /// (configuration) label, the `config` column of its tables.
    #[serde(flatten)]
    pub run: RunHeader,
    /// The spec as parsed.
    pub spec: RecordedSpec,
    /// The task: name, grader, prompt and data hash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<TaskRecord>,
    /// Run dtype.
    pub dtype: Dtype,
    /// Replica schedule.
    pub replica_schedule: ReplicaSchedule,
    /// `passes.pool_problems` when above 1 (problems run in pooled groups of that size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_problems: Option<usize>,
    /// `passes.refill` when on (each pass ran as one continuously refilled queue).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refill: Option<bool>,
    /// Continuations per branch.
    pub k: u32,
    /// Campaign seed.
    pub seed: u64,
    /// The one-line error that stopped the last invocation, if it failed (cleared when a
    /// rerun resumes the run).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
    /// Problems in the spec.
    pub problems_total: usize,
    /// Problems with a finished shard.
    pub problems_done: usize,
    /// Exact/replica continuations whose starting K/V had a decode-time fingerprint to verify.
    pub snapshot_checks: u64,
    /// Of those, the verified ones (counted after the comparison matched).
    pub snapshot_hits: u64,
    /// `snapshot_hits / snapshot_checks` (1 when there were none).
    pub snapshot_hit_rate: f64,
    /// Distinct snapshots (one per pivot and pass) verified in the exact and replica passes;
    /// absent in runs written before they were counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_checks_pivots: Option<u64>,
    /// Of those, the snapshots every continuation of which was verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_hits_pivots: Option<u64>,
    /// Cost per pass name (plus `rollout`).
    pub cost: BTreeMap<String, PassCost>,
    /// The numerical path of each pass (absent in runs written before it was recorded).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub numerics: BTreeMap<String, PassNumerics>,
    /// What the spectrum pass sent, summed over finished problems; absent without that pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spectrum: Option<SpectrumStats>,
    /// The slice of the spec's problems this run folder holds (`campaign run --shard i/N`);
    /// absent for an unsharded run. A sharded run's `problems_total` counts its own problems.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardSpec>,
    /// For a folder written by `campaign merge`: the shards it was merged from, in order
    /// (an unsharded input appears as `0/1`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub merged_from: Vec<ShardSpec>,
    /// sha256 of each table the run finished (file name → hex digest), recorded as it
    /// finished and verified by `check` and `analyze` before they read a table; empty while
    /// unfinished and in runs written before digests were recorded.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub files_sha256: BTreeMap<String, String>,
}

/// The numerical path of one pass, summed over problems: what decides a stock step's rounding
/// (engine, kernels, batch rows, key axis), so two runs or two passes can be compared
/// afterwards. Per continuation, `continuations.parquet` holds the same (`path_*` columns).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PassNumerics {
    /// Continuation engine as run.
    pub engine: String,
    /// `exact` (natural order, `passes.batch_size`) or the replica schedule (`shuffled`, `same`).
    pub schedule: String,
    /// Rows the pass's batches (or refill queue) were asked to hold.
    pub batch_rows: usize,
    /// Masked key positions added to every step's key axis.
    pub key_pad: i64,
    /// Fewest and most rows of a step that decoded a kept token.
    pub rows_min: u32,
    /// Most rows of such a step.
    pub rows_max: u32,
    /// Shortest key axis attended.
    pub keys_min: u32,
    /// Longest key axis attended.
    pub keys_max: u32,
    /// Continuation-steps decoded (one per continuation per step).
    pub steps: u64,
    /// Sampler kernel (`aten` or `fused`).
    pub sampler: String,
    /// Glue kernels (`aten` or `fused`).
    pub glue: String,
}

impl PassNumerics {
    /// Widen `self` by another problem's summary of the same pass.
    pub fn add(&mut self, o: &PassNumerics) {
        if self.steps == 0 && o.steps > 0 {
            *self = o.clone();
            return;
        }
        self.widen((o.rows_min, o.rows_max), (o.keys_min, o.keys_max), o.steps);
    }

    /// Widen the row and key-axis ranges by `steps` continuation-steps spanning `rows` and
    /// `keys` (nothing when `steps` is 0).
    pub fn widen(&mut self, rows: (u32, u32), keys: (u32, u32), steps: u64) {
        if steps == 0 {
            return;
        }
        if self.steps == 0 {
            (self.rows_min, self.rows_max) = rows;
            (self.keys_min, self.keys_max) = keys;
        } else {
            self.rows_min = self.rows_min.min(rows.0);
            self.rows_max = self.rows_max.max(rows.1);
            self.keys_min = self.keys_min.min(keys.0);
            self.keys_max = self.keys_max.max(keys.1);
        }
        self.steps += steps;
    }
}

/// The SpectrumKV frames of the spectrum pass (one per pivot: the decode-time snapshot
/// compressed at the spec's budget), summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SpectrumStats {
    /// Snapshots compressed (pivots).
    pub snapshots: u64,
    /// Their context positions, summed.
    pub tokens: u64,
    /// Of those, sent at FP16.
    pub tokens_fp16: u64,
    /// Sent at INT8.
    pub tokens_int8: u64,
    /// Sent at INT4.
    pub tokens_int4: u64,
    /// Dropped (masked at their original positions).
    pub tokens_drop: u64,
    /// Bytes of the wire frames, summed (header, indices, blocks, trailer).
    pub frame_bytes: u64,
    /// Bytes of the same contexts' full-FP16 KV, summed (the budget's denominator).
    pub fp16_bytes: u64,
    /// Smallest per-snapshot real budget `frame bytes ÷ full-FP16 bytes` (1 when none).
    pub real_b_min: f64,
    /// Largest per-snapshot real budget (0 when none).
    pub real_b_max: f64,
}

impl SpectrumStats {
    /// Add another sum to this one.
    pub fn add(&mut self, o: &SpectrumStats) {
        if o.snapshots == 0 {
            return;
        }
        if self.snapshots == 0 {
            *self = *o;
            return;
        }
        self.snapshots += o.snapshots;
        self.tokens += o.tokens;
        self.tokens_fp16 += o.tokens_fp16;
        self.tokens_int8 += o.tokens_int8;
        self.tokens_int4 += o.tokens_int4;
        self.tokens_drop += o.tokens_drop;
        self.frame_bytes += o.frame_bytes;
        self.fp16_bytes += o.fp16_bytes;
        self.real_b_min = self.real_b_min.min(o.real_b_min);
        self.real_b_max = self.real_b_max.max(o.real_b_max);
    }

    /// Overall real budget: frame bytes ÷ full-FP16 bytes (`None` without snapshots).
    pub fn real_b(&self) -> Option<f64> {
        (self.fp16_bytes > 0).then(|| self.frame_bytes as f64 / self.fp16_bytes as f64)
    }
}

/// Shard `index` of `count` of a campaign's problems: the problems at positions `j` (0-based,
/// in the spec's order: GSM8K index `problems.start + j`) with `j % count == index`, i.e.
/// round-robin, so shards differ in size by at most one problem and long and short problems
/// spread evenly. Written `index/count` on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ShardSpec {
    /// 0-based shard number, below `count`.
    pub index: usize,
    /// Number of shards, at least 1.
    pub count: usize,
}

impl ShardSpec {
    /// The whole campaign as one shard.
    pub const WHOLE: ShardSpec = ShardSpec { index: 0, count: 1 };

    /// A shard, refused unless `count >= 1` and `index < count`.
    pub fn new(index: usize, count: usize) -> Result<ShardSpec, String> {
        if count == 0 {
            return Err(format!("shard {index}/{count}: N must be at least 1"));
        }
        if index >= count {
            return Err(format!(
                "shard {index}/{count}: i must be below N (shards are numbered 0..{})",
                count - 1
            ));
        }
        Ok(ShardSpec { index, count })
    }

    /// Whether the problem at 0-based position `position` of the spec belongs to this shard.
    pub fn holds(&self, position: usize) -> bool {
        position % self.count == self.index
    }

    /// The items of `all` (in the spec's order) this shard holds.
    pub fn select<T: Clone>(&self, all: &[T]) -> Vec<T> {
        all.iter()
            .enumerate()
            .filter(|(j, _)| self.holds(*j))
            .map(|(_, p)| p.clone())
            .collect()
    }
}

impl fmt::Display for ShardSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl std::str::FromStr for ShardSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<ShardSpec, String> {
        let bad = || format!("shard `{s}`: expected i/N with 0 <= i < N (e.g. 0/4)");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let i: usize = i.trim().parse().map_err(|_| bad())?;
        let n: usize = n.trim().parse().map_err(|_| bad())?;
        ShardSpec::new(i, n)
    }
}

impl Manifest {
    /// The passes the spec ran, in order.
    pub fn passes(&self) -> Vec<Pass> {
        self.spec.passes().to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{BiTiles, EngineMode, PolicyKind};
    use std::path::{Path, PathBuf};

    fn load(path: &Path) -> (Manifest, serde_json::Value) {
        let text = std::fs::read_to_string(path).unwrap();
        let m: Manifest = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{} does not load: {e}", path.display()));
        (m, serde_json::from_str(&text).unwrap())
    }

    /// Every campaign manifest in the repository loads through the shared type and writes back
    /// as it reads; gpu-trust's (written by the current writer) writes back the same JSON value.
    #[test]
    fn every_recorded_manifest_loads_and_round_trips() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let trust_path = root.join("tests/fixtures/manifests/gpu-trust.json");
        let mut paths: Vec<PathBuf> = [
            "tests/fixtures/manifests/bf16-cpu.json",
            "tests/fixtures/manifests/gpu-engines-bi-eager.json",
            "tests/fixtures/manifests/gpu-engines-bi-graph.json",
        ]
        .iter()
        .map(|p| root.join(p))
        .collect();
        let n_docs = paths.len();
        for entry in std::fs::read_dir(root.join("tests/fixtures/analysis/runs")).unwrap() {
            let m = entry.unwrap().path().join(MANIFEST);
            if m.is_file() {
                paths.push(m);
            }
        }
        assert!(paths.len() > n_docs, "no fixture manifests found");
        for path in &paths {
            // Older specs gain the defaults of keys added since, so compare parsed values.
            let (m, _) = load(path);
            let again: Manifest =
                serde_json::from_value(serde_json::to_value(&m).unwrap()).unwrap();
            assert_eq!(again, m, "{} does not round-trip", path.display());
        }
        let (trust, value) = load(&trust_path);
        assert_eq!(serde_json::to_value(&trust).unwrap(), value);
        assert!(matches!(trust.spec, RecordedSpec::Full(_)));
        assert_eq!(
            (trust.run.exec.policy, trust.dtype, trust.run.exec.engine),
            (PolicyKind::Stock, Dtype::Bf16, Some(EngineMode::Graph))
        );
        assert_eq!(trust.replica_schedule, ReplicaSchedule::Shuffled);
        assert_eq!(trust.passes(), Pass::ALL[..3]);
    }

    #[test]
    fn shards_parse_validate_and_partition_round_robin() {
        let s: ShardSpec = "1/3".parse().unwrap();
        assert_eq!((s.index, s.count, s.to_string()), (1, 3, "1/3".into()));
        let picked: Vec<u32> = s.select(&[10, 11, 12, 13, 14, 15, 16]);
        assert_eq!(picked, vec![11, 14]);
        for bad in ["3/3", "0/0", "1", "a/2", "-1/2", ""] {
            assert!(bad.parse::<ShardSpec>().is_err(), "{bad}");
        }
        assert!(ShardSpec::WHOLE.holds(5));
    }

    #[test]
    fn enums_serialize_to_the_recorded_strings() {
        let s = |v: serde_json::Value| v.as_str().unwrap().to_string();
        assert_eq!(
            s(serde_json::to_value(PolicyKind::BatchInvariant).unwrap()),
            "batch_invariant"
        );
        let alias: PolicyKind = serde_json::from_str("\"batch-invariant\"").unwrap();
        assert_eq!(alias, PolicyKind::BatchInvariant);
        for d in [Dtype::Fp32, Dtype::Fp16, Dtype::Bf16] {
            assert_eq!(s(serde_json::to_value(d).unwrap()), d.to_string());
        }
        for e in [EngineMode::Eager, EngineMode::Static, EngineMode::Graph] {
            assert_eq!(s(serde_json::to_value(e).unwrap()), e.to_string());
        }
        for p in Pass::ALL {
            assert_eq!(s(serde_json::to_value(p).unwrap()), p.as_str());
            assert_eq!(Pass::parse(p.as_str()), Some(p));
        }
    }

    #[test]
    fn exec_record_resumes_only_with_the_same_engine_and_tiles() {
        let stock = |e| ExecRecord {
            policy: PolicyKind::Stock,
            tiles: None,
            engine: Some(e),
        };
        let mut was = stock(EngineMode::Graph);
        let err = was
            .resume_with(&stock(EngineMode::Eager), "run")
            .unwrap_err();
        assert!(err.to_string().contains("--engine graph"), "{err}");
        assert!(was.resume_with(&stock(EngineMode::Graph), "run").is_ok());
        let bi = |t: BiTiles| ExecRecord {
            policy: PolicyKind::BatchInvariant,
            tiles: Some(t),
            engine: Some(EngineMode::Eager),
        };
        let small = BiTiles {
            gemm_rows: 4,
            ..BiTiles::CPU
        };
        let mut was = bi(BiTiles::CPU);
        let err = was.resume_with(&bi(small), "run").unwrap_err().to_string();
        assert!(
            err.contains("--tiles gemm_rows=16,") && !err.contains('\n'),
            "{err}"
        );
        // Batch-invariant numerics do not depend on the engine; an older record gains tiles.
        let mut old = ExecRecord {
            policy: PolicyKind::BatchInvariant,
            tiles: None,
            engine: Some(EngineMode::Graph),
        };
        old.resume_with(&bi(small), "run").unwrap();
        assert_eq!(old.tiles, Some(small));
        let v = serde_json::to_value(bi(small)).unwrap();
        assert_eq!(v["policy"], "batch_invariant");
        assert_eq!(v["tiles"]["gemm_rows"], 4);
        assert_eq!(v["engine"], "eager");
    }
}
