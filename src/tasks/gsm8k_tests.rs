//! Tests of GSM8K loading, prompts, number parsing and answer extraction. Every extraction test
//! is a literal model output; the name says which behaviour it pins.
use super::*;
use crate::tasks::{Prompt, Task};

fn n(i: i128) -> Number {
    Number::integer(i)
}

fn frac(a: i128, b: i128) -> Number {
    Number::new(a, b).unwrap()
}

/// Extracted value and rule, for compact asserts.
fn ex(output: &str) -> Option<(Number, Rule)> {
    extract_answer(output).map(|e| (e.value, e.rule))
}

// ---- numbers --------------------------------------------------------------------------------

#[test]
fn parses_plain_comma_dollar_and_decimal_numbers() {
    assert_eq!(parse_number("18"), Some(n(18)));
    assert_eq!(parse_number("1,234"), Some(n(1234)));
    assert_eq!(parse_number("1,450,000"), Some(n(1_450_000)));
    assert_eq!(parse_number("$5"), Some(n(5)));
    assert_eq!(parse_number("\\$5"), Some(n(5)));
    assert_eq!(parse_number("18.00"), Some(n(18)));
    assert_eq!(parse_number("18."), Some(n(18)));
    assert_eq!(parse_number("0.25"), Some(frac(1, 4)));
    assert_eq!(parse_number(".5"), Some(frac(1, 2)));
    assert_eq!(parse_number("25%"), Some(n(25)));
    assert_eq!(parse_number("$1,234.50"), Some(frac(2469, 2)));
}

#[test]
fn decimal_zeros_equal_the_integer() {
    assert_eq!(parse_number("18.000"), parse_number("18"));
    assert_eq!(parse_number("$18.00."), Some(n(18)));
}

#[test]
fn parses_negative_numbers_in_all_spellings() {
    assert_eq!(parse_number("-10"), Some(n(-10)));
    assert_eq!(parse_number("−3"), Some(n(-3)));
    assert_eq!(parse_number("-$5"), Some(n(-5)));
    assert_eq!(parse_number("$-5"), Some(n(-5)));
    assert_eq!(parse_number("is -2.5 degrees"), Some(frac(-5, 2)));
    assert_eq!(parse_number("(-4)"), Some(n(-4)));
}

#[test]
fn minus_after_a_digit_or_letter_is_subtraction_not_a_sign() {
    assert_eq!(
        scan_numbers("21-15")
            .iter()
            .map(|s| s.value)
            .collect::<Vec<_>>(),
        [n(21), n(15)]
    );
    assert_eq!(scan_numbers("x-5")[0].value, n(5));
    assert_eq!(scan_numbers("(3)-2")[1].value, n(2));
}

#[test]
fn commas_not_in_groups_of_three_separate_numbers() {
    let vals: Vec<Number> = scan_numbers("3,4 and 1,2345")
        .iter()
        .map(|s| s.value)
        .collect();
    assert_eq!(vals, [n(3), n(4), n(1), n(2345)]);
}

#[test]
fn parses_fractions_in_answer_contexts() {
    assert_eq!(parse_number("3/4"), Some(frac(3, 4)));
    assert_eq!(parse_number("\\frac{3}{4}"), Some(frac(3, 4)));
    assert_eq!(parse_number("\\dfrac{10}{2}"), Some(n(5)));
    assert_eq!(
        parse_number("1/0"),
        Some(n(1)),
        "a zero denominator is not a fraction"
    );
}

#[test]
fn strips_latex_wrappers_around_numbers() {
    assert_eq!(parse_number("\\text{18 dollars}"), Some(n(18)));
    assert_eq!(parse_number("1{,}234"), Some(n(1234)));
    assert_eq!(parse_number("1\\,234"), Some(n(1234)));
    assert_eq!(parse_number("\\( 42 \\)"), Some(n(42)));
}

#[test]
fn text_without_numbers_has_no_value() {
    assert_eq!(parse_number("eighteen"), None);
    assert_eq!(parse_number(""), None);
    assert_eq!(parse_number("$."), None);
}

#[test]
fn huge_numbers_are_skipped_not_panicking() {
    let big = "9".repeat(60);
    assert_eq!(parse_number(&big), None);
    assert_eq!(parse_number(&format!("{big} then 7")), Some(n(7)));
    assert_eq!(parse_number(&format!("0.{big}")), None);
}

#[test]
fn numbers_display_in_normal_form() {
    assert_eq!(n(18).to_string(), "18");
    assert_eq!(frac(-7, 2).to_string(), "-3.5");
    assert_eq!(frac(-1, 4).to_string(), "-0.25");
    assert_eq!(frac(2, 3).to_string(), "2/3");
    assert_eq!(frac(1, 8).to_string(), "0.125");
    assert_eq!(parse_number("18.50").unwrap().to_string(), "18.5");
}

#[test]
fn numbers_round_trip_through_serde() {
    let v = frac(-7, 2);
    let json = serde_json::to_string(&v).unwrap();
    assert_eq!(json, "\"-3.5\"");
    assert_eq!(serde_json::from_str::<Number>(&json).unwrap(), v);
    assert!(serde_json::from_str::<Number>("\"abc\"").is_err());
}

// ---- extraction: explicit patterns ----------------------------------------------------------

#[test]
fn takes_number_after_four_hashes() {
    assert_eq!(
        ex("She makes 9 * 2 = 18.\n#### 18"),
        Some((n(18), Rule::Hashes))
    );
    assert_eq!(ex("#### $1,234.00"), Some((n(1234), Rule::Hashes)));
    assert_eq!(ex("####-10"), Some((n(-10), Rule::Hashes)));
}

#[test]
fn markdown_heading_with_four_hashes_is_not_an_answer() {
    let out = "#### Step 1: eggs left\n16 - 3 - 4 = 9\n#### Step 2: money\n9 * 2 = 18";
    assert_eq!(ex(out), Some((n(18), Rule::LastNumber)));
    assert_eq!(ex("##### 5\nso 7"), Some((n(7), Rule::LastNumber)));
}

#[test]
fn takes_boxed_answer() {
    assert_eq!(
        ex("So she makes \\boxed{18} dollars."),
        Some((n(18), Rule::Boxed))
    );
    assert_eq!(ex("\\[\n\\boxed{1,234}\n\\]"), Some((n(1234), Rule::Boxed)));
    assert_eq!(ex("\\boxed{\\$18.00}"), Some((n(18), Rule::Boxed)));
    assert_eq!(ex("\\boxed {7}"), Some((n(7), Rule::Boxed)));
    assert_eq!(ex("\\fbox{9}"), Some((n(9), Rule::Boxed)));
}

#[test]
fn boxed_content_with_units_fraction_or_equation() {
    assert_eq!(
        ex("\\boxed{18 \\text{ dollars}}"),
        Some((n(18), Rule::Boxed))
    );
    assert_eq!(ex("\\boxed{\\frac{3}{4}}"), Some((frac(3, 4), Rule::Boxed)));
    assert_eq!(ex("\\boxed{x = 5}"), Some((n(5), Rule::Boxed)));
    assert_eq!(ex("\\boxed{16 - 3 - 4 = 9}"), Some((n(9), Rule::Boxed)));
    assert_eq!(ex("\\boxed{-3}"), Some((n(-3), Rule::Boxed)));
    assert_eq!(ex("\\boxed{25\\%}"), Some((n(25), Rule::Boxed)));
}

#[test]
fn last_boxed_wins_over_earlier_boxed() {
    let out = "First I got \\boxed{20}. Wait, that is wrong. The answer is \\boxed{18}.";
    assert_eq!(ex(out), Some((n(18), Rule::Boxed)));
}

#[test]
fn empty_or_unclosed_boxed_falls_through() {
    assert_eq!(
        ex("I will put it in \\boxed{}. It is 18."),
        Some((n(18), Rule::LastNumber))
    );
    assert_eq!(
        ex("The total is 12 so \\boxed{18"),
        Some((n(18), Rule::LastNumber))
    );
}

#[test]
fn boxed_beats_answer_is_and_hashes() {
    let out = "The answer is 20.\n#### 19\n\\boxed{18}";
    assert_eq!(ex(out), Some((n(18), Rule::Boxed)));
    assert_eq!(
        ex("#### 19\nThe answer is 20."),
        Some((n(19), Rule::Hashes))
    );
}

#[test]
fn takes_the_answer_is_phrase() {
    assert_eq!(
        ex("9 * 2 = 18. The answer is 18."),
        Some((n(18), Rule::AnswerIs))
    );
    assert_eq!(ex("So the answer is $18."), Some((n(18), Rule::AnswerIs)));
    assert_eq!(
        ex("The final answer is $18$. I hope it is correct."),
        Some((n(18), Rule::AnswerIs))
    );
    assert_eq!(ex("Answer: 18 eggs"), Some((n(18), Rule::AnswerIs)));
    assert_eq!(ex("**Answer:** 18"), Some((n(18), Rule::AnswerIs)));
    assert_eq!(
        ex("**Final Answer**: 1,600"),
        Some((n(1600), Rule::AnswerIs))
    );
    assert_eq!(
        ex("the answer to the question is 42, of course"),
        Some((n(42), Rule::AnswerIs))
    );
    assert_eq!(ex("THE ANSWER IS -7"), Some((n(-7), Rule::AnswerIs)));
    assert_eq!(
        ex("The answer is 18.5 kg."),
        Some((frac(37, 2), Rule::AnswerIs))
    );
}

#[test]
fn answer_phrase_ending_its_line_takes_the_next_line() {
    assert_eq!(
        ex("Final answer:\n\n 18\nDone in 3 steps."),
        Some((n(18), Rule::AnswerIs))
    );
}

#[test]
fn answer_phrase_takes_result_of_an_equation() {
    assert_eq!(
        ex("The answer is 16 - 3 - 4 = 9 eggs."),
        Some((n(9), Rule::AnswerIs))
    );
    assert_eq!(
        ex("The answer is 18 (= 9 * 2)."),
        Some((n(18), Rule::AnswerIs))
    );
}

#[test]
fn answer_phrase_stops_at_the_sentence_end() {
    let out = "The answer is not stated. Janet has 4 ducks and makes 18.";
    assert_eq!(ex(out), Some((n(18), Rule::LastNumber)));
}

#[test]
fn answer_phrase_allows_one_word_before_the_number() {
    assert_eq!(
        ex("The answer is therefore 18."),
        Some((n(18), Rule::AnswerIs))
    );
    assert_eq!(
        ex("The answer is approximately $18."),
        Some((n(18), Rule::AnswerIs))
    );
    assert_eq!(ex("The answer is: **18**"), Some((n(18), Rule::AnswerIs)));
    assert_eq!(ex("The answer is 1,234."), Some((n(1234), Rule::AnswerIs)));
}

#[test]
fn answer_phrase_far_from_its_number_defers_to_later_rules() {
    let out = "The answer is found by multiplying 9 by 2, which gives 18.";
    assert_eq!(ex(out), Some((n(18), Rule::LastNumber)));
    let out = "The final answer is: Janet makes $18 every day.";
    assert_eq!(ex(out), Some((n(18), Rule::LastNumber)));
}

#[test]
fn last_answer_phrase_wins() {
    let out = "The answer is 20. Let me re-check: 9 * 2 = 18. The answer is 18.";
    assert_eq!(ex(out), Some((n(18), Rule::AnswerIs)));
}

#[test]
fn answer_phrase_beats_a_later_stray_number() {
    let out = "The answer is 18.\n\nNote: there are 7 days in a week.";
    assert_eq!(ex(out), Some((n(18), Rule::AnswerIs)));
}

#[test]
fn words_like_answers_or_answered_are_not_answer_phrases() {
    assert_eq!(
        ex("He answered 3 questions, she answers 4: total 7"),
        Some((n(7), Rule::LastNumber))
    );
}

// ---- extraction: fallback -------------------------------------------------------------------

#[test]
fn falls_back_to_last_number() {
    assert_eq!(
        ex("16 - 3 - 4 = 9 eggs. 9 * 2 = $18 per day."),
        Some((n(18), Rule::LastNumber))
    );
    assert_eq!(
        ex("She makes $1,234.50 in total."),
        Some((frac(2469, 2), Rule::LastNumber))
    );
    assert_eq!(
        ex("It drops to -3 degrees."),
        Some((n(-3), Rule::LastNumber))
    );
    assert_eq!(ex("It is 18."), Some((n(18), Rule::LastNumber)));
}

#[test]
fn no_number_means_no_answer() {
    assert_eq!(ex(""), None);
    assert_eq!(ex("I don't know."), None);
}

// ---- extraction: code ------------------------------------------------------------------------

#[test]
fn code_only_answer_has_no_answer_and_is_not_executed() {
    let out = "```python\neggs = 16 - 3 - 4\nprint(eggs * 2)\n```";
    assert_eq!(ex(out), None);
}

#[test]
fn numbers_inside_code_are_ignored_for_the_fallback() {
    let out =
        "Here is the code:\n```python\ntotal = 16 - 3 - 4\nprint(total * 2)\n```\nIt uses 2 steps.";
    assert_eq!(ex(out), Some((n(2), Rule::LastNumber)));
}

#[test]
fn takes_printed_output_block_after_code() {
    let out =
        "```python\nprint((16 - 3 - 4) * 2)\n```\n```output\n18\n```\nThe code runs in 1 second.";
    assert_eq!(ex(out), Some((n(18), Rule::PrintedOutput)));
}

#[test]
fn unlabelled_block_after_code_is_printed_output() {
    let out = "```python\nx = 9 * 2\nprint(x)\n```\nOutput:\n```\n18\n```\nSo it needs 2 lines.";
    assert_eq!(ex(out), Some((n(18), Rule::PrintedOutput)));
}

#[test]
fn takes_printed_result_phrase_after_code() {
    let out =
        "```python\nprint(9 * 2)\n```\nWhen you run this code, it will output `18`. It has 1 line.";
    assert_eq!(ex(out), Some((n(18), Rule::PrintedOutput)));
    let out = "```python\nprint(9 * 2)\n```\nThis prints 18, using 1 multiplication";
    assert_eq!(ex(out), Some((n(18), Rule::PrintedOutput)));
}

#[test]
fn takes_output_of_the_code_phrase() {
    let out = "```python\nprint(9 * 2)\n```\nThe output of the code is 18, after 2 steps";
    assert_eq!(ex(out), Some((n(18), Rule::PrintedOutput)));
}

#[test]
fn float_printed_by_code_equals_integer_gold() {
    let out = "```python\nprint((16 - 3 - 4) * 2.0)\n```\n```output\n18.0\n```";
    let g = grade_answer(out, "18");
    assert!(g.correct, "{g:?}");
    assert_eq!(g.rule.as_deref(), Some("printed_output"));
}

#[test]
fn explicit_answer_beats_printed_output() {
    let out = "```python\nprint(20)\n```\n```output\n20\n```\nThe code is wrong; the answer is 18.";
    assert_eq!(ex(out), Some((n(18), Rule::AnswerIs)));
    let out = "```python\nprint(18)\n```\nOutput: 18\nTherefore \\boxed{18}";
    assert_eq!(ex(out), Some((n(18), Rule::Boxed)));
}

#[test]
fn answer_phrases_inside_code_are_ignored() {
    let out = "```python\n# The answer is 5\nprint(\"The answer is\", 20)\n```\nJanet makes $18.";
    assert_eq!(ex(out), Some((n(18), Rule::LastNumber)));
}

#[test]
fn print_call_mentioned_in_prose_without_a_number_falls_through() {
    let out = "```python\nprint(total)\n```\nWe print(total) at the end; she earns 18 dollars";
    assert_eq!(ex(out), Some((n(18), Rule::LastNumber)));
}

#[test]
fn unclosed_code_fence_hides_the_rest() {
    let out = "Let me compute 9 * 2 = 18.\n```python\ntotal = 9 * 2\nprint(total + 100";
    assert_eq!(ex(out), Some((n(18), Rule::LastNumber)));
}

#[test]
fn unlabelled_block_without_code_before_is_prose() {
    let out = "```\n16 - 3 - 4 = 9\n9 * 2 = 18\n```";
    assert_eq!(ex(out), Some((n(18), Rule::LastNumber)));
}

#[test]
fn offset_points_at_the_winning_match() {
    let out = "abc \\boxed{18}";
    assert_eq!(extract_answer(out).unwrap().offset, 4);
    let out = "x\n#### 5";
    assert_eq!(extract_answer(out).unwrap().offset, 2);
}

#[test]
fn qwen_coder_style_answer_with_code_and_boxed() {
    let out = "To solve this problem, we need to calculate how many eggs Janet sells.\n\n\
        1. **Eggs laid per day**: 16\n2. **Eggs eaten**: 3\n3. **Eggs for muffins**: 4\n\n\
        ```python\neggs_per_day = 16\nremaining = eggs_per_day - 3 - 4\nprint(remaining * 2)\n```\n\n\
        Janet makes \\(\\boxed{18}\\) dollars every day at the farmers' market.";
    assert_eq!(ex(out), Some((n(18), Rule::Boxed)));
}

// ---- grading -----------------------------------------------------------------------------------

#[test]
fn grades_by_normalized_numeric_equality() {
    assert!(grade_answer("The answer is 18.00", "18").correct);
    assert!(grade_answer("#### 1600", "1,600").correct);
    assert!(grade_answer("\\boxed{1,600}", "1600").correct);
    assert!(grade_answer("It is -10 degrees.", "-10").correct);
    assert!(!grade_answer("The answer is 17.", "18").correct);
    assert!(!grade_answer("no idea", "18").correct);
    let g = grade_answer("The answer is $18.", "18");
    assert_eq!(g.predicted.as_deref(), Some("18"));
    assert_eq!(g.rule.as_deref(), Some("answer_is"));
}

#[test]
fn eight_shot_grading_ignores_invented_next_question() {
    let task = Gsm8k::bundled(0..1, PromptFormat::EightShotCot).unwrap();
    let p = &task.problems()[0];
    let out = " Janet sells 16 - 3 - 4 = 9 eggs. She makes 9 * 2 = 18. The answer is 18.\n\nQ: Tom has 5 apples.\nA: The answer is 5.";
    let g = task.grade(p, out);
    assert!(g.correct, "{g:?}");
    assert_eq!(g.predicted.as_deref(), Some("18"));
}

#[test]
fn chat_grading_keeps_blank_lines() {
    let task = Gsm8k::bundled(0..1, PromptFormat::ZeroShotChat).unwrap();
    let p = &task.problems()[0];
    let out = "Step 1: 16 - 3 - 4 = 9.\n\nStep 2: 9 * 2 = 18.\n\n\\boxed{18}<|im_end|>\\boxed{5}";
    assert!(task.grade(p, out).correct);
}

// ---- data and prompts -------------------------------------------------------------------------

#[test]
fn bundled_test_split_has_all_problems_with_numeric_golds() {
    let all = bundled_problems(..).unwrap();
    assert_eq!(all.len(), TEST_LEN);
    assert_eq!(all[0].gold, "18");
    assert_eq!(all[0].id, "gsm8k-test-0");
    assert!(
        all[0]
            .question
            .starts_with("Janet’s ducks lay 16 eggs per day.")
    );
    assert!(all.iter().all(|p| parse_number(&p.gold).is_some()));
    // Every reference solution grades as correct against its own gold.
    assert!(
        all.iter()
            .all(|p| grade_answer(&p.solution, &p.gold).correct)
    );
}

#[test]
fn selects_problems_by_range() {
    let some = bundled_problems(10..13).unwrap();
    assert_eq!(
        some.iter().map(|p| p.index).collect::<Vec<_>>(),
        [10, 11, 12]
    );
    assert_eq!(bundled_problems(1318..).unwrap().len(), 1);
    assert_eq!(bundled_problems(..=4).unwrap().len(), 5);
    assert!(bundled_problems(5..5).unwrap().is_empty());
}

#[test]
fn rejects_a_range_past_the_end() {
    let err = bundled_problems(1300..1400).unwrap_err().to_string();
    assert_eq!(
        err,
        "spec: gsm8k: problems 1300..1400 requested but data/gsm8k/test.jsonl has 1319"
    );
}

#[test]
fn rejects_malformed_jsonl_with_a_line_number() {
    let text = "{\"question\": \"q\", \"answer\": \"x\\n#### 3\"}\nnot json\n";
    let err = parse_problems(text, "t.jsonl", ..).unwrap_err().to_string();
    assert!(err.starts_with("spec: gsm8k: t.jsonl problem 1: "), "{err}");
    assert_eq!(
        parse_problems(text, "dir/t.jsonl", ..1).unwrap()[0].id,
        "gsm8k-t-0"
    );
    let text = "{\"question\": \"q\", \"answer\": \"no marker\"}";
    let err = parse_problems(text, "t.jsonl", ..).unwrap_err().to_string();
    assert_eq!(
        err,
        "spec: gsm8k: t.jsonl problem 0: answer has no `#### N`"
    );
    let text = "{\"question\": \"q\", \"answer\": \"#### many\"}";
    let err = parse_problems(text, "t.jsonl", ..).unwrap_err().to_string();
    assert_eq!(
        err,
        "spec: gsm8k: t.jsonl problem 0: gold answer `many` is not a number"
    );
}

#[test]
fn missing_file_is_an_io_error() {
    let err = load_problems(Path::new("/nonexistent/gsm8k.jsonl"), ..).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
}

#[test]
fn exemplars_are_the_standard_eight() {
    let ex = cot_exemplars().unwrap();
    assert_eq!(ex.len(), 8);
    assert!(
        ex[0]
            .question
            .starts_with("There are 15 trees in the grove.")
    );
    assert_eq!(
        ex.iter().map(|e| e.answer.as_str()).collect::<Vec<_>>(),
        ["6", "5", "39", "8", "9", "29", "33", "8"]
    );
    assert!(ex.iter().all(|e| !e.rationale.contains("answer is")));
}

#[test]
fn eight_shot_prompt_has_the_standard_layout() {
    let task = Gsm8k::bundled(0..1, PromptFormat::EightShotCot).unwrap();
    let Prompt::Text { text } = task.prompt(&task.problems()[0]) else {
        panic!("8-shot prompt is text");
    };
    assert!(text.starts_with(
        "Q: There are 15 trees in the grove. Grove workers will plant trees in the grove today. \
         After they are done, there will be 21 trees. How many trees did the grove workers plant today?\n\
         A: There are 15 trees originally. Then there were 21 trees after some more were planted. \
         So there must have been 21 - 15 = 6. The answer is 6.\n\nQ: If there are 3 cars"
    ));
    assert!(
        text.contains("23 - 15 is 8. The answer is 8.\n\nQ: Janet’s ducks lay 16 eggs per day.")
    );
    assert!(text.ends_with("at the farmers' market?\nA:"));
    assert_eq!(text.matches("\nA: ").count(), 8);
    assert_eq!(text.matches("Q: ").count(), 9);
}

#[test]
fn zero_shot_prompt_is_one_user_message_with_the_boxed_instruction() {
    let task = Gsm8k::bundled(1..2, PromptFormat::ZeroShotChat).unwrap();
    let p = &task.problems()[0];
    let Prompt::Chat { messages } = task.prompt(p) else {
        panic!("zero-shot prompt is chat");
    };
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].role, "user");
    assert_eq!(
        messages[0].content,
        format!(
            "{}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
            p.question
        )
    );
    let json = serde_json::to_value(task.prompt(p)).unwrap();
    assert_eq!(json["kind"], "chat");
    assert_eq!(json["messages"][0]["role"], "user");
}

#[test]
fn prompt_format_parses_and_prints_its_name() {
    for f in PromptFormat::ALL {
        assert_eq!(f.as_str().parse::<PromptFormat>().unwrap(), f);
        assert_eq!(serde_json::to_string(&f).unwrap(), format!("\"{f}\""));
    }
    assert_eq!(
        "8-shot-cot".parse::<PromptFormat>().unwrap(),
        PromptFormat::EightShotCot
    );
    let err = "five-shot".parse::<PromptFormat>().unwrap_err().to_string();
    assert_eq!(
        err,
        "spec: gsm8k: unknown prompt format `five-shot` (expected zero-shot-chat or eight-shot-cot)"
    );
}

#[test]
fn never_panics_on_arbitrary_text() {
    // Deterministic pseudo-random texts over pieces that stress the scanner and the segmenter:
    // multi-byte characters next to signs, dollars, fences, braces and markers.
    const PIECES: [&str; 32] = [
        "1",
        "23",
        ",",
        ".",
        "-",
        "−",
        "$",
        "\\$",
        "%",
        "/",
        "=",
        "(",
        ")",
        "{",
        "}",
        "\\boxed{",
        "\\frac{",
        "####",
        "#",
        "```",
        "```python\n",
        "```output\n",
        "\n",
        " ",
        "answer is ",
        "Answer:",
        "prints ",
        "é",
        "日本",
        "🙂",
        "9999999999999999999999999999999999999999",
        "0.",
    ];
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    for _ in 0..3000 {
        let mut text = String::new();
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        let len = (state >> 59) as usize + 1;
        for _ in 0..len * 2 {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1);
            text.push_str(PIECES[(state >> 59) as usize % PIECES.len()]);
        }
        let _ = extract_answer(&text);
        let _ = parse_number(&text);
        let _ = grade_answer(&text, "18");
    }
}

#[test]
fn extreme_values_are_rejected_not_wrapped() {
    assert_eq!(Number::new(i128::MIN, 1), None);
    assert_eq!(Number::new(1, i128::MIN), None);
    assert_eq!(Number::new(1, 0), None);
    assert_eq!(Number::new(6, -4), Some(frac(-3, 2)));
}
