//! Cache-ON and cache-OFF decoding of a batch of problems in lockstep.
//!
//! Per step, cache-ON feeds each row's last token against its KV cache, cache-OFF runs one full
//! forward over prompt ⊕ generated-so-far (right-padded, a fresh cache, each row's last
//! position); both choose with the same counter-based noise, so identical logits give identical
//! tokens. The two logit rows of a step are compared on the device in fp64 while the paths
//! share their prefix. In [`Mode::Forced`] cache-OFF is fed cache-ON's tokens (teacher forcing
//! on cache-ON's sequence), and the residual stream after every layer and the cached K/V of the
//! current position are compared too (layer-wise drift). One readback per step.
//!
//! Batch schedule: a row leaves a path's batch as soon as that path has stopped (cache-ON drops
//! its cache row, cache-OFF stops re-running it), and cache-OFF pads only to its longest
//! active row. Under the stock policy a batch's shape can change how kernels round, so the
//! schedule is part of the numerical path: it is a function of the spec only (the fixed
//! batches and each row's own stop), so reruns and resumes reproduce it bitwise; under
//! `batch_invariant` a row's logits do not depend on its batch at all.
use crate::Result;
use crate::decode::engine::{Stop, TextStop};
use crate::exec::ExecPolicy;
use crate::generate::check_finite;
use crate::kv_cache::KvCache;
use crate::model::hooks::{ForwardHook, NoHook, Recorder};
use crate::model::{Decoder, LogitsAt};
use crate::sampling::{self, NoiseKey, Sampling};
use tch::{Device, Kind, Tensor};

/// Whether cache-OFF follows its own tokens or cache-ON's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Both paths run free (each feeds its own choices).
    Free,
    /// Cache-OFF is fed cache-ON's tokens; `drift` also compares residuals and K/V per layer.
    Forced {
        /// Record layer-wise drift.
        drift: bool,
    },
}

/// What the lockstep runs with.
pub struct Settings<'a> {
    /// The model.
    pub model: &'a Decoder,
    /// Execution policy of both paths.
    pub policy: ExecPolicy,
    /// Token selection (both paths, same noise).
    pub sampling: Sampling,
    /// Token cap.
    pub max_new_tokens: usize,
    /// End-of-sequence tokens.
    pub stop_tokens: &'a [i64],
    /// Text stop test, if any.
    pub text_stop: Option<TextStop<'a>>,
}

/// The two paths' logits at one step on the same prefix, compared in fp64.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCompare {
    /// Generation step (0 = the logits after the prompt).
    pub step: usize,
    /// `max_v |z_ON − z_OFF|`.
    pub max_abs: f64,
    /// `mean_v (z_ON − z_OFF)²`.
    pub mse: f64,
    /// `KL(p_OFF ‖ p_ON)` at temperature 1 (nats).
    pub kl: f64,
    /// Argmax of cache-ON.
    pub argmax_on: i64,
    /// Argmax of cache-OFF.
    pub argmax_off: i64,
    /// `p(top1) − p(top2)` of cache-ON.
    pub margin_on: f64,
    /// `p(top1) − p(top2)` of cache-OFF.
    pub margin_off: f64,
}

/// Layer-wise drift at one step and layer (teacher-forced): relative L2 and max-abs of
/// `x_ON − x_OFF` at the current position, `‖Δ‖ / ‖x_OFF‖`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Drift {
    /// Generation step.
    pub step: usize,
    /// Layer.
    pub layer: usize,
    /// Residual stream after the layer: relative L2.
    pub resid_rel: f64,
    /// Residual stream: max-abs.
    pub resid_max_abs: f64,
    /// Cached key of the current position: relative L2 (over heads × head dim).
    pub k_rel: f64,
    /// Cached key: max-abs.
    pub k_max_abs: f64,
    /// Cached value: relative L2.
    pub v_rel: f64,
    /// Cached value: max-abs.
    pub v_max_abs: f64,
}

/// One problem's pair of generations.
#[derive(Debug, Clone, PartialEq)]
pub struct PairOutcome {
    /// Cache-ON's tokens.
    pub on: Vec<i64>,
    /// Cache-OFF's tokens (in forced mode: its argmax at each step of cache-ON's sequence).
    pub off: Vec<i64>,
    /// Why cache-ON stopped.
    pub stop_on: Stop,
    /// Why cache-OFF stopped.
    pub stop_off: Stop,
    /// Logit comparisons at every step where both paths had the same prefix.
    pub compare: Vec<StepCompare>,
    /// Layer-wise drift (forced mode with drift only), step-major.
    pub drift: Vec<Drift>,
}

impl PairOutcome {
    /// First step where the two token sequences differ (a length difference counts), if any.
    pub fn first_divergence(&self) -> Option<usize> {
        first_difference(&self.on, &self.off)
    }
}

/// First index where `a` and `b` differ, counting a length difference.
pub fn first_difference(a: &[i64], b: &[i64]) -> Option<usize> {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => Some(i),
        None if a.len() != b.len() => Some(a.len().min(b.len())),
        None => None,
    }
}

/// Right-pad `seqs` with token 0 into a `[B, max]` int64 tensor on `device`.
pub(crate) fn padded(seqs: &[&[i64]], device: Device) -> Result<Tensor> {
    let width = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
    let mut flat = Vec::with_capacity(seqs.len() * width);
    for s in seqs {
        flat.extend_from_slice(s);
        flat.extend(std::iter::repeat_n(0, width - s.len()));
    }
    Ok(Tensor::f_from_slice(&flat)?
        .f_view([seqs.len() as i64, width as i64])?
        .f_to_device(device)?)
}

/// fp64 comparison of two `[B, V]` logit rows: `[B, 7]` (max-abs, MSE, KL(OFF‖ON), argmax ON,
/// argmax OFF, margin ON, margin OFF).
pub(crate) fn compare_logits(on: &Tensor, off: &Tensor) -> Result<Tensor> {
    let a = on.f_to_kind(Kind::Double)?;
    let f = off.f_to_kind(Kind::Double)?;
    let d = a.f_sub(&f)?;
    let max_abs = d.f_abs()?.f_amax([-1], false)?;
    let mse = d
        .f_mul(&d)?
        .f_mean_dim([-1i64].as_slice(), false, Kind::Double)?;
    let (la, lf) = (
        a.f_log_softmax(-1, Kind::Double)?,
        f.f_log_softmax(-1, Kind::Double)?,
    );
    let kl = lf.f_exp()?.f_mul(&lf.f_sub(&la)?)?.f_sum_dim_intlist(
        [-1i64].as_slice(),
        false,
        Kind::Double,
    )?;
    let margin = |lp: &Tensor| -> Result<Tensor> {
        let (top, _) = lp.f_exp()?.f_topk(2, -1, true, true)?;
        Ok(top.f_select(1, 0)?.f_sub(&top.f_select(1, 1)?)?)
    };
    let cols = [
        max_abs,
        mse,
        kl,
        a.f_argmax(-1, false)?.f_to_kind(Kind::Double)?,
        f.f_argmax(-1, false)?.f_to_kind(Kind::Double)?,
        margin(&la)?,
        margin(&lf)?,
    ];
    Ok(Tensor::f_stack(&cols, 1)?)
}

/// Relative L2 and max-abs of `x − y` over the last dim, in fp64: two tensors of `x`'s
/// leading shape.
fn rel_and_max(x: &Tensor, y: &Tensor) -> Result<(Tensor, Tensor)> {
    let (x, y) = (x.f_to_kind(Kind::Double)?, y.f_to_kind(Kind::Double)?);
    let d = x.f_sub(&y)?;
    let norm = |t: &Tensor| -> Result<Tensor> {
        Ok(t.f_mul(t)?
            .f_sum_dim_intlist([-1i64].as_slice(), false, Kind::Double)?
            .f_sqrt()?)
    };
    let rel = norm(&d)?.f_div(&norm(&y)?.f_clamp_min(f64::MIN_POSITIVE)?)?;
    Ok((rel, d.f_abs()?.f_amax([-1], false)?))
}

/// Drift of one step: `[B, L, 6]` (resid rel, resid max, K rel, K max, V rel, V max).
fn drift_tensor(
    rec_on: &Recorder,
    rec_off: &Recorder,
    on: &KvCache,
    on_at: &[(usize, i64)],
    off: &KvCache,
    off_at: &[(usize, i64)],
) -> Result<Tensor> {
    let (r_rel, r_max) = rel_and_max(&rec_on.stacked()?, &rec_off.stacked()?)?; // [L, B]
    let (eo, ef) = (on.entries(on_at)?, off.entries(off_at)?); // [L, 2, B, H, D]
    let flat = |t: Tensor| -> Result<Tensor> {
        let s = t.size();
        Ok(t.f_reshape([s[0], s[1], s[2], -1])?)
    };
    let (kv_rel, kv_max) = rel_and_max(&flat(eo)?, &flat(ef)?)?; // [L, 2, B]
    let cols = [
        r_rel,
        r_max,
        kv_rel.f_select(1, 0)?,
        kv_max.f_select(1, 0)?,
        kv_rel.f_select(1, 1)?,
        kv_max.f_select(1, 1)?,
    ];
    Ok(Tensor::f_stack(&cols, 2)?.f_permute([1, 0, 2])?) // [B, L, 6]
}

/// Run cache-ON and cache-OFF in lockstep over `prompts` (one row each); `keys[i]` is row
/// *i*'s noise key at step 0 (its `step` is replaced per step).
pub fn run(
    s: &Settings,
    prompts: &[Vec<i64>],
    keys: &[NoiseKey],
    mode: Mode,
) -> Result<Vec<PairOutcome>> {
    let _guard = tch::no_grad_guard();
    let mut ls = Lockstep::prefill(s, prompts, keys, mode)?;
    for step in 0..s.max_new_tokens {
        let off = ls.off_forward(step)?;
        let lo = match &ls.logits_on {
            Some(z) => {
                let z = z.f_view([ls.active_on.len() as i64, -1])?;
                check_finite(&z, &format!("cache-ON decoding, step {step}"))?;
                Some(z)
            }
            None => None,
        };
        let both = ls.compared_rows();
        let host = ls.read_back(step, lo.as_ref(), off.logits.as_ref(), &both)?;
        let drift = ls.drift_values(&off)?;
        ls.record(step, &host, lo.is_some(), &both, drift.as_deref());
        if step + 1 == s.max_new_tokens || !ls.advance()? {
            break;
        }
    }
    Ok(ls.out)
}

/// The lockstep of one batch in progress: both paths' outputs so far, the rows still decoding
/// on each path, cache-ON's cache, recorder and next logits.
struct Lockstep<'a> {
    s: &'a Settings<'a>,
    prompts: &'a [Vec<i64>],
    keys: &'a [NoiseKey],
    /// Cache-OFF is fed cache-ON's tokens.
    forced: bool,
    /// Layer-wise drift is recorded.
    drift: bool,
    out: Vec<PairOutcome>,
    done_on: Vec<bool>,
    done_off: Vec<bool>,
    /// Rows still decoding on each path: finished rows leave that path's batch (compaction).
    active_on: Vec<usize>,
    active_off: Vec<usize>,
    cache: KvCache,
    rec_on: Recorder,
    /// Cache-ON's logits of the step to come (none once every row stopped).
    logits_on: Option<Tensor>,
}

/// Cache-OFF's forward of one step: its logits and fresh cache (none without active rows),
/// its recorder and the length of each active row's sequence.
struct OffStep {
    logits: Option<Tensor>,
    cache: Option<KvCache>,
    rec: Recorder,
    lens: Vec<i64>,
}

impl<'a> Lockstep<'a> {
    /// Cache-ON's prefill (right-padded, lengths cut back to each prompt).
    fn prefill(
        s: &'a Settings<'a>,
        prompts: &'a [Vec<i64>],
        keys: &'a [NoiseKey],
        mode: Mode,
    ) -> Result<Self> {
        let (model, dev) = (s.model, s.model.device());
        let n = prompts.len();
        let drift = matches!(mode, Mode::Forced { drift: true });
        let forced = matches!(mode, Mode::Forced { .. });
        let out: Vec<PairOutcome> = (0..n)
            .map(|_| PairOutcome {
                on: vec![],
                off: vec![],
                stop_on: Stop::Length,
                stop_off: Stop::Length,
                compare: vec![],
                drift: vec![],
            })
            .collect();
        let plen: Vec<i64> = prompts.iter().map(|p| p.len() as i64).collect();
        let width = plen.iter().copied().max().unwrap_or(0);
        let mut cache = model.new_cache(n, width + s.max_new_tokens as i64 + 1)?;
        let ids = padded(
            &prompts.iter().map(|p| p.as_slice()).collect::<Vec<_>>(),
            dev,
        )?;
        let last: Vec<i64> = plen.iter().map(|l| l - 1).collect();
        let mut rec_on = Recorder::new(last.clone(), false);
        let logits_on = {
            let hook: &mut dyn ForwardHook = if drift { &mut rec_on } else { &mut NoHook };
            model.forward_with(&ids, &mut cache, &s.policy, &LogitsAt::PerRow(last), hook)?
        };
        cache.truncate(&plen)?;
        Ok(Self {
            s,
            prompts,
            keys,
            forced,
            drift,
            out,
            done_on: vec![false; n],
            done_off: vec![false; n],
            active_on: (0..n).collect(),
            active_off: (0..n).collect(),
            cache,
            rec_on,
            logits_on: Some(logits_on),
        })
    }

    /// Cache-OFF: a full forward over each of its active rows' sequence.
    fn off_forward(&self, step: usize) -> Result<OffStep> {
        let (s, out, forced) = (self.s, &self.out, self.forced);
        let seqs: Vec<Vec<i64>> = self
            .active_off
            .iter()
            .map(|&i| {
                let generated = if forced { &out[i].on } else { &out[i].off };
                let mut v = self.prompts[i].clone();
                v.extend_from_slice(generated);
                v
            })
            .collect();
        let lens: Vec<i64> = seqs.iter().map(|v| v.len() as i64).collect();
        let mut rec = Recorder::new(lens.iter().map(|l| l - 1).collect(), false);
        let (logits, cache) = if self.active_off.is_empty() {
            (None, None)
        } else {
            let ids = padded(
                &seqs.iter().map(|v| v.as_slice()).collect::<Vec<_>>(),
                s.model.device(),
            )?;
            let mut off_cache = s.model.new_cache(self.active_off.len(), ids.size()[1])?;
            let last: Vec<i64> = lens.iter().map(|l| l - 1).collect();
            let hook: &mut dyn ForwardHook = if self.drift { &mut rec } else { &mut NoHook };
            let z = s.model.forward_with(
                &ids,
                &mut off_cache,
                &s.policy,
                &LogitsAt::PerRow(last),
                hook,
            )?;
            let z = z.f_view([self.active_off.len() as i64, -1])?;
            check_finite(&z, &format!("cache-OFF decoding, step {step}"))?;
            (Some(z), Some(off_cache))
        };
        Ok(OffStep {
            logits,
            cache,
            rec,
            lens,
        })
    }

    /// Rows compared this step: active on both paths with a shared prefix, as (row, index in
    /// cache-ON's batch, index in cache-OFF's).
    fn compared_rows(&self) -> Vec<(usize, usize, usize)> {
        let out = &self.out;
        let pos_off = |i: usize| self.active_off.iter().position(|&r| r == i);
        self.active_on
            .iter()
            .enumerate()
            .filter(|&(_, &i)| self.forced || out[i].on == out[i].off)
            .filter_map(|(j, &i)| pos_off(i).map(|k| (i, j, k)))
            .collect()
    }

    /// The step's one readback: the comparison of the `both` rows (7 values each), then
    /// cache-ON's tokens, then cache-OFF's (free mode only).
    fn read_back(
        &self,
        step: usize,
        lo: Option<&Tensor>,
        logits_off: Option<&Tensor>,
        both: &[(usize, usize, usize)],
    ) -> Result<Vec<f64>> {
        let (s, dev) = (self.s, self.s.model.device());
        let words_for = |rows: &[usize]| -> Result<Tensor> {
            let step_keys: Vec<NoiseKey> = rows
                .iter()
                .map(|&i| NoiseKey {
                    step: step as u64,
                    ..self.keys[i]
                })
                .collect();
            Ok(Tensor::f_from_slice(&sampling::noise_words(&step_keys))?
                .f_to_device(dev)?
                .f_view([2, rows.len() as i64, 1])?)
        };
        let mut parts: Vec<Tensor> = Vec::with_capacity(3);
        if let (Some(lo), Some(lf)) = (lo, logits_off)
            && !both.is_empty()
        {
            let idx =
                |v: Vec<i64>| -> Result<Tensor> { Ok(Tensor::f_from_slice(&v)?.f_to_device(dev)?) };
            let jo = idx(both.iter().map(|x| x.1 as i64).collect())?;
            let jf = idx(both.iter().map(|x| x.2 as i64).collect())?;
            let c = compare_logits(&lo.f_index_select(0, &jo)?, &lf.f_index_select(0, &jf)?)?;
            parts.push(c.f_reshape([-1])?);
        }
        if let Some(lo) = lo {
            let t = sampling::select_on_device(
                lo,
                s.sampling,
                &words_for(&self.active_on)?,
                s.model.sampler(),
            )?;
            parts.push(t.f_to_kind(Kind::Double)?.f_reshape([-1])?);
        }
        if let (Some(lf), false) = (logits_off, self.forced) {
            let t = sampling::select_on_device(
                lf,
                s.sampling,
                &words_for(&self.active_off)?,
                s.model.sampler(),
            )?;
            parts.push(t.f_to_kind(Kind::Double)?.f_reshape([-1])?);
        }
        Ok(Vec::try_from(
            Tensor::f_cat(&parts, 0)?.f_to_device(Device::Cpu)?,
        )?)
    }

    /// Layer-wise drift of the step's rows, `[B, L, 6]` flattened (drift mode with an active
    /// cache-OFF batch only).
    fn drift_values(&self, off: &OffStep) -> Result<Option<Vec<f64>>> {
        match &off.cache {
            Some(off_cache) if self.drift => {
                // Forced: both paths hold the same rows in the same order.
                let a = self.active_on.len();
                let on_at: Vec<(usize, i64)> =
                    (0..a).map(|j| (j, self.cache.lens()[j] - 1)).collect();
                let off_at: Vec<(usize, i64)> = (0..a).map(|j| (j, off.lens[j] - 1)).collect();
                let t = drift_tensor(
                    &self.rec_on,
                    &off.rec,
                    &self.cache,
                    &on_at,
                    off_cache,
                    &off_at,
                )?;
                Ok(Some(Vec::try_from(
                    t.f_to_device(Device::Cpu)?.f_reshape([-1])?,
                )?))
            }
            _ => Ok(None),
        }
    }

    /// Record the step's comparisons, drift and tokens, and each path's stops.
    fn record(
        &mut self,
        step: usize,
        host: &[f64],
        on_ran: bool,
        both: &[(usize, usize, usize)],
        drift: Option<&[f64]>,
    ) {
        let (forced, layers) = (self.forced, self.s.model.config().num_layers());
        let out = &mut self.out;
        let nc = both.len() * 7;
        let (cmp, rest) = host.split_at(nc);
        let (tok_on, tok_off) = rest.split_at(if on_ran { self.active_on.len() } else { 0 });
        for (r, &(i, _, _)) in both.iter().enumerate() {
            let row = &cmp[r * 7..(r + 1) * 7];
            out[i].compare.push(StepCompare {
                step,
                max_abs: row[0],
                mse: row[1],
                kl: row[2],
                argmax_on: row[3] as i64,
                argmax_off: row[4] as i64,
                margin_on: row[5],
                margin_off: row[6],
            });
            if forced {
                out[i].off.push(row[4] as i64);
            }
        }
        if let Some(d) = drift {
            for (j, &i) in self.active_on.iter().enumerate() {
                for l in 0..layers {
                    let c = &d[(j * layers + l) * 6..(j * layers + l + 1) * 6];
                    out[i].drift.push(Drift {
                        step,
                        layer: l,
                        resid_rel: c[0],
                        resid_max_abs: c[1],
                        k_rel: c[2],
                        k_max_abs: c[3],
                        v_rel: c[4],
                        v_max_abs: c[5],
                    });
                }
            }
        }
        let s = self.s;
        let stop = |toks: &[i64]| -> Option<Stop> {
            let last = *toks.last()?;
            if s.stop_tokens.contains(&last) {
                Some(Stop::Eos)
            } else if s.text_stop.is_some_and(|f| f(toks)) {
                Some(Stop::Text)
            } else {
                None
            }
        };
        for (j, &i) in self.active_on.iter().enumerate() {
            out[i].on.push(tok_on[j] as i64);
            if let Some(r) = stop(&out[i].on) {
                out[i].stop_on = r;
                self.done_on[i] = true;
            }
            if forced {
                out[i].stop_off = out[i].stop_on;
                self.done_off[i] = self.done_on[i];
            }
        }
        if !forced {
            for (k, &i) in self.active_off.iter().enumerate() {
                out[i].off.push(tok_off[k] as i64);
                if let Some(r) = stop(&out[i].off) {
                    out[i].stop_off = r;
                    self.done_off[i] = true;
                }
            }
        }
    }

    /// Drop the stopped rows from each path's batch, then run cache-ON's next decode step;
    /// false once both paths have stopped every row.
    fn advance(&mut self) -> Result<bool> {
        let (done_on, done_off) = (&self.done_on, &self.done_off);
        self.active_off.retain(|&i| !done_off[i]);
        let keep: Vec<usize> = (0..self.active_on.len())
            .filter(|&j| !done_on[self.active_on[j]])
            .collect();
        if keep.len() < self.active_on.len() && !keep.is_empty() {
            self.cache.select_rows(&keep)?;
        }
        self.active_on = keep.iter().map(|&j| self.active_on[j]).collect();
        if self.active_on.is_empty() && self.active_off.is_empty() {
            return Ok(false);
        }
        // Cache-ON: one decode step per active row.
        self.logits_on = if self.active_on.is_empty() {
            None
        } else {
            let feed: Vec<i64> = self
                .active_on
                .iter()
                .map(|&i| *self.out[i].on.last().expect("a token per step"))
                .collect();
            let ids = Tensor::f_from_slice(&feed)?
                .f_view([self.active_on.len() as i64, 1])?
                .f_to_device(self.s.model.device())?;
            self.rec_on = Recorder::new(vec![0; self.active_on.len()], false);
            let hook: &mut dyn ForwardHook = if self.drift {
                &mut self.rec_on
            } else {
                &mut NoHook
            };
            Some(self.s.model.forward_with(
                &ids,
                &mut self.cache,
                &self.s.policy,
                &LogitsAt::Last,
                hook,
            )?)
        };
        Ok(true)
    }
}
