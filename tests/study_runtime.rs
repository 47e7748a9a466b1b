//! The study runtime under the three studies (release binary, CPU, SmolLM2-135M): a run
//! SIGKILLed once its first unit is committed resumes to tables byte-identical to an
//! uninterrupted run (credit campaign, divergence study, SpectrumKV ppl grid), and a run folder
//! holding another spec is refused in one line, non-zero, with nothing overwritten.
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const SPECTRUM: &str = r#"
name = "spectrum-resume"
model = "smollm2-135m-instruct"
dtype = "fp32"
device = "cpu"

[ppl]
context = 128
continuation = 16
windows = 3
budgets = [0.5]
policies = ["spectrum", "pdtrim"]
quantizers = ["kivi"]
"#;

const DIVERGENCE: &str = r#"
name = "divergence-resume"
model = "smollm2-135m-instruct"
dtypes = ["fp32"]
device = "cpu"
policy = "stock"
seed = 13
batch_size = 1
max_new_tokens = 6

[problems]
start = 0
count = 3
format = "zero-shot-chat"

[[strategies]]
kind = "greedy"

[steps]
teacher_forced = true
"#;

/// A study's command line: `args` then `--quiet --out <out>`.
struct Study {
    args: Vec<String>,
}

impl Study {
    fn new(dir: &Path, words: &[&str], spec_text: &str) -> Study {
        let spec = dir.join("spec.toml");
        std::fs::write(&spec, spec_text).unwrap();
        let mut args: Vec<String> = words.iter().map(|w| w.to_string()).collect();
        args.push(spec.display().to_string());
        Study { args }
    }

    fn command(&self, out: &Path) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvcredit"));
        c.args(&self.args).arg("--quiet").arg("--out").arg(out);
        c
    }

    fn run(&self, out: &Path) -> std::process::Output {
        self.command(out).output().expect("binary runs")
    }
}

/// Finished shards (folders not starting with `.`) under `shards`, recursively one level for
/// grids (`shards/<grid>/<unit>`).
fn units(shards: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(shards) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .filter(|e| e.path().join("shard.json").exists())
        .count()
}

/// The `.parquet` files directly in `dir` (name → bytes).
fn tables(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".parquet"))
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

/// Run `study` uninterrupted, then again SIGKILLed once `shards` (relative to the run folder)
/// holds a finished unit and before the run finished, then rerun it; asserts the rerun
/// skipped the finished unit and wrote tables byte-identical to the uninterrupted run's.
fn sigkill_and_resume(group: &str, study: &Study, shards: &str, total: usize) -> PathBuf {
    let dir = common::scratch("study-runtime", group);
    let reference = dir.join("reference");
    let ok = study.run(&reference);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        stdout
            .trim_end()
            .ends_with(&format!("outputs are in {}", reference.display())),
        "{stdout}"
    );
    assert_eq!(units(&reference.join(shards)), total);
    let want = tables(&reference);
    assert!(!want.is_empty());

    let killed = dir.join("killed");
    let mut child = study.command(&killed).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(600);
    while units(&killed.join(shards)) == 0 && Instant::now() < deadline {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("{group} exited ({status}) before it could be killed");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let done = units(&killed.join(shards));
    assert!(
        (1..total).contains(&done),
        "{group}: {done} of {total} units when killed; the kill did not interrupt the run"
    );
    for name in want.keys() {
        assert!(!killed.join(name).exists(), "{name} written before the end");
    }
    let first = std::fs::read_dir(killed.join(shards))
        .unwrap()
        .flatten()
        .find(|e| e.path().join("shard.json").exists())
        .unwrap()
        .path()
        .join("shard.json");
    let before = std::fs::metadata(&first).unwrap().modified().unwrap();

    let resumed = study.run(&killed);
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    assert_eq!(
        std::fs::metadata(&first).unwrap().modified().unwrap(),
        before,
        "{group}: the finished unit was computed again"
    );
    let got = tables(&killed);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (name, bytes) in &want {
        assert!(&got[name] == bytes, "{group}: {name} differs after resume");
    }
    dir
}

/// A second spec in the run folder of a finished run: one line, non-zero, nothing touched.
fn other_spec_is_refused(dir: &Path, other: &Study, manifest: &str) {
    let out = dir.join("reference");
    let before: BTreeMap<String, Vec<u8>> = tables(&out);
    let manifest = out.join(manifest);
    let m = std::fs::read(&manifest).unwrap();
    let r = other.run(&out);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success());
    assert!(
        err.trim().lines().count() == 1 && err.contains("different spec"),
        "{err}"
    );
    assert_eq!(tables(&out), before, "tables overwritten");
    assert_eq!(std::fs::read(&manifest).unwrap(), m, "manifest overwritten");
}

#[test]
fn sigkilled_spectrum_ppl_grid_resumes_to_identical_parquet() {
    let dir = common::scratch("study-runtime", "spectrum-spec");
    let study = Study::new(&dir, &["spectrum", "ppl"], SPECTRUM);
    let run = sigkill_and_resume("spectrum", &study, "shards/ppl", 3);
    let other = Study::new(
        &dir,
        &["spectrum", "ppl"],
        &SPECTRUM.replace("windows = 3", "windows = 2"),
    );
    other_spec_is_refused(&run, &other, "ppl.manifest.json");
}

#[test]
fn sigkilled_divergence_study_resumes_to_identical_parquet() {
    let dir = common::scratch("study-runtime", "divergence-spec");
    let study = Study::new(&dir, &["divergence", "run"], DIVERGENCE);
    let run = sigkill_and_resume("divergence", &study, "shards", 3);
    let other = Study::new(
        &dir,
        &["divergence", "run"],
        &DIVERGENCE.replace("seed = 13", "seed = 14"),
    );
    other_spec_is_refused(&run, &other, "manifest.json");
}

#[test]
fn sigkilled_credit_campaign_resumes_to_identical_parquet() {
    let dir = common::scratch("study-runtime", "credit-spec");
    let text = common::tiny_campaign_spec("credit-resume", 3);
    let study = Study::new(&dir, &["campaign", "run"], &text);
    let run = sigkill_and_resume("credit", &study, "shards", 3);
    let other = Study::new(
        &dir,
        &["campaign", "run"],
        &text.replace("seed = 7", "seed = 8"),
    );
    other_spec_is_refused(&run, &other, "manifest.json");
}
