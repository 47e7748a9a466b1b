//! Run-time choices shared by every command: device, dtype, and where a model comes from.
use crate::model::Decoder;
use crate::registry::RegistryPaths;
use crate::tasks::Prompt;
use crate::{Error, Result};
use std::path::{Path, PathBuf};
use tch::{Device, Kind};

/// Floating-point type of weights and activations.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// IEEE single precision.
    Fp32,
    /// IEEE half precision.
    Fp16,
    /// bfloat16.
    Bf16,
}

impl Dtype {
    /// The libtorch kind.
    pub fn kind(self) -> Kind {
        match self {
            Dtype::Fp32 => Kind::Float,
            Dtype::Fp16 => Kind::Half,
            Dtype::Bf16 => Kind::BFloat16,
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Dtype::Fp32 => "fp32",
            Dtype::Fp16 => "fp16",
            Dtype::Bf16 => "bf16",
        })
    }
}

/// Wait for the device's queued work (a no-op on the CPU), so wall-clock timings are honest.
pub fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Parse `cpu`, `cuda` or `cuda:N`, checking that CUDA is really available.
pub fn parse_device(s: &str) -> Result<Device> {
    let dev = match s {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => Device::Cuda(0),
        _ => match s
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
        {
            Some(n) => Device::Cuda(n),
            None => {
                return Err(Error::Spec(format!(
                    "unknown device `{s}` (use cpu, cuda or cuda:N)"
                )));
            }
        },
    };
    let n = tch::Cuda::device_count() as usize;
    match dev {
        Device::Cuda(i) if i < n => Ok(dev),
        _ => Err(Error::Spec(format!(
            "device `{s}` requested but libtorch sees {n} CUDA device(s)"
        ))),
    }
}

/// Where a model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A Hugging Face directory (`config.json`, safetensors, optional `tokenizer.json`).
    HfDir(PathBuf),
    /// A GGUF file; `name` is the registry name when it came from the registry.
    Gguf {
        /// The file.
        path: PathBuf,
        /// Registry name, if any.
        name: Option<String>,
        /// Where the file's digest is cached (`None`: hashed on every load).
        digests: Option<PathBuf>,
    },
}

impl ModelSource {
    /// Resolve a command-line model argument: an existing folder or `.gguf` file, else a
    /// registry name (which must have been pulled into the cache of `registry`).
    pub fn resolve(arg: &str, registry: &RegistryPaths) -> Result<ModelSource> {
        let path = Path::new(arg);
        if path.is_dir() {
            return Ok(ModelSource::HfDir(path.to_path_buf()));
        }
        if path.is_file() {
            return Ok(ModelSource::Gguf {
                path: path.to_path_buf(),
                name: None,
                digests: registry.digest_cache(),
            });
        }
        if arg.contains('/') || arg.ends_with(".gguf") {
            return Err(Error::Spec(format!(
                "model `{arg}`: no such file or directory"
            )));
        }
        let path = crate::registry::model_path(registry, arg)?;
        Ok(ModelSource::Gguf {
            path,
            name: Some(arg.to_string()),
            digests: registry.digest_cache(),
        })
    }
}

/// A model ready to run, with its tokenizer when one was found.
pub struct LoadedModel {
    /// The decoder.
    pub decoder: Decoder,
    /// Tokenizer, if the source had one.
    pub tokenizer: Option<tokenizers::Tokenizer>,
    /// Chat template, if the source had one.
    pub chat: Option<crate::chat::ChatTemplate>,
    /// Token ids that end a sequence: EOS and the end-of-turn tokens (EOS first).
    pub stop_tokens: Vec<i64>,
    /// The tokenizer's special (control) token ids, ascending; those that are not stop tokens
    /// are never pivots or alternatives.
    pub special_tokens: Vec<i64>,
    /// Short name for records.
    pub name: String,
    /// SHA-256 of the weights file, when known.
    pub sha256: Option<String>,
}

impl LoadedModel {
    fn tokenizer(&self) -> Result<&tokenizers::Tokenizer> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| Error::Tokenizer(format!("model `{}` has no tokenizer", self.name)))
    }

    /// Token ids of a task prompt: chat messages go through the chat template (which writes
    /// the special tokens itself); raw text is encoded with the tokenizer's special tokens.
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<i64>> {
        let tok = self.tokenizer()?;
        let (text, add_special) = match prompt {
            Prompt::Text { text } => (text.clone(), true),
            Prompt::Chat { messages } => {
                let template = self.chat.as_ref().ok_or_else(|| {
                    Error::Tokenizer(format!("model `{}` has no chat template", self.name))
                })?;
                (
                    template.render_with(messages, true, serde_json::Value::Null)?,
                    false,
                )
            }
        };
        let enc = tok
            .encode(text.as_str(), add_special)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().iter().map(|&x| x as i64).collect())
    }

    /// Text of token ids (special tokens kept, so stop markers stay visible to graders).
    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        let ids: Vec<u32> = ids.iter().map(|&x| x as u32).collect();
        self.tokenizer()?
            .decode(&ids, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }
}

fn ids_i64(ids: &[u32]) -> Vec<i64> {
    ids.iter().map(|&x| x as i64).collect()
}

/// Load a model from its source.
pub fn load(source: &ModelSource, dtype: Dtype, device: Device) -> Result<LoadedModel> {
    match source {
        ModelSource::HfDir(dir) => {
            let decoder = Decoder::load_hf_dir(dir, dtype.kind(), device)?;
            let tok_path = dir.join("tokenizer.json");
            let tokenizer = match tok_path.exists() {
                true => Some(crate::tokenizer::from_file(&tok_path)?),
                false => None,
            };
            let tc_path = dir.join("tokenizer_config.json");
            let chat = match tc_path.exists() {
                true => Some(crate::chat::ChatTemplate::from_tokenizer_config(&tc_path)?),
                false => None,
            };
            let eos = &decoder.config().eos_token_ids;
            let (stop_tokens, special_tokens) = match &tokenizer {
                Some(t) => (
                    crate::tokenizer::hf_stop_token_ids(eos, t),
                    crate::tokenizer::special_token_ids(t),
                ),
                None => (eos.clone(), vec![]),
            };
            Ok(LoadedModel {
                decoder,
                tokenizer,
                chat,
                stop_tokens: ids_i64(&stop_tokens),
                special_tokens: ids_i64(&special_tokens),
                name: dir.display().to_string(),
                sha256: None,
            })
        }
        ModelSource::Gguf {
            path,
            name,
            digests,
        } => {
            // The file's own digest; a registry model whose bytes are not its entry's is
            // refused before it is parsed.
            let sha256 = Some(crate::registry::model_sha256(
                path,
                name.as_deref(),
                digests.as_deref(),
            )?);
            let mut g = crate::model::gguf::load(path)?;
            let decoder = g.take_decoder(dtype.kind(), device)?;
            let text = |id: Option<u32>| id.and_then(|i| g.tokenizer.id_to_token(i));
            let chat = match &g.chat_template {
                Some(src) => Some(crate::chat::ChatTemplate::new(
                    src,
                    text(g.bos_token_id).as_deref(),
                    text(g.eos_token_ids.first().copied()).as_deref(),
                )?),
                None => None,
            };
            let label = name.clone().unwrap_or_else(|| {
                path.file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default()
            });
            Ok(LoadedModel {
                decoder,
                stop_tokens: ids_i64(&g.eos_token_ids),
                special_tokens: ids_i64(&crate::tokenizer::special_token_ids(&g.tokenizer)),
                tokenizer: Some(g.tokenizer),
                chat,
                name: label,
                sha256,
            })
        }
    }
}
