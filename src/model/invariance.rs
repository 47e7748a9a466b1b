//! Checks that the decoder's outputs do not depend on how it is run: batch invariance under a
//! policy (design invariant 4), shared by `tests/invariance.rs` and `kvcredit invariance`, in
//! the style of vLLM's `test_decode_logprobs_match_prefill_logprobs` and its bs1-vs-bsN test;
//! and the glue implementation ([`check_glue`]).
//!
//! Each trial draws (from a seeded generator) a probe sequence of `n` tokens split into a
//! prompt of `p` tokens and `n − p` decoded tokens. The reference is one batch-1 prefill of all
//! `n` tokens (logits at every position, and the cache fingerprint of the row). Every check
//! computes the same tokens another way and compares logits — bitwise with `Tensor::equal`, and
//! as the largest absolute difference — and the SHA-256 fingerprint of the row's K/V:
//!
//! * `prefill_prefix`: a prefill of the first `p` tokens only (a shorter prefill);
//! * `decode_vs_prefill`: after that prefill, the rest decoded one token per step;
//! * `chunked_prefill`: the `n` tokens fed as 2–3 consecutive multi-token forwards;
//! * `prefill_last_only`: a prefill asking for the last position's logits only;
//! * `batch{B}_row{r}`: the probe at row `r` of a batch of `B` sequences whose other rows have
//!   random lengths (shorter and longer) and random tokens: a right-padded ragged prefill of
//!   all prompts (padding is random tokens, not zeros), then batched decode steps in which
//!   every row advances from its own length.
use crate::exec::ExecPolicy;
use crate::exec::glue::{Glue, bits};
use crate::kv_cache::{KvCache, Snapshot};
use crate::model::{Decoder, LogitsAt};
use crate::{Error, Result};
use tch::{Kind, Tensor};

/// What to run.
#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// Independent trials (probe sequences).
    pub trials: usize,
    /// Seed of the token/length generator (shared by all policies, so they see the same inputs).
    pub seed: u64,
    /// Shortest probe sequence (prompt plus decoded tokens).
    pub min_len: usize,
    /// Longest probe sequence; neighbours in a batch are up to this long too.
    pub max_len: usize,
    /// Most decode steps per trial.
    pub decode_steps: usize,
    /// `(batch size, row of the probe)` configurations.
    pub batches: Vec<(usize, usize)>,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions {
            trials: 3,
            seed: 0,
            min_len: 6,
            max_len: 72,
            decode_steps: 5,
            batches: vec![(5, 3), (2, 0), (7, 6)],
        }
    }
}

/// Outcome of one kind of comparison, accumulated over trials.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Check {
    /// Which comparison.
    pub name: String,
    /// Logit rows compared.
    pub rows: usize,
    /// Largest absolute logit difference.
    pub max_abs: f64,
    /// Every compared logit row was bitwise equal.
    pub bitwise: bool,
    /// K/V fingerprints compared.
    pub kv_compared: usize,
    /// Every compared fingerprint was equal.
    pub kv_equal: bool,
}

impl Check {
    fn new(name: &str) -> Check {
        Check {
            name: name.to_string(),
            rows: 0,
            max_abs: 0.0,
            bitwise: true,
            kv_compared: 0,
            kv_equal: true,
        }
    }

    /// Logits and K/V were bitwise equal.
    pub fn passed(&self) -> bool {
        self.bitwise && self.kv_equal
    }

    fn logits(&mut self, got: &Tensor, want: &Tensor) -> Result<()> {
        let (got, want) = (got.f_reshape([-1])?, want.f_reshape([-1])?);
        self.rows += 1;
        if !got.f_equal(&want)? {
            self.bitwise = false;
        }
        let diff = got
            .f_to_kind(Kind::Double)?
            .f_sub(&want.f_to_kind(Kind::Double)?)?
            .f_abs()?
            .f_max()?
            .f_double_value(&[])?;
        if diff.is_nan() || diff > self.max_abs {
            self.max_abs = diff;
        }
        Ok(())
    }

    fn kv(&mut self, equal: bool) {
        self.kv_compared += 1;
        self.kv_equal &= equal;
    }
}

/// How close the checked policy's reference logits are to the stock policy's (a sanity check
/// of the values: invariance alone would also hold for a kernel computing nonsense).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct StockAgreement {
    /// Logit rows (positions) compared.
    pub rows: usize,
    /// Largest absolute logit difference.
    pub max_abs: f64,
    /// Rows whose argmax is the same token.
    pub argmax_equal: usize,
}

impl StockAgreement {
    /// Add one sequence: `reference` (its logits under the checked policy, `[n, V]`) against
    /// a stock prefill of `seq`.
    fn add(&mut self, model: &Decoder, seq: &[i64], reference: &Tensor) -> Result<()> {
        let n = seq.len();
        let mut cache = model.new_cache(1, n as i64)?;
        let stock = model
            .forward(&ids(seq)?, &mut cache, &ExecPolicy::Stock, &LogitsAt::All)?
            .f_get(0)?
            .f_to_kind(Kind::Double)?;
        let mine = reference.f_to_kind(Kind::Double)?;
        let diff = mine.f_sub(&stock)?.f_abs()?.f_max()?.f_double_value(&[])?;
        if diff.is_nan() || diff > self.max_abs {
            self.max_abs = diff;
        }
        let same = mine
            .f_argmax(-1, false)?
            .f_eq_tensor(&stock.f_argmax(-1, false)?)?
            .f_sum(Kind::Int64)?
            .f_int64_value(&[])?;
        self.rows += n;
        self.argmax_equal += same as usize;
        Ok(())
    }

    /// Share of rows with the same argmax.
    pub fn argmax_rate(&self) -> f64 {
        if self.rows == 0 {
            1.0
        } else {
            self.argmax_equal as f64 / self.rows as f64
        }
    }
}

/// All checks of one run.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    /// Policy the model ran under.
    pub policy: ExecPolicy,
    /// One entry per kind of comparison, in a fixed order.
    pub checks: Vec<Check>,
    /// The reference prefills against the same prefills under stock (`None` under stock).
    pub vs_stock: Option<StockAgreement>,
}

impl Report {
    /// Every check was bitwise equal (logits and K/V).
    pub fn invariant(&self) -> bool {
        self.checks.iter().all(Check::passed)
    }

    /// Largest absolute logit difference over all checks.
    pub fn max_abs(&self) -> f64 {
        self.checks.iter().map(|c| c.max_abs).fold(0.0, f64::max)
    }

    /// A fixed-width table, one line per check.
    pub fn table(&self) -> String {
        let mut s = format!(
            "{:<22} {:>6} {:>12} {:>8} {:>10}\n",
            "check", "rows", "max|Δlogit|", "bitwise", "kv equal"
        );
        for c in &self.checks {
            s.push_str(&format!(
                "{:<22} {:>6} {:>12.3e} {:>8} {:>10}\n",
                c.name,
                c.rows,
                c.max_abs,
                if c.bitwise { "yes" } else { "NO" },
                if c.kv_equal {
                    format!("yes ({})", c.kv_compared)
                } else {
                    format!("NO ({})", c.kv_compared)
                }
            ));
        }
        s
    }
}

/// SplitMix64: a tiny seeded generator, so inputs do not depend on any other RNG state.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }

    fn tokens(&mut self, n: usize, vocab: usize) -> Vec<i64> {
        (0..n)
            .map(|_| (self.next() % vocab as u64) as i64)
            .collect()
    }
}

fn ids(tokens: &[i64]) -> Result<Tensor> {
    Ok(Tensor::f_from_slice(tokens)?.f_view([1, -1])?)
}

fn same_kv(a: &KvCache, ra: usize, b: &KvCache, rb: usize, len: i64) -> Result<bool> {
    Ok(a.fingerprint(Snapshot { row: ra, len })? == b.fingerprint(Snapshot { row: rb, len })?)
}

/// Run every check on `model` under `policy`.
pub fn run(model: &Decoder, policy: ExecPolicy, opts: &CheckOptions) -> Result<Report> {
    if opts.min_len < 2 || opts.max_len < opts.min_len || opts.decode_steps == 0 {
        return Err(Error::Spec(
            "invariance checks need 2 <= min_len <= max_len and decode_steps >= 1".into(),
        ));
    }
    for &(bs, row) in &opts.batches {
        if row >= bs {
            return Err(Error::Spec(format!(
                "batch configuration: row {row} is outside a batch of {bs}"
            )));
        }
    }
    let _guard = tch::no_grad_guard();
    let vocab = model.config().vocab_size;
    let mut rng = Rng(opts.seed);
    let mut checks: Vec<Check> = ["prefill_prefix", "decode_vs_prefill", "chunked_prefill"]
        .iter()
        .map(|n| Check::new(n))
        .chain([Check::new("prefill_last_only")])
        .chain(
            opts.batches
                .iter()
                .map(|(bs, row)| Check::new(&format!("batch{bs}_row{row}"))),
        )
        .collect();
    let mut vs_stock = (policy != ExecPolicy::Stock).then_some(StockAgreement {
        rows: 0,
        max_abs: 0.0,
        argmax_equal: 0,
    });
    for _ in 0..opts.trials {
        let n = rng.range(opts.min_len, opts.max_len);
        let steps = rng.range(1, opts.decode_steps.min(n - 1));
        let p = n - steps;
        let seq = rng.tokens(n, vocab);

        // Reference: one batch-1 prefill of all n tokens.
        let mut ref_cache = model.new_cache(1, n as i64)?;
        let reference = model
            .forward(&ids(&seq)?, &mut ref_cache, &policy, &LogitsAt::All)?
            .f_get(0)?;
        if let Some(agree) = vs_stock.as_mut() {
            agree.add(model, &seq, &reference)?;
        }

        // A shorter prefill, then decode steps.
        let mut cache = model.new_cache(1, n as i64)?;
        let out = model.forward(&ids(&seq[..p])?, &mut cache, &policy, &LogitsAt::All)?;
        for j in 0..p {
            checks[0].logits(&out.f_get(0)?.f_get(j as i64)?, &reference.f_get(j as i64)?)?;
        }
        checks[0].kv(same_kv(&cache, 0, &ref_cache, 0, p as i64)?);
        for j in p..n {
            let out = model.forward(&ids(&seq[j..j + 1])?, &mut cache, &policy, &LogitsAt::All)?;
            checks[1].logits(&out, &reference.f_get(j as i64)?)?;
        }
        checks[1].kv(same_kv(&cache, 0, &ref_cache, 0, n as i64)?);

        // Chunked prefill: 2 or 3 consecutive multi-token forwards.
        let mut cuts = vec![0, rng.range(1, n - 1)];
        if cuts[1] + 1 < n && rng.next().is_multiple_of(2) {
            cuts.push(rng.range(cuts[1] + 1, n - 1));
        }
        cuts.push(n);
        let mut cache = model.new_cache(1, n as i64)?;
        for w in cuts.windows(2) {
            let out =
                model.forward(&ids(&seq[w[0]..w[1]])?, &mut cache, &policy, &LogitsAt::All)?;
            for j in w[0]..w[1] {
                checks[2].logits(
                    &out.f_get(0)?.f_get((j - w[0]) as i64)?,
                    &reference.f_get(j as i64)?,
                )?;
            }
        }
        checks[2].kv(same_kv(&cache, 0, &ref_cache, 0, n as i64)?);

        // Last-position logits only (the path generation uses).
        let mut cache = model.new_cache(1, n as i64)?;
        let out = model.forward(&ids(&seq)?, &mut cache, &policy, &LogitsAt::Last)?;
        checks[3].logits(&out, &reference.f_get(n as i64 - 1)?)?;
        checks[3].kv(same_kv(&cache, 0, &ref_cache, 0, n as i64)?);

        // The probe inside batches of other sequences.
        for (ci, &(bs, row)) in opts.batches.iter().enumerate() {
            let check = &mut checks[4 + ci];
            // Prompt and decode tokens per row; the probe's are fixed.
            let mut prompts: Vec<Vec<i64>> = Vec::with_capacity(bs);
            let mut decoded: Vec<Vec<i64>> = Vec::with_capacity(bs);
            for r in 0..bs {
                if r == row {
                    prompts.push(seq[..p].to_vec());
                    decoded.push(seq[p..].to_vec());
                } else {
                    let len = rng.range(1, opts.max_len);
                    prompts.push(rng.tokens(len, vocab));
                    decoded.push(rng.tokens(steps, vocab));
                }
            }
            let t = prompts.iter().map(Vec::len).max().unwrap_or(1);
            let mut flat = Vec::with_capacity(bs * t);
            for pr in &prompts {
                flat.extend_from_slice(pr);
                flat.extend(rng.tokens(t - pr.len(), vocab));
            }
            let tokens = Tensor::f_from_slice(&flat)?.f_view([bs as i64, t as i64])?;
            let mut cache = model.new_cache(bs, (t + steps) as i64)?;
            let out = model.forward(&tokens, &mut cache, &policy, &LogitsAt::All)?;
            for j in 0..p {
                check.logits(
                    &out.f_get(row as i64)?.f_get(j as i64)?,
                    &reference.f_get(j as i64)?,
                )?;
            }
            let lens: Vec<i64> = prompts.iter().map(|pr| pr.len() as i64).collect();
            cache.truncate(&lens)?;
            for s in 0..steps {
                let next: Vec<i64> = decoded.iter().map(|d| d[s]).collect();
                let out = model.forward(
                    &Tensor::f_from_slice(&next)?.f_view([bs as i64, 1])?,
                    &mut cache,
                    &policy,
                    &LogitsAt::All,
                )?;
                check.logits(&out.f_get(row as i64)?, &reference.f_get((p + s) as i64)?)?;
            }
            check.kv(same_kv(&cache, row, &ref_cache, 0, n as i64)?);
        }
    }
    Ok(Report {
        policy,
        checks,
        vs_stock,
    })
}

/// Logits of `model` under `policy` with each glue, compared bitwise: a prefill of `prompt`
/// into two rows (one slice write), the second row cut back three positions, then `steps`
/// greedy decode steps over the now ragged rows (scattered writes). `(elements, mismatches)`.
pub fn check_glue(
    model: &Decoder,
    policy: &ExecPolicy,
    prompt: &[i64],
    steps: usize,
) -> Result<(i64, i64)> {
    Glue::Fused.check_device(model.device())?;
    let n = prompt.len() as i64;
    if n < 4 {
        return Err(Error::Spec(format!(
            "the glue's model check needs a prompt of at least 4 tokens, got {n}"
        )));
    }
    let run = |glue: Glue| -> Result<Vec<Tensor>> {
        let forward = |ids: &Tensor, cache: &mut KvCache| {
            model.forward_with_glue(ids, cache, policy, &LogitsAt::Last, glue)
        };
        let mut cache = model.new_cache(2, n + steps as i64 + 1)?;
        let ids = Tensor::f_from_slice(prompt)?
            .f_view([1, n])?
            .f_repeat([2, 1])?;
        let mut logits = forward(&ids, &mut cache)?;
        cache.truncate(&[n, n - 3])?;
        let mut out = Vec::new();
        for _ in 0..steps {
            let next = logits.f_argmax(-1, false)?.f_view([2, 1])?;
            out.push(logits);
            logits = forward(&next, &mut cache)?;
        }
        out.push(logits);
        Ok(out)
    };
    let (a, f) = (run(Glue::Aten)?, run(Glue::Fused)?);
    let mut elements = 0;
    let mut mismatches = 0;
    for (a, f) in a.iter().zip(&f) {
        elements += a.numel() as i64;
        mismatches += bits(a)?
            .f_ne_tensor(&bits(f)?)?
            .f_sum(Kind::Int64)?
            .f_int64_value(&[])?;
    }
    Ok((elements, mismatches))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logit_comparison_is_bitwise_and_fails_cleanly_on_mismatched_shapes() -> Result<()> {
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let mut c = Check::new("x");
        c.logits(&a, &a.copy())?;
        assert!(c.bitwise && c.max_abs == 0.0 && c.rows == 1);
        c.logits(&a, &Tensor::from_slice(&[1.0f32, 2.0, 3.5]))?;
        assert!(!c.bitwise && c.max_abs == 0.5 && c.rows == 2);
        // Lengths that cannot be compared: an error, not a panic.
        assert!(c.logits(&a, &Tensor::from_slice(&[1.0f32, 2.0])).is_err());
        Ok(())
    }
}
