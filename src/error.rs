//! Typed errors for the library. Every variant renders as one line that names the subsystem,
//! so the binary can print it and exit non-zero without a panic trace.
use std::path::PathBuf;

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong in kvcredit, with enough context to act on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file the run needs is missing or unreadable.
    #[error("io: {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `config.json` (or GGUF metadata) is malformed or names something unsupported.
    #[error("config: {0}")]
    Config(String),
    /// The checkpoint names an architecture kvcredit does not implement.
    #[error(
        "config: unknown architecture `{0}` (supported: llama, mistral, qwen2, qwen3, gemma2, gemma3)"
    )]
    UnknownArch(String),
    /// Weights are missing, truncated, or have the wrong shape or dtype.
    #[error("weights: {0}")]
    Weights(String),
    /// GGUF parsing or de-quantization failed.
    #[error("gguf: {0}")]
    Gguf(String),
    /// Tokenizer construction or encoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The KV cache was asked for something it cannot do.
    #[error("kv-cache: {0}")]
    KvCache(String),
    /// The model produced non-finite logits.
    #[error("numerics: {0}")]
    NonFinite(String),
    /// A campaign or run specification is invalid.
    #[error("spec: {0}")]
    Spec(String),
    /// Fetching or verifying a model package failed.
    #[error("models: {0}")]
    Models(String),
    /// Reading or writing Parquet/JSON outputs failed.
    #[error("output: {0}")]
    Output(String),
    /// An invariant check failed (fingerprint mismatch, replica differs, ...).
    #[error("invariant: {0}")]
    Invariant(String),
    /// An error reported by libtorch.
    #[error("torch: {0}")]
    Torch(String),
    /// A tiered KV transfer (SpectrumKV) failed: bad plan, frame or budget.
    #[error("spectrum: {0}")]
    Spectrum(String),
}

impl From<tch::TchError> for Error {
    fn from(e: tch::TchError) -> Self {
        let msg = e.to_string();
        let first = msg.lines().next().unwrap_or("").to_string();
        if first.contains("out of memory") {
            Error::Torch(format!("out of memory: {first}"))
        } else {
            Error::Torch(first)
        }
    }
}

impl Error {
    /// Wrap an io error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
