//! Batch schedules of a pass: which of a problem's continuations (jobs) are decoded together.
//!
//! A problem's jobs are numbered in natural order (pivot, branch, sample). Exact and refeed
//! take them in that order, `batch_size` at a time. A `shuffled` replica takes them in reverse
//! order, at most `replica_batch_size` (r) at a time, with its first batch shortened to `s`
//! rows: `s` is the largest value in `1..=r` that leaves the fewest jobs in a batch with the
//! same members as their exact batch (`s = r`, the plain reversed chunking, whenever that
//! already shares none). The job count is only known once the rollout has found its pivots,
//! so the schedule is built per problem then, and the campaign refuses to run a replica whose
//! grouping equals exact's.
//!
//! That never happens for a problem with at least two jobs unless `batch_size` and r are both
//! 1 (which [`crate::credit::spec::CampaignSpec::validate`] rejects): with r = 1 the replica runs every
//! job alone, which exact does only when `batch_size` = 1; with r ≥ 2, if the groupings
//! coincided for both `s = 1` and `s = 2`, exact's batch holding the last job would be both
//! `{n−1}` and `{n−2, n−1}`. When both sizes are at least 2 no job at all shares its exact
//! batch (checked exhaustively in the tests for up to 64 jobs and sizes up to 16); when one of
//! them is 1, at most one job does.

/// Batches of job indices, in execution order; each job appears in exactly one.
pub type Batches = Vec<Vec<usize>>;

/// `order` taken `size` at a time (`size` 0 counts as 1).
pub fn chunked(order: &[usize], size: usize) -> Batches {
    order.chunks(size.max(1)).map(<[usize]>::to_vec).collect()
}

/// The exact (and refeed) schedule of `n` jobs: natural order, `batch_size` at a time.
pub fn exact(n: usize, batch_size: usize) -> Batches {
    chunked(&(0..n).collect::<Vec<_>>(), batch_size)
}

/// The shuffled replica schedule of `n` jobs whose exact batches hold `batch_size` jobs: reverse
/// order, at most `replica_batch_size` at a time, first batch shortened as the module explains.
pub fn shuffled(n: usize, batch_size: usize, replica_batch_size: usize) -> Batches {
    let r = replica_batch_size.max(1);
    let exact = exact(n, batch_size);
    let reversed: Vec<usize> = (0..n).rev().collect();
    let mut best: Option<(usize, Batches)> = None;
    for s in (1..=r.min(n)).rev() {
        let mut batches = vec![reversed[..s].to_vec()];
        batches.extend(chunked(&reversed[s..], r));
        let shared = shared_jobs(&batches, &exact);
        if best.as_ref().is_none_or(|(b, _)| shared < *b) {
            best = Some((shared, batches));
        }
        if shared == 0 {
            break;
        }
    }
    best.map(|(_, b)| b).unwrap_or_default()
}

/// Jobs whose batch in `a` has exactly the members of their batch in `b`.
pub fn shared_jobs(a: &[Vec<usize>], b: &[Vec<usize>]) -> usize {
    let n = a.iter().chain(b).flatten().max().map_or(0, |&m| m + 1);
    let mut batch_of = vec![usize::MAX; n];
    for (i, batch) in b.iter().enumerate() {
        for &j in batch {
            batch_of[j] = i;
        }
    }
    a.iter()
        .filter(|batch| {
            let Some(&first) = batch.first() else {
                return false;
            };
            let home = batch_of[first];
            home != usize::MAX
                && b[home].len() == batch.len()
                && batch.iter().all(|&j| batch_of[j] == home)
        })
        .map(Vec::len)
        .sum()
}

/// Whether two schedules of the same jobs group them identically (the same set of batch
/// memberships, whatever the order of batches or of rows within them).
pub fn same_grouping(a: &[Vec<usize>], b: &[Vec<usize>]) -> bool {
    let jobs: usize = a.iter().map(Vec::len).sum();
    jobs == b.iter().map(Vec::len).sum::<usize>() && shared_jobs(a, b) == jobs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_partition(batches: &[Vec<usize>], n: usize) -> bool {
        let mut seen = vec![false; n];
        for &j in batches.iter().flatten() {
            if j >= n || seen[j] {
                return false;
            }
            seen[j] = true;
        }
        seen.iter().all(|&s| s) && batches.iter().all(|b| !b.is_empty())
    }

    #[test]
    fn plain_reversed_chunks_are_kept_when_they_share_no_batch() {
        assert_eq!(exact(8, 4), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
        assert_eq!(
            shuffled(8, 4, 3),
            vec![vec![7, 6, 5], vec![4, 3, 2], vec![1, 0]]
        );
    }

    #[test]
    fn one_batch_holding_every_job_is_split() {
        // The case: batch_size 64 and 32 jobs; the old replica (reverse, 32 at a time)
        // ran one batch of the same 32 jobs as exact.
        let old = chunked(&(0..32).rev().collect::<Vec<_>>(), 32);
        assert!(same_grouping(&old, &exact(32, 64)));
        let new = shuffled(32, 64, 32);
        assert_eq!(new[0].len(), 31);
        assert_eq!(shared_jobs(&new, &exact(32, 64)), 0);
    }

    #[test]
    fn equal_sizes_dividing_the_jobs_are_offset() {
        // reverse chunks of 4 over 8 jobs are exact's two batches again
        let old = chunked(&(0..8).rev().collect::<Vec<_>>(), 4);
        assert!(same_grouping(&old, &exact(8, 4)));
        let new = shuffled(8, 4, 4);
        assert_eq!(new, vec![vec![7, 6, 5], vec![4, 3, 2, 1], vec![0]]);
        assert_eq!(shared_jobs(&new, &exact(8, 4)), 0);
    }

    #[test]
    fn every_grouping_of_two_or_more_jobs_differs_unless_both_sizes_are_one() {
        for n in 0..=64 {
            for b in 1..=16 {
                for r in 1..=16 {
                    let (e, s) = (exact(n, b), shuffled(n, b, r));
                    assert!(is_partition(&s, n), "n={n} b={b} r={r}: {s:?}");
                    assert!(s.iter().all(|x| x.len() <= r), "n={n} b={b} r={r}");
                    let same = same_grouping(&s, &e);
                    assert_eq!(same, n <= 1 || (b == 1 && r == 1), "n={n} b={b} r={r}");
                    let shared = shared_jobs(&s, &e);
                    if n >= 2 && b >= 2 && r >= 2 {
                        assert_eq!(shared, 0, "n={n} b={b} r={r}: {s:?}");
                    } else if n >= 2 && (b >= 2 || r >= 2) {
                        assert!(shared <= 1, "n={n} b={b} r={r}: {s:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn grouping_ignores_batch_and_row_order_but_not_membership() {
        let a = vec![vec![0, 1], vec![2, 3]];
        assert!(same_grouping(&a, &[vec![3, 2], vec![1, 0]]));
        assert!(!same_grouping(&a, &[vec![0, 2], vec![1, 3]]));
        assert!(!same_grouping(&a, &[vec![0, 1, 2, 3]]));
        assert_eq!(shared_jobs(&a, &[vec![1, 0], vec![2], vec![3]]), 2);
    }
}
