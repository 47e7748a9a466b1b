//! Your own task end to end: the worked example of `docs/guide/your-own-task.md` (a JSONL of
//! multiple-choice questions, a few-shot file, the choice grader) runs through `kvcredit eval
//! run`, a tiny campaign and `kvcredit analyze` on the CPU with SmolLM2-135M-Instruct; the
//! manifest and the report name the task and grader, and the campaign's grades are the choice
//! grader's. A bad mapping is refused in one line before anything is written.
mod common;

use arrow_array::{Array, BooleanArray, StringArray, UInt32Array};
use kvcredit::credit::CampaignSpec;
use kvcredit::credit::spec::Truncated;
use kvcredit::decode::engine::Stop;
use kvcredit::io::parquet::read_batches;
use kvcredit::tasks::{Grade, Task};
use std::path::{Path, PathBuf};

const GUIDE: &str = include_str!("../docs/guide/your-own-task.md");

/// The guide's files (a fenced block right after `<!-- file: NAME -->`), written to `dir`.
fn write_guide_files(dir: &Path) -> Vec<String> {
    let mut names = Vec::new();
    let mut lines = GUIDE.lines();
    while let Some(line) = lines.next() {
        let Some(name) = line
            .strip_prefix("<!-- file: ")
            .and_then(|r| r.strip_suffix(" -->"))
        else {
            continue;
        };
        let fence = lines.next().expect("a fenced block after the file marker");
        assert!(fence.starts_with("```"), "{name}: {fence}");
        let body: Vec<&str> = lines.by_ref().take_while(|l| *l != "```").collect();
        std::fs::write(dir.join(name), body.join("\n") + "\n").unwrap();
        names.push(name.to_string());
    }
    names
}

fn strings(path: &Path, col: &str) -> Vec<Option<String>> {
    read_batches(path)
        .unwrap()
        .iter()
        .flat_map(|b| {
            let a: StringArray = common::column(b, col);
            (0..a.len())
                .map(|i| (!a.is_null(i)).then(|| a.value(i).to_string()))
                .collect::<Vec<_>>()
        })
        .collect()
}

const CHOICE_RULES: [&str; 4] = ["boxed", "answer_is", "letter", "choice_text"];

#[test]
fn the_guides_own_task_runs_through_eval_campaign_and_analyze() {
    let dir = common::scratch("tasks", "guide");
    let files = write_guide_files(&dir);
    assert_eq!(
        files,
        [
            "capitals.jsonl",
            "shots.jsonl",
            "eval.toml",
            "campaign.toml"
        ]
    );
    let path = |p: &str| dir.join(p).to_string_lossy().into_owned();
    let data_sha = kvcredit::io::sha256_hex(&std::fs::read(dir.join("capitals.jsonl")).unwrap());

    // Eval.
    let rows = path("eval.parquet");
    let (code, out, err) = common::kvcredit(&["eval", "run", &path("eval.toml"), "--out", &rows]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("task `capitals`, grader `choice`, prompt chat, 1-shot"),
        "{out}"
    );
    assert!(
        out.contains(&format!("data sha256 {}", &data_sha[..12])),
        "{out}"
    );
    let problems: Vec<u32> = read_batches(Path::new(&rows))
        .unwrap()
        .iter()
        .flat_map(|b| {
            common::column::<UInt32Array>(b, "problem")
                .values()
                .to_vec()
        })
        .collect();
    assert_eq!(problems, [0, 1, 2]);
    for rule in strings(Path::new(&rows), "rule").into_iter().flatten() {
        assert!(CHOICE_RULES.contains(&rule.as_str()), "{rule}");
    }
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("eval.json")).unwrap()).unwrap();
    assert_eq!(summary["task"]["grader"], "choice");
    assert_eq!(summary["task"]["file_sha256"], data_sha.as_str());
    assert_eq!(summary["total"], 3);

    // Campaign: validate, run, analyze.
    let spec = path("campaign.toml");
    let (code, out, err) = common::kvcredit(&["campaign", "validate", &spec]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("3 problems (task `capitals`, grader choice, chat, 1-shot)"),
        "{out}"
    );
    let run = dir.join("run");
    let (code, _, err) = common::kvcredit(&[
        "campaign",
        "run",
        &spec,
        "--out",
        run.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{err}");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["task"]["name"], "capitals");
    assert_eq!(manifest["task"]["grader"], "choice");
    assert_eq!(manifest["task"]["file_sha256"], data_sha.as_str());

    // The rollouts were graded by the choice grader: regrading their texts gives the table.
    let (loaded, _) = CampaignSpec::load(Path::new(&spec)).unwrap();
    let (task, problems) = loaded.task().unwrap();
    let batches = read_batches(&run.join("rollouts.parquet")).unwrap();
    let mut graded = 0;
    for b in &batches {
        let ids: UInt32Array = common::column(b, "problem");
        let texts: StringArray = common::column(b, "text");
        let stops: StringArray = common::column(b, "stop");
        let rules: StringArray = common::column(b, "extraction_rule");
        let correct: BooleanArray = common::column(b, "correct");
        for i in 0..b.num_rows() {
            let p = &problems[ids.value(i) as usize];
            let stop = match stops.value(i) {
                "length" => Stop::Length,
                "text" => Stop::Text,
                _ => Stop::Eos,
            };
            let g: Grade = task.grade(p, texts.value(i));
            assert_eq!(
                (Truncated::default().correct(&g, stop), g.rule.as_deref()),
                (
                    correct.value(i),
                    (!rules.is_null(i)).then(|| rules.value(i))
                ),
                "{:?}",
                texts.value(i)
            );
            if let Some(r) = &g.rule {
                assert!(CHOICE_RULES.contains(&r.as_str()), "{r}");
            }
            graded += 1;
        }
    }
    assert_eq!(graded, 3);

    let (code, _, err) = common::kvcredit(&["analyze", run.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let report = std::fs::read_to_string(run.join("report.md")).unwrap();
    assert!(
        report.contains(
            "- `capitals-smollm2`: task `capitals`, grader `choice`, prompt chat, 1-shot"
        ),
        "{report}"
    );

    // The data file changed under the same spec: the finished run is not reused silently.
    std::fs::write(
        dir.join("capitals.jsonl"),
        GUIDE_ROWS_WITH_A_CHANGED_GOLD.trim_start(),
    )
    .unwrap();
    let (code, _, err) = common::kvcredit(&[
        "campaign",
        "run",
        &spec,
        "--out",
        run.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("data sha256"), "{err}");
}

const GUIDE_ROWS_WITH_A_CHANGED_GOLD: &str = r#"
{"id": "fr", "q": "What is the capital of France?", "options": ["Lyon", "Paris", "Nice", "Lille"], "gold": "A"}
{"id": "it", "q": "What is the capital of Italy?", "options": ["Rome", "Milan", "Turin", "Naples"], "gold": 0}
{"id": "de", "q": "What is the capital of Germany?", "options": ["Bonn", "Munich", "Berlin", "Hamburg"], "gold": "Berlin"}
"#;

#[test]
fn a_bad_mapping_is_refused_before_anything_is_written() {
    let dir = common::scratch("tasks", "refused");
    write_guide_files(&dir);
    let spec = std::fs::read_to_string(dir.join("campaign.toml")).unwrap();
    let cases: [(&str, String, &str); 4] = [
        (
            "field",
            spec.replace("answer = \"gold\"", "answer = \"solution\""),
            "row 0 has no field `solution` (task.fields.answer); its fields: gold, id, options, q",
        ),
        (
            "file",
            spec.replace("file = \"capitals.jsonl\"", "file = \"capitals.json\""),
            "capitals.json",
        ),
        (
            "grader",
            spec.replace("kind = \"choice\"", "kind = \"numeric\""),
            "gold answer `B` has text besides the number",
        ),
        (
            "both",
            spec.replace(
                "[task]\n",
                "[problems]\ncount = 2\nformat = \"zero-shot-chat\"\n\n[task]\n",
            ),
            "[problems] and [task] are both set",
        ),
    ];
    for (case, text, needle) in cases {
        let p: PathBuf = dir.join(format!("{case}.toml"));
        std::fs::write(&p, text).unwrap();
        let out = dir.join(format!("run-{case}"));
        for args in [
            vec![
                "campaign",
                "run",
                p.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
            ],
            vec!["campaign", "validate", p.to_str().unwrap()],
        ] {
            let (code, _, err) = common::kvcredit(&args);
            assert_eq!(code, 2, "{case}: {err}");
            assert_eq!(err.trim().lines().count(), 1, "{case}: {err}");
            assert!(err.contains(needle), "{case}: `{needle}` not in {err}");
        }
        assert!(!out.exists(), "{case}: the run folder was written");
    }
    let eval = std::fs::read_to_string(dir.join("eval.toml"))
        .unwrap()
        .replace("id = \"id\"", "id = \"key\"");
    std::fs::write(dir.join("bad-eval.toml"), eval).unwrap();
    let rows = dir.join("bad-eval.parquet");
    let (code, _, err) = common::kvcredit(&[
        "eval",
        "run",
        dir.join("bad-eval.toml").to_str().unwrap(),
        "--out",
        rows.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no field `key` (task.fields.id)"), "{err}");
    assert!(!rows.exists());
}
