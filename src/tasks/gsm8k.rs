//! GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems"): 1,319 grade-school
//! math word problems whose answers are numbers.
//!
//! Data: `data/gsm8k/test.jsonl` and the 8 chain-of-thought exemplars of Wei et al. 2022
//! (`data/gsm8k/cot_8shot.jsonl`) are embedded in the binary at build time, so a run never
//! depends on the working directory; [`load_problems`] reads another file of the same shape.
//!
//! Prompt formats ([`PromptFormat`]):
//! - `zero-shot-chat`: one user message, the question followed by [`ZERO_SHOT_INSTRUCTION`]
//!   (the "reason step by step ... \boxed{}" instruction of the Qwen2.5-Math and DeepSeek-R1
//!   evaluations). No system message: the chat template supplies its default.
//! - `eight-shot-cot`: raw text in the lm-evaluation-harness `gsm8k-cot` layout,
//!   `Q: {question}\nA: {rationale} The answer is {n}.\n\n` eight times, then `Q: {question}\nA:`.
//!
//! # Answer extraction ([`extract_answer`])
//!
//! The output is first split into prose and fenced code blocks (```` ``` ````). A fenced block
//! whose info string is `output`/`text`/`console`/`stdout`/`plaintext`, or an unlabelled block
//! that follows a code block, is *printed output*; any other labelled block is *code*; an
//! unlabelled block with no code before it is prose. An unclosed fence runs to the end. Then the
//! first rule that finds a number wins, and within a rule the last occurrence wins (models
//! restate and correct themselves):
//!
//! 1. `boxed`: `\boxed{..}` / `\fbox{..}` in prose or output (nested braces; `x = 5` gives 5).
//! 2. `hashes`: `#### N` in prose or output (exactly four `#`, the number first: a markdown
//!    heading `#### Step 1` is not an answer).
//! 3. `answer_is`: "the answer is N", "The final answer is $N$", "Answer: N", "**Answer:** N",
//!    "answer to the question is N", in prose. The number must open the rest of the sentence
//!    (or the next line when the phrase ends its line), after at most one word ("the answer is
//!    therefore 18"); it is read after the last top-level `=` if there is one ("the answer is
//!    16 - 3 - 4 = 9" gives 9). "The answer is found by multiplying 9 by 2, which gives 18"
//!    names no number here, so a later rule decides.
//! 4. `printed_output`: the last number of a printed-output block, or the number opening the
//!    sentence after "the output is", "the output of the code is", "prints", "Output:" in prose
//!    (same window rule as 3).
//! 5. `last_number`: the last number in the prose.
//!
//! Model code is never executed, and code blocks are never searched: a Qwen coder answer that is
//! only a program (`print(16 - 3 - 4)`) has no answer unless it also states or shows the result.
//! Executing generated code would make grading depend on an interpreter, and on code that may not
//! terminate; the cost is that a code-only answer counts as wrong.
//!
//! Numbers ([`Number`]): `1,234` (comma groups of exactly three digits), `$5`, `\$5`, `-5`,
//! `−5`, `-$5`, `18.` (a trailing period ends the sentence), `18.00` (equal to 18), `.5`, `25%`
//! (the percent sign is dropped; GSM8K golds are plain numbers), and in answer contexts the
//! fractions `3/4` and `\frac{3}{4}`. A `-` directly after a letter, digit or closing bracket is
//! subtraction (`21-15`), not a sign. Values are exact rationals, so grading is exact equality.
use super::{Grade, Message, Problem, Prompt, Task, truncate_at_stops};
use crate::{Error, Result};
use regex::Regex;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::str::FromStr;
use std::sync::LazyLock;

/// The name of the grader GSM8K answers are graded by.
pub const GRADER: &str = "numeric";

/// The GSM8K test split (1,319 problems), as vendored in `data/gsm8k/test.jsonl`.
pub const TEST_JSONL: &str = include_str!("../../data/gsm8k/test.jsonl");

/// The 8 chain-of-thought exemplars, as vendored in `data/gsm8k/cot_8shot.jsonl`.
pub const COT_8SHOT_JSONL: &str = include_str!("../../data/gsm8k/cot_8shot.jsonl");

/// Number of problems in the test split.
pub const TEST_LEN: usize = 1319;

/// The instruction appended to the question in the zero-shot chat prompt (on its own line).
pub const ZERO_SHOT_INSTRUCTION: &str =
    "Please reason step by step, and put your final answer within \\boxed{}.";

/// How a GSM8K problem is put to the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PromptFormat {
    /// One user message: question, newline, [`ZERO_SHOT_INSTRUCTION`]; rendered with the chat template.
    ZeroShotChat,
    /// The standard 8-shot chain-of-thought text prompt ("Q: .. A: .. The answer is N.").
    EightShotCot,
}

impl PromptFormat {
    /// Every format, in a fixed order.
    pub const ALL: [PromptFormat; 2] = [PromptFormat::ZeroShotChat, PromptFormat::EightShotCot];

    /// The format's name in specs and records.
    pub fn as_str(self) -> &'static str {
        match self {
            PromptFormat::ZeroShotChat => "zero-shot-chat",
            PromptFormat::EightShotCot => "eight-shot-cot",
        }
    }

    /// Text stop sequences. The 8-shot list is lm-evaluation-harness `gsm8k-cot`'s (`Q:`,
    /// `</s>`, `<|im_end|>`) plus OLMES's blank line and the other end-of-turn markers; chat
    /// stops only catch end-of-turn markers that were decoded as text (the model's stop tokens
    /// end generation first).
    pub fn stop_sequences(self) -> &'static [&'static str] {
        match self {
            PromptFormat::ZeroShotChat => &[
                "<|im_end|>",
                "<|endoftext|>",
                "<end_of_turn>",
                "<eos>",
                "</s>",
            ],
            PromptFormat::EightShotCot => &[
                "\n\n",
                "Q:",
                "</s>",
                "<|im_end|>",
                "<|endoftext|>",
                "<end_of_turn>",
                "<eos>",
            ],
        }
    }

    /// Default generation budget: 256 for 8-shot (lm-evaluation-harness), 512 for chat, whose
    /// answers are longer (step-by-step text, often with code).
    pub fn max_new_tokens(self) -> usize {
        match self {
            PromptFormat::ZeroShotChat => 512,
            PromptFormat::EightShotCot => 256,
        }
    }
}

impl fmt::Display for PromptFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PromptFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<PromptFormat> {
        match s.to_ascii_lowercase().as_str() {
            "zero-shot-chat" | "zero_shot_chat" | "chat" => Ok(PromptFormat::ZeroShotChat),
            "eight-shot-cot" | "eight_shot_cot" | "8-shot-cot" | "8shot" => {
                Ok(PromptFormat::EightShotCot)
            }
            _ => Err(Error::Spec(format!(
                "gsm8k: unknown prompt format `{s}` (expected zero-shot-chat or eight-shot-cot)"
            ))),
        }
    }
}

/// One few-shot exemplar.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exemplar {
    /// The question.
    pub question: String,
    /// The chain of thought, without the closing "The answer is N.".
    pub rationale: String,
    /// The final answer.
    pub answer: String,
}

/// The 8 chain-of-thought exemplars of Wei et al. 2022, from the embedded `cot_8shot.jsonl`.
pub fn cot_exemplars() -> Result<Vec<Exemplar>> {
    let mut out = Vec::new();
    for (i, line) in COT_8SHOT_JSONL.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let ex: Exemplar = serde_json::from_str(line)
            .map_err(|e| Error::Spec(format!("gsm8k: cot_8shot.jsonl line {}: {e}", i + 1)))?;
        out.push(ex);
    }
    if out.len() != 8 {
        return Err(Error::Spec(format!(
            "gsm8k: cot_8shot.jsonl has {} exemplars, expected 8",
            out.len()
        )));
    }
    Ok(out)
}

/// The chat messages of the zero-shot prompt.
pub fn zero_shot_messages(question: &str) -> Vec<Message> {
    vec![Message::user(format!(
        "{question}\n{ZERO_SHOT_INSTRUCTION}"
    ))]
}

/// The 8-shot chain-of-thought text prompt; ends in `A:` (the model continues with ` ...`).
pub fn eight_shot_prompt(exemplars: &[Exemplar], question: &str) -> String {
    let mut text = String::new();
    for ex in exemplars {
        text.push_str(&format!(
            "Q: {}\nA: {} The answer is {}.\n\n",
            ex.question, ex.rationale, ex.answer
        ));
    }
    text.push_str(&format!("Q: {question}\nA:"));
    text
}

#[derive(Deserialize)]
struct RawItem {
    question: String,
    answer: String,
}

/// The gold answer text of a GSM8K solution: what follows the last `####`, on its line, trimmed.
pub fn gold_from_solution(solution: &str) -> Option<&str> {
    let at = solution.rfind("####")?;
    let gold = solution[at + 4..].lines().next().unwrap_or("").trim();
    (!gold.is_empty()).then_some(gold)
}

/// Parse problems `range` (0-based line numbers; `..` for all) from GSM8K-shaped JSONL text,
/// one `{"question", "answer"}` object per line. `source` names the text in errors, and its file
/// stem names the split in ids: problem 17 of `.../test.jsonl` is `gsm8k-test-17`.
pub fn parse_problems(
    jsonl: &str,
    source: &str,
    range: impl RangeBounds<usize>,
) -> Result<Vec<Problem>> {
    let lines: Vec<&str> = jsonl.lines().filter(|l| !l.trim().is_empty()).collect();
    let start = match range.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s.saturating_add(1),
        Bound::Unbounded => 0,
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.saturating_add(1),
        Bound::Excluded(&e) => e,
        Bound::Unbounded => lines.len(),
    };
    if start > end || end > lines.len() {
        return Err(Error::Spec(format!(
            "gsm8k: problems {start}..{end} requested but {source} has {}",
            lines.len()
        )));
    }
    let split = Path::new(source)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "data".to_string());
    let mut out = Vec::with_capacity(end - start);
    for (index, line) in lines.iter().enumerate().take(end).skip(start) {
        let raw: RawItem = serde_json::from_str(line)
            .map_err(|e| Error::Spec(format!("gsm8k: {source} problem {index}: {e}")))?;
        let gold = gold_from_solution(&raw.answer).ok_or_else(|| {
            Error::Spec(format!(
                "gsm8k: {source} problem {index}: answer has no `#### N`"
            ))
        })?;
        if parse_number(gold).is_none() {
            return Err(Error::Spec(format!(
                "gsm8k: {source} problem {index}: gold answer `{gold}` is not a number"
            )));
        }
        out.push(Problem {
            id: format!("gsm8k-{split}-{index}"),
            index,
            gold: gold.to_string(),
            question: raw.question,
            solution: raw.answer,
            choices: vec![],
        });
    }
    Ok(out)
}

/// Problems `range` of the embedded GSM8K test split.
pub fn bundled_problems(range: impl RangeBounds<usize>) -> Result<Vec<Problem>> {
    parse_problems(TEST_JSONL, "data/gsm8k/test.jsonl", range)
}

/// Problems `range` of a GSM8K-shaped JSONL file.
pub fn load_problems(path: &Path, range: impl RangeBounds<usize>) -> Result<Vec<Problem>> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    parse_problems(&text, &path.display().to_string(), range)
}

/// The GSM8K task: selected problems and one prompt format.
#[derive(Debug, Clone)]
pub struct Gsm8k {
    problems: Vec<Problem>,
    format: PromptFormat,
    exemplars: Vec<Exemplar>,
    stops: Vec<String>,
}

impl Gsm8k {
    /// A task over `problems` with prompt format `format`.
    pub fn new(problems: Vec<Problem>, format: PromptFormat) -> Result<Gsm8k> {
        Ok(Gsm8k {
            problems,
            format,
            exemplars: cot_exemplars()?,
            stops: format
                .stop_sequences()
                .iter()
                .map(|s| s.to_string())
                .collect(),
        })
    }

    /// A task over problems `range` of the embedded test split.
    pub fn bundled(range: impl RangeBounds<usize>, format: PromptFormat) -> Result<Gsm8k> {
        Gsm8k::new(bundled_problems(range)?, format)
    }

    /// The prompt format.
    pub fn format(&self) -> PromptFormat {
        self.format
    }
}

impl Task for Gsm8k {
    fn name(&self) -> &str {
        "gsm8k"
    }

    /// The numeric grader (`GraderSpec::gsm8k`: exact equality, no units), which
    /// [`grade_answer`] applies.
    fn grader(&self) -> &str {
        GRADER
    }

    fn problems(&self) -> &[Problem] {
        &self.problems
    }

    fn prompt(&self, problem: &Problem) -> Prompt {
        match self.format {
            PromptFormat::ZeroShotChat => Prompt::Chat {
                messages: zero_shot_messages(&problem.question),
            },
            PromptFormat::EightShotCot => Prompt::Text {
                text: eight_shot_prompt(&self.exemplars, &problem.question),
            },
        }
    }

    fn stop_sequences(&self) -> &[String] {
        &self.stops
    }

    fn max_new_tokens(&self) -> usize {
        self.format.max_new_tokens()
    }

    /// Cuts the output at the format's stop sequences (so an 8-shot model that goes on to invent
    /// the next "Q:" is graded on its own answer), then [`grade_answer`].
    fn grade(&self, problem: &Problem, output: &str) -> Grade {
        grade_answer(
            truncate_at_stops(output, self.format.stop_sequences()),
            &problem.gold,
        )
    }
}

/// Grade `output` against the gold answer text (`1,600`): exact equality of normalized numbers.
pub fn grade_answer(output: &str, gold: &str) -> Grade {
    let extracted = extract_answer(output);
    let gold = parse_number(gold);
    let correct = matches!((&extracted, gold), (Some(e), Some(g)) if e.value == g);
    Grade {
        predicted: extracted.as_ref().map(|e| e.value.to_string()),
        rule: extracted.as_ref().map(|e| e.rule.as_str().to_string()),
        correct,
    }
}

// ---------------------------------------------------------------------------------------------
// Numbers

/// An exact rational number, reduced, with a positive denominator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Number {
    num: i128,
    den: i128,
}

fn gcd(mut a: i128, mut b: i128) -> i128 {
    a = a.abs();
    b = b.abs();
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Number {
    /// `num / den`, reduced; `None` when `den` is 0 or on overflow.
    pub fn new(num: i128, den: i128) -> Option<Number> {
        if den == 0 || num == i128::MIN || den == i128::MIN {
            return None;
        }
        let g = gcd(num, den).max(1);
        let (mut num, mut den) = (num / g, den / g);
        if den < 0 {
            num = num.checked_neg()?;
            den = den.checked_neg()?;
        }
        Some(Number { num, den })
    }

    /// An integer.
    pub fn integer(n: i128) -> Number {
        Number { num: n, den: 1 }
    }

    /// Numerator and (positive) denominator.
    pub fn parts(self) -> (i128, i128) {
        (self.num, self.den)
    }

    /// Whether the value is an integer.
    pub fn is_integer(self) -> bool {
        self.den == 1
    }

    fn div(self, other: Number) -> Option<Number> {
        Number::new(
            self.num.checked_mul(other.den)?,
            self.den.checked_mul(other.num)?,
        )
    }
}

impl fmt::Display for Number {
    /// Integers as integers, terminating decimals as decimals (`-3.5`), others as `num/den`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.den == 1 {
            return write!(f, "{}", self.num);
        }
        let (mut d, mut twos, mut fives) = (self.den, 0u32, 0u32);
        while d % 2 == 0 {
            d /= 2;
            twos += 1;
        }
        while d % 5 == 0 {
            d /= 5;
            fives += 1;
        }
        let places = twos.max(fives);
        let scaled = 10i128
            .checked_pow(places)
            .and_then(|p| self.num.checked_mul(p / self.den));
        match scaled {
            Some(scaled) if d == 1 => {
                let sign = if scaled < 0 { "-" } else { "" };
                let p = 10u128.pow(places);
                let abs = scaled.unsigned_abs();
                write!(
                    f,
                    "{sign}{}.{:0width$}",
                    abs / p,
                    abs % p,
                    width = places as usize
                )
            }
            _ => write!(f, "{}/{}", self.num, self.den),
        }
    }
}

impl Serialize for Number {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Number {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Number, D::Error> {
        let s = String::deserialize(d)?;
        parse_number(&s).ok_or_else(|| serde::de::Error::custom(format!("not a number: `{s}`")))
    }
}

/// A number found in text: byte span and value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    start: usize,
    end: usize,
    value: Number,
}

/// Every number in `s`, left to right (see the module docs for the accepted forms).
fn scan_numbers(s: &str) -> Vec<Span> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let digit_at = |k: usize| k < b.len() && b[k].is_ascii_digit();
        let starts_int = b[i].is_ascii_digit();
        let starts_frac = b[i] == b'.' && digit_at(i + 1) && (i == 0 || !b[i - 1].is_ascii_digit());
        if !(starts_int || starts_frac) {
            i += 1;
            continue;
        }
        let first = i;
        let mut digits = String::new();
        let mut j = i;
        while digit_at(j) {
            digits.push(b[j] as char);
            j += 1;
        }
        // Thousands groups: `,ddd` not followed by another digit, after a lead of 1-3 digits.
        if (1..=3).contains(&digits.len()) {
            while j < b.len()
                && b[j] == b','
                && digit_at(j + 1)
                && digit_at(j + 2)
                && digit_at(j + 3)
                && !digit_at(j + 4)
            {
                digits.push_str(&s[j + 1..j + 4]);
                j += 4;
            }
        }
        let mut places = 0u32;
        if j < b.len() && b[j] == b'.' && digit_at(j + 1) {
            j += 1;
            while digit_at(j) {
                digits.push(b[j] as char);
                places += 1;
                j += 1;
            }
        }
        let (start, negative) = sign_before(s, first);
        let value = digits
            .parse::<i128>()
            .ok()
            .zip(10i128.checked_pow(places))
            .and_then(|(n, den)| Number::new(if negative { -n } else { n }, den));
        if let Some(value) = value {
            out.push(Span {
                start,
                end: j,
                value,
            });
        }
        i = j;
    }
    out
}

/// Whether the number whose first digit is at `first` carries a minus sign (`-5`, `−5`, `-$5`,
/// `$-5`, `-\$5`), and where the number then starts.
fn sign_before(s: &str, first: usize) -> (usize, bool) {
    let mut k = first;
    let dollar = |k: usize| -> usize {
        if s[..k].ends_with("\\$") {
            k - 2
        } else if s[..k].ends_with('$') {
            k - 1
        } else {
            k
        }
    };
    k = dollar(k);
    let sign_len = if s[..k].ends_with('-') {
        1
    } else if s[..k].ends_with('−') {
        '−'.len_utf8()
    } else {
        0
    };
    if sign_len == 0 {
        return (first, false);
    }
    let sign_at = k - sign_len;
    let before = s[..sign_at].chars().next_back();
    let is_operator = before.is_some_and(|c| c.is_alphanumeric() || matches!(c, ')' | ']' | '}'));
    if is_operator {
        (first, false)
    } else {
        (dollar(sign_at), true)
    }
}

static FRAC_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}").expect("constant regex")
});
static LATEX_CMD_RE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\\[A-Za-z]+").expect("constant regex"));

/// Drop LaTeX markup that hides numbers: `\frac{a}{b}` → `a/b`, `\$` → `$`, `1{,}234` → `1,234`,
/// thin spaces, command names (`\text`, `\boxed`, ...) and braces.
pub(crate) fn delatex(s: &str) -> String {
    if !s.contains('\\') && !s.contains('{') {
        return s.to_string();
    }
    let s = FRAC_RE.replace_all(s, "$1/$2");
    let s = s
        .replace("{,}", ",")
        .replace("\\$", "$")
        .replace("\\%", "%")
        .replace("\\,", "")
        .replace("\\!", "")
        .replace("\\;", " ")
        .replace("\\ ", " ");
    LATEX_CMD_RE.replace_all(&s, " ").replace(['{', '}'], "")
}

/// The first numeric value in `text` (LaTeX-aware; `a/b` and `\frac{a}{b}` are fractions).
pub fn parse_number(text: &str) -> Option<Number> {
    first_value(text, usize::MAX)
}

/// The first numeric value in `text`, if at most `max_words` words come before it.
fn first_value(text: &str, max_words: usize) -> Option<Number> {
    let clean = delatex(text);
    let spans = scan_numbers(&clean);
    let first = *spans.first()?;
    let words = clean[..first.start]
        .split(|c: char| !c.is_alphabetic())
        .filter(|w| !w.is_empty())
        .count();
    if words > max_words {
        return None;
    }
    let after = clean[first.end..].trim_start();
    if let Some(denominator) = after.strip_prefix('/') {
        let at = clean.len() - denominator.trim_start().len();
        if let Some(den) = spans.iter().find(|s| s.start == at)
            && let Some(q) = first.value.div(den.value)
        {
            return Some(q);
        }
    }
    Some(first.value)
}

// ---------------------------------------------------------------------------------------------
// Extraction

/// Which rule found the answer (in priority order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// `\boxed{N}`.
    Boxed,
    /// `#### N`.
    Hashes,
    /// "the answer is N", "Answer: N".
    AnswerIs,
    /// A printed-output block after code, or "the output is N".
    PrintedOutput,
    /// The last number in the prose.
    LastNumber,
}

impl Rule {
    /// Every rule, highest priority first.
    pub const PRIORITY: [Rule; 5] = [
        Rule::Boxed,
        Rule::Hashes,
        Rule::AnswerIs,
        Rule::PrintedOutput,
        Rule::LastNumber,
    ];

    /// The rule's name in records.
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Boxed => "boxed",
            Rule::Hashes => "hashes",
            Rule::AnswerIs => "answer_is",
            Rule::PrintedOutput => "printed_output",
            Rule::LastNumber => "last_number",
        }
    }

    /// The rule named `name` in records.
    pub fn from_name(name: &str) -> Option<Rule> {
        Rule::PRIORITY.into_iter().find(|r| r.as_str() == name)
    }

    /// Whether the rule reads an explicit final-answer marker (`\boxed{}`, `#### N`, "the
    /// answer is N") rather than falling back on printed output or the last number.
    pub fn is_final_answer(self) -> bool {
        matches!(self, Rule::Boxed | Rule::Hashes | Rule::AnswerIs)
    }
}

/// An answer found in model output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Extracted {
    /// The value.
    pub value: Number,
    /// The rule that found it.
    pub rule: Rule,
    /// Byte offset in the output where the matched pattern (or number) starts.
    pub offset: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SegKind {
    Prose,
    Code,
    Output,
}

#[derive(Debug, Clone, Copy)]
struct Segment<'a> {
    kind: SegKind,
    start: usize,
    text: &'a str,
}

const OUTPUT_LANGS: [&str; 7] = [
    "output",
    "text",
    "txt",
    "console",
    "stdout",
    "plaintext",
    "plain",
];

/// Split `text` into prose, code and printed-output segments at fence lines.
fn segments(text: &str) -> Vec<Segment<'_>> {
    let mut segs = Vec::new();
    let mut prose_start = 0;
    let mut open: Option<(usize, SegKind)> = None;
    let mut seen_code = false;
    let mut line_start = 0;
    for line in text.split_inclusive('\n') {
        let trimmed = line.trim_start();
        let is_fence = trimmed.starts_with("```") || trimmed.starts_with("~~~");
        if is_fence {
            match open.take() {
                None => {
                    segs.push(Segment {
                        kind: SegKind::Prose,
                        start: prose_start,
                        text: &text[prose_start..line_start],
                    });
                    let info = trimmed[3..]
                        .trim_start_matches(['`', '~'])
                        .split_whitespace()
                        .next()
                        .unwrap_or("")
                        .to_ascii_lowercase();
                    let kind = if OUTPUT_LANGS.contains(&info.as_str()) {
                        SegKind::Output
                    } else if info.is_empty() {
                        if seen_code {
                            SegKind::Output
                        } else {
                            SegKind::Prose
                        }
                    } else {
                        seen_code = true;
                        SegKind::Code
                    };
                    open = Some((line_start + line.len(), kind));
                }
                Some((content_start, kind)) => {
                    segs.push(Segment {
                        kind,
                        start: content_start,
                        text: &text[content_start..line_start],
                    });
                    prose_start = line_start + line.len();
                }
            }
        }
        line_start += line.len();
    }
    let (start, kind) = open.unwrap_or((prose_start, SegKind::Prose));
    segs.push(Segment {
        kind,
        start,
        text: &text[start.min(text.len())..],
    });
    segs.retain(|s| !s.text.is_empty());
    segs
}

static HASHES_RE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?:^|[^#])(####)[ \t]*([^#\n][^\n]*)").expect("constant regex"));
static ANSWER_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)\banswer\b(?:\s+to\s+(?:the|this|that|your)\b[^\n.:]{0,60}?)?[\s*_]*(?::|=|\bis\b|\bwas\b|\bequals\b|\bwould\s+be\b|\bwill\s+be\b|\bshould\s+be\b)",
    )
    .expect("constant regex")
});
static PRINTED_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i)\b(?:output|outputs|prints?|printed)\b(?:\s+of\s+(?:the|this)\s+(?:code|program|script))?(?:\s+(?:is|was|will\s+be|would\s+be))?[\s*_]*[:=]?",
    )
    .expect("constant regex")
});

/// The text an answer phrase ending at `from` refers to: the rest of its line, or the next
/// non-blank line when the phrase ends its line.
fn window_after(text: &str, from: usize) -> &str {
    let rest = &text[from..];
    let line = rest.split('\n').next().unwrap_or("");
    let blank = line
        .trim_matches(|c: char| c.is_whitespace() || matches!(c, '*' | '_' | ':' | '`'))
        .is_empty();
    if blank {
        rest.split('\n')
            .skip(1)
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
    } else {
        line
    }
}

/// Words allowed between an answer phrase and its number ("the answer is therefore 18").
const MAX_GAP_WORDS: usize = 1;

/// The value a phrase refers to: the number that opens the sentence in `window` (at most
/// [`MAX_GAP_WORDS`] words before it), taken after the last `=` outside parentheses when that
/// part has one. A sentence that only mentions numbers further on ("the answer is found by
/// multiplying 9 by 2") refers to none: the later rules decide.
fn value_in_window(window: &str) -> Option<Number> {
    let b = window.as_bytes();
    let mut cut = window.len();
    for (i, &c) in b.iter().enumerate() {
        if matches!(c, b'.' | b'!' | b'?') && (i + 1 == b.len() || b[i + 1].is_ascii_whitespace()) {
            cut = i;
            break;
        }
    }
    let sentence = &window[..cut];
    let mut depth = 0i32;
    let mut last_eq = None;
    for (i, c) in sentence.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            '=' if depth <= 0 => last_eq = Some(i),
            _ => {}
        }
    }
    last_eq
        .and_then(|i| first_value(&sentence[i + 1..], MAX_GAP_WORDS))
        .or_else(|| first_value(sentence, MAX_GAP_WORDS))
}

/// The content of the brace group opening at `s[open]`.
pub(crate) fn braced(s: &str, open: usize) -> Option<&str> {
    let mut depth = 0usize;
    for (i, c) in s[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&s[open + 1..open + i]);
                }
            }
            _ => {}
        }
    }
    None
}

type Candidate = (usize, Number);

fn boxed_candidates(seg: &Segment<'_>, out: &mut Vec<Candidate>) {
    let t = seg.text;
    for cmd in ["\\boxed", "\\fbox"] {
        for (at, _) in t.match_indices(cmd) {
            let after = at + cmd.len();
            let open = after + (t[after..].len() - t[after..].trim_start().len());
            if !t[open..].starts_with('{') {
                continue;
            }
            let Some(content) = braced(t, open) else {
                continue;
            };
            let clean = delatex(content);
            let value = match clean.rfind('=') {
                Some(i) => parse_number(&clean[i + 1..]).or_else(|| parse_number(&clean)),
                None => parse_number(&clean),
            };
            if let Some(v) = value {
                out.push((seg.start + at, v));
            }
        }
    }
}

fn hashes_candidates(seg: &Segment<'_>, out: &mut Vec<Candidate>) {
    for caps in HASHES_RE.captures_iter(seg.text) {
        let (Some(mark), Some(rest)) = (caps.get(1), caps.get(2)) else {
            continue;
        };
        // The number must come first: `#### 18`, `#### $1,234`, not a heading `#### Step 1`.
        let lead = rest.as_str().trim_start_matches(|c: char| {
            c.is_whitespace() || matches!(c, '$' | '\\' | '(' | '[' | '*')
        });
        let numeric_start = lead
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_digit() || matches!(c, '-' | '−' | '.'));
        if !numeric_start {
            continue;
        }
        if let Some(v) = value_in_window(rest.as_str()) {
            out.push((seg.start + mark.start(), v));
        }
    }
}

fn phrase_candidates(re: &Regex, seg: &Segment<'_>, out: &mut Vec<Candidate>) {
    for m in re.find_iter(seg.text) {
        // `print(total)` quoted in prose is a call, not a statement about the result.
        if seg.text[m.end()..].starts_with('(') {
            continue;
        }
        if let Some(v) = value_in_window(window_after(seg.text, m.end())) {
            out.push((seg.start + m.start(), v));
        }
    }
}

fn last_number_candidate(seg: &Segment<'_>, out: &mut Vec<Candidate>) {
    let clean = delatex(seg.text);
    if let Some(last) = scan_numbers(&clean).last() {
        // Offsets into cleaned text only order candidates within one segment; clamp to it.
        out.push((seg.start + last.start.min(seg.text.len()), last.value));
    }
}

/// Find the final answer in model output (rules in the module docs). `None` when the output
/// states no number outside code.
pub fn extract_answer(output: &str) -> Option<Extracted> {
    let segs = segments(output);
    for rule in Rule::PRIORITY {
        let mut found = Vec::new();
        for seg in &segs {
            candidates(rule, seg, &mut found);
        }
        if let Some(&(offset, value)) = found.iter().max_by_key(|(offset, _)| *offset) {
            return Some(Extracted {
                value,
                rule,
                offset,
            });
        }
    }
    None
}

/// Where each rule looks: explicit markers in prose and printed output, phrases in prose,
/// printed-output blocks, and the fallback in prose only; never in code.
fn candidates(rule: Rule, seg: &Segment<'_>, out: &mut Vec<Candidate>) {
    match (rule, seg.kind) {
        (_, SegKind::Code) => {}
        (Rule::Boxed, _) => boxed_candidates(seg, out),
        (Rule::Hashes, _) => hashes_candidates(seg, out),
        (Rule::AnswerIs, SegKind::Prose) => phrase_candidates(&ANSWER_RE, seg, out),
        (Rule::PrintedOutput, SegKind::Prose) => phrase_candidates(&PRINTED_RE, seg, out),
        (Rule::PrintedOutput, SegKind::Output) => last_number_candidate(seg, out),
        (Rule::LastNumber, SegKind::Prose) => last_number_candidate(seg, out),
        (Rule::AnswerIs | Rule::LastNumber, SegKind::Output) => {}
    }
}

#[cfg(test)]
#[path = "gsm8k_tests.rs"]
mod tests;
