//! The tiered representation of one row of a KV cache: per token a [`Tier`], the tokens of
//! each stored tier gathered (their original positions kept as index lists), and per layer
//! and tier the K and V [`Block`]s. Built from a dense cache; restored into an ordinary
//! [`KvCache`] whose dropped positions are masked, so the decoder runs unchanged.
use super::quant::{self, Block, BlockShape, Side};
use super::{Quantizer, Tier};
use crate::kv_cache::{KvCache, KvShape, KvWrite};
use crate::{Error, Result};
use tch::{Device, Kind, Tensor};

/// A tier per context token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierPlan {
    tiers: Vec<Tier>,
}

impl TierPlan {
    /// A plan from one tier per token.
    pub fn new(tiers: Vec<Tier>) -> TierPlan {
        TierPlan { tiers }
    }

    /// Every one of `n` tokens at `tier`.
    pub fn uniform(n: usize, tier: Tier) -> TierPlan {
        TierPlan {
            tiers: vec![tier; n],
        }
    }

    /// Tokens in the plan.
    pub fn len(&self) -> usize {
        self.tiers.len()
    }

    /// Whether the plan has no tokens.
    pub fn is_empty(&self) -> bool {
        self.tiers.is_empty()
    }

    /// The tier of each token.
    pub fn tiers(&self) -> &[Tier] {
        &self.tiers
    }

    /// Tokens per stored tier, in [`Tier::STORED`] order.
    pub fn counts(&self) -> [usize; 3] {
        let mut c = [0; 3];
        for t in &self.tiers {
            if let Some(i) = Tier::STORED.iter().position(|s| s == t) {
                c[i] += 1;
            }
        }
        c
    }

    /// Tokens dropped.
    pub fn dropped(&self) -> usize {
        self.tiers.iter().filter(|&&t| t == Tier::Drop).count()
    }

    /// Positions of the tokens at `tier`, ascending: the gathering order.
    pub fn positions(&self, tier: Tier) -> Vec<i64> {
        (0..self.tiers.len() as i64)
            .filter(|&i| self.tiers[i as usize] == tier)
            .collect()
    }
}

/// K and V blocks of one stored tier of one layer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierBlocks {
    /// Keys.
    pub k: Block,
    /// Values.
    pub v: Block,
}

/// A tiered snapshot of `len` context positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TieredKv {
    /// Layers, heads and width.
    pub shape: KvShape,
    /// Context positions (stored and dropped).
    pub len: i64,
    /// How INT8/INT4 are quantized.
    pub quantizer: Quantizer,
    /// 16-bit type of the FP16 tier (fp16 or bf16).
    pub wire16: Kind,
    /// Original positions of each stored tier's tokens in gathered order ([`Tier::STORED`]).
    pub index: [Vec<i64>; 3],
    /// Per layer, per stored tier.
    pub layers: Vec<[TierBlocks; 3]>,
}

impl TieredKv {
    /// Quantize positions `0..plan.len()` of `row` of `cache` as `plan` says.
    pub fn build(cache: &KvCache, row: usize, plan: &TierPlan, q: Quantizer) -> Result<TieredKv> {
        let len = plan.len() as i64;
        if row >= cache.batch() || len > cache.lens()[row] {
            return Err(Error::Spectrum(format!(
                "a plan of {len} tokens does not fit row {row} of the cache"
            )));
        }
        let shape = cache.shape();
        let index = Tier::STORED.map(|t| plan.positions(t));
        let idx: Vec<Tensor> = index
            .iter()
            .map(|p| Ok(Tensor::f_from_slice(p)?.f_to_device(cache.device())?))
            .collect::<Result<_>>()?;
        let mut layers = Vec::with_capacity(shape.layers);
        for layer in 0..shape.layers {
            let (k, v) = cache.layer_kv(layer, len)?;
            let (k, v) = (k.f_select(0, row as i64)?, v.f_select(0, row as i64)?);
            let mut blocks: [TierBlocks; 3] = Default::default();
            for (i, tier) in Tier::STORED.into_iter().enumerate() {
                if index[i].is_empty() {
                    continue;
                }
                blocks[i] = TierBlocks {
                    k: quant::encode(&k.f_index_select(1, &idx[i])?, tier, q, Side::Key)?,
                    v: quant::encode(&v.f_index_select(1, &idx[i])?, tier, q, Side::Value)?,
                };
            }
            layers.push(blocks);
        }
        Ok(TieredKv {
            shape,
            len,
            quantizer: q,
            wire16: quant::wire16(cache.kind()),
            index,
            layers,
        })
    }

    /// Positions no tier stores, ascending.
    pub fn dropped(&self) -> Vec<i64> {
        let mut stored = vec![false; self.len as usize];
        for p in self.index.iter().flatten() {
            stored[*p as usize] = true;
        }
        (0..self.len).filter(|&p| !stored[p as usize]).collect()
    }

    /// Shape of the block of stored tier `i`.
    pub fn block_shape(&self, i: usize) -> BlockShape {
        BlockShape {
            heads: self.shape.kv_heads,
            tokens: self.index[i].len() as i64,
            head_dim: self.shape.head_dim,
        }
    }

    /// Dequantized K and V of `layer`, `[Hkv, len, D]` each in `kind` on `device`: stored
    /// tokens at their original positions, zeros at dropped ones.
    pub fn layer_dense(
        &self,
        layer: usize,
        kind: Kind,
        device: Device,
    ) -> Result<(Tensor, Tensor)> {
        let (h, d) = (self.shape.kv_heads, self.shape.head_dim);
        let mut k = Tensor::f_zeros([h, self.len, d], (kind, device))?;
        let mut v = Tensor::f_zeros([h, self.len, d], (kind, device))?;
        for (i, tier) in Tier::STORED.into_iter().enumerate() {
            if self.index[i].is_empty() {
                continue;
            }
            let shape = self.block_shape(i);
            let b = &self.layers[layer][i];
            let src16 = self.wire16;
            let idx = Tensor::f_from_slice(&self.index[i])?.f_to_device(device)?;
            let kq = quant::decode(
                &b.k,
                tier,
                self.quantizer,
                Side::Key,
                shape,
                src16,
                kind,
                device,
            )?;
            let vq = quant::decode(
                &b.v,
                tier,
                self.quantizer,
                Side::Value,
                shape,
                src16,
                kind,
                device,
            )?;
            let _ = k.f_index_copy_(1, &idx, &kq)?;
            let _ = v.f_index_copy_(1, &idx, &vq)?;
        }
        Ok((k, v))
    }

    /// Refuse a context that the receiving model cannot hold: another KV shape, or more than
    /// `max_positions` positions with `extra` to decode (checked before anything is
    /// allocated, since a frame whose tokens are all dropped is tiny for any claimed length).
    pub fn check_fits(&self, shape: KvShape, max_positions: usize, extra: i64) -> Result<()> {
        if self.shape != shape {
            let s = |x: KvShape| {
                format!(
                    "{} layers × {} heads × {}",
                    x.layers, x.kv_heads, x.head_dim
                )
            };
            return Err(Error::Spectrum(format!(
                "frame KV shape {} does not match the model's {}",
                s(self.shape),
                s(shape)
            )));
        }
        let need = self.len as u64 + extra.max(0) as u64;
        if need > max_positions as u64 {
            return Err(Error::Spectrum(format!(
                "frame context of {} positions plus {extra} to decode exceeds the model's limit of {max_positions}",
                self.len
            )));
        }
        Ok(())
    }

    /// A one-row cache (`kind`, `device`, room for `extra` more positions) holding the
    /// dequantized context, dropped positions masked out of attention.
    pub fn restore(&self, kind: Kind, device: Device, extra: i64) -> Result<KvCache> {
        let mut cache = KvCache::new(self.shape, 1, self.len + extra, kind, device)?;
        if self.len == 0 {
            return Ok(cache);
        }
        let none = Tensor::f_zeros([1, self.len], (Kind::Int64, device))?;
        for layer in 0..self.shape.layers {
            let (k, v) = self.layer_dense(layer, kind, device)?;
            let _ = cache.write(
                layer,
                &k.f_unsqueeze(0)?,
                &v.f_unsqueeze(0)?,
                KvWrite::At(0),
                &none,
                self.len,
            )?;
        }
        cache.advance(self.len);
        cache.mask_positions(0, &self.dropped())?;
        Ok(cache)
    }

    /// Bytes of all blocks (payload, scales, zeros), without header, indices and trailer.
    pub fn block_bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| l.iter())
            .map(|b| b.k.len() + b.v.len())
            .sum()
    }
}
