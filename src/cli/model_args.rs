//! The model choice shared by commands that run either a real or a synthetic model.
use super::run_args::registry_paths;
use anyhow::{Context, bail};
use kvcredit::Decoder;
use kvcredit::ExecSettings;
use kvcredit::model::synthetic;
use kvcredit::runtime::{self, Dtype, ModelSource};
use tch::Device;

/// `--model`, or `--synthetic` with `--weight-seed`.
#[derive(clap::Args)]
pub struct ModelArgs {
    /// Model: a registry name, `.gguf` file or Hugging Face directory.
    #[arg(
        long,
        required_unless_present = "synthetic",
        conflicts_with = "synthetic"
    )]
    pub model: Option<String>,
    /// Instead of a model: seeded random weights (std 0.02) with the shape of a real
    /// checkpoint (qwen2.5-0.5b, qwen2.5-1.5b, tiny-qwen2, ...).
    #[arg(long)]
    pub synthetic: Option<String>,
    /// Seed of the synthetic weights.
    #[arg(long, default_value_t = 0)]
    pub weight_seed: i64,
    /// Run past the model's trained positions (`max_position_embeddings` / GGUF
    /// `context_length`), which are refused by default.
    #[arg(long)]
    pub allow_extrapolation: bool,
}

/// A loaded model and how reports name it.
pub struct Chosen {
    /// The decoder.
    pub decoder: Decoder,
    /// Description: the model argument, or the synthetic shape and seed.
    pub what: String,
    /// The synthetic shape's name, if synthetic.
    pub shape: Option<String>,
}

impl ModelArgs {
    /// Load the chosen model in `dtype` on `device` (synthetic weights are drawn there), its
    /// glue ops run and its tokens drawn as `exec` asks.
    pub fn load(
        &self,
        dtype: Dtype,
        device: Device,
        exec: &ExecSettings,
    ) -> anyhow::Result<Chosen> {
        let mut chosen = match (&self.model, &self.synthetic) {
            (Some(m), _) => Chosen {
                decoder: runtime::load(
                    &ModelSource::resolve(m, &registry_paths())?,
                    dtype,
                    device,
                )?
                .decoder,
                what: m.clone(),
                shape: None,
            },
            (None, Some(name)) => Chosen {
                decoder: synthetic::decoder(name, dtype.kind(), device, self.weight_seed)
                    .with_context(|| format!("synthetic model `{name}`"))?,
                what: format!("synthetic {name} (weight seed {})", self.weight_seed),
                shape: Some(name.clone()),
            },
            (None, None) => bail!("give --model or --synthetic"),
        };
        chosen.decoder.limit_context(!self.allow_extrapolation);
        chosen.decoder.use_settings(exec);
        Ok(chosen)
    }
}
