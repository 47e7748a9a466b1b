//! RMSNorm in the two flavours the supported families use.
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
    pub fn new(weight: Tensor, eps: f64, weight_offset: bool) -> RmsNorm {
        let weight = if weight_offset { &weight + 1.0 } else { weight };
        RmsNorm {
            weight,
            eps,
            weight_offset,
        }
    }

    /// Normalize `x`, returning its dtype.
    pub fn forward(&self, x: &Tensor, policy: &ExecPolicy) -> Tensor {
        if self.weight_offset {
            let normed = policy.rms_normalize(x, self.eps, accum_kind(x.kind()));
            (normed * &self.weight).to_kind(x.kind())
        } else {
            &self.weight * policy.rms_normalize(x, self.eps, x.kind())
        }
    }
}
