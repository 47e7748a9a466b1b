//! `experiments/repro-run.sh` end to end on CPU: two tiny campaigns on SmolLM2-135M (one
//! stock, one batch-invariant) run in parallel into ROOT/<config>, then one report names both;
//! a rerun leaves the finished run dirs as they are (shards deleted or not), and bad input stops the script
//! before any campaign runs.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn tiny_spec(dir: &Path, name: &str, policy: &str) -> PathBuf {
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(
        &p,
        format!(
            "# tiny CPU campaign for tests/repro_run.rs\n\
             name = \"{name}\"\nmodel = \"smollm2-135m-instruct\"\ndtype = \"fp32\"\n\
             device = \"cpu\"\npolicy = \"{policy}\"\nseed = 5\n\n\
             [problems]\nstart = 0\ncount = 2\nformat = \"zero-shot-chat\"\n\n\
             [rollout]\nmax_new_tokens = 16\ntemperature = 0.0\n\n\
             [pivots]\nmax_margin = 1.0\nmax_per_rollout = 1\nrule = \"lowest_margin\"\nalternatives = 1\n\n\
             [continuations]\nk = 2\nmax_new_tokens = 6\ntemperature = 1.0\n\n\
             [passes]\nrun = [\"exact\", \"replica\", \"refeed\"]\nreplica_schedule = \"shuffled\"\n\
             batch_size = 4\nreplica_batch_size = 3\n"
        ),
    )
    .unwrap();
    p
}

fn script(root: &Path, env: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments/repro-run.sh"))
        .arg(env!("CARGO_BIN_EXE_kvcredit"))
        .arg(root)
        .envs(env.iter().copied())
        .output()
        .expect("bash runs");
    (
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn repro_run_script_runs_two_tiny_campaigns_into_one_report_and_resumes() {
    let dir = common::scratch("repro", "run");
    let a = tiny_spec(&dir, "tiny-stock", "stock");
    let b = tiny_spec(&dir, "tiny-bi", "batch_invariant");
    let specs = format!("{} {}", a.display(), b.display());
    let root = dir.join("out");
    let env = [
        ("REPRO_SPECS", specs.as_str()),
        ("REPRO_PARALLEL", "2"),
        ("REPRO_REPS", "50"),
        ("REPRO_USD_PER_GPU_HOUR", "36"),
    ];
    let (code, log) = script(&root, &env);
    assert_eq!(code, 0, "{log}");
    let report = root.join("report/report.md");
    let text = std::fs::read_to_string(&report).unwrap();
    let sec = &text[text.find("## Reproduction table").expect("table")..];
    for name in ["tiny-stock", "tiny-bi"] {
        assert!(root.join(name).join("manifest.json").is_file(), "{name}");
        assert!(
            sec.lines().any(|l| l.starts_with(&format!("| {name} |"))),
            "{name} has no row:\n{sec}"
        );
    }
    assert!(sec.contains("$36.00 per GPU-hour"), "price passed through");
    let twins = &sec[sec.find("### Batch-invariant twins").expect("twin table")..];
    assert!(
        twins.contains("| tiny-bi |") && twins.contains("| yes |"),
        "{twins}"
    );

    // Rerun: every run dir is finished, so nothing in it changes, even with its shards
    // deleted (the committed repro dirs keep only the tables of finished runs).
    let file = |n: &str, f: &str| std::fs::read(root.join(n).join(f)).unwrap();
    let before: Vec<_> = ["tiny-stock", "tiny-bi"]
        .iter()
        .map(|n| (file(n, "estimates.parquet"), file(n, "manifest.json")))
        .collect();
    std::fs::remove_dir_all(root.join("tiny-stock/shards")).unwrap();
    let (code, log) = script(&root, &env);
    assert_eq!(code, 0, "{log}");
    let after: Vec<_> = ["tiny-stock", "tiny-bi"]
        .iter()
        .map(|n| (file(n, "estimates.parquet"), file(n, "manifest.json")))
        .collect();
    assert!(before == after, "rerun changed a finished run dir");
    assert!(!root.join("tiny-stock/shards").exists(), "shards rerun");
    for n in ["tiny-stock", "tiny-bi"] {
        let l = std::fs::read_to_string(root.join("logs").join(format!("{n}.log"))).unwrap();
        assert!(l.contains("already finished"), "{n}: {l}");
    }
    assert_eq!(
        std::fs::read_to_string(&report).unwrap(),
        text,
        "report changed"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn repro_run_script_refuses_bad_input_before_running_anything() {
    let dir = common::scratch("repro", "bad");
    let good = tiny_spec(&dir, "tiny-ok", "stock");
    let bad = dir.join("tiny-bad.toml");
    std::fs::write(
        &bad,
        std::fs::read_to_string(&good)
            .unwrap()
            .replace("name = \"tiny-ok\"", "name = \"tiny-bad\"")
            .replace("k = 2", "k = 0"),
    )
    .unwrap();
    let root = dir.join("out");
    let specs = format!("{} {}", good.display(), bad.display());
    let (code, log) = script(&root, &[("REPRO_SPECS", &specs)]);
    assert_ne!(code, 0, "{log}");
    assert!(log.contains("continuations.k"), "{log}");
    assert!(
        !root.join("tiny-ok").exists(),
        "a campaign ran before validation"
    );
    let good_s = good.display().to_string();
    let (code, log) = script(
        &root,
        &[("REPRO_SPECS", good_s.as_str()), ("REPRO_PARALLEL", "0")],
    );
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("REPRO_PARALLEL"), "{log}");
    assert!(!root.join("tiny-ok").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_failing_campaign_stops_neither_the_others_nor_the_report() {
    let dir = common::scratch("repro", "fail");
    let good = tiny_spec(&dir, "tiny-good", "stock");
    // Valid as a spec, refused at run time: its rollout needs more positions than SmolLM2 has.
    let long = dir.join("tiny-long.toml");
    std::fs::write(
        &long,
        std::fs::read_to_string(&good)
            .unwrap()
            .replace("name = \"tiny-good\"", "name = \"tiny-long\"")
            .replace("max_new_tokens = 16", "max_new_tokens = 20000"),
    )
    .unwrap();
    let specs = format!("{} {}", long.display(), good.display());
    let root = dir.join("out");
    let env = [
        ("REPRO_SPECS", specs.as_str()),
        ("REPRO_PARALLEL", "1"),
        ("REPRO_REPS", "50"),
    ];
    let (code, log) = script(&root, &env);
    assert_ne!(code, 0, "a failed campaign must fail the script:\n{log}");
    assert!(log.contains("FAILED tiny-long"), "{log}");
    assert!(log.contains("not every campaign finished"), "{log}");
    let report = std::fs::read_to_string(root.join("report/report.md")).expect("report written");
    assert!(report.contains("| tiny-good |"), "{report}");
    assert!(
        !root.join("tiny-long").exists(),
        "refused before its first write"
    );
    let l = std::fs::read_to_string(root.join("logs/tiny-long.log")).unwrap();
    assert!(l.contains("needs 20120 positions"), "{l}");
    std::fs::remove_dir_all(&dir).unwrap();
}
