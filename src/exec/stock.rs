//! Stock policy: plain libtorch ops, as an eager Hugging Face model would run them.
use super::AttnParams;
use crate::Result;
use tch::Tensor;

pub(super) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    Ok(x.f_linear(w, b)?)
}

pub(super) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, p: &AttnParams) -> Result<Tensor> {
    let (b, hq, t, d) = q.size4()?;
    let hkv = k.size()[1];
    let group = hq / hkv;
    let l = k.size()[2];
    // Fold the query heads of a group into rows so K/V are never copied per query head.
    let qg = q.f_reshape([b, hkv, group * t, d])?;
    let scores = super::glue::softmax_input(&qg.f_matmul(&k.f_transpose(-1, -2)?)?, p, group)?;
    let probs = scores
        .f_softmax(-1, super::accum_kind(q.kind()))?
        .f_to_kind(q.kind())?;
    Ok(probs
        .f_view([b, hkv, group * t, l])?
        .f_matmul(v)?
        .f_view([b, hq, t, d])?)
}
