//! Executes `notebooks/analysis.ipynb` against `kvcredit analyze` output for the synthetic
//! runs: the notebook recomputes the main table with polars and asserts it equals
//! `summary.parquet`, so a drift between the two fails here.
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `jupyter` from the project venv (`$VIRTUAL_ENV`, else `.venv`), else from PATH.
fn jupyter() -> Option<PathBuf> {
    let venvs = [
        std::env::var_os("VIRTUAL_ENV").map(PathBuf::from),
        Some(root().join(".venv")),
    ];
    for v in venvs.into_iter().flatten() {
        let j = v.join("bin/jupyter");
        if j.is_file() {
            return Some(j);
        }
    }
    let ok = Command::new("jupyter")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then(|| PathBuf::from("jupyter"))
}

#[test]
fn notebook_reproduces_summary_parquet() {
    let Some(jupyter) = jupyter() else {
        println!("skipped: jupyter not found in $VIRTUAL_ENV, .venv or PATH");
        return;
    };
    let names = [
        "stock_shuffled",
        "stock_k5",
        "same_schedule",
        "batch_invariant",
    ];
    let work = std::env::temp_dir().join(format!("kvcredit-notebook-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let fixtures = root().join("tests/fixtures/analysis/runs");
    let mut dirs = Vec::new();
    for n in names {
        let d = work.join(n);
        std::fs::create_dir_all(&d).unwrap();
        for e in std::fs::read_dir(fixtures.join(n)).unwrap() {
            let p = e.unwrap().path();
            std::fs::copy(&p, d.join(p.file_name().unwrap())).unwrap();
        }
        dirs.push(d);
    }
    let out = work.join("combined");
    let status = Command::new(env!("CARGO_BIN_EXE_kvcredit"))
        .arg("analyze")
        .args(&dirs)
        .args(["--reps", "200", "--out"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let joined = std::env::join_paths(&dirs).unwrap();
    let executed = work.join("executed.ipynb");
    let res = Command::new(&jupyter)
        .args(["nbconvert", "--to", "notebook", "--execute"])
        .arg(root().join("notebooks/analysis.ipynb"))
        .arg("--output")
        .arg(&executed)
        .env("KVCREDIT_RUN_DIR", &joined)
        .env("KVCREDIT_OUT_DIR", &out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "notebook failed:\n{err}");
    let nb = std::fs::read_to_string(&executed).unwrap();
    assert!(
        nb.contains("summary.parquet agrees with the recomputation on 8 configuration"),
        "assertion cell did not report"
    );
    assert!(
        nb.contains("image/png"),
        "no figure in the executed notebook"
    );
    std::fs::remove_dir_all(&work).unwrap();
}
