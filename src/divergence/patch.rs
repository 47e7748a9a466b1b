//! Residual-stream patching at the first divergence step τ of a greedy pair.
//!
//! Cache-ON's state before step τ is rebuilt (prefill of the prompt, then one decode step per
//! shared token: batch 1), cache-OFF's residual stream at step τ is recorded from a full
//! forward over prompt ⊕ y[0..τ]. The decode step that produces step τ's logits is then run
//! once per layer set in one batch — row 0 unpatched (the control), row *r* with the residual
//! stream of the current position replaced by cache-OFF's after the layers of set *r*; past
//! KV stays cache-ON's. Immediate recovery `(m_patch − m_ON) / (m_OFF − m_ON)` with
//! `m = z[y_OFF] − z[y_ON]`; trajectory recovery: each row continues greedily (cache-ON) for
//! `k` tokens, compared with cache-OFF's own continuation.
use super::lockstep::first_difference;
use super::spec::LayerSet;
use crate::Result;
use crate::exec::ExecPolicy;
use crate::kv_cache::KvCache;
use crate::model::hooks::{Patch, Recorder};
use crate::model::{Decoder, LogitsAt};
use crate::sampling::{self, Sampling};
use tch::{Device, Kind, Tensor};

/// One patched row's result.
#[derive(Debug, Clone, PartialEq)]
pub struct PatchResult {
    /// Label of the layer set (`control` for the unpatched row).
    pub label: String,
    /// First patched layer.
    pub layer_start: usize,
    /// One past the last patched layer.
    pub layer_end: usize,
    /// `z[y_OFF] − z[y_ON]` of this row's logits.
    pub m: f64,
    /// Immediate recovery `(m − m_ON) / (m_OFF − m_ON)` (m_ON from the control row).
    pub recovery: f64,
    /// Greedy token of this row at step τ.
    pub token: i64,
    /// Tokens generated from τ on (the first is `token`).
    pub continuation: Vec<i64>,
    /// Share of the continuation equal position-wise to cache-OFF's tokens from τ.
    pub follow_off: f64,
    /// Share equal to cache-ON's tokens from τ.
    pub follow_on: f64,
    /// Leading tokens of the continuation equal to cache-OFF's (trajectory recovery length).
    pub off_prefix: usize,
}

/// The patch experiment of one problem.
#[derive(Debug, Clone, PartialEq)]
pub struct PatchOutcome {
    /// `z[y_OFF] − z[y_ON]` of cache-OFF at τ.
    pub m_off: f64,
    /// Whether the rebuilt states reproduce the divergence (control argmax = y_ON and
    /// cache-OFF argmax = y_OFF).
    pub reproduced: bool,
    /// One row per layer set, the control first.
    pub rows: Vec<PatchResult>,
}

/// Run the patch experiment for one diverged greedy pair: `on` and `off` are the two token
/// sequences, `tau` their first difference (≥ 1: step 0 is one computation on both paths).
#[allow(clippy::too_many_arguments)]
pub fn run(
    model: &Decoder,
    policy: &ExecPolicy,
    prompt: &[i64],
    on: &[i64],
    off: &[i64],
    tau: usize,
    sets: &[LayerSet],
    k: usize,
) -> Result<PatchOutcome> {
    let _guard = tch::no_grad_guard();
    let dev = model.device();
    if tau == 0 || tau >= on.len() || tau >= off.len() {
        return Err(crate::Error::Spec(format!(
            "patch: divergence step {tau} is not inside both sequences ({} and {} tokens)",
            on.len(),
            off.len()
        )));
    }
    let (y_on, y_off) = (on[tau], off[tau]);
    let ids = |v: &[i64]| -> Result<Tensor> {
        Ok(Tensor::f_from_slice(v)?.f_view([1, -1])?.f_to_device(dev)?)
    };
    // Cache-ON before step τ: prefill, then decode the shared tokens y[0..τ−1].
    let mut cache = model.new_cache(1, (prompt.len() + tau + k + 1) as i64)?;
    let _ = model.forward(&ids(prompt)?, &mut cache, policy, &LogitsAt::Last)?;
    for &t in &on[..tau - 1] {
        let _ = model.forward(&ids(&[t])?, &mut cache, policy, &LogitsAt::Last)?;
    }
    // Cache-OFF at step τ: full forward over prompt ⊕ y[0..τ], residuals at the last position.
    let mut seq = prompt.to_vec();
    seq.extend_from_slice(&on[..tau]);
    let mut off_cache = model.new_cache(1, seq.len() as i64)?;
    let mut rec = Recorder::new(vec![seq.len() as i64 - 1], false);
    let z_off = model
        .forward_with(
            &ids(&seq)?,
            &mut off_cache,
            policy,
            &LogitsAt::Last,
            &mut rec,
        )?
        .f_view([1, -1])?;
    let residual = rec.stacked()?; // [L, 1, H]

    // The patched step, one row per set (row 0 = control), all from the same snapshot.
    let rows = sets.len() + 1;
    let snap = cache.snapshot(0);
    let parts: Vec<(&KvCache, _)> = (0..rows).map(|_| (&cache, snap)).collect();
    let mut batch = KvCache::gather(&parts, (k + 1) as i64)?;
    let mut ranges: Vec<std::ops::Range<usize>> = Vec::with_capacity(rows);
    ranges.push(0..0);
    ranges.extend(sets.iter().map(|s| s.layers.clone()));
    let h = residual.size()[2];
    let values = residual.f_expand([-1, rows as i64, h], false)?;
    let mut hook = Patch::new(vec![0; rows], ranges, values)?;
    let feed = Tensor::f_full([rows as i64, 1], on[tau - 1], (Kind::Int64, dev))?;
    let z = model
        .forward_with(&feed, &mut batch, policy, &LogitsAt::Last, &mut hook)?
        .f_view([rows as i64, -1])?;
    let m_of = |z: &Tensor| -> Result<Vec<f64>> {
        let z = z.f_to_kind(Kind::Double)?;
        let d = z.f_select(1, y_off)?.f_sub(&z.f_select(1, y_on)?)?;
        Ok(Vec::try_from(d.f_to_device(Device::Cpu)?)?)
    };
    let m = m_of(&z)?;
    let m_off = m_of(&z_off)?[0];
    let first = sampling::select(&z, Sampling::Greedy, &[], model.sampler())?;
    let off_first = sampling::select(&z_off, Sampling::Greedy, &[], model.sampler())?[0];
    // Trajectory: every row continues greedily against its own (cache-ON) cache.
    let mut conts: Vec<Vec<i64>> = first.iter().map(|&t| vec![t]).collect();
    for _ in 1..k {
        let feed: Vec<i64> = conts
            .iter()
            .map(|c| *c.last().expect("non-empty"))
            .collect();
        let t = Tensor::f_from_slice(&feed)?
            .f_view([rows as i64, 1])?
            .f_to_device(dev)?;
        let z = model.forward(&t, &mut batch, policy, &LogitsAt::Last)?;
        let next = sampling::select(
            &z.f_view([rows as i64, -1])?,
            Sampling::Greedy,
            &[],
            model.sampler(),
        )?;
        for (c, t) in conts.iter_mut().zip(next) {
            c.push(t);
        }
    }
    let share = |c: &[i64], refs: &[i64]| -> f64 {
        let n = c.len().min(refs.len());
        if n == 0 {
            return 0.0;
        }
        c.iter().zip(refs).filter(|(a, b)| a == b).count() as f64 / n as f64
    };
    let (off_rest, on_rest) = (&off[tau..], &on[tau..]);
    let m_on = m[0];
    let results = conts
        .into_iter()
        .enumerate()
        .map(|(r, c)| {
            let (label, layers) = if r == 0 {
                ("control".to_string(), 0..0)
            } else {
                (sets[r - 1].label.clone(), sets[r - 1].layers.clone())
            };
            let n = c.len().min(off_rest.len());
            PatchResult {
                label,
                layer_start: layers.start,
                layer_end: layers.end,
                m: m[r],
                recovery: (m[r] - m_on) / (m_off - m_on),
                token: c[0],
                follow_off: share(&c, off_rest),
                follow_on: share(&c, on_rest),
                off_prefix: first_difference(&c[..n], &off_rest[..n]).unwrap_or(n),
                continuation: c,
            }
        })
        .collect();
    Ok(PatchOutcome {
        m_off,
        reproduced: first[0] == y_on && off_first == y_off,
        rows: results,
    })
}
