//! `[task]` in campaign, eval and divergence specs: the bundled GSM8K, or a JSONL/Parquet file
//! of problems with a field mapping, a prompt recipe and a grader ([`super::grade`]).
//!
//! ```toml
//! [task]
//! name = "capitals"               # label in records (default: the file's stem)
//! file = "capitals.jsonl"         # .jsonl or .parquet, relative to the spec's folder
//! start = 0                       # first row (default 0)
//! count = 3                       # rows (default: all from start)
//!
//! [task.fields]                   # row field → role (defaults: question, answer)
//! question = "q"
//! answer = "gold"                 # a string or a number
//! id = "id"                       # optional (default: NAME-ROW)
//! solution = "rationale"          # optional
//! choices = "options"             # optional: a list field, or a list of fields ["A", "B"]
//!
//! [task.prompt]
//! style = "chat"                  # chat (the model's chat template) or text
//! system = "Answer briefly."      # chat: a system message; text: a preamble
//! template = "{question}\n{choices}"   # placeholders {question}, {choices}, {id}
//! fewshot = "shots.jsonl"         # examples, same fields; user/assistant turns (chat) or
//! fewshot_count = 2               #   `template + example_answer + separator` blocks (text)
//! example_answer = "{answer}"     # placeholders {answer}, {solution}, {letter} (choice grader)
//! stop = ["\n\n"]                 # stop sequences (the end-of-turn markers are always added)
//! max_new_tokens = 128            # default budget (chat 512, text 256)
//!
//! [task.grader]
//! kind = "choice"                 # numeric, exact, choice, regex or math, with options
//! ```
//!
//! Bundled GSM8K is `bundled = "gsm8k"` with `format` (`zero-shot-chat` or `eight-shot-cot`),
//! `start` and `count`; it is prompted and graded (`numeric`) exactly as the older `[problems]`
//! table has it. Everything a file or mapping can get wrong (missing file, a row without a
//! mapped field, a gold answer the grader cannot read, duplicate ids, a bad pattern) is one
//! error line when the task loads, before anything runs.
use super::grade::{Grader, GraderSpec};
use super::gsm8k::{self, Gsm8k, PromptFormat};
use super::{Grade, Message, Problem, Prompt, Task, truncate_at_stops};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// A `[task]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskSpec {
    /// Label in records and reports (default: the bundled name or the file's stem).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A bundled task (`gsm8k`); exclusive with `file`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundled: Option<String>,
    /// A JSONL or Parquet file of problems (a relative path is relative to the spec's folder).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
    /// First row (0-based).
    #[serde(default)]
    pub start: usize,
    /// Rows (default: all from `start`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<usize>,
    /// Bundled GSM8K's prompt format: `zero-shot-chat` or `eight-shot-cot`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// Which fields of a file's rows hold what.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fields: Option<FieldMap>,
    /// How a file task's problems are put to the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<PromptSpec>,
    /// How answers are graded (required with `file`; bundled GSM8K grades `numeric`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grader: Option<GraderSpec>,
}

/// Row field names of each role.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FieldMap {
    /// The question (a string).
    #[serde(default = "default_question")]
    pub question: String,
    /// The gold answer (a string or a number).
    #[serde(default = "default_answer")]
    pub answer: String,
    /// A stable id (a string or an integer); default `NAME-ROW`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// A reference solution (for few-shot examples' `{solution}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub solution: Option<String>,
    /// Multiple-choice options: one field holding a list, or one field per choice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub choices: Option<ChoiceFields>,
}

impl Default for FieldMap {
    fn default() -> FieldMap {
        FieldMap {
            question: default_question(),
            answer: default_answer(),
            id: None,
            solution: None,
            choices: None,
        }
    }
}

fn default_question() -> String {
    "question".into()
}

fn default_answer() -> String {
    "answer".into()
}

/// Where a row's choices are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ChoiceFields {
    /// One field holding a list of strings.
    List(String),
    /// One field per choice, in label order.
    Fields(Vec<String>),
}

/// Chat messages rendered by the model's template, or raw text.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptStyle {
    /// Chat messages, rendered with the model's own chat template.
    #[default]
    Chat,
    /// Raw text the model continues.
    Text,
}

/// How a file task's problems are put to the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptSpec {
    /// `chat` (default) or `text`.
    #[serde(default)]
    pub style: PromptStyle,
    /// Chat: a system message; text: a preamble followed by a blank line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    /// The question's turn: `{question}`, `{choices}` (`A. ..` lines), `{id}`.
    #[serde(default = "default_template")]
    pub template: String,
    /// A file of few-shot examples with the task's fields (relative to the spec's folder).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fewshot: Option<PathBuf>,
    /// Use only the first examples (default: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fewshot_count: Option<usize>,
    /// An example's answer: `{answer}`, `{solution}`, `{letter}`.
    #[serde(default = "default_example_answer")]
    pub example_answer: String,
    /// Text style: what follows each example's answer.
    #[serde(default = "default_separator")]
    pub separator: String,
    /// Stop sequences (default: a blank line for text, none for chat); the end-of-turn
    /// markers of the chat templates are always added.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Vec<String>>,
    /// Default generation budget (chat 512, text 256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<usize>,
}

impl Default for PromptSpec {
    fn default() -> PromptSpec {
        PromptSpec {
            style: PromptStyle::Chat,
            system: None,
            template: default_template(),
            fewshot: None,
            fewshot_count: None,
            example_answer: default_example_answer(),
            separator: default_separator(),
            stop: None,
            max_new_tokens: None,
        }
    }
}

fn default_template() -> String {
    "{question}".into()
}

fn default_example_answer() -> String {
    "{answer}".into()
}

fn default_separator() -> String {
    "\n\n".into()
}

/// End-of-turn markers that may be decoded as text; always stop sequences of a file task.
pub const END_MARKERS: [&str; 5] = [
    "<|im_end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<eos>",
    "</s>",
];

impl TaskSpec {
    /// Bundled GSM8K problems `start..start + count` in `format`.
    pub fn gsm8k(start: usize, count: usize, format: &str) -> TaskSpec {
        TaskSpec {
            name: None,
            bundled: Some("gsm8k".into()),
            file: None,
            start,
            count: Some(count),
            format: Some(format.into()),
            fields: None,
            prompt: None,
            grader: None,
        }
    }

    /// The task's label.
    pub fn label(&self) -> String {
        if let Some(n) = &self.name {
            return n.clone();
        }
        match (&self.bundled, &self.file) {
            (Some(b), _) => b.clone(),
            (None, Some(f)) => f
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "task".into()),
            (None, None) => "task".into(),
        }
    }

    /// Make relative file paths relative to `base` (the spec file's folder).
    pub fn resolve_paths(&mut self, base: &Path) {
        let join = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        if let Some(f) = &mut self.file {
            join(f);
        }
        if let Some(f) = self.prompt.as_mut().and_then(|p| p.fewshot.as_mut()) {
            join(f);
        }
    }

    fn err(&self, m: impl std::fmt::Display) -> Error {
        Error::Spec(format!("task `{}`: {m}", self.label()))
    }

    /// Check what can be checked without reading the file.
    pub fn validate(&self) -> Result<()> {
        if self.count == Some(0) {
            return Err(self.err("task.count must be positive"));
        }
        if self.name.as_ref().is_some_and(|n| n.trim().is_empty()) {
            return Err(self.err("task.name must not be empty"));
        }
        match (&self.bundled, &self.file) {
            (Some(_), Some(_)) => Err(self.err("set task.bundled or task.file, not both")),
            (None, None) => {
                Err(self
                    .err("set task.bundled (\"gsm8k\") or task.file (a .jsonl or .parquet file)"))
            }
            (Some(b), None) => {
                if b != "gsm8k" {
                    return Err(self.err(format!("unknown bundled task `{b}` (bundled: gsm8k)")));
                }
                for (set, key) in [
                    (self.name.is_some(), "name"),
                    (self.fields.is_some(), "fields"),
                    (self.prompt.is_some(), "prompt"),
                    (self.grader.is_some(), "grader"),
                ] {
                    if set {
                        return Err(self.err(format!(
                            "task.{key} is not used with bundled \"gsm8k\" (its name is gsm8k, its prompt task.format, its grader numeric); use task.file for your own recipe"
                        )));
                    }
                }
                let Some(format) = &self.format else {
                    return Err(self.err(
                        "task.format (zero-shot-chat or eight-shot-cot) is required with bundled \"gsm8k\"",
                    ));
                };
                format.parse::<PromptFormat>().map_err(|e| {
                    self.err(format!(
                        "task.format: {}",
                        e.to_string().trim_start_matches("spec: ")
                    ))
                })?;
                let end = self.start.saturating_add(self.count.unwrap_or(0));
                if self.start >= gsm8k::TEST_LEN || end > gsm8k::TEST_LEN {
                    return Err(self.err(format!(
                        "task.start + task.count = {end} exceeds the {} GSM8K test problems",
                        gsm8k::TEST_LEN
                    )));
                }
                Ok(())
            }
            (None, Some(_)) => {
                if self.format.is_some() {
                    return Err(self.err(
                        "task.format is for bundled \"gsm8k\"; a file task's prompt is [task.prompt]",
                    ));
                }
                let Some(g) = &self.grader else {
                    return Err(self.err(
                        "a file task needs [task.grader] with kind = numeric, exact, choice, regex or math",
                    ));
                };
                g.build()
                    .map_err(|e| self.err(e.to_string().trim_start_matches("spec: ")))?;
                let p = self.prompt.clone().unwrap_or_default();
                if !p.template.contains("{question}") {
                    return Err(self.err("task.prompt.template has no {question}"));
                }
                if p.fewshot.is_none() && p.fewshot_count.is_some() {
                    return Err(
                        self.err("task.prompt.fewshot_count is set without task.prompt.fewshot")
                    );
                }
                if p.max_new_tokens == Some(0) {
                    return Err(self.err("task.prompt.max_new_tokens must be positive"));
                }
                Ok(())
            }
        }
    }

    /// Load the task: read and check the file, its rows and the few-shot examples.
    pub fn load(&self) -> Result<SpecTask> {
        self.validate()?;
        let Some(file) = &self.file else {
            let format: PromptFormat = self.format.as_deref().unwrap_or_default().parse()?;
            let end = match self.count {
                Some(c) => self.start + c,
                None => gsm8k::TEST_LEN,
            };
            let task = Gsm8k::bundled(self.start..end, format)?;
            return Ok(SpecTask::Gsm8k(task));
        };
        let name = self.label();
        let grader = self.grader.as_ref().expect("validated").build()?;
        let fields = self.fields.clone().unwrap_or_default();
        let recipe = self.prompt.clone().unwrap_or_default();
        let bytes =
            std::fs::read(file).map_err(|e| self.err(format!("{}: {e}", file.display())))?;
        let sha256 = crate::io::sha256_hex(&bytes);
        let rows = read_rows(file, &bytes).map_err(|m| self.err(m))?;
        if rows.is_empty() {
            return Err(self.err(format!("{} has no rows", file.display())));
        }
        let end = match self.count {
            Some(c) => self.start.saturating_add(c),
            None => rows.len(),
        };
        if self.start >= rows.len() || end > rows.len() {
            return Err(self.err(format!(
                "rows {}..{end} requested but {} has {}",
                self.start,
                file.display(),
                rows.len()
            )));
        }
        let problems = rows[self.start..end]
            .iter()
            .enumerate()
            .map(|(j, row)| to_problem(&name, &fields, row, self.start + j))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|m| self.err(format!("{}: {m}", file.display())))?;
        let mut ids = BTreeSet::new();
        for p in &problems {
            if !ids.insert(p.id.as_str()) {
                return Err(self.err(format!("{}: id `{}` appears twice", file.display(), p.id)));
            }
            grader.check_gold(p).map_err(|m| {
                self.err(format!(
                    "{} row {} ({}): {m}",
                    file.display(),
                    p.index,
                    p.id
                ))
            })?;
        }
        let examples = match &recipe.fewshot {
            None => vec![],
            Some(shots) => {
                let bytes = std::fs::read(shots)
                    .map_err(|e| self.err(format!("{}: {e}", shots.display())))?;
                let rows = read_rows(shots, &bytes).map_err(|m| self.err(m))?;
                let n = recipe.fewshot_count.unwrap_or(rows.len());
                if n > rows.len() {
                    return Err(self.err(format!(
                        "task.prompt.fewshot_count = {n} but {} has {} examples",
                        shots.display(),
                        rows.len()
                    )));
                }
                rows[..n]
                    .iter()
                    .enumerate()
                    .map(|(i, row)| to_problem(&name, &fields, row, i))
                    .collect::<std::result::Result<Vec<_>, _>>()
                    .map_err(|m| self.err(format!("{}: {m}", shots.display())))?
            }
        };
        let labels: Vec<char> = match &self.grader {
            Some(GraderSpec::Choice {
                labels: Some(l), ..
            }) => l.chars().collect(),
            _ => "ABCDEFGHIJ".chars().collect(),
        };
        let uses = |s: &str, key: &str| s.contains(&format!("{{{key}}}"));
        if uses(&recipe.template, "choices") && fields.choices.is_none() {
            return Err(
                self.err("task.prompt.template uses {choices} but task.fields.choices is not set")
            );
        }
        if !examples.is_empty() {
            if uses(&recipe.example_answer, "solution") && fields.solution.is_none() {
                return Err(self.err(
                    "task.prompt.example_answer uses {solution} but task.fields.solution is not set",
                ));
            }
            if uses(&recipe.example_answer, "letter") {
                if grader.name() != "choice" {
                    return Err(self.err(
                        "task.prompt.example_answer uses {letter}, which needs the choice grader",
                    ));
                }
                for ex in &examples {
                    grader.gold_label(ex).map_err(|m| {
                        self.err(format!("few-shot example {} ({}): {m}", ex.index, ex.id))
                    })?;
                }
            }
        }
        let mut stops: Vec<String> = match (&recipe.stop, recipe.style) {
            (Some(s), _) => s.iter().filter(|s| !s.is_empty()).cloned().collect(),
            (None, PromptStyle::Text) => vec!["\n\n".into()],
            (None, PromptStyle::Chat) => vec![],
        };
        for m in END_MARKERS {
            if !stops.iter().any(|s| s == m) {
                stops.push(m.to_string());
            }
        }
        let max_new_tokens = recipe.max_new_tokens.unwrap_or(match recipe.style {
            PromptStyle::Chat => 512,
            PromptStyle::Text => 256,
        });
        Ok(SpecTask::File(Box::new(FileTask {
            name,
            problems,
            recipe,
            examples,
            labels,
            stops,
            max_new_tokens,
            grader,
            file: file.clone(),
            sha256,
        })))
    }
}

/// Rows of a `.jsonl` or `.parquet` file as JSON objects.
fn read_rows(path: &Path, bytes: &[u8]) -> std::result::Result<Vec<Map<String, Value>>, String> {
    let ext = path
        .extension()
        .map(|e| e.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    match ext.as_str() {
        "jsonl" | "ndjson" => {
            let text = std::str::from_utf8(bytes)
                .map_err(|e| format!("{}: not UTF-8: {e}", path.display()))?;
            let mut rows = Vec::new();
            for (i, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                match serde_json::from_str::<Value>(line) {
                    Ok(Value::Object(m)) => rows.push(m),
                    Ok(_) => {
                        return Err(format!(
                            "{} line {}: not a JSON object",
                            path.display(),
                            i + 1
                        ));
                    }
                    Err(e) => return Err(format!("{} line {}: {e}", path.display(), i + 1)),
                }
            }
            Ok(rows)
        }
        "parquet" => parquet_rows(path).map_err(|e| e.to_string()),
        _ => Err(format!(
            "{}: expected a .jsonl or .parquet file",
            path.display()
        )),
    }
}

fn parquet_rows(path: &Path) -> Result<Vec<Map<String, Value>>> {
    let mut rows = Vec::new();
    for batch in crate::io::parquet::read_batches(path)? {
        let schema = batch.schema();
        for r in 0..batch.num_rows() {
            let mut row = Map::new();
            for (f, col) in schema.fields().iter().zip(batch.columns()) {
                let v = arrow_value(col.as_ref(), r).map_err(|m| {
                    Error::Spec(format!("{}: column `{}`: {m}", path.display(), f.name()))
                })?;
                row.insert(f.name().clone(), v);
            }
            rows.push(row);
        }
    }
    Ok(rows)
}

/// One cell of an Arrow column as JSON (strings, integers, floats, booleans and lists of them).
fn arrow_value(col: &dyn arrow_array::Array, r: usize) -> std::result::Result<Value, String> {
    use arrow_array::cast::AsArray;
    use arrow_array::types::*;
    use arrow_schema::DataType as D;
    if col.is_null(r) {
        return Ok(Value::Null);
    }
    Ok(match col.data_type() {
        D::Utf8 => Value::from(col.as_string::<i32>().value(r)),
        D::LargeUtf8 => Value::from(col.as_string::<i64>().value(r)),
        D::Utf8View => Value::from(col.as_string_view().value(r)),
        D::Boolean => Value::from(col.as_boolean().value(r)),
        D::Int8 => Value::from(col.as_primitive::<Int8Type>().value(r)),
        D::Int16 => Value::from(col.as_primitive::<Int16Type>().value(r)),
        D::Int32 => Value::from(col.as_primitive::<Int32Type>().value(r)),
        D::Int64 => Value::from(col.as_primitive::<Int64Type>().value(r)),
        D::UInt8 => Value::from(col.as_primitive::<UInt8Type>().value(r)),
        D::UInt16 => Value::from(col.as_primitive::<UInt16Type>().value(r)),
        D::UInt32 => Value::from(col.as_primitive::<UInt32Type>().value(r)),
        D::UInt64 => Value::from(col.as_primitive::<UInt64Type>().value(r)),
        D::Float32 => Value::from(col.as_primitive::<Float32Type>().value(r) as f64),
        D::Float64 => Value::from(col.as_primitive::<Float64Type>().value(r)),
        D::List(_) => {
            let inner = col.as_list::<i32>().value(r);
            Value::Array(
                (0..inner.len())
                    .map(|i| arrow_value(inner.as_ref(), i))
                    .collect::<std::result::Result<_, _>>()?,
            )
        }
        D::LargeList(_) => {
            let inner = col.as_list::<i64>().value(r);
            Value::Array(
                (0..inner.len())
                    .map(|i| arrow_value(inner.as_ref(), i))
                    .collect::<std::result::Result<_, _>>()?,
            )
        }
        other => return Err(format!("unsupported type {other}")),
    })
}

/// A scalar cell as text: strings as they are, numbers and booleans printed.
fn scalar(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

fn to_problem(
    task: &str,
    fields: &FieldMap,
    row: &Map<String, Value>,
    index: usize,
) -> std::result::Result<Problem, String> {
    let known = || {
        let mut keys: Vec<&str> = row.keys().map(String::as_str).collect();
        keys.sort_unstable();
        keys.join(", ")
    };
    let get = |key: &str, role: &str| {
        row.get(key).filter(|v| !v.is_null()).ok_or_else(|| {
            format!(
                "row {index} has no field `{key}` (task.fields.{role}); its fields: {}",
                known()
            )
        })
    };
    let question = match get(&fields.question, "question")? {
        Value::String(s) => s.clone(),
        other => {
            return Err(format!(
                "row {index}: field `{}` (question) is not a string: {other}",
                fields.question
            ));
        }
    };
    let gold = scalar(get(&fields.answer, "answer")?).ok_or_else(|| {
        format!(
            "row {index}: field `{}` (answer) is not a string or a number",
            fields.answer
        )
    })?;
    let id = match &fields.id {
        Some(k) => scalar(get(k, "id")?)
            .ok_or_else(|| format!("row {index}: field `{k}` (id) is not a string or a number"))?,
        None => format!("{task}-{index}"),
    };
    let solution = match &fields.solution {
        Some(k) => scalar(get(k, "solution")?).ok_or_else(|| {
            format!("row {index}: field `{k}` (solution) is not a string or a number")
        })?,
        None => String::new(),
    };
    let choices = match &fields.choices {
        None => vec![],
        Some(ChoiceFields::List(k)) => match get(k, "choices")? {
            Value::Array(items) => items
                .iter()
                .map(|v| {
                    scalar(v).ok_or_else(|| {
                        format!("row {index}: field `{k}` (choices) holds a non-scalar item")
                    })
                })
                .collect::<std::result::Result<_, _>>()?,
            _ => return Err(format!("row {index}: field `{k}` (choices) is not a list")),
        },
        Some(ChoiceFields::Fields(keys)) => keys
            .iter()
            .map(|k| {
                scalar(get(k, "choices")?).ok_or_else(|| {
                    format!("row {index}: field `{k}` (a choice) is not a string or a number")
                })
            })
            .collect::<std::result::Result<_, _>>()?,
    };
    if fields.choices.is_some() && choices.len() < 2 {
        return Err(format!(
            "row {index} has {} choices (at least 2)",
            choices.len()
        ));
    }
    Ok(Problem {
        id,
        index,
        question,
        solution,
        gold,
        choices,
    })
}

/// A task loaded from a `[task]` table.
#[derive(Debug, Clone)]
pub enum SpecTask {
    /// The bundled GSM8K.
    Gsm8k(Gsm8k),
    /// A file task.
    File(Box<FileTask>),
}

/// Problems from a JSONL/Parquet file with a prompt recipe and a grader.
#[derive(Debug, Clone)]
pub struct FileTask {
    name: String,
    problems: Vec<Problem>,
    recipe: PromptSpec,
    examples: Vec<Problem>,
    labels: Vec<char>,
    stops: Vec<String>,
    max_new_tokens: usize,
    grader: Grader,
    file: PathBuf,
    sha256: String,
}

impl FileTask {
    /// `template` with a problem's placeholders filled in.
    fn render(&self, template: &str, p: &Problem) -> String {
        let choices: Vec<String> = p
            .choices
            .iter()
            .zip(&self.labels)
            .map(|(c, l)| format!("{l}. {c}"))
            .collect();
        let letter = self
            .grader
            .gold_label(p)
            .map(String::from)
            .unwrap_or_default();
        fill(
            template,
            &[
                ("question", &p.question),
                ("choices", &choices.join("\n")),
                ("id", &p.id),
                ("answer", &p.gold),
                ("solution", &p.solution),
                ("letter", &letter),
            ],
        )
    }
}

/// Replace each `{key}` of `vars` in `template` in one left-to-right pass (values are not
/// searched again; other braces, such as `\boxed{}`, stay as they are).
fn fill(template: &str, vars: &[(&str, &String)]) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    'scan: while let Some(at) = rest.find('{') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        for (k, v) in vars {
            if tail.len() > k.len() + 1
                && tail[1..].starts_with(k)
                && tail[1 + k.len()..].starts_with('}')
            {
                out.push_str(v);
                rest = &tail[k.len() + 2..];
                continue 'scan;
            }
        }
        out.push('{');
        rest = &tail[1..];
    }
    out.push_str(rest);
    out
}

impl Task for FileTask {
    fn name(&self) -> &str {
        &self.name
    }

    fn grader(&self) -> &str {
        self.grader.name()
    }

    fn problems(&self) -> &[Problem] {
        &self.problems
    }

    fn prompt(&self, problem: &Problem) -> Prompt {
        let r = &self.recipe;
        match r.style {
            PromptStyle::Chat => {
                let mut messages = Vec::new();
                if let Some(s) = &r.system {
                    messages.push(Message::new("system", s.clone()));
                }
                for ex in &self.examples {
                    messages.push(Message::user(self.render(&r.template, ex)));
                    messages.push(Message::new(
                        "assistant",
                        self.render(&r.example_answer, ex),
                    ));
                }
                messages.push(Message::user(self.render(&r.template, problem)));
                Prompt::Chat { messages }
            }
            PromptStyle::Text => {
                let mut text = String::new();
                if let Some(s) = &r.system {
                    text.push_str(s);
                    text.push_str("\n\n");
                }
                for ex in &self.examples {
                    text.push_str(&self.render(&r.template, ex));
                    text.push_str(&self.render(&r.example_answer, ex));
                    text.push_str(&r.separator);
                }
                text.push_str(&self.render(&r.template, problem));
                Prompt::Text { text }
            }
        }
    }

    fn stop_sequences(&self) -> &[String] {
        &self.stops
    }

    fn max_new_tokens(&self) -> usize {
        self.max_new_tokens
    }

    /// Cuts the output at the stop sequences, then grades it.
    fn grade(&self, problem: &Problem, output: &str) -> Grade {
        self.grader
            .grade(problem, truncate_at_stops(output, &self.stops))
    }
}

impl SpecTask {
    fn inner(&self) -> &dyn Task {
        match self {
            SpecTask::Gsm8k(t) => t,
            SpecTask::File(t) => t.as_ref(),
        }
    }

    /// How the prompt is made, in a word: the GSM8K format, or `chat`/`text` with the number
    /// of few-shot examples.
    pub fn prompt_label(&self) -> String {
        match self {
            SpecTask::Gsm8k(t) => t.format().to_string(),
            SpecTask::File(t) => {
                let style = match t.recipe.style {
                    PromptStyle::Chat => "chat",
                    PromptStyle::Text => "text",
                };
                match t.examples.len() {
                    0 => style.to_string(),
                    n => format!("{style}, {n}-shot"),
                }
            }
        }
    }

    /// What a manifest records about the task.
    pub fn record(&self) -> TaskRecord {
        let (file, file_sha256) = match self {
            SpecTask::Gsm8k(_) => (
                None,
                Some(crate::io::sha256_hex(gsm8k::TEST_JSONL.as_bytes())),
            ),
            SpecTask::File(t) => (Some(t.file.display().to_string()), Some(t.sha256.clone())),
        };
        TaskRecord {
            name: self.name().to_string(),
            grader: self.grader().to_string(),
            prompt: self.prompt_label(),
            file,
            file_sha256,
        }
    }
}

impl Task for SpecTask {
    fn name(&self) -> &str {
        self.inner().name()
    }

    fn grader(&self) -> &str {
        self.inner().grader()
    }

    fn problems(&self) -> &[Problem] {
        self.inner().problems()
    }

    fn prompt(&self, problem: &Problem) -> Prompt {
        self.inner().prompt(problem)
    }

    fn stop_sequences(&self) -> &[String] {
        self.inner().stop_sequences()
    }

    fn max_new_tokens(&self) -> usize {
        self.inner().max_new_tokens()
    }

    fn grade(&self, problem: &Problem, output: &str) -> Grade {
        self.inner().grade(problem, output)
    }
}

/// The task a run used (`task` in campaign and divergence manifests; absent in runs written
/// before it was recorded).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRecord {
    /// Task label (`gsm8k`, or a file task's name).
    pub name: String,
    /// Grader name (`numeric`, `exact`, `choice`, `regex`, `math`).
    pub grader: String,
    /// How prompts were made (`zero-shot-chat`, `chat, 2-shot`, ...).
    pub prompt: String,
    /// The problems file of a file task (as resolved when the run started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    /// SHA-256 of the problems file's bytes (for GSM8K, of the bundled test split).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_sha256: Option<String>,
}

impl TaskRecord {
    /// Refuse to resume a run recorded with `self` on a task that differs in data or grading.
    pub fn resume_with(&self, now: &TaskRecord, what: &str) -> crate::Result<()> {
        if self.file_sha256 != now.file_sha256 || self.grader != now.grader {
            return Err(crate::Error::Spec(format!(
                "{what} was run on task `{}` (grader {}, data sha256 {}) and the spec now gives `{}` (grader {}, data sha256 {}); use another --out",
                self.name,
                self.grader,
                short(&self.file_sha256),
                now.name,
                now.grader,
                short(&now.file_sha256)
            )));
        }
        Ok(())
    }

    /// One line for reports: name, grader, prompt, file and its hash.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "`{}`, grader `{}`, prompt {}",
            self.name, self.grader, self.prompt
        );
        if let Some(f) = &self.file {
            s.push_str(&format!(", file `{f}`"));
        }
        if self.file_sha256.is_some() {
            s.push_str(&format!(", data sha256 {}", short(&self.file_sha256)));
        }
        s
    }
}

fn short(sha: &Option<String>) -> String {
    match sha {
        Some(s) => format!("{}…", &s[..s.len().min(12)]),
        None => "-".into(),
    }
}

#[cfg(test)]
#[path = "spec_tests.rs"]
mod tests;
