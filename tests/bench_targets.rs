//! `benches/targets.toml`: the shipped file loads with the issue's targets and the H200
//! reference baselines; malformed files are one-line errors.
use kvcredit::bench::{
    HfBaseline, HfComparison, TargetFile, default_hf_files, hf_comparison, hf_legend,
    read_hf_baselines,
};

fn shipped() -> TargetFile {
    TargetFile::shipped().unwrap()
}

#[test]
fn the_shipped_file_holds_the_issue_targets_and_h200_baselines() {
    let t = shipped();
    assert_eq!(
        (t.continuation.batch, t.continuation.min_speedup),
        (64, 10.0)
    );
    assert_eq!(
        (t.decode.shape.as_str(), t.decode.max_ms),
        ("qwen2.5-1.5b", 2.9)
    );
    assert_eq!(t.snapshot.max_ratio, 1.1);
    let b = t
        .reference_baseline("qwen2.5-0.5b", 64, "cuda", "bf16")
        .unwrap();
    assert_eq!(b.generate_tokens_per_s, 1053.0);
    assert_eq!(b.source, "docs/guide/gpu.md (H200, transformers 5.17)");
    assert_eq!(t.hf_baselines.results.len(), 8);
    // Reference numbers apply to their device and dtype only.
    assert!(
        t.reference_baseline("qwen2.5-0.5b", 64, "cpu", "bf16")
            .is_none()
    );
    assert!(
        t.reference_baseline("qwen2.5-0.5b", 64, "cuda", "fp32")
            .is_none()
    );
    assert!(
        t.reference_baseline("qwen2.5-0.5b", 3, "cuda", "bf16")
            .is_none()
    );
}

#[test]
fn bad_target_files_are_one_line_errors() {
    let dir = std::env::temp_dir().join(format!("kvcredit-targets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = TargetFile::SHIPPED;
    let first = "{ shape = \"qwen2.5-0.5b\", batch = 1, generate_tokens_per_s = 15.0 }";
    assert!(text.contains(first));
    for (name, bad, needle) in [
        (
            "speedup",
            text.replace("min_speedup = 10.0", "min_speedup = 0.0"),
            "min_speedup",
        ),
        (
            "unknown",
            text.replace("[snapshot]", "[snapshot]\nmax_ratioo = 2.0"),
            "max_ratioo",
        ),
        (
            "duplicate",
            text.replace(first, &format!("{first},\n    {first}")),
            "twice",
        ),
        ("batch", text.replace("batch = 64", "batch = 0"), "positive"),
        ("syntax", text.replace("[decode]", "[decode"), "targets"),
    ] {
        let path = dir.join(format!("{name}.toml"));
        std::fs::write(&path, bad).unwrap();
        let e = TargetFile::load(&path).unwrap_err().to_string();
        assert!(e.starts_with("spec: bench targets"), "{name}: {e}");
        assert!(e.contains(needle), "{name}: {e}");
        assert_eq!(e.lines().count(), 1, "{name}: {e}");
    }
    let e = TargetFile::load(&dir.join("absent.toml"))
        .unwrap_err()
        .to_string();
    assert_eq!(e.lines().count(), 1, "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// The "vs HF" label: static-cache compiled generate when every baseline has it, else the eager
// one, said to be the weak baseline.
fn base(batch: usize, eager: f64, st: Option<f64>) -> HfBaseline {
    HfBaseline {
        source: "hf.json".into(),
        batch,
        generate_tokens_per_s: eager,
        static_tokens_per_s: st,
    }
}

#[test]
fn static_baseline_is_the_reference_when_measured() {
    let both = [base(1, 15.0, Some(300.0)), base(64, 1000.0, Some(12000.0))];
    assert_eq!(hf_comparison(&both), Some(HfComparison::Static));
    assert_eq!(both[1].reference(), (12000.0, HfComparison::Static));
    let legend = hf_legend(&both).unwrap();
    assert!(
        legend.starts_with("vs static-cache compiled HF generate"),
        "{legend}"
    );
    assert!(!legend.contains("weak"), "{legend}");
}

#[test]
fn eager_only_baseline_is_labelled_weak() {
    let eager = [base(64, 1053.0, None)];
    assert_eq!(hf_comparison(&eager), Some(HfComparison::Eager));
    assert_eq!(eager[0].reference(), (1053.0, HfComparison::Eager));
    assert_eq!(HfComparison::Eager.column(), "vs eager HF");
    let legend = hf_legend(&eager).unwrap();
    assert!(
        legend.starts_with("vs eager HF generate (weak baseline)"),
        "{legend}"
    );
    assert!(legend.contains("--static"), "{legend}");
}

#[test]
fn one_eager_only_batch_makes_the_whole_comparison_weak() {
    let mixed = [base(1, 15.0, None), base(64, 1000.0, Some(12000.0))];
    assert_eq!(hf_comparison(&mixed), Some(HfComparison::Eager));
    assert!(hf_legend(&mixed).unwrap().contains("(weak baseline)"));
    assert_eq!(hf_comparison(&[]), None);
    assert_eq!(hf_legend(&[]), None);
}

#[test]
fn hf_json_is_matched_on_shape_dtype_and_device() {
    let dir = std::env::temp_dir().join(format!("kvcredit-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("hf.json");
    let json = r#"{"device": "cuda", "results": [
        {"shape": "qwen2.5-0.5b", "dtype": "bf16", "batch": 64,
         "generate": {"tokens_per_s": 940.0}, "generate_static": {"tokens_per_s": 12776.0}},
        {"shape": "qwen2.5-0.5b", "dtype": "fp16", "batch": 64,
         "generate": {"tokens_per_s": 900.0}}]}"#;
    std::fs::write(&path, json).unwrap();
    let got = read_hf_baselines(&path, "qwen2.5-0.5b", "bf16", "cuda").unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].reference(), (12776.0, HfComparison::Static));
    let fp16 = read_hf_baselines(&path, "qwen2.5-0.5b", "fp16", "cuda").unwrap();
    assert_eq!(hf_comparison(&fp16), Some(HfComparison::Eager));
    assert!(
        read_hf_baselines(&path, "qwen2.5-0.5b", "bf16", "cpu")
            .unwrap()
            .is_empty()
    );
    assert!(
        read_hf_baselines(&path, "qwen2.5-1.5b", "bf16", "cuda")
            .unwrap()
            .is_empty()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_repository_ships_static_baselines() {
    let files = default_hf_files();
    assert!(!files.is_empty(), "results/throughput/hf-generate-*.json");
    for f in &files {
        for shape in ["qwen2.5-0.5b", "qwen2.5-1.5b"] {
            let b = read_hf_baselines(f, shape, "bf16", "cuda").unwrap();
            assert_eq!(
                hf_comparison(&b).unwrap_or(HfComparison::Static),
                HfComparison::Static
            );
        }
    }
}
