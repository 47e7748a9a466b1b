//! `kvcredit check` on a real campaign (SmolLM2-135M-Instruct, two problems, run once and
//! copied per test): the clean run passes every rule, its shuffled replica grouped the
//! continuations differently from exact in every problem, its snapshot counters equal the
//! exact/replica continuations and pivots, and each planted violation (a replica that ran
//! exact's batches, an unverified continuation, counters or tables that disagree) fails the
//! rule that guards it.
mod common;

use arrow_array::builder::{Int64Builder, ListBuilder};
use arrow_array::{
    Array, BooleanArray, Int64Array, ListArray, RecordBatch, StringArray, UInt32Array,
};
use kvcredit::check::{CheckReport, Rule, check_run};
use kvcredit::io::parquet::{read_batches, write_batches};
use kvcredit::runtime::{self, Dtype, ModelSource};
use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

const MODEL: &str = "smollm2-135m-instruct";

/// Both batch sizes exceed a problem's continuations (at most 2 pivots × 2 branches × K 2):
/// the old replica (reverse order, 16 at a time) ran exactly exact's one batch.
const SPEC: &str = r#"
name = "check-rules"
model = "smollm2-135m-instruct"
dtype = "fp32"
device = "cpu"
policy = "stock"
seed = 7

[problems]
start = 0
count = 2
format = "zero-shot-chat"

[rollout]
max_new_tokens = 40
temperature = 0.0

[pivots]
max_margin = 0.6
max_per_rollout = 2
alternatives = 1

[continuations]
k = 2
max_new_tokens = 12
temperature = 1.0

[passes]
run = ["exact", "replica", "refeed"]
replica_schedule = "shuffled"
batch_size = 16
replica_batch_size = 16
"#;

/// The campaign, run once per test binary.
fn clean_run() -> &'static Path {
    static RUN: OnceLock<PathBuf> = OnceLock::new();
    RUN.get_or_init(|| {
        let dir = common::scratch("check-rules", "clean");
        let spec_path = dir.join("spec.toml");
        std::fs::write(&spec_path, SPEC).unwrap();
        let src = ModelSource::resolve(MODEL, &common::registry_paths())
            .expect("model pulled (make models)");
        let model = runtime::load(&src, Dtype::Fp32, tch::Device::Cpu).expect("model loads");
        let out = dir.join("run");
        common::run_campaign_file(&spec_path, &model, &out);
        out
    })
}

/// A copy of the clean run's merged tables and manifest, to plant a violation in.
fn copy_of_run(name: &str) -> PathBuf {
    let src = clean_run();
    let dst = common::scratch("check-rules", name);
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, dst.join(p.file_name().unwrap())).unwrap();
        }
    }
    dst
}

/// The violations of `rule` in a report.
fn of(report: &CheckReport, rule: Rule) -> Vec<String> {
    report
        .violations
        .iter()
        .filter(|v| v.rule == rule)
        .map(|v| v.to_string())
        .collect()
}

/// The violations of every rule but `replica-floor`. This fixture's replica is a structural zero
/// on CPUs whose stock decode step is schedule-invariant and not elsewhere;
/// `the_replica_floor_rule_fires_exactly_on_a_structural_zero` checks that rule against its
/// tokens, and the other tests count the rest.
fn others(report: &CheckReport) -> Vec<String> {
    report
        .violations
        .iter()
        .filter(|v| v.rule != Rule::ReplicaFloor)
        .map(|v| v.to_string())
        .collect()
}

fn u32s(b: &RecordBatch, name: &str) -> Vec<u32> {
    common::column::<UInt32Array>(b, name).values().to_vec()
}

fn strs(b: &RecordBatch, name: &str) -> Vec<String> {
    let a: StringArray = common::column(b, name);
    (0..a.len()).map(|i| a.value(i).to_string()).collect()
}

/// `b` with column `name` replaced.
fn with_column(b: &RecordBatch, name: &str, col: Arc<dyn Array>) -> RecordBatch {
    let i = b.schema().index_of(name).unwrap();
    let mut cols = b.columns().to_vec();
    cols[i] = col;
    RecordBatch::try_new(b.schema(), cols).unwrap()
}

/// Rewrite a table of the run, batch by batch.
fn rewrite(run: &Path, table: &str, f: impl Fn(&RecordBatch) -> Vec<RecordBatch>) {
    let path = run.join(table);
    let batches: Vec<RecordBatch> = read_batches(&path).unwrap().iter().flat_map(f).collect();
    write_batches(&path, &batches).unwrap();
}

/// Rewrite `table` without its first row.
fn drop_first_row(run: &Path, table: &str) {
    let dropped = Cell::new(false);
    rewrite(run, table, |b| keep_rows(b, |_| dropped.replace(true)));
    assert!(dropped.get());
}

/// The rows of `b` for which `keep` holds, as slices of `b`.
fn keep_rows(b: &RecordBatch, keep: impl Fn(usize) -> bool) -> Vec<RecordBatch> {
    let mut out = Vec::new();
    let mut start = None;
    for i in 0..=b.num_rows() {
        match (i < b.num_rows() && keep(i), start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                out.push(b.slice(s, i - s));
                start = None;
            }
            _ => {}
        }
    }
    out
}

fn edit_manifest(run: &Path, f: impl Fn(&mut serde_json::Value)) {
    let path = run.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut m);
    std::fs::write(&path, serde_json::to_string_pretty(&m).unwrap()).unwrap();
}

fn manifest(run: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(run.join("manifest.json")).unwrap()).unwrap()
}

/// A batch's members: `(pivot_pos, alt_rank, sample)`.
type Members = BTreeSet<(u32, u32, u32)>;

/// Per (problem, pass): the set of batch memberships.
fn groupings(run: &Path) -> BTreeMap<(u32, String), BTreeSet<Members>> {
    let mut batches: BTreeMap<(u32, String, u32), Members> = BTreeMap::new();
    for b in read_batches(&run.join("continuations.parquet")).unwrap() {
        let (prob, pos, rank, sample, chunk) = (
            u32s(&b, "problem"),
            u32s(&b, "pivot_pos"),
            u32s(&b, "alt_rank"),
            u32s(&b, "sample"),
            u32s(&b, "chunk"),
        );
        let pass = strs(&b, "pass");
        for i in 0..b.num_rows() {
            batches
                .entry((prob[i], pass[i].clone(), chunk[i]))
                .or_default()
                .insert((pos[i], rank[i], sample[i]));
        }
    }
    let mut out: BTreeMap<(u32, String), BTreeSet<Members>> = BTreeMap::new();
    for ((prob, pass, _), members) in batches {
        out.entry((prob, pass)).or_default().insert(members);
    }
    out
}

#[test]
fn a_real_run_passes_every_rule() {
    let report = check_run(clean_run()).unwrap();
    assert!(others(&report).is_empty(), "{:#?}", report.violations);
    for rule in [
        Rule::Counts,
        Rule::Placement,
        Rule::ReplicaGrouping,
        Rule::SnapshotVerified,
    ] {
        assert!(report.rules.contains(&rule), "{rule} not applied");
    }
    assert!(
        report.n_continuations > 0,
        "no pivots found; loosen max_margin"
    );
}

#[test]
fn shuffled_replica_groups_every_problem_differently_from_exact() {
    let g = groupings(clean_run());
    let problems: BTreeSet<u32> = g.keys().map(|(p, _)| *p).collect();
    assert!(!problems.is_empty());
    for p in problems {
        let exact = &g[&(p, "exact".to_string())];
        let replica = &g[&(p, "replica".to_string())];
        assert_eq!(exact.len(), 1, "problem {p}: exact fits one batch of 16");
        assert_ne!(exact, replica, "problem {p}: replica ran exact's batches");
        // No replica batch has the members of an exact batch (both sizes ≥ 2).
        assert!(
            replica.iter().all(|b| !exact.contains(b)),
            "problem {p}: {replica:?} shares a batch with {exact:?}"
        );
        assert_eq!(&g[&(p, "refeed".to_string())], exact);
    }
}

#[test]
fn snapshot_counters_equal_the_exact_and_replica_continuations_and_pivots() {
    let run = clean_run();
    let m = manifest(run);
    let (mut resumed, mut snapshots) = (0u64, BTreeSet::new());
    for b in read_batches(&run.join("continuations.parquet")).unwrap() {
        let pass = strs(&b, "pass");
        let verified: BooleanArray = common::column(&b, "snapshot_verified");
        let (prob, pos) = (u32s(&b, "problem"), u32s(&b, "pivot_pos"));
        for i in 0..b.num_rows() {
            let resumes = pass[i] != "refeed";
            assert_eq!(verified.value(i), resumes, "row {i} of pass {}", pass[i]);
            if resumes {
                resumed += 1;
                snapshots.insert((prob[i], pos[i], pass[i].clone()));
            }
        }
    }
    let pivots: BTreeSet<(u32, u32)> = snapshots.iter().map(|(p, t, _)| (*p, *t)).collect();
    assert!(resumed > 0);
    assert_eq!(
        snapshots.len(),
        2 * pivots.len(),
        "exact and replica per pivot"
    );
    assert_eq!(m["snapshot_checks"], resumed);
    assert_eq!(m["snapshot_hits"], resumed);
    assert_eq!(m["snapshot_checks_pivots"], snapshots.len() as u64);
    assert_eq!(m["snapshot_hits_pivots"], snapshots.len() as u64);
    assert_eq!(
        m["snapshot_checks"],
        m["cost"]["exact"]["continuations"].as_u64().unwrap()
            + m["cost"]["replica"]["continuations"].as_u64().unwrap()
    );
    for b in read_batches(&run.join("estimates.parquet")).unwrap() {
        let pass = strs(&b, "pass");
        let verified: BooleanArray = common::column(&b, "snapshot_verified");
        for (i, pass) in pass.iter().enumerate() {
            assert_eq!(verified.value(i), pass != "refeed", "estimate row {i}");
        }
    }
}

#[test]
fn a_replica_that_ran_exacts_grouping_fails_check() {
    let run = copy_of_run("exact-grouping");
    // Give every replica row the chunk, row and batch size of its exact twin.
    let mut exact: BTreeMap<(u32, u32, u32, u32), [u32; 3]> = BTreeMap::new();
    for b in read_batches(&run.join("continuations.parquet")).unwrap() {
        let pass = strs(&b, "pass");
        let cols = ["problem", "pivot_pos", "alt_rank", "sample", "chunk", "row"];
        let v: Vec<Vec<u32>> = cols.iter().map(|c| u32s(&b, c)).collect();
        let rows = u32s(&b, "batch_rows");
        for i in 0..b.num_rows() {
            if pass[i] == "exact" {
                exact.insert(
                    (v[0][i], v[1][i], v[2][i], v[3][i]),
                    [v[4][i], v[5][i], rows[i]],
                );
            }
        }
    }
    rewrite(&run, "continuations.parquet", |b| {
        let pass = strs(b, "pass");
        let key: Vec<Vec<u32>> = ["problem", "pivot_pos", "alt_rank", "sample"]
            .iter()
            .map(|c| u32s(b, c))
            .collect();
        let mut out = b.clone();
        for (col, name) in ["chunk", "row", "batch_rows"].iter().enumerate() {
            let old = u32s(b, name);
            let new: Vec<u32> = (0..b.num_rows())
                .map(|i| {
                    if pass[i] == "replica" {
                        exact[&(key[0][i], key[1][i], key[2][i], key[3][i])][col]
                    } else {
                        old[i]
                    }
                })
                .collect();
            out = with_column(&out, name, Arc::new(UInt32Array::from(new)));
        }
        vec![out]
    });
    let report = check_run(&run).unwrap();
    let found = of(&report, Rule::ReplicaGrouping);
    let problems = groupings(&run)
        .keys()
        .map(|(p, _)| *p)
        .collect::<BTreeSet<_>>();
    assert_eq!(found.len(), problems.len(), "{found:?}");
    assert!(found[0].contains("ran exact's batches"), "{found:?}");
    assert!(of(&report, Rule::Placement).is_empty(), "{report:?}");
    assert_eq!(
        others(&report).len(),
        found.len(),
        "{:?}",
        report.violations
    );
}

#[test]
fn an_unverified_replica_continuation_fails_check() {
    let run = copy_of_run("unverified");
    let done = Cell::new(false);
    rewrite(&run, "continuations.parquet", |b| {
        let pass = strs(b, "pass");
        let mut v: Vec<bool> = common::column::<BooleanArray>(b, "snapshot_verified")
            .iter()
            .map(|x| x.unwrap())
            .collect();
        if let Some(i) = pass.iter().position(|p| p == "replica")
            && !done.replace(true)
        {
            v[i] = false;
        }
        vec![with_column(
            b,
            "snapshot_verified",
            Arc::new(BooleanArray::from(v)),
        )]
    });
    assert!(done.get());
    let report = check_run(&run).unwrap();
    let found = of(&report, Rule::SnapshotVerified);
    assert_eq!(found.len(), 1, "{:?}", report.violations);
    assert!(found[0].contains("continuation problem=") && found[0].contains("pass=replica"));
    assert_eq!(others(&report).len(), 1, "{:?}", report.violations);
}

#[test]
fn snapshot_counters_that_disagree_with_the_rows_fail_check() {
    // A pass whose verification was skipped: its continuations are not counted, the hit rate
    // of the remaining checks is still 100%.
    let run = copy_of_run("skipped-pass");
    edit_manifest(&run, |m| {
        let replica = m["cost"]["replica"]["continuations"].as_u64().unwrap();
        let checks = m["snapshot_checks"].as_u64().unwrap() - replica;
        let pivots = m["snapshot_checks_pivots"].as_u64().unwrap() / 2;
        m["snapshot_checks"] = checks.into();
        m["snapshot_hits"] = checks.into();
        m["snapshot_checks_pivots"] = pivots.into();
        m["snapshot_hits_pivots"] = pivots.into();
    });
    let report = check_run(&run).unwrap();
    let found = of(&report, Rule::SnapshotHitRate);
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(
        found[0].contains("exact/replica continuations"),
        "{found:?}"
    );
    assert!(found[1].contains("snapshot_checks_pivots"), "{found:?}");
    assert_eq!(others(&report).len(), 2, "{:?}", report.violations);

    let run = copy_of_run("pivot-miss");
    edit_manifest(&run, |m| {
        let hits = m["snapshot_hits_pivots"].as_u64().unwrap() - 1;
        m["snapshot_hits_pivots"] = hits.into();
    });
    let found = of(&check_run(&run).unwrap(), Rule::SnapshotHitRate);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("snapshot_hits_pivots"), "{found:?}");

    let run = copy_of_run("no-pivot-counts");
    edit_manifest(&run, |m| {
        let o = m.as_object_mut().unwrap();
        o.remove("snapshot_checks_pivots");
        o.remove("snapshot_hits_pivots");
    });
    let found = of(&check_run(&run).unwrap(), Rule::SnapshotHitRate);
    assert_eq!(found.len(), 1, "{found:?}");
}

#[test]
fn unfinished_problems_fail_the_counts_rule() {
    let run = copy_of_run("unfinished");
    edit_manifest(&run, |m| m["problems_done"] = 1.into());
    let found = of(&check_run(&run).unwrap(), Rule::Counts);
    assert!(
        found
            .iter()
            .any(|v| v.contains("problems_done 1 ≠ problems_total 2")),
        "{found:?}"
    );
    assert!(
        found.iter().any(|v| v.contains("rollouts.parquet: 2 rows")),
        "{found:?}"
    );
}

#[test]
fn a_missing_rollout_row_fails_the_counts_rule() {
    let run = copy_of_run("no-rollout");
    drop_first_row(&run, "rollouts.parquet");
    let found = of(&check_run(&run).unwrap(), Rule::Counts);
    assert!(
        found
            .iter()
            .any(|v| v.contains("1 rows but problems_done = 2")),
        "{found:?}"
    );
}

#[test]
fn a_missing_pivot_row_fails_the_counts_rule() {
    let run = copy_of_run("no-pivot");
    drop_first_row(&run, "pivots.parquet");
    let report = check_run(&run).unwrap();
    let found = of(&report, Rule::Counts);
    assert!(
        found.iter().any(|v| v.contains("no pivots row")),
        "{found:?}"
    );
    assert!(found.iter().any(|v| v.contains("n_pivots")), "{found:?}");
}

#[test]
fn continuation_rows_that_disagree_with_the_manifest_cost_fail_the_counts_rule() {
    let run = copy_of_run("cost");
    edit_manifest(&run, |m| {
        let n = m["cost"]["replica"]["continuations"].as_u64().unwrap() + 1;
        m["cost"]["replica"]["continuations"] = n.into();
    });
    let report = check_run(&run).unwrap();
    let found = of(&report, Rule::Counts);
    assert_eq!(found.len(), 1, "{:?}", report.violations);
    assert!(found[0].contains("cost.replica.continuations"), "{found:?}");
    assert_eq!(others(&report).len(), 1, "{:?}", report.violations);
}

#[test]
fn a_sample_missing_from_every_pass_fails_the_counts_rule() {
    let run = copy_of_run("no-sample");
    let target: OnceLock<(u32, u32)> = OnceLock::new();
    rewrite(&run, "continuations.parquet", |b| {
        let (prob, pos, rank, sample) = (
            u32s(b, "problem"),
            u32s(b, "pivot_pos"),
            u32s(b, "alt_rank"),
            u32s(b, "sample"),
        );
        if b.num_rows() == 0 {
            return vec![b.clone()];
        }
        let &(p0, t0) = target.get_or_init(|| (prob[0], pos[0]));
        keep_rows(b, |i| {
            !(prob[i] == p0 && pos[i] == t0 && rank[i] == 0 && sample[i] == 1)
        })
    });
    let report = check_run(&run).unwrap();
    let found = of(&report, Rule::Counts);
    let (p0, t0) = target.get().unwrap();
    for pass in ["exact", "replica", "refeed"] {
        let needle = format!("continuations problem={p0} pivot_pos={t0} pass={pass}: 3 rows");
        assert!(
            found.iter().any(|v| v.contains(&needle)),
            "{needle}: {found:?}"
        );
    }
    assert!(found.iter().any(|v| v.contains("cost.exact.continuations")));
}

#[test]
fn a_batch_with_a_repeated_row_fails_the_placement_rule() {
    let run = copy_of_run("repeated-row");
    let done = Cell::new(false);
    rewrite(&run, "continuations.parquet", |b| {
        let pass = strs(b, "pass");
        let mut row = u32s(b, "row");
        let chunk = u32s(b, "chunk");
        if let Some(first) = pass.iter().position(|p| p == "exact")
            && !done.get()
        {
            let twin = (first + 1..b.num_rows())
                .find(|&i| pass[i] == "exact" && chunk[i] == chunk[first])
                .expect("a pivot's two branches share exact's batch");
            row[twin] = row[first];
            done.set(true);
        }
        vec![with_column(b, "row", Arc::new(UInt32Array::from(row)))]
    });
    assert!(done.get());
    let report = check_run(&run).unwrap();
    let found = of(&report, Rule::Placement);
    assert_eq!(found.len(), 1, "{:?}", report.violations);
    assert!(found[0].contains("pass=exact chunk="), "{found:?}");
}

/// Continuation keys `(problem, pivot_pos, alt_rank, sample, branch)` of `pass` and their tokens.
fn tokens_of(run: &Path, pass: &str) -> BTreeMap<(u32, u32, u32, u32, String), Vec<i64>> {
    let mut out = BTreeMap::new();
    for b in read_batches(&run.join("continuations.parquet")).unwrap() {
        let p = strs(&b, "pass");
        let branch = strs(&b, "branch");
        let key: Vec<Vec<u32>> = ["problem", "pivot_pos", "alt_rank", "sample"]
            .iter()
            .map(|c| u32s(&b, c))
            .collect();
        let toks: ListArray = common::column(&b, "tokens");
        for i in 0..b.num_rows() {
            if p[i] == pass {
                let t = toks.value(i);
                let t = t.as_any().downcast_ref::<Int64Array>().unwrap();
                out.insert(
                    (
                        key[0][i],
                        key[1][i],
                        key[2][i],
                        key[3][i],
                        branch[i].clone(),
                    ),
                    t.values().to_vec(),
                );
            }
        }
    }
    out
}

/// Rewrite the replica rows' tokens with `f(key, exact's tokens, own tokens)`.
fn set_replica_tokens(
    run: &Path,
    f: impl Fn(&(u32, u32, u32, u32, String), &[i64], &[i64]) -> Vec<i64>,
) {
    let exact = tokens_of(run, "exact");
    rewrite(run, "continuations.parquet", |b| {
        let p = strs(b, "pass");
        let branch = strs(b, "branch");
        let key: Vec<Vec<u32>> = ["problem", "pivot_pos", "alt_rank", "sample"]
            .iter()
            .map(|c| u32s(b, c))
            .collect();
        let toks: ListArray = common::column(b, "tokens");
        let mut list = ListBuilder::new(Int64Builder::new());
        for i in 0..b.num_rows() {
            let own = toks.value(i);
            let own = own.as_any().downcast_ref::<Int64Array>().unwrap().values();
            let k = (
                key[0][i],
                key[1][i],
                key[2][i],
                key[3][i],
                branch[i].clone(),
            );
            let new = if p[i] == "replica" {
                f(&k, &exact[&k], own)
            } else {
                own.to_vec()
            };
            list.values().append_slice(&new);
            list.append(true);
        }
        let list = list.finish();
        // keep the file's list field (its nullability and item name)
        let field = b.schema().field_with_name("tokens").unwrap().clone();
        let list = ListArray::new(
            match field.data_type() {
                arrow_schema::DataType::List(item) => item.clone(),
                t => panic!("tokens is {t}"),
            },
            list.offsets().clone(),
            list.values().clone(),
            None,
        );
        vec![with_column(b, "tokens", Arc::new(list))]
    });
}

/// The clean run's replica-floor verdict follows its tokens: the rule fires exactly when every
/// replica continuation is token-identical to exact's (on CPUs whose stock decode step is
/// schedule-invariant it does; elsewhere it does not).
#[test]
fn the_replica_floor_rule_fires_exactly_on_a_structural_zero() {
    let run = clean_run();
    let (exact, replica) = (tokens_of(run, "exact"), tokens_of(run, "replica"));
    assert_eq!(exact.len(), replica.len());
    let report = check_run(run).unwrap();
    assert!(report.rules.contains(&Rule::ReplicaFloor));
    assert_eq!(
        !of(&report, Rule::ReplicaFloor).is_empty(),
        exact == replica
    );
}

/// A planted structural zero (every replica continuation given exact's tokens) fails
/// `replica-floor`, naming the settings to change; one replica token changed back (the
/// negative control) passes it, and so does the same run recorded as batch-invariant (where
/// identity is the invariant).
#[test]
fn a_structurally_zero_replica_fails_check() {
    let run = copy_of_run("structural-zero");
    set_replica_tokens(&run, |_, exact, _| exact.to_vec());
    let report = check_run(&run).unwrap();
    let found = of(&report, Rule::ReplicaFloor);
    assert_eq!(found.len(), 1, "{:?}", report.violations);
    assert!(found[0].contains("structural zero"), "{found:?}");
    assert!(found[0].contains("passes.replica_key_pad"), "{found:?}");

    let control = copy_of_run("structural-zero-control");
    let first = tokens_of(&control, "exact").into_keys().next().unwrap();
    set_replica_tokens(&control, |k, exact, _| {
        let mut t = exact.to_vec();
        if *k == first {
            t.push(0);
        }
        t
    });
    assert!(of(&check_run(&control).unwrap(), Rule::ReplicaFloor).is_empty());

    edit_manifest(&run, |m| m["policy"] = "batch_invariant".into());
    let bi = check_run(&run).unwrap();
    assert!(!bi.rules.contains(&Rule::ReplicaFloor));
    assert!(of(&bi, Rule::ReplicaFloor).is_empty());
}

/// The clean run's replica attended over another key axis than exact at every step (its key
/// padding); planting exact's key axis into every replica row (`keys_as_exact` = its steps)
/// fails `replica-path`.
#[test]
fn a_replica_on_exacts_key_axis_fails_check() {
    let clean = check_run(clean_run()).unwrap();
    assert!(clean.rules.contains(&Rule::ReplicaPath));
    assert!(of(&clean, Rule::ReplicaPath).is_empty(), "{clean:?}");
    let run = copy_of_run("equalized-path");
    rewrite(&run, "continuations.parquet", |b| {
        let p = strs(b, "pass");
        let steps = u32s(b, "path_steps");
        let same: Vec<Option<i64>> = (0..b.num_rows())
            .map(|i| Some(i64::from(steps[i])))
            .collect();
        assert!(p.iter().any(|x| x == "replica"));
        vec![with_column(
            b,
            "keys_as_exact",
            Arc::new(Int64Array::from(same)),
        )]
    });
    let found = of(&check_run(&run).unwrap(), Rule::ReplicaPath);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("equalized"), "{found:?}");
}
