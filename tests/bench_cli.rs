//! `kvcredit bench` end to end on a synthetic shape on the CPU: the report's files, its
//! correctness lines (batch-invariant continuations identical across batch sizes), snapshot
//! memory, and clean errors. Speeds are not asserted here; they belong to the benchmark itself.
mod common;

/// One intra-op thread: the test measures nothing, and the machine may be shared.
fn kvcredit(args: &[&str]) -> (i32, String, String) {
    common::kvcredit_env(args, &[("OMP_NUM_THREADS", "1")])
}

#[test]
fn bench_writes_json_and_parquet_and_checks_invariance() {
    let out = common::scratch("bench", "report");
    let (code, stdout, stderr) = kvcredit(&[
        "bench",
        "--synthetic",
        "tiny-qwen2",
        "--dtype",
        "fp32",
        "--prompt",
        "24",
        "--batches",
        "1,3",
        "--steps",
        "2",
        "--rollout-tokens",
        "12",
        "--pivots",
        "4",
        "--k",
        "2",
        "--new-tokens",
        "6",
        "--cont-batches",
        "3,8",
        "--profile",
        "3",
        "--samplers",
        "aten",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "bench failed: {stderr}");
    assert!(stdout.contains("wrote "), "{stdout}");

    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("bench-tiny-qwen2-fp32-cpu.json")).unwrap(),
    )
    .unwrap();
    assert!(json["errors"].as_array().unwrap().is_empty(), "{json}");
    // Two policies × two batch sizes of decode steps and of continuations.
    assert_eq!(json["decode"].as_array().unwrap().len(), 4);
    let conts = json["continuations"].as_array().unwrap();
    assert_eq!(conts.len(), 4);
    for c in conts {
        // 4 pivots × 2 branches × k = 2, 6 tokens each, no stop tokens.
        assert_eq!(c["jobs"], 16);
        assert_eq!(c["tokens"], 96);
        assert_eq!(c["snapshot_checks"], 16);
        assert_eq!(c["sampler"], "aten");
    }
    // The fused sampler's bitwise check runs only where the fused sampler can run.
    assert!(json["sampler_check"].is_null(), "{}", json["sampler_check"]);
    let digests = |policy: &str| -> Vec<String> {
        conts
            .iter()
            .filter(|c| c["policy"] == policy)
            .map(|c| c["tokens_sha256"].as_str().unwrap().to_string())
            .collect()
    };
    let bi = digests("batch_invariant");
    assert_eq!(bi.len(), 2);
    assert_eq!(
        bi[0], bi[1],
        "batch-invariant samples depend on the batch size"
    );
    let targets = json["targets"].as_array().unwrap();
    let target = |prefix: &str| {
        targets
            .iter()
            .find(|t| t["name"].as_str().unwrap().starts_with(prefix))
            .unwrap_or_else(|| panic!("no target {prefix}"))
    };
    assert_eq!(
        target("continuation tokens identical across engines and batches, batch_invariant")["met"],
        true
    );
    let memory = target("snapshot memory");
    assert_eq!(memory["met"], true);
    assert!(memory["value"].as_f64().unwrap() < 1.1);

    // One device profile per policy; on the CPU it sees no kernels but writes its trace.
    let profiles = json["profiles"].as_array().unwrap();
    assert_eq!(profiles.len(), 2, "{profiles:?}");
    for p in profiles {
        assert_eq!(
            (p["batch"].as_u64(), p["steps"].as_u64()),
            (Some(3), Some(2))
        );
        assert!(p["kernels"].as_array().unwrap().is_empty(), "{p}");
        let trace = std::path::PathBuf::from(p["trace"].as_str().unwrap());
        assert!(trace.starts_with(&out), "{}", trace.display());
        let text = std::fs::read_to_string(&trace).unwrap();
        assert!(text.contains("aten::"), "trace without ops");
    }
    assert!(
        stdout.contains("device profile: batch_invariant batch 3"),
        "{stdout}"
    );

    // The Parquet table holds one row per measurement: 2 prefills + 4 decode + 4 continuations.
    let parquet = out.join("bench-tiny-qwen2-fp32-cpu.parquet");
    let batches = kvcredit::io::parquet::read_batches(&parquet).unwrap();
    let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
    assert_eq!(rows, 10);
    let schema = batches[0].schema();
    for col in [
        "measurement",
        "policy",
        "engine",
        "batch",
        "tokens_per_s",
        "step_ms",
        "tokens_sha256",
        "sampler",
    ] {
        assert!(schema.field_with_name(col).is_ok(), "missing column {col}");
    }
}

#[test]
fn bench_rejects_bad_settings_in_one_line() {
    let out = common::scratch("bench", "bad");
    let bad_targets = out.join("bad-targets.toml");
    std::fs::write(
        &bad_targets,
        "[continuation]\nbatch = 64\nmin_speedup = -1.0\n",
    )
    .unwrap();
    let missing_targets = out.join("no-such-targets.toml");
    for args in [
        vec!["--batches", "0"],
        vec!["--profile", "0"],
        vec!["--prompt", "0"],
        vec!["--synthetic", "no-such-shape"],
        vec!["--targets", bad_targets.to_str().unwrap()],
        vec!["--targets", missing_targets.to_str().unwrap()],
    ] {
        let mut all = vec!["bench", "--quiet", "--out", out.to_str().unwrap()];
        if !args.contains(&"--synthetic") {
            all.extend(["--synthetic", "tiny-qwen2"]);
        }
        all.extend(args.iter().copied());
        let (code, _, stderr) = kvcredit(&all);
        assert_ne!(code, 0, "{all:?} succeeded");
        assert!(!stderr.contains("panicked"), "{all:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{all:?}: {stderr}");
        assert!(stderr.starts_with("error:"), "{all:?}: {stderr}");
    }
    // The fused sampler is CUDA-only: asked for on the CPU by flag or by KVCREDIT_SAMPLER, it
    // is a one-line error before anything is measured or written; so is an unknown sampler.
    let fused_out = out.join("fused");
    let base = [
        "bench",
        "--quiet",
        "--synthetic",
        "tiny-qwen2",
        "--out",
        fused_out.to_str().unwrap(),
    ];
    let flag = [&base[..], &["--samplers", "fused"]].concat();
    for (args, env) in [
        (&flag[..], vec![]),
        (&base[..], vec![("KVCREDIT_SAMPLER", "fused")]),
        (&base[..], vec![("KVCREDIT_SAMPLER", "gumbel")]),
    ] {
        let mut env = env;
        env.push(("OMP_NUM_THREADS", "1"));
        let (code, _, stderr) = common::kvcredit_env(args, &env);
        assert_ne!(code, 0, "{args:?} {env:?} succeeded");
        assert_eq!(stderr.trim().lines().count(), 1, "{env:?}: {stderr}");
        assert!(stderr.contains("sampler"), "{env:?}: {stderr}");
        assert!(
            !fused_out.exists(),
            "{env:?}: wrote {}",
            fused_out.display()
        );
    }
    // So is the fused glue (KVCREDIT_GLUE), and an unknown glue; `aten` runs anywhere.
    for value in ["fused", "triton"] {
        let env = [("KVCREDIT_GLUE", value), ("OMP_NUM_THREADS", "1")];
        let (code, _, stderr) = common::kvcredit_env(&base, &env);
        assert_eq!(code, 2, "KVCREDIT_GLUE={value} exited {code}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{value}: {stderr}");
        assert!(stderr.contains("glue"), "{value}: {stderr}");
        assert!(
            !fused_out.exists(),
            "{value}: wrote {}",
            fused_out.display()
        );
    }
}

/// The binary copied alone into an empty folder and run from there (no source tree beside it,
/// as on a GPU machine) prints `bench --help` and runs a synthetic bench on its built-in
/// targets; `--targets` still replaces them (a missing file is then the error).
#[test]
fn bench_runs_from_a_lone_copy_of_the_binary() {
    let dir = common::scratch("bench", "lone-binary");
    let exe = dir.join("kvcredit");
    std::fs::copy(env!("CARGO_BIN_EXE_kvcredit"), &exe).unwrap();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(&exe)
            .args(args)
            .current_dir(&dir)
            .env("OMP_NUM_THREADS", "1")
            .output()
            .expect("the copied binary runs");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (
            out.status.code().unwrap_or(-1),
            text(&out.stdout),
            text(&out.stderr),
        )
    };
    let (code, stdout, stderr) = run(&["bench", "--help"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("--targets"), "{stdout}");

    let bench = [
        "bench",
        "--synthetic",
        "tiny-qwen2",
        "--dtype",
        "fp32",
        "--prompt",
        "8",
        "--batches",
        "1",
        "--steps",
        "1",
        "--rollout-tokens",
        "4",
        "--pivots",
        "1",
        "--k",
        "1",
        "--new-tokens",
        "2",
        "--cont-batches",
        "2",
        "--samplers",
        "aten",
        "--quiet",
        "--out",
        "report",
    ];
    let (code, stdout, stderr) = run(&bench);
    assert_eq!(code, 0, "bench failed beside no source tree: {stderr}");
    assert!(stdout.contains("wrote "), "{stdout}");
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("report/bench-tiny-qwen2-fp32-cpu.json")).unwrap(),
    )
    .unwrap();
    assert!(
        !json["targets"].as_array().unwrap().is_empty(),
        "built-in targets evaluated"
    );

    let (code, _, stderr) = run(&[&bench[..], &["--targets", "no-such-targets.toml"]].concat());
    assert_ne!(code, 0);
    assert!(stderr.contains("no-such-targets.toml"), "{stderr}");
}
