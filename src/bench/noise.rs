//! Which schedule dimensions change a row's numerics bitwise (`kvcredit bench noise`).
//!
//! A serving engine decodes a request under batch shapes it does not choose. Each probe here
//! computes the same row twice, under a reference schedule and under another setting of one
//! dimension, and compares the outputs bit for bit:
//!
//! - `gemm_rows`: every linear shape of the model (`qkv`, `o`, `gate_up`, `down`, `lm_head`)
//!   on `M` rows of a decode step, row 0 against the same row alone (`M = 1`);
//! - `step_rows`: a whole decode step (eager and static) of `M` rows, rows 0 and `M − 1`
//!   against each decoded alone;
//! - `key_pad`: a static step whose cache holds `pad` more (masked) positions than the aligned
//!   capacity, against no padding, at 1 row and at the largest row count;
//! - `engine`: the eager step (key axis: the rows' length) against the static one (key axis:
//!   the aligned capacity);
//! - `prefill_chunk`: the prompt prefilled in chunks of `c` tokens against one forward: the
//!   last position's logits and the cache's K/V.
//!
//! The engine has no split-KV attention path (stock attention is one matmul, a softmax and
//! one matmul over the whole key axis), so that dimension has no probe.
use crate::exec::ExecPolicy;
use crate::kv_cache::{KvCache, Snapshot};
use crate::model::{Decoder, LogitsAt};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// What to probe.
#[derive(Debug, Clone)]
pub struct NoiseConfig {
    /// Prompt length of every row (the cached context of the decode steps).
    pub prompt: usize,
    /// Largest row count of the GEMM probe (every `M` in `1..=gemm_max_rows`).
    pub gemm_max_rows: usize,
    /// Row counts of the decode-step probes.
    pub rows: Vec<usize>,
    /// Key paddings of the static step.
    pub pads: Vec<i64>,
    /// Prefill chunk sizes.
    pub chunks: Vec<usize>,
    /// Seed of prompts and inputs.
    pub seed: u64,
}

/// One probe's outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NoiseRow {
    /// `gemm_rows`, `step_rows`, `key_pad`, `engine`, `prefill_chunk`.
    pub dimension: String,
    /// What was varied, e.g. `qkv 1536x2048` or `static, M = 64`.
    pub probe: String,
    /// The settings compared with the reference whose outputs differ bitwise (compressed
    /// ranges, e.g. `9-16, 33`), or empty.
    pub differs_at: String,
    /// The settings compared whose outputs are bitwise the reference's.
    pub same_at: String,
    /// Largest absolute difference seen (0 when all were bitwise equal).
    pub max_abs_diff: f64,
}

/// Every probe on `model` under `policy`.
pub fn run(model: &Decoder, policy: &ExecPolicy, cfg: &NoiseConfig) -> Result<Vec<NoiseRow>> {
    let _guard = tch::no_grad_guard();
    if cfg.prompt == 0 || cfg.rows.is_empty() || cfg.gemm_max_rows == 0 {
        return Err(Error::Spec(
            "noise: the prompt length, --rows and --gemm-max-rows must be positive".into(),
        ));
    }
    if let Some(p) = cfg.pads.iter().find(|&&p| p < 0) {
        return Err(Error::Spec(format!("noise: key padding {p} is negative")));
    }
    if cfg.chunks.contains(&0) {
        return Err(Error::Spec(
            "noise: a prefill chunk must be positive".into(),
        ));
    }
    model.check_context(
        cfg.prompt + 2 + cfg.pads.iter().copied().max().unwrap_or(0) as usize + 8,
        "the noise probes",
    )?;
    let mut rows = gemm_rows(model, policy, cfg)?;
    let max_rows = cfg.rows.iter().copied().max().unwrap_or(1).max(1);
    let base = prefill_rows(model, policy, cfg, max_rows)?;
    rows.extend(step_rows(model, policy, cfg, &base)?);
    rows.extend(key_pad(model, policy, cfg, &base, max_rows)?);
    rows.push(engine(model, policy, &base, max_rows)?);
    rows.extend(prefill_chunk(model, policy, cfg)?);
    Ok(rows)
}

/// The probes as a Markdown table.
pub fn table(rows: &[NoiseRow]) -> String {
    let mut s = String::from(
        "| dimension | probe | differs bitwise at | bitwise the same at | max abs diff |\n| --- | --- | --- | --- | ---: |\n",
    );
    let cell = |x: &str| {
        if x.is_empty() {
            "—".to_string()
        } else {
            x.to_string()
        }
    };
    for r in rows {
        s += &format!(
            "| {} | {} | {} | {} | {:.3e} |\n",
            r.dimension,
            r.probe,
            cell(&r.differs_at),
            cell(&r.same_at),
            r.max_abs_diff
        );
    }
    s
}

/// Settings compressed into ranges: `1-8, 12, 16-20`.
fn ranges(xs: &[i64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < xs.len() {
        let mut j = i;
        while j + 1 < xs.len() && xs[j + 1] == xs[j] + 1 {
            j += 1;
        }
        out.push(if j > i {
            format!("{}-{}", xs[i], xs[j])
        } else {
            xs[i].to_string()
        });
        i = j + 1;
    }
    out.join(", ")
}

/// Whether `a` and `b` hold the same bits, and their largest absolute difference.
fn compare(a: &Tensor, b: &Tensor) -> Result<(bool, f64)> {
    if a.size() != b.size() || a.kind() != b.kind() {
        return Err(Error::Spec(format!(
            "noise: comparing {:?} {:?} with {:?} {:?}",
            a.size(),
            a.kind(),
            b.size(),
            b.kind()
        )));
    }
    let bits = |t: &Tensor| -> Result<Tensor> {
        let t = t.f_contiguous()?;
        Ok(match t.kind() {
            Kind::BFloat16 | Kind::Half => t.f_view_dtype(Kind::Int16)?,
            Kind::Float => t.f_view_dtype(Kind::Int)?,
            Kind::Double => t.f_view_dtype(Kind::Int64)?,
            _ => t,
        })
    };
    let same = bool::try_from(bits(a)?.f_eq_tensor(&bits(b)?)?.f_all()?)?;
    let diff = a
        .f_to_kind(Kind::Double)?
        .f_sub(&b.f_to_kind(Kind::Double)?)?
        .f_abs()?
        .f_max()?;
    Ok((same, f64::try_from(diff)?))
}

/// Accumulates which settings differ from the reference.
#[derive(Default)]
struct Tally {
    differs: Vec<i64>,
    same: Vec<i64>,
    max: f64,
}

impl Tally {
    fn add(&mut self, at: i64, (same, diff): (bool, f64)) {
        if same {
            self.same.push(at);
        } else {
            self.differs.push(at);
        }
        self.max = self.max.max(diff);
    }

    fn row(self, dimension: &str, probe: String) -> NoiseRow {
        NoiseRow {
            dimension: dimension.into(),
            probe,
            differs_at: ranges(&self.differs),
            same_at: ranges(&self.same),
            max_abs_diff: self.max,
        }
    }
}

fn seeded(seed: u64) {
    tch::manual_seed(seed as i64);
}

fn random_ids(model: &Decoder, rows: usize, len: usize) -> Result<Tensor> {
    let vocab = model.config().vocab_size as i64;
    Ok(Tensor::f_randint(
        vocab,
        [rows as i64, len as i64],
        (Kind::Int64, model.device()),
    )?)
}

/// The model's linear shapes `(name, in, out)` as the decoder runs them (fused projections).
fn linear_shapes(model: &Decoder) -> Vec<(&'static str, i64, i64)> {
    let c = model.config();
    let (h, d) = (c.hidden_size as i64, c.head_dim as i64);
    let (hq, hkv) = (c.num_attention_heads as i64, c.num_key_value_heads as i64);
    let inter = c.intermediate_size as i64;
    vec![
        ("qkv", h, (hq + 2 * hkv) * d),
        ("o", hq * d, h),
        ("gate_up", h, 2 * inter),
        ("down", inter, h),
        ("lm_head", h, c.vocab_size as i64),
    ]
}

fn gemm_rows(model: &Decoder, policy: &ExecPolicy, cfg: &NoiseConfig) -> Result<Vec<NoiseRow>> {
    seeded(cfg.seed);
    let (kind, device) = (model.kind(), model.device());
    let mut out = Vec::new();
    for (name, k, n) in linear_shapes(model) {
        let w = Tensor::f_randn([n, k], (kind, device))?.f_mul_scalar(0.02)?;
        let x = Tensor::f_randn([cfg.gemm_max_rows as i64, 1, k], (kind, device))?;
        let reference = policy.linear(&x.f_narrow(0, 0, 1)?, &w, None)?;
        let mut t = Tally::default();
        for m in 2..=cfg.gemm_max_rows as i64 {
            let y = policy.linear(&x.f_narrow(0, 0, m)?, &w, None)?;
            t.add(m, compare(&y.f_narrow(0, 0, 1)?, &reference)?);
        }
        out.push(t.row("gemm_rows", format!("{name} {k}x{n}, row 0 vs M = 1")));
    }
    Ok(out)
}

/// `rows` prompts of the configured length prefilled one at a time (each row's K/V is then
/// its own, whatever batch it later joins).
fn prefill_rows(
    model: &Decoder,
    policy: &ExecPolicy,
    cfg: &NoiseConfig,
    rows: usize,
) -> Result<Vec<KvCache>> {
    seeded(cfg.seed ^ 0x5eed);
    let ids = random_ids(model, rows, cfg.prompt + 1)?;
    (0..rows as i64)
        .map(|r| {
            let mut cache = model.new_cache(1, cfg.prompt as i64 + 1)?;
            let _ = model.forward(
                &ids.f_narrow(0, r, 1)?.f_narrow(1, 0, cfg.prompt as i64)?,
                &mut cache,
                policy,
                &LogitsAt::Last,
            )?;
            Ok(cache)
        })
        .collect()
}

/// One decode step of the rows `ids` (row `i` resumes `base[ids[i]]`, feeds token `ids[i]`),
/// eager or static with `pad` extra key positions; logits `[rows, V]`.
fn step(
    model: &Decoder,
    policy: &ExecPolicy,
    base: &[KvCache],
    ids: &[usize],
    static_pad: Option<i64>,
) -> Result<Tensor> {
    let parts: Vec<(&KvCache, Snapshot)> = ids
        .iter()
        .map(|&i| (&base[i], base[i].snapshot(0)))
        .collect();
    let b = ids.len() as i64;
    let len = parts.iter().map(|(_, s)| s.len).max().unwrap_or(0);
    let feed: Vec<i64> = ids.iter().map(|&i| 1 + i as i64).collect();
    let tokens = Tensor::f_from_slice(&feed)?
        .f_view([b, 1])?
        .f_to_device(model.device())?;
    match static_pad {
        None => {
            let mut cache = KvCache::gather(&parts, 1)?;
            Ok(model
                .forward(&tokens, &mut cache, policy, &LogitsAt::Last)?
                .f_view([b, -1])?)
        }
        Some(pad) => {
            let align = crate::decode::stepper::CAPACITY_ALIGN;
            let cap = (len + 1 + align - 1) / align * align + pad;
            let mut cache = KvCache::gather(&parts, cap - len)?;
            let positions = Tensor::f_from_slice(cache.lens())?
                .f_view([b, 1])?
                .f_to_device(model.device())?;
            model.forward_static(&tokens, &positions, &mut cache, policy)
        }
    }
}

fn step_rows(
    model: &Decoder,
    policy: &ExecPolicy,
    cfg: &NoiseConfig,
    base: &[KvCache],
) -> Result<Vec<NoiseRow>> {
    let mut out = Vec::new();
    for (label, pad) in [("eager", None), ("static", Some(0))] {
        let mut t = Tally::default();
        let alone = |i: usize| step(model, policy, base, &[i], pad);
        for &m in cfg.rows.iter().filter(|&&m| m > 1) {
            let ids: Vec<usize> = (0..m).collect();
            let all = step(model, policy, base, &ids, pad)?;
            let first = compare(&all.f_narrow(0, 0, 1)?, &alone(0)?)?;
            let last = compare(&all.f_narrow(0, m as i64 - 1, 1)?, &alone(m - 1)?)?;
            t.add(m as i64, (first.0 && last.0, first.1.max(last.1)));
        }
        out.push(t.row(
            "step_rows",
            format!("{label} decode step, rows 0 and M − 1 vs each alone"),
        ));
    }
    Ok(out)
}

fn key_pad(
    model: &Decoder,
    policy: &ExecPolicy,
    cfg: &NoiseConfig,
    base: &[KvCache],
    max_rows: usize,
) -> Result<Vec<NoiseRow>> {
    let mut out = Vec::new();
    let mut counts = vec![1];
    if max_rows > 1 {
        counts.push(max_rows);
    }
    for m in counts {
        let ids: Vec<usize> = (0..m).collect();
        let reference = step(model, policy, base, &ids, Some(0))?;
        let mut t = Tally::default();
        for &pad in cfg.pads.iter().filter(|&&p| p > 0) {
            let padded = step(model, policy, base, &ids, Some(pad))?;
            t.add(pad, compare(&padded, &reference)?);
        }
        out.push(t.row(
            "key_pad",
            format!("static step, M = {m}, pad positions vs none"),
        ));
    }
    Ok(out)
}

fn engine(
    model: &Decoder,
    policy: &ExecPolicy,
    base: &[KvCache],
    max_rows: usize,
) -> Result<NoiseRow> {
    let mut t = Tally::default();
    let mut counts = vec![1];
    if max_rows > 1 {
        counts.push(max_rows);
    }
    for m in counts {
        let ids: Vec<usize> = (0..m).collect();
        let eager = step(model, policy, base, &ids, None)?;
        let stat = step(model, policy, base, &ids, Some(0))?;
        t.add(m as i64, compare(&eager, &stat)?);
    }
    Ok(t.row(
        "engine",
        "eager (key axis = rows' length) vs static (aligned capacity), at M".into(),
    ))
}

fn prefill_chunk(model: &Decoder, policy: &ExecPolicy, cfg: &NoiseConfig) -> Result<Vec<NoiseRow>> {
    seeded(cfg.seed ^ 0xc4a2);
    let n = cfg.prompt as i64;
    let ids = random_ids(model, 1, cfg.prompt)?;
    let prefill = |chunk: i64| -> Result<(Tensor, KvCache)> {
        let mut cache = model.new_cache(1, n)?;
        let mut logits = None;
        let mut at = 0;
        while at < n {
            let c = chunk.min(n - at);
            logits = Some(model.forward(
                &ids.f_narrow(1, at, c)?,
                &mut cache,
                policy,
                &LogitsAt::Last,
            )?);
            at += c;
        }
        Ok((logits.expect("a positive prompt"), cache))
    };
    let (ref_logits, ref_cache) = prefill(n)?;
    let ref_kv = ref_cache.fingerprint(ref_cache.snapshot(0))?;
    let (mut logits, mut kv) = (Tally::default(), Tally::default());
    for &c in cfg.chunks.iter().filter(|&&c| (c as i64) < n) {
        let (l, cache) = prefill(c as i64)?;
        logits.add(c as i64, compare(&l, &ref_logits)?);
        let same = cache.fingerprint(cache.snapshot(0))? == ref_kv;
        kv.add(c as i64, (same, 0.0));
    }
    Ok(vec![
        logits.row(
            "prefill_chunk",
            format!("last-position logits, chunk c vs one {n}-token forward"),
        ),
        kv.row(
            "prefill_chunk",
            format!("cache K/V (SHA-256), chunk c vs one {n}-token forward"),
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_compress_runs() {
        assert_eq!(ranges(&[1, 2, 3, 5, 7, 8]), "1-3, 5, 7-8");
        assert_eq!(ranges(&[]), "");
        assert_eq!(ranges(&[4]), "4");
    }

    #[test]
    fn compare_sees_one_bit_and_not_equal_values() -> Result<()> {
        let a = Tensor::f_from_slice(&[0.0f32, 1.0])?;
        let b = Tensor::f_from_slice(&[-0.0f32, 1.0])?;
        // -0.0 == 0.0 as values, but the bits differ
        assert!(!compare(&a, &b)?.0);
        assert!(compare(&a, &a.copy())?.0);
        Ok(())
    }
}
