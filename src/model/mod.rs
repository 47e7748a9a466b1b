//! One generic decoder-only transformer in libtorch covering the LLaMA family (LLaMA, Mistral
//! with sliding windows, SmolLM2), Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm), Gemma-2
//! (embedding scaling, sandwich norms, soft-capping, alternating windows,
//! `query_pre_attn_scalar`), Gemma-3 (q/k norms, local/global RoPE), OLMo-2 (post-norm blocks,
//! q/k norms over all heads) and Phi-3 (fused `qkv_proj` and `gate_up_proj`, LongRoPE).
//!
//! Reference implementation: Hugging Face transformers' `modeling_{llama,mistral,qwen2,qwen3,
//! gemma2,gemma3,olmo2,phi3}.py` (eager attention). Family differences live in [`ArchConfig`]
//! as data.
//!
//! Prefill (many tokens per row) and decode (one token per row) are the same call,
//! [`Decoder::forward`]; a full recompute without cache is a forward over a fresh cache.
mod attention;
pub mod gguf;
pub mod hooks;
pub mod invariance;
mod mlp;
mod norm;
pub(crate) mod rope;
pub mod synthetic;
pub mod weights;

use crate::config::{ArchConfig, Dims, LayerKind};
use crate::exec::glue::Glue;
use crate::exec::{AttnScratch, ExecPolicy};
use crate::kv_cache::{KvCache, KvShape, KvWrite};
use crate::sampling::Sampler;
use crate::{Error, Result};
use attention::{Attention, LayerInputs, QkNorm};
pub use hooks::Trace;
use hooks::{ForwardHook, NoHook, Site};
use mlp::Mlp;
use norm::RmsNorm;
use rope::RopeTable;
use std::path::Path;
use tch::{Device, Kind, Tensor};
pub use weights::Weights;

/// Which positions to compute logits for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogitsAt {
    /// Every position: `[B, T, V]`.
    All,
    /// The last position of every row: `[B, 1, V]`.
    Last,
    /// One position per row (index into the T new tokens): `[B, 1, V]`.
    PerRow(Vec<i64>),
}

/// Device-resident inputs of one forward pass: what the layers read besides weights and cache.
struct StepInputs<'a> {
    /// Token ids `[B, T]` (int64, on the model's device).
    tokens: &'a Tensor,
    /// Absolute position of each new token `[B, T]` (int64, on the model's device).
    positions: &'a Tensor,
    /// Keys attended: positions `0..key_len` of the cache.
    key_len: i64,
    /// Where the new K/V rows go.
    write: KvWrite,
    /// The glue the layers run.
    glue: Glue,
}

struct Layer {
    kind: LayerKind,
    /// Norm of the attention input (`input_layernorm`; none in OLMo-2's post-norm blocks).
    attn_in: Option<RmsNorm>,
    /// Norm of the attention output before the residual add (sandwich and post-norm blocks).
    attn_out: Option<RmsNorm>,
    /// Norm of the MLP input.
    mlp_in: Option<RmsNorm>,
    /// Norm of the MLP output before the residual add (sandwich and post-norm blocks).
    mlp_out: Option<RmsNorm>,
    attn: Attention,
    mlp: Mlp,
}

/// `norm(x)`, or `x` itself where the block has no norm at that place.
fn maybe_norm(norm: &Option<RmsNorm>, x: Tensor, policy: &ExecPolicy) -> Result<Tensor> {
    match norm {
        Some(n) => n.forward(&x, policy),
        None => Ok(x),
    }
}

/// A loaded decoder. Immutable: the KV cache is passed in by the caller.
pub struct Decoder {
    cfg: ArchConfig,
    embed: Tensor,
    embed_scale: Option<Tensor>,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Tensor,
    rope_full: RopeTable,
    rope_local: Option<RopeTable>,
    kind: Kind,
    device: Device,
    /// Refuse forwards past `max_position_embeddings` (see [`Decoder::limit_context`]).
    limit_positions: bool,
    /// The glue ops' implementation (see [`Decoder::set_glue`]).
    glue: Glue,
    /// The sampler that draws tokens from this decoder's logits (see [`Decoder::set_sampler`]).
    sampler: Sampler,
}

impl Decoder {
    /// Load a Hugging Face directory (`config.json` + safetensors).
    pub fn load_hf_dir(dir: &Path, kind: Kind, device: Device) -> Result<Decoder> {
        let cfg_path = dir.join("config.json");
        if !cfg_path.exists() {
            return Err(Error::Config(format!("{}: no config.json", dir.display())));
        }
        let cfg = ArchConfig::from_hf_file(&cfg_path)?;
        let weights = Weights::from_safetensors_dir(dir, kind, device)?;
        Decoder::from_weights(cfg, weights)
    }

    /// Build from a configuration and checkpoint tensors named by Hugging Face keys.
    pub fn from_weights(cfg: ArchConfig, mut w: Weights) -> Result<Decoder> {
        cfg.validate()?;
        let _guard = tch::no_grad_guard();
        let (kind, device) = (w.kind, w.device);
        let Dims {
            hidden: h,
            vocab: v,
            ..
        } = cfg.dims();
        let embed = w.take("model.embed_tokens.weight", &[v, h])?;
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for (i, &kind_i) in cfg.layer_types.iter().enumerate() {
            layers.push(load_layer(&cfg, &mut w, i, kind_i)?);
        }
        let final_norm = load_norm(&cfg, &mut w, "model.norm.weight", h)?;
        let lm_head = load_lm_head(&cfg, &mut w, &embed)?;
        let unused = w.unused();
        if !unused.is_empty() {
            return Err(Error::Weights(format!(
                "{} checkpoint tensors were not used (first: `{}`): wrong architecture?",
                unused.len(),
                unused[0]
            )));
        }
        let embed_scale = cfg
            .scale_embeddings
            .then(|| {
                Tensor::f_from_slice(&[(cfg.hidden_size as f64).sqrt()])?
                    .f_view(())?
                    .f_to_kind(kind)?
                    .f_to_device(device)
            })
            .transpose()?;
        Ok(Decoder {
            rope_full: RopeTable::new(&cfg.rope, cfg.head_dim, device)?,
            rope_local: cfg
                .rope_local
                .as_ref()
                .map(|r| RopeTable::new(r, cfg.head_dim, device))
                .transpose()?,
            cfg,
            embed,
            embed_scale,
            layers,
            norm: final_norm,
            lm_head,
            kind,
            device,
            limit_positions: false,
            glue: Glue::resolve(None, device),
            sampler: Sampler::resolve(None, device),
        })
    }

    /// Refuse (`true`) or allow forwards past the positions the checkpoint was trained for
    /// ([`ArchConfig::context_length`]: `max_position_embeddings` or GGUF `context_length`,
    /// stretched by YaRN and dynamic NTK). Off for library users (numerics
    /// checks on tiny fixtures run past them on purpose); every command turns it on unless
    /// given `--allow-extrapolation`.
    pub fn limit_context(&mut self, on: bool) {
        self.limit_positions = on;
    }

    /// Run the glue ops with `glue` (`None`: the device's default), where it can run
    /// ([`Glue::resolve`]): the run's [`crate::ExecSettings::glue`]. Both glues compute bitwise
    /// the same values.
    pub fn set_glue(&mut self, glue: Option<Glue>) {
        self.glue = Glue::resolve(glue, self.device);
    }

    /// The glue this decoder's forward passes run.
    pub fn glue(&self) -> Glue {
        self.glue
    }

    /// Draw sampled tokens from this decoder's logits with `sampler` (`None`: the device's
    /// default, [`Sampler::resolve`]): the run's [`crate::ExecSettings::sampler`]. Both samplers
    /// choose bitwise the same tokens.
    pub fn set_sampler(&mut self, sampler: Option<Sampler>) {
        self.sampler = Sampler::resolve(sampler, self.device);
    }

    /// The sampler that draws tokens from this decoder's logits.
    pub fn sampler(&self) -> Sampler {
        self.sampler
    }

    /// Take the glue and the sampler of a run's resolved settings ([`Self::set_glue`],
    /// [`Self::set_sampler`]): what every command does with a model it loads.
    pub fn use_settings(&mut self, exec: &crate::exec::ExecSettings) {
        self.set_glue(exec.glue);
        self.set_sampler(exec.sampler);
    }

    /// The most positions a sequence may use: `Some(`[`ArchConfig::context_length`]`)` while
    /// [`Self::limit_context`] is on, else `None`.
    pub fn context_limit(&self) -> Option<usize> {
        self.limit_positions.then_some(self.cfg.context_length())
    }

    /// Refuse `what` if it needs more than [`Self::context_limit`] positions: one line naming
    /// the limit, the need and how to override it.
    pub fn check_context(&self, positions: usize, what: &str) -> Result<()> {
        match self.context_limit() {
            Some(limit) if positions > limit => Err(Error::ContextLimit(format!(
                "{what} needs {positions} positions but the model has {limit} (max_position_embeddings / context_length); pass --allow-extrapolation to run past it"
            ))),
            _ => Ok(()),
        }
    }

    /// The architecture this decoder was built from.
    pub fn config(&self) -> &ArchConfig {
        &self.cfg
    }

    /// Element type of weights and activations.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Device the weights live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Shape of this model's KV cache.
    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            layers: self.cfg.num_layers(),
            kv_heads: self.cfg.num_key_value_heads as i64,
            head_dim: self.cfg.head_dim as i64,
        }
    }

    /// An empty cache for `batch` rows and about `capacity` positions.
    pub fn new_cache(&self, batch: usize, capacity: i64) -> Result<KvCache> {
        KvCache::new(self.kv_shape(), batch, capacity, self.kind, self.device)
    }

    /// Feed `tokens` (`[B, T]`, int64) after each row's cached positions, append their K/V to
    /// `cache`, and return logits (in the run dtype) at the requested positions.
    pub fn forward(
        &self,
        tokens: &Tensor,
        cache: &mut KvCache,
        policy: &ExecPolicy,
        at: &LogitsAt,
    ) -> Result<Tensor> {
        self.forward_with(tokens, cache, policy, at, &mut NoHook)
    }

    /// [`Self::forward`] with `hook` called at every layer's sites (see [`hooks`]); it may
    /// record or replace the residual stream and the sublayer outputs.
    pub fn forward_with(
        &self,
        tokens: &Tensor,
        cache: &mut KvCache,
        policy: &ExecPolicy,
        at: &LogitsAt,
        hook: &mut dyn ForwardHook,
    ) -> Result<Tensor> {
        self.forward_keyed(tokens, cache, policy, at, hook, (0, self.glue))
    }

    /// [`Self::forward`] attending over `key_pad` more key positions than the rows need
    /// (masked, as a batch padded to a longer co-resident row would): the same logits up to the
    /// rounding a longer key axis brings under the stock policy, bitwise the same under the
    /// batch-invariant one. The continuation engine's eager replica uses it.
    pub fn forward_padded(
        &self,
        tokens: &Tensor,
        cache: &mut KvCache,
        policy: &ExecPolicy,
        at: &LogitsAt,
        key_pad: i64,
    ) -> Result<Tensor> {
        self.forward_keyed(
            tokens,
            cache,
            policy,
            at,
            &mut NoHook,
            (key_pad.max(0), self.glue),
        )
    }

    /// [`Self::forward`] under `glue` (the glue compared by
    /// [`invariance::check_glue`]).
    pub(crate) fn forward_with_glue(
        &self,
        tokens: &Tensor,
        cache: &mut KvCache,
        policy: &ExecPolicy,
        at: &LogitsAt,
        glue: Glue,
    ) -> Result<Tensor> {
        self.forward_keyed(tokens, cache, policy, at, &mut NoHook, (0, glue))
    }

    /// The forward pass attending over `key_pad` extra key positions, with `glue`.
    fn forward_keyed(
        &self,
        tokens: &Tensor,
        cache: &mut KvCache,
        policy: &ExecPolicy,
        at: &LogitsAt,
        hook: &mut dyn ForwardHook,
        (key_pad, glue): (i64, Glue),
    ) -> Result<Tensor> {
        let _guard = tch::no_grad_guard();
        let dims = tokens.size();
        if dims.len() != 2 || dims[0] as usize != cache.batch() {
            return Err(Error::KvCache(format!(
                "tokens of shape {dims:?} do not match a cache of {} rows",
                cache.batch()
            )));
        }
        let (b, t) = (dims[0], dims[1]);
        // Range check where the ids are (host ids cost no device sync), one readback.
        let range =
            Tensor::f_stack(&[tokens.f_min()?, tokens.f_max()?], 0)?.f_to_device(Device::Cpu)?;
        let (lo, hi) = (range.f_int64_value(&[0])?, range.f_int64_value(&[1])?);
        if lo < 0 || hi >= self.cfg.vocab_size as i64 {
            return Err(Error::Spec(format!(
                "token ids must lie in 0..{} (got {lo}..={hi})",
                self.cfg.vocab_size
            )));
        }
        let longest = cache.lens().iter().copied().max().unwrap_or(0);
        self.check_context((longest + t) as usize, "this forward pass")?;
        let tokens = tokens.f_to_device(self.device)?;
        cache.reserve(t + key_pad)?;
        let lens = cache.lens();
        let start = lens.first().copied().unwrap_or(0);
        let uniform = lens.iter().all(|&l| l == start);
        let steps = Tensor::f_arange(t, (Kind::Int64, self.device))?.f_view([1, t])?;
        let (positions, write) = if uniform {
            // Every row continues at `start`: positions need no host→device copy.
            (
                steps.f_add_scalar(start)?.f_expand([b, t], false)?,
                KvWrite::At(start),
            )
        } else {
            let lens = Tensor::f_from_slice(lens)?.f_to_device(self.device)?;
            (lens.f_view([b, 1])?.f_add(&steps)?, KvWrite::Scatter)
        };
        let key_len = lens.iter().copied().max().unwrap_or(0) + t + key_pad;
        let inputs = StepInputs {
            tokens: &tokens,
            positions: &positions,
            key_len,
            write,
            glue,
        };
        let logits = self.forward_inputs(&inputs, cache, policy, at, hook)?;
        cache.advance(t);
        Ok(logits)
    }

    /// One decode step over *static, device-resident* inputs, the form a CUDA graph captures:
    /// `tokens` and `positions` (`[B, 1]` int64 on the model's device; `positions` must be each
    /// row's current length in `cache`), attention over the cache's whole capacity under a
    /// mask built on the device, K/V written by scatter. No host sync and no host→device copy;
    /// shapes depend only on `B` and the cache capacity. Returns logits `[B, V]` and advances
    /// `cache`'s lengths by one.
    ///
    /// The layers are the same code as [`Self::forward`]'s. Under the batch-invariant policy
    /// the logits are bitwise those of [`Self::forward`] (keys beyond a row's length fall in
    /// masked chunks that add exact zeros); under the stock policy the longer key axis may
    /// round differently, like any change of shape.
    pub fn forward_static(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        cache: &mut KvCache,
        policy: &ExecPolicy,
    ) -> Result<Tensor> {
        let _guard = tch::no_grad_guard();
        let b = cache.batch() as i64;
        if tokens.size() != [b, 1] || positions.size() != [b, 1] {
            return Err(Error::KvCache(format!(
                "static step: tokens {:?} and positions {:?} must be [{b}, 1]",
                tokens.size(),
                positions.size()
            )));
        }
        if tokens.device() != self.device || positions.device() != self.device {
            return Err(Error::KvCache(format!(
                "static step: tokens and positions must be on the model's device ({:?})",
                self.device
            )));
        }
        if cache.lens().iter().any(|&l| l >= cache.capacity()) {
            return Err(Error::KvCache(format!(
                "static step: a row is full (capacity {})",
                cache.capacity()
            )));
        }
        let inputs = StepInputs {
            tokens,
            positions,
            key_len: cache.capacity(),
            write: KvWrite::Scatter,
            glue: self.glue,
        };
        let logits = self.forward_inputs(&inputs, cache, policy, &LogitsAt::Last, &mut NoHook)?;
        cache.advance(1);
        Ok(logits.f_view([b, -1])?)
    }

    /// The layers over device-resident inputs: embedding, masks and RoPE angles built on the
    /// device from `inputs.positions`, every layer, final norm and head. Shared by
    /// [`Self::forward`] and [`Self::forward_static`]. Does not move the cache's lengths.
    fn forward_inputs(
        &self,
        inputs: &StepInputs,
        cache: &mut KvCache,
        policy: &ExecPolicy,
        at: &LogitsAt,
        hook: &mut dyn ForwardHook,
    ) -> Result<Tensor> {
        let (b, t) = (inputs.tokens.size()[0], inputs.tokens.size()[1]);
        let (positions, key_len) = (inputs.positions, inputs.key_len);
        let keys =
            Tensor::f_arange(key_len, (Kind::Int64, self.device))?.f_view([1, 1, key_len])?;
        let qpos = positions.f_view([b, t, 1])?;
        let mut causal = keys.f_le_tensor(&qpos)?;
        if let Some(attended) = cache.attended(key_len)? {
            causal = causal.f_logical_and(&attended)?;
        }
        let min = match self.kind {
            Kind::Half => f64::from(half::f16::MIN),
            Kind::BFloat16 => f64::from(half::bf16::MIN),
            _ => f64::from(f32::MIN),
        };
        let to_mask = |allowed: &Tensor| -> Result<Tensor> {
            Ok(
                Tensor::f_zeros([b, 1, 1, t, key_len], (self.kind, self.device))?.f_masked_fill(
                    &allowed.f_logical_not()?.f_view([b, 1, 1, t, key_len])?,
                    min,
                )?,
            )
        };
        let full_mask = (to_mask(&causal)?, AttnScratch::default());
        let mut window_masks: Vec<(usize, (Tensor, AttnScratch))> = Vec::new();
        for kind in &self.cfg.layer_types {
            if let LayerKind::Sliding { window } = *kind
                && !window_masks.iter().any(|(w, _)| *w == window)
            {
                let recent = keys.f_gt_tensor(&qpos.f_sub_scalar(window as i64)?)?;
                let mask = to_mask(&causal.f_logical_and(&recent)?)?;
                window_masks.push((window, (mask, AttnScratch::default())));
            }
        }
        let (cos, sin) = self.rope_full.cos_sin(positions, self.kind)?;
        let local = self
            .rope_local
            .as_ref()
            .map(|r| r.cos_sin(positions, self.kind))
            .transpose()?;

        let mut h = Tensor::f_embedding(&self.embed, inputs.tokens, -1, false, false)?;
        if let Some(s) = &self.embed_scale {
            let _ = h.f_mul_(s)?;
        }
        for (i, layer) in self.layers.iter().enumerate() {
            let (mask, (cos, sin)) = match layer.kind {
                LayerKind::Full => (&full_mask, (&cos, &sin)),
                LayerKind::Sliding { window } => {
                    let m = &window_masks
                        .iter()
                        .find(|(w, _)| *w == window)
                        .expect("mask built above")
                        .1;
                    (
                        m,
                        local.as_ref().map(|(c, s)| (c, s)).unwrap_or((&cos, &sin)),
                    )
                }
            };
            let layer_inputs = LayerInputs {
                cos,
                sin,
                mask: &mask.0,
                positions,
                write: inputs.write,
                key_len,
                scratch: &mask.1,
                glue: inputs.glue,
            };
            let mut site = |x: Tensor, site: Site| -> Result<Tensor> {
                Ok(hook.on_sublayer(i, site, &x)?.unwrap_or(x))
            };
            let x = maybe_norm(&layer.attn_in, h.shallow_clone(), policy)?;
            let a = layer.attn.forward(&x, i, cache, &layer_inputs, policy)?;
            let a = site(maybe_norm(&layer.attn_out, a, policy)?, Site::AttnOut)?;
            let h_attn = h.f_add(&a)?;
            let x = maybe_norm(&layer.mlp_in, h_attn.shallow_clone(), policy)?;
            let m = layer.mlp.forward(&x, policy, inputs.glue)?;
            let m = site(maybe_norm(&layer.mlp_out, m, policy)?, Site::MlpOut)?;
            h = h_attn.f_add(&m)?;
            if let Some(patched) = hook.on_residual(i, &h)? {
                h = patched;
            }
        }
        let h = match at {
            LogitsAt::All => h,
            LogitsAt::Last => h.f_narrow(1, t - 1, 1)?,
            LogitsAt::PerRow(idx) => {
                if idx.len() as i64 != b || idx.iter().any(|&i| i < 0 || i >= t) {
                    return Err(Error::Spec(format!(
                        "per-row logit positions {idx:?} out of range 0..{t}"
                    )));
                }
                let idx = Tensor::f_from_slice(idx)?
                    .f_to_device(self.device)?
                    .f_view([b, 1, 1])?;
                h.f_gather(
                    1,
                    &idx.f_expand([b, 1, self.cfg.hidden_size as i64], false)?,
                    false,
                )?
            }
        };
        let h = self.norm.forward(&h, policy)?;
        let mut logits = policy.linear(&h, &self.lm_head, None)?;
        if let Some(cap) = self.cfg.final_logit_softcapping {
            logits = logits.f_div_scalar(cap)?.f_tanh()?.f_mul_scalar(cap)?;
        }
        Ok(logits)
    }

    /// Post-RoPE queries of every layer for the last `w` tokens of a forward pass that fed
    /// `tokens` (`[B, T]`) at positions `start..start + T` and recorded `trace`: each layer's
    /// input (the embedding, or the previous layer's residual) through its input norm and
    /// query projection. `[B, Hq, w, D]` per layer, in layer order.
    pub fn trace_queries(
        &self,
        tokens: &Tensor,
        start: i64,
        trace: &Trace,
        w: i64,
        policy: &ExecPolicy,
    ) -> Result<Vec<Tensor>> {
        let _guard = tch::no_grad_guard();
        let (b, t) = (tokens.size()[0], tokens.size()[1]);
        if trace.residual.len() != self.layers.len() || w < 1 || w > t {
            return Err(Error::Spec(format!(
                "queries of the last {w} of {t} tokens need a trace of all {} layers (got {})",
                self.layers.len(),
                trace.residual.len()
            )));
        }
        let last = tokens.f_to_device(self.device)?.f_narrow(1, t - w, w)?;
        let mut h = Tensor::f_embedding(&self.embed, &last, -1, false, false)?;
        if let Some(s) = &self.embed_scale {
            let _ = h.f_mul_(s)?;
        }
        let positions = Tensor::f_arange(w, (Kind::Int64, self.device))?
            .f_add_scalar(start + t - w)?
            .f_view([1, w])?
            .f_expand([b, w], false)?;
        let (cos, sin) = self.rope_full.cos_sin(&positions, self.kind)?;
        let local = self
            .rope_local
            .as_ref()
            .map(|r| r.cos_sin(&positions, self.kind))
            .transpose()?;
        let mut out = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let (c, s) = match (layer.kind, &local) {
                (LayerKind::Sliding { .. }, Some((c, s))) => (c, s),
                _ => (&cos, &sin),
            };
            let x = maybe_norm(&layer.attn_in, h.shallow_clone(), policy)?;
            out.push(layer.attn.queries(&x, c, s, policy)?);
            h = trace.residual[i].f_narrow(1, t - w, w)?;
        }
        Ok(out)
    }

    /// Logits of every position of `tokens` (`[B, T]`) computed from scratch (cache-OFF).
    pub fn forward_full(&self, tokens: &Tensor, policy: &ExecPolicy) -> Result<Tensor> {
        let dims = tokens.size();
        let mut cache = self.new_cache(dims[0] as usize, dims[1])?;
        self.forward(tokens, &mut cache, policy, &LogitsAt::All)
    }
}

/// An RMSNorm weight of `n` elements under `key` (kept in the accumulation dtype where the
/// architecture says so).
fn load_norm(cfg: &ArchConfig, w: &mut Weights, key: &str, n: i64) -> Result<RmsNorm> {
    let fp32 = cfg.norm_weight_fp32;
    let kind = if fp32 {
        crate::exec::accum_kind(w.kind)
    } else {
        w.kind
    };
    RmsNorm::new(
        w.take_as(key, &[n], kind)?,
        cfg.rms_norm_eps,
        cfg.norm_weight_offset,
        fp32,
    )
}

/// Decoder layer `i`: its attention, MLP and the norms the architecture places around them.
fn load_layer(cfg: &ArchConfig, w: &mut Weights, i: usize, kind: LayerKind) -> Result<Layer> {
    let h = cfg.dims().hidden;
    let p = format!("model.layers.{i}");
    let attn = load_attention(cfg, w, &format!("{p}.self_attn"))?;
    let mlp = load_mlp(cfg, w, &p)?;
    let mut opt_norm = |on: bool, name: &str| -> Result<Option<RmsNorm>> {
        on.then(|| load_norm(cfg, w, &format!("{p}.{name}.weight"), h))
            .transpose()
    };
    let (pre, sandwich) = (cfg.pre_norms, cfg.sandwich_norms);
    let mlp_in_name = if sandwich {
        "pre_feedforward_layernorm"
    } else {
        "post_attention_layernorm"
    };
    Ok(Layer {
        kind,
        attn_in: opt_norm(pre, "input_layernorm")?,
        attn_out: opt_norm(sandwich, "post_attention_layernorm")?,
        mlp_in: opt_norm(pre, mlp_in_name)?,
        mlp_out: opt_norm(sandwich, "post_feedforward_layernorm")?,
        attn,
        mlp,
    })
}

/// The attention of the layer whose tensors start with `a` (`model.layers.{i}.self_attn`):
/// projections (q/k/v separate or one fused `qkv_proj`), biases and q/k norms as configured.
fn load_attention(cfg: &ArchConfig, w: &mut Weights, a: &str) -> Result<Attention> {
    let Dims {
        hidden: h,
        heads: hq,
        kv_heads: hkv,
        head_dim: d,
        ..
    } = cfg.dims();
    let bias = if cfg.attention_bias {
        Some((
            w.take(&format!("{a}.q_proj.bias"), &[hq * d])?,
            w.take(&format!("{a}.k_proj.bias"), &[hkv * d])?,
            w.take(&format!("{a}.v_proj.bias"), &[hkv * d])?,
        ))
    } else {
        None
    };
    let qk_norm = if cfg.qk_norm {
        let (nq, nk) = if cfg.qk_norm_across_heads {
            (hq * d, hkv * d)
        } else {
            (d, d)
        };
        Some(QkNorm {
            q: load_norm(cfg, w, &format!("{a}.q_norm.weight"), nq)?,
            k: load_norm(cfg, w, &format!("{a}.k_norm.weight"), nk)?,
            across_heads: cfg.qk_norm_across_heads,
        })
    } else {
        None
    };
    // Phi-3 stores q/k/v as one `qkv_proj` (q rows, then k, then v).
    let fused_qkv = format!("{a}.qkv_proj.weight");
    let (q, k, v) = if w.contains(&fused_qkv) {
        let qkv = w.take(&fused_qkv, &[(hq + 2 * hkv) * d, h])?;
        (
            qkv.f_narrow(0, 0, hq * d)?,
            qkv.f_narrow(0, hq * d, hkv * d)?,
            qkv.f_narrow(0, (hq + hkv) * d, hkv * d)?,
        )
    } else {
        (
            w.take(&format!("{a}.q_proj.weight"), &[hq * d, h])?,
            w.take(&format!("{a}.k_proj.weight"), &[hkv * d, h])?,
            w.take(&format!("{a}.v_proj.weight"), &[hkv * d, h])?,
        )
    };
    Attention::new(
        &q,
        &k,
        &v,
        bias,
        w.take(&format!("{a}.o_proj.weight"), &[h, hq * d])?,
        qk_norm,
        (hq, hkv, d),
        cfg.softmax_scale,
        cfg.attn_logit_softcapping,
    )
}

/// The gated MLP of the layer whose tensors start with `p` (gate and up separate or one fused
/// `gate_up_proj`).
fn load_mlp(cfg: &ArchConfig, w: &mut Weights, p: &str) -> Result<Mlp> {
    let Dims {
        hidden: h,
        intermediate: inter,
        ..
    } = cfg.dims();
    // Phi-3 stores gate and up as one `gate_up_proj` (gate rows, then up).
    let fused_gate_up = format!("{p}.mlp.gate_up_proj.weight");
    let (gate, up) = if w.contains(&fused_gate_up) {
        let gu = w.take(&fused_gate_up, &[2 * inter, h])?;
        (gu.f_narrow(0, 0, inter)?, gu.f_narrow(0, inter, inter)?)
    } else {
        (
            w.take(&format!("{p}.mlp.gate_proj.weight"), &[inter, h])?,
            w.take(&format!("{p}.mlp.up_proj.weight"), &[inter, h])?,
        )
    };
    Mlp::new(
        &gate,
        &up,
        w.take(&format!("{p}.mlp.down_proj.weight"), &[h, inter])?,
        cfg.activation,
    )
}

/// The output projection: `lm_head.weight`, or the embeddings when tied (a stored copy of a
/// tied head is taken so it does not count as unused).
fn load_lm_head(cfg: &ArchConfig, w: &mut Weights, embed: &Tensor) -> Result<Tensor> {
    let Dims {
        hidden: h,
        vocab: v,
        ..
    } = cfg.dims();
    if w.contains("lm_head.weight") && !cfg.tie_word_embeddings {
        w.take("lm_head.weight", &[v, h])
    } else if cfg.tie_word_embeddings {
        // Some tied checkpoints still store a copy; it must not be left unused.
        if w.contains("lm_head.weight") {
            let _ = w.take("lm_head.weight", &[v, h])?;
        }
        Ok(embed.shallow_clone())
    } else {
        Err(Error::Weights(
            "missing tensor `lm_head.weight` (embeddings are not tied)".into(),
        ))
    }
}
