//! The C in docs/driver-guide.md is code, not prose: every ```c block is
//! extracted and compiled with the flags of the guide's own build command,
//! and the complete driver of §1.1 is built with that command, loaded by the
//! host's real loader, created and scanned (host/tests/integration/conformance/battery.rs runs
//! the conformance battery on it). A snippet that stops compiling, or a
//! driver that stops working, fails here before a vendor finds it.

mod common;

use devhost::driver::instance::Instance;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn guide() -> String {
    let path = repo().join("docs/driver-guide.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The fenced blocks of one language, with the line each starts on.
fn blocks(text: &str, lang: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (n, line) in text.lines().enumerate() {
        match &mut current {
            None if line.trim() == format!("```{lang}") => current = Some((n + 2, String::new())),
            Some(_) if line.trim() == "```" => out.extend(current.take()),
            Some((_, body)) => {
                body.push_str(line);
                body.push('\n');
            }
            None => {}
        }
    }
    out
}

/// The guide's build command: the first `cc …` line of a sh block.
fn build_command(text: &str) -> String {
    blocks(text, "sh")
        .iter()
        .flat_map(|(_, b)| b.lines().map(|l| l.trim().to_string()).collect::<Vec<_>>())
        .find(|l| l.starts_with("cc "))
        .expect("the guide shows a `cc` build command")
}

/// The strict flags in the build command (language, warnings, code generation).
fn strict_flags(command: &str) -> Vec<String> {
    command
        .split_whitespace()
        .filter(|w| w.starts_with("-std=") || w.starts_with("-W") || w.starts_with("-f") || *w == "-pthread")
        .map(str::to_string)
        .collect()
}

/// The complete driver: the block that defines the entry point.
fn complete_driver(c: &[(usize, String)]) -> &str {
    let found: Vec<&str> =
        c.iter().map(|(_, b)| b.as_str()).filter(|b| b.contains("devhost_driver_entry_v1(void) {")).collect();
    assert_eq!(found.len(), 1, "exactly one complete driver in the guide");
    found[0]
}

fn header_into(dir: &Path) {
    std::fs::copy(repo().join("drivers/abi/include/devhost_driver.h"), dir.join("devhost_driver.h")).unwrap();
}

fn run(mut cmd: Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Names of the file-scope `static` functions a snippet defines.
fn static_functions(snippet: &str) -> Vec<String> {
    snippet
        .lines()
        .filter(|l| l.starts_with("static ") && !l.contains('='))
        .filter_map(|l| l.split('(').next())
        .filter_map(|head| head.split_whitespace().last())
        .map(|name| name.trim_start_matches('*').to_string())
        .collect()
}

#[test]
fn the_build_command_is_the_same_in_readme_guide_abi_doc_and_build_rs() {
    let flags = "-std=c11 -Wall -Wextra -Werror -shared -fPIC -I";
    assert!(build_command(&guide()).starts_with(&format!("cc {flags} ")), "{}", build_command(&guide()));
    for doc in ["README.md", "docs/driver-abi.md", "drivers/example-c/README.md"] {
        let text = std::fs::read_to_string(repo().join(doc)).unwrap();
        let cmd = build_command(&text);
        assert!(cmd.starts_with(&format!("cc {flags} ")), "{doc} builds with `{cmd}`");
        assert!(text.contains("-pthread"), "{doc}: no -pthread");
    }
    let build_rs = std::fs::read_to_string(repo().join("drivers/example-c/build.rs")).unwrap();
    assert!(build_rs.contains(r#"["-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-I"]"#));
}

#[test]
fn every_c_snippet_of_the_guide_compiles_with_the_strict_flags() {
    let text = guide();
    let flags = strict_flags(&build_command(&text));
    assert!(flags.contains(&"-Werror".to_string()) && flags.contains(&"-std=c11".to_string()), "{flags:?}");
    let c = blocks(&text, "c");
    let driver = complete_driver(&c);
    // A snippet goes into the §1.1 file above its hooks: includes, struct and helpers.
    let prelude = &driver[..driver.find("static devhost_status acme_create(").expect("acme_create in §1.1")];
    let stand_ins = c.iter().map(|(_, b)| b.as_str()).find(|b| b.contains("Stand-ins")).expect("stand-ins block");
    let dir = tempfile::tempdir().unwrap();
    header_into(dir.path());
    let mut compiled = 0;
    for (line, snippet) in &c {
        if snippet.as_str() == driver {
            continue;
        }
        let name = format!("snippet_line_{line}.c");
        let refs: Vec<String> = static_functions(snippet).iter().map(|f| format!("(void (*)(void)){f}")).collect();
        let mut unit = format!("{prelude}\n{stand_ins}\n#line {line} \"driver-guide.md\"\n{snippet}\n");
        if !refs.is_empty() {
            // What the descriptor would do: use every hook, so none is an unused static.
            unit.push_str(&format!("void (*const guide_uses_{line}[])(void) = {{{}}};\n", refs.join(", ")));
        }
        std::fs::write(dir.path().join(&name), unit).unwrap();
        let mut cc = Command::new("cc");
        cc.current_dir(dir.path()).args(&flags).args(["-c", "-I", ".", "-o", "/dev/null", &name]);
        run(cc, &format!("the C snippet at docs/driver-guide.md line {line}"));
        compiled += 1;
    }
    assert!(compiled >= 6, "only {compiled} C snippets found besides the complete driver");
}

/// Builds the §1.1 driver exactly as the guide says, in a fresh folder.
fn build_guide_driver(dir: &Path) -> PathBuf {
    let text = guide();
    header_into(dir);
    std::fs::write(dir.join("acme.c"), complete_driver(&blocks(&text, "c"))).unwrap();
    let mut sh = Command::new("sh");
    sh.current_dir(dir).args(["-c", &build_command(&text)]);
    run(sh, "the guide's build command");
    let so = dir.join("libdevhost_acme.so");
    let nm = Command::new("nm").args(["-D", "--defined-only"]).arg(&so).output().expect("nm runs");
    let exported: Vec<String> = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
        .collect();
    assert_eq!(exported, ["devhost_driver_entry_v1"], "the module exports only the entry point");
    so
}

#[tokio::test]
async fn the_complete_driver_builds_loads_and_scans() {
    let dir = tempfile::tempdir().unwrap();
    let so = build_guide_driver(dir.path());
    let module =
        devhost::driver::loader::load(&so).unwrap_or_else(|e| panic!("the host refuses the guide's driver: {e}"));
    assert_eq!((module.name, module.version), ("acme", "0.1.0"));
    assert!(module.capabilities().is_empty(), "{:?}", module.capabilities());
    let options = vec![("count".to_string(), "3".to_string())];
    let inst = Instance::create("acme", module, &options, common::CALL_TIMEOUT).await.expect("create");
    let out = inst.scan().await.expect("scan");
    assert_eq!(out.problems, Vec::<String>::new(), "the host refused part of the scan");
    let ids: Vec<&str> = out.devices.iter().map(|d| d.id.as_str()).collect();
    assert_eq!(ids, ["acme-0", "acme-1", "acme-2"]);
    let d = &out.devices[1];
    assert_eq!((d.healthy, d.numa_node, d.attributes["model"].as_str()), (true, Some(1), "npu-9"));
    assert_eq!(d.edits.device_nodes[0].container_path, "/dev/acme1");
    assert_eq!(d.edits.envs, [("ACME_VISIBLE_DEVICES".to_string(), "acme-1".to_string())]);
    inst.shutdown();
}

#[tokio::test]
async fn the_complete_driver_refuses_options_in_the_guides_two_forms() {
    let dir = tempfile::tempdir().unwrap();
    let so = build_guide_driver(dir.path());
    for (key, value, expected) in [
        ("count", "lots", r#"option "count": "lots" is not a number between 0 and 1024"#),
        ("count", "1025", r#"option "count": "1025" is not a number between 0 and 1024"#),
        ("colour", "blue", r#"unknown option "colour" (value "blue"); known options: count, sysfs_root"#),
    ] {
        let module = devhost::driver::loader::load(&so).unwrap();
        let options = vec![(key.to_string(), value.to_string())];
        let err = match Instance::create("acme", module, &options, common::CALL_TIMEOUT).await {
            Ok(_) => panic!("{key} = {value} was accepted"),
            Err(e) => e,
        };
        let (code, message) = common::refusal(&err);
        assert_eq!(code, devhost_abi::DEVHOST_ERR_INVALID_ARGUMENT);
        assert_eq!(message, expected);
    }
    // The guide states both forms for every C driver.
    assert!(guide().contains(r#"`option "KEY": "VALUE" is not …`"#));
    assert!(guide().contains(r#"`unknown option "KEY" (value "VALUE"); known options: a, b, c`"#));
}
