//! The driver modules: the loader's checks, optional hooks, `create` retries, and the NVIDIA, FPGA
//! and TPU drivers against their simulated hardware.

mod create_retry;
mod fpga;
mod loader;
mod nvidia;
mod nvidia_image;
mod tpu;
mod try_hooks;
