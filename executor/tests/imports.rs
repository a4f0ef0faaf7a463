//! Imports go one way: api → daemon → sandbox/store/db → shim protocol and
//! sys. This test reads the crate's sources, builds the graph of which
//! top-level module names which (`crate::NAME`, `use crate::{NAME, ..}`),
//! and fails on any cycle, naming the modules in it and the edges that
//! close it. Test code (from the first `#[cfg(test)]` of a file on) and
//! comments do not count.

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

/// The top-level modules `code` names.
fn names(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        let after = &code[i + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            // `use crate::{a, b::{c, d}, e}`: the first segment of each
            // top-level item of the group.
            let mut depth = 0;
            let mut start = true;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && (c.is_ascii_alphanumeric() || c == '_') => {
                        found.insert(ident(&group[j..]).to_string());
                        start = false;
                    }
                    c if c.is_whitespace() => {}
                    _ => start = false,
                }
            }
        } else {
            found.insert(ident(after).to_string());
        }
    }
    found
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
