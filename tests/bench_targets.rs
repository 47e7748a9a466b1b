//! `benches/targets.toml`: the shipped file loads with the issue's targets and the H200
//! reference baselines; malformed files are one-line errors.
use kvcredit::bench::TargetFile;

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
    assert_eq!(b.source, "docs/h200-facts.md (H200, transformers 5.17)");
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
