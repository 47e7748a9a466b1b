//! The run arguments every command shares, in two stages (after ripgrep's `lowargs` →
//! `hiargs`): [`RunArgs`] holds them as typed, [`RunArgs::resolve`] (and its variants for spec
//! and bench commands) turns them once into a validated [`RunConfig`] — device, dtype, the
//! execution policy with its tiles, and the engine — that the command then passes on. Nothing
//! below the CLI reads these settings from the environment.
use anyhow::bail;
use kvcredit::decode::engine::EngineMode;
use kvcredit::exec::glue::Glue;
use kvcredit::registry::RegistryPaths;
use kvcredit::runtime::{self, Dtype};
use kvcredit::sampling::Sampler;
use kvcredit::{ExecPolicy, ExecSettings, PolicyKind};
use tch::Device;

/// `--dtype`, `--device`, `--policy`, `--tiles`, `--engine`, as typed.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct RunArgs {
    /// Weights/activations dtype (default: the spec's, else the command's: bf16 for bench,
    /// fp32 otherwise).
    #[arg(long, value_enum)]
    pub dtype: Option<Dtype>,
    /// cpu, cuda or cuda:N (default: the spec's, else cpu).
    #[arg(long)]
    pub device: Option<String>,
    /// Execution policy: stock or batch_invariant (default: the spec's, else the command's;
    /// bench takes a comma-separated list).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub policy: Vec<PolicyKind>,
    /// Batch-invariant tile overrides over the device's defaults, e.g.
    /// `gemm_rows=64,key_chunk=256` (keys: gemm_rows, norm_rows, query_tile, key_chunk, units, and kernels=aten|fused; fused, the CUDA default, runs the NVRTC kernels).
    /// Default: the environment variable KVCREDIT_BI_TILES, if set. Recorded in manifests.
    #[arg(long)]
    pub tiles: Option<String>,
    /// Continuation engine: auto, eager, static or graph (default: KVCREDIT_ENGINE, else auto:
    /// graph on CUDA when available, else eager; bench takes a comma-separated list).
    /// Recorded in manifests.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub engine: Vec<EngineMode>,
}

/// Where and how a run executes, resolved.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The device.
    pub device: Device,
    /// The device as given (`cpu`, `cuda`, `cuda:N`), for manifests and reports.
    pub device_name: String,
    /// Weights/activations dtype.
    pub dtype: Dtype,
    /// Execution policy with its tiles.
    pub policy: ExecPolicy,
    /// Tiles (of the batch-invariant policy) and engine.
    pub exec: ExecSettings,
}

/// A command's own defaults.
pub struct Defaults {
    /// Dtype when `--dtype` is absent.
    pub dtype: Dtype,
    /// Policy when `--policy` is absent.
    pub policy: PolicyKind,
}

/// Where registry models are cached and which Python pulls them, read once from the
/// environment: `KVCREDIT_HOME` (else `$HOME/.cache/kvcredit`) and `KVCREDIT_PYTHON`.
pub fn registry_paths() -> RegistryPaths {
    RegistryPaths::from_vars(
        std::env::var_os("KVCREDIT_HOME"),
        std::env::var_os("HOME"),
        std::env::var_os("KVCREDIT_PYTHON"),
    )
}

/// An `aten|fused` choice from the environment variable `var` (read through `env`); an unknown
/// name is a spec error naming the variable.
fn env_choice<T>(
    env: &dyn Fn(&str) -> Option<String>,
    var: &str,
    what: &str,
    parse: fn(&str) -> kvcredit::Result<T>,
) -> anyhow::Result<Option<T>> {
    let Some(s) = env(var) else {
        return Ok(None);
    };
    let choice = parse(s.trim())
        .map_err(|_| kvcredit::Error::Spec(format!("{var}=`{s}`: not a {what} (aten, fused)")))?;
    Ok(Some(choice))
}

/// The only value of a flag that takes one here.
fn one<T: Copy>(v: &[T], flag: &str) -> anyhow::Result<Option<T>> {
    match v {
        [] => Ok(None),
        [x] => Ok(Some(*x)),
        _ => bail!("--{flag} takes one value here"),
    }
}

impl RunArgs {
    /// Device (`--device`, else `default`) and tiles/engine, with `engine` in place of
    /// `--engine` when given.
    fn place(
        &self,
        default_device: &str,
        engine: Option<EngineMode>,
    ) -> anyhow::Result<(Device, String, ExecSettings)> {
        let name = self
            .device
            .clone()
            .unwrap_or_else(|| default_device.to_string());
        let device = runtime::parse_device(&name)?;
        let env = |name: &str| std::env::var(name).ok().filter(|s| !s.trim().is_empty());
        let tiles = self.tiles.clone().or_else(|| env("KVCREDIT_BI_TILES"));
        let engine = match (engine, env("KVCREDIT_ENGINE")) {
            (Some(e), _) => Some(e),
            (None, Some(s)) => Some(
                <EngineMode as clap::ValueEnum>::from_str(s.trim(), true).map_err(|_| {
                    kvcredit::Error::Spec(format!(
                        "KVCREDIT_ENGINE=`{s}`: not an engine (auto, eager, static, graph)"
                    ))
                })?,
            ),
            (None, None) => None,
        };
        let sampler = env_choice(&env, "KVCREDIT_SAMPLER", "sampler", Sampler::parse)?;
        let glue = env_choice(&env, "KVCREDIT_GLUE", "glue", Glue::parse)?;
        let exec = ExecSettings::resolve(device, tiles.as_deref(), engine, sampler, glue)?;
        Ok((device, name, exec))
    }

    /// The configuration of a command that runs one model in one setting.
    pub fn resolve(&self, d: Defaults) -> anyhow::Result<RunConfig> {
        let engine = one(&self.engine, "engine")?;
        let kind = one(&self.policy, "policy")?.unwrap_or(d.policy);
        let (device, device_name, exec) = self.place("cpu", engine)?;
        Ok(RunConfig {
            device,
            device_name,
            dtype: self.dtype.unwrap_or(d.dtype),
            policy: exec.policy(kind),
            exec,
        })
    }

    /// The configuration of a spec's run (`what`: the command, for messages): dtype and policy
    /// are the spec's (`--dtype`/`--policy` are refused), the device the spec's unless
    /// `--device` overrides it.
    pub fn resolve_spec(
        &self,
        what: &str,
        device: &str,
        dtype: Dtype,
        policy: PolicyKind,
    ) -> anyhow::Result<RunConfig> {
        if self.dtype.is_some() || !self.policy.is_empty() {
            bail!(
                "{what}: dtype and policy come from the spec; edit it instead of passing --dtype/--policy"
            );
        }
        let engine = one(&self.engine, "engine")?;
        let (device, device_name, exec) = self.place(device, engine)?;
        Ok(RunConfig {
            device,
            device_name,
            dtype,
            policy: exec.policy(policy),
            exec,
        })
    }

    /// Bench's configuration: the policies (`--policy`, else `policies`) and the engines
    /// (`--engine`, else `engines(device)`) to measure; `exec.engine` is the first engine.
    pub fn resolve_bench(
        &self,
        dtype: Dtype,
        policies: &[PolicyKind],
        engines: impl Fn(Device) -> Vec<EngineMode>,
    ) -> anyhow::Result<(RunConfig, Vec<PolicyKind>, Vec<EngineMode>)> {
        let (device, device_name, exec) = self.place("cpu", None)?;
        // `auto` stands for the engine resolved once (KVCREDIT_ENGINE included).
        let engines = if self.engine.is_empty() {
            engines(device)
        } else {
            self.engine.clone()
        }
        .into_iter()
        .map(|e| {
            if e == EngineMode::Auto {
                exec.engine
            } else {
                e
            }
        })
        .collect();
        let policies = if self.policy.is_empty() {
            policies.to_vec()
        } else {
            self.policy.clone()
        };
        let cfg = RunConfig {
            device,
            device_name,
            dtype: self.dtype.unwrap_or(dtype),
            policy: exec.policy(policies[0]),
            exec,
        };
        Ok((cfg, policies, engines))
    }
}
