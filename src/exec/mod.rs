//! Execution policy: how the decoder's reductions (matmuls, attention, norms) — and the MLP
//! activation, whose CPU kernel is position-dependent — are executed.
//!
//! The policy is picked once per run and handed to [`crate::model::Decoder::forward`]; model
//! code calls the ops here and never branches on the policy itself. [`batch_invariant`]
//! explains the batch-invariant implementation; [`crate::model::invariance`] holds the checks
//! of it.
use crate::config::Activation;
use tch::{Kind, Tensor};

pub mod batch_invariant;
mod fused;
pub mod glue;
mod stock;

pub use batch_invariant::{BiKernels, BiTiles, TileOverrides};

/// An execution policy as specs, arguments and records name it: without its settings.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Plain libtorch kernels: fastest, but a token's numerics depend on batch shape.
    #[default]
    Stock,
    /// Fixed-shape, fixed-order reductions: a token's logits and KV rows do not depend on
    /// how many tokens or sequences share the forward pass.
    #[value(name = "batch_invariant", alias = "batch-invariant")]
    #[serde(alias = "batch-invariant")]
    BatchInvariant,
}

impl PolicyKind {
    /// The policy of this kind with `tiles` (used by the batch-invariant policy only).
    pub fn with_tiles(self, tiles: BiTiles) -> ExecPolicy {
        match self {
            PolicyKind::Stock => ExecPolicy::Stock,
            PolicyKind::BatchInvariant => ExecPolicy::BatchInvariant(tiles),
        }
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PolicyKind::Stock => "stock",
            PolicyKind::BatchInvariant => "batch_invariant",
        })
    }
}

/// How reductions are executed: the policy with the settings its ops run with. (Serialized as
/// `"stock"` or `{"batch_invariant": tiles}`; records use [`ExecRecord`].)
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExecPolicy {
    /// Plain libtorch kernels: fastest, but a token's numerics depend on batch shape.
    Stock,
    /// Fixed-shape, fixed-order reductions over these tiles: a token's logits and KV rows do
    /// not depend on how many tokens or sequences share the forward pass (for these tiles;
    /// other tiles give other, equally invariant, numerics).
    BatchInvariant(BiTiles),
}

impl ExecPolicy {
    /// The batch-invariant policy with `device`'s default tiles.
    pub fn batch_invariant(device: tch::Device) -> ExecPolicy {
        ExecPolicy::BatchInvariant(BiTiles::for_device(device))
    }

    /// The policy's name.
    pub fn kind(&self) -> PolicyKind {
        match self {
            ExecPolicy::Stock => PolicyKind::Stock,
            ExecPolicy::BatchInvariant(_) => PolicyKind::BatchInvariant,
        }
    }

    /// The tiles, under the batch-invariant policy.
    pub fn tiles(&self) -> Option<BiTiles> {
        match self {
            ExecPolicy::Stock => None,
            ExecPolicy::BatchInvariant(t) => Some(*t),
        }
    }
}

impl std::fmt::Display for ExecPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.kind().fmt(f)
    }
}

/// The type reductions accumulate in: fp64 for fp64 runs, fp32 otherwise (as Hugging Face
/// does for norms and softmax).
pub fn accum_kind(kind: Kind) -> Kind {
    if kind == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    }
}

/// The size of `x`'s last dimension (an error for a 0-d tensor).
fn last_dim(x: &Tensor) -> crate::Result<i64> {
    x.size().last().copied().ok_or_else(|| {
        crate::Error::Torch(format!(
            "expected a tensor of at least 1 dimension, got {:?}",
            x.size()
        ))
    })
}

/// Parameters of one attention call, shared by all policies.
pub struct AttnParams<'a> {
    /// Multiplier applied to `q·k`.
    pub scale: f64,
    /// `tanh` soft-capping of scores, if any.
    pub softcap: Option<f64>,
    /// Additive mask broadcastable to `[B, Hkv, group, T, L]` (0 keeps, dtype-min drops).
    pub mask: &'a Tensor,
    /// Scratch shared by every attention call over this mask in one forward pass, if any.
    pub scratch: Option<&'a AttnScratch>,
    /// The glue that scales, caps and masks the scores (fused where it runs).
    pub glue: glue::Glue,
}

/// Tensors derived from one mask and shape, shared by the attention calls of the layers of a
/// forward pass (every layer would build the same ones): a policy keys them by the shape and
/// settings they depend on.
#[derive(Default)]
pub struct AttnScratch {
    entries: std::cell::RefCell<Vec<([i64; 6], Vec<Tensor>)>>,
}

impl AttnScratch {
    /// The tensors stored under `key`, made by `make` the first time.
    pub(crate) fn get_or(
        &self,
        key: [i64; 6],
        make: impl FnOnce() -> crate::Result<Vec<Tensor>>,
    ) -> crate::Result<Vec<Tensor>> {
        if let Some((_, v)) = self.entries.borrow().iter().find(|(k, _)| *k == key) {
            return Ok(v.iter().map(Tensor::shallow_clone).collect());
        }
        let v = make()?;
        self.entries
            .borrow_mut()
            .push((key, v.iter().map(Tensor::shallow_clone).collect()));
        Ok(v)
    }
}

impl ExecPolicy {
    /// `x @ w^T + b` over the last dimension of `x`.
    pub fn linear(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> crate::Result<Tensor> {
        match self {
            ExecPolicy::Stock => stock::linear(x, w, b),
            ExecPolicy::BatchInvariant(t) if t.kernels == BiKernels::Fused => {
                fused::linear(t, x, w, b)
            }
            ExecPolicy::BatchInvariant(t) => batch_invariant::linear(t, x, w, b),
        }
    }

    /// Grouped-query attention. `q`: `[B, Hq, T, D]`; `k`, `v`: `[B, Hkv, L, D]`.
    /// Returns `[B, Hq, T, D]`.
    pub fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        p: &AttnParams,
    ) -> crate::Result<Tensor> {
        match self {
            ExecPolicy::Stock => stock::attention(q, k, v, p),
            ExecPolicy::BatchInvariant(t) if t.kernels == BiKernels::Fused => {
                fused::attention(t, q, k, v, p)
            }
            ExecPolicy::BatchInvariant(t) => batch_invariant::attention(t, q, k, v, p),
        }
    }

    /// `x / rms(x)` over the last dimension, computed in the accumulation type (fp32, fp64
    /// for fp64 runs) and returned as `out` (that type, or `x`'s own, rounded once).
    pub fn rms_normalize(&self, x: &Tensor, eps: f64, out: Kind) -> crate::Result<Tensor> {
        match self {
            ExecPolicy::Stock => {
                // libtorch's rms_norm upcasts half types internally: one kernel instead of the
                // six of the written-out formula, bitwise equal to it on the CPU. (`to_kind` to
                // `x`'s own kind is a no-op.)
                let h = last_dim(x)?;
                Ok(x.f_to_kind(out)?.f_rms_norm([h], None::<Tensor>, eps)?)
            }
            ExecPolicy::BatchInvariant(t) if t.kernels == BiKernels::Fused => {
                fused::rms_normalize(t, x, eps, out, None)
            }
            ExecPolicy::BatchInvariant(t) => {
                Ok(batch_invariant::rms_normalize(t, x, eps)?.f_to_kind(out)?)
            }
        }
    }

    /// `weight · (x / rms(x))` over the last dimension, the normalized values rounded to `x`'s
    /// type before the product (LLaMA's RMSNorm); one launch under the fused batch-invariant
    /// kernels, bitwise the product after [`Self::rms_normalize`].
    pub fn rms_norm(&self, x: &Tensor, weight: &Tensor, eps: f64) -> crate::Result<Tensor> {
        match self {
            ExecPolicy::BatchInvariant(t) if t.kernels == BiKernels::Fused => {
                fused::rms_normalize(t, x, eps, x.kind(), Some(weight))
            }
            _ => Ok(weight.f_mul(&self.rms_normalize(x, eps, x.kind())?)?),
        }
    }

    /// The gated MLP's `act(gate) · up` from `gu` (`[..., 2 · inter]`: gate columns, then up
    /// columns), in `gu`'s dtype; the SiLU product by `glue` where it is fusable.
    pub fn gated(
        &self,
        gu: &Tensor,
        inter: i64,
        act: Activation,
        glue: glue::Glue,
    ) -> crate::Result<Tensor> {
        // The fused glue's SiLU product is bitwise both the stock ops and the fused
        // batch-invariant activation kernel followed by the product.
        let fusable = act == Activation::Silu
            && match self {
                ExecPolicy::Stock => true,
                ExecPolicy::BatchInvariant(t) => t.kernels == BiKernels::Fused,
            };
        if fusable && let Some(y) = glue::fused_silu_mul(glue, gu, inter)? {
            return Ok(y);
        }
        let gate = gu.f_narrow(-1, 0, inter)?;
        let up = gu.f_narrow(-1, inter, inter)?;
        Ok(self.activation(&gate, act)?.f_mul(&up)?)
    }

    /// The gated MLP's activation, elementwise, returning `x`'s dtype.
    pub fn activation(&self, x: &Tensor, act: Activation) -> crate::Result<Tensor> {
        match self {
            ExecPolicy::Stock => Ok(match act {
                Activation::Silu => x.f_silu()?,
                Activation::GeluTanh => x.f_gelu("tanh")?,
                Activation::Gelu => x.f_gelu("none")?,
            }),
            ExecPolicy::BatchInvariant(t) if t.kernels == BiKernels::Fused => {
                fused::activation(x, act)
            }
            ExecPolicy::BatchInvariant(_) => batch_invariant::activation(x, act),
        }
    }
}

/// How the decode steps of continuations are executed.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum EngineMode {
    /// `graph` on a CUDA device when this binary can capture graphs, `eager` otherwise.
    // Commands take `--engine`, else `KVCREDIT_ENGINE`, resolved once with their other
    // arguments ([`ExecSettings::resolve`]); nothing here reads the environment.
    #[default]
    Auto,
    /// One [`crate::model::Decoder::forward`] per step, attending over each row's valid keys.
    Eager,
    /// [`crate::model::Decoder::forward_static`] per step: device-resident inputs, attention over the batch
    /// cache's fixed capacity, K/V written by scatter; no host syncs but the token readback.
    Static,
    /// The static step captured once per batch size as a CUDA graph and replayed (falls back
    /// to `static`, with a warning, if a capture fails).
    Graph,
}

impl std::fmt::Display for EngineMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EngineMode::Auto => "auto",
            EngineMode::Eager => "eager",
            EngineMode::Static => "static",
            EngineMode::Graph => "graph",
        })
    }
}

impl EngineMode {
    /// The concrete mode `Auto` stands for on `device` (other modes are returned as they are).
    pub fn resolve(self, device: tch::Device) -> EngineMode {
        if self != EngineMode::Auto {
            return self;
        }
        if device.is_cuda() && crate::cuda_graph::compiled() {
            EngineMode::Graph
        } else {
            EngineMode::Eager
        }
    }
}

/// What a run resolves once from its arguments besides device and dtype: the batch-invariant
/// policy's tiles and the continuation engine. Ops and the engine get these values; neither
/// reads the environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecSettings {
    /// Tiles of the batch-invariant policy.
    pub tiles: BiTiles,
    /// Continuation engine, resolved (never `auto`).
    pub engine: EngineMode,
    /// The sampler asked for (`None`: the device's default, [`crate::sampling::Sampler`]);
    /// not recorded, since both samplers choose bitwise the same tokens.
    pub sampler: Option<crate::sampling::Sampler>,
    /// The glue asked for (`None`: the device's default, [`glue::Glue`]); not recorded, since
    /// both compute bitwise the same values.
    pub glue: Option<glue::Glue>,
}

impl ExecSettings {
    /// The sampler kernel these settings run on `device` (`aten` or `fused`).
    pub fn sampler_name(&self, device: tch::Device) -> String {
        crate::sampling::Sampler::resolve(self.sampler, device)
            .name()
            .to_string()
    }

    /// The glue kernels these settings run on `device` (`aten` or `fused`).
    pub fn glue_name(&self, device: tch::Device) -> String {
        glue::Glue::resolve(self.glue, device).name().to_string()
    }

    /// `device`'s default tiles and the engine `auto` stands for there.
    pub fn defaults(device: tch::Device) -> ExecSettings {
        ExecSettings {
            tiles: BiTiles::for_device(device),
            engine: EngineMode::Auto.resolve(device),
            sampler: None,
            glue: None,
        }
    }

    /// Resolve arguments as typed, for `device`: tile overrides `tiles` over the device's
    /// defaults, `engine` (else `auto`) resolved for the device, and the sampler and glue
    /// asked for (`None`: the device's default), checked against the device.
    pub fn resolve(
        device: tch::Device,
        tiles: Option<&str>,
        engine: Option<EngineMode>,
        sampler: Option<crate::sampling::Sampler>,
        glue: Option<glue::Glue>,
    ) -> crate::Result<ExecSettings> {
        let overrides = match tiles {
            Some(s) => TileOverrides::parse(s)?,
            None => TileOverrides::default(),
        };
        let engine = engine.unwrap_or(EngineMode::Auto);
        let cuda = matches!(device, tch::Device::Cuda(_));
        let base = match overrides.kernels {
            Some(BiKernels::Aten) if cuda => BiTiles::CUDA_ATEN,
            _ => BiTiles::for_device(device),
        };
        let tiles = overrides.apply(base);
        if tiles.kernels == BiKernels::Fused && !(cuda && crate::cuda_graph::compiled()) {
            return Err(crate::Error::Spec(format!(
                "tile setting kernels=fused needs a CUDA device and a binary built with CUDA headers (device {device:?})"
            )));
        }
        if tiles.kernels == BiKernels::Fused && tiles.key_chunk % 32 != 0 {
            return Err(crate::Error::Spec(format!(
                "tile setting key_chunk={}: the fused attention kernel needs a multiple of 32",
                tiles.key_chunk
            )));
        }
        if let Some(s) = sampler {
            s.check_device(device)?;
        }
        if let Some(g) = glue {
            g.check_device(device)?;
        }
        Ok(ExecSettings {
            tiles,
            engine: engine.resolve(device),
            sampler,
            glue,
        })
    }

    /// The policy of `kind` with these tiles.
    pub fn policy(&self, kind: PolicyKind) -> ExecPolicy {
        kind.with_tiles(self.tiles)
    }

    /// What a manifest records of a run of `kind` with these settings (`engine`: the one that
    /// ran, if any; tiles only under the batch-invariant policy).
    pub fn record(&self, kind: PolicyKind, engine: Option<EngineMode>) -> ExecRecord {
        ExecRecord {
            policy: kind,
            tiles: self.policy(kind).tiles(),
            engine,
        }
    }
}

/// How a run executed, recorded (flattened) in every manifest — campaign, divergence, and the
/// spectrum grids': the policy, the tiles it ran with, and the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ExecRecord {
    /// Execution policy.
    pub policy: PolicyKind,
    /// The batch-invariant policy's tiles (absent under stock, and in runs written before they
    /// were recorded). Other tiles give other numerics, so a run resumes only with the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tiles: Option<BiTiles>,
    /// Continuation engine as resolved (never `auto`); `eager` for studies that step the
    /// decoder themselves; absent in runs written before it was recorded. Under the stock
    /// policy it decides rounding, so a stock run resumes only with the same one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineMode>,
}

impl ExecRecord {
    /// Refuse to resume a run recorded as `self` with `now` (same policy): another engine under
    /// stock, or other tiles under batch-invariant; fill in what an older run did not record.
    pub fn resume_with(&mut self, now: &ExecRecord, what: &str) -> crate::Result<()> {
        if let (Some(was), Some(e)) = (self.engine, now.engine)
            && self.policy == PolicyKind::Stock
            && was != e
        {
            return Err(crate::Error::Spec(format!(
                "{what} was run with the {was} engine and would resume with {e} (stock numerics differ between them); pass --engine {was} (or set KVCREDIT_ENGINE={was}) to resume"
            )));
        }
        if let (Some(was), Some(t)) = (self.tiles, now.tiles)
            && was != t
        {
            return Err(crate::Error::Spec(format!(
                "{what} was run with batch-invariant tiles {} and would resume with {} (other tiles, other numerics); pass --tiles {} to resume",
                was.describe(),
                t.describe(),
                was.describe()
            )));
        }
        self.engine = self.engine.or(now.engine);
        self.tiles = self.tiles.or(now.tiles);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn kernels_setting_parses_applies_and_records_compatibly() -> crate::Result<()> {
        let o = TileOverrides::parse("kernels=fused, key_chunk=64")?;
        let t = o.apply(BiTiles::CPU);
        assert_eq!((t.kernels, t.key_chunk), (BiKernels::Fused, 64));
        assert!(t.describe().ends_with(",kernels=fused3"));
        assert_eq!(
            TileOverrides::parse("kernels=fused3")?.kernels,
            Some(BiKernels::Fused)
        );
        assert!(!BiTiles::CPU.describe().contains("kernels"));
        assert!(TileOverrides::parse("kernels=triton").is_err());
        // Records of the ATen kernels keep their old form; old records read as ATen.
        let aten = serde_json::to_value(BiTiles::CUDA_ATEN)
            .map_err(|e| crate::Error::Output(e.to_string()))?;
        assert!(aten.get("kernels").is_none());
        let fused =
            serde_json::to_value(BiTiles::CUDA).map_err(|e| crate::Error::Output(e.to_string()))?;
        assert_eq!(fused["kernels"], "fused3");
        // Records of the earlier fused revisions do not load as the current one.
        for old in ["fused", "fused2"] {
            let mut r = fused.clone();
            r["kernels"] = old.into();
            assert!(serde_json::from_value::<BiTiles>(r).is_err(), "{old}");
        }
        let old: BiTiles =
            serde_json::from_value(aten).map_err(|e| crate::Error::Output(e.to_string()))?;
        assert_eq!(old, BiTiles::CUDA_ATEN);
        Ok(())
    }

    #[test]
    fn fused_kernels_are_the_cuda_default_and_refused_on_the_cpu() -> crate::Result<()> {
        let cpu = ExecSettings::resolve(Device::Cpu, Some("kernels=aten"), None, None, None)?;
        assert_eq!(cpu.tiles, BiTiles::CPU);
        let err = ExecSettings::resolve(Device::Cpu, Some("kernels=fused"), None, None, None)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("kernels=fused needs a CUDA device"), "{err}");
        let aten = ExecSettings::resolve(Device::Cuda(0), Some("kernels=aten"), None, None, None)?;
        assert_eq!(aten.tiles, BiTiles::CUDA_ATEN);
        if crate::cuda_graph::compiled() {
            let auto = ExecSettings::resolve(Device::Cuda(0), Some(""), None, None, None)?;
            assert_eq!(auto.tiles, BiTiles::CUDA);
            assert!(
                ExecSettings::resolve(Device::Cuda(0), Some("key_chunk=48"), None, None, None)
                    .is_err()
            );
        }
        Ok(())
    }
}
