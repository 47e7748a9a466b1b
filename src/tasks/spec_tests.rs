use super::*;
use crate::io::parquet::{Column, Table};

/// A fresh folder under the system temp dir for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvcredit-taskspec-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const CAPITALS: &str = r#"{"id": "fr", "q": "Capital of France?", "options": ["Lyon", "Paris", "Nice"], "gold": "B"}
{"id": "it", "q": "Capital of Italy?", "options": ["Rome", "Milan", "Turin"], "gold": 0}

{"id": "de", "q": "Capital of Germany?", "options": ["Bonn", "Munich", "Berlin"], "gold": "Berlin"}
"#;

fn spec(dir: &Path, extra: &str) -> TaskSpec {
    let text = format!(
        r#"name = "capitals"
file = "capitals.jsonl"
{extra}
[fields]
question = "q"
answer = "gold"
id = "id"
choices = "options"

[grader]
kind = "choice"
"#
    );
    let mut t: TaskSpec = toml::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
    t.resolve_paths(dir);
    t
}

fn load_err(t: &TaskSpec) -> String {
    let e = t.load().unwrap_err().to_string();
    assert_eq!(e.lines().count(), 1, "{e}");
    assert!(e.starts_with("spec: task `"), "{e}");
    e
}

#[test]
fn a_jsonl_file_loads_with_its_mapping_and_hash() {
    let dir = scratch("jsonl");
    std::fs::write(dir.join("capitals.jsonl"), CAPITALS).unwrap();
    let task = spec(&dir, "").load().unwrap();
    assert_eq!((task.name(), task.grader()), ("capitals", "choice"));
    let ids: Vec<&str> = task.problems().iter().map(|p| p.id.as_str()).collect();
    assert_eq!(ids, ["fr", "it", "de"]);
    let p = &task.problems()[1];
    assert_eq!((p.index, p.gold.as_str()), (1, "0"));
    assert_eq!(p.choices, ["Rome", "Milan", "Turin"]);
    let rec = task.record();
    assert_eq!(
        rec.file_sha256.as_deref(),
        Some(crate::io::sha256_hex(CAPITALS.as_bytes()).as_str())
    );
    assert_eq!(rec.prompt, "chat");
    // The gold may be a label, a 0-based index or a choice's text.
    for (i, want) in ['B', 'A', 'C'].into_iter().enumerate() {
        let p = &task.problems()[i];
        let g = task.grade(p, &format!("The answer is ({want})."));
        assert!(g.correct, "{p:?}: {g:?}");
        assert!(!task.grade(p, "The answer is (D).").correct);
    }
    // start/count select rows; row indices stay file positions.
    let part = spec(&dir, "start = 1\ncount = 2").load().unwrap();
    assert_eq!(part.problems()[0].index, 1);
    assert_eq!(part.problems().len(), 2);
}

#[test]
fn prompts_follow_the_recipe() {
    let dir = scratch("prompt");
    std::fs::write(dir.join("capitals.jsonl"), CAPITALS).unwrap();
    std::fs::write(
        dir.join("shots.jsonl"),
        r#"{"id": "es", "q": "Capital of Spain?", "options": ["Madrid", "Seville"], "gold": "A"}"#,
    )
    .unwrap();
    let chat = spec(
        &dir,
        "[prompt]\nsystem = \"Be brief.\"\ntemplate = \"{question}\\n{choices}\\nPut the letter in \\\\boxed{}.\"\nfewshot = \"shots.jsonl\"\nexample_answer = \"\\\\boxed{{letter}}\"\n",
    )
    .load()
    .unwrap();
    let Prompt::Chat { messages } = chat.prompt(&chat.problems()[0]) else {
        panic!("chat expected")
    };
    let turns: Vec<(&str, &str)> = messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    assert_eq!(
        turns,
        [
            ("system", "Be brief."),
            (
                "user",
                "Capital of Spain?\nA. Madrid\nB. Seville\nPut the letter in \\boxed{}."
            ),
            ("assistant", "\\boxed{A}"),
            (
                "user",
                "Capital of France?\nA. Lyon\nB. Paris\nC. Nice\nPut the letter in \\boxed{}."
            ),
        ]
    );
    assert_eq!(chat.record().prompt, "chat, 1-shot");
    let text = spec(
        &dir,
        "[prompt]\nstyle = \"text\"\ntemplate = \"Q: {question}\\nA:\"\nfewshot = \"shots.jsonl\"\nexample_answer = \" {letter}\"\nstop = [\"Q:\"]\nmax_new_tokens = 5\n",
    )
    .load()
    .unwrap();
    let Prompt::Text { text: t } = text.prompt(&text.problems()[2]) else {
        panic!("text expected")
    };
    assert_eq!(
        t,
        "Q: Capital of Spain?\nA: A\n\nQ: Capital of Germany?\nA:"
    );
    assert_eq!(text.max_new_tokens(), 5);
    assert_eq!(text.stop_sequences()[0], "Q:");
    assert!(text.stop_sequences().iter().any(|s| s == "<|im_end|>"));
    // Output after a stop sequence is not graded.
    let p = &text.problems()[2];
    assert!(text.grade(p, " C\nQ: next? Answer: A").correct);
    assert!(!text.grade(p, " B\nQ: next? Answer: C").correct);
}

#[test]
fn fill_replaces_only_known_placeholders_once() {
    let q = "what is {answer}?".to_string();
    let a = "42".to_string();
    let out = fill(
        "{question} \\boxed{} {x} {answer}{",
        &[("question", &q), ("answer", &a)],
    );
    assert_eq!(out, "what is {answer}? \\boxed{} {x} 42{");
}

#[test]
fn a_parquet_file_loads_with_one_field_per_choice() {
    let dir = scratch("parquet");
    Table::new()
        .with("question", Column::Str(vec!["2+2?".into(), "3+3?".into()]))
        .with("a", Column::Str(vec!["3".into(), "6".into()]))
        .with("b", Column::Str(vec!["4".into(), "7".into()]))
        .with("answer", Column::I64(vec![1, 0]))
        .write(&dir.join("sums.parquet"))
        .unwrap();
    let t: TaskSpec = toml::from_str(
        "file = \"sums.parquet\"\n[fields]\nchoices = [\"a\", \"b\"]\n[grader]\nkind = \"choice\"\n",
    )
    .unwrap();
    let mut t = t;
    t.resolve_paths(&dir);
    let task = t.load().unwrap();
    assert_eq!(task.name(), "sums");
    let p = &task.problems()[0];
    assert_eq!((p.id.as_str(), p.gold.as_str()), ("sums-0", "1"));
    assert_eq!(p.choices, ["3", "4"]);
    assert!(task.grade(p, "Answer: B").correct);
    assert!(!task.grade(&task.problems()[1], "Answer: B").correct);
}

#[test]
fn bad_files_and_mappings_are_one_line_errors() {
    let dir = scratch("bad");
    std::fs::write(dir.join("capitals.jsonl"), CAPITALS).unwrap();
    let with_file = |name: &str, text: &str| {
        std::fs::write(dir.join(name), text).unwrap();
        let mut t = spec(&dir, "");
        t.file = Some(dir.join(name));
        t
    };
    let cases: Vec<(TaskSpec, &str)> = vec![
        (
            spec(&dir, "").tap(|t| t.file = Some(dir.join("none.jsonl"))),
            "none.jsonl",
        ),
        (
            with_file("x.csv", "q,gold\n"),
            "expected a .jsonl or .parquet",
        ),
        (with_file("empty.jsonl", "\n"), "has no rows"),
        (with_file("broken.jsonl", "{\"q\": \"x\",\n"), "line 1"),
        (with_file("array.jsonl", "[1, 2]\n"), "not a JSON object"),
        (
            with_file(
                "nogold.jsonl",
                "{\"id\": 1, \"q\": \"x\", \"options\": [\"a\", \"b\"]}\n",
            ),
            "row 0 has no field `gold` (task.fields.answer); its fields: id, options, q",
        ),
        (
            with_file(
                "badgold.jsonl",
                "{\"id\": 1, \"q\": \"x\", \"options\": [\"a\", \"b\"], \"gold\": \"Z\"}\n",
            ),
            "gold answer `Z` is not a label (AB)",
        ),
        (
            with_file(
                "dup.jsonl",
                "{\"id\": 1, \"q\": \"x\", \"options\": [\"a\", \"b\"], \"gold\": \"A\"}\n{\"id\": 1, \"q\": \"y\", \"options\": [\"a\", \"b\"], \"gold\": \"A\"}\n",
            ),
            "id `1` appears twice",
        ),
        (
            with_file(
                "qnum.jsonl",
                "{\"id\": 1, \"q\": 5, \"options\": [\"a\", \"b\"], \"gold\": \"A\"}\n",
            ),
            "is not a string",
        ),
        (
            with_file(
                "onechoice.jsonl",
                "{\"id\": 1, \"q\": \"x\", \"options\": [\"a\"], \"gold\": \"A\"}\n",
            ),
            "at least 2",
        ),
        (spec(&dir, "count = 9"), "rows 0..9 requested but"),
        (spec(&dir, "start = 3"), "rows 3..3 requested"),
        (spec(&dir, "count = 0"), "task.count must be positive"),
        (
            spec(&dir, "[prompt]\ntemplate = \"Q:\"\n"),
            "has no {question}",
        ),
        (
            spec(&dir, "[prompt]\nfewshot_count = 2\n"),
            "without task.prompt.fewshot",
        ),
        (
            spec(&dir, "[prompt]\nfewshot = \"missing-shots.jsonl\"\n"),
            "missing-shots.jsonl",
        ),
        (
            spec(
                &dir,
                "[prompt]\nfewshot = \"capitals.jsonl\"\nfewshot_count = 4\n",
            ),
            "fewshot_count = 4 but",
        ),
        (
            spec(
                &dir,
                "[prompt]\nfewshot = \"capitals.jsonl\"\nexample_answer = \"{solution}\"\n",
            ),
            "task.fields.solution is not set",
        ),
        (
            spec(&dir, "format = \"zero-shot-chat\""),
            "task.format is for bundled",
        ),
        (spec(&dir, "bundled = \"gsm8k\""), "not both"),
        (
            spec(&dir, "").tap(|t| t.grader = None),
            "needs [task.grader]",
        ),
        (
            spec(&dir, "").tap(|t| {
                t.grader = Some(GraderSpec::Numeric {
                    tolerance: 0.0,
                    relative_tolerance: 0.0,
                    units: vec![],
                })
            }),
            "gold answer `B` has text besides the number",
        ),
    ];
    for (t, needle) in cases {
        let e = load_err(&t);
        assert!(e.contains(needle), "`{needle}` not in: {e}");
    }
    let e = load_err(&spec(&dir, "").tap(|t| {
        t.fields.as_mut().unwrap().choices = None;
    }));
    assert!(e.contains("has no choices"), "{e}");
    let e = load_err(
        &spec(&dir, "[prompt]\ntemplate = \"{question} {choices}\"\n").tap(|t| {
            t.fields.as_mut().unwrap().choices = None;
            t.grader = Some(GraderSpec::Exact {
                case_sensitive: false,
                keep_articles: false,
                alternatives: None,
            });
        }),
    );
    assert!(e.contains("uses {choices}"), "{e}");
    let e = toml::from_str::<TaskSpec>("file = \"x.jsonl\"\nquestion = \"q\"\n").unwrap_err();
    assert!(e.to_string().contains("unknown field `question`"), "{e}");
}

#[test]
fn bundled_gsm8k_is_the_problems_table_task() {
    let t: TaskSpec =
        toml::from_str("bundled = \"gsm8k\"\nstart = 5\ncount = 3\nformat = \"eight-shot-cot\"\n")
            .unwrap();
    let task = t.load().unwrap();
    let old = Gsm8k::bundled(5..8, PromptFormat::EightShotCot).unwrap();
    assert_eq!(task.problems(), old.problems());
    for p in old.problems() {
        assert_eq!(task.prompt(p), old.prompt(p));
    }
    assert_eq!(task.stop_sequences(), old.stop_sequences());
    assert_eq!((task.name(), task.grader()), ("gsm8k", "numeric"));
    let rec = task.record();
    assert_eq!(
        (rec.prompt.as_str(), rec.file.as_deref()),
        ("eight-shot-cot", None)
    );
    assert_eq!(
        rec.file_sha256,
        Some(crate::io::sha256_hex(gsm8k::TEST_JSONL.as_bytes()))
    );
    for (text, needle) in [
        ("bundled = \"gsm8k\"\ncount = 2\n", "task.format"),
        (
            "bundled = \"gsm8k\"\ncount = 2\nformat = \"five-shot\"\n",
            "five-shot",
        ),
        (
            "bundled = \"gsm8k\"\nstart = 1318\ncount = 2\nformat = \"chat\"\n",
            "exceeds the 1319",
        ),
        (
            "bundled = \"math\"\nformat = \"chat\"\n",
            "unknown bundled task `math`",
        ),
        (
            "bundled = \"gsm8k\"\nformat = \"chat\"\n[grader]\nkind = \"exact\"\n",
            "task.grader is not used",
        ),
        (
            "name = \"mine\"\nbundled = \"gsm8k\"\nformat = \"chat\"\n",
            "task.name is not used",
        ),
        ("count = 2\n", "set task.bundled"),
    ] {
        let t: TaskSpec = toml::from_str(text).unwrap();
        let e = load_err(&t);
        assert!(e.contains(needle), "`{needle}` not in: {e}");
    }
}

/// `value.tap(f)`: `f` applied to a mutable `value`, which is returned.
trait Tap: Sized {
    fn tap(mut self, f: impl FnOnce(&mut Self)) -> Self {
        f(&mut self);
        self
    }
}

impl Tap for TaskSpec {}

#[test]
fn campaign_and_divergence_specs_take_a_task_table_relative_to_the_spec() {
    use crate::credit::CampaignSpec;
    use crate::divergence::spec::DivergenceSpec;
    let dir = scratch("specs");
    std::fs::create_dir_all(dir.join("data")).unwrap();
    std::fs::write(dir.join("data/capitals.jsonl"), CAPITALS).unwrap();
    let task = "[task]\nfile = \"data/capitals.jsonl\"\nstart = 1\n[task.fields]\nquestion = \"q\"\nanswer = \"gold\"\nchoices = \"options\"\n[task.grader]\nkind = \"choice\"\n";
    let div = format!(
        "name = \"d\"\nmodel = \"m\"\ndtypes = [\"fp32\"]\nseed = 1\nbatch_size = 2\nmax_new_tokens = 4\n[[strategies]]\nkind = \"greedy\"\n{task}"
    );
    std::fs::write(dir.join("div.toml"), &div).unwrap();
    let (spec, _) = DivergenceSpec::load(&dir.join("div.toml")).unwrap();
    let (t, problems) = spec.task().unwrap();
    assert_eq!(
        (t.name(), problems.len(), spec.first_index()),
        ("capitals", 2, 1)
    );
    let both = div.replace(
        "[task]\n",
        "[problems]\ncount = 1\nformat = \"chat\"\n[task]\n",
    );
    std::fs::write(dir.join("both.toml"), both).unwrap();
    let e = DivergenceSpec::load(&dir.join("both.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[problems] and [task] are both set"), "{e}");
    let neither = div.replace(task, "");
    std::fs::write(dir.join("neither.toml"), neither).unwrap();
    let e = DivergenceSpec::load(&dir.join("neither.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no [task]"), "{e}");
    let campaign = format!(
        "name = \"c\"\nmodel = \"m\"\ndtype = \"fp32\"\nseed = 1\n[rollout]\nmax_new_tokens = 4\n[pivots]\nmax_margin = 0.5\nmax_per_rollout = 1\n[continuations]\nk = 1\nmax_new_tokens = 2\ntemperature = 1.0\n[passes]\nrun = [\"exact\"]\nbatch_size = 2\n{task}"
    );
    std::fs::write(dir.join("campaign.toml"), &campaign).unwrap();
    let (spec, _) = CampaignSpec::load(&dir.join("campaign.toml")).unwrap();
    assert_eq!(spec.task().unwrap().1.len(), 2);
    // The recorded spec (manifest) round-trips without a `problems` key.
    let json = serde_json::to_string(&spec).unwrap();
    assert!(!json.contains("\"problems\""), "{json}");
    let back: CampaignSpec = serde_json::from_str(&json).unwrap();
    assert_eq!(back, spec);
    std::fs::write(
        dir.join("bad.toml"),
        campaign.replace("answer = \"gold\"", "answer = \"golden\""),
    )
    .unwrap();
    let e = CampaignSpec::load(&dir.join("bad.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no field `golden`"), "{e}");
}
