//! The wire format of a [`TieredKv`], version 1. All integers little-endian.
//!
//! ```text
//! header (40 bytes)
//!   0  magic "SPKV"          4  version u16 (1)     6  quantizer u8 (0 kivi,
//!                                                    1 lab-compat-token, 2 lab-compat)
//!   7  16-bit type u8 (0 fp16, 1 bf16)              8  group size u16 (32)
//!  10  index width u8 (2 if len ≤ 65536, else 4)   11  reserved u8 (0)
//!  12  layers u32   16  kv heads u32   20  head dim u32   24  context len u32
//!  28  tokens per stored tier: fp16, int8, int4 (u32 each)
//! index lists: per stored tier, its tokens' original positions in gathered order
//! per layer, per stored tier with tokens: K payload, K scales, K zeros, V payload, V scales,
//!   V zeros (sizes from quant::block_sizes)
//! trailer: SHA-256 of everything before it (32 bytes)
//! ```
//!
//! [`frame_len`] gives the exact size from the shape and the tier counts alone, so a budget
//! can be met before anything is quantized; [`decode`] checks the sizes, the bounds of every
//! header field and the fingerprint before it reads a block.
use super::quant::{self, BlockShape, GROUP, Side};
use super::tiers::{TierBlocks, TieredKv};
use super::{Quantizer, Tier};
use crate::kv_cache::KvShape;
use crate::{Error, Result};
use sha2::{Digest, Sha256};
use tch::Kind;

/// Format version written and accepted.
pub const VERSION: u16 = 1;
/// Bytes of the fixed header.
pub const HEADER: usize = 40;
/// Bytes of the fingerprint trailer.
pub const TRAILER: usize = 32;
const MAGIC: &[u8; 4] = b"SPKV";
/// The quantizer's code in header byte 6 (code 1 is the per-token scheme, code 2 per head).
fn quantizer_code(q: Quantizer) -> u8 {
    match q {
        Quantizer::Kivi => 0,
        Quantizer::LabCompatToken => 1,
        Quantizer::LabCompat => 2,
    }
}

/// Largest accepted layer count, head count and head width (a frame claiming more is bad).
const MAX_DIM: u32 = 4096;
/// Largest accepted context length.
const MAX_LEN: u32 = 1 << 24;

fn index_width(len: i64) -> usize {
    if len <= 1 << 16 { 2 } else { 4 }
}

/// Exact bytes of the frame of a `len`-token context of `shape` with `counts` tokens per stored
/// tier under quantizer `q`: header, index lists, blocks, trailer.
pub fn frame_len(shape: KvShape, len: i64, counts: [usize; 3], q: Quantizer) -> usize {
    let indices: usize = counts.iter().sum::<usize>() * index_width(len);
    let per_layer: usize = Tier::STORED
        .into_iter()
        .zip(counts)
        .map(|(tier, m)| {
            let s = BlockShape {
                heads: shape.kv_heads,
                tokens: m as i64,
                head_dim: shape.head_dim,
            };
            [Side::Key, Side::Value]
                .into_iter()
                .map(|side| {
                    let (p, sc, z) = quant::block_sizes(tier, q, side, s);
                    p + sc + z
                })
                .sum::<usize>()
        })
        .sum();
    HEADER + indices + shape.layers * per_layer + TRAILER
}

/// Bytes of the full-FP16 KV of a `len`-token context: `2 · L · Hkv · D · len · 2`, the
/// denominator of the budget.
pub fn fp16_bytes(shape: KvShape, len: i64) -> usize {
    2 * shape.layers * (shape.kv_heads * shape.head_dim * len) as usize * 2
}

/// Serialize with the fingerprint trailer.
pub fn encode(t: &TieredKv) -> Result<Vec<u8>> {
    let counts = t.index.clone().map(|i| i.len());
    let mut out = Vec::with_capacity(frame_len(t.shape, t.len, counts, t.quantizer));
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.push(quantizer_code(t.quantizer));
    out.push(u8::from(t.wire16 == Kind::BFloat16));
    out.extend_from_slice(&(GROUP as u16).to_le_bytes());
    let width = index_width(t.len);
    out.push(width as u8);
    out.push(0);
    for x in [
        t.shape.layers as u32,
        t.shape.kv_heads as u32,
        t.shape.head_dim as u32,
        t.len as u32,
    ] {
        out.extend_from_slice(&x.to_le_bytes());
    }
    for c in counts {
        out.extend_from_slice(&(c as u32).to_le_bytes());
    }
    for &p in t.index.iter().flatten() {
        out.extend_from_slice(&(p as u32).to_le_bytes()[..width]);
    }
    for layer in &t.layers {
        for (i, b) in layer.iter().enumerate() {
            if counts[i] == 0 {
                continue;
            }
            for block in [&b.k, &b.v] {
                out.extend_from_slice(&block.payload);
                out.extend_from_slice(&block.scales);
                out.extend_from_slice(&block.zeros);
            }
        }
    }
    let digest = Sha256::digest(&out);
    out.extend_from_slice(&digest);
    if out.len() != frame_len(t.shape, t.len, counts, t.quantizer) {
        return Err(Error::Spectrum(format!(
            "encoded {} bytes, the accounting says {}",
            out.len(),
            frame_len(t.shape, t.len, counts, t.quantizer)
        )));
    }
    Ok(out)
}

/// Whether every little-endian 16-bit number in `bytes` (`BFloat16`, else `Half`) is finite
/// (its exponent bits not all ones).
fn all_finite16(bytes: &[u8], kind: Kind) -> bool {
    let exp: u16 = if kind == Kind::BFloat16 {
        0x7F80
    } else {
        0x7C00
    };
    bytes
        .chunks_exact(2)
        .all(|c| u16::from_le_bytes([c[0], c[1]]) & exp != exp)
}

/// Parse and verify a frame (bounds, sizes, fingerprint, index lists).
pub fn decode(bytes: &[u8]) -> Result<TieredKv> {
    let bad = |m: String| Err(Error::Spectrum(format!("bad frame: {m}")));
    if bytes.len() < HEADER + TRAILER {
        return bad(format!("{} bytes is shorter than a header", bytes.len()));
    }
    if &bytes[..4] != MAGIC {
        return bad("wrong magic".into());
    }
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]);
    let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
    let version = u16_at(4);
    if version != VERSION {
        return bad(format!("version {version}, this build reads {VERSION}"));
    }
    let quantizer = match bytes[6] {
        0 => Quantizer::Kivi,
        1 => Quantizer::LabCompatToken,
        2 => Quantizer::LabCompat,
        x => return bad(format!("unknown quantizer {x}")),
    };
    let wire16 = match bytes[7] {
        0 => Kind::Half,
        1 => Kind::BFloat16,
        x => return bad(format!("unknown 16-bit type {x}")),
    };
    if u16_at(8) as i64 != GROUP {
        return bad(format!("group size {}, this build uses {GROUP}", u16_at(8)));
    }
    let (layers, heads, dim, len) = (u32_at(12), u32_at(16), u32_at(20), u32_at(24));
    if [layers, heads, dim].iter().any(|&x| x == 0 || x > MAX_DIM) || len > MAX_LEN || dim % 2 != 0
    {
        return bad(format!(
            "shape {layers} layers × {heads} heads × {dim} out of bounds (or len {len})"
        ));
    }
    let width = bytes[10] as usize;
    if width != index_width(len as i64) || bytes[11] != 0 {
        return bad(format!("index width {width} for a context of {len}"));
    }
    let counts = [u32_at(28), u32_at(32), u32_at(36)].map(|c| c as usize);
    if counts.iter().sum::<usize>() > len as usize {
        return bad(format!("{counts:?} stored tokens in a context of {len}"));
    }
    let shape = KvShape {
        layers: layers as usize,
        kv_heads: heads as i64,
        head_dim: dim as i64,
    };
    let want = frame_len(shape, len as i64, counts, quantizer);
    if bytes.len() != want {
        return bad(format!("{} bytes, the header implies {want}", bytes.len()));
    }
    let body = bytes.len() - TRAILER;
    if Sha256::digest(&bytes[..body])[..] != bytes[body..] {
        return bad("fingerprint mismatch (corrupted in transit?)".into());
    }
    let mut at = HEADER;
    let mut seen = vec![false; len as usize];
    let mut index: [Vec<i64>; 3] = Default::default();
    for (i, &c) in counts.iter().enumerate() {
        for _ in 0..c {
            let mut b = [0u8; 4];
            b[..width].copy_from_slice(&bytes[at..at + width]);
            at += width;
            let p = u32::from_le_bytes(b) as usize;
            if p >= len as usize || seen[p] {
                return bad(format!("index {p} out of range or repeated"));
            }
            seen[p] = true;
            index[i].push(p as i64);
        }
    }
    let mut take = |n: usize| {
        let s = bytes[at..at + n].to_vec();
        at += n;
        s
    };
    let mut out_layers = Vec::with_capacity(layers as usize);
    for layer in 0..layers {
        let mut blocks: [TierBlocks; 3] = Default::default();
        for (i, tier) in Tier::STORED.into_iter().enumerate() {
            if counts[i] == 0 {
                continue;
            }
            let s = BlockShape {
                heads: heads as i64,
                tokens: counts[i] as i64,
                head_dim: dim as i64,
            };
            for side in [Side::Key, Side::Value] {
                let (p, sc, z) = quant::block_sizes(tier, quantizer, side, s);
                let block = quant::Block {
                    payload: take(p),
                    scales: take(sc),
                    zeros: take(z),
                };
                // A signed frame can still carry NaN or infinite numbers; none is restored.
                let fp16_payload = tier == Tier::Fp16;
                if (fp16_payload && !all_finite16(&block.payload, wire16))
                    || !all_finite16(&block.scales, Kind::Half)
                    || !all_finite16(&block.zeros, Kind::Half)
                {
                    return bad(format!(
                        "non-finite number in layer {layer}, {} {side:?} block",
                        tier.name()
                    ));
                }
                match side {
                    Side::Key => blocks[i].k = block,
                    Side::Value => blocks[i].v = block,
                }
            }
        }
        out_layers.push(blocks);
    }
    Ok(TieredKv {
        shape,
        len: len as i64,
        quantizer,
        wire16,
        index,
        layers: out_layers,
    })
}
