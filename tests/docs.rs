//! The documentation against the code: every `kvcredit SUBCOMMAND` in a ```sh block of the
//! README, the guides or a job list is a real subcommand (its `--help` exits 0), every
//! repository path they cite exists, every `make` target they name is in the Makefile, the
//! README's results tables carry each `results/<claim>/summary.json`'s numbers, and the GPU
//! runner parses and drives job lists. Each checker has a negative control that must fail.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The README and every guide.
fn documents() -> Vec<PathBuf> {
    let mut docs = vec![repo().join("README.md")];
    let mut guides: Vec<PathBuf> = std::fs::read_dir(repo().join("docs/guide"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    guides.sort();
    docs.extend(guides);
    docs
}

/// The lines of the ```sh blocks of a markdown text, with `\` continuations joined.
fn sh_lines(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut inside = false;
    let mut pending = String::new();
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("```") {
            inside = !inside && t.trim_start_matches('`').trim() == "sh";
            continue;
        }
        if !inside {
            continue;
        }
        let code = t.split(" # ").next().unwrap_or("").trim_end();
        if code.starts_with('#') {
            continue;
        }
        if let Some(head) = code.strip_suffix('\\') {
            pending.push_str(head);
            continue;
        }
        pending.push_str(code);
        if !pending.trim().is_empty() {
            out.push(std::mem::take(&mut pending));
        }
        pending.clear();
    }
    out
}

/// The subcommand paths (`campaign run`, `analyze`, …) a command line invokes: the words after
/// each `kvcredit` (or `./gpu/kvcredit`, `$(BIN)`) that are not options, paths or values.
fn subcommands(line: &str) -> Vec<Vec<String>> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let mut found = Vec::new();
    for (i, w) in words.iter().enumerate() {
        if !(w.ends_with("kvcredit") && !w.contains('.') || *w == "./gpu/kvcredit") {
            continue;
        }
        let mut path: Vec<String> = Vec::new();
        for next in &words[i + 1..] {
            let bare = next
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !next.starts_with('-');
            // A second word is a nested subcommand only for the commands that have them.
            let nests = path.len() == 1
                && [
                    "campaign",
                    "divergence",
                    "spectrum",
                    "bench",
                    "models",
                    "eval",
                ]
                .contains(&path[0].as_str());
            if bare && (path.is_empty() || nests) && !next.starts_with("runs") {
                path.push(next.to_string());
            } else {
                break;
            }
        }
        if !path.is_empty() {
            found.push(path);
        }
    }
    found
}

/// `bench` has nested subcommands but also runs on its own: `bench noise` is nested, while
/// `bench --synthetic` is not. Whether a word is a nested subcommand is the binary's call.
fn is_subcommand(path: &[String]) -> bool {
    let out = Command::new(env!("CARGO_BIN_EXE_kvcredit"))
        .args(path)
        .arg("--help")
        .output()
        .unwrap();
    out.status.success()
}

/// Repository paths a markdown file cites: relative link targets, and backticked words that
/// start with a top-level folder of the repository (placeholders and globs are skipped).
fn cited_paths(doc: &Path, text: &str) -> Vec<PathBuf> {
    const TOP: [&str; 11] = [
        "src/",
        "tests/",
        "docs/",
        "experiments/",
        "results/",
        "benches/",
        "slurm/",
        "data/",
        "kernels/",
        "notebooks/",
        ".ci/",
    ];
    let placeholder = |s: &str| {
        s.contains(['*', '<', '>', '{', '}', '$', '…', ' ', '|', '='])
            || [
                "NAME",
                "CLAIM",
                "PATH",
                "DIR",
                "SPEC",
                "MODEL",
                "FILE",
                "docs/runs/",
            ]
            .iter()
            .any(|p| s.contains(p))
    };
    let mut out = Vec::new();
    let dir = doc.parent().unwrap();
    // Prose: link targets and backticked paths, outside fenced blocks.
    let mut prose = String::new();
    let mut fenced = Vec::new();
    let mut inside = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            inside = !inside;
            continue;
        }
        if inside {
            fenced.push(line);
        } else {
            prose.push_str(line);
            prose.push('\n');
        }
    }
    let mut rest = prose.as_str();
    while let Some(i) = rest.find("](") {
        rest = &rest[i + 2..];
        let end = rest.find(')').unwrap_or(rest.len());
        let target = rest[..end].split('#').next().unwrap();
        if !target.is_empty() && !target.contains("://") && !placeholder(target) {
            out.push(dir.join(target));
        }
    }
    let words = prose
        .split('`')
        .skip(1)
        .step_by(2)
        .chain(fenced.iter().flat_map(|l| l.split_whitespace()));
    for w in words {
        let w = w.trim_matches(|c| "\"',;()".contains(c));
        if TOP.iter().any(|t| w.starts_with(t)) && !placeholder(w) {
            out.push(repo().join(w.split(':').next().unwrap()));
        }
    }
    out
}

fn make_targets() -> BTreeSet<String> {
    read(&repo().join("Makefile"))
        .lines()
        .filter_map(|l| l.split_once(':').map(|(t, _)| t))
        .filter(|t| !t.is_empty() && !t.contains([' ', '\t', '$', '.', '=', '#']))
        .map(str::to_string)
        .collect()
}

/// Problems with the commands of `lines`: unknown subcommands, missing make targets, scripts
/// that do not exist.
fn command_problems(lines: &[String]) -> Vec<String> {
    let targets = make_targets();
    let mut problems = Vec::new();
    let mut checked = BTreeSet::new();
    for line in lines {
        for path in subcommands(line) {
            // `bench X` and `eval X`: X may be an argument of the command itself.
            if checked.insert(path.clone()) && !is_subcommand(&path) {
                let argument = path.len() == 2
                    && ["bench", "eval"].contains(&path[0].as_str())
                    && is_subcommand(&path[..1]);
                if !argument {
                    problems.push(format!(
                        "`kvcredit {}` is no subcommand: {line}",
                        path.join(" ")
                    ));
                }
            }
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        for (i, w) in words.iter().enumerate() {
            if *w == "make" {
                for t in words[i + 1..].iter().take_while(|t| !t.starts_with('#')) {
                    if t.contains('=') || t.starts_with('-') || *t == "&&" {
                        continue;
                    }
                    if !targets.contains(*t) {
                        problems.push(format!("no make target `{t}`: {line}"));
                    }
                    break;
                }
            }
            if *w == "bash"
                && let Some(script) = words.get(i + 1)
                && !repo().join(script).exists()
            {
                problems.push(format!("no script {script}: {line}"));
            }
        }
    }
    problems
}

#[test]
fn every_documented_command_names_a_real_subcommand_target_or_script() {
    let mut lines = Vec::new();
    for doc in documents() {
        lines.extend(sh_lines(&read(&doc)));
    }
    for jobs in job_lists() {
        lines.extend(job_commands(&jobs));
    }
    let problems = command_problems(&lines);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(
        lines.iter().filter(|l| !subcommands(l).is_empty()).count() >= 30,
        "the README and guides show kvcredit commands"
    );
}

#[test]
fn a_made_up_subcommand_target_or_script_is_caught() {
    let bad = [
        "kvcredit frobnicate runs/x".to_string(),
        "kvcredit campaign frobnicate experiments/demo.toml".to_string(),
        "make frobnicate".to_string(),
        "bash experiments/frobnicate.sh".to_string(),
    ];
    let problems = command_problems(&bad);
    assert_eq!(problems.len(), 4, "{problems:?}");
    let good = [
        "kvcredit campaign run experiments/demo.toml --out runs/demo".to_string(),
        "kvcredit bench --synthetic qwen2.5-0.5b".to_string(),
        "make demo".to_string(),
    ];
    assert!(command_problems(&good).is_empty());
}

#[test]
fn every_cited_repository_path_exists() {
    let mut missing = Vec::new();
    let mut n = 0;
    for doc in documents() {
        for path in cited_paths(&doc, &read(&doc)) {
            n += 1;
            if !path.exists() {
                missing.push(format!("{}: {}", doc.display(), path.display()));
            }
        }
    }
    assert!(missing.is_empty(), "missing:\n{}", missing.join("\n"));
    assert!(n >= 50, "only {n} paths cited");
    // Negative control: a link and a backticked path that do not exist.
    let doc = repo().join("README.md");
    let fake = "see [x](docs/guide/nope.md) and `src/nope.rs`";
    let cited = cited_paths(&doc, fake);
    assert_eq!(cited.len(), 2);
    assert!(cited.iter().all(|p| !p.exists()));
}

fn job_lists() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(repo().join("experiments/jobs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "jobs"))
        .collect();
    v.sort();
    v
}

/// The commands of a job list, as `experiments/gpu-run.sh check` parses them.
fn job_commands(jobs: &Path) -> Vec<String> {
    let out = Command::new("bash")
        .arg(repo().join("experiments/gpu-run.sh"))
        .arg("check")
        .arg(jobs)
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        jobs.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.splitn(4, '\t').nth(3).map(str::to_string))
        .collect()
}

#[test]
fn every_claim_has_a_job_list_and_every_job_list_parses() {
    let claims: Vec<String> = std::fs::read_dir(repo().join("results"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(claims.len() >= 4);
    for claim in &claims {
        let dir = repo().join("results").join(claim);
        for f in ["README.md", "summary.json"] {
            assert!(dir.join(f).exists(), "results/{claim}/{f}");
        }
        assert!(
            repo()
                .join(format!("experiments/jobs/{claim}.jobs"))
                .exists()
                || claim == "spectrum",
            "results/{claim} has no experiments/jobs/{claim}.jobs"
        );
    }
    for jobs in job_lists() {
        assert!(!job_commands(&jobs).is_empty(), "{}", jobs.display());
    }
    // Negative control: a job line without a command is refused with exit 2.
    let dir = std::env::temp_dir().join(format!("kvcredit-docs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.jobs");
    std::fs::write(&bad, "# a comment\nlonely\n").unwrap();
    let out = Command::new("bash")
        .arg(repo().join("experiments/gpu-run.sh"))
        .args(["check", bad.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_gpu_runner_drives_a_job_list_in_order() {
    let dir = std::env::temp_dir().join(format!("kvcredit-gpurun-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_kvcredit"), dir.join("kvcredit")).unwrap();
    let jobs = dir.join("t.jobs");
    std::fs::write(
        &jobs,
        "bg - sleep 1; echo late > $R/bg.txt &\nversion - kvcredit --version\nwait\n\
         after - cat $R/bg.txt\nfails - kvcredit frobnicate\n",
    )
    .unwrap();
    let out = Command::new("bash")
        .arg(repo().join("experiments/gpu-run.sh"))
        .arg("drive")
        .arg(&jobs)
        .env("WORK", &dir)
        .current_dir(repo())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps = read(&dir.join("R/steps.txt"));
    // `bg` runs beside `version`; `wait` holds `after` until both ended.
    let order: Vec<&str> = steps
        .lines()
        .map(|l| l.split(':').next().unwrap())
        .collect();
    assert_eq!(order.len(), 4, "{steps}");
    assert_eq!(order[2..], ["after", "fails"], "{steps}");
    assert!(steps.contains("after: exit 0"), "{steps}");
    assert!(steps.contains("fails: exit 2"), "{steps}");
    assert!(read(&dir.join("R/logs/version.log")).starts_with("kvcredit "));
    assert!(read(&dir.join("R/logs/after.log")).contains("late"));
    assert!(dir.join("R/DONE").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The strings the README must show for a summary: intervals `[x, lo, hi]` of rates as
/// `x% [lo, hi]` (percent, one decimal), of percentage points (`_pp`) as `x [lo, hi]`; counts
/// `[a, b]` under `*identical*` / `niah*` / `*checks*` as `a/b`; ratios (`ratio*`) as `x.xx×`;
/// tokens/s as `28,498`; PPL changes (`*delta_pct*`) as `+x.xx`.
fn expected_strings(key: &str, v: &serde_json::Value, out: &mut Vec<String>) {
    use serde_json::Value;
    let num = |v: &Value| v.as_f64();
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                expected_strings(&format!("{key}/{k}"), v, out);
            }
        }
        Value::Array(a) if a.len() == 3 && a.iter().all(|x| x.is_number()) => {
            let (x, lo, hi) = (
                num(&a[0]).unwrap(),
                num(&a[1]).unwrap(),
                num(&a[2]).unwrap(),
            );
            if key.ends_with("_pp") {
                out.push(format!("{x:.1} [{lo:.1}, {hi:.1}]"));
            } else {
                out.push(format!(
                    "{:.1}% [{:.1}, {:.1}]",
                    x * 100.0,
                    lo * 100.0,
                    hi * 100.0
                ));
            }
        }
        Value::Array(a)
            if a.len() == 2
                && a.iter().all(|x| x.is_u64())
                && (key.contains("identical")
                    || key.contains("niah")
                    || key.contains("checks")) =>
        {
            out.push(format!("{}/{}", a[0], a[1]));
        }
        Value::Number(n) => {
            let x = n.as_f64().unwrap();
            let parent = key.rsplit('/').nth(1).unwrap_or("");
            if parent.starts_with("ratio") {
                out.push(format!("{x:.2}×"));
            } else if parent.contains("tokens_per_s") {
                let s = format!("{}", x.round() as i64);
                let mut grouped = String::new();
                for (i, c) in s.chars().enumerate() {
                    if i > 0 && (s.len() - i) % 3 == 0 {
                        grouped.push(',');
                    }
                    grouped.push(c);
                }
                out.push(grouped);
            } else if key.contains("delta_pct") {
                out.push(format!("{x:+.2}"));
            }
        }
        _ => {}
    }
}

fn readme_results_section() -> String {
    let readme = read(&repo().join("README.md")).replace('−', "-");
    let start = readme.find("\n## Results").expect("a Results section");
    let end = readme[start + 1..]
        .find("\n## ")
        .map_or(readme.len(), |e| start + 1 + e);
    readme[start..end].to_string()
}

#[test]
fn the_readme_results_tables_carry_every_summary() {
    let section = readme_results_section();
    let mut checked = 0;
    for entry in std::fs::read_dir(repo().join("results")).unwrap() {
        let dir = entry.unwrap().path();
        let claim = dir.file_name().unwrap().to_string_lossy().into_owned();
        let summary: serde_json::Value =
            serde_json::from_str(&read(&dir.join("summary.json"))).unwrap();
        assert!(
            section.contains(&format!("results/{claim}/")),
            "README Results does not link results/{claim}/"
        );
        let measured = summary["measured_at"].as_str().expect("measured_at");
        let date = &measured[..10];
        assert!(section.contains(date), "README lacks {claim}'s date {date}");
        let commit = measured.rsplit(' ').next().unwrap();
        assert!(
            section.contains(commit),
            "README lacks {claim}'s commit {commit}"
        );
        assert!(
            section.contains(&format!("experiments/regenerate.sh {claim}")),
            "README lacks {claim}'s regenerate command"
        );
        let mut want = Vec::new();
        expected_strings("", &summary, &mut want);
        assert!(!want.is_empty(), "{claim}: no numbers in summary.json");
        for s in &want {
            assert!(section.contains(s.as_str()), "README lacks {claim}'s {s}");
            checked += 1;
        }
    }
    assert!(checked >= 40, "only {checked} numbers checked");
}

#[test]
fn a_changed_summary_number_is_caught() {
    let section = readme_results_section();
    let summary: serde_json::Value =
        serde_json::from_str(&read(&repo().join("results/replica-floor/summary.json"))).unwrap();
    let mut changed = summary.clone();
    changed["runs"]
        .as_object_mut()
        .unwrap()
        .values_mut()
        .next()
        .unwrap()["replica_floor"][0] = serde_json::json!(0.376);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    expected_strings("", &summary, &mut a);
    expected_strings("", &changed, &mut b);
    assert!(a.iter().all(|s| section.contains(s.as_str())));
    assert!(b.iter().any(|s| !section.contains(s.as_str())));
}
