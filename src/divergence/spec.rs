//! Divergence study specification: a TOML file fixed before anything runs (its SHA-256 goes
//! into the manifest). One spec drives every step of the study on one model.
use crate::credit::spec::{ProblemSpec, load_task_choice, validate_task_choice};
use crate::exec::PolicyKind;
use crate::runtime::Dtype;
use crate::sampling::Sampling;
use crate::tasks::{Problem, SpecTask, TaskSpec};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::path::Path;

/// A whole study.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DivergenceSpec {
    /// Label (also the default output folder name).
    pub name: String,
    /// Model: a registry name, a GGUF file or a Hugging Face folder.
    pub model: String,
    /// Dtypes to run, each a full pass over the steps (fp32 is the falsification arm).
    pub dtypes: Vec<Dtype>,
    /// `cpu`, `cuda` or `cuda:N`.
    #[serde(default = "default_device")]
    pub device: String,
    /// Execution policy (`batch_invariant` is the control: no divergence may remain).
    #[serde(default)]
    pub policy: PolicyKind,
    /// Seed of all sampling noise.
    pub seed: u64,
    /// Problems decoded together (rows of one batch) in every step.
    pub batch_size: usize,
    /// Which GSM8K problems and how they are prompted (the older form of `[task]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problems: Option<ProblemSpec>,
    /// The task: bundled GSM8K or a file of problems, its prompt recipe and grader.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<TaskSpec>,
    /// Token cap of every generation.
    pub max_new_tokens: usize,
    /// Sampling strategies of the free-running pairs (`greedy`, `temperature`, `top_p`).
    pub strategies: Vec<Sampling>,
    /// Which steps run after the free-running pairs.
    #[serde(default)]
    pub steps: Steps,
}

fn default_device() -> String {
    "cpu".into()
}

/// Optional steps of the protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Steps {
    /// Teacher-forced comparison on cache-ON's greedy sequence, with layer-wise drift of the
    /// residual stream and of the cached K/V.
    #[serde(default = "yes")]
    pub teacher_forced: bool,
    /// Residual patching at the first divergence step of the greedy pairs.
    #[serde(default)]
    pub patch: Option<PatchSpec>,
    /// Live vs replay, the prefill-chunk sweep and KV transplants on cache-ON's greedy
    /// sequences.
    #[serde(default)]
    pub replay: Option<ReplaySpec>,
    /// Run the non-greedy strategies only on problems whose position in the study is below
    /// this; all when absent.
    #[serde(default)]
    pub sampled_max_problems: Option<usize>,
    /// Token cap of the non-greedy strategies (≤ `max_new_tokens`); `max_new_tokens` when
    /// absent.
    #[serde(default)]
    pub sampled_max_new_tokens: Option<usize>,
    /// Teacher-force only problems whose position is below this; all when absent.
    #[serde(default)]
    pub forced_max_problems: Option<usize>,
    /// Token cap of the teacher-forced comparison (≤ `max_new_tokens`).
    #[serde(default)]
    pub forced_max_new_tokens: Option<usize>,
}

/// Live vs replay at stage boundaries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplaySpec {
    /// Boundaries *b* (generated tokens before the state, ≥ 1); longer than a sequence: skipped.
    pub boundaries: Vec<usize>,
    /// Prefill chunk sizes of REPLAY (0 = the whole sequence in one shot, always included).
    pub chunks: Vec<usize>,
    /// Greedy tokens generated from each state.
    pub continuation_tokens: usize,
    /// Replay only problems whose position in the study is below this (batch-1 work); all
    /// when absent.
    #[serde(default)]
    pub max_problems: Option<usize>,
}

impl Default for Steps {
    fn default() -> Steps {
        Steps {
            teacher_forced: true,
            patch: None,
            replay: None,
            sampled_max_problems: None,
            sampled_max_new_tokens: None,
            forced_max_problems: None,
            forced_max_new_tokens: None,
        }
    }
}

fn yes() -> bool {
    true
}

/// Residual-stream patching.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PatchSpec {
    /// Layer sets patched: `each` (every single layer), `all`, or a range `a..b`.
    pub layers: Vec<String>,
    /// Tokens followed after the patched step (trajectory recovery).
    pub trajectory_tokens: usize,
    /// Patch only problems whose position in the study is below this (batch-1 work); all
    /// when absent.
    #[serde(default)]
    pub max_problems: Option<usize>,
}

/// One patched layer set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerSet {
    /// Label in records (`3`, `0..4`, `all`).
    pub label: String,
    /// Layers patched.
    pub layers: Range<usize>,
}

/// One entry of [`PatchSpec::layers`], parsed.
enum Entry {
    Each,
    All,
    Range(Range<usize>),
}

fn parse_entry(s: &str) -> Result<Entry> {
    match s {
        "each" => Ok(Entry::Each),
        "all" => Ok(Entry::All),
        _ => s
            .split_once("..")
            .and_then(|(a, b)| Some(a.trim().parse().ok()?..b.trim().parse().ok()?))
            .filter(|r: &Range<usize>| r.start < r.end)
            .map(Entry::Range)
            .ok_or_else(|| {
                Error::Spec(format!(
                    "steps.patch.layers: `{s}` is not `each`, `all` or a non-empty range `a..b`"
                ))
            }),
    }
}

impl PatchSpec {
    /// Check the entries' syntax (bounds need the model: [`Self::layer_sets`]).
    pub fn check_syntax(&self) -> Result<()> {
        self.layers
            .iter()
            .try_for_each(|e| parse_entry(e).map(|_| ()))
    }

    /// The layer sets for a model of `n` layers, in spec order; an out-of-range or malformed
    /// entry is an error.
    pub fn layer_sets(&self, n: usize) -> Result<Vec<LayerSet>> {
        let mut out = Vec::new();
        for entry in &self.layers {
            match parse_entry(entry)? {
                Entry::Each => out.extend((0..n).map(|l| LayerSet {
                    label: l.to_string(),
                    layers: l..l + 1,
                })),
                Entry::All => out.push(LayerSet {
                    label: "all".into(),
                    layers: 0..n,
                }),
                Entry::Range(r) if r.end <= n => out.push(LayerSet {
                    label: entry.clone(),
                    layers: r,
                }),
                Entry::Range(r) => {
                    return Err(Error::Spec(format!(
                        "steps.patch.layers: range {}..{} out of bounds for a model of {n} layers",
                        r.start, r.end
                    )));
                }
            }
        }
        Ok(out)
    }
}

/// The label of a strategy in records: `greedy`, `temperature=0.7`, `top_p=0.9,t=0.7`.
pub fn strategy_label(s: &Sampling) -> String {
    match *s {
        Sampling::Greedy => "greedy".into(),
        Sampling::Temperature { temperature } => format!("temperature={temperature}"),
        Sampling::TopP { top_p, temperature } => format!("top_p={top_p},t={temperature}"),
    }
}

impl DivergenceSpec {
    /// Parse and validate a spec; returns it with the SHA-256 of the file's bytes.
    pub fn load(path: &Path) -> Result<(DivergenceSpec, String)> {
        crate::study::spec::load_spec(path)
    }

    /// The task (`[task]`, or GSM8K from `[problems]`) and its problems, loaded and checked.
    pub fn task(&self) -> Result<(SpecTask, Vec<Problem>)> {
        load_task_choice(
            self.problems.as_ref(),
            self.task.as_ref(),
            &format!("divergence `{}`", self.name),
        )
    }

    /// The data-set index of the study's first problem (problem `i` of the study is at
    /// `first_index() + i`).
    pub fn first_index(&self) -> usize {
        match (&self.problems, &self.task) {
            (Some(p), _) => p.start,
            (None, Some(t)) => t.start,
            (None, None) => 0,
        }
    }

    /// Reject specs that cannot run (what needs the model, such as layer ranges, is checked
    /// by [`PatchSpec::layer_sets`] once it is loaded, before anything is written).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Spec(format!("divergence `{}`: {m}", self.name)));
        // The name is the default output folder's last component.
        if self.name.is_empty() || self.name.contains('/') || self.name == "." || self.name == ".."
        {
            return bad("name must be one path component (non-empty, no `/`, not `.` or `..`)");
        }
        if self.dtypes.is_empty() || self.strategies.is_empty() {
            return bad("dtypes and strategies must not be empty");
        }
        for (i, d) in self.dtypes.iter().enumerate() {
            if self.dtypes[..i].contains(d) {
                return bad(&format!("dtypes lists {d} twice"));
            }
        }
        self.check_bounds().map_err(|e| match e {
            Error::Spec(m) => Error::Spec(format!("divergence `{}`: {m}", self.name)),
            other => other,
        })?;
        validate_task_choice(
            self.problems.as_ref(),
            self.task.as_ref(),
            &format!("divergence `{}`", self.name),
        )?;
        if self.batch_size == 0 || self.max_new_tokens == 0 {
            return bad("batch_size and max_new_tokens must be positive");
        }
        for (i, s) in self.strategies.iter().enumerate() {
            for (j, t) in self.strategies.iter().enumerate().take(i) {
                if s == t {
                    return bad(&format!("strategies {j} and {i} are the same"));
                }
            }
            let positive = |t: f64| t.is_finite() && t > 0.0;
            match *s {
                Sampling::Greedy => {}
                Sampling::Temperature { temperature } if positive(temperature) => {}
                Sampling::TopP { top_p, temperature }
                    if positive(temperature) && top_p > 0.0 && top_p <= 1.0 => {}
                _ => return bad("temperatures must be finite and positive, and top_p in (0, 1]"),
            }
        }
        let st = &self.steps;
        let limits = [
            (
                "steps.sampled_max_problems",
                st.sampled_max_problems,
                usize::MAX,
            ),
            (
                "steps.forced_max_problems",
                st.forced_max_problems,
                usize::MAX,
            ),
            (
                "steps.sampled_max_new_tokens",
                st.sampled_max_new_tokens,
                self.max_new_tokens,
            ),
            (
                "steps.forced_max_new_tokens",
                st.forced_max_new_tokens,
                self.max_new_tokens,
            ),
            (
                "steps.patch.max_problems",
                st.patch.as_ref().and_then(|p| p.max_problems),
                usize::MAX,
            ),
            (
                "steps.replay.max_problems",
                st.replay.as_ref().and_then(|r| r.max_problems),
                usize::MAX,
            ),
        ];
        for (key, value, most) in limits {
            if let Some(v) = value
                && (v == 0 || v > most)
            {
                return bad(&format!("{key} must be in 1..={most} (got {v})"));
            }
        }
        if let Some(p) = &self.steps.patch {
            if p.layers.is_empty() || p.trajectory_tokens == 0 {
                return bad("steps.patch needs layer sets and trajectory_tokens > 0");
            }
            // Syntax now; bounds once the model's layer count is known.
            p.check_syntax()?;
            if !self.strategies.contains(&Sampling::Greedy) {
                return bad("steps.patch patches the greedy pairs: add the greedy strategy");
            }
        }
        if let Some(r) = &self.steps.replay {
            if r.boundaries.is_empty() || r.boundaries.contains(&0) || r.continuation_tokens == 0 {
                return bad("steps.replay needs boundaries ≥ 1 and continuation_tokens > 0");
            }
            if let Some(b) = r.boundaries.iter().find(|&&b| b > self.max_new_tokens) {
                return bad(&format!(
                    "steps.replay.boundaries: {b} lies past the {} generated tokens (max_new_tokens)",
                    self.max_new_tokens
                ));
            }
            for (key, list) in [("boundaries", &r.boundaries), ("chunks", &r.chunks)] {
                for (i, x) in list.iter().enumerate() {
                    if list[..i].contains(x) {
                        return bad(&format!("steps.replay.{key} lists {x} twice"));
                    }
                }
            }
            if !self.strategies.contains(&Sampling::Greedy) {
                return bad("steps.replay replays the greedy pairs: add the greedy strategy");
            }
        }
        Ok(())
    }

    /// Tokens beyond the prompt that a problem's sequences may reach: the generated tokens
    /// plus the longest replay continuation or patched trajectory after them.
    pub fn tokens_after_prompt(&self) -> usize {
        let replay = self
            .steps
            .replay
            .as_ref()
            .map_or(0, |r| r.continuation_tokens);
        let patch = self.steps.patch.as_ref().map_or(0, |p| p.trajectory_tokens);
        self.max_new_tokens.saturating_add(replay.max(patch))
    }

    /// Every count and length within [`crate::study::bounds`], before anything is allocated.
    fn check_bounds(&self) -> Result<()> {
        use crate::study::bounds::{self, at_most};
        at_most("batch_size", self.batch_size, bounds::MAX_BATCH)?;
        let mut terms = vec![self.max_new_tokens];
        if let Some(r) = &self.steps.replay {
            terms.push(r.continuation_tokens);
            if let Some(c) = r.chunks.iter().max() {
                at_most("steps.replay.chunks", *c, bounds::MAX_TOKENS)?;
            }
        }
        if let Some(p) = &self.steps.patch {
            terms.push(p.trajectory_tokens);
        }
        bounds::tokens_at_most(
            "max_new_tokens + steps.replay.continuation_tokens + steps.patch.trajectory_tokens",
            &terms,
        )?;
        Ok(())
    }

    /// Refuse keys a `[[strategies]]` entry does not use (serde reads the entries by their
    /// `kind` and would drop the rest).
    fn check_strategy_keys(&self, text: &str) -> Result<()> {
        let raw: toml::Table = toml::from_str(text).map_err(|e| Error::Spec(e.to_string()))?;
        let Some(list) = raw.get("strategies").and_then(|v| v.as_array()) else {
            return Ok(());
        };
        for (i, (entry, s)) in list.iter().zip(&self.strategies).enumerate() {
            let allowed: &[&str] = match s {
                Sampling::Greedy => &["kind"],
                Sampling::Temperature { .. } => &["kind", "temperature"],
                Sampling::TopP { .. } => &["kind", "top_p", "temperature"],
            };
            if let Some(t) = entry.as_table()
                && let Some(k) = t.keys().find(|k| !allowed.contains(&k.as_str()))
            {
                return Err(Error::Spec(format!(
                    "divergence `{}`: strategies[{i}] ({}): unknown key `{k}` (expected {})",
                    self.name,
                    strategy_label(s),
                    allowed.join(", ")
                )));
            }
        }
        Ok(())
    }
}

impl crate::study::spec::StudySpec for DivergenceSpec {
    fn resolve_paths(&mut self, dir: &Path) {
        if let Some(t) = &mut self.task {
            t.resolve_paths(dir);
        }
    }

    fn validate_loaded(&self, text: &str) -> Result<()> {
        self.validate()?;
        self.check_strategy_keys(text)?;
        self.task().map(drop)
    }
}
