//! Task accuracy: greedy (or sampled) answers to a task's problems (GSM8K, or a `[task]` of an
//! eval spec), decoded in batches by the continuation engine, graded, and written as Parquet
//! rows.
use crate::decode::engine::{self, Decoding, EngineMode, EngineOptions, Job, Start};
use crate::exec::ExecPolicy;
use crate::io::parquet::{Column, Table};
use crate::kv_cache::{KvCache, Snapshot};
use crate::model::LogitsAt;
use crate::runtime::LoadedModel;
use crate::sampling::{NoiseKey, Sampling};
use crate::tasks::{Accuracy, SpecTask, Task, TaskSpec};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use tch::Tensor;

/// An eval spec (`kvcredit eval run SPEC`): a `[task]` and, optionally, the model and the
/// decoding settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalSpec {
    /// Model: a registry name, a GGUF file or a Hugging Face folder (`--model` overrides it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Token cap per answer (default: the task's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<usize>,
    /// Problems decoded together (default 8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<usize>,
    /// The task.
    pub task: TaskSpec,
}

impl EvalSpec {
    /// Parse a spec and load its task (file paths are relative to the spec's folder); returns
    /// the spec, the task and the SHA-256 of the spec file's bytes.
    pub fn load(path: &Path) -> Result<(EvalSpec, SpecTask, String)> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let mut spec: EvalSpec = toml::from_str(&text).map_err(|e| {
            Error::Spec(format!(
                "{}: {}",
                path.display(),
                e.message().replace('\n', " ")
            ))
        })?;
        if let Some(dir) = path.parent() {
            spec.task.resolve_paths(dir);
        }
        if spec.max_new_tokens == Some(0) || spec.batch_size == Some(0) {
            return Err(Error::Spec(format!(
                "{}: max_new_tokens and batch_size must be positive",
                path.display()
            )));
        }
        let task = spec.task.load()?;
        Ok((spec, task, crate::io::sha256_hex(text.as_bytes())))
    }
}

/// Settings of an evaluation.
#[derive(Debug, Clone)]
pub struct EvalOptions {
    /// Token cap per answer.
    pub max_new_tokens: usize,
    /// Problems decoded together.
    pub batch_size: usize,
    /// Token selection.
    pub sampling: Sampling,
    /// Seed of the sampling noise.
    pub seed: u64,
    /// Execution policy.
    pub policy: ExecPolicy,
    /// Engine of the answers' decode steps.
    pub engine: EngineMode,
}

/// One graded answer.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalRow {
    /// Problem index in the data set.
    pub problem: u32,
    /// Prompt length in tokens.
    pub prompt_len: u32,
    /// Generated tokens.
    pub n_tokens: u32,
    /// Why generation stopped.
    pub stop: String,
    /// Generated text.
    pub text: String,
    /// Extracted answer.
    pub answer: Option<String>,
    /// Extraction rule that fired.
    pub rule: Option<String>,
    /// Graded correct.
    pub correct: bool,
}

/// Answer and grade every problem of `task`; `on_done` is told after each batch how many
/// problems finished.
pub fn evaluate(
    model: &LoadedModel,
    task: &dyn Task,
    opts: &EvalOptions,
    on_done: &mut dyn FnMut(usize),
) -> Result<Vec<EvalRow>> {
    let stops = task.stop_sequences();
    let text_stop = |ids: &[i64]| {
        model
            .decode(ids)
            .map(|t| stops.iter().any(|s| t.contains(s)))
            .unwrap_or(false)
    };
    let decoding = Decoding {
        model: &model.decoder,
        policy: opts.policy,
        sampling: opts.sampling,
        max_new_tokens: opts.max_new_tokens,
        stop_tokens: &model.stop_tokens,
        text_stop: Some(&text_stop),
    };
    let mut rows = Vec::new();
    for chunk in task.problems().chunks(opts.batch_size.max(1)) {
        let prompts = chunk
            .iter()
            .map(|p| model.encode_prompt(&task.prompt(p)))
            .collect::<Result<Vec<_>>>()?;
        if prompts.iter().any(|p| p.is_empty()) {
            return Err(Error::Spec("a prompt encoded to no tokens".into()));
        }
        // Prefill all but the last prompt token; the engine feeds that one first.
        let caches = prompts
            .iter()
            .map(|p| {
                let mut cache = model.decoder.new_cache(1, p.len() as i64)?;
                if p.len() > 1 {
                    let ids = Tensor::f_from_slice(&p[..p.len() - 1])?.f_view([1, -1])?;
                    let _ =
                        model
                            .decoder
                            .forward(&ids, &mut cache, &opts.policy, &LogitsAt::Last)?;
                }
                Ok(cache)
            })
            .collect::<Result<Vec<KvCache>>>()?;
        let jobs: Vec<Job> = chunk
            .iter()
            .zip(&prompts)
            .zip(&caches)
            .map(|((problem, p), cache)| Job {
                start: Start {
                    cache,
                    snap: Snapshot {
                        row: 0,
                        len: p.len() as i64 - 1,
                    },
                    expect: None,
                },
                first_token: *p.last().expect("non-empty"),
                key: NoiseKey::rollout(opts.seed, problem.index as u64),
            })
            .collect();
        let order: Vec<usize> = (0..jobs.len()).collect();
        let opts_engine = EngineOptions::mode(opts.engine);
        let (outs, _, _) = engine::run_with(
            &decoding,
            &jobs,
            &order,
            jobs.len(),
            &opts_engine,
            &mut |_| {},
        )?;
        for ((problem, prompt), out) in chunk.iter().zip(&prompts).zip(outs) {
            let text = model.decode(&out.tokens)?;
            let grade = task.grade(problem, &text);
            rows.push(EvalRow {
                problem: problem.index as u32,
                prompt_len: prompt.len() as u32,
                n_tokens: out.tokens.len() as u32,
                stop: out.stop.as_str().to_string(),
                text,
                answer: grade.predicted,
                rule: grade.rule,
                correct: grade.correct,
            });
        }
        on_done(chunk.len());
    }
    Ok(rows)
}

/// Accuracy over rows.
pub fn accuracy(rows: &[EvalRow]) -> Accuracy {
    Accuracy::from_outcomes(rows.iter().map(|r| r.correct))
}

/// Rows as a Parquet table.
pub fn table(rows: &[EvalRow], model: &str) -> Table {
    Table::new()
        .with("model", Column::Str(vec![model.to_string(); rows.len()]))
        .with(
            "problem",
            Column::U32(rows.iter().map(|r| r.problem).collect()),
        )
        .with(
            "prompt_len",
            Column::U32(rows.iter().map(|r| r.prompt_len).collect()),
        )
        .with(
            "n_tokens",
            Column::U32(rows.iter().map(|r| r.n_tokens).collect()),
        )
        .with(
            "stop",
            Column::Str(rows.iter().map(|r| r.stop.clone()).collect()),
        )
        .with(
            "text",
            Column::Str(rows.iter().map(|r| r.text.clone()).collect()),
        )
        .with(
            "answer",
            Column::OptStr(rows.iter().map(|r| r.answer.clone()).collect()),
        )
        .with(
            "rule",
            Column::OptStr(rows.iter().map(|r| r.rule.clone()).collect()),
        )
        .with(
            "correct",
            Column::Bool(rows.iter().map(|r| r.correct).collect()),
        )
}
