//! Gated MLP: `down(act(gate(x)) * up(x))`, with gate and up fused into one projection.
use crate::Result;
use crate::config::Activation;
use crate::exec::ExecPolicy;
use crate::exec::glue::Glue;
use tch::Tensor;

/// Gated MLP of one layer.
pub struct Mlp {
    /// `[2 * intermediate, hidden]`: gate rows then up rows.
    gate_up: Tensor,
    down: Tensor,
    intermediate: i64,
    activation: Activation,
}

impl Mlp {
    /// Fuse the checkpoint's `gate_proj` and `up_proj` weights.
    pub fn new(gate: &Tensor, up: &Tensor, down: Tensor, activation: Activation) -> Result<Mlp> {
        Ok(Mlp {
            intermediate: gate.size()[0],
            gate_up: Tensor::f_cat(&[gate, up], 0)?,
            down,
            activation,
        })
    }

    /// Apply to `x` (`[B, T, hidden]`), the SiLU product by `glue` where it is fusable.
    pub fn forward(&self, x: &Tensor, policy: &ExecPolicy, glue: Glue) -> Result<Tensor> {
        let gu = policy.linear(x, &self.gate_up, None)?;
        let act = policy.gated(&gu, self.intermediate, self.activation, glue)?;
        policy.linear(&act, &self.down, None)
    }
}
