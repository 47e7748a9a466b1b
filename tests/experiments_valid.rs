//! Every spec shipped under `experiments/` passes its study's full validation (a spec that
//! only fails on the GPU machine costs a session), and a broken copy of one does not.
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
