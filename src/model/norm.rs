//! RMSNorm in the three flavours the supported families use.
use crate::Result;
use crate::exec::{ExecPolicy, accum_kind};
use tch::Tensor;

/// RMSNorm over the last dimension.
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
    /// `normalize(x) * w` in fp32, then cast (Gemma with `w` = `1 + w_checkpoint`, OLMo-2);
    /// otherwise LLaMA style: `w * normalize(x).to(dtype)`.
    weight_fp32: bool,
}

impl RmsNorm {
    /// A norm with the checkpoint's weight vector (`weight` already in fp32 when
    /// `weight_fp32`): `weight_offset` adds one to it (Gemma's `1 + w`).
    pub fn new(
        weight: Tensor,
        eps: f64,
        weight_offset: bool,
        weight_fp32: bool,
    ) -> Result<RmsNorm> {
        let weight = if weight_offset {
            weight.f_add_scalar(1.0)?
        } else {
            weight
        };
        Ok(RmsNorm {
            weight,
            eps,
            weight_fp32,
        })
    }

    /// Normalize `x`, returning its dtype.
    pub fn forward(&self, x: &Tensor, policy: &ExecPolicy) -> Result<Tensor> {
        if self.weight_fp32 {
            let normed = policy.rms_normalize(x, self.eps, accum_kind(x.kind()))?;
            Ok(normed.f_mul(&self.weight)?.f_to_kind(x.kind())?)
        } else {
            policy.rms_norm(x, &self.weight, self.eps)
        }
    }
}
