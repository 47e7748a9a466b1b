//! System B: cache-ON vs cache-OFF divergence (`kvcredit divergence run`).
//!
//! Cache-ON prefills the prompt and then decodes one token per step against the KV cache;
//! cache-OFF runs a full forward over prompt ⊕ generated-so-far at every step. A study (one
//! TOML spec, see `experiments/`) runs per dtype: free-running pairs per sampling strategy with
//! shared per-step noise ([`lockstep`]), the teacher-forced fp64 logit comparison and layer-wise
//! drift of the residual stream and cached K/V ([`lockstep::Mode::Forced`]), and residual-stream
//! patching at the first divergence step ([`patch`]), and live vs replay with the prefill-chunk
//! sweep and KV transplants ([`replay`]). Model code is untouched: the study reads
//! and replaces activations through [`crate::model::hooks`]. `kvcredit divergence analyze` reads
//! the run dirs back ([`analysis`]) and writes the report ([`report`]) and its figures
//! ([`figures`]).
pub mod analysis;
mod figures;
pub mod lockstep;
pub mod patch;
pub mod replay;
pub mod report;
pub mod run;
pub mod spec;

pub use run::{Manifest, RunOptions, run_study};
pub use spec::DivergenceSpec;
