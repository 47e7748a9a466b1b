//! Self-attention of one layer: fused q/k/v projection (optional biases), optional q/k RMSNorm
//! (per head, or over all heads at once as in OLMo-2), RoPE and the cache write (fused where [`glue`] runs), grouped-query attention through the
//! execution policy, output projection.
use super::norm::RmsNorm;
use crate::Result;
use crate::exec::glue::{self, CacheWrite, Glue};
use crate::exec::{AttnParams, AttnScratch, ExecPolicy};
use crate::kv_cache::{KvCache, KvWrite};
use tch::Tensor;

/// RMSNorms of the queries and keys before RoPE.
pub struct QkNorm {
    /// Query norm (`q_norm`).
    pub q: RmsNorm,
    /// Key norm (`k_norm`).
    pub k: RmsNorm,
    /// Each norm spans all heads' projection (`[Hq * D]`, `[Hkv * D]`) instead of one head
    /// (`[D]`).
    pub across_heads: bool,
}

impl QkNorm {
    /// Normalize `x` (`[B, T, heads * D]`) and view it as `[B, T, heads, D]`.
    fn apply(
        &self,
        norm: &RmsNorm,
        x: &Tensor,
        heads: i64,
        d: i64,
        policy: &ExecPolicy,
    ) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        if self.across_heads {
            Ok(norm.forward(x, policy)?.f_view([b, t, heads, d])?)
        } else {
            norm.forward(&x.f_view([b, t, heads, d])?, policy)
        }
    }
}

/// Attention weights and shape of one layer.
pub struct Attention {
    /// `[(Hq + 2 Hkv) * D, hidden]`: q rows, then k, then v.
    qkv: Tensor,
    qkv_bias: Option<Tensor>,
    o: Tensor,
    qk_norm: Option<QkNorm>,
    heads: i64,
    kv_heads: i64,
    head_dim: i64,
    scale: f64,
    softcap: Option<f64>,
}

/// Per-forward inputs shared by all layers of one kind.
pub struct LayerInputs<'a> {
    /// RoPE cosines `[B, 1, T, D]`.
    pub cos: &'a Tensor,
    /// RoPE sines `[B, 1, T, D]`, first half negated (see [`glue::rope_apply`]).
    pub sin: &'a Tensor,
    /// Additive mask `[B, 1, 1, T, L]`.
    pub mask: &'a Tensor,
    /// Absolute positions `[B, T]` (where new K/V rows are written).
    pub positions: &'a Tensor,
    /// How new K/V rows are written.
    pub write: KvWrite,
    /// Keys attended (`L`).
    pub key_len: i64,
    /// Scratch shared by the layers attending under `mask`.
    pub scratch: &'a AttnScratch,
    /// The glue that applies RoPE, writes the cache and scales and masks the scores.
    pub glue: Glue,
}

impl Attention {
    /// Build from checkpoint tensors (q/k/v fused here).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        bias: Option<(Tensor, Tensor, Tensor)>,
        o: Tensor,
        qk_norm: Option<QkNorm>,
        shape: (i64, i64, i64),
        scale: f64,
        softcap: Option<f64>,
    ) -> Result<Attention> {
        let (heads, kv_heads, head_dim) = shape;
        Ok(Attention {
            qkv: Tensor::f_cat(&[q, k, v], 0)?,
            qkv_bias: bias
                .map(|(bq, bk, bv)| Tensor::f_cat(&[bq, bk, bv], 0))
                .transpose()?,
            o,
            qk_norm,
            heads,
            kv_heads,
            head_dim,
            scale,
            softcap,
        })
    }

    /// Attend `x` (`[B, T, hidden]`) over the cache of `layer` plus the new tokens.
    pub fn forward(
        &self,
        x: &Tensor,
        layer: usize,
        cache: &mut KvCache,
        inputs: &LayerInputs,
        policy: &ExecPolicy,
    ) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let (hq, hkv, d) = (self.heads, self.kv_heads, self.head_dim);
        let qkv = policy.linear(x, &self.qkv, self.qkv_bias.as_ref())?;
        let to = CacheWrite {
            cache,
            layer,
            write: inputs.write,
            positions: inputs.positions,
            key_len: inputs.key_len,
        };
        let (q, k_all, v_all) = match &self.qk_norm {
            Some(n) => {
                let v = qkv
                    .f_narrow(-1, (hq + hkv) * d, hkv * d)?
                    .f_view([b, t, hkv, d])?
                    .f_transpose(1, 2)?;
                let q = n.apply(&n.q, &qkv.f_narrow(-1, 0, hq * d)?, hq, d, policy)?;
                let k = n.apply(&n.k, &qkv.f_narrow(-1, hq * d, hkv * d)?, hkv, d, policy)?;
                let q = glue::rope_apply(&q.f_transpose(1, 2)?, inputs.cos, inputs.sin)?;
                let k = glue::rope_apply(&k.f_transpose(1, 2)?, inputs.cos, inputs.sin)?;
                let (k_all, v_all) =
                    to.cache
                        .write(to.layer, &k, &v, to.write, to.positions, to.key_len)?;
                (q, k_all, v_all)
            }
            None => glue::rope_write(inputs.glue, &qkv, (hq, hkv, d), inputs.cos, inputs.sin, to)?,
        };
        let params = AttnParams {
            scale: self.scale,
            softcap: self.softcap,
            mask: inputs.mask,
            scratch: Some(inputs.scratch),
            glue: inputs.glue,
        };
        let out = policy.attention(&q, &k_all, &v_all, &params)?;
        let out = out.f_transpose(1, 2)?.f_reshape([b, t, hq * d])?;
        policy.linear(&out, &self.o, None)
    }

    /// The post-RoPE queries `[B, Hq, T, D]` this layer computes from `x` (`[B, T, hidden]`),
    /// as [`Self::forward`] does before attending; nothing is written to a cache.
    pub fn queries(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        policy: &ExecPolicy,
    ) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let (hq, d) = (self.heads, self.head_dim);
        let qkv = policy.linear(x, &self.qkv, self.qkv_bias.as_ref())?;
        let q = qkv.f_narrow(-1, 0, hq * d)?;
        let q = match &self.qk_norm {
            Some(n) => n.apply(&n.q, &q, hq, d, policy)?,
            None => q.f_view([b, t, hq, d])?,
        };
        glue::rope_apply(&q.f_transpose(1, 2)?, cos, sin)
    }
}
