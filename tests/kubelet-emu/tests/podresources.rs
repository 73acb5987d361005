//! The PodResources emulator driven by a real gRPC client over its socket.

use std::time::Duration;

use devhost_proto::connect_uds;
use devhost_proto::podresources::v1::pod_resources_lister_client::PodResourcesListerClient;
use devhost_proto::podresources::v1::{
    AllocatableResourcesRequest, ContainerDevices, ContainerResources, GetPodResourcesRequest, ListPodResourcesRequest,
    PodResources,
};
use kubelet_emu::PodResourcesServer;
use tonic::Code;
use tonic::transport::Channel;

const GPU: &str = "example.com/gpu";
const WAIT: Duration = Duration::from_secs(5);

async fn client(server: &PodResourcesServer) -> PodResourcesListerClient<Channel> {
    PodResourcesListerClient::new(connect_uds(server.socket_path()).await.unwrap())
}

async fn list(server: &PodResourcesServer) -> Vec<PodResources> {
    client(server).await.list(ListPodResourcesRequest {}).await.unwrap().into_inner().pod_resources
}

fn container(name: &str, resource: &str, ids: &[&str]) -> (String, String, Vec<String>) {
    (name.into(), resource.into(), ids.iter().map(|s| s.to_string()).collect())
}

fn devices(resource: &str, ids: &[&str]) -> ContainerDevices {
    ContainerDevices {
        resource_name: resource.into(),
        device_ids: ids.iter().map(|s| s.to_string()).collect(),
        topology: None,
    }
}

#[tokio::test]
async fn list_reports_the_pods_the_test_sets_and_forgets_removed_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let server = PodResourcesServer::start(&tmp.path().join("pod-resources/kubelet.sock")).unwrap();
    assert_eq!(list(&server).await, []);

    server.set_pod("ml", "train-0", vec![container("main", GPU, &["gpu-1", "gpu-0"])]);
    server.set_pod("default", "infer", vec![container("srv", GPU, &["gpu-2"])]);
    let pods = list(&server).await;
    let names: Vec<(&str, &str)> = pods.iter().map(|p| (p.namespace.as_str(), p.name.as_str())).collect();
    assert_eq!(names, [("default", "infer"), ("ml", "train-0")], "sorted by namespace, then name");
    assert_eq!(
        pods[1].containers,
        [ContainerResources {
            name: "main".into(),
            devices: vec![devices(GPU, &["gpu-1", "gpu-0"])],
            ..Default::default()
        }]
    );

    assert!(server.remove_pod("ml", "train-0"));
    assert!(!server.remove_pod("ml", "train-0"), "removed twice");
    assert_eq!(server.pods(), [("default".to_string(), "infer".to_string())]);
    assert_eq!(list(&server).await.len(), 1);
    assert_eq!(server.list_count(), 3);
}

#[tokio::test]
async fn a_container_with_several_resources_is_one_entry() {
    let tmp = tempfile::tempdir().unwrap();
    let server = PodResourcesServer::start(&tmp.path().join("kubelet.sock")).unwrap();
    server.set_pod(
        "ns",
        "p",
        vec![container("a", GPU, &["gpu-0"]), container("b", GPU, &["gpu-1"]), container("a", "x.io/nic", &["nic-0"])],
    );
    let pod = list(&server).await.remove(0);
    let containers: Vec<(&str, usize)> = pod.containers.iter().map(|c| (c.name.as_str(), c.devices.len())).collect();
    assert_eq!(containers, [("a", 2), ("b", 1)]);
    assert_eq!(pod.containers[0].devices[1], devices("x.io/nic", &["nic-0"]));
}

#[tokio::test]
async fn get_finds_one_pod_or_is_not_found() {
    let tmp = tempfile::tempdir().unwrap();
    let server = PodResourcesServer::start(&tmp.path().join("kubelet.sock")).unwrap();
    server.set_pod("ns", "p", vec![container("c", GPU, &["gpu-3"])]);
    let mut client = client(&server).await;
    let request = |name: &str| GetPodResourcesRequest { pod_name: name.into(), pod_namespace: "ns".into() };
    let pod = client.get(request("p")).await.unwrap().into_inner().pod_resources.unwrap();
    assert_eq!((pod.name.as_str(), pod.containers[0].devices[0].device_ids[0].as_str()), ("p", "gpu-3"));
    let err = client.get(request("q")).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert!(err.message().contains("ns/q"), "{}", err.message());
}

#[tokio::test]
async fn allocatable_resources_are_what_the_test_sets() {
    let tmp = tempfile::tempdir().unwrap();
    let server = PodResourcesServer::start(&tmp.path().join("kubelet.sock")).unwrap();
    server.set_allocatable(GPU, vec!["gpu-0".into(), "gpu-1".into()]);
    let response = client(&server).await.get_allocatable_resources(AllocatableResourcesRequest {}).await.unwrap();
    assert_eq!(response.into_inner().devices, [devices(GPU, &["gpu-0", "gpu-1"])]);
}

#[tokio::test]
async fn stop_removes_the_socket_and_restart_keeps_the_pods() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("kubelet.sock");
    let server = PodResourcesServer::start(&path).unwrap();
    server.set_pod("ns", "p", vec![container("c", GPU, &["gpu-0"])]);
    server.stop();
    assert!(!path.exists(), "socket left behind");
    assert!(connect_uds(&path).await.is_err(), "still reachable after stop");
    server.restart().unwrap();
    assert_eq!(list(&server).await.len(), 1);
    drop(server);
    assert!(!path.exists(), "socket left behind after drop");
}

#[tokio::test]
async fn wait_list_count_wakes_on_a_list_and_times_out_naming_the_count() {
    let tmp = tempfile::tempdir().unwrap();
    let server = PodResourcesServer::start(&tmp.path().join("kubelet.sock")).unwrap();
    let err = server.wait_list_count(1, Duration::from_millis(50)).await.unwrap_err();
    assert!(err.to_string().contains("1 PodResources List call(s)"), "{err}");
    assert!(err.to_string().contains("0 List call(s)"), "{err}");
    let (waited, _) = tokio::join!(server.wait_list_count(1, WAIT), list(&server));
    waited.unwrap();
}
