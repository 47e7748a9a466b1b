//! Quantization of one tier's tokens of one layer, K or V, to the bytes the wire carries.
//!
//! Input is the gathered tokens of the tier, `[Hkv, m, D]`, post-RoPE (what the cache holds).
//! [`Quantizer::Kivi`] groups keys per channel (each group: up to [`GROUP`] consecutive gathered
//! tokens of one head and channel) and values per token (each group: up to [`GROUP`] channels
//! of one head and token); each group has an fp16 scale `(max − min) / (2^bits − 1)` and an
//! fp16 zero point `min`, codes are `round((x − zero) / scale)` clamped to `0..2^bits`.
//! [`Quantizer::LabCompat`] has one fp16 scale `max|x| / (2^(bits−1) − 1)` per token and KV
//! head (over the head's channels; scales in the row-major order of `[Hkv, m]`),
//! [`Quantizer::LabCompatToken`] one per token over all heads and channels (`[m]`); both store
//! codes `round(x / scale)` with an offset of `2^(bits−1)`.
//!
//! Codes are laid out in the row-major order of `[Hkv, m, D]`; INT4 packs element `2i` in
//! the low nibble and `2i + 1` in the high nibble of byte `i`. Scales and zeros are fp16
//! little-endian in the row-major order of their groups. The FP16 tier stores the elements'
//! 16-bit patterns (bf16 for bf16 caches, fp16 otherwise) and no scales.
use super::{Quantizer, Tier};
use crate::{Error, Result};
use tch::{Device, Kind, Tensor};

/// Group size of the group-wise quantizers (tokens for KIVI keys, channels for KIVI values).
pub const GROUP: i64 = 32;

/// K or V: KIVI groups them along different axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Keys.
    Key,
    /// Values.
    Value,
}

/// The bytes of one tier of one layer for K or V.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Block {
    /// Codes (packed two per byte for INT4), or 16-bit elements for the FP16 tier.
    pub payload: Vec<u8>,
    /// fp16 scales.
    pub scales: Vec<u8>,
    /// fp16 zero points (KIVI only).
    pub zeros: Vec<u8>,
}

impl Block {
    /// Bytes in all three parts.
    pub fn len(&self) -> usize {
        self.payload.len() + self.scales.len() + self.zeros.len()
    }

    /// Whether the block holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Shape of a block: `m` gathered tokens of `heads` heads of width `head_dim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockShape {
    /// Key/value heads.
    pub heads: i64,
    /// Tokens in the tier.
    pub tokens: i64,
    /// Per-head width.
    pub head_dim: i64,
}

/// Byte sizes `(payload, scales, zeros)` of a block.
pub fn block_sizes(tier: Tier, q: Quantizer, side: Side, s: BlockShape) -> (usize, usize, usize) {
    let elems = (s.heads * s.tokens * s.head_dim) as usize;
    let groups = |n: i64| ((n + GROUP - 1) / GROUP) as usize;
    match tier {
        Tier::Drop => (0, 0, 0),
        Tier::Fp16 => (2 * elems, 0, 0),
        Tier::Int8 | Tier::Int4 => {
            let payload = elems * tier.bits() / 8;
            let n = match (q, side) {
                (Quantizer::Kivi, Side::Key) => (s.heads * s.head_dim) as usize * groups(s.tokens),
                (Quantizer::Kivi, Side::Value) => {
                    (s.heads * s.tokens) as usize * groups(s.head_dim)
                }
                (Quantizer::LabCompat, _) => (s.heads * s.tokens) as usize,
                (Quantizer::LabCompatToken, _) => s.tokens as usize,
            };
            let zeros = if q == Quantizer::Kivi { 2 * n } else { 0 };
            (payload, 2 * n, zeros)
        }
    }
}

/// The 16-bit type the FP16 tier stores for a cache of `kind`.
pub fn wire16(kind: Kind) -> Kind {
    if kind == Kind::BFloat16 {
        Kind::BFloat16
    } else {
        Kind::Half
    }
}

fn to_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t
        .f_to_device(Device::Cpu)?
        .f_contiguous()?
        .f_view([-1])?
        .f_view_dtype(Kind::Uint8)?;
    Ok(Vec::<u8>::try_from(&t)?)
}

fn from_bytes(bytes: &[u8], kind: Kind, device: Device) -> Result<Tensor> {
    let t = Tensor::f_from_slice(bytes)?;
    let t = if kind == Kind::Uint8 {
        t
    } else {
        t.f_view_dtype(kind)?
    };
    Ok(t.f_to_device(device)?)
}

/// Quantize `x` (`[Hkv, m, D]`, any float type) to the tier's bytes.
pub fn encode(x: &Tensor, tier: Tier, q: Quantizer, side: Side) -> Result<Block> {
    let dims = x.size();
    if dims.len() != 3 {
        return Err(Error::Spectrum(format!(
            "block of shape {dims:?} is not [H, m, D]"
        )));
    }
    if dims[1] == 0 || tier == Tier::Drop {
        return Ok(Block::default());
    }
    if tier == Tier::Fp16 {
        return Ok(Block {
            payload: to_bytes(&x.f_to_kind(wire16(x.kind()))?)?,
            ..Block::default()
        });
    }
    let bits = tier.bits() as i64;
    let x = x.f_to_kind(Kind::Float)?;
    let (codes, scales, zeros) = match q {
        Quantizer::Kivi => {
            let (h, m, d) = (dims[0], dims[1], dims[2]);
            let grouped = match side {
                Side::Key => x.shallow_clone(),
                Side::Value => x.f_reshape([h * m, d, 1])?,
            };
            let (codes, scale, zero) = asymmetric(&grouped, bits)?;
            (codes.f_reshape([h, m, d])?, scale, Some(zero))
        }
        Quantizer::LabCompat | Quantizer::LabCompatToken => {
            let qmax = ((1 << (bits - 1)) - 1) as f64;
            // Per head: the max over channels; per token: over heads and channels.
            let dims: &[i64] = if q == Quantizer::LabCompat {
                &[2]
            } else {
                &[0, 2]
            };
            let amax = x.f_abs()?.f_amax(dims, true)?;
            let scale = amax.f_div_scalar(qmax)?.f_to_kind(Kind::Half)?;
            let s = nonzero(&scale.f_to_kind(Kind::Float)?)?;
            let codes = x
                .f_div(&s)?
                .f_round()?
                .f_clamp(-qmax, qmax)?
                .f_add_scalar(qmax + 1.0)?;
            (codes, scale, None)
        }
    };
    if !bool::try_from(scales.f_isfinite()?.f_all()?)? {
        return Err(Error::Spectrum(format!(
            "a {} scale overflows fp16 (|x| up to {:.3e})",
            tier.name(),
            x.f_abs()?.f_max()?.f_double_value(&[])?
        )));
    }
    let codes = codes.f_to_kind(Kind::Int64)?;
    let packed = if tier == Tier::Int4 {
        let pairs = codes.f_reshape([-1, 2])?;
        pairs
            .f_select(1, 0)?
            .f_add(&pairs.f_select(1, 1)?.f_mul_scalar(16)?)?
    } else {
        codes.f_reshape([-1])?
    };
    Ok(Block {
        payload: to_bytes(&packed.f_to_kind(Kind::Uint8)?)?,
        scales: to_bytes(&scales)?,
        zeros: match zeros {
            Some(z) => to_bytes(&z)?,
            None => Vec::new(),
        },
    })
}

/// A scale with zeros replaced by ones (a constant group: every code is 0).
fn nonzero(s: &Tensor) -> Result<Tensor> {
    Ok(s.f_where_scalarother(&s.f_gt(0.0)?, 1.0)?)
}

/// Asymmetric min/max over groups of [`GROUP`] along dim 1 of `x` (`[A, N, B]`, fp32):
/// codes `[A, N, B]` (fp32, integral), scales and zeros `[A, ⌈N/G⌉, B]` (fp16).
fn asymmetric(x: &Tensor, bits: i64) -> Result<(Tensor, Tensor, Tensor)> {
    let (a, n, b) = (x.size()[0], x.size()[1], x.size()[2]);
    let ng = (n + GROUP - 1) / GROUP;
    let grouped = pad_groups(x, ng)?.f_view([a, ng, GROUP, b])?;
    let qmax = ((1 << bits) - 1) as f64;
    let lo = grouped.f_amin([2], false)?;
    let hi = grouped.f_amax([2], false)?;
    let scale = hi.f_sub(&lo)?.f_div_scalar(qmax)?.f_to_kind(Kind::Half)?;
    let zero = lo.f_to_kind(Kind::Half)?;
    let s = scale.f_to_kind(Kind::Float)?;
    let z = zero.f_to_kind(Kind::Float)?.f_unsqueeze(2)?;
    let codes = grouped
        .f_sub(&z)?
        .f_div(&nonzero(&s)?.f_unsqueeze(2)?)?
        .f_round()?
        .f_clamp(0.0, qmax)?
        .f_where_scalarother(&s.f_gt(0.0)?.f_unsqueeze(2)?, 0.0)?;
    let codes = codes.f_view([a, ng * GROUP, b])?.f_narrow(1, 0, n)?;
    Ok((codes, scale, zero))
}

/// `x` (`[A, N, B]`) padded along dim 1 to `ng · GROUP` by repeating its last row, which lies
/// in the last group already and so changes no group's min or max.
fn pad_groups(x: &Tensor, ng: i64) -> Result<Tensor> {
    let (a, n, b) = (x.size()[0], x.size()[1], x.size()[2]);
    let pad = ng * GROUP - n;
    if pad == 0 {
        return Ok(x.shallow_clone());
    }
    let last = x.f_narrow(1, n - 1, 1)?.f_expand([a, pad, b], false)?;
    Ok(Tensor::f_cat(&[x, &last], 1)?)
}

/// Restore `[Hkv, m, D]` in `out` (dtype) on `device` from a block written by [`encode`] for a
/// cache of `cache_kind`. Sizes are checked against [`block_sizes`].
#[allow(clippy::too_many_arguments)]
pub fn decode(
    block: &Block,
    tier: Tier,
    q: Quantizer,
    side: Side,
    shape: BlockShape,
    cache_kind: Kind,
    out: Kind,
    device: Device,
) -> Result<Tensor> {
    let BlockShape {
        heads: h,
        tokens: m,
        head_dim: d,
    } = shape;
    let sizes = (block.payload.len(), block.scales.len(), block.zeros.len());
    let want = block_sizes(tier, q, side, shape);
    if sizes != want {
        return Err(Error::Spectrum(format!(
            "{} block of {m} tokens: {sizes:?} bytes (payload, scales, zeros), expected {want:?}",
            tier.name()
        )));
    }
    if m == 0 || tier == Tier::Drop {
        return Ok(Tensor::f_zeros([h, m, d], (out, device))?);
    }
    if tier == Tier::Fp16 {
        let x = from_bytes(&block.payload, wire16(cache_kind), device)?;
        return Ok(x.f_view([h, m, d])?.f_to_kind(out)?);
    }
    let bytes = from_bytes(&block.payload, Kind::Uint8, device)?.f_to_kind(Kind::Int64)?;
    let codes = if tier == Tier::Int4 {
        Tensor::f_stack(
            &[bytes.f_remainder(16)?, bytes.f_floor_divide_scalar(16)?],
            1,
        )?
    } else {
        bytes
    };
    let codes = codes.f_to_kind(Kind::Float)?.f_view([h, m, d])?;
    let scales = from_bytes(&block.scales, Kind::Half, device)?.f_to_kind(Kind::Float)?;
    let x = match q {
        Quantizer::Kivi => {
            let zeros = from_bytes(&block.zeros, Kind::Half, device)?.f_to_kind(Kind::Float)?;
            let (a, n, b) = match side {
                Side::Key => (h, m, d),
                Side::Value => (h * m, d, 1),
            };
            let ng = (n + GROUP - 1) / GROUP;
            let grouped =
                pad_groups(&codes.f_reshape([a, n, b])?, ng)?.f_view([a, ng, GROUP, b])?;
            let x = grouped
                .f_mul(&scales.f_view([a, ng, 1, b])?)?
                .f_add(&zeros.f_view([a, ng, 1, b])?)?;
            x.f_view([a, ng * GROUP, b])?
                .f_narrow(1, 0, n)?
                .f_reshape([h, m, d])?
        }
        Quantizer::LabCompat | Quantizer::LabCompatToken => {
            let offset = (1i64 << (tier.bits() - 1)) as f64;
            let per = if q == Quantizer::LabCompat { h } else { 1 };
            codes
                .f_sub_scalar(offset)?
                .f_mul(&scales.f_view([per, m, 1])?)?
        }
    };
    Ok(x.f_to_kind(out)?)
}
