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
use super::stats::EngineStats;
use crate::cuda_graph::CudaGraph;
use crate::exec::EngineMode;
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

/// Static capacities are rounded up to a multiple of this many positions. The stock attention
/// matmuls run over the whole capacity, and for a key axis that is not a multiple of 8 cuBLAS
/// picks unaligned kernels several times slower (on the H200, the bench's continuations at
/// batch 64 spent 0.82 ms of a 2.6 ms step in them).
pub const CAPACITY_ALIGN: i64 = 8;

/// The static modes' cache (at least `min_capacity` positions per row, rounded up to
/// [`CAPACITY_ALIGN`], then `key_pad` more, with a mask of skipped positions from the start:
/// the steps a graph captures read it whether or not a row masks anything yet) and device
/// inputs.
fn static_buffers(
    model: &Decoder,
    parts: &[(&KvCache, Snapshot)],
    extra: usize,
    min_capacity: i64,
    key_pad: i64,
) -> Result<(KvCache, StaticState)> {
    let longest = parts.iter().map(|(_, s)| s.len).max().unwrap_or(0);
    let cap = min_capacity.max(longest + extra as i64);
    let cap = (cap + CAPACITY_ALIGN - 1) / CAPACITY_ALIGN * CAPACITY_ALIGN + key_pad;
    let mut cache = KvCache::gather(parts, cap - longest)?;
    cache.keep_mask()?;
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

/// How a batch's steps run: eager forwards, or the static step over device-resident inputs
/// (replayed as CUDA graphs in the graph mode).
enum Steps {
    Eager,
    Static(StaticState),
}

/// Graph counters of a run, kept across batch reloads.
#[derive(Default)]
struct GraphCounters {
    captures: u64,
    capture_seconds: f64,
    nodes: Option<u64>,
}

/// A batch of rows being decoded one token per step.
pub struct Stepper<'m> {
    model: &'m Decoder,
    policy: ExecPolicy,
    sampling: Sampling,
    mode: EngineMode,
    cache: KvCache,
    steps: Steps,
    counters: GraphCounters,
    /// Masked key positions attended beyond what the rows need ([`Stepper::key_len`]).
    key_pad: i64,
}

impl<'m> Stepper<'m> {
    /// A batch whose row `i` resumes `parts[i]`, with room for `extra` more positions; the
    /// static modes allocate at least `min_capacity` positions per row (so later chunks fit).
    /// Every step attends over `key_pad` masked key positions more than the rows need: the
    /// static modes' capacity grows by it, eager steps pad their key axis by it.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: &'m Decoder,
        policy: ExecPolicy,
        sampling: Sampling,
        mode: EngineMode,
        parts: &[(&KvCache, Snapshot)],
        extra: usize,
        min_capacity: i64,
        key_pad: i64,
    ) -> Result<Stepper<'m>> {
        Stepper::build(
            model,
            policy,
            sampling,
            mode,
            parts,
            extra,
            min_capacity,
            key_pad,
            false,
        )
    }

    /// A batch whose row `i` resumes `parts[i]`, with `capacity` positions per row in every
    /// mode (eager included), so that any snapshot up to `capacity − extra` positions can later
    /// be loaded into any row ([`Self::load_row`]) and still decode `extra` positions;
    /// `key_pad` as in [`Self::new`].
    #[allow(clippy::too_many_arguments)]
    pub fn with_capacity(
        model: &'m Decoder,
        policy: ExecPolicy,
        sampling: Sampling,
        mode: EngineMode,
        parts: &[(&KvCache, Snapshot)],
        extra: usize,
        capacity: i64,
        key_pad: i64,
    ) -> Result<Stepper<'m>> {
        Stepper::build(
            model, policy, sampling, mode, parts, extra, capacity, key_pad, true,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        model: &'m Decoder,
        policy: ExecPolicy,
        sampling: Sampling,
        mode: EngineMode,
        parts: &[(&KvCache, Snapshot)],
        extra: usize,
        min_capacity: i64,
        key_pad: i64,
        eager_capacity: bool,
    ) -> Result<Stepper<'m>> {
        if key_pad < 0 {
            return Err(Error::Spec(format!("key padding {key_pad} is negative")));
        }
        let mode = mode.resolve(model.device());
        if mode == EngineMode::Graph && !model.device().is_cuda() {
            return Err(Error::Spec(format!(
                "engine `graph` needs a CUDA device (model is on {:?}); use `static` or `eager`",
                model.device()
            )));
        }
        let (cache, steps) = if mode == EngineMode::Eager {
            let longest = parts.iter().map(|(_, s)| s.len).max().unwrap_or(0);
            let room = if eager_capacity {
                (min_capacity - longest).max(extra as i64)
            } else {
                extra as i64
            };
            (KvCache::gather(parts, room + key_pad)?, Steps::Eager)
        } else {
            let (cache, st) = static_buffers(model, parts, extra, min_capacity, key_pad)?;
            (cache, Steps::Static(st))
        };
        Ok(Stepper {
            model,
            policy,
            sampling,
            mode,
            cache,
            steps,
            counters: GraphCounters::default(),
            key_pad,
        })
    }

    /// The mode this batch runs in (`Auto` resolved).
    pub fn mode(&self) -> EngineMode {
        self.mode
    }

    /// Replace the batch by one resuming `parts`.
    pub fn load(&mut self, parts: &[(&KvCache, Snapshot)], extra: usize) -> Result<()> {
        let rows = match &self.steps {
            Steps::Eager => {
                self.cache = KvCache::gather(parts, extra as i64 + self.key_pad)?;
                return Ok(());
            }
            Steps::Static(st) => st.io.size()[0] as usize,
        };
        let longest = parts.iter().map(|(_, s)| s.len).max().unwrap_or(0);
        if parts.len() <= rows && longest + extra as i64 <= self.cache.capacity() {
            self.cache.load_rows(parts)
        } else {
            // Bigger than the first batch (not the engine's schedules): new buffers, no graphs.
            self.steps = Steps::Eager;
            let cap = self.cache.capacity() - self.key_pad;
            let (cache, st) = static_buffers(self.model, parts, extra, cap, self.key_pad)?;
            self.cache = cache;
            self.steps = Steps::Static(st);
            Ok(())
        }
    }

    /// Overwrite row `row` with snapshot `snap` of `src` (the other rows, the capacity and
    /// any captured graphs stay); the caller keeps it within the capacity.
    pub fn load_row(&mut self, row: usize, src: &KvCache, snap: Snapshot) -> Result<()> {
        self.cache.load_row(row, src, snap)
    }

    /// Set row `row`'s length back to `len` (at most its length now): its next step writes
    /// there, and positions from there on are never attended again.
    pub fn rewind_row(&mut self, row: usize, len: i64) -> Result<()> {
        let mut lens = self.cache.lens().to_vec();
        let Some(l) = lens.get_mut(row) else {
            return Err(Error::KvCache(format!(
                "cannot rewind row {row} of a batch of {}",
                self.cache.batch()
            )));
        };
        *l = len;
        self.cache.truncate(&lens)
    }

    /// The batch cache (rows `0..batch()`).
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Rows in the batch.
    pub fn batch(&self) -> usize {
        self.cache.batch()
    }

    /// The key axis the next step attends over: the static modes' whole capacity, or in the
    /// eager mode the longest row after the step plus the key padding.
    pub fn key_len(&self) -> i64 {
        match self.steps {
            Steps::Static(_) => self.cache.capacity(),
            Steps::Eager => self.cache.lens().iter().copied().max().unwrap_or(0) + 1 + self.key_pad,
        }
    }

    /// Add this batch's graph counters to `stats`.
    pub fn report(&self, stats: &mut EngineStats) {
        stats.mode = self.mode.to_string();
        stats.graph_captures += self.counters.captures;
        stats.capture_seconds += self.counters.capture_seconds;
        if self.counters.nodes.is_some() {
            stats.graph_nodes = self.counters.nodes;
        }
        if let Steps::Static(StaticState {
            fallback: Some(why),
            ..
        }) = &self.steps
        {
            stats.graph_fallback = Some(why.clone());
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
        let (next, finite) = if let Steps::Static(st) = &mut self.steps {
            let step = StaticStep {
                model: self.model,
                policy: &self.policy,
                sampling: self.sampling,
                graphs: self.mode == EngineMode::Graph,
            };
            step.run(st, &mut self.cache, &mut self.counters, feed, keys)?
        } else {
            let ids = Tensor::f_from_slice(feed)?.f_view([b as i64, 1])?;
            let logits = self
                .model
                .forward_padded(
                    &ids,
                    &mut self.cache,
                    &self.policy,
                    &LogitsAt::Last,
                    self.key_pad,
                )?
                .f_view([b as i64, -1])?;
            let words = Tensor::f_from_slice(&sampling::noise_words(keys))?
                .f_to_device(self.model.device())?
                .f_view([2, b as i64, 1])?;
            sampling::select_checked(&logits, self.sampling, &words, self.model.sampler())?
        };
        if !finite {
            return Err(Error::NonFinite(
                "non-finite logits during continuation decoding (dtype overflow? try --dtype fp32 or bf16)"
                    .into(),
            ));
        }
        Ok(next)
    }

    /// Keep only the given rows, in the given order.
    pub fn compact(&mut self, keep: &[usize]) -> Result<()> {
        if matches!(self.steps, Steps::Static(_)) {
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

/// What a static step needs besides the batch's buffers.
struct StaticStep<'a> {
    model: &'a Decoder,
    policy: &'a ExecPolicy,
    sampling: Sampling,
    /// Whether steps are captured and replayed as CUDA graphs (the graph mode).
    graphs: bool,
}

impl StaticStep<'_> {
    /// One step of rows `0..feed.len()`: returns the tokens and whether all logits were finite.
    fn run(
        &self,
        st: &mut StaticState,
        cache: &mut KvCache,
        counters: &mut GraphCounters,
        feed: &[i64],
        keys: &[NoiseKey],
    ) -> Result<(Vec<i64>, bool)> {
        let b = feed.len();
        let vocab = self.model.config().vocab_size as i64;
        if let Some(&bad) = feed.iter().find(|&&t| t < 0 || t >= vocab) {
            return Err(Error::Spec(format!(
                "token id {bad} is outside the vocabulary 0..{vocab}"
            )));
        }
        if cache.lens().iter().any(|&l| l >= cache.capacity()) {
            return Err(Error::KvCache(format!(
                "static batch is full (capacity {})",
                cache.capacity()
            )));
        }
        let words = sampling::noise_words(keys);
        let lens = cache.lens();
        let mut host = Vec::with_capacity(4 * b);
        for r in 0..b {
            host.extend_from_slice(&[feed[r], lens[r], words[r], words[b + r]]);
        }
        st.io
            .f_narrow(0, 0, b as i64)?
            .f_copy_(&Tensor::f_from_slice(&host)?.f_view([b as i64, 4])?)?;

        let use_graphs = self.graphs && st.fallback.is_none();
        let out = if !use_graphs {
            self.body(st, cache, b)?
        } else if let Some(c) = st.graphs.iter().find(|c| c.batch == b) {
            c.graph.replay()?;
            c.out.shallow_clone()
        } else {
            let t = Instant::now();
            match CudaGraph::capture(self.model.device(), || self.body(st, cache, b)) {
                Ok((graph, out)) => {
                    counters.captures += 1;
                    counters.capture_seconds += t.elapsed().as_secs_f64();
                    counters.nodes = graph.nodes().or(counters.nodes);
                    graph.replay()?;
                    st.graphs.push(Captured {
                        batch: b,
                        out: out.shallow_clone(),
                        graph,
                    });
                    out
                }
                Err(e) => {
                    eprintln!("warning: {e}; continuing with the static step without CUDA graphs");
                    st.fallback = Some(e.to_string());
                    self.body(st, cache, b)?
                }
            }
        };
        let both = sampling::split_checked(&out)?;
        cache.advance(1);
        Ok(both)
    }

    /// The static step of rows `0..b` from the device input buffer: `[b + 1]` int64 on the
    /// device (tokens, then the all-finite flag). Device work only (what a graph captures).
    fn body(&self, st: &StaticState, cache: &KvCache, b: usize) -> Result<Tensor> {
        let b = b as i64;
        let cols = st.io.f_narrow(0, 0, b)?;
        let tokens = cols.f_select(1, 0)?.f_view([b, 1])?;
        let positions = cols.f_select(1, 1)?.f_view([b, 1])?;
        let words = cols
            .f_narrow(1, 2, 2)?
            .f_transpose(0, 1)?
            .f_view([2, b, 1])?;
        let mut view = cache.rows_view(b as usize)?;
        let logits = self
            .model
            .forward_static(&tokens, &positions, &mut view, self.policy)?;
        sampling::select_and_check_on_device(&logits, self.sampling, &words, self.model.sampler())
    }
}
