//! The runner with a container runtime (the emulated CRI): a release waits
//! until every container of its holder has exited, whatever PodResources
//! says, and calls the hook only for what it still holds then.

use super::tests::{FAST, Fake, Lists, eventually, holder, ids};
use super::*;
use crate::engine::containers::RECHECK;
use kubelet_emu::{ContainerState, RuntimeServer};
use std::time::Duration;

struct Node {
    _dir: tempfile::TempDir,
    cri: RuntimeServer,
    lists: Lists,
}

impl Node {
    fn new() -> Node {
        let dir = tempfile::tempdir().unwrap();
        let cri = RuntimeServer::start(&dir.path().join("cri.sock")).unwrap();
        Node { _dir: dir, cri, lists: Lists::new() }
    }

    fn start(&self, fake: Arc<Fake>) -> ReleaseRunner {
        let runtime = Arc::new(Runtime::new(self.cri.socket_path().to_path_buf()));
        ReleaseRunner::start_gated("x.com/gpu", fake, self.lists.tx.subscribe(), FAST, None, Some(runtime))
    }
}

/// Long enough for several re-checks of the runtime.
const SEVERAL_CHECKS: Duration = Duration::from_millis(1300);

#[tokio::test]
async fn a_release_waits_until_the_holders_container_has_exited() {
    let node = Node::new();
    node.cri.set_container("ns", "train", "main", "c0ffee0123456789", ContainerState::ContainerRunning);
    let fake = Fake::with(vec![]);
    let runner = node.start(fake.clone());
    node.lists.list(&runner, &[("gpu-0", holder("train", "main"))]).await;
    // The kubelet stops listing the pod (a static pod's manifest went) while it still runs.
    node.lists.list(&runner, &[]).await;
    eventually("the wait to show", || runner.unhealthy("gpu-0").is_some_and(|r| r.contains("waiting"))).await;
    let reason = runner.unhealthy("gpu-0").unwrap();
    assert!(reason.contains("ns/train/main") && reason.contains("c0ffee012345 CONTAINER_RUNNING"), "{reason}");
    assert!(runner.pending()[0].waiting.is_some(), "/status shows the wait");
    tokio::time::sleep(SEVERAL_CHECKS).await;
    assert!(fake.calls().is_empty(), "released under a running container");
    assert!(node.cri.list_count() >= 2, "the runtime is asked again while it runs");

    let exited = std::time::Instant::now();
    node.cri.set_state("c0ffee0123456789", ContainerState::ContainerExited);
    eventually("the release after the exit", || fake.calls() == [ids(&["gpu-0"])]).await;
    assert!(exited.elapsed() <= RECHECK + Duration::from_millis(400), "released {:?} after", exited.elapsed());
    eventually("Healthy again", || runner.unhealthy("gpu-0").is_none()).await;
}

#[tokio::test]
async fn every_attempt_of_the_container_must_have_exited_and_others_do_not_count() {
    let node = Node::new();
    node.cri.set_container("ns", "train", "main", "attempt-0", ContainerState::ContainerExited);
    node.cri.set_container("ns", "train", "main", "attempt-1", ContainerState::ContainerCreated);
    // Another container of the same pod, and a same-named container in another namespace.
    node.cri.set_container("ns", "train", "sidecar", "side", ContainerState::ContainerRunning);
    let fake = Fake::with(vec![]);
    let runner = node.start(fake.clone());
    node.lists.list(&runner, &[("gpu-0", holder("train", "main"))]).await;
    node.lists.list(&runner, &[]).await;
    eventually("the wait", || runner.unhealthy("gpu-0").is_some_and(|r| r.contains("attempt-1 CONTAINER_CREATED")))
        .await;
    let reason = runner.unhealthy("gpu-0").unwrap();
    assert!(!reason.contains("attempt-0") && !reason.contains("side"), "{reason}");
    node.cri.remove_container("attempt-1");
    eventually("the release", || fake.calls().len() == 1).await;
}

#[tokio::test]
async fn a_runtime_that_does_not_answer_keeps_the_device_held() {
    let node = Node::new();
    node.cri.set_failing(Some(tonic::Code::Unavailable));
    let fake = Fake::with(vec![]);
    let runner = node.start(fake.clone());
    node.lists.list(&runner, &[("gpu-0", holder("train", "main"))]).await;
    node.lists.list(&runner, &[]).await;
    eventually("the wait", || runner.unhealthy("gpu-0").is_some_and(|r| r.contains("did not answer"))).await;
    tokio::time::sleep(SEVERAL_CHECKS).await;
    assert!(fake.calls().is_empty(), "released while the runtime could not say");
    node.cri.set_failing(None);
    eventually("the release once it answers", || fake.calls().len() == 1).await;
}

#[tokio::test]
async fn without_a_cri_the_release_runs_as_before() {
    // A socket that serves something else than the CRI (e.g. a containerd without its CRI
    // plugin): no way to know, so today's behaviour, at once.
    let node = Node::new();
    node.cri.set_failing(Some(tonic::Code::Unimplemented));
    let fake = Fake::with(vec![]);
    let runner = node.start(fake.clone());
    node.lists.list(&runner, &[("gpu-0", holder("train", "main"))]).await;
    node.lists.list(&runner, &[]).await;
    eventually("the release", || fake.calls().len() == 1).await;
    // And a missing socket, likewise.
    let lists = Lists::new();
    let fake = Fake::with(vec![]);
    let missing = Arc::new(Runtime::new(node._dir.path().join("none.sock")));
    let runner = ReleaseRunner::start_gated("x.com/gpu", fake.clone(), lists.tx.subscribe(), FAST, None, Some(missing));
    lists.list(&runner, &[("gpu-0", holder("train", "main"))]).await;
    lists.list(&runner, &[]).await;
    eventually("the release without a socket", || fake.calls().len() == 1).await;
}

#[tokio::test]
async fn a_device_handed_out_again_while_waiting_is_not_released() {
    let node = Node::new();
    node.cri.set_container("ns", "train", "main", "c1", ContainerState::ContainerRunning);
    let fake = Fake::with(vec![]);
    let runner = node.start(fake.clone());
    let train = holder("train", "main");
    node.lists.list(&runner, &[("gpu-0", train.clone()), ("gpu-1", train.clone())]).await;
    node.lists.list(&runner, &[]).await;
    eventually("the wait", || runner.unhealthy("gpu-1").is_some_and(|r| r.contains("waiting"))).await;
    node.lists.list(&runner, &[("gpu-1", holder("next", "main"))]).await;
    node.cri.set_state("c1", ContainerState::ContainerExited);
    eventually("the release", || !fake.calls().is_empty()).await;
    assert_eq!(fake.calls(), [ids(&["gpu-0"])], "the new tenant's device was scrubbed");
}

#[tokio::test]
async fn an_unseen_holder_cannot_be_asked_about_and_is_released_as_before() {
    let node = Node::new();
    let fake = Fake::with(vec![]);
    let runner = node.start(fake.clone());
    node.lists.list(&runner, &[]).await;
    runner.allocated(ids(&["gpu-3"])).await;
    tokio::time::sleep(ALLOCATE_GRACE + Duration::from_millis(20)).await;
    // A List that started after the grace shows no container holding it.
    node.lists.tx.send_modify(|s| {
        s.generation += 1;
        s.resources = Some(Arc::new(BTreeMap::from([("x.com/gpu".to_string(), Default::default())])));
        s.listed_at = Some(Instant::now());
    });
    eventually("the release", || fake.calls() == [ids(&["gpu-3"])]).await;
    assert_eq!(node.cri.list_count(), 0, "asked the runtime about a holder it cannot name");
}

#[tokio::test]
async fn a_stopped_runner_never_calls_the_hook_after_its_wait() {
    let node = Node::new();
    node.cri.set_container("ns", "train", "main", "c1", ContainerState::ContainerRunning);
    let fake = Fake::with(vec![]);
    let runner = node.start(fake.clone());
    node.lists.list(&runner, &[("gpu-0", holder("train", "main"))]).await;
    node.lists.list(&runner, &[]).await;
    eventually("the wait", || runner.unhealthy("gpu-0").is_some_and(|r| r.contains("waiting"))).await;
    // A reload replaces the runner: its successor goes on from the kept state and waits itself.
    runner.stop();
    node.cri.set_state("c1", ContainerState::ContainerExited);
    tokio::time::sleep(SEVERAL_CHECKS).await;
    assert!(fake.calls().is_empty(), "the replaced runner called the hook");
}
