//! Corrupt, truncated and foreign files fail with one clear `Error::Gguf` line, never a panic.
use kvcredit::Error;
use kvcredit::gguf::GgufFile;
use std::path::PathBuf;

fn tmp(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvcredit-gguf-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let p = dir.join(name);
    std::fs::write(&p, bytes).expect("write tmp file");
    p
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// A minimal valid GGUF v3: one string key, one F32 tensor of `n` elements (type `ty`).
fn minimal(ty: u32, n: u64) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes()); // tensors
    b.extend(1u64.to_le_bytes()); // kv
    string(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    string(&mut b, "llama");
    string(&mut b, "t");
    b.extend(1u32.to_le_bytes());
    b.extend(n.to_le_bytes());
    b.extend(ty.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for i in 0..n {
        b.extend((i as f32).to_le_bytes());
    }
    b
}

fn gguf_err(bytes: &[u8], name: &str) -> String {
    let p = tmp(name, bytes);
    match GgufFile::open(&p) {
        Ok(_) => panic!("{name}: opened a bad file"),
        Err(e @ Error::Gguf(_)) => {
            let s = e.to_string();
            assert!(!s.contains('\n'), "{name}: multi-line error {s:?}");
            assert!(s.starts_with("gguf: "), "{s}");
            s
        }
        Err(other) => panic!("{name}: expected Error::Gguf, got {other:?}"),
    }
}

#[test]
fn minimal_file_is_valid() {
    let p = tmp("ok.gguf", &minimal(0, 8));
    let g = GgufFile::open(&p).expect("valid minimal file");
    let info = g.tensor_info("t").expect("tensor");
    assert_eq!(
        g.read_f32(info).expect("read"),
        (0..8).map(|i| i as f32).collect::<Vec<_>>()
    );
}

#[test]
fn bad_magic_empty_and_short_files() {
    assert!(gguf_err(b"", "empty.gguf").contains("not a GGUF file"));
    assert!(gguf_err(b"GG", "short.gguf").contains("not a GGUF file"));
    let mut b = minimal(0, 8);
    b[0..4].copy_from_slice(b"GGML");
    let e = gguf_err(&b, "magic.gguf");
    assert!(e.contains("bad magic"), "{e}");
    let e = gguf_err(b"{\"not\": \"gguf\"}", "json.gguf");
    assert!(e.contains("bad magic"), "{e}");
}

#[test]
fn unsupported_versions() {
    let mut b = minimal(0, 8);
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(gguf_err(&b, "v1.gguf").contains("version 1"));
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(gguf_err(&b, "be.gguf").contains("big-endian"));
    b[4..8].copy_from_slice(&77u32.to_le_bytes());
    assert!(gguf_err(&b, "v77.gguf").contains("unsupported GGUF version 77"));
}

#[test]
fn truncated_anywhere() {
    let full = minimal(0, 8);
    for cut in [8, 20, 30, 50, 70, full.len() - 1] {
        let e = gguf_err(&full[..cut], &format!("cut{cut}.gguf"));
        assert!(e.contains("truncated"), "cut at {cut}: {e}");
    }
    // the real-format fixture, cut in its data section
    let fx = std::fs::read(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/dequant.gguf"),
    )
    .expect("fixture");
    let e = gguf_err(&fx[..fx.len() - 100], "fixture-cut.gguf");
    assert!(e.contains("extends past the end"), "{e}");
    let e = gguf_err(&fx[..4000], "fixture-header-cut.gguf");
    assert!(e.contains("truncated"), "{e}");
}

#[test]
fn unknown_tensor_and_value_types() {
    let e = gguf_err(&minimal(99, 8), "type99.gguf");
    assert!(e.contains("unknown or unsupported tensor type 99"), "{e}");
    // IQ2_XXS (16) exists in ggml but is not supported here
    let e = gguf_err(&minimal(16, 256), "iq2.gguf");
    assert!(e.contains("tensor type 16"), "{e}");
    let mut b = minimal(0, 8);
    // value type of the first key sits right after its string: 24 header + 8 + 20 name bytes
    let at = 24 + 8 + "general.architecture".len();
    b[at..at + 4].copy_from_slice(&42u32.to_le_bytes());
    let e = gguf_err(&b, "valtype.gguf");
    assert!(e.contains("unknown value type 42"), "{e}");
}

#[test]
fn absurd_counts_and_lengths_do_not_allocate() {
    let mut b = minimal(0, 8);
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = gguf_err(&b, "ntensors.gguf");
    assert!(e.contains("more than the file can hold"), "{e}");
    let mut b = minimal(0, 8);
    b[24..32].copy_from_slice(&(1u64 << 60).to_le_bytes()); // key length
    let e = gguf_err(&b, "keylen.gguf");
    assert!(e.contains("truncated"), "{e}");
    // a Q4_K tensor whose row length is not a multiple of 256
    let e = gguf_err(&minimal(12, 100), "rowlen.gguf");
    assert!(e.contains("not a multiple"), "{e}");
}

#[test]
fn load_reports_missing_and_corrupt_files() {
    let missing = PathBuf::from("/nonexistent/model.gguf");
    assert!(matches!(
        kvcredit::model::gguf::load(&missing),
        Err(Error::Io { .. })
    ));
    let p = tmp("garbage.gguf", &[0u8; 1000]);
    match kvcredit::model::gguf::load(&p) {
        Err(Error::Gguf(m)) => assert!(m.contains("bad magic"), "{m}"),
        Err(e) => panic!("expected Error::Gguf, got {e:?}"),
        Ok(_) => panic!("loaded garbage"),
    }
    // valid container without tokenizer/architecture metadata: a clear error, not a panic
    let p = tmp("notokenizer.gguf", &minimal(0, 8));
    let e = kvcredit::model::gguf::load(&p)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("tokenizer.ggml.model"), "{e}");
}
