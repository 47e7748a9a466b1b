//! `kvcredit bench campaign`: a tiny real CPU campaign (SmolLM2-135M-Instruct, 2 problems,
//! 16-token rollouts, 1 pivot, 6-token continuations) run and timed end to end. The report's
//! per-pass tokens are the manifest's cost, the whole run their sum; `--pool-problems` reaches
//! the manifest; an existing run folder is refused; `--from` reprints the same rows from the
//! folder (wall time n/a for a resumed run, an unfinished one refused); a bad spec or pool size
//! is a one-line error with nothing written. Speeds are not asserted.
mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The shared tiny SmolLM2 CPU campaign (`common::tiny_campaign_spec`).
fn spec_text() -> String {
    common::tiny_campaign_spec("bench-campaign", 2)
}

/// One intra-op thread: the machine may be shared, and nothing here is a speed claim.
fn kvcredit(args: &[&str]) -> (i32, String, String) {
    common::kvcredit_env(args, &[("OMP_NUM_THREADS", "1")])
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `stderr` is one `error: …` line (returned).
fn one_error_line(stderr: &str) -> &str {
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "not one line: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    lines[0]
}

/// The rows of the table's passes (between the header and the whole-run line).
fn pass_rows(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .skip_while(|l| !l.starts_with("pass "))
        .skip(1)
        .take_while(|l| !l.starts_with("whole run:"))
        .collect()
}

/// The timed run of the spec, shared by the tests here.
struct Run {
    root: PathBuf,
    spec: PathBuf,
    dir: PathBuf,
    stdout: String,
}

fn timed() -> &'static Run {
    static RUN: OnceLock<Run> = OnceLock::new();
    RUN.get_or_init(|| {
        let root = common::scratch("bench-campaign", "runs");
        let spec = root.join("spec.toml");
        std::fs::write(&spec, spec_text()).unwrap();
        let dir = root.join("run");
        let extra = root.join("extra.json");
        let (code, stdout, stderr) = kvcredit(&[
            "bench",
            "campaign",
            s(&spec),
            "--out",
            s(&dir),
            "--json",
            s(&extra),
            "--quiet",
        ]);
        assert_eq!(code, 0, "bench campaign failed: {stdout}{stderr}");
        Run {
            root,
            spec,
            dir,
            stdout,
        }
    })
}

#[test]
fn the_report_is_the_manifests_cost_and_its_sum() {
    let r = timed();
    let report = json(&r.dir.join("bench-campaign.json"));
    let manifest = json(&r.dir.join("manifest.json"));
    // --json FILE holds the same report.
    assert_eq!(
        std::fs::read(r.root.join("extra.json")).unwrap(),
        std::fs::read(r.dir.join("bench-campaign.json")).unwrap()
    );
    let cost = manifest["cost"].as_object().unwrap();
    let passes = report["passes"].as_array().unwrap();
    let names: Vec<&str> = passes.iter().map(|p| p["pass"].as_str().unwrap()).collect();
    assert_eq!(names, ["rollout", "exact", "replica", "refeed"]);
    assert_eq!(cost.len(), passes.len());
    let (mut tokens, mut conts) = (0, 0);
    for p in passes {
        let c = &cost[p["pass"].as_str().unwrap()];
        assert_eq!(p["tokens"], c["tokens"], "{p}");
        assert_eq!(p["continuations"], c["continuations"], "{p}");
        assert_eq!(p["device_seconds"], c["device_seconds"], "{p}");
        tokens += p["tokens"].as_u64().unwrap();
        conts += p["continuations"].as_u64().unwrap();
    }
    assert!(tokens > 0);
    // 2 problems × 1 pivot × 2 branches × k = 2, in each of three passes.
    assert_eq!(conts, 24);
    let whole = &report["whole_run"];
    assert_eq!(whole["tokens"].as_u64(), Some(tokens));
    assert_eq!(whole["continuations"].as_u64(), Some(conts));
    assert_eq!(whole["wall_source"], "measured");
    let wall = whole["wall_seconds"].as_f64().unwrap();
    assert!(wall > 0.0);
    let rate = whole["tokens_per_wall_s"].as_f64().unwrap();
    assert!((rate - tokens as f64 / wall).abs() <= 1e-9 * rate);
    for key in [
        "spec_sha256",
        "model",
        "dtype",
        "device",
        "policy",
        "engine",
    ] {
        assert_eq!(report[key], manifest[key], "{key}");
    }
    assert_eq!(report["spec_name"], "bench-campaign");
    assert_eq!(report["pool_problems"], 1);
    assert_eq!(report["batch_size"], 4);
    assert_eq!(
        report["replica_batch_size"], 4,
        "the same schedule: exact's batches"
    );
    assert_eq!(report["problems"], 2);
    assert_eq!(report["kvcredit_version"], manifest["kvcredit_version"]);
    assert_eq!(report["libtorch_version"], manifest["libtorch_version"]);
    // The table: one row per pass, the whole run, and where the outputs are.
    assert_eq!(pass_rows(&r.stdout).len(), 4, "{}", r.stdout);
    assert!(
        r.stdout
            .contains(&format!("whole run: 24 continuations, {tokens} tokens;")),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("results: "), "{}", r.stdout);
    // Without the override the manifest records no pooling.
    assert!(manifest.get("pool_problems").is_none(), "{manifest}");
}

#[test]
fn pool_problems_overrides_the_spec_and_is_recorded() {
    let r = timed();
    // An existing empty folder is a new run's folder, not a refused one.
    let dir = r.root.join("pooled");
    std::fs::create_dir_all(&dir).unwrap();
    let (code, stdout, stderr) = kvcredit(&[
        "bench",
        "campaign",
        s(&r.spec),
        "--out",
        s(&dir),
        "--pool-problems",
        "2",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert_eq!(json(&dir.join("manifest.json"))["pool_problems"], 2);
    assert_eq!(json(&dir.join("bench-campaign.json"))["pool_problems"], 2);
    assert!(stdout.contains("pool_problems 2"), "{stdout}");
    // The spec file alone (pool 1) does not resume the pooled folder.
    let (code, _, stderr) = kvcredit(&["campaign", "run", s(&r.spec), "--out", s(&dir)]);
    assert_eq!(code, 2);
    assert!(
        one_error_line(&stderr).contains("passes.pool_problems = 2"),
        "{stderr}"
    );
}

#[test]
fn refill_overrides_the_spec_and_is_recorded() {
    let r = timed();
    let dir = r.root.join("refill");
    let (code, stdout, stderr) = kvcredit(&[
        "bench",
        "campaign",
        s(&r.spec),
        "--out",
        s(&dir),
        "--refill",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert_eq!(json(&dir.join("manifest.json"))["refill"], true);
    assert_eq!(json(&dir.join("bench-campaign.json"))["refill"], true);
    assert!(stdout.contains("pool_problems 1, refill,"), "{stdout}");
    assert!(
        json(&r.dir.join("bench-campaign.json"))
            .get("refill")
            .is_none()
    );
    // The spec file alone (no refill) does not resume the refill folder.
    let (code, _, stderr) = kvcredit(&["campaign", "run", s(&r.spec), "--out", s(&dir)]);
    assert_eq!(code, 2);
    assert!(
        one_error_line(&stderr).contains("passes.refill = true"),
        "{stderr}"
    );
}

#[test]
fn an_existing_run_folder_is_refused() {
    let r = timed();
    let before = std::fs::read(r.dir.join("manifest.json")).unwrap();
    let (code, stdout, stderr) = kvcredit(&["bench", "campaign", s(&r.spec), "--out", s(&r.dir)]);
    assert_eq!(code, 2, "{stdout}");
    assert!(
        one_error_line(&stderr).contains("already holds a campaign run"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(r.dir.join("manifest.json")).unwrap(), before);
    // A partial run (shards, no manifest yet) too.
    let partial = r.root.join("partial");
    std::fs::create_dir_all(partial.join("shards")).unwrap();
    let (code, _, stderr) = kvcredit(&["bench", "campaign", s(&r.spec), "--out", s(&partial)]);
    assert_eq!(code, 2);
    one_error_line(&stderr);
    assert!(!partial.join("manifest.json").exists());
}

#[test]
fn from_reprints_the_runs_rows() {
    let r = timed();
    let again = r.root.join("from.json");
    let (code, stdout, stderr) = kvcredit(&[
        "bench",
        "campaign",
        "--from",
        s(&r.dir),
        "--json",
        s(&again),
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(pass_rows(&stdout), pass_rows(&r.stdout));
    let (a, b) = (json(&r.dir.join("bench-campaign.json")), json(&again));
    assert_eq!(a["passes"], b["passes"]);
    assert_eq!(a["whole_run"]["tokens"], b["whole_run"]["tokens"]);
    assert_eq!(b["whole_run"]["wall_source"], "manifest");
    assert!(b["whole_run"]["wall_seconds"].as_f64().is_some());
    assert!(b.get("load_seconds").is_none());

    // The same manifest with a resume recorded: no wall time.
    let mut m = json(&r.dir.join("manifest.json"));
    m["resumed_at"] = serde_json::json!([m["started_at"].clone()]);
    let resumed = r.root.join("resumed");
    std::fs::create_dir_all(&resumed).unwrap();
    std::fs::write(resumed.join("manifest.json"), m.to_string()).unwrap();
    let (code, stdout, stderr) = kvcredit(&["bench", "campaign", "--from", s(&resumed)]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("wall n/a (resumed)"), "{stdout}");
    assert_eq!(pass_rows(&stdout), pass_rows(&r.stdout));

    // Timestamps spanning less than the passes' device seconds (shards from elsewhere).
    m["resumed_at"] = serde_json::json!([]);
    m["finished_at"] = m["started_at"].clone();
    m["cost"]["exact"]["device_seconds"] = serde_json::json!(30.0);
    let early = r.root.join("early");
    std::fs::create_dir_all(&early).unwrap();
    std::fs::write(early.join("manifest.json"), m.to_string()).unwrap();
    let (code, stdout, stderr) = kvcredit(&["bench", "campaign", "--from", s(&early)]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("wall n/a (timestamps shorter than the device time)"),
        "{stdout}"
    );

    // Unfinished: refused.
    m["resumed_at"] = serde_json::json!([]);
    m["finished_at"] = Value::Null;
    let unfinished = r.root.join("unfinished");
    std::fs::create_dir_all(&unfinished).unwrap();
    std::fs::write(unfinished.join("manifest.json"), m.to_string()).unwrap();
    let (code, _, stderr) = kvcredit(&["bench", "campaign", "--from", s(&unfinished)]);
    assert_eq!(code, 2);
    assert!(
        one_error_line(&stderr).contains("has not finished"),
        "{stderr}"
    );
    // Another study's manifest.
    let other = r.root.join("other");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("manifest.json"), r#"{"name": "div"}"#).unwrap();
    let (code, _, stderr) = kvcredit(&["bench", "campaign", "--from", s(&other)]);
    assert_eq!(code, 2);
    assert!(
        one_error_line(&stderr).contains("is not a campaign manifest"),
        "{stderr}"
    );
    // Not a run folder.
    let (code, _, stderr) = kvcredit(&["bench", "campaign", "--from", s(&r.root)]);
    assert_eq!(code, 2);
    assert!(
        one_error_line(&stderr).contains("no manifest.json"),
        "{stderr}"
    );
}

#[test]
fn a_bad_spec_or_pool_size_writes_nothing() {
    let root = common::scratch("bench-campaign", "bad");
    let bad = root.join("bad.toml");
    std::fs::write(&bad, spec_text().replace("k = 2", "k = 0")).unwrap();
    let good = root.join("good.toml");
    std::fs::write(&good, spec_text()).unwrap();
    for (spec, extra, says) in [
        (&bad, None, "continuations.k"),
        (
            &good,
            Some("0"),
            "--pool-problems: spec: campaign `bench-campaign`: passes.pool_problems must be positive",
        ),
    ] {
        let out = root.join("out");
        let mut args = vec!["bench", "campaign", s(spec), "--out", s(&out)];
        if let Some(p) = extra {
            args.extend(["--pool-problems", p]);
        }
        let (code, stdout, stderr) = kvcredit(&args);
        assert_eq!(code, 2, "{stdout}");
        let line = one_error_line(&stderr);
        assert!(line.contains(says), "{line}");
        assert!(!out.exists(), "{} was written", out.display());
    }
}
