//! Putting devhost's own spec files back: a file of devhost's in `cdi_dir` that someone else
//! removed or changed is written again with the content devhost wants there, at most once a
//! second per file and said in the log at most once a minute per file, so a tool that fights
//! devhost over a file costs neither a hot loop nor a flooded log.

use super::CdiWriter;
use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

/// The least time between two rewrites of one file.
pub const REWRITE_EVERY: Duration = Duration::from_secs(1);
/// The least time between two log lines about one file.
pub const LOG_EVERY: Duration = Duration::from_secs(60);
/// How long after a failed rewrite the next one is tried (sooner when the folder changes).
pub const RETRY_AFTER_ERROR: Duration = Duration::from_secs(10);

/// What was wrong with one of devhost's files on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Damage {
    Removed,
    Changed,
}

/// How the file at `path` differs from `bytes`; `None` when it holds exactly them.
fn damage(path: &Path, bytes: &[u8]) -> Option<Damage> {
    match std::fs::read(path) {
        Ok(old) if old == bytes => None,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Some(Damage::Removed),
        // Unreadable counts as changed: the write says why it cannot be put right.
        _ => Some(Damage::Changed),
    }
}

impl CdiWriter {
    /// devhost's files whose content on disk is not what devhost wants, and how.
    pub fn damaged(&self) -> Vec<(String, Damage)> {
        let wanted = self.wanted();
        wanted.iter().filter_map(|(file, bytes)| Some((file.clone(), damage(&self.dir.join(file), bytes)?))).collect()
    }

    /// Writes `file` again if it still is not what devhost wants (checked and written under the
    /// writer's lock, so a newer device list is never overwritten by an older one); `None` when
    /// nothing is wrong any more, or the file is no longer devhost's.
    pub fn restore(&self, file: &str) -> io::Result<Option<Damage>> {
        let wanted = self.wanted();
        let Some(bytes) = wanted.get(file) else { return Ok(None) };
        let Some(damage) = damage(&self.dir.join(file), bytes) else { return Ok(None) };
        self.write_file(file, bytes)?;
        Ok(Some(damage))
    }
}

/// When one file was last written again and last said in the log.
#[derive(Default)]
struct FileLog {
    written: Option<Instant>,
    logged: Option<Instant>,
    /// Rewrites (or failures) since the last line.
    unlogged: u32,
}

/// Restores devhost's damaged files, within the limits above.
pub struct Repairer {
    writer: CdiWriter,
    files: HashMap<String, FileLog>,
}

impl Repairer {
    pub fn new(writer: CdiWriter) -> Repairer {
        Repairer { writer, files: HashMap::new() }
    }

    /// Restores every damaged file that may be written again at `now`; returns when to come back
    /// for those that may not be yet (or whose write failed).
    pub fn run(&mut self, now: Instant) -> Option<Instant> {
        // Forget files quiet for a minute: the map stays as small as the folder.
        self.files.retain(|_, f| f.written.is_some_and(|w| now.duration_since(w) < LOG_EVERY) || f.unlogged > 0);
        let mut next: Option<Instant> = None;
        for (file, _) in self.writer.damaged() {
            let state = self.files.entry(file.clone()).or_default();
            if let Some(at) = state.written.map(|w| w + REWRITE_EVERY).filter(|at| *at > now) {
                next = Some(next.map_or(at, |n| n.min(at)));
                continue;
            }
            let outcome = self.writer.restore(&file);
            if matches!(outcome, Ok(None)) {
                continue;
            }
            state.written = Some(now);
            if outcome.is_err() {
                let at = now + RETRY_AFTER_ERROR;
                next = Some(next.map_or(at, |n| n.min(at)));
            }
            if state.logged.is_some_and(|l| now.duration_since(l) < LOG_EVERY) {
                state.unlogged += 1;
                continue;
            }
            log(&self.writer.dir().join(&file), &outcome, std::mem::take(&mut state.unlogged));
            state.logged = Some(now);
        }
        next
    }
}

/// The one line about a file's repair; `before` counts the repairs left unsaid since the last.
fn log(path: &Path, outcome: &io::Result<Option<Damage>>, before: u32) {
    let path = path.display();
    let fight = if before > 0 {
        format!(
            " ({before} more time(s) since the last such line: something keeps changing devhost's file; devhost writes it \
             again at most once a second and says so at most once a minute)"
        )
    } else {
        String::new()
    };
    match outcome {
        Ok(Some(Damage::Removed)) => {
            tracing::warn!("CDI spec {path} was removed by someone else; written again{fight}")
        }
        Ok(Some(Damage::Changed)) => {
            tracing::warn!("CDI spec {path} was changed by someone else; written again with devhost's content{fight}")
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(
            "CDI spec {path} was removed or changed by someone else and cannot be written again ({e}); trying again \
             in {RETRY_AFTER_ERROR:?} or at the folder's next change{fight}"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::device::Device;

    fn dev(id: &str) -> Device {
        Device::test(id).node("/dev/null", &format!("/dev/{id}"))
    }

    #[test]
    fn a_removed_or_changed_file_is_written_again_once_a_second_at_most() {
        let dir = tempfile::tempdir().unwrap();
        let writer = CdiWriter::new(dir.path());
        writer.write("example.com/gpu", &[dev("a")]).unwrap();
        let path = writer.path("example.com/gpu");
        let want = std::fs::read(&path).unwrap();
        let mut repairer = Repairer::new(writer.clone());
        let t0 = Instant::now();
        assert_eq!(repairer.run(t0), None, "nothing damaged");
        std::fs::remove_file(&path).unwrap();
        assert_eq!(writer.damaged(), [("devhost-example.com_gpu.json".to_string(), Damage::Removed)]);
        assert_eq!(repairer.run(t0), None);
        assert_eq!(std::fs::read(&path).unwrap(), want);
        // Changed again at once: not before a second has passed.
        std::fs::write(&path, "{}").unwrap();
        assert_eq!(repairer.run(t0 + Duration::from_millis(300)), Some(t0 + REWRITE_EVERY));
        assert_eq!(std::fs::read(&path).unwrap(), b"{}");
        assert_eq!(repairer.run(t0 + REWRITE_EVERY), None);
        assert_eq!(std::fs::read(&path).unwrap(), want);
    }

    #[test]
    fn a_fight_over_a_file_is_said_once_a_minute_with_the_rewrites_between_counted() {
        let dir = tempfile::tempdir().unwrap();
        let writer = CdiWriter::new(dir.path());
        writer.write("example.com/gpu", &[dev("a")]).unwrap();
        let (path, file) = (writer.path("example.com/gpu"), "devhost-example.com_gpu.json");
        let mut repairer = Repairer::new(writer);
        let t0 = Instant::now();
        for second in 0..5 {
            std::fs::remove_file(&path).unwrap();
            repairer.run(t0 + Duration::from_secs(second));
        }
        let state = &repairer.files[file];
        assert_eq!((state.logged, state.unlogged), (Some(t0), 4), "said at the first rewrite only");
        std::fs::remove_file(&path).unwrap();
        repairer.run(t0 + LOG_EVERY);
        let state = &repairer.files[file];
        assert_eq!(
            (state.logged, state.unlogged),
            (Some(t0 + LOG_EVERY), 0),
            "said again a minute later, with the count"
        );
    }

    #[test]
    fn files_no_longer_devhosts_are_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let writer = CdiWriter::new(dir.path());
        writer.write("example.com/gpu", &[dev("a")]).unwrap();
        writer.remove("example.com/gpu").unwrap();
        std::fs::write(dir.path().join("vendor.json"), "{}").unwrap();
        assert!(writer.damaged().is_empty());
        assert_eq!(writer.restore("devhost-example.com_gpu.json").unwrap(), None);
        assert!(!writer.path("example.com/gpu").exists());
    }
}
