//! The fake's run-time state: the loaded machine, which GPUs have fallen off
//! the bus, the event sets with their queues, and the control file that a
//! test appends commands to while the daemon runs.
//!
//! Control file commands, one per line (`#` starts a comment):
//! - `xid <gpu-index> <xid> [<gi> <ci>]`: a critical Xid event on that GPU,
//!   delivered to every event set registered for Xid events on it;
//! - `lost <gpu-index>`: the GPU falls off the bus: every call on it (and its
//!   MIG devices) answers `NVML_ERROR_GPU_IS_LOST`, and each event set that
//!   watches it returns `NVML_ERROR_GPU_IS_LOST` from its next wait, once;
//! - `vanish <gpu-index>`: the GPU stops answering like a lost one (every
//!   call on it answers `NVML_ERROR_GPU_IS_LOST`), but no event says so: no
//!   Xid, and the event wait goes on as if nothing happened. Only a driver
//!   that asks the GPU notices;
//! - `fail <gpu-index> <code>`: every call on the GPU answers that NVML
//!   return code (e.g. 999, unknown error), again without an event;
//! - `back <gpu-index>`: the GPU answers normally again (after `lost`,
//!   `vanish` or `fail`);
//! - `hold <gpu-index>`: memory queries on the GPU (what a health probe asks)
//!   block until `release <gpu-index>`, without holding up any other call:
//!   a GPU slow to answer, for what a driver does meanwhile. Lines written
//!   together apply together, so `xid 2 79` and `hold 2` in one write hold
//!   the first probe after that Xid.
//!
//! Only lines appended after `nvmlInit` are read, so a control file left over
//! from an earlier run replays nothing.

use crate::machine::{Bdf, Machine};
use crate::wake::ControlWatch;
use std::collections::VecDeque;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// NVML's "not a MIG event" GPU/compute instance ID.
pub const NO_INSTANCE: u32 = 0xFFFF_FFFF;
/// `nvmlEventTypeXidCriticalError`.
pub const XID_EVENT: u64 = 0x8;
/// Event types a GPU with event support reports: ECC (single, double),
/// P-state and critical Xid.
pub const ALL_EVENTS: u64 = 0x1 | 0x2 | 0x4 | XID_EVENT;
/// What an old GPU without Xid events reports: P-state only.
pub const OLD_GPU_EVENTS: u64 = 0x4;

/// One queued event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub gpu: usize,
    pub event_type: u64,
    pub data: u64,
    pub gpu_instance: u32,
    pub compute_instance: u32,
}

/// One `nvmlEventSet_t`.
#[derive(Debug, Default)]
pub struct EventSet {
    /// (GPU index, registered event mask).
    pub registered: Vec<(usize, u64)>,
    pub queue: VecDeque<Event>,
    /// A watched GPU fell off the bus since the last wait.
    pub lost_pending: bool,
    /// Wakes this set's waiter when the control file changes (made by the
    /// first wait; shared with a wait in progress, so freeing the set cannot
    /// close the descriptor under it).
    pub watch: Option<Arc<ControlWatch>>,
}

impl EventSet {
    fn watches(&self, gpu: usize, mask: u64) -> bool {
        self.registered.iter().any(|&(g, m)| g == gpu && m & mask != 0)
    }
}

/// Everything the fake knows while initialised.
pub struct Runtime {
    pub machine: Machine,
    pub bus: Vec<Bdf>,
    pub lost: Vec<bool>,
    /// The code every call on the GPU answers (`fail`).
    pub failing: Vec<Option<u32>>,
    /// Memory queries on the GPU wait (`hold`, until `release`).
    pub held: Vec<bool>,
    pub sets: Vec<Option<EventSet>>,
    pub init_count: u32,
    control: Option<Control>,
}

struct Control {
    path: PathBuf,
    offset: u64,
    partial: String,
    /// Says whether the file changed since the last look, so that the
    /// calls in between skip opening it (`None`: always look).
    watch: Option<ControlWatch>,
}

impl Runtime {
    /// Loads the machine file at `path`.
    pub fn load(path: &Path) -> Result<Runtime, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("machine file {}: {e}", path.display()))?;
        let machine = Machine::parse(&text, path)?;
        let bus = machine.gpus.iter().filter_map(|g| Bdf::parse(&g.pci_bus_id)).collect();
        let lost = machine.gpus.iter().map(|g| g.lost).collect();
        let control = machine.control.as_ref().map(|c| {
            let dir = path.parent().unwrap_or(Path::new("."));
            let path = dir.join(c);
            // Watch first, then take the end: a line written in between is not lost.
            let watch = ControlWatch::new(&path);
            // Start at the current end: only commands written from now on count.
            let offset = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            Control { path, offset, partial: String::new(), watch }
        });
        let failing = vec![None; machine.gpus.len()];
        let held = vec![false; machine.gpus.len()];
        Ok(Runtime { machine, bus, lost, failing, held, sets: Vec::new(), init_count: 0, control })
    }

    /// The control file, when the machine names one.
    pub fn control_path(&self) -> Option<&Path> {
        self.control.as_ref().map(|c| c.path.as_path())
    }

    /// Reads and applies the commands appended to the control file since the
    /// last call. Cheap when nothing changed.
    pub fn poll_control(&mut self) {
        let Some(control) = self.control.as_mut() else { return };
        if control.watch.as_ref().is_some_and(|w| !w.pending()) {
            return;
        }
        let Ok(mut file) = std::fs::File::open(&control.path) else { return };
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if len < control.offset {
            // Truncated or replaced: start over from its beginning.
            control.offset = 0;
            control.partial.clear();
        }
        if len == control.offset || file.seek(SeekFrom::Start(control.offset)).is_err() {
            return;
        }
        let mut fresh = String::new();
        if file.read_to_string(&mut fresh).is_err() {
            return;
        }
        control.offset += fresh.len() as u64;
        control.partial.push_str(&fresh);
        let Some(end) = control.partial.rfind('\n') else { return };
        let complete: String = control.partial.drain(..=end).collect();
        for line in complete.lines() {
            if let Err(e) = self.apply(line) {
                eprintln!("fake-nvml: control line {line:?} ignored: {e}");
            }
        }
    }

    fn apply(&mut self, line: &str) -> Result<(), String> {
        let line = line.split('#').next().unwrap_or("").trim();
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some((&command, args)) = words.split_first() else { return Ok(()) };
        let num = |i: usize| -> Result<u64, String> {
            args.get(i).ok_or("missing argument")?.parse::<u64>().map_err(|e| e.to_string())
        };
        let gpu = num(0)? as usize;
        if gpu >= self.lost.len() {
            return Err(format!("no GPU {gpu}"));
        }
        match command {
            "xid" => {
                let (gi, ci) = match (args.get(2), args.get(3)) {
                    (Some(_), Some(_)) => (num(2)? as u32, num(3)? as u32),
                    _ => (NO_INSTANCE, NO_INSTANCE),
                };
                let event = Event { gpu, event_type: XID_EVENT, data: num(1)?, gpu_instance: gi, compute_instance: ci };
                for set in self.sets.iter_mut().flatten() {
                    if set.watches(gpu, XID_EVENT) {
                        set.queue.push_back(event);
                    }
                }
            }
            "lost" => {
                self.lost[gpu] = true;
                for set in self.sets.iter_mut().flatten() {
                    if set.watches(gpu, u64::MAX) {
                        set.lost_pending = true;
                    }
                }
            }
            "vanish" => self.lost[gpu] = true,
            "fail" => self.failing[gpu] = Some(u32::try_from(num(1)?).map_err(|e| e.to_string())?),
            "back" => {
                self.lost[gpu] = false;
                self.failing[gpu] = None;
            }
            "hold" => self.held[gpu] = true,
            "release" => self.held[gpu] = false,
            other => {
                return Err(format!("unknown command {other:?} (xid, lost, vanish, fail, back, hold, release)"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn runtime(dir: &Path) -> Runtime {
        let machine = dir.join("m.toml");
        std::fs::write(
            &machine,
            "control = \"ctl\"\n[[gpu]]\nuuid = \"GPU-a\"\nname = \"n\"\nmemory_mib = 1\npci_bus_id = \"0:1:0.0\"\nminor = 0\n",
        )
        .unwrap();
        std::fs::write(dir.join("ctl"), "xid 0 48\n").unwrap();
        Runtime::load(&machine).unwrap()
    }

    fn append(dir: &Path, text: &str) {
        let mut f = std::fs::OpenOptions::new().append(true).open(dir.join("ctl")).unwrap();
        f.write_all(text.as_bytes()).unwrap();
    }

    #[test]
    fn old_lines_are_skipped_and_partial_lines_wait() {
        let dir = std::env::temp_dir().join(format!("fake-nvml-state-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut rt = runtime(&dir);
        rt.sets.push(Some(EventSet { registered: vec![(0, XID_EVENT)], ..Default::default() }));
        rt.poll_control();
        assert!(rt.sets[0].as_ref().unwrap().queue.is_empty(), "the line written before init replayed");
        append(&dir, "xid 0 79");
        rt.poll_control();
        assert!(rt.sets[0].as_ref().unwrap().queue.is_empty(), "an unterminated line was applied");
        append(&dir, "\nlost 0\n");
        rt.poll_control();
        let set = rt.sets[0].as_ref().unwrap();
        assert_eq!(set.queue.front().map(|e| e.data), Some(79));
        assert!(set.lost_pending && rt.lost[0]);
        append(&dir, "back 0\n");
        rt.poll_control();
        assert!(!rt.lost[0]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_vanished_gpu_is_lost_without_telling_any_event_set() {
        let dir = std::env::temp_dir().join(format!("fake-nvml-vanish-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut rt = runtime(&dir);
        rt.sets.push(Some(EventSet { registered: vec![(0, XID_EVENT)], ..Default::default() }));
        append(&dir, "vanish 0\n");
        rt.poll_control();
        let set = rt.sets[0].as_ref().unwrap();
        assert!(rt.lost[0], "the GPU still answers");
        assert!(!set.lost_pending && set.queue.is_empty(), "an event set was told");
        append(&dir, "back 0\nfail 0 999\n");
        rt.poll_control();
        assert!(!rt.lost[0]);
        assert_eq!(rt.failing[0], Some(999));
        append(&dir, "back 0\n");
        rt.poll_control();
        assert_eq!(rt.failing[0], None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hold_and_release_apply_in_order_with_the_lines_written_beside_them() {
        let dir = std::env::temp_dir().join(format!("fake-nvml-hold-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut rt = runtime(&dir);
        rt.sets.push(Some(EventSet { registered: vec![(0, XID_EVENT)], ..Default::default() }));
        append(&dir, "xid 0 79\nhold 0\n");
        rt.poll_control();
        assert!(rt.held[0], "hold was not applied");
        assert_eq!(rt.sets[0].as_ref().unwrap().queue.len(), 1, "the Xid written with it was not queued");
        append(&dir, "release 0\n");
        rt.poll_control();
        assert!(!rt.held[0], "release was not applied");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
