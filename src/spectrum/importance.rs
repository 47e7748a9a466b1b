//! Token importance at prefill end (SnapKV's scheme): the attention that the last `window`
//! prompt queries pay each context token, softmax in fp32, summed over the window and averaged
//! over the query heads of each KV head, smoothed by 1-D pooling, then aggregated over layers
//! and KV heads to one score per token.
use crate::config::LayerKind;
use crate::exec::ExecPolicy;
use crate::kv_cache::KvCache;
use crate::model::{Decoder, Trace};
use crate::{Error, Result};
use tch::{Kind, Tensor};

/// How per-layer, per-head scores become one score per token.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Aggregate {
    /// Maximum over layers and KV heads.
    Max,
    /// Mean over layers and KV heads.
    Mean,
}

/// The 1-D pooling along the token axis.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Pooling {
    /// Max pooling (SnapKV's default).
    Max,
    /// Average pooling (padding not counted).
    Avg,
}

/// Settings of the importance score (recorded with every result).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ImportanceSpec {
    /// Prompt queries observed (the last ones).
    pub window: i64,
    /// Pooling kernel (odd; 1 = none).
    pub kernel: i64,
    /// Pooling kind.
    pub pooling: Pooling,
    /// Aggregation over layers and KV heads.
    pub aggregate: Aggregate,
}

impl Default for ImportanceSpec {
    fn default() -> Self {
        ImportanceSpec {
            window: 32,
            kernel: 5,
            pooling: Pooling::Max,
            aggregate: Aggregate::Max,
        }
    }
}

impl ImportanceSpec {
    /// One line naming the settings, for tables.
    pub fn describe(&self) -> String {
        format!(
            "w={} pool={:?}{} agg={:?}",
            self.window, self.pooling, self.kernel, self.aggregate
        )
        .to_lowercase()
    }
}

/// Prefill `tokens` (host ids) as one row into `cache` (which must be empty), recording the
/// residual stream. Returns the last position's logits and the trace for [`score`].
pub fn prefill_traced(
    model: &Decoder,
    tokens: &[i64],
    cache: &mut KvCache,
    policy: &ExecPolicy,
) -> Result<(Tensor, Trace)> {
    if cache.batch() != 1 || cache.lens()[0] != 0 || tokens.is_empty() {
        return Err(Error::Spectrum(
            "prefill needs an empty one-row cache and at least one token".into(),
        ));
    }
    let ids = Tensor::f_from_slice(tokens)?.f_view([1, -1])?;
    let mut trace = Trace::default();
    let logits = model.forward_with(
        &ids,
        cache,
        policy,
        &crate::model::LogitsAt::Last,
        &mut trace,
    )?;
    Ok((logits, trace))
}

/// Per-token scores (length = the prefilled tokens) from the prefill of [`prefill_traced`].
pub fn score(
    model: &Decoder,
    tokens: &[i64],
    cache: &KvCache,
    trace: &Trace,
    spec: &ImportanceSpec,
    policy: &ExecPolicy,
) -> Result<Vec<f64>> {
    let _guard = tch::no_grad_guard();
    let n = tokens.len() as i64;
    if spec.window < 1 || spec.kernel < 1 || spec.kernel % 2 == 0 {
        return Err(Error::Spectrum(format!(
            "importance window {} and pooling kernel {} (odd) must be positive",
            spec.window, spec.kernel
        )));
    }
    let w = spec.window.min(n);
    let ids = Tensor::f_from_slice(tokens)?.f_view([1, -1])?;
    let queries = model.trace_queries(&ids, 0, trace, w, policy)?;
    let cfg = model.config();
    let device = model.device();
    let keys = Tensor::f_arange(n, (Kind::Int64, device))?.f_view([1, n])?;
    let qpos = Tensor::f_arange(w, (Kind::Int64, device))?
        .f_add_scalar(n - w)?
        .f_view([w, 1])?;
    let mut per_layer = Vec::with_capacity(queries.len());
    for (layer, q) in queries.iter().enumerate() {
        let (k, _) = cache.layer_kv(layer, n)?;
        let k = k.f_select(0, 0)?.f_to_kind(Kind::Float)?;
        let hkv = k.size()[0];
        let group = q.size()[1] / hkv;
        let d = q.size()[3];
        let qg = q
            .f_select(0, 0)?
            .f_to_kind(Kind::Float)?
            .f_reshape([hkv, group * w, d])?;
        let mut s = qg
            .f_matmul(&k.f_transpose(1, 2)?)?
            .f_mul_scalar(cfg.softmax_scale)?;
        if let Some(cap) = cfg.attn_logit_softcapping {
            s = s.f_div_scalar(cap)?.f_tanh()?.f_mul_scalar(cap)?;
        }
        let mut allowed = keys.f_le_tensor(&qpos)?;
        if let LayerKind::Sliding { window } = cfg.layer_types[layer] {
            allowed =
                allowed.f_logical_and(&keys.f_gt_tensor(&qpos.f_sub_scalar(window as i64)?)?)?;
        }
        let s = s
            .f_view([hkv, group, w, n])?
            .f_masked_fill(&allowed.f_logical_not()?, f64::NEG_INFINITY)?;
        let p = s.f_softmax(-1, Kind::Float)?;
        // Summed over the window's queries, averaged over the group's query heads: [Hkv, n].
        let a = p
            .f_sum_dim_intlist([2i64].as_slice(), false, Kind::Float)?
            .f_mean_dim([1i64].as_slice(), false, Kind::Float)?;
        let pad = spec.kernel / 2;
        let a = a.f_unsqueeze(1)?;
        let pooled = match spec.pooling {
            Pooling::Max => a.f_max_pool1d([spec.kernel], [1], [pad], [1], false)?,
            Pooling::Avg => a.f_avg_pool1d([spec.kernel], [1], [pad], false, false)?,
        };
        per_layer.push(pooled.f_squeeze_dim(1)?);
    }
    let all = Tensor::f_stack(&per_layer, 0)?.f_view([-1, n])?;
    let agg = match spec.aggregate {
        Aggregate::Max => all.f_amax([0], false)?,
        Aggregate::Mean => all.f_mean_dim([0i64].as_slice(), false, Kind::Float)?,
    };
    Ok(Vec::<f64>::try_from(
        agg.f_to_kind(Kind::Double)?.f_to_device(tch::Device::Cpu)?,
    )?)
}
