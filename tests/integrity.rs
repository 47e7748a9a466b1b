//! Integrity end to end: a run's tables and shards verified by their recorded sha256 before
//! they are read, cached models verified against the registry, and the decode worker's
//! concurrency and deadlines.
mod common;

use std::path::{Path, PathBuf};

/// A copy, in `dir/run`, of a finished tiny CPU campaign (one problem of the shared tiny
/// spec) that is run once per test binary.
fn tiny_run(dir: &Path) -> PathBuf {
    static RUN: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    let src = RUN.get_or_init(|| {
        let dir = common::scratch("integrity", "tiny");
        let spec = dir.join("spec.toml");
        std::fs::write(&spec, common::tiny_campaign_spec("integrity", 1)).unwrap();
        let out = dir.join("run");
        let (code, _, err) = common::kvcredit(&[
            "campaign",
            "run",
            spec.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--quiet",
        ]);
        assert_eq!(code, 0, "{err}");
        out
    });
    let out = dir.join("run");
    copy_dir(src, &out);
    out
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        let to = dst.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), &to).unwrap();
        }
    }
}

fn manifest(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap()
}

/// `count` offsets spread over a file of `len` bytes, first and last byte included.
fn offsets(len: usize, count: usize) -> Vec<usize> {
    (0..count).map(|i| i * (len - 1) / (count - 1)).collect()
}

#[test]
fn a_flipped_byte_in_any_table_fails_check_and_analyze() {
    let dir = common::scratch("integrity", "flip");
    let out = tiny_run(&dir);
    let run = out.to_str().unwrap();
    // The manifest records each table's own sha256.
    let m = manifest(&out);
    for t in ["rollouts", "pivots", "continuations", "estimates"] {
        let file = format!("{t}.parquet");
        let want = kvcredit::io::integrity::sha256_file(&out.join(&file)).unwrap();
        assert_eq!(m["files_sha256"][&file], want.as_str(), "{file}");
    }
    // Negative control: the untouched run passes.
    let (code, stdout, err) = common::kvcredit(&["check", run]);
    assert_eq!(code, 0, "{stdout}{err}");
    // 12 offsets in each of two tables, header and footer included: none passes.
    let mut passed = Vec::new();
    let mut tried = 0;
    for file in ["estimates.parquet", "continuations.parquet"] {
        let path = out.join(file);
        let clean = std::fs::read(&path).unwrap();
        for at in offsets(clean.len(), 12) {
            let mut bytes = clean.clone();
            bytes[at] ^= 0x01;
            std::fs::write(&path, &bytes).unwrap();
            tried += 1;
            let (code, stdout, err) = common::kvcredit(&["check", run]);
            if code != 1 {
                passed.push(format!("{file}@{at}: exit {code}"));
            } else {
                let line = stdout.lines().next().unwrap_or("");
                assert!(
                    line.starts_with("integrity: ") && line.contains(file),
                    "{file}@{at}: {stdout}"
                );
                assert_eq!(err.lines().count(), 1, "{err}");
            }
        }
        std::fs::write(&path, &clean).unwrap();
    }
    assert_eq!(tried, 24);
    assert!(
        passed.is_empty(),
        "{} of 24 passed: {passed:?}",
        passed.len()
    );
    // analyze refuses the same damage before reading, naming the file.
    let path = out.join("continuations.parquet");
    let clean = std::fs::read(&path).unwrap();
    let mut bytes = clean.clone();
    bytes[clean.len() / 2] ^= 0x80;
    std::fs::write(&path, &bytes).unwrap();
    let report = dir.join("report");
    let (code, _, err) = common::kvcredit(&[
        "analyze",
        run,
        "--out",
        report.to_str().unwrap(),
        "--reps",
        "10",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("integrity: ") && err.contains("continuations.parquet"),
        "{err}"
    );
    assert!(!report.join("summary.parquet").exists());
    std::fs::write(&path, &clean).unwrap();
    let (code, _, err) = common::kvcredit(&[
        "analyze",
        run,
        "--out",
        report.to_str().unwrap(),
        "--reps",
        "10",
    ]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn shards_carry_their_hashes_and_merge_verifies_them() {
    let dir = common::scratch("integrity", "shards");
    let out = tiny_run(&dir);
    let shard = out.join("shards").join("problem-00000");
    let hashes: std::collections::BTreeMap<String, String> = serde_json::from_str(
        &std::fs::read_to_string(shard.join(kvcredit::io::integrity::SHARD_HASHES)).unwrap(),
    )
    .unwrap();
    assert_eq!(hashes.len(), 4, "{hashes:?}");
    // Negative control: the clean run merges.
    let merged = dir.join("merged");
    let (code, _, err) = common::kvcredit(&[
        "campaign",
        "merge",
        out.to_str().unwrap(),
        "--out",
        merged.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    // One flipped byte in a shard's table: merge refuses before reading it, naming it.
    let table = shard.join("estimates.parquet");
    let mut bytes = std::fs::read(&table).unwrap();
    let at = bytes.len() / 3;
    bytes[at] ^= 0x10;
    std::fs::write(&table, &bytes).unwrap();
    let again = dir.join("merged-again");
    let (code, _, err) = common::kvcredit(&[
        "campaign",
        "merge",
        out.to_str().unwrap(),
        "--out",
        again.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("integrity: ") && err.contains("problem-00000/estimates.parquet"),
        "{err}"
    );
    assert!(!again.join("estimates.parquet").exists());
}

/// A temporary cache root holding a copy of the registry's smallest model, with one byte
/// flipped when `flip` (the shared cache is never touched).
fn model_home(name: &str, flip: bool) -> PathBuf {
    let src = common::model_path("smollm2-135m-instruct");
    let home = common::scratch("integrity", name);
    let dir = home.join("models").join("smollm2-135m-instruct");
    std::fs::create_dir_all(&dir).unwrap();
    let dst = dir.join("smollm2-135m-instruct.gguf");
    let mut bytes = std::fs::read(src).unwrap();
    if flip {
        // A byte of the last tensor's data: the file still parses and loads.
        let at = bytes.len() - 1000;
        bytes[at] ^= 0x01;
    }
    std::fs::write(&dst, bytes).unwrap();
    home
}

#[test]
fn a_corrupted_cached_model_is_refused_by_name() {
    let home = model_home("model-flip", true);
    let env = [("KVCREDIT_HOME", home.to_str().unwrap())];
    let (code, _, err) = common::kvcredit_env(
        &[
            "generate",
            "--model",
            "smollm2-135m-instruct",
            "--ids",
            "1,2,3",
            "--max-new-tokens",
            "2",
        ],
        &env,
    );
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("model `smollm2-135m-instruct`")
            && err.contains("kvcredit models pull smollm2-135m-instruct --force"),
        "{err}"
    );
    let (code, stdout, err) =
        common::kvcredit_env(&["models", "verify", "smollm2-135m-instruct"], &env);
    assert_eq!(code, 2, "{stdout}{err}");
    assert!(
        stdout.contains("sha256 mismatch") && stdout.contains("--force"),
        "{stdout}"
    );
    // Every pulled model when no name is given: the same verdict.
    let (code, stdout, _) = common::kvcredit_env(&["models", "verify"], &env);
    assert_eq!(code, 2);
    assert!(stdout.starts_with("smollm2-135m-instruct: "), "{stdout}");
}

#[test]
fn an_intact_cached_model_verifies_and_loads() {
    let home = model_home("model-ok", false);
    let env = [("KVCREDIT_HOME", home.to_str().unwrap())];
    let (code, stdout, err) =
        common::kvcredit_env(&["models", "verify", "smollm2-135m-instruct"], &env);
    assert_eq!(code, 0, "{err}");
    let want = kvcredit::registry::find("smollm2-135m-instruct")
        .unwrap()
        .sha256
        .clone();
    assert!(
        stdout.starts_with(&format!("smollm2-135m-instruct: ok sha256 {want}")),
        "{stdout}"
    );
    // The digest was cached beside the models (so a load does not hash again).
    let cached = std::fs::read_dir(home.join("models").join(".sha256"))
        .unwrap()
        .count();
    assert_eq!(cached, 1);
    let (code, _, err) = common::kvcredit_env(
        &[
            "generate",
            "--model",
            "smollm2-135m-instruct",
            "--ids",
            "1,2,3",
            "--max-new-tokens",
            "2",
        ],
        &env,
    );
    assert_eq!(code, 0, "{err}");
}

#[test]
fn the_recorded_model_hash_is_the_files_own() {
    // A GGUF given by path (no registry entry to compare with): the loaded model carries the
    // file's own digest, so a changed file records a changed hash.
    let home = model_home("model-path", true);
    let path = home
        .join("models")
        .join("smollm2-135m-instruct")
        .join("smollm2-135m-instruct.gguf");
    let m = kvcredit::runtime::load(
        &kvcredit::runtime::ModelSource::Gguf {
            path: path.clone(),
            name: None,
            digests: None,
        },
        kvcredit::runtime::Dtype::Fp32,
        tch::Device::Cpu,
    )
    .unwrap();
    let own = kvcredit::io::integrity::sha256_file(&path).unwrap();
    assert_eq!(m.sha256.as_deref(), Some(own.as_str()));
    let registry = &kvcredit::registry::find("smollm2-135m-instruct")
        .unwrap()
        .sha256;
    assert_ne!(&own, registry);
}

// ---------------------------------------------------------------------------------------
// The decode worker (`spectrum serve`).

mod worker {
    use super::common;
    use kvcredit::exec::ExecPolicy;
    use kvcredit::model::{Decoder, LogitsAt};
    use kvcredit::spectrum::tiers::{TierPlan, TieredKv};
    use kvcredit::spectrum::transport::{self, ServeOptions};
    use kvcredit::spectrum::{Quantizer, Tier, wire};
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::{Duration, Instant};
    use tch::{Kind, Tensor};

    fn model() -> Decoder {
        common::load(&common::hf_fixtures().join("qwen2"), Kind::Float).unwrap()
    }

    /// A good frame of a 40-token context in all three stored tiers, the token to feed and
    /// the worker's expected greedy tokens.
    fn frame(m: &Decoder) -> (Vec<u8>, i64, Vec<i64>) {
        let ids: Vec<i64> = (0..41u64)
            .map(|i| ((i * 2654435761) % 127) as i64)
            .collect();
        let (ctx, last) = ids.split_at(40);
        let mut cache = m.new_cache(1, 44).unwrap();
        let t = Tensor::from_slice(ctx).view([1, -1]);
        let _ = m
            .forward(&t, &mut cache, &ExecPolicy::Stock, &LogitsAt::Last)
            .unwrap();
        let plan = TierPlan::new(
            (0..40)
                .map(|i| [Tier::Fp16, Tier::Int8, Tier::Int4][i % 3])
                .collect(),
        );
        let tiered = TieredKv::build(&cache, 0, &plan, Quantizer::Kivi).unwrap();
        let (want, ..) =
            transport::decode_greedy(m, &tiered, last[0], 2, &ExecPolicy::Stock).unwrap();
        (wire::encode(&tiered).unwrap(), last[0], want)
    }

    fn options(max_connections: usize) -> ServeOptions {
        ServeOptions {
            max_frame: 1 << 20,
            max_requests: None,
            read_timeout: Duration::from_secs(30),
            request_timeout: Duration::from_secs(30),
            max_connections,
            policy: ExecPolicy::Stock,
        }
    }

    /// A worker on a loopback port, serving in its own thread for the rest of the test binary.
    fn spawn(opts: ServeOptions) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let m = model();
            transport::serve(&m, &listener, &opts, &mut |_| {})
        });
        addr
    }

    fn envelope(first: i64, steps: u32, len: u64) -> Vec<u8> {
        let mut e = Vec::new();
        e.extend_from_slice(b"SPRQ");
        e.extend_from_slice(&1u16.to_le_bytes());
        e.extend_from_slice(&[0, 0]);
        e.extend_from_slice(&(first as u32).to_le_bytes());
        e.extend_from_slice(&steps.to_le_bytes());
        e.extend_from_slice(&len.to_le_bytes());
        e
    }

    fn connect(addr: std::net::SocketAddr) -> TcpStream {
        let s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s
    }

    #[test]
    fn a_byte_a_second_client_does_not_hold_a_valid_request() {
        let m = model();
        let (frame, first, want) = frame(&m);
        let addr = spawn(options(8));
        // The slow client: a valid envelope, then one frame byte a second, in its own thread.
        let mut request = envelope(first, 2, frame.len() as u64);
        request.extend_from_slice(&frame);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let trickle = {
            let stop = stop.clone();
            let mut s = connect(addr);
            std::thread::spawn(move || {
                for b in request {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                    if s.write_all(&[b]).is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_secs(1));
                }
            })
        };
        std::thread::sleep(Duration::from_millis(1500));
        // A valid request while the slow client is connected: answered within 2 s.
        let t0 = Instant::now();
        let mut s = connect(addr);
        let r = transport::request(&mut s, &frame, first, 2, None).unwrap();
        let took = t0.elapsed();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(r.tokens, want);
        assert!(took < Duration::from_secs(2), "answered after {took:?}");
        trickle.join().unwrap();
    }

    #[test]
    fn a_request_past_its_deadline_is_refused() {
        let m = model();
        let (frame, first, _) = frame(&m);
        let addr = spawn(ServeOptions {
            read_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_millis(800),
            ..options(4)
        });
        // Bytes keep coming (every 100 ms, well inside the read timeout), but the whole
        // request does not arrive within the deadline.
        let mut s = connect(addr);
        let mut request = envelope(first, 2, frame.len() as u64);
        request.extend_from_slice(&frame);
        let t0 = Instant::now();
        for b in &request[..30] {
            if s.write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        assert!(t0.elapsed() < Duration::from_secs(5));
        let text = String::from_utf8_lossy(reply.get(9..).unwrap_or(&[])).into_owned();
        assert!(
            reply.get(4) == Some(&1) && text.contains("deadline"),
            "{text}"
        );
    }

    #[test]
    fn connections_past_the_cap_are_refused_and_the_rest_served() {
        let m = model();
        let (frame, first, want) = frame(&m);
        let addr = spawn(options(2));
        let idle: Vec<TcpStream> = (0..2).map(|_| connect(addr)).collect();
        std::thread::sleep(Duration::from_millis(200));
        let mut third = connect(addr);
        let mut reply = Vec::new();
        let _ = third.read_to_end(&mut reply);
        let text = String::from_utf8_lossy(reply.get(9..).unwrap_or(&[])).into_owned();
        assert!(reply.get(4) == Some(&1) && text.contains("busy"), "{text}");
        drop(idle);
        // The slots free up once the idle clients leave.
        std::thread::sleep(Duration::from_millis(300));
        let mut s = connect(addr);
        let r = transport::request(&mut s, &frame, first, 2, None).unwrap();
        assert_eq!(r.tokens, want);
    }

    #[test]
    fn a_resigned_frame_with_a_nan_is_refused() {
        use sha2::{Digest, Sha256};
        let m = model();
        let (frame, first, want) = frame(&m);
        // The first FP16-tier element of layer 0 sits right after the header and the index
        // lists; set an element to NaN (0x7e00) and sign the frame again.
        let tiered = wire::decode(&frame).unwrap();
        let n_index: usize = tiered.index.iter().map(Vec::len).sum();
        let at = wire::HEADER + 2 * n_index; // 2-byte indices below 65536 tokens
        let mut bad = frame.clone();
        bad[at..at + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
        let body = bad.len() - wire::TRAILER;
        let sig = Sha256::digest(&bad[..body]);
        bad[body..].copy_from_slice(&sig[..]);
        let e = wire::decode(&bad).unwrap_err().to_string();
        assert!(e.contains("non-finite"), "{e}");
        // Infinity too (0x7c00), and the worker refuses it over the wire and goes on serving.
        bad[at..at + 2].copy_from_slice(&0x7c00u16.to_le_bytes());
        let sig = Sha256::digest(&bad[..body]);
        bad[body..].copy_from_slice(&sig[..]);
        let addr = spawn(options(4));
        let mut s = connect(addr);
        let e = transport::request(&mut s, &bad, first, 2, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("non-finite"), "{e}");
        let mut s = connect(addr);
        let r = transport::request(&mut s, &frame, first, 2, None).unwrap();
        assert_eq!(r.tokens, want);
    }

    #[test]
    fn a_huge_length_claim_allocates_nothing_up_front() {
        // A 1 GiB limit and a claim just under it, then the peer hangs up: the worker
        // answers with a truncation error, and a valid request is served after it.
        let m = model();
        let (frame, first, want) = frame(&m);
        let addr = spawn(ServeOptions {
            max_frame: 1 << 30,
            ..options(4)
        });
        let mut s = connect(addr);
        s.write_all(&envelope(first, 2, (1 << 30) - 1)).unwrap();
        s.write_all(&frame[..100]).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        let text = String::from_utf8_lossy(reply.get(9..).unwrap_or(&[])).into_owned();
        assert!(text.contains("truncated frame"), "{text}");
        let mut s = connect(addr);
        let r = transport::request(&mut s, &frame, first, 2, None).unwrap();
        assert_eq!(r.tokens, want);
    }

    #[test]
    fn zero_timeouts_and_no_connections_are_refused_at_start() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let m = model();
        for (opts, what) in [
            (
                ServeOptions {
                    read_timeout: Duration::ZERO,
                    ..options(4)
                },
                "read timeout",
            ),
            (
                ServeOptions {
                    request_timeout: Duration::ZERO,
                    ..options(4)
                },
                "request timeout",
            ),
            (options(0), "connections"),
        ] {
            let e = transport::serve(&m, &listener, &opts, &mut |_| {})
                .unwrap_err()
                .to_string();
            assert!(e.contains(what), "{e}");
        }
    }

    /// `spectrum serve` with `args` after the model: (exit code, stderr).
    fn serve_cli(args: &[&str]) -> (i32, String) {
        let model = common::hf_fixtures().join("qwen2");
        let mut all = vec!["spectrum", "serve", "--model", model.to_str().unwrap()];
        all.extend(args);
        let (code, _, err) = common::kvcredit(&all);
        (code, err)
    }

    #[test]
    fn serve_flags_out_of_range_are_refused_naming_the_flag() {
        for (args, needle) in [
            (
                vec!["--max-frame-mib", "18446744073709551615"],
                "--max-frame-mib",
            ),
            (vec!["--max-frame-mib", "0"], "--max-frame-mib"),
            (vec!["--read-timeout-s", "0"], "--read-timeout-s"),
            (vec!["--request-timeout-s", "0"], "--request-timeout-s"),
            (vec!["--max-connections", "0"], "--max-connections"),
            (vec!["--bind", "0.0.0.0:0"], "--allow-remote"),
        ] {
            let (code, err) = serve_cli(&args);
            assert_eq!(code, 2, "{args:?}: {err}");
            assert!(
                err.contains(needle) && err.lines().count() == 1,
                "{args:?}: {err}"
            );
        }
    }

    #[test]
    fn allow_remote_serves_beyond_loopback_with_a_warning() {
        let model = common::hf_fixtures().join("qwen2");
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvcredit"))
            .args(["spectrum", "serve", "--model"])
            .arg(&model)
            .args(["--bind", "0.0.0.0:0", "--allow-remote"])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines =
            std::io::BufRead::lines(std::io::BufReader::new(child.stderr.take().unwrap()));
        let warning = lines.next().unwrap().unwrap();
        let started = lines.next().unwrap().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            warning.starts_with("warning: ") && warning.contains("no authentication"),
            "{warning}"
        );
        assert!(started.contains("0.0.0.0:"), "{started}");
    }
}

// ---------------------------------------------------------------------------------------
// Specs and flags: bounds before allocation, finite floats, unknown keys, repeats, names.

mod specs {
    use super::common;
    use kvcredit::credit::CampaignSpec;
    use kvcredit::divergence::spec::DivergenceSpec;
    use kvcredit::spectrum::spec::SpectrumSpec;
    use std::path::{Path, PathBuf};

    fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    /// `text` with the line starting `key =` replaced by `key = value` (the line must exist).
    fn set(text: &str, key: &str, value: &str) -> String {
        let prefix = format!("{key} = ");
        assert!(
            text.lines().any(|l| l.starts_with(&prefix)),
            "no `{key}` line"
        );
        text.lines()
            .map(|l| {
                if l.starts_with(&prefix) {
                    format!("{key} = {value}")
                } else {
                    l.to_string()
                }
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    /// The one-line error of loading `text` with `load`, asserting it names `needle`.
    fn refused<T: std::fmt::Debug>(
        load: impl Fn(&Path) -> kvcredit::Result<T>,
        dir: &Path,
        text: &str,
        needle: &str,
    ) {
        let p = write(dir, "spec.toml", text);
        let e = load(&p).expect_err(needle).to_string();
        assert!(e.contains(needle) && !e.contains('\n'), "{needle}: {e}");
    }

    #[test]
    fn campaign_counts_and_floats_are_bounded_before_anything_runs() {
        let dir = common::scratch("integrity", "campaign-spec");
        let base = common::tiny_campaign_spec("bounds", 1);
        let load = |p: &Path| CampaignSpec::load(p);
        // Control: the base spec loads.
        load(&write(&dir, "ok.toml", &base)).unwrap();
        // [continuations] k is the first `k =` line.
        for (key, value, needle) in [
            ("k", "1000000000", "continuations.k = 1000000000 exceeds"),
            (
                "alternatives",
                "1000000",
                "pivots.alternatives = 1000000 exceeds",
            ),
            (
                "max_per_rollout",
                "100000",
                "pivots.max_per_rollout = 100000 exceeds",
            ),
            (
                "batch_size",
                "100000000",
                "passes.batch_size = 100000000 exceeds",
            ),
            ("max_new_tokens", "18446744073709551615", "max_new_tokens"),
        ] {
            refused(load, &dir, &set(&base, key, value), needle);
        }
        refused(
            load,
            &dir,
            &set(&set(&base, "k", "65536"), "max_per_rollout", "4096"),
            "continuations per group (passes.pool_problems × pivots.max_per_rollout × (1 + pivots.alternatives) × continuations.k) = 1 × 4096 × 2 × 65536 exceeds",
        );
        refused(
            load,
            &dir,
            &set(&base, "name", "\"..\""),
            "one path component",
        );
        for t in ["nan", "inf", "-inf", "-0.5"] {
            refused(load, &dir, &set(&base, "temperature", t), "temperature");
        }
        // Through the binary: one line, exit 2, nothing run.
        let p = write(&dir, "k.toml", &set(&base, "k", "1000000000"));
        let (code, _, err) = common::kvcredit(&["campaign", "validate", p.to_str().unwrap()]);
        assert_eq!(code, 2, "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(err.contains("continuations.k = 1000000000"), "{err}");
    }

    #[test]
    fn generate_refuses_a_non_finite_temperature() {
        for t in ["NaN", "inf", "-1"] {
            let (code, _, err) = common::kvcredit(&[
                "generate",
                "--model",
                "smollm2-135m-instruct",
                "--ids",
                "1,2",
                &format!("--temperature={t}"),
            ]);
            assert_eq!(code, 2, "{t}: {err}");
            assert!(err.contains("--temperature"), "{t}: {err}");
        }
    }

    fn spectrum_base() -> String {
        std::fs::read_to_string(root().join("experiments/spectrum-cpu-small.toml")).unwrap()
    }

    #[test]
    fn spectrum_specs_are_bounded_named_and_listed_once() {
        let dir = common::scratch("integrity", "spectrum-spec");
        let base = spectrum_base();
        let load = |p: &Path| SpectrumSpec::load(p);
        load(&write(&dir, "ok.toml", &base)).unwrap();
        for (key, value, needle) in [
            (
                "context",
                "18446744073709551615",
                "ppl: context + continuation",
            ),
            (
                "windows",
                "100000",
                "ppl: windows × (context + continuation)",
            ),
            ("budgets", "[]", "ppl: no budgets"),
            ("budgets", "[0.3, 0.3]", "budgets lists 0.3 twice"),
            ("budgets", "[nan]", "budget NaN"),
            (
                "quantizers",
                "[\"kivi\", \"kivi\"]",
                "quantizers lists Kivi twice",
            ),
            ("name", "\"../../x\"", "one path component"),
            ("name", "\"a/b\"", "one path component"),
            ("name", "\"..\"", "one path component"),
            ("name", "\"\"", "one path component"),
        ] {
            refused(load, &dir, &set(&base, key, value), needle);
        }
        refused(
            load,
            &dir,
            &format!(
                "{base}\n[probe]\ncontext = 64\nquantizers = [\"kivi\"]\ngate_max_ppl_ratio = inf\n"
            ),
            "gate ratio",
        );
    }

    #[test]
    fn a_spectrum_context_past_the_models_positions_is_refused() {
        // The fixture's max_position_embeddings is far below 100000 tokens.
        let dir = common::scratch("integrity", "spectrum-positions");
        let model = common::hf_fixtures().join("qwen2");
        let text = set(
            &set(
                &spectrum_base(),
                "model",
                &format!("{:?}", model.display().to_string()),
            ),
            "context",
            "100000",
        );
        let spec = write(&dir, "spec.toml", &text);
        let out = dir.join("out");
        let (code, _, err) = common::kvcredit(&[
            "spectrum",
            "ppl",
            spec.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 2, "{err}");
        assert!(
            err.contains("[ppl] context + continuation needs 100128 positions"),
            "{err}"
        );
        assert!(!out.exists());
    }

    fn divergence_base() -> String {
        std::fs::read_to_string(root().join("experiments/divergence-cpu-smollm2.toml")).unwrap()
    }

    #[test]
    fn divergence_specs_refuse_unknown_keys_repeats_and_far_boundaries() {
        let dir = common::scratch("integrity", "divergence-spec");
        let base = divergence_base();
        let load = |p: &Path| DivergenceSpec::load(p);
        load(&write(&dir, "ok.toml", &base)).unwrap();
        for (text, needle) in [
            (
                base.replace("top_p = 0.9\n", "top_p = 0.9\ntop_k = 5\n"),
                "strategies[1] (top_p=0.9,t=0.7): unknown key `top_k`",
            ),
            (
                base.replace(
                    "kind = \"greedy\"\n",
                    "kind = \"greedy\"\ntemperature = 0.5\n",
                ),
                "strategies[0] (greedy): unknown key `temperature`",
            ),
            (
                set(&base, "dtypes", "[\"fp32\", \"bf16\", \"fp32\"]"),
                "dtypes lists fp32 twice",
            ),
            (
                set(&base, "boundaries", "[4, 9]"),
                "9 lies past the 8 generated",
            ),
            (
                set(&base, "boundaries", "[4, 4]"),
                "boundaries lists 4 twice",
            ),
            (set(&base, "chunks", "[16, 16, 0]"), "chunks lists 16 twice"),
            (set(&base, "name", "\"..\""), "one path component"),
            (set(&base, "temperature", "inf"), "finite and positive"),
            (set(&base, "temperature", "nan"), "finite and positive"),
            (
                set(&base, "max_new_tokens", "18446744073709551615"),
                "exceeds the limit",
            ),
            (
                set(&base, "batch_size", "1000000000"),
                "batch_size = 1000000000",
            ),
        ] {
            refused(load, &dir, &text, needle);
        }
    }

    #[test]
    fn a_divergence_run_past_the_models_positions_is_refused_before_writing() {
        let dir = common::scratch("integrity", "divergence-positions");
        let model = common::chat_fixture(&dir.join("model"), 96);
        let text = set(
            &set(
                &set(
                    &divergence_base(),
                    "model",
                    &format!("{:?}", model.display().to_string()),
                ),
                "dtypes",
                "[\"fp32\"]",
            ),
            "layers",
            "[\"all\"]",
        );
        let spec = write(&dir, "spec.toml", &text);
        let out = dir.join("out");
        let (code, _, err) = common::kvcredit(&[
            "divergence",
            "run",
            spec.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--quiet",
        ]);
        assert_eq!(code, 2, "{err}");
        assert!(
            err.contains("context: divergence `divergence-cpu-smollm2` (problem")
                && err.contains("but the model has 96"),
            "{err}"
        );
        assert!(!out.join("manifest.json").exists());
    }
}

// ---------------------------------------------------------------------------------------
// One process per run folder.

mod lock {
    use super::common;
    use kvcredit::study::{LOCK, lock_run};

    #[test]
    fn a_second_process_on_a_locked_run_folder_refuses_naming_the_holder() {
        let dir = common::scratch("integrity", "lock-held");
        let out = dir.join("run");
        let held = lock_run(&out).unwrap();
        let pid = std::process::id().to_string();
        // In this process too: a second lock of the same folder is refused.
        let e = lock_run(&out).unwrap_err().to_string();
        assert!(e.contains(&format!("pid {pid}")), "{e}");
        let spec = dir.join("spec.toml");
        std::fs::write(&spec, common::tiny_campaign_spec("locked", 1)).unwrap();
        let (code, _, err) = common::kvcredit(&[
            "campaign",
            "run",
            spec.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--quiet",
        ]);
        assert_eq!(code, 2, "{err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains("in use by another kvcredit process") && err.contains(&pid),
            "{err}"
        );
        assert!(!out.join("manifest.json").exists());
        // Released on drop: the folder can be locked again.
        drop(held);
        drop(lock_run(&out).unwrap());
    }

    #[test]
    fn a_stale_lock_is_taken_over_and_leftover_temporaries_removed() {
        let dir = common::scratch("integrity", "lock-stale");
        // The lock file of a process that has exited (its lock died with it), and the
        // temporary files an interrupted write left behind.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        std::fs::write(dir.join(LOCK), format!("{dead}\n")).unwrap();
        let tmps = [
            format!(".manifest.json.tmp-{dead}"),
            format!(".estimates.parquet.tmp-{dead}"),
        ];
        for t in &tmps {
            std::fs::write(dir.join(t), b"partial").unwrap();
        }
        std::fs::write(dir.join("keep.tmp-notes"), b"not ours").unwrap();
        let held = lock_run(&dir).unwrap();
        let holder = std::fs::read_to_string(dir.join(LOCK)).unwrap();
        assert_eq!(holder.trim(), std::process::id().to_string());
        for t in &tmps {
            assert!(!dir.join(t).exists(), "{t} left");
        }
        assert!(dir.join("keep.tmp-notes").exists());
        drop(held);
    }
}
