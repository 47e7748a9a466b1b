//! De-quantization of every supported ggml type against gguf-py's reference implementation
//! (the one transformers uses), bit for bit, on a GGUF file written by gguf-py itself
//! (`tests/fixtures/gguf/dequant.gguf`, made by `tests/gen_gguf_reference.py dequant`).
use kvcredit::gguf::{GgmlType, GgufFile};
use std::path::Path;

fn fixture() -> GgufFile {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/dequant.gguf");
    GgufFile::open(&p).expect("open dequant fixture")
}

#[test]
fn every_type_matches_gguf_py_bit_for_bit() {
    let g = fixture();
    let expected_types = [
        ("f32", GgmlType::F32),
        ("f16", GgmlType::F16),
        ("bf16", GgmlType::Bf16),
        ("q4_0", GgmlType::Q4_0),
        ("q4_1", GgmlType::Q4_1),
        ("q5_0", GgmlType::Q5_0),
        ("q5_1", GgmlType::Q5_1),
        ("q8_0", GgmlType::Q8_0),
        ("q2_k", GgmlType::Q2K),
        ("q3_k", GgmlType::Q3K),
        ("q4_k", GgmlType::Q4K),
        ("q5_k", GgmlType::Q5K),
        ("q6_k", GgmlType::Q6K),
    ];
    for (name, ty) in expected_types {
        let info = g
            .tensor_info(name)
            .unwrap_or_else(|| panic!("fixture lacks `{name}`"));
        assert_eq!(info.ggml_type, ty, "{name}");
        assert_eq!(info.torch_shape(), vec![4, 512], "{name}");
        let got = g.read_f32(info).expect(name);
        let want_info = g
            .tensor_info(&format!("{name}.expected"))
            .expect("expected tensor");
        assert_eq!(want_info.ggml_type, GgmlType::F32);
        let want = g.read_f32(want_info).expect("expected values");
        assert_eq!(got.len(), want.len(), "{name}");
        let mismatches = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let max_abs = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert_eq!(
            mismatches, 0,
            "{name}: {mismatches} values differ (max abs {max_abs:e})"
        );
        // the fixture is not degenerate
        assert!(want.iter().any(|&x| x != 0.0), "{name}: all zeros");
    }
}

#[test]
fn tensor_reads_as_torch_shape() {
    let g = fixture();
    let info = g.tensor_info("q4_k").expect("q4_k");
    let t = g.read_tensor(info).expect("read");
    assert_eq!(t.size(), vec![4, 512]);
    assert_eq!(t.kind(), tch::Kind::Float);
    assert_eq!(g.version, 3);
    assert_eq!(
        g.opt_str("general.architecture").expect("str"),
        Some("dequant-test")
    );
}
