//! kvcredit: a research toolkit for the numerics of KV-cache replay in LLM inference.
//!
//! The crate holds one generic libtorch decoder ([`model`]), an append-only KV cache whose
//! state after *t* tokens is a cheap exact value ([`kv_cache`]), execution policies that swap
//! how reductions run without forking model code ([`exec`]), counter-based sampling
//! ([`sampling`]), three-pass counterfactual credit campaigns ([`credit`]) and the tooling
//! around them.
// The core: builds without the studies' crates (`cargo check --lib --no-default-features`).
pub mod config;
pub mod cuda_graph;
pub mod decode;
pub mod error;
pub mod exec;
pub mod generate;
pub mod gguf;
pub mod kv_cache;
pub mod model;
pub mod nvrtc;
pub mod profile;
pub mod sampling;
pub mod stats;
pub mod tokenizer;

// The studies, their runtime, analyses and reports (feature `studies`, on by default).
#[cfg(feature = "studies")]
pub mod analysis;
#[cfg(feature = "studies")]
pub mod bench;
#[cfg(feature = "studies")]
pub mod chat;
#[cfg(feature = "studies")]
pub mod check;
#[cfg(feature = "studies")]
pub mod credit;
#[cfg(feature = "studies")]
pub mod divergence;
#[cfg(feature = "studies")]
pub mod eval;
#[cfg(feature = "studies")]
pub mod io;
#[cfg(feature = "studies")]
pub mod registry;
#[cfg(feature = "studies")]
pub mod report;
#[cfg(feature = "studies")]
pub mod runtime;
#[cfg(feature = "studies")]
pub mod seed;
#[cfg(feature = "studies")]
pub mod spectrum;
#[cfg(feature = "studies")]
pub mod study;
#[cfg(feature = "studies")]
pub mod tasks;

pub use config::{Arch, ArchConfig};
pub use error::{Error, Result};
pub use exec::{ExecPolicy, ExecSettings, PolicyKind};
pub use kv_cache::{KvCache, Snapshot};
pub use model::{Decoder, LogitsAt};
