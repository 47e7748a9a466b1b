//! `make models` pulls exactly the registry models listed in `tests/models.txt`; this test fails
//! when an integration test or the smoke spec names a registry model that the list lacks, so a
//! fresh machine (empty model cache) cannot miss one.
use std::collections::BTreeSet;
use std::path::Path;

fn listed() -> BTreeSet<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(root.join("tests/models.txt"))
        .expect("tests/models.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

#[test]
fn every_model_the_tests_name_is_pulled_by_make() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let names: Vec<String> = kvcredit::registry::models()
        .expect("registry")
        .iter()
        .map(|m| m.name.clone())
        .collect();
    let mut sources = vec![
        root.join("experiments/ci-smoke.toml"),
        root.join("Makefile"),
    ];
    for dir in ["tests", "tests/common"] {
        for e in std::fs::read_dir(root.join(dir)).unwrap().flatten() {
            if e.path().extension().is_some_and(|x| x == "rs") {
                sources.push(e.path());
            }
        }
    }
    let listed = listed();
    for path in &sources {
        let text = std::fs::read_to_string(path).unwrap();
        for name in &names {
            if text.contains(&format!("\"{name}\"")) || text.contains(&format!("{name}\n")) {
                assert!(
                    listed.contains(name),
                    "{} uses `{name}`, which tests/models.txt does not list",
                    path.display()
                );
            }
        }
    }
    for name in &listed {
        assert!(
            names.contains(name),
            "tests/models.txt lists `{name}`, not in the registry"
        );
    }
}
