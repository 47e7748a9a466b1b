//! System C, SpectrumKV: a prefill worker sends the context's KV cache to a decode worker in
//! precision tiers chosen per token (FP16, INT8, INT4 or dropped) under a byte budget.
//!
//! - [`quant`]: group-wise quantization of one tier's gathered tokens (KIVI: keys per channel,
//!   values per token, asymmetric min/max; `lab-compat`: symmetric per token per KV head;
//!   `lab-compat-token`: symmetric per token over all heads) and bit packing.
//! - [`tiers`]: the tiered representation of a cache ([`tiers::TieredKv`]), built from a dense
//!   cache and a per-token [`Tier`] plan, restored into an ordinary [`crate::KvCache`] (dropped
//!   tokens masked at their original positions), and its exact byte accounting.
//! - [`importance`]: per-token scores from the last prompt queries' attention at prefill end.
//! - [`allocate`]: tier plans under a budget (greedy SpectrumKV, its position-only variant,
//!   the importance-ranked binary `snapkv`, PDTrim, uniform).
//! - [`wire`]: the versioned, fingerprinted byte format; [`transport`]: TCP workers.
//! - [`eval`]: perplexity, NIAH and the INT4 probe; [`ttft`]: time to first token of a real
//!   transfer; [`grid`]: all four as resumable runs (manifest and shards); [`report`] and [`compare`]: the report over run folders with
//!   paired policy comparisons.
pub mod allocate;
pub mod compare;
pub mod eval;
pub mod figures;
pub mod grid;
pub mod importance;
pub mod quant;
pub mod report;
pub mod spec;
pub mod tiers;
pub mod transport;
pub mod ttft;
pub mod wire;

/// Precision of one context token on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// 16 bits per element: the cache's own type when it is fp16/bf16, fp16 for fp32 caches.
    Fp16,
    /// 8-bit codes with group scales.
    Int8,
    /// 4-bit codes (two per byte) with group scales.
    Int4,
    /// Not sent; masked out of attention on the decode side.
    Drop,
}

impl Tier {
    /// The stored tiers, in wire order.
    pub const STORED: [Tier; 3] = [Tier::Fp16, Tier::Int8, Tier::Int4];

    /// Bits per element.
    pub fn bits(self) -> usize {
        match self {
            Tier::Fp16 => 16,
            Tier::Int8 => 8,
            Tier::Int4 => 4,
            Tier::Drop => 0,
        }
    }

    /// Lower-case name (`fp16`, `int8`, `int4`, `drop`).
    pub fn name(self) -> &'static str {
        match self {
            Tier::Fp16 => "fp16",
            Tier::Int8 => "int8",
            Tier::Int4 => "int4",
            Tier::Drop => "drop",
        }
    }
}

/// How INT8/INT4 tiers are quantized.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum Quantizer {
    /// KIVI: keys per channel (groups of tokens), values per token (groups of channels),
    /// asymmetric min/max with an fp16 scale and zero point per group.
    Kivi,
    /// The public kvcache-lab code's cache path: symmetric per token per KV head, one fp16
    /// scale `max|x| / (2^(bits−1) − 1)` per token and head (over its channels) for K and V.
    LabCompat,
    /// Symmetric per token over all KV heads and channels: one fp16 scale per token for K
    /// and one for V (the kvcache-lab perplexity path's granularity, applied post-RoPE here).
    LabCompatToken,
}

impl Quantizer {
    /// Stable name, as written in tables and on the wire.
    pub fn name(self) -> &'static str {
        match self {
            Quantizer::Kivi => "kivi",
            Quantizer::LabCompat => "lab-compat",
            Quantizer::LabCompatToken => "lab-compat-token",
        }
    }
}

impl std::fmt::Display for Quantizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
