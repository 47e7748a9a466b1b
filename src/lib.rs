//! kvcredit: a research toolkit for the numerics of KV-cache replay in LLM inference.
//!
//! The crate holds one generic libtorch decoder ([`model`]), an append-only KV cache whose
//! state after *t* tokens is a cheap exact value ([`kv_cache`]), execution policies that swap
//! how reductions run without forking model code ([`exec`]), counter-based sampling
//! ([`sampling`]), three-pass counterfactual credit campaigns ([`credit`]) and the tooling
//! around them.
pub mod analysis;
pub mod bench;
pub mod chat;
pub mod check;
pub mod config;
pub mod credit;
pub mod cuda_graph;
pub mod decode;
pub mod divergence;
pub mod error;
pub mod eval;
pub mod exec;
pub mod generate;
pub mod gguf;
pub mod io;
pub mod kv_cache;
pub mod model;
pub mod nvrtc;
pub mod profile;
pub mod registry;
pub mod runtime;
pub mod sampling;
pub mod scoped;
pub mod seed;
pub mod spectrum;
pub mod stats;
pub mod study;
pub mod tasks;
pub mod tokenizer;

pub use config::{Arch, ArchConfig};
pub use error::{Error, Result};
pub use exec::{ExecPolicy, ExecSettings, PolicyKind};
pub use kv_cache::{KvCache, Snapshot};
pub use model::{Decoder, LogitsAt};
