//! Static layering rules over `src/`, read from the source text: no import cycle between
//! modules; top-level modules in layers, each importing only its own layer or lower ones (test
//! code aside); no function over a length limit; no environment reads or process globals below
//! the CLI. Each rule is checked on the crate and, as a negative control, on a synthetic input
//! that breaks it.
//!
//! The module graph has one node per file (`src/credit/spec.rs` is `credit::spec`,
//! `src/exec/mod.rs` is `exec`) and an edge for every `crate::`, `super::` or `self::` path a file
//! names outside comments and string literals: `use` trees, and inline paths. A path that ends at
//! a name a `mod.rs` re-exports from a submodule (`pub use spec::CampaignSpec`) points at that
//! submodule. A `mod.rs` naming its own submodules is not an edge (it declares them).
use regex::Regex;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::LazyLock;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// One source file: its module path and its text with comments and literals blanked out.
struct SourceFile {
    /// Path under `src/` (`credit/spec.rs`).
    path: String,
    module: Vec<String>,
    /// `src/x/mod.rs` (its `self::` is `x`, not `x`'s parent).
    is_dir_module: bool,
    code: String,
}

/// Every `.rs` file under `src/`, except the crate roots (`lib.rs`, `main.rs`).
fn source_files(root: &Path) -> Vec<SourceFile> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("src/ is readable") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel_path = path.strip_prefix(root).expect("under src/");
            let rel = rel_path.with_extension("");
            let mut module: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            let is_dir_module = module.last().is_some_and(|m| m == "mod");
            if is_dir_module {
                module.pop();
            }
            if module == ["lib"] || module == ["main"] {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("source is UTF-8");
            out.push(SourceFile {
                path: rel_path.to_string_lossy().into_owned(),
                module,
                is_dir_module,
                code: strip_comments_and_strings(&text),
            });
        }
    }
    out.sort_by(|a, b| a.module.cmp(&b.module));
    out
}

/// The text with `//` and `/* */` comments removed and string and char literals emptied (line
/// breaks kept), so a path in a doc link or an error message is not read as an import and a
/// brace in a literal does not end a function.
fn strip_comments_and_strings(src: &str) -> String {
    static RE: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(
            r##"(?s)//[^\n]*|/\*.*?\*/|r#+".*?"#+|r"[^"]*"|b?"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])'"##,
        )
        .expect("valid regex")
    });
    RE.replace_all(src, |c: &regex::Captures| {
        let lines = "\n".repeat(c[0].matches('\n').count());
        if c[0].starts_with('/') {
            format!(" {lines}")
        } else {
            format!("\"\"{lines}")
        }
    })
    .into_owned()
}

/// Every path named by a `use` item (its tree expanded) or inline, starting with `crate`,
/// `super` or `self`.
fn named_paths(code: &str) -> Vec<Vec<String>> {
    static USE: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"\buse\s+([^;]*);").expect("valid regex"));
    static INLINE: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"\b(?:crate|super|self)(?:\s*::\s*[A-Za-z_][A-Za-z0-9_]*)+").expect("regex")
    });
    let mut paths = Vec::new();
    for u in USE.captures_iter(code) {
        expand_use_tree(&[], &u[1], &mut paths);
    }
    let without_uses = USE.replace_all(code, ";");
    for m in INLINE.find_iter(&without_uses) {
        paths.push(
            m.as_str()
                .split("::")
                .map(|s| s.trim().to_string())
                .collect(),
        );
    }
    paths.retain(|p| {
        matches!(
            p.first().map(String::as_str),
            Some("crate" | "super" | "self")
        )
    });
    paths
}

/// Expands `a::{b, c::{d, e as f}}` under `prefix` into full paths (aliases dropped).
fn expand_use_tree(prefix: &[String], tree: &str, out: &mut Vec<Vec<String>>) {
    let mut depth = 0;
    let mut start = 0;
    let mut parts = Vec::new();
    for (i, ch) in tree.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&tree[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&tree[start..]);
    for part in parts.into_iter().map(str::trim).filter(|p| !p.is_empty()) {
        let mut path = prefix.to_vec();
        if let Some(open) = part.find('{') {
            let close = part.rfind('}').unwrap_or(part.len());
            path.extend(segments(&part[..open]));
            expand_use_tree(&path, &part[open + 1..close], out);
        } else {
            let name = part.split(" as ").next().unwrap_or(part);
            path.extend(segments(name));
            out.push(path);
        }
    }
}

fn segments(s: &str) -> Vec<String> {
    s.split("::")
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// A path named in `file`, as absolute module segments (without `crate`).
fn absolute(file: &SourceFile, path: &[String]) -> Vec<String> {
    let mut base: Vec<String> = match path[0].as_str() {
        "crate" => Vec::new(),
        "self" if file.is_dir_module => file.module.clone(),
        _ => file.module[..file.module.len().saturating_sub(1)].to_vec(),
    };
    let mut rest = &path[1..];
    while rest.first().is_some_and(|s| s == "super") {
        base.pop();
        rest = &rest[1..];
    }
    base.extend(rest.iter().cloned());
    base
}

/// The module graph of `files`.
fn module_graph(files: &[SourceFile]) -> Graph {
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| f.module.clone()).collect();
    // Names each directory module re-exports from inside itself: (module, name) -> target.
    let mut reexports: BTreeMap<(Vec<String>, String), Vec<String>> = BTreeMap::new();
    static PUB_USE: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"\bpub\s+use\s+([^;]*);").expect("valid regex"));
    for f in files.iter().filter(|f| f.is_dir_module) {
        for u in PUB_USE.captures_iter(&f.code) {
            let mut paths = Vec::new();
            expand_use_tree(&[], &u[1], &mut paths);
            for p in paths {
                let p = match p[0].as_str() {
                    "crate" | "super" | "self" => absolute(f, &p),
                    _ => f.module.iter().cloned().chain(p.iter().cloned()).collect(),
                };
                let (Some(name), Some(target)) = (p.last(), longest_module(&modules, &p)) else {
                    continue;
                };
                if target.starts_with(&f.module) && target != f.module {
                    reexports.insert((f.module.clone(), name.clone()), target);
                }
            }
        }
    }
    let mut graph = Graph::new();
    for f in files {
        let from = f.module.join("::");
        let targets = graph.entry(from.clone()).or_default();
        for path in named_paths(&f.code) {
            let abs = absolute(f, &path);
            let Some(mut target) = longest_module(&modules, &abs) else {
                continue;
            };
            // Follow re-exports: `crate::credit::CampaignSpec` is `credit::spec`.
            while let Some(next) = abs
                .get(target.len())
                .and_then(|n| reexports.get(&(target.clone(), n.clone())))
            {
                target = next.clone();
            }
            let declares_child = target.len() > f.module.len() && target.starts_with(&f.module);
            if target != f.module && !declares_child {
                targets.insert(target.join("::"));
            }
        }
    }
    graph
}

fn longest_module(modules: &BTreeSet<Vec<String>>, path: &[String]) -> Option<Vec<String>> {
    (1..=path.len())
        .rev()
        .map(|k| path[..k].to_vec())
        .find(|p| modules.contains(p))
}

/// The graph between top-level modules (`credit::records -> io::parquet` is `credit -> io`).
fn top_level(graph: &Graph) -> Graph {
    let top = |m: &str| m.split("::").next().unwrap_or(m).to_string();
    let mut out = Graph::new();
    for (from, tos) in graph {
        let entry = out.entry(top(from)).or_default();
        entry.extend(tos.iter().map(|t| top(t)).filter(|t| *t != top(from)));
    }
    out
}

/// One cycle (`a -> b -> a`) through each strongly connected component of more than one
/// module, sorted.
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    let mut found: Vec<Vec<String>> = strongly_connected(graph)
        .iter()
        .map(|scc| cycle_through(graph, &scc.iter().collect(), &scc[0]))
        .collect();
    found.sort();
    found
}

/// Components of two or more mutually reachable nodes, each sorted (reachability from every
/// node: the graphs here have a few hundred nodes).
fn strongly_connected(graph: &Graph) -> Vec<Vec<String>> {
    let reach = |from: &String| {
        let mut seen: BTreeSet<&String> = BTreeSet::new();
        let mut stack = vec![from];
        while let Some(v) = stack.pop() {
            for w in graph.get(v).into_iter().flatten() {
                if seen.insert(w) {
                    stack.push(w);
                }
            }
        }
        seen
    };
    let reachable: BTreeMap<&String, BTreeSet<&String>> =
        graph.keys().map(|v| (v, reach(v))).collect();
    let mut out: Vec<Vec<String>> = Vec::new();
    for (v, from_v) in &reachable {
        if !from_v.contains(v) || out.iter().any(|c| c.contains(v)) {
            continue;
        }
        let comp = from_v
            .iter()
            .filter(|w| reachable.get(**w).is_some_and(|r| r.contains(v)))
            .map(|w| (*w).clone())
            .collect();
        out.push(comp);
    }
    out
}

/// A shortest cycle from `start` back to itself inside `members` (breadth-first).
fn cycle_through(graph: &Graph, members: &BTreeSet<&String>, start: &String) -> Vec<String> {
    let mut prev: BTreeMap<&String, &String> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for w in graph
            .get(v)
            .into_iter()
            .flatten()
            .filter(|w| members.contains(w))
        {
            if w == start {
                let mut path = vec![start.clone()];
                let mut at = v;
                while at != start {
                    path.push(at.clone());
                    at = prev[at];
                }
                path.push(start.clone());
                path.reverse();
                return path;
            }
            if !prev.contains_key(w) {
                prev.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    unreachable!("a strongly connected component holds a cycle through each member")
}

fn crate_graph() -> Graph {
    module_graph(&source_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
    ))
}

/// Each component of mutually importing modules: its members, and one cycle through them.
fn describe(graph: &Graph) -> String {
    strongly_connected(graph)
        .iter()
        .map(|scc| {
            let cycle = cycle_through(graph, &scc.iter().collect(), &scc[0]);
            let edges: Vec<String> = scc
                .iter()
                .map(|m| {
                    let inside: Vec<&str> = graph[m]
                        .iter()
                        .filter(|t| scc.contains(t))
                        .map(String::as_str)
                        .collect();
                    format!("    {m} -> {}", inside.join(", "))
                })
                .collect();
            format!(
                "{} modules, e.g. {}; their imports of each other:\n{}",
                scc.len(),
                cycle.join(" -> "),
                edges.join("\n")
            )
        })
        .collect::<Vec<_>>()
        .join("\n  ")
}

#[test]
fn no_import_cycle_between_modules() {
    let graph = crate_graph();
    assert!(
        graph.len() > 100,
        "read {} modules: is src/ where the test looks?",
        graph.len()
    );
    assert!(
        graph["credit::campaign"].contains("decode::engine"),
        "edges are read"
    );
    assert!(
        cycles(&graph).is_empty(),
        "import cycles between modules:\n  {}",
        describe(&graph)
    );
}

/// Synthetic sources with a cycle through a re-export, a `super::` path and a grouped `use`,
/// plus paths in comments and strings that must not count.
#[test]
fn cycle_finder_reports_a_synthetic_cycle() {
    let file = |module: &str, is_dir_module: bool, text: &str| SourceFile {
        path: format!("{}.rs", module.replace("::", "/")),
        module: module.split("::").map(String::from).collect(),
        is_dir_module,
        code: strip_comments_and_strings(text),
    };
    let files = vec![
        file(
            "a",
            true,
            "mod spec;\npub use spec::Spec;\nuse crate::c::Thing;",
        ),
        file(
            "a::spec",
            false,
            "use crate::{io::{schema::Row, parquet}, z};",
        ),
        file(
            "a::records",
            false,
            "use super::spec::Spec;\n// crate::c::x\nfn f() { \"crate::z\"; }",
        ),
        file("io", true, ""),
        file(
            "io::schema",
            false,
            "pub fn f() -> crate::a::Spec { todo!() }",
        ),
        file("io::parquet", false, ""),
        file("c", false, "/* use crate::a; */"),
        file("z", false, ""),
    ];
    let graph = module_graph(&files);
    assert_eq!(
        graph["a::spec"],
        BTreeSet::from(["io::schema".into(), "io::parquet".into(), "z".into()])
    );
    assert_eq!(graph["a::records"], BTreeSet::from(["a::spec".into()]));
    assert_eq!(
        graph["a"],
        BTreeSet::from(["c".into()]),
        "declaring a child is no edge"
    );
    assert!(
        graph["c"].is_empty() && graph["z"].is_empty(),
        "comments and strings are skipped"
    );
    assert_eq!(
        cycles(&graph),
        vec![vec![
            "a::spec".to_string(),
            "io::schema".into(),
            "a::spec".into()
        ]],
        "the re-exported Spec resolves to a::spec, closing the cycle"
    );
    let top = top_level(&graph);
    assert_eq!(
        cycles(&top),
        vec![vec!["a".to_string(), "io".into(), "a".into()]]
    );

    let acyclic = Graph::from([
        ("x".to_string(), BTreeSet::from(["y".to_string()])),
        ("y".to_string(), BTreeSet::from(["z".to_string()])),
    ]);
    assert!(cycles(&acyclic).is_empty());
}

/// The top-level modules (`src/<name>/` or `src/<name>.rs`) by layer, low to high. A module
/// imports modules of its own layer or lower ones, never a higher one, and no two top-level
/// modules import each other, directly or through others (test code aside).
const LAYERS: [(&str, &[&str]); 7] = [
    (
        "foundation",
        &[
            "error",
            "config",
            "gguf",
            "tokenizer",
            "nvrtc",
            "cuda_graph",
            "profile",
            "stats",
        ],
    ),
    ("core", &["kv_cache", "exec", "model", "sampling"]),
    ("decode", &["decode", "generate"]),
    (
        "study runtime and io",
        &[
            "io", "registry", "chat", "tasks", "runtime", "study", "report",
        ],
    ),
    (
        "studies, their analyses and reports",
        &[
            "credit",
            "divergence",
            "spectrum",
            "eval",
            "analysis",
            "check",
            "seed",
        ],
    ),
    ("bench", &["bench"]),
    ("cli", &["cli"]),
];

/// Imports between top-level modules that break the layering, each with where it is and where
/// the named item belongs. The list only shrinks: an import that is gone must leave it.
const LAYERING_PENDING: [(&str, &str, &str); 0] = [];

/// The files without their test code (`*tests.rs` files, `#[cfg(test)] mod` blocks): what the
/// library itself is built from.
fn library_code(files: Vec<SourceFile>) -> Vec<SourceFile> {
    static TEST_MOD: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{").expect("regex"));
    files
        .into_iter()
        .filter(|f| !f.path.ends_with("tests.rs"))
        .map(|mut f| {
            if let Some(m) = TEST_MOD.find(&f.code) {
                f.code.truncate(m.start());
            }
            f
        })
        .collect()
}

/// The layering as the failure message prints it: one line per layer, low to high.
fn layering_text(layers: &[(&str, &[&str])]) -> String {
    layers
        .iter()
        .enumerate()
        .map(|(i, (name, modules))| format!("  {i} {name}: {}", modules.join(", ")))
        .collect::<Vec<_>>()
        .join("\n")
}

/// What breaks the layering in `top` (the graph between top-level modules), with the `pending`
/// imports set aside: modules in no layer (and layer entries that are no module), imports of a
/// higher layer, cycles, and pending imports that are gone.
fn layering_violations(
    top: &Graph,
    layers: &[(&str, &[&str])],
    pending: &[(&str, &str, &str)],
) -> Vec<String> {
    let layer_of: BTreeMap<&str, usize> = layers
        .iter()
        .enumerate()
        .flat_map(|(i, (_, ms))| ms.iter().map(move |m| (*m, i)))
        .collect();
    let mut out = Vec::new();
    for m in top.keys().filter(|m| !layer_of.contains_key(m.as_str())) {
        out.push(format!("module `{m}` is in no layer: add it to LAYERS"));
    }
    for m in layer_of.keys().filter(|m| !top.contains_key(**m)) {
        out.push(format!("LAYERS names `{m}`, which is no module"));
    }
    let set_aside: BTreeSet<(&str, &str)> = pending.iter().map(|(a, b, _)| (*a, *b)).collect();
    for (a, b) in &set_aside {
        if !top.get(*a).is_some_and(|tos| tos.contains(*b)) {
            out.push(format!(
                "`{a}` no longer imports `{b}`: remove it from LAYERING_PENDING"
            ));
        }
    }
    let mut kept = Graph::new();
    for (from, tos) in top {
        let entry = kept.entry(from.clone()).or_default();
        for to in tos {
            if set_aside.contains(&(from.as_str(), to.as_str())) {
                continue;
            }
            entry.insert(to.clone());
            if let (Some(&i), Some(&j)) = (layer_of.get(from.as_str()), layer_of.get(to.as_str()))
                && j > i
            {
                out.push(format!(
                    "`{from}` ({}) imports `{to}` ({}), a higher layer",
                    layers[i].0, layers[j].0
                ));
            }
        }
    }
    out.extend(
        cycles(&kept)
            .iter()
            .map(|c| format!("import cycle: {}", c.join(" -> "))),
    );
    out
}

#[test]
fn top_level_modules_follow_the_layering() {
    let files = library_code(source_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
    ));
    let top = top_level(&module_graph(&files));
    assert!(top.len() > 25, "read {} top-level modules", top.len());
    assert!(top["credit"].contains("decode"), "edges are read");
    let bad = layering_violations(&top, &LAYERS, &LAYERING_PENDING);
    assert!(
        bad.is_empty(),
        "the top-level modules break the layering (low to high):\n{}\n\n  {}",
        layering_text(&LAYERS),
        bad.join("\n  ")
    );
}

/// A synthetic graph with an import of a higher layer, a cycle inside one layer, a module in
/// no layer, a layer entry that is no module, and a pending import that is gone: each is
/// reported. The same graph with those fixed passes.
#[test]
fn layering_check_flags_a_synthetic_graph() {
    let graph = |edges: &[(&str, &str)], nodes: &[&str]| {
        let mut g = Graph::new();
        for n in nodes {
            g.entry(n.to_string()).or_default();
        }
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    let layers: [(&str, &[&str]); 3] = [
        ("low", &["config", "gguf", "tokenizer"]),
        ("core", &["exec", "model", "gone"]),
        ("high", &["cli"]),
    ];
    let bad = graph(
        &[
            ("gguf", "tokenizer"),
            ("tokenizer", "gguf"),
            ("exec", "cli"),
            ("model", "exec"),
            ("stray", "config"),
        ],
        &["config", "cli"],
    );
    let pending = [("model", "config", "moved already")];
    assert_eq!(
        layering_violations(&bad, &layers, &pending),
        vec![
            "module `stray` is in no layer: add it to LAYERS".to_string(),
            "LAYERS names `gone`, which is no module".into(),
            "`model` no longer imports `config`: remove it from LAYERING_PENDING".into(),
            "`exec` (core) imports `cli` (high), a higher layer".into(),
            "import cycle: gguf -> tokenizer -> gguf".into(),
        ]
    );
    let layers: [(&str, &[&str]); 3] = [
        ("low", &["config", "gguf", "tokenizer"]),
        ("core", &["exec", "model"]),
        ("high", &["cli"]),
    ];
    let good = graph(
        &[
            ("tokenizer", "gguf"),
            ("cli", "exec"),
            ("model", "exec"),
            ("model", "config"),
        ],
        &["config", "cli", "gguf"],
    );
    assert_eq!(
        layering_violations(&good, &layers, &pending),
        Vec::<String>::new()
    );
    let cyclic = graph(
        &[
            ("tokenizer", "gguf"),
            ("gguf", "tokenizer"),
            ("model", "config"),
        ],
        &["config", "cli", "exec"],
    );
    assert_eq!(
        layering_violations(&cyclic, &layers, &[("gguf", "tokenizer", "set aside")]),
        Vec::<String>::new(),
        "a pending import is set aside"
    );
}

/// The top-level modules the library builds without feature `studies` (`make check-core`):
/// the core and what it needs.
const CORE: [&str; 14] = [
    "config",
    "cuda_graph",
    "decode",
    "error",
    "exec",
    "generate",
    "gguf",
    "kv_cache",
    "model",
    "nvrtc",
    "profile",
    "sampling",
    "stats",
    "tokenizer",
];

/// Crates only the studies use (their Rust names), optional behind feature `studies`.
const STUDY_CRATES: [&str; 6] = [
    "arrow_array",
    "arrow_schema",
    "indicatif",
    "parquet",
    "plotters",
    "polars",
];

/// Why the core would not build without feature `studies`, read statically: a core file that
/// names a study crate or imports a module outside the core, a `pub mod` in `lib.rs` gated
/// otherwise than as [`CORE`] says, or a study crate in `Cargo.toml` that is not an optional
/// dependency of `studies`.
fn core_violations(
    files: &[SourceFile],
    lib_rs: &str,
    cargo_toml: &str,
    core: &[&str],
) -> Vec<String> {
    static CRATE_PATH: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(&format!(r"(?:^|[^:\w])({})\s*::", STUDY_CRATES.join("|"))).expect("regex")
    });
    static MOD: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r#"(?m)^(#\[cfg\(feature\s*=\s*""\)\]\s*)?pub mod (\w+);"#).expect("regex")
    });
    let mut out = Vec::new();
    let in_core = |m: &str| core.contains(&m.split("::").next().unwrap_or(m));
    for f in files.iter().filter(|f| in_core(&f.module[0])) {
        if let Some(c) = CRATE_PATH.captures(&f.code) {
            out.push(format!("{}: names the study crate `{}`", f.path, &c[1]));
        }
    }
    let top = top_level(&module_graph(files));
    for (from, tos) in top.iter().filter(|(m, _)| in_core(m)) {
        for to in tos.iter().filter(|t| !in_core(t)) {
            out.push(format!(
                "core module `{from}` imports `{to}`, outside the core"
            ));
        }
    }
    for c in MOD.captures_iter(&strip_comments_and_strings(lib_rs)) {
        match (c.get(1).is_some(), in_core(&c[2])) {
            (true, true) => out.push(format!("lib.rs gates core module `{}`", &c[2])),
            (false, false) => out.push(format!(
                "lib.rs builds `{}` without feature `studies`",
                &c[2]
            )),
            _ => {}
        }
    }
    let studies = cargo_toml
        .lines()
        .find(|l| l.starts_with("studies = ["))
        .unwrap_or("");
    for name in STUDY_CRATES.map(|c| c.replace('_', "-")) {
        let Some(dep) = cargo_toml
            .lines()
            .find(|l| l.starts_with(&format!("{name} = ")))
        else {
            continue;
        };
        if !dep.contains("optional = true") || !studies.contains(&format!("\"dep:{name}\"")) {
            out.push(format!(
                "Cargo.toml: `{name}` is not an optional dependency of feature `studies`"
            ));
        }
    }
    out
}

#[test]
fn the_core_builds_without_the_study_crates() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = library_code(source_files(&root.join("src")));
    let read = |p: &str| std::fs::read_to_string(root.join(p)).expect("readable");
    assert!(
        files
            .iter()
            .filter(|f| CORE.contains(&f.module[0].as_str()))
            .count()
            > 20,
        "core files are read"
    );
    let bad = core_violations(&files, &read("src/lib.rs"), &read("Cargo.toml"), &CORE);
    assert!(
        bad.is_empty(),
        "the core ({}) must build without feature `studies`:\n  {}",
        CORE.join(", "),
        bad.join("\n  ")
    );
}

/// Synthetic sources: a core file naming `parquet::` (and one naming only a module called
/// `parquet` inside the crate, which is fine), a core file importing a study module, `lib.rs`
/// gating a core module and not gating a study one, and a study crate that is not optional.
#[test]
fn core_check_flags_synthetic_study_crates_and_imports() {
    let file = |path: &str, module: &str, text: &str| SourceFile {
        path: path.into(),
        module: module.split("::").map(String::from).collect(),
        is_dir_module: false,
        code: strip_comments_and_strings(text),
    };
    let files = [
        file(
            "exec/write.rs",
            "exec::write",
            "fn f() { let w = parquet::arrow::ArrowWriter::try_new(); }",
        ),
        file(
            "model.rs",
            "model",
            "use crate::io::parquet::Table; // plotters::x\nfn g() { \"indicatif::Bar\"; }",
        ),
        file("io/parquet.rs", "io::parquet", "use parquet::file;"),
    ];
    let lib_rs = "pub mod model;\n#[cfg(feature = \"studies\")]\npub mod exec;\npub mod io;\n";
    let cargo = "[dependencies]\nparquet = { version = \"60\", optional = true }\nplotters = \"0.3\"\n\n[features]\nstudies = [\"dep:parquet\"]\n";
    assert_eq!(
        core_violations(&files, lib_rs, cargo, &["exec", "model"]),
        vec![
            "exec/write.rs: names the study crate `parquet`".to_string(),
            "core module `model` imports `io`, outside the core".into(),
            "lib.rs gates core module `exec`".into(),
            "lib.rs builds `io` without feature `studies`".into(),
            "Cargo.toml: `plotters` is not an optional dependency of feature `studies`".into(),
        ]
    );
    let lib_rs = "pub mod exec;\npub mod model;\n#[cfg(feature = \"studies\")]\npub mod io;\n";
    let cargo = "parquet = { version = \"60\", optional = true }\nstudies = [\"dep:parquet\"]\n";
    assert_eq!(
        core_violations(&files[2..], lib_rs, cargo, &["exec", "model"]),
        Vec::<String>::new()
    );
}

/// Functions longer than this many lines (signature to closing brace) are split into named
/// helpers.
const MAX_FN_LINES: usize = 150;

/// Functions still over [`MAX_FN_LINES`], by file and name. The list only shrinks: a function
/// split below the limit must leave it, and no other function may join it.
const OVER_LIMIT: [(&str, &str); 0] = [];

/// Every function with a body outside test modules (`#[cfg(test)] mod` blocks, `*_tests.rs`,
/// `tests.rs`): (file, name, lines from `fn` to the closing brace).
fn function_lengths(files: &[SourceFile]) -> Vec<(String, String, usize)> {
    static TEST_MOD: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{").expect("regex"));
    static FN: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"\bfn\s+(\w+)").expect("regex"));
    let mut out = Vec::new();
    for f in files {
        if f.path.ends_with("_tests.rs") || f.path.ends_with("tests.rs") {
            continue;
        }
        let code = f.code.as_bytes();
        let tests: Vec<(usize, usize)> = TEST_MOD
            .find_iter(&f.code)
            .map(|m| (m.start(), matching_brace(code, m.end() - 1)))
            .collect();
        for m in FN.captures_iter(&f.code) {
            let at = m.get(0).expect("match").start();
            if tests.iter().any(|&(a, b)| (a..b).contains(&at)) {
                continue;
            }
            // The body opens at the first `{` outside the signature's brackets; a `;` first
            // means a declaration without a body.
            let mut depth = 0i32;
            let Some(open) = (at..code.len()).find(|&i| {
                match code[i] {
                    b'(' | b'[' | b'<' => depth += 1,
                    b')' | b']' => depth -= 1,
                    b'>' if code[i - 1] != b'-' && code[i - 1] != b'=' => depth -= 1,
                    b'{' | b';' if depth <= 0 => return true,
                    _ => {}
                }
                false
            }) else {
                continue;
            };
            if code[open] == b';' {
                continue;
            }
            let close = matching_brace(code, open);
            let line = |i: usize| code[..i].iter().filter(|&&b| b == b'\n').count();
            out.push((f.path.clone(), m[1].to_string(), line(close) - line(at) + 1));
        }
    }
    out
}

/// The index just past the `}` matching the `{` at `open`.
fn matching_brace(code: &[u8], open: usize) -> usize {
    let mut depth = 0;
    for (i, &b) in code.iter().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// Functions over the limit that are not listed, and listed ones that are no longer over it.
fn length_violations(
    lengths: &[(String, String, usize)],
    listed: &[(&str, &str)],
) -> (Vec<String>, Vec<String>) {
    let over: BTreeSet<(&str, &str)> = lengths
        .iter()
        .filter(|(_, _, n)| *n > MAX_FN_LINES)
        .map(|(f, name, _)| (f.as_str(), name.as_str()))
        .collect();
    let listed: BTreeSet<(&str, &str)> = listed.iter().copied().collect();
    let new = lengths
        .iter()
        .filter(|(f, name, n)| *n > MAX_FN_LINES && !listed.contains(&(f.as_str(), name.as_str())))
        .map(|(f, name, n)| format!("{f}: fn {name} ({n} lines)"))
        .collect();
    let fixed = listed
        .difference(&over)
        .map(|(f, name)| format!("{f}: fn {name}"))
        .collect();
    (new, fixed)
}

#[test]
fn no_new_function_over_150_lines() {
    let files = source_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let lengths = function_lengths(&files);
    assert!(lengths.len() > 1000, "read {} functions", lengths.len());
    let (new, fixed) = length_violations(&lengths, &OVER_LIMIT);
    assert!(
        new.is_empty(),
        "functions over {MAX_FN_LINES} lines (split them into named helpers):\n  {}",
        new.join("\n  ")
    );
    assert!(
        fixed.is_empty(),
        "no longer over {MAX_FN_LINES} lines: remove from OVER_LIMIT:\n  {}",
        fixed.join("\n  ")
    );
}

/// A synthetic file: a long function (braces in strings, comments and a nested block inside),
/// a short one, a declaration without a body, and a long function in a test module.
#[test]
fn function_length_check_flags_a_synthetic_long_function() {
    let body = "    let x = 1;\n".repeat(MAX_FN_LINES);
    let text = format!(
        "pub fn long<T: Into<u8>>(a: T) -> Result<(), ()>\nwhere T: Copy\n{{\n    let s = \"}}\"; // }}\n    if true {{ /* {{ */ }}\n{body}}}\n\
         fn short() -> u8 {{\n    2\n}}\ntrait X {{ fn decl(&self); }}\n\
         #[cfg(test)]\nmod tests {{\n    fn long_test() {{\n{body}    }}\n}}\n"
    );
    let files = [SourceFile {
        path: "synthetic.rs".into(),
        module: vec!["synthetic".into()],
        is_dir_module: false,
        code: strip_comments_and_strings(&text),
    }];
    let lengths = function_lengths(&files);
    let names: Vec<(&str, usize)> = lengths.iter().map(|(_, n, l)| (n.as_str(), *l)).collect();
    assert_eq!(names, vec![("long", MAX_FN_LINES + 6), ("short", 3)]);
    let (new, fixed) = length_violations(&lengths, &[("synthetic.rs", "short")]);
    assert_eq!(
        new,
        vec![format!(
            "synthetic.rs: fn long ({} lines)",
            MAX_FN_LINES + 6
        )]
    );
    assert_eq!(fixed, vec!["synthetic.rs: fn short".to_string()]);
}

/// Files below the CLI that still read the environment, each with what it reads. The list only
/// shrinks: a file that stops reading must leave it.
const ENV_READS_PENDING: [(&str, &str); 0] = [];

/// Process-wide or thread-local state below the CLI that is not a run setting.
const GLOBALS_NOT_SETTINGS: [(&str, &str); 2] = [
    (
        "io/mod.rs",
        "CONTAINED: whether a panic is being contained, for the panic filter",
    ),
    ("registry.rs", "COUNTER: unique names of temporary files"),
];

/// Run settings still held in process globals with thread-local overrides (filled from
/// `ExecSettings` by the CLI). The list only shrinks.
const SETTING_GLOBALS_PENDING: [(&str, &str); 0] = [];

/// Non-test files (outside `cli/` and `main.rs`) that read the environment, and those that hold
/// an atomic `static` or a `thread_local!`.
fn env_and_globals(files: &[SourceFile]) -> (BTreeSet<String>, BTreeSet<String>) {
    static ENV: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"\benv\s*::\s*var(?:_os|s|s_os)?\s*\(").expect("regex"));
    static GLOBAL: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"\bstatic\s+\w+\s*:\s*(?:std::sync::atomic::)?Atomic|\bthread_local!")
            .expect("regex")
    });
    static TEST_MOD: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{").expect("regex"));
    let (mut env, mut globals) = (BTreeSet::new(), BTreeSet::new());
    for f in files {
        if f.path.starts_with("cli/") || f.path.ends_with("tests.rs") {
            continue;
        }
        let code = TEST_MOD
            .find(&f.code)
            .map_or(f.code.as_str(), |m| &f.code[..m.start()]);
        if ENV.is_match(code) {
            env.insert(f.path.clone());
        }
        if GLOBAL.is_match(code) {
            globals.insert(f.path.clone());
        }
    }
    (env, globals)
}

#[test]
fn settings_come_as_values_not_from_environment_or_globals() {
    let files = source_files(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let (env, globals) = env_and_globals(&files);
    let pending: BTreeSet<String> = ENV_READS_PENDING
        .iter()
        .map(|(f, _)| f.to_string())
        .collect();
    assert_eq!(
        env, pending,
        "environment read below the CLI (resolve it in src/cli/)"
    );
    let known: BTreeSet<String> = GLOBALS_NOT_SETTINGS
        .iter()
        .chain(&SETTING_GLOBALS_PENDING)
        .map(|(f, _)| f.to_string())
        .collect();
    assert_eq!(
        globals, known,
        "a process or thread-local global below the CLI"
    );
}

#[test]
fn environment_and_global_check_flags_a_synthetic_file() {
    let file = |path: &str, text: &str| SourceFile {
        path: path.into(),
        module: vec![path.trim_end_matches(".rs").replace('/', "::")],
        is_dir_module: false,
        code: strip_comments_and_strings(text),
    };
    let files = [
        file(
            "exec/mod.rs",
            "fn f() { let v = std::env::var(\"KVCREDIT_X\"); }",
        ),
        file("model.rs", "static N: AtomicU8 = AtomicU8::new(0);"),
        file(
            "kv.rs",
            "thread_local! { static C: Cell<u8> = Cell::new(0); }",
        ),
        file("cli/run_args.rs", "fn g() { std::env::var_os(\"HOME\"); }"),
        file(
            "ok.rs",
            "// std::env::var(\"X\") in a comment\nfn h() { \"thread_local!\"; }",
        ),
        file(
            "t.rs",
            "#[cfg(test)]\nmod tests { fn t() { std::env::var(\"X\"); } }",
        ),
    ];
    let (env, globals) = env_and_globals(&files);
    assert_eq!(env, BTreeSet::from(["exec/mod.rs".to_string()]));
    assert_eq!(
        globals,
        BTreeSet::from(["kv.rs".to_string(), "model.rs".to_string()])
    );
}
