//! The spectrum passes: each pivot's continuations resume the rollout's decode-time KV after
//! SpectrumKV compression at `[passes.spectrum]`'s budget, under exact's schedule (`spectrum`)
//! or the replica's (`spectrum_replica`); the frames' statistics go to the shard.
use super::exact::exact_schedule;
use super::replica::replica_schedule;
use crate::credit::pass::{CreditPass, PassContext, Schedule, StartState, Starts};
use crate::credit::rollout::{Pivot, Rollout};
use crate::credit::schema::SpectrumStats;
use crate::credit::spec::{Pass, PassSpec, SpectrumPass};
use crate::kv_cache::KvCache;
use crate::spectrum::eval;
use crate::{Error, Result};

/// A compressed decode-time snapshot, under the replica's schedule when `replica`.
pub(crate) struct Spectrum {
    pub replica: bool,
}

impl CreditPass for Spectrum {
    fn pass(&self) -> Pass {
        if self.replica {
            Pass::SpectrumReplica
        } else {
            Pass::Spectrum
        }
    }

    fn starts(&self, cx: &PassContext, roll: &Rollout, pivots: &[Pivot]) -> Result<Starts> {
        let sp = cx.spec.spectrum_pass().ok_or_else(|| {
            Error::Spec(format!(
                "campaign `{}`: the {} pass needs [passes.spectrum]",
                cx.spec.name,
                self.pass()
            ))
        })?;
        let (mut tokens, mut stats) = (0, SpectrumStats::default());
        let caches = pivots
            .iter()
            .map(|p| spectrum_prefix(cx, roll, p, sp, &mut tokens, &mut stats))
            .collect::<Result<_>>()?;
        Ok(Starts {
            state: StartState::Caches(caches),
            tokens,
            spectrum: Some(stats),
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

/// The start at `pivot`: importance from a traced prefill of `prompt ⊕ y_<t` (the last prompt
/// queries' attention, as `spectrum ppl` scores a context; its length added to `tokens`), the
/// rollout's decode-time snapshot at the pivot allocated into tiers at the budget, quantized
/// and packed into a wire frame, then decoded, verified and dequantized into an ordinary
/// one-row cache (dropped tokens masked at their original positions).
fn spectrum_prefix(
    cx: &PassContext,
    roll: &Rollout,
    pivot: &Pivot,
    sp: &SpectrumPass,
    tokens: &mut u64,
    stats: &mut SpectrumStats,
) -> Result<KvCache> {
    let decoder = &cx.model.decoder;
    let mut ids = roll.prompt.clone();
    ids.extend(roll.steps[..pivot.pos].iter().map(|s| s.token));
    *tokens += ids.len() as u64;
    let snap = roll.snapshot(pivot.pos);
    let pre = eval::prefill_and_score(decoder, &ids, &cx.decoding.policy, &sp.importance)?;
    drop(pre.cache);
    let variant = sp.variant()?;
    let c = eval::compress_snapshot(&roll.cache, snap.row, &pre.scores, &variant, sp.protect)
        .map_err(|e| e.context(&format!("spectrum pass at pivot {}", pivot.pos)))?;
    let [fp16, int8, int4] = c.plan.counts();
    let real_b = c.real_b();
    stats.add(&SpectrumStats {
        snapshots: 1,
        tokens: c.plan.len() as u64,
        tokens_fp16: fp16 as u64,
        tokens_int8: int8 as u64,
        tokens_int4: int4 as u64,
        tokens_drop: c.plan.dropped() as u64,
        frame_bytes: c.frame.len() as u64,
        fp16_bytes: c.fp16_bytes as u64,
        real_b_min: real_b,
        real_b_max: real_b,
    });
    eval::receive(decoder, &c.frame, 0)
}
