//! The header every study's manifest starts with ([`RunHeader`], flattened into it) and the
//! resume check it carries.
use crate::exec::ExecRecord;
use serde::{Deserialize, Serialize};

/// The header every study's manifest starts with (flattened into it): which study and spec
/// ran, on which model and numerical path, by which build, and when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunHeader {
    /// The study that wrote the run: `credit`, `divergence` or `spectrum` (absent in runs
    /// written before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub study: Option<String>,
    /// The spec's label; the `config` column of a campaign's tables.
    pub name: String,
    /// SHA-256 of the spec file's bytes, recorded before anything ran.
    pub spec_sha256: String,
    /// Model name.
    pub model: String,
    /// SHA-256 of the model file, when known.
    pub model_sha256: Option<String>,
    /// Run device.
    pub device: String,
    /// Execution policy, its tiles and the engine.
    #[serde(flatten)]
    pub exec: ExecRecord,
    /// libtorch's intra-op threads in a CPU run (`--threads`): the CPU's GEMMs and reductions
    /// split their sums by thread, so other counts give other low bits. Absent for GPU runs
    /// and for runs written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_threads: Option<i32>,
    /// kvcredit version.
    pub kvcredit_version: String,
    /// libtorch version the binary was built against.
    pub libtorch_version: String,
    /// When the run first started (UTC, RFC 3339).
    pub started_at: String,
    /// When each later invocation resumed it.
    #[serde(default)]
    pub resumed_at: Vec<String>,
    /// When it finished, if it has.
    pub finished_at: Option<String>,
}

/// What [`RunHeader::start`] records of the spec and the model.
#[derive(Debug, Clone, Copy)]
pub struct RunOrigin<'a> {
    /// `credit`, `divergence` or `spectrum`.
    pub study: &'a str,
    /// The spec's label.
    pub name: &'a str,
    /// SHA-256 of the spec file's bytes.
    pub spec_sha256: &'a str,
    /// Model name.
    pub model: &'a str,
    /// SHA-256 of the model file, when known.
    pub model_sha256: Option<&'a str>,
    /// Run device.
    pub device: &'a str,
}

impl RunHeader {
    /// The header of a run starting now.
    pub fn start(o: RunOrigin, exec: ExecRecord) -> RunHeader {
        RunHeader {
            study: Some(o.study.to_string()),
            name: o.name.to_string(),
            spec_sha256: o.spec_sha256.to_string(),
            model: o.model.to_string(),
            model_sha256: o.model_sha256.map(str::to_string),
            device: o.device.to_string(),
            exec,
            cpu_threads: cpu_threads(o.device),
            kvcredit_version: env!("CARGO_PKG_VERSION").to_string(),
            libtorch_version: env!("KVCREDIT_LIBTORCH_VERSION").to_string(),
            started_at: crate::io::UtcTime::now().rfc3339(),
            resumed_at: vec![],
            finished_at: None,
        }
    }

    /// Refuse, in one line, to resume the run in `out` with a spec of another hash, or a CPU
    /// run with another libtorch thread count than it started with.
    pub fn check_resume(&self, spec_sha256: &str, out: &std::path::Path) -> crate::Result<()> {
        if self.spec_sha256 != spec_sha256 {
            return Err(crate::Error::Spec(format!(
                "{} holds a run of a different spec (sha256 {}…, this spec {}…); use another --out",
                out.display(),
                &self.spec_sha256[..self.spec_sha256.len().min(12)],
                &spec_sha256[..spec_sha256.len().min(12)]
            )));
        }
        let now = cpu_threads(&self.device);
        if let (Some(was), Some(now)) = (self.cpu_threads, now)
            && was != now
        {
            return Err(crate::Error::Spec(format!(
                "{} was run with {was} libtorch threads and would resume with {now} (CPU sums split by thread, so other counts give other numbers); pass --threads {was} to resume",
                out.display()
            )));
        }
        Ok(())
    }
}

/// libtorch's intra-op thread count when `device` is the CPU (what a CPU run records and
/// resumes only with).
fn cpu_threads(device: &str) -> Option<i32> {
    (device == "cpu").then(tch::get_num_threads)
}
