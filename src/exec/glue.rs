//! The glue between a layer's GEMMs — RoPE and the cache write, the attention scores' scale
//! and mask, the gated MLP's SiLU and product — as ATen ops (the reference, any device) or as
//! the fused kernels of `kernels/glue.cu` (CUDA, compiled with NVRTC), which compute bitwise
//! the same values in one launch each instead of two to eight kernels and copies.
//!
//! Both implementations round to the element type at the same places with the same correctly
//! rounded fp32 operations, so the choice changes no result and is not recorded; its check,
//! [`check_fused`], compares them bit for bit on every element type, with a negative control
//! that leaves one rounding out. [`Glue::resolve`] says which one runs: the choice travels as a
//! value, from the run's [`super::ExecSettings`] through the decoder to each op.
use super::fused::{self, dtype_code, grid, typed_kernel};
use super::{AttnParams, ExecPolicy};
use crate::config::Activation;
use crate::kv_cache::{KvCache, KvShape, KvWrite};
use crate::nvrtc::Arg;
use crate::{Error, Result};
use tch::{Device, Kind, Tensor};

const SOURCE: &str = concat!(
    include_str!("../../kernels/dtype.cuh"),
    include_str!("../../kernels/glue.cu")
);
/// Threads of a glue block (`KVC_GLUE_THREADS`).
const THREADS: i64 = 256;

/// Which implementation runs the glue. Both compute bitwise the same values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Glue {
    /// ATen ops (any device; the reference).
    Aten,
    /// `kernels/glue.cu` compiled with NVRTC (CUDA only).
    Fused,
}

impl Glue {
    /// Parse `aten` or `fused`.
    pub fn parse(s: &str) -> Result<Glue> {
        match s {
            "aten" => Ok(Glue::Aten),
            "fused" => Ok(Glue::Fused),
            _ => Err(Error::Spec(format!("`{s}` is not a glue (aten, fused)"))),
        }
    }

    /// The name [`Glue::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Glue::Aten => "aten",
            Glue::Fused => "fused",
        }
    }

    /// Whether this implementation can run on `device`.
    pub fn check_device(self, device: Device) -> Result<()> {
        if self == Glue::Fused && !crate::nvrtc::available(device) {
            return Err(Error::Spec(format!(
                "the fused glue needs a CUDA device and a binary built with the C++ shim (device {device:?})"
            )));
        }
        Ok(())
    }

    /// The implementation that runs on `device` when `asked` (`None`: the device's default):
    /// ATen when asked, else fused where it can run, else ATen.
    pub fn resolve(asked: Option<Glue>, device: Device) -> Glue {
        match asked {
            Some(Glue::Aten) => Glue::Aten,
            _ if crate::nvrtc::available(device) => Glue::Fused,
            _ => Glue::Aten,
        }
    }
}

/// The implementation that runs `glue` on `x`: `glue` where it runs and handles `x`'s element
/// type, else ATen.
fn glue_for(glue: Glue, x: &Tensor) -> Glue {
    if dtype_code(x.kind()).is_some() {
        Glue::resolve(Some(glue), x.device())
    } else {
        Glue::Aten
    }
}

fn int(v: i64, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Torch(format!("glue kernel: {what} {v} is too large")))
}

fn blocks(n: i64) -> Result<u32> {
    grid((n + THREADS - 1) / THREADS)
}

/// Rotate `x` (`[B, H, T, D]`) by the given angles (`sin` with its first half negated, as the
/// model's RoPE table returns it). Bitwise the same as Hugging Face's
/// `x·cos + rotate_half(x)·sin`: `rotate_half(x)·sin` is `[−x₂·s, x₁·s]` and `roll(x)·signed`
/// is `[x₂·(−s), x₁·s]`, equal since IEEE products are sign-symmetric.
pub fn rope_apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.size()[3] / 2;
    let rotated = x.f_roll([half], [3])?;
    Ok(x.f_mul(cos)?.f_add(&rotated.f_mul(sin)?)?)
}

/// Where a forward pass writes a layer's new K/V rows.
pub(crate) struct CacheWrite<'a> {
    /// The cache.
    pub cache: &'a mut KvCache,
    /// The layer.
    pub layer: usize,
    /// How rows are written.
    pub write: KvWrite,
    /// Absolute positions `[B, T]` of the new rows.
    pub positions: &'a Tensor,
    /// Keys attended (`L`).
    pub key_len: i64,
}

/// RoPE on the query and key heads of `qkv` (`[B, T, (Hq + 2 Hkv) · D]`, `heads` = (Hq, Hkv,
/// D)) with `cos`, `sin` (`[B, 1, T, D]`, see [`rope_apply`]), the new keys and values written
/// to the cache by `glue`: the rotated queries `[B, Hq, T, D]` and the keys and values attended
/// (`[B, Hkv, L, D]`).
pub(crate) fn rope_write(
    glue: Glue,
    qkv: &Tensor,
    heads: (i64, i64, i64),
    cos: &Tensor,
    sin: &Tensor,
    to: CacheWrite,
) -> Result<(Tensor, Tensor, Tensor)> {
    rope_write_with(glue_for(glue, qkv), qkv, heads, cos, sin, to)
}

fn rope_write_with(
    glue: Glue,
    qkv: &Tensor,
    (hq, hkv, d): (i64, i64, i64),
    cos: &Tensor,
    sin: &Tensor,
    to: CacheWrite,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t) = (qkv.size()[0], qkv.size()[1]);
    let fused = glue == Glue::Fused
        && qkv.is_contiguous()
        && cos.is_contiguous()
        && sin.is_contiguous()
        && cos.kind() == qkv.kind()
        && sin.kind() == qkv.kind()
        && cos.size() == [b, 1, t, d]
        && sin.size() == [b, 1, t, d]
        && d % 2 == 0
        && to.positions.kind() == Kind::Int64
        && to.positions.size() == [b, t];
    if !fused {
        let v = qkv
            .f_narrow(-1, (hq + hkv) * d, hkv * d)?
            .f_view([b, t, hkv, d])?
            .f_transpose(1, 2)?;
        // Rotate the query and key heads together: one set of elementwise ops.
        let qk = qkv
            .f_narrow(-1, 0, (hq + hkv) * d)?
            .f_view([b, t, hq + hkv, d])?
            .f_transpose(1, 2)?;
        let qk = rope_apply(&qk, cos, sin)?;
        let (k_all, v_all) = to.cache.write(
            to.layer,
            &qk.f_narrow(1, hq, hkv)?,
            &v,
            to.write,
            to.positions,
            to.key_len,
        )?;
        return Ok((qk.f_narrow(1, 0, hq)?, k_all, v_all));
    }
    let q = Tensor::f_empty([b, hq, t, d], (qkv.kind(), qkv.device()))?;
    let (kc, vc) = to.cache.buffers_mut(to.layer);
    let cs = kc.stride();
    if kc.stride() != vc.stride() || cs[3] != 1 {
        return Err(Error::KvCache(format!(
            "fused RoPE write: cache buffers of strides {:?} and {:?}",
            kc.stride(),
            vc.stride()
        )));
    }
    let ps = to.positions.stride();
    typed_kernel(SOURCE, qkv, "kvc_rope_qkv", &[])?.launch(
        blocks(b * t * (hq + 2 * hkv) * d)?,
        THREADS as u32,
        &[
            Arg::Ptr(qkv.data_ptr()),
            Arg::Ptr(cos.data_ptr()),
            Arg::Ptr(sin.data_ptr()),
            Arg::Ptr(to.positions.data_ptr()),
            Arg::I64(ps[0]),
            Arg::I64(ps[1]),
            Arg::Ptr(q.data_ptr()),
            Arg::Ptr(kc.data_ptr()),
            Arg::Ptr(vc.data_ptr()),
            Arg::I64(cs[0]),
            Arg::I64(cs[1]),
            Arg::I64(cs[2]),
            Arg::I32(int(b, "batch")?),
            Arg::I32(int(t, "positions")?),
            Arg::I32(int(hq, "heads")?),
            Arg::I32(int(hkv, "heads")?),
            Arg::I32(int(d, "head width")?),
        ],
    )?;
    let (k_all, v_all) = to.cache.attended_kv(to.layer, to.key_len)?;
    Ok((q, k_all, v_all))
}

/// Softmax's input from raw attention scores `s` (`[B, Hkv, G · T, L]`): `s · scale`,
/// soft-capped if asked, plus the mask (`[B, 1, 1, T, L]`), as `[B, Hkv, G, T, L]` (fp32 from
/// the fused kernel, `s`'s type from the ATen ops: softmax takes both to the same fp32 values),
/// by `p.glue`.
pub(crate) fn softmax_input(s: &Tensor, p: &AttnParams, group: i64) -> Result<Tensor> {
    softmax_input_with(glue_for(p.glue, s), s, p, group)
}

fn softmax_input_with(glue: Glue, s: &Tensor, p: &AttnParams, group: i64) -> Result<Tensor> {
    let (scale, softcap, mask) = (p.scale, p.softcap, p.mask);
    let (b, hkv, gt, l) = s.size4()?;
    let t = gt / group;
    let fused = glue == Glue::Fused
        && softcap.is_none()
        && s.is_contiguous()
        && mask.is_contiguous()
        && mask.kind() == s.kind()
        && mask.size() == [b, 1, 1, t, l];
    if !fused {
        let mut scores = s.f_mul_scalar(scale)?;
        if let Some(cap) = softcap {
            scores = scores.f_div_scalar(cap)?.f_tanh()?.f_mul_scalar(cap)?;
        }
        return Ok(scores.f_view([b, hkv, group, t, l])?.f_add(mask)?);
    }
    let out = Tensor::f_empty([b, hkv, group, t, l], (Kind::Float, s.device()))?;
    let n = s.numel() as i64;
    typed_kernel(SOURCE, s, "kvc_scores", &[])?.launch(
        blocks(n)?,
        THREADS as u32,
        &[
            Arg::Ptr(s.data_ptr()),
            Arg::Ptr(mask.data_ptr()),
            Arg::Ptr(out.data_ptr()),
            Arg::I64(n),
            Arg::I32(int(hkv, "heads")?),
            Arg::I32(int(group, "group")?),
            Arg::I32(int(t, "positions")?),
            Arg::I32(int(l, "keys")?),
            Arg::F32(scale as f32),
        ],
    )?;
    Ok(out)
}

/// `silu(gate) · up` from `gu` (`[..., 2 · I]`: gate columns, then up) by the fused kernel, or
/// `None` where `glue` is not the fused one there (the caller runs the ATen ops,
/// [`ExecPolicy::gated`]). The batch-invariant policy's own activation kernel has the same
/// formula, rounded at the same place, so its callers may take either.
pub(crate) fn fused_silu_mul(glue: Glue, gu: &Tensor, inter: i64) -> Result<Option<Tensor>> {
    if glue_for(glue, gu) == Glue::Fused && gu.is_contiguous() {
        Ok(Some(silu_mul(gu, inter, false)?))
    } else {
        Ok(None)
    }
}

/// The fused SiLU product of contiguous `gu`; `control` leaves out the activation's rounding
/// (the check's negative control).
fn silu_mul(gu: &Tensor, inter: i64, control: bool) -> Result<Tensor> {
    let mut dims = gu.size();
    let rows = gu.numel() as i64 / (2 * inter);
    if let Some(last) = dims.last_mut() {
        *last = inter;
    }
    let out = Tensor::f_empty(dims.as_slice(), (gu.kind(), gu.device()))?;
    typed_kernel(SOURCE, gu, "kvc_silu_mul", &[])?.launch(
        blocks(rows * inter)?,
        THREADS as u32,
        &[
            Arg::Ptr(gu.data_ptr()),
            Arg::Ptr(out.data_ptr()),
            Arg::I64(rows),
            Arg::I32(int(inter, "width")?),
            Arg::I32(i32::from(control)),
        ],
    )?;
    Ok(out)
}

/// What [`check_fused`] compared, bitwise, over fp32, fp16 and bf16.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GlueCheck {
    /// Elements compared: rotated queries, both cache buffers, softmax outputs, MLP products.
    pub elements: i64,
    /// Of those, the ones whose bits differ between the fused kernels and the ATen ops.
    pub mismatches: i64,
    /// Logits of a real forward pass compared
    /// ([`crate::model::invariance::check_glue`]; 0 when it did not run).
    #[serde(default)]
    pub logits_elements: i64,
    /// Of those, the ones whose bits differ between the two glues.
    #[serde(default)]
    pub logits_mismatches: i64,
    /// MLP products of the negative control (the activation not rounded before the product)
    /// that differ from the ATen ops': must be above zero, or the comparison could not see a
    /// change of rounding.
    pub control_mismatches: i64,
}

impl GlueCheck {
    /// Bitwise agreement, and a negative control that the comparison caught.
    pub fn passed(&self) -> bool {
        self.mismatches == 0 && self.logits_mismatches == 0 && self.control_mismatches > 0
    }
}

/// [`rope_write_with`] into a fresh one-layer cache of `cap` positions per row, scattered at
/// `positions` (`[B, T]`): the queries and the layer's whole K and V buffers.
fn rope_write_fresh(
    glue: Glue,
    qkv: &Tensor,
    heads: (i64, i64, i64),
    (cos, sin): (&Tensor, &Tensor),
    positions: &Tensor,
    cap: i64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let shape = KvShape {
        layers: 1,
        kv_heads: heads.1,
        head_dim: heads.2,
    };
    let b = qkv.size()[0] as usize;
    let mut cache = KvCache::new(shape, b, cap, qkv.kind(), qkv.device())?;
    let to = CacheWrite {
        cache: &mut cache,
        layer: 0,
        write: KvWrite::Scatter,
        positions,
        key_len: cap,
    };
    rope_write_with(glue, qkv, heads, cos, sin, to)
}

/// Compare the fused glue with the ATen ops on `device` (CUDA), bitwise, on random inputs of
/// the Qwen2.5-0.5B head shape (14 query heads, 2 key/value heads of 64): RoPE and the cache
/// write of three rows of five positions at different offsets, the softmax of masked scores
/// (probabilities compared), and the SiLU product of a 4,864-wide MLP. Also the batch-invariant
/// policy's shortened launches against their longer forms: that SiLU product against its
/// activation kernel then the product, the weighted RMSNorm against the norm kernel then the
/// product, and a one-row linear (run as the row twice) against row 0 of the row and a zero
/// row.
pub fn check_fused(device: Device, seed: u64) -> Result<GlueCheck> {
    Glue::Fused.check_device(device)?;
    let _guard = tch::no_grad_guard();
    tch::manual_seed(seed as i64);
    let (b, t, hq, hkv, d, cap) = (3i64, 5i64, 14i64, 2i64, 64i64, 32i64);
    let mut elements = 0;
    let mut mismatches = 0;
    let mut control_mismatches = 0;
    let mut compare = |a: &Tensor, f: &Tensor| -> Result<()> {
        let (a, f) = (bits(a)?, bits(f)?);
        elements += a.numel() as i64;
        mismatches += a.f_ne_tensor(&f)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;
        Ok(())
    };
    for kind in [Kind::Float, Kind::Half, Kind::BFloat16] {
        let opts = (kind, device);
        let qkv = Tensor::f_randn([b, t, (hq + 2 * hkv) * d], opts)?;
        let angles = Tensor::f_rand([b, 1, t, d], (Kind::Float, device))?.f_mul_scalar(6.3)?;
        let cos = angles.f_cos()?.f_to_kind(kind)?;
        let sin = angles.f_sin()?.f_to_kind(kind)?;
        let starts = Tensor::f_from_slice(&[0i64, 4, 11])?.f_to_device(device)?;
        let positions = starts
            .f_view([b, 1])?
            .f_add(&Tensor::f_arange(t, (Kind::Int64, device))?.f_view([1, t])?)?;
        let mut outs = Vec::new();
        for glue in [Glue::Aten, Glue::Fused] {
            outs.push(rope_write_fresh(
                glue,
                &qkv,
                (hq, hkv, d),
                (&cos, &sin),
                &positions,
                cap,
            )?);
        }
        let ((qa, ka, va), (qf, kf, vf)) = (&outs[0], &outs[1]);
        compare(qa, qf)?;
        compare(ka, kf)?;
        compare(va, vf)?;

        let (g, l) = (hq / hkv, 48i64);
        let s = Tensor::f_randn([b, hkv, g * t, l], opts)?.f_mul_scalar(4.0)?;
        let keep = Tensor::f_rand([b, 1, 1, t, l], (Kind::Float, device))?.f_gt(0.2)?;
        let min = match kind {
            Kind::Half => f64::from(half::f16::MIN),
            Kind::BFloat16 => f64::from(half::bf16::MIN),
            _ => f64::from(f32::MIN),
        };
        let mask =
            Tensor::f_zeros([b, 1, 1, t, l], opts)?.f_masked_fill(&keep.f_logical_not()?, min)?;
        let probs = |glue| -> Result<Tensor> {
            let p = AttnParams {
                scale: 0.125,
                softcap: None,
                mask: &mask,
                scratch: None,
                glue,
            };
            Ok(softmax_input_with(glue, &s, &p, g)?.f_softmax(-1, Kind::Float)?)
        };
        compare(&probs(Glue::Aten)?, &probs(Glue::Fused)?)?;

        let inter = 4864;
        let gu = Tensor::f_randn([b, t, 2 * inter], opts)?.f_mul_scalar(3.0)?;
        let gate = gu.f_narrow(-1, 0, inter)?;
        let up = gu.f_narrow(-1, inter, inter)?;
        let reference = ExecPolicy::Stock
            .activation(&gate, Activation::Silu)?
            .f_mul(&up)?;
        let product = silu_mul(&gu, inter, false)?;
        compare(&reference, &product)?;
        // The batch-invariant policy's launches that these kernels shortened: the same bits.
        let tiles = super::BiTiles::for_device(device);
        compare(
            &fused::activation(&gate, Activation::Silu)?.f_mul(&up)?,
            &product,
        )?;
        let x = Tensor::f_randn([b, t, 896], opts)?;
        let w = Tensor::f_rand([896], opts)?.f_add_scalar(0.5)?;
        compare(
            &w.f_mul(&fused::rms_normalize(&tiles, &x, 1e-6, kind, None)?)?,
            &fused::rms_normalize(&tiles, &x, 1e-6, kind, Some(&w))?,
        )?;
        let one = x.f_narrow(0, 0, 1)?.f_narrow(1, 0, 1)?.f_view([1, 896])?;
        let two = Tensor::f_cat(&[&one, &one.f_zeros_like()?], 0)?;
        let weight = Tensor::f_randn([1152, 896], opts)?.f_mul_scalar(0.03)?;
        compare(
            &fused::linear(&tiles, &two, &weight, None)?.f_narrow(0, 0, 1)?,
            &fused::linear(&tiles, &one, &weight, None)?,
        )?;
        if kind != Kind::Float {
            let control = silu_mul(&gu, inter, true)?;
            control_mismatches += bits(&control)?
                .f_ne_tensor(&bits(&reference)?)?
                .f_sum(Kind::Int64)?
                .f_int64_value(&[])?;
        }
    }
    Ok(GlueCheck {
        elements,
        mismatches,
        logits_elements: 0,
        logits_mismatches: 0,
        control_mismatches,
    })
}

/// A tensor's bits as integers of its width (so that NaNs compare by payload).
pub(crate) fn bits(x: &Tensor) -> Result<Tensor> {
    Ok(match x.kind() {
        Kind::Float => x.f_view_dtype(Kind::Int)?,
        Kind::Half | Kind::BFloat16 => x.f_view_dtype(Kind::Int16)?,
        other => {
            return Err(Error::Torch(format!(
                "glue check: no bit view for {other:?}"
            )));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_are_spec_errors() {
        for g in [Glue::Aten, Glue::Fused] {
            assert_eq!(Glue::parse(g.name()).unwrap(), g);
        }
        assert!(matches!(Glue::parse("triton"), Err(Error::Spec(_))));
    }

    #[test]
    fn the_cpu_runs_the_aten_ops_whatever_is_asked() {
        for asked in [None, Some(Glue::Aten), Some(Glue::Fused)] {
            assert_eq!(Glue::resolve(asked, Device::Cpu), Glue::Aten);
        }
        assert_eq!(
            Glue::resolve(Some(Glue::Aten), Device::Cuda(0)),
            Glue::Aten,
            "ATen is run where it is asked for, whatever the device"
        );
        let x = Tensor::zeros([2], (Kind::Float, Device::Cpu));
        assert_eq!(glue_for(Glue::Fused, &x), Glue::Aten);
        assert!(Glue::Fused.check_device(Device::Cpu).is_err());
        assert!(Glue::Aten.check_device(Device::Cpu).is_ok());
        assert!(matches!(check_fused(Device::Cpu, 1), Err(Error::Spec(_))));
    }

    /// The ATen path writes the rotated keys and the values at each row's positions and
    /// leaves every other cache position as it was.
    #[test]
    fn the_aten_path_writes_keys_and_values_at_the_rows_positions() {
        let (b, t, hq, hkv, d, cap) = (2i64, 3i64, 4i64, 2i64, 8i64, 10i64);
        tch::manual_seed(3);
        let qkv = Tensor::randn([b, t, (hq + 2 * hkv) * d], (Kind::Float, Device::Cpu));
        let cos = Tensor::ones([b, 1, t, d], (Kind::Float, Device::Cpu));
        let sin = Tensor::zeros([b, 1, t, d], (Kind::Float, Device::Cpu));
        let positions = Tensor::from_slice(&[0i64, 1, 2, 5, 6, 7]).view([b, t]);
        let glue = glue_for(Glue::Fused, &qkv);
        assert_eq!(glue, Glue::Aten);
        let (q, k, v) =
            rope_write_fresh(glue, &qkv, (hq, hkv, d), (&cos, &sin), &positions, cap).unwrap();
        // cos = 1, sin = 0: the rotation is the identity.
        let heads = qkv.view([b, t, hq + 2 * hkv, d]).transpose(1, 2);
        assert!(q.equal(&heads.narrow(1, 0, hq)));
        for (row, start) in [(0i64, 0i64), (1, 5)] {
            let kr = k.get(row).narrow(1, start, t);
            let vr = v.get(row).narrow(1, start, t);
            assert!(kr.equal(&heads.get(row).narrow(0, hq, hkv)));
            assert!(vr.equal(&heads.get(row).narrow(0, hq + hkv, hkv)));
        }
        let written = Tensor::from_slice(&[0i64, 1, 2]);
        let untouched = k.get(0).index_select(1, &written.f_add_scalar(3).unwrap());
        assert_eq!(untouched.abs().sum(Kind::Float).double_value(&[]), 0.0);
    }
}
