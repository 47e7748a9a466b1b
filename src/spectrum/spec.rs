//! The TOML specification of a SpectrumKV evaluation (see `experiments/spectrum-*.toml`),
//! validated completely before anything runs.
use super::Quantizer;
use super::allocate::{Policy, Protect};
use super::eval::{TextNorm, Variant};
use super::importance::ImportanceSpec;
use crate::exec::PolicyKind;
use crate::model::Decoder;
use crate::runtime::Dtype;
use crate::study::bounds;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// A whole evaluation: the model, the scoring settings and the sections to run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpectrumSpec {
    /// Label (default output folder `runs/<name>`).
    pub name: String,
    /// Model: a registry name, GGUF file or Hugging Face folder.
    pub model: String,
    /// Weights/activations dtype.
    pub dtype: Dtype,
    /// `cpu`, `cuda` or `cuda:N`.
    #[serde(default = "default_device")]
    pub device: String,
    /// Execution policy of the decoder.
    #[serde(default)]
    pub policy: PolicyKind,
    /// Importance settings.
    #[serde(default)]
    pub importance: ImportanceSpec,
    /// Tokens pinned to FP16.
    #[serde(default)]
    pub protect: Protect,
    /// WikiText-2 perplexity.
    pub ppl: Option<PplSpec>,
    /// Single-needle NIAH grid.
    pub niah: Option<NiahSpec>,
    /// The INT4 probe and the continuous gate.
    pub probe: Option<ProbeSpec>,
    /// Time to first token of a real transfer (`spectrum send`).
    pub ttft: Option<TtftSpec>,
}

fn default_device() -> String {
    "cpu".into()
}

/// Perplexity section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PplSpec {
    /// Context tokens `n`.
    pub context: usize,
    /// Continuation tokens `m`.
    pub continuation: usize,
    /// Non-overlapping text windows.
    pub windows: usize,
    /// Budgets `b`.
    pub budgets: Vec<f64>,
    /// Policy names ([`Policy::parse`]).
    pub policies: Vec<String>,
    /// Quantizers of the INT tiers.
    pub quantizers: Vec<Quantizer>,
    /// Text normalization before tokenization: `lf` (CRLF → LF, the default) or `raw`.
    #[serde(default)]
    pub text: TextNorm,
}

/// NIAH section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NiahSpec {
    /// Prompt tokens (about).
    pub context: usize,
    /// Depths, evenly spaced over `[0, 1]`.
    pub depths: usize,
    /// Seeds per depth.
    pub seeds: usize,
    /// Budgets `b`.
    pub budgets: Vec<f64>,
    /// Policy names.
    pub policies: Vec<String>,
    /// Quantizers.
    pub quantizers: Vec<Quantizer>,
    /// Answer token cap.
    #[serde(default = "default_answer")]
    pub max_new_tokens: usize,
}

fn default_answer() -> usize {
    12
}

/// Probe section: three NIAH trials at `b` per quantizer, and the continuous gate (PPL ratio
/// under uniform INT4 on `gate_windows` WikiText windows).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeSpec {
    /// Prompt tokens of the trials (about).
    pub context: usize,
    /// Budget of the 3-tier trials.
    #[serde(default = "default_probe_b")]
    pub b: f64,
    /// Quantizers probed.
    pub quantizers: Vec<Quantizer>,
    /// Answer token cap.
    #[serde(default = "default_answer")]
    pub max_new_tokens: usize,
    /// Gate: context tokens of the perplexity windows.
    #[serde(default = "default_gate_context")]
    pub gate_context: usize,
    /// Gate: continuation tokens.
    #[serde(default = "default_gate_continuation")]
    pub gate_continuation: usize,
    /// Gate: windows.
    #[serde(default = "default_gate_windows")]
    pub gate_windows: usize,
    /// Gate: text normalization of the windows (`lf`, the default, or `raw`).
    #[serde(default)]
    pub gate_text: TextNorm,
    /// Gate: INT4 allowed iff PPL(uniform INT4) / PPL(uncompressed) ≤ this.
    #[serde(default = "default_gate_ratio")]
    pub gate_max_ppl_ratio: f64,
}

/// TTFT section (`spectrum send`): a tiered transfer of the first `context` WikiText-2 tokens
/// beside an FP16 one, `repeats` times over each link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TtftSpec {
    /// Context tokens (the last one is fed on the decode side).
    pub context: usize,
    /// Tier policy of the tiered transfer ([`Policy::parse`]).
    #[serde(default = "default_ttft_policy")]
    pub policy: String,
    /// Its budget `b`.
    #[serde(default = "default_ttft_b")]
    pub b: f64,
    /// Quantizer of its INT tiers.
    #[serde(default = "default_ttft_quantizer")]
    pub quantizer: Quantizer,
    /// Text normalization before tokenization (`lf`, the default, or `raw`).
    #[serde(default)]
    pub text: TextNorm,
    /// Link limits in megabits per second (paced writes); `0` is an unlimited link.
    #[serde(default = "default_links")]
    pub links_mbps: Vec<f64>,
    /// Measurements of each transfer per link (the first also warms the workers up).
    #[serde(default = "default_repeats")]
    pub repeats: usize,
}

impl TtftSpec {
    /// The links as paced rates (`None`: unlimited).
    pub fn links(&self) -> Vec<Option<f64>> {
        self.links_mbps
            .iter()
            .map(|&m| (m > 0.0).then_some(m))
            .collect()
    }
}

fn default_ttft_policy() -> String {
    "spectrum".into()
}
fn default_ttft_b() -> f64 {
    0.5
}
fn default_ttft_quantizer() -> Quantizer {
    Quantizer::Kivi
}
fn default_links() -> Vec<f64> {
    vec![0.0]
}
fn default_repeats() -> usize {
    3
}

fn default_probe_b() -> f64 {
    0.3
}
fn default_gate_context() -> usize {
    512
}
fn default_gate_continuation() -> usize {
    128
}
fn default_gate_windows() -> usize {
    2
}
fn default_gate_ratio() -> f64 {
    1.05
}

fn bad(m: String) -> Error {
    Error::Spec(format!("spectrum spec: {m}"))
}

fn check_budgets(what: &str, b: &[f64]) -> Result<()> {
    if b.is_empty() {
        return Err(bad(format!("{what}: no budgets")));
    }
    if let Some(x) = b.iter().find(|x| !(**x > 0.0 && **x <= 2.0)) {
        return Err(bad(format!("{what}: budget {x} outside (0, 2]")));
    }
    no_repeats(what, "budgets", b)
}

/// Refuse a list that names an entry twice (it would run, and write, its rows twice).
fn no_repeats<T: PartialEq + std::fmt::Debug>(what: &str, key: &str, items: &[T]) -> Result<()> {
    for (i, x) in items.iter().enumerate() {
        if items[..i].contains(x) {
            return Err(bad(format!("{what}: {key} lists {x:?} twice")));
        }
    }
    Ok(())
}

/// `what`'s token count (`terms` summed) within [`bounds::MAX_TOKENS`].
fn tokens(what: &str, terms: &[usize]) -> Result<usize> {
    bounds::tokens_at_most(what, terms).map_err(|e| bad(e.to_string().replace("spec: ", "")))
}

fn policies(what: &str, names: &[String]) -> Result<Vec<Policy>> {
    if names.is_empty() {
        return Err(bad(format!("{what}: no policies")));
    }
    names
        .iter()
        .map(|n| Policy::parse(n).map_err(|e| bad(format!("{what}: {e}"))))
        .collect()
}

impl SpectrumSpec {
    /// Read and validate a spec file; returns it with the SHA-256 of the file's bytes.
    pub fn load(path: &Path) -> Result<(SpectrumSpec, String)> {
        crate::study::spec::load_spec(path)
    }

    /// Check every section; nothing runs before this passes.
    pub fn validate(&self) -> Result<()> {
        // The name is the default output folder's last component.
        let one_component = matches!(
            Path::new(&self.name)
                .components()
                .collect::<Vec<_>>()
                .as_slice(),
            [std::path::Component::Normal(_)]
        );
        if !one_component || self.name.contains(['/', '\\']) {
            return Err(bad(format!(
                "name `{}` must be one path component (no `/`, `..` or empty)",
                self.name
            )));
        }
        self.check_bounds()?;
        let i = &self.importance;
        if i.window < 1 || i.kernel < 1 || i.kernel % 2 == 0 {
            return Err(bad(format!(
                "importance window {} must be ≥ 1 and kernel {} odd",
                i.window, i.kernel
            )));
        }
        let pinned = self.protect.sinks + self.protect.recent;
        if let Some(p) = &self.ppl {
            check_budgets("ppl", &p.budgets)?;
            policies("ppl", &p.policies)?;
            no_repeats("ppl", "policies", &p.policies)?;
            no_repeats("ppl", "quantizers", &p.quantizers)?;
            if p.context <= pinned + 1 || p.continuation == 0 || p.windows == 0 {
                return Err(bad(format!(
                    "ppl: context {} must exceed the {pinned} pinned tokens + 1, continuation and windows ≥ 1",
                    p.context
                )));
            }
            if p.quantizers.is_empty() {
                return Err(bad("ppl: no quantizers".into()));
            }
        }
        if let Some(n) = &self.niah {
            check_budgets("niah", &n.budgets)?;
            policies("niah", &n.policies)?;
            no_repeats("niah", "policies", &n.policies)?;
            no_repeats("niah", "quantizers", &n.quantizers)?;
            if n.context <= pinned + 1 || n.depths == 0 || n.seeds == 0 || n.max_new_tokens == 0 {
                return Err(bad("niah: context must exceed the pinned tokens; depths, seeds, max_new_tokens ≥ 1".into()));
            }
            if n.quantizers.is_empty() {
                return Err(bad("niah: no quantizers".into()));
            }
        }
        if let Some(p) = &self.probe {
            check_budgets("probe", &[p.b])?;
            if p.quantizers.is_empty() || p.context <= pinned + 1 || p.gate_context <= 2 {
                return Err(bad(
                    "probe: needs quantizers and a context beyond the pinned tokens".into(),
                ));
            }
            if !p.gate_max_ppl_ratio.is_finite()
                || p.gate_max_ppl_ratio < 1.0
                || p.gate_windows == 0
                || p.gate_continuation == 0
            {
                return Err(bad(
                    "probe: gate ratio ≥ 1, gate windows and continuation ≥ 1".into(),
                ));
            }
        }
        if let Some(t) = &self.ttft {
            check_budgets("ttft", &[t.b])?;
            policies("ttft", std::slice::from_ref(&t.policy))?;
            no_repeats("ttft", "links_mbps", &t.links_mbps)?;
            if t.context <= pinned + 1 || t.repeats == 0 || t.links_mbps.is_empty() {
                return Err(bad(format!(
                    "ttft: context {} must exceed the {pinned} pinned tokens + 1; repeats and links_mbps ≥ 1",
                    t.context
                )));
            }
            if let Some(m) = t.links_mbps.iter().find(|m| !(m.is_finite() && **m >= 0.0)) {
                return Err(bad(format!(
                    "ttft: link {m} Mbit/s must be finite and ≥ 0 (0: unlimited)"
                )));
            }
        }
        Ok(())
    }

    /// Every context, continuation and window count within [`bounds::MAX_TOKENS`] (checked
    /// arithmetic: no count can overflow later).
    fn check_bounds(&self) -> Result<()> {
        if let Some(p) = &self.ppl {
            let span = tokens("ppl: context + continuation", &[p.context, p.continuation])?;
            bounds::product_at_most(
                "ppl: windows × (context + continuation)",
                &[p.windows, span],
                bounds::MAX_TOKENS,
            )
            .map_err(|e| bad(e.to_string().replace("spec: ", "")))?;
        }
        if let Some(n) = &self.niah {
            tokens(
                "niah: context + max_new_tokens",
                &[n.context, n.max_new_tokens],
            )?;
            bounds::product_at_most(
                "niah: depths × seeds",
                &[n.depths, n.seeds],
                bounds::MAX_TOKENS,
            )
            .map_err(|e| bad(e.to_string().replace("spec: ", "")))?;
        }
        if let Some(p) = &self.probe {
            tokens(
                "probe: context + max_new_tokens",
                &[p.context, p.max_new_tokens],
            )?;
            let span = tokens(
                "probe: gate_context + gate_continuation",
                &[p.gate_context, p.gate_continuation],
            )?;
            bounds::product_at_most(
                "probe: gate_windows × (gate_context + gate_continuation)",
                &[p.gate_windows, span],
                bounds::MAX_TOKENS,
            )
            .map_err(|e| bad(e.to_string().replace("spec: ", "")))?;
        }
        if let Some(t) = &self.ttft {
            tokens("ttft: context + 1", &[t.context, 1])?;
            bounds::product_at_most(
                "ttft: links × repeats",
                &[t.links_mbps.len(), t.repeats],
                bounds::MAX_TOKENS,
            )
            .map_err(|e| bad(e.to_string().replace("spec: ", "")))?;
        }
        Ok(())
    }

    /// Refuse a section whose sequences need more positions than `model` has.
    pub fn check_positions(&self, model: &Decoder) -> Result<()> {
        let mut needs = Vec::new();
        if let Some(p) = &self.ppl {
            needs.push(("[ppl] context + continuation", p.context + p.continuation));
        }
        if let Some(n) = &self.niah {
            needs.push((
                "[niah] context + max_new_tokens",
                n.context + n.max_new_tokens,
            ));
        }
        if let Some(p) = &self.probe {
            needs.push((
                "[probe] context + max_new_tokens",
                p.context + p.max_new_tokens,
            ));
            needs.push((
                "[probe] gate_context + gate_continuation",
                p.gate_context + p.gate_continuation,
            ));
        }
        if let Some(t) = &self.ttft {
            needs.push(("[ttft] context + 1 decode step", t.context + 1));
        }
        for (what, n) in needs {
            bounds::check_positions(model, n, &format!("spectrum `{}` {what}", self.name))?;
        }
        Ok(())
    }

    /// The perplexity variants.
    pub fn ppl_variants(&self) -> Result<Vec<Variant>> {
        let p = self
            .ppl
            .as_ref()
            .ok_or_else(|| bad("no [ppl] section".into()))?;
        Ok(Variant::grid(
            &policies("ppl", &p.policies)?,
            &p.budgets,
            &p.quantizers,
        ))
    }

    /// The NIAH variants.
    pub fn niah_variants(&self) -> Result<Vec<Variant>> {
        let n = self
            .niah
            .as_ref()
            .ok_or_else(|| bad("no [niah] section".into()))?;
        Ok(Variant::grid(
            &policies("niah", &n.policies)?,
            &n.budgets,
            &n.quantizers,
        ))
    }
}

impl crate::study::spec::StudySpec for SpectrumSpec {
    fn validate_loaded(&self, _text: &str) -> Result<()> {
        self.validate()
    }

    fn parse_error(message: String) -> Error {
        bad(message)
    }
}
