//! kvcredit: a research toolkit for the numerics of KV-cache replay in LLM inference.
//!
//! The crate holds one generic libtorch decoder ([`model`]), an append-only KV cache whose
//! state after *t* tokens is a cheap exact value ([`kv_cache`]), execution policies that swap
//! how reductions run without forking model code ([`exec`]), counter-based sampling
//! ([`sampling`]) and the tooling around them.
pub mod analysis;
pub mod check;
pub mod config;
pub mod error;
pub mod exec;
pub mod generate;
pub mod kv_cache;
pub mod model;
pub mod runtime;
pub mod sampling;
pub mod stats;

pub use config::{Arch, ArchConfig};
pub use error::{Error, Result};
pub use exec::ExecPolicy;
pub use kv_cache::{KvCache, Snapshot};
pub use model::{Decoder, LogitsAt};
