//! RMSNorm in the two flavours the supported families use.
use crate::Result;
use crate::exec::{ExecPolicy, accum_kind};
use tch::Tensor;

/// RMSNorm over the last dimension.
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
    /// Gemma style: `normalize(x) * (1 + w)` in fp32, then cast; otherwise LLaMA style:
    /// `w * normalize(x).to(dtype)`.
    weight_offset: bool,
}

impl RmsNorm {
    /// A norm with the checkpoint's weight vector.
    pub fn new(weight: Tensor, eps: f64, weight_offset: bool) -> Result<RmsNorm> {
        let weight = if weight_offset {
            weight.f_add_scalar(1.0)?
        } else {
            weight
        };
        Ok(RmsNorm {
            weight,
            eps,
            weight_offset,
        })
    }

    /// Normalize `x`, returning its dtype.
    pub fn forward(&self, x: &Tensor, policy: &ExecPolicy) -> Result<Tensor> {
        if self.weight_offset {
            let normed = policy.rms_normalize(x, self.eps, accum_kind(x.kind()))?;
            Ok(normed.f_mul(&self.weight)?.f_to_kind(x.kind())?)
        } else {
            policy.rms_norm(x, &self.weight, self.eps)
        }
    }
}
