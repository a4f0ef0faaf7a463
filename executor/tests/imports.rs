//! Imports go one way: api → daemon → sandbox/store/db → shim protocol and
//! sys. This test reads the crate's sources, builds the graph of which
//! top-level module names which (`crate::NAME`, `use crate::{NAME, ..}`),
//! and fails on any cycle, naming the modules in it and the edges that
//! close it. Test code (from the first `#[cfg(test)]` of a file on) and
//! comments do not count.
//!
//! Inside `daemon/` and `sandbox/` the same holds between files, and in
//! `daemon/` the floors hold too (docs/architecture.md): the steps at the
//! bottom (every file not listed below), the verbs above them, the drivers
//! (background loops that run verbs) on top. A file's edges there are the
//! names it uses (`super::x::Y`, `crate::daemon::Y`, resolved through
//! `mod.rs`'s re-exports to the file that defines `Y`) and the `Daemon`
//! (or `Sandbox`) methods it calls that one other file defines: those
//! types' methods are spread over the folder, so a call is a dependency
//! as much as an import is. A verb uses no other verb, a step no verb and
//! no driver, a driver no other driver. Names form no cycle; calls may go
//! both ways between two steps (the launch and the ready pool it draws
//! from). `mod.rs` is the composition root: it declares every part's
//! state, and its own edges do not count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The source without comments and without its tests.
fn code(src: &str) -> String {
    let src = src.find("#[cfg(test)]").map_or(src, |i| &src[..i]);
    let mut out = String::new();
    let mut rest = src;
    while !rest.is_empty() {
        let line = rest.find("//");
        let block = rest.find("/*");
        match (line, block) {
            (Some(l), b) if b.is_none_or(|b| l < b) => {
                // `"//"` in a string literal (a URL) would cut a line
                // short; that can only hide an edge inside that string.
                out.push_str(&rest[..l]);
                rest = rest[l..].find('\n').map_or("", |n| &rest[l + n..]);
            }
            (_, Some(b)) => {
                out.push_str(&rest[..b]);
                rest = rest[b..].find("*/").map_or("", |n| &rest[b + n + 2..]);
            }
            _ => {
                out.push_str(rest);
                rest = "";
            }
        }
    }
    out
}

fn ident(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The first segment of the path `after` begins (after `crate::`), or
/// of each top-level item of a group: `use crate::{a, b::{c, d}, e}`.
fn heads(after: &str) -> Vec<String> {
    let Some(group) = after.strip_prefix('{') else { return vec![ident(after).to_string()] };
    let mut found = Vec::new();
    let mut depth = 0;
    let mut start = true;
    for (j, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => start = true,
            c if start && (c.is_ascii_alphanumeric() || c == '_') => {
                found.push(ident(&group[j..]).to_string());
                start = false;
            }
            c if c.is_whitespace() => {}
            _ => start = false,
        }
    }
    found
}

/// The top-level modules `code` names.
fn names(code: &str) -> BTreeSet<String> {
    code.match_indices("crate::").flat_map(|(i, _)| heads(&code[i + "crate::".len()..])).collect()
}

fn graph() -> Graph {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &mut files);
    let mut g = Graph::new();
    for f in &files {
        let rel = f.strip_prefix(&root).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_str().unwrap();
        let module = first.trim_end_matches(".rs").to_string();
        if module == "lib" || module == "main" {
            continue;
        }
        let src = std::fs::read_to_string(f).unwrap();
        let deps = g.entry(module.clone()).or_default();
        deps.extend(names(&code(&src)).into_iter().filter(|d| *d != module));
    }
    let modules: BTreeSet<String> = g.keys().cloned().collect();
    for deps in g.values_mut() {
        deps.retain(|d| modules.contains(d));
    }
    g
}

/// `daemon/` files above the steps.
const VERBS: &[&str] = &[
    "checkpoint",
    "copy",
    "create",
    "diff",
    "exec",
    "export",
    "fork",
    "images",
    "limits",
    "lineages",
    "logs",
    "network",
    "pause",
    "processes",
    "publish",
    "pull",
    "results",
    "resume",
    "rollback",
    "snapshot_rm",
    "suspend",
];
const DRIVERS: &[&str] = &["host", "lifetime", "metrics", "retention"];

/// The names `code` reaches through `prefix` (`super::`, `crate::daemon::`):
/// the first segment of each path, or of each item of a group.
fn reached(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (i, _) in code.match_indices(prefix) {
        let before = code[..i].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        found.extend(heads(&code[i + prefix.len()..]));
    }
    found
}

/// The methods each file of a folder defines on `ty` (`impl ty {`).
fn methods(files: &BTreeMap<String, String>, ty: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (f, code) in files {
        let mut rest = code.as_str();
        while let Some(i) = rest.find(&format!("impl {ty} {{")).or_else(|| rest.find(&format!("::{ty} {{"))) {
            rest = &rest[i..];
            let end = rest.find("\n}").unwrap_or(rest.len());
            for line in rest[..end].lines() {
                let t = line.trim_start_matches("    ");
                let t = t.strip_prefix("pub ").or_else(|| t.strip_prefix("pub(crate) ")).unwrap_or(t);
                if line.starts_with("    ") && !line.starts_with("     ") {
                    if let Some(n) = t.strip_prefix("fn ") {
                        out.entry(ident(n).to_string()).or_default().insert(f.clone());
                    }
                }
            }
            rest = &rest[end..];
        }
    }
    out
}

/// `dir`'s files (a subfolder counts as its file) and, per file, the
/// other files it uses, each with why (the names and `.calls()`).
fn file_graph(dir: &str, ty: &str) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(dir);
    let mut paths = Vec::new();
    sources(&root, &mut paths);
    let mut files: BTreeMap<String, String> = BTreeMap::new();
    for p in &paths {
        let rel = p.strip_prefix(&root).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_str().unwrap();
        let f = first.trim_end_matches(".rs").to_string();
        files.entry(f).or_default().push_str(&code(&std::fs::read_to_string(p).unwrap()));
    }
    // `pub use x::{A, B}` in mod.rs: A and B are x's.
    let mut owner: BTreeMap<String, String> = BTreeMap::new();
    for stmt in files["mod"].split(';') {
        let Some(u) = stmt.trim().strip_prefix("pub use ").or_else(|| stmt.trim().strip_prefix("pub(crate) use "))
        else {
            continue;
        };
        let (from, items) = u.split_once("::").unwrap_or((u, ""));
        for item in items.trim_matches(|c| c == '{' || c == '}').split(',') {
            owner.insert(item.trim().to_string(), from.to_string());
        }
    }
    let methods = methods(&files, ty);
    let mut g = BTreeMap::new();
    for (f, code) in &files {
        let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let via = if f == "mod" { "self::" } else { "super::" };
        let mut used = reached(code, via);
        used.extend(reached(code, &format!("crate::{dir}::")));
        for n in used {
            let to = if files.contains_key(&n) { n.clone() } else { owner.get(&n).cloned().unwrap_or("mod".into()) };
            edges.entry(to).or_default().insert(n);
        }
        for recv in ["self.", "d.", "daemon.", "this."] {
            for (i, _) in code.match_indices(recv) {
                if code[..i].chars().next_back().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.') {
                    continue;
                }
                let name = ident(&code[i + recv.len()..]);
                if !code[i + recv.len() + name.len()..].starts_with('(') {
                    continue;
                }
                if let Some(defs) = methods.get(name).filter(|d| d.len() == 1) {
                    let to = defs.iter().next().unwrap();
                    edges.entry(to.clone()).or_default().insert(format!(".{name}()"));
                }
            }
        }
        edges.remove(f);
        g.insert(f.clone(), edges);
    }
    g
}

/// What breaks the rules in a folder's file graph: name cycles, and in
/// `daemon/` floor violations.
fn file_faults(dir: &str, g: &BTreeMap<String, BTreeMap<String, BTreeSet<String>>>) -> Vec<String> {
    let mut faults = Vec::new();
    let is_name = |why: &BTreeSet<String>| why.iter().any(|w| !w.starts_with('.'));
    let mut names = Graph::new();
    for (f, edges) in g {
        let deps = names.entry(f.clone()).or_default();
        if f != "mod" {
            deps.extend(edges.iter().filter(|(_, w)| is_name(w)).map(|(t, _)| t.clone()));
        }
    }
    for comp in cycles(&names) {
        faults.push(format!("{dir}/: files {} name each other in a cycle", comp.join(", ")));
    }
    if dir == "daemon" {
        let floor = |f: &str| {
            if VERBS.contains(&f) {
                1
            } else if DRIVERS.contains(&f) {
                2
            } else {
                0
            }
        };
        for (f, edges) in g.iter().filter(|(f, _)| *f != "mod") {
            for (t, why) in edges.iter().filter(|(t, _)| *t != "mod") {
                let (a, b) = (floor(f), floor(t));
                if b > a || (b == a && a > 0) {
                    let what = ["step", "verb", "driver"];
                    faults.push(format!("daemon/{f}.rs ({}) uses {t}.rs ({}): {why:?}", what[a], what[b]));
                }
            }
        }
    }
    faults
}

#[test]
fn files_inside_daemon_and_sandbox_keep_their_floors() {
    let mut faults = Vec::new();
    for (dir, ty) in [("daemon", "Daemon"), ("sandbox", "Sandbox")] {
        let g = file_graph(dir, ty);
        assert!(g.len() > 10 && !g["mod"].is_empty(), "{dir}/ was not read");
        faults.extend(file_faults(dir, &g));
    }
    for v in VERBS.iter().chain(DRIVERS) {
        assert!(
            Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("src/daemon/{v}.rs")).is_file(),
            "{v} is listed but daemon/{v}.rs is gone"
        );
    }
    assert!(faults.is_empty(), "floors broken:\n{}", faults.join("\n"));
}

#[test]
fn the_file_check_sees_a_verb_calling_a_verb_and_a_step_naming_a_driver() {
    let one = |code: &str| code.to_string();
    let files: BTreeMap<String, String> = [
        ("resume".to_string(), one("impl Daemon {\n    pub fn resume(&self) {}\n}\n")),
        ("fork".to_string(), one("impl Daemon {\n    fn fork(&self) { self.resume(); }\n}\n")),
    ]
    .into();
    let m = methods(&files, "Daemon");
    assert_eq!(m["resume"], BTreeSet::from(["resume".to_string()]));
    let mut g = BTreeMap::new();
    g.insert("mod".to_string(), BTreeMap::new());
    g.insert("fork".to_string(), BTreeMap::from([("resume".to_string(), BTreeSet::from([".resume()".to_string()]))]));
    g.insert("resume".to_string(), BTreeMap::new());
    g.insert("launch".to_string(), BTreeMap::from([("host".to_string(), BTreeSet::from(["host".to_string()]))]));
    g.insert("host".to_string(), BTreeMap::new());
    let faults = file_faults("daemon", &g);
    assert_eq!(faults.len(), 2, "{faults:?}");
    assert!(faults[0].contains("fork.rs (verb) uses resume.rs (verb)"), "{faults:?}");
    assert!(faults[1].contains("launch.rs (step) uses host.rs (driver)"), "{faults:?}");
    // Two files naming each other is a cycle; two steps calling each
    // other is not.
    let mut g = BTreeMap::new();
    g.insert("mod".to_string(), BTreeMap::new());
    g.insert("a".to_string(), BTreeMap::from([("b".to_string(), BTreeSet::from(["B".to_string()]))]));
    g.insert("b".to_string(), BTreeMap::from([("a".to_string(), BTreeSet::from([".a()".to_string()]))]));
    assert!(file_faults("daemon", &g).is_empty());
    g.insert("b".to_string(), BTreeMap::from([("a".to_string(), BTreeSet::from(["A".to_string()]))]));
    assert_eq!(file_faults("daemon", &g), vec!["daemon/: files a, b name each other in a cycle".to_string()]);
}

/// Strongly connected components with more than one module (Tarjan).
fn cycles(g: &Graph) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a Graph,
        next: usize,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> T<'a> {
        fn visit(&mut self, v: &'a str) {
            self.index.insert(v, self.next);
            self.low.insert(v, self.next);
            self.next += 1;
            self.stack.push(v);
            for w in &self.g[v] {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    self.low.insert(v, self.low[v].min(self.low[w]));
                } else if self.stack.contains(&w) {
                    self.low.insert(v, self.low[v].min(self.index[w]));
                }
            }
            if self.low[v] == self.index[v] {
                let mut comp = Vec::new();
                loop {
                    let w = self.stack.pop().unwrap();
                    comp.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if comp.len() > 1 {
                    comp.sort();
                    self.out.push(comp);
                }
            }
        }
    }
    let mut t = T { g, next: 0, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), out: Vec::new() };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out
}

#[test]
fn no_two_modules_import_each_other_even_through_others() {
    let g = graph();
    let found = cycles(&g);
    let mut report = String::new();
    for comp in &found {
        report.push_str(&format!("cycle among {}:\n", comp.join(", ")));
        for m in comp {
            let inside: Vec<&str> = g[m].iter().filter(|d| comp.contains(d)).map(String::as_str).collect();
            report.push_str(&format!("  {m} -> {}\n", inside.join(", ")));
        }
    }
    assert!(found.is_empty(), "module imports form cycles:\n{report}");
}

#[test]
fn the_check_sees_a_cycle_through_a_grouped_import() {
    // The checker itself: a → b through `use crate::{x, b::Y}`, b → a; a
    // comment naming c is no edge.
    let mut g = Graph::new();
    g.insert("a".into(), names(&code("use crate::{x, b::{Y, Z}};\n// crate::c\n")));
    g.insert("b".into(), names(&code("fn f() { crate::a::g() }")));
    g.insert("x".into(), BTreeSet::new());
    assert_eq!(g["a"], BTreeSet::from(["x".to_string(), "b".to_string()]));
    assert_eq!(cycles(&g), vec![vec!["a".to_string(), "b".to_string()]]);
}
