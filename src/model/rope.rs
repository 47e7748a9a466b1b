//! Rotary position embeddings (half-rotation layout, as in Hugging Face), with linear,
//! Llama-3, YaRN, dynamic-NTK and LongRoPE frequency scaling (transformers'
//! `modeling_rope_utils.py`). Angles are computed in fp32 from the absolute positions of the
//! tokens in each forward pass, so a token's rotation never depends on its batch neighbours;
//! where the frequencies change with the sequence length (dynamic NTK, LongRoPE past its
//! original length) the length is the token's own position plus one.
use crate::Result;
use crate::config::{Rope, RopeScaling};
use tch::{Device, Kind, Tensor};

/// Inverse frequencies for one RoPE configuration, kept on the run device.
pub struct RopeTable {
    /// `[D/2]` fp32: the frequencies of every position (static scalings) or of positions
    /// within the trained length (dynamic NTK, LongRoPE's short factors).
    inv_freq: Tensor,
    /// Frequencies that depend on the position.
    by_position: ByPosition,
    /// Multiplier of cos and sin (YaRN, LongRoPE); `1` otherwise.
    attention_factor: f64,
}

/// How the frequencies change with the position.
enum ByPosition {
    /// They do not.
    Fixed,
    /// Dynamic NTK: position `p` with `p + 1 > max` uses the base `θ·s^(D/(D−2))`,
    /// `s = factor·(p+1)/max − (factor − 1)`, i.e. `inv_freq_i · s^(−2i/(D−2))`. Positions
    /// `max..max + rows` (the context limit `max · factor`, at most [`MAX_NTK_ROWS`] rows) are
    /// read from `table`, computed on the host, so that their frequencies never depend on how
    /// a device kernel splits a batch into vector lanes (vectorized and scalar `exp` may round
    /// differently); positions past it (only with `--allow-extrapolation`) are computed on the
    /// device.
    DynamicNtk {
        factor: f64,
        max: f64,
        /// `[rows, D/2]` fp32, row `r` for position `max + r`.
        table: Tensor,
        /// `inv_freq` in fp64 `[D/2]`.
        base: Tensor,
        /// `−2i/(D−2)` in fp64 `[D/2]`.
        exponents: Tensor,
    },
    /// LongRoPE past the original length (beyond the context limit, see
    /// [`RopeScaling::LongRope`]): positions `p` with `p + 1 > original` use `long` (`[D/2]`
    /// fp32).
    LongRope { long: Tensor, original: f64 },
}

/// Most host-computed rows of a dynamic-NTK table.
const MAX_NTK_ROWS: usize = 1 << 16;

/// `1 / θ^(2i/d)` for `i < d/2`, in fp64.
fn plain_inv_freq(theta: f64, head_dim: usize) -> Vec<f64> {
    let d = head_dim as f64;
    (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / d))
        .collect()
}

/// YaRN's frequencies (transformers' `_compute_yarn_parameters`): between the dimensions
/// that turn `beta_fast` and `beta_slow` times over the original length, a linear ramp from
/// the original frequencies to those divided by `factor`.
fn yarn_inv_freq(
    theta: f64,
    head_dim: usize,
    factor: f64,
    original: f64,
    (beta_fast, beta_slow): (f64, f64),
    truncate: bool,
) -> Vec<f64> {
    let d = head_dim as f64;
    let correction_dim = |rotations: f64| {
        d * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
    if low == high {
        high += 0.001;
    }
    plain_inv_freq(theta, head_dim)
        .into_iter()
        .enumerate()
        .map(|(i, f)| {
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolate = 1.0 - ramp;
            (f / factor) * (1.0 - extrapolate) + f * extrapolate
        })
        .collect()
}

fn to_f32_tensor(xs: &[f64], device: Device) -> Result<Tensor> {
    let v: Vec<f32> = xs.iter().map(|&x| x as f32).collect();
    Ok(Tensor::f_from_slice(&v)?.f_to_device(device)?)
}

impl RopeTable {
    /// Inverse frequencies `1 / θ^(2i/d)`, scaled as the configuration asks.
    pub fn new(rope: &Rope, head_dim: usize, device: Device) -> Result<RopeTable> {
        let base = plain_inv_freq(rope.theta, head_dim);
        let fixed = |inv: Vec<f64>, attention_factor: f64| -> Result<RopeTable> {
            Ok(RopeTable {
                inv_freq: to_f32_tensor(&inv, device)?,
                by_position: ByPosition::Fixed,
                attention_factor,
            })
        };
        match &rope.scaling {
            RopeScaling::None => fixed(base, 1.0),
            RopeScaling::Linear { factor } => fixed(base.iter().map(|f| f / factor).collect(), 1.0),
            &RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let scaled = base
                    .iter()
                    .map(|&f| {
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
                    })
                    .collect();
                fixed(scaled, 1.0)
            }
            &RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                attention_factor,
            } => fixed(
                yarn_inv_freq(
                    rope.theta,
                    head_dim,
                    factor,
                    original_max_position_embeddings,
                    (beta_fast, beta_slow),
                    truncate,
                ),
                attention_factor,
            ),
            &RopeScaling::DynamicNtk {
                factor,
                max_position_embeddings,
            } => {
                let d = head_dim as f64;
                let exponents: Vec<f64> = (0..head_dim / 2)
                    .map(|i| -2.0 * i as f64 / (d - 2.0))
                    .collect();
                let max = max_position_embeddings;
                let rows = ((max * factor).ceil() - max).clamp(1.0, MAX_NTK_ROWS as f64) as usize;
                let mut table = Vec::with_capacity(rows * head_dim / 2);
                for r in 0..rows {
                    let s = factor * (max + r as f64 + 1.0) / max - (factor - 1.0);
                    table.extend(
                        base.iter()
                            .zip(&exponents)
                            .map(|(f, e)| (f * (e * s.ln()).exp()) as f32),
                    );
                }
                Ok(RopeTable {
                    inv_freq: to_f32_tensor(&base, device)?,
                    by_position: ByPosition::DynamicNtk {
                        factor,
                        max,
                        table: Tensor::f_from_slice(&table)?
                            .f_view([rows as i64, (head_dim / 2) as i64])?
                            .f_to_device(device)?,
                        base: Tensor::f_from_slice(&base)?.f_to_device(device)?,
                        exponents: Tensor::f_from_slice(&exponents)?.f_to_device(device)?,
                    },
                    attention_factor: 1.0,
                })
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                attention_factor,
            } => {
                let divide = |factors: &[f64]| -> Vec<f64> {
                    base.iter().zip(factors).map(|(f, s)| f / s).collect()
                };
                Ok(RopeTable {
                    inv_freq: to_f32_tensor(&divide(short_factor), device)?,
                    by_position: ByPosition::LongRope {
                        long: to_f32_tensor(&divide(long_factor), device)?,
                        original: *original_max_position_embeddings,
                    },
                    attention_factor: *attention_factor,
                })
            }
        }
    }

    /// Inverse frequencies per position: `[1, 1, D/2]`, or `[B, T, D/2]` where they depend
    /// on the position.
    fn inv_freq_at(&self, positions: &Tensor) -> Result<Tensor> {
        let fixed = self.inv_freq.f_view([1, 1, -1])?;
        Ok(match &self.by_position {
            ByPosition::Fixed => fixed,
            ByPosition::DynamicNtk {
                factor,
                max,
                table,
                base,
                exponents,
            } => {
                let (b, t) = (positions.size()[0], positions.size()[1]);
                let (rows, half) = (table.size()[0], table.size()[1]);
                let start = *max as i64;
                // Within the trained length: the plain frequencies; then the table.
                let row = positions.f_sub_scalar(start)?.f_clamp(0, rows - 1)?;
                let from_table = table
                    .f_index_select(0, &row.f_reshape([-1])?)?
                    .f_view([b, t, half])?;
                let trained = positions.f_lt(start)?.f_unsqueeze(-1)?;
                let inv = fixed.f_where_self(&trained, &from_table)?;
                // Past the table: s = factor·(p+1)/max − (factor − 1) on the device.
                let s = positions
                    .f_to_kind(Kind::Double)?
                    .f_add_scalar(1.0)?
                    .f_mul_scalar(*factor / *max)?
                    .f_sub_scalar(*factor - 1.0)?
                    .f_clamp_min(1.0)?
                    .f_unsqueeze(-1)?;
                let computed = s
                    .f_log()?
                    .f_mul(&exponents.f_view([1, 1, -1])?)?
                    .f_exp()?
                    .f_mul(&base.f_view([1, 1, -1])?)?
                    .f_to_kind(Kind::Float)?;
                let past = positions.f_ge(start + rows)?.f_unsqueeze(-1)?;
                computed.f_where_self(&past, &inv)?
            }
            ByPosition::LongRope { long, original } => {
                let is_long = positions
                    .f_to_kind(Kind::Double)?
                    .f_add_scalar(1.0)?
                    .f_gt(*original)?
                    .f_unsqueeze(-1)?;
                long.f_view([1, 1, -1])?.f_where_self(&is_long, &fixed)?
            }
        })
    }

    /// `(cos, sin)` of shape `[B, 1, T, D]` in `kind` for absolute `positions` `[B, T]`, with
    /// the sign of `rotate_half` folded into the sines: the first half of `sin` is negated, so
    /// that [`crate::exec::glue::rope_apply`] rotates with one `roll`.
    pub fn cos_sin(&self, positions: &Tensor, kind: Kind) -> Result<(Tensor, Tensor)> {
        let freqs = positions
            .f_to_kind(Kind::Float)?
            .f_unsqueeze(-1)?
            .f_mul(&self.inv_freq_at(positions)?)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?.f_unsqueeze(1)?;
        let (mut cos, mut sin) = (emb.f_cos()?, emb.f_sin()?);
        if self.attention_factor != 1.0 {
            cos = cos.f_mul_scalar(self.attention_factor)?;
            sin = sin.f_mul_scalar(self.attention_factor)?;
        }
        let sin = sin.f_to_kind(kind)?;
        let half = sin.size()[3] / 2;
        let signed = Tensor::f_cat(
            &[
                sin.f_narrow(3, 0, half)?.f_neg()?,
                sin.f_narrow(3, half, half)?,
            ],
            3,
        )?;
        Ok((cos.f_to_kind(kind)?, signed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ArchConfig, LayerKind};
    use std::path::Path;

    fn values(t: &Tensor) -> Vec<f64> {
        Vec::<f64>::try_from(t.to_kind(Kind::Double).reshape([-1])).unwrap()
    }

    fn rel_diff(a: &[f64], b: &[f64]) -> f64 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / y.abs())
            .fold(0.0, f64::max)
    }

    #[test]
    fn frequencies_and_attention_factor_match_transformers_on_every_fixture() -> Result<()> {
        // expected.json holds, per layer, the `inv_freq` and `attention_scaling` transformers
        // computed (for dynamic NTK: those of the trained length).
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf");
        let mut checked = Vec::new();
        for entry in std::fs::read_dir(&root).unwrap() {
            let dir = entry.unwrap().path();
            if !dir.join("config.json").exists() {
                continue;
            }
            let cfg = ArchConfig::from_hf_file(&dir.join("config.json"))?;
            let text = std::fs::read_to_string(dir.join("expected.json")).unwrap();
            let exp: serde_json::Value = serde_json::from_str(&text).unwrap();
            for (i, kind) in cfg.layer_types.iter().enumerate() {
                let rope = match (kind, &cfg.rope_local) {
                    (LayerKind::Sliding { .. }, Some(local)) => local,
                    _ => &cfg.rope,
                };
                let table = RopeTable::new(rope, cfg.head_dim, Device::Cpu)?;
                let layer = &exp["layer_rope"][i];
                let want: Vec<f64> = layer["inv_freq"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect();
                let diff = rel_diff(&values(&table.inv_freq), &want);
                let name = dir.file_name().unwrap().to_string_lossy().into_owned();
                // HF computes in fp32, this table in fp64 rounded once to fp32.
                assert!(diff < 1e-6, "{name} layer {i}: inv_freq rel diff {diff}");
                let att = layer["attention_scaling"].as_f64().unwrap();
                assert!(
                    (table.attention_factor - att).abs() < 1e-12,
                    "{name}: attention factor {} vs {att}",
                    table.attention_factor
                );
                checked.push(name);
            }
        }
        for must in [
            "qwen2_yarn",
            "llama_yarn_mscale",
            "llama_dynamic",
            "phi3_longrope",
        ] {
            assert!(checked.iter().any(|n| n == must), "fixture {must} missing");
        }
        Ok(())
    }

    #[test]
    fn yarn_changes_the_low_frequencies_only() -> Result<()> {
        let plain = plain_inv_freq(1e4, 16);
        let yarn = yarn_inv_freq(1e4, 16, 8.0, 2048.0, (32.0, 1.0), true);
        // Ramp ends: floor(2.02) = 2 and ceil(5.03) = 6.
        assert_eq!(&yarn[..3], &plain[..3]);
        for i in 3..6 {
            assert!(yarn[i] < plain[i] && yarn[i] > plain[i] / 8.0, "{i}");
        }
        for i in 6..8 {
            assert!((yarn[i] - plain[i] / 8.0).abs() < 1e-18, "{i}");
        }
        Ok(())
    }

    fn table(scaling: RopeScaling) -> Result<RopeTable> {
        RopeTable::new(
            &Rope {
                theta: 1e4,
                scaling,
            },
            16,
            Device::Cpu,
        )
    }

    /// Inverse frequencies of each of `positions` as `[positions][D/2]`.
    fn per_position(t: &RopeTable, positions: &[i64]) -> Result<Vec<Vec<f64>>> {
        let p = Tensor::from_slice(positions).view([1, -1]);
        let inv = t
            .inv_freq_at(&p)?
            .expand([1, positions.len() as i64, 8], false);
        Ok((0..positions.len() as i64)
            .map(|i| values(&inv.get(0).get(i)))
            .collect())
    }

    #[test]
    fn dynamic_ntk_grows_the_base_per_position() -> Result<()> {
        let t = table(RopeScaling::DynamicNtk {
            factor: 2.0,
            max_position_embeddings: 16.0,
        })?;
        let plain = values(&table(RopeScaling::None)?.inv_freq);
        // Positions 16..32 come from the host table, 40 and 100 from the device formula.
        let got = per_position(&t, &[0, 15, 16, 30, 31, 32, 40, 100])?;
        // Within the trained length: bitwise the plain frequencies.
        assert_eq!(got[0], plain);
        assert_eq!(got[1], plain);
        // Past it: transformers' base θ·(factor·len/max − (factor − 1))^(d/(d−2)), len = p + 1.
        for (row, p) in [
            (2, 16.0),
            (3, 30.0),
            (4, 31.0),
            (5, 32.0),
            (6, 40.0),
            (7, 100.0),
        ] {
            let base = 1e4 * (2.0 * (p + 1.0) / 16.0 - 1.0f64).powf(16.0 / 14.0);
            let want = plain_inv_freq(base, 16);
            let diff = rel_diff(&got[row], &want);
            assert!(diff < 1e-6, "position {p}: {diff}");
            assert!(got[row][1] < plain[1], "the base grew");
        }
        // A position reads the same frequencies whatever the batch around it.
        let alone = per_position(&t, &[20])?;
        let batch = per_position(&t, &[3, 20, 7, 25, 19])?;
        assert_eq!(alone[0], batch[1]);
        Ok(())
    }

    #[test]
    fn longrope_uses_long_factors_from_the_original_length_on() -> Result<()> {
        let short = vec![1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7];
        let long = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let t = table(RopeScaling::LongRope {
            short_factor: short.clone(),
            long_factor: long.clone(),
            original_max_position_embeddings: 32.0,
            attention_factor: 1.2,
        })?;
        let plain = plain_inv_freq(1e4, 16);
        let got = per_position(&t, &[0, 31, 32, 40])?;
        let divided = |f: &[f64]| -> Vec<f64> {
            plain
                .iter()
                .zip(f)
                .map(|(p, s)| ((p / s) as f32) as f64)
                .collect()
        };
        assert_eq!(got[0], divided(&short));
        assert_eq!(got[1], divided(&short));
        assert_eq!(got[2], divided(&long));
        assert_eq!(got[3], divided(&long));
        // cos/sin carry the attention factor: cos² + sin² = 1.2².
        let (cos, sin) = t.cos_sin(&Tensor::from_slice(&[5i64]).view([1, 1]), Kind::Float)?;
        let norm = values(&(cos.square() + sin.square()));
        assert!(norm.iter().all(|x| (x - 1.44).abs() < 1e-5), "{norm:?}");
        Ok(())
    }
}
