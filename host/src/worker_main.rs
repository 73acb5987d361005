//! `devhost-worker`: the driver worker mode of `devhost` alone, for
//! `isolation = "process"`. The host starts it from beside its own binary
//! (`devhost __driver-worker NAME MODULE` is the same program in the big
//! binary): about 0.45 MB instead of 15.5, so a worker starts sooner and keeps
//! fewer pages resident. It is not meant to be run by hand.

use std::process::ExitCode;

fn main() -> ExitCode {
    devhost::driver::isolation::worker_entry().unwrap_or_else(|| {
        eprintln!(
            "devhost-worker runs driver workers for devhost (isolation = \"process\") and is started by devhost itself"
        );
        ExitCode::from(2)
    })
}
