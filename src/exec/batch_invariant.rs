//! Batch-invariant policy: every reduction runs through a call of a *fixed shape*, so a
//! token's numerics cannot depend on how many other tokens share the forward pass.
//!
//! Library kernels (cuBLAS, MKL/oneDNN, the ATen reduction kernels) choose their algorithm —
//! split-K, tile shape, threads per output, vector width — from the shapes, strides and
//! alignment of a call; those choices change the order in which a dot product or a row sum is
//! accumulated, which is why stock results move with the batch. Within one call of a given
//! shape, every output row is computed the same way, whatever its position or neighbours (this
//! is measured, not assumed: see `tests/invariance.rs` and `kvcredit invariance`). So:
//!
//! * **linear**: the rows (`B·T`) are copied into a fresh zero-padded buffer whose row count
//!   is a multiple of [`BiTiles::gemm_rows`], and one `[gemm_rows, K] × [K, N]` matmul is issued
//!   per tile.
//! * **RMSNorm**: the squares are summed over row tiles of [`BiTiles::norm_rows`] rows; the rest
//!   is elementwise.
//! * **attention**: split-KV ("flash-decoding") with a fixed key chunk. Queries are grouped
//!   into blocks of [`BiTiles::query_tile`] positions of one sequence (all query heads of a KV
//!   head folded into the rows); each (block, key chunk) pair is a work unit; units are
//!   batched [`BiTiles::units`] at a time into fixed-shape batched matmuls that return, per
//!   query and chunk, the chunk max `m_c`, `l_c = Σ exp(s − m_c)` and `o_c = Σ exp(s − m_c)·v`.
//!   Chunks are then combined with the exact max `M = max_c m_c` (max is order-free) by a
//!   sequential fold over chunks in key order: `Σ_c o_c·exp(m_c − M) / Σ_c l_c·exp(m_c − M)`.
//!   A key always lands in the same chunk at the same offset, whatever `L` is; chunks a query
//!   cannot see get `exp(m_c − M) = 0` exactly and add an exact zero, and trailing chunks only
//!   append zeros to the fold, so neither the number of chunks nor the values of masked keys
//!   reach a query's result. Everything inside attention is fp32.
//! * **activations**: on the CPU, ATen's SiLU/GELU-tanh/sigmoid use a vectorized (SLEEF) path
//!   for the body of a buffer and a scalar path for its tail, so an element's result depends on
//!   where it lands in the buffer. They are composed here from `exp`, `tanh` and `erf`, whose
//!   two paths agree bitwise (measured), computed in fp32.
//!
//! Tile sizes are per device ([`BiTiles::for_device`]): a large row tile is free on the GPU but
//! multiplies the work of a batch-1 decode on the CPU. Results are invariant for *one* tile
//! configuration; changing the tiles changes the numerics (like changing the kernel), so keep
//! them fixed across runs that are compared. The tiles travel in the policy value
//! ([`super::ExecPolicy::BatchInvariant`]): they are resolved once from a command's arguments
//! (`--tiles`, else `KVCREDIT_BI_TILES`, over the device's defaults) and recorded in every
//! manifest.
use super::{AttnParams, accum_kind};
use crate::config::Activation;
use crate::{Error, Result};
use tch::{Device, Kind, Tensor};

/// Which kernels the batch-invariant policy runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BiKernels {
    /// Fixed-shape ATen calls (this module): any device; the tiles below set the shapes.
    #[default]
    Aten,
    /// CUDA only ([`super::fused`]): linear layers as single cuBLASLt GEMMs of at most
    /// `gemm_rows` rows under M-invariant settings (long-K weights in two fixed K slices),
    /// and NVRTC-compiled kernels for attention (blocks of `key_chunk` keys dealt to eight
    /// warps), RMSNorm and the activation. `norm_rows`, `query_tile` and `units` are not used.
    ///
    /// Recorded as `fused3`, the third revision (2026-12-02: eight warps per attention block);
    /// the first (`fused`: one block walking the keys in series) and the second (`fused2`: four
    /// warps) had other numerics, so their records fail to load instead of resuming under these.
    #[serde(rename = "fused3")]
    Fused,
}

impl BiKernels {
    fn is_aten(&self) -> bool {
        *self == BiKernels::Aten
    }
}

/// Fixed shapes of the batch-invariant policy's calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BiTiles {
    /// Rows per matmul of a linear layer.
    pub gemm_rows: i64,
    /// Rows per row-sum call of RMSNorm.
    pub norm_rows: i64,
    /// Query positions of one sequence per attention block.
    pub query_tile: i64,
    /// Keys per attention chunk.
    pub key_chunk: i64,
    /// (block, chunk) units per batched attention matmul.
    pub units: i64,
    /// The kernels these tiles are for (absent from records made before fused kernels
    /// existed: those ran [`BiKernels::Aten`]).
    #[serde(default, skip_serializing_if = "BiKernels::is_aten")]
    pub kernels: BiKernels,
}

impl BiTiles {
    /// CPU defaults: a 16-row matmul tile costs ~2× a single-row decode GEMV on MKL and ~3× a
    /// one-shot prefill GEMM (see the README numbers); attention tiles are small.
    pub const CPU: BiTiles = BiTiles {
        gemm_rows: 16,
        norm_rows: 64,
        query_tile: 4,
        key_chunk: 32,
        units: 8,
        kernels: BiKernels::Aten,
    };
    /// CUDA defaults of the ATen kernels: tiles large enough that a batch of 128 decoding
    /// rows is one matmul.
    pub const CUDA_ATEN: BiTiles = BiTiles {
        gemm_rows: 128,
        norm_rows: 1024,
        query_tile: 8,
        key_chunk: 128,
        units: 256,
        kernels: BiKernels::Aten,
    };
    /// CUDA defaults: the fused kernels, GEMMs of up to 512 rows (the range over which the
    /// cuBLASLt settings were measured M-invariant on the H200), 32-key attention blocks.
    pub const CUDA: BiTiles = BiTiles {
        gemm_rows: 512,
        norm_rows: 1024,
        query_tile: 8,
        key_chunk: 32,
        units: 256,
        kernels: BiKernels::Fused,
    };

    /// The default tiles of `device`'s kind.
    pub fn for_device(device: Device) -> BiTiles {
        match device {
            Device::Cpu => BiTiles::CPU,
            _ => BiTiles::CUDA,
        }
    }

    /// `gemm_rows=…,norm_rows=…,query_tile=…,key_chunk=…,units=…` (then `,kernels=fused3`
    /// for the fused kernels).
    pub fn describe(&self) -> String {
        let mut s = format!(
            "gemm_rows={},norm_rows={},query_tile={},key_chunk={},units={}",
            self.gemm_rows, self.norm_rows, self.query_tile, self.key_chunk, self.units
        );
        if self.kernels == BiKernels::Fused {
            s.push_str(",kernels=fused3");
        }
        s
    }
}

/// Partial tile settings, e.g. parsed from `gemm_rows=64,key_chunk=256`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TileOverrides {
    /// See [`BiTiles::gemm_rows`].
    pub gemm_rows: Option<i64>,
    /// See [`BiTiles::norm_rows`].
    pub norm_rows: Option<i64>,
    /// See [`BiTiles::query_tile`].
    pub query_tile: Option<i64>,
    /// See [`BiTiles::key_chunk`].
    pub key_chunk: Option<i64>,
    /// See [`BiTiles::units`].
    pub units: Option<i64>,
    /// See [`BiTiles::kernels`].
    pub kernels: Option<BiKernels>,
}

impl TileOverrides {
    /// Parse `key=value` pairs separated by commas (empty string: no overrides).
    pub fn parse(s: &str) -> Result<TileOverrides> {
        let mut o = TileOverrides::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| Error::Spec(format!("tile setting `{part}` is not key=value")))?;
            if k.trim() == "kernels" {
                o.kernels = Some(match v.trim() {
                    "aten" => BiKernels::Aten,
                    "fused" | "fused3" => BiKernels::Fused,
                    other => {
                        return Err(Error::Spec(format!(
                            "tile setting `kernels={other}`: expected aten or fused"
                        )));
                    }
                });
                continue;
            }
            let v: i64 = v.trim().parse().ok().filter(|v| *v > 0).ok_or_else(|| {
                Error::Spec(format!("tile setting `{part}`: not a positive integer"))
            })?;
            let slot = match k.trim() {
                "gemm_rows" => &mut o.gemm_rows,
                "norm_rows" => &mut o.norm_rows,
                "query_tile" => &mut o.query_tile,
                "key_chunk" => &mut o.key_chunk,
                "units" => &mut o.units,
                other => {
                    return Err(Error::Spec(format!(
                        "unknown tile setting `{other}` (gemm_rows, norm_rows, query_tile, key_chunk, units, kernels)"
                    )));
                }
            };
            *slot = Some(v);
        }
        Ok(o)
    }

    /// `t` with the settings given here replaced.
    pub fn apply(&self, mut t: BiTiles) -> BiTiles {
        t.gemm_rows = self.gemm_rows.unwrap_or(t.gemm_rows);
        t.norm_rows = self.norm_rows.unwrap_or(t.norm_rows);
        t.query_tile = self.query_tile.unwrap_or(t.query_tile);
        t.key_chunk = self.key_chunk.unwrap_or(t.key_chunk);
        t.units = self.units.unwrap_or(t.units);
        t.kernels = self.kernels.unwrap_or(t.kernels);
        t
    }
}

fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// `x` (`[…, K]`) as a fresh zero-padded `[tiles·rows, K]` buffer, with the number of real rows.
fn padded_rows(x: &Tensor, rows_per_tile: i64, kind: Kind) -> Result<(Tensor, i64, i64)> {
    let dims = x.size();
    let k = super::last_dim(x)?;
    let rows: i64 = dims[..dims.len() - 1].iter().product();
    let tiles = ceil_div(rows.max(1), rows_per_tile);
    let buf = Tensor::f_zeros([tiles * rows_per_tile, k], (kind, x.device()))?;
    if rows > 0 {
        buf.f_narrow(0, 0, rows)?
            .f_copy_(&x.f_reshape([rows, k])?)?;
    }
    Ok((buf, rows, tiles))
}

/// `parts` joined along dimension 0 (the one part itself when there is one).
fn join(parts: Vec<Tensor>) -> Result<Tensor> {
    if parts.len() == 1 {
        Ok(parts.into_iter().next().expect("one part"))
    } else {
        Ok(Tensor::f_cat(&parts, 0)?)
    }
}

/// `x @ w^T + b`, one fixed-shape matmul per row tile.
pub(super) fn linear(
    tiles: &BiTiles,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
) -> Result<Tensor> {
    let m = tiles.gemm_rows;
    let dims = x.size();
    let n = w.size()[0];
    let (buf, rows, tiles) = padded_rows(x, m, x.kind())?;
    let outs = (0..tiles)
        .map(|i| Ok(aligned_rows(&buf, i * m, m)?.f_linear(w, b)?))
        .collect::<Result<Vec<Tensor>>>()?;
    let out = join(outs)?;
    let mut shape = dims[..dims.len() - 1].to_vec();
    shape.push(n);
    Ok(out.f_narrow(0, 0, rows)?.f_reshape(shape)?)
}

/// Rows `start..start + n` of the 2-D `flat`, with the pointer alignment a BLAS library sees
/// (up to 256 bytes) of `flat`'s own: a view when the row offset keeps it, else a copy. So a
/// tile's GEMM does not depend on where the tile sits in the batch.
pub(super) fn aligned_rows(flat: &Tensor, start: i64, n: i64) -> Result<Tensor> {
    let piece = flat.f_narrow(0, start, n)?;
    let offset = start * flat.size()[1] * flat.kind().elt_size_in_bytes() as i64;
    if offset % 256 == 0 {
        return Ok(piece);
    }
    let mut fresh = piece.f_empty_like()?;
    fresh.f_copy_(&piece)?;
    Ok(fresh)
}

/// `x / rms(x)` in fp32 (fp64 for fp64 runs) over the last dimension, the sums of squares taken over fixed row tiles.
pub(super) fn rms_normalize(tiles: &BiTiles, x: &Tensor, eps: f64) -> Result<Tensor> {
    let m = tiles.norm_rows;
    let dims = x.size();
    let h = super::last_dim(x)?;
    let acc = accum_kind(x.kind());
    let xf = x.f_to_kind(acc)?;
    // The squares, written straight into a zero-padded buffer of whole tiles.
    let rows: i64 = dims[..dims.len() - 1].iter().product();
    let tiles = ceil_div(rows.max(1), m);
    let buf = Tensor::f_zeros([tiles * m, h], (acc, x.device()))?;
    if rows > 0 {
        let flat = xf.f_reshape([rows, h])?;
        let _ = flat.f_mul_out(&buf.f_narrow(0, 0, rows)?, &flat)?;
    }
    let sums = (0..tiles)
        .map(|i| {
            Ok(buf
                .f_narrow(0, i * m, m)?
                .f_sum_dim_intlist([-1i64].as_slice(), false, acc)?)
        })
        .collect::<Result<Vec<Tensor>>>()?;
    let sums = join(sums)?;
    let mut shape = dims[..dims.len() - 1].to_vec();
    shape.push(1);
    let var = sums
        .f_narrow(0, 0, rows)?
        .f_reshape(shape)?
        .f_div_scalar(h as f64)?;
    Ok(xf.f_mul(&var.f_add_scalar(eps)?.f_rsqrt()?)?)
}

/// MLP activation from position-independent elementwise primitives, in fp32 (fp64 for fp64).
pub(super) fn activation(x: &Tensor, act: Activation) -> Result<Tensor> {
    let xf = x.f_to_kind(accum_kind(x.kind()))?;
    let y = match act {
        Activation::Silu => xf.f_div(&xf.f_neg()?.f_exp()?.f_add_scalar(1.0)?)?,
        Activation::GeluTanh => {
            // 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), as ATen writes it.
            let k_beta = std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5;
            let cube = xf.f_mul(&xf)?.f_mul(&xf)?;
            let inner = xf
                .f_add(&cube.f_mul_scalar(0.044715)?)?
                .f_mul_scalar(k_beta)?;
            xf.f_mul_scalar(0.5)?
                .f_mul(&inner.f_tanh()?.f_add_scalar(1.0)?)?
        }
        Activation::Gelu => xf.f_mul_scalar(0.5)?.f_mul(
            &xf.f_mul_scalar(std::f64::consts::FRAC_1_SQRT_2)?
                .f_erf()?
                .f_add_scalar(1.0)?,
        )?,
    };
    Ok(y.f_to_kind(x.kind())?)
}

/// Grouped-query attention by fixed-shape split-KV; see the module documentation.
pub(super) fn attention(
    tiles: &BiTiles,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttnParams,
) -> Result<Tensor> {
    let (b, hq, t, d) = q.size4()?;
    let (hkv, l) = (k.size()[1], k.size()[2]);
    let group = hq / hkv;
    let (tq, c, w) = (tiles.query_tile, tiles.key_chunk, tiles.units);
    let (nt, nc) = (ceil_div(t, tq), ceil_div(l, c));
    let (t_pad, l_pad) = (nt * tq, nc * c);
    let rows = group * tq;
    let f = accum_kind(q.kind());
    let dev = q.device();

    let msize = p.mask.size();
    if !(msize.len() == 5 && msize[1] == 1 && msize[2] == 1) {
        return Err(Error::Torch(format!(
            "batch-invariant attention needs a mask of shape [B, 1, 1, T, L], got {msize:?}"
        )));
    }

    // Query blocks [B·nt, Hkv, group·tq, D]: rows are (query head of the group, position).
    let qb = q
        .f_to_kind(f)?
        .f_reshape([b, hkv, group, t, d])?
        .f_constant_pad_nd([0, 0, 0, t_pad - t])?
        .f_reshape([b, hkv, group, nt, tq, d])?
        .f_permute([0, 3, 1, 2, 4, 5])?
        .f_contiguous()?
        .f_reshape([b * nt, hkv, rows, d])?;
    // Key/value chunks [B·nc, Hkv, c, D].
    let chunks = |x: &Tensor| -> Result<Tensor> {
        Ok(x.f_to_kind(f)?
            .f_constant_pad_nd([0, 0, 0, l_pad - l])?
            .f_reshape([b, hkv, nc, c, d])?
            .f_permute([0, 2, 1, 3, 4])?
            .f_contiguous()?
            .f_reshape([b * nc, hkv, c, d])?)
    };
    let (kc, vc) = (chunks(k)?, chunks(v)?);
    // Mask per unit [B·nt·nc, tq, c], units ordered (sequence, block, chunk). Padded keys and
    // padded query positions are masked. Unit u < units is (block u / nc, chunk u % nc);
    // padding units read block 0, chunk 0. Built on the device (no host copy, so the step can
    // be captured in a CUDA graph), once per forward pass when the layers share a scratch.
    let units = b * nt * nc;
    let batches = ceil_div(units, w);
    let u_pad = batches * w;
    let make = || -> Result<Vec<Tensor>> {
        let mask = p
            .mask
            .f_to_kind(f)?
            .f_expand([b, 1, 1, t, l], false)?
            .f_reshape([b, t, l])?
            .f_pad(
                [0, l_pad - l, 0, t_pad - t],
                "constant",
                f64::from(f32::MIN),
            )?
            .f_reshape([b, nt, tq, nc, c])?
            .f_permute([0, 1, 3, 2, 4])?
            .f_contiguous()?
            .f_reshape([units, tq, c])?
            .f_constant_pad_nd([0, 0, 0, 0, 0, u_pad - units])?;
        let u = Tensor::f_arange(u_pad, (Kind::Int64, dev))?;
        let u = u.f_masked_fill(&u.f_ge(units)?, 0)?;
        let q_idx = u.f_divide_scalar_mode(nc, "floor")?;
        let kv_idx = q_idx
            .f_divide_scalar_mode(nt, "floor")?
            .f_mul_scalar(nc)?
            .f_add(&u.f_remainder(nc)?)?;
        Ok(vec![mask, q_idx, kv_idx])
    };
    let prepared = match p.scratch {
        Some(scratch) => scratch.get_or([b, t, l, tq, c, w], make)?,
        None => make()?,
    };
    let (mask, q_idx, kv_idx) = (&prepared[0], &prepared[1], &prepared[2]);

    let (mut maxes, mut sums, mut outs) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..batches {
        let qi = q_idx.f_narrow(0, i * w, w)?;
        let ki = kv_idx.f_narrow(0, i * w, w)?;
        let qs = qb.f_index_select(0, &qi)?.f_reshape([w * hkv, rows, d])?;
        let ks = kc.f_index_select(0, &ki)?.f_reshape([w * hkv, c, d])?;
        let vs = vc.f_index_select(0, &ki)?.f_reshape([w * hkv, c, d])?;
        let mut s = qs.f_bmm(&ks.f_transpose(1, 2)?)?.f_mul_scalar(p.scale)?;
        if let Some(cap) = p.softcap {
            s = s.f_div_scalar(cap)?.f_tanh()?.f_mul_scalar(cap)?;
        }
        let s = s
            .f_view([w, hkv, group, tq, c])?
            .f_add(&mask.f_narrow(0, i * w, w)?.f_view([w, 1, 1, tq, c])?)?
            .f_view([w * hkv, rows, c])?;
        let m = s.f_amax([-1i64].as_slice(), true)?;
        let e = s.f_sub(&m)?.f_exp()?;
        sums.push(e.f_sum_dim_intlist([-1i64].as_slice(), true, f)?);
        outs.push(e.f_bmm(&vs)?);
        maxes.push(m);
    }
    let gather = |parts: Vec<Tensor>, last: i64| -> Result<Tensor> {
        Ok(join(parts)?
            .f_narrow(0, 0, units * hkv)?
            .f_view([b * nt, nc, hkv, rows, last])?)
    };
    let (maxes, sums, outs) = (gather(maxes, 1)?, gather(sums, 1)?, gather(outs, d)?);
    let top = maxes.f_amax([1i64].as_slice(), true)?;
    let factor = maxes.f_sub(&top)?.f_exp()?;
    // Numerators and denominators side by side ([…, D + 1]): one product and one add per
    // chunk for both (elementwise, so bitwise the same as two separate folds).
    let both = Tensor::f_cat(&[outs, sums], -1)?.f_mul(&factor)?;
    // Fixed-order fold over chunks (key order).
    let mut acc = both.f_select(1, 0)?;
    for ci in 1..nc {
        acc = acc.f_add(&both.f_select(1, ci)?)?;
    }
    let (num, den) = (acc.f_narrow(-1, 0, d)?, acc.f_narrow(-1, d, 1)?);
    Ok(num
        .f_div(&den)?
        .f_view([b, nt, hkv, group, tq, d])?
        .f_permute([0, 2, 3, 1, 4, 5])?
        .f_reshape([b, hq, t_pad, d])?
        .f_narrow(2, 0, t)?
        .f_to_kind(q.kind())?)
}
