//! Publishing a DRA resource's devices as ResourceSlices: one task per DRA front
//! ([`spawn`]) keeps the API server's slices of (driver, node) equal to the resource's healthy
//! devices, from the resource's device view (every change), a watch on the slices (someone
//! else deleted or edited one: the kubelet deletes every slice of its node when it starts) and
//! a full resync every [`RESYNC`] as a backstop.
//!
//! What is published, per DRA resource and node:
//! - one pool, named after the node, with `spec.nodeName` = the node and `spec.driver` = the
//!   resource's DRA driver; every slice is owned by the Node object (garbage-collected with it);
//! - the resource's **physical devices** (`replicas` does not apply to DRA, the manifest warns),
//!   named by [`dra_device_name`](super::prepare::dra_device_name), in the order the driver
//!   reported them. An **unhealthy device stays, with a taint**: key `<driver>/unhealthy`
//!   ([`taint_key`](super::taint::taint_key)), value the driver's health reason as a label value ([`taint_value`](super::taint::taint_value)),
//!   effect the resource's `dra_taint_effect` (NoSchedule unless NoExecute); recovery removes
//!   it, and a taint's `timeAdded` is kept while the device stays unhealthy. The scheduler
//!   allocates a tainted device only to a claim that tolerates the taint. An API server whose
//!   DRADeviceTaints gate is off drops taints: the first slice stored without them turns the
//!   publisher to leaving unhealthy devices out (logged once), as before taints;
//! - at most [`MAX_DEVICES_PER_SLICE`] devices per slice ([`MAX_DEVICES_PER_TAINTED_SLICE`]
//!   while a device of the pool is tainted); a bigger pool is split into several slices, all
//!   with the same generation and `resourceSliceCount`. A pool without a device keeps one
//!   empty slice, so that consumers know it is empty rather than missing.
//!
//! Slice names are deterministic: `<node>-<driver>-<index, 4 digits>` (for a name over 253
//! characters, the `<node>-<driver>` part is cut and 8 hex digits of its hash appended). A
//! create that races another (ours, after a restart, or a slice just seen deleted) fails with
//! AlreadyExists instead of making a duplicate, so no cache of our own writes is needed, and
//! name order is index order (the scheduler tries slices first-fit in name order).
//!
//! Generations, simplified from the upstream helper: the pool's generation is the highest among
//! the existing slices. If nothing is created or deleted and at most one slice changes, that
//! slice is updated in place at the same generation (an object is replaced atomically, so no
//! consumer sees a mixed pool). Otherwise slices that are not wanted any more are deleted
//! first, then **every** slice is written at generation + 1: consumers use only the highest
//! generation and wait for `resourceSliceCount` slices of it, so they see the old pool or the
//! new one, never a mix.
//!
//! Attributes (see [`attribute_name`] and [`typed`]): `numaNode` (int) from the device's NUMA
//! node; `resource.kubernetes.io/pciBusID` from a `pci_address` attribute holding one PCI
//! address, and `resource.kubernetes.io/pcieRoot` where sysfs shows its root; the capacity
//! `memory` from `memory` (MiB) or `hbm_gib` (GiB); then every other driver attribute under
//! the driver's own domain (unprefixed), typed int, bool, version (semver 2.0) or string. At
//! most [`MAX_ENTRIES`] attributes and capacities per device, in that order.
//!
//! Stopping the task does **not** delete the slices: the kubelet deletes a driver's slices 30 s
//! after the driver's registration socket is gone, and a devhost restart (or reload) within
//! that time must not make the devices vanish and come back for the scheduler.
//!
//! The parts: [`attributes`] (a device in DRA's terms), `publisher` (one reconcile pass),
//! `task` (the background task and its watch).

pub mod attributes;
mod publisher;
mod task;

pub use attributes::{
    MAX_ATTRIBUTE_NAME, MAX_ENTRIES, MAX_VALUE, NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, attribute_name, binary_quantity,
    dra_device, is_semver, pci_bus_id, pcie_root_of_link, typed,
};
pub use publisher::{
    MAX_DEVICES_PER_SLICE, MAX_DEVICES_PER_TAINTED_SLICE, Published, Unhealthy, desired, selector, slice_name,
};
pub use task::{PASS_TIMEOUT, RESYNC, spawn};

#[cfg(test)]
mod tests;
