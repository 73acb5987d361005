//! The commands an operator runs on a node without a kubelet (list, check, sim, drivers, the log
//! formats, the manual and completions), the manifest's errors, the module trust policy and the
//! NFD labels.

mod commands;
mod configs;
mod manifest_fuzz;
mod nfd;
mod polish;
mod trust;
