//! A batch of rows decoded one token per step: the batch KV cache and how a step runs.
//!
//! * **eager**: [`Decoder::forward`] on a cache gathered per chunk (capacity: the chunk's
//!   longest snapshot plus the tokens to decode), then sampling; one readback per step.
//! * **static**: [`Decoder::forward_static`] over device-resident inputs: one `[rows, 4]`
//!   int64 buffer on the device holds each row's token, position and the two halves of its
//!   noise-key digest, refreshed by one host→device copy per step. The cache keeps one
//!   capacity for the whole run; new chunks are copied into its rows and compaction moves rows
//!   in place, so the tensors a step touches never change.
//! * **graph**: the static step (forward, sampling, finiteness check) captured once per batch
//!   size as a CUDA graph ([`crate::cuda_graph`]) and replayed. A failed capture falls back to
//!   the static step with a warning.
//!
//! All three produce the same tokens under the batch-invariant policy (the static forward is
//! bitwise the eager one there); under the stock policy the static modes attend over a longer
//! key axis, which may round differently, like any other change of shape.
use super::engine::{EngineMode, EngineStats};
use crate::cuda_graph::CudaGraph;
use crate::exec::ExecPolicy;
use crate::kv_cache::{KvCache, Snapshot};
use crate::model::{Decoder, LogitsAt};
use crate::sampling::{self, NoiseKey, Sampling};
use crate::{Error, Result};
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// A captured step for one batch size. `out` is declared before `graph` so it is dropped
/// first (it lives in the graph's memory pool).
struct Captured {
    batch: usize,
    out: Tensor,
    graph: CudaGraph,
}

/// Device-side state of the static and graph modes.
struct StaticState {
    /// `[rows, 4]` int64: token, position, key digest high half, low half.
    io: Tensor,
    graphs: Vec<Captured>,
    /// Set when a capture failed: why, and graphs are not tried again.
    fallback: Option<String>,
}

/// The static modes' cache (at least `min_capacity` positions per row) and device inputs.
fn static_buffers(
    model: &Decoder,
    parts: &[(&KvCache, Snapshot)],
    extra: usize,
    min_capacity: i64,
) -> Result<(KvCache, StaticState)> {
    let longest = parts.iter().map(|(_, s)| s.len).max().unwrap_or(0);
    let cap = min_capacity.max(longest + extra as i64);
    let cache = KvCache::gather(parts, cap - longest)?;
    let io = Tensor::f_zeros([parts.len() as i64, 4], (Kind::Int64, model.device()))?;
    Ok((
        cache,
        StaticState {
            io,
            graphs: Vec::new(),
            fallback: None,
        },
    ))
}

/// A batch of rows being decoded one token per step.
pub struct Stepper<'m> {
    model: &'m Decoder,
    policy: ExecPolicy,
    sampling: Sampling,
    mode: EngineMode,
    cache: KvCache,
    st: Option<StaticState>,
    captures: u64,
    capture_seconds: f64,
    graph_nodes: Option<u64>,
}

impl<'m> Stepper<'m> {
    /// A batch whose row `i` resumes `parts[i]`, with room for `extra` more positions; the
    /// static modes allocate at least `min_capacity` positions per row (so later chunks fit).
    pub fn new(
        model: &'m Decoder,
        policy: ExecPolicy,
        sampling: Sampling,
        mode: EngineMode,
        parts: &[(&KvCache, Snapshot)],
        extra: usize,
        min_capacity: i64,
    ) -> Result<Stepper<'m>> {
        let mode = mode.resolve(model.device());
        if mode == EngineMode::Graph && !model.device().is_cuda() {
            return Err(Error::Spec(format!(
                "engine `graph` needs a CUDA device (model is on {:?}); use `static` or `eager`",
                model.device()
            )));
        }
        let (cache, st) = if mode == EngineMode::Eager {
            (KvCache::gather(parts, extra as i64)?, None)
        } else {
            let (cache, st) = static_buffers(model, parts, extra, min_capacity)?;
            (cache, Some(st))
        };
        Ok(Stepper {
            model,
            policy,
            sampling,
            mode,
            cache,
            st,
            captures: 0,
            capture_seconds: 0.0,
            graph_nodes: None,
        })
    }

    /// The mode this batch runs in (`Auto` resolved).
    pub fn mode(&self) -> EngineMode {
        self.mode
    }

    /// Replace the batch by one resuming `parts`.
    pub fn load(&mut self, parts: &[(&KvCache, Snapshot)], extra: usize) -> Result<()> {
        if self.st.is_none() {
            self.cache = KvCache::gather(parts, extra as i64)?;
            return Ok(());
        }
        let longest = parts.iter().map(|(_, s)| s.len).max().unwrap_or(0);
        let rows = self.st.as_ref().map_or(0, |s| s.io.size()[0] as usize);
        if parts.len() <= rows && longest + extra as i64 <= self.cache.capacity() {
            self.cache.load_rows(parts)
        } else {
            // Bigger than the first batch (not the engine's schedules): new buffers, no graphs.
            self.st = None;
            let cap = self.cache.capacity();
            let (cache, st) = static_buffers(self.model, parts, extra, cap)?;
            self.cache = cache;
            self.st = Some(st);
            Ok(())
        }
    }

    /// The batch cache (rows `0..batch()`).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Rows in the batch.
    pub fn batch(&self) -> usize {
        self.cache.batch()
    }

    /// Add this batch's graph counters to `stats`.
    pub fn report(&self, stats: &mut EngineStats) {
        stats.mode = self.mode.to_string();
        stats.graph_captures += self.captures;
        stats.capture_seconds += self.capture_seconds;
        if self.graph_nodes.is_some() {
            stats.graph_nodes = self.graph_nodes;
        }
        if let Some(why) = self.st.as_ref().and_then(|s| s.fallback.clone()) {
            stats.graph_fallback = Some(why);
        }
    }

    /// Feed one token per row and return the token chosen for each row (`keys[r]` is row
    /// `r`'s noise key). Fails on non-finite logits.
    pub fn step(&mut self, feed: &[i64], keys: &[NoiseKey]) -> Result<Vec<i64>> {
        let b = feed.len();
        if b != self.cache.batch() || keys.len() != b {
            return Err(Error::Spec(format!(
                "step of {b} tokens and {} keys on a batch of {} rows",
                keys.len(),
                self.cache.batch()
            )));
        }
        let (next, finite) = if self.st.is_some() {
            self.static_step(feed, keys)?
        } else {
            let ids = Tensor::from_slice(feed).view([b as i64, 1]);
            let logits = self
                .model
                .forward(&ids, &mut self.cache, &self.policy, &LogitsAt::Last)?
                .view([b as i64, -1]);
            let words = Tensor::from_slice(&sampling::noise_words(keys))
                .to_device(self.model.device())
                .view([2, b as i64, 1]);
            sampling::select_checked(&logits, self.sampling, &words)?
        };
        if !finite {
            return Err(Error::NonFinite(
                "non-finite logits during continuation decoding (dtype overflow? try --dtype fp32 or bf16)"
                    .into(),
            ));
        }
        Ok(next)
    }

    fn static_step(&mut self, feed: &[i64], keys: &[NoiseKey]) -> Result<(Vec<i64>, bool)> {
        let b = feed.len();
        let vocab = self.model.config().vocab_size as i64;
        if let Some(&bad) = feed.iter().find(|&&t| t < 0 || t >= vocab) {
            return Err(Error::Spec(format!(
                "token id {bad} is outside the vocabulary 0..{vocab}"
            )));
        }
        if self
            .cache
            .lens()
            .iter()
            .any(|&l| l >= self.cache.capacity())
        {
            return Err(Error::KvCache(format!(
                "static batch is full (capacity {})",
                self.cache.capacity()
            )));
        }
        let words = sampling::noise_words(keys);
        let lens = self.cache.lens();
        let mut host = Vec::with_capacity(4 * b);
        for r in 0..b {
            host.extend_from_slice(&[feed[r], lens[r], words[r], words[b + r]]);
        }
        let st = self.st.as_ref().expect("static state");
        st.io
            .narrow(0, 0, b as i64)
            .f_copy_(&Tensor::from_slice(&host).view([b as i64, 4]))?;

        let use_graphs = self.mode == EngineMode::Graph && st.fallback.is_none();
        let out = if !use_graphs {
            self.static_body(b)?
        } else if let Some(c) = st.graphs.iter().find(|c| c.batch == b) {
            c.graph.replay()?;
            c.out.shallow_clone()
        } else {
            let t = Instant::now();
            match CudaGraph::capture(self.model.device(), || self.static_body(b)) {
                Ok((graph, out)) => {
                    self.captures += 1;
                    self.capture_seconds += t.elapsed().as_secs_f64();
                    self.graph_nodes = graph.nodes().or(self.graph_nodes);
                    graph.replay()?;
                    let st = self.st.as_mut().expect("static state");
                    st.graphs.push(Captured {
                        batch: b,
                        out: out.shallow_clone(),
                        graph,
                    });
                    out
                }
                Err(e) => {
                    eprintln!("warning: {e}; continuing with the static step without CUDA graphs");
                    self.st.as_mut().expect("static state").fallback = Some(e.to_string());
                    self.static_body(b)?
                }
            }
        };
        let both = sampling::split_checked(&out)?;
        self.cache.advance(1);
        Ok(both)
    }

    /// The static step of rows `0..b` from the device input buffer: `[b + 1]` int64 on the
    /// device (tokens, then the all-finite flag). Device work only (what a graph captures).
    fn static_body(&self, b: usize) -> Result<Tensor> {
        let st = self.st.as_ref().expect("static state");
        let b = b as i64;
        let cols = st.io.narrow(0, 0, b);
        let tokens = cols.select(1, 0).view([b, 1]);
        let positions = cols.select(1, 1).view([b, 1]);
        let words = cols.narrow(1, 2, 2).transpose(0, 1).view([2, b, 1]);
        let mut view = self.cache.rows_view(b as usize);
        let logits = self
            .model
            .forward_static(&tokens, &positions, &mut view, &self.policy)?;
        sampling::select_and_check_on_device(&logits, self.sampling, &words)
    }

    /// Keep only the given rows, in the given order.
    pub fn compact(&mut self, keep: &[usize]) -> Result<()> {
        if self.st.is_some() {
            self.cache.compact_rows(keep)
        } else {
            self.cache.select_rows(keep)
        }
    }

    /// The device the batch lives on.
    pub fn device(&self) -> Device {
        self.model.device()
    }
}
