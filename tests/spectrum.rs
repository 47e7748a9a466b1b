//! SpectrumKV: tiers restore the dense cache (bitwise at FP16), quantized tiers match an
//! independent f64 dequantizer within their error bounds, the frame's bytes equal the
//! accounting, the wire round-trips bitwise and rejects damaged frames, dropped tokens are
//! masked at their original positions, importance and allocation behave as specified.
mod common;

use kvcredit::exec::ExecPolicy;
use kvcredit::kv_cache::KvShape;
use kvcredit::model::LogitsAt;
use kvcredit::spectrum::allocate::{self, Budget, Policy, Protect};
use kvcredit::spectrum::importance::{self, Aggregate, ImportanceSpec, Pooling};
use kvcredit::spectrum::quant::{self, Block, BlockShape, GROUP, Side};
use kvcredit::spectrum::tiers::{TierPlan, TieredKv};
use kvcredit::spectrum::{Quantizer, Tier, wire};
use kvcredit::{Decoder, KvCache, Result};
use std::path::Path;
use tch::{Device, Kind, Tensor};

const POLICY: ExecPolicy = ExecPolicy::Stock;
const QUANTIZERS: [Quantizer; 3] = [
    Quantizer::Kivi,
    Quantizer::LabCompat,
    Quantizer::LabCompatToken,
];

fn model(name: &str, kind: Kind) -> Decoder {
    common::load(&common::hf_fixtures().join(name), kind).unwrap()
}

fn prompt(n: usize, seed: u64) -> Vec<i64> {
    (0..n as u64)
        .map(|i| ((i * 2654435761 + seed * 97) % 127) as i64)
        .collect()
}

fn prefilled(m: &Decoder, ids: &[i64]) -> KvCache {
    let mut cache = m.new_cache(1, ids.len() as i64 + 4).unwrap();
    let t = Tensor::from_slice(ids).view([1, -1]);
    let _ = m.forward(&t, &mut cache, &POLICY, &LogitsAt::Last).unwrap();
    cache
}

/// Logits of feeding `token` after the cache's positions.
fn step(m: &Decoder, cache: &mut KvCache, token: i64) -> Tensor {
    let t = Tensor::from_slice(&[token]).view([1, 1]);
    m.forward(&t, cache, &POLICY, &LogitsAt::Last).unwrap()
}

fn plan_of(n: usize, f: impl Fn(usize) -> Tier) -> TierPlan {
    TierPlan::new((0..n).map(f).collect())
}

#[test]
fn all_fp16_tier_restores_the_dense_cache_bitwise() -> Result<()> {
    for kind in [Kind::Half, Kind::BFloat16] {
        let m = model("qwen2", kind);
        let ids = prompt(40, 1);
        let cache = prefilled(&m, &ids);
        let snap = cache.snapshot(0);
        for q in QUANTIZERS {
            let t = TieredKv::build(&cache, 0, &TierPlan::uniform(40, Tier::Fp16), q)?;
            let back = wire::decode(&wire::encode(&t)?)?;
            let r = back.restore(kind, Device::Cpu, 4)?;
            assert_eq!(r.fingerprint(r.snapshot(0))?, cache.fingerprint(snap)?);
            assert!(r.masked_positions(0)?.is_empty());
        }
        // Negative control: one INT8 token changes the restored bits.
        let t = TieredKv::build(
            &cache,
            0,
            &plan_of(40, |i| if i == 7 { Tier::Int8 } else { Tier::Fp16 }),
            Quantizer::Kivi,
        )?;
        let r = t.restore(kind, Device::Cpu, 0)?;
        assert_ne!(r.fingerprint(r.snapshot(0))?, cache.fingerprint(snap)?);
    }
    // An fp32 cache's FP16 tier is the cache rounded to fp16, bitwise.
    let m = model("qwen2", Kind::Float);
    let cache = prefilled(&m, &prompt(40, 2));
    let t = TieredKv::build(
        &cache,
        0,
        &TierPlan::uniform(40, Tier::Fp16),
        Quantizer::Kivi,
    )?;
    for layer in 0..m.kv_shape().layers {
        let (k, v) = t.layer_dense(layer, Kind::Float, Device::Cpu)?;
        let (dk, dv) = cache.layer_kv(layer, 40)?;
        for (got, dense) in [(k, dk), (v, dv)] {
            let want = dense.select(0, 0).to_kind(Kind::Half).to_kind(Kind::Float);
            assert!(got.equal(&want));
            assert!(
                !got.equal(&dense.select(0, 0)),
                "fp32 values are not all fp16-exact"
            );
        }
    }
    Ok(())
}

/// Independent dequantizer: plain f64 loops over the bytes, written from the format's
/// description (not from `quant::decode`).
fn reference_dequant(b: &Block, tier: Tier, q: Quantizer, side: Side, s: BlockShape) -> Vec<f64> {
    let (h, m, d) = (s.heads as usize, s.tokens as usize, s.head_dim as usize);
    let g = GROUP as usize;
    let f16 = |bytes: &[u8], i: usize| {
        f64::from(half::f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]))
    };
    let code = |i: usize| -> f64 {
        match tier {
            Tier::Int8 => b.payload[i] as f64,
            _ => {
                let byte = b.payload[i / 2];
                (if i.is_multiple_of(2) {
                    byte & 0x0f
                } else {
                    byte >> 4
                }) as f64
            }
        }
    };
    let mut out = vec![0.0; h * m * d];
    for hh in 0..h {
        for t in 0..m {
            for c in 0..d {
                let i = (hh * m + t) * d + c;
                out[i] = match (q, side) {
                    (Quantizer::Kivi, Side::Key) => {
                        // Scales [h, ceil(m/g), d].
                        let gi = (hh * m.div_ceil(g) + t / g) * d + c;
                        code(i) * f16(&b.scales, gi) + f16(&b.zeros, gi)
                    }
                    (Quantizer::Kivi, Side::Value) => {
                        // Scales [h·m, ceil(d/g)].
                        let gi = (hh * m + t) * d.div_ceil(g) + c / g;
                        code(i) * f16(&b.scales, gi) + f16(&b.zeros, gi)
                    }
                    (Quantizer::LabCompat, _) => {
                        // Scales [h, m].
                        let offset = if tier == Tier::Int8 { 128.0 } else { 8.0 };
                        (code(i) - offset) * f16(&b.scales, hh * m + t)
                    }
                    (Quantizer::LabCompatToken, _) => {
                        // Scales [m].
                        let offset = if tier == Tier::Int8 { 128.0 } else { 8.0 };
                        (code(i) - offset) * f16(&b.scales, t)
                    }
                };
            }
        }
    }
    out
}

/// The error bound of element `i`: half a step of its group (with fp16 rounding of the scale
/// and zero point), from the group's min/max (asymmetric) or |max| (symmetric) in `x`.
fn bound(x: &[f64], tier: Tier, q: Quantizer, side: Side, s: BlockShape, i: usize) -> f64 {
    let (m, d) = (s.tokens as usize, s.head_dim as usize);
    let g = GROUP as usize;
    let (hh, t, c) = (i / (m * d), i / d % m, i % d);
    let members: Vec<usize> = match (q, side) {
        (Quantizer::Kivi, Side::Key) => (t / g * g..((t / g + 1) * g).min(m))
            .map(|tt| (hh * m + tt) * d + c)
            .collect(),
        (Quantizer::Kivi, Side::Value) => (c / g * g..((c / g + 1) * g).min(d))
            .map(|cc| (hh * m + t) * d + cc)
            .collect(),
        (Quantizer::LabCompat, _) => (0..d).map(|cc| (hh * m + t) * d + cc).collect(),
        (Quantizer::LabCompatToken, _) => (0..s.heads as usize)
            .flat_map(|h2| (0..d).map(move |cc| (h2 * m + t) * d + cc))
            .collect(),
    };
    let lo = members.iter().map(|&j| x[j]).fold(f64::INFINITY, f64::min);
    let hi = members
        .iter()
        .map(|&j| x[j])
        .fold(f64::NEG_INFINITY, f64::max);
    let amax = lo.abs().max(hi.abs());
    let levels = match q {
        Quantizer::Kivi => ((1u32 << tier.bits()) - 1) as f64,
        Quantizer::LabCompat | Quantizer::LabCompatToken => {
            ((1u32 << (tier.bits() - 1)) - 1) as f64
        }
    };
    let step = match q {
        Quantizer::Kivi => (hi - lo) / levels,
        Quantizer::LabCompat | Quantizer::LabCompatToken => amax / levels,
    };
    // fp16 rounding (relative 2^-11) of the scale, times the largest code, and of the zero.
    let fp16 = 2f64.powi(-11);
    step * (0.5 + levels * fp16) + amax * fp16 + 1e-12
}

fn random_block(h: i64, m: i64, d: i64, seed: i64) -> Tensor {
    tch::manual_seed(seed);
    let x = Tensor::randn([h, m, d], (Kind::Float, Device::Cpu));
    // One channel with a large offset (like Qwen's key biases) and a spread of magnitudes.
    let offset = Tensor::zeros([1, 1, d], (Kind::Float, Device::Cpu));
    let _ = offset.narrow(2, 3, 1).fill_(40.0);
    x * Tensor::linspace(0.1, 3.0, m, (Kind::Float, Device::Cpu)).view([1, m, 1]) + offset
}

#[test]
fn quantized_tiers_match_an_independent_reference_within_their_bounds() -> Result<()> {
    let s = BlockShape {
        heads: 2,
        tokens: 70,
        head_dim: 64,
    };
    let x = random_block(s.heads, s.tokens, s.head_dim, 3);
    let xs: Vec<f64> = Vec::<f64>::try_from(x.to_kind(Kind::Double).view([-1])).unwrap();
    for q in QUANTIZERS {
        for side in [Side::Key, Side::Value] {
            for tier in [Tier::Int8, Tier::Int4] {
                let b = quant::encode(&x, tier, q, side)?;
                let sizes = quant::block_sizes(tier, q, side, s);
                assert_eq!((b.payload.len(), b.scales.len(), b.zeros.len()), sizes);
                let reference = reference_dequant(&b, tier, q, side, s);
                let ours =
                    quant::decode(&b, tier, q, side, s, Kind::Float, Kind::Double, Device::Cpu)?;
                let ours: Vec<f64> = Vec::<f64>::try_from(ours.view([-1])).unwrap();
                let mut worst = 0.0f64;
                for i in 0..xs.len() {
                    // The library's dequantizer agrees with the reference to fp32 rounding.
                    assert!(
                        (ours[i] - reference[i]).abs() <= 1e-6 * (1.0 + reference[i].abs()),
                        "{q} {side:?} {tier:?} element {i}: {} vs reference {}",
                        ours[i],
                        reference[i]
                    );
                    let e = (reference[i] - xs[i]).abs();
                    let bd = bound(&xs, tier, q, side, s, i);
                    assert!(
                        e <= bd,
                        "{q} {side:?} {tier:?} element {i}: error {e} > bound {bd}"
                    );
                    worst = worst.max(e / bd);
                }
                assert!(worst > 0.2, "bound is loose: worst error/bound {worst}");
                // Negative control: INT4's errors break the INT8 bound somewhere.
                if tier == Tier::Int4 {
                    let over = (0..xs.len())
                        .filter(|&i| {
                            (reference[i] - xs[i]).abs() > bound(&xs, Tier::Int8, q, side, s, i)
                        })
                        .count();
                    assert!(
                        over > 0,
                        "{q} {side:?}: INT4 within the INT8 bound everywhere"
                    );
                }
            }
        }
    }
    // Keys with an outlier channel: per-channel grouping beats per-token symmetric scaling.
    let err = |q: Quantizer| -> Result<f64> {
        let b = quant::encode(&x, Tier::Int4, q, Side::Key)?;
        let r = quant::decode(
            &b,
            Tier::Int4,
            q,
            Side::Key,
            s,
            Kind::Float,
            Kind::Float,
            Device::Cpu,
        )?;
        Ok((r - &x).abs().mean(Kind::Float).double_value(&[]))
    };
    let (kivi, lab) = (err(Quantizer::Kivi)?, err(Quantizer::LabCompat)?);
    assert!(
        kivi * 4.0 < lab,
        "INT4 key error: kivi {kivi}, lab-compat {lab}"
    );
    // Mis-sized blocks are rejected, not read.
    let mut b = quant::encode(&x, Tier::Int4, Quantizer::Kivi, Side::Key)?;
    b.payload.pop();
    let e = quant::decode(
        &b,
        Tier::Int4,
        Quantizer::Kivi,
        Side::Key,
        s,
        Kind::Float,
        Kind::Float,
        Device::Cpu,
    );
    assert!(e.is_err());
    Ok(())
}

/// `[2, m, d]` whose head 0 spans ±0.01 and head 1 ±10: one scale over both heads wastes
/// head 0's codes.
fn two_range_block(m: i64, d: i64) -> Tensor {
    tch::manual_seed(11);
    let x = Tensor::rand([2, m, d], (Kind::Float, Device::Cpu)) * 2.0 - 1.0;
    x * Tensor::from_slice(&[0.01f32, 10.0]).view([2, 1, 1])
}

#[test]
fn lab_compat_scales_per_kv_head_and_lab_compat_token_per_token() -> Result<()> {
    let s = BlockShape {
        heads: 2,
        tokens: 40,
        head_dim: 64,
    };
    let x = two_range_block(s.tokens, s.head_dim);
    let head0_err = |q: Quantizer| -> Result<f64> {
        let b = quant::encode(&x, Tier::Int8, q, Side::Value)?;
        // One fp16 scale per token and head (per head), or per token (over heads).
        let per = if q == Quantizer::LabCompat { 2 } else { 1 };
        assert_eq!(b.scales.len(), 2 * per * s.tokens as usize);
        assert!(b.zeros.is_empty());
        let r = quant::decode(
            &b,
            Tier::Int8,
            q,
            Side::Value,
            s,
            Kind::Float,
            Kind::Float,
            Device::Cpu,
        )?;
        Ok((r - &x).select(0, 0).abs().max().double_value(&[]))
    };
    let (head, token) = (
        head0_err(Quantizer::LabCompat)?,
        head0_err(Quantizer::LabCompatToken)?,
    );
    // Per head: half a step of 0.01/127; over heads: half a step of 10/127 swamps head 0.
    assert!(head <= 0.6 * 0.01 / 127.0, "per-head error {head}");
    assert!(token > 100.0 * head, "per-token {token} vs per-head {head}");
    // Negative control: with equal ranges in both heads the two agree bitwise.
    let same = Tensor::cat(&[x.narrow(0, 1, 1), x.narrow(0, 1, 1)], 0);
    let dq = |q: Quantizer| -> Result<Tensor> {
        let b = quant::encode(&same, Tier::Int4, q, Side::Key)?;
        quant::decode(
            &b,
            Tier::Int4,
            q,
            Side::Key,
            s,
            Kind::Float,
            Kind::Float,
            Device::Cpu,
        )
    };
    assert!(dq(Quantizer::LabCompat)?.equal(&dq(Quantizer::LabCompatToken)?));
    Ok(())
}

#[test]
fn lab_compat_names_and_wire_codes_are_distinct_and_stable() -> Result<()> {
    use clap::ValueEnum;
    #[derive(serde::Deserialize)]
    struct Q {
        q: Quantizer,
    }
    for (name, q) in [
        ("kivi", Quantizer::Kivi),
        ("lab-compat", Quantizer::LabCompat),
        ("lab-compat-token", Quantizer::LabCompatToken),
    ] {
        assert_eq!(q.name(), name);
        assert_eq!(Quantizer::from_str(name, false).unwrap(), q);
        let parsed: Q = toml::from_str(&format!("q = \"{name}\"")).unwrap();
        assert_eq!(parsed.q, q);
    }
    assert!(toml::from_str::<Q>("q = \"lab-compat-head\"").is_err());
    // Header byte 6: 1 is the per-token scheme, 2 per head; each decodes to its own.
    let m = model("qwen2", Kind::Float);
    let cache = prefilled(&m, &prompt(40, 12));
    for (q, code) in [
        (Quantizer::Kivi, 0u8),
        (Quantizer::LabCompatToken, 1),
        (Quantizer::LabCompat, 2),
    ] {
        let bytes = wire::encode(&TieredKv::build(&cache, 0, &mixed_plan(40), q)?)?;
        assert_eq!(bytes[6], code, "{q}");
        assert_eq!(wire::decode(&bytes)?.quantizer, q);
    }
    Ok(())
}

/// The allocation tests' cache shape, token count and importance scores (not monotone in
/// position, so importance and position rank tokens differently).
fn allocation_fixture() -> (KvShape, usize, Vec<f64>) {
    let n = 600;
    let shape = KvShape {
        layers: 4,
        kv_heads: 2,
        head_dim: 64,
    };
    (shape, n, (0..n).map(|i| ((i * 37) % 101) as f64).collect())
}

#[test]
fn lab_compat_per_head_scales_are_counted_in_the_budget() -> Result<()> {
    let (shape, n, scores) = allocation_fixture();
    let plan = |q: Quantizer, b: f64| -> Result<(TierPlan, f64)> {
        let budget = Budget {
            b,
            shape,
            quantizer: q,
            protect: Protect::default(),
        };
        let p = allocate::allocate(Policy::Spectrum { int4: true }, &scores, &budget)?;
        let real = budget.real_b(&p);
        Ok((p, real))
    };
    for b in [0.3, 0.5] {
        for q in QUANTIZERS {
            let (_, real) = plan(q, b)?;
            assert!(real <= b, "{q} at b={b}: real {real}");
        }
        // Twice the scales: the same INT plan costs more per head than per token.
        let (p, _) = plan(Quantizer::LabCompatToken, b)?;
        assert!(p.counts()[1] + p.counts()[2] > 0);
        let cost = |q| wire::frame_len(shape, n as i64, p.counts(), q);
        assert_eq!(
            cost(Quantizer::LabCompat) - cost(Quantizer::LabCompatToken),
            shape.layers * 2 * 2 * (p.counts()[1] + p.counts()[2])
        );
    }
    Ok(())
}

fn mixed_plan(n: usize) -> TierPlan {
    plan_of(n, |i| match i % 7 {
        0 | 1 => Tier::Fp16,
        2 | 3 => Tier::Int8,
        4 | 5 => Tier::Int4,
        _ => Tier::Drop,
    })
}

#[test]
fn frame_bytes_equal_the_accounting() -> Result<()> {
    let m = model("qwen2", Kind::Float);
    let shape = m.kv_shape();
    for n in [9usize, 40, 75] {
        let cache = prefilled(&m, &prompt(n, 4));
        for q in QUANTIZERS {
            let plan = mixed_plan(n);
            let t = TieredKv::build(&cache, 0, &plan, q)?;
            let bytes = wire::encode(&t)?;
            let budget = Budget {
                b: 1.0,
                shape,
                quantizer: q,
                protect: Protect::default(),
            };
            assert_eq!(
                bytes.len(),
                wire::frame_len(shape, n as i64, plan.counts(), q)
            );
            assert_eq!(bytes.len(), budget.bytes(&plan));
            let counted = n - plan.dropped();
            assert_eq!(
                bytes.len(),
                wire::HEADER + 2 * counted + t.block_bytes() + wire::TRAILER
            );
            // Each block's bytes by hand: payload bits, fp16 scales (and zeros).
            let (h, d) = (shape.kv_heads as usize, shape.head_dim as usize);
            let c = plan.counts();
            let groups = |x: usize| x.div_ceil(GROUP as usize);
            let scales = |mt: usize| match q {
                Quantizer::Kivi => 2 * 2 * (h * d * groups(mt) + h * mt * groups(d)),
                Quantizer::LabCompat => 2 * 2 * h * mt,
                Quantizer::LabCompatToken => 2 * 2 * mt,
            };
            let per_layer =
                2 * h * d * (2 * c[0] + c[1]) + h * d * c[2] + scales(c[1]) + scales(c[2]);
            assert_eq!(t.block_bytes(), shape.layers * per_layer);
            assert_eq!(
                wire::fp16_bytes(shape, n as i64),
                2 * shape.layers * h * d * n * 2
            );
        }
    }
    Ok(())
}

#[test]
fn wire_round_trips_bitwise() -> Result<()> {
    let m = model("qwen2", Kind::Float);
    let cache = prefilled(&m, &prompt(75, 5));
    for q in QUANTIZERS {
        let t = TieredKv::build(&cache, 0, &mixed_plan(75), q)?;
        let bytes = wire::encode(&t)?;
        let back = wire::decode(&bytes)?;
        assert_eq!(back, t);
        assert_eq!(wire::encode(&back)?, bytes);
        let (a, b) = (
            t.restore(Kind::Float, Device::Cpu, 0)?,
            back.restore(Kind::Float, Device::Cpu, 0)?,
        );
        assert_eq!(a.fingerprint(a.snapshot(0))?, b.fingerprint(b.snapshot(0))?);
        assert_eq!(a.masked_positions(0)?, t.dropped());
    }
    Ok(())
}

#[test]
fn damaged_frames_are_rejected_with_one_line() -> Result<()> {
    let m = model("qwen2", Kind::Float);
    let cache = prefilled(&m, &prompt(40, 6));
    let bytes = wire::encode(&TieredKv::build(
        &cache,
        0,
        &mixed_plan(40),
        Quantizer::Kivi,
    )?)?;
    let one_line = |r: Result<TieredKv>, what: &str| {
        let e = r.expect_err(what).to_string();
        assert!(
            !e.contains('\n') && e.starts_with("spectrum: bad frame"),
            "{what}: {e}"
        );
        e
    };
    let mut flipped = bytes.clone();
    flipped[wire::HEADER + 100] ^= 0x10;
    assert!(one_line(wire::decode(&flipped), "flipped").contains("fingerprint"));
    one_line(wire::decode(&bytes[..bytes.len() - 1]), "truncated");
    one_line(wire::decode(&bytes[..10]), "short");
    let mut huge = bytes.clone();
    huge[24..28].copy_from_slice(&u32::MAX.to_le_bytes());
    one_line(wire::decode(&huge), "huge len");
    let mut version = bytes.clone();
    version[4] = 9;
    one_line(wire::decode(&version), "version");
    // The intact frame still decodes.
    assert!(wire::decode(&bytes).is_ok());
    Ok(())
}

#[test]
fn dropped_tokens_are_masked_at_their_original_positions() -> Result<()> {
    for name in ["qwen2", "mistral_sw"] {
        let m = model(name, Kind::Float);
        let ids = prompt(30, 7);
        let cache = prefilled(&m, &ids);
        let dropped = [3i64, 4, 11, 20, 26, 28];
        let plan = plan_of(30, |i| {
            if dropped.contains(&(i as i64)) {
                Tier::Drop
            } else {
                Tier::Fp16
            }
        });
        let t = TieredKv::build(&cache, 0, &plan, Quantizer::Kivi)?;
        let mut restored = t.restore(Kind::Float, Device::Cpu, 2)?;
        assert_eq!(restored.lens(), &[30]);
        assert_eq!(restored.masked_positions(0)?, dropped.to_vec());
        // Same cache without dropping, those positions masked instead: the stored values at
        // masked positions never reach the output (the restored cache has zeros there).
        let full = TieredKv::build(
            &cache,
            0,
            &TierPlan::uniform(30, Tier::Fp16),
            Quantizer::Kivi,
        )?;
        let mut masked = full.restore(Kind::Float, Device::Cpu, 2)?;
        masked.mask_positions(0, &dropped)?;
        let mut unmasked = full.restore(Kind::Float, Device::Cpu, 2)?;
        let (a, b, c) = (
            step(&m, &mut restored, 5),
            step(&m, &mut masked, 5),
            step(&m, &mut unmasked, 5),
        );
        assert!(a.equal(&b), "{name}: masked values leak");
        assert!(
            !a.equal(&c),
            "{name}: dropping changed nothing (negative control)"
        );
        // The next token sits at position 30, and the mask survives growth of the cache.
        assert_eq!(restored.lens(), &[31]);
        restored.reserve(100)?;
        assert_eq!(restored.masked_positions(0)?, dropped.to_vec());
        // ... and copies of it (gather, load_rows), but not into rows of unmasked sources.
        let g = KvCache::gather(
            &[
                (&cache, cache.snapshot(0)),
                (&restored, restored.snapshot(0)),
            ],
            1,
        )?;
        assert!(g.masked_positions(0)?.is_empty());
        assert_eq!(g.masked_positions(1)?, dropped.to_vec());
        let mut reused = KvCache::gather(&[(&restored, restored.snapshot(0))], 1)?;
        reused.load_rows(&[(&cache, cache.snapshot(0))])?;
        assert!(reused.masked_positions(0)?.is_empty());
    }
    Ok(())
}

#[test]
fn importance_sums_the_window_attention() -> Result<()> {
    let m = model("qwen2", Kind::Float);
    let ids = prompt(50, 8);
    let mut cache = m.new_cache(1, 50)?;
    let (logits, trace) = importance::prefill_traced(&m, &ids, &mut cache, &POLICY)?;
    // The traced prefill is the ordinary one.
    let plain = prefilled(&m, &ids);
    assert_eq!(
        cache.fingerprint(cache.snapshot(0))?,
        plain.fingerprint(plain.snapshot(0))?
    );
    assert_eq!(logits.size(), [1, 1, 128]);
    let spec = ImportanceSpec {
        window: 8,
        kernel: 1,
        pooling: Pooling::Avg,
        aggregate: Aggregate::Mean,
    };
    let s = importance::score(&m, &ids, &cache, &trace, &spec, &POLICY)?;
    assert_eq!(s.len(), 50);
    // Each of the 8 queries' probabilities sum to 1: so do the mean scores, times 8.
    let total: f64 = s.iter().sum();
    assert!((total - 8.0).abs() < 1e-4, "sum {total}");
    assert!(s.iter().all(|&x| x >= 0.0));
    // Max pooling (kernel 5) then max aggregation is the max over the window of the
    // unpooled max: the two maxima commute.
    let max_of = |kernel, pooling| ImportanceSpec {
        kernel,
        pooling,
        aggregate: Aggregate::Max,
        ..spec
    };
    let plain = importance::score(&m, &ids, &cache, &trace, &max_of(1, Pooling::Max), &POLICY)?;
    let pooled = importance::score(&m, &ids, &cache, &trace, &max_of(5, Pooling::Max), &POLICY)?;
    assert_ne!(pooled, plain);
    for i in 0..50usize {
        let window = plain[i.saturating_sub(2)..(i + 3).min(50)]
            .iter()
            .cloned()
            .fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(pooled[i], window, "token {i}");
    }
    Ok(())
}

#[test]
fn allocation_meets_the_budget_and_promotes_by_importance() -> Result<()> {
    let (shape, n, scores) = allocation_fixture();
    let budget = |b: f64| Budget {
        b,
        shape,
        quantizer: Quantizer::Kivi,
        protect: Protect::default(),
    };
    let mut last_fp16 = 0;
    for b in [0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0] {
        for policy in [
            Policy::Spectrum { int4: true },
            Policy::Spectrum { int4: false },
            Policy::PdTrim,
        ] {
            let plan = allocate::allocate(policy, &scores, &budget(b))?;
            let real = budget(b).real_b(&plan);
            assert!(real <= b, "{} at b={b}: real {real}", policy.name());
            // Within one FP16 token of the budget (greedy fills it).
            let slack =
                wire::fp16_bytes(shape, 1) as f64 / wire::fp16_bytes(shape, n as i64) as f64;
            assert!(
                real > b - 2.0 * slack || plan.counts()[0] == n,
                "{} at b={b}: real {real}",
                policy.name()
            );
            // Protected tokens are FP16.
            let t = plan.tiers();
            assert!(t[..4].iter().chain(&t[n - 32..]).all(|&x| x == Tier::Fp16));
            if let Policy::Spectrum { int4 } = policy {
                if !int4 {
                    assert!(!t.contains(&Tier::Int4));
                }
                // Every token at a higher tier is at least as important as any at a lower one.
                let rank = |x: Tier| match x {
                    Tier::Fp16 => 3,
                    Tier::Int8 => 2,
                    Tier::Int4 => 1,
                    Tier::Drop => 0,
                };
                for i in 4..n - 32 {
                    for j in 4..n - 32 {
                        if rank(t[i]) > rank(t[j]) {
                            assert!(scores[i] >= scores[j], "b={b}: {i} above {j}");
                        }
                    }
                }
                if int4 {
                    assert!(plan.counts()[0] >= last_fp16);
                    last_fp16 = plan.counts()[0];
                }
            } else {
                // PDTrim: a prefix of sinks and a suffix of recent tokens, nothing quantized.
                let kept: Vec<usize> = (0..n).filter(|&i| t[i] == Tier::Fp16).collect();
                assert_eq!(plan.counts()[1] + plan.counts()[2], 0);
                let k = kept.len();
                assert!(
                    kept[4..]
                        .iter()
                        .enumerate()
                        .all(|(j, &i)| i == n - (k - 4) + j)
                );
            }
        }
    }
    // b = 0.5 under KIVI with scales counted is not all INT8 (the scales do not fit).
    let half = allocate::allocate(Policy::Spectrum { int4: true }, &scores, &budget(0.5))?;
    assert!(half.counts()[2] > 0 && half.counts()[1] > 0);
    // Below the protected tokens' cost: an error.
    assert!(allocate::allocate(Policy::PdTrim, &scores, &budget(0.01)).is_err());
    Ok(())
}

/// `snapkv` keeps the most important tokens at FP16 (binary, importance-ranked) and
/// `spectrum-position` tiers by recency; both meet the budget. Controls: `snapkv` keeps a
/// different set than PDTrim on scores that do not rise with position, `spectrum-position`
/// ignores the scores (reversing them leaves its plan unchanged) while `spectrum` does not.
#[test]
fn importance_binary_and_position_tiered_baselines() -> Result<()> {
    let (shape, n, scores) = allocation_fixture();
    let reversed: Vec<f64> = scores.iter().map(|s| -s).collect();
    let budget = |b: f64| Budget {
        b,
        shape,
        quantizer: Quantizer::Kivi,
        protect: Protect::default(),
    };
    for b in [0.2, 0.3, 0.5, 0.8] {
        let snap = allocate::allocate(Policy::SnapKv, &scores, &budget(b))?;
        let pd = allocate::allocate(Policy::PdTrim, &scores, &budget(b))?;
        assert!(budget(b).real_b(&snap) <= b);
        // Same byte budget, same count of FP16 tokens, nothing quantized.
        assert_eq!(snap.counts(), pd.counts(), "b={b}");
        assert_eq!(snap.counts()[1] + snap.counts()[2], 0);
        let t = snap.tiers();
        assert!(t[..4].iter().chain(&t[n - 32..]).all(|&x| x == Tier::Fp16));
        for i in 4..n - 32 {
            for j in 4..n - 32 {
                if t[i] == Tier::Fp16 && t[j] == Tier::Drop {
                    assert!(scores[i] >= scores[j], "b={b}: kept {i} below dropped {j}");
                }
            }
        }
        assert_ne!(
            snap.tiers(),
            pd.tiers(),
            "b={b}: snapkv chose PDTrim's tokens"
        );

        let pos = allocate::allocate(Policy::SpectrumPosition, &scores, &budget(b))?;
        let pos_rev = allocate::allocate(Policy::SpectrumPosition, &reversed, &budget(b))?;
        let tiered = allocate::allocate(Policy::Spectrum { int4: true }, &scores, &budget(b))?;
        let tiered_rev =
            allocate::allocate(Policy::Spectrum { int4: true }, &reversed, &budget(b))?;
        assert!(budget(b).real_b(&pos) <= b);
        assert_eq!(
            pos.tiers(),
            pos_rev.tiers(),
            "b={b}: position tiers read the scores"
        );
        assert_ne!(
            tiered.tiers(),
            tiered_rev.tiers(),
            "b={b}: spectrum ignores the scores"
        );
        // Later unprotected tokens sit at a tier at least as high as earlier ones.
        let rank = |x: Tier| match x {
            Tier::Fp16 => 3,
            Tier::Int8 => 2,
            Tier::Int4 => 1,
            Tier::Drop => 0,
        };
        let pt = pos.tiers();
        assert!((4..n - 33).all(|i| rank(pt[i]) <= rank(pt[i + 1])), "b={b}");
    }
    for name in ["snapkv", "spectrum-position"] {
        assert_eq!(Policy::parse(name)?.name(), name);
    }
    assert!(allocate::allocate(Policy::SnapKv, &scores, &budget(0.01)).is_err());
    Ok(())
}

#[test]
fn decode_worker_over_loopback_matches_in_process_and_survives_bad_frames() -> Result<()> {
    use kvcredit::spectrum::transport::{self, ServeOptions};
    use std::io::Write;
    use std::net::{Shutdown, TcpListener, TcpStream};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (log_tx, log_rx) = std::sync::mpsc::channel::<String>();
    let worker = std::thread::spawn(move || {
        let m = model("qwen2", Kind::Float);
        let opts = ServeOptions {
            max_frame: 1 << 20,
            max_requests: Some(7),
            read_timeout: std::time::Duration::from_millis(300),
            request_timeout: std::time::Duration::from_secs(30),
            max_connections: 8,
            policy: POLICY,
        };
        transport::serve(&m, &listener, &opts, &mut |l: &str| {
            log_tx.send(l.to_string()).unwrap()
        })
    });
    let m = model("qwen2", Kind::Float);
    let ids = prompt(60, 9);
    let (ctx, last) = ids.split_at(59);
    let cache = prefilled(&m, ctx);
    let tiered = TieredKv::build(&cache, 0, &mixed_plan(59), Quantizer::Kivi)?;
    let frame = wire::encode(&tiered)?;
    let (want, _, _, fp) = transport::decode_greedy(&m, &tiered, last[0], 3, &POLICY)?;
    let connect = || {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
            .unwrap();
        s
    };
    // 1. A good frame, paced at 50 Mbit/s: the worker's tokens and KV are the in-process ones.
    let mut s = connect();
    let r = transport::request(&mut s, &frame, last[0], 3, Some(50.0))?;
    assert_eq!(r.tokens, want);
    assert_eq!(r.fingerprint, fp);
    // The pacing shows: the frame takes at least its size at 50 Mbit/s to send.
    assert!(r.send.as_secs_f64() >= frame.len() as f64 * 8.0 / 50e6 * 0.9);
    // 2. Same connection, a corrupted frame: rejected with one line.
    let mut bad = frame.clone();
    bad[frame.len() / 2] ^= 1;
    let e = transport::request(&mut s, &bad, last[0], 1, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("fingerprint") && !e.contains('\n'), "{e}");
    // 3. An oversized frame is refused from its envelope alone.
    let mut s = connect();
    let mut env = Vec::new();
    env.extend_from_slice(b"SPRQ");
    env.extend_from_slice(&1u16.to_le_bytes());
    env.extend_from_slice(&[0, 0]);
    env.extend_from_slice(&(last[0] as u32).to_le_bytes());
    env.extend_from_slice(&1u32.to_le_bytes());
    env.extend_from_slice(&(1u64 << 40).to_le_bytes());
    s.write_all(&env).unwrap();
    let mut reply = Vec::new();
    std::io::Read::read_to_end(&mut s, &mut reply).unwrap();
    let text = String::from_utf8_lossy(&reply[9..]).to_string();
    assert!(
        reply[4] == 1 && text.contains("exceeds the limit"),
        "{text}"
    );
    // 4. A truncated frame: the peer hangs up half way.
    let mut s = connect();
    let mut half = env.clone();
    half[16..24].copy_from_slice(&(frame.len() as u64).to_le_bytes());
    half.extend_from_slice(&frame[..frame.len() / 2]);
    s.write_all(&half).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let mut reply = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut reply);
    // 5. Not a request at all.
    let mut s = connect();
    s.write_all(&[b'x'; 40]).unwrap();
    let mut reply = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut reply);
    // 6. A stalled client: half an envelope, then silence with the socket open. The worker
    // drops it after its read timeout instead of waiting forever.
    let mut stalled = connect();
    stalled.write_all(&env[..10]).unwrap();
    // 7. The worker still serves, without waiting for the stalled client: the same answer as
    // before.
    let mut s = connect();
    let r = transport::request(&mut s, &frame, last[0], 3, None)?;
    assert_eq!(r.tokens, want);
    // Closed, so that its idle time-out does not race the stalled client's for the last slot.
    drop(s);
    worker.join().unwrap()?;
    drop(stalled);
    let log: Vec<String> = log_rx.try_iter().collect();
    assert_eq!(log.len(), 7, "{log:?}");
    // Connections are read concurrently: 7 and the time-out of 6 come in either order.
    let mut last_two = [&log[5], &log[6]];
    last_two.sort_by_key(|l| !l.starts_with("served"));
    assert!(
        log[0].starts_with("served") && last_two[0].starts_with("served"),
        "{log:?}"
    );
    for (line, what) in [&log[1], &log[2], &log[3], &log[4], last_two[1]]
        .into_iter()
        .zip(["fingerprint", "exceeds", "truncated", "not a", "envelope"])
    {
        assert!(
            line.starts_with("rejected: ") && line.contains(what),
            "{line}"
        );
        assert!(!line.contains('\n'));
    }
    Ok(())
}

#[test]
fn bad_specs_fail_with_one_line_before_anything_runs() {
    let dir = common::scratch("spectrum", "specs");
    let base = "name = \"x\"\nmodel = \"tests/fixtures/hf/qwen2\"\ndtype = \"fp32\"\n";
    let ppl = "[ppl]\ncontext = 128\ncontinuation = 8\nwindows = 1\nquantizers = [\"kivi\"]\n";
    let cases = [
        (
            format!("{base}{ppl}budgets = [0.5]\npolicies = [\"spectrum\"]\nextra = 1\n"),
            "unknown field",
        ),
        (
            format!("{base}{ppl}budgets = [0.0]\npolicies = [\"spectrum\"]\n"),
            "budget 0",
        ),
        (
            format!("{base}{ppl}budgets = [0.5]\npolicies = [\"h2o\"]\n"),
            "unknown policy",
        ),
        (
            format!(
                "{base}[importance]\nkernel = 4\n{ppl}budgets = [0.5]\npolicies = [\"pdtrim\"]\n"
            ),
            "odd",
        ),
        (
            format!(
                "{base}[protect]\nrecent = 200\n{ppl}budgets = [0.5]\npolicies = [\"pdtrim\"]\n"
            ),
            "pinned",
        ),
        (
            format!("{base}{ppl}budgets = [0.5]\npolicies = [\"pdtrim\"]\ntext = \"crlf\"\n"),
            "crlf",
        ),
        (
            format!(
                "{base}{ppl}budgets = [0.5]\npolicies = [\"pdtrim\"]\n[ttft]\ncontext = 64\nlinks_mbps = [-1]\n"
            ),
            "ttft: link -1",
        ),
        (
            format!(
                "{base}{ppl}budgets = [0.5]\npolicies = [\"pdtrim\"]\n[ttft]\ncontext = 64\nrepeats = 0\n"
            ),
            "repeats",
        ),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let spec = dir.join(format!("spec{i}.toml"));
        std::fs::write(&spec, text).unwrap();
        let out = dir.join(format!("out{i}"));
        let (code, _, err) = common::kvcredit(&[
            "spectrum",
            "ppl",
            spec.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 2, "case {i}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "case {i}: {err}");
        assert!(
            err.starts_with("error: spec: spectrum spec") && err.contains(want),
            "case {i}: {err}"
        );
        assert!(!out.exists(), "case {i}: output written");
    }
}

#[test]
fn variants_with_one_plan_are_measured_once_and_sharing_is_exact() -> Result<()> {
    use kvcredit::spectrum::eval::{self, PplOptions, Variant};
    let m = model("qwen2", Kind::Float);
    let ids = prompt(96, 3);
    let v = |policy: &str, b: Option<f64>| Variant {
        policy: Policy::parse(policy).unwrap(),
        quantizer: Quantizer::Kivi,
        b,
    };
    let o = PplOptions {
        context: 64,
        continuation: 16,
        windows: 1,
        variants: vec![
            v("spectrum", Some(2.0)),
            v("spectrum-2tier", Some(2.0)),
            v("uniform-int4", None),
        ],
        importance: ImportanceSpec::default(),
        protect: Protect::default(),
        policy: POLICY,
        text: eval::TextNorm::Lf,
    };
    let rows = eval::perplexity_window(&m, &ids, &o, 0)?;
    assert_eq!(rows[0].shared_with, None);
    assert_eq!(rows[1].shared_with.as_deref(), Some("spectrum/kivi/2"));
    assert_eq!(rows[1].nll.to_bits(), rows[0].nll.to_bits());
    // Negative control: a different plan is measured and differs.
    assert_eq!(rows[2].shared_with, None);
    assert_ne!(rows[2].nll.to_bits(), rows[0].nll.to_bits());
    // The shared row equals measuring that variant alone.
    let alone = PplOptions {
        variants: vec![v("spectrum-2tier", Some(2.0))],
        ..o.clone()
    };
    let r = eval::perplexity_window(&m, &ids, &alone, 0)?;
    assert_eq!(r[0].shared_with, None);
    assert_eq!(r[0].nll.to_bits(), rows[1].nll.to_bits());
    assert_eq!(r[0].bytes, rows[1].bytes);
    Ok(())
}

#[test]
fn report_pairs_every_number_with_an_interval_and_draws_the_figures_it_has_data_for() -> Result<()>
{
    use kvcredit::io::parquet::{Column, Table};
    use kvcredit::spectrum::eval::{NiahRow, PplRow};
    use kvcredit::spectrum::report;
    let root =
        std::env::temp_dir().join(format!("kvcredit-spectrum-report-{}", std::process::id()));
    let run = root.join("spectrum-tiny");
    std::fs::create_dir_all(&run).unwrap();
    let row = |policy: &str, quantizer: &str, window: u32, nll: f64| PplRow {
        policy: policy.into(),
        quantizer: quantizer.into(),
        b: Some(0.5),
        b_real: 0.5,
        bytes: 100,
        window,
        tiers: [1, 1, 1, 0],
        nll,
        nll_base: 10.0,
        tokens: 10,
        kl: 0.0,
        top1_agree: 1.0,
        shared_with: None,
    };
    let mut text = String::from("{\"section\":\"ppl\"}\n");
    for (w, (a, b)) in [(10.0, 12.0), (10.5, 13.0)].into_iter().enumerate() {
        let rows = vec![
            row("spectrum", "kivi", w as u32, a),
            row("pdtrim", "none", w as u32, b),
        ];
        text.push_str(
            &serde_json::json!({"unit": format!("window {w}"), "rows": rows}).to_string(),
        );
        text.push('\n');
    }
    text.push_str("{\"torn");
    std::fs::write(run.join("ppl.rows.jsonl"), text).unwrap();
    let md = report::report(std::slice::from_ref(&run), &root.join("out"))?;
    assert!(root.join("out/report.md").exists());
    // Window 1 of spectrum: exp(0.5 / 10) − 1 = +5.13%; pooled over both: exp(0.5 / 20) − 1.
    assert!((kvcredit::spectrum::eval::window_delta(&row("s", "k", 1, 10.5)) - 5.127).abs() < 1e-3);
    assert!(md.contains("| spectrum kivi b=0.5 | 2 | +2.53 |"), "{md}");
    assert!(md.contains("Tiered (kivi) − PDTrim at b = 0.5, paired over windows"));
    // The seed's PPL claim beside ours, with the paired interval the verdict is read from.
    assert!(md.contains("## Seed claims beside ours"), "{md}");
    assert!(
        md.contains("| PPL Δ% at b = 0.5, tiered +1.97 / −0.06 / −0.44 vs PDTrim +25.85 / +22.07 / +35.63 | ")
            && md.contains(" over 2 windows | "),
        "{md}"
    );
    // PPL rows alone: its figure only.
    let exists = |f: &str| root.join("out").join(f).exists();
    assert!(exists("ppl-delta.png") && exists("ppl-delta.svg"));
    assert!(!exists("niah-depth.png") && !exists("ttft-stages.png"));
    assert!(md.contains("[`ppl-delta.png`](ppl-delta.png)"), "{md}");

    // With NIAH rows, a probe verdict and TTFT rows, every figure and table.
    let niah = |policy: &str, b: Option<f64>, depth: f64, seed: u64, correct: bool| NiahRow {
        policy: policy.into(),
        quantizer: "kivi".into(),
        b,
        b_real: b,
        depth,
        seed,
        prompt_len: 100,
        value: "42".into(),
        answer: if correct { "42" } else { "7" }.into(),
        correct,
        prompt_format: "text".into(),
        shared_with: None,
    };
    let mut text = String::from("{\"section\":\"niah\",\"grid\":{\"depths\":3}}\n");
    for (depth, seed) in [(0.0, 0), (0.5, 0), (0.0, 1)] {
        let rows = vec![
            niah("full", None, depth, seed, true),
            niah("spectrum", Some(0.5), depth, seed, seed == 0),
        ];
        text.push_str(
            &serde_json::json!({"unit": format!("depth {depth} seed {seed}"), "rows": rows})
                .to_string(),
        );
        text.push('\n');
    }
    std::fs::write(run.join("niah.rows.jsonl"), text).unwrap();
    Table::new()
        .with("model", Column::Str(vec!["tiny".into()]))
        .with("quantizer", Column::Str(vec!["kivi".into()]))
        .with("b", Column::F64(vec![0.3]))
        .with("context", Column::U32(vec![64]))
        .with("trials_passed", Column::U32(vec![3]))
        .with("probe_int4", Column::Bool(vec![true]))
        .with("selected_policy", Column::Str(vec!["spectrum".into()]))
        .with("gate_ppl_ratio", Column::F64(vec![1.01]))
        .with("gate_kl", Column::F64(vec![0.004]))
        .with("gate_max_ppl_ratio", Column::F64(vec![1.05]))
        .with("gate_int4", Column::Bool(vec![true]))
        .write(&run.join("probe.parquet"))?;
    // Repeat 0 is the warm-up: the medians are over repeats 1 and 2.
    let ttft = [(1000.0, 900.0), (100.0, 80.0), (120.0, 90.0)];
    let n = 2 * ttft.len();
    let col = |f: &dyn Fn(usize, bool) -> f64| {
        Column::F64((0..n).map(|i| f(i / 2, i % 2 == 0)).collect())
    };
    let mut t = Table::new()
        .with("model", Column::Str(vec!["tiny".into(); n]))
        .with(
            "transfer",
            Column::Str((0..n).map(|i| ["tiered", "fp16"][i % 2].into()).collect()),
        )
        .with("tier_policy", Column::Str(vec!["spectrum".into(); n]))
        .with("quantizer", Column::Str(vec!["kivi".into(); n]))
        .with("b", Column::F64(vec![0.5; n]))
        .with("b_real", col(&|_, tiered| if tiered { 0.5 } else { 1.0 }))
        .with("bytes", Column::I64(vec![1000; n]))
        .with("context", Column::U32(vec![64; n]))
        .with("bandwidth_mbps", Column::OptF64(vec![None; n]))
        .with(
            "repeat",
            Column::U32((0..n).map(|i| (i / 2) as u32).collect()),
        )
        .with("first_token", Column::I64(vec![1; n]));
    for c in [
        "prefill_ms",
        "scoring_ms",
        "pack_ms",
        "send_ms",
        "receive_ms",
        "unpack_ms",
        "first_step_ms",
        "round_trip_ms",
    ] {
        t = t.with(c, col(&|_, _| 10.0));
    }
    t.with(
        "ttft_ms",
        col(&|r, tiered| if tiered { ttft[r].1 } else { ttft[r].0 }),
    )
    .write(&run.join("ttft.parquet"))?;
    let r = report::write_report(std::slice::from_ref(&run), &root.join("out"))?;
    for stem in ["ppl-delta", "niah-depth", "ttft-stages"] {
        for ext in ["png", "svg"] {
            let f = root.join("out").join(format!("{stem}.{ext}"));
            assert!(f.exists() && r.figures.contains(&f), "{}", f.display());
            assert!(std::fs::metadata(&f).unwrap().len() > 1000);
        }
        assert!(
            r.markdown.contains(&format!("[`{stem}.png`]({stem}.png)")),
            "{}",
            r.markdown
        );
    }
    let md = r.markdown;
    assert!(md.contains("kivi → **spectrum** (INT4 on)"), "{md}");
    assert!(md.contains("| fp16 | 2 of 3 |"), "{md}");
    // Stages 10 ms each (send and receive overlap: one of them counts), other = TTFT − 60.
    assert!(
        md.contains("| spectrum kivi b=0.5 | 2 of 3 | 0.5000 | 0.0 | 10.0 | 10.0 | 10.0 | 10.0 | 10.0 | 10.0 | 10.0 | 25.0 | 85.0 | +22.7% |"),
        "{md}"
    );
    assert!(md.contains("| NIAH variant |"));
    // Data gone: its figure goes too.
    std::fs::remove_file(run.join("ttft.parquet")).unwrap();
    report::report(&[run], &root.join("out"))?;
    assert!(!exists("ttft-stages.png") && !exists("ttft-stages.svg"));
    assert!(exists("niah-depth.png"));
    std::fs::remove_dir_all(&root).unwrap();
    Ok(())
}

#[test]
fn wikitext_is_tokenized_with_lf_line_ends_unless_raw_is_asked() -> Result<()> {
    use kvcredit::runtime::{self, Dtype, ModelSource};
    use kvcredit::spectrum::eval::{self, TextNorm, WIKITEXT2_TEST};
    assert!(WIKITEXT2_TEST.contains("\r\n"));
    let lf_text = TextNorm::Lf.apply(WIKITEXT2_TEST);
    assert!(!lf_text.contains('\r') && lf_text.contains('\n'));
    assert_eq!(TextNorm::Raw.apply(WIKITEXT2_TEST), WIKITEXT2_TEST);
    assert_eq!(TextNorm::default(), TextNorm::Lf);
    // A character-level tokenizer: `\r` is `<unk>` (0), `\n` id 96.
    let dir = common::scratch("spectrum", "wikitext-lf");
    let src = ModelSource::HfDir(common::chat_fixture(&dir.join("model"), 4096));
    let model = runtime::load(&src, Dtype::Fp32, Device::Cpu)?;
    let (lf, raw) = (
        eval::wikitext_ids(&model, 3000, TextNorm::Lf)?,
        eval::wikitext_ids(&model, 3000, TextNorm::Raw)?,
    );
    assert_eq!(lf.len(), 3000);
    let nl = 96;
    let crlf = raw.windows(2).filter(|w| w == &[0, nl]).count();
    assert!(crlf >= 3, "raw text has {crlf} CRLF pairs");
    // Negative control: the two streams differ, and only by the `\r` before each `\n`.
    assert_ne!(lf, raw);
    let stripped: Vec<i64> = (0..raw.len())
        .filter(|&i| !(raw[i] == 0 && raw.get(i + 1) == Some(&nl)))
        .map(|i| raw[i])
        .collect();
    assert_eq!(stripped[..], lf[..stripped.len()]);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn ppl_records_its_text_and_refuses_a_grid_of_other_settings() {
    let dir = common::scratch("spectrum", "ppl-text");
    let model = common::chat_fixture(&dir.join("model"), 4096);
    let spec = |text: &str| {
        let p = dir.join(format!("spec-{text}.toml"));
        std::fs::write(
            &p,
            format!(
                "name = \"t\"\nmodel = \"{}\"\ndtype = \"fp32\"\n[protect]\nsinks = 2\nrecent = 8\n[ppl]\ncontext = 64\ncontinuation = 8\nwindows = 1\nbudgets = [0.5]\npolicies = [\"pdtrim\", \"uniform-int8\"]\nquantizers = [\"lab-compat\"]\n{text}",
                model.display()
            ),
        )
        .unwrap();
        p
    };
    let run = |spec: &Path, out: &Path| {
        common::kvcredit(&[
            "spectrum",
            "ppl",
            spec.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--quiet",
        ])
    };
    let nll_base = |out: &Path| {
        let b = common::read_batch(&out.join("ppl.parquet"));
        let text = common::column::<arrow_array::StringArray>(&b, "text");
        let nll = common::column::<arrow_array::Float64Array>(&b, "nll_base");
        (text.value(0).to_string(), nll.value(0))
    };
    let (lf, raw) = (dir.join("lf"), dir.join("raw"));
    let (code, _, err) = run(&spec(""), &lf);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run(&spec("text = \"raw\"\n"), &raw);
    assert_eq!(code, 0, "{err}");
    let ((t_lf, base_lf), (t_raw, base_raw)) = (nll_base(&lf), nll_base(&raw));
    assert_eq!((t_lf.as_str(), t_raw.as_str()), ("lf", "raw"));
    // The first window's text holds a line end: the uncompressed NLLs differ.
    assert_ne!(base_lf.to_bits(), base_raw.to_bits());
    // The grid's manifest records the text and the protocol.
    let manifest = lf.join("ppl.manifest.json");
    let written = std::fs::read_to_string(&manifest).unwrap();
    let m: serde_json::Value = serde_json::from_str(&written).unwrap();
    assert_eq!(m["text"], "lf", "{written}");
    assert_eq!(
        m["protocol"],
        kvcredit::spectrum::eval::PROTOCOL,
        "{written}"
    );
    // A manifest of another protocol, or one without it (written before it existed), or of
    // another text is refused in one line, and left as it was.
    let set = |key: &str, value: Option<serde_json::Value>| {
        let mut old = m.clone();
        let fields = old.as_object_mut().unwrap();
        match value {
            Some(v) => fields.insert(key.to_string(), v),
            None => fields.remove(key),
        };
        old
    };
    let edits = [
        ("protocol", set("protocol", Some(1.into()))),
        ("protocol", set("protocol", None)),
        ("text", set("text", Some("raw".into()))),
    ];
    for (what, old) in edits {
        let old = serde_json::to_string_pretty(&old).unwrap();
        std::fs::write(&manifest, &old).unwrap();
        let (code, _, err) = run(&spec(""), &lf);
        assert_ne!(code, 0, "{what}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(what) && err.contains("(ppl)"), "{err}");
        assert_eq!(std::fs::read_to_string(&manifest).unwrap(), old);
    }
    // Negative control: the manifest as written resumes.
    std::fs::write(&manifest, &written).unwrap();
    let (code, _, err) = run(&spec(""), &lf);
    assert_eq!(code, 0, "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A journal of `rows` per unit after `header`.
fn write_journal<R: serde::Serialize>(path: &Path, header: &str, units: Vec<(String, Vec<R>)>) {
    let mut text = format!("{header}\n");
    for (unit, rows) in units {
        text.push_str(&serde_json::json!({"unit": unit, "rows": rows}).to_string());
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

#[test]
fn report_pairs_policies_per_window_with_holm_and_power() -> Result<()> {
    use kvcredit::spectrum::compare;
    use kvcredit::spectrum::eval::{NiahRow, PplRow};
    use kvcredit::spectrum::report;
    let dir = common::scratch("spectrum", "report-paired");
    let run = dir.join("spectrum-tiny");
    std::fs::create_dir_all(&run).unwrap();
    let row = |policy: &str, quantizer: &str, b: Option<f64>, window: u32, nll: f64| PplRow {
        policy: policy.into(),
        quantizer: quantizer.into(),
        b,
        b_real: 0.5,
        bytes: 100,
        window,
        tiers: [1, 1, 1, 0],
        nll,
        nll_base: 10.0,
        tokens: 10,
        kl: 0.0,
        top1_agree: 1.0,
        shared_with: None,
    };
    let windows = 12u32;
    let units: Vec<(String, Vec<PplRow>)> = (0..windows)
        .map(|w| {
            let noise = 0.01 * f64::from(w % 4);
            let spectrum = 10.2 + noise;
            let rows = vec![
                row("spectrum", "kivi", Some(0.5), w, spectrum),
                // Same rows: identical on every window.
                row("spectrum-position", "kivi", Some(0.5), w, spectrum),
                // ± 0.002 around the tiered policy: no difference to find.
                row(
                    "snapkv",
                    "none",
                    Some(0.5),
                    w,
                    spectrum + if w % 2 == 0 { 0.002 } else { -0.002 },
                ),
                // Far worse on every window.
                row("pdtrim", "none", Some(0.5), w, 13.0 + noise),
                row("uniform-int8", "kivi", None, w, 10.05 + 0.5 * noise),
            ];
            (format!("window {w}"), rows)
        })
        .collect();
    let header = serde_json::json!({"section": "ppl", "model": "tiny",
        "grid": {"context": 64, "continuation": 8, "windows": windows, "text": "lf"}});
    write_journal(&run.join("ppl.rows.jsonl"), &header.to_string(), units);
    let niah = |policy: &str, depth: f64, seed: u64, correct: bool| NiahRow {
        policy: policy.into(),
        quantizer: if policy == "spectrum" { "kivi" } else { "none" }.into(),
        b: (policy != "full").then_some(0.5),
        b_real: (policy != "full").then_some(0.5),
        depth,
        seed,
        prompt_len: 100,
        value: "42".into(),
        answer: String::new(),
        correct,
        prompt_format: "text".into(),
        shared_with: None,
    };
    let mut units = Vec::new();
    for seed in 0..3u64 {
        for d in 0..10 {
            let depth = f64::from(d) / 9.0;
            let rows = vec![
                niah("full", depth, seed, true),
                niah("spectrum", depth, seed, true),
                niah("snapkv", depth, seed, true),
                niah("pdtrim", depth, seed, false),
            ];
            units.push((format!("depth {depth} seed {seed}"), rows));
        }
    }
    let header = r#"{"section":"niah","grid":{"depths":10}}"#;
    write_journal(&run.join("niah.rows.jsonl"), header, units);
    let md = report::report(std::slice::from_ref(&run), &dir.join("out"))?;
    // The protocol, from the journal's settings.
    assert!(
        md.contains("text `lf` (CRLF line ends → LF before tokenization)")
            && md.contains("The first n − 1 = 63 context tokens are compressed")
            && md.contains("the first included, is scored against the compressed cache"),
        "{md}"
    );
    let line = |prefix: &str| -> String {
        md.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no row `{prefix}`:\n{md}"))
            .to_string()
    };
    let r = line("| 0.5 | spectrum kivi | pdtrim none | 12 |");
    assert!(r.ends_with("| spectrum lower Δ% (Holm p < 0.05) |"), "{r}");
    let r = line("| 0.5 | spectrum kivi | snapkv none | 12 |");
    assert!(r.ends_with("| not distinguishable at 12 windows |"), "{r}");
    let r = line("| 0.5 | spectrum kivi | spectrum-position kivi | 12 |");
    assert!(r.ends_with("| identical on all 12 windows |"), "{r}");
    let r = line("| 0.5 | snapkv none | pdtrim none | 12 |");
    assert!(r.ends_with("| snapkv lower Δ% (Holm p < 0.05) |"), "{r}");
    line("| 0.5 | spectrum kivi | uniform-int8 kivi | 12 |");
    line("| 0.5 | pdtrim none | uniform-int8 kivi | 12 |");
    assert!(md.contains("Power: the median MDE is "), "{md}");
    // Holm never lowers a p-value; the pairs' windows are the shared ones.
    let rows: Vec<PplRow> = report::read_journal(&run.join("ppl.rows.jsonl"))?;
    let keys: Vec<compare::Key> = rows
        .iter()
        .take(5)
        .map(|r| (r.policy.clone(), r.quantizer.clone(), r.b))
        .collect();
    let diffs = compare::ppl_diffs(&rows, &keys)?;
    assert!(diffs.len() >= 8);
    for d in &diffs {
        if let (Some(p), Some(h)) = (d.p, d.p_holm) {
            assert!(h >= p, "{d:?}");
        }
    }
    // Negative control: without the shared windows there is no pair.
    let early: Vec<PplRow> = rows
        .iter()
        .filter(|r| r.policy != "pdtrim" || r.window >= 100)
        .cloned()
        .collect();
    let none = compare::ppl_diffs(&early, &keys)?;
    assert!(none.iter().all(|d| d.r.0 != "pdtrim" && d.a.0 != "pdtrim"));
    // NIAH: 30 haystacks over 3 seeds, paired by haystack.
    let r = line("| 0.5 | spectrum kivi | pdtrim none | 30 (3) | 30 / 0 | 30 / 0 |");
    assert!(
        r.ends_with("| spectrum more accurate (Holm p < 0.05) |"),
        "{r}"
    );
    let r = line("| 0.5 | spectrum kivi | snapkv none | 30 (3) |");
    assert!(
        r.ends_with("| not distinguishable at 30 haystacks |"),
        "{r}"
    );
    // A journal without the text setting says so.
    let text = std::fs::read_to_string(run.join("ppl.rows.jsonl")).unwrap();
    let old = text.replacen(",\"text\":\"lf\"", "", 1);
    assert_ne!(old, text);
    std::fs::write(run.join("ppl.rows.jsonl"), old).unwrap();
    let md = report::report(&[run], &dir.join("out"))?;
    assert!(md.contains("text not recorded"), "{md}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn report_on_a_tiny_cpu_grid_pairs_the_baselines() {
    let dir = common::scratch("spectrum", "report-grid");
    let model = common::chat_fixture(&dir.join("model"), 4096);
    let spec = dir.join("spec.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"t\"\nmodel = \"{}\"\ndtype = \"fp32\"\n[protect]\nsinks = 2\nrecent = 4\n\
             [ppl]\ncontext = 48\ncontinuation = 8\nwindows = 3\nbudgets = [0.5]\n\
             policies = [\"spectrum\", \"spectrum-position\", \"snapkv\", \"pdtrim\", \"uniform-int8\"]\n\
             quantizers = [\"kivi\"]\n\
             [niah]\ncontext = 150\ndepths = 2\nseeds = 2\nbudgets = [0.5]\n\
             policies = [\"spectrum\", \"snapkv\", \"pdtrim\"]\nquantizers = [\"kivi\"]\nmax_new_tokens = 3\n",
            model.display()
        ),
    )
    .unwrap();
    let run = dir.join("run");
    for section in ["ppl", "niah"] {
        let (code, _, err) = common::kvcredit(&[
            "spectrum",
            section,
            spec.to_str().unwrap(),
            "--out",
            run.to_str().unwrap(),
            "--quiet",
        ]);
        assert_eq!(code, 0, "{section}: {err}");
    }
    let out = dir.join("report");
    let (code, _, err) = common::kvcredit(&[
        "spectrum",
        "report",
        run.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    for prefix in [
        "| 0.5 | spectrum kivi | pdtrim none | 3 |",
        "| 0.5 | spectrum kivi | snapkv none | 3 |",
        "| 0.5 | spectrum kivi | spectrum-position kivi | 3 |",
        "| 0.5 | snapkv none | pdtrim none | 3 |",
        "| 0.5 | spectrum kivi | uniform-int8 kivi | 3 |",
        "| 0.5 | spectrum kivi | pdtrim none | 4 (2) |",
        "| 0.5 | snapkv none | pdtrim none | 4 (2) |",
    ] {
        assert!(
            md.lines().any(|l| l.starts_with(prefix)),
            "no row `{prefix}`:\n{md}"
        );
    }
    assert!(
        md.contains("Perplexity protocol: WikiText-2 test text `lf`"),
        "{md}"
    );
    // The merged tables without the shards the report reads: refused, not an empty report.
    std::fs::remove_dir_all(run.join("shards").join("niah")).unwrap();
    let (code, _, err) = common::kvcredit(&[
        "spectrum",
        "report",
        run.to_str().unwrap(),
        "--out",
        dir.join("report-2").to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("niah.manifest.json but no shards/niah/") && err.trim().lines().count() == 1,
        "{err}"
    );
    assert!(!dir.join("report-2").join("report.md").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Lines a child process writes to stderr, collected on a thread.
fn stderr_lines(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    use std::io::BufRead;
    let err = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(err).lines().map_while(|l| l.ok()) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

#[test]
fn ttft_grid_over_a_real_decode_worker_resumes_per_repeat() {
    let dir = common::scratch("spectrum", "ttft-grid");
    let model = common::chat_fixture(&dir.join("model"), 4096);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut worker = std::process::Command::new(env!("CARGO_BIN_EXE_kvcredit"))
        .args(["spectrum", "serve", "--model", model.to_str().unwrap()])
        .args(["--bind", &addr])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let log = stderr_lines(&mut worker);
    let ready = log
        .recv_timeout(std::time::Duration::from_secs(120))
        .unwrap();
    assert!(ready.starts_with("spectrum decode worker"), "{ready}");
    let body = "[protect]\nsinks = 2\nrecent = 4\n\
                [ttft]\ncontext = 48\nb = 0.5\nlinks_mbps = [0, 200]\nrepeats = 2\n";
    let spec = dir.join("spec.toml");
    let model_line = format!(
        "name = \"t\"\nmodel = \"{}\"\ndtype = \"fp32\"\n",
        model.display()
    );
    std::fs::write(&spec, format!("{model_line}{body}")).unwrap();
    let run = dir.join("run");
    let send = |spec: &Path| {
        common::kvcredit(&[
            "spectrum",
            "send",
            spec.to_str().unwrap(),
            "--connect",
            &addr,
            "--out",
            run.to_str().unwrap(),
            "--quiet",
        ])
    };
    let served = || log.try_iter().filter(|l| l.starts_with("served")).count();
    let rows = || ttft_transfers(&run.join("ttft.parquet"));
    // Two links × two repeats × (tiered, fp16): eight requests, eight rows, and the worker's
    // first tokens are the in-process ones (send checks each).
    let (code, out, err) = send(&spec);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("outputs are in"), "{out}");
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(served(), 8);
    let (n, transfers) = rows();
    assert_eq!(n, 8);
    assert_eq!(transfers, ["fp16", "tiered"]);
    let manifest = std::fs::read_to_string(run.join("ttft.manifest.json")).unwrap();
    assert!(manifest.contains("\"units_done\": 4"), "{manifest}");
    // A rerun of the finished grid measures nothing and leaves the table as it was.
    let before = std::fs::read(run.join("ttft.parquet")).unwrap();
    let (code, _, err) = send(&spec);
    assert_eq!(code, 0, "{err}");
    assert_eq!(served(), 0);
    assert_eq!(std::fs::read(run.join("ttft.parquet")).unwrap(), before);
    // One repeat lost (an interrupted run): only its two transfers are measured again.
    let shard = run.join("shards/ttft/link-001-repeat-00001");
    std::fs::remove_dir_all(&shard).unwrap();
    let (code, _, err) = send(&spec);
    assert_eq!(code, 0, "{err}");
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(served(), 2);
    assert_eq!(rows().0, 8);
    assert!(shard.join("shard.json").exists());
    // Negative control: another spec in the same folder is refused in one line.
    let other = dir.join("other.toml");
    std::fs::write(
        &other,
        format!("{model_line}{}", body.replace("= 2\n", "= 3\n")),
    )
    .unwrap();
    let (code, _, err) = send(&other);
    assert_ne!(code, 0);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("different spec"), "{err}");
    assert_eq!(served(), 0);
    worker.kill().unwrap();
    let _ = worker.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Row count and distinct `transfer` values (sorted) of a ttft table.
fn ttft_transfers(path: &Path) -> (usize, Vec<String>) {
    let mut all = Vec::new();
    for b in kvcredit::io::parquet::read_batches(path).unwrap() {
        let col: arrow_array::StringArray = common::column(&b, "transfer");
        all.extend(col.iter().map(|v| v.unwrap().to_string()));
    }
    let mut kinds = all.clone();
    kinds.sort();
    kinds.dedup();
    (all.len(), kinds)
}

#[test]
fn a_cpu_grid_records_its_thread_count_and_resumes_only_with_it() {
    let dir = common::scratch("spectrum", "threads");
    let model = common::chat_fixture(&dir.join("model"), 4096);
    let spec = dir.join("spec.toml");
    std::fs::write(
        &spec,
        format!(
            "name = \"t\"\nmodel = \"{}\"\ndtype = \"fp32\"\n[protect]\nsinks = 2\nrecent = 8\n\
             [ppl]\ncontext = 64\ncontinuation = 8\nwindows = 2\nbudgets = [0.5]\n\
             policies = [\"pdtrim\"]\nquantizers = [\"kivi\"]\n",
            model.display()
        ),
    )
    .unwrap();
    let out = dir.join("run");
    let run = |threads: &str| {
        common::kvcredit(&[
            "spectrum",
            "ppl",
            spec.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--quiet",
            "--threads",
            threads,
        ])
    };
    let (code, _, err) = run("1");
    assert_eq!(code, 0, "{err}");
    let manifest = out.join("ppl.manifest.json");
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    assert_eq!(m["cpu_threads"], 1, "{m}");
    // One window lost, then a resume with another thread count: refused in one line, naming
    // the count to pass, before anything is measured.
    let shard = out.join("shards/ppl/window-00001");
    std::fs::remove_dir_all(&shard).unwrap();
    let (code, _, err) = run("2");
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("--threads 1"), "{err}");
    assert!(!shard.exists());
    // The same count resumes.
    let (code, _, err) = run("1");
    assert_eq!(code, 0, "{err}");
    assert!(shard.join("shard.json").exists());
    // Out of range is a usage error.
    let (code, _, _) = run("0");
    assert_ne!(code, 0);
    let _ = std::fs::remove_dir_all(&dir);
}
