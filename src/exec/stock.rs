//! Stock policy: plain libtorch ops, as an eager Hugging Face model would run them.
use super::AttnParams;
use tch::Tensor;

pub(super) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    x.linear(w, b)
}

pub(super) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, p: &AttnParams) -> Tensor {
    let (b, hq, t, d) = q.size4().expect("q is 4-d");
    let hkv = k.size()[1];
    let group = hq / hkv;
    let l = k.size()[2];
    // Fold the query heads of a group into rows so K/V are never copied per query head.
    let qg = q.reshape([b, hkv, group * t, d]);
    let mut scores = qg.matmul(&k.transpose(-1, -2)) * p.scale;
    if let Some(cap) = p.softcap {
        scores = (scores / cap).tanh() * cap;
    }
    let scores = scores.view([b, hkv, group, t, l]) + p.mask;
    let probs = scores
        .softmax(-1, super::accum_kind(q.kind()))
        .to_kind(q.kind());
    probs
        .view([b, hkv, group * t, l])
        .matmul(v)
        .view([b, hq, t, d])
}
