//! SIGHUP re-reads the manifest and applies only the difference: untouched
//! resources keep their sockets and streams, a newly dropped module can be
//! enabled, and an invalid manifest is refused while the old one serves.

use crate::common::*;
use std::os::unix::fs::MetadataExt;
use std::time::Duration;

fn hup(d: &Daemon) {
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGHUP) };
}

fn inode(node: &Node, sock: &str) -> u64 {
    std::fs::metadata(node.kubelet_dir().join(sock)).unwrap().ino()
}

fn body(dir: &std::path::Path, resources: &str) -> String {
    format!(
        r#"
driver_dir = "{}"
[driver.example_c]
options = {{ count = 4 }}
[driver.example_rust]
options = {{ count = 2 }}
{resources}
"#,
        dir.display()
    )
}

const A: &str = "[[resource]]\nname = \"example.com/a\"\ndriver = \"example_c\"\nmatch = { model = \"example-*\" }\n";

/// A daemon serving `A` (the example_c driver's 4 devices), once the kubelet lists them.
struct Serving {
    node: Node,
    dir: std::path::PathBuf,
    m: std::path::PathBuf,
    kubelet: Kubelet,
    d: Daemon,
}

async fn serving_a() -> Serving {
    let node = Node::new();
    let dir = module("example_c").parent().unwrap().to_path_buf();
    let m = node.write_manifest(&body(&dir, A));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/a", WAIT, |x| x.len() == 4).await.unwrap();
    Serving { node, dir, m, kubelet, d }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_applies_only_the_difference() {
    let node = Node::new();
    let dir = module("example_c").parent().unwrap().to_path_buf();
    let a = "[[resource]]\nname = \"example.com/a\"\ndriver = \"example_c\"\nmatch = { index = \"0\" }\n";
    let b = "[[resource]]\nname = \"example.com/b\"\ndriver = \"example_rust\"\n";
    let d1 = "[[resource]]\nname = \"example.com/d\"\ndriver = \"example_c\"\nmatch = { index = \"1\" }\n";
    let d2 = "[[resource]]\nname = \"example.com/d\"\ndriver = \"example_c\"\nmatch = { index = \"2\" }\n";
    let c = "[[resource]]\nname = \"example.com/c\"\ndriver = \"example_c\"\nmatch = { index = \"3\" }\n";
    let m = node.write_manifest(&body(&dir, &format!("{a}{b}{d1}")));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    for r in ["example.com/a", "example.com/b", "example.com/d"] {
        kubelet.wait_registered(r, WAIT).await.unwrap();
    }
    kubelet.wait_devices("example.com/d", WAIT, |x| x.len() == 1 && x[0].id == "example-1").await.unwrap();
    kubelet.wait_devices("example.com/a", WAIT, |x| x.len() == 1).await.unwrap();
    let a_inode = inode(&node, "devhost-example.com_a.sock");
    let a_lists = kubelet.list_count("example.com/a");

    std::fs::write(&m, body(&dir, &format!("{a}{d2}{c}"))).unwrap();
    hup(&d);
    kubelet.wait_registered("example.com/c", WAIT).await.unwrap();
    kubelet.wait_devices("example.com/d", WAIT, |x| x.len() == 1 && x[0].id == "example-2").await.unwrap();
    d.wait_log("reload applied", WAIT).await;
    // Untouched: same socket, one registration, its stream still open.
    assert_eq!(inode(&node, "devhost-example.com_a.sock"), a_inode);
    assert_eq!(kubelet.registration_count("example.com/a"), 1);
    assert!(kubelet.is_connected("example.com/a"));
    assert_eq!(kubelet.list_count("example.com/a"), a_lists, "no new list was needed for a");
    // Changed: registered again. Removed: socket gone, stream ended.
    assert_eq!(kubelet.registration_count("example.com/d"), 2);
    assert!(!node.kubelet_dir().join("devhost-example.com_b.sock").exists());
    kubelet.wait_disconnected("example.com/b", WAIT).await.unwrap();
    let resp = kubelet.allocate("example.com/a", vec![vec!["example-0".into()]]).await.unwrap();
    assert_eq!(env_of(&resp, 0, "EXAMPLE_ALLOCATED").as_deref(), Some("example-0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newly_dropped_module_is_enabled_by_sighup() {
    let node = Node::new();
    let drivers = node.path().join("drivers");
    std::fs::create_dir_all(&drivers).unwrap();
    std::fs::copy(module("example_c"), drivers.join("libdevhost_example_c.so")).unwrap();
    let late = "[[resource]]\nname = \"example.com/late\"\ndriver = \"example_rust\"\n";
    let m = node.write_manifest(&body(&drivers, &format!("{A}{late}")));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_registered("example.com/a", WAIT).await.unwrap();
    d.wait_log("no module file found", WAIT).await;
    assert!(!kubelet.resources().contains(&"example.com/late".to_string()));

    std::fs::copy(module("example_rust"), drivers.join("libdevhost_example_rust.so")).unwrap();
    hup(&d);
    let devs = kubelet.wait_devices("example.com/late", WAIT, |x| x.len() == 2).await.unwrap();
    assert_eq!(devs[0].id, "rex-0");
    assert_eq!(kubelet.registration_count("example.com/a"), 1, "the running resource was not touched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_new_manifest_is_rejected_and_the_old_one_keeps_serving() {
    let Serving { node: _node, dir: _, m, kubelet, d } = serving_a().await;
    std::fs::write(&m, "[[resource]]\nname = \"no-slash\"\ndriver = \"example_c\"\n").unwrap();
    hup(&d);
    let log = d.wait_log("new manifest rejected", WAIT).await;
    assert!(log.contains("devhost.toml:2:"), "the error names the line: {log}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(kubelet.is_connected("example.com/a"));
    assert_eq!(kubelet.registration_count("example.com/a"), 1);
    let resp = kubelet.allocate("example.com/a", vec![vec!["example-1".into()]]).await.unwrap();
    assert_eq!(env_of(&resp, 0, "EXAMPLE_ALLOCATED").as_deref(), Some("example-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn editing_the_file_reloads_it_without_a_signal() {
    let Serving { node, dir, m, kubelet, d } = serving_a().await;
    // As a ConfigMap volume does: the new text lands under a new name, then replaces the file.
    let late = "[[resource]]\nname = \"example.com/late\"\ndriver = \"example_rust\"\n";
    let tmp = node.path().join("..data_tmp");
    std::fs::write(&tmp, body(&dir, &format!("{A}{late}"))).unwrap();
    std::fs::rename(&tmp, &m).unwrap();
    kubelet.wait_devices("example.com/late", WAIT, |x| x.len() == 2).await.unwrap();
    d.wait_log("the manifest file changed: reloading", WAIT).await;
    assert_eq!(kubelet.registration_count("example.com/a"), 1);
}

/// A ConfigMap volume as the kubelet lays it out: the file is a link through
/// `..data` to a timestamped folder, and an update swaps `..data` (a new
/// link renamed over it) and removes the old folder; the file's own link
/// never changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_volume_update_reloads_it_without_a_signal() {
    use std::os::unix::fs::symlink;
    let node = Node::new();
    let dir = module("example_c").parent().unwrap().to_path_buf();
    let volume = node.path().join("config");
    let first = volume.join("..2026_12_02_10_00_00.000000001");
    std::fs::create_dir_all(&first).unwrap();
    std::fs::write(first.join("devhost.toml"), body(&dir, A)).unwrap();
    symlink(first.file_name().unwrap(), volume.join("..data")).unwrap();
    symlink("..data/devhost.toml", volume.join("devhost.toml")).unwrap();
    let m = volume.join("devhost.toml");
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/a", WAIT, |x| x.len() == 4).await.unwrap();

    let late = "[[resource]]\nname = \"example.com/late\"\ndriver = \"example_rust\"\n";
    let second = volume.join("..2026_12_02_10_05_00.000000002");
    std::fs::create_dir_all(&second).unwrap();
    std::fs::write(second.join("devhost.toml"), body(&dir, &format!("{A}{late}"))).unwrap();
    symlink(second.file_name().unwrap(), volume.join("..data_tmp")).unwrap();
    std::fs::rename(volume.join("..data_tmp"), volume.join("..data")).unwrap();
    std::fs::remove_dir_all(&first).unwrap();
    kubelet.wait_devices("example.com/late", WAIT, |x| x.len() == 2).await.unwrap();
    d.wait_log("the manifest file changed: reloading", WAIT).await;
    assert_eq!(kubelet.registration_count("example.com/a"), 1, "the running resource was not touched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moving_an_entry_in_the_file_restarts_nothing() {
    let Serving { node: _node, dir, m, kubelet, d } = serving_a().await;
    std::fs::write(&m, format!("# a comment moves every line down\n\n{}", body(&dir, A))).unwrap();
    let log = d.wait_log("reload applied", WAIT).await;
    assert!(log.contains("unchanged=example.com/a"), "{log}");
    assert_eq!(kubelet.registration_count("example.com/a"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_disabled_by_a_panic_comes_back_on_reload() {
    let node = Node::new();
    let m = node.write_manifest(&format!(
        "[driver.t]\nmodule = \"{}\"\noptions = {{ panic_in = \"allocate\" }}\n[[resource]]\nname = \"example.com/t\"\ndriver = \"t\"\n",
        module("testdrv").display()
    ));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/t", WAIT, |x| x.len() == 4).await.unwrap();
    kubelet.allocate("example.com/t", vec![vec!["t-0".into()]]).await.unwrap_err();
    kubelet.wait_devices("example.com/t", WAIT, |x| x.iter().all(|d| d.health == "Unhealthy")).await.unwrap();
    hup(&d);
    kubelet.wait_devices("example.com/t", WAIT, |x| x.iter().all(|d| d.health == "Healthy")).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_module_replaced_on_disk_is_loaded_by_the_next_reload() {
    let node = Node::new();
    let drivers = node.path().join("drivers");
    std::fs::create_dir_all(&drivers).unwrap();
    let so = drivers.join("libdevhost_x.so");
    std::fs::copy(module("example_c"), &so).unwrap();
    let m = node.write_manifest(&format!(
        "driver_dir = \"{}\"\n[driver.x]\nisolation = \"in-process\"\noptions = {{ count = 2 }}\n[[resource]]\nname = \"example.com/x\"\ndriver = \"x\"\n",
        drivers.display()
    ));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/x", WAIT, |x| x.len() == 2).await.unwrap();
    // A new version lands (a new file renamed over the old one): nothing
    // changes until the reload, which loads it even with an unchanged table.
    let tmp = drivers.join("new.tmp");
    std::fs::copy(module("example_rust"), &tmp).unwrap();
    std::fs::rename(&tmp, &so).unwrap();
    kubelet.allocate("example.com/x", vec![vec!["example-1".into()]]).await.unwrap();
    hup(&d);
    d.wait_log("the module file changed on disk; loading the new file", WAIT).await;
    kubelet
        .wait_devices("example.com/x", WAIT, |x| x.len() == 2 && x.iter().all(|d| d.id.starts_with("rex-")))
        .await
        .unwrap();
    kubelet.allocate("example.com/x", vec![vec!["rex-1".into()]]).await.unwrap();
    // Touched but not changed: the next reload keeps the instance.
    let bytes = std::fs::read(&so).unwrap();
    std::fs::write(&so, bytes).unwrap();
    hup(&d);
    let start = std::time::Instant::now();
    while d.logs().matches("reload applied").count() < 2 {
        assert!(start.elapsed() < WAIT, "the second reload never applied: {}", d.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(d.logs().matches("the module file changed on disk").count(), 1, "{}", d.logs());
}

/// A reload that changes one resource and adds a driver whose create hangs
/// for 5 s: the changed resource is served again at once, and the resource
/// it replaces served until then; the new driver's resource follows when its
/// create returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_serves_each_changed_resource_as_soon_as_its_own_driver_is_in() {
    let Serving { node: _node, dir, m, kubelet, d } = serving_a().await;
    let fewer = "[[resource]]\nname = \"example.com/a\"\ndriver = \"example_c\"\nmatch = { index = \"0\" }\n";
    let slow = format!(
        "[driver.slow]\nmodule = \"{}\"\noptions = {{ count = 1, hang_in = \"create\", hang_ms = 5000 }}\n\
         [[resource]]\nname = \"example.com/slow\"\ndriver = \"slow\"\n",
        module("testdrv").display()
    );
    std::fs::write(&m, body(&dir, &format!("{fewer}{slow}"))).unwrap();
    let t = std::time::Instant::now();
    hup(&d);
    kubelet.wait_devices("example.com/a", WAIT, |x| x.len() == 1).await.unwrap();
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "the changed resource came back {took:?} after the reload, held back by another driver's create; log:\n{}",
        d.logs()
    );
    assert_eq!(kubelet.registration_count("example.com/slow"), 0, "the slow driver is still in create");
    assert_eq!(kubelet.registration_count("example.com/a"), 2, "the changed resource registers again, once");
    kubelet.wait_devices("example.com/slow", WAIT, |x| x.len() == 1).await.unwrap();
    assert!(t.elapsed() >= Duration::from_secs(5), "the slow resource came before its create returned");
    d.wait_log("reload applied", WAIT).await;
    assert_eq!(kubelet.registration_count("example.com/a"), 2);
}

/// A DRA front that cannot start (its kubeconfig is missing) is tried once
/// per apply, however many installs the apply makes (two drivers here), and
/// again at the next reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dra_front_that_cannot_start_is_tried_once_per_apply() {
    let node = Node::new();
    let dir = module("example_c").parent().unwrap().to_path_buf();
    let dra = format!(
        "kubeconfig = \"{}\"\nkubelet_root_dir = \"{}\"\n",
        node.path().join("no-such-kubeconfig").display(),
        node.path().join("kubelet-root").display()
    );
    let resources = "[[resource]]\nname = \"example.com/accel\"\ndriver = \"example_c\"\napi = \"dra\"\n\
                     [[resource]]\nname = \"example.com/b\"\ndriver = \"example_rust\"\n";
    let m = node.write_manifest(&format!("{dra}{}", body(&dir, resources)));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    kubelet.wait_devices("example.com/b", WAIT, |x| x.len() == 2).await.unwrap();
    let tries = |log: &str| log.lines().filter(|l| l.contains("not served") && l.contains("dra_driver")).count();
    d.wait_log("not served", WAIT).await;
    // Both drivers are in: every install of the start has been synced.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(tries(&d.logs()), 1, "{}", d.logs());
    hup(&d);
    d.wait_log("reload applied", WAIT).await;
    let deadline = std::time::Instant::now() + WAIT;
    while tries(&d.logs()) < 2 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(tries(&d.logs()), 2, "tried again once by the reload: {}", d.logs());
}

/// A reload that changes one resource of a driver it keeps: the resource is served again with
/// the device its new entry selects. The kept driver's rescan used to be started before the
/// new resources were installed, so on a node of many drivers it could publish to the old
/// resource, and the new one registered with no devices until the driver's next change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_of_one_resource_among_many_kept_drivers_serves_its_new_device() {
    const DRIVERS: usize = 16;
    let node = Node::new();
    let so = module("example_c");
    let text = |moved_to: usize| {
        let mut m = String::new();
        for k in 0..DRIVERS {
            // Drivers in process (the quickest scans) and isolated, alternately.
            let isolation = if k % 2 == 0 { "in-process" } else { "process" };
            m.push_str(&format!(
                "[driver.c{k:02}]\nmodule = \"{}\"\nisolation = \"{isolation}\"\noptions = {{ count = 2 }}\n\n",
                so.display()
            ));
        }
        for k in 0..DRIVERS {
            // Driver c00 comes first in the apply's order: its rescan starts before the others'.
            let index = if k == 0 { moved_to } else { 0 };
            m.push_str(&format!(
                "[[resource]]\nname = \"example.com/r{k}\"\ndriver = \"c{k:02}\"\nmatch = {{ id = \"example-{index}\" }}\n\n"
            ));
        }
        m
    };
    let m = node.write_manifest(&text(0));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    for k in 0..DRIVERS {
        kubelet.wait_devices(&format!("example.com/r{k}"), WAIT, |x| x.len() == 1).await.unwrap();
    }
    for round in 1..=8 {
        let want = format!("example-{}", round % 2);
        std::fs::write(&m, text(round % 2)).unwrap();
        hup(&d);
        if let Err(e) = kubelet.wait_devices("example.com/r0", WAIT, |x| x.len() == 1 && x[0].id == want).await {
            panic!("reload {round}: example.com/r0 is not served with {want}: {e}\nlog:\n{}", d.logs());
        }
        for k in 1..DRIVERS {
            let r = format!("example.com/r{k}");
            kubelet.wait_devices(&r, WAIT, |x| x.len() == 1 && x[0].id == "example-0").await.unwrap();
        }
    }
}

/// Reloads of random manifests over a few drivers (kept, replaced when their options or isolation
/// change) and resources (moved between drivers and devices, dropped, added back), some racing a
/// kubelet restart or a worker process's crash: after every reload each resource the manifest
/// names is served with exactly the device its entry selects, and once all is done, Healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_reloads_always_end_with_every_resource_serving_what_its_entry_selects() {
    const DRIVERS: usize = 6;
    const RESOURCES: usize = 6;
    const RELOADS: usize = 120;
    // DEVHOST_TEST_SEED=N tries other manifests; a failure names its seed.
    // (xorshift stays at 0 from 0: any other seed will do.)
    let first_seed =
        std::env::var("DEVHOST_TEST_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0x5eed_d00d_u64).max(1);
    let mut seed = first_seed;
    let (mut restarts, mut restarted, mut kills) = (first_seed, 0, [0; DRIVERS]);
    let mut below = |n: usize| {
        // xorshift64*: deterministic, so that a failure replays.
        seed ^= seed >> 12;
        seed ^= seed << 25;
        seed ^= seed >> 27;
        (seed.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    };
    let node = Node::new();
    let so = module("example_c");
    // Each driver's (count, isolated); each resource's (driver, index), or None when left out.
    // Driver dK names its devices dK-0, dK-1, ...: an ID says which driver serves it.
    let mut drivers: Vec<(usize, bool)> = (0..DRIVERS).map(|k| (4, k % 2 == 1)).collect();
    let mut resources: Vec<Option<(usize, usize)>> = (0..RESOURCES).map(|r| Some((r % DRIVERS, 0))).collect();
    let text = |drivers: &[(usize, bool)], resources: &[Option<(usize, usize)>]| {
        let mut m = String::new();
        for (k, (count, isolated)) in drivers.iter().enumerate() {
            let isolation = if *isolated { "process" } else { "in-process" };
            m.push_str(&format!(
                "[driver.d{k}]\nmodule = \"{}\"\nisolation = \"{isolation}\"\noptions = {{ count = {count}, prefix = \"d{k}\" }}\n\n",
                so.display()
            ));
        }
        for (r, sel) in resources.iter().enumerate() {
            if let Some((k, i)) = sel {
                m.push_str(&format!(
                    "[[resource]]\nname = \"example.com/r{r}\"\ndriver = \"d{k}\"\nmatch = {{ id = \"d{k}-{i}\" }}\n\n"
                ));
            }
        }
        m
    };
    let m = node.write_manifest(&text(&drivers, &resources));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    for round in 0..=RELOADS {
        if round > 0 {
            // A driver or two change (count 3 to 5, or isolation): replaced instances.
            for _ in 0..below(3) {
                let k = below(DRIVERS);
                match below(2) {
                    0 => drivers[k].0 = 3 + below(3),
                    _ => drivers[k].1 = !drivers[k].1,
                }
            }
            // Resources move, leave or come back; no device is selected twice.
            let mut taken = std::collections::HashSet::new();
            for sel in resources.iter_mut() {
                *sel = match below(6) {
                    0 => None,
                    1 | 2 => *sel,
                    _ => Some((below(DRIVERS), below(3))),
                };
                if let Some((k, i)) = *sel
                    && (i >= drivers[k].0 || !taken.insert((k, i)))
                {
                    *sel = None;
                }
            }
            std::fs::write(&m, text(&drivers, &resources)).unwrap();
            hup(&d);
            // One reload in four races a kubelet restart (drawn apart, so the manifests stay
            // those of the seed).
            restarts = restarts.rotate_left(7) ^ (round as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            if restarts % 4 == 0 {
                kubelet.restart().unwrap();
                restarted += 1;
            }
            // One reload in eight races the crash of an isolated driver's worker process; each
            // driver's at most three times, so that its restart backoff stays under a second.
            if (restarts >> 8) % 8 == 0 {
                let isolated: Vec<usize> = (0..DRIVERS).filter(|k| drivers[*k].1 && kills[*k] < 3).collect();
                if !isolated.is_empty() {
                    let k = isolated[(restarts >> 16) as usize % isolated.len()];
                    if let Some(pid) = worker_of(d.child.id(), &format!("d{k}")) {
                        // SAFETY: kill(2) on a worker process of our own child.
                        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                        kills[k] += 1;
                    }
                }
            }
        }
        for (r, sel) in resources.iter().enumerate() {
            let Some((k, i)) = sel else { continue };
            let (name, want) = (format!("example.com/r{r}"), format!("d{k}-{i}"));
            let served =
                |x: &[devhost_proto::v1beta1::Device]| x.len() == 1 && x[0].id == want && x[0].health == "Healthy";
            if let Err(e) = kubelet.wait_devices(&name, WAIT, served).await {
                panic!(
                    "seed {first_seed}, reload {round}: {name} (driver d{k}) is not served with {want}: {e}\nmanifest:\n{}\nlog:\n{}",
                    text(&drivers, &resources),
                    d.logs()
                );
            }
        }
    }
    assert!(restarted > RELOADS / 8, "seed {first_seed}: only {restarted} kubelet restarts in {RELOADS} reloads");
    let killed: usize = kills.iter().sum();
    assert!(killed > RELOADS / 32, "seed {first_seed}: only {killed} workers killed in {RELOADS} reloads");
    eprintln!("seed {first_seed}: {RELOADS} reloads, {restarted} kubelet restarts, {killed} workers killed");
    // A check above may have passed on a list from before a reload: once every reload is
    // applied and the registrations are done, each resource still serves its device.
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        // SIGHUPs that come during an apply are one reload: count the reloads begun.
        let log = d.logs();
        if log.matches(": reloading ").count() == log.matches("reload applied").count() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "seed {first_seed}: a reload never finished; log:\n{log}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // First scans and registrations finish in the background, in milliseconds; a killed worker
    // comes back after its backoff (at most 10 s), its devices Healthy again.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for (r, sel) in resources.iter().enumerate() {
        let Some((k, i)) = sel else { continue };
        let (name, want) = (format!("example.com/r{r}"), format!("d{k}-{i}"));
        let served = |x: &[devhost_proto::v1beta1::Device]| x.len() == 1 && x[0].id == want && x[0].health == "Healthy";
        if let Err(e) = kubelet.wait_devices(&name, WAIT, served).await {
            panic!("seed {first_seed}: {name} at the end: {e}\nlog:\n{}", d.logs());
        }
        assert!(kubelet.is_connected(&name), "seed {first_seed}: {name} is not connected at the end");
    }
}
