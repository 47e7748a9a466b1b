//! The exact pass: each pivot's continuations resume the rollout's own decode-time KV, verified
//! against its fingerprint, in exact's batches. Its starts and schedule are the other passes'
//! building blocks.
use crate::Result;
use crate::credit::pass::{CreditPass, PassContext, Plan, Schedule, StartState, Starts};
use crate::credit::rollout::{Pivot, Rollout};
use crate::credit::spec::{Pass, PassSpec};
use crate::decode::schedule;

/// Decode-time KV under exact's schedule.
pub(crate) struct Exact;

impl CreditPass for Exact {
    fn pass(&self) -> Pass {
        Pass::Exact
    }

    fn starts(&self, _: &PassContext, _: &Rollout, _: &[Pivot]) -> Result<Starts> {
        Ok(snapshots())
    }

    fn schedule(&self, passes: &PassSpec, _: &str, jobs: usize) -> Result<Schedule> {
        Ok(exact_schedule(passes, jobs))
    }
}

/// The rollout's decode-time snapshots at the pivots: nothing is prefilled.
pub(crate) fn snapshots() -> Starts {
    Starts {
        state: StartState::Snapshots,
        tokens: 0,
        spectrum: None,
    }
}

/// Exact's schedule for `jobs` pooled jobs: consecutive batches of `passes.batch_size`
/// ([`schedule::exact`]), or with `passes.refill` one queue in natural order on as many rows;
/// the natural key axis.
pub(crate) fn exact_schedule(p: &PassSpec, jobs: usize) -> Schedule {
    Schedule {
        plan: if p.refill {
            Plan::Queue {
                order: (0..jobs).collect(),
                width: p.batch_size,
            }
        } else {
            Plan::Batches(schedule::exact(jobs, p.batch_size))
        },
        key_pad: 0,
        name: "exact".into(),
        batch_key: "passes.batch_size",
    }
}
