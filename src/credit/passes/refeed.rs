//! The refeed passes: each pivot's continuations resume a fresh prefill of the prompt and the
//! rollout's tokens before the pivot, under exact's schedule (`refeed`) or the replica's
//! (`refeed_replica`).
use super::exact::exact_schedule;
use super::replica::replica_schedule;
use crate::Result;
use crate::credit::pass::{CreditPass, PassContext, Schedule, StartState, Starts};
use crate::credit::rollout::{Pivot, Rollout};
use crate::credit::spec::{Pass, PassSpec};
use crate::kv_cache::KvCache;
use crate::model::LogitsAt;
use tch::Tensor;

/// A re-fed prefix, under the replica's schedule when `replica`.
pub(crate) struct Refeed {
    pub replica: bool,
}

impl CreditPass for Refeed {
    fn pass(&self) -> Pass {
        if self.replica {
            Pass::RefeedReplica
        } else {
            Pass::Refeed
        }
    }

    fn starts(&self, cx: &PassContext, roll: &Rollout, pivots: &[Pivot]) -> Result<Starts> {
        let mut tokens = 0;
        let caches = pivots
            .iter()
            .map(|p| refeed_prefix(cx, roll, p, &mut tokens))
            .collect::<Result<_>>()?;
        Ok(Starts {
            state: StartState::Caches(caches),
            tokens,
            spectrum: None,
        })
    }

    fn schedule(&self, passes: &PassSpec, what: &str, jobs: usize) -> Result<Schedule> {
        if self.replica {
            replica_schedule(passes, what, jobs)
        } else {
            Ok(exact_schedule(passes, jobs))
        }
    }
}

/// Prefill `prompt ⊕ y_<t` afresh into a cache with room for the continuation, adding its
/// length to `tokens`.
fn refeed_prefix(
    cx: &PassContext,
    roll: &Rollout,
    pivot: &Pivot,
    tokens: &mut u64,
) -> Result<KvCache> {
    let decoder = &cx.model.decoder;
    let mut ids = roll.prompt.clone();
    ids.extend(roll.steps[..pivot.pos].iter().map(|s| s.token));
    *tokens += ids.len() as u64;
    let mut cache = decoder.new_cache(1, ids.len() as i64)?;
    let t = Tensor::f_from_slice(&ids)?.f_view([1, -1])?;
    let _ = decoder.forward(&t, &mut cache, &cx.decoding.policy, &LogitsAt::Last)?;
    Ok(cache)
}
