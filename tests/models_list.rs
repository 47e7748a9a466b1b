//! `make models` pulls exactly the registry models listed in `tests/models.txt`; this test fails
//! when an integration test or the smoke spec names a registry model that the list lacks, so a
//! fresh machine (empty model cache) cannot miss one. Models a test names but never loads (a
//! spec it only validates against the registry) are listed in `tests/models-named-only.txt`.
use std::collections::BTreeSet;
use std::path::Path;

fn listed_in(file: &str) -> BTreeSet<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(root.join(file))
        .expect(file)
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
    let listed = listed_in("tests/models.txt");
    let named_only = listed_in("tests/models-named-only.txt");
    for path in &sources {
        let text = std::fs::read_to_string(path).unwrap();
        for name in &names {
            if text.contains(&format!("\"{name}\"")) || text.contains(&format!("{name}\n")) {
                assert!(
                    listed.contains(name) || named_only.contains(name),
                    "{} uses `{name}`, which tests/models.txt (nor tests/models-named-only.txt) does not list",
                    path.display()
                );
            }
        }
    }
    for name in listed.iter().chain(&named_only) {
        assert!(
            names.contains(name),
            "tests/models.txt or tests/models-named-only.txt lists `{name}`, not in the registry"
        );
    }
    for name in &named_only {
        assert!(
            !listed.contains(name),
            "`{name}` is in both lists; a pulled model belongs in tests/models.txt only"
        );
    }
}
