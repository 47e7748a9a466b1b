//! The mutation loop: seeded inputs, panics caught and classified by where they happened,
//! the largest single allocation of every input checked against a budget derived from the
//! input's length, and every error required to be one line.
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::Once;

/// SplitMix64: small, seedable, good enough to drive mutations.
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }
    /// The next 64 random bits.
    pub fn u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.u64() % n.max(1) as u64) as usize
    }
    /// True with probability `1/n`.
    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }
    /// A uniformly chosen element.
    pub fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// Global allocator that remembers, per thread, the largest single request since the last
/// [`reset_peak`] (requests above [`HARD_CAP`] are refused, so a claimed size of petabytes
/// aborts the run loudly instead of being served lazily by overcommit).
pub struct Tracking;

/// Larger single requests are refused outright.
pub const HARD_CAP: usize = 8 << 30;

thread_local! {
    static PEAK: Cell<usize> = const { Cell::new(0) };
    static FUZZING: Cell<bool> = const { Cell::new(false) };
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

fn note(n: usize) -> bool {
    let _ = PEAK.try_with(|p| {
        if n > p.get() {
            p.set(n)
        }
    });
    n <= HARD_CAP
}

// SAFETY: every call is forwarded unchanged to the system allocator (or refused with null,
// which callers must handle); the thread-local bookkeeping does not allocate.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        if !note(l.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc(l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        if !note(l.size()) {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if !note(new) {
            return std::ptr::null_mut();
        }
        unsafe { System.realloc(p, l, new) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}

fn reset_peak() {
    PEAK.with(|p| p.set(0));
}

fn peak() -> usize {
    PEAK.with(|p| p.get())
}

/// Route panics raised while a fuzz case runs on this thread into [`LAST_PANIC`] (location and
/// message) instead of stderr; other panics print as usual.
fn install_hook() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if FUZZING.with(|f| f.get()) {
                let loc = info
                    .location()
                    .map(|l| format!("{}:{}", l.file(), l.line()))
                    .unwrap_or_default();
                let msg = payload_text(info.payload());
                LAST_PANIC.with(|p| *p.borrow_mut() = Some(format!("{loc}: {msg}")));
            } else {
                prev(info)
            }
        }));
    });
}

fn payload_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

/// What one input did.
enum Outcome {
    Loaded,
    Refused,
    /// A failure: its signature (panic location, or the kind of violation) and detail.
    Failed(String, String),
}

/// Iterations of every target: `KVCREDIT_FUZZ_ITERS`, else the target's short-run default.
pub fn iterations(default: usize) -> usize {
    std::env::var("KVCREDIT_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The run seed: `KVCREDIT_FUZZ_SEED`, else the target's fixed one.
pub fn seed(default: u64) -> u64 {
    std::env::var("KVCREDIT_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// One fuzz target.
pub struct Target<'a> {
    /// Name (also the folder of its regression cases under `tests/fixtures/fuzz/`).
    pub name: &'a str,
    /// Unmutated inputs (each is also run as is).
    pub seeds: Vec<Vec<u8>>,
    /// Short-run iterations.
    pub default_iters: usize,
    /// Fixed seed of the short run.
    pub seed: u64,
    /// Largest single allocation allowed for an input of this many bytes.
    pub alloc_budget: fn(usize) -> usize,
}

/// `64 MiB + 32 × input`: room for de-quantizing the largest ratio (Q2_K expands 12×) and for
/// the parsers' working sets, far below what a forged size field would ask for.
pub fn default_budget(len: usize) -> usize {
    (64 << 20) + 32 * len
}

/// The regression cases of a target (`tests/fixtures/fuzz/<target>/*`), sorted.
pub fn regressions(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fuzz")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.retain(|p| p.is_file() && p.extension().is_none_or(|e| e != "md"));
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let b = std::fs::read(&p).expect("regression case readable");
            (p, b)
        })
        .collect()
}

fn run_one(run: &dyn Fn(&[u8]) -> Result<(), String>, input: &[u8], budget: usize) -> Outcome {
    LAST_PANIC.with(|p| p.borrow_mut().take());
    reset_peak();
    FUZZING.with(|f| f.set(true));
    let r = catch_unwind(AssertUnwindSafe(|| run(input)));
    FUZZING.with(|f| f.set(false));
    let peak = peak();
    let out = match r {
        Err(payload) => {
            let sig = LAST_PANIC
                .with(|p| p.borrow_mut().take())
                .unwrap_or_else(|| format!("panic: {}", payload_text(payload.as_ref())));
            let short = sig.lines().next().unwrap_or("").to_string();
            Outcome::Failed(format!("panic at {short}"), sig)
        }
        Ok(Ok(())) => Outcome::Loaded,
        Ok(Err(e)) if e.trim().is_empty() => Outcome::Failed("empty error".into(), e),
        Ok(Err(e)) if e.contains('\n') => Outcome::Failed(
            format!("multi-line error: {}", e.lines().next().unwrap_or("")),
            e,
        ),
        Ok(Err(e)) if e.contains("panicked") => Outcome::Failed("panic text in error".into(), e),
        Ok(Err(_)) => Outcome::Refused,
    };
    if peak > budget && !matches!(out, Outcome::Failed(..)) {
        return Outcome::Failed(
            "allocation over budget".into(),
            format!(
                "largest allocation {peak} bytes for a {}-byte input (budget {budget})",
                input.len()
            ),
        );
    }
    out
}

/// Counts of one run.
#[derive(Debug, Default)]
pub struct Report {
    /// Inputs tried (seeds, regression cases, mutants).
    pub tried: usize,
    /// Inputs that loaded.
    pub loaded: usize,
    /// Inputs refused with a one-line error.
    pub refused: usize,
    /// Distinct failures: signature → (saved input, detail).
    pub failures: BTreeMap<String, (PathBuf, String)>,
}

/// Makes one input from the random generator and the seeds.
pub type Mutator<'a> = dyn FnMut(&mut Rng, &[Vec<u8>]) -> Vec<u8> + 'a;

/// Run the seeds, the regression cases and `iterations` mutants of `target` through `run`
/// (`Ok` = loaded, `Err(line)` = refused). Panics at the end, listing every distinct failure
/// and where its input was saved, if any input panicked, gave a multi-line error or allocated
/// past the budget.
pub fn fuzz(
    target: &Target<'_>,
    mutate: &mut Mutator<'_>,
    run: &dyn Fn(&[u8]) -> Result<(), String>,
) -> Report {
    install_hook();
    let iters = iterations(target.default_iters);
    let mut rng = Rng::new(seed(target.seed));
    let mut report = Report::default();
    let out_dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("fuzz-failures")
        .join(target.name);
    let _ = std::fs::remove_dir_all(&out_dir);
    let trace = std::env::var_os("KVCREDIT_FUZZ_TRACE").is_some();
    let regress = regressions(target.name);
    let record = |input: &[u8], outcome: Outcome, report: &mut Report| {
        report.tried += 1;
        match outcome {
            Outcome::Loaded => report.loaded += 1,
            Outcome::Refused => report.refused += 1,
            Outcome::Failed(sig, detail) => {
                if !report.failures.contains_key(&sig) {
                    std::fs::create_dir_all(&out_dir).expect("failure dir");
                    let path = out_dir.join(format!("{:03}.bin", report.failures.len()));
                    std::fs::write(&path, input).expect("save failing input");
                    report.failures.insert(sig, (path, detail));
                }
            }
        }
    };
    let budget = |n: usize| (target.alloc_budget)(n);
    for s in &target.seeds {
        let o = run_one(run, s, budget(s.len()));
        record(s, o, &mut report);
    }
    for (_, r) in &regress {
        let o = run_one(run, r, budget(r.len()));
        record(r, o, &mut report);
    }
    for i in 0..iters {
        let input = mutate(&mut rng, &target.seeds);
        if trace {
            eprintln!("{} #{i}: {} bytes", target.name, input.len());
        }
        let o = run_one(run, &input, budget(input.len()));
        record(&input, o, &mut report);
    }
    let line = format!(
        "fuzz {}: {} inputs ({} seeds, {} regression cases, {iters} mutants): {} loaded, {} refused, {} distinct failures",
        target.name,
        report.tried,
        target.seeds.len(),
        regress.len(),
        report.loaded,
        report.refused,
        report.failures.len()
    );
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("KVCREDIT_FUZZ_REPORT") {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .expect("fuzz report file");
        writeln!(
            f,
            "{}",
            serde_json::json!({"target": target.name, "inputs": report.tried, "loaded": report.loaded,
                "refused": report.refused, "failures": report.failures.len(), "seed": seed(target.seed)})
        )
        .expect("write fuzz report");
    }
    if !report.failures.is_empty() {
        let list: Vec<String> = report
            .failures
            .iter()
            .map(|(sig, (p, d))| format!("  {sig}\n    input: {}\n    {d}", p.display()))
            .collect();
        panic!("{line}\n{}", list.join("\n"));
    }
    report
}

/// A scratch folder private to one target (cleared first).
pub fn scratch(target: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvcredit-fuzz-{target}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}
