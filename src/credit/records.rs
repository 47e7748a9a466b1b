//! The campaign's Parquet tables (schemas documented in the README): one builder per table.
use super::estimate::Estimate;
use super::rollout::{Pivot, Rollout};
use super::schema::col;
use super::spec::Pass;
use crate::Result;
use crate::decode::engine::{NumericalPath, Outcome, Placement};
use crate::io::hex;
use crate::io::parquet::{Column, Table};
use crate::runtime::LoadedModel;
use crate::tasks::Grade;
use std::collections::BTreeMap;

/// Where a pass ran each continuation and whether its start was verified, indexed like the
/// jobs.
pub(crate) struct PassAudit {
    /// Batch and row of each job.
    pub placements: Vec<Placement>,
    /// The job's starting K/V matched its decode-time fingerprint.
    pub verified: Vec<bool>,
    /// The numerical path each job took.
    pub paths: Vec<NumericalPath>,
}

/// One continuation job's coordinates.
#[derive(Debug, Clone, Copy)]
pub(crate) struct JobId {
    /// Index into the pivots.
    pub pivot: usize,
    /// 0 = original token, r = alternative of rank r.
    pub branch: usize,
    /// Sample index k.
    pub sample: usize,
}

/// Columns every table starts with.
pub struct Context<'a> {
    /// Configuration label (campaign name).
    pub config: &'a str,
    /// Model name.
    pub model: &'a str,
    /// Run dtype.
    pub dtype: &'a str,
    /// Execution policy.
    pub policy: &'a str,
    /// GSM8K test index.
    pub problem: u32,
}

fn common(ctx: &Context, n: usize) -> Table {
    Table::new()
        .with(col::CONFIG, Column::Str(vec![ctx.config.to_string(); n]))
        .with(col::MODEL, Column::Str(vec![ctx.model.to_string(); n]))
        .with(col::DTYPE, Column::Str(vec![ctx.dtype.to_string(); n]))
        .with(col::POLICY, Column::Str(vec![ctx.policy.to_string(); n]))
        .with(col::PROBLEM, Column::U32(vec![ctx.problem; n]))
}

/// `rollouts`: one row per problem.
pub fn rollouts(
    ctx: &Context,
    roll: &Rollout,
    text: &str,
    grade: &Grade,
    n_pivots: usize,
    _model: &LoadedModel,
) -> Result<Table> {
    let candidates = roll
        .steps
        .iter()
        .filter(|s| s.fingerprint.is_some())
        .count();
    Ok(common(ctx, 1)
        .with(col::PROMPT_LEN, Column::U32(vec![roll.prompt.len() as u32]))
        .with(col::N_TOKENS, Column::U32(vec![roll.steps.len() as u32]))
        .with(col::TOKENS, Column::ListI64(vec![roll.tokens()]))
        .with(
            col::LOGPROBS,
            Column::ListF64(vec![roll.steps.iter().map(|s| s.logprob).collect()]),
        )
        .with(
            col::MARGINS,
            Column::ListF64(vec![roll.steps.iter().map(|s| s.margin).collect()]),
        )
        .with(col::STOP, Column::Str(vec![roll.stop.as_str().into()]))
        .with(col::TEXT, Column::Str(vec![text.to_string()]))
        .with(col::ANSWER, Column::OptStr(vec![grade.predicted.clone()]))
        .with(
            col::EXTRACTION_RULE,
            Column::OptStr(vec![grade.rule.clone()]),
        )
        .with(col::CORRECT, Column::Bool(vec![grade.correct]))
        .with(col::N_CANDIDATES, Column::U32(vec![candidates as u32]))
        .with(col::N_PIVOTS, Column::U32(vec![n_pivots as u32])))
}

/// `pivots`: one row per pivot × alternative.
pub fn pivots(
    ctx: &Context,
    roll: &Rollout,
    pivots: &[Pivot],
    model: &LoadedModel,
) -> Result<Table> {
    let mut c = PivotCols::default();
    for p in pivots {
        for (r, &alt) in p.alternatives.iter().enumerate() {
            c.pos.push(p.pos as u32);
            c.abs.push((roll.prompt.len() + p.pos) as u32);
            c.token.push(p.token);
            c.token_text.push(model.decode(&[p.token])?);
            c.margin.push(p.margin);
            c.margin_t.push(p.margin_at_temperature);
            c.logprob.push(p.logprob);
            c.rank.push(r as u32 + 1);
            c.alt.push(alt);
            c.alt_text.push(model.decode(&[alt])?);
            c.fp.push(hex(&p.fingerprint));
        }
    }
    let n = c.pos.len();
    Ok(common(ctx, n)
        .with(col::PIVOT_POS, Column::U32(c.pos))
        .with(col::ABS_POS, Column::U32(c.abs))
        .with(col::TOKEN, Column::I64(c.token))
        .with(col::TOKEN_TEXT, Column::Str(c.token_text))
        .with(col::MARGIN, Column::F64(c.margin))
        .with(col::MARGIN_AT_TEMPERATURE, Column::OptF64(c.margin_t))
        .with(col::LOGPROB, Column::F64(c.logprob))
        .with(col::ALT_RANK, Column::U32(c.rank))
        .with(col::ALT_TOKEN, Column::I64(c.alt))
        .with(col::ALT_TEXT, Column::Str(c.alt_text))
        .with(col::FINGERPRINT, Column::Str(c.fp)))
}

#[derive(Default)]
struct PivotCols {
    pos: Vec<u32>,
    abs: Vec<u32>,
    token: Vec<i64>,
    token_text: Vec<String>,
    margin: Vec<f64>,
    margin_t: Vec<Option<f64>>,
    logprob: Vec<f64>,
    rank: Vec<u32>,
    alt: Vec<i64>,
    alt_text: Vec<String>,
    fp: Vec<String>,
}

/// `continuations`: one row per pass × pivot × branch × sample, with the batch it ran in and
/// whether its starting K/V was verified; a `refill` run also records each job's `fill`.
pub(crate) fn continuations(
    ctx: &Context,
    pivots: &[Pivot],
    ids: &[JobId],
    outcomes: &BTreeMap<Pass, Vec<Outcome>>,
    audits: &BTreeMap<Pass, PassAudit>,
    graded: &BTreeMap<Pass, Vec<Grade>>,
    refill: bool,
) -> Table {
    let (mut pos, mut rank, mut branch, mut pass_col, mut sample) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut tokens, mut n_tokens, mut stop, mut answer, mut correct) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut chunk, mut row, mut batch_rows, mut verified) = (vec![], vec![], vec![], vec![]);
    let mut fill = vec![];
    let mut rule = vec![];
    let (mut steps, mut rows_min, mut rows_max, mut keys_min, mut keys_max) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut rows_digest, mut keys_digest, mut as_exact) = (vec![], vec![], vec![]);
    let exact_paths = audits.get(&Pass::Exact).map(|a| &a.paths);
    for (pass, outs) in outcomes {
        let audit = &audits[pass];
        for (j, ((id, o), g)) in ids.iter().zip(outs).zip(&graded[pass]).enumerate() {
            pos.push(pivots[id.pivot].pos as u32);
            rank.push(id.branch as u32);
            branch.push(if id.branch == 0 { "orig" } else { "alt" }.to_string());
            pass_col.push(pass.as_str().to_string());
            sample.push(id.sample as u32);
            n_tokens.push(o.tokens.len() as u32);
            tokens.push(o.tokens.clone());
            stop.push(o.stop.as_str().to_string());
            answer.push(g.predicted.clone());
            rule.push(g.rule.clone());
            correct.push(g.correct);
            let at = audit.placements[j];
            chunk.push(at.chunk);
            row.push(at.row);
            batch_rows.push(at.batch_rows);
            fill.push(at.fill);
            verified.push(audit.verified[j]);
            let path = &audit.paths[j];
            steps.push(path.steps.len() as u32);
            let (rlo, rhi) = path.rows_range();
            let (klo, khi) = path.keys_range();
            rows_min.push(rlo);
            rows_max.push(rhi);
            keys_min.push(klo);
            keys_max.push(khi);
            rows_digest.push(path.rows_digest());
            keys_digest.push(path.keys_digest());
            as_exact.push(exact_paths.map(|e| path.same_key_steps(&e[j]) as i64));
        }
    }
    let table = common(ctx, pos.len())
        .with(col::PIVOT_POS, Column::U32(pos))
        .with(col::ALT_RANK, Column::U32(rank))
        .with(col::BRANCH, Column::Str(branch))
        .with(col::PASS, Column::Str(pass_col))
        .with(col::SAMPLE, Column::U32(sample))
        .with(col::TOKENS, Column::ListI64(tokens))
        .with(col::N_TOKENS, Column::U32(n_tokens))
        .with(col::STOP, Column::Str(stop))
        .with(col::ANSWER, Column::OptStr(answer))
        .with(col::EXTRACTION_RULE, Column::OptStr(rule))
        .with(col::CORRECT, Column::Bool(correct))
        .with(col::CHUNK, Column::U32(chunk))
        .with(col::ROW, Column::U32(row))
        .with(col::BATCH_ROWS, Column::U32(batch_rows));
    let table = if refill {
        table.with(col::FILL, Column::U32(fill))
    } else {
        table
    };
    table
        .with(col::SNAPSHOT_VERIFIED, Column::Bool(verified))
        .with(col::PATH_STEPS, Column::U32(steps))
        .with(col::PATH_ROWS_MIN, Column::U32(rows_min))
        .with(col::PATH_ROWS_MAX, Column::U32(rows_max))
        .with(col::PATH_KEYS_MIN, Column::U32(keys_min))
        .with(col::PATH_KEYS_MAX, Column::U32(keys_max))
        .with(col::PATH_ROWS_DIGEST, Column::Str(rows_digest))
        .with(col::PATH_KEYS_DIGEST, Column::Str(keys_digest))
        .with(col::KEYS_AS_EXACT, Column::OptI64(as_exact))
}

/// `estimates`: one row per pivot × alternative × pass.
pub fn estimates(
    ctx: &Context,
    roll: &Rollout,
    pivots: &[Pivot],
    est: &[Estimate],
    model: &LoadedModel,
) -> Result<Table> {
    let mut rows: Vec<&Estimate> = est.iter().collect();
    rows.sort_by_key(|e| (pivots[e.pivot].pos, e.alt_rank, e.pass));
    let p = |e: &Estimate| &pivots[e.pivot];
    let alt = |e: &Estimate| p(e).alternatives[e.alt_rank - 1];
    let texts = |f: &dyn Fn(&Estimate) -> i64| -> Result<Vec<String>> {
        rows.iter().map(|e| model.decode(&[f(e)])).collect()
    };
    let orig_text = texts(&|e| p(e).token)?;
    let alt_text = texts(&alt)?;
    Ok(common(ctx, rows.len())
        .with(
            col::PIVOT_POS,
            Column::U32(rows.iter().map(|e| p(e).pos as u32).collect()),
        )
        .with(
            col::ABS_POS,
            Column::U32(
                rows.iter()
                    .map(|e| (roll.prompt.len() + p(e).pos) as u32)
                    .collect(),
            ),
        )
        .with(
            col::ALT_RANK,
            Column::U32(rows.iter().map(|e| e.alt_rank as u32).collect()),
        )
        .with(
            col::PASS,
            Column::Str(rows.iter().map(|e| e.pass.as_str().to_string()).collect()),
        )
        .with(
            col::ESTIMATE,
            Column::F64(rows.iter().map(|e| e.value).collect()),
        )
        .with(
            col::ORIG_SUCCESSES,
            Column::U32(rows.iter().map(|e| e.orig_successes).collect()),
        )
        .with(
            col::ALT_SUCCESSES,
            Column::U32(rows.iter().map(|e| e.alt_successes).collect()),
        )
        .with(col::K, Column::U32(rows.iter().map(|e| e.k).collect()))
        .with(
            col::INFORMATIVE,
            Column::Bool(rows.iter().map(|e| e.informative).collect()),
        )
        .with(
            col::MARGIN,
            Column::F64(rows.iter().map(|e| p(e).margin).collect()),
        )
        .with(
            col::ORIG_TOKEN,
            Column::I64(rows.iter().map(|e| p(e).token).collect()),
        )
        .with(
            col::ALT_TOKEN,
            Column::I64(rows.iter().map(|e| alt(e)).collect()),
        )
        .with(col::ORIG_TEXT, Column::Str(orig_text))
        .with(col::ALT_TEXT, Column::Str(alt_text))
        .with(
            col::SNAPSHOT_VERIFIED,
            Column::Bool(rows.iter().map(|e| e.snapshot_verified).collect()),
        ))
}
