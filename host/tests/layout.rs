//! The layout of `host/src` is the architecture (docs/architecture.md): its areas form a chain,
//! lock → manifest → driver → engine → fronts (device_plugin, dra) → ops, and a module may use only
//! its own area and those before it; the two fronts do not use each other. This test reads every
//! `.rs` file under host/src, finds the `crate::` paths its code names (also inside `use crate::{…}`
//! groups, `super::` chains and paths into the file's own child modules) and names each one against
//! the order. [`EXCEPTIONS`] lists the known ones still to cut; the test also fails when one of them
//! is no longer needed, so the list only shrinks.
//!
//! Inside one area, the files must not import each other in a circle: shared vocabulary lives in a
//! leaf file both sides import (docs/architecture.md). And the driver side and the engine speak no
//! gRPC: no tonic and no kubelet protos (`devhost_proto`) there, but for the clients listed in
//! [`GRPC_EXCEPTIONS`].

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// (file under host/src, imported path prefix): known imports against the order, still to cut.
/// None left: holder tracking and release moved into the engine.
const EXCEPTIONS: &[(&str, &str)] = &[];

/// (file under host/src, file it uses): imports that close a known circle between files of one
/// area, still to cut. The circle check leaves these out; each must still close a circle. None
/// left: what a `mod.rs` declares for its own files lives in a leaf file they all import.
const CIRCLE_EXCEPTIONS: &[(&str, &str)] = &[];

/// (file under host/src, crate named): known uses of gRPC in driver/ and engine/.
const GRPC_EXCEPTIONS: &[(&str, &str)] = &[
    // The engine's client of the kubelet's PodResources API (who holds a device): a client of a
    // kubelet API, not a front, so it stays in the engine.
    ("engine/podresources.rs", "devhost_proto"),
    ("engine/podresources.rs", "tonic"),
    // The engine's client of the runtime's CRI (whether a holder's containers have exited), for
    // the same reason.
    ("engine/containers.rs", "devhost_proto"),
    ("engine/containers.rs", "tonic"),
    // Its tests make that client's fake runtime fail with a gRPC code.
    ("engine/release/gate_tests.rs", "tonic"),
];

/// The crates that are gRPC: the transport and the kubelet's (and runtime's) protos.
const GRPC_CRATES: &[&str] = &["tonic", "devhost_proto"];

/// The areas that must not use [`GRPC_CRATES`].
const NO_GRPC: &[&str] = &["driver", "engine"];

/// The area of a module path (segments after `crate`), with its rank in the order; `None` for the
/// crate root and `fronts` itself, which only declare modules.
fn area(segments: &[String]) -> Option<(String, u32)> {
    let first = segments.first()?.as_str();
    let rank = match first {
        "lock" | "fs_events" | "names" => 0,
        "manifest" => 1,
        "driver" => 2,
        "engine" => 3,
        "fronts" => {
            let front = segments.get(1)?;
            return Some((format!("fronts::{front}"), 4));
        }
        "ops" => 5,
        _ => return None,
    };
    Some((first.to_string(), rank))
}

/// Module path of a file: `fronts/dra/mod.rs` → [fronts, dra]; `engine/cdi.rs` → [engine, cdi].
fn module_of(rel: &Path) -> Vec<String> {
    let mut segs: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
    let last = segs.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" && stem != "main" {
        segs.push(stem.to_string());
    }
    segs
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rs_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Expands what follows `crate::` (or a resolved `super::` chain) at `rest` into full paths:
/// `a::b`, or every entry of a `{…}` group, nested groups included.
fn expand(prefix: &[String], rest: &str, out: &mut Vec<Vec<String>>) {
    let mut path = prefix.to_vec();
    let mut s = rest;
    loop {
        let s2 = s.trim_start();
        if let Some(group) = s2.strip_prefix('{') {
            let mut depth = 1;
            let mut end = 0;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    end = i;
                    break;
                }
            }
            let inner = &group[..end];
            let (mut depth, mut start) = (0, 0);
            for (i, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        expand(&path, &inner[start..i], out);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            expand(&path, &inner[start..], out);
            return;
        }
        let len = s2.find(|c: char| !is_ident(c)).unwrap_or(s2.len());
        if len == 0 {
            break;
        }
        path.push(s2[..len].to_string());
        match s2[len..].strip_prefix("::") {
            Some(next) => s = next,
            None => break,
        }
    }
    if !path.is_empty() && path.iter().all(|p| p != "self") {
        out.push(path);
    } else if let Some(i) = path.iter().position(|p| p == "self") {
        path.truncate(i);
        out.push(path);
    }
}

/// Byte ranges of the inline modules (`mod tests { … }`) of a file's code: inside one, the first
/// `super::` names the file's own module.
fn inline_modules(code: &str) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    for (i, _) in code.match_indices("mod ") {
        if i > 0 && is_ident(bytes[i - 1] as char) {
            continue;
        }
        let rest = &code[i + 4..];
        let name = rest.find(|c: char| !is_ident(c)).unwrap_or(rest.len());
        let Some(body) = rest[name..].trim_start().strip_prefix('{') else { continue };
        let open = code.len() - body.len();
        let mut depth = 1;
        for (j, c) in body.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                out.push(open..open + j);
                break;
            }
        }
    }
    out
}

/// The child modules a file declares in files of their own (`mod conn;`, `pub mod worker;`).
fn child_modules(code: &str) -> Vec<String> {
    code.lines()
        .filter_map(|l| {
            let l = l.trim();
            let decl = l
                .strip_prefix("mod ")
                .or_else(|| l.split_once(" mod ").map(|(_, rest)| rest).filter(|_| l.starts_with("pub")))?;
            let name = decl.strip_suffix(';')?.trim();
            name.chars().all(is_ident).then(|| name.to_string())
        })
        .collect()
}

/// Every crate path the code of a file at module `module` names: `crate::` paths, `super::` chains
/// and paths into its own child modules, each as a full path from the crate root.
fn uses(module: &[String], code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    for (i, _) in code.match_indices("crate::") {
        if i > 0 && is_ident(bytes[i - 1] as char) {
            continue; // `$crate::` or an identifier ending in `crate`
        }
        expand(&[], &code[i + "crate::".len()..], &mut out);
    }
    let inline = inline_modules(code);
    for (i, _) in code.match_indices("super::") {
        if i > 0 && (is_ident(bytes[i - 1] as char) || code[..i].ends_with("::")) {
            continue; // counted from the first `super::` of a chain
        }
        let mut rest = &code[i..];
        let mut base = module.to_vec();
        // Inside `mod tests { … }` the first `super::` is the file itself.
        let mut in_file = inline.iter().filter(|r| r.contains(&i)).count();
        while let Some(r) = rest.strip_prefix("super::") {
            if in_file > 0 {
                in_file -= 1;
            } else {
                base.pop();
            }
            rest = r;
        }
        expand(&base, rest, &mut out);
    }
    for child in child_modules(code) {
        let head = format!("{child}::");
        for (i, _) in code.match_indices(&head) {
            if i > 0 && (is_ident(bytes[i - 1] as char) || code[..i].ends_with("::")) {
                continue; // `x::child::` is not this child
            }
            let mut prefix = module.to_vec();
            prefix.push(child.clone());
            expand(&prefix, &code[i + head.len()..], &mut out);
        }
    }
    out
}

/// Every file under host/src but `main.rs` (the binary wires every area together), as (name
/// relative to host/src, module path, code without comments).
fn sources() -> Vec<(String, Vec<String>, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    files.sort();
    assert!(files.len() > 40, "found only {} files under {}", files.len(), src.display());
    files
        .into_iter()
        .filter_map(|file| {
            let rel = file.strip_prefix(&src).unwrap();
            let name = rel.to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&file).unwrap();
            (name != "main.rs").then(|| (name, module_of(rel), blank_literals(&text)))
        })
        .collect()
}

/// Every import against the order, as (file, imported path).
fn violations() -> Vec<(String, String)> {
    let mut found = Vec::new();
    for (name, module, code) in sources() {
        let Some((from, from_rank)) = area(&module) else { continue };
        for path in uses(&module, &code) {
            let Some((to, to_rank)) = area(&path) else { continue };
            if to != from && to_rank >= from_rank {
                found.push((name.clone(), path.join("::")));
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

/// The imports between files of one area: file → (file it uses → the first path naming it).
type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// The file-to-file imports inside each area, from `files` (name, module path, code).
fn area_graph(files: &[(String, Vec<String>, String)]) -> Graph {
    let by_module: BTreeMap<&[String], &str> = files.iter().map(|(n, m, _)| (m.as_slice(), n.as_str())).collect();
    let mut graph = Graph::new();
    for (name, module, code) in files {
        let Some((from, _)) = area(module) else { continue };
        for path in uses(module, code) {
            if area(&path).is_none_or(|(to, _)| to != from) {
                continue;
            }
            // The file is the longest prefix of the path that is a module of its own.
            let Some(target) = (1..=path.len()).rev().find_map(|n| by_module.get(&path[..n])) else { continue };
            if *target != name {
                graph.entry(name.clone()).or_default().entry(target.to_string()).or_insert_with(|| path.join("::"));
            }
        }
    }
    graph
}

/// Every import circle in `graph`, each as the files along it and back to the first, with the
/// path each names of the next.
fn circles(graph: &Graph) -> Vec<String> {
    // Tarjan's strongly connected components, then one circle through each of more than one file.
    struct State<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        components: Vec<Vec<&'a str>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in s.graph.get(v).into_iter().flat_map(|e| e.keys()) {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w);
                if w == v {
                    break;
                }
            }
            s.components.push(component);
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v.as_str()) {
            visit(&mut s, v);
        }
    }
    let mut out = Vec::new();
    for component in s.components.iter().filter(|c| c.len() > 1) {
        let members: BTreeSet<&str> = component.iter().copied().collect();
        let start = *members.iter().next().unwrap();
        // A shortest way back to `start` inside the component (breadth first).
        let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([start]);
        let mut last = None;
        while let Some(v) = queue.pop_front() {
            for w in graph[v].keys().map(String::as_str).filter(|w| members.contains(w)) {
                if w == start {
                    last = Some(v);
                    queue.clear();
                    break;
                }
                if !came_from.contains_key(w) {
                    came_from.insert(w, v);
                    queue.push_back(w);
                }
            }
        }
        let mut way = vec![start];
        let mut v = last.unwrap();
        while v != start {
            way.push(v);
            v = came_from[v];
        }
        way[1..].reverse();
        way.push(start);
        let steps: Vec<String> =
            way.windows(2).map(|p| format!("{} uses crate::{}", p[0], graph[p[0]][p[1]])).collect();
        let mut circle = format!("{} ({})", way.join(" → "), steps.join("; "));
        if members.len() + 1 > way.len() {
            let all: Vec<&str> = members.iter().copied().collect();
            circle.push_str(&format!("; in circles with these too: {}", all.join(", ")));
        }
        out.push(circle);
    }
    out.sort();
    out
}

/// Every use of a gRPC crate in the areas that must have none, as (file, crate).
fn grpc_uses() -> Vec<(String, String)> {
    let mut found = Vec::new();
    for (name, module, code) in sources() {
        if !module.first().is_some_and(|a| NO_GRPC.contains(&a.as_str())) {
            continue;
        }
        let bytes = code.as_bytes();
        for krate in GRPC_CRATES {
            let named = code.match_indices(krate).any(|(i, _)| {
                let before = i.checked_sub(1).map(|j| bytes[j] as char);
                let after = bytes.get(i + krate.len()).map(|&b| b as char);
                !before.is_some_and(|c| is_ident(c) || c == ':') && !after.is_some_and(is_ident)
            });
            if named {
                found.push((name.clone(), krate.to_string()));
            }
        }
    }
    found
}

#[test]
fn areas_use_only_the_areas_before_them() {
    let found = violations();
    let unexpected: Vec<String> = found
        .iter()
        .filter(|(file, path)| !EXCEPTIONS.iter().any(|(f, p)| f == file && path.starts_with(p)))
        .map(|(file, path)| format!("host/src/{file} uses crate::{path}"))
        .collect();
    assert!(
        unexpected.is_empty(),
        "imports against the order lock → manifest → driver → engine → fronts → ops \
         (docs/architecture.md):\n  {}",
        unexpected.join("\n  ")
    );
}

#[test]
fn every_listed_exception_is_still_needed() {
    let found = violations();
    let stale: Vec<String> = EXCEPTIONS
        .iter()
        .filter(|(f, p)| !found.iter().any(|(file, path)| file == f && path.starts_with(p)))
        .map(|(f, p)| format!("host/src/{f} → crate::{p}"))
        .collect();
    assert!(stale.is_empty(), "exceptions no longer needed, remove them from EXCEPTIONS:\n  {}", stale.join("\n  "));
    let grpc = grpc_uses();
    let stale: Vec<String> = GRPC_EXCEPTIONS
        .iter()
        .filter(|(f, k)| !grpc.iter().any(|(file, krate)| file == f && krate == k))
        .map(|(f, k)| format!("host/src/{f} → {k}"))
        .collect();
    assert!(
        stale.is_empty(),
        "exceptions no longer needed, remove them from GRPC_EXCEPTIONS:\n  {}",
        stale.join("\n  ")
    );
}

/// Whether `to` reaches `from` in `graph`: the import `from` → `to` closes a circle.
fn closes_a_circle(graph: &Graph, from: &str, to: &str) -> bool {
    let mut seen = BTreeSet::new();
    let mut todo = vec![to];
    while let Some(v) = todo.pop() {
        if v == from {
            return true;
        }
        if seen.insert(v) {
            todo.extend(graph.get(v).into_iter().flat_map(|e| e.keys().map(String::as_str)));
        }
    }
    false
}

#[test]
fn files_of_one_area_import_each_other_in_no_circle() {
    let mut graph = area_graph(&sources());
    let stale: Vec<String> = CIRCLE_EXCEPTIONS
        .iter()
        .filter(|(f, t)| !graph.get(*f).is_some_and(|e| e.contains_key(*t)) || !closes_a_circle(&graph, f, t))
        .map(|(f, t)| format!("host/src/{f} → host/src/{t}"))
        .collect();
    assert!(
        stale.is_empty(),
        "exceptions that close no circle any more, remove them from CIRCLE_EXCEPTIONS:\n  {}",
        stale.join("\n  ")
    );
    for (from, to) in CIRCLE_EXCEPTIONS {
        graph.get_mut(*from).map(|e| e.remove(*to));
    }
    let found = circles(&graph);
    assert!(
        found.is_empty(),
        "import circles between files of one area (move what both sides need into a leaf file \
         both import, docs/architecture.md):\n  {}",
        found.join("\n  ")
    );
}

#[test]
fn the_driver_side_and_the_engine_speak_no_grpc() {
    let unexpected: Vec<String> = grpc_uses()
        .into_iter()
        .filter(|(f, k)| !GRPC_EXCEPTIONS.iter().any(|(file, krate)| file == f && krate == k))
        .map(|(f, k)| format!("host/src/{f} uses {k}"))
        .collect();
    assert!(
        unexpected.is_empty(),
        "gRPC in driver/ or engine/ (a kubelet API's types and status codes belong to its front, \
         host/src/fronts):\n  {}",
        unexpected.join("\n  ")
    );
}

#[test]
fn groups_and_super_chains_are_read() {
    let module: Vec<String> = ["engine", "registry"].iter().map(|s| s.to_string()).collect();
    let code = "use crate::{driver::device::Device, fronts::{dra, device_plugin::release::{self, Phase}}};\n\
                use super::super::ops::metrics;\nuse super::view;";
    let mut got: Vec<String> = uses(&module, code).iter().map(|p| p.join("::")).collect();
    got.sort();
    assert_eq!(
        got,
        [
            "driver::device::Device",
            "engine::view",
            "fronts::device_plugin::release",
            "fronts::device_plugin::release::Phase",
            "fronts::dra",
            "ops::metrics",
        ]
    );
}

#[test]
fn child_modules_and_tests_modules_are_read() {
    let module: Vec<String> = ["driver", "isolation"].iter().map(|s| s.to_string()).collect();
    let code = "mod conn;\npub mod worker;\nfn f() { worker::main(); x::conn::y(); }\n\
                mod tests {\n    use super::*;\n    use super::super::loader;\n}";
    let mut got: Vec<String> = uses(&module, code).iter().map(|p| p.join("::")).collect();
    got.sort();
    assert_eq!(got, ["driver::isolation", "driver::isolation::worker::main", "driver::loader"]);
}

/// Three files of one area that import each other in a ring, and a leaf beside them.
fn ring() -> Vec<(String, Vec<String>, String)> {
    let file = |name: &str, module: &[&str], code: &str| {
        (name.to_string(), module.iter().map(|s| s.to_string()).collect(), code.to_string())
    };
    vec![
        file("driver/call.rs", &["driver", "call"], "pub struct CallError;"),
        file("driver/instance.rs", &["driver", "instance"], "use crate::driver::isolation::supervisor::Supervisor;"),
        file("driver/isolation/mod.rs", &["driver", "isolation"], "pub mod supervisor;"),
        file("driver/isolation/supervisor.rs", &["driver", "isolation", "supervisor"], "use super::conn::Conn;"),
        file(
            "driver/isolation/conn.rs",
            &["driver", "isolation", "conn"],
            "use crate::driver::{call::CallError, instance::ANSWER_SPIN};",
        ),
        file("engine/cdi.rs", &["engine", "cdi"], "use crate::driver::instance::Instance;"),
    ]
}

#[test]
fn a_circle_is_found_and_named_file_by_file() {
    let found = circles(&area_graph(&ring()));
    assert_eq!(
        found,
        ["driver/instance.rs → driver/isolation/supervisor.rs → driver/isolation/conn.rs → driver/instance.rs \
          (driver/instance.rs uses crate::driver::isolation::supervisor::Supervisor; \
          driver/isolation/supervisor.rs uses crate::driver::isolation::conn::Conn; \
          driver/isolation/conn.rs uses crate::driver::instance::ANSWER_SPIN)"]
    );
    let mut cut = ring();
    cut[4].2 = "use crate::driver::call::CallError;".to_string();
    assert!(circles(&area_graph(&cut)).is_empty());
}

/// Longest a function in host/src may be, in lines from its `fn` to its closing brace.
const MAX_FUNCTION_LINES: usize = 80;

/// (file under host/src, function): functions allowed over [`MAX_FUNCTION_LINES`], at most 3,
/// each with its reason in a comment here. None now.
const LONG_FUNCTIONS: &[(&str, &str)] = &[];

/// `text` with comments and the insides of string and char literals blanked (newlines kept), so
/// braces in them are not counted.
fn blank_literals(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < c.len() {
        let blank = |out: &mut String, ch: char| out.push(if ch == '\n' { '\n' } else { ' ' });
        if c[i] == '/' && c.get(i + 1) == Some(&'/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
                out.push(' ');
            }
        } else if c[i] == 'r' && matches!(c.get(i + 1), Some('"' | '#')) && (i == 0 || !is_ident(c[i - 1])) {
            // A raw string: r"…", r#"…"#.
            let hashes = c[i + 1..].iter().take_while(|&&h| h == '#').count();
            let close: String = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
            let start = i + 2 + hashes;
            let rest: String = c[start.min(c.len())..].iter().collect();
            let end = rest.find(&close).map_or(c.len(), |e| start + rest[..e].chars().count() + close.len());
            for &ch in &c[i..end] {
                blank(&mut out, ch);
            }
            i = end;
        } else if c[i] == '"' {
            out.push(' ');
            i += 1;
            while i < c.len() && c[i] != '"' {
                let skip = if c[i] == '\\' { 2 } else { 1 };
                for &ch in &c[i..(i + skip).min(c.len())] {
                    blank(&mut out, ch);
                }
                i += skip;
            }
            out.push(' ');
            i += 1;
        } else if c[i] == '\'' && (c.get(i + 2) == Some(&'\'') || c.get(i + 1) == Some(&'\\')) {
            // A char literal ('{', '\n', '\''); a lifetime has no closing quote.
            let end = c[i + 2..].iter().position(|&q| q == '\'').map_or(c.len(), |p| i + 3 + p);
            for &ch in &c[i..end] {
                blank(&mut out, ch);
            }
            i = end;
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// The functions of one file's code (its `#[cfg(test)] mod tests { … }` left out) that are
/// over [`MAX_FUNCTION_LINES`], as (function, first line, lines).
fn long_functions(text: &str) -> Vec<(String, usize, usize)> {
    let code = blank_literals(text);
    let code = code.find("#[cfg(test)]\nmod tests {").map_or(code.as_str(), |i| &code[..i]);
    let lines: Vec<&str> = code.lines().collect();
    let mut found = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let Some(at) =
            line.match_indices("fn ").map(|(i, _)| i).find(|&i| i == 0 || !is_ident(line.as_bytes()[i - 1] as char))
        else {
            continue;
        };
        let name: String = line[at + 3..].chars().take_while(|&ch| is_ident(ch)).collect();
        if name.is_empty() {
            continue;
        }
        let (mut depth, mut opened) = (0i32, false);
        for (end, l) in lines.iter().enumerate().skip(start) {
            let from = if end == start { at } else { 0 };
            for ch in l[from..].chars() {
                match ch {
                    '{' => (depth, opened) = (depth + 1, true),
                    '}' => depth -= 1,
                    ';' if !opened => depth = i32::MIN,
                    _ => {}
                }
            }
            if depth == i32::MIN || (opened && depth <= 0) {
                let len = end - start + 1;
                if opened && len > MAX_FUNCTION_LINES {
                    found.push((name.clone(), start + 1, len));
                }
                break;
            }
        }
    }
    found
}

#[test]
fn no_function_is_longer_than_a_screen_but_the_listed_ones() {
    assert!(LONG_FUNCTIONS.len() <= 3, "at most 3 long functions, each with its reason");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    let mut long = Vec::new();
    for file in files {
        let name = file.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
        if name.ends_with("tests.rs") {
            continue;
        }
        for (function, line, len) in long_functions(&std::fs::read_to_string(&file).unwrap()) {
            if !LONG_FUNCTIONS.contains(&(name.as_str(), function.as_str())) {
                long.push(format!("{name}:{line} fn {function}: {len} lines"));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over {MAX_FUNCTION_LINES} lines (split them, or list them in LONG_FUNCTIONS with the reason):\n{}",
        long.join("\n")
    );
}

/// Longest a file in host/src may be, in lines before its `#[cfg(test)] mod tests { … }`.
const MAX_FILE_LINES: usize = 600;

/// Lines of a file's code before its inline `#[cfg(test)] mod tests`.
fn lines_before_tests(text: &str) -> usize {
    let code = text.find("#[cfg(test)]\nmod tests {").map_or(text, |i| &text[..i]);
    code.lines().count()
}

#[test]
fn no_file_is_longer_than_a_sitting_but_its_tests() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    let mut long = Vec::new();
    for file in files {
        let name = file.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
        let lines = lines_before_tests(&std::fs::read_to_string(&file).unwrap());
        if !name.ends_with("tests.rs") && lines > MAX_FILE_LINES {
            long.push(format!("{name}: {lines} lines"));
        }
    }
    assert!(
        long.is_empty(),
        "files over {MAX_FILE_LINES} lines besides their tests (split them by job):\n{}",
        long.join("\n")
    );
    let text = format!("{}#[cfg(test)]\nmod tests {{\n{}}}\n", "fn a() {}\n".repeat(3), "    fn t() {}\n".repeat(900));
    assert_eq!(lines_before_tests(&text), 3, "the tests module is left out");
}

#[test]
fn long_functions_are_measured_past_braces_in_strings_chars_and_comments() {
    let body = |n: usize| (0..n).map(|i| format!("    let x{i} = 1;\n")).collect::<String>();
    let text = format!(
        "fn short() {{\n{}}}\n// fn commented() {{\npub async fn long(a: &str) -> u8 {{\n    let s = \"}}}}\";\n    \
         let c = '}}';\n    let r = r#\"}}\"#; // }}\n{}    0\n}}\ntrait T {{\n    fn declared(&self);\n}}\n",
        body(10),
        body(MAX_FUNCTION_LINES)
    );
    let found = long_functions(&text);
    assert_eq!(found, vec![("long".to_string(), 14, MAX_FUNCTION_LINES + 6)], "{text}");
    let tests = format!("fn kept() {{}}\n#[cfg(test)]\nmod tests {{\nfn long_test() {{\n{}}}\n}}\n", body(100));
    assert!(long_functions(&tests).is_empty());
}
