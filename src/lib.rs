//! kvcredit: a research toolkit for the numerics of KV-cache replay in LLM inference.
//!
//! The crate holds one generic libtorch decoder ([`model`]), an append-only KV cache whose
//! state after *t* tokens is a cheap exact value ([`kv_cache`]), execution policies that swap
//! how reductions run without forking model code ([`exec`]), and the tooling around them.
pub mod config;
pub mod error;
pub mod registry;
pub mod tasks;

pub use config::{Arch, ArchConfig};
pub use error::{Error, Result};
