//! Modules run from a private copy: a module file overwritten in place
//! (`cp new.so old.so`: truncate, then write) while the daemon serves
//! changes nothing in the running daemon; the next reload reads the new
//! file, checks its pin, and loads it.

use crate::common::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn hup(d: &Daemon) {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGHUP) };
}

fn sha256(path: &Path) -> String {
    devhost::driver::loader::sha256_file(path).unwrap()
}

fn manifest(drivers: &Path, isolation: &str, pin: &str) -> String {
    format!(
        "driver_dir = \"{}\"\n[driver.x]\nisolation = \"{isolation}\"\nsha256 = \"{pin}\"\noptions = {{ count = 2 }}\n\
         [[resource]]\nname = \"example.com/x\"\ndriver = \"x\"\n",
        drivers.display()
    )
}

/// `cp` semantics: the same inode, truncated and written again.
fn overwrite_in_place(from: &Path, to: &Path) {
    let bytes = std::fs::read(from).unwrap();
    std::fs::write(to, bytes).unwrap();
}

async fn allocate_example(kubelet: &Kubelet, id: &str) {
    let resp = kubelet.allocate("example.com/x", vec![vec![id.to_string()]]).await.unwrap();
    assert_eq!(env_of(&resp, 0, "EXAMPLE_ALLOCATED").as_deref(), Some(id));
}

async fn overwrite_while_serving(isolation: &str) {
    let node = Node::new();
    let drivers = node.path().join("drivers");
    std::fs::create_dir_all(&drivers).unwrap();
    let so: PathBuf = drivers.join("libdevhost_x.so");
    std::fs::copy(module("example_c"), &so).unwrap();
    let new = module("example_rust");
    let m = node.write_manifest(&manifest(&drivers, isolation, &sha256(&so)));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let mut d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/x", WAIT, |x| x.len() == 2).await.unwrap();
    allocate_example(&kubelet, "example-0").await;

    overwrite_in_place(&new, &so);
    // Calls into the driver (its allocate hook and its own threads) keep
    // running the code that was loaded, for a good while.
    let start = Instant::now();
    let mut answered = 0;
    while start.elapsed() < Duration::from_secs(3) {
        allocate_example(&kubelet, "example-1").await;
        answered += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(answered > 10, "only {answered} Allocate calls in 3 s");
    assert!(d.child.try_wait().unwrap().is_none(), "devhost died; log:\n{}", d.logs());

    // A reload reads the new file: its bytes do not match the pin, so the
    // running instance keeps serving the old code.
    hup(&d);
    let log = d.wait_log("sha256 mismatch", WAIT).await;
    assert!(log.contains("the module file changed on disk; loading the new file"), "{log}");
    assert!(log.contains("the previous instance keeps serving"), "{log}");
    allocate_example(&kubelet, "example-0").await;

    // With the pin of the new file, the reload loads it.
    std::fs::write(&m, manifest(&drivers, isolation, &sha256(&new))).unwrap();
    hup(&d);
    kubelet.wait_devices("example.com/x", WAIT, |x| x.iter().any(|d| d.id == "rex-0")).await.unwrap();
    let resp = kubelet.allocate("example.com/x", vec![vec!["rex-0".into(), "rex-1".into()]]).await.unwrap();
    assert_eq!(env_of(&resp, 0, "REX_ALLOCATED_COUNT").as_deref(), Some("2"));
    assert!(d.child.try_wait().unwrap().is_none(), "devhost died; log:\n{}", d.logs());
    assert_eq!(d.terminate(WAIT).and_then(|s| s.code()), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_process_module_overwritten_in_place_keeps_serving_until_the_reload() {
    overwrite_while_serving("in-process").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_module_overwritten_in_place_keeps_serving_until_the_reload() {
    overwrite_while_serving("process").await;
}

/// A worker restarted after a crash runs the copy that was checked, not
/// what the file became meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_loads_the_checked_copy_not_the_overwritten_file() {
    let node = Node::new();
    let drivers = node.path().join("drivers");
    std::fs::create_dir_all(&drivers).unwrap();
    let so = drivers.join("libdevhost_x.so");
    compile_c(&repo_root().join("tests/fixtures/crash_driver.c"), &so, &abi_include());
    let arm = node.path().join("arm");
    let m = node.write_manifest(&format!(
        "driver_dir = \"{}\"\n[driver.x]\nisolation = \"process\"\npoll_interval = \"100ms\"\n\
         options = {{ crash_in = \"scan\", how = \"segv\", arm_file = \"{}\" }}\n\
         [[resource]]\nname = \"example.com/x\"\ndriver = \"x\"\n",
        drivers.display(),
        arm.display()
    ));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/x", WAIT, |x| x.len() == 2).await.unwrap();
    overwrite_in_place(&module("example_rust"), &so);
    std::fs::write(&arm, "").unwrap();
    d.wait_log("worker process restarted", WAIT).await;
    // The list right after the restart can still be the one sent while the worker was down (the
    // same devices, Unhealthy): wait for the restarted worker's own scan.
    kubelet
        .wait_devices("example.com/x", WAIT, |x| {
            x.len() == 2 && x.iter().all(|d| d.id.starts_with("crash-") && d.health == "Healthy")
        })
        .await
        .unwrap();
}

/// The hash of a module is taken from its sealed copy when first asked for
/// (start-up does not hash without a pin), so it names the bytes read even
/// after the file was overwritten in place; the file identity tells a
/// reload that the file changed.
#[test]
fn the_lazy_hash_is_of_the_bytes_read_not_of_the_file_now() {
    let dir = tempfile::tempdir().unwrap();
    let (c, rust) = (dir.path().join("c.so"), module("example_rust"));
    std::fs::copy(module("example_c"), &c).unwrap();
    let read_then = sha256(&c);
    let image = devhost::driver::loader::Image::read(&c).unwrap();
    assert!(!image.source.changed_on_disk());
    overwrite_in_place(&rust, &c);
    assert_eq!(image.source.sha256(), read_then, "the hash must be of the bytes read, not of the file now");
    assert_ne!(image.source.sha256(), sha256(&c));
    assert!(image.source.changed_on_disk());
}
