//! The DRA kubelet plugin v1 and plugin registration v1 messages: each one
//! round-trips through its encoding, the field numbers are the kubelet's
//! (checked byte by byte), and the service names give the upstream wire paths.

use devhost_proto::dra::v1::{
    Claim, Device, NodePrepareResourceResponse, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
    NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse, dra_plugin_server,
};
use devhost_proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse, registration_server,
};
use prost::Message;

fn round_trip<M: Message + Default + PartialEq + std::fmt::Debug>(message: M) -> Vec<u8> {
    let bytes = message.encode_to_vec();
    let back = M::decode(bytes.as_slice()).expect("decodes");
    assert_eq!(back, message);
    bytes
}

fn claim() -> Claim {
    Claim { namespace: "n".into(), uid: "u".into(), name: "c".into() }
}

#[test]
fn service_names_keep_the_upstream_packages() {
    assert_eq!(dra_plugin_server::SERVICE_NAME, "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin");
    assert_eq!(registration_server::SERVICE_NAME, "pluginregistration.Registration");
    assert_eq!(devhost_proto::DRA_PLUGIN_TYPE, "DRAPlugin");
    assert_eq!(devhost_proto::DRA_V1_SERVICE, "v1.DRAPlugin");
}

#[test]
fn claim_uses_namespace_1_uid_2_name_3() {
    let bytes = round_trip(claim());
    assert_eq!(bytes, [0x0a, 1, b'n', 0x12, 1, b'u', 0x1a, 1, b'c']);
}

#[test]
fn prepare_and_unprepare_requests_carry_claims_in_field_1() {
    let bytes = round_trip(NodePrepareResourcesRequest { claims: vec![claim()] });
    assert_eq!(&bytes[..2], [0x0a, 9]);
    let unprepare = round_trip(NodeUnprepareResourcesRequest { claims: vec![claim()] });
    assert_eq!(unprepare, bytes);
}

#[test]
fn device_uses_fields_1_to_5() {
    let device = Device {
        request_names: vec!["r".into()],
        pool_name: "p".into(),
        device_name: "d".into(),
        cdi_device_ids: vec!["v/c=x".into()],
        share_id: Some("s".into()),
    };
    let bytes = round_trip(device);
    let expected = [
        &[0x0a, 1, b'r'][..],
        &[0x12, 1, b'p'],
        &[0x1a, 1, b'd'],
        &[0x22, 5, b'v', b'/', b'c', b'=', b'x'],
        &[0x2a, 1, b's'],
    ]
    .concat();
    assert_eq!(bytes, expected);
    // Unset, the optional share ID is absent from the wire (not an empty string).
    let plain = Device { share_id: None, ..Device::default() };
    assert!(round_trip(plain).is_empty());
}

#[test]
fn prepare_response_maps_claim_uid_to_devices_1_and_error_2() {
    let entry = NodePrepareResourceResponse { devices: vec![], error: "e".into() };
    assert_eq!(round_trip(entry.clone()), [0x12, 1, b'e']);
    let response = NodePrepareResourcesResponse { claims: [("u".to_string(), entry)].into() };
    // 1: map entry { 1: "u", 2: { 2: "e" } }
    assert_eq!(round_trip(response), [0x0a, 8, 0x0a, 1, b'u', 0x12, 3, 0x12, 1, b'e']);
    let with_device = NodePrepareResourceResponse {
        devices: vec![Device { pool_name: "p".into(), device_name: "d".into(), ..Device::default() }],
        error: String::new(),
    };
    assert_eq!(round_trip(with_device), [0x0a, 6, 0x12, 1, b'p', 0x1a, 1, b'd']);
}

#[test]
fn unprepare_response_maps_claim_uid_to_error_1() {
    let entry = NodeUnprepareResourceResponse { error: "e".into() };
    assert_eq!(round_trip(entry.clone()), [0x0a, 1, b'e']);
    let response = NodeUnprepareResourcesResponse { claims: [("u".to_string(), entry)].into() };
    assert_eq!(round_trip(response), [0x0a, 8, 0x0a, 1, b'u', 0x12, 3, 0x0a, 1, b'e']);
}

#[test]
fn plugin_info_uses_fields_1_to_4() {
    let info = PluginInfo {
        r#type: "t".into(),
        name: "n".into(),
        endpoint: "e".into(),
        supported_versions: vec!["a".into(), "b".into()],
    };
    let bytes = round_trip(info);
    assert_eq!(bytes, [0x0a, 1, b't', 0x12, 1, b'n', 0x1a, 1, b'e', 0x22, 1, b'a', 0x22, 1, b'b']);
}

#[test]
fn registration_status_uses_registered_1_and_error_2() {
    let status = RegistrationStatus { plugin_registered: true, error: "e".into() };
    assert_eq!(round_trip(status), [0x08, 1, 0x12, 1, b'e']);
    assert!(round_trip(RegistrationStatusResponse {}).is_empty());
    assert!(round_trip(InfoRequest {}).is_empty());
}

#[test]
fn v1beta1_is_v1_without_the_share_id() {
    use devhost_proto::dra::v1beta1;
    assert_eq!(v1beta1::dra_plugin_server::SERVICE_NAME, "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin");
    assert_eq!(devhost_proto::DRA_V1BETA1_SERVICE, "v1beta1.DRAPlugin");
    let v1 = Device {
        request_names: vec!["r".into()],
        pool_name: "p".into(),
        device_name: "d".into(),
        cdi_device_ids: vec!["v/c=x".into()],
        share_id: None,
    };
    let beta = v1beta1::Device::decode(round_trip(v1).as_slice()).unwrap();
    assert_eq!(
        beta,
        v1beta1::Device {
            request_names: vec!["r".into()],
            pool_name: "p".into(),
            device_name: "d".into(),
            cdi_device_ids: vec!["v/c=x".into()],
        }
    );
    let request = v1beta1::NodePrepareResourcesRequest {
        claims: vec![v1beta1::Claim { namespace: "n".into(), uid: "u".into(), name: "c".into() }],
    };
    assert_eq!(round_trip(request), round_trip(NodePrepareResourcesRequest { claims: vec![claim()] }));
}
