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

/// Append-only KV cache for a batch of sequences.
pub struct KvCache {
    shape: KvShape,
    layers: Vec<LayerKv>,
    lens: Vec<i64>,
    capacity: i64,
    kind: Kind,
    device: Device,
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
                grown.narrow(2, 0, self.capacity).f_copy_(buf)?;
                *buf = grown;
            }
        }
        self.capacity = cap;
        Ok(())
    }

    /// Write `k`, `v` (`[B, Hkv, T, D]`) for `layer` at each row's current length and return
    /// views of the valid prefix `[B, Hkv, max_len + T, D]`. Lengths advance in [`Self::advance`].
    pub(crate) fn write(
        &mut self,
        layer: usize,
        k: &Tensor,
        v: &Tensor,
        positions: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let t = k.size()[2];
        let uniform = self.lens.windows(2).all(|w| w[0] == w[1]);
        let start = self.lens.first().copied().unwrap_or(0);
        let end = self.lens.iter().copied().max().unwrap_or(0) + t;
        let buf = &mut self.layers[layer];
        if uniform {
            buf.k.narrow(2, start, t).f_copy_(k)?;
            buf.v.narrow(2, start, t).f_copy_(v)?;
        } else {
            let dims = k.size();
            let index = positions.view([dims[0], 1, t, 1]).expand(&dims, false);
            let _ = buf.k.f_scatter_(2, &index, k)?;
            let _ = buf.v.f_scatter_(2, &index, v)?;
        }
        Ok((buf.k.narrow(2, 0, end), buf.v.narrow(2, 0, end)))
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
        for (src, s) in parts {
            if src.shape != first.shape || src.kind != first.kind || src.device != first.device {
                return Err(Error::KvCache(
                    "gathered caches differ in shape, dtype or device".into(),
                ));
            }
            if s.row >= src.batch() || s.len > src.lens[s.row] {
                return Err(Error::KvCache(format!(
                    "snapshot (row {}, len {}) is not within its source cache",
                    s.row, s.len
                )));
            }
        }
        let mut out = KvCache::new(
            first.shape,
            parts.len(),
            longest + extra,
            first.kind,
            first.device,
        )?;
        for (i, (src, s)) in parts.iter().enumerate() {
            if s.len == 0 {
                continue;
            }
            for (dst, from) in out.layers.iter_mut().zip(&src.layers) {
                for (d, f) in [(&dst.k, &from.k), (&dst.v, &from.v)] {
                    d.narrow(0, i as i64, 1)
                        .narrow(2, 0, s.len)
                        .f_copy_(&f.narrow(0, s.row as i64, 1).narrow(2, 0, s.len))?;
                }
            }
        }
        out.lens = parts.iter().map(|(_, s)| s.len).collect();
        Ok(out)
    }

    /// Keep only the given rows (in the given order), e.g. to drop finished sequences.
    pub fn select_rows(&mut self, rows: &[usize]) -> Result<()> {
        if rows.iter().any(|&r| r >= self.batch()) {
            return Err(Error::KvCache(format!("row out of range in {rows:?}")));
        }
        let idx = Tensor::from_slice(&rows.iter().map(|&r| r as i64).collect::<Vec<_>>())
            .to_device(self.device);
        for layer in &mut self.layers {
            layer.k = layer.k.f_index_select(0, &idx)?;
            layer.v = layer.v.f_index_select(0, &idx)?;
        }
        self.lens = rows.iter().map(|&r| self.lens[r]).collect();
        Ok(())
    }

    /// SHA-256 over the K and V bytes of the first `len` positions of `row`, all layers, in
    /// layer order. Bitwise: any changed bit changes the fingerprint.
    pub fn fingerprint(&self, snap: Snapshot) -> Result<[u8; 32]> {
        let mut h = Sha256::new();
        h.update(snap.len.to_le_bytes());
        for layer in &self.layers {
            for buf in [&layer.k, &layer.v] {
                let part = buf
                    .narrow(0, snap.row as i64, 1)
                    .narrow(2, 0, snap.len)
                    .to_device(Device::Cpu)
                    .contiguous();
                let n = part.numel() * self.kind.elt_size_in_bytes();
                let mut bytes = vec![0u8; n];
                part.f_view_dtype(Kind::Uint8)?
                    .f_copy_data_u8(&mut bytes, n)?;
                h.update(&bytes);
            }
        }
        Ok(h.finalize().into())
    }

    /// Flip one bit of the stored keys of `row` at `pos` in `layer` (for tests of the
    /// fingerprint check).
    pub fn corrupt_for_test(&mut self, layer: usize, row: usize, pos: i64) -> Result<()> {
        let cell = self.layers[layer]
            .k
            .narrow(0, row as i64, 1)
            .narrow(2, pos, 1);
        let flipped = cell.f_neg()?;
        let nudged =
            flipped.f_where_self(&cell.f_eq(0.0)?.logical_not(), &cell.f_add_scalar(1.0)?)?;
        self.layers[layer]
            .k
            .narrow(0, row as i64, 1)
            .narrow(2, pos, 1)
            .f_copy_(&nudged)?;
        Ok(())
    }
}
