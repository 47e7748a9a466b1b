//! Every spec shipped under `experiments/` passes its study's full validation (a spec that
//! only fails on the GPU machine costs a session), and a broken copy of one does not; the
//! seed-table reproduction specs pass `kvcredit campaign validate` and fix issue 16's settings.
mod common;
use kvcredit::credit::CampaignSpec;
use kvcredit::divergence::DivergenceSpec;
use kvcredit::spectrum::spec::SpectrumSpec;
use std::path::{Path, PathBuf};

/// A campaign spec has a `[passes]` table (`spectrum-credit-*` are campaigns with a spectrum
/// pass, not spectrum evaluations).
fn is_campaign(path: &Path) -> bool {
    let text = std::fs::read_to_string(path).unwrap();
    toml::from_str::<toml::Table>(&text).is_ok_and(|t| t.contains_key("passes"))
}

fn load(path: &Path) -> kvcredit::Result<()> {
    let name = path.file_name().unwrap().to_string_lossy();
    if name.starts_with("divergence-") {
        DivergenceSpec::load(path).map(drop)
    } else if name.starts_with("spectrum-") && !is_campaign(path) {
        SpectrumSpec::load(path).map(drop)
    } else {
        CampaignSpec::load(path).map(drop)
    }
}

fn specs() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments");
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_shipped_spec_validates() {
    let all = specs();
    assert!(all.len() >= 10, "{all:?}");
    let bad: Vec<String> = all
        .iter()
        .filter_map(|p| load(p).err().map(|e| format!("{}: {e}", p.display())))
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
}

#[test]
fn a_shipped_spec_with_a_contradiction_is_refused() {
    // Negative control: the OOM spec with a replica schedule but no replica pass (the mistake
    // that cost an H200 step on 2026-12-01).
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments/gpu-oom.toml");
    let text = std::fs::read_to_string(&src).unwrap();
    let text = text.replace("[passes]\n", "[passes]\nreplica_schedule = \"same\"\n");
    let dir = std::env::temp_dir().join(format!("kvcredit-experiments-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("gpu-oom.toml");
    std::fs::write(&p, text).unwrap();
    let e = load(&p).expect_err("contradiction refused").to_string();
    assert!(e.contains("replica_schedule"), "{e}");
}

fn repro_specs() -> Vec<PathBuf> {
    specs()
        .into_iter()
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("repro-"))
        })
        .collect()
}

#[test]
fn repro_specs_pass_campaign_validate_with_the_issue_settings() {
    let all = repro_specs();
    assert_eq!(
        all.len(),
        8,
        "six stock configurations and two twins: {all:?}"
    );
    let paths: Vec<String> = all.iter().map(|p| p.display().to_string()).collect();
    let mut args = vec!["campaign", "validate"];
    args.extend(paths.iter().map(String::as_str));
    let (code, out, err) = common::kvcredit(&args);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        out.lines().filter(|l| l.contains(": ok: ")).count(),
        8,
        "{out}"
    );
    let mut stock = std::collections::BTreeSet::new();
    let mut twins = Vec::new();
    for p in &all {
        let (spec, _) = CampaignSpec::load(p).unwrap();
        let text = std::fs::read_to_string(p).unwrap();
        assert!(
            text.starts_with("# ") && text.contains("Estimated cost"),
            "{}: header comment with purpose and cost",
            p.display()
        );
        assert_eq!(spec.device, "cuda", "{}", p.display());
        let problems = spec.problems.as_ref().expect("GSM8K [problems]");
        assert!(problems.count >= 80, "{}", p.display());
        assert!(spec.continuations.k >= 4, "{}", p.display());
        assert!(spec.pivots.max_per_rollout >= 4, "{}", p.display());
        let key = (
            spec.model.clone(),
            problems.format.clone(),
            spec.dtype.to_string(),
        );
        match spec.policy.to_string().as_str() {
            "stock" => assert!(stock.insert(key), "duplicate {}", p.display()),
            _ => twins.push((key, spec.clone())),
        }
    }
    let q15 = "qwen2.5-coder-1.5b-instruct";
    let q05 = "qwen2.5-coder-0.5b-instruct";
    let mut want = std::collections::BTreeSet::new();
    for fmt in ["zero-shot-chat", "eight-shot-cot"] {
        for dt in ["bf16", "fp16"] {
            want.insert((q15.to_string(), fmt.to_string(), dt.to_string()));
        }
        want.insert((q05.to_string(), fmt.to_string(), "bf16".to_string()));
    }
    assert_eq!(stock, want);
    assert_eq!(twins.len(), 2);
    for (key, twin) in twins {
        assert_eq!(key.0, q05);
        // A twin differs from its stock configuration only in name and policy.
        let stock_path = all
            .iter()
            .find(|p| {
                let (s, _) = CampaignSpec::load(p).unwrap();
                format!("{}-bi", s.name) == twin.name
            })
            .expect("the twin's stock spec");
        let (mut s, _) = CampaignSpec::load(stock_path).unwrap();
        s.name = twin.name.clone();
        s.policy = twin.policy;
        assert_eq!(s, twin);
    }
}

#[test]
fn campaign_validate_refuses_a_bad_spec_in_one_line_and_writes_nothing() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments/repro-qwen05-zs-bf16.toml");
    let text = std::fs::read_to_string(&src).unwrap();
    let dir = common::scratch("experiments", "validate");
    let cases = [
        (text.replace("count = 80", "count = 2000"), "exceeds"),
        (
            text.replace("qwen2.5-coder-0.5b-instruct", "no-such-model"),
            "no-such-model",
        ),
        (
            text.replace("format = \"zero-shot-chat\"", "format = \"nine-shot\""),
            "format",
        ),
    ];
    for (i, (bad, needle)) in cases.iter().enumerate() {
        assert_ne!(bad, &text, "case {i} changed nothing");
        let p = dir.join(format!("bad{i}.toml"));
        std::fs::write(&p, bad).unwrap();
        let (code, out, err) = common::kvcredit(&[
            "campaign",
            "validate",
            &src.display().to_string(),
            &p.display().to_string(),
        ]);
        assert_eq!(code, 2, "{out}{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(needle), "{err}");
    }
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(
        left.len(),
        cases.len(),
        "validate wrote something: {left:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
