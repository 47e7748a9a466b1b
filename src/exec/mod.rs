//! Execution policy: how the decoder's reductions (matmuls, attention, norms) — and the MLP
//! activation, whose CPU kernel is position-dependent — are executed.
//!
//! The policy is picked once per run and handed to [`crate::model::Decoder::forward`]; model
//! code calls the ops here and never branches on the policy itself. [`batch_invariant`]
//! explains the batch-invariant implementation; [`invariance`] holds the checks of it.
use crate::config::Activation;
use tch::{Kind, Tensor};

pub mod batch_invariant;
pub mod invariance;
mod stock;

pub use batch_invariant::{BiTiles, TileOverrides};

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
/// `"stock"` or `{"batch_invariant": tiles}`; records use [`crate::io::schema::ExecRecord`].)
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
            ExecPolicy::BatchInvariant(t) => {
                Ok(batch_invariant::rms_normalize(t, x, eps)?.f_to_kind(out)?)
            }
        }
    }

    /// The gated MLP's activation, elementwise, returning `x`'s dtype.
    pub fn activation(&self, x: &Tensor, act: Activation) -> crate::Result<Tensor> {
        match self {
            ExecPolicy::Stock => Ok(match act {
                Activation::Silu => x.f_silu()?,
                Activation::GeluTanh => x.f_gelu("tanh")?,
                Activation::Gelu => x.f_gelu("none")?,
            }),
            ExecPolicy::BatchInvariant(_) => batch_invariant::activation(x, act),
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
    pub engine: crate::decode::engine::EngineMode,
}

impl ExecSettings {
    /// `device`'s default tiles and the engine `auto` stands for there.
    pub fn defaults(device: tch::Device) -> ExecSettings {
        ExecSettings {
            tiles: BiTiles::for_device(device),
            engine: crate::decode::engine::EngineMode::Auto.resolve(device),
        }
    }

    /// Resolve arguments as typed, for `device`: tile overrides `tiles` (else the environment
    /// variable `KVCREDIT_BI_TILES`) over the device's defaults, and `engine` (else
    /// `KVCREDIT_ENGINE`, else `auto`) resolved for the device. The two variables are a
    /// documented fallback read here, once, and nowhere else.
    pub fn resolve(
        device: tch::Device,
        tiles: Option<&str>,
        engine: Option<crate::decode::engine::EngineMode>,
    ) -> crate::Result<ExecSettings> {
        use crate::decode::engine::EngineMode;
        let env = |name: &str| std::env::var(name).ok().filter(|s| !s.trim().is_empty());
        let overrides = match tiles
            .map(str::to_string)
            .or_else(|| env("KVCREDIT_BI_TILES"))
        {
            Some(s) => TileOverrides::parse(&s)?,
            None => TileOverrides::default(),
        };
        let engine = match engine {
            Some(e) => e,
            None => match env("KVCREDIT_ENGINE") {
                Some(s) => {
                    <EngineMode as clap::ValueEnum>::from_str(s.trim(), true).map_err(|_| {
                        crate::Error::Spec(format!(
                            "KVCREDIT_ENGINE=`{s}`: not an engine (auto, eager, static, graph)"
                        ))
                    })?
                }
                None => EngineMode::Auto,
            },
        };
        Ok(ExecSettings {
            tiles: overrides.apply(BiTiles::for_device(device)),
            engine: engine.resolve(device),
        })
    }

    /// The policy of `kind` with these tiles.
    pub fn policy(&self, kind: PolicyKind) -> ExecPolicy {
        kind.with_tiles(self.tiles)
    }

    /// What a manifest records of a run of `kind` with these settings (`engine`: the one that
    /// ran, if any; tiles only under the batch-invariant policy).
    pub fn record(
        &self,
        kind: PolicyKind,
        engine: Option<crate::decode::engine::EngineMode>,
    ) -> crate::io::schema::ExecRecord {
        crate::io::schema::ExecRecord {
            policy: kind,
            tiles: self.policy(kind).tiles(),
            engine,
        }
    }
}
