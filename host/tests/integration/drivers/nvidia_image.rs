//! NVIDIA `device-nodes` for an image whose `PATH` and `LD_LIBRARY_PATH` are its own: the real
//! daemon's Allocate answer (and the CDI spec it writes) sets neither, and what it mounts is
//! found by a container anyway. The container is a tiny root filesystem made here (the host's
//! dynamic loader and libc, no `ld.so.cache`, a probe program under `/opt/app/bin`); the
//! Allocate mounts are applied with real bind mounts in a private mount namespace (`unshare`),
//! and the probe runs under `chroot` with the image's own environment: it `dlopen`s
//! `libnvidia-ml.so.1` (the fake NVML, mounted from `driver_root`) through the loader's search
//! path, asks it for its GPUs, and runs `nvidia-smi` by name through the image's `PATH`.
//! Needs root or unprivileged user namespaces; says so and skips otherwise.

use crate::common::*;
use std::path::{Path, PathBuf};
use std::process::Command;

const GPU: &str = "GPU-0e5b9c2a-1d3f-4a6b-8c7d-000000000000";
/// The image's own values, unlike anything the NVIDIA driver would set.
const IMAGE_PATH: &str = "/opt/app/bin:/usr/bin";
const IMAGE_LD_LIBRARY_PATH: &str = "/opt/app/lib";

const MACHINE: &str = r#"topology_default = "node"
[[gpu]]
uuid = "GPU-0e5b9c2a-1d3f-4a6b-8c7d-000000000000"
name = "NVIDIA H100 80GB HBM3"
memory_mib = 81559
pci_bus_id = "00000000:18:00.0"
minor = 0
"#;

const PROBE: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <unistd.h>
int main(void) {
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (h == NULL) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
    int (*init)(void) = (int (*)(void))dlsym(h, "nvmlInit_v2");
    int (*count)(unsigned *) = (int (*)(unsigned *))dlsym(h, "nvmlDeviceGetCount_v2");
    unsigned n = 0;
    if (init == NULL || count == NULL || init() != 0 || count(&n) != 0) { fprintf(stderr, "NVML calls failed\n"); return 3; }
    struct link_map *map = NULL;
    dlinfo(h, RTLD_DI_LINKMAP, &map);
    printf("nvml: %u GPU(s) from %s\n", n, map ? map->l_name : "?");
    fflush(stdout);
    execlp("nvidia-smi", "nvidia-smi", (char *)NULL);
    perror("execlp nvidia-smi");
    return 4;
}
"#;

const SMI: &str = r#"
#include <stdio.h>
int main(void) { puts("nvidia-smi from driver_root"); return 0; }
"#;

fn cc(src: &str, out: &Path) {
    let c = out.with_extension("c");
    std::fs::write(&c, src).unwrap();
    let st = Command::new("cc").args(["-std=c11", "-Wall", "-Werror", "-o"]).arg(out).arg(&c).arg("-ldl").status();
    assert!(st.expect("run cc").success(), "compiling {}", c.display());
}

/// Copies `bin` and every library `ldd` resolves for it into `root`, each at its own path.
fn copy_with_libraries(bin: &Path, root: &Path) {
    let out = Command::new("ldd").arg(bin).output().expect("run ldd");
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let path = line.split("=>").last().and_then(|r| r.split_whitespace().next()).unwrap_or("");
        if path.starts_with('/') {
            let to = root.join(path.trim_start_matches('/'));
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(path, &to).unwrap_or_else(|e| panic!("copy {path}: {e}"));
        }
    }
}

/// How to get a private mount namespace here: as root, or in a user namespace.
fn unshare_args() -> Option<Vec<&'static str>> {
    [vec!["-m"], vec!["-r", "-m"]]
        .into_iter()
        .find(|args| Command::new("unshare").args(args).arg("true").status().is_ok_and(|s| s.success()))
}

/// The node: fake NVML for the daemon, a driver root with the "real" driver files, the manifest.
fn setup(node: &Node, smi: &Path) -> PathBuf {
    let root = node.path();
    let nvml = root.join("nvml");
    std::fs::create_dir_all(&nvml).unwrap();
    let fake = devhost_bin().parent().unwrap().join("libfake_nvml.so");
    assert!(fake.exists(), "{} is missing: run `cargo build --workspace` first", fake.display());
    std::fs::copy(&fake, nvml.join("libnvidia-ml.so.1")).unwrap();
    std::fs::write(nvml.join("fake-nvml.toml"), MACHINE).unwrap();
    std::fs::create_dir_all(root.join("dev")).unwrap();
    std::fs::write(root.join("dev/nvidiactl"), "").unwrap();
    std::fs::write(root.join("dev/nvidia0"), "").unwrap();
    let lib = root.join(format!("driver/usr/lib/{}-linux-gnu", std::env::consts::ARCH));
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::copy(&fake, lib.join("libnvidia-ml.so.550.54.15")).unwrap();
    std::os::unix::fs::symlink("libnvidia-ml.so.550.54.15", lib.join("libnvidia-ml.so.1")).unwrap();
    std::fs::create_dir_all(root.join("driver/usr/bin")).unwrap();
    std::fs::copy(smi, root.join("driver/usr/bin/nvidia-smi")).unwrap();
    node.write_manifest(&format!(
        r#"cdi_dir = "{root}/cdi"
[driver.nvidia]
module = "{module}"
[driver.nvidia.options]
nvml_lib = "{root}/nvml/libnvidia-ml.so.1"
sysfs_root = "{root}/sys"
devfs_root = "{root}/dev"
driver_root = "{root}/driver"
device_list_strategy = "device-nodes"
[[resource]]
name = "nvidia.com/gpu"
driver = "nvidia"
"#,
        module = module("nvidia").display(),
        root = root.display(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_nodes_leave_the_images_paths_alone_and_its_loader_and_path_find_the_driver() {
    let node = Node::new();
    let work = node.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let (probe, smi) = (work.join("probe"), work.join("nvidia-smi"));
    cc(PROBE, &probe);
    cc(SMI, &smi);
    let manifest = setup(&node, &smi);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let _d = Daemon::start(&manifest, &node.kubelet_dir());
    kubelet.wait_devices("nvidia.com/gpu", WAIT, |d| d.len() == 1).await.unwrap();
    let resp = kubelet.allocate("nvidia.com/gpu", vec![vec![GPU.into()]]).await.unwrap();
    let c = &resp.container_responses[0];

    // Nothing replaces the image's PATH or LD_LIBRARY_PATH, neither in Allocate nor in the CDI spec.
    for key in ["PATH", "LD_LIBRARY_PATH"] {
        assert_eq!(c.envs.get(key), None, "Allocate sets {key}: {:?}", c.envs);
    }
    let cdi: Vec<PathBuf> = std::fs::read_dir(node.path().join("cdi")).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(!cdi.is_empty(), "no CDI spec written");
    for spec in &cdi {
        let text = std::fs::read_to_string(spec).unwrap();
        assert!(text.contains("libnvidia-ml.so.1") && !text.contains("PATH="), "{}:\n{text}", spec.display());
    }

    let Some(unshare) = unshare_args() else {
        eprintln!("SKIPPED the container run: `unshare -m` needs root or unprivileged user namespaces here");
        return;
    };
    // The image: loader and libc (no ld.so.cache), its own program, its own environment.
    let rootfs = node.path().join("rootfs");
    std::fs::create_dir_all(rootfs.join("opt/app/bin")).unwrap();
    std::fs::create_dir_all(rootfs.join("opt/app/lib")).unwrap();
    std::fs::create_dir_all(rootfs.join("etc")).unwrap();
    std::fs::copy(&probe, rootfs.join("opt/app/bin/probe")).unwrap();
    copy_with_libraries(&probe, &rootfs);
    copy_with_libraries(&devhost_bin().parent().unwrap().join("libfake_nvml.so"), &rootfs);
    std::fs::write(rootfs.join("etc/fake-nvml.toml"), MACHINE).unwrap();
    // `env` to start the probe with the image's environment only (a plain copy of the host's).
    std::fs::create_dir_all(rootfs.join("usr/bin")).unwrap();
    std::fs::copy("/usr/bin/env", rootfs.join("usr/bin/env")).unwrap();
    copy_with_libraries(Path::new("/usr/bin/env"), &rootfs);
    // The runtime's part: every mount of the Allocate answer, as bind mounts.
    let mut script = String::from("set -e\n");
    for m in &c.mounts {
        let target = format!("{}{}", rootfs.display(), m.container_path);
        let parent = Path::new(&target).parent().unwrap().display().to_string();
        script += &format!("mkdir -p '{parent}'; touch '{target}'; mount --bind '{}' '{target}'\n", m.host_path);
    }
    script += &format!(
        "exec chroot '{}' /usr/bin/env -i PATH={IMAGE_PATH} LD_LIBRARY_PATH={IMAGE_LD_LIBRARY_PATH} \
         FAKE_NVML_MACHINE=/etc/fake-nvml.toml /opt/app/bin/probe\n",
        rootfs.display()
    );
    let out = Command::new("unshare").args(&unshare).args(["sh", "-c", &script]).output().expect("run unshare");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the container run failed ({}):\n{stdout}{stderr}\nscript:\n{script}", out.status);
    let multiarch = format!("/usr/lib/{}-linux-gnu/libnvidia-ml.so.1", std::env::consts::ARCH);
    assert!(stdout.contains(&format!("nvml: 1 GPU(s) from {multiarch}")), "{stdout}{stderr}");
    assert!(stdout.contains("nvidia-smi from driver_root"), "{stdout}{stderr}");
}
