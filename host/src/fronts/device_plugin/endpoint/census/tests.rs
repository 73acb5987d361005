use super::*;
use devhost_proto::v1beta1 as pb;
use prost::Message;

fn allocate(containers: Vec<Vec<&str>>) -> Vec<u8> {
    pb::AllocateRequest {
        container_requests: containers
            .into_iter()
            .map(|ids| pb::ContainerAllocateRequest { devices_ids: ids.into_iter().map(String::from).collect() })
            .collect(),
    }
    .encode_to_vec()
}

#[test]
fn calls_are_told_apart_by_their_path() {
    assert_eq!(Call::of("/v1beta1.DevicePlugin/Allocate"), Call::Allocate);
    assert_eq!(Call::of("/v1beta1.DevicePlugin/GetPreferredAllocation"), Call::Preferred);
    assert_eq!(Call::of("/v1beta1.DevicePlugin/PreStartContainer"), Call::PreStart);
    assert_eq!(Call::of("/v1beta1.DevicePlugin/ListAndWatch"), Call::Watch);
    assert_eq!(Call::of("/v1beta1.DevicePlugin/GetDevicePluginOptions"), Call::Empty);
    assert_eq!(Call::of("/other.Service/Allocate"), Call::Empty);
}

#[test]
fn census_counts_containers_ids_and_the_longest_id_without_decoding() {
    let c = census(Call::Allocate, &allocate(vec![vec!["a", "bb"], vec![], vec!["ccc"]])).unwrap();
    assert_eq!(c, Census { containers: 3, ids: 3, most_in_one: 2, longest: 3 });
    let pre = pb::PreStartContainerRequest { devices_ids: vec!["x".into(); 5] }.encode_to_vec();
    assert_eq!(census(Call::PreStart, &pre).unwrap(), Census { containers: 0, ids: 5, most_in_one: 5, longest: 1 });
    let pref = pb::PreferredAllocationRequest {
        container_requests: vec![pb::ContainerPreferredAllocationRequest {
            available_device_i_ds: vec!["a".into(), "b".into()],
            must_include_device_i_ds: vec!["a".into()],
            allocation_size: 2,
        }],
    }
    .encode_to_vec();
    assert_eq!(census(Call::Preferred, &pref).unwrap(), Census { containers: 1, ids: 3, most_in_one: 3, longest: 1 });
}

#[test]
fn census_skips_unknown_fields_and_refuses_what_is_not_protobuf() {
    // Field 7 (varint), field 9 (fixed64) and field 1 as a container holding field 3 (bytes).
    let msg = [0x38, 0x01, 0x49, 0, 0, 0, 0, 0, 0, 0, 0, 0x0a, 0x03, 0x1a, 0x01, b'z'];
    assert_eq!(census(Call::Allocate, &msg).unwrap(), Census { containers: 1, ..Census::default() });
    for bad in [&[0x0a, 0x05, b'a'][..], &[0x0b][..], &[0x00, 0x01][..], &[0x08][..], &[0xff; 11][..]] {
        assert!(census(Call::Allocate, bad).unwrap_err().starts_with("malformed message"), "{bad:?}");
    }
}

#[test]
fn requests_naming_more_ids_than_could_be_valid_are_refused_unread() {
    let c = |containers, ids, most_in_one, longest| Census { containers, ids, most_in_one, longest };
    assert_eq!(admissible(Call::Allocate, c(1, 4, 4, 63), 4), Ok(()));
    let err = admissible(Call::Allocate, c(2, 5, 3, 5), 4).unwrap_err();
    assert!(err.contains("names 5 device IDs") && err.contains("the 4 device IDs the resource advertises"), "{err}");
    // Available and must-include may both name every device.
    assert_eq!(admissible(Call::Preferred, c(1, 8, 8, 5), 4), Ok(()));
    assert!(admissible(Call::Preferred, c(1, 9, 9, 5), 4).unwrap_err().contains("in one container request"));
    let err = admissible(Call::PreStart, c(0, 1, 1, MAX_ID + 1), 4).unwrap_err();
    assert!(err.contains(&format!("device ID of {} bytes", MAX_ID + 1)), "{err}");
    let err = admissible(Call::Allocate, c(MAX_CONTAINERS + 1, 0, 0, 0), 1_000_000).unwrap_err();
    assert!(err.contains(&format!("{} container requests", MAX_CONTAINERS + 1)), "{err}");
}
