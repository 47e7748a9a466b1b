//! The KV cache: per layer, append-only, preallocated, with the number of valid positions of
//! each sequence (row) as its only state.
//!
//! Because nothing is ever overwritten below a row's length, "the state after *t* tokens" is
//! just the pair (cache, *t*): a [`Snapshot`] refers to it without copying. Sliding-window
//! layers keep the full history too and apply their window as a mask, so a snapshot stays
//! valid however far decoding has gone.
use crate::{Error, Result};
use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};

/// K and V buffers of one layer: `[B, Hkv, capacity, D]` each.
struct LayerKv {
    k: Tensor,
    v: Tensor,
}

/// Shape of a cache's buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvShape {
    /// Decoder layers.
    pub layers: usize,
    /// Key/value heads per layer.
    pub kv_heads: i64,
    /// Per-head width.
    pub head_dim: i64,
}

/// A snapshot's K/V bytes in host memory ([`KvCache::to_host`]): hashing them gives the
/// snapshot's fingerprint.
pub struct HostKv {
    len: i64,
    /// Contiguous uint8 CPU tensor, `None` for an empty snapshot.
    bytes: Option<Tensor>,
}

impl HostKv {
    /// Positions in the snapshot.
    pub fn positions(&self) -> i64 {
        self.len
    }

    /// SHA-256 over the length (little-endian) and the K/V bytes: [`KvCache::fingerprint`].
    pub fn fingerprint(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(self.len.to_le_bytes());
        if let Some(t) = &self.bytes {
            let n = t.numel();
            // SAFETY: `t` is a contiguous uint8 CPU tensor of `n` elements that `self` owns and
            // nothing writes to; the slice does not outlive this borrow of it.
            let data = unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, n) };
            h.update(data);
        }
        h.finalize().into()
    }
}

/// A snapshot's K/V gathered on the cache's device ([`KvCache::copy_out`]), not yet on the host.
pub struct SnapshotKv {
    len: i64,
    /// Contiguous `[2·layers, Hkv, len, D]`, `None` for an empty snapshot.
    kv: Option<Tensor>,
}

impl SnapshotKv {
    /// Positions in the snapshot.
    pub fn positions(&self) -> i64 {
        self.len
    }

    /// The bytes in host memory. From a CUDA device they go to page-locked memory (libtorch's
    /// caching host allocator reuses it across copies): a direct DMA, faster than staging
    /// through pageable memory.
    pub fn to_host(self) -> Result<HostKv> {
        let Some(all) = self.kv else {
            return Ok(HostKv {
                len: self.len,
                bytes: None,
            });
        };
        let bytes = match all.device() {
            dev @ Device::Cuda(_) => {
                let mut host = Tensor::f_empty(all.size(), (all.kind(), Device::Cpu))?
                    .f_internal_pin_memory(dev)?;
                host.f_copy_(&all)?;
                host
            }
            _ => all.f_to_device(Device::Cpu)?.f_contiguous()?,
        }
        .f_view_dtype(Kind::Uint8)?;
        Ok(HostKv {
            len: self.len,
            bytes: Some(bytes),
        })
    }
}

/// Hashes snapshots on background threads while the caller goes on (the decode-time
/// fingerprints of a rollout, say): each [`SnapshotKv`] sent with a tag is copied to the host
/// and hashed by a worker, and comes back from [`HashPool::finish`] as `(tag, fingerprint)`, in
/// no particular order. At most `bound` snapshots wait at a time — a send blocks beyond that —
/// which bounds the device memory they hold.
pub struct HashPool<'scope, T: Send> {
    tx: std::sync::mpsc::SyncSender<(T, SnapshotKv)>,
    workers: Vec<std::thread::ScopedJoinHandle<'scope, Result<Hashed<T>>>>,
}

/// Hashing threads for a [`HashPool`] on this machine: one core is left to the caller, at
/// most eight.
pub fn hash_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .saturating_sub(1)
        .clamp(1, 8)
}

/// Tagged fingerprints.
type Hashed<T> = Vec<(T, [u8; 32])>;

impl<'scope, T: Send + 'scope> HashPool<'scope, T> {
    /// Start `threads` hashing threads (at least one) in `scope`.
    pub fn start<'env>(
        scope: &'scope std::thread::Scope<'scope, 'env>,
        threads: usize,
        bound: usize,
    ) -> Self {
        let (tx, rx) = std::sync::mpsc::sync_channel::<(T, SnapshotKv)>(bound);
        let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
        let workers = (0..threads.max(1))
            .map(|_| {
                let rx = std::sync::Arc::clone(&rx);
                scope.spawn(move || {
                    let mut done = Vec::new();
                    loop {
                        // The lock is held only while waiting for the next snapshot.
                        let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                        match next {
                            Ok((tag, kv)) => done.push((tag, kv.to_host()?.fingerprint())),
                            Err(_) => return Ok(done),
                        }
                    }
                })
            })
            .collect();
        HashPool { tx, workers }
    }

    /// Queue `kv` for hashing under `tag`.
    pub fn send(&self, tag: T, kv: SnapshotKv) -> Result<()> {
        self.tx
            .send((tag, kv))
            .map_err(|_| Error::Invariant("fingerprint hashing stopped".into()))
    }

    /// Wait for every queued snapshot: the `(tag, fingerprint)` pairs.
    pub fn finish(self) -> Result<Hashed<T>> {
        drop(self.tx);
        let mut all = Vec::new();
        for w in self.workers {
            all.extend(
                w.join()
                    .map_err(|_| Error::Invariant("fingerprint hashing panicked".into()))??,
            );
        }
        Ok(all)
    }
}

/// The integer type of `kind`'s width: its values compared as bits (NaN equal to itself, −0
/// not equal to +0).
fn bit_kind(kind: Kind) -> Kind {
    match kind.elt_size_in_bytes() {
        2 => Kind::Int16,
        4 => Kind::Int,
        _ => Kind::Int64,
    }
}

/// Append-only KV cache for a batch of sequences.
pub struct KvCache {
    shape: KvShape,
    layers: Vec<LayerKv>,
    lens: Vec<i64>,
    capacity: i64,
    kind: Kind,
    device: Device,
    /// Positions that attention skips, `[B, capacity]` bool (true = masked), e.g. tokens a
    /// compressed transfer dropped; they keep their original positions. `None`: none masked.
    masked: Option<Tensor>,
}

/// How a forward pass writes its new K/V rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KvWrite {
    /// Every row at this position (all rows have the same length): a slice copy.
    At(i64),
    /// Each row at its own positions, by scatter along the position axis (device-side).
    Scatter,
}

/// A reference to the state of one row after `len` tokens. Valid as long as the cache it
/// came from lives, since positions below a row's length are never overwritten.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    /// Row of the cache.
    pub row: usize,
    /// Number of valid positions.
    pub len: i64,
}

/// Which of a layer's buffers a transplant copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvParts {
    /// Keys only.
    K,
    /// Values only.
    V,
    /// Keys and values.
    Kv,
}

impl KvParts {
    fn keys(self) -> bool {
        matches!(self, KvParts::K | KvParts::Kv)
    }

    fn values(self) -> bool {
        matches!(self, KvParts::V | KvParts::Kv)
    }

    /// The name in records (`k`, `v`, `kv`).
    pub fn as_str(self) -> &'static str {
        match self {
            KvParts::K => "k",
            KvParts::V => "v",
            KvParts::Kv => "kv",
        }
    }
}

/// The layers × positions × buffers a transplant copies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSelect {
    /// Layers copied.
    pub layers: std::ops::Range<usize>,
    /// Positions copied.
    pub positions: std::ops::Range<i64>,
    /// K, V or both.
    pub parts: KvParts,
}

/// One row of [`KvCache::transplant`]: a base state, a donor state of the same length, and
/// what to take from the donor.
pub struct Transplant<'a> {
    /// The state the new row starts from.
    pub base: (&'a KvCache, Snapshot),
    /// Where the selected K/V come from.
    pub donor: (&'a KvCache, Snapshot),
    /// What is taken from the donor.
    pub select: KvSelect,
}

impl KvCache {
    /// An empty cache for `batch` rows with room for `capacity` positions (it grows on demand).
    pub fn new(
        shape: KvShape,
        batch: usize,
        capacity: i64,
        kind: Kind,
        device: Device,
    ) -> Result<KvCache> {
        let capacity = capacity.max(1);
        let layers = (0..shape.layers)
            .map(|_| {
                let dims = [batch as i64, shape.kv_heads, capacity, shape.head_dim];
                Ok(LayerKv {
                    k: Tensor::f_zeros(dims, (kind, device))?,
                    v: Tensor::f_zeros(dims, (kind, device))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            shape,
            layers,
            lens: vec![0; batch],
            capacity,
            kind,
            device,
            masked: None,
        })
    }

    /// Rows in the batch.
    pub fn batch(&self) -> usize {
        self.lens.len()
    }

    /// Valid positions of each row.
    pub fn lens(&self) -> &[i64] {
        &self.lens
    }

    /// Positions allocated per row.
    pub fn capacity(&self) -> i64 {
        self.capacity
    }

    /// Element type of the buffers.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Device of the buffers.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Shape of the buffers.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Bytes allocated for K and V over all layers.
    pub fn allocated_bytes(&self) -> i64 {
        2 * self.shape.layers as i64
            * self.batch() as i64
            * self.shape.kv_heads
            * self.capacity
            * self.shape.head_dim
            * self.kind.elt_size_in_bytes() as i64
    }

    /// The state of `row` as it is now.
    pub fn snapshot(&self, row: usize) -> Snapshot {
        Snapshot {
            row,
            len: self.lens[row],
        }
    }

    /// Make sure every row can take `extra` more positions, growing (by doubling) if needed.
    pub fn reserve(&mut self, extra: i64) -> Result<()> {
        let need = self.lens.iter().copied().max().unwrap_or(0) + extra;
        if need <= self.capacity {
            return Ok(());
        }
        let mut cap = self.capacity;
        while cap < need {
            cap *= 2;
        }
        for layer in &mut self.layers {
            for buf in [&mut layer.k, &mut layer.v] {
                let mut dims = buf.size();
                dims[2] = cap;
                let grown = Tensor::f_zeros(dims, (self.kind, self.device))?;
                grown.f_narrow(2, 0, self.capacity)?.f_copy_(buf)?;
                *buf = grown;
            }
        }
        if let Some(m) = &mut self.masked {
            let grown = Tensor::f_zeros([m.size()[0], cap], (Kind::Bool, self.device))?;
            grown.f_narrow(1, 0, self.capacity)?.f_copy_(m)?;
            *m = grown;
        }
        self.capacity = cap;
        Ok(())
    }

    /// Write `k`, `v` (`[B, Hkv, T, D]`) for `layer` as `how` says and return views of keys
    /// and values `0..key_len` (`[B, Hkv, key_len, D]`). Device ops only: lengths advance in
    /// [`Self::advance`].
    pub(crate) fn write(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        how: KvWrite,
        positions: &Tensor,
        key_len: i64,
    ) -> Result<(Tensor, Tensor)> {
        let t = k.size()[2];
        let buf = &mut self.layers[layer];
        match how {
            KvWrite::At(start) => {
                buf.k.f_narrow(2, start, t)?.f_copy_(k)?;
                buf.v.f_narrow(2, start, t)?.f_copy_(v)?;
            }
            KvWrite::Scatter => {
                let dims = k.size();
                let index = positions
                    .f_view([dims[0], 1, t, 1])?
                    .f_expand(&dims, false)?;
                let _ = buf.k.f_scatter_(2, &index, k)?;
                let _ = buf.v.f_scatter_(2, &index, v)?;
            }
        }
        self.attended_kv(layer, key_len)
    }

    /// `layer`'s key and value buffers (`[B, Hkv, capacity, D]`), for a kernel that writes
    /// new rows into them itself (`exec::glue`).
    pub(crate) fn buffers_mut(&mut self, layer: usize) -> (&mut Tensor, &mut Tensor) {
        let buf = &mut self.layers[layer];
        (&mut buf.k, &mut buf.v)
    }

    /// Views of `layer`'s keys and values `0..key_len` (`[B, Hkv, key_len, D]`).
    pub(crate) fn attended_kv(&self, layer: usize, key_len: i64) -> Result<(Tensor, Tensor)> {
        let buf = &self.layers[layer];
        Ok((
            buf.k.f_narrow(2, 0, key_len)?,
            buf.v.f_narrow(2, 0, key_len)?,
        ))
    }

    /// A cache sharing this one's buffers, restricted to rows `0..n` (views: writes through it
    /// land in this cache). Its lengths are a copy; this cache's do not move.
    pub(crate) fn rows_view(&self, n: usize) -> Result<KvCache> {
        Ok(KvCache {
            shape: self.shape,
            layers: self
                .layers
                .iter()
                .map(|l| {
                    Ok(LayerKv {
                        k: l.k.f_narrow(0, 0, n as i64)?,
                        v: l.v.f_narrow(0, 0, n as i64)?,
                    })
                })
                .collect::<Result<_>>()?,
            lens: self.lens[..n.min(self.lens.len())].to_vec(),
            capacity: self.capacity,
            kind: self.kind,
            device: self.device,
            masked: self
                .masked
                .as_ref()
                .map(|m| m.f_narrow(0, 0, n as i64))
                .transpose()?,
        })
    }

    /// Keep only the given rows (in the given order) by moving them to the front of the
    /// buffers in place: the buffers (and views of them, e.g. captured in a CUDA graph) stay.
    pub(crate) fn compact_rows(&mut self, rows: &[usize]) -> Result<()> {
        if rows.iter().any(|&r| r >= self.batch()) {
            return Err(Error::KvCache(format!("row out of range in {rows:?}")));
        }
        let idx = Tensor::f_from_slice(&rows.iter().map(|&r| r as i64).collect::<Vec<_>>())?
            .f_to_device(self.device)?;
        let (b, n) = (self.batch() as i64, rows.len() as i64);
        for layer in &mut self.layers {
            for buf in [&mut layer.k, &mut layer.v] {
                let moved = buf.f_narrow(0, 0, b)?.f_index_select(0, &idx)?;
                buf.f_narrow(0, 0, n)?.f_copy_(&moved)?;
            }
        }
        if let Some(m) = &self.masked {
            let moved = m.f_narrow(0, 0, b)?.f_index_select(0, &idx)?;
            m.f_narrow(0, 0, n)?.f_copy_(&moved)?;
        }
        self.lens = rows.iter().map(|&r| self.lens[r]).collect();
        Ok(())
    }

    /// Advance every row's length by `t` after a forward pass.
    pub(crate) fn advance(&mut self, t: i64) {
        for len in &mut self.lens {
            *len += t;
        }
    }

    /// Set each row's length explicitly, e.g. after a right-padded ragged prefill, or to roll
    /// a row back to an earlier snapshot. Lengths may only shrink or stay.
    pub fn truncate(&mut self, lens: &[i64]) -> Result<()> {
        if lens.len() != self.lens.len() {
            return Err(Error::KvCache(format!(
                "{} lengths for {} rows",
                lens.len(),
                self.lens.len()
            )));
        }
        for (cur, &new) in self.lens.iter_mut().zip(lens) {
            if new > *cur || new < 0 {
                return Err(Error::KvCache(format!(
                    "cannot set length {new} on a row of length {cur}"
                )));
            }
            *cur = new;
        }
        Ok(())
    }

    /// A new cache whose row *i* starts from snapshot `parts[i].1` of cache `parts[i].0`
    /// (the prefixes are copied into the new batch; the sources are untouched), with room for
    /// `extra` further positions. All sources must share shape, dtype and device.
    pub fn gather(parts: &[(&KvCache, Snapshot)], extra: i64) -> Result<KvCache> {
        let Some((first, _)) = parts.first() else {
            return Err(Error::KvCache("gather needs at least one snapshot".into()));
        };
        let longest = parts.iter().map(|(_, s)| s.len).max().unwrap_or(0);
        let mut out = KvCache::new(
            first.shape,
            parts.len(),
            longest + extra,
            first.kind,
            first.device,
        )?;
        out.load_rows_into(parts, false)?;
        Ok(out)
    }

    /// Overwrite rows `0..parts.len()` with the snapshots `parts` (positions at and beyond each
    /// snapshot's length are zeroed) and make them the whole batch. The buffers keep their
    /// capacity, which must hold the longest snapshot.
    ///
    /// Rows taken from the same source cache are moved with one `index_select` per buffer, so
    /// the cost is a few device ops per layer and source, not per row.
    pub fn load_rows(&mut self, parts: &[(&KvCache, Snapshot)]) -> Result<()> {
        self.load_rows_into(parts, true)
    }

    fn load_rows_into(&mut self, parts: &[(&KvCache, Snapshot)], zero: bool) -> Result<()> {
        let n = parts.len();
        if n == 0 || n > self.rows() {
            return Err(Error::KvCache(format!(
                "cannot load {n} snapshots into a cache of {} rows",
                self.rows()
            )));
        }
        for (src, s) in parts {
            self.check_source(src, *s)?;
        }
        // Group the rows by source cache, in first-appearance order.
        let mut groups: Vec<(&KvCache, Vec<usize>)> = Vec::new();
        for (i, (src, _)) in parts.iter().enumerate() {
            match groups.iter_mut().find(|(g, _)| std::ptr::eq(*g, *src)) {
                Some((_, rows)) => rows.push(i),
                None => groups.push((src, vec![i])),
            }
        }
        if zero {
            for layer in &mut self.layers {
                for buf in [&mut layer.k, &mut layer.v] {
                    let _ = buf.f_narrow(0, 0, n as i64)?.f_zero_()?;
                }
            }
        }
        for (src, rows) in &groups {
            let longest = rows.iter().map(|&i| parts[i].1.len).max().unwrap_or(0);
            if longest == 0 {
                continue;
            }
            if let [i] = rows[..] {
                // A source of one row: copy its prefix directly (one op per buffer).
                let s = parts[i].1;
                for (dst, from) in self.layers.iter_mut().zip(&src.layers) {
                    for (d, f) in [(&dst.k, &from.k), (&dst.v, &from.v)] {
                        d.f_narrow(0, i as i64, 1)?
                            .f_narrow(2, 0, s.len)?
                            .f_copy_(&f.f_narrow(0, s.row as i64, 1)?.f_narrow(2, 0, s.len)?)?;
                    }
                }
                continue;
            }
            let to_i64 = |v: Vec<i64>| -> Result<Tensor> {
                Ok(Tensor::f_from_slice(&v)?.f_to_device(self.device)?)
            };
            let dst_idx = to_i64(rows.iter().map(|&i| i as i64).collect())?;
            let src_idx = to_i64(rows.iter().map(|&i| parts[i].1.row as i64).collect())?;
            let lens = to_i64(rows.iter().map(|&i| parts[i].1.len).collect())?;
            // Positions at or beyond a row's length: [rows, 1, longest, 1].
            let beyond = Tensor::f_arange(longest, (Kind::Int64, self.device))?
                .f_view([1, 1, longest, 1])?
                .f_ge_tensor(&lens.f_view([-1, 1, 1, 1])?)?;
            for (dst, from) in self.layers.iter_mut().zip(&src.layers) {
                for (d, f) in [(&mut dst.k, &from.k), (&mut dst.v, &from.v)] {
                    let sel = f
                        .f_narrow(2, 0, longest)?
                        .f_index_select(0, &src_idx)?
                        .f_masked_fill(&beyond, 0.0)?;
                    let _ = d
                        .f_narrow(2, 0, longest)?
                        .f_index_copy_(0, &dst_idx, &sel)?;
                }
            }
        }
        self.load_masks(parts)?;
        self.lens = parts.iter().map(|(_, s)| s.len).collect();
        Ok(())
    }

    /// Keep a mask of skipped positions (all false if none was kept), so that every later
    /// mask lands in the same storage. A captured CUDA graph reads the mask it saw at capture:
    /// a cache whose steps are captured must hold one before the first capture, or masks that
    /// rows bring later (refills of masked snapshots) would not be seen.
    pub(crate) fn keep_mask(&mut self) -> Result<()> {
        self.mask().map(|_| ())
    }

    /// The mask of skipped positions (a view sharing its storage), made all-false first if
    /// none was kept.
    fn mask(&mut self) -> Result<Tensor> {
        if self.masked.is_none() {
            let rows = self.rows() as i64;
            self.masked = Some(Tensor::f_zeros(
                [rows, self.capacity],
                (Kind::Bool, self.device),
            )?);
        }
        Ok(self.masked.as_ref().expect("made above").shallow_clone())
    }

    /// Refuse a snapshot `snap` of `src` that cannot be copied into a row of this cache:
    /// another shape, dtype or device, a row or length outside `src`, or longer than the
    /// capacity.
    fn check_source(&self, src: &KvCache, snap: Snapshot) -> Result<()> {
        if src.shape != self.shape || src.kind != self.kind || src.device != self.device {
            return Err(Error::KvCache(
                "gathered caches differ in shape, dtype or device".into(),
            ));
        }
        if snap.row >= src.batch() || snap.len > src.lens[snap.row] || snap.len < 0 {
            return Err(Error::KvCache(format!(
                "snapshot (row {}, len {}) is not within its source cache",
                snap.row, snap.len
            )));
        }
        if snap.len > self.capacity {
            return Err(Error::KvCache(format!(
                "snapshot of length {} does not fit a cache of capacity {}",
                snap.len, self.capacity
            )));
        }
        Ok(())
    }

    /// Overwrite batch row `row` with snapshot `snap` of `src`, leaving the other rows as they
    /// are. Positions at and beyond the snapshot's length keep whatever they held: attention
    /// never sees them, since a row's queries attend only to keys at or below its own position
    /// (the causal mask on each row's position, in the eager and the static forward alike).
    pub fn load_row(&mut self, row: usize, src: &KvCache, snap: Snapshot) -> Result<()> {
        if row >= self.batch() {
            return Err(Error::KvCache(format!(
                "cannot load row {row} of a batch of {}",
                self.batch()
            )));
        }
        self.check_source(src, snap)?;
        if snap.len > 0 {
            for (dst, from) in self.layers.iter_mut().zip(&src.layers) {
                for (d, f) in [(&dst.k, &from.k), (&dst.v, &from.v)] {
                    d.f_narrow(0, row as i64, 1)?
                        .f_narrow(2, 0, snap.len)?
                        .f_copy_(
                            &f.f_narrow(0, snap.row as i64, 1)?
                                .f_narrow(2, 0, snap.len)?,
                        )?;
                }
            }
        }
        if self.masked.is_some() || src.masked.is_some() {
            let mut m = self.mask()?.f_narrow(0, row as i64, 1)?;
            let _ = m.f_zero_()?;
            if let (Some(from), true) = (&src.masked, snap.len > 0) {
                m.f_narrow(1, 0, snap.len)?.f_copy_(
                    &from
                        .f_narrow(0, snap.row as i64, 1)?
                        .f_narrow(1, 0, snap.len)?,
                )?;
            }
        }
        self.lens[row] = snap.len;
        Ok(())
    }

    /// Rows `0..parts.len()` of the attention mask from the snapshots' sources (an existing
    /// mask is overwritten in place; none is made when no source masks anything).
    fn load_masks(&mut self, parts: &[(&KvCache, Snapshot)]) -> Result<()> {
        if self.masked.is_none() && parts.iter().all(|(src, _)| src.masked.is_none()) {
            return Ok(());
        }
        let rows = self.rows() as i64;
        let mut m = match &self.masked {
            Some(m) => m.shallow_clone(),
            None => Tensor::f_zeros([rows, self.capacity], (Kind::Bool, self.device))?,
        };
        let _ = m.f_zero_()?;
        for (i, (src, s)) in parts.iter().enumerate() {
            if let (Some(from), true) = (&src.masked, s.len > 0) {
                m.f_narrow(0, i as i64, 1)?
                    .f_narrow(1, 0, s.len)?
                    .f_copy_(&from.f_narrow(0, s.row as i64, 1)?.f_narrow(1, 0, s.len)?)?;
            }
        }
        self.masked = Some(m);
        Ok(())
    }

    /// Mask `positions` of `row` out of attention from now on (the K/V there stay, so the
    /// other positions keep their RoPE angles). Positions must lie below the row's length.
    pub fn mask_positions(&mut self, row: usize, positions: &[i64]) -> Result<()> {
        if row >= self.batch() {
            return Err(Error::KvCache(format!("row {row} out of range")));
        }
        if let Some(&p) = positions.iter().find(|&&p| p < 0 || p >= self.lens[row]) {
            return Err(Error::KvCache(format!(
                "cannot mask position {p} of a row of length {}",
                self.lens[row]
            )));
        }
        if positions.is_empty() {
            return Ok(());
        }
        let m = &self.mask()?;
        let idx = Tensor::f_from_slice(positions)?.f_to_device(self.device)?;
        let _ = m.f_narrow(0, row as i64, 1)?.f_index_fill_(1, &idx, 1)?;
        Ok(())
    }

    /// Masked positions of `row`, ascending.
    pub fn masked_positions(&self, row: usize) -> Result<Vec<i64>> {
        match &self.masked {
            None => Ok(Vec::new()),
            Some(m) => {
                let r = m.f_narrow(0, row as i64, 1)?.f_view([-1])?.f_nonzero()?;
                Ok(Vec::<i64>::try_from(
                    r.f_view([-1])?.f_to_device(Device::Cpu)?,
                )?)
            }
        }
    }

    /// Views of the keys and values of `layer`, positions `0..len`: `[B, Hkv, len, D]` each.
    pub fn layer_kv(&self, layer: usize, len: i64) -> Result<(Tensor, Tensor)> {
        let Some(l) = self.layers.get(layer) else {
            return Err(Error::KvCache(format!("layer {layer} out of range")));
        };
        if len < 0 || len > self.capacity {
            return Err(Error::KvCache(format!(
                "{len} positions do not fit a capacity of {}",
                self.capacity
            )));
        }
        Ok((l.k.f_narrow(2, 0, len)?, l.v.f_narrow(2, 0, len)?))
    }

    /// Which keys `0..key_len` attention may see, `[B, 1, key_len]` bool, or `None` when no
    /// position is masked.
    pub(crate) fn attended(&self, key_len: i64) -> Result<Option<Tensor>> {
        let b = self.batch() as i64;
        self.masked
            .as_ref()
            .map(|m| {
                Ok(m.f_narrow(0, 0, b)?
                    .f_narrow(1, 0, key_len)?
                    .f_logical_not()?
                    .f_unsqueeze(1)?)
            })
            .transpose()
    }

    /// Rows the buffers hold (at least [`Self::batch`]).
    fn rows(&self) -> usize {
        self.layers
            .first()
            .map_or(self.lens.len(), |l| l.k.size()[0] as usize)
    }

    /// Whether row `a` differs bitwise from row `b` over positions `0..upto` (all layers, K
    /// and V), as a one-element boolean tensor on the device: nothing is read back, so a
    /// caller can fold many such checks and read the result once.
    pub fn rows_differ(&self, a: usize, b: usize, upto: i64) -> Result<Tensor> {
        let x = self.copy_out(Snapshot { row: a, len: upto })?;
        let y = self.copy_out(Snapshot { row: b, len: upto })?;
        Ok(match (x.kv, y.kv) {
            (Some(x), Some(y)) => {
                let bits = bit_kind(self.kind);
                x.f_view_dtype(bits)?
                    .f_ne_tensor(&y.f_view_dtype(bits)?)?
                    .f_any()?
                    .f_view([1])?
            }
            _ => Tensor::f_zeros([1], (Kind::Bool, self.device))?,
        })
    }

    /// Whether each row `rows[i]` is bitwise equal to row `reference[i]` over positions
    /// `0..upto` (all layers, K and V), compared on the device with one readback.
    pub fn rows_equal(&self, rows: &[usize], reference: &[usize], upto: i64) -> Result<bool> {
        if rows.len() != reference.len() || rows.iter().chain(reference).any(|&r| r >= self.batch())
        {
            return Err(Error::KvCache(format!(
                "rows {rows:?} / {reference:?} do not match a batch of {}",
                self.batch()
            )));
        }
        let bits = bit_kind(self.kind);
        let to_i64 = |v: &[usize]| -> Result<Tensor> {
            Ok(
                Tensor::f_from_slice(&v.iter().map(|&r| r as i64).collect::<Vec<_>>())?
                    .f_to_device(self.device)?,
            )
        };
        let (a, b) = (to_i64(rows)?, to_i64(reference)?);
        let mut differs: Vec<Tensor> = Vec::with_capacity(2 * self.layers.len());
        for layer in &self.layers {
            for buf in [&layer.k, &layer.v] {
                let x = buf
                    .f_narrow(2, 0, upto.clamp(0, self.capacity))?
                    .f_view_dtype(bits)?;
                let ne = x
                    .f_index_select(0, &a)?
                    .f_ne_tensor(&x.f_index_select(0, &b)?)?
                    .f_any()?;
                differs.push(ne.f_view([1])?);
            }
        }
        let any = Tensor::f_cat(&differs, 0)?.f_any()?;
        Ok(!bool::try_from(any.f_to_device(Device::Cpu)?)?)
    }

    /// Keep only the given rows (in the given order), e.g. to drop finished sequences.
    pub fn select_rows(&mut self, rows: &[usize]) -> Result<()> {
        if rows.iter().any(|&r| r >= self.batch()) {
            return Err(Error::KvCache(format!("row out of range in {rows:?}")));
        }
        let idx = Tensor::f_from_slice(&rows.iter().map(|&r| r as i64).collect::<Vec<_>>())?
            .f_to_device(self.device)?;
        for layer in &mut self.layers {
            layer.k = layer.k.f_index_select(0, &idx)?;
            layer.v = layer.v.f_index_select(0, &idx)?;
        }
        if let Some(m) = &mut self.masked {
            *m = m.f_index_select(0, &idx)?;
        }
        self.lens = rows.iter().map(|&r| self.lens[r]).collect();
        Ok(())
    }

    /// SHA-256 over the K and V bytes of the first `len` positions of `row`, all layers, in
    /// layer order. Bitwise: any changed bit changes the fingerprint.
    pub fn fingerprint(&self, snap: Snapshot) -> Result<[u8; 32]> {
        Ok(self.to_host(snap)?.fingerprint())
    }

    /// A snapshot's K/V copied to host memory (one device→host copy), to hash later — on
    /// another thread, say, while the device works on.
    pub fn to_host(&self, snap: Snapshot) -> Result<HostKv> {
        self.copy_out(snap)?.to_host()
    }

    /// A snapshot's K/V gathered into one buffer on the cache's device (a device-side copy,
    /// queued like any other op): [`SnapshotKv::to_host`] then brings it to the host — on
    /// another thread, say, so the host side of that copy overlaps the device's work.
    pub fn copy_out(&self, snap: Snapshot) -> Result<SnapshotKv> {
        if snap.row >= self.batch() || snap.len > self.capacity || snap.len < 0 {
            return Err(Error::KvCache(format!(
                "snapshot (row {}, len {}) is not within this cache",
                snap.row, snap.len
            )));
        }
        if snap.len == 0 || self.layers.is_empty() {
            return Ok(SnapshotKv {
                len: snap.len,
                kv: None,
            });
        }
        // [2·layers, Hkv, len, D] in (layer, K/V) order.
        let parts: Vec<Tensor> = self
            .layers
            .iter()
            .flat_map(|l| [&l.k, &l.v])
            .map(|buf| {
                Ok(buf
                    .f_narrow(0, snap.row as i64, 1)?
                    .f_narrow(2, 0, snap.len)?)
            })
            .collect::<Result<_>>()?;
        Ok(SnapshotKv {
            len: snap.len,
            kv: Some(Tensor::f_cat(&parts, 0)?),
        })
    }

    /// A new cache whose row *i* is `parts[i].base` with the K and/or V of `parts[i].donor`
    /// over the selected layers and positions, with room for `extra` further positions.
    /// Sources are untouched (no cache is ever rewritten below its length): a transplant is a
    /// new state, and transplanting the original values back restores the base's fingerprint.
    /// Base and donor must come from caches of the same shape, dtype and device (the same
    /// model) and have the same length.
    pub fn transplant(parts: &[Transplant], extra: i64) -> Result<KvCache> {
        let bases: Vec<(&KvCache, Snapshot)> = parts.iter().map(|p| p.base).collect();
        for (i, p) in parts.iter().enumerate() {
            let ((base, bs), (donor, ds)) = (p.base, p.donor);
            if donor.shape != base.shape || donor.kind != base.kind || donor.device != base.device {
                return Err(Error::KvCache(format!(
                    "transplant {i}: donor cache ({:?}, {:?}) is not of the base's model ({:?}, {:?})",
                    donor.shape, donor.kind, base.shape, base.kind
                )));
            }
            if ds.len != bs.len || ds.row >= donor.batch() || ds.len > donor.lens[ds.row] {
                return Err(Error::KvCache(format!(
                    "transplant {i}: donor snapshot (row {}, len {}) does not match a base of length {}",
                    ds.row, ds.len, bs.len
                )));
            }
            let s = &p.select;
            if s.layers.start > s.layers.end || s.layers.end > base.shape.layers {
                return Err(Error::KvCache(format!(
                    "transplant {i}: layers {}..{} out of bounds for {} layers",
                    s.layers.start, s.layers.end, base.shape.layers
                )));
            }
            if s.positions.start < 0
                || s.positions.start > s.positions.end
                || s.positions.end > bs.len
            {
                return Err(Error::KvCache(format!(
                    "transplant {i}: positions {}..{} out of bounds for a snapshot of length {}",
                    s.positions.start, s.positions.end, bs.len
                )));
            }
        }
        let out = KvCache::gather(&bases, extra)?;
        for (i, p) in parts.iter().enumerate() {
            let (donor, ds) = p.donor;
            let s = &p.select;
            let (start, n) = (s.positions.start, s.positions.end - s.positions.start);
            if n == 0 {
                continue;
            }
            for l in s.layers.clone() {
                let (dst, src) = (&out.layers[l], &donor.layers[l]);
                let mut pairs = Vec::with_capacity(2);
                if s.parts.keys() {
                    pairs.push((&dst.k, &src.k));
                }
                if s.parts.values() {
                    pairs.push((&dst.v, &src.v));
                }
                for (d, f) in pairs {
                    d.f_narrow(0, i as i64, 1)?
                        .f_narrow(2, start, n)?
                        .f_copy_(&f.f_narrow(0, ds.row as i64, 1)?.f_narrow(2, start, n)?)?;
                }
            }
        }
        Ok(out)
    }

    /// Copies of the K and V stored at `at[j] = (row, position)` for every layer:
    /// `[layers, 2, at.len(), Hkv, D]` (K then V), e.g. to compare two caches entry by entry.
    pub fn entries(&self, at: &[(usize, i64)]) -> Result<Tensor> {
        if let Some(&(r, p)) = at
            .iter()
            .find(|&&(r, p)| r >= self.batch() || p < 0 || p >= self.lens[r])
        {
            return Err(Error::KvCache(format!(
                "entry (row {r}, position {p}) is not within this cache"
            )));
        }
        let to_t = |v: Vec<i64>| -> Result<Tensor> {
            Ok(Tensor::f_from_slice(&v)?.f_to_device(self.device)?)
        };
        let rows = to_t(at.iter().map(|&(r, _)| r as i64).collect())?;
        let pos = to_t(at.iter().map(|&(_, p)| p).collect())?;
        let mut per_layer = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            // Advanced indexing on dims 0 and 2 of [B, H, cap, D]: [n, H, D].
            let pick = |buf: &Tensor| {
                buf.f_index(&[Some(rows.shallow_clone()), None, Some(pos.shallow_clone())])
            };
            per_layer.push(Tensor::f_stack(&[pick(&l.k)?, pick(&l.v)?], 0)?);
        }
        Ok(Tensor::f_stack(&per_layer, 0)?)
    }

    /// Flip one bit of the stored keys of `row` at `pos` in `layer` (for tests of the
    /// fingerprint check).
    pub fn corrupt_for_test(&mut self, layer: usize, row: usize, pos: i64) -> Result<()> {
        let cell = self.layers[layer]
            .k
            .f_narrow(0, row as i64, 1)?
            .f_narrow(2, pos, 1)?;
        let flipped = cell.f_neg()?;
        let nudged =
            flipped.f_where_self(&cell.f_eq(0.0)?.f_logical_not()?, &cell.f_add_scalar(1.0)?)?;
        self.layers[layer]
            .k
            .f_narrow(0, row as i64, 1)?
            .f_narrow(2, pos, 1)?
            .f_copy_(&nudged)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(batch: usize, lens: &[i64], seed: f64) -> KvCache {
        let shape = KvShape {
            layers: 2,
            kv_heads: 2,
            head_dim: 4,
        };
        let mut c = KvCache::new(shape, batch, 12, Kind::Float, Device::Cpu).unwrap();
        for (i, layer) in c.layers.iter_mut().enumerate() {
            let n = layer.k.numel() as i64;
            let vals = Tensor::arange(n, (Kind::Float, Device::Cpu)) + seed + i as f64;
            layer.k.copy_(&vals.view(layer.k.size().as_slice()));
            layer
                .v
                .copy_(&(vals * -1.0).view(layer.v.size().as_slice()));
        }
        c.lens = lens.to_vec();
        c
    }

    #[test]
    fn hash_pool_returns_each_copys_fingerprint_under_its_tag() -> Result<()> {
        let c = filled(3, &[10, 7, 12], 0.0);
        let snaps: Vec<Snapshot> = (0..3)
            .flat_map(|row| (0..=c.lens()[row]).map(move |len| Snapshot { row, len }))
            .collect();
        // More copies than the bound and than the threads: sends block, nothing is lost.
        let mut got = std::thread::scope(|scope| -> Result<Vec<(usize, [u8; 32])>> {
            let pool = HashPool::start(scope, 3, 2);
            for (i, &snap) in snaps.iter().enumerate() {
                pool.send(i, c.copy_out(snap)?)?;
            }
            pool.finish()
        })?;
        got.sort_by_key(|&(i, _)| i);
        assert_eq!(got.len(), snaps.len());
        for (i, fp) in got {
            assert_eq!(fp, c.fingerprint(snaps[i])?, "copy {i}");
        }
        // Negative control: a tag's fingerprint is its own copy's, not any other's.
        assert_ne!(
            c.fingerprint(Snapshot { row: 0, len: 5 })?,
            c.fingerprint(Snapshot { row: 0, len: 6 })?
        );
        // Nothing sent: nothing back.
        let none = std::thread::scope(|scope| HashPool::<u8>::start(scope, 2, 1).finish())?;
        assert!(none.is_empty());
        Ok(())
    }

    #[test]
    fn gather_and_load_rows_copy_exact_prefixes_and_zero_the_rest() -> Result<()> {
        let a = filled(3, &[10, 7, 12], 0.0);
        let b = filled(1, &[9], 1000.0);
        let snaps = [
            (&a, Snapshot { row: 2, len: 5 }),
            (&b, Snapshot { row: 0, len: 9 }),
            (&a, Snapshot { row: 0, len: 8 }),
            (&a, Snapshot { row: 2, len: 5 }),
        ];
        let g = KvCache::gather(&snaps, 3)?;
        assert_eq!(g.lens(), &[5, 9, 8, 5]);
        assert_eq!(g.capacity(), 12);
        // Reuse a dirty cache: load_rows must give the same buffers.
        let mut r = filled(5, &[1, 1, 1, 1, 1], 50.0);
        r.load_rows(&snaps)?;
        assert_eq!(r.lens(), g.lens());
        for (i, (src, s)) in snaps.iter().enumerate() {
            let fp = src.fingerprint(*s)?;
            assert_eq!(g.fingerprint(g.snapshot(i))?, fp);
            assert_eq!(r.fingerprint(r.snapshot(i))?, fp);
            for (lg, lr) in g.layers.iter().zip(&r.layers) {
                for buf in [&lg.k, &lg.v, &lr.k, &lr.v] {
                    let rest = buf.narrow(0, i as i64, 1).narrow(2, s.len, 12 - s.len);
                    assert_eq!(rest.abs().sum(Kind::Float).double_value(&[]), 0.0);
                }
            }
        }
        assert!(g.rows_equal(&[3, 1], &[0, 1], 12)?);
        assert!(!g.rows_equal(&[2], &[0], 12)?);
        Ok(())
    }

    #[test]
    fn rows_differ_sees_one_changed_bit_below_the_length_only() -> Result<()> {
        let mut c = filled(3, &[10, 10, 10], 0.0);
        let read = |t: Tensor| bool::try_from(t).unwrap();
        // Row 1 becomes a copy of row 0: equal over every length, in both orders.
        for layer in c.layers.iter_mut() {
            for buf in [&mut layer.k, &mut layer.v] {
                let row0 = buf.narrow(0, 0, 1).copy();
                buf.narrow(0, 1, 1).copy_(&row0);
            }
        }
        assert!(!read(c.rows_differ(0, 1, 10)?));
        assert!(!read(c.rows_differ(1, 0, 12)?));
        assert!(!read(c.rows_differ(0, 1, 0)?));
        // Negative control: a row that differs everywhere differs.
        assert!(read(c.rows_differ(0, 2, 1)?));
        // −0.0 for +0.0 in row 1's last layer's V, at position 9: the values compare equal, the
        // bits do not.
        let v = &mut c.layers[1].v;
        let _ = v.narrow(0, 0, 1).narrow(2, 9, 1).fill_(0.0);
        let _ = v.narrow(0, 1, 1).narrow(2, 9, 1).fill_(-0.0);
        assert!(read(c.rows_differ(0, 1, 10)?));
        assert!(read(c.rows_differ(1, 0, 12)?));
        // Positions from `upto` on are not compared.
        assert!(!read(c.rows_differ(0, 1, 9)?));
        Ok(())
    }

    #[test]
    fn compact_rows_moves_rows_in_place() -> Result<()> {
        let mut c = filled(4, &[3, 4, 5, 6], 0.0);
        let before: Vec<[u8; 32]> = (0..4)
            .map(|r| c.fingerprint(c.snapshot(r)).unwrap())
            .collect();
        let ptr = c.layers[0].k.data_ptr();
        c.compact_rows(&[3, 1])?;
        assert_eq!(c.lens(), &[6, 4]);
        assert_eq!(c.layers[0].k.data_ptr(), ptr);
        assert_eq!(c.fingerprint(c.snapshot(0))?, before[3]);
        assert_eq!(c.fingerprint(c.snapshot(1))?, before[1]);
        Ok(())
    }
}
