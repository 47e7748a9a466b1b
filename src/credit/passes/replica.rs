//! The replica pass: exact's starting state under the replica's schedule
//! (`passes.replica_schedule`), the noise floor the treatments are read against.
use super::exact::{exact_schedule, snapshots};
use crate::credit::pass::{CreditPass, PassContext, Plan, Schedule, Starts};
use crate::credit::rollout::{Pivot, Rollout};
use crate::credit::spec::{Pass, PassSpec, ReplicaSchedule};
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

    fn schedule(&self, passes: &PassSpec, what: &str, jobs: usize) -> Result<Schedule> {
        replica_schedule(passes, what, jobs)
    }
}

/// The replica's schedule for `jobs` pooled jobs: exact's batches or queue under `same`; under
/// `shuffled` other batches ([`replica_batches`]) or, with `passes.refill`, another queue
/// ([`replica_queue`]). Its key axis is padded by `passes.replica_key_pad`.
pub(crate) fn replica_schedule(p: &PassSpec, what: &str, jobs: usize) -> Result<Schedule> {
    let shuffled = p.replica_schedule == ReplicaSchedule::Shuffled;
    let plan = if !shuffled {
        exact_schedule(p, jobs).plan
    } else if p.refill {
        let (order, width) = replica_queue(p, what, jobs)?;
        Plan::Queue { order, width }
    } else {
        let exact = schedule::exact(jobs, p.batch_size);
        Plan::Batches(replica_batches(p, what, &exact)?)
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
fn replica_batches(p: &PassSpec, what: &str, exact: &[Vec<usize>]) -> Result<schedule::Batches> {
    let n = exact.iter().map(Vec::len).sum();
    let r = p.effective_replica_batch_size();
    let replica = schedule::shuffled(n, p.batch_size, r);
    if n > 0 && schedule::same_grouping(&replica, exact) {
        return Err(Error::Spec(format!(
            "{what}: the shuffled replica would run exact's batches ({n} continuations, passes.batch_size = {}, passes.replica_batch_size = {r}); change passes.replica_batch_size",
            p.batch_size
        )));
    }
    Ok(replica)
}

/// A group's shuffled replica queue with `passes.refill`: its `n` jobs in reverse order on
/// `passes.replica_batch_size` rows; refused when that is exact's queue (the same order on
/// as many rows, which happens only for a single job).
fn replica_queue(p: &PassSpec, what: &str, n: usize) -> Result<(Vec<usize>, usize)> {
    let r = p.effective_replica_batch_size();
    let order: Vec<usize> = (0..n).rev().collect();
    let exact: Vec<usize> = (0..n).collect();
    if n > 0 && order == exact && r.min(n) == p.batch_size.min(n) {
        return Err(Error::Spec(format!(
            "{what}: the shuffled replica would run exact's queue ({n} continuations, passes.batch_size = {}, passes.replica_batch_size = {r})",
            p.batch_size
        )));
    }
    Ok((order, r))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn passes(extra: &str) -> PassSpec {
        toml::from_str(&format!(
            "run = [\"exact\", \"replica\"]\nbatch_size = 4\n{extra}"
        ))
        .expect("pass spec")
    }

    fn batches(s: &Schedule) -> &schedule::Batches {
        match &s.plan {
            Plan::Batches(b) => b,
            Plan::Queue { .. } => panic!("a queue"),
        }
    }

    #[test]
    fn same_repeats_exacts_batches_and_queue() {
        for refill in ["", "refill = true"] {
            let p = passes(&format!("replica_schedule = \"same\"\n{refill}"));
            let (exact, replica) = (
                exact_schedule(&p, 10),
                replica_schedule(&p, "test", 10).expect("schedule"),
            );
            assert_eq!(replica.plan, exact.plan);
            assert_eq!((replica.key_pad, replica.name.as_str()), (0, "same"));
            assert_eq!(replica.batch_key, "passes.batch_size");
        }
    }

    #[test]
    fn shuffled_regroups_the_same_jobs_on_a_padded_key_axis() {
        let p = passes("replica_schedule = \"shuffled\"\nreplica_batch_size = 3");
        let (exact, replica) = (
            exact_schedule(&p, 10),
            replica_schedule(&p, "test", 10).expect("schedule"),
        );
        let (e, r) = (batches(&exact), batches(&replica));
        assert!(!schedule::same_grouping(e, r));
        let mut jobs: Vec<usize> = r.concat();
        jobs.sort_unstable();
        assert_eq!(jobs, e.concat());
        assert!(r.iter().all(|b| b.len() <= 3));
        assert_eq!((replica.key_pad, replica.name.as_str()), (3, "shuffled"));
        assert_eq!(replica.batch_key, "passes.replica_batch_size");

        let p = passes("replica_schedule = \"shuffled\"\nreplica_batch_size = 3\nrefill = true");
        let replica = replica_schedule(&p, "test", 4).expect("schedule");
        let queue = Plan::Queue {
            order: vec![3, 2, 1, 0],
            width: 3,
        };
        assert_eq!(replica.plan, queue);
        assert_ne!(exact_schedule(&p, 4).plan, queue);
    }

    /// Negative controls: a shuffled replica that would repeat exact's batches (both sizes 1,
    /// which `validate` refuses) or exact's queue (a single job on as many rows) is an error.
    #[test]
    fn shuffled_refuses_to_repeat_exact() {
        let p = PassSpec {
            batch_size: 1,
            ..passes("replica_schedule = \"shuffled\"\nreplica_batch_size = 1")
        };
        let e = replica_schedule(&p, "problem 7", 3).err().expect("refused");
        assert!(
            e.to_string()
                .contains("problem 7: the shuffled replica would run exact's batches")
        );
        let p = passes("replica_schedule = \"shuffled\"\nreplica_batch_size = 4\nrefill = true");
        let e = replica_schedule(&p, "problem 7", 1).err().expect("refused");
        assert!(e.to_string().contains("would run exact's queue"));
        assert!(replica_schedule(&p, "problem 7", 2).is_ok());
    }
}
