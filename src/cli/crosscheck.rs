//! `kvcredit crosscheck`: teacher-forced logits on a device/dtype against CPU fp32.
use super::model_args::ModelArgs;
use super::run_args::registry_paths;
use anyhow::bail;
use kvcredit::model::synthetic;
use kvcredit::runtime::{self, Dtype, ModelSource};
use kvcredit::{Decoder, ExecPolicy};
use tch::{Device, Kind, Tensor};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Token ids, comma-separated (default: 32 fixed ids below the vocabulary size).
    #[arg(long, value_delimiter = ',')]
    ids: Option<Vec<i64>>,
    /// Device under test.
    #[arg(long, default_value = "cuda")]
    device: String,
    /// Dtypes under test.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = vec![Dtype::Fp16, Dtype::Bf16])]
    dtype: Vec<Dtype>,
    /// Largest allowed max-abs difference from CPU fp32.
    #[arg(long, default_value_t = 2e-2)]
    tol: f64,
}

/// Load the model under test (or the CPU fp32 reference) in `dtype` on `device`.
fn load(a: &Args, dtype: Dtype, device: Device) -> anyhow::Result<Decoder> {
    let mut decoder = match (&a.model.model, &a.model.synthetic) {
        (Some(m), _) => {
            runtime::load(&ModelSource::resolve(m, &registry_paths())?, dtype, device)?.decoder
        }
        (None, Some(name)) => {
            // Weights are drawn on the CPU in fp32 so every device and dtype sees the same values.
            let cfg = synthetic::config(name)?;
            let w = synthetic::random_weights(&cfg, Kind::Float, Device::Cpu, a.model.weight_seed)?;
            Decoder::from_weights(cfg, w.with_target(dtype.kind(), device))?
        }
        (None, None) => bail!("give --model or --synthetic"),
    };
    decoder.limit_context(!a.model.allow_extrapolation);
    Ok(decoder)
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let reference = load(&a, Dtype::Fp32, Device::Cpu)?;
    let vocab = reference.config().vocab_size as i64;
    let ids = a
        .ids
        .clone()
        .unwrap_or_else(|| (0..32).map(|i| (i * 7919 + 11) % vocab).collect());
    let t = Tensor::f_from_slice(&ids)?.f_view([1, -1])?;
    let want = reference.forward_full(&t, &ExecPolicy::Stock)?;
    drop(reference);
    let device = runtime::parse_device(&a.device)?;
    let mut failed = false;
    for &dtype in &a.dtype {
        let m = load(&a, dtype, device)?;
        let got = m
            .forward_full(&t, &ExecPolicy::Stock)?
            .f_to_device(Device::Cpu)?
            .f_to_kind(Kind::Float)?;
        let diff = got.f_sub(&want)?.f_abs()?.f_max()?.f_double_value(&[])?;
        let ok = diff <= a.tol;
        failed |= !ok;
        println!(
            "{} {dtype} vs cpu fp32: max |Δlogit| = {diff:.3e} over {} positions ({})",
            a.device,
            ids.len(),
            if ok { "ok" } else { "FAIL" }
        );
    }
    if failed {
        bail!("logits differ from CPU fp32 by more than {}", a.tol);
    }
    Ok(())
}
