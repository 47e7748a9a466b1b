//! Evaluations of tier policies on a real model: WikiText-2 perplexity with the context KV
//! compressed, single-needle NIAH, and the deployment-time INT4 probe.
//!
//! Every variant goes through the real path: tier plan → quantize and pack → wire frame →
//! decode and verify → restore into an ordinary cache → the unchanged decoder.
//!
//! # Perplexity protocol
//!
//! - Text: WikiText-2 raw, test split ([`WIKITEXT2_TEST`]), normalized by [`TextNorm`] before
//!   tokenization: CRLF line ends become LF by default ([`TextNorm::Lf`]); [`TextNorm::Raw`]
//!   keeps the file's bytes. No special tokens are added.
//! - Windows: window `w` is tokens `w·(n+m) .. (w+1)·(n+m)` of that stream (non-overlapping,
//!   from the start), with `n` context and `m` continuation tokens.
//! - Compressed: the first `n − 1` context tokens are prefilled, scored for importance and
//!   their KV compressed (tier plan over those `n − 1` positions, budget `b` relative to their
//!   full-FP16 bytes).
//! - Fed uncompressed: token `n − 1` (the last context token) and the continuation tokens
//!   `n .. n+m−2` are teacher-forced on the decode side after the restored cache, their own KV
//!   kept at the cache's precision.
//! - Scored: every one of the `m` continuation tokens, each predicted from the compressed
//!   context (so the first continuation token is scored against the compressed cache too),
//!   against the same window under the uncompressed cache (`nll_base`).
use super::allocate::{self, Budget, Policy, Protect};
use super::importance::{self, ImportanceSpec};
use super::tiers::{TierPlan, TieredKv};
use super::transport::{self, sync};
use super::{Quantizer, Tier, wire};
use crate::exec::ExecPolicy;
use crate::io::parquet::{Column, Table};
use crate::kv_cache::{KvCache, KvShape};
use crate::model::{Decoder, LogitsAt};
use crate::runtime::LoadedModel;
use crate::tasks::{Message, Prompt};
use crate::{Error, Result};
use std::time::{Duration, Instant};
use tch::{Kind, Tensor};

/// WikiText-2 raw, test split, byte for byte (its lines end in CRLF):
/// `data/wikitext-2-raw/wiki.test.raw`.
pub const WIKITEXT2_TEST: &str = include_str!("../../data/wikitext-2-raw/wiki.test.raw");

/// Version of what decides a row beyond the spec's settings (the quantizers' granularity,
/// the perplexity protocol): a grid's manifest records it, and one written under another
/// version is not resumed.
pub const PROTOCOL: u32 = 2;

/// How the WikiText-2 text is normalized before tokenization.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum TextNorm {
    /// Line ends CRLF → LF: the text that standard WikiText-2 evaluations tokenize.
    #[default]
    Lf,
    /// The file's bytes as they are, CRLF line ends kept.
    Raw,
}

impl TextNorm {
    /// Stable name (`lf`, `raw`), as written in tables.
    pub fn name(self) -> &'static str {
        match self {
            TextNorm::Lf => "lf",
            TextNorm::Raw => "raw",
        }
    }

    /// `text` normalized.
    pub fn apply(self, text: &str) -> std::borrow::Cow<'_, str> {
        match self {
            TextNorm::Lf => std::borrow::Cow::Owned(text.replace("\r\n", "\n")),
            TextNorm::Raw => std::borrow::Cow::Borrowed(text),
        }
    }
}

impl std::fmt::Display for TextNorm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The first `need` token ids of the WikiText-2 test text, normalized by `norm`, under
/// `model`'s tokenizer (no special tokens), tokenizing only as much text as needed.
pub fn wikitext_ids(model: &LoadedModel, need: usize, norm: TextNorm) -> Result<Vec<i64>> {
    let tok = model
        .tokenizer
        .as_ref()
        .ok_or_else(|| Error::Tokenizer(format!("model `{}` has no tokenizer", model.name)))?;
    let text = norm.apply(WIKITEXT2_TEST);
    let mut chars = (need * 8).max(4096);
    loop {
        let end = text
            .char_indices()
            .nth(chars)
            .map_or(text.len(), |(i, _)| i);
        let enc = tok
            .encode(&text[..end], false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        // Drop the last few tokens: the cut may have split a word.
        let ids: Vec<i64> = enc.get_ids().iter().map(|&x| x as i64).collect();
        if ids.len() > need + 8 || end == text.len() {
            if ids.len() < need {
                return Err(Error::Spectrum(format!(
                    "WikiText-2 test has {} tokens, {need} needed",
                    ids.len()
                )));
            }
            return Ok(ids[..need].to_vec());
        }
        chars *= 2;
    }
}

/// A prefilled context ready to be compressed.
pub struct Prefilled {
    /// One-row cache of the context.
    pub cache: KvCache,
    /// Importance per context token.
    pub scores: Vec<f64>,
    /// Time of the (traced) prefill forward.
    pub prefill: Duration,
    /// Time of the scoring.
    pub scoring: Duration,
}

/// Prefill `ids` and score its tokens.
pub fn prefill_and_score(
    model: &Decoder,
    ids: &[i64],
    policy: &ExecPolicy,
    spec: &ImportanceSpec,
) -> Result<Prefilled> {
    let t0 = Instant::now();
    let mut cache = model.new_cache(1, ids.len() as i64)?;
    let (_, trace) = importance::prefill_traced(model, ids, &mut cache, policy)?;
    sync(model.device());
    let prefill = t0.elapsed();
    let t1 = Instant::now();
    let scores = importance::score(model, ids, &cache, &trace, spec, policy)?;
    Ok(Prefilled {
        cache,
        scores,
        prefill,
        scoring: t1.elapsed(),
    })
}

/// One compression setting.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Variant {
    /// Tier policy.
    pub policy: Policy,
    /// Quantizer of the INT tiers.
    pub quantizer: Quantizer,
    /// Nominal budget (`None` for policies that ignore it).
    pub b: Option<f64>,
}

impl Variant {
    /// The quantizer's name, or `none` when the plan holds no INT tier by construction.
    pub fn quantizer_name(&self) -> &'static str {
        if no_int_tier(self.policy) {
            "none"
        } else {
            self.quantizer.name()
        }
    }

    /// Every variant of the given policies, budgets and quantizers (budget-free policies once
    /// per quantizer, quantizer-free ones once per budget).
    pub fn grid(policies: &[Policy], budgets: &[f64], quantizers: &[Quantizer]) -> Vec<Variant> {
        let mut out = Vec::new();
        for &policy in policies {
            let qs: &[Quantizer] = if no_int_tier(policy) {
                &quantizers[..quantizers.len().min(1)]
            } else {
                quantizers
            };
            for &quantizer in qs {
                if policy.uses_budget() {
                    out.extend(budgets.iter().map(|&b| Variant {
                        policy,
                        quantizer,
                        b: Some(b),
                    }));
                } else {
                    out.push(Variant {
                        policy,
                        quantizer,
                        b: None,
                    });
                }
            }
        }
        out
    }
}

/// Whether `policy`'s plans hold no INT tier by construction (keep/drop at FP16, or all FP16).
fn no_int_tier(policy: Policy) -> bool {
    matches!(
        policy,
        Policy::PdTrim | Policy::PdTrimFirst { .. } | Policy::SnapKv | Policy::Uniform(Tier::Fp16)
    )
}

/// A compressed context: plan, frame and how long it took.
pub struct Compressed {
    /// Tier per token.
    pub plan: TierPlan,
    /// The wire frame.
    pub frame: Vec<u8>,
    /// Full-FP16 bytes of the context (the budget's denominator).
    pub fp16_bytes: usize,
    /// Allocation, quantization and packing time.
    pub pack: Duration,
}

impl Compressed {
    /// Real budget: frame bytes ÷ full-FP16 bytes.
    pub fn real_b(&self) -> f64 {
        self.frame.len() as f64 / self.fp16_bytes as f64
    }
}

/// The tier plan of `v` for `pre`.
pub fn plan_of(pre: &Prefilled, v: &Variant, protect: Protect) -> Result<TierPlan> {
    plan_for(&pre.scores, pre.cache.shape(), v, protect)
}

/// The tier plan of `v` for a context of `scores.len()` tokens of KV shape `shape`.
pub fn plan_for(scores: &[f64], shape: KvShape, v: &Variant, protect: Protect) -> Result<TierPlan> {
    let budget = Budget {
        b: v.b.unwrap_or(1.0),
        shape,
        quantizer: v.quantizer,
        protect,
    };
    allocate::allocate(v.policy, scores, &budget)
}

/// What decides a variant's decode-side result: its plan, and its quantizer when the plan
/// holds an INT tier. Variants with equal keys are measured once.
pub type ShareKey = (Vec<Tier>, Option<Quantizer>);

/// The [`ShareKey`] of `plan` under `q`.
pub fn share_key(plan: &TierPlan, q: Quantizer) -> ShareKey {
    let c = plan.counts();
    (plan.tiers().to_vec(), (c[1] + c[2] > 0).then_some(q))
}

/// `policy/quantizer/b` of a variant, as in the `shared_with` column.
pub fn variant_label(v: &Variant) -> String {
    format!(
        "{}/{}/{}",
        v.policy.name(),
        v.quantizer_name(),
        v.b.map_or("-".into(), |b| b.to_string())
    )
}

/// Allocate, quantize and pack `pre` under `v`.
pub fn compress(pre: &Prefilled, v: &Variant, protect: Protect) -> Result<Compressed> {
    let t0 = Instant::now();
    let plan = plan_of(pre, v, protect)?;
    compress_plan(pre, v, plan, t0)
}

/// Quantize and pack `pre` under an already allocated `plan` (`t0`: when allocation began).
fn compress_plan(pre: &Prefilled, v: &Variant, plan: TierPlan, t0: Instant) -> Result<Compressed> {
    compress_row(&pre.cache, 0, v, plan, t0)
}

/// Quantize and pack positions `0..plan.len()` of `row` of `cache` under `plan`.
fn compress_row(
    cache: &KvCache,
    row: usize,
    v: &Variant,
    plan: TierPlan,
    t0: Instant,
) -> Result<Compressed> {
    let tiered = TieredKv::build(cache, row, &plan, v.quantizer)?;
    let frame = wire::encode(&tiered)?;
    Ok(Compressed {
        fp16_bytes: wire::fp16_bytes(cache.shape(), plan.len() as i64),
        plan,
        frame,
        pack: t0.elapsed(),
    })
}

/// Compress a snapshot of another cache (its first `scores.len()` positions of `row`, e.g. a
/// rollout's decode-time KV at a pivot) under `v`, with importance `scores` taken elsewhere.
pub fn compress_snapshot(
    cache: &KvCache,
    row: usize,
    scores: &[f64],
    v: &Variant,
    protect: Protect,
) -> Result<Compressed> {
    let t0 = Instant::now();
    let plan = plan_for(scores, cache.shape(), v, protect)?;
    compress_row(cache, row, v, plan, t0)
}

/// The decode side of a frame: verify, dequantize, restore (room for `extra` positions).
pub fn receive(model: &Decoder, frame: &[u8], extra: i64) -> Result<KvCache> {
    wire::decode(frame)?.restore(model.kind(), model.device(), extra)
}

/// Log-probabilities (fp64, `[m, V]`, on the model's device) of teacher-forcing `tokens` after
/// `cache`. The per-token statistics are reduced on that device and only scalars leave it: a
/// `[m, V]` fp64 tensor is hundreds of MB per variant, which a GPU grid would otherwise copy to
/// the host and reduce on its CPU.
fn teacher_forced(
    model: &Decoder,
    cache: &mut KvCache,
    tokens: &[i64],
    policy: &ExecPolicy,
) -> Result<Tensor> {
    let ids = Tensor::f_from_slice(tokens)?.f_view([1, -1])?;
    let logits = model.forward(&ids, cache, policy, &LogitsAt::All)?;
    Ok(logits
        .f_select(0, 0)?
        .f_to_kind(Kind::Double)?
        .f_log_softmax(-1, Kind::Double)?)
}

/// One perplexity measurement of one variant on one text window.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PplRow {
    /// Variant.
    pub policy: String,
    /// Quantizer name (`none` for PDTrim).
    pub quantizer: String,
    /// Nominal budget.
    pub b: Option<f64>,
    /// Frame bytes ÷ full-FP16 bytes.
    pub b_real: f64,
    /// Frame bytes.
    pub bytes: u64,
    /// Text window index.
    pub window: u32,
    /// Tokens per tier: fp16, int8, int4, dropped.
    pub tiers: [u32; 4],
    /// Σ NLL of the continuation under the compressed cache.
    pub nll: f64,
    /// Σ NLL under the uncompressed cache.
    pub nll_base: f64,
    /// Continuation tokens scored.
    pub tokens: u32,
    /// Mean KL(uncompressed ‖ compressed) per continuation token.
    pub kl: f64,
    /// Argmax agreement with the uncompressed cache over the continuation.
    pub top1_agree: f64,
    /// The variant ([`variant_label`]) whose measurement this row reuses because both have
    /// the same [`ShareKey`]; `None` when measured for this variant.
    pub shared_with: Option<String>,
}

/// Settings of the perplexity evaluation (the protocol is in the [module docs](self)).
#[derive(Debug, Clone)]
pub struct PplOptions {
    /// Context tokens `n` (its first `n − 1` are prefilled and compressed; the decode side
    /// feeds the last one, uncompressed, and the continuation).
    pub context: usize,
    /// Continuation tokens `m` scored.
    pub continuation: usize,
    /// Non-overlapping windows of `n + m` tokens from the start of the text.
    pub windows: usize,
    /// Variants.
    pub variants: Vec<Variant>,
    /// Importance settings.
    pub importance: ImportanceSpec,
    /// Pinned tokens.
    pub protect: Protect,
    /// Execution policy.
    pub policy: ExecPolicy,
    /// How the text behind the token stream was normalized (recorded in the table).
    pub text: TextNorm,
}

/// Perplexity rows of every window over the token stream `text_ids`.
pub fn perplexity(model: &Decoder, text_ids: &[i64], o: &PplOptions) -> Result<Vec<PplRow>> {
    let mut rows = Vec::new();
    for w in 0..o.windows {
        rows.extend(perplexity_window(model, text_ids, o, w)?);
    }
    Ok(rows)
}

/// Perplexity rows of window `w`: one prefill and scoring of its first `n − 1` tokens, shared
/// by every variant; each variant's compressed cache then takes token `n − 1` and the
/// continuation teacher-forced, and all `m` continuation tokens are scored. Variants with the
/// same [`ShareKey`] are measured once (`shared_with`).
pub fn perplexity_window(
    model: &Decoder,
    text_ids: &[i64],
    o: &PplOptions,
    w: usize,
) -> Result<Vec<PplRow>> {
    let span = o.context + o.continuation;
    if o.context < 2 || o.continuation < 1 || o.windows * span > text_ids.len() || w >= o.windows {
        return Err(Error::Spectrum(format!(
            "{} windows of {} + {} tokens need {} tokens; the text has {}",
            o.windows,
            o.context,
            o.continuation,
            o.windows * span,
            text_ids.len()
        )));
    }
    let mut rows: Vec<PplRow> = Vec::new();
    let mut measured: std::collections::HashMap<ShareKey, usize> = Default::default();
    let ids = &text_ids[w * span..(w + 1) * span];
    let (ctx, fed, target) = (
        &ids[..o.context - 1],
        &ids[o.context - 1..span - 1],
        &ids[o.context..],
    );
    let pre = prefill_and_score(model, ctx, &o.policy, &o.importance)?;
    let mut base_cache = KvCache::gather(&[(&pre.cache, pre.cache.snapshot(0))], fed.len() as i64)?;
    let base = teacher_forced(model, &mut base_cache, fed, &o.policy)?;
    let idx = Tensor::f_from_slice(target)?
        .f_view([-1, 1])?
        .f_to_device(model.device())?;
    let nll_of = |lp: &Tensor| -> Result<f64> {
        Ok(-lp
            .f_gather(1, &idx, false)?
            .f_sum(Kind::Double)?
            .f_double_value(&[])?)
    };
    let nll_base = nll_of(&base)?;
    let base_top = base.f_argmax(-1, false)?;
    for v in &o.variants {
        let t0 = Instant::now();
        let plan = plan_of(&pre, v, o.protect)?;
        let key = share_key(&plan, v.quantizer);
        let counts = plan.counts();
        let tiers = [
            counts[0] as u32,
            counts[1] as u32,
            counts[2] as u32,
            plan.dropped() as u32,
        ];
        let row = |nll: f64, kl: f64, top1_agree: f64, bytes: usize, shared_with| PplRow {
            policy: v.policy.name().to_string(),
            quantizer: v.quantizer_name().to_string(),
            b: v.b,
            b_real: bytes as f64 / wire::fp16_bytes(pre.cache.shape(), plan.len() as i64) as f64,
            bytes: bytes as u64,
            window: w as u32,
            tiers,
            nll,
            nll_base,
            tokens: target.len() as u32,
            kl,
            top1_agree,
            shared_with,
        };
        if let Some(&i) = measured.get(&key) {
            let (r, label) = (&rows[i], variant_label(&o.variants[i]));
            let budget = Budget {
                b: v.b.unwrap_or(1.0),
                shape: pre.cache.shape(),
                quantizer: v.quantizer,
                protect: o.protect,
            };
            let new = row(r.nll, r.kl, r.top1_agree, budget.bytes(&plan), Some(label));
            rows.push(new);
            continue;
        }
        let c = compress_plan(&pre, v, plan.clone(), t0)?;
        let mut cache = receive(model, &c.frame, fed.len() as i64)?;
        let lp = teacher_forced(model, &mut cache, fed, &o.policy)?;
        let kl = base
            .f_exp()?
            .f_mul(&base.f_sub(&lp)?)?
            .f_sum_dim_intlist([1i64].as_slice(), false, Kind::Double)?
            .f_mean(Kind::Double)?
            .f_double_value(&[])?;
        let agree = lp
            .f_argmax(-1, false)?
            .f_eq_tensor(&base_top)?
            .f_to_kind(Kind::Double)?
            .f_mean(Kind::Double)?
            .f_double_value(&[])?;
        measured.insert(key, rows.len());
        rows.push(row(nll_of(&lp)?, kl, agree, c.frame.len(), None));
    }
    Ok(rows)
}

/// Per-window Δ% of one row.
pub fn window_delta(r: &PplRow) -> f64 {
    100.0 * (((r.nll - r.nll_base) / r.tokens as f64).exp() - 1.0)
}

/// One variant's perplexity over all windows: `(ppl, ppl_base, Δ%, mean KL, mean real b)`.
pub fn ppl_summary(rows: &[&PplRow]) -> (f64, f64, f64, f64, f64) {
    let tokens: f64 = rows.iter().map(|r| r.tokens as f64).sum();
    let ppl = (rows.iter().map(|r| r.nll).sum::<f64>() / tokens).exp();
    let base = (rows.iter().map(|r| r.nll_base).sum::<f64>() / tokens).exp();
    let kl = rows.iter().map(|r| r.kl * r.tokens as f64).sum::<f64>() / tokens;
    let b = rows.iter().map(|r| r.b_real).sum::<f64>() / rows.len() as f64;
    (ppl, base, 100.0 * (ppl / base - 1.0), kl, b)
}

/// Perplexity rows as a table (schema in the README).
pub fn ppl_table(rows: &[PplRow], model: &str, o: &PplOptions) -> Table {
    let n = rows.len();
    let col = |f: &dyn Fn(&PplRow) -> f64| Column::F64(rows.iter().map(f).collect());
    Table::new()
        .with("model", Column::Str(vec![model.to_string(); n]))
        .with(
            "policy",
            Column::Str(rows.iter().map(|r| r.policy.clone()).collect()),
        )
        .with(
            "quantizer",
            Column::Str(rows.iter().map(|r| r.quantizer.clone()).collect()),
        )
        .with("b", Column::OptF64(rows.iter().map(|r| r.b).collect()))
        .with("b_real", col(&|r| r.b_real))
        .with(
            "bytes",
            Column::I64(rows.iter().map(|r| r.bytes as i64).collect()),
        )
        .with(
            "window",
            Column::U32(rows.iter().map(|r| r.window).collect()),
        )
        .with("context", Column::U32(vec![o.context as u32; n]))
        .with(
            "n_fp16",
            Column::U32(rows.iter().map(|r| r.tiers[0]).collect()),
        )
        .with(
            "n_int8",
            Column::U32(rows.iter().map(|r| r.tiers[1]).collect()),
        )
        .with(
            "n_int4",
            Column::U32(rows.iter().map(|r| r.tiers[2]).collect()),
        )
        .with(
            "n_drop",
            Column::U32(rows.iter().map(|r| r.tiers[3]).collect()),
        )
        .with(
            "tokens",
            Column::U32(rows.iter().map(|r| r.tokens).collect()),
        )
        .with("nll", col(&|r| r.nll))
        .with("nll_base", col(&|r| r.nll_base))
        .with("ppl", col(&|r| (r.nll / r.tokens as f64).exp()))
        .with("ppl_base", col(&|r| (r.nll_base / r.tokens as f64).exp()))
        .with("kl", col(&|r| r.kl))
        .with("top1_agree", col(&|r| r.top1_agree))
        .with(
            "shared_with",
            Column::OptStr(rows.iter().map(|r| r.shared_with.clone()).collect()),
        )
        .with("importance", Column::Str(vec![o.importance.describe(); n]))
        .with("sinks", Column::U32(vec![o.protect.sinks as u32; n]))
        .with("recent", Column::U32(vec![o.protect.recent as u32; n]))
        .with("text", Column::Str(vec![o.text.name().to_string(); n]))
}

/// RULER's noise haystack sentences.
const FILLER: &str =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ";
/// Needle keys, picked by seed.
const KEYS: [&str; 10] = [
    "apple", "harbor", "violet", "summit", "lantern", "meadow", "copper", "falcon", "orchid",
    "glacier",
];

/// One NIAH case: the prompt ids and the expected 7-digit value.
#[derive(Debug, Clone)]
pub struct NiahCase {
    /// Needle depth in `[0, 1]` (fraction of the haystack before the needle).
    pub depth: f64,
    /// Seed of key and value.
    pub seed: u64,
    /// The value to retrieve.
    pub value: String,
    /// Prompt token ids (chat template or plain text, then the answer prefix).
    pub ids: Vec<i64>,
    /// `chat` (the model's template) or `text` (no template: the plain-text format).
    pub prompt_format: &'static str,
}

/// Build a single-needle case of about `context` tokens: the message rendered with the
/// model's chat template, or, for a model without one, as plain text (BOS, the message, a
/// blank line), followed by the answer prefix.
pub fn niah_case(model: &LoadedModel, context: usize, depth: f64, seed: u64) -> Result<NiahCase> {
    let mut rng = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(0x2545_F491_4F6C_DD1D);
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let key = KEYS[(next() % KEYS.len() as u64) as usize];
    let value = format!("{}", 1_000_000 + next() % 9_000_000);
    let needle = format!(" One of the special magic numbers for {key} is: {value}. ");
    let build = |reps: usize| -> Result<Vec<i64>> {
        let before = ((reps as f64) * depth).round() as usize;
        let hay = format!(
            "{}{needle}{}",
            FILLER.repeat(before),
            FILLER.repeat(reps - before)
        );
        let msg = format!(
            "Some special magic numbers are hidden within the following text. Make sure to \
             memorize it. I will quiz you about the numbers afterwards.\n{hay}\nWhat is the \
             special magic number for {key} mentioned in the provided text?"
        );
        let prompt = if model.chat.is_some() {
            Prompt::Chat {
                messages: vec![Message::user(msg)],
            }
        } else {
            Prompt::Text {
                text: format!("{msg}\n\n"),
            }
        };
        let mut ids = model.encode_prompt(&prompt)?;
        let tok = model
            .tokenizer
            .as_ref()
            .ok_or_else(|| Error::Tokenizer("niah needs a tokenizer".into()))?;
        let prefix = tok
            .encode(
                format!("The special magic number for {key} mentioned in the provided text is")
                    .as_str(),
                false,
            )
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        ids.extend(prefix.get_ids().iter().map(|&x| x as i64));
        Ok(ids)
    };
    let one = build(1)?.len();
    let per = build(11)?.len().saturating_sub(one) as f64 / 10.0;
    let reps = (((context as f64 - one as f64) / per.max(1.0)).floor() as usize + 1).max(1);
    Ok(NiahCase {
        depth,
        seed,
        value,
        ids: build(reps)?,
        prompt_format: if model.chat.is_some() { "chat" } else { "text" },
    })
}

/// Whether the first run of digits in `text` is `value`.
pub fn niah_correct(text: &str, value: &str) -> bool {
    let digits: String = text
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits == value
}

/// One NIAH answer.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NiahRow {
    /// Policy name.
    pub policy: String,
    /// Quantizer name.
    pub quantizer: String,
    /// Nominal budget.
    pub b: Option<f64>,
    /// Real budget (`None` for the uncompressed reference).
    pub b_real: Option<f64>,
    /// Needle depth.
    pub depth: f64,
    /// Case seed.
    pub seed: u64,
    /// Prompt tokens.
    pub prompt_len: u32,
    /// Expected value.
    pub value: String,
    /// Greedy answer.
    pub answer: String,
    /// Exact match.
    pub correct: bool,
    /// `chat` or `text` ([`NiahCase::prompt_format`]).
    pub prompt_format: String,
    /// The variant whose answer this row reuses (same [`ShareKey`]), if any.
    pub shared_with: Option<String>,
}

/// Greedy answers of `case` under every variant (and the uncompressed cache, policy `full`),
/// after one prefill and scoring; variants with the same [`ShareKey`] are decoded once.
pub fn niah(
    model: &LoadedModel,
    case: &NiahCase,
    variants: &[Variant],
    importance: &ImportanceSpec,
    protect: Protect,
    policy: &ExecPolicy,
    max_new_tokens: usize,
) -> Result<Vec<NiahRow>> {
    let d = &model.decoder;
    let (ctx, last) = case.ids.split_at(case.ids.len() - 1);
    let pre = prefill_and_score(d, ctx, policy, importance)?;
    let answer = |tiered: &TieredKv| -> Result<String> {
        let (tokens, ..) = transport::decode_greedy(d, tiered, last[0], max_new_tokens, policy)?;
        let end = tokens
            .iter()
            .position(|t| model.stop_tokens.contains(t))
            .unwrap_or(tokens.len());
        model.decode(&tokens[..end])
    };
    let row = |v: Option<&Variant>, b_real: Option<f64>, text: String, shared_with| NiahRow {
        policy: v.map_or("full".into(), |v| v.policy.name().to_string()),
        quantizer: v.map_or("none".into(), |v| v.quantizer_name().to_string()),
        b: v.and_then(|v| v.b),
        b_real,
        depth: case.depth,
        seed: case.seed,
        prompt_len: case.ids.len() as u32,
        value: case.value.clone(),
        correct: niah_correct(&text, &case.value),
        answer: text,
        prompt_format: case.prompt_format.to_string(),
        shared_with,
    };
    let mut rows = Vec::with_capacity(variants.len() + 1);
    // The uncompressed reference: the dense cache itself, not a tier.
    let mut dense = KvCache::gather(
        &[(&pre.cache, pre.cache.snapshot(0))],
        max_new_tokens as i64,
    )?;
    let mut tokens = Vec::new();
    let mut next = last[0];
    for _ in 0..max_new_tokens {
        let logits = d.forward(
            &Tensor::f_from_slice(&[next])?.f_view([1, 1])?,
            &mut dense,
            policy,
            &LogitsAt::Last,
        )?;
        next = logits
            .f_view([-1])?
            .f_argmax(0, false)?
            .f_int64_value(&[])?;
        if model.stop_tokens.contains(&next) {
            break;
        }
        tokens.push(next);
    }
    rows.push(row(None, None, model.decode(&tokens)?, None));
    let mut measured: std::collections::HashMap<ShareKey, usize> = Default::default();
    for (i, v) in variants.iter().enumerate() {
        let t0 = Instant::now();
        let plan = plan_of(&pre, v, protect)?;
        let key = share_key(&plan, v.quantizer);
        if let Some(&j) = measured.get(&key) {
            let budget = Budget {
                b: v.b.unwrap_or(1.0),
                shape: pre.cache.shape(),
                quantizer: v.quantizer,
                protect,
            };
            let text = rows[j + 1].answer.clone();
            let label = variant_label(&variants[j]);
            rows.push(row(Some(v), Some(budget.real_b(&plan)), text, Some(label)));
            continue;
        }
        let c = compress_plan(&pre, v, plan, t0)?;
        let text = answer(&wire::decode(&c.frame)?)?;
        measured.insert(key, i);
        rows.push(row(Some(v), Some(c.real_b()), text, None));
    }
    Ok(rows)
}

/// NIAH rows as a table.
pub fn niah_table(rows: &[NiahRow], model: &str, importance: &ImportanceSpec) -> Table {
    let n = rows.len();
    Table::new()
        .with("model", Column::Str(vec![model.to_string(); n]))
        .with(
            "policy",
            Column::Str(rows.iter().map(|r| r.policy.clone()).collect()),
        )
        .with(
            "quantizer",
            Column::Str(rows.iter().map(|r| r.quantizer.clone()).collect()),
        )
        .with("b", Column::OptF64(rows.iter().map(|r| r.b).collect()))
        .with(
            "b_real",
            Column::OptF64(rows.iter().map(|r| r.b_real).collect()),
        )
        .with("depth", Column::F64(rows.iter().map(|r| r.depth).collect()))
        .with(
            "seed",
            Column::I64(rows.iter().map(|r| r.seed as i64).collect()),
        )
        .with(
            "prompt_len",
            Column::U32(rows.iter().map(|r| r.prompt_len).collect()),
        )
        .with(
            "value",
            Column::Str(rows.iter().map(|r| r.value.clone()).collect()),
        )
        .with(
            "answer",
            Column::Str(rows.iter().map(|r| r.answer.clone()).collect()),
        )
        .with(
            "correct",
            Column::Bool(rows.iter().map(|r| r.correct).collect()),
        )
        .with(
            "prompt_format",
            Column::Str(rows.iter().map(|r| r.prompt_format.clone()).collect()),
        )
        .with(
            "shared_with",
            Column::OptStr(rows.iter().map(|r| r.shared_with.clone()).collect()),
        )
        .with("importance", Column::Str(vec![importance.describe(); n]))
}

/// The probe's verdict for one quantizer.
#[derive(Debug, Clone, PartialEq)]
pub struct ProbeVerdict {
    /// Quantizer probed.
    pub quantizer: Quantizer,
    /// Trials passed (of three).
    pub passed: usize,
    /// INT4 allowed (≥ 2 of 3).
    pub int4: bool,
    /// Policy selected: `spectrum` (3-tier) or `spectrum-2tier`.
    pub selected: &'static str,
}

/// The deployment-time probe: three NIAH trials (depths 0.25, 0.5, 0.75) under the 3-tier
/// policy at budget `b`. Returns the verdict and the trial rows.
#[allow(clippy::too_many_arguments)]
pub fn probe(
    model: &LoadedModel,
    context: usize,
    b: f64,
    quantizer: Quantizer,
    importance: &ImportanceSpec,
    protect: Protect,
    policy: &ExecPolicy,
    max_new_tokens: usize,
) -> Result<(ProbeVerdict, Vec<NiahRow>)> {
    let v = Variant {
        policy: Policy::Spectrum { int4: true },
        quantizer,
        b: Some(b),
    };
    let mut rows = Vec::new();
    for depth in [0.25, 0.5, 0.75] {
        let case = niah_case(model, context, depth, 0)?;
        let r = niah(
            model,
            &case,
            &[v],
            importance,
            protect,
            policy,
            max_new_tokens,
        )?;
        rows.extend(r.into_iter().filter(|r| r.policy != "full"));
    }
    let passed = rows.iter().filter(|r| r.correct).count();
    let int4 = passed >= 2;
    Ok((
        ProbeVerdict {
            quantizer,
            passed,
            int4,
            selected: if int4 { "spectrum" } else { "spectrum-2tier" },
        },
        rows,
    ))
}

/// The continuous INT4 gate for one quantizer: perplexity ratio and mean KL under uniform
/// INT4 (protected tokens at FP16) against the uncompressed cache.
#[derive(Debug, Clone, PartialEq)]
pub struct Gate {
    /// Quantizer.
    pub quantizer: Quantizer,
    /// PPL(uniform INT4) / PPL(uncompressed).
    pub ppl_ratio: f64,
    /// Mean KL per token.
    pub kl: f64,
    /// `ppl_ratio ≤` the threshold.
    pub int4: bool,
}

/// The gate of each quantizer over perplexity windows of `o` (its variants are replaced).
pub fn gate(
    model: &Decoder,
    text_ids: &[i64],
    o: &PplOptions,
    quantizers: &[Quantizer],
    max_ratio: f64,
) -> Result<Vec<Gate>> {
    let o = PplOptions {
        variants: quantizers
            .iter()
            .map(|&quantizer| Variant {
                policy: Policy::Uniform(Tier::Int4),
                quantizer,
                b: None,
            })
            .collect(),
        ..o.clone()
    };
    let rows = perplexity(model, text_ids, &o)?;
    Ok(quantizers
        .iter()
        .map(|&q| {
            let mine: Vec<&PplRow> = rows.iter().filter(|r| r.quantizer == q.name()).collect();
            let (ppl, base, _, kl, _) = ppl_summary(&mine);
            Gate {
                quantizer: q,
                ppl_ratio: ppl / base,
                kl,
                int4: ppl / base <= max_ratio,
            }
        })
        .collect())
}
