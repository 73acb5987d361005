//! The layout of `host/src` is the architecture (docs/architecture.md): its areas form a chain,
//! lock → manifest → driver → engine → fronts (device_plugin, dra) → ops, and a module may use only
//! its own area and those before it; the two fronts do not use each other. This test reads every
//! `.rs` file under host/src, finds the `crate::` paths its code names (also inside `use crate::{…}`
//! groups, and `super::` chains that climb out of the file's area) and names each one against the
//! order. [`EXCEPTIONS`] lists the known ones still to cut; the test also fails when one of them is
//! no longer needed, so the list only shrinks.

use std::path::{Path, PathBuf};

/// (file under host/src, imported path prefix): known imports against the order, still to cut.
/// None left: holder tracking and release moved into the engine.
const EXCEPTIONS: &[(&str, &str)] = &[];

/// The area of a module path (segments after `crate`), with its rank in the order; `None` for the
/// crate root and `fronts` itself, which only declare modules.
fn area(segments: &[String]) -> Option<(String, u32)> {
    let first = segments.first()?.as_str();
    let rank = match first {
        "lock" | "fs_events" => 0,
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

/// The code of a file without its comments (`//` to the end of the line), so doc links to a later
/// area are not counted as uses.
fn code(text: &str) -> String {
    text.lines().map(|l| l.find("//").map_or(l, |i| &l[..i])).collect::<Vec<_>>().join("\n")
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

/// Every crate path the code of a file at module `module` names.
fn uses(module: &[String], code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    for (i, _) in code.match_indices("crate::") {
        if i > 0 && is_ident(bytes[i - 1] as char) {
            continue; // `$crate::` or an identifier ending in `crate`
        }
        expand(&[], &code[i + "crate::".len()..], &mut out);
    }
    for (i, _) in code.match_indices("super::") {
        if i > 0 && (is_ident(bytes[i - 1] as char) || code[..i].ends_with("::")) {
            continue; // counted from the first `super::` of a chain
        }
        let mut rest = &code[i..];
        let mut base = module.to_vec();
        while let Some(r) = rest.strip_prefix("super::") {
            base.pop();
            rest = r;
        }
        // Only a chain that climbs out of the file's area says something about the order.
        if area(&base).is_none() || base.len() < area_depth(module) {
            expand(&base, rest, &mut out);
        }
    }
    out
}

/// How many segments name the area of a module: 2 under `fronts`, else 1.
fn area_depth(module: &[String]) -> usize {
    if module.first().is_some_and(|m| m == "fronts") { 2 } else { 1 }
}

/// Every import against the order, as (file, imported path).
fn violations() -> Vec<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rs_files(&src, &mut files);
    files.sort();
    assert!(files.len() > 40, "found only {} files under {}", files.len(), src.display());
    let mut found = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap();
        let rel_name = rel.to_string_lossy().into_owned();
        if rel_name == "main.rs" {
            continue; // the binary wires every area together
        }
        let module = module_of(rel);
        let Some((from, from_rank)) = area(&module) else { continue };
        let text = std::fs::read_to_string(&file).unwrap();
        for path in uses(&module, &code(&text)) {
            let Some((to, to_rank)) = area(&path) else { continue };
            if to != from && to_rank >= from_rank {
                found.push((rel_name.clone(), path.join("::")));
            }
        }
    }
    found.sort();
    found.dedup();
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
            "fronts::device_plugin::release",
            "fronts::device_plugin::release::Phase",
            "fronts::dra",
            "ops::metrics",
        ]
    );
}
