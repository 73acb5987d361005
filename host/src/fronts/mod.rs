//! The kubelet APIs devhost serves, each a thin front over the [`crate::engine`]:
//! [`device_plugin`] (Device Plugin API v1beta1) and [`dra`] (Dynamic Resource Allocation).
//! The two fronts do not use each other.

pub mod device_plugin;
pub mod dra;
