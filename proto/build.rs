//! Compiles `v1beta1/api.proto` with protox (pure Rust), so building needs no
//! system `protoc`, then generates tonic clients and servers for both services.

use std::error::Error;

fn main() -> Result<(), Box<dyn Error>> {
    let proto = "v1beta1/api.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["."])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
