//! System B on the CPU fixtures: forward hooks (recording and patching the residual stream),
//! KV transplantation between caches, and cache-ON vs cache-OFF in lockstep — bitwise equal
//! under the batch-invariant policy (with a stock negative control that must differ), within
//! 1e-4 and without flips in fp32 under the stock policy.
mod common;

use common::*;
use kvcredit::divergence::lockstep::{self, Mode, PairOutcome, Settings};
use kvcredit::kv_cache::{KvParts, KvSelect, Transplant};
use kvcredit::model::hooks::{Patch, Recorder};
use kvcredit::sampling::{NoiseKey, Sampling};
use kvcredit::{Decoder, ExecPolicy, KvCache, LogitsAt, Result};
use tch::{Kind, Tensor};

/// Fixture architectures: LLaMA, Qwen2 (biases), Gemma-2 (soft-caps, alternating windows),
/// Mistral (sliding window), Qwen3 and Gemma-3 (q/k norms, head dim 32, local/global RoPE).
const FIXTURES: &[&str] = &["llama", "qwen2", "gemma2", "mistral_sw", "qwen3", "gemma3"];

/// A one-element list of layer ranges.
fn one(r: std::ops::Range<usize>) -> Vec<std::ops::Range<usize>> {
    vec![r]
}

fn model(name: &str, kind: Kind) -> Result<Decoder> {
    load(&hf_fixtures().join(name), kind)
}

/// Seeded token ids in `0..vocab`.
fn random_ids(len: usize, seed: i64, vocab: i64) -> Vec<i64> {
    tch::manual_seed(seed);
    ids(&Tensor::randint(
        vocab,
        [1, len as i64],
        (Kind::Int64, tch::Device::Cpu),
    ))
}

fn prefill(
    m: &Decoder,
    ids_: &[i64],
    hook: Option<&mut dyn kvcredit::model::hooks::ForwardHook>,
) -> Result<(Tensor, KvCache)> {
    let mut cache = m.new_cache(1, ids_.len() as i64 + 4)?;
    let t = Tensor::from_slice(ids_).view([1, -1]);
    let logits = match hook {
        Some(h) => m.forward_with(&t, &mut cache, &ExecPolicy::Stock, &LogitsAt::All, h)?,
        None => m.forward(&t, &mut cache, &ExecPolicy::Stock, &LogitsAt::All)?,
    };
    Ok((logits, cache))
}

#[test]
fn patching_a_layer_with_its_own_activations_changes_nothing_bitwise() -> Result<()> {
    for name in FIXTURES {
        let m = model(name, Kind::Float)?;
        let layers = m.config().num_layers();
        let ids_ = random_ids(10, 5, m.config().vocab_size as i64);
        let pos = 7;
        let (plain, plain_cache) = prefill(&m, &ids_, None)?;
        let mut rec = Recorder::new(vec![pos], true);
        let (recorded, rec_cache) = prefill(&m, &ids_, Some(&mut rec))?;
        assert!(
            recorded.equal(&plain),
            "{name}: recording changed the logits"
        );
        assert_eq!(rec.residual.len(), layers);
        assert_eq!((rec.attn_out.len(), rec.mlp_out.len()), (layers, layers));
        let fp = plain_cache.fingerprint(plain_cache.snapshot(0))?;
        assert_eq!(rec_cache.fingerprint(rec_cache.snapshot(0))?, fp);
        let own = rec.stacked()?;
        let mut sets: Vec<std::ops::Range<usize>> = (0..layers).map(|l| l..l + 1).collect();
        sets.push(0..layers);
        for set in sets {
            let mut patch = Patch::new(vec![pos], vec![set.clone()], own.shallow_clone())?;
            let (patched, cache) = prefill(&m, &ids_, Some(&mut patch))?;
            assert!(
                patched.equal(&plain),
                "{name}: self-patch of layers {set:?} changed logits"
            );
            assert_eq!(
                cache.fingerprint(cache.snapshot(0))?,
                fp,
                "{name} {set:?}: KV changed"
            );
        }
        // Negative control: a patch with other values changes the logits from `pos` on only.
        let mut patch = Patch::new(vec![pos], one(0..1), &own + 1e-2)?;
        let (patched, _) = prefill(&m, &ids_, Some(&mut patch))?;
        assert!(
            patched.narrow(1, 0, pos).equal(&plain.narrow(1, 0, pos)),
            "{name}: earlier positions moved"
        );
        assert!(
            !patched.narrow(1, pos, 1).equal(&plain.narrow(1, pos, 1)),
            "{name}: a real patch had no effect"
        );
    }
    Ok(())
}

#[test]
fn patch_rejects_out_of_range_layers_and_positions() -> Result<()> {
    let m = model("llama", Kind::Float)?;
    let values = Tensor::zeros([2, 1, 64], (Kind::Float, tch::Device::Cpu));
    let err = Patch::new(vec![0], one(0..3), values.shallow_clone())
        .err()
        .expect("range 0..3 of 2 layers");
    assert!(
        err.to_string().contains("out of bounds") && !err.to_string().contains('\n'),
        "{err}"
    );
    let mut patch = Patch::new(vec![40], one(0..1), values)?;
    let mut cache = m.new_cache(1, 8)?;
    let t = Tensor::from_slice(&[1i64, 2, 3]).view([1, -1]);
    let err = m
        .forward_with(
            &t,
            &mut cache,
            &ExecPolicy::Stock,
            &LogitsAt::Last,
            &mut patch,
        )
        .expect_err("position 40 of 3");
    assert!(err.to_string().contains("position 40"), "{err}");
    Ok(())
}

fn all_positions(len: i64, layers: usize, parts: KvParts) -> KvSelect {
    KvSelect {
        layers: 0..layers,
        positions: 0..len,
        parts,
    }
}

#[test]
fn transplant_round_trip_restores_the_fingerprint() -> Result<()> {
    for name in FIXTURES {
        let m = model(name, Kind::Float)?;
        let (layers, vocab) = (m.config().num_layers(), m.config().vocab_size as i64);
        let (_, a) = prefill(&m, &random_ids(9, 1, vocab), None)?;
        let (_, b) = prefill(&m, &random_ids(9, 2, vocab), None)?;
        let (sa, sb) = (a.snapshot(0), b.snapshot(0));
        let (fa, fb) = (a.fingerprint(sa)?, b.fingerprint(sb)?);
        for parts in [KvParts::K, KvParts::V, KvParts::Kv] {
            for select in [
                all_positions(9, layers, parts),
                KvSelect {
                    layers: layers - 1..layers,
                    positions: 3..7,
                    parts,
                },
            ] {
                let x = KvCache::transplant(
                    &[Transplant {
                        base: (&a, sa),
                        donor: (&b, sb),
                        select: select.clone(),
                    }],
                    2,
                )?;
                let fx = x.fingerprint(x.snapshot(0))?;
                assert_ne!(fx, fa, "{name} {select:?}: the transplant changed nothing");
                let y = KvCache::transplant(
                    &[Transplant {
                        base: (&x, x.snapshot(0)),
                        donor: (&a, sa),
                        select: select.clone(),
                    }],
                    0,
                )?;
                assert_eq!(
                    y.fingerprint(y.snapshot(0))?,
                    fa,
                    "{name} {select:?}: round trip"
                );
            }
        }
        let whole = KvCache::transplant(
            &[Transplant {
                base: (&a, sa),
                donor: (&b, sb),
                select: all_positions(9, layers, KvParts::Kv),
            }],
            0,
        )?;
        assert_eq!(
            whole.fingerprint(whole.snapshot(0))?,
            fb,
            "{name}: all of K and V is the donor"
        );
        assert_eq!(
            (a.fingerprint(sa)?, b.fingerprint(sb)?),
            (fa, fb),
            "{name}: sources changed"
        );
    }
    Ok(())
}

#[test]
fn transplant_between_models_or_lengths_is_a_one_line_error() -> Result<()> {
    let llama = model("llama", Kind::Float)?;
    let gemma = model("gemma3", Kind::Float)?;
    let (_, a) = prefill(&llama, &[1, 2, 3, 4, 5], None)?;
    let (_, short) = prefill(&llama, &[1, 2, 3], None)?;
    let (_, g) = prefill(&gemma, &[1, 2, 3, 4, 5], None)?;
    let sel = all_positions(5, 2, KvParts::Kv);
    let cases: [(Transplant, &str); 4] = [
        (
            Transplant {
                base: (&a, a.snapshot(0)),
                donor: (&g, g.snapshot(0)),
                select: sel.clone(),
            },
            "not of the base's model",
        ),
        (
            Transplant {
                base: (&a, a.snapshot(0)),
                donor: (&short, short.snapshot(0)),
                select: sel.clone(),
            },
            "does not match a base of length 5",
        ),
        (
            Transplant {
                base: (&a, a.snapshot(0)),
                donor: (&a, a.snapshot(0)),
                select: KvSelect {
                    layers: 0..3,
                    ..sel.clone()
                },
            },
            "layers 0..3 out of bounds",
        ),
        (
            Transplant {
                base: (&a, a.snapshot(0)),
                donor: (&a, a.snapshot(0)),
                select: KvSelect {
                    positions: 2..6,
                    ..sel.clone()
                },
            },
            "positions 2..6 out of bounds",
        ),
    ];
    for (t, needle) in cases {
        let err = KvCache::transplant(&[t], 0)
            .err()
            .expect("must fail")
            .to_string();
        assert!(
            err.contains(needle) && !err.contains('\n'),
            "`{needle}` not in one line: {err}"
        );
    }
    Ok(())
}

fn lockstep_pairs(
    m: &Decoder,
    policy: ExecPolicy,
    sampling: Sampling,
    mode: Mode,
) -> Result<Vec<PairOutcome>> {
    let vocab = m.config().vocab_size as i64;
    // Ragged prompts, decoded together.
    let prompts: Vec<Vec<i64>> = [5, 9, 7]
        .iter()
        .enumerate()
        .map(|(i, &n)| random_ids(n, 10 + i as i64, vocab))
        .collect();
    let keys: Vec<NoiseKey> = (0..prompts.len())
        .map(|i| NoiseKey::divergence(3, i as u64, 0))
        .collect();
    let s = Settings {
        model: m,
        policy,
        sampling,
        max_new_tokens: 12,
        stop_tokens: &[],
        text_stop: None,
    };
    lockstep::run(&s, &prompts, &keys, mode)
}

/// Largest |Δlogit| and number of flips over all compared steps, and whether any pair diverged.
fn summary(pairs: &[PairOutcome]) -> (f64, usize, bool) {
    let steps = pairs.iter().flat_map(|p| &p.compare);
    let max = steps.clone().map(|s| s.max_abs).fold(0.0, f64::max);
    let flips = steps.filter(|s| s.argmax_on != s.argmax_off).count();
    (
        max,
        flips,
        pairs.iter().any(|p| p.first_divergence().is_some()),
    )
}

#[test]
fn cache_on_equals_cache_off_bitwise_under_batch_invariant_and_stock_differs() -> Result<()> {
    let temp = Sampling::Temperature { temperature: 1.0 };
    let mut stock_max = 0.0f64;
    for name in FIXTURES {
        for kind in [Kind::Float, Kind::BFloat16] {
            let m = model(name, kind)?;
            for sampling in [Sampling::Greedy, temp] {
                let pairs = lockstep_pairs(
                    &m,
                    ExecPolicy::BatchInvariant(kvcredit::exec::BiTiles::CPU),
                    sampling,
                    Mode::Free,
                )?;
                let (max, flips, diverged) = summary(&pairs);
                assert_eq!(
                    (max, flips, diverged),
                    (0.0, 0, false),
                    "{name} {kind:?} {sampling:?}"
                );
                assert!(pairs.iter().all(|p| p.compare.len() == 12));
            }
            let forced = lockstep_pairs(
                &m,
                ExecPolicy::BatchInvariant(kvcredit::exec::BiTiles::CPU),
                Sampling::Greedy,
                Mode::Forced { drift: true },
            )?;
            for d in forced.iter().flat_map(|p| &p.drift) {
                assert_eq!(
                    [d.resid_max_abs, d.k_max_abs, d.v_max_abs],
                    [0.0; 3],
                    "{name} {kind:?} drift {d:?}"
                );
            }
            let stock = lockstep_pairs(
                &m,
                ExecPolicy::Stock,
                Sampling::Greedy,
                Mode::Forced { drift: false },
            )?;
            let (max, _, _) = summary(&stock);
            println!("{name} {kind:?}: stock max |Δlogit| ON vs OFF = {max:.3e}");
            stock_max = stock_max.max(max);
        }
    }
    // Negative control: the same harness under the stock policy sees cache-ON ≠ cache-OFF.
    assert!(
        stock_max > 0.0,
        "stock cache-ON and cache-OFF were bitwise equal everywhere"
    );
    Ok(())
}

#[test]
fn fp32_cache_on_and_off_agree_within_1e_4_without_flips() -> Result<()> {
    for name in FIXTURES {
        let m = model(name, Kind::Float)?;
        let forced = lockstep_pairs(
            &m,
            ExecPolicy::Stock,
            Sampling::Greedy,
            Mode::Forced { drift: true },
        )?;
        let (max, flips, _) = summary(&forced);
        println!("{name}: fp32 stock teacher-forced max |Δlogit| = {max:.3e}, flips {flips}");
        assert!(
            max < 1e-4 && flips == 0,
            "{name}: max {max:e}, {flips} flips"
        );
        assert!(
            forced
                .iter()
                .all(|p| p.compare.len() == 12 && p.drift.len() == 12 * m.config().num_layers())
        );
        let free = lockstep_pairs(&m, ExecPolicy::Stock, Sampling::Greedy, Mode::Free)?;
        assert!(!summary(&free).2, "{name}: fp32 greedy pair diverged");
    }
    Ok(())
}

const SPEC_HEAD: &str = r#"name = "bad"
model = "MODEL"
dtypes = ["fp32"]
seed = 1
batch_size = 2
max_new_tokens = 4
[problems]
count = 1
format = "zero-shot-chat"
"#;

/// `kvcredit divergence run SPEC --out OUT --quiet`.
fn run_study(spec: &std::path::Path, out: &std::path::Path) -> (i32, String, String) {
    kvcredit(&[
        "divergence",
        "run",
        spec.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ])
}

/// Write a spec (SPEC_HEAD with the fixture model + `rest`), run it, and require a one-line
/// error containing `needle` and no output folder.
fn assert_bad_spec(name: &str, rest: &str, needle: &str) {
    let dir = scratch("divergence", name);
    let spec = dir.join("spec.toml");
    let model = hf_fixtures().join("llama");
    let text = SPEC_HEAD.replace("MODEL", &model.display().to_string()) + rest;
    std::fs::write(&spec, text).unwrap();
    let out = dir.join("out");
    let (code, _, err) = run_study(&spec, &out);
    assert_ne!(code, 0, "{name}: expected failure");
    assert_eq!(
        err.trim().lines().count(),
        1,
        "{name}: one line expected: {err}"
    );
    assert!(
        err.starts_with("error: ") && err.contains(needle),
        "{name}: `{needle}` not in: {err}"
    );
    assert!(!out.exists(), "{name}: wrote {}", out.display());
}

#[test]
fn bad_divergence_specs_are_one_line_errors_and_write_nothing() {
    assert_bad_spec(
        "unknown-strategy",
        "[[strategies]]\nkind = \"beam\"\n",
        "unknown variant `beam`",
    );
    assert_bad_spec(
        "layer-range",
        "[[strategies]]\nkind = \"greedy\"\n[steps.patch]\nlayers = [\"0..5\"]\ntrajectory_tokens = 2\n",
        "range 0..5 out of bounds for a model of 2 layers",
    );
    assert_bad_spec(
        "layer-syntax",
        "[[strategies]]\nkind = \"greedy\"\n[steps.patch]\nlayers = [\"3..1\"]\ntrajectory_tokens = 2\n",
        "`3..1` is not",
    );
    assert_bad_spec(
        "top-p",
        "[[strategies]]\nkind = \"top_p\"\ntop_p = 1.5\ntemperature = 1.0\n",
        "top_p in (0, 1]",
    );
    assert_bad_spec(
        "sampled-tokens",
        "[[strategies]]\nkind = \"greedy\"\n[steps]\nsampled_max_new_tokens = 9\n",
        "steps.sampled_max_new_tokens must be in 1..=4 (got 9)",
    );
    assert_bad_spec(
        "patch-problems",
        "[[strategies]]\nkind = \"greedy\"\n[steps.patch]\nlayers = [\"all\"]\ntrajectory_tokens = 2\nmax_problems = 0\n",
        "steps.patch.max_problems must be in 1..=",
    );
}

#[test]
fn merging_shards_that_are_all_empty_keeps_the_schema() -> Result<()> {
    use kvcredit::io::parquet::{Column, Table, concat_files, read_batches};
    let dir = scratch("divergence", "empty-merge");
    let empty = Table::new()
        .with("x", Column::I64(vec![]))
        .with("y", Column::Str(vec![]));
    let files: Vec<_> = (0..2).map(|i| dir.join(format!("{i}.parquet"))).collect();
    for f in &files {
        empty.write(f)?;
    }
    concat_files(&files, &dir.join("all.parquet"))?;
    let batches = read_batches(&dir.join("all.parquet"))?;
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows, 0);
    let schema = arrow_array::RecordBatchReader::schema(
        &parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(
            std::fs::File::open(dir.join("all.parquet")).unwrap(),
        )
        .unwrap()
        .build()
        .unwrap(),
    );
    assert_eq!(schema.fields().len(), 2);
    Ok(())
}

#[test]
fn patching_every_layer_at_tau_gives_cache_off_logits_and_replay_rows_are_consistent() -> Result<()>
{
    use kvcredit::divergence::spec::LayerSet;
    use kvcredit::divergence::{patch, replay};
    let m = model("qwen2", Kind::Float)?;
    let layers = m.config().num_layers();
    let prompt = random_ids(6, 21, m.config().vocab_size as i64);
    let on: Vec<i64> = random_ids(10, 22, m.config().vocab_size as i64);
    let mut off = on.clone();
    off[5] = (on[5] + 1) % m.config().vocab_size as i64;
    let sets = vec![
        LayerSet {
            label: "0".into(),
            layers: 0..1,
        },
        LayerSet {
            label: "all".into(),
            layers: 0..layers,
        },
    ];
    let r = patch::run(&m, &ExecPolicy::Stock, &prompt, &on, &off, 5, &sets, 3)?;
    assert_eq!(r.rows.len(), 3);
    assert_eq!(r.rows[0].label, "control");
    assert!(r.rows.iter().all(|x| x.continuation.len() == 3));
    // With every layer patched, the current position's final residual is cache-OFF's.
    assert!(
        (r.rows[2].m - r.m_off).abs() < 1e-4,
        "{} vs {}",
        r.rows[2].m,
        r.m_off
    );
    let err =
        patch::run(&m, &ExecPolicy::Stock, &prompt, &on, &off, 0, &sets, 3).expect_err("tau 0");
    assert!(!err.to_string().contains('\n'));

    // Live vs replay under batch_invariant: every construction and transplant is bitwise live.
    let rows = replay::run(
        &m,
        None,
        &ExecPolicy::BatchInvariant(kvcredit::exec::BiTiles::CPU),
        &prompt,
        &on,
        6,
        &[1, 4, 0],
        4,
    )?;
    assert!(
        rows.iter()
            .all(|x| x.replica_equal && x.follows_live && x.follows_replay)
    );
    assert!(
        rows.iter()
            .all(|x| x.k_max_abs.iter().chain(&x.v_max_abs).all(|&d| d == 0.0))
    );
    assert_eq!(
        rows.iter().filter(|x| x.kind == "transplant").count(),
        2 * (replay::transplant_ranges(layers).len() + 2)
    );
    assert!(rows.iter().all(|x| !x.kind.starts_with("fp32")));

    // The fp32 half of the fixed-prefix 2×2 beside a bf16 study: incremental and one-shot fp32
    // states of the same ids, bitwise equal to each other under batch_invariant.
    let m16 = model("qwen2", Kind::BFloat16)?;
    let rows = replay::run(
        &m16,
        Some(&m),
        &ExecPolicy::BatchInvariant(kvcredit::exec::BiTiles::CPU),
        &prompt,
        &on,
        6,
        &[0],
        4,
    )?;
    let fp32: Vec<_> = rows.iter().filter(|x| x.kind.starts_with("fp32")).collect();
    assert_eq!(fp32.len(), 2);
    assert_eq!(
        (fp32[0].kind.as_str(), fp32[1].kind.as_str()),
        ("fp32-live", "fp32-replay")
    );
    for r in &fp32 {
        assert!(r.replica_equal && r.continuation.len() == 4);
        assert!(r.k_max_abs.iter().chain(&r.v_max_abs).all(|&d| d == 0.0));
    }
    assert_eq!(fp32[0].continuation, fp32[1].continuation);
    Ok(())
}

#[test]
fn divergence_report_prints_rates_with_intervals_and_mcnemar() -> Result<()> {
    use kvcredit::io::parquet::{Column, Table};
    let dir = scratch("divergence", "report");
    let run = dir.join("run");
    std::fs::create_dir_all(&run).unwrap();
    // Four fp16 greedy pairs: three diverge (τ = 1, 2, 3); correct ON/OFF: (1,0) (1,0) (0,0) (1,1).
    let on: Vec<Vec<i64>> = vec![vec![1, 2], vec![1, 2, 3], vec![1, 2, 3, 4], vec![5]];
    let off: Vec<Vec<i64>> = vec![vec![1, 9], vec![1, 2, 9], vec![1, 2, 3, 9], vec![5]];
    let s = |v: &str| Column::Str(vec![v.to_string(); 4]);
    Table::new()
        .with("model", s("m"))
        .with("dtype", s("fp16"))
        .with("strategy", s("greedy"))
        .with("problem", Column::U32(vec![0, 1, 2, 3]))
        .with("tokens_on", Column::ListI64(on))
        .with("tokens_off", Column::ListI64(off))
        .with("correct_on", Column::Bool(vec![true, true, false, true]))
        .with("correct_off", Column::Bool(vec![false, false, false, true]))
        .write(&run.join("pairs.parquet"))?;
    // Teacher-forced: fp16 problems 0 and 1 with per-problem means twice fp32's on every metric.
    let s8 = |a: &str, b: &str| Column::Str([a, a, a, a, b, b, b, b].map(String::from).to_vec());
    let f8 = |v: [f64; 8]| Column::F64(v.to_vec());
    Table::new()
        .with("model", s8("m", "m"))
        .with("dtype", s8("fp16", "fp32"))
        .with("problem", Column::U32(vec![0, 0, 1, 1, 0, 0, 1, 1]))
        .with("step", Column::I64(vec![0, 1, 0, 1, 0, 1, 0, 1]))
        .with("max_abs", f8([1.0, 3.0, 4.0, 4.0, 1.0, 1.0, 2.0, 2.0]))
        .with("mse", f8([2.0, 2.0, 8.0, 8.0, 1.0, 1.0, 4.0, 4.0]))
        .with("kl_off_on", f8([1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]))
        .with(
            "flip",
            Column::Bool(vec![true, false, false, false, false, false, false, false]),
        )
        .write(&run.join("forced.parquet"))?;
    // Patches: two reproduced problems; the all-layer patch recovers τ on both, the whole
    // continuation (k = 3) on one.
    let s4 = |v: [&str; 4]| Column::Str(v.map(String::from).to_vec());
    Table::new()
        .with("model", s("m"))
        .with("dtype", s("fp16"))
        .with("label", s4(["control", "all", "control", "all"]))
        .with("layer_start", Column::I64(vec![0, 0, 0, 0]))
        .with("layer_end", Column::I64(vec![0, 2, 0, 2]))
        .with("reproduced", Column::Bool(vec![true; 4]))
        .with("off_prefix", Column::I64(vec![0, 3, 0, 1]))
        .with("continuation", Column::ListI64(vec![vec![1, 2, 3]; 4]))
        .write(&run.join("patches.parquet"))?;
    // Replay: one boundary where the one-shot REPLAY differs from LIVE; the all-layer K+V
    // transplant into LIVE follows its donor (REPLAY).
    Table::new()
        .with("model", s("m"))
        .with("dtype", s("fp16"))
        .with("problem", Column::U32(vec![0; 4]))
        .with("boundary", Column::I64(vec![4; 4]))
        .with("kind", s4(["live", "replay", "replay", "transplant"]))
        .with("chunk", Column::I64(vec![-1, 0, 1, -1]))
        .with("direction", s4(["", "", "", "live<-replay"]))
        .with("parts", s4(["", "", "", "kv"]))
        .with("layer_start", Column::I64(vec![0; 4]))
        .with("layer_end", Column::I64(vec![0, 0, 0, 2]))
        .with("replica_equal", Column::Bool(vec![true; 4]))
        .with("follows_live", Column::Bool(vec![true, false, true, false]))
        .with(
            "follows_replay",
            Column::Bool(vec![true, true, false, true]),
        )
        .write(&run.join("replay.parquet"))?;
    std::fs::write(
        run.join("hf-div.json"),
        r#"{"problems": [0, 1, 2, 3], "runs": [{"dtype": "fp16", "strategy": "greedy", "problems": 4, "diverged": 2, "pairs": []}]}"#,
    )
    .unwrap();
    let (code, _, err) = kvcredit(&["divergence", "analyze", run.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let report = std::fs::read_to_string(run.join("report.md")).unwrap();
    // Wilson 95% for 3/4: [30.1, 95.4]; McNemar exact with b = 2, c = 0: p = 0.5.
    assert!(
        report.contains("| m | greedy | fp16 | 75.0% [30.1, 95.4] (3/4) | 2.0 [1.5, 2.5] (n=3) |"),
        "{report}"
    );
    assert!(report.contains("| 2 / 0 | 0.500 |"), "{report}");
    // Teacher-forced means over problems (0 and 1 weigh the same): max abs Δ = (2 + 4)/2.
    assert!(
        report.contains("| m | fp16 | 2 | 3.000e0 [-9.706e0, 1.571e1] | 5.000e0 [-3.312e1, 4.312e1] | 1.000e0 [1.000e0, 1.000e0] | 25.0% [4.6, 69.9] (1/4) |"),
        "{report}"
    );
    assert!(report.contains("| m | fp32 | 2 |"), "{report}");
    // Every bootstrap draw has the ratio 2; bf16 is absent.
    assert!(
        report.contains("| m | fp16/fp32 | 2.000 [2.000, 2.000] (G=2) | 2.000 [2.000, 2.000] (G=2) | 2.000 [2.000, 2.000] (G=2) |"),
        "{report}"
    );
    assert!(
        report.contains("| m | bf16/fp32 | bf16 missing |"),
        "{report}"
    );
    assert!(
        report.contains(
            "| m | fp16 | all | 2/2 | 100.0% [34.2, 100.0] (2/2) | 50.0% [9.5, 90.5] (1/2) |"
        ),
        "{report}"
    );
    assert!(
        report.contains("| m | fp16 | replay | chunk 0 | 1 | 100.0% [20.7, 100.0] (1/1) | 0.0% [0.0, 79.3] (0/1) | - |"),
        "{report}"
    );
    assert!(
        report.contains("| m | fp16 | transplant | live<-replay kv 0..2 | 1 | 100.0% [20.7, 100.0] (1/1) | 0.0% [0.0, 79.3] (0/1) | 100.0% [20.7, 100.0] (1/1) |"),
        "{report}"
    );
    // Seed claims: one row each, with our number and a verdict.
    for row in [
        "| 100% fp16 divergence under every strategy, greedy included | m greedy: 75.0% [30.1, 95.4] (3/4) | does not replicate |",
        "| cache-ON more accurate in 8 of 9 conditions | ON better in 1 of 1 conditions (OFF better 0, ties 0); sign test p = 1.000; conditions with McNemar p < 0.05: 0 | does not replicate |",
        "| fp32 flip rate exactly 0.0% | m: 0.0% [0.0, 49.0] (0/4) | replicates |",
        "| GQA models spike at the first layer; Gemma accumulates uniformly | drift.parquet absent | not measured |",
        "| patching the entire residual stream fails to recover the cache-free trajectory | all-layer patch, trajectory recovered: 50.0% [9.5, 90.5] (1/2) | does not replicate |",
        "all-layer K+V transplants following the donor at informative boundaries: 100.0% [20.7, 100.0] (1/1) | inconclusive (interval straddles 50%) |",
    ] {
        assert!(report.contains(row), "{row}\n{report}");
    }
    // Figures: PNG + SVG of each figure whose table is present, each listed in report.md; no
    // drift figure without drift.parquet.
    let figures = [
        "divergence-rate",
        "tau-ecdf",
        "accuracy-churn",
        "logit-delta",
        "flip-position",
        "patch-recovery",
        "transplant-donor",
        "chunk-divergence",
    ];
    assert!(report.contains("\n## Figures\n"), "{report}");
    for stem in figures {
        for ext in ["png", "svg"] {
            let p = run.join(format!("{stem}.{ext}"));
            assert!(
                std::fs::metadata(&p).is_ok_and(|m| m.len() > 0),
                "{}",
                p.display()
            );
        }
        assert!(
            report.contains(&format!("- [`{stem}.png`]({stem}.png) (`{stem}.svg`): ")),
            "{stem}\n{report}"
        );
    }
    assert!(!run.join("drift.png").exists() && !run.join("drift.svg").exists());
    assert!(!report.contains("`drift.png`"), "{report}");
    // A run dir with pairs.parquet only: the figures of the other tables are skipped, not errors,
    // and a stale one from an earlier analysis there is removed.
    let bare = dir.join("pairs-only");
    std::fs::create_dir_all(&bare).unwrap();
    std::fs::copy(run.join("pairs.parquet"), bare.join("pairs.parquet")).unwrap();
    std::fs::copy(
        run.join("patch-recovery.png"),
        bare.join("patch-recovery.png"),
    )
    .unwrap();
    let (code, _, err) = kvcredit(&["divergence", "analyze", bare.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let bare_report = std::fs::read_to_string(bare.join("report.md")).unwrap();
    for stem in figures {
        let present = ["divergence-rate", "tau-ecdf", "accuracy-churn"].contains(&stem);
        for ext in ["png", "svg"] {
            assert_eq!(
                bare.join(format!("{stem}.{ext}")).exists(),
                present,
                "{stem}.{ext}"
            );
        }
        assert_eq!(
            bare_report.contains(&format!("`{stem}.png`")),
            present,
            "{stem}\n{bare_report}"
        );
    }
    // With a drift table: the drift figure, and the layer-0 / last-layer means in the seed row.
    Table::new()
        .with("model", s("m"))
        .with("dtype", s("fp16"))
        .with("layer", Column::I64(vec![0, 1, 0, 1]))
        .with("resid_rel", Column::F64(vec![1e-3, 1e-2, 3e-3, 3e-2]))
        .write(&run.join("drift.parquet"))?;
    let out2 = dir.join("with-drift");
    let (code, _, err) = kvcredit(&[
        "divergence",
        "analyze",
        run.to_str().unwrap(),
        "--out",
        out2.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let report = std::fs::read_to_string(out2.join("report.md")).unwrap();
    assert!(
        report.contains("| m fp16: layer-0 2.00e-3, last 2.00e-2 | see drift figure (no test) |"),
        "{report}"
    );
    for ext in ["png", "svg"] {
        assert!(out2.join(format!("drift.{ext}")).exists());
    }
    assert!(
        report.contains("- [`drift.png`](drift.png) (`drift.svg`): "),
        "{report}"
    );
    assert!(
        report.contains(
            "| hf-div.json | m | fp16 | greedy | 4 | 50.0% [15.0, 85.0] (2/4) | 75.0% [30.1, 95.4] (3/4) |"
        ),
        "{report}"
    );
    Ok(())
}

#[test]
fn an_fp16_overflow_stops_that_dtype_only_and_keeps_the_others() {
    // The embedding scaled by 1e6 overflows fp16 (max 65504) but not fp32, whose RMS norms
    // bring the residual back to logits of normal size: fp16 must stop with one line naming
    // the dtype, problems, phase and step, and fp32 must still run and be merged.
    let dir = scratch("divergence", "fp16-overflow");
    let model = chat_fixture(&dir.join("model"), 4096);
    let path = model.join("model.safetensors");
    let tensors: Vec<(String, Tensor)> = Tensor::read_safetensors(&path)
        .unwrap()
        .into_iter()
        .map(|(name, t)| {
            if name == "model.embed_tokens.weight" {
                (name, &t * 1e6)
            } else {
                (name, t)
            }
        })
        .collect();
    Tensor::write_safetensors(&tensors, &path).unwrap();
    let spec = dir.join("spec.toml");
    let text = SPEC_HEAD
        .replace("MODEL", &model.display().to_string())
        .replace(r#"dtypes = ["fp32"]"#, r#"dtypes = ["fp16", "fp32"]"#)
        + "[[strategies]]\nkind = \"greedy\"\n[steps]\nteacher_forced = false\n";
    std::fs::write(&spec, text).unwrap();
    let out = dir.join("out");
    let (code, _, err) = run_study(&spec, &out);
    assert_eq!(code, 2, "fp16 overflow reported: {err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    for needle in [
        "numerics: fp16, problems 0..=0: free/greedy",
        "non-finite logits during cache-",
        "step 0",
        "tables of fp32 merged",
    ] {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert!(
        m["failed_dtypes"]["fp16"]
            .as_str()
            .unwrap()
            .contains("step 0")
    );
    assert_eq!(m["merged_dtypes"], serde_json::json!(["fp32"]));
    assert!(m["finished_at"].is_null());
    // The merged tables hold fp32's pair and nothing of fp16.
    let pairs = read_batch(&out.join("pairs.parquet"));
    let dtypes: arrow_array::StringArray = column(&pairs, "dtype");
    assert_eq!(pairs.num_rows(), 1);
    assert_eq!(dtypes.value(0), "fp32");
    // Negative control: the unscaled model runs both dtypes to the end.
    let clean = chat_fixture(&dir.join("clean"), 4096);
    let spec2 = dir.join("clean.toml");
    std::fs::write(
        &spec2,
        std::fs::read_to_string(&spec)
            .unwrap()
            .replace(&model.display().to_string(), &clean.display().to_string()),
    )
    .unwrap();
    let (code, _, err) = run_study(&spec2, &dir.join("clean-out"));
    assert_eq!(code, 0, "{err}");
}
