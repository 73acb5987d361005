//! Compiles `v1beta1/api.proto` (Device Plugin API),
//! `podresources/v1/api.proto` (PodResources API), `dra/v1/api.proto` and
//! `dra/v1beta1/api.proto` (DRA kubelet plugin API) and `pluginregistration/v1/api.proto` (the kubelet's
//! plugin registration) `cri/v1/api.proto` (the container runtime's ListContainers) and `dra-health/v1` and `v1alpha1`
//! (the kubelet's DRA resource health service) with protox (pure Rust), so
//! building needs no system `protoc`, then generates tonic clients and servers
//! for every service.

use std::error::Error;

fn main() -> Result<(), Box<dyn Error>> {
    let protos = [
        "v1beta1/api.proto",
        "podresources/v1/api.proto",
        "dra/v1/api.proto",
        "dra/v1beta1/api.proto",
        "pluginregistration/v1/api.proto",
        "cri/v1/api.proto",
        "dra-health/v1/api.proto",
        "dra-health/v1alpha1/api.proto",
    ];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let fds = protox::compile(protos, ["."])?;
    tonic_prost_build::configure().build_server(true).build_client(true).compile_fds(fds)?;
    Ok(())
}
