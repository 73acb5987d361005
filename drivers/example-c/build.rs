//! Compiles `example.c` into `libdevhost_example_c.so` with the system C
//! compiler and the same strict flags a vendor would use, then copies it next
//! to the workspace's other driver modules (`target/<profile>/`), so
//! `cargo build` leaves every bundled driver in one directory.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

const SO_NAME: &str = "libdevhost_example_c.so";

fn main() -> ExitCode {
    match build() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: building the C example driver: {message}");
            ExitCode::FAILURE
        }
    }
}

fn build() -> Result<(), String> {
    let manifest_dir = PathBuf::from(env_var("CARGO_MANIFEST_DIR")?);
    let out_dir = PathBuf::from(env_var("OUT_DIR")?);
    let source = manifest_dir.join("example.c");
    let include = manifest_dir.join("../abi/include");
    println!("cargo:rerun-if-changed={}", source.display());
    println!("cargo:rerun-if-changed={}", include.join("devhost_driver.h").display());
    println!("cargo:rerun-if-env-changed=CC");

    let compiler = env::var_os("CC").unwrap_or_else(|| "cc".into());
    let built = out_dir.join(SO_NAME);
    let mut command = Command::new(&compiler);
    command
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-I"])
        .arg(&include)
        .arg("-o")
        .arg(&built)
        .arg(&source)
        .arg("-pthread");
    let output = command
        .output()
        .map_err(|e| format!("cannot run the C compiler {compiler:?} (set CC to choose another): {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "{command:?} failed ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }

    let profile_dir = profile_dir(&out_dir)?;
    // Copy under a temporary name and rename, so a test or host that loads
    // the module while cargo runs never sees a half-written file.
    let staged = profile_dir.join(format!(".{SO_NAME}.tmp"));
    let dest = profile_dir.join(SO_NAME);
    fs::copy(&built, &staged).map_err(|e| format!("cannot copy {} to {}: {e}", built.display(), staged.display()))?;
    fs::rename(&staged, &dest).map_err(|e| format!("cannot rename {} to {}: {e}", staged.display(), dest.display()))?;
    Ok(())
}

fn env_var(name: &str) -> Result<String, String> {
    env::var(name).map_err(|e| format!("cargo did not set {name}: {e}"))
}

/// `target/<profile>/build/<pkg>-<hash>/out` → `target/<profile>`.
fn profile_dir(out_dir: &Path) -> Result<PathBuf, String> {
    out_dir
        .ancestors()
        .nth(3)
        .map(Path::to_path_buf)
        .ok_or_else(|| format!("OUT_DIR {} is not target/<profile>/build/<pkg>/out", out_dir.display()))
}
