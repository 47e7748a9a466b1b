//! `kvcredit spectrum …`: SpectrumKV evaluations (perplexity, NIAH, probe) from a spec, and
//! the two workers of a real tiered transfer (`serve`, `send`).
use super::run_args::{Defaults, RunArgs, RunConfig, registry_paths};
use anyhow::{Context, bail};
use kvcredit::PolicyKind;
use kvcredit::decode::engine::EngineMode;
use kvcredit::io::parquet::{Column, Table};
use kvcredit::runtime::{self, Dtype, LoadedModel, ModelSource};
use kvcredit::spectrum::allocate::{Policy, Protect};
use kvcredit::spectrum::eval::{self, TextNorm, Variant};
use kvcredit::spectrum::grid::{self, GridRun};
use kvcredit::spectrum::importance::ImportanceSpec;
use kvcredit::spectrum::spec::SpectrumSpec;
use kvcredit::spectrum::transport::{self, ServeOptions};
use kvcredit::spectrum::{Quantizer, wire};
use kvcredit::study::progress::outputs_line;
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(clap::Subcommand)]
pub enum Cmd {
    /// WikiText-2 perplexity with the context KV compressed (the spec's [ppl] section).
    Ppl(SpecArgs),
    /// Single-needle NIAH grid (the spec's [niah] section).
    Niah(SpecArgs),
    /// The INT4 probe (3 NIAH trials at b = 0.3) and the continuous gate ([probe] section).
    Probe(SpecArgs),
    /// Decode worker: receive tiered KV frames over TCP and decode from them.
    Serve(ServeArgs),
    /// Prefill worker: prefill a WikiText context, compress, send; TTFT by stage vs FP16.
    Send(SendArgs),
    /// Markdown report over run folders (one per model): PPL Δ% with t-intervals, NIAH with
    /// Wilson intervals, probe verdicts, TTFT stage medians; figures as PNG and SVG.
    Report(ReportArgs),
}

#[derive(clap::Args)]
pub struct ReportArgs {
    /// Run folders (one per model) holding ppl.rows.jsonl / niah.rows.jsonl / probe*.parquet /
    /// ttft*.parquet.
    #[arg(required = true)]
    dirs: Vec<PathBuf>,
    /// Output folder of report.md and the figures.
    #[arg(long, default_value = "runs/spectrum-report")]
    out: PathBuf,
}

#[derive(clap::Args)]
pub struct SpecArgs {
    /// Spec file (see experiments/spectrum-*.toml).
    spec: PathBuf,
    /// Output folder (default: runs/<name>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// `--device` overrides the spec's; `--tiles` (recorded in the grids' manifests; dtype and policy
    /// are the spec's).
    #[command(flatten)]
    run: RunArgs,
    /// Hide progress bars.
    #[arg(long)]
    quiet: bool,
}

#[derive(clap::Args)]
pub struct WorkerModel {
    /// Model: registry name, GGUF file or Hugging Face folder.
    #[arg(long)]
    model: String,
    /// Dtype (default fp32), device, policy (default stock), tiles.
    #[command(flatten)]
    run: RunArgs,
}

impl WorkerModel {
    fn load(&self) -> anyhow::Result<(LoadedModel, RunConfig)> {
        let cfg = self.run.resolve(Defaults {
            dtype: Dtype::Fp32,
            policy: PolicyKind::Stock,
        })?;
        let mut model = runtime::load(
            &ModelSource::resolve(&self.model, &registry_paths())?,
            cfg.dtype,
            cfg.device,
        )?;
        model.decoder.set_glue(cfg.exec.glue);
        Ok((model, cfg))
    }
}

#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: WorkerModel,
    /// Address to listen on (loopback by default; another address needs --allow-remote).
    #[arg(long, default_value = "127.0.0.1:7070")]
    bind: String,
    /// Allow a --bind address other than loopback. The protocol has no authentication: anyone
    /// who reaches the port can make the worker decode.
    #[arg(long)]
    allow_remote: bool,
    /// Largest accepted frame, MiB (at most 65536).
    #[arg(long, default_value_t = 1024)]
    max_frame_mib: u64,
    /// Exit after this many requests.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Drop a connection that sends nothing for this many seconds.
    #[arg(long, default_value_t = 30)]
    read_timeout_s: u64,
    /// Refuse a request whose bytes have not all arrived this many seconds after its first.
    #[arg(long, default_value_t = 120)]
    request_timeout_s: u64,
    /// Most connections open at once (one more is refused with an error reply).
    #[arg(long, default_value_t = 16)]
    max_connections: usize,
}

/// Largest `--max-frame-mib`: 64 GiB.
const MAX_FRAME_MIB: u64 = 1 << 16;

/// The worker's settings from its flags, refused (before the model loads) when a limit is
/// out of range, a timeout is zero, or `--bind` is not loopback without `--allow-remote`.
fn serve_options(a: &ServeArgs, policy: kvcredit::ExecPolicy) -> anyhow::Result<ServeOptions> {
    if a.max_frame_mib == 0 || a.max_frame_mib > MAX_FRAME_MIB {
        anyhow::bail!(
            "--max-frame-mib {}: must lie in 1..={MAX_FRAME_MIB}",
            a.max_frame_mib
        );
    }
    for (flag, v) in [
        ("--read-timeout-s", a.read_timeout_s),
        ("--request-timeout-s", a.request_timeout_s),
    ] {
        if v == 0 {
            anyhow::bail!("{flag} 0: a timeout must be at least 1 second");
        }
    }
    if a.max_connections == 0 {
        anyhow::bail!("--max-connections 0: must be at least 1");
    }
    let addrs: Vec<std::net::SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(&a.bind)
        .with_context(|| format!("--bind {}", a.bind))?
        .collect();
    let remote: Vec<String> = addrs
        .iter()
        .filter(|x| !x.ip().is_loopback())
        .map(ToString::to_string)
        .collect();
    if !remote.is_empty() {
        if !a.allow_remote {
            anyhow::bail!(
                "--bind {}: {} is not a loopback address and the protocol has no authentication; pass --allow-remote to serve it anyway",
                a.bind,
                remote.join(", ")
            );
        }
        eprintln!(
            "warning: serving on {} beyond loopback: the protocol has no authentication, so anyone who reaches it can make this worker decode",
            remote.join(", ")
        );
    }
    let opts = ServeOptions {
        max_frame: a.max_frame_mib << 20,
        max_requests: a.max_requests,
        read_timeout: std::time::Duration::from_secs(a.read_timeout_s),
        request_timeout: std::time::Duration::from_secs(a.request_timeout_s),
        max_connections: a.max_connections,
        policy,
    };
    opts.check()?;
    Ok(opts)
}

#[derive(clap::Args)]
pub struct SendArgs {
    #[command(flatten)]
    model: WorkerModel,
    /// Decode worker address.
    #[arg(long, default_value = "127.0.0.1:7070")]
    connect: String,
    /// Prompt tokens (the first n of WikiText-2 test).
    #[arg(long, default_value_t = 1024)]
    context: usize,
    /// Tier policy.
    #[arg(long, default_value = "spectrum")]
    tier_policy: String,
    /// Budget b.
    #[arg(long, default_value_t = 0.5)]
    b: f64,
    /// Quantizer of the INT tiers.
    #[arg(long, value_enum, default_value_t = Quantizer::Kivi)]
    quantizer: Quantizer,
    /// WikiText-2 normalization before tokenization: `lf` (CRLF → LF) or `raw` (bytes kept).
    #[arg(long, value_enum, default_value_t = TextNorm::Lf)]
    text: TextNorm,
    /// Link limit in megabits per second (paced writes); unlimited if absent.
    #[arg(long)]
    bandwidth_mbps: Option<f64>,
    /// Measurements of each of the two transfers (the first is also a warm-up row).
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// TTFT rows (Parquet).
    #[arg(long, default_value = "runs/spectrum-ttft.parquet")]
    out: PathBuf,
}

pub fn run(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Ppl(a) => ppl(a),
        Cmd::Niah(a) => niah(a),
        Cmd::Probe(a) => probe(a),
        Cmd::Serve(a) => serve(a),
        Cmd::Send(a) => send(a),
        Cmd::Report(a) => {
            let r = kvcredit::spectrum::report::write_report(&a.dirs, &a.out)?;
            println!("report: {}", r.path.display());
            for f in &r.figures {
                println!("figure: {}", f.display());
            }
            Ok(())
        }
    }
}

/// Spec, its hash, loaded model, output folder and the resolved run configuration.
struct Setup {
    spec: SpectrumSpec,
    sha: String,
    model: LoadedModel,
    out: PathBuf,
    cfg: RunConfig,
}

fn setup(a: &SpecArgs) -> anyhow::Result<Setup> {
    let (mut spec, sha) = SpectrumSpec::load(&a.spec)?;
    let cfg = a
        .run
        .resolve_spec("spectrum", &spec.device, spec.dtype, spec.policy)?;
    spec.device = cfg.device_name.clone();
    let mut model = runtime::load(
        &ModelSource::resolve(&spec.model, &registry_paths())?,
        cfg.dtype,
        cfg.device,
    )?;
    model.decoder.set_glue(cfg.exec.glue);
    spec.check_positions(&model.decoder)?;
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("runs").join(&spec.name));
    Ok(Setup {
        spec,
        sha,
        model,
        out,
        cfg,
    })
}

impl Setup {
    /// The grid's run settings; the engine is `eager` (the grids step the decoder themselves).
    fn grid(&self, quiet: bool) -> GridRun<'_> {
        GridRun {
            spec: &self.spec,
            spec_sha256: &self.sha,
            model: &self.model,
            dtype: self.cfg.dtype,
            policy: self.cfg.policy,
            exec: self
                .cfg
                .exec
                .record(self.spec.policy, Some(EngineMode::Eager)),
            out: &self.out,
            quiet,
        }
    }
}

fn ppl(a: SpecArgs) -> anyhow::Result<()> {
    let s = setup(&a)?;
    let (rows, o, path) = grid::ppl(&s.grid(a.quiet))?;
    println!(
        "{} n={} m={} windows={} importance {} (sinks {}, recent {})",
        s.model.name,
        o.context,
        o.continuation,
        o.windows,
        o.importance.describe(),
        o.protect.sinks,
        o.protect.recent
    );
    println!(
        "{:<15} {:<10} {:>5} {:>7} {:>9} {:>9} {:>8} {:>9}",
        "policy", "quantizer", "b", "b_real", "ppl", "ppl_base", "Δ%", "KL"
    );
    for v in &o.variants {
        let mine: Vec<&eval::PplRow> = rows
            .iter()
            .filter(|r| {
                r.policy == v.policy.name() && r.quantizer == v.quantizer_name() && r.b == v.b
            })
            .collect();
        let (ppl, base, delta, kl, b_real) = eval::ppl_summary(&mine);
        println!(
            "{:<15} {:<10} {:>5} {:>7.4} {:>9.3} {:>9.3} {:>+8.2} {:>9.5}",
            v.policy.name(),
            v.quantizer_name(),
            v.b.map_or("-".into(), |b| format!("{b}")),
            b_real,
            ppl,
            base,
            delta,
            kl
        );
    }
    println!("rows: {}", path.display());
    println!("{}", outputs_line(&s.out));
    Ok(())
}

fn niah(a: SpecArgs) -> anyhow::Result<()> {
    let s = setup(&a)?;
    let (rows, path) = grid::niah(&s.grid(a.quiet))?;
    let n = s
        .spec
        .niah
        .as_ref()
        .context("the spec has no [niah] section")?;
    println!(
        "{} NIAH ~{} tokens, {} depths × {} seeds",
        s.model.name, n.context, n.depths, n.seeds
    );
    let mut keys: Vec<(String, String, Option<f64>)> = Vec::new();
    for r in &rows {
        let k = (r.policy.clone(), r.quantizer.clone(), r.b);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    for (p, q, b) in keys {
        let mine: Vec<_> = rows
            .iter()
            .filter(|r| r.policy == p && r.quantizer == q && r.b == b)
            .collect();
        let ok = mine.iter().filter(|r| r.correct).count();
        println!(
            "{p:<15} {q:<10} b={:<5} {ok}/{} = {:.1}%",
            b.map_or("-".into(), |b| format!("{b}")),
            mine.len(),
            100.0 * ok as f64 / mine.len() as f64
        );
    }
    println!("rows: {}", path.display());
    println!("{}", outputs_line(&s.out));
    Ok(())
}

fn probe(a: SpecArgs) -> anyhow::Result<()> {
    let s = setup(&a)?;
    let (lines, path) = grid::probe(&s.grid(a.quiet))?;
    for line in lines {
        println!("{line}");
    }
    println!("rows: {}", path.display());
    println!("{}", outputs_line(&s.out));
    Ok(())
}

fn serve(a: ServeArgs) -> anyhow::Result<()> {
    // Flags are checked before the model loads (its policy is filled in after).
    let mut opts = serve_options(&a, kvcredit::ExecPolicy::Stock)?;
    let (model, cfg) = a.model.load()?;
    opts.policy = cfg.policy;
    let listener = TcpListener::bind(&a.bind).with_context(|| format!("bind {}", a.bind))?;
    eprintln!(
        "spectrum decode worker: {} on {}",
        model.name,
        listener.local_addr()?
    );
    transport::serve(&model.decoder, &listener, &opts, &mut |line: &str| {
        eprintln!("{line}")
    })?;
    Ok(())
}

/// One transfer's TTFT stages.
struct Ttft {
    what: String,
    repeat: usize,
    b_real: f64,
    bytes: usize,
    prefill: Duration,
    scoring: Duration,
    pack: Duration,
    reply: transport::Reply,
    total: Duration,
}

fn send(a: SendArgs) -> anyhow::Result<()> {
    let (model, cfg) = a.model.load()?;
    kvcredit::study::bounds::check_positions(
        &model.decoder,
        a.context.saturating_add(1),
        &format!("--context {} + 1 decode step", a.context),
    )?;
    let policy = Policy::parse(&a.tier_policy)?;
    let ids = eval::wikitext_ids(&model, a.context, a.text)?;
    let (ctx, last) = ids.split_at(ids.len() - 1);
    let tiered = Variant {
        policy,
        quantizer: a.quantizer,
        b: policy.uses_budget().then_some(a.b),
    };
    let fp16 = Variant {
        policy: Policy::Uniform(kvcredit::spectrum::Tier::Fp16),
        quantizer: a.quantizer,
        b: None,
    };
    // The FP16 transfer sends every token at 16 bits: nothing to protect or score.
    let none = Protect {
        sinks: 0,
        recent: 0,
    };
    let spec = ImportanceSpec::default();
    let d = &model.decoder;
    let mut stream =
        TcpStream::connect(&a.connect).with_context(|| format!("connect {}", a.connect))?;
    stream.set_nodelay(true)?;
    let mut rows = Vec::new();
    for repeat in 0..a.repeats.max(1) {
        for (what, v, protect) in [
            ("tiered", &tiered, Protect::default()),
            ("fp16", &fp16, none),
        ] {
            let t0 = Instant::now();
            let pre = eval::prefill_and_score(d, ctx, &cfg.policy, &spec)?;
            let scoring = if what == "fp16" {
                Duration::ZERO
            } else {
                pre.scoring
            };
            let c = eval::compress(&pre, v, protect)?;
            let sent_at = Instant::now();
            let reply = transport::request(&mut stream, &c.frame, last[0], 1, a.bandwidth_mbps)?;
            // The FP16 transfer needs no scores: its TTFT leaves the scoring out.
            let skipped = if what == "fp16" {
                pre.scoring
            } else {
                Duration::ZERO
            };
            let total = (sent_at - t0) - skipped + reply.round_trip;
            // The worker's first token is the one the same tiered cache gives in-process.
            let local = wire::decode(&c.frame)?;
            let (tokens, _, _, fp) = transport::decode_greedy(d, &local, last[0], 1, &cfg.policy)?;
            if tokens != reply.tokens || fp != reply.fingerprint {
                bail!(
                    "{what}: decode worker answered {:?}, in-process {:?} (KV fingerprints {})",
                    reply.tokens,
                    tokens,
                    if fp == reply.fingerprint {
                        "equal"
                    } else {
                        "differ"
                    }
                );
            }
            rows.push(Ttft {
                what: what.to_string(),
                repeat,
                b_real: c.real_b(),
                bytes: c.frame.len(),
                prefill: pre.prefill,
                scoring,
                pack: c.pack,
                reply,
                total,
            });
        }
    }
    write_ttft(&rows, &a, &model.name, &a.out)?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{} context {} tokens, {} {} b={} link {}",
        model.name,
        a.context,
        policy.name(),
        a.quantizer,
        a.b,
        a.bandwidth_mbps
            .map_or("unlimited".into(), |m| format!("{m} Mbit/s"))
    );
    println!(
        "{:<7} {:>3} {:>7} {:>11} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9}",
        "what",
        "rep",
        "b_real",
        "bytes",
        "prefill",
        "score",
        "pack",
        "send",
        "receive",
        "unpack",
        "step",
        "TTFT ms"
    );
    for r in &rows {
        println!(
            "{:<7} {:>3} {:>7.4} {:>11} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>9.1}",
            r.what,
            r.repeat,
            r.b_real,
            r.bytes,
            ms(r.prefill),
            ms(r.scoring),
            ms(r.pack),
            ms(r.reply.send),
            ms(r.reply.receive),
            ms(r.reply.unpack),
            ms(r.reply.first_step),
            ms(r.total)
        );
    }
    println!(
        "first tokens match the in-process tiered cache; rows: {}",
        a.out.display()
    );
    Ok(())
}

fn write_ttft(rows: &[Ttft], a: &SendArgs, model: &str, path: &Path) -> anyhow::Result<()> {
    let n = rows.len();
    let ms = |f: &dyn Fn(&Ttft) -> Duration| {
        Column::F64(rows.iter().map(|r| f(r).as_secs_f64() * 1e3).collect())
    };
    Table::new()
        .with("model", Column::Str(vec![model.to_string(); n]))
        .with(
            "transfer",
            Column::Str(rows.iter().map(|r| r.what.clone()).collect()),
        )
        .with("tier_policy", Column::Str(vec![a.tier_policy.clone(); n]))
        .with(
            "quantizer",
            Column::Str(vec![a.quantizer.name().to_string(); n]),
        )
        .with("b", Column::F64(vec![a.b; n]))
        .with(
            "b_real",
            Column::F64(rows.iter().map(|r| r.b_real).collect()),
        )
        .with(
            "bytes",
            Column::I64(rows.iter().map(|r| r.bytes as i64).collect()),
        )
        .with("context", Column::U32(vec![a.context as u32; n]))
        .with("text", Column::Str(vec![a.text.to_string(); n]))
        .with("bandwidth_mbps", Column::OptF64(vec![a.bandwidth_mbps; n]))
        .with(
            "repeat",
            Column::U32(rows.iter().map(|r| r.repeat as u32).collect()),
        )
        .with(
            "first_token",
            Column::I64(rows.iter().map(|r| r.reply.tokens[0]).collect()),
        )
        .with("prefill_ms", ms(&|r| r.prefill))
        .with("scoring_ms", ms(&|r| r.scoring))
        .with("pack_ms", ms(&|r| r.pack))
        .with("send_ms", ms(&|r| r.reply.send))
        .with("receive_ms", ms(&|r| r.reply.receive))
        .with("unpack_ms", ms(&|r| r.reply.unpack))
        .with("first_step_ms", ms(&|r| r.reply.first_step))
        .with("round_trip_ms", ms(&|r| r.reply.round_trip))
        .with("ttft_ms", ms(&|r| r.total))
        .write(path)?;
    Ok(())
}
