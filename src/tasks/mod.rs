//! Evaluation tasks: a problem set, how to prompt a model with a problem, and how to grade what
//! the model wrote.
//!
//! A [`Task`] owns its problems and one prompt format (fixed per campaign, see
//! `docs/guide/concepts.md`). Prompts come out either as chat [`Message`]s, which the caller renders
//! with the model's own chat template, or as raw [`Prompt::Text`]. Grading is pure: it never
//! runs model output (see [`gsm8k`] for the GSM8K extraction rules and [`grade`] for the
//! graders a spec chooses from).
//!
//! A `[task]` spec ([`TaskSpec`]) names the bundled GSM8K or a JSONL/Parquet file with a field
//! mapping, a prompt recipe and a grader, and loads into a [`SpecTask`].
use serde::{Deserialize, Serialize};
use std::fmt;

pub mod grade;
pub mod gsm8k;
pub mod spec;

pub use grade::{Grader, GraderSpec};
pub use gsm8k::Gsm8k;
pub use spec::{SpecTask, TaskSpec};

/// One item of a task's data set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// Stable id, unique within the task (`gsm8k-test-17`).
    pub id: String,
    /// 0-based position in the source file.
    pub index: usize,
    /// The question as given to the model.
    pub question: String,
    /// The reference solution, as in the source (for GSM8K: the worked solution ending in `#### N`).
    pub solution: String,
    /// The gold final answer as written in the source (`1,600`), before normalization.
    pub gold: String,
    /// The choices of a multiple-choice item, in label order (empty otherwise).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub choices: Vec<String>,
}

/// One chat message, to be rendered by the model's chat template.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The message text.
    pub content: String,
}

impl Message {
    /// A message with `role`.
    pub fn new(role: &str, content: impl Into<String>) -> Message {
        Message {
            role: role.to_string(),
            content: content.into(),
        }
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Message {
        Message::new("user", content)
    }
}

/// What the model is fed for one problem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Prompt {
    /// Chat messages; render with the model's chat template and `add_generation_prompt = true`.
    Chat {
        /// The conversation so far; the model writes the next assistant turn.
        messages: Vec<Message>,
    },
    /// Raw text, tokenized as is (a BOS token is the tokenizer's business); the model continues it.
    Text {
        /// The whole prompt.
        text: String,
    },
}

/// The grade of one model output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grade {
    /// The normalized answer found in the output, if any (`18`, `-3.5`, `2/3`).
    pub predicted: Option<String>,
    /// The extraction rule that produced it (`boxed`, `hashes`, `answer_is`, `printed_output`,
    /// `last_number`).
    pub rule: Option<String>,
    /// Whether `predicted` equals the gold answer after normalization.
    pub correct: bool,
}

/// A task: problems, one prompt format, and a grader.
pub trait Task {
    /// Short name for records (`gsm8k`).
    fn name(&self) -> &str;
    /// The grader's name for records (`numeric`, `exact`, `choice`, `regex`, `math`).
    fn grader(&self) -> &str;
    /// The selected problems, in order.
    fn problems(&self) -> &[Problem];
    /// The prompt for one problem.
    fn prompt(&self, problem: &Problem) -> Prompt;
    /// Text stop sequences for generation, on top of the model's end-of-sequence tokens.
    fn stop_sequences(&self) -> &[String];
    /// A default generation budget in new tokens.
    fn max_new_tokens(&self) -> usize;
    /// Grade one output (the generated text only, without the prompt).
    fn grade(&self, problem: &Problem, output: &str) -> Grade;
}

/// Cut `output` at the first occurrence of any stop sequence (what a generator that honours
/// the stops would have returned).
pub fn truncate_at_stops<'a>(output: &'a str, stops: &[impl AsRef<str>]) -> &'a str {
    let cut = stops
        .iter()
        .map(AsRef::as_ref)
        .filter(|s| !s.is_empty())
        .filter_map(|s| output.find(s))
        .min()
        .unwrap_or(output.len());
    &output[..cut]
}

/// Accuracy over a set of graded outputs, with a Wilson 95% interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Accuracy {
    /// Number graded correct.
    pub correct: usize,
    /// Number graded.
    pub total: usize,
}

impl Accuracy {
    /// Count `true`s in an iterator of outcomes.
    pub fn from_outcomes(outcomes: impl IntoIterator<Item = bool>) -> Accuracy {
        outcomes
            .into_iter()
            .fold(Accuracy::default(), |mut acc, ok| {
                acc.push(ok);
                acc
            })
    }

    /// Add one outcome.
    pub fn push(&mut self, correct: bool) {
        self.total += 1;
        self.correct += usize::from(correct);
    }

    /// `correct / total`, 0 when nothing was graded.
    pub fn rate(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.correct as f64 / self.total as f64
        }
    }

    /// Wilson 95% interval of the rate.
    pub fn wilson95(&self) -> (f64, f64) {
        crate::stats::wilson(
            self.correct as u64,
            self.total.max(self.correct) as u64,
            0.95,
        )
        .ok()
        .flatten()
        .unwrap_or((0.0, 1.0))
    }
}

impl fmt::Display for Accuracy {
    /// `7/20 = 35.0% (95% CI 18.1%-56.7%)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (lo, hi) = self.wilson95();
        write!(
            f,
            "{}/{} = {:.1}% (95% CI {:.1}%-{:.1}%)",
            self.correct,
            self.total,
            100.0 * self.rate(),
            100.0 * lo,
            100.0 * hi
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acc(correct: usize, total: usize) -> Accuracy {
        Accuracy { correct, total }
    }

    #[test]
    fn wilson_matches_published_values() {
        // 7/20: Wilson 95% interval 0.18119-0.56715 (statsmodels proportion_confint(method="wilson")).
        let (lo, hi) = acc(7, 20).wilson95();
        assert!((lo - 0.181192).abs() < 1e-6, "{lo}");
        assert!((hi - 0.567146).abs() < 1e-6, "{hi}");
    }

    #[test]
    fn wilson_stays_inside_unit_interval_at_extremes() {
        let (lo, hi) = acc(0, 20).wilson95();
        assert_eq!(lo, 0.0);
        assert!(hi > 0.1 && hi < 0.2, "{hi}");
        let (lo, hi) = acc(20, 20).wilson95();
        assert!(lo > 0.8 && lo < 0.9, "{lo}");
        assert!((hi - 1.0).abs() < 1e-12, "{hi}");
    }

    #[test]
    fn wilson_of_nothing_is_the_whole_interval() {
        assert_eq!(acc(0, 0).wilson95(), (0.0, 1.0));
        assert_eq!(Accuracy::default().rate(), 0.0);
    }

    #[test]
    fn accuracy_counts_and_formats() {
        let acc = Accuracy::from_outcomes([true, false, true, true]);
        assert_eq!(
            acc,
            Accuracy {
                correct: 3,
                total: 4
            }
        );
        assert_eq!(acc.rate(), 0.75);
        let acc = Accuracy {
            correct: 7,
            total: 20,
        };
        assert_eq!(acc.to_string(), "7/20 = 35.0% (95% CI 18.1%-56.7%)");
    }

    #[test]
    fn truncation_cuts_at_earliest_stop() {
        let out = " 6 trees. The answer is 6.\n\nQ: next";
        assert_eq!(
            truncate_at_stops(out, &["Q:", "\n\n"]),
            " 6 trees. The answer is 6."
        );
        assert_eq!(truncate_at_stops("no stop here", &["Q:"]), "no stop here");
        assert_eq!(truncate_at_stops("abc", &[""]), "abc");
    }
}
