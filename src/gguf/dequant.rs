//! De-quantization of ggml tensor types to `f32`.
//!
//! Each block decoder is a direct port of `dequantize_blocks` in gguf-py's `gguf/quants.py`
//! (the implementation Hugging Face transformers uses, itself matching ggml's
//! `dequantize_row_*`), with the same order of floating-point operations, so results are
//! bit-identical to it; `tests/gguf_dequant.rs` checks this on random blocks of every type.
use crate::{Error, Result};
use half::{bf16, f16};
use rayon::prelude::*;

/// Storage type of a GGUF tensor (ggml's `ggml_type` numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Bf16,
}

const QK_K: usize = 256;

impl GgmlType {
    /// Map ggml's numeric type id; `None` for types kvcredit cannot de-quantize.
    pub fn from_u32(t: u32) -> Option<GgmlType> {
        Some(match t {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::Bf16,
            _ => return None,
        })
    }

    /// ggml's numeric type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::Bf16 => 30,
        }
    }

    /// (elements per block, bytes per block).
    pub fn block(self) -> (usize, usize) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q2K => (QK_K, 84),
            GgmlType::Q3K => (QK_K, 110),
            GgmlType::Q4K => (QK_K, 144),
            GgmlType::Q5K => (QK_K, 176),
            GgmlType::Q6K => (QK_K, 210),
        }
    }
}

#[inline]
fn half(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// De-quantize `n` elements stored as `ty` in `data` (sizes are checked before the output is
/// allocated).
pub fn dequantize(ty: GgmlType, data: &[u8], n: usize) -> Result<Vec<f32>> {
    check_size(ty, data.len(), n)?;
    let mut out = vec![0f32; n];
    dequantize_into(ty, data, &mut out)?;
    Ok(out)
}

/// `n` elements of `ty` must fill whole blocks and occupy exactly `len` bytes.
fn check_size(ty: GgmlType, len: usize, n: usize) -> Result<()> {
    let (block, bytes) = ty.block();
    if !n.is_multiple_of(block) {
        return Err(Error::Gguf(format!(
            "{n} elements is not a multiple of the {ty:?} block size {block}"
        )));
    }
    let n_blocks = n / block;
    if n_blocks.checked_mul(bytes) != Some(len) {
        return Err(Error::Gguf(format!(
            "{ty:?} data has {len} bytes, expected {} for {n} elements",
            n_blocks as u128 * bytes as u128
        )));
    }
    Ok(())
}

/// De-quantize `data` (stored as `ty`) into `out`, whose length is the element count.
pub fn dequantize_into(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    check_size(ty, data.len(), out.len())?;
    let (block, bytes) = ty.block();
    let decode: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => |b, y| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, y| y[0] = half(b, 0),
        GgmlType::Bf16 => |b, y| y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q2K => q2_k,
        GgmlType::Q3K => q3_k,
        GgmlType::Q4K => q4_k,
        GgmlType::Q5K => q5_k,
        GgmlType::Q6K => q6_k,
    };
    // Work in chunks of many blocks so per-element types do not pay rayon's per-item cost.
    let per_chunk = (16384 / block).max(1);
    out.par_chunks_mut(per_chunk * block)
        .zip(data.par_chunks(per_chunk * bytes))
        .for_each(|(y, b)| {
            for (yb, bb) in y.chunks_exact_mut(block).zip(b.chunks_exact(bytes)) {
                decode(bb, yb);
            }
        });
    Ok(())
}

/// `d (f16) | qs[16]`: element j < 16 is the low nibble of qs[j], j >= 16 the high nibble of
/// qs[j - 16]; value `d * (q - 8)`.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * ((qs[j] & 0x0f) as i8 - 8) as f32;
        y[j + 16] = d * ((qs[j] >> 4) as i8 - 8) as f32;
    }
}

/// `d | m | qs[16]`: `d * q + m`.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let m = half(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = d * (qs[j] & 0x0f) as f32 + m;
        y[j + 16] = d * (qs[j] >> 4) as f32 + m;
    }
}

/// `d | qh (u32) | qs[16]`: bit j of qh is the fifth bit of element j; `d * (q - 16)`.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let lo = (qs[j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        let hi = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        y[j] = d * (lo as i8 - 16) as f32;
        y[j + 16] = d * (hi as i8 - 16) as f32;
    }
}

/// `d | m | qh | qs[16]`: `d * q + m`.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let m = half(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let lo = (qs[j] & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        let hi = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        y[j] = d * lo as f32 + m;
        y[j + 16] = d * hi as f32 + m;
    }
}

/// `d | qs[32] (i8)`: `q * d`.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    for j in 0..32 {
        y[j] = (b[2 + j] as i8) as f32 * d;
    }
}

/// `scales[16] | qs[64] | d | dmin`. Element o = h*128 + k*32 + j (h < 2, k < 4, j < 32) is
/// bits 2k..2k+2 of qs[h*32 + j]; group o/16 has scale `d * (s & 15)` and min
/// `dmin * (s >> 4)`; value `dl * q - ml`.
fn q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = half(b, 80);
    let dmin = half(b, 82);
    for h in 0..2 {
        for k in 0..4 {
            for j in 0..32 {
                let o = h * 128 + k * 32 + j;
                let s = scales[o / 16];
                let dl = d * (s & 0x0f) as f32;
                let ml = dmin * (s >> 4) as f32;
                let q = (qs[h * 32 + j] >> (2 * k)) & 3;
                y[o] = dl * q as f32 - ml;
            }
        }
    }
}

/// `hmask[32] | qs[64] | scales[12] | d`. Six-bit signed group scales (16 groups of 16); low
/// two bits as in Q2_K, the third bit from hmask (set bit means no offset): `d*sc * q`.
fn q3_k(b: &[u8], y: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let sc = &b[96..108];
    let d = half(b, 108);
    let mut dl = [0f32; 16];
    for (i, dl) in dl.iter_mut().enumerate() {
        let lo = (sc[i % 8] >> (4 * (i / 8))) & 0x0f;
        let hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 0x03;
        let s = ((lo | (hi << 4)) as i8).wrapping_sub(32);
        *dl = d * s as f32;
    }
    for h in 0..2 {
        for k in 0..4 {
            for j in 0..32 {
                let o = h * 128 + k * 32 + j;
                let ql = ((qs[h * 32 + j] >> (2 * k)) & 3) as i8;
                let qh = ((hmask[j] >> (o / 32)) & 1) ^ 1;
                let q = ql - ((qh << 2) as i8);
                y[o] = dl[o / 16] * q as f32;
            }
        }
    }
}

/// The eight 6-bit (scale, min) pairs of Q4_K/Q5_K packed in 12 bytes.
fn k_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for i in 0..4 {
        sc[i] = s[i] & 0x3f;
        mn[i] = s[4 + i] & 0x3f;
        sc[4 + i] = (s[8 + i] & 0x0f) | ((s[i] >> 2) & 0x30);
        mn[4 + i] = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30);
    }
    (sc, mn)
}

/// `d | dmin | scales[12] | qs[128]`: element o = c*64 + s*32 + j is nibble s of
/// qs[c*32 + j]; group g = o/32; value `(d*sc[g]) * q - dmin*m[g]`.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let dmin = half(b, 2);
    let (sc, mn) = k_scale_min(&b[4..16]);
    let qs = &b[16..144];
    for c in 0..4 {
        for s in 0..2 {
            let g = c * 2 + s;
            let dl = d * sc[g] as f32;
            let ml = dmin * mn[g] as f32;
            for j in 0..32 {
                let q = (qs[c * 32 + j] >> (4 * s)) & 0x0f;
                y[g * 32 + j] = dl * q as f32 - ml;
            }
        }
    }
}

/// `d | dmin | scales[12] | qh[32] | qs[128]`: as Q4_K with bit g of qh[j] as fifth bit.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let d = half(b, 0);
    let dmin = half(b, 2);
    let (sc, mn) = k_scale_min(&b[4..16]);
    let qh = &b[16..48];
    let qs = &b[48..176];
    for c in 0..4 {
        for s in 0..2 {
            let g = c * 2 + s;
            let dl = d * sc[g] as f32;
            let ml = dmin * mn[g] as f32;
            for j in 0..32 {
                let q = ((qs[c * 32 + j] >> (4 * s)) & 0x0f) | (((qh[j] >> g) & 1) << 4);
                y[g * 32 + j] = dl * q as f32 - ml;
            }
        }
    }
}

/// `ql[128] | qh[64] | scales[16] (i8) | d`. Element o = h*128 + r*32 + j (r < 4):
/// low nibble (r < 2) or high nibble (r >= 2) of ql[h*64 + (r%2)*32 + j], two high bits
/// `(qh[h*32 + j] >> 2r) & 3`; value `(d * scales[o/16]) * (q - 32)`.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let scales = &b[192..208];
    let d = half(b, 208);
    for h in 0..2 {
        for r in 0..4 {
            for j in 0..32 {
                let o = h * 128 + r * 32 + j;
                let lo = (ql[h * 64 + (r % 2) * 32 + j] >> (4 * (r / 2))) & 0x0f;
                let hi = (qh[h * 32 + j] >> (2 * r)) & 0x03;
                let q = ((lo | (hi << 4)) as i8) - 32;
                let dl = d * (scales[o / 16] as i8) as f32;
                y[o] = dl * q as f32;
            }
        }
    }
}
