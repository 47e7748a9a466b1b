//! Three-pass campaigns on a real model (SmolLM2-135M-Instruct from the model cache; `make
//! test` pulls it): same-schedule replicas are bitwise identical to exact, the fingerprint
//! check catches a corrupted snapshot, a SIGKILLed run resumes to identical Parquet, and the
//! tables load in polars and pandas.
mod common;

use kvcredit::credit::CampaignSpec;
use kvcredit::credit::rollout::{self, RolloutParams};
use kvcredit::credit::schema;
use kvcredit::credit::spec::PivotSpec;
use kvcredit::decode::engine::{self, Decoding, Job, Start};
use kvcredit::io::parquet::read_batches;
use kvcredit::runtime::{self, Dtype, LoadedModel, ModelSource};
use kvcredit::sampling::{NoiseKey, Sampling};
use kvcredit::{Error, ExecPolicy};
use std::path::{Path, PathBuf};
use std::process::Command;

const MODEL: &str = "smollm2-135m-instruct";

fn model() -> LoadedModel {
    let src =
        ModelSource::resolve(MODEL, &common::registry_paths()).expect("model pulled (make models)");
    runtime::load(&src, Dtype::Fp32, tch::Device::Cpu).expect("model loads")
}

fn spec_text(name: &str, schedule: &str, problems: usize) -> String {
    format!(
        r#"
name = "{name}"
model = "{MODEL}"
dtype = "fp32"
device = "cpu"
policy = "stock"
seed = 7

[problems]
start = 0
count = {problems}
format = "zero-shot-chat"

[rollout]
max_new_tokens = 40
temperature = 0.0

[pivots]
max_margin = 0.6
max_per_rollout = 2
alternatives = 1

[continuations]
k = 2
max_new_tokens = 16
temperature = 1.0

[passes]
run = ["exact", "replica", "refeed"]
replica_schedule = "{schedule}"
batch_size = 4
replica_batch_size = 3
"#
    )
}

/// [`spec_text`] made small (shorter rollouts and continuations, K = 1, no refeed) and pooled
/// in pairs of problems when `pool`.
fn small_spec_text(name: &str, problems: usize, pool: bool) -> String {
    let text = spec_text(name, "shuffled", problems)
        .replace("max_new_tokens = 40", "max_new_tokens = 24")
        .replace("max_new_tokens = 16", "max_new_tokens = 6")
        .replace("k = 2", "k = 1")
        .replace(
            r#"["exact", "replica", "refeed"]"#,
            r#"["exact", "replica"]"#,
        );
    if pool {
        text.replace(
            "replica_batch_size = 3\n",
            "replica_batch_size = 3\npool_problems = 2\n",
        )
    } else {
        text
    }
}

fn write_spec(dir: &Path, text: &str) -> PathBuf {
    let p = dir.join("spec.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// Write `text` as the spec in `dir` and run it to the end into `dir/out`.
fn run_spec(dir: &Path, text: &str, out: &str) -> (PathBuf, schema::Manifest) {
    let out = dir.join(out);
    let m = common::run_campaign_file(&write_spec(dir, text), &model(), &out);
    (out, m)
}

/// Rows of one string/list column per (pass) from continuations.parquet, as debug strings.
fn continuation_tokens(run: &Path, pass: &str) -> Vec<String> {
    use arrow_array::{ListArray, StringArray, UInt32Array};
    let mut out = Vec::new();
    for b in read_batches(&run.join("continuations.parquet")).unwrap() {
        let passes: StringArray = common::column(&b, "pass");
        let toks: ListArray = common::column(&b, "tokens");
        let u32s = |n: &str| -> UInt32Array { common::column(&b, n) };
        let (pos, probs, ranks, samples) = (
            u32s("pivot_pos"),
            u32s("problem"),
            u32s("alt_rank"),
            u32s("sample"),
        );
        for i in 0..b.num_rows() {
            if passes.value(i) == pass {
                out.push(format!(
                    "{}/{}/{}/{}: {:?}",
                    probs.value(i),
                    pos.value(i),
                    ranks.value(i),
                    samples.value(i),
                    toks.value(i)
                ));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn same_schedule_replica_is_bitwise_identical_to_exact() {
    let dir = common::scratch("campaign", "same");
    let (out, m) = run_spec(&dir, &spec_text("same", "same", 2), "run");
    assert_eq!(m.snapshot_hit_rate, 1.0);
    assert!(
        m.snapshot_checks > 0,
        "no pivots were found; loosen max_margin"
    );
    let exact = continuation_tokens(&out, "exact");
    let replica = continuation_tokens(&out, "replica");
    assert!(!exact.is_empty());
    assert_eq!(exact, replica);
    // Estimates too: compare the estimate column of exact and replica rows pairwise.
    let est = kvcredit_estimates(&out);
    let by = |p: &str| {
        est.iter()
            .filter(|r| r.0 == p)
            .map(|r| r.1.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(by("exact"), by("replica"));
    // ... and `check` (replica-same compares batch placements too) passes the run.
    let report = kvcredit::check::check_run(&out).unwrap();
    assert!(report.passed(), "{:#?}", report.violations);
}

#[test]
fn a_spec_whose_shuffled_replica_cannot_differ_from_exact_is_rejected() {
    let dir = common::scratch("campaign", "one-per-batch");
    let base = spec_text("one", "shuffled", 1);
    for (from, to) in [
        (
            "batch_size = 4\nreplica_batch_size = 3",
            "batch_size = 1\nreplica_batch_size = 1",
        ),
        ("batch_size = 4\nreplica_batch_size = 3", "batch_size = 1"),
    ] {
        let text = base.replace(from, to);
        assert_ne!(text, base);
        let err = CampaignSpec::load(&write_spec(&dir, &text))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("set passes.replica_batch_size to 2 or more") && !err.contains('\n'),
            "{err}"
        );
    }
    // Two per replica batch, or a `same` replica, is fine.
    let two = base.replace("replica_batch_size = 3", "replica_batch_size = 2");
    let two = two.replace("batch_size = 4", "batch_size = 1");
    CampaignSpec::load(&write_spec(&dir, &two)).unwrap();
    let same = spec_text("one", "same", 1).replace(
        "batch_size = 4\nreplica_batch_size = 3",
        "batch_size = 1\nreplica_batch_size = 1",
    );
    CampaignSpec::load(&write_spec(&dir, &same)).unwrap();
}

/// (pass, "problem/pos/rank=estimate") rows of estimates.parquet.
fn kvcredit_estimates(run: &Path) -> Vec<(String, String)> {
    use arrow_array::{Float64Array, StringArray, UInt32Array};
    let mut out = Vec::new();
    for b in read_batches(&run.join("estimates.parquet")).unwrap() {
        let pass: StringArray = common::column(&b, "pass");
        let est: Float64Array = common::column(&b, "estimate");
        let prob: UInt32Array = common::column(&b, "problem");
        let pos: UInt32Array = common::column(&b, "pivot_pos");
        for i in 0..b.num_rows() {
            out.push((
                pass.value(i).to_string(),
                format!(
                    "{}/{}={:?}",
                    prob.value(i),
                    pos.value(i),
                    est.value(i).to_bits()
                ),
            ));
        }
    }
    out
}

#[test]
fn fingerprint_check_catches_a_corrupted_snapshot() {
    let m = model();
    let prompt: Vec<i64> = (1..30).collect();
    let params = RolloutParams {
        sampling: Sampling::Greedy,
        max_new_tokens: 12,
        key: NoiseKey::rollout(1, 0),
        stop_tokens: &[],
        special_tokens: &[],
        text_stop: None,
        policy: ExecPolicy::Stock,
        max_margin: 1.0,
        alternatives: 1,
    };
    let mut roll = rollout::rollout(&m.decoder, &prompt, &params).unwrap();
    let spec = PivotSpec {
        max_margin: 1.0,
        max_per_rollout: 1,
        rule: kvcredit::credit::spec::PivotRule::LowestMargin,
        alternatives: 1,
    };
    let pivot = rollout::select_pivots(&roll.steps, &spec).remove(0);
    let decoding = Decoding {
        model: &m.decoder,
        policy: ExecPolicy::Stock,
        sampling: Sampling::Greedy,
        max_new_tokens: 2,
        stop_tokens: &[],
        text_stop: None,
    };
    let run = |roll: &rollout::Rollout| {
        let job = Job {
            start: Start {
                cache: &roll.cache,
                snap: roll.snapshot(pivot.pos),
                expect: Some(pivot.fingerprint),
            },
            first_token: pivot.token,
            key: params.key,
        };
        engine::run(&decoding, &[job], &[0], 1, &mut |_| {})
    };
    let (_, checks) = run(&roll).expect("clean snapshot resumes");
    assert_eq!((checks.checks, checks.hits), (1, 1));
    // Counted per continuation and per distinct snapshot, only for rows that were compared:
    // two rows of one snapshot (one hashed, one compared on the device), a row of another
    // snapshot in the next batch, and a row without a fingerprint.
    let (other, _) = roll
        .steps
        .iter()
        .enumerate()
        .find(|(t, s)| *t != pivot.pos && s.fingerprint.is_some())
        .expect("a second fingerprinted step");
    let start = |t: usize, verify: bool| Start {
        cache: &roll.cache,
        snap: roll.snapshot(t),
        expect: verify.then(|| roll.steps[t].fingerprint.unwrap()),
    };
    let jobs: Vec<Job> = [
        (pivot.pos, true),
        (pivot.pos, true),
        (other, true),
        (other, false),
    ]
    .iter()
    .enumerate()
    .map(|(k, &(t, verify))| Job {
        start: start(t, verify),
        first_token: pivot.token,
        key: NoiseKey {
            sample: k as u64,
            ..params.key
        },
    })
    .collect();
    let batches = vec![vec![1, 0, 3], vec![2]];
    let r =
        engine::run_batches(&decoding, &jobs, &batches, &Default::default(), &mut |_| {}).unwrap();
    assert_eq!(r.verified, vec![true, true, true, false]);
    assert_eq!(
        (
            r.checks.checks,
            r.checks.hits,
            r.checks.snapshots,
            r.checks.snapshot_hits
        ),
        (3, 3, 2, 2)
    );
    let at: Vec<(u32, u32, u32)> = r
        .placements
        .iter()
        .map(|p| (p.chunk, p.row, p.batch_rows))
        .collect();
    assert_eq!(at, vec![(0, 1, 3), (0, 0, 3), (1, 0, 1), (0, 2, 3)]);
    roll.cache.corrupt_for_test(3, 0, 5).unwrap();
    match run(&roll) {
        Err(Error::Invariant(msg)) => assert!(msg.contains("fingerprint mismatch"), "{msg}"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a corrupted snapshot was accepted"),
    }
}

/// `run_queue` under the batch-invariant policy, eager and static, on 2 rows over 6 jobs:
/// every job's outcome is bitwise that of the job run alone, though rows were reloaded with
/// shorter snapshots than the jobs before them (stale K/V beyond a row's length would change
/// the tokens), one reloaded row was verified on the device against a resident row of the
/// same snapshot, and a job whose branch token is a stop token ended at once and gave its row
/// to the next job. Negative control: a wrong expected fingerprint on a job reached only by
/// refill is an invariant error.
#[test]
fn refill_queue_is_bitwise_each_job_alone_under_batch_invariant() {
    use kvcredit::decode::engine::{EngineMode, EngineOptions};
    let m = model();
    let policy = ExecPolicy::BatchInvariant(kvcredit::exec::BiTiles::CPU);
    let prompt: Vec<i64> = (1..30).collect();
    let params = RolloutParams {
        sampling: Sampling::Greedy,
        max_new_tokens: 12,
        key: NoiseKey::rollout(1, 0),
        stop_tokens: &[],
        special_tokens: &[],
        text_stop: None,
        policy,
        max_margin: 1.0,
        alternatives: 1,
    };
    let roll = rollout::rollout(&m.decoder, &prompt, &params).unwrap();
    // A second rollout of another, longer prompt: its K/V are unrelated to the first's.
    let other: Vec<i64> = (200..260).collect();
    let roll_b = rollout::rollout(&m.decoder, &other, &params).unwrap();
    let marked = |r: &rollout::Rollout| -> Vec<usize> {
        (0..r.steps.len())
            .filter(|&t| r.steps[t].fingerprint.is_some())
            .collect()
    };
    let (a, b) = (marked(&roll), marked(&roll_b));
    assert!(a.len() >= 2 && !b.is_empty(), "too few fingerprinted steps");
    // Jobs 0-1 resume the second rollout's longest snapshot, 2-3 a middle and 4-5 a short one
    // of the first. Job 0's branch token is a stop token, so row 0 takes job 2 (shorter) at
    // once while row 1 decodes job 1 (longer): job 0's stale K/V lie within the keys even the
    // eager step spans. Later job 4 (shorter) follows job 1 in row 1, and a job joins a
    // resident row of its own snapshot.
    let (long, mid, short) = (b[b.len() - 1], a[a.len() / 2], a[0]);
    let stop = roll.steps[0].token;
    let spots = [
        (&roll_b, long, stop),
        (&roll_b, long, 7),
        (&roll, mid, 5),
        (&roll, mid, 7),
        (&roll, short, 9),
        (&roll, short, 11),
    ];
    let jobs = |bad: Option<usize>| -> Vec<Job> {
        spots
            .iter()
            .enumerate()
            .map(|(k, &(r, t, first_token))| Job {
                start: Start {
                    cache: &r.cache,
                    snap: r.snapshot(t),
                    expect: Some(if bad == Some(k) {
                        [0; 32]
                    } else {
                        r.steps[t].fingerprint.unwrap()
                    }),
                },
                first_token,
                key: NoiseKey {
                    sample: k as u64,
                    ..params.key
                },
            })
            .collect()
    };
    let stops = [stop];
    let decoding = Decoding {
        model: &m.decoder,
        policy,
        sampling: Sampling::Temperature { temperature: 1.0 },
        max_new_tokens: 8,
        stop_tokens: &stops,
        text_stop: None,
    };
    let order: Vec<usize> = (0..spots.len()).collect();
    for mode in [EngineMode::Eager, EngineMode::Static] {
        let opts = EngineOptions::mode(mode);
        let all = jobs(None);
        let q = engine::run_queue(&decoding, &all, &order, 2, &opts, &mut |_| {}).unwrap();
        let alone: Vec<Vec<usize>> = order.iter().map(|&j| vec![j]).collect();
        let r = engine::run_batches(&decoding, &all, &alone, &opts, &mut |_| {}).unwrap();
        assert_eq!(q.outcomes, r.outcomes, "{mode}: queue ≠ each job alone");
        assert!(q.outcomes[0].tokens.is_empty());
        assert_eq!(q.verified, vec![true; spots.len()], "{mode}");
        let c = q.checks;
        assert_eq!(
            (c.checks, c.hits, c.snapshots, c.snapshot_hits),
            (6, 6, 3, 3)
        );
        // Job 1 (beside job 0, same snapshot) and a reloaded row at least were compared on
        // the device.
        assert!(
            q.stats.hashed_snapshots <= 4,
            "{mode}: {}",
            q.stats.describe()
        );
        let at: Vec<(u32, u32, u32, u32)> = q
            .placements
            .iter()
            .map(|p| (p.chunk, p.row, p.fill, p.batch_rows))
            .collect();
        assert!(at.iter().all(|&(c, _, _, b)| c == 0 && b == 2), "{at:?}");
        assert_eq!((at[0].1, at[0].2, at[2].1, at[2].2), (0, 0, 0, 1), "{at:?}");
        // A row reloaded with a shorter snapshot than the job before it.
        let shorter = at.iter().enumerate().any(|(j, &(_, row, fill, _))| {
            fill > 0
                && at.iter().enumerate().any(|(i, &(_, r2, f2, _))| {
                    r2 == row && f2 + 1 == fill && all[i].start.snap.len > all[j].start.snap.len
                })
        });
        assert!(shorter, "{mode}: no reload with a shorter snapshot: {at:?}");
        // Negative control: job 5 is reached only by refill.
        assert!(at[5].2 > 0, "{at:?}");
        match engine::run_queue(&decoding, &jobs(Some(5)), &order, 2, &opts, &mut |_| {}) {
            Err(Error::Invariant(msg)) => assert!(msg.contains("fingerprint mismatch"), "{msg}"),
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("{mode}: a wrong fingerprint was accepted"),
        }
        // Eight jobs of the longest snapshot on 3 rows, in step: the third row's second job
        // ends as the last two jobs start, and it steps on (2 of 3 rows live: no compaction)
        // for as long as they run, which must not outgrow the rows' capacity.
        let same: Vec<Job> = (0..8)
            .map(|k| Job {
                start: Start {
                    cache: &roll_b.cache,
                    snap: roll_b.snapshot(long),
                    expect: roll_b.steps[long].fingerprint,
                },
                first_token: 20 + k,
                key: NoiseKey {
                    sample: k as u64,
                    ..params.key
                },
            })
            .collect();
        let order: Vec<usize> = (0..same.len()).collect();
        let q = engine::run_queue(&decoding, &same, &order, 3, &opts, &mut |_| {}).unwrap();
        let alone: Vec<Vec<usize>> = order.iter().map(|&j| vec![j]).collect();
        let r = engine::run_batches(&decoding, &same, &alone, &opts, &mut |_| {}).unwrap();
        assert_eq!(
            q.outcomes, r.outcomes,
            "{mode}: queue of one snapshot ≠ each job alone"
        );
        assert_eq!(q.checks.hits, 8, "{mode}");
    }
}

#[test]
fn sigkilled_campaign_resumes_to_identical_parquet() {
    let (dir, reference, _) =
        sigkill_and_resume("kill", &spec_text("kill", "shuffled", 2), true, &[]);
    analyze_unfinished(&dir, &reference, &dir.join("killed"));
}

/// `analyze` on the killed run's copy (problem 0 of 2 done, no tables): alone it is refused in
/// one line; beside the finished run it is listed as not finished, and its finished shard is
/// read only with `--partial`, under its own label; a `failure` in its manifest (as a failed
/// invocation records it) is shown as why it stopped.
fn analyze_unfinished(dir: &Path, reference: &Path, killed: &Path) {
    let bin = env!("CARGO_BIN_EXE_kvcredit");
    let analyze = |out: &str, extra: &[&str], runs: &[&Path]| {
        let mut c = Command::new(bin);
        c.args(["analyze", "--reps", "50", "--out"])
            .arg(dir.join(out))
            .args(extra)
            .args(runs);
        let o = c.output().expect("binary runs");
        let report = std::fs::read_to_string(dir.join(out).join("report.md")).unwrap_or_default();
        (o, report)
    };
    let (alone, _) = analyze("a-alone", &[], &[killed]);
    let err = String::from_utf8_lossy(&alone.stderr);
    assert!(
        !alone.status.success(),
        "an unfinished run alone was analyzed"
    );
    assert!(
        err.trim().lines().count() == 1
            && err.contains("no finished run dir")
            && err.contains("--partial"),
        "{err}"
    );
    let (done, report) = analyze("a-done", &[], &[reference]);
    assert!(done.status.success());
    assert!(!report.contains("Configurations not finished"), "{report}");
    let (both, report) = analyze("a-both", &[], &[reference, killed]);
    assert!(
        both.status.success(),
        "{}",
        String::from_utf8_lossy(&both.stderr)
    );
    let listed = report
        .lines()
        .find(|l| l.starts_with("| kill |") && l.contains("1/2"))
        .unwrap_or_else(|| panic!("killed run not listed: {report}"));
    assert!(
        listed.contains("interrupted (resumable)") && listed.contains("| no |"),
        "{listed}"
    );
    assert!(!report.contains("kill (partial 1/2)"), "{report}");
    let path = killed.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    m["failure"] = "numerics: problem 1: non-finite logits during rollout step 0".into();
    std::fs::write(&path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    let (partial, report) = analyze("a-partial", &["--partial"], &[reference, killed]);
    assert!(
        partial.status.success(),
        "{}",
        String::from_utf8_lossy(&partial.stderr)
    );
    assert!(
        report.contains("stopped: numerics: problem 1: non-finite logits"),
        "{report}"
    );
    assert!(report.contains("| kill (partial 1/2) |"), "{report}");
}

/// Problems 0-1 and 2 in two pools (3 problems, `pool_problems = 2`): a SIGKILL after the first
/// pool's shards landed resumes to Parquet byte-identical to an uninterrupted run; so does a
/// run stopped between two shard commits of one pool (one shard of the pool and the tables
/// missing, not finished), which reruns the pool and writes only that shard.
#[test]
fn sigkilled_pooled_campaign_resumes_to_identical_parquet() {
    let text = small_spec_text("poolkill", 3, true);
    let (dir, reference, interrupted) = sigkill_and_resume("poolkill", &text, false, &[]);
    let bin = env!("CARGO_BIN_EXE_kvcredit");
    let kept = interrupted.join("shards/problem-00000/shard.json");
    let before = std::fs::read(&kept).unwrap();
    std::fs::remove_dir_all(interrupted.join("shards/problem-00001")).unwrap();
    for table in ["rollouts", "pivots", "continuations", "estimates"] {
        std::fs::remove_file(interrupted.join(format!("{table}.parquet"))).unwrap();
    }
    let path = interrupted.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    m["finished_at"] = serde_json::Value::Null;
    std::fs::write(&path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    let again = Command::new(bin)
        .args(["campaign", "run"])
        .arg(dir.join("spec.toml"))
        .args(["--quiet", "--out"])
        .arg(&interrupted)
        .output()
        .unwrap();
    assert!(
        again.status.success(),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert_eq!(
        std::fs::read(&kept).unwrap(),
        before,
        "a finished shard was rewritten"
    );
    assert!(interrupted.join("shards/problem-00001/shard.json").exists());
    for table in ["rollouts", "pivots", "continuations", "estimates"] {
        let a = std::fs::read(reference.join(format!("{table}.parquet"))).unwrap();
        let b = std::fs::read(interrupted.join(format!("{table}.parquet"))).unwrap();
        assert!(a == b, "{table}.parquet differs after rerunning a pool");
    }
    let manifest = std::fs::read_to_string(interrupted.join("manifest.json")).unwrap();
    assert!(manifest.contains(r#""pool_problems": 2"#), "{manifest}");
}

/// Run `text` (with the command-line arguments `extra`) to completion, then again SIGKILLed
/// once problem 0's shard landed and resumed; asserts byte-identical Parquet. Returns (scratch
/// dir, reference run, resumed run).
fn sigkill_and_resume(
    name: &str,
    text: &str,
    engine_check: bool,
    extra: &[&str],
) -> (PathBuf, PathBuf, PathBuf) {
    let bin = env!("CARGO_BIN_EXE_kvcredit");
    let dir = common::scratch("campaign", name);
    let spec = write_spec(&dir, text);
    let reference = dir.join("reference");
    let interrupted = dir.join("interrupted");
    let command = |out: &Path| {
        let mut c = Command::new(bin);
        c.args([
            "campaign",
            "run",
            spec.to_str().unwrap(),
            "--quiet",
            "--out",
            out.to_str().unwrap(),
        ])
        .args(extra);
        c
    };
    let run = |out: &Path| command(out).output().expect("binary runs");
    let ok = run(&reference);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    // Start again elsewhere and SIGKILL once the first problem's shard has landed.
    let mut child = command(&interrupted).spawn().unwrap();
    let first = interrupted.join("shards/problem-00000");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
    while !first.exists() && std::time::Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("campaign exited ({status}) before it could be killed");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(first.exists());
    assert!(
        !interrupted.join("estimates.parquet").exists(),
        "the run finished before it was killed"
    );
    // Kept as killed for `analyze_unfinished`.
    let copied = Command::new("cp")
        .arg("-a")
        .arg(&interrupted)
        .arg(dir.join("killed"))
        .status()
        .unwrap();
    assert!(copied.success());
    let resumed = run(&interrupted);
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    for table in ["rollouts", "pivots", "continuations", "estimates"] {
        let a = std::fs::read(reference.join(format!("{table}.parquet"))).unwrap();
        let b = std::fs::read(interrupted.join(format!("{table}.parquet"))).unwrap();
        assert!(a == b, "{table}.parquet differs after resume");
        let batches = read_batches(&reference.join(format!("{table}.parquet"))).unwrap();
        let names: Vec<String> = batches[0]
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().clone())
            .collect();
        let refill = extra.contains(&"--refill");
        assert_eq!(
            names,
            schema::run_columns(table, refill).unwrap(),
            "{table} columns"
        );
    }
    let manifest = std::fs::read_to_string(interrupted.join("manifest.json")).unwrap();
    assert!(manifest.contains("resumed_at"));
    assert!(manifest.contains(r#""engine": "eager""#), "{manifest}");
    if !engine_check {
        return (dir, reference, interrupted);
    }
    // A stock run resumes only under the engine it ran with (their rounding differs); checked
    // on a copy of the killed run (a finished one is final, under any engine).
    let unfinished = dir.join("killed-engine");
    let copied = Command::new("cp")
        .arg("-a")
        .arg(dir.join("killed"))
        .arg(&unfinished)
        .status()
        .unwrap();
    assert!(copied.success());
    let other = command(&unfinished)
        .env("KVCREDIT_ENGINE", "static")
        .output()
        .expect("binary runs");
    let err = String::from_utf8_lossy(&other.stderr);
    assert!(!other.status.success(), "resumed under another engine");
    assert!(
        err.starts_with("error:") && err.contains("KVCREDIT_ENGINE=eager"),
        "{err}"
    );
    (dir, reference, interrupted)
}

/// Every table's rows with the placement columns (chunk, row, batch_rows, fill) left out.
fn tables_without_placement(run: &Path) -> Vec<(String, Vec<arrow_array::RecordBatch>)> {
    let placement = schema::SCHEDULE_COLUMNS;
    ["rollouts", "pivots", "continuations", "estimates"]
        .iter()
        .map(|t| {
            let batches = read_batches(&run.join(format!("{t}.parquet")))
                .unwrap()
                .into_iter()
                .map(|b| {
                    let keep: Vec<usize> = (0..b.num_columns())
                        .filter(|&i| !placement.contains(&b.schema().field(i).name().as_str()))
                        .collect();
                    b.project(&keep).unwrap()
                })
                .collect();
            (t.to_string(), batches)
        })
        .collect()
}

/// Assert that two runs' four tables are non-empty and bitwise equal, all but the schedule
/// columns (placement and numerical path; `what` names the two schedules in the message).
fn assert_same_tables_but_placement(a: &Path, b: &Path, what: &str) {
    let (a, b) = (tables_without_placement(a), tables_without_placement(b));
    for ((name, x), (_, y)) in a.iter().zip(&b) {
        assert!(
            x.iter().map(|b| b.num_rows()).sum::<usize>() > 0,
            "{name} is empty"
        );
        assert_eq!(x, y, "{name} differs between {what}");
    }
}

/// Under the batch-invariant policy, pooling 3 problems' rollouts and continuations (pools of
/// 2: problems 0-1, then 2) gives bitwise the tables of per-problem scheduling, all but the
/// placement columns; the pooled replica still ran batches other than exact's, and exact's
/// pools did mix problems. Negative control: another seed changes the continuations, and the
/// same comparison catches it.
#[test]
fn pooled_scheduling_is_bitwise_per_problem_scheduling_under_batch_invariant() {
    let dir = common::scratch("campaign", "pool");
    // Batches of 5 over 4 jobs a problem: a pool of two problems must mix them in a batch.
    let base = small_spec_text("pool", 3, false)
        .replace(r#"policy = "stock""#, r#"policy = "batch_invariant""#)
        .replace("batch_size = 4\n", "batch_size = 5\n");
    let pooled_text = small_spec_text("pool", 3, true)
        .replace(r#"policy = "stock""#, r#"policy = "batch_invariant""#)
        .replace("batch_size = 4\n", "batch_size = 5\n");
    let (single, _) = run_spec(&dir, &base, "single");
    let (pooled, _) = run_spec(&dir, &pooled_text, "pooled");
    assert_same_tables_but_placement(&single, &pooled, "pooled and per-problem scheduling");
    // Exact's batches held continuations of two problems at once.
    use arrow_array::{StringArray, UInt32Array};
    let mut by_batch: std::collections::BTreeMap<(String, u32, u32), Vec<u32>> = Default::default();
    for b in read_batches(&pooled.join("continuations.parquet")).unwrap() {
        let pass: StringArray = common::column(&b, "pass");
        let chunk: UInt32Array = common::column(&b, "chunk");
        let problem: UInt32Array = common::column(&b, "problem");
        for i in 0..b.num_rows() {
            let group = problem.value(i) / 2;
            by_batch
                .entry((pass.value(i).to_string(), group, chunk.value(i)))
                .or_default()
                .push(problem.value(i));
        }
    }
    assert!(
        by_batch
            .iter()
            .any(|((p, _, _), probs)| p == "exact" && probs.iter().any(|&q| q != probs[0])),
        "no exact batch pooled two problems: {by_batch:?}"
    );
    // `check` passes the pooled run: placements per pool, and the replica's grouping differs
    // from exact's in every pool.
    let report = kvcredit::check::check_run(&pooled).unwrap();
    assert!(report.passed(), "{:#?}", report.violations);
    let manifest = std::fs::read_to_string(pooled.join("manifest.json")).unwrap();
    assert!(manifest.contains(r#""pool_problems": 2"#), "{manifest}");
    let manifest = std::fs::read_to_string(single.join("manifest.json")).unwrap();
    assert!(!manifest.contains("pool_problems"), "{manifest}");

    // Negative control.
    let (other, _) = run_spec(&dir, &base.replace("seed = 7", "seed = 8"), "other");
    let (a, c) = (
        tables_without_placement(&single),
        tables_without_placement(&other),
    );
    let differs: Vec<&str> = a
        .iter()
        .zip(&c)
        .filter(|((_, x), (_, y))| x != y)
        .map(|((n, _), _)| n.as_str())
        .collect();
    assert!(
        differs.contains(&"continuations"),
        "another seed went unnoticed: {differs:?}"
    );
}

/// A pooled SIGKILLed run with `--refill` resumes to byte-identical Parquet (with `fill`).
#[test]
fn sigkilled_refill_campaign_resumes_to_identical_parquet() {
    let text = small_spec_text("refillkill", 3, true);
    let (_, _, resumed) = sigkill_and_resume("refillkill", &text, false, &["--refill"]);
    let manifest = std::fs::read_to_string(resumed.join("manifest.json")).unwrap();
    assert!(manifest.contains(r#""refill": true"#), "{manifest}");
}

/// Per (pass, group of 2 problems) the continuations each row ran, in `fill` order, as sorted
/// sequences of "problem/pivot_pos/alt_rank/sample"; also whether any job was a refill.
type RowSequences = std::collections::BTreeMap<(String, u32), Vec<Vec<String>>>;

fn row_sequences(run: &Path) -> (RowSequences, bool) {
    use arrow_array::{StringArray, UInt32Array};
    type Rows = std::collections::BTreeMap<u32, Vec<(u32, String)>>;
    let mut by: std::collections::BTreeMap<(String, u32), Rows> = Default::default();
    let mut refilled = false;
    for b in read_batches(&run.join("continuations.parquet")).unwrap() {
        let pass: StringArray = common::column(&b, "pass");
        let u32s = |n: &str| -> UInt32Array { common::column(&b, n) };
        let (problem, pos, rank, sample) = (
            u32s("problem"),
            u32s("pivot_pos"),
            u32s("alt_rank"),
            u32s("sample"),
        );
        let (row, fill) = (u32s("row"), u32s("fill"));
        for i in 0..b.num_rows() {
            refilled |= fill.value(i) > 0;
            let who = format!(
                "{}/{}/{}/{}",
                problem.value(i),
                pos.value(i),
                rank.value(i),
                sample.value(i)
            );
            by.entry((pass.value(i).to_string(), problem.value(i) / 2))
                .or_default()
                .entry(row.value(i))
                .or_default()
                .push((fill.value(i), who));
        }
    }
    let seqs = by
        .into_iter()
        .map(|(k, rows)| {
            let mut v: Vec<Vec<String>> = rows
                .into_values()
                .map(|mut r| {
                    r.sort();
                    r.into_iter().map(|x| x.1).collect()
                })
                .collect();
            v.sort();
            (k, v)
        })
        .collect();
    (seqs, refilled)
}

/// Under the batch-invariant policy, a refill run of pooled problems (pairs; queues of 3 rows
/// over up to 8 continuations) gives bitwise the tables of the per-problem fixed-batch run,
/// all but the placement columns; `check` passes it; its replica's row sequences differ from
/// exact's in every group; the `fill` column is there, and a tampered one fails `check`;
/// the run folder is refused (in one line) to a run without refill, and `finished_run` finds it
/// only with refill.
#[test]
fn refill_pooled_campaign_is_bitwise_per_problem_scheduling_under_batch_invariant() {
    let dir = common::scratch("campaign", "refill");
    let bi = |pool: bool| {
        small_spec_text("refill", 3, pool)
            .replace(r#"policy = "stock""#, r#"policy = "batch_invariant""#)
            .replace("batch_size = 4\n", "batch_size = 3\n")
    };
    let (single, _) = run_spec(&dir, &bi(false), "single");
    let spec_path = write_spec(&dir, &bi(true));
    let (mut spec, sha) = CampaignSpec::load(&spec_path).unwrap();
    spec.passes.refill = true;
    let model = model();
    let refill = dir.join("refill");
    let run = |spec: &CampaignSpec| {
        kvcredit::credit::run_campaign(
            spec,
            &sha,
            &model,
            &kvcredit::credit::RunOptions {
                out_dir: refill.clone(),
                quiet: true,
                shard: None,
                exec: None,
            },
        )
    };
    let m = run(&spec).unwrap();
    assert_eq!(m.refill, Some(true));
    assert_same_tables_but_placement(&single, &refill, "refill and per-problem batches");
    let names: Vec<String> = read_batches(&refill.join("continuations.parquet")).unwrap()[0]
        .schema()
        .fields()
        .iter()
        .map(|f| f.name().clone())
        .collect();
    assert_eq!(names, schema::run_columns("continuations", true).unwrap());
    let report = kvcredit::check::check_run(&refill).unwrap();
    assert!(report.passed(), "{:#?}", report.violations);
    let (seqs, refilled) = row_sequences(&refill);
    assert!(refilled, "no row was refilled: {seqs:?}");
    for group in 0..2 {
        let of = |p: &str| &seqs[&(p.to_string(), group)];
        assert_ne!(of("exact"), of("replica"), "group {group}");
    }
    let manifest = std::fs::read_to_string(single.join("manifest.json")).unwrap();
    assert!(!manifest.contains(r#""refill":"#), "{manifest}");

    // Negative control: a row given the same fill twice.
    let tampered = dir.join("tampered");
    let copied = Command::new("cp")
        .arg("-a")
        .arg(&refill)
        .arg(&tampered)
        .status()
        .unwrap();
    assert!(copied.success());
    let path = tampered.join("continuations.parquet");
    let mut done = false;
    let batches: Vec<arrow_array::RecordBatch> = read_batches(&path)
        .unwrap()
        .into_iter()
        .map(|b| {
            use arrow_array::UInt32Array;
            let i = b.schema().index_of("fill").unwrap();
            let fill: UInt32Array = common::column(&b, "fill");
            let mut v: Vec<u32> = (0..fill.len()).map(|j| fill.value(j)).collect();
            if let Some(j) = v.iter().position(|&f| f > 0).filter(|_| !done) {
                v[j] = 0;
                done = true;
            }
            let mut cols = b.columns().to_vec();
            cols[i] = std::sync::Arc::new(UInt32Array::from(v));
            arrow_array::RecordBatch::try_new(b.schema(), cols).unwrap()
        })
        .collect();
    assert!(done);
    kvcredit::io::parquet::write_batches(&path, &batches).unwrap();
    let report = kvcredit::check::check_run(&tampered).unwrap();
    let placement: Vec<String> = report
        .violations
        .iter()
        .filter(|v| v.rule == kvcredit::check::Rule::Placement)
        .map(ToString::to_string)
        .collect();
    assert!(
        placement.iter().any(|v| v.contains("fills")),
        "{:#?}",
        report.violations
    );

    // The same spec without refill: not this finished run, and refused on resume.
    let mut plain = spec.clone();
    plain.passes.refill = false;
    assert!(
        kvcredit::credit::finished_run(&spec, &sha, &refill, None)
            .unwrap()
            .is_some()
    );
    assert!(
        kvcredit::credit::finished_run(&plain, &sha, &refill, None)
            .unwrap()
            .is_none()
    );
    let err = run(&plain).unwrap_err().to_string();
    assert!(
        err.contains("passes.refill = true") && !err.contains('\n'),
        "{err}"
    );
}

#[test]
fn estimates_load_in_polars_and_pandas() {
    let dir = common::scratch("campaign", "py");
    let (out, _) = run_spec(&dir, &spec_text("py", "shuffled", 1), "run");
    let python = std::env::var("KVCREDIT_PYTHON")
        .unwrap_or_else(|_| format!("{}/.venv/bin/python", env!("CARGO_MANIFEST_DIR")));
    let script = r#"
import sys, polars as pl, pandas as pd
run = sys.argv[1]
for t in ["rollouts", "pivots", "continuations", "estimates"]:
    a = pl.read_parquet(f"{run}/{t}.parquet")
    b = pd.read_parquet(f"{run}/{t}.parquet")
    assert len(a) == len(b), t
e = pl.read_parquet(f"{run}/estimates.parquet")
assert set(e["pass"].unique()) <= {"exact", "replica", "refeed"}
assert e["estimate"].is_between(-1, 1).all()
print("ok", len(e))
"#;
    let o = Command::new(python)
        .args(["-c", script, out.to_str().unwrap()])
        .output()
        .expect("python runs");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("ok"));
}

/// One column of a run's table as debug strings (`None` for nulls): utf8, bool, f64 and
/// list columns.
fn strings(run: &Path, table: &str, name: &str) -> Vec<Option<String>> {
    use arrow_array::{Array, BooleanArray, Float64Array, ListArray, StringArray};
    let mut out = Vec::new();
    for b in read_batches(&run.join(format!("{table}.parquet"))).unwrap() {
        let col = b.column(b.schema().index_of(name).unwrap()).clone();
        let any = col.as_any();
        for i in 0..col.len() {
            let v = if col.is_null(i) {
                None
            } else if let Some(a) = any.downcast_ref::<StringArray>() {
                Some(a.value(i).to_string())
            } else if let Some(a) = any.downcast_ref::<BooleanArray>() {
                Some(a.value(i).to_string())
            } else if let Some(a) = any.downcast_ref::<Float64Array>() {
                Some(format!("{:?}", a.value(i).to_bits()))
            } else if let Some(a) = any.downcast_ref::<ListArray>() {
                Some(format!("{:?}", a.value(i)))
            } else {
                panic!("{table}.{name}: unexpected type {:?}", col.data_type())
            };
            out.push(v);
        }
    }
    out
}

#[test]
fn truncated_setting_regrades_only_length_stopped_outputs() {
    let dir = common::scratch("campaign", "truncated");
    let run = |truncated: &str| {
        let text = spec_text(truncated, "shuffled", 1)
            .replace("temperature = 0.0", "temperature = 0.7")
            .replace(
                "[continuations]\n",
                &format!("[continuations]\ntruncated = \"{truncated}\"\n"),
            );
        let (out, m) = run_spec(&dir, &text, truncated);
        let manifest = std::fs::read_to_string(out.join("manifest.json")).unwrap();
        assert!(
            manifest.contains(&format!(r#""truncated": "{truncated}""#)),
            "{manifest}"
        );
        assert!(m.snapshot_checks > 0, "no pivots");
        out
    };
    let (last, explicit) = (run("last_number"), run("explicit"));
    let col = |run: &Path, name: &str| strings(run, "continuations", name);
    assert_eq!(col(&last, "tokens"), col(&explicit, "tokens"));
    let stops = col(&last, "stop");
    let rules = col(&last, "extraction_rule");
    let answers = col(&last, "answer");
    let (ok_last, ok_explicit) = (col(&last, "correct"), col(&explicit, "correct"));
    let mut length_rows = 0;
    for i in 0..stops.len() {
        // A rule is recorded exactly when an answer was found.
        assert_eq!(rules[i].is_some(), answers[i].is_some(), "row {i}");
        if stops[i].as_deref() != Some("length") {
            assert_eq!(ok_last[i], ok_explicit[i], "row {i}");
            continue;
        }
        length_rows += 1;
        let explicit_rule = matches!(rules[i].as_deref(), Some("boxed" | "hashes" | "answer_is"));
        let want = if explicit_rule {
            &ok_last[i]
        } else {
            &Some("false".into())
        };
        assert_eq!(&ok_explicit[i], want, "row {i}");
    }
    assert!(length_rows > 0, "no continuation hit the token cap");
    // Rollouts carry the rule too.
    let r = strings(&last, "rollouts", "extraction_rule");
    assert_eq!(r.len(), 1);
    assert_eq!(
        r[0].is_some(),
        strings(&last, "rollouts", "answer")[0].is_some()
    );
    // A sampled rollout (T = 0.7) records the margin at its temperature for every pivot.
    let margins = strings(&last, "pivots", "margin");
    let at_t = strings(&last, "pivots", "margin_at_temperature");
    assert!(!at_t.is_empty() && at_t.iter().all(Option::is_some));
    assert_ne!(margins, at_t);
}

/// A finished run is final: `run_campaign` returns it as it is, even with its shards deleted
/// (nothing is recomputed or written). Negative control: the same folder with `finished_at`
/// cleared is resumed, its shards recomputed, to byte-identical tables.
#[test]
fn a_finished_run_is_left_as_it_is() {
    let dir = common::scratch("campaign", "finished");
    let spec_path = dir.join("spec.toml");
    std::fs::write(&spec_path, common::tiny_campaign_spec("finished", 2)).unwrap();
    let (spec, sha) = CampaignSpec::load(&spec_path).unwrap();
    let model = model();
    let out = dir.join("run");
    common::run_campaign_file(&spec_path, &model, &out);
    let read = |f: &str| std::fs::read(out.join(f)).unwrap();
    let tables: Vec<Vec<u8>> = schema::TABLES
        .iter()
        .map(|t| read(&format!("{t}.parquet")))
        .collect();
    let manifest = read("manifest.json");
    std::fs::remove_dir_all(out.join("shards")).unwrap();

    assert!(
        kvcredit::credit::finished_run(&spec, &sha, &out, None)
            .unwrap()
            .is_some()
    );
    assert!(
        kvcredit::credit::finished_run(&spec, &"0".repeat(64), &out, None)
            .unwrap()
            .is_none(),
        "another spec's run is not this one"
    );
    let m = common::run_campaign_file(&spec_path, &model, &out);
    assert!(m.run.resumed_at.is_empty(), "{:?}", m.run.resumed_at);
    assert_eq!(read("manifest.json"), manifest, "manifest rewritten");
    assert!(!out.join("shards").exists(), "shards recomputed");

    let mut v: serde_json::Value = serde_json::from_slice(&manifest).unwrap();
    v["finished_at"] = serde_json::Value::Null;
    std::fs::write(
        out.join("manifest.json"),
        serde_json::to_string_pretty(&v).unwrap(),
    )
    .unwrap();
    assert!(
        kvcredit::credit::finished_run(&spec, &sha, &out, None)
            .unwrap()
            .is_none()
    );
    let m = common::run_campaign_file(&spec_path, &model, &out);
    assert_eq!(m.run.resumed_at.len(), 1);
    assert!(out.join("shards/problem-00001").exists(), "not resumed");
    for (t, before) in schema::TABLES.iter().zip(&tables) {
        assert!(
            &read(&format!("{t}.parquet")) == before,
            "{t}.parquet differs"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
