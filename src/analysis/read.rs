//! Reading a campaign run dir: `manifest.json`, `estimates.parquet`, `continuations.parquet`,
//! and the row identities (and stop/extraction-rule counts) of `rollouts.parquet` and
//! `pivots.parquet`.
//!
//! Only the columns the analysis needs are read (by name, so extra columns are ignored and
//! column order does not matter). Integer columns accept any Arrow integer width that holds
//! the values, string columns any of Utf8 / LargeUtf8 / Utf8View, list columns List or
//! LargeList: files written by pyarrow or polars read as well as those written by kvcredit.
//! Every failure is one `Error::Output` line naming the file and the column.
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use crate::io::frame::{Frame, column_names, out_err};
use crate::{Error, Result};

use crate::credit::schema::col;
pub use crate::credit::schema::{
    CONTINUATIONS, ESTIMATES, MANIFEST, Manifest, PIVOTS, Pass, PassCost, ROLLOUTS,
};

/// Whether a policy label names the batch-invariant execution policy (`batch_invariant`, also
/// accepted as `batch-invariant`).
pub fn is_batch_invariant(policy: &str) -> bool {
    matches!(policy, "batch_invariant" | "batch-invariant")
}

/// Read and parse `RUN_DIR/manifest.json`.
pub fn read_manifest(run_dir: &Path) -> Result<Manifest> {
    let path = run_dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::Output(format!("{}: {e}", path.display())))
}

/// One row of `estimates.parquet` (the columns the analysis uses).
#[derive(Debug, Clone, PartialEq)]
pub struct EstimateRow {
    /// Configuration label (campaign name).
    pub config: String,
    /// Model name.
    pub model: String,
    /// Dtype label.
    pub dtype: String,
    /// Policy label.
    pub policy: String,
    /// GSM8K problem index (the cluster id).
    pub problem: u32,
    /// Index of the pivot among generated tokens.
    pub pivot_pos: u32,
    /// 1 = runner-up alternative, 2 = the next, ...
    pub alt_rank: u32,
    /// Which pass.
    pub pass: Pass,
    /// `Â` as written by the campaign.
    pub estimate: f64,
    /// Correct continuations of the orig branch.
    pub orig_successes: u32,
    /// Correct continuations of the alt branch.
    pub alt_successes: u32,
    /// Continuations per branch.
    pub k: u32,
    /// As written: this pass's 2K outcomes are not all equal.
    pub informative: bool,
    /// KV fingerprint verified at resume (exact/replica).
    pub snapshot_verified: bool,
}

impl EstimateRow {
    /// The canonical quantized estimate `(orig_successes − alt_successes) / k`, computed from
    /// the integer counts so that equal estimates compare equal and thresholds `m/k` land
    /// exactly.
    pub fn a_hat(&self) -> f64 {
        (f64::from(self.orig_successes) - f64::from(self.alt_successes)) / f64::from(self.k)
    }

    /// Whether the pass's 2K outcomes are not all equal, from the counts.
    pub fn is_informative(&self) -> bool {
        !(self.orig_successes == self.alt_successes
            && (self.orig_successes == 0 || self.orig_successes == self.k))
    }

    /// `(problem, pivot_pos, alt_rank)`.
    pub fn key(&self) -> Key {
        Key {
            problem: self.problem,
            pivot_pos: self.pivot_pos,
            alt_rank: self.alt_rank,
        }
    }
}

/// Identity of one estimate across passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key {
    /// Problem index.
    pub problem: u32,
    /// Pivot index among generated tokens.
    pub pivot_pos: u32,
    /// Alternative rank.
    pub alt_rank: u32,
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "problem={} pivot_pos={} alt_rank={}",
            self.problem, self.pivot_pos, self.alt_rank
        )
    }
}

/// One row of `continuations.parquet`.
#[derive(Debug, Clone, PartialEq)]
pub struct ContinuationRow {
    /// Problem index.
    pub problem: u32,
    /// Pivot index.
    pub pivot_pos: u32,
    /// 0 for the orig branch, else the alternative's rank.
    pub alt_rank: u32,
    /// `orig` or `alt`.
    pub branch: String,
    /// Which pass.
    pub pass: Pass,
    /// Sample index `k`.
    pub sample: u32,
    /// Generated token ids.
    pub tokens: Vec<i64>,
    /// Number of tokens.
    pub n_tokens: u32,
    /// `eos` or `length`.
    pub stop: String,
    /// Extracted answer, if any.
    pub answer: Option<String>,
    /// Graded outcome.
    pub correct: bool,
    /// The batch it ran in (absent in runs written before placements were recorded).
    pub placement: Option<Placement>,
    /// Its starting KV matched the decode-time fingerprint (absent in older runs).
    pub snapshot_verified: Option<bool>,
    /// Its numerical path, where the run recorded one.
    pub path: Option<PathRow>,
}

/// A continuation's recorded numerical path (the `path_*` columns and `keys_as_exact`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathRow {
    /// Steps it was decoded in.
    pub steps: u32,
    /// Of those, the steps whose key axis equals exact's at the same step of the same
    /// continuation (null when the run has no exact pass).
    pub keys_as_exact: Option<i64>,
}

/// Where a continuation ran in its pass: `chunk` (batch index within the pass for its
/// problem), `row` (row in that batch), `batch_rows` (rows the batch started with) and, in
/// refill runs, `fill` (its index among the continuations its row ran; 0 when not recorded).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Placement {
    /// Batch index within the pass, per problem.
    pub chunk: u32,
    /// Row in that batch.
    pub row: u32,
    /// Rows in that batch.
    pub batch_rows: u32,
    /// Index among the continuations its row ran (0 without a `fill` column).
    pub fill: u32,
}

/// One row of `rollouts.parquet` (its identity and pivot count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RolloutRow {
    /// Problem index.
    pub problem: u32,
    /// Pivots chosen in the rollout.
    pub n_pivots: u32,
}

/// One row of `pivots.parquet` (its identity).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PivotRow {
    /// Problem index.
    pub problem: u32,
    /// Pivot index among generated tokens.
    pub pivot_pos: u32,
    /// Alternative rank.
    pub alt_rank: u32,
}

pub(crate) fn passes(frame: &Frame, col: &str) -> Result<Vec<Pass>> {
    frame
        .strings(col)?
        .into_iter()
        .map(|s| {
            Pass::parse(&s).ok_or_else(|| {
                frame.err(
                    col,
                    format_args!(
                        "unknown pass `{s}` (expected one of {})",
                        Pass::ALL.map(Pass::as_str).join(", ")
                    ),
                )
            })
        })
        .collect()
}

/// Read `RUN_DIR/estimates.parquet`.
pub fn read_estimates(run_dir: &Path) -> Result<Vec<EstimateRow>> {
    let path = run_dir.join(ESTIMATES);
    let cols = [
        col::CONFIG,
        col::MODEL,
        col::DTYPE,
        col::POLICY,
        col::PROBLEM,
        col::PIVOT_POS,
        col::ALT_RANK,
        col::PASS,
        col::ESTIMATE,
        col::ORIG_SUCCESSES,
        col::ALT_SUCCESSES,
        col::K,
        col::INFORMATIVE,
        col::SNAPSHOT_VERIFIED,
    ];
    let f = Frame::read(&path, &cols)?;
    let (config, model, dtype, policy) = (
        f.strings(col::CONFIG)?,
        f.strings(col::MODEL)?,
        f.strings(col::DTYPE)?,
        f.strings(col::POLICY)?,
    );
    let (problem, pivot_pos, alt_rank) = (
        f.u32s(col::PROBLEM)?,
        f.u32s(col::PIVOT_POS)?,
        f.u32s(col::ALT_RANK)?,
    );
    let pass = passes(&f, col::PASS)?;
    let estimate = f.f64s(col::ESTIMATE)?;
    let (orig, alt, k) = (
        f.u32s(col::ORIG_SUCCESSES)?,
        f.u32s(col::ALT_SUCCESSES)?,
        f.u32s(col::K)?,
    );
    let (informative, verified) = (f.bools(col::INFORMATIVE)?, f.bools(col::SNAPSHOT_VERIFIED)?);
    let mut rows = Vec::with_capacity(f.len());
    let mut strs = config.into_iter().zip(model).zip(dtype).zip(policy);
    for j in 0..f.len() {
        let (((config, model), dtype), policy) = strs.next().expect("columns have equal length");
        let row = EstimateRow {
            config,
            model,
            dtype,
            policy,
            problem: problem[j],
            pivot_pos: pivot_pos[j],
            alt_rank: alt_rank[j],
            pass: pass[j],
            estimate: estimate[j],
            orig_successes: orig[j],
            alt_successes: alt[j],
            k: k[j],
            informative: informative[j],
            snapshot_verified: verified[j],
        };
        if row.k == 0 || row.orig_successes > row.k || row.alt_successes > row.k {
            return Err(out_err(
                &path,
                format_args!(
                    "row {j} ({}, pass={}): successes {}/{} out of k={}",
                    row.key(),
                    row.pass,
                    row.orig_successes,
                    row.alt_successes,
                    row.k
                ),
            ));
        }
        rows.push(row);
    }
    Ok(rows)
}

/// Read `RUN_DIR/continuations.parquet` (`chunk`, `row`, `batch_rows` and
/// `snapshot_verified` when the file has them).
pub fn read_continuations(run_dir: &Path) -> Result<Vec<ContinuationRow>> {
    let path = run_dir.join(CONTINUATIONS);
    let mut cols = vec![
        col::PROBLEM,
        col::PIVOT_POS,
        col::ALT_RANK,
        col::BRANCH,
        col::PASS,
        col::SAMPLE,
        col::TOKENS,
        col::N_TOKENS,
        col::STOP,
        col::ANSWER,
        col::CORRECT,
    ];
    let present = column_names(&path)?;
    let has = |c: &str| present.iter().any(|p| p == c);
    let placed = [col::CHUNK, col::ROW, col::BATCH_ROWS]
        .iter()
        .all(|c| has(c));
    if placed {
        cols.extend([col::CHUNK, col::ROW, col::BATCH_ROWS]);
    }
    let filled = placed && has(col::FILL);
    if filled {
        cols.push(col::FILL);
    }
    let verified = has(col::SNAPSHOT_VERIFIED);
    if verified {
        cols.push(col::SNAPSHOT_VERIFIED);
    }
    let pathed = has(col::PATH_STEPS) && has(col::KEYS_AS_EXACT);
    if pathed {
        cols.extend([col::PATH_STEPS, col::KEYS_AS_EXACT]);
    }
    let f = Frame::read(&path, &cols)?;
    let (problem, pivot_pos, alt_rank, sample, n_tokens) = (
        f.u32s(col::PROBLEM)?,
        f.u32s(col::PIVOT_POS)?,
        f.u32s(col::ALT_RANK)?,
        f.u32s(col::SAMPLE)?,
        f.u32s(col::N_TOKENS)?,
    );
    let pass = passes(&f, col::PASS)?;
    let correct = f.bools(col::CORRECT)?;
    let placements: Option<Vec<Placement>> = if placed {
        let (c, r, b) = (
            f.u32s(col::CHUNK)?,
            f.u32s(col::ROW)?,
            f.u32s(col::BATCH_ROWS)?,
        );
        let fill = if filled {
            f.u32s(col::FILL)?
        } else {
            vec![0; f.len()]
        };
        Some(
            (0..f.len())
                .map(|j| Placement {
                    chunk: c[j],
                    row: r[j],
                    batch_rows: b[j],
                    fill: fill[j],
                })
                .collect(),
        )
    } else {
        None
    };
    let verified = if verified {
        Some(f.bools(col::SNAPSHOT_VERIFIED)?)
    } else {
        None
    };
    let paths: Option<Vec<PathRow>> = if pathed {
        let steps = f.u32s(col::PATH_STEPS)?;
        let same = f.opt_i64s(col::KEYS_AS_EXACT)?;
        Some(
            steps
                .into_iter()
                .zip(same)
                .map(|(steps, keys_as_exact)| PathRow {
                    steps,
                    keys_as_exact,
                })
                .collect(),
        )
    } else {
        None
    };
    let mut branch = f.strings(col::BRANCH)?.into_iter();
    let mut tokens = f.int_lists(col::TOKENS)?.into_iter();
    let mut stop = f.strings(col::STOP)?.into_iter();
    let mut answer = f.opt_strings(col::ANSWER)?.into_iter();
    let mut rows = Vec::with_capacity(f.len());
    for j in 0..f.len() {
        rows.push(ContinuationRow {
            problem: problem[j],
            pivot_pos: pivot_pos[j],
            alt_rank: alt_rank[j],
            branch: branch.next().expect("equal length"),
            pass: pass[j],
            sample: sample[j],
            tokens: tokens.next().expect("equal length"),
            n_tokens: n_tokens[j],
            stop: stop.next().expect("equal length"),
            answer: answer.next().expect("equal length"),
            correct: correct[j],
            placement: placements.as_ref().map(|p| p[j]),
            snapshot_verified: verified.as_ref().map(|v| v[j]),
            path: paths.as_ref().map(|p| p[j]),
        });
    }
    Ok(rows)
}

/// Read the `problem` and `n_pivots` columns of `RUN_DIR/rollouts.parquet`.
pub fn read_rollouts(run_dir: &Path) -> Result<Vec<RolloutRow>> {
    let f = Frame::read(&run_dir.join(ROLLOUTS), &[col::PROBLEM, col::N_PIVOTS])?;
    let (problem, n_pivots) = (f.u32s(col::PROBLEM)?, f.u32s(col::N_PIVOTS)?);
    Ok(problem
        .into_iter()
        .zip(n_pivots)
        .map(|(problem, n_pivots)| RolloutRow { problem, n_pivots })
        .collect())
}

/// Read the row identities of `RUN_DIR/pivots.parquet`.
pub fn read_pivots(run_dir: &Path) -> Result<Vec<PivotRow>> {
    let f = Frame::read(
        &run_dir.join(PIVOTS),
        &[col::PROBLEM, col::PIVOT_POS, col::ALT_RANK],
    )?;
    let (problem, pivot_pos, alt_rank) = (
        f.u32s(col::PROBLEM)?,
        f.u32s(col::PIVOT_POS)?,
        f.u32s(col::ALT_RANK)?,
    );
    Ok((0..f.len())
        .map(|j| PivotRow {
            problem: problem[j],
            pivot_pos: pivot_pos[j],
            alt_rank: alt_rank[j],
        })
        .collect())
}

/// Stop reasons and extraction rules of one pass's generated texts (continuations, or the
/// rollouts under the label `rollout`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OutputCounts {
    /// Rows counted.
    pub rows: u64,
    /// Rows with `stop == "length"`: the token cap was hit (truncated).
    pub truncated: u64,
    /// Rows per `extraction_rule` value (a null rule counts as `none`); `None` when a file
    /// had no `extraction_rule` column (written before the column existed).
    pub rules: Option<BTreeMap<String, u64>>,
}

impl OutputCounts {
    /// Add another run's counts (rules stay known only if both are).
    pub fn merge(&mut self, other: &OutputCounts) {
        self.rows += other.rows;
        self.truncated += other.truncated;
        self.rules = match (self.rules.take(), &other.rules) {
            (Some(mut a), Some(b)) => {
                for (rule, n) in b {
                    *a.entry(rule.clone()).or_default() += n;
                }
                Some(a)
            }
            _ => None,
        };
    }
}

/// Label of the rollouts in [`read_output_counts`].
pub const ROLLOUT: &str = "rollout";

/// Name of the optional extraction-rule column of continuations and rollouts.
pub const EXTRACTION_RULE: &str = col::EXTRACTION_RULE;

fn count_outputs(
    f: &Frame,
    labels: Vec<String>,
    out: &mut BTreeMap<String, OutputCounts>,
) -> Result<()> {
    let stop = f.strings(col::STOP)?;
    let rules = if f.has(EXTRACTION_RULE) {
        Some(f.opt_strings(EXTRACTION_RULE)?)
    } else {
        None
    };
    for (j, (label, stop)) in labels.into_iter().zip(stop).enumerate() {
        let c = out.entry(label).or_insert_with(|| OutputCounts {
            rules: rules.as_ref().map(|_| BTreeMap::new()),
            ..OutputCounts::default()
        });
        c.rows += 1;
        c.truncated += u64::from(stop == "length");
        if let (Some(rules), Some(map)) = (&rules, c.rules.as_mut()) {
            let rule = rules[j].as_deref().unwrap_or("none");
            *map.entry(rule.to_string()).or_default() += 1;
        }
    }
    Ok(())
}

/// Per pass (`exact`, `replica`, `refeed`) the continuations' stop and extraction-rule counts
/// from `continuations.parquet` (required), and under [`ROLLOUT`] those of
/// `rollouts.parquet` when the run dir has one. `extraction_rule` is read only if present.
pub fn read_output_counts(run_dir: &Path) -> Result<BTreeMap<String, OutputCounts>> {
    let mut out = BTreeMap::new();
    let path = run_dir.join(CONTINUATIONS);
    let f = Frame::read_optional(&path, &[col::PASS, col::STOP], &[EXTRACTION_RULE])?;
    let labels = passes(&f, col::PASS)?
        .into_iter()
        .map(|p| p.as_str().to_string())
        .collect();
    count_outputs(&f, labels, &mut out)?;
    let path = run_dir.join(ROLLOUTS);
    if path.exists() {
        let f = Frame::read_optional(&path, &[col::STOP], &[EXTRACTION_RULE])?;
        count_outputs(&f, vec![ROLLOUT.to_string(); f.len()], &mut out)?;
    }
    Ok(out)
}
