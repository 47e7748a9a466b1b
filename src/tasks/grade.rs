//! Graders: how an answer is found in model output and compared with the gold answer, chosen by
//! name in a `[task.grader]` table (`kind = "..."`).
//!
//! - `numeric`: the GSM8K extraction rules ([`super::gsm8k`]: `boxed`, `hashes`, `answer_is`,
//!   `printed_output`, `last_number`), exact rational equality, or within `tolerance` (absolute)
//!   / `relative_tolerance`. A gold answer must be a number; `units` lists words that may
//!   follow it (`12 cm`).
//! - `exact`: normalized exact match of a string answer, read from `\boxed{..}` (`boxed`),
//!   "the answer is X" / "Answer: X" (`answer_is`), or else the last non-empty line
//!   (`last_line`). Normalization lowercases (unless `case_sensitive`), turns punctuation into
//!   spaces, drops the articles a/an/the (unless `keep_articles`) and collapses whitespace.
//!   `alternatives = "|"` splits the gold into accepted answers.
//! - `choice`: a multiple-choice letter, read from `\boxed{B}` (`boxed`), "the answer is (B)" /
//!   "Answer: B" / "the correct option is B" (`answer_is`), a line that is only a label or a
//!   parenthesized label `(B)` (`letter`), or else a last line equal to one choice's text
//!   (`choice_text`). Letters outside the problem's choices never match; only capital letters
//!   count, so the article "a" and words like "Because" are not answers.
//! - `regex`: the last match of `pattern` (its group `answer`, else group 1) (`regex`),
//!   compared as normalized strings or, with `compare = "numeric"`, as numbers.
//! - `math`: a LaTeX answer from the last `\boxed{..}` (`boxed`), "the answer is X"
//!   (`answer_is`) or the last number (`last_number`), normalized ([`normalize_math`]) and
//!   compared as exact rationals when both sides are numbers, else as canonical strings.
//!
//! Within a rule the last occurrence wins; the rule that fired is recorded with every grade.
use super::gsm8k::{self, Number};
use super::{Grade, Problem};
use crate::{Error, Result};
use regex::Regex;
use serde::{Deserialize, Serialize};
use std::sync::LazyLock;

/// A grader as written in a spec (`[task.grader]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum GraderSpec {
    /// Numbers, by the GSM8K rules.
    Numeric {
        /// Largest absolute difference still graded correct (0: exact equality).
        #[serde(default)]
        tolerance: f64,
        /// Largest difference relative to the gold's magnitude still graded correct.
        #[serde(default)]
        relative_tolerance: f64,
        /// Unit words allowed after a gold number (`cm`, `dollars`).
        #[serde(default)]
        units: Vec<String>,
    },
    /// Normalized exact match of strings.
    Exact {
        /// Compare case-sensitively.
        #[serde(default)]
        case_sensitive: bool,
        /// Keep the articles a/an/the.
        #[serde(default)]
        keep_articles: bool,
        /// Separator of accepted alternatives in the gold (`"|"`).
        #[serde(default)]
        alternatives: Option<String>,
    },
    /// A multiple-choice letter.
    Choice {
        /// The labels, in choice order (default `ABCDEFGHIJ`).
        #[serde(default)]
        labels: Option<String>,
    },
    /// A regular expression's capture.
    Regex {
        /// The pattern; its group `answer`, or else group 1, is the answer.
        pattern: String,
        /// How the capture is compared with the gold.
        #[serde(default)]
        compare: Compare,
        /// Compare strings case-sensitively.
        #[serde(default)]
        case_sensitive: bool,
    },
    /// LaTeX math answers.
    Math {
        /// Unit words dropped after an answer (on top of `\text{..}` units).
        #[serde(default)]
        units: Vec<String>,
    },
}

/// How a regex capture is compared with the gold answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Compare {
    /// Normalized strings (as the `exact` grader).
    #[default]
    Exact,
    /// Numbers (as the `numeric` grader, exact equality).
    Numeric,
}

impl GraderSpec {
    /// The grader's name in records.
    pub fn name(&self) -> &'static str {
        match self {
            GraderSpec::Numeric { .. } => "numeric",
            GraderSpec::Exact { .. } => "exact",
            GraderSpec::Choice { .. } => "choice",
            GraderSpec::Regex { .. } => "regex",
            GraderSpec::Math { .. } => "math",
        }
    }

    /// The numeric grader of GSM8K (exact equality, no units).
    pub fn gsm8k() -> GraderSpec {
        GraderSpec::Numeric {
            tolerance: 0.0,
            relative_tolerance: 0.0,
            units: vec![],
        }
    }

    /// The runnable grader; a bad option is an error.
    pub fn build(&self) -> Result<Grader> {
        let bad = |m: String| Err(Error::Spec(format!("task.grader ({}): {m}", self.name())));
        match self {
            GraderSpec::Numeric {
                tolerance,
                relative_tolerance,
                ..
            } if !(tolerance.is_finite()
                && relative_tolerance.is_finite()
                && *tolerance >= 0.0
                && *relative_tolerance >= 0.0) =>
            {
                bad("tolerance and relative_tolerance must be finite and non-negative".into())
            }
            GraderSpec::Exact {
                alternatives: Some(sep),
                ..
            } if sep.is_empty() => bad("alternatives must be a non-empty separator".into()),
            GraderSpec::Choice { labels: Some(l) }
                if l.is_empty()
                    || !l.chars().all(|c| c.is_ascii_uppercase())
                    || (1..l.len()).any(|i| l[..i].contains(&l[i..i + 1])) =>
            {
                bad(format!("labels `{l}` must be distinct capital letters"))
            }
            GraderSpec::Regex { pattern, .. } => {
                let re = match Regex::new(pattern) {
                    Ok(re) => re,
                    Err(e) => {
                        let first = e
                            .to_string()
                            .lines()
                            .last()
                            .unwrap_or("")
                            .trim()
                            .to_string();
                        return bad(format!("pattern `{pattern}` does not compile: {first}"));
                    }
                };
                if re.captures_len() < 2 {
                    return bad(format!(
                        "pattern `{pattern}` has no capture group (the answer is group `answer` or group 1)"
                    ));
                }
                Ok(Grader {
                    spec: self.clone(),
                    regex: Some(re),
                })
            }
            _ => Ok(Grader {
                spec: self.clone(),
                regex: None,
            }),
        }
    }
}

/// A grader ready to run (its options checked, its pattern compiled).
#[derive(Debug, Clone)]
pub struct Grader {
    spec: GraderSpec,
    regex: Option<Regex>,
}

/// Whether an extraction rule reads an explicit final-answer marker (`\boxed{}`, `#### N`,
/// "the answer is X", a user's pattern) rather than a fallback (printed output, the last
/// number, line or letter). Rule names mean the same in every grader.
pub fn is_final_answer_rule(rule: &str) -> bool {
    matches!(rule, "boxed" | "hashes" | "answer_is" | "regex")
}

impl Grader {
    /// The spec it was built from.
    pub fn spec(&self) -> &GraderSpec {
        &self.spec
    }

    /// The grader's name in records.
    pub fn name(&self) -> &'static str {
        self.spec.name()
    }

    /// Why `problem`'s gold answer cannot be graded, if it cannot (checked when a task loads).
    pub fn check_gold(&self, problem: &Problem) -> std::result::Result<(), String> {
        let gold = problem.gold.trim();
        if gold.is_empty() {
            return Err("gold answer is empty".into());
        }
        match &self.spec {
            GraderSpec::Numeric { units, .. } => strict_number(gold, units).map(|_| ()),
            GraderSpec::Exact { .. } => Ok(()),
            GraderSpec::Choice { .. } => {
                if problem.choices.is_empty() {
                    return Err("has no choices (map task.fields.choices)".into());
                }
                if problem.choices.len() > self.labels().len() {
                    return Err(format!(
                        "has {} choices but the grader has {} labels",
                        problem.choices.len(),
                        self.labels().len()
                    ));
                }
                self.gold_label(problem).map(|_| ())
            }
            GraderSpec::Regex { compare, .. } => match compare {
                Compare::Exact => Ok(()),
                Compare::Numeric => strict_number(gold, &[]).map(|_| ()),
            },
            GraderSpec::Math { .. } => Ok(()),
        }
    }

    /// Grade `output` (already cut at the task's stop sequences) against `problem`'s gold.
    pub fn grade(&self, problem: &Problem, output: &str) -> Grade {
        match &self.spec {
            GraderSpec::Numeric {
                tolerance,
                relative_tolerance,
                ..
            } => {
                let mut g = gsm8k::grade_answer(output, &problem.gold);
                if !g.correct && (*tolerance > 0.0 || *relative_tolerance > 0.0) {
                    let found = gsm8k::extract_answer(output).map(|e| e.value);
                    if let (Some(p), Some(gold)) = (found, gsm8k::parse_number(&problem.gold)) {
                        let (p, gold) = (to_f64(p), to_f64(gold));
                        g.correct =
                            (p - gold).abs() <= tolerance.max(relative_tolerance * gold.abs());
                    }
                }
                g
            }
            GraderSpec::Exact {
                case_sensitive,
                keep_articles,
                alternatives,
            } => {
                let found = extract_text(output);
                let norm = |s: &str| normalize_text(s, *case_sensitive, *keep_articles);
                let golds: Vec<&str> = match alternatives {
                    Some(sep) => problem.gold.split(sep.as_str()).collect(),
                    None => vec![problem.gold.as_str()],
                };
                let correct = found.as_ref().is_some_and(|(_, text)| {
                    let p = norm(text);
                    !p.is_empty() && golds.iter().any(|g| norm(g) == p)
                });
                grade_of(found.map(|(rule, text)| (rule, norm(&text))), correct)
            }
            GraderSpec::Choice { .. } => {
                let found = self.extract_letter(problem, output);
                let gold = self.gold_label(problem).ok();
                let correct = matches!((&found, gold), (Some((_, l)), Some(g)) if *l == g);
                grade_of(found.map(|(r, l)| (r, l.to_string())), correct)
            }
            GraderSpec::Regex {
                compare,
                case_sensitive,
                ..
            } => {
                let re = self.regex.as_ref().expect("built with its pattern");
                let found = re.captures_iter(output).last().and_then(|c| {
                    c.name("answer")
                        .or_else(|| c.get(1))
                        .map(|m| m.as_str().to_string())
                });
                let (predicted, correct) = match (compare, found) {
                    (_, None) => (None, false),
                    (Compare::Exact, Some(s)) => {
                        let p = normalize_text(&s, *case_sensitive, true);
                        let ok = !p.is_empty()
                            && p == normalize_text(&problem.gold, *case_sensitive, true);
                        (Some(p), ok)
                    }
                    (Compare::Numeric, Some(s)) => match gsm8k::parse_number(&s) {
                        Some(v) => (
                            Some(v.to_string()),
                            gsm8k::parse_number(&problem.gold) == Some(v),
                        ),
                        None => (None, false),
                    },
                };
                Grade {
                    rule: predicted.as_ref().map(|_| "regex".to_string()),
                    predicted,
                    correct,
                }
            }
            GraderSpec::Math { units } => {
                let found = extract_math(output);
                let gold = normalize_math(&problem.gold, units);
                let pred = found.map(|(rule, s)| (rule, normalize_math(&s, units)));
                let correct = matches!(&pred, Some((_, p)) if !p.is_empty() && *p == gold);
                grade_of(pred, correct)
            }
        }
    }

    fn labels(&self) -> Vec<char> {
        match &self.spec {
            GraderSpec::Choice {
                labels: Some(labels),
            } => labels.chars().collect(),
            _ => "ABCDEFGHIJ".chars().collect(),
        }
    }

    /// The gold's label: a label (`B`, `(B)`), a 0-based index (`1`), or a choice's text.
    pub fn gold_label(&self, problem: &Problem) -> std::result::Result<char, String> {
        let labels = &self.labels()[..problem.choices.len().min(self.labels().len())];
        let gold = problem.gold.trim();
        let bare = gold.trim_matches(|c: char| matches!(c, '(' | ')' | '.' | ' '));
        let mut chars = bare.chars();
        if let (Some(c), None) = (chars.next(), chars.next())
            && labels.contains(&c.to_ascii_uppercase())
        {
            return Ok(c.to_ascii_uppercase());
        }
        if let Ok(i) = gold.parse::<usize>()
            && i < labels.len()
        {
            return Ok(labels[i]);
        }
        let norm = |s: &str| normalize_text(s, false, true);
        let hits: Vec<usize> = (0..labels.len())
            .filter(|&i| norm(&problem.choices[i]) == norm(gold))
            .collect();
        match hits[..] {
            [i] => Ok(labels[i]),
            _ => Err(format!(
                "gold answer `{gold}` is not a label ({}), a 0-based index or the text of one choice",
                labels.iter().collect::<String>()
            )),
        }
    }

    fn extract_letter(&self, problem: &Problem, output: &str) -> Option<(&'static str, char)> {
        let all = self.labels();
        let labels = &all[..problem.choices.len().min(all.len())];
        let ok = |m: Option<regex::Match<'_>>| {
            m.and_then(|m| m.as_str().chars().next())
                .filter(|c| labels.contains(c))
        };
        if let Some(l) = boxed_contents(output)
            .iter()
            .rev()
            .find_map(|b| ok(CHOICE_BOXED_RE.captures(b).and_then(|c| c.get(1))))
        {
            return Some(("boxed", l));
        }
        // "The answer is A cat": a bare `A` or `I` followed by a lowercase word is a word.
        let stated = CHOICE_ANSWER_RE
            .captures_iter(output)
            .filter(|c| {
                let word = c.get(1).is_none()
                    && matches!(&c[2], "A" | "I")
                    && c[3].starts_with(char::is_whitespace)
                    && c[3].trim_start().starts_with(|ch: char| ch.is_lowercase());
                !word
            })
            .filter_map(|c| ok(c.get(2)))
            .last();
        if let Some(l) = stated {
            return Some(("answer_is", l));
        }
        let mut letters: Vec<(usize, char)> = CHOICE_LINE_RE
            .captures_iter(output)
            .chain(CHOICE_PAREN_RE.captures_iter(output))
            .filter_map(|c| Some((c.get(1)?.start(), ok(c.get(1))?)))
            .collect();
        letters.sort_unstable();
        if let Some(&(_, l)) = letters.last() {
            return Some(("letter", l));
        }
        let line = output.lines().rev().find(|l| !l.trim().is_empty())?;
        let norm = |s: &str| normalize_text(s, false, true);
        let hits: Vec<usize> = (0..labels.len())
            .filter(|&i| !norm(&problem.choices[i]).is_empty())
            .filter(|&i| norm(&problem.choices[i]) == norm(line))
            .collect();
        match hits[..] {
            [i] => Some(("choice_text", labels[i])),
            _ => None,
        }
    }
}

fn grade_of(found: Option<(&'static str, String)>, correct: bool) -> Grade {
    match found {
        Some((rule, predicted)) => Grade {
            predicted: Some(predicted),
            rule: Some(rule.to_string()),
            correct,
        },
        None => Grade {
            predicted: None,
            rule: None,
            correct: false,
        },
    }
}

fn to_f64(n: Number) -> f64 {
    let (num, den) = n.parts();
    num as f64 / den as f64
}

/// The gold as a number when it is only a number, with at most one of `units` after it.
fn strict_number(gold: &str, units: &[String]) -> std::result::Result<Number, String> {
    let mut text = gold.trim().trim_end_matches('.').trim_end();
    for u in units {
        let lower = text.to_lowercase();
        if lower.ends_with(&u.to_lowercase()) && text.len() > u.len() {
            let rest = &text[..text.len() - u.len()];
            if rest.ends_with(|c: char| c.is_ascii_digit() || c.is_whitespace() || c == '}') {
                text = rest.trim_end();
                break;
            }
        }
    }
    let clean = gsm8k::delatex(text);
    if clean.chars().any(char::is_alphabetic) {
        return Err(format!(
            "gold answer `{gold}` has text besides the number (list a unit in task.grader.units)"
        ));
    }
    gsm8k::parse_number(text).ok_or_else(|| format!("gold answer `{gold}` is not a number"))
}

/// Lowercase (unless `case_sensitive`), punctuation to spaces, articles dropped (unless
/// `keep_articles`), whitespace collapsed.
pub fn normalize_text(s: &str, case_sensitive: bool, keep_articles: bool) -> String {
    let s: String = s
        .chars()
        .map(|c| {
            if c.is_alphanumeric() || c.is_whitespace() {
                c
            } else {
                ' '
            }
        })
        .collect();
    let s = if case_sensitive { s } else { s.to_lowercase() };
    s.split_whitespace()
        .filter(|w| keep_articles || !matches!(w.to_lowercase().as_str(), "a" | "an" | "the"))
        .collect::<Vec<_>>()
        .join(" ")
}

static ANSWER_PHRASE_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?i)\banswer\b(?:\s+to\s+(?:the|this|that)\b[^\n.:]{0,60}?)?[\s*_]*(?::|\bis\b|\bwas\b|=)[\s*_:]*")
        .expect("constant regex")
});
static CHOICE_BOXED_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^\s*(?:\\(?:text|mathrm|textbf)\{)?\s*\(?\s*([A-Z])\s*\)?\s*\}?\s*$")
        .expect("constant regex")
});
static CHOICE_ANSWER_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(
        r"(?i:\b(?:answer|option|choice)\b(?:\s+(?:is|would\s+be|should\s+be))?)[\s*_:]*(?:\$?\\boxed\{)?([\(\[])?([A-Z])\b([^\n]*)",
    )
    .expect("constant regex")
});
static CHOICE_LINE_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?m)^[\s*_]*[\(\[]?([A-Z])[\)\]]?[.:]?[\s*_]*$").expect("constant regex")
});
static CHOICE_PAREN_RE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"\(([A-Z])\)").expect("constant regex"));

/// The contents of every `\boxed{..}` / `\fbox{..}` in `s`, in order (nested braces).
pub fn boxed_contents(s: &str) -> Vec<&str> {
    let mut out: Vec<(usize, &str)> = Vec::new();
    for cmd in ["\\boxed", "\\fbox"] {
        for (at, _) in s.match_indices(cmd) {
            let after = at + cmd.len();
            let open = after + (s[after..].len() - s[after..].trim_start().len());
            if s[open..].starts_with('{')
                && let Some(c) = gsm8k::braced(s, open)
            {
                out.push((at, c));
            }
        }
    }
    out.sort_unstable_by_key(|(at, _)| *at);
    out.into_iter().map(|(_, c)| c).collect()
}

/// The text after the last "the answer is" / "Answer:" phrase, to the end of its sentence
/// (or the next non-blank line when the phrase ends its line).
fn answer_phrase(output: &str) -> Option<String> {
    let m = ANSWER_PHRASE_RE.find_iter(output).last()?;
    let rest = &output[m.end()..];
    let line = rest
        .lines()
        .find(|l| !l.trim().trim_matches(['*', '_']).is_empty())?;
    let b = line.as_bytes();
    let cut = (0..b.len())
        .find(|&i| matches!(b[i], b'.' | b'!' | b'?') && (i + 1 == b.len() || b[i + 1] == b' '))
        .unwrap_or(b.len());
    let s = line[..cut].trim().trim_matches(['*', '_', '$', '"']).trim();
    (!s.is_empty()).then(|| s.to_string())
}

/// A string answer: `boxed`, `answer_is`, or the last non-empty line (`last_line`).
fn extract_text(output: &str) -> Option<(&'static str, String)> {
    if let Some(b) = boxed_contents(output).last() {
        let inner = b.trim();
        let inner = ["\\text{", "\\mathrm{", "\\textbf{"]
            .iter()
            .find_map(|p| inner.strip_prefix(p).and_then(|r| r.strip_suffix('}')))
            .unwrap_or(inner);
        return Some(("boxed", inner.to_string()));
    }
    if let Some(s) = answer_phrase(output) {
        return Some(("answer_is", s));
    }
    let line = output.lines().rev().find(|l| !l.trim().is_empty())?;
    Some(("last_line", line.trim().to_string()))
}

/// A math answer: the last `\boxed{..}`, "the answer is X", or else the GSM8K rules' number
/// (`hashes`, `printed_output`, `last_number`).
fn extract_math(output: &str) -> Option<(&'static str, String)> {
    if let Some(b) = boxed_contents(output).last() {
        return Some(("boxed", b.to_string()));
    }
    if let Some(s) = answer_phrase(output) {
        return Some(("answer_is", s));
    }
    let e = gsm8k::extract_answer(output)?;
    Some((e.rule.as_str(), e.value.to_string()))
}

static TEXT_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}").expect("constant regex")
});
static THOUSANDS_RE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$").expect("constant regex"));
static PLAIN_NUMBER_RE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^-?(?:\d+(?:\.\d*)?|\.\d+)$").expect("constant regex"));
static SIMPLE_FRAC_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}$").expect("constant regex")
});
static SLASH_FRAC_RE: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)$").expect("constant regex"));
static TRAILING_WORDS_RE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"^(.*?[0-9}])\s+[A-Za-z]{2,}(?:\s+[A-Za-z]+)*\.?$").expect("constant regex")
});

/// A math answer in canonical form: an exact rational when it is a number (`\frac{1}{2}`,
/// `\dfrac12`, `0.5`, `1,000`, `50\%`, `5 \text{ cm}`, `x = 5`), else a string with LaTeX
/// spacing, `\left`/`\right`, `\dfrac`/`\tfrac`, brace-less `\frac12`/`\sqrt2`, `\text{}`
/// units, degrees and spaces normalized (`\dfrac{\sqrt3}{2}` and `\frac{\sqrt{3}}{2}` agree).
pub fn normalize_math(answer: &str, units: &[String]) -> String {
    let mut s = answer.trim().to_string();
    for (open, close) in [("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")] {
        if let Some(inner) = s.strip_prefix(open).and_then(|r| r.strip_suffix(close)) {
            s = inner.trim().to_string();
        }
    }
    for (from, to) in [
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\:", ""),
        ("\\ ", " "),
        ("~", " "),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("\\%", "%"),
        ("\\$", ""),
        ("$", ""),
        ("{,}", ","),
        ("^\\circ", ""),
        ("^{\\circ}", ""),
        ("°", ""),
        ("\\displaystyle", ""),
    ] {
        s = s.replace(from, to);
    }
    // Units: a trailing `\text{ cm}` after a value is dropped; other `\text{..}` keep their text.
    if let Some(m) = TEXT_RE.find_iter(&s).last() {
        let inner = TEXT_RE
            .captures(m.as_str())
            .map(|c| c[1].trim().to_string());
        let before = s[..m.start()].trim_end();
        let unit =
            inner.is_some_and(|i| i.chars().all(|c| c.is_alphabetic() || c == ' ' || c == '.'));
        if unit
            && s[m.end()..].trim().is_empty()
            && before.ends_with(|c: char| c.is_ascii_digit() || c == '}')
        {
            s = before.to_string();
        }
    }
    s = TEXT_RE.replace_all(&s, "$1").into_owned();
    for u in units {
        if let Some(rest) = s.trim_end().strip_suffix(u.as_str())
            && rest.ends_with(|c: char| c.is_ascii_digit() || c.is_whitespace() || c == '}')
        {
            s = rest.to_string();
        }
    }
    if let Some(c) = TRAILING_WORDS_RE.captures(s.trim()) {
        s = c[1].to_string();
    }
    // `x = 5`: the value after the last top-level `=` when a lone variable precedes it.
    if let Some((lhs, rhs)) = s.rsplit_once('=')
        && lhs.trim().chars().count() == 1
        && lhs.trim().chars().all(char::is_alphabetic)
    {
        s = rhs.to_string();
    }
    let s = s.trim().trim_end_matches('.').trim();
    let s = s.strip_suffix('%').unwrap_or(s).trim();
    let s = braced_args(s);
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    let s = if THOUSANDS_RE.is_match(&s) {
        s.replace(',', "")
    } else {
        s
    };
    match math_number(&s) {
        Some(n) => n.to_string(),
        None => s,
    }
}

/// `\frac` and `\sqrt` with every argument in braces (`\frac12` → `\frac{1}{2}`, `\sqrt3` →
/// `\sqrt{3}`), recursively.
fn braced_args(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 8);
    let mut i = 0;
    while i < s.len() {
        let rest = &s[i..];
        let cmd = ["\\frac", "\\sqrt"]
            .into_iter()
            .find(|c| rest.starts_with(c) && !rest[c.len()..].starts_with(char::is_alphabetic));
        let Some(cmd) = cmd else {
            let c = rest.chars().next().expect("non-empty");
            out.push(c);
            i += c.len_utf8();
            continue;
        };
        out.push_str(cmd);
        i += cmd.len();
        let nargs = if cmd == "\\frac" { 2 } else { 1 };
        for _ in 0..nargs {
            let ws = s[i..].len() - s[i..].trim_start().len();
            let at = i + ws;
            if s[at..].starts_with('{') {
                match gsm8k::braced(s, at) {
                    Some(inner) => {
                        out.push('{');
                        out.push_str(&braced_args(inner));
                        out.push('}');
                        i = at + inner.len() + 2;
                    }
                    None => break,
                }
            } else if let Some(c) = s[at..].chars().next().filter(char::is_ascii_alphanumeric) {
                out.push('{');
                out.push(c);
                out.push('}');
                i = at + 1;
            } else {
                break;
            }
        }
    }
    out
}

/// `s` as an exact rational when it is a plain number or a fraction of plain numbers.
fn math_number(s: &str) -> Option<Number> {
    let plain = |t: &str| {
        PLAIN_NUMBER_RE
            .is_match(t)
            .then(|| gsm8k::parse_number(t))
            .flatten()
    };
    if let Some(n) = plain(s) {
        return Some(n);
    }
    let (neg, num, den) = if let Some(c) = SIMPLE_FRAC_RE.captures(s) {
        (c[1].len() == 1, plain(&c[2])?, plain(&c[3])?)
    } else if let Some(c) = SLASH_FRAC_RE.captures(s) {
        (false, plain(&c[1])?, plain(&c[2])?)
    } else {
        return None;
    };
    let (a, b) = num.parts();
    let (c, d) = den.parts();
    let q = Number::new(a.checked_mul(d)?, b.checked_mul(c)?)?;
    if neg {
        let (n, d) = q.parts();
        Number::new(-n, d)
    } else {
        Some(q)
    }
}

#[cfg(test)]
#[path = "grade_tests.rs"]
mod tests;
