//! Container edits per device for each device-list strategy: the
//! `NVIDIA_VISIBLE_DEVICES` variable (for the NVIDIA container runtime), CDI
//! names (with the nodes and files that define them in devhost's spec), or
//! plain device nodes plus the driver's user-space libraries and tools mounted
//! read-only, for nodes without the NVIDIA container toolkit.
//! The libraries and tools go where any image already looks (the dynamic
//! loader's default folders, `/usr/bin`), never through `PATH` or
//! `LD_LIBRARY_PATH`, which would replace the image's own values.

use crate::config::{Config, IdStrategy};
use std::path::{Path, PathBuf};

/// Where the driver's libraries appear inside the container (CUDA images put
/// it on their own `LD_LIBRARY_PATH`); they are mounted into
/// [`CONTAINER_LIB_DIRS`] as well.
pub const CONTAINER_LIB_DIR: &str = "/usr/local/nvidia/lib64";
/// Where the driver's tools appear inside the container (CUDA images put it
/// on their own `PATH`); they are mounted into [`CONTAINER_BIN_DIRS`] as well.
pub const CONTAINER_BIN_DIR: &str = "/usr/local/nvidia/bin";

/// The glibc loader's default folder on Debian-style (multiarch) systems for
/// this architecture: searched by `ld.so` without any cache entry or variable.
const MULTIARCH_LIB_DIR: &str = if cfg!(target_arch = "x86_64") {
    "/usr/lib/x86_64-linux-gnu"
} else if cfg!(target_arch = "aarch64") {
    "/usr/lib/aarch64-linux-gnu"
} else if cfg!(all(target_arch = "powerpc64", target_endian = "little")) {
    "/usr/lib/powerpc64le-linux-gnu"
} else {
    "/usr/lib"
};

/// Every container folder a library is mounted into: ours, then the loader's
/// default folders of the Debian/Ubuntu family (multiarch) and of the
/// RHEL/Fedora/SUSE family (`/usr/lib64`; on Arch it is a link to `/usr/lib`).
/// The loader finds a library there whatever the image's `LD_LIBRARY_PATH`
/// and `ld.so.cache` say (a cache entry for the same name still wins).
pub const CONTAINER_LIB_DIRS: [&str; 3] = [CONTAINER_LIB_DIR, MULTIARCH_LIB_DIR, "/usr/lib64"];
/// Every container folder a tool is mounted into: ours and `/usr/bin`, which
/// is on the default `PATH` of every distribution and of container runtimes.
pub const CONTAINER_BIN_DIRS: [&str; 2] = [CONTAINER_BIN_DIR, "/usr/bin"];

/// Library folders searched under `driver_root`, in order.
const LIB_DIRS: &[&str] =
    &["usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "lib64", "usr/lib", "lib"];
/// Binary folders searched under `driver_root`, in order.
const BIN_DIRS: &[&str] = &["usr/bin", "bin"];
/// The user-space libraries CUDA and NVML programs need ("compute" and
/// "utility" in NVIDIA's terms): `libX.so` and every `libX.so.*`.
const LIBRARIES: &[&str] = &[
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-cfg.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-opencl.so",
    "libnvidia-gpucomp.so",
    "libnvidia-allocator.so",
    "libnvidia-fatbinaryloader.so",
];
const BINARIES: &[&str] =
    &["nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"];
/// Device nodes every GPU container needs besides `/dev/nvidiaN`.
pub const CONTROL_NODES: &[&str] = &["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"];

/// One file to bind-mount: its resolved host path and its container path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mount {
    pub host: PathBuf,
    pub container: String,
}

/// The driver files found under `driver_root`, once, at create.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DriverFiles {
    pub libraries: Vec<Mount>,
    pub binaries: Vec<Mount>,
}

/// The edits of one device, in the order they are emitted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Edits {
    /// (host path, container path, permissions).
    pub device_nodes: Vec<(String, String, String)>,
    /// (host path, container path, read-only).
    pub mounts: Vec<(String, String, bool)>,
    pub env: Vec<(String, String)>,
    pub cdi: Vec<String>,
}

/// Finds the NVIDIA libraries and tools under `driver_root`. Symlinks are
/// resolved inside `driver_root` (an absolute link target means
/// `<driver_root>/target`), so a driver container's tree works too. The first
/// folder that has a file name wins.
pub fn find_driver_files(driver_root: &Path) -> DriverFiles {
    let mut files = DriverFiles::default();
    let wanted_lib = |name: &str| {
        LIBRARIES.iter().any(|l| name == *l || name.strip_prefix(l).is_some_and(|rest| rest.starts_with('.')))
    };
    for dir in LIB_DIRS {
        collect(driver_root, dir, CONTAINER_LIB_DIR, &wanted_lib, &mut files.libraries);
    }
    for dir in BIN_DIRS {
        collect(driver_root, dir, CONTAINER_BIN_DIR, &|n: &str| BINARIES.contains(&n), &mut files.binaries);
    }
    files
}

fn collect(root: &Path, dir: &str, container_dir: &str, wanted: &dyn Fn(&str) -> bool, out: &mut Vec<Mount>) {
    let Ok(entries) = std::fs::read_dir(root.join(dir)) else { return };
    let mut names: Vec<String> = entries.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect();
    names.sort();
    for name in names.into_iter().filter(|n| wanted(n)) {
        let container = format!("{container_dir}/{name}");
        if out.iter().any(|m| m.container == container) {
            continue;
        }
        match resolve_in_root(root, &root.join(dir).join(&name)) {
            Some(host) => out.push(Mount { host, container }),
            None => log::debug!("driver file {dir}/{name} under {} is a dangling link; skipped", root.display()),
        }
    }
}

/// Follows symlinks with absolute targets taken relative to `root`; `None`
/// for dangling links, loops, or anything but a regular file at the end.
pub fn resolve_in_root(root: &Path, path: &Path) -> Option<PathBuf> {
    let mut current = path.to_path_buf();
    for _ in 0..16 {
        let meta = std::fs::symlink_metadata(&current).ok()?;
        if !meta.file_type().is_symlink() {
            return meta.is_file().then_some(current);
        }
        let target = std::fs::read_link(&current).ok()?;
        current = match target.strip_prefix("/") {
            Ok(inside) => root.join(inside),
            Err(_) => current.parent()?.join(target),
        };
    }
    None
}

/// The control nodes (`/dev/nvidiactl`, ...) present under `devfs_root`.
pub fn present_control_nodes(devfs_root: &Path) -> Vec<String> {
    CONTROL_NODES.iter().filter(|n| devfs_root.join(n).exists()).map(|n| n.to_string()).collect()
}

/// How one device is described to the container runtime.
pub struct Target<'a> {
    /// The kubelet device ID (the UUID).
    pub uuid: &'a str,
    /// `index` strategy name: `3` or `3:1` for a MIG device.
    pub index_name: &'a str,
    /// Minor of `/dev/nvidiaN` (the parent's for a MIG device).
    pub minor: Option<u32>,
}

/// The edits of one device under `config`'s strategies.
pub fn device_edits(config: &Config, files: &DriverFiles, control_nodes: &[String], target: &Target<'_>) -> Edits {
    let mut edits = Edits::default();
    let name = match config.id_strategy {
        IdStrategy::Uuid => target.uuid,
        IdStrategy::Index => target.index_name,
    };
    if config.list.envvar {
        edits.env.push(("NVIDIA_VISIBLE_DEVICES".into(), name.into()));
    }
    if config.list.cdi {
        edits.cdi.push(format!("{}={name}", config.cdi_kind));
    }
    // With `cdi` the same nodes and files define the device's CDI name: devhost writes them into
    // its spec under that name and hands out the name instead (docs/features.md).
    if config.list.describes_nodes() {
        let gpu_node = target.minor.map(|m| format!("nvidia{m}"));
        for node in control_nodes.iter().chain(gpu_node.iter()) {
            let host = config.devfs_root.join(node).to_string_lossy().into_owned();
            edits.device_nodes.push((host, format!("/dev/{node}"), "rw".into()));
        }
        // No PATH or LD_LIBRARY_PATH: a variable would replace the image's own value.
        let spread = |mounts: &[Mount], from: &str, dirs: &[&str], out: &mut Vec<(String, String, bool)>| {
            for m in mounts {
                let host = m.host.to_string_lossy().into_owned();
                let name = m.container.strip_prefix(from).unwrap_or(&m.container);
                out.extend(dirs.iter().map(|dir| (host.clone(), format!("{dir}{name}"), true)));
            }
        };
        spread(&files.libraries, CONTAINER_LIB_DIR, &CONTAINER_LIB_DIRS, &mut edits.mounts);
        spread(&files.binaries, CONTAINER_BIN_DIR, &CONTAINER_BIN_DIRS, &mut edits.mounts);
    }
    edits
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    #[test]
    fn absolute_links_resolve_inside_the_driver_root() {
        let root = tempfile::tempdir().unwrap();
        let lib = root.path().join("usr/lib64");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libcuda.so.550.54.15"), "").unwrap();
        symlink("/usr/lib64/libcuda.so.550.54.15", lib.join("libcuda.so.1")).unwrap();
        symlink("libcuda.so.1", lib.join("libcuda.so")).unwrap();
        symlink("missing", lib.join("libnvidia-ml.so.1")).unwrap();
        let real = lib.join("libcuda.so.550.54.15");
        assert_eq!(resolve_in_root(root.path(), &lib.join("libcuda.so")), Some(real.clone()));
        assert_eq!(resolve_in_root(root.path(), &lib.join("libnvidia-ml.so.1")), None);
    }

    #[test]
    fn library_names_match_whole_prefixes_only() {
        let root = tempfile::tempdir().unwrap();
        let lib = root.path().join("usr/lib/x86_64-linux-gnu");
        std::fs::create_dir_all(&lib).unwrap();
        for name in ["libcuda.so.1", "libcudart.so.12", "libcudadebugger.so.1", "libnvidia-ml.so.1", "libnvidia-mlx.so"]
        {
            std::fs::write(lib.join(name), "").unwrap();
        }
        let files = find_driver_files(root.path());
        let names: Vec<&str> = files.libraries.iter().map(|m| m.container.as_str()).collect();
        assert_eq!(
            names,
            vec![
                "/usr/local/nvidia/lib64/libcuda.so.1",
                "/usr/local/nvidia/lib64/libcudadebugger.so.1",
                "/usr/local/nvidia/lib64/libnvidia-ml.so.1"
            ]
        );
    }
}
