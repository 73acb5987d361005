//! What the command line tells an operator who mistypes something, and what it generates from
//! its own definition: suggestions for mistyped subcommands and flags, a hint for a resource's
//! mistyped `driver`, every unknown driver option with its `file:line:col`, shell completions,
//! the manual page and `--version` with the commit.

use crate::common::*;
use std::process::Command;

#[test]
fn a_mistyped_subcommand_or_flag_gets_a_suggestion() {
    let (code, _, err) = devhost(&["lsit"]);
    assert_eq!(code, 2, "{err}");
    let tip = err.lines().find(|l| l.contains("tip:")).unwrap_or_default();
    assert!(tip.contains("similar subcommand") && tip.contains("'list'"), "{err}");
    let (code, _, err) = devhost(&["list", "--conifg", "devhost.toml"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("a similar argument exists: '--config'"), "{err}");
}

#[test]
fn a_mistyped_resource_driver_names_the_declared_driver() {
    let node = Node::new();
    let m = node.write_manifest_exact(&format!(
        "driver_dir = \"{dir}\"\n[driver.example_c]\noptions = {{ count = 1 }}\n[[resource]]\nname = \"example.com/c\"\ndriver = \"example_c\"\n[[resource]]\nname = \"example.com/d\"\ndriver = \"exmaple_c\"\n",
        dir = module("example_c").parent().unwrap().display()
    ));
    let (code, _, err) = devhost(&["check", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    let at = m.display();
    assert!(err.contains("driver exmaple_c: no module file found"), "{err}");
    assert!(
        err.contains(&format!(
            "{at}:9:10: a resource names driver \"exmaple_c\", which no [driver.exmaple_c] table declares: \
             did you mean \"example_c\" (declared at {at}:2:1)?"
        )),
        "{err}"
    );
}

#[test]
fn every_unknown_driver_option_is_reported_where_it_is_written() {
    let node = Node::new();
    let m = node.write_manifest_exact(&format!(
        "[driver.t]\nmodule = \"{t}\"\n[driver.t.options]\ncount = 1\ncolour = \"blue\"\ntopo = {{ numa = 1 }}\n[[resource]]\nname = \"example.com/t\"\ndriver = \"t\"\n",
        t = module("testdrv").display()
    ));
    let (code, _, err) = devhost(&["check", "--config", m.to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    let at = m.display();
    assert!(err.contains("unknown options \"colour\", \"topo.numa\""), "{err}");
    assert!(
        err.contains(&format!("in the manifest: {at}:5:1: option \"colour\", {at}:6:10: option \"topo.numa\"")),
        "{err}"
    );
}

#[test]
fn the_daemon_logs_where_the_options_of_a_failed_create_are_written() {
    let node = Node::new();
    let m = node.write_manifest_exact(&format!(
        "state_dir = \"{state}\"\n[driver.t]\nmodule = \"{t}\"\noptions = {{ colour = \"blue\" }}\n[[resource]]\nname = \"example.com/t\"\ndriver = \"t\"\n",
        state = node.path().join("state").display(),
        t = module("testdrv").display()
    ));
    let d = Daemon::start(&m, &node.kubelet_dir());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let needle = "create failed (retried with backoff): ";
    let log = rt.block_on(d.wait_log(needle, WAIT));
    let line = log.lines().find(|l| l.contains(needle)).unwrap();
    assert!(line.contains(&format!("in the manifest: {}:4:13: option \"colour\"", m.display())), "{line}");
}

/// The subcommands `devhost help` lists, but `help` itself.
fn subcommands() -> Vec<String> {
    let (code, out, err) = devhost(&["help"]);
    assert_eq!(code, 0, "{err}");
    let list = out.split("Commands:").nth(1).expect("a Commands section");
    let names: Vec<String> = list
        .lines()
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| *n != "help")
        .map(String::from)
        .collect();
    assert!(names.len() >= 9, "{names:?}");
    names
}

#[test]
fn the_man_page_renders_and_describes_every_subcommand() {
    let (code, page, err) = devhost(&["manpage"]);
    assert_eq!(code, 0, "{err}");
    assert!(page.starts_with(".ie") || page.contains("\n.TH devhost 1"), "{page}");
    for name in subcommands() {
        assert!(page.contains(&format!(".SH \"DEVHOST {}\"", name.to_uppercase())), "no section for {name}");
    }
    // The subcommand list points at those sections, not at pages that do not exist.
    assert!(!page.contains("devhost\\-run(1)"), "the list names a devhost-run(1) page");
    assert!(page.contains("devhost run (see \\fBDEVHOST RUN\\fR below)"), "{page}");
    // Rendered the way `man` does, with every groff warning on.
    let Ok(groff) = Command::new("groff").arg("--version").output() else {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "groff is missing (scripts/install-deps installs it)");
        eprintln!("SKIPPED: rendering (no groff)");
        return;
    };
    assert!(groff.status.success());
    let path = std::env::temp_dir().join(format!("devhost-{}.1", std::process::id()));
    std::fs::write(&path, &page).unwrap();
    let out = Command::new("groff").args(["-man", "-Tutf8", "-ww"]).arg(&path).output().unwrap();
    let _ = std::fs::remove_file(&path);
    let (text, warnings) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && warnings.trim().is_empty(), "groff: {warnings}");
    // groff emboldens with backspaces and justifies with spaces: strip both before looking.
    let plain: String = {
        let mut s = String::new();
        for c in text.chars() {
            if c == '\u{8}' {
                s.pop();
            } else {
                s.push(c);
            }
        }
        s.split_whitespace().collect::<Vec<_>>().join(" ")
    };
    for name in subcommands() {
        assert!(
            plain.contains(&format!("devhost {name}")),
            "the rendered page does not show `devhost {name}`:\n{plain}"
        );
    }
    assert!(plain.contains("--config"), "{plain}");
}

#[test]
fn completions_are_generated_for_bash_zsh_and_fish() {
    for shell in ["bash", "zsh", "fish"] {
        let (code, out, err) = devhost(&["completions", shell]);
        assert_eq!(code, 0, "{shell}: {err}");
        for name in subcommands() {
            assert!(out.contains(&name), "{shell} completion lacks {name}");
        }
    }
    // bash really loads it and binds it to `devhost`.
    let (_, script, _) = devhost(&["completions", "bash"]);
    let out = Command::new("bash").args(["-c", &format!("{script}\ncomplete -p devhost")]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("_devhost"), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let (code, _, err) = devhost(&["completions", "tcsh"]);
    assert_eq!(code, 2, "an unsupported shell is refused: {err}");
}

#[test]
fn version_names_the_commit_it_was_built_from() {
    let (code, out, err) = devhost(&["--version"]);
    assert_eq!(code, 0, "{err}");
    let version = env!("CARGO_PKG_VERSION");
    let head = Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).current_dir(repo_root()).output();
    match head {
        Ok(h) if h.status.success() && std::env::var_os("DEVHOST_COMMIT").is_none() => {
            let commit = String::from_utf8_lossy(&h.stdout).trim().to_string();
            assert_eq!(out.trim(), format!("devhost {version} (commit {commit})"));
        }
        // No git (a source tarball): the version alone.
        _ => assert!(out.trim().starts_with(&format!("devhost {version}")), "{out}"),
    }
}
