//! The daemon's life around the kubelet and the manifest, with the real
//! binary and the kubelet emulator: SIGTERM while the kubelet hangs, and
//! manifest edits that are half-written or remove resources.

use crate::common::*;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

fn driver(lock_dir: &Path) -> String {
    format!(
        "lock_dir = \"{}\"\n[driver.t]\nmodule = \"{}\"\noptions = {{ count = 4 }}\n",
        lock_dir.display(),
        module("testdrv").display()
    )
}

fn resource(letter: char, index: u32) -> String {
    format!("[[resource]]\nname = \"example.com/{letter}\"\ndriver = \"t\"\nmatch = {{ id = \"t-{index}\" }}\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_hung_kubelet_exits_at_once_and_removes_every_socket() {
    let node = Node::new();
    let letters = ['a', 'b', 'c', 'd'];
    let body: String = letters.iter().zip(0..).map(|(l, i)| resource(*l, i)).collect();
    let m = node.write_manifest(&format!("{}{body}", driver(&node.path().join("run"))));
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    kubelet.hold_register(true);
    let mut d = Daemon::start(&m, &node.kubelet_dir());
    // Every endpoint is serving and waiting for an answer that never comes.
    kubelet.wait_register_calls(letters.len() as u64, WAIT).await.unwrap();
    let sockets: Vec<_> =
        letters.iter().map(|l| node.kubelet_dir().join(format!("devhost-example.com_{l}.sock"))).collect();
    assert!(sockets.iter().all(|s| s.exists()));
    let start = Instant::now();
    let status = tokio::task::block_in_place(|| d.terminate(Duration::from_secs(8)));
    let took = start.elapsed();
    eprintln!("exited {took:?} after SIGTERM");
    let status = status.unwrap_or_else(|| panic!("no exit within 8 s; log:\n{}", d.logs()));
    assert!(status.success(), "{status:?}");
    // The overall stop deadline is 3 s; a stuck Register must not even use it.
    assert!(took < Duration::from_secs(4), "took {took:?}");
    for s in &sockets {
        assert!(!s.exists(), "{} left behind", s.display());
    }
    assert!(kubelet.socket_path().exists(), "kubelet.sock is not ours to remove");
    kubelet.hold_register(false);
}

fn three(node: &Node) -> (std::path::PathBuf, String) {
    let head = driver(&node.path().join("run"));
    let text = format!("{head}{}{}{}", resource('a', 0), resource('b', 1), resource('c', 2));
    (node.write_manifest(&text), head)
}

async fn serving(kubelet: &Kubelet, names: &[&str]) {
    for r in names {
        kubelet.wait_devices(r, WAIT, |d| d.len() == 1).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_written_in_pieces_is_applied_only_once_complete() {
    let node = Node::new();
    let (m, head) = three(&node);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    serving(&kubelet, &["example.com/a", "example.com/b", "example.com/c"]).await;
    // A slow writer: the first piece parses (the cut falls in a comment)
    // and names only resource a.
    let pieces = [
        format!("{head}{}# the rest follows", resource('a', 0)),
        format!(" soon\n{}", resource('b', 1)),
        format!("{}{}", resource('c', 2), resource('d', 3)),
    ];
    let mut file = std::fs::OpenOptions::new().write(true).truncate(true).open(&m).unwrap();
    for (i, piece) in pieces.iter().enumerate() {
        if i > 0 {
            // Each pause is well within the 1 s settle period, longer than the old 300 ms.
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
        file.write_all(piece.as_bytes()).unwrap();
        file.flush().unwrap();
    }
    drop(file);
    kubelet.wait_devices("example.com/d", WAIT, |d| d.len() == 1).await.unwrap();
    let log = d.wait_log("reload applied", WAIT).await;
    assert_eq!(log.matches("reload applied").count(), 1, "one reload, of the whole file:\n{log}");
    assert!(!log.contains("removed by this reload"), "{log}");
    for r in ["example.com/a", "example.com/b", "example.com/c"] {
        assert_eq!(kubelet.registration_count(r), 1, "{r} was restarted:\n{log}");
        assert!(kubelet.is_connected(r), "{r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_removes_a_resource_names_it() {
    let node = Node::new();
    let (m, head) = three(&node);
    let kubelet = Kubelet::start(&node.kubelet_dir()).unwrap();
    let d = Daemon::start(&m, &node.kubelet_dir());
    serving(&kubelet, &["example.com/a", "example.com/b", "example.com/c"]).await;
    // Written the atomic way the operator guide asks for: a new file renamed over the old one.
    let tmp = node.path().join("devhost.toml.new");
    std::fs::write(&tmp, format!("{head}{}{}", resource('a', 0), resource('c', 2))).unwrap();
    std::fs::rename(&tmp, &m).unwrap();
    kubelet.wait_disconnected("example.com/b", WAIT).await.unwrap();
    let log = d.wait_log("reload applied", WAIT).await;
    let removed: Vec<&str> = log.lines().filter(|l| l.contains("removed by this reload")).collect();
    assert_eq!(removed.len(), 1, "{log}");
    assert!(removed[0].contains("WARN") && removed[0].contains("resource=example.com/b"), "{}", removed[0]);
    assert_eq!(kubelet.registration_count("example.com/a"), 1);
    assert_eq!(kubelet.registration_count("example.com/c"), 1);
}
