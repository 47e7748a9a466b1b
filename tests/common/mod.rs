//! Shared helpers for the integration tests.
#![allow(dead_code)]
use kvcredit::{Decoder, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// Root of the Hugging Face parity fixtures.
pub fn hf_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

/// Every fixture directory (sorted), failing loudly when none exist.
pub fn fixture_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(hf_fixtures())
        .expect("tests/fixtures/hf exists (run tests/gen_fixtures.py)")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("config.json").exists())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no fixtures under tests/fixtures/hf");
    dirs
}

/// The reference tensors of a fixture by name.
pub fn reference(dir: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(dir.join("reference.safetensors"))
        .expect("reference.safetensors readable")
        .into_iter()
        .collect()
}

/// Load a fixture model on the CPU in `kind`.
pub fn load(dir: &Path, kind: Kind) -> Result<Decoder> {
    Decoder::load_hf_dir(dir, kind, Device::Cpu)
}

/// Largest absolute difference of two tensors, in f64.
pub fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

/// Token ids of a `[1, T]` int64 tensor.
pub fn ids(t: &Tensor) -> Vec<i64> {
    Vec::<i64>::try_from(t.reshape([-1])).expect("int64 ids")
}

/// A fixture's name.
pub fn name(dir: &Path) -> String {
    dir.file_name().unwrap().to_string_lossy().into_owned()
}

/// The registry's cache and Python as the CLI resolves them, from this process's environment.
pub fn registry_paths() -> kvcredit::registry::RegistryPaths {
    kvcredit::registry::RegistryPaths::from_vars(
        std::env::var_os("KVCREDIT_HOME"),
        std::env::var_os("HOME"),
        std::env::var_os("KVCREDIT_PYTHON"),
    )
}

/// A registry model's file in the cache (`$KVCREDIT_HOME/models/<name>/<name>.gguf`, default
/// `~/.cache/kvcredit`), failing with instructions when it is missing.
pub fn model_path(name: &str) -> PathBuf {
    let home = std::env::var_os("KVCREDIT_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/kvcredit")
        });
    let p = home.join("models").join(name).join(format!("{name}.gguf"));
    assert!(
        p.exists(),
        "model file {} is missing: run `kvcredit models pull {name}` (or set KVCREDIT_HOME)",
        p.display()
    );
    p
}

/// Run the `kvcredit` binary with `args` and extra environment; `(exit code, stdout, stderr)`.
pub fn kvcredit_env(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvcredit"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("binary runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Run the `kvcredit` binary with `args`; `(exit code, stdout, stderr)`.
pub fn kvcredit(args: &[&str]) -> (i32, String, String) {
    kvcredit_env(args, &[])
}

/// A fresh, empty scratch folder for one test (`<tmp>/kvcredit-<group>-<name>-<pid>`).
pub fn scratch(group: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvcredit-{group}-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Column `name` of a record batch as its concrete Arrow array type.
pub fn column<T: arrow_array::Array + Clone + 'static>(
    b: &arrow_array::RecordBatch,
    name: &str,
) -> T {
    b.column(b.schema().index_of(name).unwrap())
        .as_any()
        .downcast_ref::<T>()
        .unwrap_or_else(|| panic!("column {name} has an unexpected type"))
        .clone()
}

/// Copy the llama fixture to `dir` with `max_position_embeddings` set, a character-level
/// tokenizer over its 128 ids (0 = `<unk>`) and a ChatML-like chat template.
pub fn chat_fixture(dir: &Path, max_positions: usize) -> PathBuf {
    let src = hf_fixtures().join("llama");
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["max_position_embeddings"] = serde_json::json!(max_positions);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let mut vocab = serde_json::Map::new();
    vocab.insert("<unk>".into(), 0.into());
    let chars = (b' '..=b'~').map(char::from).chain(['\n']);
    for (i, c) in chars.enumerate() {
        vocab.insert(c.to_string(), (i + 1).into());
    }
    assert!(vocab.len() <= 128);
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    let template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}";
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": template}).to_string(),
    )
    .unwrap();
    dir.to_path_buf()
}

/// The first record batch of a Parquet file.
pub fn read_batch(path: &Path) -> arrow_array::RecordBatch {
    let f = std::fs::File::open(path).unwrap();
    let mut r = parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder::try_new(f)
        .unwrap()
        .build()
        .unwrap();
    r.next().unwrap().unwrap()
}

/// A tiny SmolLM2 fp32 CPU campaign of `count` problems (16-token rollouts, one pivot, K = 2,
/// 6-token continuations, batches of 4, the replica under exact's schedule: the bitwise control
/// that passes `check` on any CPU), named `name`.
pub fn tiny_campaign_spec(name: &str, count: usize) -> String {
    format!(
        r#"
name = "{name}"
model = "smollm2-135m-instruct"
dtype = "fp32"
device = "cpu"
policy = "stock"
seed = 7

[problems]
start = 0
count = {count}
format = "zero-shot-chat"

[rollout]
max_new_tokens = 16
temperature = 0.0

[pivots]
max_margin = 1.0
max_per_rollout = 1
alternatives = 1

[continuations]
k = 2
max_new_tokens = 6
temperature = 1.0

[passes]
run = ["exact", "replica", "refeed"]
replica_schedule = "same"
batch_size = 4
"#
    )
}

/// Load the campaign spec at `spec_path` and run it to the end into `out` on `model`, progress
/// hidden; returns the final manifest.
pub fn run_campaign_file(
    spec_path: &Path,
    model: &kvcredit::runtime::LoadedModel,
    out: &Path,
) -> kvcredit::credit::schema::Manifest {
    let (spec, sha) = kvcredit::credit::CampaignSpec::load(spec_path).unwrap();
    kvcredit::credit::run_campaign(
        &spec,
        &sha,
        model,
        &kvcredit::credit::RunOptions {
            out_dir: out.to_path_buf(),
            quiet: true,
            shard: None,
            exec: None,
        },
    )
    .unwrap()
}
