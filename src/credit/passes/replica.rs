//! The replica pass: exact's starting state under the replica's schedule
//! (`passes.replica_schedule`), the noise floor the treatments are read against.
use super::exact::{exact_schedule, snapshots};
use crate::credit::pass::{CreditPass, PassContext, Plan, Schedule, Starts};
use crate::credit::rollout::{Pivot, Rollout};
use crate::credit::spec::{CampaignSpec, Pass, ReplicaSchedule};
use crate::decode::schedule;
use crate::{Error, Result};

/// Decode-time KV under the replica's schedule.
pub(crate) struct Replica;

impl CreditPass for Replica {
    fn pass(&self) -> Pass {
        Pass::Replica
    }

    fn starts(&self, _: &PassContext, _: &Rollout, _: &[Pivot]) -> Result<Starts> {
        Ok(snapshots())
    }

    fn schedule(&self, cx: &PassContext, jobs: usize) -> Result<Schedule> {
        replica_schedule(cx, jobs)
    }
}

/// The replica's schedule for `jobs` pooled jobs: exact's batches or queue under `same`; under
/// `shuffled` other batches ([`replica_batches`]) or, with `passes.refill`, another queue
/// ([`replica_queue`]). Its key axis is padded by `passes.replica_key_pad`.
pub(crate) fn replica_schedule(cx: &PassContext, jobs: usize) -> Result<Schedule> {
    let p = &cx.spec.passes;
    let shuffled = p.replica_schedule == ReplicaSchedule::Shuffled;
    let plan = if !shuffled {
        exact_schedule(cx, jobs).plan
    } else if p.refill {
        let (order, width) = replica_queue(cx.spec, cx.what, jobs)?;
        Plan::Queue { order, width }
    } else {
        let exact = schedule::exact(jobs, p.batch_size);
        Plan::Batches(replica_batches(cx.spec, cx.what, &exact)?)
    };
    Ok(Schedule {
        plan,
        key_pad: p.effective_replica_key_pad(),
        name: p.replica_schedule.to_string(),
        batch_key: if shuffled && p.replica_batch_size.is_some() {
            "passes.replica_batch_size"
        } else {
            "passes.batch_size"
        },
    })
}

/// A group's shuffled replica batches ([`schedule::shuffled`]); refuses a grouping equal to
/// exact's (which the schedule avoids for every problem with two or more continuations unless
/// both batch sizes are 1, a spec `validate` rejects).
fn replica_batches(
    spec: &CampaignSpec,
    what: &str,
    exact: &[Vec<usize>],
) -> Result<schedule::Batches> {
    let n = exact.iter().map(Vec::len).sum();
    let r = spec.passes.effective_replica_batch_size();
    let replica = schedule::shuffled(n, spec.passes.batch_size, r);
    if n > 0 && schedule::same_grouping(&replica, exact) {
        return Err(Error::Spec(format!(
            "{what}: the shuffled replica would run exact's batches ({n} continuations, passes.batch_size = {}, passes.replica_batch_size = {r}); change passes.replica_batch_size",
            spec.passes.batch_size
        )));
    }
    Ok(replica)
}

/// A group's shuffled replica queue with `passes.refill`: its `n` jobs in reverse order on
/// `passes.replica_batch_size` rows; refused when that is exact's queue (the same order on
/// as many rows, which happens only for a single job).
fn replica_queue(spec: &CampaignSpec, what: &str, n: usize) -> Result<(Vec<usize>, usize)> {
    let r = spec.passes.effective_replica_batch_size();
    let order: Vec<usize> = (0..n).rev().collect();
    let exact: Vec<usize> = (0..n).collect();
    if n > 0 && order == exact && r.min(n) == spec.passes.batch_size.min(n) {
        return Err(Error::Spec(format!(
            "{what}: the shuffled replica would run exact's queue ({n} continuations, passes.batch_size = {}, passes.replica_batch_size = {r})",
            spec.passes.batch_size
        )));
    }
    Ok((order, r))
}
