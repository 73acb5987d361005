//! The frozen compatibility drivers in `tests/compat/vMAJOR_MINOR/`: each
//! still compiles with the strict flags against its own copy of the header,
//! declares the version its folder names, and its header's layout is a prefix
//! of the current ABI (every field it knows at the same offset and width,
//! every constant unchanged), which is what lets the current host load it.

mod common;

use common::*;
use devhost_abi::*;
use std::path::PathBuf;

/// Every frozen folder with the (major, minor) its name declares.
fn frozen_folders() -> Vec<(PathBuf, (i128, i128))> {
    let root = repo_root().join("tests/compat");
    let entries = std::fs::read_dir(&root).unwrap_or_else(|e| panic!("reading {}: {e}", root.display()));
    let mut folders: Vec<_> = entries
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.is_dir())
        .map(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
            let version = name
                .strip_prefix('v')
                .and_then(|v| v.split_once('_'))
                .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
                .unwrap_or_else(|| panic!("{}: frozen folders are named vMAJOR_MINOR", p.display()));
            (p, version)
        })
        .collect();
    folders.sort();
    assert!(!folders.is_empty(), "no frozen folders under {}", root.display());
    folders
}

/// The frozen header probed for every struct field and constant it declares.
fn probe_frozen(dir: &std::path::Path) -> (HeaderFacts, Measured) {
    let header = dir.join("devhost_driver.h");
    let facts = parse_header(&read(&header));
    let strings: Vec<String> = facts.string_defines.keys().cloned().collect();
    let tag = dir.file_name().and_then(|n| n.to_str()).unwrap_or("frozen");
    let probe = probe_source("devhost_driver.h", &facts.structs, &facts.numeric_defines, &strings);
    let measured = run_probe(&format!("compat-{tag}"), &header, &probe);
    (facts, measured)
}

#[test]
fn frozen_drivers_compile_against_their_own_header() {
    for (dir, _) in frozen_folders() {
        let out =
            scratch("compat-build").join(format!("lib{}.so", dir.file_name().and_then(|n| n.to_str()).unwrap_or("x")));
        let src = dir.join("driver.c");
        cc(&[
            "-shared".as_ref(),
            "-fPIC".as_ref(),
            "-I".as_ref(),
            dir.as_os_str(),
            "-o".as_ref(),
            out.as_os_str(),
            src.as_os_str(),
        ]);
        assert!(out.is_file(), "{} produced no module", src.display());
    }
}

#[test]
fn frozen_headers_declare_their_folder_version() {
    for (dir, (major, minor)) in frozen_folders() {
        let (_, c) = probe_frozen(&dir);
        assert_eq!(c.constants.get("DEVHOST_ABI_MAJOR"), Some(&major), "{}", dir.display());
        assert_eq!(c.constants.get("DEVHOST_ABI_MINOR"), Some(&minor), "{}", dir.display());
    }
}

#[test]
fn frozen_layouts_are_a_prefix_of_the_current_abi() {
    let current = rust_layouts();
    let mut problems = Vec::new();
    for (dir, _) in frozen_folders() {
        let (facts, c) = probe_frozen(&dir);
        let at = dir.display();
        for (name, fields) in &facts.structs {
            let Some(now) = current.get(name) else {
                problems.push(format!("{at}: struct {name} no longer exists"));
                continue;
            };
            let (size, align) = c.structs[name];
            if size > now.size {
                problems.push(format!("{at}: sizeof({name}) shrank from {size} to {}", now.size));
            }
            if align != now.align {
                problems.push(format!("{at}: alignof({name}) was {align}, now {}", now.align));
            }
            for (i, field) in fields.iter().enumerate() {
                let then = c.fields[&(name.clone(), field.clone())];
                match now.fields.get(i) {
                    Some((f, place)) if f == field && *place == then => {}
                    Some((f, place)) => {
                        problems.push(format!("{at}: {name} field {i} was {field} at {then:?}, now {f} at {place:?}"))
                    }
                    None => problems.push(format!("{at}: {name}.{field} was removed")),
                }
            }
        }
    }
    assert_none("a frozen header is no longer a prefix of the current ABI", problems);
}

#[test]
fn frozen_constants_keep_their_values() {
    let mut problems = Vec::new();
    for (dir, _) in frozen_folders() {
        let (facts, c) = probe_frozen(&dir);
        let at = dir.display();
        for (name, then) in &c.constants {
            match rust_constant(name) {
                None => problems.push(format!("{at}: {name} was removed")),
                // The minor version is the one constant that grows.
                Some(now) if name == "DEVHOST_ABI_MINOR" && now >= *then => {}
                Some(now) if now != *then => problems.push(format!("{at}: {name} was {then}, now {now}")),
                Some(_) => {}
            }
        }
        if facts.string_defines.get("DEVHOST_ENTRY_SYMBOL_V1").map(String::as_str) != Some(DEVHOST_ENTRY_SYMBOL_V1) {
            problems.push(format!("{at}: DEVHOST_ENTRY_SYMBOL_V1 differs from {DEVHOST_ENTRY_SYMBOL_V1:?}"));
        }
    }
    assert_none("a frozen constant changed", problems);
}

#[test]
fn the_current_minor_has_a_frozen_folder() {
    // Bumping DEVHOST_ABI_MINOR ships a new minor: its header and a driver
    // using what it added must be frozen beside the older ones.
    let current = (DEVHOST_ABI_MAJOR as i128, DEVHOST_ABI_MINOR as i128);
    let folders: Vec<_> = frozen_folders().into_iter().map(|(_, v)| v).collect();
    assert!(
        folders.contains(&current),
        "no tests/compat/v{}_{} for the current ABI (found {folders:?})",
        current.0,
        current.1
    );
}

#[test]
fn the_v1_0_descriptor_ends_at_watch_stop() {
    // The host decides that a driver has no `release` from its declared
    // size; that size for a v1.0 module must be exactly DESC_SIZE_V1_0.
    let dir = repo_root().join("tests/compat/v1_0");
    let (_, c) = probe_frozen(&dir);
    assert_eq!(c.structs["devhost_driver_desc"].0, DESC_SIZE_V1_0);
    assert!(!field_present(DESC_SIZE_V1_0, std::mem::offset_of!(devhost_driver_desc, release), size_of::<usize>()));
}

#[test]
fn the_v1_1_host_api_ends_at_prefer_device() {
    // A 1.2 driver decides that its host has no `device_health_reason` from
    // the host's declared size; a 1.0 or 1.1 host declares HOST_API_SIZE_V1_1.
    for minor in ["v1_0", "v1_1"] {
        let (_, c) = probe_frozen(&repo_root().join("tests/compat").join(minor));
        assert_eq!(c.structs["devhost_host_api"].0, HOST_API_SIZE_V1_1, "{minor}");
    }
    let reason = std::mem::offset_of!(devhost_host_api, device_health_reason);
    assert!(!field_present(HOST_API_SIZE_V1_1, reason, size_of::<usize>()));
    assert!(field_present(size_of::<devhost_host_api>(), reason, size_of::<usize>()));
}

#[test]
fn the_v1_2_host_api_ends_at_device_health_reason() {
    // A 1.3 driver decides that its host has no `claim_parameters` from the
    // host's declared size; a 1.2 host declares HOST_API_SIZE_V1_2.
    let (_, c) = probe_frozen(&repo_root().join("tests/compat/v1_2"));
    assert_eq!(c.structs["devhost_host_api"].0, HOST_API_SIZE_V1_2);
    let params = std::mem::offset_of!(devhost_host_api, claim_parameters);
    assert!(!field_present(HOST_API_SIZE_V1_2, params, size_of::<usize>()));
    assert!(field_present(size_of::<devhost_host_api>(), params, size_of::<usize>()));
}
