//! `kvcredit generate`: quick generation from a prompt or token ids.
use super::run_args::{Defaults, RunArgs, registry_paths};
use anyhow::{Context, bail};
use kvcredit::PolicyKind;
use kvcredit::generate::{GenerateOptions, generate, generate_nocache};
use kvcredit::runtime::{self, Dtype, ModelSource};
use kvcredit::sampling::Sampling;

#[derive(clap::Args)]
pub struct Args {
    /// Model: a Hugging Face directory.
    #[arg(long)]
    model: String,
    /// Prompt text (needs a tokenizer).
    #[arg(long, conflicts_with = "ids")]
    prompt: Option<String>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',')]
    ids: Option<Vec<i64>>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Seed of the sampling noise.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Dtype (default fp32), device, policy (default stock), tiles.
    #[command(flatten)]
    run: RunArgs,
    /// Recompute the whole sequence every step instead of using the KV cache.
    #[arg(long)]
    no_cache: bool,
    /// Run past the model's trained positions (`max_position_embeddings` / GGUF
    /// `context_length`), which are refused by default.
    #[arg(long)]
    allow_extrapolation: bool,
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        bail!(
            "--temperature {}: must be a finite number ≥ 0 (0 is greedy)",
            a.temperature
        );
    }
    kvcredit::study::bounds::tokens_at_most("--max-new-tokens", &[a.max_new_tokens])?;
    let cfg = a.run.resolve(Defaults {
        dtype: Dtype::Fp32,
        policy: PolicyKind::Stock,
    })?;
    let source = ModelSource::resolve(&a.model, &registry_paths())?;
    let mut model = runtime::load(&source, cfg.dtype, cfg.device)?;
    model.decoder.limit_context(!a.allow_extrapolation);
    model.decoder.use_settings(&cfg.exec);
    let prompt: Vec<i64> = match (&a.prompt, &a.ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => {
            let tok = model
                .tokenizer
                .as_ref()
                .context("this model has no tokenizer; pass --ids")?;
            let enc = tok
                .encode(text.as_str(), true)
                .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
            enc.get_ids().iter().map(|&x| x as i64).collect()
        }
        (None, None) => bail!("give --prompt or --ids"),
    };
    let opts = GenerateOptions {
        max_new_tokens: a.max_new_tokens,
        sampling: Sampling::from_temperature(a.temperature),
        seed: a.seed,
        stop_tokens: model.stop_tokens.clone(),
        policy: cfg.policy,
    };
    let out = if a.no_cache {
        generate_nocache(&model.decoder, &prompt, &opts)?
    } else {
        generate(&model.decoder, &prompt, &opts)?
    };
    if let Some(tok) = &model.tokenizer {
        let ids: Vec<u32> = out.tokens.iter().map(|&x| x as u32).collect();
        let text = tok
            .decode(&ids, false)
            .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
        println!("{text}");
    }
    println!("tokens: {:?}", out.tokens);
    let n = out.tokens.len().max(1) as f64;
    println!(
        "prompt {} tokens in {:.3} s; {} new tokens in {:.3} s ({:.1} tok/s) [{} {} {}]",
        prompt.len(),
        out.prefill_secs,
        out.tokens.len(),
        out.decode_secs,
        n / out.decode_secs.max(1e-9),
        cfg.dtype,
        cfg.device_name,
        cfg.policy
    );
    Ok(())
}
