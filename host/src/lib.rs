//! devhost: one kubelet device-plugin host for every accelerator driver.
//!
//! The tree follows the data flow, in four areas over one configuration, each
//! using only the ones before it:
//! [`manifest`] (the configuration) → [`driver`] (loading vendor modules,
//! calling them on driver threads or in isolated worker processes, the device
//! model they report) → [`engine`] (the shared core: device registry per
//! resource, sharing, preferred allocation, CDI spec files, health history and
//! the metrics recorded) → [`fronts`] (the
//! kubelet APIs: [`fronts::device_plugin`] and [`fronts::dra`], which
//! publishes ResourceSlices and prepares claims from the same drivers) → [`ops`] (operator surfaces: the metrics, probes and status server, Node
//! Feature Discovery labels, completion scripts and manual page, the `sim`
//! kubelet emulator run and the `conformance` battery). [`lock`] keeps one
//! daemon per kubelet folder. docs/architecture.md has the allowed order and
//! the exceptions to it.
//! [`fs_events`] reads inotify events on the runtime for the two file watches.
//! [`names`] holds the stable hash the CDI and DRA name rules share.

pub mod driver;
pub mod engine;
pub mod fronts;
pub mod fs_events;
pub mod lock;
pub mod manifest;
pub mod names;
pub mod ops;
