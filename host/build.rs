//! Puts the git commit the binary is built from into `DEVHOST_COMMIT` (for `--version` and the
//! `devhost_build_info` metric). `DEVHOST_COMMIT` in the build's environment wins (an image built
//! from a context without `.git` can pass it); without either it is empty and the version is the
//! crate's alone.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-env-changed=DEVHOST_COMMIT");
    let commit = match std::env::var("DEVHOST_COMMIT") {
        Ok(c) => c,
        Err(_) => {
            // A new commit or checkout rewrites the worktree's HEAD log and HEAD.
            for path in ["HEAD", "logs/HEAD"] {
                if let Some(p) = git(&["rev-parse", "--git-path", path]).filter(|p| std::path::Path::new(p).exists()) {
                    println!("cargo:rerun-if-changed={p}");
                }
            }
            git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_default()
        }
    };
    let commit: String = commit.chars().filter(|c| c.is_ascii_alphanumeric() || *c == '-').take(40).collect();
    println!("cargo:rustc-env=DEVHOST_COMMIT={commit}");
    let version = match commit.as_str() {
        "" => env!("CARGO_PKG_VERSION").to_string(),
        c => format!("{} (commit {c})", env!("CARGO_PKG_VERSION")),
    };
    println!("cargo:rustc-env=DEVHOST_VERSION={version}");
}
