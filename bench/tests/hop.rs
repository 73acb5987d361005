//! The hand-off floor (`null-server --hop`): the null plugin answers Allocate
//! on its gRPC task (`inline`) or across a thread or a child process of its
//! own, with what devhost answers for the C example (the devices' edits and
//! what its hook adds), and refuses it without `--hop`.

use devhost_proto::v1beta1 as pb;
use std::process::{Child, Command};

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(socket: &std::path::Path, hop: Option<&str>) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_devhost-bench"));
    cmd.arg("null-server").arg("--socket").arg(socket);
    if let Some(hop) = hop {
        cmd.arg("--hop").arg(hop);
    }
    Server(cmd.spawn().expect("start the null server"))
}

fn allocate_request(ids: &[&str]) -> pb::AllocateRequest {
    pb::AllocateRequest {
        container_requests: vec![pb::ContainerAllocateRequest {
            devices_ids: ids.iter().map(|s| s.to_string()).collect(),
        }],
    }
}

/// The processes whose parent is `pid`, by their command line.
fn children(pid: u32) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // The parent is the second field after the parenthesised command name.
        let Some(after) = stat.rsplit_once(')').map(|(_, rest)| rest) else { continue };
        if after.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok()) == Some(pid) {
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            found.push(String::from_utf8_lossy(&cmdline).replace('\0', " "));
        }
    }
    found
}

/// The names of `pid`'s threads.
fn thread_names(pid: u32) -> Vec<String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("read the server's threads");
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect()
}

#[tokio::test]
async fn allocate_is_answered_inline_across_a_thread_or_a_process() {
    let dir = tempfile::tempdir().unwrap();
    for hop in ["inline", "thread", "process"] {
        let socket = dir.path().join(format!("{hop}.sock"));
        let server = serve(&socket, Some(hop));
        let mut client = devhost_bench::null::client(&socket).await.unwrap();
        for ids in [&["example-0"][..], &["example-1", "example-5"]] {
            let resp = client.allocate(allocate_request(ids)).await.unwrap().into_inner();
            assert_eq!(resp.container_responses.len(), 1, "{hop}");
            let c = &resp.container_responses[0];
            assert_eq!(c.envs.get("EXAMPLE_ALLOCATED").map(String::as_str), Some(ids.join(",").as_str()), "{hop}");
            assert_eq!(
                c.annotations.get("example.com/allocated-count").map(String::as_str),
                Some(ids.len().to_string().as_str()),
                "{hop}"
            );
            // The devices' own edits, as devhost composes them for the C example.
            assert_eq!(c.envs.get("EXAMPLE_VISIBLE_DEVICES").map(String::as_str), Some(ids.join(",").as_str()));
            let nodes: Vec<(&str, &str, &str)> = c
                .devices
                .iter()
                .map(|d| (d.host_path.as_str(), d.container_path.as_str(), d.permissions.as_str()))
                .collect();
            let want: Vec<String> = ids.iter().map(|id| format!("/dev/example{}", &id["example-".len()..])).collect();
            assert_eq!(nodes, want.iter().map(|p| ("/dev/null", p.as_str(), "rw")).collect::<Vec<_>>(), "{hop}");
        }
        let workers: Vec<String> =
            children(server.0.id()).into_iter().filter(|c| c.contains("null-hop-worker")).collect();
        assert_eq!(workers.len(), usize::from(hop == "process"), "{hop}: hop worker processes {workers:?}");
        let threads = thread_names(server.0.id());
        let hop_threads = threads.iter().filter(|t| *t == "null-hop").count();
        assert_eq!(hop_threads, usize::from(hop == "thread"), "{hop}: threads {threads:?}");
    }
}

#[tokio::test]
async fn without_a_hop_allocate_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("null.sock");
    let _server = serve(&socket, None);
    let mut client = devhost_bench::null::client(&socket).await.unwrap();
    let err = client.allocate(allocate_request(&["example-0"])).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unimplemented);
    client.get_device_plugin_options(pb::Empty {}).await.unwrap();
}

/// The null plugin's Allocate, on its gRPC task and across each hop, is devhost's answer for the
/// C example to the byte: the check `devhost-bench handoff` makes before it times anything. A
/// null plugin that refuses Allocate (no `--hop`) fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_null_plugin_answers_allocate_as_devhost_does() {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_devhost-bench"));
    let art = devhost_bench::node::Artifacts {
        dir: bin.parent().unwrap().to_path_buf(),
        repo: std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf(),
    };
    for p in [art.devhost(), art.module("example_c")] {
        assert!(p.exists(), "{} is missing: run `cargo build --workspace` first", p.display());
    }
    let keys = "isolation = \"in-process\"\noptions = { count = 8 }";
    let (_node, _kubelet, _daemon, devhost) =
        devhost_bench::node::c_example_node(&art, "bench.example.com/c", 8, keys).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    for hop in [Some("inline"), Some("thread"), Some("process"), None] {
        let socket = dir.path().join(format!("{}.sock", hop.unwrap_or("none")));
        let _server = serve(&socket, hop);
        let null = devhost_bench::null::client(&socket).await.unwrap();
        let same = devhost_bench::handoff::same_answers(&devhost, &[("null", &null)]).await;
        assert_eq!(same.is_ok(), hop.is_some(), "{hop:?}: {same:?}");
    }
}
