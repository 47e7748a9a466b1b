//! The batch-invariant policy's fused CUDA kernels ([`super::BiKernels::Fused`]): the same
//! guarantee as the fixed-shape ATen calls of [`super::batch_invariant`] — a token's result
//! does not depend on what shares its forward pass — in about as many launches as the stock
//! policy.
//!
//! * **linear** (fp16, bf16): one GEMM per call of at most `gemm_rows` rows, run with cuBLASLt
//!   preferred and reduced-precision reductions and split-K off
//!   ([`crate::nvrtc::with_invariant_blas`]): under those settings a row's result did not
//!   depend on M for M = 2…512 on the H200 (`kvcredit invariance` checks it per model); a
//!   one-row call runs as two rows, and a long-K weight as a fixed split over K.
//! * **attention, RMSNorm, activation**: kernels of `kernels/bi_kernels.cu`, compiled at run
//!   time with NVRTC, in which each output element is one fixed sequence of fp32 operations
//!   over its own row (the file explains the attention's chunked online softmax and why keys
//!   a query cannot see never reach its result).
//!
//! fp64 runs use the ATen kernels throughout, fp32 runs for their linear layers.
use super::{AttnParams, BiTiles, batch_invariant};
use crate::config::Activation;
use crate::nvrtc::{Arg, Kernel, with_invariant_blas};
use crate::{Error, Result};
use tch::{Kind, Tensor};

const SOURCE: &str = concat!(
    include_str!("../../kernels/dtype.cuh"),
    include_str!("../../kernels/bi_kernels.cu")
);
const THREADS: u32 = 128;
/// Threads of an attention block (`KVC_ATT_THREADS`: eight warps).
const ATT_THREADS: u32 = 256;

/// The kernels' element-type code, or `None` for types they do not handle.
pub(super) fn dtype_code(kind: Kind) -> Option<i32> {
    match kind {
        Kind::Float => Some(0),
        Kind::Half => Some(1),
        Kind::BFloat16 => Some(2),
        _ => None,
    }
}

fn kernel(x: &Tensor, name: &str, defines: &[(&str, i64)]) -> Result<Kernel> {
    typed_kernel(SOURCE, x, name, defines)
}

/// Kernel `name` of `source` (which starts with `kernels/dtype.cuh`) for `x`'s element type
/// and device, with `defines`.
pub(super) fn typed_kernel(
    source: &'static str,
    x: &Tensor,
    name: &str,
    defines: &[(&str, i64)],
) -> Result<Kernel> {
    let code = dtype_code(x.kind())
        .ok_or_else(|| Error::Torch(format!("fused kernels do not handle {:?}", x.kind())))?;
    let mut options = vec![format!("-DKVC_DTYPE={code}")];
    options.extend(defines.iter().map(|(k, v)| format!("-D{k}={v}")));
    Kernel::get(x.device(), source, &options, name)
}

pub(super) fn grid(n: i64) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::Torch(format!("kernel grid of {n} blocks is too large")))
}

/// `x @ w^T + b` as GEMMs of at most `gemm_rows` rows under the M-invariant cuBLAS settings.
///
/// A one-row GEMM is run as two rows (the row twice, one copy; a row's result does not depend on
/// the other rows' values): on the H200 cuBLASLt rounds M = 1 differently from M ≥ 2
/// (`kvcredit invariance`'s decode_vs_prefill check on the Qwen2.5-0.5B shape). A long-K
/// weight is cut into [`k_slices`] fixed slices ([`sliced_gemm`]). fp32 (and fp64) GEMMs have
/// no split-K switch, so they keep the fixed-shape ATen tiles (`gemm_rows` rows, zero-padded).
pub(super) fn linear(
    tiles: &BiTiles,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
) -> Result<Tensor> {
    if !matches!(x.kind(), Kind::Half | Kind::BFloat16) {
        return batch_invariant::linear(tiles, x, w, b);
    }
    let dims = x.size();
    let k = super::last_dim(x)?;
    let rows: i64 = dims[..dims.len() - 1].iter().product();
    let m = tiles.gemm_rows;
    let mut shape = dims[..dims.len() - 1].to_vec();
    shape.push(w.size()[0]);
    let slices = if w.is_contiguous() {
        k_slices(w.size()[0], k)
    } else {
        1
    };
    // One GEMM of `n` rows of `piece` (≥ 2 rows; a one-row piece is widened first).
    let gemm = |piece: Tensor, n: i64| -> Result<Tensor> {
        let piece = if n == 1 {
            piece.f_repeat([2, 1])?
        } else {
            piece
        };
        Ok(sliced_gemm(&piece, w, b, slices)?.f_narrow(0, 0, n)?)
    };
    with_invariant_blas(|| {
        let flat = x.f_reshape([rows, k])?.f_contiguous()?;
        if rows <= m {
            return Ok(gemm(flat, rows)?.f_reshape(shape.as_slice())?);
        }
        let mut outs = Vec::new();
        let mut start = 0;
        while start < rows {
            let n = m.min(rows - start);
            outs.push(gemm(batch_invariant::aligned_rows(&flat, start, n)?, n)?);
            start += n;
        }
        Ok(Tensor::f_cat(&outs, 0)?.f_reshape(shape.as_slice())?)
    })
}

/// Fixed K slices of a GEMM with `n` outputs over `k` inputs, from the weight's shape alone:
/// 2 for a long-K weight (`k ≥ 2048` and `k ≥ 2n`, e.g. an MLP's down projection), else 1.
/// With split-K off, cuBLASLt runs such a GEMM on a handful of thread blocks: the Qwen2.5-1.5B
/// down projection took 199 µs against 9 µs stock on the H200, and 11 µs as two slices
/// (`benches/gemm_shapes.py`).
pub(super) fn k_slices(n: i64, k: i64) -> i64 {
    if k >= 2048 && k >= 2 * n && k % 16 == 0 {
        2
    } else {
        1
    }
}

/// `x @ w^T + b` for a 2-D `x` of at least two rows, with K cut into `slices` equal slices at
/// fixed offsets: each slice is one GEMM into fp32 (a batched GEMM over the slices), and the
/// partial products are added in slice order, then the bias, then rounded once to `x`'s type.
/// A row's result depends only on that row (the slices are fixed by the weight's shape).
fn sliced_gemm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, slices: i64) -> Result<Tensor> {
    if slices == 1 {
        return Ok(x.f_linear(w, b)?);
    }
    let (m, k) = x.size2()?;
    let n = w.size()[0];
    let ks = k / slices;
    let xs = x.f_view([m, slices, ks])?.f_transpose(0, 1)?;
    let ws = w.f_view([n, slices, ks])?.f_permute([1, 2, 0])?;
    let parts = xs.f_bmm_dtype(&ws, Kind::Float)?;
    let mut acc = parts.f_select(0, 0)?;
    for i in 1..slices {
        acc = acc.f_add(&parts.f_select(0, i)?)?;
    }
    if let Some(b) = b {
        acc = acc.f_add(&b.f_to_kind(Kind::Float)?)?;
    }
    Ok(acc.f_to_kind(x.kind())?)
}

/// `x / rms(x)` over the last dimension in fp32, returned as `out` (fp32 or `x`'s type);
/// with `weight` (of `x`'s type, and `out` that type too), times the weight after the rounding,
/// in the same launch.
pub(super) fn rms_normalize(
    tiles: &BiTiles,
    x: &Tensor,
    eps: f64,
    out: Kind,
    weight: Option<&Tensor>,
) -> Result<Tensor> {
    let weighted = |y: Tensor| -> Result<Tensor> {
        Ok(match weight {
            Some(w) => w.f_mul(&y)?,
            None => y,
        })
    };
    if dtype_code(x.kind()).is_none() {
        return weighted(batch_invariant::rms_normalize(tiles, x, eps)?.f_to_kind(out)?);
    }
    let weight = match weight {
        Some(w) if w.kind() == x.kind() && out == x.kind() && w.is_contiguous() => Some(w),
        Some(_) => return weighted(rms_normalize(tiles, x, eps, out, None)?),
        None => None,
    };
    let dims = x.size();
    let h = super::last_dim(x)?;
    let rows: i64 = dims[..dims.len() - 1].iter().product();
    let xc = x.f_contiguous()?;
    // fp32 straight from the kernel unless `out` is `x`'s own half type.
    let f32_out = out != x.kind() || x.kind() == Kind::Float;
    let y = Tensor::f_empty(
        dims.as_slice(),
        (if f32_out { Kind::Float } else { x.kind() }, x.device()),
    )?;
    kernel(&xc, "kvc_bi_rms", &[])?.launch(
        grid(rows)?,
        THREADS,
        &[
            Arg::Ptr(xc.data_ptr()),
            Arg::Ptr(y.data_ptr()),
            Arg::Ptr(match weight {
                Some(w) if !f32_out => w.data_ptr(),
                _ => std::ptr::null_mut(),
            }),
            Arg::I32(h as i32),
            Arg::F32(eps as f32),
            Arg::I32(i32::from(f32_out)),
        ],
    )?;
    match weight {
        Some(w) if f32_out => Ok(w.f_mul(&y.f_to_kind(out)?)?),
        _ => Ok(y.f_to_kind(out)?),
    }
}

/// The MLP activation, elementwise in fp32, returned in `x`'s type.
pub(super) fn activation(x: &Tensor, act: Activation) -> Result<Tensor> {
    if dtype_code(x.kind()).is_none() {
        return batch_invariant::activation(x, act);
    }
    let xc = x.f_contiguous()?;
    let y = xc.f_empty_like()?;
    let n = xc.numel() as i64;
    let mode = match act {
        Activation::Silu => 0,
        Activation::GeluTanh => 1,
        Activation::Gelu => 2,
    };
    kernel(&xc, "kvc_bi_act", &[])?.launch(
        grid((n + i64::from(THREADS) - 1) / i64::from(THREADS))?,
        THREADS,
        &[
            Arg::Ptr(xc.data_ptr()),
            Arg::Ptr(y.data_ptr()),
            Arg::I64(n),
            Arg::I32(mode),
        ],
    )?;
    Ok(y)
}

/// `t` with unit stride in its last dimension (a copy only when it has another).
fn unit_last(t: &Tensor) -> Result<Tensor> {
    Ok(if t.stride().last() == Some(&1) {
        t.shallow_clone()
    } else {
        t.f_contiguous()?
    })
}

/// Grouped-query attention by the fused kernel; see `kernels/bi_kernels.cu`.
pub(super) fn attention(
    tiles: &BiTiles,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttnParams,
) -> Result<Tensor> {
    let kind = q.kind();
    if dtype_code(kind).is_none() {
        return batch_invariant::attention(tiles, q, k, v, p);
    }
    let (b, hq, t, d) = q.size4()?;
    let (hkv, l) = (k.size()[1], k.size()[2]);
    let msize = p.mask.size();
    if !(msize.len() == 5 && msize[1] == 1 && msize[2] == 1 && msize[4] == l) {
        return Err(Error::Torch(format!(
            "fused attention needs a mask of shape [B, 1, 1, T, {l}], got {msize:?}"
        )));
    }
    if hkv == 0 || hq % hkv != 0 || k.kind() != kind || v.kind() != kind {
        return Err(Error::Torch(format!(
            "fused attention: {hq} query heads over {hkv} key heads, kinds {kind:?}/{:?}/{:?}",
            k.kind(),
            v.kind()
        )));
    }
    let (q, k, v) = (unit_last(q)?, unit_last(k)?, unit_last(v)?);
    let mask = unit_last(&p.mask.f_to_kind(kind)?)?;
    let (qs, ks, vs, ms) = (q.stride(), k.stride(), v.stride(), mask.stride());
    // A broadcast mask dimension reads the same row for every sequence or position.
    let msb = if msize[0] == 1 { 0 } else { ms[0] };
    let mst = if msize[3] == 1 { 0 } else { ms[3] };
    let drop = match kind {
        Kind::Half => f32::from(half::f16::MIN),
        Kind::BFloat16 => f32::from(half::bf16::MIN),
        _ => f32::MIN,
    };
    // K rows can be read 16 bytes at a time when every row starts 16-byte aligned.
    let el = kind.elt_size_in_bytes() as i64;
    let vec = el == 2
        && d % 8 == 0
        && (k.data_ptr() as usize).is_multiple_of(16)
        && [ks[0], ks[1], ks[2]].iter().all(|s| (s * el) % 16 == 0);
    let out = Tensor::f_empty([b, hq, t, d], (kind, q.device()))?;
    let kern = kernel(
        &q,
        "kvc_bi_attention",
        &[("HD", d), ("CH", tiles.key_chunk)],
    )?;
    kern.launch(
        grid(b * hq * t)?,
        ATT_THREADS,
        &[
            Arg::Ptr(q.data_ptr()),
            Arg::Ptr(k.data_ptr()),
            Arg::Ptr(v.data_ptr()),
            Arg::Ptr(mask.data_ptr()),
            Arg::Ptr(out.data_ptr()),
            Arg::I32(hq as i32),
            Arg::I32((hq / hkv) as i32),
            Arg::I32(t as i32),
            Arg::I32(l as i32),
            Arg::I64(qs[0]),
            Arg::I64(qs[1]),
            Arg::I64(qs[2]),
            Arg::I64(ks[0]),
            Arg::I64(ks[1]),
            Arg::I64(ks[2]),
            Arg::I64(vs[0]),
            Arg::I64(vs[1]),
            Arg::I64(vs[2]),
            Arg::I64(msb),
            Arg::I64(mst),
            Arg::F32(p.scale as f32),
            Arg::F32(p.softcap.map_or(0.0, |c| c as f32)),
            Arg::F32(drop),
            Arg::I32(i32::from(vec)),
        ],
    )?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::k_slices;

    /// Only long-K weights are sliced: the MLP down projections of both Qwen shapes, not their
    /// attention, gate/up or output-head weights.
    #[test]
    fn only_long_k_weights_are_sliced() {
        assert_eq!(k_slices(896, 4864), 2);
        assert_eq!(k_slices(1536, 8960), 2);
        for (n, k) in [
            (896, 896),
            (128, 896),
            (4864, 896),
            (151936, 896),
            (256, 1536),
        ] {
            assert_eq!(k_slices(n, k), 1, "N={n} K={k}");
        }
        // A K that does not split into 16-element-aligned halves stays whole.
        assert_eq!(k_slices(100, 4100), 1);
    }
}
