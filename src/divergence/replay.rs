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
//! its continuation equals the donor's own token for token. States are built at batch 1; all
//! continuations of a boundary run together in one batch (row order: LIVE, one-shot REPLAY,
//! the chunked replays, the transplants), so donor and recipient continue under one schedule.
use crate::Result;
use crate::exec::ExecPolicy;
use crate::kv_cache::{KvCache, KvParts, KvSelect, Transplant};
use crate::model::{Decoder, LogitsAt};
use crate::sampling::{self, Sampling};
use tch::{Device, Kind, Tensor};

/// One state's result at a boundary.
#[derive(Debug, Clone, PartialEq)]
pub struct StateResult {
    /// `live`, `replay` (construction rows), `transplant` rows, or `fp32-live` / `fp32-replay`
    /// (the fp32 half of the fixed-prefix 2×2).
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
    /// Per layer max |K − K_LIVE| and max |V − V_LIVE| over the state's positions (fp32 rows:
    /// against the fp32 incremental state).
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
        let t = Tensor::f_from_slice(part)?
            .f_view([1, -1])?
            .f_to_device(dev)?;
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
    let t = Tensor::f_from_slice(prompt)?
        .f_view([1, -1])?
        .f_to_device(dev)?;
    let _ = model.forward(&t, &mut cache, policy, &LogitsAt::Last)?;
    for &x in toks {
        let t = Tensor::f_from_slice(&[x])?
            .f_view([1, 1])?
            .f_to_device(dev)?;
        let _ = model.forward(&t, &mut cache, policy, &LogitsAt::Last)?;
    }
    Ok(cache)
}

/// Greedy continuations of `k` tokens from every one-row state, in one batch: feed `first`,
/// then each row's chosen token. The states are copied; they keep their positions.
fn continue_greedy(
    model: &Decoder,
    policy: &ExecPolicy,
    states: &[&KvCache],
    first: i64,
    k: usize,
) -> Result<Vec<Vec<i64>>> {
    let dev = model.device();
    let rows = states.len() as i64;
    let parts: Vec<(&KvCache, _)> = states.iter().map(|c| (*c, c.snapshot(0))).collect();
    let mut cache = KvCache::gather(&parts, k as i64 + 1)?;
    let mut out = vec![Vec::with_capacity(k); states.len()];
    let mut feed = Tensor::f_full([rows, 1], first, (Kind::Int64, dev))?;
    for _ in 0..k {
        let z = model.forward(&feed, &mut cache, policy, &LogitsAt::Last)?;
        let next = sampling::select(
            &z.f_view([rows, -1])?,
            Sampling::Greedy,
            &[],
            model.sampler(),
        )?;
        for (o, &t) in out.iter_mut().zip(&next) {
            o.push(t);
        }
        feed = Tensor::f_from_slice(&next)?
            .f_view([rows, 1])?
            .f_to_device(dev)?;
    }
    Ok(out)
}

/// Per layer max |ΔK| and |ΔV| of two one-row caches over `len` positions.
fn kv_diff(a: &KvCache, b: &KvCache, len: i64) -> Result<(Vec<f64>, Vec<f64>)> {
    let at: Vec<(usize, i64)> = (0..len).map(|p| (0, p)).collect();
    let d = a
        .entries(&at)?
        .f_to_kind(Kind::Double)?
        .f_sub(&b.entries(&at)?.f_to_kind(Kind::Double)?)?
        .f_abs()?;
    let l = d.size()[0];
    let m = d.f_reshape([l, 2, -1])?.f_amax([-1], false)?; // [L, 2]
    let host: Vec<f64> = Vec::try_from(m.f_to_device(Device::Cpu)?.f_reshape([-1])?)?;
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

/// Live vs replay and transplants at boundary `b` (1 ≤ b ≤ y.len()) of sequence `y`; with
/// `fp32` (the same weights in fp32, when the study's dtype is 16-bit) also the fp32 half of
/// the fixed-prefix 2×2: incremental (`fp32-live`) and one-shot (`fp32-replay`) states of the
/// same ids, each built twice (`replica_equal`), their K/V against each other and their greedy
/// continuations (`follows_live`/`follows_replay` compare with the study dtype's).
#[allow(clippy::too_many_arguments)]
pub fn run(
    model: &Decoder,
    fp32: Option<&Decoder>,
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
    let live_a = live(model, policy, prompt, &y[..b - 1], extra)?;
    let live_b = live(model, policy, prompt, &y[..b - 1], extra)?;
    let oneshot = prefill_chunks(model, policy, &ids, 0, extra)?;
    let n_layers = model.config().num_layers();
    // Every state, with its row's description; continued together at the end.
    struct Meta {
        kind: &'static str,
        chunk: i64,
        direction: &'static str,
        parts: &'static str,
        layers: (usize, usize),
        replica_equal: bool,
    }
    let meta = |kind, chunk, direction, parts, layers, replica_equal| Meta {
        kind,
        chunk,
        direction,
        parts,
        layers,
        replica_equal,
    };
    let mut states: Vec<(Meta, KvCache)> = Vec::new();
    let live_equal = fp(&live_a)? == fp(&live_b)?;
    for &c in chunks {
        let a = prefill_chunks(model, policy, &ids, c, extra)?;
        let again = prefill_chunks(model, policy, &ids, c, extra)?;
        let equal = fp(&a)? == fp(&again)?;
        states.push((meta("replay", c as i64, "", "", (0, 0), equal), a));
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
                let m = meta("transplant", -1, direction, parts.as_str(), (lo, hi), true);
                states.push((m, t));
            }
        }
    }
    // Row 0 continues LIVE, row 1 the one-shot REPLAY, then every state above.
    let mut all: Vec<&KvCache> = vec![&live_a, &oneshot];
    all.extend(states.iter().map(|(_, c)| c));
    let conts = continue_greedy(model, policy, &all, first, k)?;
    let (live_cont, replay_cont) = (conts[0].clone(), conts[1].clone());
    let row = |m: &Meta, state: &KvCache, cont: Vec<i64>| -> Result<StateResult> {
        let (k_max_abs, v_max_abs) = kv_diff(state, &live_a, len)?;
        Ok(StateResult {
            kind: m.kind.into(),
            chunk: m.chunk,
            direction: m.direction.into(),
            parts: m.parts.into(),
            layers: m.layers,
            replica_equal: m.replica_equal,
            k_max_abs,
            v_max_abs,
            follows_live: cont == live_cont,
            follows_replay: cont == replay_cont,
            continuation: cont,
        })
    };
    let mut out = vec![row(
        &meta("live", -1, "", "", (0, 0), live_equal),
        &live_a,
        live_cont.clone(),
    )?];
    for ((m, state), cont) in states.iter().zip(conts.into_iter().skip(2)) {
        out.push(row(m, state, cont)?);
    }
    if let Some(m32) = fp32 {
        let live32 = live(m32, policy, prompt, &y[..b - 1], extra)?;
        let live32_again = live(m32, policy, prompt, &y[..b - 1], extra)?;
        let one32 = prefill_chunks(m32, policy, &ids, 0, extra)?;
        let one32_again = prefill_chunks(m32, policy, &ids, 0, extra)?;
        let conts = continue_greedy(m32, policy, &[&live32, &one32], first, k)?;
        for (kind, state, equal, cont) in [
            (
                "fp32-live",
                &live32,
                fp(&live32)? == fp(&live32_again)?,
                &conts[0],
            ),
            (
                "fp32-replay",
                &one32,
                fp(&one32)? == fp(&one32_again)?,
                &conts[1],
            ),
        ] {
            // K/V against the fp32 incremental state: 0 for it, the construction gap for the
            // one-shot state.
            let (k_max_abs, v_max_abs) = kv_diff(state, &live32, len)?;
            out.push(StateResult {
                kind: kind.into(),
                chunk: if kind == "fp32-live" { -1 } else { 0 },
                direction: String::new(),
                parts: String::new(),
                layers: (0, 0),
                replica_equal: equal,
                k_max_abs,
                v_max_abs,
                follows_live: *cont == live_cont,
                follows_replay: *cont == replay_cont,
                continuation: cont.clone(),
            });
        }
    }
    Ok(out)
}
