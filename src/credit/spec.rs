//! Campaign specification: a TOML file fixed before anything runs (its hash goes into the
//! manifest).
use crate::decode::engine::Stop;
use crate::exec::PolicyKind;
use crate::runtime::Dtype;
use crate::sampling::Sampling;
use crate::spectrum::Quantizer;
use crate::spectrum::allocate::{Policy, Protect};
use crate::spectrum::eval::Variant;
use crate::spectrum::importance::ImportanceSpec;
use crate::tasks::gsm8k::{self, PromptFormat};
use crate::tasks::{Grade, Problem, SpecTask, Task, TaskSpec, grade};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

use std::fmt;
use std::path::Path;

/// A whole campaign.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CampaignSpec {
    /// Label of this configuration (also the default output folder name).
    pub name: String,
    /// Model: a registry name (`kvcredit models list`), a GGUF file or a Hugging Face folder.
    pub model: String,
    /// Weights/activations dtype.
    pub dtype: Dtype,
    /// `cpu`, `cuda` or `cuda:N`.
    #[serde(default = "default_device")]
    pub device: String,
    /// Execution policy.
    #[serde(default)]
    pub policy: PolicyKind,
    /// Seed of all sampling noise.
    pub seed: u64,
    /// Which GSM8K problems and how they are prompted (the older form of `[task]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problems: Option<ProblemSpec>,
    /// The task: bundled GSM8K or a file of problems, its prompt recipe and grader.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<TaskSpec>,
    /// How rollouts are generated.
    pub rollout: RolloutSpec,
    /// How pivots and alternatives are chosen.
    pub pivots: PivotSpec,
    /// Continuations per branch.
    pub continuations: ContinuationSpec,
    /// Passes and their batch schedules.
    pub passes: PassSpec,
}

fn default_device() -> String {
    "cpu".into()
}

/// Problem selection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProblemSpec {
    /// First GSM8K test index.
    #[serde(default)]
    pub start: usize,
    /// Number of problems.
    pub count: usize,
    /// `zero-shot-chat` or `eight-shot-cot`.
    pub format: String,
}

impl ProblemSpec {
    /// The GSM8K task these settings select, and its problems (all of them, or an error).
    pub fn task(&self) -> Result<(SpecTask, Vec<Problem>)> {
        let format: PromptFormat = self.format.parse()?;
        let task = crate::tasks::Gsm8k::bundled(self.start..self.start + self.count, format)?;
        let problems = task.problems().to_vec();
        if problems.len() < self.count {
            return Err(Error::Spec(format!(
                "only {} GSM8K problems from index {}",
                problems.len(),
                self.start
            )));
        }
        Ok((SpecTask::Gsm8k(task), problems))
    }

    /// Reject settings that select no GSM8K problems; `what` names the spec in errors.
    pub fn validate(&self, what: &str) -> Result<()> {
        let bad = |m: String| Err(Error::Spec(format!("{what}: {m}")));
        if self.count == 0 {
            return bad("problems.count must be positive".into());
        }
        self.format.parse::<PromptFormat>().map_err(|e| match e {
            Error::Spec(m) => Error::Spec(format!("{what}: problems.format: {m}")),
            other => other,
        })?;
        let end = self.start.saturating_add(self.count);
        if end > gsm8k::TEST_LEN {
            return bad(format!(
                "problems.start + problems.count = {end} exceeds the {} GSM8K test problems",
                gsm8k::TEST_LEN
            ));
        }
        Ok(())
    }
}

/// `[problems]` or `[task]` of a spec (exactly one): checked without reading a task file.
pub fn validate_task_choice(
    problems: Option<&ProblemSpec>,
    task: Option<&TaskSpec>,
    what: &str,
) -> Result<()> {
    match (problems, task) {
        (Some(p), None) => p.validate(what),
        (None, Some(t)) => t.validate(),
        (Some(_), Some(_)) => Err(Error::Spec(format!(
            "{what}: [problems] and [task] are both set; keep one ([task] is the newer form)"
        ))),
        (None, None) => Err(Error::Spec(format!(
            "{what}: no [task] (or [problems]) section says what to run on"
        ))),
    }
}

/// The task of `[problems]` or `[task]` and its problems, loaded and checked.
pub fn load_task_choice(
    problems: Option<&ProblemSpec>,
    task: Option<&TaskSpec>,
    what: &str,
) -> Result<(SpecTask, Vec<Problem>)> {
    validate_task_choice(problems, task, what)?;
    match (problems, task) {
        (Some(p), _) => p.task(),
        (None, Some(t)) => {
            let task = t.load()?;
            let problems = task.problems().to_vec();
            Ok((task, problems))
        }
        (None, None) => Err(Error::Spec(format!("{what}: no [task] section"))),
    }
}

/// Rollout generation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutSpec {
    /// Token cap of a rollout.
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 means greedy.
    #[serde(default)]
    pub temperature: f64,
}

/// How pivots are capped when more candidates qualify.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PivotRule {
    /// Lowest margins first (ties: earlier position).
    LowestMargin,
    /// Evenly spread over the candidates in position order.
    Spread,
}

/// Pivot selection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PivotSpec {
    /// A step is a candidate when `p(top1) − p(top2) ≤ max_margin`.
    pub max_margin: f64,
    /// At most this many pivots per rollout.
    pub max_per_rollout: usize,
    /// Which candidates to keep.
    #[serde(default = "default_rule")]
    pub rule: PivotRule,
    /// Alternatives per pivot: the next most probable tokens other than the chosen one.
    #[serde(default = "one")]
    pub alternatives: usize,
}

fn default_rule() -> PivotRule {
    PivotRule::LowestMargin
}

fn one() -> usize {
    1
}

/// Continuations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContinuationSpec {
    /// Continuations per branch and pass (K).
    pub k: usize,
    /// Token cap of one continuation (after the branch token).
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 means greedy.
    pub temperature: f64,
    /// How outputs stopped by the token cap are graded (continuations and rollouts alike).
    #[serde(default)]
    pub truncated: Truncated,
}

/// How an output that hit its token cap (`stop = "length"`) is graded. Such an output is
/// cut mid-reasoning, so the number a fallback rule finds in it is an intermediate value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Truncated {
    /// Always incorrect.
    Incorrect,
    /// Correct only when an explicit final-answer marker found the answer (`\boxed{}`,
    /// `#### N`, "the answer is N", a regex grader's pattern): the model had committed to it
    /// before the cap.
    #[default]
    Explicit,
    /// Graded like a finished output, down to the last number in the text.
    LastNumber,
}

impl Truncated {
    /// Whether an output with `grade` that stopped for `stop` counts as correct.
    pub fn correct(self, grade: &Grade, stop: Stop) -> bool {
        if stop != Stop::Length {
            return grade.correct;
        }
        match self {
            Truncated::Incorrect => false,
            Truncated::Explicit => {
                grade.correct
                    && grade
                        .rule
                        .as_deref()
                        .is_some_and(grade::is_final_answer_rule)
            }
            Truncated::LastNumber => grade.correct,
        }
    }
}

/// Passes and batching.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassSpec {
    /// Passes to run (exact is always run first; the others compare against it).
    pub run: Vec<Pass>,
    /// Replica batch schedule.
    #[serde(default = "default_schedule")]
    pub replica_schedule: ReplicaSchedule,
    /// Continuations decoded together in the exact and refeed passes.
    pub batch_size: usize,
    /// Most continuations decoded together in a shuffled replica pass (default
    /// `ceil(batch_size / 2)`).
    #[serde(default)]
    pub replica_batch_size: Option<usize>,
    /// Masked key positions the replica's steps attend over beyond exact's (default
    /// [`DEFAULT_REPLICA_KEY_PAD`] under `shuffled`, 0 under `same`): the replica decodes as if
    /// a longer request were co-resident in its batch, so its stock attention runs on another
    /// key axis than exact's at every step. Under `shuffled` it must not be a multiple of 8:
    /// the static engines' key axis is a multiple of 8, and padding it by whole multiples of 8
    /// keeps cuBLAS's aligned attention kernels, which leave a row's bits unchanged (see
    /// `docs/guide/replica-floor.md`), while an unaligned axis takes other kernels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_key_pad: Option<i64>,
    /// Settings of the spectrum pass (`[passes.spectrum]`); required with it, refused without.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spectrum: Option<SpectrumPass>,
    /// Problems whose rollouts are decoded together and whose passes' continuations are
    /// pooled into the same batches (consecutive problems of the spec; default 1: each problem
    /// alone).
    #[serde(default = "one_problem", skip_serializing_if = "is_one_problem")]
    pub pool_problems: usize,
    /// Continuous refill (default off): each pass of a group runs as one queue on a batch of
    /// fixed width whose rows are reloaded with the next continuation as soon as theirs
    /// finishes ([`crate::decode::engine::run_queue`]), instead of fixed batches. Any pool size.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub refill: bool,
}

fn one_problem() -> usize {
    1
}

fn is_one_problem(p: &usize) -> bool {
    *p == 1
}

/// The spectrum pass: each pivot's decode-time KV snapshot compressed with SpectrumKV tiers at
/// byte budget `b` (importance from a traced prefill of the same prefix, tier allocation,
/// quantize, pack into a wire frame, decode, dequantize into an ordinary cache), from which the
/// continuations resume. Importance and protect default as in spectrum specs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpectrumPass {
    /// Budget: frame bytes ÷ full-FP16 KV bytes of the snapshot, in (0, 1]; required by the
    /// budgeted policies, refused by the `uniform-*` ones (they ignore it).
    #[serde(default)]
    pub b: Option<f64>,
    /// Tier policy (`spectrum`, `spectrum-2tier`, `pdtrim`, `pdtrim-first`, `uniform-fp16`,
    /// `uniform-int8`, `uniform-int4`).
    #[serde(default = "default_spectrum_policy")]
    pub policy: String,
    /// Quantizer of the INT tiers.
    #[serde(default = "default_quantizer")]
    pub quantizer: Quantizer,
    /// Importance settings.
    #[serde(default)]
    pub importance: ImportanceSpec,
    /// Tokens pinned to FP16.
    #[serde(default)]
    pub protect: Protect,
}

fn default_spectrum_policy() -> String {
    "spectrum".into()
}

fn default_quantizer() -> Quantizer {
    Quantizer::Kivi
}

impl SpectrumPass {
    /// The tier policy, checked.
    pub fn tier_policy(&self) -> Result<Policy> {
        Policy::parse(&self.policy)
    }

    /// The compression setting ([`Variant`]); `b` is `None` for the uniform policies.
    pub fn variant(&self) -> Result<Variant> {
        let policy = self.tier_policy()?;
        Ok(Variant {
            policy,
            quantizer: self.quantizer,
            b: if policy.uses_budget() { self.b } else { None },
        })
    }

    /// `policy/quantizer/b` of the compression setting, as SpectrumKV's `shared_with` column
    /// writes it.
    pub fn label(&self) -> Result<String> {
        Ok(crate::spectrum::eval::variant_label(&self.variant()?))
    }

    /// Why these settings cannot run, if they cannot.
    fn problem(&self) -> Option<String> {
        let policy = match self.tier_policy() {
            Ok(p) => p,
            Err(e) => return Some(format!("passes.spectrum.policy: {e}")),
        };
        match (policy.uses_budget(), self.b) {
            (true, None) => {
                return Some(format!(
                    "passes.spectrum.b is required by policy \"{}\"",
                    self.policy
                ));
            }
            (false, Some(_)) => {
                return Some(format!(
                    "passes.spectrum.b is set but policy \"{}\" ignores the budget; remove it",
                    self.policy
                ));
            }
            (true, Some(b)) if !(b > 0.0 && b <= 1.0) => {
                return Some(format!("passes.spectrum.b = {b} lies outside (0, 1]"));
            }
            _ => {}
        }
        let i = &self.importance;
        if i.window < 1 || i.kernel < 1 || i.kernel % 2 == 0 {
            return Some(format!(
                "passes.spectrum.importance: window {} must be ≥ 1 and kernel {} odd",
                i.window, i.kernel
            ));
        }
        None
    }
}

/// The replica's default key padding under the `shuffled` schedule (positions): not a
/// multiple of 8, so the replica's attention key axis is never aligned like exact's.
pub const DEFAULT_REPLICA_KEY_PAD: i64 = 3;

impl PassSpec {
    /// `replica_batch_size`, or its default `ceil(batch_size / 2)`.
    pub fn effective_replica_batch_size(&self) -> usize {
        self.replica_batch_size
            .unwrap_or(self.batch_size.div_ceil(2))
    }

    /// `replica_key_pad`, or its default for the replica schedule.
    pub fn effective_replica_key_pad(&self) -> i64 {
        self.replica_key_pad.unwrap_or(match self.replica_schedule {
            ReplicaSchedule::Same => 0,
            ReplicaSchedule::Shuffled => DEFAULT_REPLICA_KEY_PAD,
        })
    }

    /// Whether any pass runs under the replica's schedule.
    pub fn has_replica_schedule(&self) -> bool {
        self.run
            .iter()
            .any(|p| p.schedule() == PassSchedule::Replica)
    }
}

fn default_schedule() -> ReplicaSchedule {
    ReplicaSchedule::Shuffled
}

impl CampaignSpec {
    /// Parse and validate a spec; returns it with the SHA-256 of the file's bytes.
    pub fn load(path: &Path) -> Result<(CampaignSpec, String)> {
        crate::study::spec::load_spec(path)
    }

    /// The task (`[task]`, or GSM8K from `[problems]`) and its problems, loaded and checked.
    pub fn task(&self) -> Result<(SpecTask, Vec<Problem>)> {
        load_task_choice(
            self.problems.as_ref(),
            self.task.as_ref(),
            &format!("campaign `{}`", self.name),
        )
    }

    /// Keys that have defaults but only make sense with another setting: a replica schedule or
    /// batch size written out for a campaign without a replica pass is a mistake in the spec.
    fn validate_explicit_keys(&self, text: &str) -> Result<()> {
        let raw: toml::Table = toml::from_str(text).map_err(|e| Error::Spec(e.to_string()))?;
        let passes = raw.get("passes").and_then(|v| v.as_table());
        let written = |key: &str| passes.is_some_and(|t| t.contains_key(key));
        if !self.passes.has_replica_schedule() {
            for key in ["replica_schedule", "replica_batch_size", "replica_key_pad"] {
                if written(key) {
                    return Err(Error::Spec(format!(
                        "campaign `{}`: passes.{key} is set but passes.run has no pass under the replica's schedule (\"replica\", \"refeed_replica\", \"spectrum_replica\")",
                        self.name
                    )));
                }
            }
        }
        Ok(())
    }

    /// The spectrum pass's settings, when it runs.
    pub fn spectrum_pass(&self) -> Option<&SpectrumPass> {
        self.passes
            .spectrum
            .as_ref()
            .filter(|_| self.runs_spectrum())
    }

    /// Whether a pass resumes from a SpectrumKV-compressed state.
    fn runs_spectrum(&self) -> bool {
        self.passes
            .run
            .iter()
            .any(|p| p.state() == PassState::Spectrum)
    }

    /// Reject specs that cannot run.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Spec(format!("campaign `{}`: {m}", self.name)));
        // The name is the default output folder's last component.
        if self.name.is_empty() || self.name.contains('/') || self.name == "." || self.name == ".."
        {
            return bad("name must be one path component (non-empty, no `/`, not `.` or `..`)");
        }
        validate_task_choice(
            self.problems.as_ref(),
            self.task.as_ref(),
            &format!("campaign `{}`", self.name),
        )?;
        if self.continuations.k == 0 || self.passes.batch_size == 0 {
            return bad("continuations.k and passes.batch_size must be positive");
        }
        if self.passes.pool_problems == 0 {
            return bad("passes.pool_problems must be positive");
        }
        if self.passes.replica_batch_size == Some(0) {
            return bad("passes.replica_batch_size must be positive");
        }
        if self.pivots.alternatives == 0 {
            return bad("pivots.alternatives must be at least 1");
        }
        if !(0.0..=1.0).contains(&self.pivots.max_margin) {
            return bad("pivots.max_margin must lie in [0, 1]");
        }
        for (key, t) in [
            ("rollout.temperature", self.rollout.temperature),
            ("continuations.temperature", self.continuations.temperature),
        ] {
            if !(t.is_finite() && t >= 0.0) {
                return bad(&format!("{key} = {t} must be a finite number ≥ 0"));
            }
        }
        self.check_bounds().map_err(|e| match e {
            Error::Spec(m) => Error::Spec(format!("campaign `{}`: {m}", self.name)),
            other => other,
        })?;
        if self.passes.run.first() != Some(&Pass::Exact) {
            return bad("passes.run must start with \"exact\"");
        }
        for (i, p) in self.passes.run.iter().enumerate() {
            if self.passes.run[..i].contains(p) {
                return bad(&format!(
                    "passes.run lists \"{}\" twice; each pass runs once",
                    p.as_str()
                ));
            }
        }
        match (self.runs_spectrum(), &self.passes.spectrum) {
            (true, None) => {
                return bad(
                    "passes.run has a spectrum pass but there is no [passes.spectrum] section",
                );
            }
            (false, Some(_)) => {
                return bad("[passes.spectrum] is set but passes.run has no spectrum pass");
            }
            (true, Some(sp)) => {
                if let Some(m) = sp.problem() {
                    return bad(&m);
                }
            }
            (false, None) => {}
        }
        if self.pivots.max_per_rollout == 0 {
            return bad("pivots.max_per_rollout (P) must be at least 1");
        }
        if self.rollout.max_new_tokens == 0 || self.continuations.max_new_tokens == 0 {
            return bad("rollout.max_new_tokens and continuations.max_new_tokens must be positive");
        }
        let pad = self.passes.effective_replica_key_pad();
        let align = crate::decode::stepper::CAPACITY_ALIGN;
        match self.passes.replica_schedule {
            _ if !(0..=1 << 16).contains(&pad) => {
                return bad(&format!(
                    "passes.replica_key_pad = {pad} must lie in 0..=65536"
                ));
            }
            ReplicaSchedule::Same if pad != 0 => {
                return bad(
                    "passes.replica_key_pad must be 0 with replica_schedule = \"same\" (the replica then repeats exact's numerical path)",
                );
            }
            ReplicaSchedule::Shuffled if pad % align == 0 && self.passes.has_replica_schedule() => {
                return bad(&format!(
                    "passes.replica_key_pad = {pad} keeps the replica's key axis aligned like exact's, where stock attention kernels leave a row's bits unchanged and the floor can be structurally zero; use a value that is not a multiple of {align} (default {DEFAULT_REPLICA_KEY_PAD}), or replica_schedule = \"same\" for a bitwise control"
                ));
            }
            ReplicaSchedule::Same
                if self
                    .passes
                    .run
                    .iter()
                    .any(|p| p.schedule() == PassSchedule::Replica && *p != Pass::Replica) =>
            {
                return bad(
                    "refeed_replica and spectrum_replica need replica_schedule = \"shuffled\" (under \"same\" they repeat refeed and spectrum)",
                );
            }
            _ => {}
        }
        if self.passes.replica_schedule == ReplicaSchedule::Shuffled
            && self.passes.has_replica_schedule()
            && self.passes.batch_size == 1
            && self.passes.effective_replica_batch_size() == 1
        {
            return bad(
                "passes.batch_size = 1 and passes.replica_batch_size = 1 run every continuation alone, so a shuffled replica would repeat exact's batches; set passes.replica_batch_size to 2 or more",
            );
        }
        Ok(())
    }

    /// Every count and length within [`crate::study::bounds`], before anything is allocated.
    fn check_bounds(&self) -> Result<()> {
        use crate::study::bounds::{self, at_most};
        let (p, c) = (&self.pivots, &self.continuations);
        at_most("continuations.k", c.k, bounds::MAX_K)?;
        at_most(
            "pivots.alternatives",
            p.alternatives,
            bounds::MAX_ALTERNATIVES,
        )?;
        at_most(
            "pivots.max_per_rollout",
            p.max_per_rollout,
            bounds::MAX_PIVOTS,
        )?;
        at_most(
            "passes.batch_size",
            self.passes.batch_size,
            bounds::MAX_BATCH,
        )?;
        at_most(
            "passes.replica_batch_size",
            self.passes.effective_replica_batch_size(),
            bounds::MAX_BATCH,
        )?;
        bounds::product_at_most(
            "continuations per group (passes.pool_problems × pivots.max_per_rollout × (1 + pivots.alternatives) × continuations.k)",
            &[
                self.passes.pool_problems,
                p.max_per_rollout,
                p.alternatives.saturating_add(1),
                c.k,
            ],
            bounds::MAX_GROUP_CONTINUATIONS,
        )?;
        bounds::tokens_at_most(
            "rollout.max_new_tokens + continuations.max_new_tokens",
            &[self.rollout.max_new_tokens, c.max_new_tokens],
        )?;
        Ok(())
    }

    /// Rollout sampling rule.
    pub fn rollout_sampling(&self) -> Sampling {
        Sampling::from_temperature(self.rollout.temperature)
    }

    /// Continuation sampling rule.
    pub fn continuation_sampling(&self) -> Sampling {
        Sampling::from_temperature(self.continuations.temperature)
    }
}

/// A pass: how the pivot state is obtained ([`PassState`]) and under which batch schedule its
/// continuations run ([`PassSchedule`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pass {
    /// Resume from the rollout's own (verified) decode-time KV, under exact's schedule.
    Exact,
    /// The exact pass's state under the replica's schedule: the noise floor.
    Replica,
    /// Re-prefill prompt and generated ids up to the pivot as a fresh prompt, under exact's
    /// schedule: the re-fed state's own effect.
    Refeed,
    /// Resume from the decode-time KV after SpectrumKV compression at a byte budget
    /// (`[passes.spectrum]`): tiered, quantized, packed, then dequantized into a cache; under
    /// exact's schedule.
    Spectrum,
    /// The re-fed state under the replica's schedule (what a replica-vs-refeed design measures).
    RefeedReplica,
    /// The spectrum state under the replica's schedule.
    SpectrumReplica,
}

/// Where a pass's pivot state comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassState {
    /// The rollout's decode-time snapshot, verified.
    Decode,
    /// A fresh prefill of the prefix's token ids.
    Refeed,
    /// The decode-time snapshot compressed with SpectrumKV.
    Spectrum,
}

/// Which batch schedule a pass's continuations run under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassSchedule {
    /// Exact's batches, natural key axis.
    Exact,
    /// The replica's batches and noise sources (`[passes]` `replica_*`).
    Replica,
}

impl Pass {
    /// All passes, in column order.
    pub const ALL: [Pass; 6] = [
        Pass::Exact,
        Pass::Replica,
        Pass::Refeed,
        Pass::Spectrum,
        Pass::RefeedReplica,
        Pass::SpectrumReplica,
    ];

    /// The passes compared with exact against the replica floor (the analysis's treatments).
    pub const TREATMENTS: [Pass; 4] = [
        Pass::Refeed,
        Pass::Spectrum,
        Pass::RefeedReplica,
        Pass::SpectrumReplica,
    ];

    /// The pass's name in records.
    pub fn as_str(self) -> &'static str {
        match self {
            Pass::Exact => "exact",
            Pass::Replica => "replica",
            Pass::Refeed => "refeed",
            Pass::Spectrum => "spectrum",
            Pass::RefeedReplica => "refeed_replica",
            Pass::SpectrumReplica => "spectrum_replica",
        }
    }

    /// Where the pass's pivot state comes from.
    pub fn state(self) -> PassState {
        match self {
            Pass::Exact | Pass::Replica => PassState::Decode,
            Pass::Refeed | Pass::RefeedReplica => PassState::Refeed,
            Pass::Spectrum | Pass::SpectrumReplica => PassState::Spectrum,
        }
    }

    /// The schedule its continuations run under.
    pub fn schedule(self) -> PassSchedule {
        match self {
            Pass::Exact | Pass::Refeed | Pass::Spectrum => PassSchedule::Exact,
            Pass::Replica | Pass::RefeedReplica | Pass::SpectrumReplica => PassSchedule::Replica,
        }
    }

    /// Whether the pass resumes the rollout's own decode-time KV, verified against its
    /// fingerprint (exact and replica); refeed and spectrum start from a state built anew.
    pub fn resumes_snapshot(self) -> bool {
        self.state() == PassState::Decode
    }

    /// The pass a name denotes (`exact`, `replica`, `refeed`, `spectrum`, `refeed_replica`,
    /// `spectrum_replica`).
    pub fn parse(s: &str) -> Option<Pass> {
        Pass::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

impl fmt::Display for Pass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the replica pass is scheduled relative to exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaSchedule {
    /// Exactly the exact pass's batches (must then be bitwise identical to it).
    Same,
    /// Jobs in reverse order, at most `replica_batch_size` at a time, grouped so that the
    /// batches' memberships differ from exact's (see `decode::schedule`), as a serving engine
    /// might.
    Shuffled,
}

impl ReplicaSchedule {
    /// The schedule's name in records.
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaSchedule::Same => "same",
            ReplicaSchedule::Shuffled => "shuffled",
        }
    }
}

impl fmt::Display for ReplicaSchedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl crate::study::spec::StudySpec for CampaignSpec {
    fn resolve_paths(&mut self, dir: &Path) {
        if let Some(t) = &mut self.task {
            t.resolve_paths(dir);
        }
    }

    fn validate_loaded(&self, text: &str) -> Result<()> {
        self.validate()?;
        self.validate_explicit_keys(text)?;
        self.task().map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grade(rule: Option<&str>, correct: bool) -> Grade {
        Grade {
            predicted: rule.map(|_| "18".to_string()),
            rule: rule.map(str::to_string),
            correct,
        }
    }

    #[test]
    fn truncated_outputs_are_graded_per_the_setting() {
        let boxed = grade(Some("boxed"), true);
        let last = grade(Some("last_number"), true);
        let printed = grade(Some("printed_output"), true);
        let wrong = grade(Some("answer_is"), false);
        let none = grade(None, false);
        for stop in [Stop::Eos, Stop::Text] {
            for t in [
                Truncated::Incorrect,
                Truncated::Explicit,
                Truncated::LastNumber,
            ] {
                assert!(t.correct(&boxed, stop) && t.correct(&last, stop));
                assert!(!t.correct(&wrong, stop) && !t.correct(&none, stop));
            }
        }
        let at_cap = |t: Truncated| {
            [&boxed, &last, &printed, &wrong, &none].map(|g| t.correct(g, Stop::Length))
        };
        assert_eq!(at_cap(Truncated::Incorrect), [false; 5]);
        assert_eq!(
            at_cap(Truncated::Explicit),
            [true, false, false, false, false]
        );
        assert_eq!(
            at_cap(Truncated::LastNumber),
            [true, true, true, false, false]
        );
    }

    #[test]
    fn truncated_defaults_to_explicit_and_rejects_unknown_values() {
        let parse = |extra: &str| {
            toml::from_str::<ContinuationSpec>(&format!(
                "k = 2\nmax_new_tokens = 8\ntemperature = 1.0\n{extra}"
            ))
        };
        assert_eq!(parse("").unwrap().truncated, Truncated::Explicit);
        assert_eq!(
            parse("truncated = \"last_number\"").unwrap().truncated,
            Truncated::LastNumber
        );
        assert_eq!(
            parse("truncated = \"incorrect\"").unwrap().truncated,
            Truncated::Incorrect
        );
        let e = parse("truncated = \"boxed\"").unwrap_err().to_string();
        assert!(e.contains("incorrect") && e.contains("last_number"), "{e}");
    }

    #[test]
    fn refill_defaults_to_off_and_is_serialized_only_when_on() {
        let parse = |extra: &str| {
            toml::from_str::<PassSpec>(&format!("run = [\"exact\"]\nbatch_size = 4\n{extra}"))
                .unwrap()
        };
        let off = parse("");
        assert!(!off.refill);
        assert!(!serde_json::to_string(&off).unwrap().contains("refill"));
        let on = parse("refill = true\npool_problems = 3");
        assert!(on.refill && on.pool_problems == 3);
        assert!(
            serde_json::to_string(&on)
                .unwrap()
                .contains(r#""refill":true"#)
        );
    }
}
