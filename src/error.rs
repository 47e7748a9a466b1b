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
    #[error("config: {}", one_line(.0))]
    Config(String),
    /// The checkpoint names an architecture kvcredit does not implement.
    #[error(
        "config: unknown architecture `{}` (supported: llama, mistral, qwen2, qwen3, gemma2, gemma3, olmo2, phi3)",
        one_line(.0)
    )]
    UnknownArch(String),
    /// Weights are missing, truncated, or have the wrong shape or dtype.
    #[error("weights: {}", one_line(.0))]
    Weights(String),
    /// GGUF parsing or de-quantization failed.
    #[error("gguf: {}", one_line(.0))]
    Gguf(String),
    /// Tokenizer construction or encoding failed.
    #[error("tokenizer: {}", one_line(.0))]
    Tokenizer(String),
    /// The KV cache was asked for something it cannot do.
    #[error("kv-cache: {}", one_line(.0))]
    KvCache(String),
    /// A request needs more positions than the model was trained for.
    #[error("context: {}", one_line(.0))]
    ContextLimit(String),
    /// The model produced non-finite logits.
    #[error("numerics: {}", one_line(.0))]
    NonFinite(String),
    /// A campaign or run specification is invalid.
    #[error("spec: {}", one_line(.0))]
    Spec(String),
    /// Fetching or verifying a model package failed.
    #[error("models: {}", one_line(.0))]
    Models(String),
    /// Reading or writing Parquet/JSON outputs failed.
    #[error("output: {}", one_line(.0))]
    Output(String),
    /// A file's bytes are not the ones recorded for it (sha256 of a table, shard or model).
    #[error("integrity: {}", one_line(.0))]
    Integrity(String),
    /// An invariant check failed (fingerprint mismatch, replica differs, ...).
    #[error("invariant: {}", one_line(.0))]
    Invariant(String),
    /// An allocation failed (libtorch's CPU or CUDA allocator).
    #[error("out of memory: {}", one_line(.0))]
    OutOfMemory(String),
    /// An error reported by libtorch.
    #[error("torch: {}", one_line(.0))]
    Torch(String),
    /// A tiered KV transfer (SpectrumKV) failed: bad plan, frame or budget.
    #[error("spectrum: {0}")]
    Spectrum(String),
}

impl From<tch::TchError> for Error {
    fn from(e: tch::TchError) -> Self {
        let msg = e.to_string();
        let first = msg.lines().next().unwrap_or("").to_string();
        // CUDA: "CUDA out of memory. Tried to allocate ..."; CPU: "DefaultCPUAllocator: can't
        // allocate memory: you tried to allocate ..." (or "not enough memory").
        if [
            "out of memory",
            "not enough memory",
            "can't allocate memory",
        ]
        .iter()
        .any(|m| first.contains(m))
        {
            Error::OutOfMemory(first)
        } else {
            Error::Torch(first)
        }
    }
}

/// Text from files (keys, token strings, template snippets) with its control characters
/// escaped, so that every error stays on one line.
pub fn one_line(s: &str) -> std::borrow::Cow<'_, str> {
    if s.chars().any(char::is_control) {
        s.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_debug().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect::<String>()
            .into()
    } else {
        s.into()
    }
}

impl Error {
    /// The same error with where it happened (`problem 3, exact pass`) prepended to its
    /// message.
    pub fn context(self, what: &str) -> Error {
        let at = |m: String| format!("{what}: {m}");
        match self {
            Error::Config(m) => Error::Config(at(m)),
            Error::Weights(m) => Error::Weights(at(m)),
            Error::Gguf(m) => Error::Gguf(at(m)),
            Error::Tokenizer(m) => Error::Tokenizer(at(m)),
            Error::KvCache(m) => Error::KvCache(at(m)),
            Error::ContextLimit(m) => Error::ContextLimit(at(m)),
            Error::NonFinite(m) => Error::NonFinite(at(m)),
            Error::Spec(m) => Error::Spec(at(m)),
            Error::Models(m) => Error::Models(at(m)),
            Error::Output(m) => Error::Output(at(m)),
            Error::Invariant(m) => Error::Invariant(at(m)),
            Error::Integrity(m) => Error::Integrity(at(m)),
            Error::OutOfMemory(m) => Error::OutOfMemory(at(m)),
            Error::Torch(m) => Error::Torch(at(m)),
            Error::Spectrum(m) => Error::Spectrum(at(m)),
            other @ (Error::Io { .. } | Error::UnknownArch(_)) => other,
        }
    }

    /// Wrap an io error with the path it concerns.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
