//! Static layering rules over `src/`, read from the source text: no import cycle between
//! modules. Each rule is checked on the crate and, as a negative control, on a synthetic input
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
            let rel = path
                .strip_prefix(root)
                .expect("under src/")
                .with_extension("");
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
                module,
                is_dir_module,
                code: strip_comments_and_strings(&text),
            });
        }
    }
    out.sort_by(|a, b| a.module.cmp(&b.module));
    out
}

/// The text with `//` and `/* */` comments removed and string and char literals emptied, so a
/// path in a doc link or an error message is not read as an import.
fn strip_comments_and_strings(src: &str) -> String {
    static RE: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(
            r##"(?s)//[^\n]*|/\*.*?\*/|r#+".*?"#+|r"[^"]*"|b?"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])'"##,
        )
        .expect("valid regex")
    });
    RE.replace_all(src, |c: &regex::Captures| {
        if c[0].starts_with('/') {
            " ".to_string()
        } else {
            "\"\"".to_string()
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

/// The graph between top-level modules (`credit::spec -> io::schema` is `credit -> io`).
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
            format!(
                "{} modules {{{}}}, e.g. {}",
                scc.len(),
                scc.join(", "),
                cycle.join(" -> ")
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
