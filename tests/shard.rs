//! Sharded campaigns: `campaign run --shard i/N` runs and `campaign merge` reproduces an
//! unsharded run's Parquet byte for byte; merge refuses shards of another spec, overlapping
//! shards and missing problems, writing nothing; a bad `--shard` is refused before anything is
//! written; and the Slurm template (`slurm/submit.sh`) does the same on a real single-node
//! Slurm cluster the test starts (skipped, with a message, where Slurm or root is missing).
//!
//! A tiny CPU campaign (SmolLM2-135M-Instruct, 3 problems, a few tokens each) under the stock
//! policy: a problem's shard is computed by the same code, from the same inputs, whichever
//! shard or process runs it (the resume test in campaign.rs shows stock CPU runs reproduce
//! across processes), so no batch-invariant kernels are needed for byte identity here.
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_kvcredit");

/// The shared tiny SmolLM2 CPU campaign (`common::tiny_campaign_spec`).
fn spec_text() -> String {
    common::tiny_campaign_spec("shard", 3)
}

/// The unsharded reference run and the two shards, computed once for every test here.
struct Runs {
    root: PathBuf,
    spec: PathBuf,
    whole: PathBuf,
    shards: [PathBuf; 2],
}

fn ok(o: &Output, what: &str) {
    assert!(
        o.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

fn kvcredit(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("binary runs")
}

fn run(spec: &Path, out: &Path, shard: Option<&str>) -> Output {
    let mut args = vec![
        "campaign",
        "run",
        spec.to_str().unwrap(),
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ];
    if let Some(s) = shard {
        args.extend(["--shard", s]);
    }
    kvcredit(&args)
}

fn runs() -> &'static Runs {
    static RUNS: OnceLock<Runs> = OnceLock::new();
    RUNS.get_or_init(|| {
        let root = common::scratch("shard", "runs");
        let spec = root.join("spec.toml");
        std::fs::write(&spec, spec_text()).unwrap();
        let whole = root.join("whole");
        ok(&run(&spec, &whole, None), "unsharded run");
        let shards = [root.join("shard-0"), root.join("shard-1")];
        for (i, dir) in shards.iter().enumerate() {
            ok(
                &run(&spec, dir, Some(&format!("{i}/2"))),
                &format!("shard {i}/2"),
            );
        }
        Runs {
            root,
            spec,
            whole,
            shards,
        }
    })
}

/// Every Parquet file under `dir` (relative path → bytes).
fn parquet_files(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(base, &p, out);
            } else if p.extension().is_some_and(|x| x == "parquet") {
                out.insert(
                    p.strip_prefix(base).unwrap().to_path_buf(),
                    std::fs::read(&p).unwrap(),
                );
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// `merged` holds exactly the unsharded run's Parquet files (the four tables and every
/// per-problem shard), each byte-identical.
fn assert_same_parquet(whole: &Path, merged: &Path) {
    let (a, b) = (parquet_files(whole), parquet_files(merged));
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "different Parquet files"
    );
    for table in ["rollouts", "pivots", "continuations", "estimates"] {
        assert!(a.contains_key(Path::new(&format!("{table}.parquet"))));
    }
    assert_eq!(a.len(), 4 + 4 * 3, "4 tables + 4 per problem");
    for (path, bytes) in &a {
        assert!(bytes == &b[path], "{} differs", path.display());
    }
}

fn manifest(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap()
}

#[test]
fn two_shards_merge_byte_identical_to_the_unsharded_run() {
    let r = runs();
    // Round-robin: shard 0 holds positions 0 and 2, shard 1 position 1; recorded.
    let (m0, m1) = (manifest(&r.shards[0]), manifest(&r.shards[1]));
    assert_eq!(m0["shard"], serde_json::json!({"index": 0, "count": 2}));
    assert_eq!(m1["shard"], serde_json::json!({"index": 1, "count": 2}));
    assert_eq!(
        (m0["problems_total"].as_u64(), m0["problems_done"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(m1["problems_done"], 1);
    assert!(r.shards[0].join("shards/problem-00002").is_dir());
    assert!(!r.shards[0].join("shards/problem-00001").exists());
    assert!(manifest(&r.whole).get("shard").is_none());
    // Merged in either order.
    let merged = r.root.join("merged");
    let (s0, s1) = (r.shards[0].to_str().unwrap(), r.shards[1].to_str().unwrap());
    let o = kvcredit(&[
        "campaign",
        "merge",
        s1,
        s0,
        "--out",
        merged.to_str().unwrap(),
    ]);
    ok(&o, "merge");
    assert!(String::from_utf8_lossy(&o.stdout).contains("merged 2 shards"));
    assert_same_parquet(&r.whole, &merged);
    let m = manifest(&merged);
    let w = manifest(&r.whole);
    assert!(m.get("shard").is_none());
    assert_eq!(
        m["merged_from"],
        serde_json::json!([{"index": 1, "count": 2}, {"index": 0, "count": 2}])
    );
    for key in [
        "spec_sha256",
        "problems_total",
        "problems_done",
        "snapshot_checks",
        "snapshot_hits",
        "snapshot_checks_pivots",
        "snapshot_hits_pivots",
    ] {
        assert_eq!(m[key], w[key], "{key}");
    }
    // The merged folder is a complete run: `check` passes it, and merging again (into the same
    // --out) or resuming it as the unsharded campaign (nothing left to run) reproduces it.
    let report = kvcredit::check::check_run(&merged).unwrap();
    assert!(report.passed(), "{:#?}", report.violations);
    ok(
        &kvcredit(&[
            "campaign",
            "merge",
            s0,
            s1,
            "--out",
            merged.to_str().unwrap(),
        ]),
        "second merge",
    );
    assert_same_parquet(&r.whole, &merged);
    ok(&run(&r.spec, &merged, None), "resuming the merged folder");
    assert_same_parquet(&r.whole, &merged);
    assert_eq!(
        manifest(&merged)["merged_from"],
        serde_json::json!([{"index": 0, "count": 2}, {"index": 1, "count": 2}])
    );
}

/// A refused merge: one line on stderr containing `want`, exit code 2, nothing at `--out`.
fn refused(dirs: &[&Path], want: &str) {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let out = runs().root.join(format!("refused-{n}"));
    let mut args = vec!["campaign", "merge"];
    args.extend(dirs.iter().map(|d| d.to_str().unwrap()));
    args.extend(["--out", out.to_str().unwrap()]);
    let o = kvcredit(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.starts_with("error:") && err.trim_end().lines().count() == 1 && err.contains(want),
        "wanted one line with `{want}`: {err}"
    );
    assert!(!out.exists(), "a refused merge wrote {}", out.display());
}

/// A copy of run folder `src` at `dst`.
fn copy_run(src: &Path, dst: &Path) {
    let o = Command::new("cp")
        .args(["-r", src.to_str().unwrap(), dst.to_str().unwrap()])
        .output()
        .unwrap();
    ok(&o, "cp -r");
}

#[test]
fn merge_refuses_shards_of_another_spec() {
    let r = runs();
    // Shard 1 as if it had run a spec with other bytes (its manifest's sha256 edited).
    let other = r.root.join("other-spec");
    copy_run(&r.shards[1], &other);
    let mut m = manifest(&other);
    m["spec_sha256"] = "0123456789abcdef".repeat(4).into();
    std::fs::write(
        other.join("manifest.json"),
        serde_json::to_string_pretty(&m).unwrap(),
    )
    .unwrap();
    refused(
        &[&r.shards[0], &other],
        "ran a different spec (sha256 0123456789ab…)",
    );
}

#[test]
fn merge_refuses_overlapping_shards() {
    let r = runs();
    refused(
        &[&r.shards[0], &r.shards[1], &r.whole],
        "problem 0 is in both",
    );
    refused(&[&r.shards[1], &r.shards[1]], "problem 1 is in both");
}

#[test]
fn merge_refuses_missing_problems() {
    let r = runs();
    refused(
        &[&r.shards[0]],
        "1 of the spec's 3 problems are in none of the given runs (problem 1); the first missing, 1, belongs to shard 1/2",
    );
    // A shard whose run did not finish a problem.
    let partial = r.root.join("partial");
    copy_run(&r.shards[0], &partial);
    std::fs::remove_dir_all(partial.join("shards/problem-00002")).unwrap();
    refused(&[&partial, &r.shards[1]], "problem 2 of");
    refused(&[&r.root.join("nowhere")], "has no manifest.json");
}

#[test]
fn a_bad_shard_is_refused_before_anything_is_written() {
    let r = runs();
    for (shard, want) in [
        ("2/2", "i must be below N"),
        ("0/0", "N must be at least 1"),
        ("1", "expected i/N"),
        ("a/2", "expected i/N"),
        ("0/4", "the spec has 3 problems, so at most 3 shards"),
    ] {
        let out = r.root.join(format!("bad-{}", shard.replace('/', "-")));
        let o = run(&r.spec, &out, Some(shard));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "--shard {shard}: {err}");
        assert!(
            err.starts_with("error:") && err.trim_end().lines().count() == 1 && err.contains(want),
            "--shard {shard}: {err}"
        );
        assert!(!out.exists(), "--shard {shard} wrote {}", out.display());
    }
    // A shard's folder resumes only as that shard.
    let o = run(&r.spec, &r.shards[0], Some("1/2"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("holds shard 0/2 and this run asks for shard 1/2"),
        "{err}"
    );
    let o = run(&r.spec, &r.shards[0], None);
    assert!(String::from_utf8_lossy(&o.stderr).contains("asks for the whole campaign"));
}

/// A single-node Slurm cluster (munged, slurmctld, slurmd as root on localhost) under one
/// scratch folder; the daemons are stopped (by pid) on drop.
struct Slurm {
    dir: PathBuf,
    conf: PathBuf,
}

impl Slurm {
    /// Why a cluster cannot be started here, if it cannot.
    fn unavailable() -> Option<String> {
        let found = |b: &str| {
            Command::new("sh")
                .args(["-c", &format!("command -v {b} || test -x /usr/sbin/{b}")])
                .output()
                .is_ok_and(|o| o.status.success())
        };
        for b in ["munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo"] {
            if !found(b) {
                return Some(format!("`{b}` not found (apt-get install slurm-wlm munge)"));
            }
        }
        let uid = Command::new("id").arg("-u").output().unwrap();
        if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
            return Some("not root (slurmd must run as root)".into());
        }
        None
    }

    fn sbin(b: &str) -> String {
        let p = format!("/usr/sbin/{b}");
        if Path::new(&p).exists() { p } else { b.into() }
    }

    fn start(dir: PathBuf) -> Slurm {
        let munge = dir.join("munge");
        for d in ["munge", "state", "spool", "log"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let sh = |script: &str| {
            let o = Command::new("sh").args(["-c", script]).output().unwrap();
            ok(&o, script);
            String::from_utf8_lossy(&o.stdout).trim().to_string()
        };
        let m = munge.display();
        sh(&format!(
            "chmod 700 {m} && head -c 1024 /dev/urandom > {m}/munge.key && chmod 400 {m}/munge.key"
        ));
        let host = sh("hostname -s");
        let cpus = sh("nproc");
        // Ports away from the defaults (6817/6818), different per test process.
        let port = 20000 + 2 * (std::process::id() % 10000);
        let d = dir.display();
        let conf = dir.join("slurm.conf");
        std::fs::write(
            &conf,
            format!(
                "ClusterName=kvcredit-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={port}
SlurmdPort={}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={m}/socket
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
",
                port + 1
            ),
        )
        .unwrap();
        let c = conf.display();
        let slurm = Slurm {
            dir: dir.clone(),
            conf: conf.clone(),
        };
        sh(&format!(
            "{} --force -S {m}/socket --key-file={m}/munge.key --pid-file={m}/pid --log-file={m}/log --seed-file={m}/seed",
            Slurm::sbin("munged")
        ));
        sh(&format!("{} -c -f {c}", Slurm::sbin("slurmctld")));
        sh(&format!("{} -f {c}", Slurm::sbin("slurmd")));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let o = slurm.client("sinfo", &["-h", "-o", "%T"]);
            if String::from_utf8_lossy(&o.stdout).trim() == "idle" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the Slurm node never became idle: {}{}",
                String::from_utf8_lossy(&o.stdout),
                slurm.logs()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        slurm
    }

    fn client(&self, bin: &str, args: &[&str]) -> Output {
        Command::new(bin)
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .output()
            .expect("slurm client runs")
    }

    fn logs(&self) -> String {
        let mut s = String::new();
        for f in ["log/slurmctld.log", "log/slurmd.log"] {
            let text = std::fs::read_to_string(self.dir.join(f)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            s += &format!(
                "\n--- {f}\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        s
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for pid in ["slurmd.pid", "slurmctld.pid", "munge/pid"] {
            if let Ok(p) = std::fs::read_to_string(self.dir.join(pid)) {
                let _ = Command::new("kill").arg(p.trim()).status();
            }
        }
    }
}

#[test]
fn slurm_array_and_dependent_merge_reproduce_the_unsharded_run() {
    if let Some(why) = Slurm::unavailable() {
        eprintln!("SKIPPED slurm_array_and_dependent_merge_reproduce_the_unsharded_run: {why}");
        return;
    }
    let r = runs();
    let dir = common::scratch("shard", "slurm");
    let slurm = Slurm::start(dir.join("cluster"));
    let root = dir.join("run");
    let submit = Path::new(env!("CARGO_MANIFEST_DIR")).join("slurm/submit.sh");
    let o = Command::new(&submit)
        .args([r.spec.to_str().unwrap(), "2", root.to_str().unwrap()])
        .env("SLURM_CONF", &slurm.conf)
        .env("KVCREDIT", BIN)
        .env("ANALYZE_ARGS", "--reps 200")
        .output()
        .unwrap();
    ok(&o, "slurm/submit.sh");
    let ids = String::from_utf8_lossy(&o.stdout).trim().to_string();
    let (array, merge) = ids.split_once(' ').expect("two job ids");
    // Wait for both jobs to leave the queue.
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let q = slurm.client("squeue", &["-h", "-o", "%i %T %r"]);
        let text = String::from_utf8_lossy(&q.stdout).to_string();
        if text.trim().is_empty() {
            break;
        }
        assert!(
            !text.contains("DependencyNeverSatisfied"),
            "an array task failed: {text}\n{}",
            std::fs::read_to_string(root.join("logs/shard-0.out")).unwrap_or_default()
                + &std::fs::read_to_string(root.join("logs/shard-1.out")).unwrap_or_default()
        );
        assert!(Instant::now() < deadline, "jobs still queued: {text}");
        std::thread::sleep(Duration::from_secs(2));
    }
    let state = |job: &str| {
        let o = slurm.client("scontrol", &["show", "job", job]);
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let log = std::fs::read_to_string(root.join("logs/merge.out")).unwrap_or_default();
    let merge_state = state(merge);
    assert!(
        merge_state.contains("JobState=COMPLETED"),
        "merge job {merge}: {merge_state}\n{log}{}",
        slurm.logs()
    );
    // Both array tasks ran, as shards 0/2 and 1/2, and the merge followed them.
    let array_state = state(array);
    assert_eq!(
        array_state.matches("JobState=COMPLETED").count(),
        2,
        "{array_state}"
    );
    for i in 0..2 {
        assert_eq!(
            manifest(&root.join(format!("shard-{i}")))["shard"],
            serde_json::json!({"index": i, "count": 2})
        );
    }
    assert!(log.contains("merged 2 shards"), "{log}");
    assert_same_parquet(&r.whole, &root.join("merged"));
    assert!(
        root.join("report/report.md").is_file(),
        "analyze wrote no report: {log}"
    );
}

fn local_gpus(spec: &Path, root: &Path, compare: &Path) -> Output {
    Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("slurm/local-gpus.sh"))
        .args([spec.to_str().unwrap(), "2", root.to_str().unwrap()])
        .env("KVCREDIT", BIN)
        .env("GPUS", "")
        .env("COMPARE", compare)
        .output()
        .unwrap()
}

/// `slurm/local-gpus.sh` (one host, one process per shard) runs the Slurm template's scripts
/// without Slurm: two shards side by side merge byte-identically to the unsharded run, and its
/// own byte-identity check fails against a run whose Parquet differs in one byte.
#[test]
fn local_gpus_script_merges_byte_identical_and_its_check_catches_a_difference() {
    let r = runs();
    let root = r.root.join("local");
    let o = local_gpus(&r.spec, &root, &r.whole);
    ok(&o, "local-gpus.sh");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("byte-identical: 16 Parquet files"),
        "{stdout}"
    );
    assert_same_parquet(&r.whole, &root.join("merged"));
    assert!(root.join("report/report.md").is_file());
    let timing: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("local-gpus.json")).unwrap())
            .unwrap();
    assert_eq!(timing["shards"], 2);
    assert_eq!(timing["shard_seconds"].as_array().unwrap().len(), 2);

    // Negative control: the same finished shards (a rerun resumes them) checked against a copy
    // of the unsharded run with one byte of its estimates table changed.
    let again = r.root.join("local-again");
    std::fs::create_dir_all(&again).unwrap();
    for i in 0..2 {
        copy_run(
            &root.join(format!("shard-{i}")),
            &again.join(format!("shard-{i}")),
        );
    }
    let altered = r.root.join("whole-altered");
    copy_run(&r.whole, &altered);
    let table = altered.join("estimates.parquet");
    let mut bytes = std::fs::read(&table).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(&table, bytes).unwrap();
    let o = local_gpus(&r.spec, &again, &altered);
    assert!(!o.status.success(), "the check passed a differing table");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("estimates.parquet differs"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
