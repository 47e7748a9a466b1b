//! Rotary position embeddings (half-rotation layout, as in Hugging Face), with linear and
//! Llama-3 frequency scaling. Angles are computed in fp32 from the absolute positions of the
//! tokens in each forward pass, so a token's rotation never depends on its batch neighbours.
use crate::Result;
use crate::config::{Rope, RopeScaling};
use tch::{Device, Kind, Tensor};

/// Inverse frequencies for one RoPE configuration, kept on the run device.
pub struct RopeTable {
    inv_freq: Tensor,
}

impl RopeTable {
    /// Inverse frequencies `1 / θ^(2i/d)`, scaled as the configuration asks.
    pub fn new(rope: &Rope, head_dim: usize, device: Device) -> Result<RopeTable> {
        let d = head_dim as f64;
        let base: Vec<f64> = (0..head_dim / 2)
            .map(|i| 1.0 / rope.theta.powf(2.0 * i as f64 / d))
            .collect();
        let scaled: Vec<f32> = base
            .iter()
            .map(|&f| match rope.scaling {
                RopeScaling::None => f,
                RopeScaling::Linear { factor } => f / factor,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings: old,
                } => {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    let low_wavelen = old / low_freq_factor;
                    let high_wavelen = old / high_freq_factor;
                    if wavelen > low_wavelen {
                        f / factor
                    } else if wavelen < high_wavelen {
                        f
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                }
            } as f32)
            .collect();
        Ok(RopeTable {
            inv_freq: Tensor::f_from_slice(&scaled)?.f_to_device(device)?,
        })
    }

    /// `(cos, sin)` of shape `[B, 1, T, D]` in `kind` for absolute `positions` `[B, T]`, with
    /// the sign of `rotate_half` folded into the sines: the first half of `sin` is negated, so
    /// that [`apply`] rotates with one `roll`.
    pub fn cos_sin(&self, positions: &Tensor, kind: Kind) -> Result<(Tensor, Tensor)> {
        let freqs = positions
            .f_to_kind(Kind::Float)?
            .f_unsqueeze(-1)?
            .f_mul(&self.inv_freq.f_view([1, 1, -1])?)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?.f_unsqueeze(1)?;
        let sin = emb.f_sin()?.f_to_kind(kind)?;
        let half = sin.size()[3] / 2;
        let signed = Tensor::f_cat(
            &[
                sin.f_narrow(3, 0, half)?.f_neg()?,
                sin.f_narrow(3, half, half)?,
            ],
            3,
        )?;
        Ok((emb.f_cos()?.f_to_kind(kind)?, signed))
    }
}

/// Rotate `x` (`[B, H, T, D]`) by the given angles (`sin` as [`RopeTable::cos_sin`] returns
/// it). Bitwise the same as Hugging Face's `x·cos + rotate_half(x)·sin`: `rotate_half(x)·sin`
/// is `[−x₂·s, x₁·s]` and `roll(x)·signed` is `[x₂·(−s), x₁·s]`, equal since IEEE products
/// are sign-symmetric.
pub fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.size()[3] / 2;
    let rotated = x.f_roll([half], [3])?;
    Ok(x.f_mul(cos)?.f_add(&rotated.f_mul(sin)?)?)
}
