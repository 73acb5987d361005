//! The resolution check against folders laid out the way a node has them, following the
//! reference CDI library's rules (tests/cluster/devicemanager/cdi_test.go runs the library).

use super::*;
use std::path::Path;

fn spec(dir: &Path, file: &str, kind: &str, names: &[&str]) {
    std::fs::create_dir_all(dir).unwrap();
    let devices: Vec<String> = names
        .iter()
        .map(|n| format!(r#"{{"name":"{n}","containerEdits":{{"deviceNodes":[{{"path":"/dev/x"}}]}}}}"#))
        .collect();
    let text = format!(r#"{{"cdiVersion":"0.5.0","kind":"{kind}","devices":[{}]}}"#, devices.join(","));
    std::fs::write(dir.join(file), text).unwrap();
}

struct Node {
    _root: tempfile::TempDir,
    etc: PathBuf,
    run: PathBuf,
}

fn node() -> Node {
    let root = tempfile::tempdir().unwrap();
    let (etc, run) = (root.path().join("etc/cdi"), root.path().join("var/run/cdi"));
    Node { _root: root, etc, run }
}

impl Node {
    fn dirs(&self) -> Vec<PathBuf> {
        vec![self.etc.clone(), self.run.clone()]
    }
}

#[test]
fn a_name_no_spec_defines_is_missing_and_missing_folders_are_empty() {
    let n = node();
    spec(&n.run, "other.json", "nvidia.com/gpu", &["GPU-a"]);
    let defined = Defined::scan(&n.dirs(), None);
    assert_eq!(defined.unresolved("nvidia.com/gpu=GPU-a"), None);
    assert_eq!(defined.unresolved("nvidia.com/gpu=GPU-b"), Some(Unresolved::Missing(n.dirs())));
    assert!(defined.skipped.is_empty(), "{:?}", defined.skipped);
}

#[test]
fn the_later_folder_wins_and_a_name_defined_twice_in_one_folder_is_dropped() {
    let n = node();
    spec(&n.etc, "nvidia.yaml.json", "nvidia.com/gpu", &["GPU-a", "GPU-b"]);
    spec(&n.run, "devhost-nvidia.com_gpu.json", "nvidia.com/gpu", &["GPU-a"]);
    let defined = Defined::scan(&n.dirs(), None);
    assert_eq!(defined.unresolved("nvidia.com/gpu=GPU-a"), None, "the later folder replaces the earlier one");
    spec(&n.run, "nvidia.json", "nvidia.com/gpu", &["GPU-a", "GPU-c"]);
    let defined = Defined::scan(&n.dirs(), None);
    let both = vec![n.run.join("devhost-nvidia.com_gpu.json"), n.run.join("nvidia.json")];
    assert_eq!(defined.unresolved("nvidia.com/gpu=GPU-a"), Some(Unresolved::Conflict(both)));
    assert_eq!(defined.unresolved("nvidia.com/gpu=GPU-b"), None);
    // The library keeps a conflict even when a later folder defines the name once more.
    let defined = Defined::scan(&[n.run.clone(), n.etc.clone()], None);
    assert!(matches!(defined.unresolved("nvidia.com/gpu=GPU-a"), Some(Unresolved::Conflict(_))));
}

#[test]
fn yaml_specs_as_nvidia_ctk_writes_them_are_read() {
    let n = node();
    std::fs::create_dir_all(&n.etc).unwrap();
    let yaml = "---\ncdiVersion: 0.5.0\ncontainerEdits:\n  deviceNodes:\n  - path: /dev/nvidiactl\ndevices:\n\
                - containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n  name: \"0\"\n\
                - containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n  name: GPU-a\nkind: nvidia.com/gpu\n";
    std::fs::write(n.etc.join("nvidia.yaml"), yaml).unwrap();
    let defined = Defined::scan(&n.dirs(), None);
    assert_eq!(defined.unresolved("nvidia.com/gpu=0"), None, "{:?}", defined.skipped);
    assert_eq!(defined.unresolved("nvidia.com/gpu=GPU-a"), None);
}

#[test]
fn a_spec_the_runtime_skips_defines_nothing_and_is_named() {
    let n = node();
    spec(&n.run, "bad-kind.json", "1x.com/gpu", &["GPU-a"]);
    spec(&n.run, "twice.json", "v.com/c", &["a", "a"]);
    std::fs::write(n.run.join("broken.yaml"), "kind: [").unwrap();
    std::fs::write(n.run.join("notes.txt"), "not a spec").unwrap();
    let defined = Defined::scan(&n.dirs(), None);
    assert_eq!(defined.skipped.len(), 3, "{:?}", defined.skipped);
    assert!(defined.skipped.iter().all(|s| s.ends_with("the runtime skips it")), "{:?}", defined.skipped);
    assert!(defined.unresolved("v.com/c=a").is_some());
}

#[test]
fn planned_files_stand_in_for_devhosts_own_files_on_disk() {
    let n = node();
    spec(&n.run, "devhost-nvidia.com_gpu.json", "nvidia.com/gpu", &["GPU-old"]);
    spec(&n.run, "nvidia.json", "nvidia.com/gpu", &["GPU-a"]);
    let bytes = br#"{"cdiVersion":"0.5.0","kind":"nvidia.com/gpu","devices":[{"name":"GPU-new"}]}"#.to_vec();
    let planned = Planned { dir: &n.run, files: vec![("devhost-nvidia.com_gpu.json".into(), bytes)] };
    let defined = Defined::scan(&n.dirs(), Some(&planned));
    assert_eq!(defined.unresolved("nvidia.com/gpu=GPU-new"), None);
    assert!(defined.unresolved("nvidia.com/gpu=GPU-old").is_some(), "the file on disk is what devhost replaces");
    assert_eq!(defined.unresolved("nvidia.com/gpu=GPU-a"), None, "other tools' files stay");
}

#[test]
fn a_problem_names_resource_device_name_folders_and_an_unread_cdi_dir() {
    let n = node();
    let defined = Defined::scan(&n.dirs(), None);
    let mut d = Device::test("GPU-a");
    d.edits.cdi_devices = vec!["nvidia.com/gpu=GPU-a".into()];
    let names = handed_out("nvidia.com/gpu", false, &[d]);
    assert_eq!(names, [("GPU-a".to_string(), "nvidia.com/gpu=GPU-a".to_string())]);
    let other = Path::new("/elsewhere/cdi");
    let found = problems("nvidia.com/gpu", &names, &defined, Some(other));
    assert_eq!(found.len(), 1);
    let text = found[0].to_string();
    let want = format!(
        "resource nvidia.com/gpu: device GPU-a: CDI name nvidia.com/gpu=GPU-a is defined by no CDI spec in {}, {} \
         (cdi_spec_dirs); devhost writes its specs into cdi_dir /elsewhere/cdi, which is not among them; containers \
         given this device fail with \"CDI device injection failed: unresolvable CDI devices\"",
        n.etc.display(),
        n.run.display()
    );
    assert_eq!(text, want);
    assert!(problems("nvidia.com/gpu", &names, &defined, Some(&n.run))[0].unread_cdi_dir.is_none());
    assert_eq!(devices_affected(&found), 1);
}
