use super::*;

fn problem(gold: &str, choices: &[&str]) -> Problem {
    Problem {
        id: "t-0".into(),
        index: 0,
        question: "?".into(),
        solution: String::new(),
        gold: gold.into(),
        choices: choices.iter().map(|c| c.to_string()).collect(),
    }
}

fn grader(toml_text: &str) -> Grader {
    toml::from_str::<GraderSpec>(toml_text)
        .unwrap_or_else(|e| panic!("{toml_text}: {e}"))
        .build()
        .unwrap()
}

/// One case: output, gold, whether it is correct, the rule that must fire (`None`: no answer).
type Case<'a> = (&'a str, &'a str, bool, Option<&'a str>);

/// Grade every case; returns (cases, cases that must not match).
fn check(g: &Grader, choices: &[&str], cases: &[Case<'_>]) -> (usize, usize) {
    for &(output, gold, correct, rule) in cases {
        let got = g.grade(&problem(gold, choices), output);
        assert_eq!(
            (got.correct, got.rule.as_deref()),
            (correct, rule),
            "{} on {output:?} (gold {gold:?}): {got:?}",
            g.name()
        );
    }
    let negatives = cases.iter().filter(|c| !c.2).count();
    assert!(negatives >= 1 && negatives < cases.len());
    (cases.len(), negatives)
}

#[test]
fn numeric_grader_keeps_the_gsm8k_rules_and_adds_tolerance() {
    let exact = grader("kind = \"numeric\"");
    let (n, neg) = check(
        &exact,
        &[],
        &[
            ("So 18 eggs.\n#### 18", "18", true, Some("hashes")),
            ("The answer is $1,600.", "1600", true, Some("answer_is")),
            ("\\boxed{18.00}", "18", true, Some("boxed")),
            ("\\boxed{\\frac{3}{4}}", "0.75", true, Some("boxed")),
            (
                "#### Step 1\nShe has 5 left",
                "5",
                true,
                Some("last_number"),
            ),
            ("The answer is 3.14", "3.14159", false, Some("answer_is")),
            ("```python\nprint(16 - 3 - 4)\n```", "9", false, None),
            (
                "21-15 = 6 so the answer is 6",
                "-6",
                false,
                Some("answer_is"),
            ),
        ],
    );
    let tol = grader("kind = \"numeric\"\ntolerance = 0.01");
    let (n2, neg2) = check(
        &tol,
        &[],
        &[
            ("The answer is 3.14", "3.14159", true, Some("answer_is")),
            ("The answer is 3.1", "3.14159", false, Some("answer_is")),
            ("no number here", "3", false, None),
        ],
    );
    let rel = grader("kind = \"numeric\"\nrelative_tolerance = 0.01");
    let (n3, neg3) = check(
        &rel,
        &[],
        &[
            ("\\boxed{1005}", "1000", true, Some("boxed")),
            ("\\boxed{1011}", "1000", false, Some("boxed")),
        ],
    );
    // Units: a gold with a unit word is refused unless the unit is listed.
    let cm = grader("kind = \"numeric\"\nunits = [\"cm\"]");
    assert!(cm.check_gold(&problem("12 cm", &[])).is_ok());
    let e = exact.check_gold(&problem("12 cm", &[])).unwrap_err();
    assert!(e.contains("task.grader.units"), "{e}");
    assert!(cm.check_gold(&problem("12 apples", &[])).is_err());
    assert!(exact.check_gold(&problem("twelve", &[])).is_err());
    assert!(exact.check_gold(&problem("$1,600", &[])).is_ok());
    let (n4, neg4) = check(
        &cm,
        &[],
        &[
            (
                "It is 12 cm long. The answer is 12 cm.",
                "12 cm",
                true,
                Some("answer_is"),
            ),
            ("The answer is 13 cm.", "12 cm", false, Some("answer_is")),
        ],
    );
    eprintln!(
        "numeric: {} cases, {} must not match",
        n + n2 + n3 + n4,
        neg + neg2 + neg3 + neg4
    );
}

#[test]
fn exact_grader_normalizes_and_reads_the_final_answer() {
    let g = grader("kind = \"exact\"");
    let (n, neg) = check(
        &g,
        &[],
        &[
            (
                "The capital of France is... The answer is **Paris**.",
                "Paris",
                true,
                Some("answer_is"),
            ),
            (
                "Answer: the Eiffel Tower!",
                "Eiffel tower",
                true,
                Some("answer_is"),
            ),
            (
                "I think it is\n\\boxed{\\text{Mount Everest}}",
                "mount everest",
                true,
                Some("boxed"),
            ),
            ("Let me think.\nparis", "Paris", true, Some("last_line")),
            (
                "The answer is Parisian cuisine.",
                "Paris",
                false,
                Some("answer_is"),
            ),
            (
                "It's not Paris, it's Lyon",
                "Paris",
                false,
                Some("last_line"),
            ),
            (
                "The answer is: Lyon. Paris was wrong.",
                "Paris",
                false,
                Some("answer_is"),
            ),
            ("", "Paris", false, None),
            ("Answer: ...", "...", false, Some("answer_is")),
        ],
    );
    let cs = grader("kind = \"exact\"\ncase_sensitive = true\nkeep_articles = true");
    let (n2, neg2) = check(
        &cs,
        &[],
        &[
            ("Answer: PARIS", "Paris", false, Some("answer_is")),
            ("Answer: The Hague", "Hague", false, Some("answer_is")),
            ("Answer: The Hague", "The Hague", true, Some("answer_is")),
        ],
    );
    let alt = grader("kind = \"exact\"\nalternatives = \"|\"");
    let (n3, neg3) = check(
        &alt,
        &[],
        &[
            (
                "Answer: NYC",
                "New York City|NYC|New York",
                true,
                Some("answer_is"),
            ),
            (
                "Answer: York",
                "New York City|NYC|New York",
                false,
                Some("answer_is"),
            ),
        ],
    );
    eprintln!(
        "exact: {} cases, {} must not match",
        n + n2 + n3,
        neg + neg2 + neg3
    );
}

#[test]
fn choice_grader_reads_letters_and_ignores_words() {
    let g = grader("kind = \"choice\"");
    let four = ["Paris", "Lyon", "Nice", "Lille"];
    let (n, neg) = check(
        &g,
        &four,
        &[
            ("The answer is (A).", "A", true, Some("answer_is")),
            ("Answer: B", "1", true, Some("answer_is")),
            ("**Answer:** C", "Nice", true, Some("answer_is")),
            (
                "The correct option is D because Lille is north.",
                "D",
                true,
                Some("answer_is"),
            ),
            ("The answer is A cat, clearly.", "A", false, None),
            ("Final: $\\boxed{B}$", "B", true, Some("boxed")),
            ("\\boxed{\\text{(C)}}", "C", true, Some("boxed")),
            (
                "Looking at the options...\n(B)\n",
                "B",
                true,
                Some("letter"),
            ),
            ("I think\nC.", "C", true, Some("letter")),
            ("I think it is Lille", "D", false, None),
            ("Let me think.\nLille", "D", true, Some("choice_text")),
            ("Because I know it, a city is nice.", "B", false, None),
            ("The answer is E.", "A", false, None),
            ("The answer is A.", "B", false, Some("answer_is")),
            (
                "(A) is wrong, so the answer is (B)",
                "B",
                true,
                Some("answer_is"),
            ),
            ("The answer is a city in France.", "A", false, None),
        ],
    );
    // Golds that are no label, index or choice text are refused when the task loads.
    assert!(g.check_gold(&problem("Marseille", &four)).is_err());
    assert!(g.check_gold(&problem("7", &four)).is_err());
    assert!(g.check_gold(&problem("A", &[])).is_err());
    assert_eq!(g.gold_label(&problem("(d)", &four)), Ok('D'));
    let custom = grader("kind = \"choice\"\nlabels = \"WXYZ\"");
    let (n2, neg2) = check(
        &custom,
        &four,
        &[
            ("Answer: X", "X", true, Some("answer_is")),
            ("Answer: B", "X", false, None),
        ],
    );
    assert!(
        toml::from_str::<GraderSpec>("kind = \"choice\"\nlabels = \"AAB\"")
            .unwrap()
            .build()
            .is_err()
    );
    eprintln!("choice: {} cases, {} must not match", n + n2, neg + neg2);
}

#[test]
fn regex_grader_takes_the_last_capture() {
    let g = grader("kind = \"regex\"\npattern = 'RESULT:\\s*(\\w+)'");
    let (n, neg) = check(
        &g,
        &[],
        &[
            (
                "RESULT: blue\nwait\nRESULT: Red",
                "red",
                true,
                Some("regex"),
            ),
            ("RESULT: blue", "red", false, Some("regex")),
            ("result: red", "red", false, None),
        ],
    );
    let named = grader(
        "kind = \"regex\"\npattern = '(?i)(final)\\s+count\\s*=\\s*(?P<answer>-?[\\d,.]+)'\ncompare = \"numeric\"",
    );
    let (n2, neg2) = check(
        &named,
        &[],
        &[
            ("Final count = 1,200", "1200", true, Some("regex")),
            ("final count = 1200.0", "1200", true, Some("regex")),
            ("final count = 12", "1200", false, Some("regex")),
        ],
    );
    for bad in [
        "kind = \"regex\"\npattern = 'RESULT: \\w+'",
        "kind = \"regex\"\npattern = 'RESULT: (\\w+'",
    ] {
        let e = toml::from_str::<GraderSpec>(bad)
            .unwrap()
            .build()
            .unwrap_err()
            .to_string();
        assert!(e.contains("pattern") && e.lines().count() == 1, "{e}");
    }
    eprintln!("regex: {} cases, {} must not match", n + n2, neg + neg2);
}

#[test]
fn math_grader_normalizes_latex_answers() {
    let g = grader("kind = \"math\"");
    let (n, neg) = check(
        &g,
        &[],
        &[
            (
                "So $\\boxed{\\dfrac{1}{2}}$.",
                "\\frac12",
                true,
                Some("boxed"),
            ),
            ("\\boxed{\\tfrac12}", "0.5", true, Some("boxed")),
            ("\\boxed{2\\sqrt{3}}", "2\\sqrt3", true, Some("boxed")),
            ("\\boxed{3\\sqrt{2}}", "2\\sqrt3", false, Some("boxed")),
            (
                "\\boxed{\\frac{\\sqrt{3}}{2}}",
                "\\dfrac{\\sqrt3}{2}",
                true,
                Some("boxed"),
            ),
            ("\\boxed{1,000}", "1000", true, Some("boxed")),
            ("\\boxed{50\\%}", "50", true, Some("boxed")),
            ("\\boxed{5 \\text{ cm}}", "5", true, Some("boxed")),
            ("\\boxed{90^\\circ}", "90", true, Some("boxed")),
            ("\\boxed{x = -3}", "-3", true, Some("boxed")),
            (
                "\\boxed{\\left( 1, 2 \\right)}",
                "(1,2)",
                true,
                Some("boxed"),
            ),
            ("\\boxed{(2, 1)}", "(1,2)", false, Some("boxed")),
            ("\\boxed{\\frac{1}{3}}", "0.33", false, Some("boxed")),
            ("\\boxed{3x}", "3", false, Some("boxed")),
            (
                "\\boxed{1} first, then \\boxed{\\frac{3}{4}}",
                "0.75",
                true,
                Some("boxed"),
            ),
            (
                "The answer is $\\frac{3}{4}$.",
                "3/4",
                true,
                Some("answer_is"),
            ),
            (
                "We get 7 and then 12 apples",
                "12",
                true,
                Some("last_number"),
            ),
            ("\\boxed{}", "0", false, Some("boxed")),
            ("no answer at all", "0", false, None),
        ],
    );
    let units = grader("kind = \"math\"\nunits = [\"m\"]");
    let (n2, neg2) = check(
        &units,
        &[],
        &[
            ("\\boxed{12 m}", "12", true, Some("boxed")),
            ("\\boxed{12 m}", "13", false, Some("boxed")),
            ("\\boxed{12 km}", "12", true, Some("boxed")),
        ],
    );
    assert_eq!(normalize_math("\\$1{,}234.50", &[]), "1234.5");
    assert_eq!(normalize_math("\\frac{-2}{4}", &[]), "-0.5");
    assert_eq!(normalize_math("-\\frac{1}{3}", &[]), "-1/3");
    eprintln!("math: {} cases, {} must not match", n + n2, neg + neg2);
}

#[test]
fn only_marker_rules_count_as_final_answers() {
    for r in ["boxed", "hashes", "answer_is", "regex"] {
        assert!(is_final_answer_rule(r), "{r}");
    }
    for r in [
        "printed_output",
        "last_number",
        "last_line",
        "letter",
        "choice_text",
        "",
    ] {
        assert!(!is_final_answer_rule(r), "{r}");
    }
}

#[test]
fn bad_grader_options_are_one_line_errors() {
    for (text, needle) in [
        ("kind = \"numeric\"\ntolerance = -1.0", "tolerance"),
        ("kind = \"exact\"\nalternatives = \"\"", "alternatives"),
        ("kind = \"choice\"\nlabels = \"ab\"", "labels"),
    ] {
        let e = toml::from_str::<GraderSpec>(text)
            .unwrap()
            .build()
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle) && e.lines().count() == 1, "{e}");
    }
    let e = toml::from_str::<GraderSpec>("kind = \"fuzzy\"").unwrap_err();
    assert!(e.to_string().contains("fuzzy"), "{e}");
    let e = toml::from_str::<GraderSpec>("kind = \"exact\"\ncase = true").unwrap_err();
    assert!(e.to_string().contains("case"), "{e}");
}

#[test]
fn gsm8k_task_names_the_grader_its_spec_builds() {
    let task = gsm8k::Gsm8k::bundled(0..1, gsm8k::PromptFormat::ZeroShotChat).unwrap();
    let built = GraderSpec::gsm8k().build().unwrap();
    assert_eq!(crate::tasks::Task::grader(&task), built.name());
    assert_eq!(gsm8k::GRADER, built.name());
}
