//! The DRA front: serves one Dynamic Resource Allocation driver to the kubelet,
//! with the plugin service (v1 and v1beta1) on `<kubelet root>/plugins/<driver>/dra.sock` and the registration
//! service on `<kubelet root>/plugins_registry/<driver>-reg.sock`, where the kubelet's plugin
//! watcher finds it (a [`ServedDriver`]); [`DraFront`], the handle the daemon holds, keeps one per
//! `api = "dra"` resource. [`slices`] publishes the
//! resource's healthy devices as ResourceSlices through the API server while the front runs;
//! [`claims`] prepares and unprepares the claims the kubelet sends, keeping them in a
//! [`checkpoint`].

pub mod api;
mod authority;
pub mod checkpoint;
pub mod claim_spec;
pub mod claims;
mod front;
pub mod health;
mod outage;
#[doc(hidden)]
pub use authority::mend_requests;
pub mod parameters;
pub mod plugin;
pub mod prepare;
pub mod registration;
mod served;
pub mod slices;
mod stale;
pub mod taint;

pub use claims::Settings;
pub use front::DraFront;
pub use served::{DEFAULT_CDI_DIR, FrontError, PLUGIN_SOCKET, PLUGINS, PLUGINS_REGISTRY, Paths, ServedDriver};
