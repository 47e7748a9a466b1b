//! Three-pass counterfactual credit: rollouts, low-margin pivots, branch continuations resumed
//! from verified decode-time KV snapshots (exact), the same under another batch schedule
//! (replica), or from a fresh prefill of the transcript prefix (refeed); graded outcomes and
//! per-pivot estimates written as Parquet. An optional fourth pass, spectrum, resumes from the
//! decode-time snapshot after SpectrumKV compression at a byte budget (`[passes.spectrum]`,
//! built on [`crate::spectrum`]'s scoring, allocation, packing and restore). Each pass is a
//! plug-in (`pass::CreditPass`, one file per pass in `passes/`); `campaign` runs them in turn.
pub mod campaign;
pub mod estimate;
pub(crate) mod pass;
pub(crate) mod passes;
pub mod records;
pub mod rollout;
pub mod schema;
pub mod spec;

pub use campaign::{Manifest, RunOptions, ShardSpec, finished_run, merge_campaign, run_campaign};
pub use spec::{CampaignSpec, Pass};
