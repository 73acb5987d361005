//! The PodResources v1 messages devhost reads, checked byte by byte against
//! the field numbers the kubelet uses, and the service name that makes the
//! wire path `/v1.PodResourcesLister/<Method>`.

use devhost_proto::podresources::v1::pod_resources_lister_server;
use devhost_proto::podresources::v1::{
    ContainerDevices, ContainerResources, DynamicResource, ListPodResourcesResponse, NumaNode, PodResources,
    TopologyInfo,
};
use prost::Message;

#[test]
fn service_name_keeps_the_bare_v1_package() {
    assert_eq!(pod_resources_lister_server::SERVICE_NAME, "v1.PodResourcesLister");
}

#[test]
fn default_socket_is_the_kubelets() {
    assert_eq!(devhost_proto::POD_RESOURCES_SOCKET, "/var/lib/kubelet/pod-resources/kubelet.sock");
}

#[test]
fn container_devices_use_fields_1_2_3() {
    let devices = ContainerDevices {
        resource_name: "r".into(),
        device_ids: vec!["x".into()],
        topology: Some(TopologyInfo { nodes: vec![NumaNode { id: 1 }] }),
    };
    // 1: "r"; 2: "x"; 3: { 1: { 1: 1 } }
    let expected = [0x0a, 1, b'r', 0x12, 1, b'x', 0x1a, 4, 0x0a, 2, 0x08, 1];
    assert_eq!(devices.encode_to_vec(), expected);
}

#[test]
fn pod_and_container_names_and_nesting_use_the_kubelets_numbers() {
    let list = ListPodResourcesResponse {
        pod_resources: vec![PodResources {
            name: "p".into(),
            namespace: "n".into(),
            containers: vec![ContainerResources { name: "c".into(), cpu_ids: vec![3], ..Default::default() }],
        }],
    };
    // list 1: pod { 1: "p", 2: "n", 3: container { 1: "c", 3: packed [3] } }
    let container = [0x0a, 1, b'c', 0x1a, 1, 3];
    let mut pod = vec![0x0a, 1, b'p', 0x12, 1, b'n', 0x1a, container.len() as u8];
    pod.extend(container);
    let mut expected = vec![0x0a, pod.len() as u8];
    expected.extend(pod);
    assert_eq!(list.encode_to_vec(), expected);
}

#[test]
fn dynamic_resources_are_field_5_and_skip_the_retired_field_1() {
    let container = ContainerResources {
        dynamic_resources: vec![DynamicResource { claim_name: "k".into(), ..Default::default() }],
        ..Default::default()
    };
    assert_eq!(container.encode_to_vec(), [0x2a, 3, 0x12, 1, b'k']);
    // An older kubelet's class name (field 1) is skipped, not an error.
    let decoded = DynamicResource::decode(&[0x0a, 1, b'z', 0x12, 1, b'k'][..]).expect("decodes");
    assert_eq!(decoded.claim_name, "k");
}

#[test]
fn fields_a_newer_kubelet_adds_are_skipped() {
    // PodResources with name "p" and an unknown field 9 (varint 7).
    let decoded = PodResources::decode(&[0x0a, 1, b'p', 0x48, 7][..]).expect("decodes");
    assert_eq!(decoded.name, "p");
}
