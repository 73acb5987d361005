//! An in-process emulation of the kubelet's device manager, for tests and for
//! `devhost sim`/`devhost demo`.
//!
//! [`Kubelet`] serves `v1beta1.Registration` on `<dir>/kubelet.sock`, validates
//! and accepts registrations the way the kubelet does, keeps one connection
//! per resource, records every ListAndWatch list, and makes the calls the
//! kubelet makes (Allocate, GetPreferredAllocation, PreStartContainer). It can
//! also restart or stop like a real kubelet, deleting sockets as it does, or
//! hang in Register (fault injection).
//! Observations are cheap getters plus waiters woken on every change.
//!
//! [`PodResourcesServer`] emulates the kubelet's PodResources API on its own
//! socket, with the pods and devices a test sets, and [`RuntimeServer`] a container runtime's
//! CRI `ListContainers`, with the containers and states a test sets.
//!
//! The real kubelet is run against devhost in `tests/cluster` (docs/testing.md). Unlike the
//! kubelet, this emulator leaves the order of device IDs and the merging of several resources'
//! Allocate answers into one container's options to its callers: the kubelet sends IDs in
//! random order and keeps the first value of an env key two resources set.

mod kubelet;
mod names;
mod podresources;
mod registration;
mod runtime;
mod state;

/// The CRI's container states, for [`RuntimeServer::set_container`].
pub use devhost_proto::cri::v1::ContainerState;
pub use kubelet::Kubelet;
pub use names::{check_extended_resource_name, is_extended_resource_name, join_endpoint};
pub use podresources::{PodContainer, PodResourcesServer};
pub use runtime::RuntimeServer;
pub use state::WaitError;

/// Re-exported so users need not depend on `devhost-proto` for the types in
/// this crate's signatures.
pub use devhost_proto::v1beta1::{AllocateResponse, Device, DevicePluginOptions};
