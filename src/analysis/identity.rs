//! Token identity with exact: per pass, how many continuations generated exactly exact's
//! tokens. A comparison whose continuations are all token-identical to exact's exercised no
//! numerical difference, so its disagreement rate is 0 by construction, not by measurement.
//!
//! ```no_run
//! use kvcredit::analysis::identity::token_identical;
//! for (pass, n) in token_identical("runs/demo".as_ref())? {
//!     println!("{pass}: {}/{} identical to exact", n.identical, n.total);
//! }
//! # Ok::<(), kvcredit::Error>(())
//! ```
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use crate::credit::schema::col;
use crate::{Error, Result};

use super::read::{CONTINUATIONS, Pass, is_batch_invariant};
use crate::io::frame::Frame;

/// Continuations of one pass joined to exact's on `(problem, pivot_pos, alt_rank, branch,
/// sample)`, and how many of them have exactly exact's token ids.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenIdentity {
    /// Joined continuations whose `tokens` equal exact's.
    pub identical: u64,
    /// Continuations of the pass with an exact continuation at the same identity.
    pub total: u64,
}

impl TokenIdentity {
    /// `identical / total`; `None` when nothing was joined.
    pub fn share(&self) -> Option<f64> {
        (self.total > 0).then(|| self.identical as f64 / self.total as f64)
    }

    /// At least one continuation was joined and every one is identical to exact's.
    pub fn all_identical(&self) -> bool {
        self.total > 0 && self.identical == self.total
    }

    /// Add another run's counts.
    pub fn merge(&mut self, other: &TokenIdentity) {
        self.identical += other.identical;
        self.total += other.total;
    }
}

/// Identity of one continuation across passes.
type ContId = (u32, u32, u32, String, u32);

/// Per non-exact pass present, its continuations' [`TokenIdentity`] with exact's, from
/// `(pass, id, tokens)` rows. A duplicate identity within one pass is an error.
pub fn count<'a>(
    rows: impl IntoIterator<Item = (Pass, ContId, &'a [i64])>,
) -> Result<BTreeMap<Pass, TokenIdentity>> {
    let mut by_pass: BTreeMap<Pass, BTreeMap<ContId, &'a [i64]>> = BTreeMap::new();
    for (pass, id, tokens) in rows {
        if by_pass
            .entry(pass)
            .or_default()
            .insert(id.clone(), tokens)
            .is_some()
        {
            let (problem, pivot_pos, alt_rank, branch, sample) = id;
            return Err(Error::Output(format!(
                "duplicate continuation problem={problem} pivot_pos={pivot_pos} \
                 alt_rank={alt_rank} pass={pass} branch={branch} sample={sample}"
            )));
        }
    }
    let exact = by_pass.remove(&Pass::Exact).unwrap_or_default();
    Ok(by_pass
        .into_iter()
        .map(|(pass, conts)| {
            let mut n = TokenIdentity::default();
            for (id, tokens) in conts {
                if let Some(e) = exact.get(&id) {
                    n.total += 1;
                    n.identical += u64::from(*e == tokens);
                }
            }
            (pass, n)
        })
        .collect())
}

/// Per non-exact pass of `RUN_DIR/continuations.parquet`, how many of its continuations are
/// token-identical to exact's ([`TokenIdentity`]); passes without continuations are absent.
pub fn token_identical(run_dir: &Path) -> Result<BTreeMap<Pass, TokenIdentity>> {
    let path = run_dir.join(CONTINUATIONS);
    let f = Frame::read(
        &path,
        &[
            col::PROBLEM,
            col::PIVOT_POS,
            col::ALT_RANK,
            col::BRANCH,
            col::PASS,
            col::SAMPLE,
            col::TOKENS,
        ],
    )?;
    let (problem, pivot_pos, alt_rank, sample) = (
        f.u32s(col::PROBLEM)?,
        f.u32s(col::PIVOT_POS)?,
        f.u32s(col::ALT_RANK)?,
        f.u32s(col::SAMPLE)?,
    );
    let branch = f.strings(col::BRANCH)?;
    let pass = super::read::passes(&f, col::PASS)?;
    let tokens = f.int_lists(col::TOKENS)?;
    count((0..f.len()).map(|j| {
        (
            pass[j],
            (
                problem[j],
                pivot_pos[j],
                alt_rank[j],
                branch[j].clone(),
                sample[j],
            ),
            tokens[j].as_slice(),
        )
    }))
    .map_err(|e| match e {
        Error::Output(m) => Error::Output(format!("{}: {m}", path.display())),
        e => e,
    })
}

/// What the replica floor of a configuration measured, judged from token identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloorStatus {
    /// Some replica continuation differs from exact's: the replica exercised numerical
    /// differences and its floor is a measurement.
    Measured,
    /// Every replica continuation equals exact's although nothing asked for identity: the
    /// floor is 0 by construction and every quantity above it is not measurable.
    StructuralZero,
    /// Every replica continuation equals exact's under `replica_schedule = "same"`: the
    /// expected bitwise-identity control.
    SameScheduleControl,
    /// Every replica continuation equals exact's under the batch-invariant policy: the
    /// expected bitwise-identity control.
    BatchInvariantControl,
    /// No replica continuation could be joined to exact's (none read).
    NotRecorded,
}

impl FloorStatus {
    /// The status of a floor from the replica's token identity, the replica schedule
    /// (`same` | `shuffled` | ...) and the policy label.
    pub fn of(replica: Option<TokenIdentity>, replica_schedule: &str, policy: &str) -> Self {
        match replica {
            Some(n) if n.all_identical() => {
                if replica_schedule == "same" {
                    FloorStatus::SameScheduleControl
                } else if is_batch_invariant(policy) {
                    FloorStatus::BatchInvariantControl
                } else {
                    FloorStatus::StructuralZero
                }
            }
            Some(n) if n.total > 0 => FloorStatus::Measured,
            _ => FloorStatus::NotRecorded,
        }
    }

    /// Label in `summary.parquet`.
    pub fn as_str(self) -> &'static str {
        match self {
            FloorStatus::Measured => "measured",
            FloorStatus::StructuralZero => "structural_zero",
            FloorStatus::SameScheduleControl => "same_schedule_control",
            FloorStatus::BatchInvariantControl => "batch_invariant_control",
            FloorStatus::NotRecorded => "not_recorded",
        }
    }

    /// Whether quantities above the floor (excess, ceiling gap) can be read: false only for
    /// a structural zero.
    pub fn measurable(self) -> bool {
        self != FloorStatus::StructuralZero
    }

    /// The report's sentence for the status.
    pub fn describe(self) -> &'static str {
        match self {
            FloorStatus::Measured => "measured",
            FloorStatus::StructuralZero => {
                "structural zero: the replica exercised no numerical difference"
            }
            FloorStatus::SameScheduleControl => {
                "bitwise-identity control (replica_schedule = \"same\"), as expected"
            }
            FloorStatus::BatchInvariantControl => {
                "bitwise-identity control (batch-invariant policy), as expected"
            }
            FloorStatus::NotRecorded => "not recorded (no replica continuations read)",
        }
    }
}

impl fmt::Display for FloorStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
