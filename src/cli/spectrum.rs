//! `kvcredit spectrum …`: SpectrumKV evaluations (perplexity, NIAH, probe, TTFT) from a spec,
//! and the decode worker of a real tiered transfer (`serve`; `send` is the prefill side).
use super::run_args::{Defaults, RunArgs, RunConfig, registry_paths};
use anyhow::Context;
use kvcredit::PolicyKind;
use kvcredit::decode::engine::EngineMode;
use kvcredit::runtime::{self, Dtype, LoadedModel, ModelSource};
use kvcredit::spectrum::eval;
use kvcredit::spectrum::grid::{self, GridRun};
use kvcredit::spectrum::spec::SpectrumSpec;
use kvcredit::spectrum::transport::{self, ServeOptions};
use kvcredit::study::progress::outputs_line;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;

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
    /// Prefill worker: prefill a WikiText context, compress, send; TTFT by stage vs FP16 (the
    /// spec's [ttft] section).
    Send(SendArgs),
    /// Markdown report over run folders (one per model): PPL Δ% with t-intervals, NIAH with
    /// Wilson intervals, probe verdicts, TTFT stage medians; figures as PNG and SVG.
    Report(ReportArgs),
}

#[derive(clap::Args)]
pub struct ReportArgs {
    /// Run folders (one per model) holding ppl / niah / probe / ttft grids (or older
    /// ppl.rows.jsonl, niah.rows.jsonl, ttft*.parquet).
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
        model.decoder.use_settings(&cfg.exec);
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
    /// The spec (its [ttft] section), output folder, run settings.
    #[command(flatten)]
    spec: SpecArgs,
    /// Decode worker address.
    #[arg(long, default_value = "127.0.0.1:7070")]
    connect: String,
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
    model.decoder.use_settings(&cfg.exec);
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

fn send(a: SendArgs) -> anyhow::Result<()> {
    let s = setup(&a.spec)?;
    let t = s
        .spec
        .ttft
        .clone()
        .context("the spec has no [ttft] section")?;
    let mut stream =
        TcpStream::connect(&a.connect).with_context(|| format!("connect {}", a.connect))?;
    stream.set_nodelay(true)?;
    let (rows, path) = grid::ttft(&s.grid(a.spec.quiet), &mut stream)?;
    println!(
        "{} context {} tokens, {} {} b={}",
        s.model.name, t.context, t.policy, t.quantizer, t.b
    );
    println!(
        "{:<7} {:<10} {:>3} {:>7} {:>11} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9}",
        "what",
        "link",
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
            "{:<7} {:<10} {:>3} {:>7.4} {:>11} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>9.1}",
            r.transfer,
            r.bandwidth_mbps
                .map_or("unlimited".into(), |m| format!("{m} Mbit/s")),
            r.repeat,
            r.b_real,
            r.bytes,
            r.prefill_ms,
            r.scoring_ms,
            r.pack_ms,
            r.send_ms,
            r.receive_ms,
            r.unpack_ms,
            r.first_step_ms,
            r.ttft_ms
        );
    }
    println!("first tokens match the in-process decode of the same frames");
    println!("rows: {}", path.display());
    println!("{}", outputs_line(&s.out));
    Ok(())
}
