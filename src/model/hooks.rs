//! Forward hooks: let a caller read and replace the residual stream and the sublayer outputs
//! of every layer during [`super::Decoder::forward_with`], so studies (drift profiling,
//! activation patching) never edit model code. The model calls the hook at fixed sites and
//! never knows what it does; [`NoHook`] changes nothing, so [`super::Decoder::forward`] is
//! bitwise the unhooked forward.
//!
//! Sites follow TransformerLens' naming: `attn_out` and `mlp_out` (sublayer outputs, before
//! they are added to the residual stream; after Gemma's and OLMo-2's output norms) and
//! `resid_post` (the residual stream after the layer), all `[B, T, hidden]` in the run dtype.
use crate::{Error, Result};
use tch::{Device, Kind, Tensor};

/// Which tensor of a layer a hook sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Site {
    /// Attention output as added to the residual stream.
    AttnOut,
    /// MLP output as added to the residual stream.
    MlpOut,
}

/// Called by the decoder at each hook site; returning `Some(t)` replaces the tensor with `t`
/// (same shape, dtype and device) for the rest of the forward pass.
pub trait ForwardHook {
    /// The residual stream after `layer` (`[B, T, hidden]`).
    fn on_residual(&mut self, layer: usize, h: &Tensor) -> Result<Option<Tensor>>;

    /// A sublayer output of `layer` before it joins the residual stream. Default: untouched.
    fn on_sublayer(&mut self, _layer: usize, _site: Site, _x: &Tensor) -> Result<Option<Tensor>> {
        Ok(None)
    }
}

/// Records the whole residual stream (every row and position) after each layer, in layer order.
#[derive(Default)]
pub struct Trace {
    /// Residual stream after each layer, `[B, T, hidden]` each.
    pub residual: Vec<Tensor>,
}

impl ForwardHook for Trace {
    fn on_residual(&mut self, _layer: usize, h: &Tensor) -> Result<Option<Tensor>> {
        self.residual.push(h.f_detach_copy()?);
        Ok(None)
    }
}

/// The hook that does nothing.
pub struct NoHook;

impl ForwardHook for NoHook {
    fn on_residual(&mut self, _: usize, _: &Tensor) -> Result<Option<Tensor>> {
        Ok(None)
    }
}

/// Gather one position per row of a `[B, T, H]` tensor: `[B, H]`.
fn at_positions(x: &Tensor, positions: &Tensor) -> Result<Tensor> {
    let (b, h) = (x.size()[0], x.size()[2]);
    let idx = positions.f_view([b, 1, 1])?.f_expand([b, 1, h], false)?;
    Ok(x.f_gather(1, &idx, false)?.f_view([b, h])?)
}

fn positions_tensor(positions: &[i64], b: usize, device: Device) -> Result<Tensor> {
    if positions.len() != b {
        return Err(Error::Spec(format!(
            "hook: {} positions for a batch of {b} rows",
            positions.len()
        )));
    }
    Ok(Tensor::f_from_slice(positions)?.f_to_device(device)?)
}

/// Records the residual stream (and optionally the sublayer outputs) of every layer at one
/// position per row (an index into the T new tokens).
pub struct Recorder {
    positions: Vec<i64>,
    sublayers: bool,
    /// Residual stream after each layer, `[B, hidden]` each, in layer order.
    pub residual: Vec<Tensor>,
    /// Attention and MLP outputs of each layer, `[B, hidden]` each (when asked for).
    pub attn_out: Vec<Tensor>,
    /// See [`Self::attn_out`].
    pub mlp_out: Vec<Tensor>,
}

impl Recorder {
    /// Record at `positions[b]` of row `b`; `sublayers` also keeps the sublayer outputs.
    pub fn new(positions: Vec<i64>, sublayers: bool) -> Recorder {
        Recorder {
            positions,
            sublayers,
            residual: vec![],
            attn_out: vec![],
            mlp_out: vec![],
        }
    }

    /// The residual stream as one `[L, B, hidden]` tensor.
    pub fn stacked(&self) -> Result<Tensor> {
        Ok(Tensor::f_stack(&self.residual, 0)?)
    }

    fn pick(&self, x: &Tensor) -> Result<Tensor> {
        let pos = positions_tensor(&self.positions, x.size()[0] as usize, x.device())?;
        at_positions(x, &pos)
    }
}

impl ForwardHook for Recorder {
    fn on_residual(&mut self, _layer: usize, h: &Tensor) -> Result<Option<Tensor>> {
        let v = self.pick(h)?;
        self.residual.push(v);
        Ok(None)
    }

    fn on_sublayer(&mut self, _layer: usize, site: Site, x: &Tensor) -> Result<Option<Tensor>> {
        if self.sublayers {
            let v = self.pick(x)?;
            match site {
                Site::AttnOut => self.attn_out.push(v),
                Site::MlpOut => self.mlp_out.push(v),
            }
        }
        Ok(None)
    }
}

/// Replaces the residual stream of row `b` at position `positions[b]` after each layer in
/// `layers[b]` with `values[layer]` row `b` (`[L, B, hidden]`, e.g. another path's
/// [`Recorder::stacked`]). Rows with an empty layer set are left alone.
pub struct Patch {
    positions: Vec<i64>,
    layers: Vec<std::ops::Range<usize>>,
    values: Tensor,
}

impl Patch {
    /// A patch of `values` (`[L, B, hidden]`) over per-row layer ranges.
    pub fn new(
        positions: Vec<i64>,
        layers: Vec<std::ops::Range<usize>>,
        values: Tensor,
    ) -> Result<Patch> {
        let dims = values.size();
        if dims.len() != 3 || dims[1] as usize != positions.len() || layers.len() != positions.len()
        {
            return Err(Error::Spec(format!(
                "patch: values {dims:?}, {} positions and {} layer ranges do not match",
                positions.len(),
                layers.len()
            )));
        }
        let n = dims[0] as usize;
        if let Some(r) = layers.iter().find(|r| r.start > r.end || r.end > n) {
            return Err(Error::Spec(format!(
                "patch: layer range {}..{} out of bounds for {n} layers",
                r.start, r.end
            )));
        }
        Ok(Patch {
            positions,
            layers,
            values,
        })
    }
}

impl ForwardHook for Patch {
    fn on_residual(&mut self, layer: usize, h: &Tensor) -> Result<Option<Tensor>> {
        let rows: Vec<i64> = (0..self.layers.len())
            .filter(|&b| self.layers[b].contains(&layer))
            .map(|b| b as i64)
            .collect();
        if rows.is_empty() {
            return Ok(None);
        }
        let (b, t, hd) = (h.size()[0], h.size()[1], h.size()[2]);
        let dev = h.device();
        let mut mask = vec![0i64; (b * t) as usize];
        for &r in &rows {
            let p = self.positions[r as usize];
            if !(0..t).contains(&p) || r >= b {
                return Err(Error::Spec(format!(
                    "patch: position {p} of row {r} outside a forward of {b}×{t} tokens"
                )));
            }
            mask[(r * t + p) as usize] = 1;
        }
        let mask = Tensor::f_from_slice(&mask)?
            .f_to_device(dev)?
            .f_view([b, t, 1])?
            .f_to_kind(Kind::Bool)?;
        // New values broadcast over T, selected only where the mask is set.
        let new = self
            .values
            .f_get(layer as i64)?
            .f_to_kind(h.kind())?
            .f_to_device(dev)?
            .f_view([b, 1, hd])?
            .f_expand([b, t, hd], false)?;
        Ok(Some(new.f_where_self(&mask, h)?))
    }
}
