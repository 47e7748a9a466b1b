//! Live vs replay at stage boundaries, the prefill-chunk sweep, and bidirectional KV
//! transplantation with donor-following.
//!
//! At a boundary *b* of cache-ON's greedy sequence y, the state is the KV of
//! `prompt ⊕ y[0..b−1]`, built two ways: LIVE (the decode-built cache: one prefill of the
//! prompt, then one decode step per token) and REPLAY (one prefill of the same ids in chunks
//! of *c*; `c = 0` means one shot). Each construction is built twice (its replica must be
//! bitwise equal), compared with LIVE per layer (max |ΔK|, |ΔV|), and continued greedily for
//! *k* tokens from `y[b−1]`. Transplants swap K and/or V over layer ranges between LIVE and
//! the one-shot REPLAY (both directions) and continue; a transplant *follows its donor* when
//! its continuation equals the donor's own token for token. Everything runs at batch 1.
use crate::Result;
use crate::exec::ExecPolicy;
use crate::kv_cache::{KvCache, KvParts, KvSelect, Transplant};
use crate::model::{Decoder, LogitsAt};
use crate::sampling::{self, Sampling};
use tch::{Device, Kind, Tensor};

/// One state's result at a boundary.
#[derive(Debug, Clone, PartialEq)]
pub struct StateResult {
    /// `live`, `replay` (construction rows) or `transplant` rows.
    pub kind: String,
    /// Prefill chunk of a replay (0 = one shot; −1 for live and transplants).
    pub chunk: i64,
    /// Transplant direction: `live<-replay` (base LIVE, donor REPLAY) or `replay<-live`.
    pub direction: String,
    /// Transplanted buffers (`k`, `v`, `kv`; empty for constructions).
    pub parts: String,
    /// Transplanted layers.
    pub layers: (usize, usize),
    /// A second build is bitwise equal (constructions only; transplants: true).
    pub replica_equal: bool,
    /// Per layer max |K − K_LIVE| and max |V − V_LIVE| over the state's positions.
    pub k_max_abs: Vec<f64>,
    /// See [`Self::k_max_abs`].
    pub v_max_abs: Vec<f64>,
    /// Greedy continuation from `y[b−1]`.
    pub continuation: Vec<i64>,
    /// Continuation equals LIVE's.
    pub follows_live: bool,
    /// Continuation equals the one-shot REPLAY's.
    pub follows_replay: bool,
}

fn prefill_chunks(
    model: &Decoder,
    policy: &ExecPolicy,
    ids: &[i64],
    chunk: usize,
    extra: i64,
) -> Result<KvCache> {
    let dev = model.device();
    let mut cache = model.new_cache(1, ids.len() as i64 + extra)?;
    let step = if chunk == 0 { ids.len() } else { chunk };
    for part in ids.chunks(step.max(1)) {
        let t = Tensor::from_slice(part).view([1, -1]).to_device(dev);
        let _ = model.forward(&t, &mut cache, policy, &LogitsAt::Last)?;
    }
    Ok(cache)
}

fn live(
    model: &Decoder,
    policy: &ExecPolicy,
    prompt: &[i64],
    toks: &[i64],
    extra: i64,
) -> Result<KvCache> {
    let dev = model.device();
    let mut cache = model.new_cache(1, (prompt.len() + toks.len()) as i64 + extra)?;
    let t = Tensor::from_slice(prompt).view([1, -1]).to_device(dev);
    let _ = model.forward(&t, &mut cache, policy, &LogitsAt::Last)?;
    for &x in toks {
        let t = Tensor::from_slice(&[x]).view([1, 1]).to_device(dev);
        let _ = model.forward(&t, &mut cache, policy, &LogitsAt::Last)?;
    }
    Ok(cache)
}

/// Greedy continuation of `k` tokens: feed `first`, then each chosen token.
fn continue_greedy(
    model: &Decoder,
    policy: &ExecPolicy,
    mut cache: KvCache,
    first: i64,
    k: usize,
) -> Result<Vec<i64>> {
    let dev = model.device();
    let mut out = Vec::with_capacity(k);
    let mut feed = first;
    for _ in 0..k {
        let t = Tensor::from_slice(&[feed]).view([1, 1]).to_device(dev);
        let z = model.forward(&t, &mut cache, policy, &LogitsAt::Last)?;
        feed = sampling::select(&z.view([1, -1]), Sampling::Greedy, &[])?[0];
        out.push(feed);
    }
    Ok(out)
}

/// Per layer max |ΔK| and |ΔV| of two one-row caches over `len` positions.
fn kv_diff(a: &KvCache, b: &KvCache, len: i64) -> Result<(Vec<f64>, Vec<f64>)> {
    let at: Vec<(usize, i64)> = (0..len).map(|p| (0, p)).collect();
    let d = (a.entries(&at)?.f_to_kind(Kind::Double)? - b.entries(&at)?.f_to_kind(Kind::Double)?)
        .f_abs()?;
    let l = d.size()[0];
    let m = d.f_reshape([l, 2, -1])?.f_amax([-1], false)?; // [L, 2]
    let host: Vec<f64> = Vec::try_from(m.to_device(Device::Cpu).reshape([-1]))?;
    Ok((
        host.iter().step_by(2).copied().collect(),
        host.iter().skip(1).step_by(2).copied().collect(),
    ))
}

/// The layer ranges transplanted: all, then the bisection halves and quarters.
pub fn transplant_ranges(layers: usize) -> Vec<(usize, usize)> {
    let mut out = vec![(0, layers)];
    let h = layers / 2;
    if h > 0 {
        out.extend([(0, h), (h, layers)]);
        let q = layers / 4;
        if q > 0 && q < h {
            out.extend([(0, q), (q, h), (h, h + q), (h + q, layers)]);
        }
    }
    out
}

/// Live vs replay and transplants at boundary `b` (1 ≤ b ≤ y.len()) of sequence `y`.
#[allow(clippy::too_many_arguments)]
pub fn run(
    model: &Decoder,
    policy: &ExecPolicy,
    prompt: &[i64],
    y: &[i64],
    b: usize,
    chunks: &[usize],
    k: usize,
) -> Result<Vec<StateResult>> {
    let _guard = tch::no_grad_guard();
    let mut ids = prompt.to_vec();
    ids.extend_from_slice(&y[..b - 1]);
    let len = ids.len() as i64;
    let extra = k as i64 + 1;
    let first = y[b - 1];
    let fp = |c: &KvCache| c.fingerprint(c.snapshot(0));
    // Continuations run on copies, so every state keeps exactly `len` positions.
    let copy = |c: &KvCache| KvCache::gather(&[(c, c.snapshot(0))], extra);
    let live_a = live(model, policy, prompt, &y[..b - 1], extra)?;
    let live_b = live(model, policy, prompt, &y[..b - 1], extra)?;
    let live_cont = continue_greedy(model, policy, copy(&live_a)?, first, k)?;
    let oneshot = prefill_chunks(model, policy, &ids, 0, extra)?;
    let replay_cont = continue_greedy(model, policy, copy(&oneshot)?, first, k)?;
    let row = |kind: &str,
               chunk: i64,
               direction: &str,
               parts: &str,
               layers: (usize, usize),
               replica_equal: bool,
               state: &KvCache,
               cont: Vec<i64>|
     -> Result<StateResult> {
        let (k_max_abs, v_max_abs) = kv_diff(state, &live_a, len)?;
        Ok(StateResult {
            kind: kind.into(),
            chunk,
            direction: direction.into(),
            parts: parts.into(),
            layers,
            replica_equal,
            k_max_abs,
            v_max_abs,
            follows_live: cont == live_cont,
            follows_replay: cont == replay_cont,
            continuation: cont,
        })
    };
    let n_layers = model.config().num_layers();
    let mut out = vec![row(
        "live",
        -1,
        "",
        "",
        (0, 0),
        fp(&live_a)? == fp(&live_b)?,
        &live_a,
        live_cont.clone(),
    )?];
    for &c in chunks {
        let a = prefill_chunks(model, policy, &ids, c, extra)?;
        let again = prefill_chunks(model, policy, &ids, c, extra)?;
        let cont = if c == 0 {
            replay_cont.clone()
        } else {
            continue_greedy(model, policy, copy(&a)?, first, k)?
        };
        let equal = fp(&a)? == fp(&again)?;
        out.push(row("replay", c as i64, "", "", (0, 0), equal, &a, cont)?);
    }
    for (direction, base, donor) in [
        ("replay<-live", &oneshot, &live_a),
        ("live<-replay", &live_a, &oneshot),
    ] {
        for parts in [KvParts::Kv, KvParts::K, KvParts::V] {
            for (lo, hi) in transplant_ranges(n_layers) {
                if parts != KvParts::Kv && (lo, hi) != (0, n_layers) {
                    continue;
                }
                let t = KvCache::transplant(
                    &[Transplant {
                        base: (base, base.snapshot(0)),
                        donor: (donor, donor.snapshot(0)),
                        select: KvSelect {
                            layers: lo..hi,
                            positions: 0..len,
                            parts,
                        },
                    }],
                    extra,
                )?;
                let cont = continue_greedy(model, policy, copy(&t)?, first, k)?;
                out.push(row(
                    "transplant",
                    -1,
                    direction,
                    parts.as_str(),
                    (lo, hi),
                    true,
                    &t,
                    cont,
                )?);
            }
        }
    }
    Ok(out)
}
